//! `arl-dataset` as a hosted service: its flags and how it starts (the runtime's host does
//! the rest — connection, ops endpoints, signals, drain).

use arl_runtime::host::{Context, Ops, Service, StartError};
use arl_runtime::http::Readiness;

use crate::service::DatasetService;

/// `arl-dataset` has no flags of its own.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// The dataset service, for `arl_runtime::host`.
pub struct Dataset;

impl Service for Dataset {
    const NAME: &'static str = "dataset";
    const ABOUT: &'static str = "ARL dataset service: datasets and task batches";
    type Args = Args;

    async fn start(_args: Args, ctx: Context) -> Result<Ops, StartError> {
        DatasetService::new(ctx.bus).start(&ctx.shutdown);
        Ok(Ops::Host(Readiness::always()))
    }
}
