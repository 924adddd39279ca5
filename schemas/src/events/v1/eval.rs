//! The resolution rate on the validation split at one step.

use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{example_run, example_time};
use crate::RunId;
use crate::events::{Example, event};

/// Unbiased pass@k over tasks (Chen et al., 2021).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct PassAtK {
    pub k: u32,
    pub value: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct EvaluationCompletedV1 {
    pub run_id: RunId,
    pub step: u32,
    pub policy_version: u64,
    pub tasks: u32,
    pub samples_per_task: u32,
    pub resolved_samples: u32,
    pub resolution_rate: f64,
    /// 95% confidence interval of the resolution rate (Wilson score).
    pub ci95_low: f64,
    pub ci95_high: f64,
    pub pass_at_k: Vec<PassAtK>,
    pub at: DateTime<Utc>,
}
event!(EvaluationCompletedV1, eval, "completed", 1, |e| format!(
    "eval.completed:{}:{}",
    e.run_id, e.step
));

impl Example for EvaluationCompletedV1 {
    fn example() -> Self {
        Self {
            run_id: example_run(),
            step: 2,
            policy_version: 2,
            tasks: 100,
            samples_per_task: 4,
            resolved_samples: 37,
            resolution_rate: 0.0925,
            ci95_low: 0.0678,
            ci95_high: 0.1250,
            pass_at_k: vec![
                PassAtK {
                    k: 1,
                    value: 0.0925,
                },
                PassAtK { k: 4, value: 0.21 },
            ],
            at: example_time(),
        }
    }
}
