//! GRPO learns: with a reward that pays for one behaviour (the response contains token 7),
//! a few steps on a tiny model raise the probability of that behaviour — on the CPU, and on
//! the GPU where there is one (skipped with the reason elsewhere).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use arl_model::backend::Backend;
use arl_model::config::{Architecture, ModelConfig};
use arl_model::generate::{Sampling, generate};
use arl_model::model::Model;
use arl_model::train::AdamW;
use arl_model::weights::Weights;
use arl_trainer::step::{Sample, StepConfig, train_step};

const PROMPT: [u32; 2] = [1, 2];
const REWARDED: u32 = 7;

fn tiny() -> Model {
    let config = ModelConfig {
        architecture: Architecture::Qwen2,
        vocab_size: 12,
        hidden_size: 32,
        intermediate_size: 48,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        rope_scaling: None,
        max_position_embeddings: 32,
        tie_word_embeddings: false,
    };
    Model::new(config.clone(), Weights::random(&config, 11, 0.3))
}

/// How often the behaviour shows: the share of 200 fresh samples (fixed seeds) whose
/// response contains the rewarded token.
fn behaviour_rate<B: Backend>(model: &Model<B>) -> f32 {
    let hits = (0..200u64)
        .filter(|seed| {
            let sampling = Sampling {
                temperature: 1.0,
                seed: 1_000_000 + seed,
                ..Sampling::default()
            };
            generate(model, &PROMPT, 3, &[], &sampling)
                .0
                .contains(&REWARDED)
        })
        .count();
    hits as f32 / 200.0
}

fn rollouts<B: Backend>(model: &Model<B>, step: u64) -> Vec<Sample> {
    let mut samples = Vec::new();
    for group in 0..2u64 {
        for i in 0..8u64 {
            let sampling = Sampling {
                temperature: 1.0,
                seed: step * 1000 + group * 100 + i + 1,
                ..Sampling::default()
            };
            let (response, logprobs) = generate(model, &PROMPT, 3, &[], &sampling);
            let reward = if response.contains(&REWARDED) {
                1.0
            } else {
                0.0
            };
            let mut tokens = PROMPT.to_vec();
            tokens.extend(&response);
            let mut rollout_logprobs = vec![0.0; PROMPT.len()];
            rollout_logprobs.extend(&logprobs);
            let mut loss_mask = vec![0; PROMPT.len()];
            loss_mask.extend(vec![1; response.len()]);
            samples.push(Sample {
                group,
                tokens,
                loss_mask,
                rollout_logprobs,
                reward,
            });
        }
    }
    samples
}

#[test]
fn a_rewarded_behaviour_becomes_more_likely() {
    learns(tiny());
}

#[test]
fn a_rewarded_behaviour_becomes_more_likely_on_the_gpu() {
    let Some(gpu) =
        arl_model::cuda::for_tests("a_rewarded_behaviour_becomes_more_likely_on_the_gpu").unwrap()
    else {
        return;
    };
    learns(tiny().to_backend(gpu));
}

fn learns<B: Backend>(mut model: Model<B>) {
    let mut optimizer = AdamW::new(&model, 0.0);
    let config = StepConfig {
        mini_batches: 2,
        epochs: 2,
        ..StepConfig::default()
    };
    let before = behaviour_rate(&model);
    let mut first_reward = None;
    let mut last = None;
    for step in 0..15 {
        let samples = rollouts(&model, step);
        let metrics = train_step(&mut model, None, &mut optimizer, &samples, &config, 2e-2);
        assert!(
            metrics.pg_loss.is_finite() && metrics.grad_norm.is_finite(),
            "{metrics:?}"
        );
        model.backend.check().unwrap();
        first_reward.get_or_insert(metrics.reward_mean);
        last = Some(metrics);
    }
    let after = behaviour_rate(&model);
    let last = last.unwrap();
    eprintln!(
        "{}: responses with token 7: {before:.3} → {after:.3}; batch reward {:.2} → {:.2}",
        model.backend.name(),
        first_reward.unwrap(),
        last.reward_mean
    );
    assert!(
        after > before + 0.3,
        "behaviour rate {before:.3} → {after:.3}"
    );
    assert!(last.reward_mean > first_reward.unwrap());
}

#[test]
fn equal_rewards_give_no_gradient_and_dynamic_sampling_drops_them() {
    let mut model = tiny();
    let before = model.weights().clone();
    let mut optimizer = AdamW::new(&model, 0.0);
    let mut samples = rollouts(&model, 99);
    samples.iter_mut().for_each(|s| s.reward = 1.0);
    let metrics = train_step(
        &mut model,
        None,
        &mut optimizer,
        &samples,
        &StepConfig::default(),
        1e-2,
    );
    assert_eq!(metrics.grad_norm, 0.0, "{metrics:?}");
    let config = StepConfig {
        dynamic_sampling: true,
        ..StepConfig::default()
    };
    let metrics = train_step(&mut model, None, &mut optimizer, &samples, &config, 1e-2);
    assert_eq!(metrics.groups_dropped, 2);
    assert_eq!(metrics.updates, 0);
    let unchanged = model
        .weights()
        .named()
        .iter()
        .zip(before.named())
        .all(|((_, a), (_, b))| a.data == b.data);
    assert!(unchanged, "flat groups must not move the weights");
}

/// Skipping the passes of zero-advantage samples changes nothing: the same step with a
/// zero-weight KL term (which forces every sample through its passes) leaves the same
/// weights, for one group with signal beside one without.
#[test]
fn skipping_zero_advantage_samples_leaves_the_update_exact() {
    let mut samples = rollouts(&tiny(), 5);
    samples
        .iter_mut()
        .filter(|s| s.group == 1)
        .for_each(|s| s.reward = 0.0);
    samples
        .iter_mut()
        .filter(|s| s.group == 0)
        .enumerate()
        .for_each(|(i, s)| s.reward = f64::from(u8::from(i % 3 == 0)));
    let step = |kl: Option<(arl_trainer::objective::KlEstimator, f64)>| {
        let mut model = tiny();
        let reference = tiny();
        let mut optimizer = AdamW::new(&model, 0.0);
        let config = StepConfig {
            kl,
            ..StepConfig::default()
        };
        let metrics = train_step(
            &mut model,
            Some(&reference),
            &mut optimizer,
            &samples,
            &config,
            1e-2,
        );
        (model, metrics)
    };
    let (skipped, m1) = step(None);
    let (passed, m2) = step(Some((arl_trainer::objective::KlEstimator::K1, 0.0)));
    assert_eq!(m1.samples_trained, 8, "{m1:?}");
    assert!(
        (m1.grad_norm - m2.grad_norm).abs() < 1e-6 * m2.grad_norm.max(1.0),
        "{m1:?} {m2:?}"
    );
    for ((name, a), (_, b)) in skipped
        .weights()
        .named()
        .iter()
        .zip(passed.weights().named())
    {
        for (x, y) in a.data.iter().zip(&b.data) {
            assert!((x - y).abs() < 1e-6, "{name}: {x} vs {y}");
        }
    }
}
