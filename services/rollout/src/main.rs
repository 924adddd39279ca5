//! `arl-rollout`: runs trials.

use std::time::Duration;

use anyhow::Context;
use arl_rollout::service::{Rollout, RolloutConfig};
use arl_runtime::{Bus, CommonArgs, Metrics, Shutdown, telemetry};
use clap::Parser;

#[derive(Debug, Parser)]
#[command(name = "arl-rollout", version, about = "ARL rollout service: trials")]
struct Args {
    #[command(flatten)]
    common: CommonArgs,

    /// Trials this replica runs at once.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,

    /// Longest a trial waits for its environment or for fresh enough weights.
    #[arg(long, default_value_t = 1800)]
    wait_limit_s: u64,

    /// A trial whose replica stops signalling (it died) is taken over after this long.
    #[arg(long, default_value_t = 60)]
    ack_wait_s: u64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let telemetry = telemetry::init("arl-rollout", telemetry::otlp_endpoint_from_env())?;
    let metrics = Metrics::new();
    let bus = Bus::connect(args.common.bus_config("arl-rollout")?, metrics.clone()).await?;
    bus.provision().await.context("provisioning streams")?;
    let shutdown = Shutdown::new();
    shutdown.trigger_on_signals();
    let router = arl_runtime::http::ops_router(
        "rollout",
        bus.clone(),
        metrics,
        arl_runtime::http::Readiness::always(),
    );
    arl_runtime::http::serve(args.common.http_addr, router, &shutdown).await?;
    let config = RolloutConfig {
        concurrency: args.concurrency,
        wait_limit: Duration::from_secs(args.wait_limit_s),
        ack_wait: Duration::from_secs(args.ack_wait_s.max(1)),
    };
    Rollout::new(bus, config).start(&shutdown);
    tracing::info!("rollout service running");
    shutdown.triggered().await;
    shutdown.wait().await;
    telemetry.shutdown().await;
    Ok(())
}
