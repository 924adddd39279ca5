//! The end of a sandbox lease, version 2: it names the trial the lease served and says why
//! the service ended a lease itself, which it now does for more than one reason (a work
//! tree past its disk limit beside an unrenewed lease). Version 1 carried only the reason's
//! name.

use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::events::v1::{example_run, example_time, example_trial};
use crate::events::{Example, event};
use crate::{LeaseId, RunId, TrialId};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum LeaseEnd {
    /// The holder released it.
    Released,
    /// The holder stopped renewing.
    Expired,
    /// A restarted sandbox service found it left over.
    Reaped,
    /// Its work tree grew past the lease's disk limit.
    DiskLimit,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SandboxReleasedV2 {
    pub run_id: RunId,
    pub lease_id: LeaseId,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trial_id: Option<TrialId>,
    pub reason: LeaseEnd,
    /// What happened, for a person: set when the service ended the lease itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    pub at: DateTime<Utc>,
}
event!(SandboxReleasedV2, sandbox, "released", 2, |e| format!(
    "sandbox.released:{}",
    e.lease_id
));

impl Example for SandboxReleasedV2 {
    fn example() -> Self {
        Self {
            run_id: example_run(),
            lease_id: LeaseId::known("lease-0193a1b2c3d4e5f6"),
            trial_id: Some(example_trial()),
            reason: LeaseEnd::DiskLimit,
            detail: Some(
                "its work tree grew by 4,113 MB, past the lease's disk limit of 4,096 MB".into(),
            ),
            at: example_time(),
        }
    }
}
