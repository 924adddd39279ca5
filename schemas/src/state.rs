//! The controller's record of one run, kept in the `ARL_RUN_STATE` key-value bucket under
//! the run id. The CLI reads it for `arl run status`, `list` and `watch`.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::events::{BatchCounts, FailureCounts, RunPhase};
use crate::spec::RunSpec;
use crate::{FieldError, RunId};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum RunStatus {
    Accepted,
    Rejected,
    Running,
    Completed,
    Failed,
    /// Stopped by a user (`arl run cancel`) before it ended.
    Cancelled,
}

impl RunStatus {
    /// True once nothing more will happen to the run.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            RunStatus::Rejected | RunStatus::Completed | RunStatus::Failed | RunStatus::Cancelled
        )
    }

    pub fn as_str(self) -> &'static str {
        match self {
            RunStatus::Accepted => "accepted",
            RunStatus::Rejected => "rejected",
            RunStatus::Running => "running",
            RunStatus::Completed => "completed",
            RunStatus::Failed => "failed",
            RunStatus::Cancelled => "cancelled",
        }
    }
}

/// One evaluation's headline numbers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct EvaluationSummary {
    pub step: u32,
    pub resolution_rate: f64,
    pub ci95_low: f64,
    pub ci95_high: f64,
    /// pass@k by k.
    pub pass_at_k: BTreeMap<u32, f64>,
}

/// One training step's headline numbers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct StepSummary {
    pub step: u32,
    pub policy_version: u64,
    pub reward_mean: f64,
    pub pg_loss: f64,
    pub grad_norm: f64,
    pub seconds: f64,
    /// What the step's batch held and trained on (absent for a version-1 `train.step`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch: Option<BatchCounts>,
    /// Tool calls per trajectory (MCP tools), as the step's `train.step` reported it;
    /// absent in states recorded before the controller kept it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls_mean: Option<f64>,
}

impl StepSummary {
    /// The step changed no weight: no sample carried an advantage (or, for a step
    /// reported without batch counts, the gradient was zero).
    pub fn trained_nothing(&self) -> bool {
        match &self.batch {
            Some(batch) => batch.samples_trained == 0,
            None => self.grad_norm == 0.0,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct RunStateV1 {
    pub run_id: RunId,
    pub name: String,
    pub status: RunStatus,
    pub phase: RunPhase,
    pub submitted_by: String,
    pub submitted_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    /// The accepted spec; absent when the request could not be decoded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec: Option<RunSpec>,
    /// The model file or folder the spec resolved to on the controller.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_path: Option<String>,
    /// The dataset file or folder the spec resolved to on the controller.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dataset_path: Option<String>,
    /// Digest of the run's registered dataset (`ARL_DATASETS` object store), once the
    /// dataset service has registered it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dataset_digest: Option<String>,
    /// Why the run was rejected.

    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<FieldError>,
    pub total_steps: u32,
    /// Steps committed by the trainer.
    pub step: u32,
    pub policy_version: u64,
    pub trials_finished: u64,
    pub failures: FailureCounts,
    #[serde(default)]
    pub steps: Vec<StepSummary>,
    #[serde(default)]
    pub evaluations: Vec<EvaluationSummary>,
    /// Per training step, trials that failed for good as `infrastructure`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub infrastructure_failures: BTreeMap<u32, u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_uri: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_reason: Option<String>,
    /// Sequence of the last progress event published for the run.
    pub progress_sequence: u64,
    /// Per stream, the last stream sequence folded into this state: a redelivered event
    /// at or below it is not applied again.
    #[serde(default)]
    pub applied: BTreeMap<String, u64>,
}

impl RunStateV1 {
    /// Share of the run done, 0–100: training steps, with the final evaluation as the
    /// last part.
    pub fn percent(&self) -> f32 {
        if self.status == RunStatus::Completed {
            return 100.0;
        }
        if self.total_steps == 0 {
            return 0.0;
        }
        let done = f64::from(self.step.min(self.total_steps)) / f64::from(self.total_steps);
        // The last 5% is the final evaluation.
        (done * 95.0) as f32
    }

    pub fn encode(&self) -> Result<Vec<u8>, serde_json::Error> {
        serde_json::to_vec(self)
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(bytes)
    }
}

/// Seconds a trainer's announcement lives without a refresh (the `ARL_TRAINERS` bucket's
/// max age); trainers refresh every third of it.
pub const TRAINER_TTL_SECONDS: u64 = 30;

/// A trainer's announcement in `ARL_TRAINERS`, keyed by `instance`: what it can train on.
/// Admission reads the live ones, so a `cuda` run is rejected before any rollout is spent
/// when no trainer has a GPU.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TrainerAnnouncementV1 {
    /// Unique per trainer process (a KV key: letters, digits, '-', '_').
    pub instance: String,
    /// Host name, for people reading the bucket.
    pub host: String,
    /// The GPUs this trainer opened; empty when it has none.
    pub devices: Vec<GpuDeviceV1>,
    /// Why it has no GPU (no driver, no device, unsupported), when `devices` is empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_unavailable: Option<String>,
    /// Runs whose model this trainer holds.
    pub runs: Vec<RunId>,
    /// Trajectories it can hold unacknowledged until their step's checkpoint (its
    /// consumer's `max_ack_pending`); admission refuses a run that would need more.
    /// Absent from trainers that predate it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held_capacity: Option<u64>,
    pub at: DateTime<Utc>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct GpuDeviceV1 {
    pub ordinal: u32,
    pub name: String,
    pub memory_bytes: u64,
    /// "major.minor", e.g. "9.0" for an H100/H200.
    pub compute_capability: String,
}

impl TrainerAnnouncementV1 {
    pub fn encode(&self) -> Result<Vec<u8>, serde_json::Error> {
        serde_json::to_vec(self)
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(bytes)
    }
}

/// A trial's entry in `ARL_TRIALS`, under its trial id, written by the rollout service
/// when it claims an attempt. Services that act on a trial's events (reward grades a
/// `trial.finished`, the trainer takes a `trajectory.ready`) check it: an event for a trial
/// with no entry, or for an attempt beyond the claimed one, was never requested and is
/// refused.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct TrialRecordV1 {
    /// The attempt claimed last.
    pub attempt: u32,
    /// The attempt is over (published, or not to be run).
    pub done: bool,
}

/// Seconds a done attempt's entry stays in `ARL_TRIALS` before it expires (written with a
/// per-message TTL when the attempt is done): longer than a copy of its request can still
/// come (a redelivery within the rollout's ack wait, 60 s by default; a republish within
/// the trial stream's 2-minute de-duplication window), so that a copy finds it done. An
/// event about an attempt published longer ago than this may have outlived its entry
/// (`arl_runtime::Bus::check_requested`).
pub const DONE_TRIAL_RECORD_KEPT_SECONDS: u64 = 300;

/// Version 2 of a trial's entry in `ARL_TRIALS`: version 1's fields, plus what the
/// trial's saga needs between its hand-offs. A superset in JSON (a version 1 reader
/// ignores `finished`; a version 1 entry reads as one with nothing finished), so both
/// versions live in the bucket side by side.
///
/// The saga: the rollout claims an attempt (`finished` absent) → runs the agent → writes
/// `finished` → publishes `trial.finished` and lets the request go; the grade
/// (`reward.scored`, or a grader's `trial.failed` for an attempt whose `finished` is set)
/// is joined with the attempt's recorded calls into `trajectory.ready` by whichever
/// replica takes it → `done`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TrialRecordV2 {
    /// The attempt claimed last.
    pub attempt: u32,
    /// The attempt is over (published, or not to be run).
    pub done: bool,
    /// Set once the attempt's agent has finished and its `trial.finished` is (about to
    /// be) published; absent while the agent runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished: Option<FinishedAttemptV1>,
}

/// What joining a finished attempt's grade needs that the grade does not carry.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct FinishedAttemptV1 {
    /// The task as the request named it (a retry is requested with it).
    pub task: crate::events::TaskRef,
    /// Calls the proxy counted for the attempt: the join waits until all are readable.
    pub calls: u32,
    /// Where the proxy stored each of them in the LLM stream (`TrialKeyRevokedV1`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub call_sequences: Vec<u64>,
    /// Agent turns whose reply could not be parsed (reported with the trajectory).
    pub parse_failures: u32,
    /// Tool calls the agent made (the `mcp-tools` agent's MCP calls; reported with the
    /// trajectory). 0 from a rollout older than this field.
    #[serde(default)]
    pub tool_calls: u32,
}

impl TrialRecordV2 {
    /// Whether an event of `attempt` of this trial can have come from the rollout
    /// service: that attempt, or an earlier one, was claimed.
    pub fn requested(record: Option<&Self>, attempt: u32) -> bool {
        record.is_some_and(|r| attempt <= r.attempt)
    }
}

/// The `ARL_TRIALS` key that marks a task's group of one step as failed (the rollout's
/// `fail_group` policy); the trainer leaves such a group out of the step. The task id is
/// hex-encoded: keys allow only a few characters.
pub fn failed_group_key(
    run: &RunId,
    split: crate::events::Split,
    step: u32,
    task: &crate::TaskId,
) -> String {
    let split = match split {
        crate::events::Split::Train => 's',
        crate::events::Split::Validation => 'v',
    };
    let task: String = task.as_str().bytes().map(|b| format!("{b:02x}")).collect();
    format!("group.{run}.{split}{step}.{task}")
}
