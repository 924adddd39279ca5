//! `arl-controller` as a hosted service: its flags and how it starts (the runtime's host does
//! the rest — connection, ops endpoints, signals, drain).

use std::path::PathBuf;

use arl_runtime::host::{Context, Ops, Service, StartError};
use arl_runtime::http::Readiness;

use crate::{Controller as ControllerService, ControllerConfig};

/// `arl-controller`'s own flags (beside the common ones).
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Folder where installed models are looked up by name.
    #[arg(long, env = "ARL_MODEL_DIR")]
    model_dir: Option<PathBuf>,
    /// Write every run's step and evaluation figures as TensorBoard scalars under
    /// DIR/<run_id>/ (`tensorboard --logdir DIR`); not written when unset.
    #[arg(long, env = "ARL_TENSORBOARD_DIR", value_name = "DIR")]
    tensorboard_dir: Option<PathBuf>,
}

/// The controller service, for `arl_runtime::host`.
pub struct Controller;

impl Service for Controller {
    const NAME: &'static str = "controller";
    const ABOUT: &'static str = "ARL controller: owns each run's life";
    type Args = Args;

    async fn start(args: Args, ctx: Context) -> Result<Ops, StartError> {
        let mut config = ControllerConfig::default();
        if let Some(dir) = args.model_dir {
            config.model_dir = dir;
        }
        config.tensorboard_dir = args.tensorboard_dir;
        ControllerService::new(ctx.bus, config)
            .await?
            .start(&ctx.shutdown);
        Ok(Ops::Host(Readiness::always()))
    }
}
