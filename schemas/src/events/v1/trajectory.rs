//! A trial's token-level training sample, assembled from its LLM calls.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{example_run, example_trial};
use crate::events::{Example, TrialSlot, event};
use crate::{RunId, TrialId};

/// One contiguous token sequence. Calls whose prompt extends the previous prompt plus
/// completion share a branch; a divergent prompt starts a new one.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TrajectoryBranch {
    pub token_ids: Vec<u32>,
    /// 1 where the token was sampled by the policy and is trained on, 0 elsewhere.
    pub loss_mask: Vec<u8>,
    /// Rollout log-probabilities, aligned with `token_ids`; 0.0 where the mask is 0.
    pub logprobs: Vec<f32>,
}

/// Where one LLM call landed in the branches.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct CallSpan {
    pub turn_index: u32,
    pub branch: u32,
    /// Offset of the call's first completion token in the branch.
    pub completion_start: u32,
    pub completion_len: u32,
    pub policy_version: u64,
}

/// What happened to the trial's sample.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum SampleStatus {
    /// Graded; trained on with its reward.
    Scored,
    /// Kept out of the loss by the failure policy (still counted in the group).
    Masked,
    /// A failure the policy scores as zero.
    ScoredZero,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TrajectoryV1 {
    pub run_id: RunId,
    pub trial_id: TrialId,
    pub slot: TrialSlot,
    pub status: SampleStatus,
    pub reward: f64,
    pub num_turns: u32,
    pub branches: Vec<TrajectoryBranch>,
    pub calls: Vec<CallSpan>,
    /// Completion tokens masked because their origin could not be proven.
    pub unproven_tokens: u32,
    pub tool_parse_failures: u32,
    /// Tool calls the agent made in the trial (MCP tools). 0 from an older rollout.
    #[serde(default)]
    pub tool_calls: u32,
}
event!(TrajectoryV1, trajectory, "ready", 1, |e| format!(
    "trajectory.ready:{}:{}",
    e.trial_id, e.slot.attempt
));

impl Example for TrajectoryV1 {
    fn example() -> Self {
        Self {
            run_id: example_run(),
            trial_id: example_trial(),
            slot: crate::events::TrialSlot {
                task_id: super::example_task(),
                step: 1,
                split: crate::events::Split::Train,
                sample_index: 2,
                attempt: 0,
            },
            status: SampleStatus::Scored,
            reward: 1.1,
            num_turns: 1,
            branches: vec![TrajectoryBranch {
                token_ids: vec![1, 9690, 198, 28, 4301, 2],
                loss_mask: vec![0, 0, 0, 1, 1, 1],
                logprobs: vec![0.0, 0.0, 0.0, -0.12, -1.03, -0.01],
            }],
            calls: vec![CallSpan {
                turn_index: 0,
                branch: 0,
                completion_start: 3,
                completion_len: 3,
                policy_version: 1,
            }],
            unproven_tokens: 0,
            tool_parse_failures: 0,
            tool_calls: 0,
        }
    }
}
