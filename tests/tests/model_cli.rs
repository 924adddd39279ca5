//! `arl model info | generate | logprobs` with the real SmolLM2 (installed by `make models`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn arl(args: &[&str], stdin: Option<&str>) -> Output {
    let exe = std::env::current_exe().unwrap();
    let binary: PathBuf = exe.parent().and_then(Path::parent).unwrap().join("arl");
    assert!(binary.exists(), "run `cargo build --bins` first");
    let mut child = Command::new(binary)
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    if let Some(input) = stdin {
        use std::io::Write;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.as_bytes())
            .unwrap();
    } else {
        drop(child.stdin.take());
    }
    child.wait_with_output().unwrap()
}

#[test]
fn model_info_generate_and_logprobs() {
    let info = arl(&["model", "info", "smollm2-135m-instruct"], None);
    assert!(
        info.status.success(),
        "{}",
        String::from_utf8_lossy(&info.stderr)
    );
    let info: serde_json::Value = serde_json::from_slice(&info.stdout).unwrap();
    assert_eq!(info["architecture"], "llama");
    assert_eq!(info["layers"], 30);
    assert_eq!(info["vocab_size"], 49152);
    assert_eq!(info["chat_template"], true);

    let answer = arl(
        &[
            "model",
            "generate",
            "smollm2-135m-instruct",
            "--prompt",
            "What is the capital of France?",
            "--chat",
            "--max-tokens",
            "16",
        ],
        None,
    );
    assert!(String::from_utf8_lossy(&answer.stdout).contains("Paris"));

    let scored = arl(
        &[
            "model",
            "logprobs",
            "smollm2-135m-instruct",
            "--tokens",
            "-",
        ],
        Some("[1, 9690, 198, 2683, 359]"),
    );
    assert!(
        scored.status.success(),
        "{}",
        String::from_utf8_lossy(&scored.stderr)
    );
    let scored: Vec<serde_json::Value> = serde_json::from_slice(&scored.stdout).unwrap();
    assert_eq!(scored.len(), 4);
    assert!(scored.iter().all(|s| s["logprob"].as_f64().unwrap() <= 0.0));

    let bad = arl(
        &[
            "model",
            "logprobs",
            "smollm2-135m-instruct",
            "--tokens",
            "-",
        ],
        Some("[1, 999999]"),
    );
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("outside the vocabulary"));
    let missing = arl(&["model", "info", "/nope.gguf"], None);
    assert_eq!(missing.status.code(), Some(2));
}
