//! The short fuzz run of `make test`: every target, a few seconds each
//! (`ARL_FUZZ_SECONDS`, default 3), from a fixed seed (`ARL_FUZZ_SEED`) so that a failure
//! reproduces. `make fuzz` runs the same targets under cargo-fuzz, coverage-guided.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use arl_fuzz::{TARGETS, mutate};

fn setting(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .map(|v| {
            v.parse()
                .unwrap_or_else(|_| panic!("{name}={v} is not a number"))
        })
        .unwrap_or(default)
}

#[test]
fn no_target_panics_on_mutants_of_its_seeds() {
    let budget = Duration::from_secs(setting("ARL_FUZZ_SECONDS", 3));
    let seed = setting("ARL_FUZZ_SEED", 0x5eed);
    for target in TARGETS {
        let outcome = mutate::run(target, budget, seed);
        println!(
            "{:<14} {:>8} inputs in {budget:?} (seed {seed:#x})",
            target.name, outcome.executions
        );
        if let Some((input, message)) = outcome.crash {
            let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
                .join(format!("crash-{}", target.name));
            std::fs::write(&path, &input).unwrap();
            panic!(
                "{} panicked: {message}\ninput ({} bytes) saved to {} — reproduce with `make fuzz-one TARGET={} INPUT={}`",
                target.name,
                input.len(),
                path.display(),
                target.name,
                path.display()
            );
        }
    }
}

/// Every seed is a valid input for its target, so mutants start deep in the parsers.
#[test]
fn the_seeds_are_valid() {
    use arl_model::gguf::GgufFile;
    let gguf = &arl_fuzz::seeds::gguf()[0];
    let file = GgufFile::parse(gguf.clone()).unwrap();
    let config = arl_model::config::ModelConfig::from_gguf(&file).unwrap();
    arl_model::weights::Weights::from_gguf(&file, &config).unwrap();
    arl_model::tokenizer::Tokenizer::from_gguf(&file).unwrap();

    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("model.safetensors"),
        &arl_fuzz::seeds::safetensors()[0],
    )
    .unwrap();
    arl_model::weights::Weights::from_safetensors_dir(dir.path(), &arl_fuzz::seeds::tiny_config())
        .unwrap();

    for toml in arl_fuzz::seeds::run_spec_toml() {
        arl_schemas::spec::RunSpec::from_toml(std::str::from_utf8(&toml).unwrap()).unwrap();
    }
    assert_eq!(arl_fuzz::seeds::run_spec_json().len(), 3);
    // The VeRL seeds load: a JSONL row, and nested Parquet with one row's null message.
    let seeds = arl_fuzz::seeds::dataset();
    for (seed, extension, (rows, errors)) in
        [(&seeds[4], "jsonl", (1, 0)), (&seeds[5], "parquet", (1, 1))]
    {
        let path = dir.path().join(format!("verl.{extension}"));
        std::fs::write(&path, &seed[1..]).unwrap();
        let loaded = arl_dataset::verl::load(&path).unwrap();
        assert_eq!((loaded.rows.len(), loaded.errors.len()), (rows, errors));
    }
    for body in arl_fuzz::seeds::proxy_request() {
        let chat = arl_proxy::api::parse_request(&body, arl_proxy::api::Kind::Chat);
        let completion = arl_proxy::api::parse_request(&body, arl_proxy::api::Kind::Completion);
        assert!(
            chat.is_ok() || completion.is_ok(),
            "{}",
            String::from_utf8_lossy(&body)
        );
    }
}
