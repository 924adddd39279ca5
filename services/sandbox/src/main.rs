//! `arl-sandbox`: leases isolated environments on this machine.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use arl_runtime::{Bus, CommonArgs, Metrics, Shutdown, telemetry};
use arl_sandbox::{SandboxConfig, SandboxService};
use clap::Parser;

#[derive(Debug, Parser)]
#[command(
    name = "arl-sandbox",
    version,
    about = "ARL sandbox service: bubblewrap leases from warm pools"
)]
struct Args {
    #[command(flatten)]
    common: CommonArgs,
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

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let telemetry = telemetry::init("arl-sandbox", telemetry::otlp_endpoint_from_env())?;
    let metrics = Metrics::new();
    let bus = Bus::connect(args.common.bus_config("arl-sandbox")?, metrics).await?;
    bus.provision().await.context("provisioning streams")?;

    let init = std::env::current_exe()?.with_file_name("arl-sandbox-init");
    let mut config = SandboxConfig::local(args.state_dir, args.environments_dir, init);
    config.proxy_socket = args.proxy_socket;
    config.proxy_port = args.proxy_port;
    config.agents_dir = args.agents_dir;
    config.max_leases = args.max_leases;
    config.pool_min_idle = args.pool_min_idle;
    config.max_ttl = Duration::from_secs(args.max_ttl_s);

    let shutdown = Shutdown::new();
    shutdown.trigger_on_signals();
    let service = SandboxService::start_local(bus, config, args.api_addr, &shutdown).await?;
    tracing::info!(
        api = service.public_url(),
        instance = service.instance(),
        "sandbox running"
    );
    shutdown.triggered().await;
    shutdown.wait().await;
    telemetry.shutdown().await;
    Ok(())
}
