//! The cluster backend: sandboxes are Kubernetes Pods (kube-rs).
//!
//! - An environment is an image: `{registry}/{name}:latest`, or pinned by digest when the
//!   lease request names one (`…@sha256:…`), or an image given per environment. An
//!   environment may instead name an OpenKruise `SandboxSet`: its sandboxes come from that
//!   warm pool through a `SandboxClaim` (`agents.kruise.io/v1alpha1`).
//! - `prepare` creates the Pod (or claims a Sandbox), waits until it runs, and asks it
//!   for its work tree (the image's working directory) and the git commit diffs are
//!   taken against; a Pod whose image cannot be pulled, or that is not running within
//!   the ready timeout, is deleted and the reason reported.
//! - `exec` goes through the Pod `exec` subresource (`pods/exec`): `/bin/sh -c` with the
//!   lease's CPU and file-size rlimits, the command's variables exported first, and
//!   coreutils `timeout` killing it at its deadline where the image has it.
//! - Limits: the container's memory, CPU and ephemeral-storage limits (the kubelet
//!   enforces them; the node's `podPidsLimit` bounds processes), no service-account
//!   token, no capabilities, no privilege escalation, the runtime's default seccomp
//!   profile; the network is the chart's NetworkPolicy's business (egress to the token
//!   proxy only, by the `arl.dev/role: sandbox` label).
//! - Reaping: with `--kube-owner-pod`, every sandbox Pod is owned by the service's own Pod,
//!   so Kubernetes deletes them when it goes; a restarted process of the same Pod deletes
//!   the ones its predecessor left (by the `arl.dev/owner` label) and announces their
//!   leases' ends from the record kept in an annotation.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use arl_schemas::LeaseId;
use arl_schemas::events::{EnvironmentRef, SandboxBackend};
use k8s_openapi::api::core::v1::{
    Container, EnvVar, Pod, PodSecurityContext, PodSpec, ResourceRequirements, SeccompProfile,
    SecurityContext,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{Api, AttachParams, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use tokio::io::AsyncWriteExt;
use tokio_util::sync::CancellationToken;

use crate::backend::{Activation, Backend, BackendError, ExecOutput, ExecSpec, Prepared, capture};
use crate::config::ResolvedLimits;
use crate::environment::{EnvironmentError, check_name};
use crate::kruise::{Sandbox, SandboxClaim, SandboxClaimSpec};
use crate::lease::LeaseRecord;

/// The container every sandbox Pod runs the environment in.
const CONTAINER: &str = "sandbox";
/// Names of the Pods this backend makes (a SandboxSet names its own).
const POD_PREFIX: &str = "arl-sbx-";
/// Labels and annotations the backend puts on what it creates.
const MANAGED_BY: (&str, &str) = ("app.kubernetes.io/managed-by", "arl-sandbox");
const ROLE: (&str, &str) = ("arl.dev/role", "sandbox");
const INSTANCE_LABEL: &str = "arl.dev/instance";
const OWNER_LABEL: &str = "arl.dev/owner";
const STATE_LABEL: &str = "arl.dev/state";
const CLAIM_LABEL: &str = "arl.dev/claim";
const LEASE_ANNOTATION: &str = "arl.dev/lease";
const ENVIRONMENT_ANNOTATION: &str = "arl.dev/environment";

/// How the backend reaches the cluster and what its Pods look like.
#[derive(Clone, Debug)]
pub struct KubeSettings {
    /// Where sandbox Pods (and claims) are made.
    pub namespace: String,
    /// Images are `{registry}/{environment}:latest` (e.g. `registry.arl:5000`); without
    /// one, only environments with an image of their own can be leased.
    pub registry: Option<String>,
    /// Images given per environment, overriding the registry's.
    pub images: BTreeMap<String, String>,
    /// Environments served from an OpenKruise SandboxSet, by set name.
    pub sandboxsets: BTreeMap<String, String>,
    /// This service instance (labels its Pods).
    pub instance: String,
    /// The service's own Pod: owner of every sandbox, so they go when it goes.
    pub owner: Option<OwnerPod>,
    /// The service account sandbox Pods run as (one with no API access).
    pub service_account: Option<String>,
    pub runtime_class: Option<String>,
    /// `ARL_PROXY_URL` inside every sandbox (the token proxy's Service, `…/v1`).
    pub proxy_url: Option<String>,
    /// Limits of Pods made ahead of demand.
    pub default_limits: ResolvedLimits,
    /// How long a Pod may take to run (image pull included).
    pub ready_timeout: Duration,
    /// Image pull secrets of sandbox Pods.
    pub image_pull_secrets: Vec<String>,
}

#[derive(Clone, Debug)]
pub struct OwnerPod {
    pub name: String,
    pub uid: String,
}

/// An environment as Pods are made of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodEnvironment {
    pub name: String,
    pub image: String,
    /// Claimed from this OpenKruise SandboxSet instead of created.
    pub sandboxset: Option<String>,
}

/// A running Pod nobody leased yet.
#[derive(Debug)]
pub struct IdlePod {
    pod: String,
    /// The claim that gave it, for a Pod of a SandboxSet.
    claim: Option<String>,
    /// The limits it was made with.
    limits: ResolvedLimits,
    environment: PodEnvironment,
}

/// A leased Pod.
#[derive(Debug)]
pub struct LeasedPod {
    pub pod: String,
    claim: Option<String>,
    lease_id: LeaseId,
    limits: ResolvedLimits,
    ended: CancellationToken,
}

pub struct Kube {
    client: kube::Client,
    settings: KubeSettings,
    pods: Api<Pod>,
    claims: Api<SandboxClaim>,
    sandboxes: Api<Sandbox>,
}

impl std::fmt::Debug for Kube {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kube")
            .field("settings", &self.settings)
            .finish()
    }
}

/// What went wrong talking to the API server, said so that an operator knows what to fix.
fn api_error(doing: &str, err: kube::Error) -> String {
    match &err {
        kube::Error::Api(status) if status.code == 403 => format!(
            "{doing}: forbidden ({}); the sandbox service's account needs that verb on that \
             resource in its namespace (see deploy/helm/arl's sandbox Role)",
            status.message
        ),
        kube::Error::Api(status) => format!("{doing}: {} ({})", status.message, status.code),
        other => format!("{doing}: {other}"),
    }
}

impl Kube {
    pub fn new(client: kube::Client, settings: KubeSettings) -> Self {
        let ns = settings.namespace.as_str();
        Self {
            pods: Api::namespaced(client.clone(), ns),
            claims: Api::namespaced(client.clone(), ns),
            sandboxes: Api::namespaced(client.clone(), ns),
            client,
            settings,
        }
    }

    pub fn client(&self) -> &kube::Client {
        &self.client
    }

    fn labels(&self, state: &str) -> BTreeMap<String, String> {
        let mut labels = BTreeMap::from([
            (MANAGED_BY.0.to_owned(), MANAGED_BY.1.to_owned()),
            (ROLE.0.to_owned(), ROLE.1.to_owned()),
            (INSTANCE_LABEL.to_owned(), self.settings.instance.clone()),
            (STATE_LABEL.to_owned(), state.to_owned()),
        ]);
        if let Some(owner) = &self.settings.owner {
            labels.insert(OWNER_LABEL.to_owned(), owner.uid.clone());
        }
        labels
    }

    fn owner_references(&self) -> Option<Vec<OwnerReference>> {
        self.settings.owner.as_ref().map(|owner| {
            vec![OwnerReference {
                api_version: "v1".into(),
                kind: "Pod".into(),
                name: owner.name.clone(),
                uid: owner.uid.clone(),
                controller: Some(false),
                block_owner_deletion: Some(false),
            }]
        })
    }

    /// The Pod of one sandbox of `environment` with `limits`.
    pub fn pod_manifest(
        &self,
        name: &str,
        environment: &PodEnvironment,
        limits: &ResolvedLimits,
    ) -> Pod {
        let settings = &self.settings;
        let quantity = |value: String| Quantity(value);
        let resources = BTreeMap::from([
            (
                "memory".to_owned(),
                quantity(format!("{}Mi", limits.memory_mb)),
            ),
            (
                "cpu".to_owned(),
                quantity(format!("{}m", (limits.cpus * 1000.0).round() as u64)),
            ),
            (
                "ephemeral-storage".to_owned(),
                quantity(format!("{}Mi", limits.disk_mb)),
            ),
        ]);
        let env = settings
            .proxy_url
            .iter()
            .map(|url| EnvVar {
                name: "ARL_PROXY_URL".into(),
                value: Some(url.clone()),
                value_from: None,
            })
            .collect::<Vec<_>>();
        // The environment's own entrypoint is not what a sandbox runs: it idles until
        // commands come through exec, and ends at once on TERM.
        let idle = "trap 'exit 0' TERM; while :; do sleep 3600 & wait $!; done";
        Pod {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                namespace: Some(settings.namespace.clone()),
                labels: Some(self.labels("idle")),
                annotations: Some(BTreeMap::from([(
                    ENVIRONMENT_ANNOTATION.to_owned(),
                    environment.name.clone(),
                )])),
                owner_references: self.owner_references(),
                ..ObjectMeta::default()
            },
            spec: Some(PodSpec {
                restart_policy: Some("Never".into()),
                automount_service_account_token: Some(false),
                enable_service_links: Some(false),
                service_account_name: settings.service_account.clone(),
                runtime_class_name: settings.runtime_class.clone(),
                termination_grace_period_seconds: Some(1),
                image_pull_secrets: (!settings.image_pull_secrets.is_empty()).then(|| {
                    settings
                        .image_pull_secrets
                        .iter()
                        .map(|name| k8s_openapi::api::core::v1::LocalObjectReference {
                            name: name.clone(),
                        })
                        .collect()
                }),
                security_context: Some(PodSecurityContext {
                    seccomp_profile: Some(SeccompProfile {
                        type_: "RuntimeDefault".into(),
                        localhost_profile: None,
                    }),
                    ..PodSecurityContext::default()
                }),
                containers: vec![Container {
                    name: CONTAINER.into(),
                    image: Some(environment.image.clone()),
                    command: Some(vec!["/bin/sh".into(), "-c".into(), idle.into()]),
                    env: (!env.is_empty()).then_some(env),
                    resources: Some(ResourceRequirements {
                        limits: Some(resources.clone()),
                        requests: Some(resources),
                        ..ResourceRequirements::default()
                    }),
                    security_context: Some(SecurityContext {
                        allow_privilege_escalation: Some(false),
                        privileged: Some(false),
                        capabilities: Some(k8s_openapi::api::core::v1::Capabilities {
                            drop: Some(vec!["ALL".into()]),
                            add: None,
                        }),
                        ..SecurityContext::default()
                    }),
                    ..Container::default()
                }],
                ..PodSpec::default()
            }),
            status: None,
        }
    }

    /// Creates a Pod of `environment` and waits until it runs.
    async fn make_pod(
        &self,
        environment: &PodEnvironment,
        limits: &ResolvedLimits,
    ) -> Result<String, BackendError> {
        let fail = |reason: String| BackendError::Prepare {
            environment: environment.name.clone(),
            reason,
        };
        let name = format!(
            "{POD_PREFIX}{}",
            &uuid::Uuid::new_v4().simple().to_string()[..16]
        );
        let manifest = self.pod_manifest(&name, environment, limits);
        self.pods
            .create(&PostParams::default(), &manifest)
            .await
            .map_err(|err| fail(api_error("creating a sandbox Pod", err)))?;
        if let Err(reason) = self.wait_running(&name).await {
            self.delete_pod(&name).await;
            return Err(fail(reason));
        }
        Ok(name)
    }

    /// Waits until the Pod's sandbox container runs; says why it never will.
    async fn wait_running(&self, name: &str) -> Result<(), String> {
        let started = Instant::now();
        let mut pause = Duration::from_millis(200);
        loop {
            let pod = self
                .pods
                .get(name)
                .await
                .map_err(|err| api_error(&format!("reading Pod {name}"), err))?;
            let last = match pod_progress(&pod) {
                PodProgress::Running => return Ok(()),
                PodProgress::Broken(why) => return Err(format!("Pod {name}: {why}")),
                PodProgress::Waiting(why) => why,
            };
            if started.elapsed() >= self.settings.ready_timeout {
                return Err(format!(
                    "Pod {name} was not running after {:?}: {last}",
                    self.settings.ready_timeout
                ));
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(2));
        }
    }

    async fn delete_pod(&self, name: &str) {
        let params = DeleteParams {
            grace_period_seconds: Some(0),
            ..DeleteParams::background()
        };
        match self.pods.delete(name, &params).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 404 => {}
            Err(err) => {
                tracing::warn!(pod = name, err = %api_error("deleting a sandbox Pod", err), "a sandbox Pod may be left")
            }
        }
    }

    /// Claims one Sandbox of `set` and waits until it runs; its Pod has its name.
    async fn claim(
        &self,
        environment: &PodEnvironment,
        set: &str,
    ) -> Result<(String, String), BackendError> {
        let fail = |reason: String| BackendError::Prepare {
            environment: environment.name.clone(),
            reason,
        };
        let claim = format!(
            "arl-claim-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..16]
        );
        let mut labels = self.labels("idle");
        labels.insert(CLAIM_LABEL.to_owned(), claim.clone());
        let object = SandboxClaim::new(
            ObjectMeta {
                name: Some(claim.clone()),
                namespace: Some(self.settings.namespace.clone()),
                labels: Some(labels.clone()),
                owner_references: self.owner_references(),
                ..ObjectMeta::default()
            },
            SandboxClaimSpec {
                template_name: set.to_owned(),
                replicas: Some(1),
                claim_timeout: Some(format!("{}s", self.settings.ready_timeout.as_secs().max(1))),
                labels,
                annotations: BTreeMap::from([(
                    ENVIRONMENT_ANNOTATION.to_owned(),
                    environment.name.clone(),
                )]),
            },
        );
        self.claims
            .create(&PostParams::default(), &object)
            .await
            .map_err(|err| fail(api_error(&format!("claiming from SandboxSet {set}"), err)))?;
        match self.wait_claimed(&claim, set).await {
            Ok(sandbox) => Ok((claim, sandbox)),
            Err(reason) => {
                self.release_claim(&claim, None).await;
                Err(fail(reason))
            }
        }
    }

    /// Waits until the claim's Sandbox runs and is ready; its name.
    async fn wait_claimed(&self, claim: &str, set: &str) -> Result<String, String> {
        let started = Instant::now();
        let mut pause = Duration::from_millis(200);
        let selector = ListParams::default().labels(&format!("{CLAIM_LABEL}={claim}"));
        loop {
            let sandboxes = self
                .sandboxes
                .list(&selector)
                .await
                .map_err(|err| api_error("listing claimed Sandboxes", err))?;
            if let Some(ready) = sandboxes.items.iter().find(|s| s.is_ready()) {
                return ready
                    .metadata
                    .name
                    .clone()
                    .ok_or_else(|| "a claimed Sandbox has no name".to_owned());
            }
            let status = self
                .claims
                .get(claim)
                .await
                .map_err(|err| api_error(&format!("reading SandboxClaim {claim}"), err))?
                .status
                .unwrap_or_default();
            let phase = status.phase.unwrap_or_default();
            if phase == "Completed" && status.claimed_replicas.unwrap_or(0) == 0 {
                let message = status.message.unwrap_or_else(|| "no message".into());
                return Err(format!(
                    "SandboxSet {set} gave no sandbox (claim {claim} completed: {message})"
                ));
            }
            if started.elapsed() >= self.settings.ready_timeout {
                return Err(format!(
                    "SandboxSet {set} gave no running sandbox within {:?} (claim {claim}, phase {phase:?})",
                    self.settings.ready_timeout
                ));
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(2));
        }
    }

    async fn release_claim(&self, claim: &str, sandbox: Option<&str>) {
        // Claimed Sandboxes outlive their claim: both go.
        if let Some(sandbox) = sandbox
            && let Err(err) = self
                .sandboxes
                .delete(sandbox, &DeleteParams::background())
                .await
            && !matches!(&err, kube::Error::Api(s) if s.code == 404)
        {
            tracing::warn!(sandbox, err = %api_error("deleting a claimed Sandbox", err), "a Sandbox may be left");
        }
        if let Err(err) = self.claims.delete(claim, &DeleteParams::background()).await
            && !matches!(&err, kube::Error::Api(s) if s.code == 404)
        {
            tracing::warn!(claim, err = %api_error("deleting a SandboxClaim", err), "a SandboxClaim may be left");
        }
    }

    /// Asks a fresh sandbox for its work tree and base commit (committing the tree when
    /// the image's working directory is not a git repository yet).
    async fn survey(
        &self,
        pod: &str,
        environment: &PodEnvironment,
    ) -> Result<(String, String), BackendError> {
        let fail = |reason: String| BackendError::Prepare {
            environment: environment.name.clone(),
            reason,
        };
        let script = "pwd || exit 3; command -v git >/dev/null || exit 4; \
             git='git -c gc.auto=0 -c maintenance.auto=false -c user.name=arl \
             -c user.email=arl@localhost -c safe.directory=*'; \
             if ! $git rev-parse HEAD >/dev/null 2>&1; then \
             $git init -q && $git add -A && \
             $git commit -q --allow-empty --no-verify -m base || exit 5; fi; \
             $git rev-parse HEAD";
        let spec = ExecSpec {
            command: script.into(),
            env: BTreeMap::new(),
            stdin: None,
            timeout: Duration::from_secs(300),
            output_limit: 64 * 1024,
        };
        let output = self
            .run(
                pod,
                &self.settings.default_limits,
                spec,
                &CancellationToken::new(),
            )
            .await?;
        let stdout = String::from_utf8_lossy(&output.stdout);
        let mut lines = stdout.lines().map(str::trim).filter(|l| !l.is_empty());
        match (output.exit_code, lines.next(), lines.next()) {
            (0, Some(workdir), Some(base)) if workdir.starts_with('/') => {
                Ok((workdir.to_owned(), base.to_owned()))
            }
            (4, _, _) => Err(fail(format!(
                "image {} has no git; sandbox images need git (diffs are taken with it)",
                environment.image
            ))),
            (code, _, _) => Err(fail(format!(
                "cannot read the work tree and base commit (exit {code}): {}",
                String::from_utf8_lossy(&output.stderr).trim()
            ))),
        }
    }

    /// Runs one command in a Pod's sandbox container.
    async fn run(
        &self,
        pod: &str,
        limits: &ResolvedLimits,
        spec: ExecSpec,
        ended: &CancellationToken,
    ) -> Result<ExecOutput, BackendError> {
        let started = Instant::now();
        let command = exec_command(&spec, limits);
        let mut params = AttachParams::default();
        // A SandboxSet's Pods are its template's: their default container is the sandbox.
        if pod.starts_with(POD_PREFIX) {
            params = params.container(CONTAINER);
        }
        let params = params.stdin(spec.stdin.is_some()).stdout(true).stderr(true);
        let mut process =
            self.pods.exec(pod, command, &params).await.map_err(|err| {
                BackendError::Spawn(api_error(&format!("exec in Pod {pod}"), err))
            })?;
        if let (Some(input), Some(mut stdin)) = (spec.stdin, process.stdin()) {
            tokio::spawn(async move {
                // The command may exit without reading; that is its business.
                let _ = stdin.write_all(&input).await;
                let _ = stdin.shutdown().await;
            });
        }
        let limit = spec.output_limit;
        let out_task = tokio::spawn(capture(process.stdout(), limit));
        let err_task = tokio::spawn(capture(process.stderr(), limit));
        let status = process.take_status();
        // Past the deadline `timeout` kills the command inside; this is the backstop.
        let deadline = spec.timeout + Duration::from_secs(5);
        let outcome = tokio::select! {
            status = async {
                match status {
                    Some(status) => status.await,
                    None => None,
                }
            } => Some(status),
            () = tokio::time::sleep(deadline) => None,
            () = ended.cancelled() => None,
        };
        // After the status the connection ends and the output streams with it; otherwise
        // (deadline, lease ended) the connection is dropped, and with it the command's
        // output so far where the streams do not end within a moment.
        let grace = Duration::from_secs(5);
        if outcome.is_some() {
            let _ = tokio::time::timeout(grace, process.join()).await;
        } else {
            process.abort();
        }
        let collect = |task: tokio::task::JoinHandle<(Vec<u8>, bool)>| async move {
            match tokio::time::timeout(grace, task).await {
                Ok(Ok(captured)) => captured,
                _ => (Vec::new(), false),
            }
        };
        let (stdout, out_truncated) = collect(out_task).await;
        let (stderr, err_truncated) = collect(err_task).await;
        let elapsed = started.elapsed();
        let exit_code = match &outcome {
            Some(status) => exit_code_of(status.as_ref()),
            None => -1,
        };
        // `timeout -s KILL` ends a command at its deadline with 128 + 9.
        let timed_out = outcome.is_none() && !ended.is_cancelled()
            || (exit_code == 137 && elapsed >= spec.timeout);
        Ok(ExecOutput {
            exit_code: if timed_out { -1 } else { exit_code },
            stdout,
            stderr,
            timed_out,
            truncated: out_truncated || err_truncated,
            duration: elapsed,
        })
    }

    async fn mark_leased(&self, pod: &str, record: &LeaseRecord) -> Result<(), BackendError> {
        let record = serde_json::to_string(record)
            .map_err(|err| BackendError::Spawn(format!("a lease record: {err}")))?;
        let patch = serde_json::json!({
            "metadata": {
                "labels": { STATE_LABEL: "leased" },
                "annotations": { LEASE_ANNOTATION: record },
            }
        });
        let marked = if pod.starts_with(POD_PREFIX) {
            self.pods
                .patch(pod, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .map(|_| ())
        } else {
            // A claimed Sandbox carries the mark (its Pod is the SandboxSet's).
            self.sandboxes
                .patch(pod, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .map(|_| ())
        };
        marked.map_err(|err| {
            BackendError::Spawn(api_error(
                &format!("labelling sandbox {pod} as leased"),
                err,
            ))
        })
    }

    /// Gives a sandbox back: its claim released (a SandboxSet's Pod), or its Pod deleted.
    async fn discard(&self, pod: &str, claim: Option<&str>) {
        match claim {
            Some(claim) => self.release_claim(claim, Some(pod)).await,
            None => self.delete_pod(pod).await,
        }
    }

    /// Pods (and claims) this service's processes made, by label selector.
    async fn delete_pods(&self, selector: &str) -> Vec<LeaseRecord> {
        let pods = match self
            .pods
            .list(&ListParams::default().labels(selector))
            .await
        {
            Ok(pods) => pods.items,
            Err(err) => {
                tracing::warn!(err = %api_error("listing sandbox Pods", err), "cannot reap sandbox Pods");
                return Vec::new();
            }
        };
        let mut records = Vec::new();
        for pod in pods {
            let Some(name) = pod.metadata.name.clone() else {
                continue;
            };
            records.extend(lease_record(&pod.metadata));
            self.delete_pod(&name).await;
        }
        if !self.settings.sandboxsets.is_empty() {
            records.extend(self.release_claims(selector).await);
        }
        records
    }

    /// Claimed Sandboxes (and their claims) by label selector.
    async fn release_claims(&self, selector: &str) -> Vec<LeaseRecord> {
        let sandboxes = match self
            .sandboxes
            .list(&ListParams::default().labels(selector))
            .await
        {
            Ok(list) => list.items,
            Err(err) => {
                tracing::warn!(err = %api_error("listing claimed Sandboxes", err), "cannot reap Sandboxes");
                return Vec::new();
            }
        };
        let mut records = Vec::new();
        for sandbox in sandboxes {
            let (Some(name), Some(claim)) = (
                sandbox.metadata.name.clone(),
                sandbox
                    .metadata
                    .labels
                    .as_ref()
                    .and_then(|l| l.get(CLAIM_LABEL))
                    .cloned(),
            ) else {
                continue;
            };
            records.extend(lease_record(&sandbox.metadata));
            self.release_claim(&claim, Some(&name)).await;
        }
        records
    }
}

/// The lease an object was marked with (`arl.dev/lease`), if it was and it reads.
fn lease_record(metadata: &ObjectMeta) -> Option<LeaseRecord> {
    let json = metadata.annotations.as_ref()?.get(LEASE_ANNOTATION)?;
    serde_json::from_str(json).ok()
}

/// `/bin/sh -c` with the lease's rlimits, the command's variables, and `timeout`.
pub fn exec_command(spec: &ExecSpec, limits: &ResolvedLimits) -> Vec<String> {
    let mut prelude = format!(
        "ulimit -t {} 2>/dev/null; ulimit -f {} 2>/dev/null; ",
        limits.cpu_seconds,
        limits.disk_mb.saturating_mul(2048)
    );
    for (name, value) in &spec.env {
        prelude.push_str(&format!("export {name}={}; ", shell_quote(value)));
    }
    let seconds = spec.timeout.as_secs_f64().ceil().max(1.0) as u64;
    prelude.push_str(&format!(
        "if command -v timeout >/dev/null 2>&1; then exec timeout -s KILL {seconds} /bin/sh -c \"$1\"; \
         else exec /bin/sh -c \"$1\"; fi"
    ));
    vec![
        "/bin/sh".into(),
        "-c".into(),
        prelude,
        "arl-exec".into(),
        spec.command.clone(),
    ]
}

fn shell_quote(value: &str) -> String {
    format!("'{}'", value.replace('\'', "'\\''"))
}

/// The exit code in an exec's final status: 0 on success, the `ExitCode` cause otherwise.
fn exit_code_of(status: Option<&k8s_openapi::apimachinery::pkg::apis::meta::v1::Status>) -> i32 {
    let Some(status) = status else {
        return -1;
    };
    if status.status.as_deref() == Some("Success") {
        return 0;
    }
    status
        .details
        .as_ref()
        .and_then(|d| d.causes.as_ref())
        .and_then(|causes| {
            causes
                .iter()
                .find(|c| c.reason.as_deref() == Some("ExitCode"))
                .and_then(|c| c.message.as_deref())
                .and_then(|m| m.parse().ok())
        })
        .unwrap_or(-1)
}

/// Where a Pod is on its way to running a sandbox.
#[derive(Debug, PartialEq)]
pub enum PodProgress {
    Running,
    /// Still coming (scheduling, pulling), with the latest reason.
    Waiting(String),
    /// Will never run, with why.
    Broken(String),
}

/// Reads a Pod's status: running, on its way, or never going to run.
pub fn pod_progress(pod: &Pod) -> PodProgress {
    let Some(status) = &pod.status else {
        return PodProgress::Waiting("no status yet".into());
    };
    let phase = status.phase.as_deref().unwrap_or("Pending");
    if matches!(phase, "Failed" | "Succeeded") {
        let why = status
            .message
            .clone()
            .or(status.reason.clone())
            .unwrap_or_default();
        return PodProgress::Broken(format!("it ended ({phase}) {why}").trim().to_owned());
    }
    let container = status
        .container_statuses
        .iter()
        .flatten()
        .find(|c| c.name == CONTAINER);
    if let Some(container) = container {
        let state = container.state.as_ref();
        if state.and_then(|s| s.running.as_ref()).is_some() && phase == "Running" {
            return PodProgress::Running;
        }
        if let Some(waiting) = state.and_then(|s| s.waiting.as_ref()) {
            let reason = waiting.reason.clone().unwrap_or_default();
            let message = waiting.message.clone().unwrap_or_default();
            // These do not heal by waiting: a wrong image name, no pull access, a bad spec.
            let fatal = [
                "ErrImagePull",
                "ImagePullBackOff",
                "InvalidImageName",
                "ErrImageNeverPull",
                "CreateContainerConfigError",
                "CreateContainerError",
            ];
            if fatal.contains(&reason.as_str()) {
                return PodProgress::Broken(format!("{reason}: {message}").trim().to_owned());
            }
            return PodProgress::Waiting(format!("{reason}: {message}"));
        }
        if let Some(terminated) = state.and_then(|s| s.terminated.as_ref()) {
            return PodProgress::Broken(format!(
                "its container exited ({}) {}",
                terminated.exit_code,
                terminated.reason.clone().unwrap_or_default()
            ));
        }
    }
    // Not scheduled yet: the scheduler's condition says why (no node fits, …).
    let scheduling = status
        .conditions
        .iter()
        .flatten()
        .find(|c| c.type_ == "PodScheduled" && c.status == "False")
        .map(|c| {
            format!(
                "{}: {}",
                c.reason.clone().unwrap_or_default(),
                c.message.clone().unwrap_or_default()
            )
        });
    PodProgress::Waiting(scheduling.unwrap_or_else(|| format!("phase {phase}")))
}

impl Backend for Kube {
    type Environment = PodEnvironment;
    type Idle = IdlePod;
    type Sandbox = LeasedPod;

    fn kind(&self) -> SandboxBackend {
        if self.settings.sandboxsets.is_empty() {
            SandboxBackend::KubernetesPod
        } else {
            SandboxBackend::OpenkruiseClaim
        }
    }

    fn resolve(&self, environment: &EnvironmentRef) -> Result<PodEnvironment, EnvironmentError> {
        let name = environment.name.as_str();
        check_name(name)?;
        let registry = self
            .settings
            .registry
            .as_deref()
            .map(|r| r.trim_end_matches('/'));
        let image = match (
            self.settings.images.get(name),
            registry,
            &environment.digest,
        ) {
            (Some(image), _, _) => image.clone(),
            (None, Some(registry), Some(digest)) => format!("{registry}/{name}@{digest}"),
            (None, Some(registry), None) => format!("{registry}/{name}:latest"),
            (None, None, _) if self.settings.sandboxsets.contains_key(name) => String::new(),
            (None, None, _) => {
                return Err(EnvironmentError::NoImage {
                    name: name.to_owned(),
                });
            }
        };
        Ok(PodEnvironment {
            name: name.to_owned(),
            image,
            sandboxset: self.settings.sandboxsets.get(name).cloned(),
        })
    }

    async fn prepare(
        &self,
        environment: &PodEnvironment,
    ) -> Result<Prepared<IdlePod>, BackendError> {
        let limits = self.settings.default_limits.clone();
        let (pod, claim) = match &environment.sandboxset {
            Some(set) => {
                let (claim, sandbox) = self.claim(environment, set).await?;
                (sandbox, Some(claim))
            }
            None => (self.make_pod(environment, &limits).await?, None),
        };
        match self.survey(&pod, environment).await {
            Ok((workdir, base)) => Ok(Prepared {
                base,
                workdir,
                sandbox: IdlePod {
                    pod,
                    claim,
                    limits,
                    environment: environment.clone(),
                },
            }),
            Err(err) => {
                self.discard(&pod, claim.as_deref()).await;
                Err(err)
            }
        }
    }

    async fn activate(
        &self,
        prepared: Prepared<IdlePod>,
        lease: Activation<'_>,
    ) -> Result<LeasedPod, BackendError> {
        let mut idle = prepared.sandbox;
        // A Pod's limits are set when it is made: a lease asking for others gets a Pod of
        // its own (a SandboxSet's Pods come as the set makes them).
        if idle.claim.is_none() && &idle.limits != lease.limits {
            self.delete_pod(&idle.pod).await;
            idle.pod = self.make_pod(&idle.environment, lease.limits).await?;
            idle.limits = lease.limits.clone();
            self.survey(&idle.pod, &idle.environment).await?;
        }
        if let Err(err) = self.mark_leased(&idle.pod, lease.record).await {
            self.discard(&idle.pod, idle.claim.as_deref()).await;
            return Err(err);
        }
        Ok(LeasedPod {
            pod: idle.pod,
            claim: idle.claim,
            lease_id: lease.record.lease_id.clone(),
            limits: lease.limits.clone(),
            ended: lease.ended,
        })
    }

    async fn exec(&self, sandbox: &LeasedPod, spec: ExecSpec) -> Result<ExecOutput, BackendError> {
        tracing::debug!(lease = %sandbox.lease_id, pod = %sandbox.pod, "exec");
        self.run(&sandbox.pod, &sandbox.limits, spec, &sandbox.ended)
            .await
    }

    async fn destroy(&self, sandbox: &LeasedPod) {
        self.discard(&sandbox.pod, sandbox.claim.as_deref()).await;
    }

    async fn reap_leftovers(&self) -> Vec<LeaseRecord> {
        // Without an owner Pod, nothing ties an earlier process's Pods to this one.
        let Some(owner) = &self.settings.owner else {
            return Vec::new();
        };
        let selector = format!(
            "{}={},{OWNER_LABEL}={},{INSTANCE_LABEL}!={}",
            MANAGED_BY.0, MANAGED_BY.1, owner.uid, self.settings.instance
        );
        self.delete_pods(&selector).await
    }

    async fn wind_down(&self) {
        let selector = format!(
            "{}={},{INSTANCE_LABEL}={},{STATE_LABEL}=idle",
            MANAGED_BY.0, MANAGED_BY.1, self.settings.instance
        );
        self.delete_pods(&selector).await;
    }
}
