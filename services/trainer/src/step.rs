//! One GRPO step on the model core: advantages per group, old (and reference)
//! log-probabilities, then `epochs` passes over `mini_batches` mini-batches, each split into
//! micro-batches by a token budget whose gradients add up before one AdamW update.
//!
//! Alignment: `Model::forward_train` returns, for a sequence of T tokens, T−1
//! log-probabilities — index t scores token t+1. A sample's `loss_mask[t+1]` and
//! `rollout_logprobs[t+1]` belong to that prediction.

use std::collections::BTreeMap;

use arl_model::backend::Backend;
use arl_model::model::Model;
use arl_model::train::{Activations, AdamW};
use arl_schemas::spec::AdvEstimator;

use crate::objective::{self, Clip, KlEstimator, LossAggregation};

/// One trajectory branch with its reward.
#[derive(Clone, Debug)]
pub struct Sample {
    /// Samples with the same group id are the `n` trials of one task.
    pub group: u64,
    pub tokens: Vec<u32>,
    /// 1 where the token was produced by the policy and is trained on.
    pub loss_mask: Vec<u8>,
    /// The engine's log-probability of each token (0 where the mask is 0).
    pub rollout_logprobs: Vec<f32>,
    pub reward: f64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OldLogprobs {
    /// Recompute with the weights before this step (then correct staleness with TIS).
    Recompute,
    /// Trust the engine's.
    Rollout,
}

#[derive(Clone, Debug)]
pub struct StepConfig {
    pub estimator: AdvEstimator,
    pub clip: Clip,
    pub kl: Option<(KlEstimator, f64)>,
    pub entropy_coef: f64,
    pub aggregation: LossAggregation,
    pub weight_decay: f32,
    pub grad_clip: f64,
    /// Tokens per micro-batch (a sample is never split).
    pub micro_batch_tokens: usize,
    /// What the training forward keeps for the backward (recomputing saves memory).
    pub activations: Activations,
    pub mini_batches: usize,
    pub epochs: usize,
    pub old_logprobs: OldLogprobs,
    /// Truncated importance sampling cap against the rollout log-probabilities.
    pub tis_cap: Option<f64>,
    /// Drop groups whose rewards are all equal.
    pub dynamic_sampling: bool,
}

impl Default for StepConfig {
    fn default() -> Self {
        Self {
            estimator: AdvEstimator::Grpo,
            clip: Clip {
                low: 0.2,
                high: 0.2,
                dual: Some(3.0),
            },
            kl: None,
            entropy_coef: 0.0,
            aggregation: LossAggregation::TokenMean,
            weight_decay: 0.0,
            grad_clip: 1.0,
            micro_batch_tokens: 4096,
            activations: Activations::Keep,
            mini_batches: 1,
            epochs: 1,
            old_logprobs: OldLogprobs::Recompute,
            tis_cap: Some(2.0),
            dynamic_sampling: false,
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepMetrics {
    pub pg_loss: f64,
    pub kl: f64,
    /// Mean entropy, clip fraction and token count over the tokens that went through the
    /// update (samples with a zero advantage and no KL or entropy term are skipped).
    pub entropy: f64,
    pub clip_fraction: f64,
    pub grad_norm: f64,
    pub reward_mean: f64,
    pub reward_max: f64,
    pub response_length_mean: f64,
    pub trained_tokens: usize,
    /// Groups (tasks) in the batch.
    pub groups: usize,
    /// Groups whose advantages are all zero (equal rewards): they teach nothing.
    pub zero_advantage_groups: usize,
    /// Samples whose loss carries a non-zero advantage.
    pub samples_trained: usize,
    pub groups_dropped: usize,
    pub updates: usize,
    /// Time spent on old and reference log-probabilities (the rest is the update).
    pub old_logprob_seconds: f64,
}

/// Runs one step; returns its metrics. `reference` enables the KL term.
pub fn train_step<B: Backend>(
    model: &mut Model<B>,
    reference: Option<&Model<B>>,
    optimizer: &mut AdamW<B>,
    samples: &[Sample],
    config: &StepConfig,
    lr: f32,
) -> StepMetrics {
    let mut metrics = StepMetrics::default();
    if samples.is_empty() {
        return metrics;
    }
    metrics.reward_mean = samples.iter().map(|s| s.reward).sum::<f64>() / samples.len() as f64;
    metrics.reward_max = samples.iter().map(|s| s.reward).fold(f64::MIN, f64::max);
    metrics.response_length_mean = samples
        .iter()
        .map(|s| s.loss_mask.iter().filter(|m| **m == 1).count() as f64)
        .sum::<f64>()
        / samples.len() as f64;

    // Advantages per group; dynamic sampling drops groups without signal.
    let mut groups: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
    for (i, s) in samples.iter().enumerate() {
        groups.entry(s.group).or_default().push(i);
    }
    let mut advantage = vec![0f64; samples.len()];
    let mut kept = Vec::new();
    metrics.groups = groups.len();
    for members in groups.values() {
        let rewards: Vec<f64> = members.iter().map(|i| samples[*i].reward).collect();
        let advantages = objective::advantages(config.estimator, &rewards);
        let signal = advantages.iter().filter(|a| a.abs() > 1e-9).count();
        metrics.samples_trained += signal;
        if signal == 0 {
            metrics.zero_advantage_groups += 1;
        }
        if config.dynamic_sampling && objective::is_flat(&rewards) {
            metrics.groups_dropped += 1;
            continue;
        }
        for (i, a) in members.iter().zip(advantages) {
            advantage[*i] = a;
            kept.push(*i);
        }
    }
    if kept.is_empty() {
        return metrics;
    }

    // A sample with zero advantage has zero policy-gradient loss and gradient; unless a KL
    // or entropy term gives it one, its forward and backward passes are skipped (the token
    // weights below still count its tokens, so every other sample's gradient is unchanged).
    let reference = reference.filter(|_| config.kl.is_some());
    let needs_pass: Vec<bool> = kept
        .iter()
        .map(|&i| advantage[i] != 0.0 || reference.is_some() || config.entropy_coef != 0.0)
        .collect();

    let started = std::time::Instant::now();
    let old: Vec<Vec<f32>> = match config.old_logprobs {
        OldLogprobs::Recompute => logprobs_of(model, samples, &kept, &needs_pass, config),
        OldLogprobs::Rollout => kept
            .iter()
            .map(|&i| samples[i].rollout_logprobs[1..].to_vec())
            .collect(),
    };
    let reference_lp = reference.map(|r| logprobs_of(r, samples, &kept, &needs_pass, config));
    metrics.old_logprob_seconds = started.elapsed().as_secs_f64();

    let (mut loss_sum, mut kl_sum, mut entropy_sum, mut clipped, mut counted) =
        (0.0, 0.0, 0.0, 0usize, 0usize);
    let mini = config.mini_batches.clamp(1, kept.len());
    for _epoch in 0..config.epochs.max(1) {
        for m in 0..mini {
            // Mini-batch m: every mini-th kept sample (positions into `kept`).
            let batch: Vec<usize> = (m..kept.len()).step_by(mini).collect();
            let lengths: Vec<usize> = batch
                .iter()
                .map(|&k| {
                    samples[kept[k]].loss_mask[1..]
                        .iter()
                        .filter(|x| **x == 1)
                        .count()
                })
                .collect();
            let weights = objective::token_weights(config.aggregation, &lengths);
            let mut grads = model.zeros_like_weights();
            let passed: Vec<usize> = batch.iter().copied().filter(|&k| needs_pass[k]).collect();
            for micro in micro_batches(
                &passed,
                |k| samples[kept[k]].tokens.len(),
                config.micro_batch_tokens,
            ) {
                let sequences: Vec<&[u32]> = micro
                    .iter()
                    .map(|&k| &samples[kept[k]].tokens[..])
                    .collect();
                let masks: Vec<&[u8]> = micro
                    .iter()
                    .map(|&k| &samples[kept[k]].loss_mask[..])
                    .collect();
                let (pass, logprobs) =
                    model.forward_train_with(&sequences, Some(&masks), config.activations);
                let entropies = pass.entropies();
                let mut d_lp = Vec::with_capacity(micro.len());
                let mut d_h = Vec::with_capacity(micro.len());
                for (j, &k) in micro.iter().enumerate() {
                    let sample = &samples[kept[k]];
                    let w = weights[batch.iter().position(|b| *b == k).unwrap_or(0)];
                    let (mut g_lp, mut g_h) =
                        (vec![0f32; logprobs[j].len()], vec![0f32; logprobs[j].len()]);
                    for t in 0..logprobs[j].len() {
                        if sample.loss_mask[t + 1] != 1 {
                            continue;
                        }
                        let lp = f64::from(logprobs[j][t]);
                        let old_lp = f64::from(old[k][t]);
                        let is = match (config.old_logprobs, config.tis_cap) {
                            (OldLogprobs::Recompute, Some(cap)) => objective::truncated_is_weight(
                                old_lp,
                                f64::from(sample.rollout_logprobs[t + 1]),
                                cap,
                            ),
                            _ => 1.0,
                        };
                        let token = objective::clipped_policy_loss(
                            lp,
                            old_lp,
                            advantage[kept[k]],
                            config.clip,
                        );
                        let mut grad = is * token.grad;
                        loss_sum += w * is * token.loss;
                        if let (Some((estimator, coef)), Some(reference)) =
                            (config.kl, &reference_lp)
                        {
                            let (value, kl_grad) =
                                objective::kl(estimator, lp, f64::from(reference[k][t]));
                            grad += coef * kl_grad;
                            kl_sum += w * value;
                        }
                        entropy_sum += w * f64::from(entropies[j][t]);
                        g_lp[t] = (w * grad) as f32;
                        g_h[t] = (-w * config.entropy_coef) as f32;
                        clipped += usize::from(token.clipped);
                        counted += 1;
                    }
                    d_lp.push(g_lp);
                    d_h.push(g_h);
                }
                model.backward(&pass, &d_lp, &d_h, &mut grads);
            }
            let norm = f64::from(model.grad_norm(&grads));
            if norm.is_finite() && norm > config.grad_clip {
                model.scale_grads(&mut grads, (config.grad_clip / norm) as f32);
            }
            metrics.grad_norm = norm;
            optimizer.weight_decay = config.weight_decay;
            optimizer.update(model, &grads, lr);
            metrics.updates += 1;
        }
    }
    let passes = (config.epochs.max(1) * mini) as f64;
    metrics.pg_loss = loss_sum / passes;
    metrics.kl = kl_sum / passes;
    metrics.entropy = entropy_sum / passes;
    metrics.clip_fraction = if counted == 0 {
        0.0
    } else {
        clipped as f64 / counted as f64
    };
    metrics.trained_tokens = counted;
    metrics
}

/// Log-probabilities (index t scores token t+1, 0 where the loss mask is 0) of the kept
/// samples that go through a pass, without gradients; empty for the others.
fn logprobs_of<B: Backend>(
    model: &Model<B>,
    samples: &[Sample],
    kept: &[usize],
    needs_pass: &[bool],
    config: &StepConfig,
) -> Vec<Vec<f32>> {
    let positions: Vec<usize> = (0..kept.len()).filter(|&k| needs_pass[k]).collect();
    let mut out = vec![Vec::new(); kept.len()];
    let len = |k: usize| samples[kept[k]].tokens.len();
    for micro in micro_batches(&positions, len, config.micro_batch_tokens) {
        let sequences: Vec<&[u32]> = micro
            .iter()
            .map(|&k| &samples[kept[k]].tokens[..])
            .collect();
        let masks: Vec<&[u8]> = micro
            .iter()
            .map(|&k| &samples[kept[k]].loss_mask[..])
            .collect();
        // No backward follows: keep as little as the forward allows.
        let (_, logprobs) =
            model.forward_train_with(&sequences, Some(&masks), Activations::Recompute);
        for (k, lp) in micro.into_iter().zip(logprobs) {
            out[k] = lp;
        }
    }
    out
}

/// Splits items into groups whose total length stays within `budget` (an item longer than
/// the budget goes alone).
fn micro_batches(items: &[usize], len: impl Fn(usize) -> usize, budget: usize) -> Vec<Vec<usize>> {
    let mut batches = Vec::new();
    let (mut current, mut tokens) = (Vec::new(), 0);
    for &item in items {
        let l = len(item);
        if !current.is_empty() && tokens + l > budget {
            batches.push(std::mem::take(&mut current));
            tokens = 0;
        }
        current.push(item);
        tokens += l;
    }
    if !current.is_empty() {
        batches.push(current);
    }
    batches
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn micro_batches_respect_the_budget() {
        let lens = [5, 5, 5, 20, 1];
        let batches = micro_batches(&[0, 1, 2, 3, 4], |i| lens[i], 10);
        assert_eq!(batches, vec![vec![0, 1], vec![2], vec![3], vec![4]]);
    }
}
