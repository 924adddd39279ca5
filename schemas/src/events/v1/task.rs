//! The tasks of one step, handed from the dataset service to the image builder and rollout.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{example_run, example_task};
use crate::events::{EnvironmentRef, Example, Split, TaskKind, event};
use crate::{RunId, TaskId};

/// One task of a batch, with what is needed to find its environment.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TaskRef {
    pub task_id: TaskId,
    pub kind: TaskKind,
    /// Content hash of the registered dataset the task came from.
    pub dataset_digest: String,
    pub environment: EnvironmentRef,
}

/// The tasks of one step; each is to be run `samples_per_task` times (`rollout.n`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TaskBatchV1 {
    pub run_id: RunId,
    pub step: u32,
    pub split: Split,
    pub samples_per_task: u32,
    pub tasks: Vec<TaskRef>,
}
event!(TaskBatchV1, task, "batch", 1, |e| format!(
    "task.batch:{}:{}:{}",
    e.run_id,
    match e.split {
        crate::events::Split::Train => "train",
        crate::events::Split::Validation => "validation",
    },
    e.step
));

impl Example for TaskBatchV1 {
    fn example() -> Self {
        Self {
            run_id: example_run(),
            step: 1,
            split: Split::Train,
            samples_per_task: 4,
            tasks: vec![TaskRef {
                task_id: example_task(),
                kind: TaskKind::Swebench,
                dataset_digest: "sha256:5d41402abc4b2a76b9719d911017c592".into(),
                environment: EnvironmentRef {
                    name: "swebench/django__django-11880".into(),
                    digest: None,
                },
            }],
        }
    }
}

/// A run's dataset was loaded, validated and registered in the `ARL_DATASETS` object
/// store under `digest` (a [`crate::dataset::DatasetManifestV1`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct DatasetRegisteredV1 {
    pub run_id: RunId,
    pub digest: String,
    pub source: String,
    pub train_tasks: u32,
    pub validation_tasks: u32,
    /// Rows left out because they failed validation (the run allowed it).
    pub invalid_rows: u32,
    pub at: chrono::DateTime<chrono::Utc>,
}
event!(DatasetRegisteredV1, task, "dataset", 1, |e| format!(
    "task.dataset:{}",
    e.run_id
));

impl Example for DatasetRegisteredV1 {
    fn example() -> Self {
        Self {
            run_id: example_run(),
            digest: "sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
                .into(),
            source: "../shared/data/swebench/verified_mini_50.jsonl".into(),
            train_tasks: 40,
            validation_tasks: 10,
            invalid_rows: 0,
            at: super::example_time(),
        }
    }
}
