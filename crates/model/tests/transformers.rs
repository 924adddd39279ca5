//! Models saved by transformers 5 (RoPE in `rope_parameters`): Qwen2, Llama with llama3,
//! linear and YaRN RoPE, and Qwen3 (with its own head_dim, and with YaRN). Each loads and
//! gives PyTorch's float32 log-probabilities to 1e-4, through the training pass and
//! through the KV-cached inference pass; each saved back by ARL loads in transformers and
//! gives the same log-probabilities again.
//!
//! The fixtures come from `transformers_reference.py` run by the python of `make vllm`
//! (ARL_VLLM_PYTHON), cached under ~/.cache/arl/test-fixtures/ in a folder keyed by the
//! script's contents.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use arl_model::config::{Architecture, ModelConfig, RopeScaling};
use arl_model::load::{open_hf_model, save_hf_model};
use arl_model::model::{KvCache, Model, SeqInput};
use arl_model::weights::StoredDtype;

const SCRIPT: &str = include_str!("transformers_reference.py");
const TOLERANCE: f64 = 1e-4;

fn home() -> PathBuf {
    PathBuf::from(std::env::var_os("HOME").expect("HOME"))
}

/// The python of `make vllm` (torch and transformers 5).
fn python() -> PathBuf {
    let path = std::env::var_os("ARL_VLLM_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| home().join(".cache/arl/vllm/bin/python"));
    assert!(
        path.exists(),
        "{} is missing: run `make vllm` (its torch and transformers write these tests' reference models)",
        path.display()
    );
    path
}

/// FNV-1a: a stable key for the script's contents.
fn fnv64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The fixtures' folder, made once per script version (written beside, then renamed, so
/// that concurrent test processes never see half of it).
fn fixtures() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let root = home().join(".cache/arl/test-fixtures");
        let dir = root.join(format!("transformers-{:016x}", fnv64(SCRIPT.as_bytes())));
        if dir.exists() {
            return dir;
        }
        std::fs::create_dir_all(&root).unwrap();
        let staging = tempfile::tempdir_in(&root).unwrap();
        let script = staging.path().join("transformers_reference.py");
        std::fs::write(&script, SCRIPT).unwrap();
        let out = staging.path().join("models");
        let output = Command::new(python())
            .arg(&script)
            .arg("make")
            .arg(&out)
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "transformers_reference.py make failed:\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
        // Another process may have finished first: either copy is the same.
        if std::fs::rename(&out, &dir).is_err() {
            assert!(dir.exists(), "cannot move fixtures to {}", dir.display());
        }
        dir
    })
}

#[derive(serde::Deserialize)]
struct Reference {
    tokens: Vec<u32>,
    logprobs: Vec<f64>,
}

fn reference(case: &str) -> Reference {
    let text = std::fs::read_to_string(fixtures().join(case).join("reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn assert_close(what: &str, got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let worst = got
        .iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs())
        .fold(0.0, f64::max);
    eprintln!(
        "{what}: worst |Δ logprob| {worst:.2e} over {} tokens",
        got.len()
    );
    assert!(
        worst < TOLERANCE,
        "{what}: log-probabilities differ by {worst:.2e} (> {TOLERANCE:e})\n got {got:?}\nwant {want:?}"
    );
}

/// Per-token log-probabilities from the inference pass, one token at a time through the
/// KV cache; a prefill of the first half agrees with it.
fn cached_logprobs(model: &Model, tokens: &[u32]) -> Vec<f64> {
    let mut cache = KvCache::new(model);
    let half = tokens.len() / 2;
    let mut out = Vec::new();
    let log_softmax_at = |logits: &[f32], target: u32| {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = logits.iter().map(|&z| f64::from(z - max).exp()).sum();
        f64::from(logits[target as usize] - max) - sum.ln()
    };
    // A forward call yields its last position's logits: decode one token at a time.
    for t in 0..tokens.len() - 1 {
        let logits = model.forward(&mut [SeqInput {
            tokens: &tokens[t..=t],
            cache: &mut cache,
        }]);
        out.push(log_softmax_at(&logits[0], tokens[t + 1]));
    }
    // And a prefill of the whole prefix agrees with the one-by-one decode.
    let mut fresh = KvCache::new(model);
    let logits = model.forward(&mut [SeqInput {
        tokens: &tokens[..half],
        cache: &mut fresh,
    }]);
    let prefill = log_softmax_at(&logits[0], tokens[half]);
    assert!((prefill - out[half - 1]).abs() < 1e-5, "prefill vs decode");
    out
}

fn check_case(case: &str) -> Model {
    let dir = fixtures().join(case);
    let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    // The point of these fixtures: transformers 5 nests RoPE settings.
    assert!(
        json["rope_parameters"]["rope_theta"].is_number() && json.get("rope_theta").is_none(),
        "{case}: expected transformers 5's rope_parameters layout in {text}"
    );
    let want = reference(case);
    let model = open_hf_model(&dir).unwrap();
    let (_, train) = model.forward_train(&[&want.tokens]);
    let train: Vec<f64> = train[0].iter().map(|v| f64::from(*v)).collect();
    assert_close(&format!("{case} training pass"), &train, &want.logprobs);
    assert_close(
        &format!("{case} cached inference"),
        &cached_logprobs(&model, &want.tokens),
        &want.logprobs,
    );
    model
}

#[test]
fn qwen2_from_transformers_5_matches_pytorch() {
    let model = check_case("qwen2");
    assert_eq!(model.config.architecture, Architecture::Qwen2);
    assert_eq!(model.config.rope_theta, 10_000.0);
}

#[test]
fn llama_with_llama3_rope_matches_pytorch() {
    let model = check_case("llama-llama3");
    assert_eq!(model.config.rope_theta, 500_000.0);
    assert!(matches!(
        model.config.rope_scaling,
        Some(RopeScaling::Llama3(_))
    ));
}

#[test]
fn llama_with_linear_rope_matches_pytorch() {
    let model = check_case("llama-linear");
    assert_eq!(
        model.config.rope_scaling,
        Some(RopeScaling::Linear { factor: 2.0 })
    );
}

#[test]
fn llama_with_yarn_rope_matches_pytorch() {
    let model = check_case("llama-yarn");
    // transformers' default mscale: 0.1·ln(4) + 1.
    let factor = model.config.rope_attention_factor();
    assert!((factor - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-12, "{factor}");
}

#[test]
fn qwen3_matches_pytorch() {
    let model = check_case("qwen3");
    assert_eq!(
        model.config.architecture,
        Architecture::Qwen3 { head_dim: 16 }
    );
    assert_eq!(model.config.q_dim(), 64);
    assert_ne!(model.config.q_dim(), model.config.hidden_size);
}

#[test]
fn qwen3_with_yarn_rope_matches_pytorch() {
    check_case("qwen3-yarn");
}

/// ARL's checkpoints of every family load back in transformers as the same model, and in
/// ARL as the same config.
#[test]
fn checkpoints_written_by_arl_load_in_transformers_identically() {
    let cases = [
        "qwen2",
        "llama-llama3",
        "llama-linear",
        "llama-yarn",
        "qwen3",
        "qwen3-yarn",
    ];
    let out = tempfile::tempdir().unwrap();
    let mut dirs = Vec::new();
    let mut wants = Vec::new();
    for case in cases {
        let model = open_hf_model(&fixtures().join(case)).unwrap();
        let dir = out.path().join(case);
        save_hf_model(&model, &dir, StoredDtype::F32).unwrap();
        let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
        assert_eq!(
            ModelConfig::from_hf_json(&text).unwrap(),
            model.config,
            "{case}: config round trip"
        );
        dirs.push(dir);
        wants.push(reference(case).logprobs);
    }
    let script = out.path().join("transformers_reference.py");
    std::fs::write(&script, SCRIPT).unwrap();
    let output = Command::new(python())
        .arg(&script)
        .arg("logprobs")
        .args(&dirs)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "transformers could not load ARL's checkpoints:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let got: Vec<Vec<f64>> = serde_json::from_slice(&output.stdout).unwrap();
    for ((case, got), want) in cases.iter().zip(&got).zip(&wants) {
        assert_close(
            &format!("{case} saved by ARL, run by transformers"),
            got,
            want,
        );
    }
}

/// `make vllm`'s SmolLM2 folder, written by transformers 5 from the GGUF (same weights,
/// dequantized): rope_theta 100,000 only inside rope_parameters, the chat template only
/// in chat_template.jinja. It reads both, and scores tokens as the GGUF does — the
/// loader that read only a top-level rope_theta ran it at 10,000 without a word.
#[test]
fn smollm2_folder_from_transformers_5_matches_its_gguf() {
    use arl_model::load::LoadedModel;
    let models = std::env::var_os("ARL_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| home().join(".cache/arl/models"));
    let (hf, gguf) = (
        models.join("SmolLM2-135M-Instruct-hf"),
        models.join("SmolLM2-135M-Instruct.Q4_1.gguf"),
    );
    for path in [&hf, &gguf] {
        assert!(
            path.exists(),
            "{} is missing: run `make models vllm`",
            path.display()
        );
    }
    let folder = LoadedModel::open(&hf).unwrap();
    assert_eq!(folder.model.config.rope_theta, 100_000.0);
    assert!(
        folder
            .chat_template_source
            .as_deref()
            .is_some_and(|t| t.contains("im_start")),
        "chat_template.jinja was not read"
    );
    let file = arl_model::load::open_model(&gguf).unwrap();
    assert_eq!(folder.model.config.rope_theta, file.config.rope_theta);
    let tokens = folder
        .tokenizer
        .encode("The capital of France is Paris, and the capital of Italy is Rome.")
        .unwrap();
    let (_, a) = folder.model.forward_train(&[&tokens]);
    let (_, b) = file.forward_train(&[&tokens]);
    let (a, b): (Vec<f64>, Vec<f64>) = (
        a[0].iter().map(|v| f64::from(*v)).collect(),
        b[0].iter().map(|v| f64::from(*v)).collect(),
    );
    assert_close("SmolLM2 folder vs GGUF", &a, &b);
}
