//! The boundary between the sandbox service and where sandboxes run.
//!
//! The local backend is [`crate::bwrap::Bubblewrap`]. A Kubernetes backend maps the same
//! calls onto Pods or OpenKruise `agents.kruise.io` SandboxClaims from a SandboxSet warm
//! pool: `prepare` = claim or create a Pod from the environment's image; `activate` = label
//! it with the lease and apply limits; `exec` = the Pod exec subresource; `destroy` =
//! delete the Pod or release the claim. Files and diffs go through `exec` (`cat`, `tar`,
//! `git`), so the service needs nothing else from a backend.

use std::collections::BTreeMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Duration;

use arl_schemas::LeaseId;
use tokio_util::sync::CancellationToken;

use crate::cgroup::LeaseCgroup;
use crate::config::ResolvedLimits;
use crate::environment::Environment;

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("preparing a work tree of {environment}: {reason}")]
    Prepare { environment: String, reason: String },
    #[error("applying limits: {0}")]
    Limits(String),
    #[error("starting the sandbox: {0}")]
    Spawn(String),
}

/// A work tree ready to be leased: `dir/tree` holds the files, `base` the git commit
/// diffs are taken against.
#[derive(Debug)]
pub struct PreparedTree {
    pub dir: PathBuf,
    pub base: String,
    /// Disk the fresh tree holds: a lease's disk limit counts growth beyond it.
    pub bytes: u64,
    pub environment: Environment,
}

/// What `exec` needs to know about a lease.
#[derive(Clone, Debug)]
pub struct SandboxHandle {
    pub lease_id: LeaseId,
    /// Holds `tree/`.
    pub dir: PathBuf,
    pub workdir: String,
    /// Read-only (host folder, path inside) mounts of the environment.
    pub mounts: Vec<(PathBuf, String)>,
    /// The environment's variables (a request's own variables override them).
    pub env: std::collections::BTreeMap<String, String>,
    pub cgroup: LeaseCgroup,
    pub limits: ResolvedLimits,
    /// Cancelled when the lease ends: running commands are killed.
    pub ended: CancellationToken,
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

#[derive(Clone, Debug)]
pub struct ExecOutput {
    /// 128 + signal when killed; -1 on timeout or when the lease ended.
    pub exit_code: i32,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub timed_out: bool,
    pub truncated: bool,
    pub duration: Duration,
}

pub trait Backend: Send + Sync + 'static {
    /// Materializes a fresh work tree of `environment` in `dir` (slow: warm pools call it
    /// ahead of demand).
    fn prepare(
        &self,
        environment: &Environment,
        dir: &Path,
    ) -> impl Future<Output = Result<String, BackendError>> + Send;

    /// Hands a prepared tree to a lease: creates its limits.
    fn activate(
        &self,
        lease_id: &LeaseId,
        limits: &ResolvedLimits,
    ) -> impl Future<Output = Result<LeaseCgroup, BackendError>> + Send;

    /// Runs one command in the lease's sandbox.
    fn exec(
        &self,
        sandbox: &SandboxHandle,
        spec: ExecSpec,
    ) -> impl Future<Output = Result<ExecOutput, BackendError>> + Send;

    /// Kills everything the lease runs and deletes its files.
    fn destroy(&self, dir: &Path, cgroup: &LeaseCgroup) -> impl Future<Output = ()> + Send;

    /// Limits and groups left by an earlier instance, for reaping.
    fn leftover_cgroups(&self) -> Vec<LeaseCgroup>;
}
