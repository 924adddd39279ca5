//! Fuzz targets: every reader of outside input, fed arbitrary bytes. A target returns
//! normally on any input (errors are fine and expected); a panic, an abort or a giant
//! allocation is a bug. The same functions serve cargo-fuzz (`fuzz/`, `make fuzz`,
//! coverage-guided) and [`mutate::run`], a short mutational run `make test` does on
//! stable Rust.

pub mod mutate;
pub mod seeds;

use std::path::Path;

use arl_model::config::ModelConfig;
use arl_model::gguf::GgufFile;
use arl_model::tokenizer::Tokenizer;
use arl_model::weights::Weights;
use arl_schemas::spec::RunSpec;

/// One fuzz target: a name and the function that reads its input.
pub struct Target {
    pub name: &'static str,
    pub run: fn(&[u8]),
    pub seeds: fn() -> Vec<Vec<u8>>,
}

/// Every target.
pub const TARGETS: &[Target] = &[
    Target {
        name: "gguf",
        run: gguf,
        seeds: seeds::gguf,
    },
    Target {
        name: "safetensors",
        run: safetensors,
        seeds: seeds::safetensors,
    },
    Target {
        name: "run_spec_toml",
        run: run_spec_toml,
        seeds: seeds::run_spec_toml,
    },
    Target {
        name: "run_spec_json",
        run: run_spec_json,
        seeds: seeds::run_spec_json,
    },
    Target {
        name: "proxy_request",
        run: proxy_request,
        seeds: seeds::proxy_request,
    },
    Target {
        name: "dataset",
        run: dataset,
        seeds: seeds::dataset,
    },
];

pub fn target(name: &str) -> Option<&'static Target> {
    TARGETS.iter().find(|t| t.name == name)
}

/// A GGUF file as the engine loads it: the parser, then the config, tokenizer and
/// weights read from it.
pub fn gguf(data: &[u8]) {
    let Ok(file) = GgufFile::parse(data.to_vec()) else {
        return;
    };
    for tensor in &file.tensors {
        let _ = file.tensor_f32(&tensor.name);
    }
    let _ = Tokenizer::from_gguf(&file);
    if let Ok(config) = ModelConfig::from_gguf(&file) {
        let _ = Weights::from_gguf(&file, &config);
    }
}

/// A `model.safetensors` of the small model [`seeds::tiny_config`] describes.
pub fn safetensors(data: &[u8]) {
    let Ok(dir) = tempfile::tempdir() else {
        return;
    };
    if std::fs::write(dir.path().join("model.safetensors"), data).is_ok() {
        let _ = Weights::from_safetensors_dir(dir.path(), &seeds::tiny_config());
    }
}

/// A run spec as `arl run submit` reads it: TOML layered with VeRL's aliases, then the
/// range and cross-field rules.
pub fn run_spec_toml(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(document) = arl_schemas::spec_layers::toml_document(text) else {
        return;
    };
    if let Ok(layered) = arl_schemas::spec_layers::build(document, &[]) {
        let _ = layered.spec.check();
    }
}

/// A run spec as the controller reads it from a `run.requested` event.
pub fn run_spec_json(data: &[u8]) {
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    if let Ok(spec) = RunSpec::from_json_value(value) {
        let _ = spec.check();
    }
}

/// A request body to the token proxy's chat and completion endpoints.
pub fn proxy_request(data: &[u8]) {
    use arl_proxy::api::{Kind, parse_request};
    let _ = parse_request(data, Kind::Chat);
    let _ = parse_request(data, Kind::Completion);
}

/// A dataset file: the first byte picks its format (JSONL, JSON, Parquet, Arrow), the rest
/// is the file, read by the math, SWE-bench and VeRL loaders.
pub fn dataset(data: &[u8]) {
    let Some((format, body)) = data.split_first() else {
        return;
    };
    let extension = ["jsonl", "json", "parquet", "arrow"][usize::from(*format) % 4];
    let Ok(dir) = tempfile::tempdir() else {
        return;
    };
    let path = dir.path().join(format!("rows.{extension}"));
    if std::fs::write(&path, body).is_err() {
        return;
    }
    read_dataset(&path);
}

fn read_dataset(path: &Path) {
    use arl_dataset::swebench::{Completeness, load};
    let _ = arl_dataset::math::load(path);
    let _ = arl_dataset::verl::load(path);
    let _ = load(path, Completeness::Full);
    let _ = load(path, Completeness::ProblemsOnly);
}
