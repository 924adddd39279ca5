//! `arl-trainer` as a hosted service: its flags and how it starts (the runtime's host does
//! the rest — connection, ops endpoints, signals, drain).

use std::path::PathBuf;
use std::time::Duration;

use arl_runtime::host::{Context, Ops, Service, StartError};
use arl_runtime::http::Readiness;

use crate::service::{Trainer as TrainerService, TrainerConfig, WeightsStore};

/// `arl-trainer`'s own flags (beside the common ones).
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Where policy versions and checkpoints are written (`<dir>/<run_id>/step-<N>/`).
    #[arg(long, env = "ARL_RUNS_DIR")]
    runs_dir: Option<PathBuf>,

    /// Policy versions kept on disk besides the newest checkpoint.
    #[arg(long, default_value_t = 2)]
    keep_versions: usize,

    /// Where engines fetch published versions: `file`, the version folder under
    /// --runs-dir (engines on this machine, or a volume every node mounts); `object`, its
    /// files uploaded to the ARL_WEIGHTS JetStream object store (engines on any machine of
    /// the bus), deleted again when the version is pruned.
    #[arg(long, env = "ARL_WEIGHTS_STORE", value_enum, default_value_t = WeightsStore::File)]
    weights_store: WeightsStore,

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

/// The trainer service, for `arl_runtime::host`.
pub struct Trainer;

impl Service for Trainer {
    const NAME: &'static str = "trainer";
    const ABOUT: &'static str = "ARL trainer: GRPO on CPU or an NVIDIA GPU";
    type Args = Args;

    async fn start(args: Args, ctx: Context) -> Result<Ops, StartError> {
        // Each step frees and re-allocates gigabytes of activations: keep them in the
        // process; and size the kernels' threads.
        let threads =
            arl_model::ops::prepare_process(args.threads).map_err(|e| format!("--threads: {e}"))?;
        tracing::info!(threads, "CPU kernels sized");
        let gpu = match args.gpu.as_str() {
            "none" => None,
            ordinal => Some(ordinal.parse::<usize>().map_err(|_| {
                format!("--gpu {ordinal:?}: give a GPU ordinal (0, 1, …) or \"none\"")
            })?),
        };
        let mut config = TrainerConfig {
            gpu,
            keep_versions: args.keep_versions,
            weights_store: args.weights_store,
            capacity: args.capacity,
            ack_wait: Duration::from_secs(args.ack_wait_s.max(1)),
            ..TrainerConfig::default()
        };
        if let Some(dir) = args.runs_dir {
            config.runs_dir = dir;
        }
        std::fs::create_dir_all(&config.runs_dir)
            .map_err(|e| format!("creating {}: {e}", config.runs_dir.display()))?;
        tracing::info!(weights_store = ?config.weights_store, "versions published from");
        // Ready once this returns: the GPU is probed and the trajectory consumer runs.
        TrainerService::new(ctx.bus, config).start(&ctx.shutdown);
        Ok(Ops::Host(Readiness::always()))
    }
}
