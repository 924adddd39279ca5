//! The explicit backward pass is the gradient of the forward pass, for every parameter
//! tensor of both architectures; training drives a tiny model's loss towards zero.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use arl_model::config::{Architecture, ModelConfig, RopeScaling, YarnRopeScaling};
use arl_model::model::Model;
use arl_model::train::{Activations, AdamW};
use arl_model::weights::Weights;

fn tiny(architecture: Architecture) -> ModelConfig {
    ModelConfig {
        architecture,
        vocab_size: 40,
        hidden_size: 16,
        intermediate_size: 24,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        rope_scaling: None,
        max_position_embeddings: 64,
        tie_word_embeddings: architecture == Architecture::Llama,
    }
}

// No sequence starts with a repeated token: with RoPE alone, positions 0 and 1 of
// "x x …" have identical states, so their different next tokens could not both be learned.
const SEQUENCES: [&[u32]; 2] = [&[1, 5, 9, 2, 33, 7, 7], &[3, 11, 18, 39, 0]];

/// L = Σ a·logprob + Σ b·entropy with fixed, uneven coefficients.
fn loss(model: &Model) -> (f64, Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let (pass, logprobs) = model.forward_train(&SEQUENCES);
    let entropies = pass.entropies();
    let a: Vec<Vec<f32>> = logprobs
        .iter()
        .enumerate()
        .map(|(s, r)| (0..r.len()).map(|t| 0.3 + 0.1 * (s + t) as f32).collect())
        .collect();
    let b: Vec<Vec<f32>> = logprobs
        .iter()
        .enumerate()
        .map(|(s, r)| {
            (0..r.len())
                .map(|t| 0.05 * (1 + s * 2 + t) as f32)
                .collect()
        })
        .collect();
    let value: f64 = logprobs
        .iter()
        .flatten()
        .zip(a.iter().flatten())
        .map(|(l, a)| f64::from(l * a))
        .sum::<f64>()
        + entropies
            .iter()
            .flatten()
            .zip(b.iter().flatten())
            .map(|(h, b)| f64::from(h * b))
            .sum::<f64>();
    (value, a, b)
}

/// Qwen3 with a head size of its own (6: q is 24 wide in a 16-wide model).
fn tiny_qwen3() -> ModelConfig {
    ModelConfig {
        tie_word_embeddings: false,
        ..tiny(Architecture::Qwen3 { head_dim: 6 })
    }
}

/// YaRN with an attention factor (mscale 1 + 0.1·ln 4): RoPE that is not a pure rotation.
fn yarn(config: ModelConfig) -> ModelConfig {
    ModelConfig {
        rope_scaling: Some(RopeScaling::Yarn(YarnRopeScaling {
            factor: 4.0,
            original_max_position_embeddings: 4.0,
            attention_factor: None,
            mscale: None,
            mscale_all_dim: None,
            beta_fast: None,
            beta_slow: None,
            truncate: None,
        })),
        ..config
    }
}

fn check_gradients(config: ModelConfig) {
    let architecture = config.architecture;
    let mut model = Model::new(config.clone(), Weights::random(&config, 7, 0.4));
    let (_, a, b) = loss(&model);
    let (pass, _) = model.forward_train(&SEQUENCES);
    let mut grads = model.weights().zeros_like();
    model.backward(&pass, &a, &b, &mut grads);

    let names: Vec<String> = model
        .weights()
        .named()
        .iter()
        .map(|(n, _)| n.clone())
        .collect();
    let analytic: Vec<Vec<f32>> = grads.named().iter().map(|(_, t)| t.data.clone()).collect();
    let eps = 1e-2f32;
    let mut worst = 0.0f64;
    for (p, name) in names.iter().enumerate() {
        let len = model.weights().named()[p].1.len();
        // A handful of elements per tensor, spread over it.
        for k in 0..6usize {
            let index = (k * 7919 + 13) % len;
            let original = model.weights().named()[p].1.data[index];
            let mut at = |value: f32| {
                model.weights_mut().named_mut()[p].1.data[index] = value;
                loss(&model).0
            };
            let numeric = (at(original + eps) - at(original - eps)) / (2.0 * f64::from(eps));
            model.weights_mut().named_mut()[p].1.data[index] = original;
            let exact = f64::from(analytic[p][index]);
            let error = (numeric - exact).abs() / (numeric.abs() + exact.abs()).max(1e-2);
            worst = worst.max(error);
            assert!(
                error < 2e-2,
                "{architecture:?} {name}[{index}]: numeric {numeric:.6} vs analytic {exact:.6}"
            );
        }
    }
    eprintln!(
        "{architecture:?}: worst relative gradient error {worst:.2e} over {} tensors",
        names.len()
    );
}

#[test]
fn gradients_match_finite_differences_llama() {
    check_gradients(tiny(Architecture::Llama));
}

#[test]
fn gradients_match_finite_differences_qwen2() {
    check_gradients(tiny(Architecture::Qwen2));
}

/// The backward of Qwen3's per-head q/k norms (their weights and the projections under
/// them) with head_dim ≠ hidden_size / num_attention_heads.
#[test]
fn gradients_match_finite_differences_qwen3() {
    let config = tiny_qwen3();
    assert_ne!(config.q_dim(), config.hidden_size);
    check_gradients(config);
}

/// The backward of YaRN's attention factor (a scaled rotation), on Qwen3 and Llama.
#[test]
fn gradients_match_finite_differences_with_yarn_rope() {
    let config = yarn(tiny_qwen3());
    assert!(config.rope_attention_factor() > 1.1);
    check_gradients(config);
    check_gradients(yarn(tiny(Architecture::Llama)));
}

#[test]
fn training_overfits_a_tiny_batch() {
    let config = tiny(Architecture::Qwen2);
    let mut model = Model::new(config.clone(), Weights::random(&config, 3, 0.3));
    let mut optimizer = AdamW::new(&model, 0.0);
    let mean_nll = |model: &Model| {
        let (_, lp) = model.forward_train(&SEQUENCES);
        -lp.iter().flatten().map(|v| f64::from(*v)).sum::<f64>()
            / lp.iter().map(Vec::len).sum::<usize>() as f64
    };
    let start = mean_nll(&model);
    let steps = 400;
    for step in 0..steps {
        let (pass, lp) = model.forward_train(&SEQUENCES);
        let count = lp.iter().map(Vec::len).sum::<usize>() as f32;
        let d: Vec<Vec<f32>> = lp.iter().map(|r| vec![-1.0 / count; r.len()]).collect();
        let mut grads = model.weights().zeros_like();
        model.backward(&pass, &d, &[], &mut grads);
        assert!(model.grad_norm(&grads).is_finite());
        // Linear decay, so the last steps settle instead of bouncing.
        let lr = 1e-2 * (1.0 - step as f32 / steps as f32) + 1e-4;
        optimizer.update(&mut model, &grads, lr);
    }
    let end = mean_nll(&model);
    assert!(end < 0.05, "loss {start:.3} → {end:.4}");
}

/// A masked pass scores only the marked tokens: there it agrees with the full pass, its
/// other predictions are 0, and its gradients equal the full pass's with zero upstream
/// gradient on the unmarked rows.
#[test]
fn a_masked_pass_scores_only_marked_tokens_with_the_same_gradients() {
    for config in [
        tiny(Architecture::Llama),
        tiny(Architecture::Qwen2),
        tiny_qwen3(),
    ] {
        let architecture = config.architecture;
        let model = Model::new(config.clone(), Weights::random(&config, 11, 0.4));
        // Token-aligned masks, as a trajectory's loss mask: a response after a prompt; the
        // second sequence has nothing to score.
        let masks: [&[u8]; 2] = [&[0, 0, 0, 1, 1, 0, 1], &[0, 0, 0, 0, 0]];
        let (full_pass, full) = model.forward_train(&SEQUENCES);
        let (pass, masked) = model.forward_train_masked(&SEQUENCES, &masks);
        let (full_entropy, entropy) = (full_pass.entropies(), pass.entropies());
        let mut d: Vec<Vec<f32>> = Vec::new();
        for (s, mask) in masks.iter().enumerate() {
            let mut ds = Vec::new();
            for t in 0..full[s].len() {
                if mask[t + 1] == 1 {
                    assert!(
                        (masked[s][t] - full[s][t]).abs() < 1e-5,
                        "{architecture:?} [{s}][{t}]"
                    );
                    assert!((entropy[s][t] - full_entropy[s][t]).abs() < 1e-5);
                } else {
                    assert_eq!((masked[s][t], entropy[s][t]), (0.0, 0.0));
                }
                ds.push(if mask[t + 1] == 1 {
                    0.5 - 0.1 * t as f32
                } else {
                    0.0
                });
            }
            d.push(ds);
        }
        let (mut want, mut got) = (model.weights().zeros_like(), model.weights().zeros_like());
        model.backward(&full_pass, &d, &d, &mut want);
        model.backward(&pass, &d, &d, &mut got);
        for ((name, w), (_, g)) in want.named().iter().zip(got.named()) {
            for (a, b) in w.data.iter().zip(&g.data) {
                assert!((a - b).abs() < 1e-5, "{architecture:?} {name}: {a} vs {b}");
            }
        }
    }
}

/// Activation checkpointing keeps one tensor per layer and runs each layer again in the
/// backward: the log-probabilities are bit for bit, and every gradient to the rounding of
/// the CPU's parallel sums (whose order varies from run to run), those of a pass that kept
/// everything.
#[test]
fn recomputed_activations_give_the_same_gradients() {
    for config in [
        tiny(Architecture::Llama),
        tiny(Architecture::Qwen2),
        tiny_qwen3(),
    ] {
        let architecture = config.architecture;
        let model = Model::new(config.clone(), Weights::random(&config, 12, 0.4));
        let masks: [&[u8]; 2] = [&[0, 0, 1, 1, 1, 1, 1], &[0, 1, 1, 1, 1]];
        let (kept, want_lp) = model.forward_train_with(&SEQUENCES, Some(&masks), Activations::Keep);
        let (recomputed, got_lp) =
            model.forward_train_with(&SEQUENCES, Some(&masks), Activations::Recompute);
        assert_eq!(got_lp, want_lp, "{architecture:?} log-probabilities");
        let d: Vec<Vec<f32>> = want_lp
            .iter()
            .map(|r| (0..r.len()).map(|t| 0.2 + 0.05 * t as f32).collect())
            .collect();
        let (mut want, mut got) = (model.weights().zeros_like(), model.weights().zeros_like());
        model.backward(&kept, &d, &d, &mut want);
        model.backward(&recomputed, &d, &d, &mut got);
        for ((name, w), (_, g)) in want.named().iter().zip(got.named()) {
            for (a, b) in w.data.iter().zip(&g.data) {
                assert!(
                    (a - b).abs() <= 1e-6 * a.abs().max(1.0),
                    "{architecture:?} {name}: {a} vs {b}"
                );
            }
        }
    }
}
