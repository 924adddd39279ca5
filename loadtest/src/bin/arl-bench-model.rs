//! `arl-bench-model`: SmolLM2-135M on this machine — prefill and decode (batch 1 and 8)
//! and training tokens/s — next to llama.cpp's prefill and decode on the same GGUF and
//! prompt, measured in the same run (PyPI xllamacpp, through scripts/llamacpp_reference.py).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use arl_model::chat::ChatMessage;
use arl_model::load::LoadedModel;
use arl_model::model::{KvCache, SeqInput};
use arl_model::train::AdamW;
use arl_trainer::step::{Sample, StepConfig, train_step};

const DECODE_STEPS: usize = 64;
/// Decode steps are timed in this many blocks; the best block counts.
const DECODE_BLOCKS: usize = 4;

fn cache_dir() -> PathBuf {
    PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".cache/arl")
}

fn llama_cpp(model: &Path, prompt: &[u32]) -> anyhow::Result<(f64, f64)> {
    let python = std::env::var_os("ARL_TOOLS_PYTHON")
        .map(PathBuf::from)
        .unwrap_or(cache_dir().join("tools/bin/python"));
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/llamacpp_reference.py");
    let mut child = std::process::Command::new(python)
        .arg(script)
        .arg(model)
        .arg(DECODE_STEPS.to_string())
        .arg(
            std::thread::available_parallelism()
                .map_or(2, |n| n.get())
                .to_string(),
        )
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()?;
    // The same prompt four times (no prompt reuse); the best run counts, as ARL's best
    // block does: a shared machine's noise only ever adds time.
    let prompts = vec![prompt.to_vec(); 4];
    child
        .stdin
        .take()
        .ok_or_else(|| anyhow::anyhow!("no stdin"))?
        .write_all(serde_json::to_string(&prompts)?.as_bytes())?;
    let output = child.wait_with_output()?;
    anyhow::ensure!(
        output.status.success(),
        "llama.cpp reference failed (run `make deps`)"
    );
    let answers: Vec<serde_json::Value> = serde_json::from_slice(&output.stdout)?;
    let best = |field: &str| {
        answers
            .iter()
            .filter_map(|a| a["timings"][field].as_f64())
            .fold(0.0, f64::max)
    };
    Ok((best("prompt_per_second"), best("predicted_per_second")))
}

fn main() -> anyhow::Result<()> {
    arl_model::ops::retain_freed_memory();
    let path = std::env::var_os("ARL_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or(cache_dir().join("models"))
        .join("SmolLM2-135M-Instruct.Q4_1.gguf");
    let loaded = LoadedModel::open(&path)?;
    let model = &loaded.model;
    let template = loaded
        .chat_template
        .as_ref()
        .ok_or_else(|| anyhow::anyhow!("no chat template"))?;
    let question = "Here is a Python function with a bug. It should return the mean of a list, but \
        it skips the first element and divides by the wrong count:\n\ndef mean(values):\n    total = 0\n    \
        for v in values[1:]:\n        total += v\n    return total / (len(values) - 1)\n\nExplain the bug and fix it.";
    let prompt = loaded.tokenizer.encode(&template.render(
        &[ChatMessage::new("user", question)],
        None,
        true,
    )?)?;
    let n = prompt.len();

    // Prefill: best of 3.
    let mut prefill = f64::MAX;
    for _ in 0..3 {
        let mut cache = KvCache::new(model);
        let started = Instant::now();
        model.forward(&mut [SeqInput {
            tokens: &prompt,
            cache: &mut cache,
        }]);
        prefill = prefill.min(started.elapsed().as_secs_f64());
    }

    // Decode at batch 1 and 8, on the GGUF's blocks and on f32 weights (what the engine
    // serves once a training step has published a version).
    let decode1 = decode(model, &prompt, 1);
    let decode8 = decode(model, &prompt, 8);
    let mut trained = model.clone();
    trained.weights_mut(); // drops the block-format copies, as a weight update does
    let decode1_f32 = decode(&trained, &prompt, 1);
    let decode8_f32 = decode(&trained, &prompt, 8);

    // Training: forward + backward + AdamW on 4 sequences of the prompt's length.
    let mut trainee = model.clone();
    let mut optimizer = AdamW::new(&trainee, 0.01);
    let batch: Vec<&[u32]> = vec![&prompt; 4];
    let mut best_train = f64::MAX;
    for _ in 0..2 {
        let started = Instant::now();
        let (pass, logprobs) = trainee.forward_train(&batch);
        let d: Vec<Vec<f32>> = logprobs.iter().map(|r| vec![-1.0; r.len()]).collect();
        let mut grads = trainee.weights().zeros_like();
        trainee.backward(&pass, &d, &[], &mut grads);
        optimizer.update(&mut trainee, &grads, 1e-6);
        best_train = best_train.min(started.elapsed().as_secs_f64());
    }
    let train = (4 * n) as f64 / best_train;

    // A whole GRPO step as the trainer runs it: 2 groups × 4 samples of the prompt plus a
    // 32-token response, old log-probabilities recomputed (one extra forward), one update.
    let samples: Vec<Sample> = (0..8)
        .map(|i| {
            let mut tokens = prompt.clone();
            tokens.extend((0..32).map(|t| 1000 + (i * 37 + t * 11) as u32 % 20_000));
            let mut loss_mask = vec![0u8; prompt.len()];
            loss_mask.extend([1u8; 32]);
            Sample {
                group: (i / 4) as u64,
                rollout_logprobs: vec![-1.0; tokens.len()],
                tokens,
                loss_mask,
                reward: f64::from(i as u8 % 2),
            }
        })
        .collect();
    let step_tokens: usize = samples.iter().map(|s| s.tokens.len()).sum();
    let mut best_step = f64::MAX;
    for _ in 0..2 {
        let started = Instant::now();
        train_step(
            &mut trainee,
            None,
            &mut optimizer,
            &samples,
            &StepConfig::default(),
            1e-6,
        );
        best_step = best_step.min(started.elapsed().as_secs_f64());
    }
    let grpo = step_tokens as f64 / best_step;

    let (lc_prefill, lc_decode) = llama_cpp(&path, &prompt)?;
    println!(
        "\nSmolLM2-135M-Instruct (Q4_1 GGUF), {n}-token prompt, {} threads",
        rayon::current_num_threads()
    );
    println!(
        "{:<34} {:>12} {:>12} {:>9}",
        "", "ARL tok/s", "llama.cpp", "ratio"
    );
    println!(
        "{:<34} {:>12.1} {:>12.1} {:>8.2}x",
        "prefill",
        n as f64 / prefill,
        lc_prefill,
        n as f64 / prefill / lc_prefill
    );
    println!(
        "{:<34} {:>12.1} {:>12.1} {:>8.2}x",
        "decode, batch 1",
        decode1,
        lc_decode,
        decode1 / lc_decode
    );
    println!(
        "{:<34} {:>12.1} {:>12.1} {:>8.2}x",
        "decode, batch 8 (total), vs batch 1",
        decode8,
        decode1,
        decode8 / decode1
    );
    println!(
        "{:<34} {:>12.1} {:>12.1} {:>8.2}x",
        "decode, f32 weights, batch 1",
        decode1_f32,
        lc_decode,
        decode1_f32 / lc_decode
    );
    println!(
        "{:<34} {:>12.1} {:>12.1} {:>8.2}x",
        "decode, f32 weights, batch 8, vs b1",
        decode8_f32,
        decode1_f32,
        decode8_f32 / decode1_f32
    );
    println!(
        "{:<34} {:>12.1} {:>12} {:>9}",
        "training (fwd + bwd + AdamW)", train, "-", "-"
    );
    println!(
        "{:<34} {:>12.1} {:>12.1} {:>8.2}x",
        "GRPO step (arl-trainer), vs above",
        grpo,
        train,
        grpo / train
    );
    Ok(())
}

/// Greedy decode tokens/s of `batch` sequences advancing together after the prompt: the
/// best of a few blocks of steps (a shared machine's noise only ever adds time).
fn decode(model: &arl_model::model::Model, prompt: &[u32], batch: usize) -> f64 {
    let mut caches: Vec<KvCache> = (0..batch).map(|_| KvCache::new(model)).collect();
    let mut next: Vec<u32> = caches
        .iter_mut()
        .map(|cache| {
            let logits = model.forward(&mut [SeqInput {
                tokens: prompt,
                cache,
            }]);
            argmax(&logits[0])
        })
        .collect();
    let mut best = f64::MAX;
    for _ in 0..DECODE_BLOCKS {
        let started = Instant::now();
        for _ in 0..DECODE_STEPS / DECODE_BLOCKS {
            let tokens: Vec<[u32; 1]> = next.iter().map(|t| [*t]).collect();
            let mut inputs: Vec<SeqInput<'_>> = caches
                .iter_mut()
                .zip(&tokens)
                .map(|(cache, t)| SeqInput { tokens: t, cache })
                .collect();
            next = model
                .forward(&mut inputs)
                .iter()
                .map(|l| argmax(l))
                .collect();
        }
        best = best.min(started.elapsed().as_secs_f64());
    }
    (DECODE_STEPS / DECODE_BLOCKS * batch) as f64 / best
}

fn argmax(logits: &[f32]) -> u32 {
    logits
        .iter()
        .enumerate()
        .fold(
            (0, f32::NEG_INFINITY),
            |b, (i, &z)| if z > b.1 { (i, z) } else { b },
        )
        .0 as u32
}
