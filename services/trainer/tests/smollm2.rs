//! One GRPO step on real trajectories sampled from SmolLM2-135M-Instruct: a finite loss, a
//! nonzero gradient when rewards differ, and a Hugging Face checkpoint that loads back with
//! the updated weights.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use arl_model::chat::ChatMessage;
use arl_model::generate::{Sampling, generate};
use arl_model::load::LoadedModel;
use arl_model::train::AdamW;
use arl_testkit::smollm2;
use arl_trainer::step::{Sample, StepConfig, train_step};

#[test]
fn one_step_on_real_smollm2_trajectories() {
    let mut loaded = LoadedModel::open(&smollm2()).unwrap();
    let template = loaded.chat_template.as_ref().unwrap();
    let prompt_text = template
        .render(
            &[ChatMessage::new("user", "Name a prime number.")],
            None,
            true,
        )
        .unwrap();
    let prompt = loaded.tokenizer.encode(&prompt_text).unwrap();
    let mut samples = Vec::new();
    for i in 0..4u64 {
        let sampling = Sampling {
            temperature: 1.0,
            seed: i + 1,
            ..Sampling::default()
        };
        let (response, logprobs) = generate(
            &loaded.model,
            &prompt,
            12,
            loaded.tokenizer.stop_ids(),
            &sampling,
        );
        let text = loaded.tokenizer.decode(&response, true).unwrap();
        // Rewards differ across the group: pay for answers that mention a 7.
        let reward = if text.contains('7') || i % 2 == 0 {
            1.0
        } else {
            0.0
        };
        let mut tokens = prompt.clone();
        tokens.extend(&response);
        let mut rollout_logprobs = vec![0.0; prompt.len()];
        rollout_logprobs.extend(&logprobs);
        let mut loss_mask = vec![0; prompt.len()];
        loss_mask.extend(vec![1; response.len()]);
        samples.push(Sample {
            group: 0,
            tokens,
            loss_mask,
            rollout_logprobs,
            reward,
        });
    }
    let before = loaded.model.forward_train(&[&samples[0].tokens]).1;
    let mut optimizer = AdamW::new(&loaded.model, 0.01);
    let metrics = train_step(
        &mut loaded.model,
        None,
        &mut optimizer,
        &samples,
        &StepConfig::default(),
        1e-5,
    );
    assert!(metrics.pg_loss.is_finite(), "{metrics:?}");
    assert!(
        metrics.grad_norm.is_finite() && metrics.grad_norm > 0.0,
        "{metrics:?}"
    );
    assert!(metrics.trained_tokens > 0);
    // On-policy, recomputed: ratios start at 1, so nothing is clipped in the first update.
    assert_eq!(metrics.clip_fraction, 0.0);

    let dir = tempfile::tempdir().unwrap();
    loaded.save_hf(dir.path()).unwrap();
    let reloaded = LoadedModel::open(dir.path()).unwrap();
    let after = reloaded.model.forward_train(&[&samples[0].tokens]).1;
    let moved = before[0]
        .iter()
        .zip(&after[0])
        .any(|(a, b)| (a - b).abs() > 1e-6);
    assert!(
        moved,
        "the checkpoint holds the weights from before the step"
    );
    let greedy = generate(
        &reloaded.model,
        &prompt,
        8,
        reloaded.tokenizer.stop_ids(),
        &Sampling::default(),
    )
    .0;
    assert!(!greedy.is_empty());
}
