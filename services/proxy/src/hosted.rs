//! `arl-proxy` as a hosted service: its flags and how it starts (the runtime's host does
//! the rest — connection, ops endpoints, signals, drain).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use arl_runtime::host::{Context, Ops, Service, StartError};

use crate::api::{self, Proxy as ProxyService, ProxyConfig};
use crate::backends::{Backends, parse_backend};
use crate::keys::Keys;
use crate::mcp::{Mcp, McpConfig};
use arl_sandbox_client::SandboxClient;

/// `arl-proxy`'s own flags (beside the common ones).
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Address agents call.
    #[arg(long, env = "ARL_PROXY_ADDR", default_value = "127.0.0.1:8200")]
    listen: SocketAddr,

    /// Also serve on this Unix socket: sandboxes reach the proxy through it
    /// (`arl-sandbox --proxy-socket`).
    #[arg(long, env = "ARL_PROXY_SOCKET")]
    listen_unix: Option<std::path::PathBuf>,
    /// The base URL agents reach this proxy at (for issued keys); default http://<listen>.
    #[arg(long)]
    public_url: Option<String>,

    /// A backend: `arl=http://host:port` (the embedded engine), `vllm=http://host:port` or
    /// `sglang=http://host:port`.
    /// Repeat for several.
    #[arg(long = "backend", required = true)]
    backends: Vec<String>,

    /// Load every new policy version into the vllm= and sglang= backends (through their
    /// weight-update APIs; vLLM must run with VLLM_SERVER_DEV_MODE=1) and route a trial
    /// to one only once it serves the trial's policy. Without it, such a backend's calls
    /// name no serving version and are not trained on.
    #[arg(long)]
    follow_weights: bool,

    /// With --follow-weights: follow only this run's versions (default: every run's).
    #[arg(long, requires = "follow_weights")]
    follow_run: Option<String>,

    /// With --follow-weights: the only folder versions are loaded from (the trainer's
    /// --runs-dir, at the same path on the engines' machines). Default: $ARL_RUNS_DIR,
    /// else ~/.cache/arl/runs.
    #[arg(long, requires = "follow_weights")]
    weights_dir: Option<std::path::PathBuf>,

    /// Name of this instance (revoke requests are addressed to it).
    #[arg(long, default_value = "proxy")]
    instance: String,

    #[arg(long, default_value_t = 8 << 20)]
    max_body_bytes: usize,

    #[arg(long, default_value_t = 256)]
    max_in_flight_per_run: usize,

    /// The environment an MCP session's sandbox is leased from (`/<key>/mcp`: the
    /// trial's sandbox tools). `scratch`, an empty work folder, is always there.
    #[arg(long, default_value = "scratch")]
    mcp_environment: String,

    /// An MCP session unused this long ends, and its sandbox with it.
    #[arg(long, default_value_t = 1800)]
    mcp_session_ttl_s: u64,

    /// Memory of an MCP session's sandbox, MB.
    #[arg(long, default_value_t = 1024)]
    mcp_memory_mb: u64,
}

/// The proxy service, for `arl_runtime::host`.
pub struct Proxy;

impl Service for Proxy {
    const NAME: &'static str = "proxy";
    const ABOUT: &'static str = "ARL token proxy: records every trial's LLM calls";
    type Args = Args;

    async fn start(args: Args, ctx: Context) -> Result<Ops, StartError> {
        let backends = args
            .backends
            .iter()
            .map(|b| parse_backend(b))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("--backend: {e}"))?;
        let keys = Arc::new(Keys::default());
        let public_url = args
            .public_url
            .unwrap_or_else(|| format!("http://{}", args.listen));
        let mcp = Mcp::new(
            keys.clone(),
            SandboxClient::new(ctx.bus.clone()),
            McpConfig {
                environment: args.mcp_environment,
                session_ttl: Duration::from_secs(args.mcp_session_ttl_s.max(1)),
                memory_mb: args.mcp_memory_mb,
                ..McpConfig::default()
            },
        );
        mcp.sweep(&ctx.shutdown);
        crate::service::serve_keys(
            &ctx.bus,
            keys.clone(),
            mcp.clone(),
            &args.instance,
            &public_url,
            &ctx.shutdown,
        )
        .await?;
        let follow_run = args
            .follow_run
            .as_deref()
            .map(arl_schemas::RunId::new)
            .transpose()
            .map_err(|e| format!("--follow-run: {e}"))?;
        let backends = Arc::new(Backends::with_following(backends, args.follow_weights));
        let proxy = ProxyService::new(
            ctx.bus.clone(),
            keys,
            mcp,
            backends.clone(),
            ProxyConfig {
                max_body_bytes: args.max_body_bytes,
                max_in_flight_per_run: args.max_in_flight_per_run,
            },
        );
        backends.watch_health(proxy.client.clone(), Duration::from_secs(2), &ctx.shutdown);
        proxy.forget_ended_runs(&args.instance, &ctx.shutdown);
        if args.follow_weights {
            crate::follow::follow(
                &ctx.bus,
                backends.clone(),
                proxy.client.clone(),
                &args.instance,
                follow_run.as_ref(),
                args.weights_dir
                    .unwrap_or_else(arl_runtime::args::default_runs_dir),
                &ctx.shutdown,
            );
        }
        let healthy = backends.clone();
        let readiness = arl_runtime::http::Readiness::probe(move || {
            if healthy.any_healthy() {
                Ok(())
            } else {
                Err("an inference backend that answers its health check".to_owned())
            }
        });
        let router = api::router(proxy).merge(arl_runtime::http::ops_router(
            "proxy",
            ctx.bus,
            ctx.metrics,
            readiness,
        ));
        if let Some(path) = &args.listen_unix {
            arl_runtime::http::serve_unix(path, router.clone(), &ctx.shutdown)
                .map_err(|e| format!("--listen-unix {}: {e}", path.display()))?;
        }
        let addr = arl_runtime::http::serve(args.listen, router, &ctx.shutdown)
            .await
            .map_err(|e| format!("--listen {}: {e}", args.listen))?;
        tracing::info!(%addr, "proxy serving");
        Ok(Ops::Own)
    }
}
