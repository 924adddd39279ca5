//! `arl-sandbox` as a hosted service: its flags and how it starts (the runtime's host does
//! the rest — connection, ops endpoints, signals, drain).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use arl_runtime::host::{Context, Ops, Service, StartError};

use crate::{SandboxConfig, SandboxService};

/// `arl-sandbox`'s own flags (beside the common ones).
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Address of the exec and file API (port 0 picks one).
    #[arg(long, env = "ARL_SANDBOX_API_ADDR", default_value = "127.0.0.1:0")]
    api_addr: SocketAddr,
    /// Lease work trees live here; the sandbox user must be able to traverse it.
    #[arg(
        long,
        env = "ARL_SANDBOX_STATE_DIR",
        default_value = "/var/lib/arl/sandbox"
    )]
    state_dir: PathBuf,
    /// Environment snapshots: <dir>/<name>/tree.
    #[arg(
        long,
        env = "ARL_ENVIRONMENTS_DIR",
        default_value = "/var/lib/arl/environments"
    )]
    environments_dir: PathBuf,
    /// The token proxy's Unix socket, relayed into every sandbox.
    #[arg(long, env = "ARL_PROXY_SOCKET")]
    proxy_socket: Option<PathBuf>,
    /// Port of the proxy relay on each sandbox's loopback.
    #[arg(long, default_value_t = 8000)]
    proxy_port: u16,
    /// A Python venv of third-party agents (e.g. mini-swe-agent), mounted read-only at
    /// /opt/arl-agents in every sandbox.
    #[arg(long, env = "ARL_SANDBOX_AGENTS_DIR")]
    agents_dir: Option<PathBuf>,
    /// Leases at once.
    #[arg(long, default_value_t = 512)]
    max_leases: usize,
    /// Prepared trees kept per environment.
    #[arg(long, default_value_t = 2)]
    pool_min_idle: usize,
    /// Longest lease ttl, seconds.
    #[arg(long, default_value_t = 6 * 3600)]
    max_ttl_s: u64,
}

/// The sandbox service, for `arl_runtime::host`.
pub struct Sandbox;

impl Service for Sandbox {
    const NAME: &'static str = "sandbox";
    const ABOUT: &'static str = "ARL sandbox service: bubblewrap leases from warm pools";
    type Args = Args;

    async fn start(args: Args, ctx: Context) -> Result<Ops, StartError> {
        // The sandbox's first process ships beside whichever executable hosts the service.
        let init = std::env::current_exe()?.with_file_name("arl-sandbox-init");
        let mut config = SandboxConfig::local(args.state_dir, args.environments_dir, init);
        config.proxy_socket = args.proxy_socket;
        config.proxy_port = args.proxy_port;
        config.agents_dir = args.agents_dir;
        config.max_leases = args.max_leases;
        config.pool_min_idle = args.pool_min_idle;
        config.max_ttl = Duration::from_secs(args.max_ttl_s);
        let service =
            SandboxService::start_local(ctx.bus, config, args.api_addr, &ctx.shutdown).await?;
        tracing::info!(
            api = service.public_url(),
            instance = service.instance(),
            "sandbox running"
        );
        Ok(Ops::Own)
    }
}
