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
