//! Real models answer real prompts.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use arl_model::chat::ChatMessage;
use arl_model::generate::{Sampling, generate};
use arl_model::load::LoadedModel;

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
