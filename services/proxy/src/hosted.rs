//! `arl-proxy` as a hosted service: its flags and how it starts (the runtime's host does
//! the rest — connection, ops endpoints, signals, drain).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use arl_runtime::host::{Context, Ops, Service, StartError};

use crate::api::{self, Proxy as ProxyService, ProxyConfig};
use crate::backends::{Backends, parse_backend};
use crate::keys::Keys;

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

    /// Name of this instance (revoke requests are addressed to it).
    #[arg(long, default_value = "proxy")]
    instance: String,

    #[arg(long, default_value_t = 8 << 20)]
    max_body_bytes: usize,

    #[arg(long, default_value_t = 256)]
    max_in_flight_per_run: usize,
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
        crate::service::serve_keys(
            &ctx.bus,
            keys.clone(),
            &args.instance,
            &public_url,
            &ctx.shutdown,
        )
        .await?;
        let backends = Arc::new(Backends::new(backends));
        let proxy = ProxyService::new(
            ctx.bus.clone(),
            keys,
            backends.clone(),
            ProxyConfig {
                max_body_bytes: args.max_body_bytes,
                max_in_flight_per_run: args.max_in_flight_per_run,
            },
        );
        backends.watch_health(proxy.client.clone(), Duration::from_secs(2), &ctx.shutdown);
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
