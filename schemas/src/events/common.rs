//! Value types shared by several events.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Why a trial (or its grading) did not produce a usable sample. Each class has its own
/// policy in the rollout service (retry, mask, fail the group, score zero).
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum FailureClass {
    /// Sandbox, image, bus or engine trouble: not the agent's fault.
    Infrastructure,
    /// The agent crashed or broke its protocol.
    AgentError,
    /// The wall-clock budget ran out.
    Timeout,
    /// The conversation no longer fits the model's context window.
    ContextOverflow,
    /// The reward service could not grade the patch.
    GradingError,
}

impl FailureClass {
    pub const ALL: [FailureClass; 5] = [
        FailureClass::Infrastructure,
        FailureClass::AgentError,
        FailureClass::Timeout,
        FailureClass::ContextOverflow,
        FailureClass::GradingError,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            FailureClass::Infrastructure => "infrastructure",
            FailureClass::AgentError => "agent_error",
            FailureClass::Timeout => "timeout",
            FailureClass::ContextOverflow => "context_overflow",
            FailureClass::GradingError => "grading_error",
        }
    }
}

/// Failed trials of a run, counted by class.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct FailureCounts {
    pub infrastructure: u64,
    pub agent_error: u64,
    pub timeout: u64,
    pub context_overflow: u64,
    pub grading_error: u64,
}

impl FailureCounts {
    pub fn add(&mut self, class: FailureClass) {
        *self.slot(class) += 1;
    }

    pub fn get(&self, class: FailureClass) -> u64 {
        match class {
            FailureClass::Infrastructure => self.infrastructure,
            FailureClass::AgentError => self.agent_error,
            FailureClass::Timeout => self.timeout,
            FailureClass::ContextOverflow => self.context_overflow,
            FailureClass::GradingError => self.grading_error,
        }
    }

    pub fn total(&self) -> u64 {
        FailureClass::ALL.iter().map(|c| self.get(*c)).sum()
    }

    fn slot(&mut self, class: FailureClass) -> &mut u64 {
        match class {
            FailureClass::Infrastructure => &mut self.infrastructure,
            FailureClass::AgentError => &mut self.agent_error,
            FailureClass::Timeout => &mut self.timeout,
            FailureClass::ContextOverflow => &mut self.context_overflow,
            FailureClass::GradingError => &mut self.grading_error,
        }
    }
}

/// Which part of the dataset a task was drawn from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Split {
    Train,
    Validation,
}

/// The kind of task, which decides how it is graded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum TaskKind {
    /// A SWE-bench instance: FAIL_TO_PASS / PASS_TO_PASS tests.
    Swebench,
    /// A Harbor task folder: `tests/test.sh` writes the reward.
    Harbor,
    /// A tool-use math problem: exact match of the final answer.
    Math,
}

/// The environment a task runs in: a local snapshot for bubblewrap, or an OCI image in a
/// cluster. `name` is stable across runs (e.g. `swebench/django__django-11880`); `digest`
/// pins the content once it is known.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub struct EnvironmentRef {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
}
