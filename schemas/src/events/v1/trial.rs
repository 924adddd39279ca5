//! One agent attempt at one task.

use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{example_run, example_task, example_time, example_trial};
use crate::events::{Example, FailureClass, Split, event};
use crate::{RunId, TaskId, TrialId};

/// Which trial this is: the `sample_index`-th of `n` samples of a task in a step. A retry
/// keeps the trial id and increments `attempt`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TrialSlot {
    pub task_id: TaskId,
    pub step: u32,
    pub split: Split,
    pub sample_index: u32,
    pub attempt: u32,
}

/// One trial to run: a work item of the rollout replicas (a durable consumer they share).
/// A retry is a new request with the same trial id and the next attempt.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TrialRequestedV1 {
    pub run_id: RunId,
    pub trial_id: TrialId,
    pub slot: TrialSlot,
    pub task: crate::events::TaskRef,
}
event!(TrialRequestedV1, trial, "requested", 1, |e| format!(
    "trial.requested:{}:{}",
    e.trial_id, e.slot.attempt
));

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TrialStartedV1 {
    pub run_id: RunId,
    pub trial_id: TrialId,
    pub slot: TrialSlot,
    /// The weights version serving the trial when it started.
    pub policy_version: u64,
    pub started_at: DateTime<Utc>,
}
event!(TrialStartedV1, trial, "started", 1, |e| format!(
    "trial.started:{}:{}",
    e.trial_id, e.slot.attempt
));

/// How the agent loop ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum AgentExit {
    /// The agent called submit (or the command agent exited 0).
    Submitted,
    /// `rollout.max_turns` reached.
    TurnLimit,
    /// The model stopped without an action.
    NoAction,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TrialFinishedV1 {
    pub run_id: RunId,
    pub trial_id: TrialId,
    pub slot: TrialSlot,
    pub exit: AgentExit,
    pub num_turns: u32,
    /// `git diff` of the work tree against the task's base.
    pub patch: String,
    pub duration_seconds: f64,
    pub finished_at: DateTime<Utc>,
}
event!(TrialFinishedV1, trial, "finished", 1, |e| format!(
    "trial.finished:{}:{}",
    e.trial_id, e.slot.attempt
));

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TrialFailedV1 {
    pub run_id: RunId,
    pub trial_id: TrialId,
    pub slot: TrialSlot,
    pub class: FailureClass,
    pub message: String,
    /// True when the class's policy will run the trial again with a fresh sandbox.
    pub will_retry: bool,
    pub failed_at: DateTime<Utc>,
}
event!(TrialFailedV1, trial, "failed", 1, |e| format!(
    "trial.failed:{}:{}",
    e.trial_id, e.slot.attempt
));

fn example_slot() -> TrialSlot {
    TrialSlot {
        task_id: example_task(),
        step: 1,
        split: Split::Train,
        sample_index: 2,
        attempt: 0,
    }
}

impl Example for TrialRequestedV1 {
    fn example() -> Self {
        Self {
            run_id: example_run(),
            trial_id: example_trial(),
            slot: example_slot(),
            task: crate::events::TaskRef {
                task_id: example_task(),
                kind: crate::events::TaskKind::Swebench,
                dataset_digest:
                    "sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08".into(),
                environment: crate::events::EnvironmentRef {
                    name: "swebench/django__django-11880".into(),
                    digest: None,
                },
            },
        }
    }
}

impl Example for TrialStartedV1 {
    fn example() -> Self {
        Self {
            run_id: example_run(),
            trial_id: example_trial(),
            slot: example_slot(),
            policy_version: 1,
            started_at: example_time(),
        }
    }
}

impl Example for TrialFinishedV1 {
    fn example() -> Self {
        Self {
            run_id: example_run(),
            trial_id: example_trial(),
            slot: example_slot(),
            exit: AgentExit::Submitted,
            num_turns: 6,
            patch: "diff --git a/django/db/models/base.py b/django/db/models/base.py\n".into(),
            duration_seconds: 73.2,
            finished_at: example_time(),
        }
    }
}

impl Example for TrialFailedV1 {
    fn example() -> Self {
        Self {
            run_id: example_run(),
            trial_id: example_trial(),
            slot: example_slot(),
            class: FailureClass::ContextOverflow,
            message: "prompt of 8,412 tokens exceeds the context window of 8,192".into(),
            will_retry: false,
            failed_at: example_time(),
        }
    }
}
