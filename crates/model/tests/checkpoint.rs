//! A model saved in Hugging Face layout loads back identical; the training forward and the
//! cached inference forward give the same log-probabilities.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use arl_model::load::LoadedModel;
use arl_model::model::{KvCache, SeqInput};
use arl_model::ops;

fn cached_logprobs(model: &arl_model::model::Model, tokens: &[u32]) -> Vec<f32> {
    let mut cache = KvCache::new(model);
    let mut logits = model
        .forward(&mut [SeqInput {
            tokens: &tokens[..1],
            cache: &mut cache,
        }])
        .remove(0);
    let mut out = Vec::new();
    for &t in &tokens[1..] {
        let (lse, _) = ops::logsumexp_entropy(&logits);
        out.push(logits[t as usize] - lse);
        logits = model
            .forward(&mut [SeqInput {
                tokens: &[t],
                cache: &mut cache,
            }])
            .remove(0);
    }
    out
}

#[test]
fn hf_checkpoint_round_trips_and_forwards_agree() {
    let loaded = LoadedModel::open(&common::smollm2()).unwrap();
    let tokens = loaded
        .tokenizer
        .encode("<|im_start|>user\nHow do I sort a list in Python?<|im_end|>\n")
        .unwrap();

    let (_, train_lp) = loaded.model.forward_train(&[&tokens]);
    let inference_lp = cached_logprobs(&loaded.model, &tokens);
    for (a, b) in train_lp[0].iter().zip(&inference_lp) {
        assert!((a - b).abs() < 1e-3, "training {a} vs inference {b}");
    }

    let dir = tempfile::tempdir().unwrap();
    loaded.save_hf(dir.path()).unwrap();
    for file in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        assert!(dir.path().join(file).is_file(), "{file} missing");
    }
    let reloaded = LoadedModel::open(dir.path()).unwrap();
    assert_eq!(reloaded.format, "huggingface");
    assert_eq!(reloaded.model.config, loaded.model.config);
    assert_eq!(
        reloaded.tokenizer.encode("def f(x): return 42").unwrap(),
        loaded.tokenizer.encode("def f(x): return 42").unwrap()
    );
    let (_, reloaded_lp) = reloaded.model.forward_train(&[&tokens]);
    assert_eq!(reloaded_lp, train_lp, "weights changed in the round trip");
    let rendered = reloaded.chat_template.as_ref().unwrap().render(
        &[arl_model::chat::ChatMessage::new("user", "hi")],
        None,
        true,
    );
    assert!(rendered.unwrap().ends_with("<|im_start|>assistant\n"));
}

/// What a trainer hands an engine of its process (`LoadedModel::as_stored`) is what the
/// engine would load from the file the trainer wrote: the same configuration, weights bit
/// for bit (f32 as is, bf16 rounded), tokenizer, stop tokens and chat template.
#[test]
fn a_model_as_stored_is_what_its_file_loads_back() {
    use arl_model::weights::StoredDtype;
    let loaded = LoadedModel::open(&common::smollm2()).unwrap();
    let message = [arl_model::chat::ChatMessage::new("user", "hi")];
    for dtype in [StoredDtype::F32, StoredDtype::Bf16] {
        let dir = tempfile::tempdir().unwrap();
        loaded.save_hf_as(dir.path(), dtype).unwrap();
        let from_file = LoadedModel::open(dir.path()).unwrap();
        let handed = loaded.as_stored(dtype, "handed".into());
        assert_eq!(handed.model.config, from_file.model.config, "{dtype:?}");
        let (a, b) = (handed.model.weights(), from_file.model.weights());
        let (named_a, named_b) = (a.named(), b.named());
        assert_eq!(named_a.len(), named_b.len());
        for ((name, t), (other, u)) in named_a.iter().zip(&named_b) {
            assert_eq!(name, other);
            assert_eq!(t.shape, u.shape, "{name}");
            let same = t
                .data
                .iter()
                .zip(&u.data)
                .all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "{dtype:?}: {name} differs from the file's");
        }
        assert_eq!(handed.tokenizer.stop_ids(), from_file.tokenizer.stop_ids());
        assert_eq!(
            handed.tokenizer.encode("def f(x): return 42").unwrap(),
            from_file.tokenizer.encode("def f(x): return 42").unwrap()
        );
        let render = |m: &LoadedModel| {
            m.chat_template
                .as_ref()
                .unwrap()
                .render(&message, None, true)
                .unwrap()
        };
        assert_eq!(render(&handed), render(&from_file));
    }
    let rounded = loaded.as_stored(StoredDtype::Bf16, "handed".into());
    let changed = rounded.model.weights().embed.data != loaded.model.weights().embed.data;
    assert!(changed, "bf16 rounding left the f32 weights as they were");
}
