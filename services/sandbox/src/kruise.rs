//! OpenKruise agents' custom resources (`agents.kruise.io/v1alpha1`), as far as the
//! Kubernetes backend reads and writes them: a `SandboxClaim` takes one `Sandbox` from a
//! `SandboxSet`'s warm pool, copying its labels onto the claimed Sandbox; the Sandbox's Pod
//! has the Sandbox's name. Fields ARL does not use are kept out; the API server keeps them.

use std::borrow::Cow;
use std::collections::BTreeMap;

use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};

pub const API_VERSION: &str = "agents.kruise.io/v1alpha1";
const GROUP: &str = "agents.kruise.io";
const VERSION: &str = "v1alpha1";

/// Implements `kube::Resource` for a namespaced kind of the group.
macro_rules! kruise_resource {
    ($type:ident, $kind:literal, $plural:literal) => {
        impl kube::Resource for $type {
            type DynamicType = ();
            type Scope = NamespaceResourceScope;

            fn kind(_: &()) -> Cow<'_, str> {
                Cow::Borrowed($kind)
            }
            fn group(_: &()) -> Cow<'_, str> {
                Cow::Borrowed(GROUP)
            }
            fn version(_: &()) -> Cow<'_, str> {
                Cow::Borrowed(VERSION)
            }
            fn plural(_: &()) -> Cow<'_, str> {
                Cow::Borrowed($plural)
            }
            fn meta(&self) -> &ObjectMeta {
                &self.metadata
            }
            fn meta_mut(&mut self) -> &mut ObjectMeta {
                &mut self.metadata
            }
        }
    };
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxClaim {
    pub api_version: String,
    pub kind: String,
    pub metadata: ObjectMeta,
    pub spec: SandboxClaimSpec,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<SandboxClaimStatus>,
}
kruise_resource!(SandboxClaim, "SandboxClaim", "sandboxclaims");

impl SandboxClaim {
    pub fn new(metadata: ObjectMeta, spec: SandboxClaimSpec) -> Self {
        Self {
            api_version: API_VERSION.into(),
            kind: "SandboxClaim".into(),
            metadata,
            spec,
            status: None,
        }
    }
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxClaimSpec {
    /// The SandboxSet to claim from.
    pub template_name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<i32>,
    /// How long to wait for a sandbox (`"300s"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim_timeout: Option<String>,
    /// Put on the claimed Sandbox.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxClaimStatus {
    /// `Claiming` or `Completed`.
    #[serde(default)]
    pub phase: Option<String>,
    #[serde(default)]
    pub message: Option<String>,
    #[serde(default)]
    pub claimed_replicas: Option<i32>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Sandbox {
    pub api_version: String,
    pub kind: String,
    pub metadata: ObjectMeta,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<SandboxStatus>,
}
kruise_resource!(Sandbox, "Sandbox", "sandboxes");

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxStatus {
    /// `Pending`, `Running`, `Paused`, …
    #[serde(default)]
    pub phase: Option<String>,
    #[serde(default)]
    pub conditions: Vec<Condition>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    #[serde(rename = "type")]
    pub type_: String,
    pub status: String,
}

impl Sandbox {
    /// Running, with its `Ready` condition true.
    pub fn is_ready(&self) -> bool {
        self.status.as_ref().is_some_and(|status| {
            status.phase.as_deref() == Some("Running")
                && status
                    .conditions
                    .iter()
                    .any(|c| c.type_ == "Ready" && c.status == "True")
        })
    }
}
