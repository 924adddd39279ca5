//! `arl model info | generate | logprobs` with the real SmolLM2 (installed by `make models`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn arl(args: &[&str], stdin: Option<&str>) -> Output {
    arl_with_env(args, stdin, &[])
}

/// `arl ARGS…` with `env` set on top of this process's environment.
fn arl_with_env(args: &[&str], stdin: Option<&str>, env: &[(&str, &Path)]) -> Output {
    let exe = std::env::current_exe().unwrap();
    let binary: PathBuf = exe.parent().and_then(Path::parent).unwrap().join("arl");
    assert!(binary.exists(), "run `cargo build --bins` first");
    let mut child = Command::new(binary)
        .args(args)
        .envs(env.iter().copied())
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

/// `arl model logprobs` on a Hugging Face folder with no tokenizer files (ids in,
/// log-probabilities out), by path and by a Hub name resolved from a local HF cache; a
/// Hub name that is not cached is an error that says where it looked.
#[test]
fn logprobs_need_no_tokenizer_and_hub_names_resolve_from_the_local_cache() {
    use arl_model::config::{Architecture, ModelConfig};
    use arl_model::model::Model;
    use arl_model::weights::{StoredDtype, Weights};

    let config = ModelConfig::from_hf_json(
        &serde_json::json!({
            "model_type": "qwen3", "vocab_size": 40, "hidden_size": 16,
            "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-6,
            "hidden_act": "silu", "max_position_embeddings": 64,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        })
        .to_string(),
    )
    .unwrap();
    assert_eq!(config.architecture, Architecture::Qwen3 { head_dim: 8 });
    let model = Model::new(config.clone(), Weights::random(&config, 9, 0.3));
    let cache = tempfile::tempdir().unwrap();
    let rev = "0123456789abcdef0123456789abcdef01234567";
    let repo = cache.path().join("models--arl-test--tiny-qwen3");
    let dir = repo.join("snapshots").join(rev);
    arl_model::load::save_hf_model(&model, &dir, StoredDtype::F32).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), rev).unwrap();
    assert!(!dir.join("tokenizer.json").exists());

    let tokens = [3u32, 17, 5, 22, 9, 31];
    let (_, want) = model.forward_train(&[&tokens]);
    let input = serde_json::to_string(&tokens).unwrap();
    let run = |model: &str, hub_cache: &Path| {
        arl_with_env(
            &["model", "logprobs", model, "--tokens", "-"],
            Some(&input),
            &[("HF_HUB_CACHE", hub_cache)],
        )
    };
    for name in [dir.to_str().unwrap(), "arl-test/tiny-qwen3"] {
        let out = run(name, cache.path());
        assert!(
            out.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let got: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(got.len(), tokens.len() - 1);
        for ((g, w), t) in got.iter().zip(&want[0]).zip(&tokens[1..]) {
            assert_eq!(g["token"], *t);
            let lp = g["logprob"].as_f64().unwrap();
            assert!((lp - f64::from(*w)).abs() < 1e-5, "{name}: {lp} vs {w}");
        }
    }
    let out = run("arl-test/not-downloaded", cache.path());
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("models--arl-test--not-downloaded") && err.contains("HF_HUB_CACHE"),
        "{err}"
    );
}
