//! One committed optimizer step of the trainer.

use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{example_run, example_time};
use crate::RunId;
use crate::events::{Example, event};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TrainMetrics {
    pub pg_loss: f64,
    pub kl: f64,
    pub entropy: f64,
    pub clip_fraction: f64,
    pub grad_norm: f64,
    pub lr: f64,
    pub reward_mean: f64,
    pub reward_max: f64,
    pub response_length_mean: f64,
    pub num_turns_mean: f64,
    /// Tool calls per trajectory (MCP tools). 0 from an older trainer.
    #[serde(default)]
    pub tool_calls_mean: f64,
    pub tokens_per_second: f64,
    pub trajectories: u32,
    /// Groups dropped by dynamic sampling (all rewards equal).
    pub groups_dropped: u32,
}

/// Seconds spent in each phase of the step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct StepTiming {
    pub wait_for_trajectories: f64,
    pub old_logprobs: f64,
    pub update: f64,
    pub save: f64,
    pub total: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TrainStepV1 {
    pub run_id: RunId,
    /// 1-based: the first committed step is 1.
    pub step: u32,
    /// The weights version this step produced.
    pub policy_version: u64,
    pub metrics: TrainMetrics,
    pub timing: StepTiming,
    pub at: DateTime<Utc>,
}
event!(TrainStepV1, train, "step", 1, |e| format!(
    "train.step:{}:{}",
    e.run_id, e.step
));

impl Example for TrainStepV1 {
    fn example() -> Self {
        Self {
            run_id: example_run(),
            step: 1,
            policy_version: 1,
            metrics: TrainMetrics {
                pg_loss: -0.0132,
                kl: 0.0004,
                entropy: 1.92,
                clip_fraction: 0.031,
                grad_norm: 0.87,
                lr: 1e-6,
                reward_mean: 0.25,
                reward_max: 1.1,
                response_length_mean: 211.0,
                num_turns_mean: 4.5,
                tool_calls_mean: 0.0,
                tokens_per_second: 1830.0,
                trajectories: 16,
                groups_dropped: 1,
            },
            timing: StepTiming {
                wait_for_trajectories: 95.0,
                old_logprobs: 4.2,
                update: 22.8,
                save: 0.9,
                total: 122.9,
            },
            at: example_time(),
        }
    }
}
