//! Token truth: a trial's training sample built only from the engine's own token ids, as
//! the proxy recorded them. Calls are taken in turn order. A call whose prompt extends
//! the previous call's prompt plus completion continues that branch: the new prompt
//! tokens (tool output, the next user turn) go in with loss mask 0, the completion with
//! mask 1. A prompt that does not extend it (history compaction, a template that drops
//! earlier reasoning, retokenization drift) starts a new branch. Completion tokens whose
//! log-probabilities were not recorded, or whose serving policy version is not known (a
//! vLLM or SGLang the proxy does not follow, or a call that overlapped a weight update),
//! cannot be proven to come from the policy they would be trained as: they are masked and
//! counted.

use arl_schemas::events::{CallSpan, LlmCallV2, TrajectoryBranch};

/// A trial's branches and where each call landed in them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Assembled {
    pub branches: Vec<TrajectoryBranch>,
    pub calls: Vec<CallSpan>,
    /// Completion tokens masked because their origin could not be proven.
    pub unproven_tokens: u32,
}

impl Assembled {
    /// Branches beyond the first: how often the history diverged.
    pub fn divergences(&self) -> usize {
        self.branches.len().saturating_sub(1)
    }

    /// Completion tokens, trained on or not.
    pub fn completion_tokens(&self) -> u32 {
        self.calls.iter().map(|c| c.completion_len).sum()
    }
}

/// Assembles the calls of one trial (any order; sorted by turn here).
pub fn assemble(calls: &[LlmCallV2]) -> Assembled {
    let mut ordered: Vec<&LlmCallV2> = calls.iter().collect();
    ordered.sort_by_key(|c| c.turn_index);
    let mut out = Assembled::default();
    for call in ordered {
        let continues = out
            .branches
            .last()
            .is_some_and(|b| call.prompt_token_ids.starts_with(&b.token_ids));
        if !continues {
            out.branches.push(TrajectoryBranch {
                token_ids: Vec::new(),
                loss_mask: Vec::new(),
                logprobs: Vec::new(),
            });
        }
        let index = out.branches.len() - 1;
        let branch = &mut out.branches[index];
        // The prompt's new tokens: the environment's, never trained on.
        let fresh = &call.prompt_token_ids[branch.token_ids.len()..];
        branch.token_ids.extend_from_slice(fresh);
        branch
            .loss_mask
            .extend(std::iter::repeat_n(0u8, fresh.len()));
        branch
            .logprobs
            .extend(std::iter::repeat_n(0.0f32, fresh.len()));
        let start = branch.token_ids.len();
        let proven =
            call.logprobs.len() == call.completion_token_ids.len() && call.served_version.is_some();
        branch
            .token_ids
            .extend_from_slice(&call.completion_token_ids);
        if proven {
            branch
                .loss_mask
                .extend(std::iter::repeat_n(1u8, call.completion_token_ids.len()));
            branch.logprobs.extend_from_slice(&call.logprobs);
        } else {
            let n = call.completion_token_ids.len();
            branch.loss_mask.extend(std::iter::repeat_n(0u8, n));
            branch.logprobs.extend(std::iter::repeat_n(0.0f32, n));
            out.unproven_tokens += u32::try_from(n).unwrap_or(u32::MAX);
        }
        out.calls.push(CallSpan {
            turn_index: call.turn_index,
            branch: u32::try_from(index).unwrap_or(u32::MAX),
            completion_start: u32::try_from(start).unwrap_or(u32::MAX),
            completion_len: u32::try_from(call.completion_token_ids.len()).unwrap_or(u32::MAX),
            policy_version: call.policy_version,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use arl_schemas::events::Example;

    fn call(turn: u32, prompt: &[u32], completion: &[u32], version: u64) -> LlmCallV2 {
        LlmCallV2 {
            turn_index: turn,
            prompt_token_ids: prompt.to_vec(),
            completion_token_ids: completion.to_vec(),
            logprobs: completion.iter().map(|t| -(*t as f32) / 100.0).collect(),
            policy_version: version,
            ..LlmCallV2::example()
        }
    }

    #[test]
    fn append_only_calls_merge_into_one_branch_with_completions_masked_in() {
        // Turn 1: prompt [1 2 3] → [4 5]; turn 2 resends it all plus a tool result [6 7].
        let a = assemble(&[
            call(1, &[1, 2, 3, 4, 5, 6, 7], &[8, 9], 4),
            call(0, &[1, 2, 3], &[4, 5], 3),
        ]);
        assert_eq!(a.branches.len(), 1);
        let b = &a.branches[0];
        assert_eq!(b.token_ids, [1, 2, 3, 4, 5, 6, 7, 8, 9]);
        assert_eq!(b.loss_mask, [0, 0, 0, 1, 1, 0, 0, 1, 1]);
        assert_eq!(b.logprobs[3..5], [-0.04, -0.05]);
        assert_eq!(b.logprobs[5], 0.0);
        assert_eq!(
            a.calls
                .iter()
                .map(|c| (
                    c.turn_index,
                    c.branch,
                    c.completion_start,
                    c.completion_len,
                    c.policy_version
                ))
                .collect::<Vec<_>>(),
            [(0, 0, 3, 2, 3), (1, 0, 7, 2, 4)]
        );
        assert_eq!(
            (a.divergences(), a.unproven_tokens, a.completion_tokens()),
            (0, 0, 4)
        );
    }

    #[test]
    fn compaction_starts_a_new_branch() {
        // Turn 2's prompt drops the first exchange (history compaction): not an extension.
        let a = assemble(&[
            call(0, &[1, 2, 3], &[4, 5], 1),
            call(1, &[1, 2, 6, 7], &[8], 1),
        ]);
        assert_eq!(a.branches.len(), 2);
        assert_eq!(a.branches[1].token_ids, [1, 2, 6, 7, 8]);
        assert_eq!(a.branches[1].loss_mask, [0, 0, 0, 0, 1]);
        assert_eq!(a.calls[1].branch, 1);
        assert_eq!(a.divergences(), 1);
    }

    #[test]
    fn retokenization_drift_inside_a_completion_branches_instead_of_training_on_it() {
        // The client sent the completion back as text and it re-tokenized differently:
        // [4 5] became [45]. The first branch keeps the engine's tokens; the second
        // starts from the drifted prompt, whose tokens are all masked.
        let a = assemble(&[
            call(0, &[1, 2, 3], &[4, 5], 1),
            call(1, &[1, 2, 3, 45, 6], &[7], 1),
        ]);
        assert_eq!(a.branches.len(), 2);
        assert_eq!(a.branches[0].loss_mask, [0, 0, 0, 1, 1]);
        assert_eq!(a.branches[1].loss_mask, [0, 0, 0, 0, 0, 1]);
        // Never a token trained on that the engine did not produce in that position.
        for b in &a.branches {
            assert_eq!(b.token_ids.len(), b.loss_mask.len());
            assert_eq!(b.token_ids.len(), b.logprobs.len());
        }
    }

    #[test]
    fn completions_without_logprobs_are_masked_as_unproven() {
        let mut c = call(0, &[1, 2], &[3, 4, 5], 1);
        c.logprobs.clear();
        let a = assemble(&[c, call(1, &[1, 2, 3, 4, 5, 6], &[7], 1)]);
        assert_eq!(a.unproven_tokens, 3);
        assert_eq!(a.branches[0].loss_mask, [0, 0, 0, 0, 0, 0, 1]);
    }

    #[test]
    fn completions_of_an_unknown_serving_version_are_masked_as_unproven() {
        let mut unknown = call(1, &[1, 2, 3, 4, 5, 6], &[7, 8], 1);
        unknown.served_version = None;
        let a = assemble(&[call(0, &[1, 2, 3], &[4, 5], 1), unknown]);
        assert_eq!(a.unproven_tokens, 2);
        assert_eq!(a.branches[0].loss_mask, [0, 0, 0, 1, 1, 0, 0, 0]);
    }

    #[test]
    fn no_calls_no_branches() {
        assert_eq!(assemble(&[]), Assembled::default());
    }
}
