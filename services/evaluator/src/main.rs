//! `arl-evaluator`: runs the validation split after evaluation steps and reports it.

use anyhow::Context;
use arl_evaluator::service::Evaluator;
use arl_runtime::{Bus, CommonArgs, Metrics, Shutdown, telemetry};
use clap::Parser;

#[derive(Debug, Parser)]
#[command(
    name = "arl-evaluator",
    version,
    about = "ARL evaluator: validation resolution rate"
)]
struct Args {
    #[command(flatten)]
    common: CommonArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let telemetry = telemetry::init("arl-evaluator", telemetry::otlp_endpoint_from_env())?;
    let metrics = Metrics::new();
    let bus = Bus::connect(args.common.bus_config("arl-evaluator")?, metrics.clone()).await?;
    bus.provision().await.context("provisioning streams")?;
    let shutdown = Shutdown::new();
    shutdown.trigger_on_signals();
    let router = arl_runtime::http::ops_router(
        "evaluator",
        bus.clone(),
        metrics,
        arl_runtime::http::Readiness::always(),
    );
    arl_runtime::http::serve(args.common.http_addr, router, &shutdown).await?;
    Evaluator::new(bus).start(&shutdown);
    tracing::info!("evaluator running");
    shutdown.triggered().await;
    shutdown.wait().await;
    telemetry.shutdown().await;
    Ok(())
}
