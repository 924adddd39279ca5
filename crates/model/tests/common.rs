//! Paths of the real models `make models` installs.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;

pub fn model_dir() -> PathBuf {
    std::env::var_os("ARL_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cache/arl/models")
        })
}

pub fn installed(file: &str) -> PathBuf {
    let path = model_dir().join(file);
    assert!(
        path.exists(),
        "{} is missing: run `make models`",
        path.display()
    );
    path
}

pub fn smollm2() -> PathBuf {
    installed("SmolLM2-135M-Instruct.Q4_1.gguf")
}

pub fn qwen_coder() -> PathBuf {
    installed("qwen2.5-coder-0.5b-instruct.gguf")
}

pub fn qwen_tokenizer_json() -> PathBuf {
    installed("qwen-tokenizer/tokenizer.json")
}

/// The Python of `make deps`' tools venv, which has xllamacpp (llama.cpp).
pub fn tools_python() -> PathBuf {
    let path = std::env::var_os("ARL_TOOLS_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").expect("HOME"))
                .join(".cache/arl/tools/bin/python")
        });
    assert!(
        path.exists(),
        "{} is missing: run `make deps`",
        path.display()
    );
    path
}

/// What llama.cpp answers for one prompt.
#[derive(Debug, serde::Deserialize)]
pub struct Reference {
    pub tokens: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub timings: serde_json::Value,
}

/// Greedy continuations from llama.cpp for token-id prompts.
pub fn llamacpp(
    model: &std::path::Path,
    prompts: &[Vec<u32>],
    max_tokens: usize,
) -> Vec<Reference> {
    use std::io::Write;
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../scripts/llamacpp_reference.py");
    let mut child = std::process::Command::new(tools_python())
        .arg(script)
        .arg(model)
        .arg(max_tokens.to_string())
        .arg("2")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(serde_json::to_string(prompts).unwrap().as_bytes())
        .unwrap();
    let output = child.wait_with_output().unwrap();
    assert!(output.status.success(), "llama.cpp reference failed");
    serde_json::from_slice(&output.stdout).unwrap()
}

/// Log-probabilities of `continuation` after `prompt` from the independent float64
/// numpy implementation (`scripts/numpy_reference.py`).
pub fn numpy_logprobs(model: &std::path::Path, prompt: &[u32], continuation: &[u32]) -> Vec<f64> {
    use std::io::Write;
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/numpy_reference.py");
    let mut child = std::process::Command::new(tools_python())
        .arg(script)
        .arg(model)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let request = serde_json::json!({"prompt": prompt, "continuation": continuation});
    child
        .stdin
        .take()
        .unwrap()
        .write_all(request.to_string().as_bytes())
        .unwrap();
    let output = child.wait_with_output().unwrap();
    assert!(output.status.success(), "numpy reference failed");
    serde_json::from_slice(&output.stdout).unwrap()
}
