//! The life of a sandbox lease.

use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{example_run, example_time, example_trial};
use crate::events::{EnvironmentRef, Example, event};
use crate::{LeaseId, RunId, TrialId};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum SandboxBackend {
    Bubblewrap,
    KubernetesPod,
    OpenkruiseClaim,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SandboxLeasedV1 {
    pub run_id: RunId,
    pub lease_id: LeaseId,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trial_id: Option<TrialId>,
    pub environment: EnvironmentRef,
    pub backend: SandboxBackend,
    /// Base URL of the lease's exec and file API.
    pub endpoint: String,
    pub expires_at: DateTime<Utc>,
    /// True when the sandbox came from a warm pool.
    pub warm: bool,
}
event!(SandboxLeasedV1, sandbox, "leased", 1, |e| format!(
    "sandbox.leased:{}",
    e.lease_id
));

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ReleaseReason {
    /// The holder released it.
    Released,
    /// The holder stopped renewing.
    Expired,
    /// A restarted sandbox service found it left over.
    Reaped,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SandboxReleasedV1 {
    pub run_id: RunId,
    pub lease_id: LeaseId,
    pub reason: ReleaseReason,
    pub at: DateTime<Utc>,
}
event!(SandboxReleasedV1, sandbox, "released", 1, |e| format!(
    "sandbox.released:{}",
    e.lease_id
));

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SandboxFailedV1 {
    pub run_id: RunId,
    /// Absent when no lease was created.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_id: Option<LeaseId>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trial_id: Option<TrialId>,
    pub environment: EnvironmentRef,
    pub message: String,
    pub at: DateTime<Utc>,
}
event!(SandboxFailedV1, sandbox, "failed", 1, |e| format!(
    "sandbox.failed:{}:{}:{}",
    e.run_id,
    e.lease_id.as_ref().map(LeaseId::as_str).unwrap_or("-"),
    e.at.timestamp_micros()
));

fn example_lease() -> LeaseId {
    LeaseId::known("lease-0193a1b2c3d4e5f6")
}

fn example_environment() -> EnvironmentRef {
    EnvironmentRef {
        name: "harbor/fix-fizzbuzz".into(),
        digest: None,
    }
}

impl Example for SandboxLeasedV1 {
    fn example() -> Self {
        Self {
            run_id: example_run(),
            lease_id: example_lease(),
            trial_id: Some(example_trial()),
            environment: example_environment(),
            backend: SandboxBackend::Bubblewrap,
            endpoint: "http://127.0.0.1:7311/leases/lease-0193a1b2c3d4e5f6".into(),
            expires_at: example_time(),
            warm: true,
        }
    }
}

impl Example for SandboxReleasedV1 {
    fn example() -> Self {
        Self {
            run_id: example_run(),
            lease_id: example_lease(),
            reason: ReleaseReason::Expired,
            at: example_time(),
        }
    }
}

impl Example for SandboxFailedV1 {
    fn example() -> Self {
        Self {
            run_id: example_run(),
            lease_id: None,
            trial_id: Some(example_trial()),
            environment: example_environment(),
            message: "bwrap: Creating new namespace failed: Operation not permitted".into(),
            at: example_time(),
        }
    }
}
