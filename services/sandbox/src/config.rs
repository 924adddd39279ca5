//! Settings of the sandbox service.

use std::path::PathBuf;
use std::time::Duration;

use arl_schemas::rpc::SandboxLimits;

#[derive(Clone, Debug)]
pub struct SandboxConfig {
    /// This instance's name: renew and release requests are addressed to it.
    pub instance: String,
    /// Where lease work trees live. Must be on one file system with `warm/`.
    pub state_dir: PathBuf,
    /// Environment snapshots: `<environments_dir>/<name>/tree/`.
    pub environments_dir: PathBuf,
    /// The `arl-sandbox-init` binary, copied into the state dir at start.
    pub init_binary: PathBuf,
    /// The token proxy's Unix socket, bound into every sandbox.
    pub proxy_socket: Option<PathBuf>,
    /// Port of the proxy relay on the sandbox's loopback.
    pub proxy_port: u16,
    /// The proxy's URL as sandboxes reach it over the network (a cluster Service), when
    /// there is no relay to a local socket.
    pub proxy_service_url: Option<String>,
    /// Third-party agents (a Python venv with e.g. mini-swe-agent), mounted read-only at
    /// `/opt/arl-agents` in every sandbox. Must be readable by the sandbox user.
    pub agents_dir: Option<PathBuf>,
    /// Host uid/gid sandboxed processes run as.
    pub sandbox_uid: u32,
    pub sandbox_gid: u32,
    /// Limits when a lease request gives none.
    pub default_limits: ResolvedLimits,
    /// Leases held at once by this instance.
    pub max_leases: usize,
    /// Per environment: trees kept prepared, and the most prepared at once.
    pub pool_min_idle: usize,
    pub pool_max_size: usize,
    /// Longest ttl a lease may ask for.
    pub max_ttl: Duration,
    /// Output kept per stream of an exec.
    pub exec_output_limit: usize,
    /// Public base URL of the HTTP API (set once the listener is bound).
    pub public_url: String,
}

/// Limits with every value decided.
#[derive(Clone, Debug, PartialEq)]
pub struct ResolvedLimits {
    pub memory_mb: u64,
    pub pids: u64,
    pub cpus: f64,
    pub cpu_seconds: u64,
    /// MB the work tree may grow beyond the environment's files ([`crate::disk`]).
    pub disk_mb: u64,
}

impl ResolvedLimits {
    pub fn merge(&self, requested: &SandboxLimits) -> Self {
        Self {
            memory_mb: requested.memory_mb.unwrap_or(self.memory_mb),
            pids: requested.pids.unwrap_or(self.pids),
            cpus: requested.cpus.unwrap_or(self.cpus),
            cpu_seconds: requested.cpu_seconds.unwrap_or(self.cpu_seconds),
            disk_mb: requested.disk_mb.unwrap_or(self.disk_mb),
        }
    }
}

impl Default for ResolvedLimits {
    fn default() -> Self {
        Self {
            memory_mb: 2048,
            pids: 256,
            cpus: 1.0,
            cpu_seconds: 600,
            disk_mb: 4096,
        }
    }
}

impl SandboxConfig {
    /// The OpenAI base URL of the token proxy inside a sandbox, when it has one.
    pub fn proxy_url(&self) -> Option<String> {
        match (&self.proxy_service_url, &self.proxy_socket) {
            (Some(url), _) => Some(format!("{}/v1", url.trim_end_matches('/'))),
            (None, Some(_)) => Some(format!("http://127.0.0.1:{}/v1", self.proxy_port)),
            (None, None) => None,
        }
    }

    /// Defaults for one machine, with state under `state_dir`.
    pub fn local(state_dir: PathBuf, environments_dir: PathBuf, init_binary: PathBuf) -> Self {
        Self {
            instance: format!("sbx{}", &uuid::Uuid::new_v4().simple().to_string()[..10]),
            state_dir,
            environments_dir,
            init_binary,
            proxy_socket: None,
            proxy_port: 8000,
            proxy_service_url: None,
            agents_dir: None,
            sandbox_uid: 65534,
            sandbox_gid: 65534,
            default_limits: ResolvedLimits::default(),
            max_leases: 512,
            pool_min_idle: 2,
            pool_max_size: 16,
            max_ttl: Duration::from_secs(6 * 3600),
            exec_output_limit: 1 << 20,
            public_url: String::new(),
        }
    }
}
