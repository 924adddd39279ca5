//! Version 1 of every event. Never edit a struct here once it has been published.

mod eval;
mod image;
mod llm;
mod reward;
mod run;
mod sandbox;
mod task;
mod train;
mod trajectory;
mod trial;
mod weights;

pub use eval::*;
pub use image::*;
pub use llm::*;
pub use reward::*;
pub use run::*;
pub use sandbox::*;
pub use task::*;
pub use train::*;
pub use trajectory::*;
pub use trial::*;
pub use weights::*;

use chrono::{DateTime, TimeZone, Utc};

/// A fixed instant for examples, so golden files are reproducible.
pub(crate) fn example_time() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2026, 11, 30, 12, 0, 0)
        .single()
        .unwrap_or_default()
}

pub(crate) fn example_run() -> crate::RunId {
    crate::RunId::known("run-0193a1b2c3d4")
}

pub(crate) fn example_trial() -> crate::TrialId {
    crate::TrialId::known("run-0193a1b2c3d4-s1-t0-k2")
}

pub(crate) fn example_task() -> crate::TaskId {
    crate::TaskId::known("django__django-11880")
}
