//! `arl-trainer`: trains each run's policy on its trajectories and publishes new weights.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use arl_runtime::{Bus, CommonArgs, Metrics, Shutdown, telemetry};
use arl_trainer::service::{Trainer, TrainerConfig};
use clap::Parser;

#[derive(Debug, Parser)]
#[command(
    name = "arl-trainer",
    version,
    about = "ARL trainer: GRPO on CPU or an NVIDIA GPU"
)]
struct Args {
    #[command(flatten)]
    common: CommonArgs,

    /// Where policy versions and checkpoints are written (`<dir>/<run_id>/step-<N>/`).
    #[arg(long, env = "ARL_RUNS_DIR")]
    runs_dir: Option<PathBuf>,

    /// Policy versions kept on disk besides the newest checkpoint.
    #[arg(long, default_value_t = 2)]
    keep_versions: usize,

    /// Trajectories held at once while their steps are trained (all runs).
    #[arg(long, default_value_t = 4096)]
    capacity: usize,

    /// Seconds between the trainer's keep-alive signals for held trajectories, × 3.
    #[arg(long, default_value_t = 30)]
    ack_wait_s: u64,

    /// The GPU `trainer.device = "cuda"` runs train on (its ordinal), or `none`. A machine
    /// without one still serves `cpu` runs; admission sends `cuda` runs only where a
    /// trainer announced a GPU.
    #[arg(long, env = "ARL_TRAINER_GPU", default_value = "0")]
    gpu: String,

    /// Threads of the CPU kernels (cpu runs); default: the cores this process may use (its
    /// CPU affinity and cgroup quota).
    #[arg(long, env = "ARL_THREADS")]
    threads: Option<usize>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // Each step frees and re-allocates gigabytes of activations: keep them in the process.
    arl_model::ops::retain_freed_memory();
    let threads = arl_model::ops::size_thread_pool(args.threads).context("--threads")?;
    let telemetry = telemetry::init("arl-trainer", telemetry::otlp_endpoint_from_env())?;
    tracing::info!(threads, "CPU kernels sized");
    let metrics = Metrics::new();
    let bus = Bus::connect(args.common.bus_config("arl-trainer")?, metrics.clone()).await?;
    bus.provision().await.context("provisioning streams")?;

    let shutdown = Shutdown::new();
    shutdown.trigger_on_signals();
    // Ready once the GPU is probed and the trajectory consumer runs.
    let started = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let readiness = arl_runtime::http::Readiness::flag(started.clone(), "the trainer's start-up");
    let router = arl_runtime::http::ops_router("trainer", bus.clone(), metrics, readiness);
    arl_runtime::http::serve(args.common.http_addr, router, &shutdown).await?;

    let gpu = match args.gpu.as_str() {
        "none" => None,
        ordinal => Some(ordinal.parse::<usize>().with_context(|| {
            format!("--gpu {ordinal:?}: give a GPU ordinal (0, 1, …) or \"none\"")
        })?),
    };
    let mut config = TrainerConfig {
        gpu,
        keep_versions: args.keep_versions,
        capacity: args.capacity,
        ack_wait: Duration::from_secs(args.ack_wait_s.max(1)),
        ..TrainerConfig::default()
    };
    if let Some(dir) = args.runs_dir {
        config.runs_dir = dir;
    }
    std::fs::create_dir_all(&config.runs_dir)
        .with_context(|| format!("creating {}", config.runs_dir.display()))?;
    Trainer::new(bus, config).start(&shutdown);
    started.store(true, std::sync::atomic::Ordering::SeqCst);
    tracing::info!("trainer running");
    shutdown.triggered().await;
    shutdown.wait().await;
    telemetry.shutdown().await;
    Ok(())
}
