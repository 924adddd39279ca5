//! One committed optimizer step of the trainer, version 2: it adds what the step's batch
//! held and how much of it carried a learning signal, so a step that trained nothing (every
//! group's rewards equal, or every trial masked) is visible to the controller and the user.
//! Version 1 lacks those counts; consumers still read it (`TrainStep`).

use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::RunId;
use crate::events::v1::{StepTiming, TrainMetrics, TrainStepV1};
use crate::events::{Example, event};

/// What one step's batch held and what of it was trained on.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct BatchCounts {
    /// Trajectories that reached the step (`train_batch_size × n` when none was lost).
    pub trajectories: u32,
    /// Trajectories kept out of the loss by the run's failure policy.
    pub masked: u32,
    /// Trajectories older than `algorithm.max_staleness` allows.
    pub stale: u32,
    /// Groups (one task's `n` trials) with at least one trainable sample.
    pub groups: u32,
    /// Groups whose rewards were all equal: GRPO gives them zero advantage, so they teach
    /// nothing (whether or not dynamic sampling dropped them).
    pub zero_advantage_groups: u32,
    /// Samples whose loss carried a non-zero advantage.
    pub samples_trained: u32,
    /// Completion tokens of the batch's trajectories kept out of the loss because their
    /// origin is not proven: no log-probabilities, or no known serving policy version (a
    /// vLLM or SGLang the proxy does not follow, a call across a weight update). Absent
    /// in steps of trainers before it was counted.
    #[serde(default)]
    pub unproven_tokens: u32,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TrainStepV2 {
    pub run_id: RunId,
    /// 1-based: the first committed step is 1.
    pub step: u32,
    /// The weights version this step produced.
    pub policy_version: u64,
    pub metrics: TrainMetrics,
    pub batch: BatchCounts,
    pub timing: StepTiming,
    pub at: DateTime<Utc>,
}
event!(TrainStepV2, train, "step", 2, |e| format!(
    "train.step:{}:{}",
    e.run_id, e.step
));

impl Example for TrainStepV2 {
    fn example() -> Self {
        let v1 = TrainStepV1::example();
        Self {
            run_id: v1.run_id,
            step: v1.step,
            policy_version: v1.policy_version,
            metrics: v1.metrics,
            batch: BatchCounts {
                trajectories: 16,
                masked: 1,
                stale: 0,
                groups: 4,
                zero_advantage_groups: 1,
                samples_trained: 11,
                unproven_tokens: 12,
            },
            timing: v1.timing,
            at: v1.at,
        }
    }
}

/// A `train.step` of any published version, as its consumers read it.
#[derive(Clone, Debug, PartialEq)]
pub enum TrainStep {
    V1(TrainStepV1),
    V2(TrainStepV2),
}

impl TrainStep {
    /// Decodes a `train.step` body of `version` (from the `Arl-Version` header).
    pub fn decode(version: u32, body: &[u8]) -> Result<Self, crate::DecodeError> {
        use crate::Event;
        match version {
            1 => TrainStepV1::decode(body).map(Self::V1),
            2 => TrainStepV2::decode(body).map(Self::V2),
            other => Err(crate::DecodeError::UnknownVersion {
                event_type: TrainStepV2::TYPE,
                version: other,
            }),
        }
    }

    pub fn run_id(&self) -> &RunId {
        match self {
            Self::V1(e) => &e.run_id,
            Self::V2(e) => &e.run_id,
        }
    }

    pub fn step(&self) -> u32 {
        match self {
            Self::V1(e) => e.step,
            Self::V2(e) => e.step,
        }
    }

    pub fn policy_version(&self) -> u64 {
        match self {
            Self::V1(e) => e.policy_version,
            Self::V2(e) => e.policy_version,
        }
    }

    pub fn metrics(&self) -> &TrainMetrics {
        match self {
            Self::V1(e) => &e.metrics,
            Self::V2(e) => &e.metrics,
        }
    }

    pub fn timing(&self) -> &StepTiming {
        match self {
            Self::V1(e) => &e.timing,
            Self::V2(e) => &e.timing,
        }
    }

    /// The batch counts; version 1 did not carry them.
    pub fn batch(&self) -> Option<&BatchCounts> {
        match self {
            Self::V1(_) => None,
            Self::V2(e) => Some(&e.batch),
        }
    }
}
