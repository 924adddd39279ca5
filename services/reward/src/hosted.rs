//! `arl-reward` as a hosted service: its flags and how it starts (the runtime's host does
//! the rest — connection, ops endpoints, signals, drain).

use std::time::Duration;

use arl_runtime::host::{Context, Ops, Service, StartError};
use arl_runtime::http::Readiness;

use crate::service::{RewardConfig, RewardService, load_test_commands};

/// `arl-reward`'s own flags (beside the common ones).
#[derive(Debug, clap::Args)]
pub struct Args {
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

/// The reward service, for `arl_runtime::host`.
pub struct Reward;

impl Service for Reward {
    const NAME: &'static str = "reward";
    const ABOUT: &'static str = "ARL reward service: grades trials";
    type Args = Args;

    async fn start(args: Args, ctx: Context) -> Result<Ops, StartError> {
        let mut config = RewardConfig {
            test_timeout: Duration::from_secs(args.test_timeout_s),
            ..RewardConfig::default()
        };
        for file in &args.swebench_recipes {
            for command in load_test_commands(file)? {
                config
                    .test_commands
                    .insert(command.instance_id.clone(), command);
            }
        }
        RewardService::new(ctx.bus, config).start(&ctx.shutdown, args.concurrency);
        Ok(Ops::Host(Readiness::always()))
    }
}
