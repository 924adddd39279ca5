//! Assembling one step's batch from trajectories: `train_batch_size` tasks × `n` trials.
//! Pure: the service feeds trajectories in and takes samples out when the batch is whole.

use std::collections::BTreeMap;

use arl_schemas::TaskId;
use arl_schemas::events::{SampleStatus, TrajectoryV1};

use crate::step::Sample;

/// What became of one trajectory offered to a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    /// New: part of the batch.
    Added,
    /// A later attempt of a trial already here: replaces it.
    Replaced,
    /// The same or an older attempt than the one held: nothing to do.
    Duplicate,
}

/// The trajectories of one training step, keyed by (task, sample index).
#[derive(Debug, Default)]
pub struct StepBatch {
    pub step: u32,
    trajectories: BTreeMap<(TaskId, u32), TrajectoryV1>,
}

/// Samples of a whole batch plus what the step reports about them.
#[derive(Debug, Default)]
pub struct Assembled {
    pub samples: Vec<Sample>,
    pub trajectories: usize,
    /// Kept out of the loss: masked by the failure policy, or too stale.
    pub masked: usize,
    pub stale: usize,
    pub num_turns_mean: f64,
    pub tool_calls_mean: f64,
    /// Completion tokens the rollout masked as unproven (no logprobs, or no known
    /// serving policy version), over every trajectory of the batch.
    pub unproven_tokens: usize,
}

impl StepBatch {
    pub fn new(step: u32) -> Self {
        Self {
            step,
            trajectories: BTreeMap::new(),
        }
    }

    pub fn offer(&mut self, trajectory: TrajectoryV1) -> Admission {
        let key = (
            trajectory.slot.task_id.clone(),
            trajectory.slot.sample_index,
        );
        match self.trajectories.get(&key) {
            Some(held) if held.slot.attempt >= trajectory.slot.attempt => Admission::Duplicate,
            Some(_) => {
                self.trajectories.insert(key, trajectory);
                Admission::Replaced
            }
            None => {
                self.trajectories.insert(key, trajectory);
                Admission::Added
            }
        }
    }

    pub fn len(&self) -> usize {
        self.trajectories.len()
    }

    pub fn is_empty(&self) -> bool {
        self.trajectories.is_empty()
    }

    /// Training samples: every branch of every scored trajectory, grouped by task.
    /// A trajectory whose oldest call's policy is more than `max_staleness` versions
    /// behind `policy_version` is left out.
    pub fn assemble(&self, policy_version: u64, max_staleness: u32) -> Assembled {
        self.assemble_without(policy_version, max_staleness, &[])
    }

    /// The tasks of the batch (one group each).
    pub fn tasks(&self) -> Vec<TaskId> {
        let mut tasks: Vec<TaskId> = self.trajectories.keys().map(|(t, _)| t.clone()).collect();
        tasks.dedup();
        tasks
    }

    /// [`StepBatch::assemble`], leaving out every trajectory of the `failed` groups (the
    /// rollout's `fail_group` policy).
    pub fn assemble_without(
        &self,
        policy_version: u64,
        max_staleness: u32,
        failed: &[TaskId],
    ) -> Assembled {
        let mut out = Assembled {
            trajectories: self.trajectories.len(),
            ..Assembled::default()
        };
        let mut groups: BTreeMap<&TaskId, u64> = BTreeMap::new();
        let (mut turns, mut tool_calls) = (0u64, 0u64);
        for ((task, _), trajectory) in &self.trajectories {
            turns += u64::from(trajectory.num_turns);
            tool_calls += u64::from(trajectory.tool_calls);
            out.unproven_tokens += trajectory.unproven_tokens as usize;
            let next_group = groups.len() as u64;
            let group = *groups.entry(task).or_insert(next_group);
            if trajectory.status == SampleStatus::Masked || failed.contains(task) {
                out.masked += 1;
                continue;
            }
            let oldest = trajectory.calls.iter().map(|c| c.policy_version).min();
            if oldest.is_some_and(|v| v + u64::from(max_staleness) < policy_version) {
                out.stale += 1;
                continue;
            }
            for branch in &trajectory.branches {
                if branch.token_ids.len() < 2 || !branch.loss_mask.contains(&1) {
                    continue;
                }
                out.samples.push(Sample {
                    group,
                    tokens: branch.token_ids.clone(),
                    loss_mask: branch.loss_mask.clone(),
                    rollout_logprobs: branch.logprobs.clone(),
                    reward: trajectory.reward,
                });
            }
        }
        let mean = |total: u64| total as f64 / self.trajectories.len().max(1) as f64;
        out.num_turns_mean = mean(turns);
        out.tool_calls_mean = mean(tool_calls);
        out
    }
}

/// A trajectory the trainer can never use (it is dead-lettered with this).
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum InvalidTrajectory {
    #[error(
        "branch {branch}: token_ids ({tokens}), loss_mask ({mask}) and logprobs ({logprobs}) must have the same length"
    )]
    Lengths {
        branch: usize,
        tokens: usize,
        mask: usize,
        logprobs: usize,
    },
    #[error("branch {0}: loss_mask values must be 0 or 1")]
    Mask(usize),
    #[error("branch {0}: logprobs must be finite and <= 0 (log-probabilities)")]
    Logprobs(usize),
    #[error("reward must be finite, got {0}")]
    Reward(f64),
}

/// Checks a trajectory's arrays line up.
pub fn validate(trajectory: &TrajectoryV1) -> Result<(), InvalidTrajectory> {
    for (i, b) in trajectory.branches.iter().enumerate() {
        if b.loss_mask.len() != b.token_ids.len() || b.logprobs.len() != b.token_ids.len() {
            return Err(InvalidTrajectory::Lengths {
                branch: i,
                tokens: b.token_ids.len(),
                mask: b.loss_mask.len(),
                logprobs: b.logprobs.len(),
            });
        }
        if b.loss_mask.iter().any(|m| *m > 1) {
            return Err(InvalidTrajectory::Mask(i));
        }
        if b.logprobs.iter().any(|l| !l.is_finite() || *l > 0.0) {
            return Err(InvalidTrajectory::Logprobs(i));
        }
    }
    if !trajectory.reward.is_finite() {
        return Err(InvalidTrajectory::Reward(trajectory.reward));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use arl_schemas::events::{CallSpan, Example};

    use super::*;

    fn trajectory(task: &str, sample: u32, attempt: u32, reward: f64) -> TrajectoryV1 {
        let mut t = TrajectoryV1::example();
        t.slot.task_id = TaskId::new(task).unwrap();
        t.slot.sample_index = sample;
        t.slot.attempt = attempt;
        t.reward = reward;
        t
    }

    #[test]
    fn duplicates_and_retries_are_resolved_by_attempt() {
        let mut batch = StepBatch::new(1);
        assert_eq!(batch.offer(trajectory("a", 0, 0, 0.0)), Admission::Added);
        assert_eq!(
            batch.offer(trajectory("a", 0, 0, 0.0)),
            Admission::Duplicate
        );
        assert_eq!(batch.offer(trajectory("a", 0, 1, 1.0)), Admission::Replaced);
        assert_eq!(
            batch.offer(trajectory("a", 0, 0, 0.0)),
            Admission::Duplicate
        );
        assert_eq!(batch.offer(trajectory("a", 1, 0, 0.0)), Admission::Added);
        assert_eq!(batch.len(), 2);
        let assembled = batch.assemble(1, 0);
        assert_eq!(assembled.samples.len(), 2);
        assert_eq!(assembled.samples[0].reward, 1.0);
    }

    #[test]
    fn groups_follow_tasks_and_masked_or_stale_samples_stay_out() {
        let mut batch = StepBatch::new(3);
        batch.offer(trajectory("a", 0, 0, 1.0));
        batch.offer(trajectory("b", 0, 0, 0.0));
        batch.offer(trajectory("a", 1, 0, 0.0));
        let mut masked = trajectory("b", 1, 0, 0.0);
        masked.status = SampleStatus::Masked;
        batch.offer(masked);
        let mut stale = trajectory("b", 2, 0, 1.0);
        stale.calls = vec![CallSpan {
            policy_version: 0,
            ..stale.calls[0].clone()
        }];
        batch.offer(stale);
        // Policy 2, staleness 1: version 1 is fine, version 0 is too old.
        let assembled = batch.assemble(2, 1);
        assert_eq!((assembled.masked, assembled.stale), (1, 1));
        let groups: Vec<u64> = assembled.samples.iter().map(|s| s.group).collect();
        assert_eq!(groups, vec![0, 0, 1]);
        // Staleness 2 lets the old one in.
        assert_eq!(batch.assemble(2, 2).stale, 0);
        let failed = batch.tasks();
        let none = batch.assemble_without(2, 2, &failed);
        assert!(none.samples.is_empty(), "a failed group trains nothing");
        assert_eq!(none.masked, none.trajectories);
    }

    #[test]
    fn misaligned_trajectories_are_refused_with_the_reason() {
        let mut t = trajectory("a", 0, 0, 1.0);
        t.branches[0].loss_mask.pop();
        let reason = validate(&t).unwrap_err();
        assert!(
            matches!(reason, InvalidTrajectory::Lengths { branch: 0, .. }),
            "{reason:?}"
        );
        assert!(reason.to_string().contains("same length"), "{reason}");
        let mut t = trajectory("a", 0, 0, 1.0);
        t.branches[0].logprobs[4] = 0.5;
        assert_eq!(validate(&t), Err(InvalidTrajectory::Logprobs(0)));
        assert!(InvalidTrajectory::Logprobs(0).to_string().contains("<= 0"));
        assert!(validate(&trajectory("a", 0, 0, 1.0)).is_ok());
    }
}
