//! Real models answer real prompts.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use arl_model::chat::ChatMessage;
use arl_model::generate::{Sampling, generate};
use arl_model::load::LoadedModel;
use arl_model::model::{KvCache, Model, SeqInput};

fn chat(model: &LoadedModel, question: &str, max_tokens: usize) -> String {
    let template = model.chat_template.as_ref().unwrap();
    let prompt = template
        .render(&[ChatMessage::new("user", question)], None, true)
        .unwrap();
    let ids = model.tokenizer.encode(&prompt).unwrap();
    let (tokens, _) = generate(
        &model.model,
        &ids,
        max_tokens,
        model.tokenizer.stop_ids(),
        &Sampling::default(),
    );
    model.tokenizer.decode(&tokens, true).unwrap()
}

#[test]
fn smollm2_knows_the_capital_of_france() {
    let model = LoadedModel::open(&common::smollm2()).unwrap();
    let answer = chat(&model, "What is the capital of France?", 24);
    assert!(answer.contains("Paris"), "{answer:?}");
}

#[test]
fn qwen_coder_writes_a_correct_python_function() {
    let model = LoadedModel::open(&common::qwen_coder()).unwrap();
    let answer = chat(
        &model,
        "Write a Python function `is_palindrome(s)` that returns True if the string s reads the same backwards. Reply with only the code in one ```python block.",
        120,
    );
    let code = answer
        .split("```python")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .unwrap_or_else(|| panic!("no python block in {answer:?}"));
    let check = format!(
        "{code}\nassert is_palindrome('racecar')\nassert is_palindrome('abba')\nassert not is_palindrome('abc')\nprint('ok')\n"
    );
    let output = std::process::Command::new("python3")
        .arg("-c")
        .arg(&check)
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&output.stdout).contains("ok"),
        "the function failed: {}\n{code}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Logits after each of `steps` greedy decode steps of every prompt, all advancing in one
/// batch (with prompts prefilled together, as the engine's first step does).
fn decode_together(model: &Model, prompts: &[Vec<u32>], steps: usize) -> Vec<Vec<Vec<f32>>> {
    let mut caches: Vec<KvCache> = prompts.iter().map(|_| KvCache::new(model)).collect();
    let mut inputs: Vec<SeqInput<'_>> = caches
        .iter_mut()
        .zip(prompts)
        .map(|(cache, p)| SeqInput { tokens: p, cache })
        .collect();
    let mut logits = model.forward(&mut inputs);
    drop(inputs);
    let mut seen: Vec<Vec<Vec<f32>>> = logits.iter().map(|l| vec![l.clone()]).collect();
    for _ in 0..steps {
        let next: Vec<[u32; 1]> = logits.iter().map(|l| [argmax(l)]).collect();
        let mut inputs: Vec<SeqInput<'_>> = caches
            .iter_mut()
            .zip(&next)
            .map(|(cache, t)| SeqInput { tokens: t, cache })
            .collect();
        logits = model.forward(&mut inputs);
        for (seen, l) in seen.iter_mut().zip(&logits) {
            seen.push(l.clone());
        }
    }
    seen
}

fn argmax(logits: &[f32]) -> u32 {
    (0..logits.len())
        .max_by(|&a, &b| logits[a].total_cmp(&logits[b]).then(b.cmp(&a)))
        .unwrap() as u32
}

/// A sequence's logits, and so its tokens and log-probabilities, are bit for bit the same
/// whatever else shares its batch: decoding 8 prompts of different lengths together equals
/// decoding each alone — on the GGUF's blocks and on f32 weights (a trained version), for
/// SmolLM2 (3 query heads per kv head) and Qwen2.5 (7).
#[test]
fn a_sequence_decodes_the_same_alone_and_in_a_batch() {
    for path in [common::smollm2(), common::qwen_coder()] {
        let loaded = LoadedModel::open(&path).unwrap();
        let mut trained = loaded.model.clone();
        trained.weights_mut(); // drops the block-format copies, as a weight update does
        let prompts: Vec<Vec<u32>> = (0..8u32)
            .map(|i| {
                (0..5 + 7 * i)
                    .map(|t| 200 + (t * 31 + i * 97) % 3000)
                    .collect()
            })
            .collect();
        for (kind, model) in [("gguf blocks", &loaded.model), ("f32", &trained)] {
            let together = decode_together(model, &prompts, 6);
            for (i, prompt) in prompts.iter().enumerate() {
                let alone = decode_together(model, std::slice::from_ref(prompt), 6);
                assert!(
                    alone[0] == together[i],
                    "{} ({kind}): prompt {i} differs alone and in a batch of 8",
                    path.display()
                );
            }
        }
    }
}
