//! The boundary between the sandbox service and where sandboxes run.
//!
//! Two backends implement it: [`crate::bwrap::Bubblewrap`] on one machine (work trees
//! copied from snapshots, commands in bubblewrap) and [`crate::kube::Kube`] in a cluster
//! (Pods from the environment's image, or OpenKruise SandboxClaims from a SandboxSet warm
//! pool; commands through the Pod exec subresource). A backend makes sandboxes ahead of
//! demand (`prepare`, for the warm pools), hands one to a lease (`activate`), runs commands
//! in it (`exec`) and ends it (`destroy`). Files and diffs go through `exec` (`cat`, `tar`,
//! `git`), so the service needs nothing else from a backend.

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use arl_schemas::events::{EnvironmentRef, LeaseEnd, SandboxBackend};
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio_util::sync::CancellationToken;

use crate::config::ResolvedLimits;
use crate::environment::EnvironmentError;
use crate::lease::LeaseRecord;

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("preparing a sandbox of {environment}: {reason}")]
    Prepare { environment: String, reason: String },
    #[error("applying limits: {0}")]
    Limits(String),
    #[error("starting the sandbox: {0}")]
    Spawn(String),
}

/// A sandbox made ahead of demand, as a warm pool holds it until a lease takes it.
#[derive(Debug)]
pub struct Prepared<T> {
    /// The commit diffs are taken against.
    pub base: String,
    /// Absolute path of the work tree inside the sandbox.
    pub workdir: String,
    /// What the backend needs to hand it to a lease.
    pub sandbox: T,
}

#[derive(Clone, Debug)]
pub struct ExecSpec {
    pub command: String,
    pub env: BTreeMap<String, String>,
    pub stdin: Option<Vec<u8>>,
    pub timeout: Duration,
    /// Bytes kept per output stream.
    pub output_limit: usize,
}

#[derive(Clone, Debug, Default)]
pub struct ExecOutput {
    /// 128 + signal when killed; -1 on timeout or when the lease ended.
    pub exit_code: i32,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub timed_out: bool,
    pub truncated: bool,
    pub duration: Duration,
}

/// A lease as its backend is told about it.
pub struct Activation<'a> {
    pub record: &'a LeaseRecord,
    pub limits: &'a ResolvedLimits,
    /// Cancelled when the lease ends: running commands are killed.
    pub ended: CancellationToken,
}

pub trait Backend: Send + Sync + 'static {
    /// An environment as this backend makes sandboxes of it.
    type Environment: Clone + Send + Sync + 'static;
    /// A prepared sandbox in a warm pool.
    type Idle: Send + Sync + 'static;
    /// A leased sandbox.
    type Sandbox: Send + Sync + 'static;

    /// How leases of this backend are announced in `sandbox.leased`.
    fn kind(&self) -> SandboxBackend;

    /// The environment a lease request names; a bad or unknown name is the caller's error.
    fn resolve(&self, environment: &EnvironmentRef) -> Result<Self::Environment, EnvironmentError>;

    /// Makes a fresh sandbox of `environment` (slow: warm pools call it ahead of demand).
    fn prepare(
        &self,
        environment: &Self::Environment,
    ) -> impl Future<Output = Result<Prepared<Self::Idle>, BackendError>> + Send;

    /// Hands a prepared sandbox to a lease: applies its limits. On error the backend has
    /// cleaned up what it was given.
    fn activate(
        &self,
        prepared: Prepared<Self::Idle>,
        lease: Activation<'_>,
    ) -> impl Future<Output = Result<Self::Sandbox, BackendError>> + Send;

    /// Runs one command in a leased sandbox.
    fn exec(
        &self,
        sandbox: &Self::Sandbox,
        spec: ExecSpec,
    ) -> impl Future<Output = Result<ExecOutput, BackendError>> + Send;

    /// Kills everything the sandbox runs and deletes it.
    fn destroy(&self, sandbox: &Self::Sandbox) -> impl Future<Output = ()> + Send;

    /// Resolves when the lease must end before its time, with why (a work tree past its
    /// disk limit); never, for a backend whose platform enforces that itself.
    fn watch(&self, sandbox: &Self::Sandbox) -> impl Future<Output = (LeaseEnd, String)> + Send {
        let _ = sandbox;
        std::future::pending()
    }

    /// Removes what an earlier instance left (sandboxes, limits, prepared ones), and
    /// returns the records of the leases it held, so that their ends can be announced.
    fn reap_leftovers(&self) -> impl Future<Output = Vec<LeaseRecord>> + Send;

    /// Deletes the prepared sandboxes nobody leased, when the service stops.
    fn wind_down(&self) -> impl Future<Output = ()> + Send;
}

/// Reads a stream to its end, keeping at most `limit` bytes.
pub(crate) async fn capture<R: AsyncRead + Unpin>(
    stream: Option<R>,
    limit: usize,
) -> (Vec<u8>, bool) {
    let Some(mut stream) = stream else {
        return (Vec::new(), false);
    };
    let mut kept = Vec::new();
    let mut truncated = false;
    let mut buffer = vec![0u8; 64 * 1024];
    loop {
        match stream.read(&mut buffer).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                let room = limit.saturating_sub(kept.len());
                if n > room {
                    truncated = true;
                }
                kept.extend_from_slice(&buffer[..n.min(room)]);
            }
        }
    }
    (kept, truncated)
}
