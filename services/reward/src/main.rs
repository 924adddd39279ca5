//! `arl-reward`: grades every finished trial.

use std::time::Duration;

use anyhow::Context;
use arl_reward::service::{RewardConfig, RewardService, load_test_commands};
use arl_runtime::{Bus, CommonArgs, Metrics, Shutdown, telemetry};
use clap::Parser;

#[derive(Debug, Parser)]
#[command(
    name = "arl-reward",
    version,
    about = "ARL reward service: grades trials"
)]
struct Args {
    #[command(flatten)]
    common: CommonArgs,

    /// SWE-bench instances with their test commands (`instances.json` form); repeatable.
    #[arg(long = "swebench-recipes")]
    swebench_recipes: Vec<std::path::PathBuf>,

    /// A test run taking longer is stopped and reported as a grading error.
    #[arg(long, default_value_t = 1800)]
    test_timeout_s: u64,

    /// Trials graded at once.
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let telemetry = telemetry::init("arl-reward", telemetry::otlp_endpoint_from_env())?;
    let mut config = RewardConfig {
        test_timeout: Duration::from_secs(args.test_timeout_s),
        ..RewardConfig::default()
    };
    for file in &args.swebench_recipes {
        for command in load_test_commands(file).map_err(anyhow::Error::msg)? {
            config
                .test_commands
                .insert(command.instance_id.clone(), command);
        }
    }
    let metrics = Metrics::new();
    let bus = Bus::connect(args.common.bus_config("arl-reward")?, metrics.clone()).await?;
    bus.provision().await.context("provisioning streams")?;
    let shutdown = Shutdown::new();
    shutdown.trigger_on_signals();
    let router = arl_runtime::http::ops_router(
        "reward",
        bus.clone(),
        metrics,
        arl_runtime::http::Readiness::always(),
    );
    arl_runtime::http::serve(args.common.http_addr, router, &shutdown).await?;
    RewardService::new(bus, config).start(&shutdown, args.concurrency);
    tracing::info!("reward service running");
    shutdown.triggered().await;
    shutdown.wait().await;
    telemetry.shutdown().await;
    Ok(())
}
