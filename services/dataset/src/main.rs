//! `arl-dataset`: loads and validates each run's dataset, registers it, and serves the
//! task batches of its training steps.

use anyhow::Context;
use arl_dataset::service::DatasetService;
use arl_runtime::{Bus, CommonArgs, Metrics, Shutdown, telemetry};
use clap::Parser;

#[derive(Debug, Parser)]
#[command(
    name = "arl-dataset",
    version,
    about = "ARL dataset service: datasets and task batches"
)]
struct Args {
    #[command(flatten)]
    common: CommonArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let telemetry = telemetry::init("arl-dataset", telemetry::otlp_endpoint_from_env())?;
    let metrics = Metrics::new();
    let bus = Bus::connect(args.common.bus_config("arl-dataset")?, metrics.clone()).await?;
    bus.provision().await.context("provisioning streams")?;
    let shutdown = Shutdown::new();
    shutdown.trigger_on_signals();
    let router = arl_runtime::http::ops_router(
        "dataset",
        bus.clone(),
        metrics,
        arl_runtime::http::Readiness::always(),
    );
    arl_runtime::http::serve(args.common.http_addr, router, &shutdown).await?;
    DatasetService::new(bus).start(&shutdown);
    tracing::info!("dataset service running");
    shutdown.triggered().await;
    shutdown.wait().await;
    telemetry.shutdown().await;
    Ok(())
}
