//! A run's life: requested → accepted | rejected → progress … → completed | failed |
//! cancelled.

use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{example_run, example_time};
use crate::events::{Example, FailureCounts, event};
use crate::spec::RunSpec;
use crate::{FieldError, RunId};

/// A user asks for a training run (`arl run submit`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RunRequestedV1 {
    pub run_id: RunId,
    pub spec: RunSpec,
    pub submitted_at: DateTime<Utc>,
    /// Who submitted it (user@host), for the audit trail.
    pub submitted_by: String,
}
event!(RunRequestedV1, run, "requested", 1, |e| format!(
    "run.requested:{}",
    e.run_id
));

/// The controller validated the spec: the run will start.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct RunAcceptedV1 {
    pub run_id: RunId,
    pub accepted_at: DateTime<Utc>,
    pub total_steps: u32,
    /// The model file or directory the name in the spec resolved to.
    pub model_path: String,
    /// The dataset file or directory the spec resolved to.
    pub dataset_path: String,
}
event!(RunAcceptedV1, run, "accepted", 1, |e| format!(
    "run.accepted:{}",
    e.run_id
));

/// The controller refused the request; `errors` lists every problem found.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct RunRejectedV1 {
    pub run_id: RunId,
    pub rejected_at: DateTime<Utc>,
    pub errors: Vec<FieldError>,
}
event!(RunRejectedV1, run, "rejected", 1, |e| format!(
    "run.rejected:{}",
    e.run_id
));

/// Where a run is in its pipeline.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum RunPhase {
    Preparing,
    Rollout,
    Training,
    Evaluating,
    Finishing,
}

/// A periodic summary of a run, published by the controller.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct RunProgressV1 {
    pub run_id: RunId,
    pub at: DateTime<Utc>,
    /// Counts the events folded into the run's state, so it rises with every progress
    /// event of the run but may skip (trial counts are announced a flush at a time); the
    /// de-duplication key.
    pub sequence: u64,
    pub phase: RunPhase,
    /// Steps committed by the trainer so far.
    pub step: u32,
    pub total_steps: u32,
    pub trials_finished: u64,
    pub failures: FailureCounts,
    /// 0–100.
    pub percent: f32,
}
event!(RunProgressV1, run, "progress", 1, |e| format!(
    "run.progress:{}:{}",
    e.run_id, e.sequence
));

/// Every step trained and the final evaluation done.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct RunCompletedV1 {
    pub run_id: RunId,
    pub completed_at: DateTime<Utc>,
    pub steps: u32,
    pub final_policy_version: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_uri: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub final_resolution_rate: Option<f64>,
}
event!(RunCompletedV1, run, "completed", 1, |e| format!(
    "run.completed:{}",
    e.run_id
));

/// A user asked to stop the run (`arl run cancel`). The controller ends it `cancelled`
/// (unless it already ended); services start no new work for it, and trials in flight stop
/// and release their sandboxes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RunCancelRequestedV1 {
    pub run_id: RunId,
    pub requested_at: DateTime<Utc>,
    /// Who asked (user@host), for the audit trail.
    pub requested_by: String,
    /// Why, in the user's words (may be empty).
    #[serde(default)]
    pub reason: String,
}
event!(
    RunCancelRequestedV1,
    run,
    "cancel_requested",
    1,
    |e| format!("run.cancel_requested:{}", e.run_id)
);

/// The controller ended the run `cancelled`, as a user asked ([`RunCancelRequestedV1`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct RunCancelledV1 {
    pub run_id: RunId,
    pub cancelled_at: DateTime<Utc>,
    pub requested_by: String,
    pub reason: String,
    /// Steps the trainer had committed when the run was cancelled.
    pub step: u32,
}
event!(RunCancelledV1, run, "cancelled", 1, |e| format!(
    "run.cancelled:{}",
    e.run_id
));

/// The run stopped before completion.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct RunFailedV1 {
    pub run_id: RunId,
    pub failed_at: DateTime<Utc>,
    /// The service that gave up.
    pub service: String,
    pub reason: String,
}
event!(RunFailedV1, run, "failed", 1, |e| format!(
    "run.failed:{}",
    e.run_id
));

impl Example for RunRequestedV1 {
    fn example() -> Self {
        Self {
            run_id: example_run(),
            spec: RunSpec::default(),
            submitted_at: example_time(),
            submitted_by: "ada@workstation".into(),
        }
    }
}

impl Example for RunAcceptedV1 {
    fn example() -> Self {
        Self {
            run_id: example_run(),
            accepted_at: example_time(),
            total_steps: 2,
            model_path: "/home/ada/.cache/arl/models/SmolLM2-135M-Instruct.Q4_1.gguf".into(),
            dataset_path: "/home/ada/arl/examples/tasks".into(),
        }
    }
}

impl Example for RunRejectedV1 {
    fn example() -> Self {
        Self {
            run_id: example_run(),
            rejected_at: example_time(),
            errors: vec![
                FieldError::new("rollout.n", "must be at least 1, got 0"),
                FieldError::new(
                    "model.path",
                    "no such file or directory: /models/missing.gguf",
                ),
            ],
        }
    }
}

impl Example for RunProgressV1 {
    fn example() -> Self {
        Self {
            run_id: example_run(),
            at: example_time(),
            sequence: 7,
            phase: RunPhase::Rollout,
            step: 1,
            total_steps: 2,
            trials_finished: 12,
            failures: FailureCounts {
                timeout: 1,
                ..FailureCounts::default()
            },
            percent: 50.0,
        }
    }
}

impl Example for RunCompletedV1 {
    fn example() -> Self {
        Self {
            run_id: example_run(),
            completed_at: example_time(),
            steps: 2,
            final_policy_version: 2,
            checkpoint_uri: Some("file:///home/ada/.cache/arl/runs/run-0193a1b2c3d4/step-2".into()),
            final_resolution_rate: Some(0.25),
        }
    }
}

impl Example for RunCancelRequestedV1 {
    fn example() -> Self {
        Self {
            run_id: example_run(),
            requested_at: example_time(),
            requested_by: "ada@workstation".into(),
            reason: "the reward curve is flat; trying a higher lr".into(),
        }
    }
}

impl Example for RunCancelledV1 {
    fn example() -> Self {
        Self {
            run_id: example_run(),
            cancelled_at: example_time(),
            requested_by: "ada@workstation".into(),
            reason: "the reward curve is flat; trying a higher lr".into(),
            step: 1,
        }
    }
}

impl Example for RunFailedV1 {
    fn example() -> Self {
        Self {
            run_id: example_run(),
            failed_at: example_time(),
            service: "trainer".into(),
            reason: "loss became NaN at step 3".into(),
        }
    }
}
