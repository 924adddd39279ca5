//! `arl-rollout` as a hosted service: its flags and how it starts (the runtime's host does
//! the rest — connection, ops endpoints, signals, drain).

use std::time::Duration;

use arl_runtime::host::{Context, Ops, Service, StartError};
use arl_runtime::http::Readiness;

use crate::service::{Rollout as RolloutService, RolloutConfig};

/// `arl-rollout`'s own flags (beside the common ones).
#[derive(Debug, clap::Args)]
pub struct Args {
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

/// The rollout service, for `arl_runtime::host`.
pub struct Rollout;

impl Service for Rollout {
    const NAME: &'static str = "rollout";
    const ABOUT: &'static str = "ARL rollout service: trials";
    type Args = Args;

    async fn start(args: Args, ctx: Context) -> Result<Ops, StartError> {
        let config = RolloutConfig {
            concurrency: args.concurrency,
            wait_limit: Duration::from_secs(args.wait_limit_s),
            ack_wait: Duration::from_secs(args.ack_wait_s.max(1)),
        };
        RolloutService::new(ctx.bus, config).start(&ctx.shutdown);
        Ok(Ops::Host(Readiness::always()))
    }
}
