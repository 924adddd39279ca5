//! "Does the task's environment exist?" — answered by the image builder.

use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{example_run, example_task, example_time};
use crate::events::{EnvironmentRef, Example, event};
use crate::{RunId, TaskId};

/// Where a ready environment lives.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum EnvironmentLocation {
    /// A content-addressed directory on the sandbox host (bubblewrap backend).
    LocalSnapshot { path: String },
    /// `{registry}/{namespace}/{instance_id}:latest`, pinned by digest.
    OciImage { reference: String },
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ImageReadyV1 {
    pub run_id: RunId,
    pub task_id: TaskId,
    pub environment: EnvironmentRef,
    pub location: EnvironmentLocation,
    /// True when it already existed and nothing was built.
    pub cached: bool,
    pub build_seconds: f64,
    pub at: DateTime<Utc>,
}
event!(ImageReadyV1, image, "ready", 1, |e| format!(
    "image.ready:{}:{}",
    e.run_id, e.task_id
));

/// Why an environment could not be made.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ImageFailureReason {
    /// The repository does not contain the base commit.
    MissingCommit,
    /// An install command exited non-zero.
    InstallError,
    /// The build ran past its time limit.
    Timeout,
    /// The Python interpreter the task needs is not on this machine.
    InterpreterMissing,
    /// The registry refused or could not be reached.
    RegistryError,
    /// BuildKit failed.
    BuildError,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ImageFailedV1 {
    pub run_id: RunId,
    pub task_id: TaskId,
    pub environment: EnvironmentRef,
    pub reason: ImageFailureReason,
    pub message: String,
    /// The last lines of the build log.
    pub log_tail: String,
    pub at: DateTime<Utc>,
}
event!(ImageFailedV1, image, "failed", 1, |e| format!(
    "image.failed:{}:{}",
    e.run_id, e.task_id
));

fn example_environment() -> EnvironmentRef {
    EnvironmentRef {
        name: "swebench/django__django-11880".into(),
        digest: Some(
            "sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08".into(),
        ),
    }
}

impl Example for ImageReadyV1 {
    fn example() -> Self {
        Self {
            run_id: example_run(),
            task_id: example_task(),
            environment: example_environment(),
            location: EnvironmentLocation::LocalSnapshot {
                path: "/home/ada/.cache/arl/envs/9f86d081884c7d65".into(),
            },
            cached: false,
            build_seconds: 41.5,
            at: example_time(),
        }
    }
}

impl Example for ImageFailedV1 {
    fn example() -> Self {
        Self {
            run_id: example_run(),
            task_id: example_task(),
            environment: example_environment(),
            reason: ImageFailureReason::InterpreterMissing,
            message: "python3.6 is not installed; install it with `pyenv install 3.6.15`".into(),
            log_tail: "pyenv: version `3.6' not installed\n".into(),
            at: example_time(),
        }
    }
}
