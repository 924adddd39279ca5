//! `arl-controller`: admits run requests and follows every run to its end.

use std::path::PathBuf;

use anyhow::Context;
use arl_controller::{Controller, ControllerConfig};
use arl_runtime::{Bus, CommonArgs, Metrics, Shutdown, telemetry};
use clap::Parser;

#[derive(Debug, Parser)]
#[command(
    name = "arl-controller",
    version,
    about = "ARL controller: owns each run's life"
)]
struct Args {
    #[command(flatten)]
    common: CommonArgs,

    /// Folder where installed models are looked up by name.
    #[arg(long, env = "ARL_MODEL_DIR")]
    model_dir: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let telemetry = telemetry::init("arl-controller", telemetry::otlp_endpoint_from_env())?;
    let metrics = Metrics::new();
    let bus = Bus::connect(args.common.bus_config("arl-controller")?, metrics.clone()).await?;
    bus.provision().await.context("provisioning streams")?;

    let shutdown = Shutdown::new();
    shutdown.trigger_on_signals();
    let router = arl_runtime::http::ops_router(
        "controller",
        bus.clone(),
        metrics,
        arl_runtime::http::Readiness::always(),
    );
    arl_runtime::http::serve(args.common.http_addr, router, &shutdown).await?;

    let mut config = ControllerConfig::default();
    if let Some(dir) = args.model_dir {
        config.model_dir = dir;
    }
    Controller::new(bus, config).await?.start(&shutdown);
    tracing::info!("controller running");
    shutdown.triggered().await;
    shutdown.wait().await;
    telemetry.shutdown().await;
    Ok(())
}
