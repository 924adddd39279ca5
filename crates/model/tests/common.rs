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
