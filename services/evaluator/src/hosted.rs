//! `arl-evaluator` as a hosted service: its flags and how it starts (the runtime's host does
//! the rest — connection, ops endpoints, signals, drain).

use arl_runtime::host::{Context, Ops, Service, StartError};
use arl_runtime::http::Readiness;

use crate::service::Evaluator as EvaluatorService;

/// `arl-evaluator` has no flags of its own.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// The evaluator service, for `arl_runtime::host`.
pub struct Evaluator;

impl Service for Evaluator {
    const NAME: &'static str = "evaluator";
    const ABOUT: &'static str = "ARL evaluator: validation resolution rate";
    type Args = Args;

    async fn start(_args: Args, ctx: Context) -> Result<Ops, StartError> {
        EvaluatorService::new(ctx.bus).start(&ctx.shutdown);
        Ok(Ops::Host(Readiness::always()))
    }
}
