//! `arl-proxy`: the token-recording gateway between agents and engines.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use arl_proxy::api::{self, Proxy, ProxyConfig};
use arl_proxy::backends::{Backends, parse_backend};
use arl_proxy::keys::Keys;
use arl_runtime::{Bus, CommonArgs, Metrics, Shutdown, telemetry};
use clap::Parser;

#[derive(Debug, Parser)]
#[command(
    name = "arl-proxy",
    version,
    about = "ARL token proxy: records every trial's LLM calls"
)]
struct Args {
    #[command(flatten)]
    common: CommonArgs,

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

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let telemetry = telemetry::init("arl-proxy", telemetry::otlp_endpoint_from_env())?;
    let backends = args
        .backends
        .iter()
        .map(|b| parse_backend(b))
        .collect::<Result<Vec<_>, _>>()
        .map_err(anyhow::Error::msg)
        .context("--backend")?;
    let metrics = Metrics::new();
    let bus = Bus::connect(args.common.bus_config("arl-proxy")?, metrics.clone()).await?;
    bus.provision().await.context("provisioning streams")?;
    let shutdown = Shutdown::new();
    shutdown.trigger_on_signals();

    let keys = Arc::new(Keys::default());
    let public_url = args
        .public_url
        .unwrap_or_else(|| format!("http://{}", args.listen));
    arl_proxy::service::serve_keys(&bus, keys.clone(), &args.instance, &public_url, &shutdown)
        .await?;
    let backends = Arc::new(Backends::new(backends));
    let proxy = Proxy::new(
        bus.clone(),
        keys,
        backends.clone(),
        ProxyConfig {
            max_body_bytes: args.max_body_bytes,
            max_in_flight_per_run: args.max_in_flight_per_run,
        },
    );
    backends.watch_health(proxy.client.clone(), Duration::from_secs(2), &shutdown);
    let healthy = backends.clone();
    let readiness = arl_runtime::http::Readiness::probe(move || {
        if healthy.any_healthy() {
            Ok(())
        } else {
            Err("an inference backend that answers its health check".to_owned())
        }
    });
    let router = api::router(proxy).merge(arl_runtime::http::ops_router(
        "proxy", bus, metrics, readiness,
    ));
    if let Some(path) = &args.listen_unix {
        arl_runtime::http::serve_unix(path, router.clone(), &shutdown)
            .with_context(|| format!("--listen-unix {}", path.display()))?;
    }
    let addr = arl_runtime::http::serve(args.listen, router, &shutdown).await?;
    tracing::info!(%addr, "proxy serving");
    shutdown.triggered().await;
    shutdown.wait().await;
    telemetry.shutdown().await;
    Ok(())
}
