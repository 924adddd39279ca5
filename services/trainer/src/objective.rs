//! The GRPO objective, token by token, with the gradient of the loss with respect to each
//! token's log-probability under the current policy (what `Model::backward` consumes).
//! Names and formulas follow VeRL (`core_algos.py`) so results can be compared.

use arl_schemas::spec::AdvEstimator;

/// Group-relative advantages of the `n` trials of one task.
/// - GRPO: (r − mean) / (std + ε), std unbiased (n − 1), as VeRL;
/// - Dr.GRPO: r − mean (no std scaling);
/// - RLOO: r − mean of the other trials = n/(n−1) · (r − mean).
///
/// A group of one has nothing to compare with: advantage 0.
pub fn advantages(estimator: AdvEstimator, rewards: &[f64]) -> Vec<f64> {
    let n = rewards.len();
    if n < 2 {
        return vec![0.0; n];
    }
    let mean = rewards.iter().sum::<f64>() / n as f64;
    match estimator {
        AdvEstimator::Grpo => {
            let var = rewards.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
            let std = var.sqrt();
            rewards.iter().map(|r| (r - mean) / (std + 1e-6)).collect()
        }
        AdvEstimator::DrGrpo => rewards.iter().map(|r| r - mean).collect(),
        AdvEstimator::Rloo => rewards
            .iter()
            .map(|r| (r - mean) * n as f64 / (n - 1) as f64)
            .collect(),
    }
}

/// True when every reward of the group is the same (dynamic sampling drops such groups:
/// they carry no signal).
pub fn is_flat(rewards: &[f64]) -> bool {
    rewards.windows(2).all(|w| (w[0] - w[1]).abs() < 1e-12)
}

/// PPO clipping settings (VeRL `clip_ratio_low/high`, dual clip `clip_ratio_c`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Clip {
    pub low: f64,
    pub high: f64,
    /// Dual clip: for negative advantages the loss is capped at −A·c (c > 1); None = off.
    pub dual: Option<f64>,
}

/// One token's clipped policy-gradient loss and its derivative.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TokenLoss {
    pub loss: f64,
    /// ∂loss/∂logp (current policy).
    pub grad: f64,
    /// True when the clipped branch was active (for the clip fraction metric).
    pub clipped: bool,
}

/// −A·ratio, clipped as PPO does, with ratio = exp(logp − old_logp):
/// loss = max(−A·r, −A·clip(r, 1−low, 1+high)); with dual clip and A < 0,
/// loss = min(that, −A·c).
pub fn clipped_policy_loss(logp: f64, old_logp: f64, advantage: f64, clip: Clip) -> TokenLoss {
    let ratio = (logp - old_logp).exp();
    let unclipped = -advantage * ratio;
    let bounded = ratio.clamp(1.0 - clip.low, 1.0 + clip.high);
    let clipped_loss = -advantage * bounded;
    // d(−A·r)/dlogp = −A·r; the clipped branch is flat where the clamp is active.
    let (mut loss, mut grad, mut clipped) = if clipped_loss > unclipped {
        let flat = bounded != ratio;
        (
            clipped_loss,
            if flat { 0.0 } else { -advantage * ratio },
            flat,
        )
    } else {
        (unclipped, -advantage * ratio, false)
    };
    if let Some(c) = clip.dual
        && advantage < 0.0
    {
        let cap = -advantage * c;
        if cap < loss {
            loss = cap;
            grad = 0.0;
            clipped = true;
        }
    }
    TokenLoss {
        loss,
        grad,
        clipped,
    }
}

/// Estimators of KL(π‖π_ref) per token (VeRL `kl_penalty`), with ∂/∂logp.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KlEstimator {
    /// logp − ref
    K1,
    /// ½(logp − ref)²
    K2,
    /// exp(ref − logp) − (ref − logp) − 1, clamped to [−10, 10] (Schulman's k3).
    LowVarKl,
}

pub fn kl(estimator: KlEstimator, logp: f64, ref_logp: f64) -> (f64, f64) {
    let d = logp - ref_logp;
    match estimator {
        KlEstimator::K1 => (d, 1.0),
        KlEstimator::K2 => (0.5 * d * d, d),
        KlEstimator::LowVarKl => {
            let value = (-d).exp() + d - 1.0;
            if value > 10.0 {
                (10.0, 0.0)
            } else {
                (value, 1.0 - (-d).exp())
            }
        }
    }
}

/// Truncated importance weight of a stale sample: min(π_old / π_rollout, cap), where
/// π_old is the trainer's recomputation and π_rollout what the engine sampled with.
pub fn truncated_is_weight(old_logp: f64, rollout_logp: f64, cap: f64) -> f64 {
    (old_logp - rollout_logp).exp().min(cap)
}

/// How token losses are reduced to one number (VeRL `loss_agg_mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LossAggregation {
    /// Σ loss / Σ mask over the whole batch.
    TokenMean,
    /// Mean over sequences of Σ loss (Dr.GRPO: no length normalization).
    SeqMeanTokenSum,
    /// Mean over sequences of (Σ loss / sequence length).
    SeqMeanTokenMean,
}

/// The weight of each token's loss in the aggregate, so that aggregate = Σ weight·loss
/// (and the gradient of a token is weight·∂loss). `lengths` are masked-token counts.
pub fn token_weights(aggregation: LossAggregation, lengths: &[usize]) -> Vec<f64> {
    let sequences = lengths.iter().filter(|l| **l > 0).count().max(1) as f64;
    let total: usize = lengths.iter().sum();
    lengths
        .iter()
        .map(|&len| match aggregation {
            _ if len == 0 => 0.0,
            LossAggregation::TokenMean => 1.0 / total as f64,
            LossAggregation::SeqMeanTokenSum => 1.0 / sequences,
            LossAggregation::SeqMeanTokenMean => 1.0 / (sequences * len as f64),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-6
    }

    #[test]
    fn advantages_by_hand() {
        let rewards = [1.0, 0.0, 0.0, 1.0];
        // mean 0.5, unbiased std sqrt(1/3) = 0.57735
        let grpo = advantages(AdvEstimator::Grpo, &rewards);
        assert!(close(grpo[0], 0.5 / (0.577_350_27 + 1e-6)), "{grpo:?}");
        assert!(close(grpo[1], -0.5 / (0.577_350_27 + 1e-6)));
        assert_eq!(
            advantages(AdvEstimator::DrGrpo, &rewards),
            vec![0.5, -0.5, -0.5, 0.5]
        );
        // RLOO: 1 − mean(0, 0, 1) = 2/3
        let rloo = advantages(AdvEstimator::Rloo, &rewards);
        assert!(
            close(rloo[0], 2.0 / 3.0) && close(rloo[1], -2.0 / 3.0),
            "{rloo:?}"
        );
        assert_eq!(
            advantages(AdvEstimator::Grpo, &[0.0, 0.0, 0.0]),
            vec![0.0; 3]
        );
        assert_eq!(advantages(AdvEstimator::Grpo, &[1.0]), vec![0.0]);
        assert!(is_flat(&[1.0, 1.0]) && !is_flat(&[1.0, 0.0]));
    }

    const CLIP: Clip = Clip {
        low: 0.2,
        high: 0.28,
        dual: Some(3.0),
    };

    #[test]
    fn clipped_loss_by_hand() {
        // On-policy: ratio 1, loss −A, gradient −A.
        let t = clipped_policy_loss(-1.0, -1.0, 2.0, CLIP);
        assert!(close(t.loss, -2.0) && close(t.grad, -2.0) && !t.clipped);
        // A > 0 and ratio above 1 + high: clipped, flat.
        let ratio: f64 = 1.5;
        let t = clipped_policy_loss(ratio.ln(), 0.0, 1.0, CLIP);
        assert!(close(t.loss, -1.28) && t.grad == 0.0 && t.clipped);
        // A > 0 and ratio below 1 − low: the unclipped branch is the max, gradient flows.
        let t = clipped_policy_loss(0.5f64.ln(), 0.0, 1.0, CLIP);
        assert!(close(t.loss, -0.5) && close(t.grad, -0.5) && !t.clipped);
        // A < 0 and ratio below 1 − low: clipped at 0.8, flat.
        let t = clipped_policy_loss(0.5f64.ln(), 0.0, -1.0, CLIP);
        assert!(close(t.loss, 0.8) && t.grad == 0.0 && t.clipped);
        // A < 0 and a huge ratio: dual clip caps the loss at −A·3.
        let t = clipped_policy_loss(5.0f64.ln(), 0.0, -1.0, CLIP);
        assert!(close(t.loss, 3.0) && t.grad == 0.0 && t.clipped);
        // Without dual clip the same token costs 5.
        let t = clipped_policy_loss(5.0f64.ln(), 0.0, -1.0, Clip { dual: None, ..CLIP });
        assert!(close(t.loss, 5.0) && close(t.grad, 5.0));
    }

    #[test]
    fn gradients_match_finite_differences() {
        let h = 1e-6;
        for &(logp, old, adv) in &[
            (-1.2, -1.0, 0.7),
            (-0.9, -1.0, -0.4),
            (-2.0, -2.1, 1.3),
            (-0.3, -0.2, -2.0),
        ] {
            let g = clipped_policy_loss(logp, old, adv, CLIP).grad;
            let numeric = (clipped_policy_loss(logp + h, old, adv, CLIP).loss
                - clipped_policy_loss(logp - h, old, adv, CLIP).loss)
                / (2.0 * h);
            assert!(
                (g - numeric).abs() < 1e-5,
                "{logp} {old} {adv}: {g} vs {numeric}"
            );
            for estimator in [KlEstimator::K1, KlEstimator::K2, KlEstimator::LowVarKl] {
                let (_, g) = kl(estimator, logp, old);
                let numeric =
                    (kl(estimator, logp + h, old).0 - kl(estimator, logp - h, old).0) / (2.0 * h);
                assert!((g - numeric).abs() < 1e-5, "{estimator:?}");
            }
        }
    }

    #[test]
    fn kl_by_hand() {
        assert!(close(kl(KlEstimator::K1, -1.0, -1.5).0, 0.5));
        assert!(close(kl(KlEstimator::K2, -1.0, -1.5).0, 0.125));
        // k3 with d = 0.5: e^{-0.5} + 0.5 − 1
        assert!(close(
            kl(KlEstimator::LowVarKl, -1.0, -1.5).0,
            (-0.5f64).exp() - 0.5
        ));
        assert!(close(kl(KlEstimator::LowVarKl, -1.0, -1.0).0, 0.0));
        assert_eq!(kl(KlEstimator::LowVarKl, -20.0, 0.0).0, 10.0);
    }

    #[test]
    fn importance_weights_are_truncated() {
        assert!(close(truncated_is_weight(-1.0, -1.0, 2.0), 1.0));
        assert!(close(truncated_is_weight(-1.0, -1.5, 2.0), 0.5f64.exp()));
        assert_eq!(truncated_is_weight(0.0, -5.0, 2.0), 2.0);
    }

    #[test]
    fn aggregation_weights_by_hand() {
        let lengths = [2, 4, 0];
        assert_eq!(
            token_weights(LossAggregation::TokenMean, &lengths),
            vec![1.0 / 6.0, 1.0 / 6.0, 0.0]
        );
        assert_eq!(
            token_weights(LossAggregation::SeqMeanTokenSum, &lengths),
            vec![0.5, 0.5, 0.0]
        );
        assert_eq!(
            token_weights(LossAggregation::SeqMeanTokenMean, &lengths),
            vec![0.25, 0.125, 0.0]
        );
    }
}
