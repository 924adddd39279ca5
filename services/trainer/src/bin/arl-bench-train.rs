//! `arl-bench-train`: one GRPO step as the trainer runs it (`arl_trainer::step::train_step`)
//! on Qwen2.5-0.5B shapes with random weights (nothing to download): old log-probabilities,
//! reference log-probabilities, then the policy's forward, backward and AdamW. It prints
//! tokens/s, MFU and peak memory per part (`--model qwen2.5-1.5b --recompute` for the larger
//! shapes with activation checkpointing), and, given `--torch-python`, the same step in
//! PyTorch eager and `torch.compile` (scripts/bench_train_torch.py) measured in the same run,
//! with ARL's ratio to each.
//!
//! On the GPU machine (README: GPU): `arl-bench-train --device cuda --torch-python python3`.
//! `make bench` runs a CPU-sized form: `--device cpu --layers 2 --sequences 2 --seq-len 256
//! --prompt-len 64 --steps 1`.
//! `ARL_CUDA_PROFILE=1` adds where the device time of a step goes, kernel by kernel.

use std::path::PathBuf;
use std::time::Instant;

use arl_model::backend::Backend;
use arl_model::config::ModelConfig;
use arl_model::generate::Rng;
use arl_model::model::Model;
use arl_model::ops::Cpu;
use arl_model::train::{Activations, AdamW};
use arl_model::weights::Weights;
use arl_trainer::objective::{Clip, KlEstimator};
use arl_trainer::step::{OldLogprobs, Sample, StepConfig, train_step};
use clap::Parser;

/// What went wrong, for the exit message.
type Result<T> = std::result::Result<T, String>;

/// Fails with `message` unless `condition` holds.
fn ensure(condition: bool, message: impl FnOnce() -> String) -> Result<()> {
    if condition { Ok(()) } else { Err(message()) }
}

/// The dense bf16 peak the MFU is taken against (H100/H200 SXM datasheet).
const PEAK_BF16_FLOPS: f64 = 989e12;

#[derive(Parser, Debug)]
#[command(about = "One GRPO step on Qwen2.5-0.5B shapes: tokens/s, MFU, peak memory")]
struct Args {
    /// cpu or cuda (GPU 0).
    #[arg(long, default_value = "cuda")]
    device: String,
    /// Sequences in the step (one micro-batch, as the PyTorch step).
    #[arg(long, default_value_t = 16)]
    sequences: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 1024)]
    seq_len: usize,
    /// Prompt tokens per sequence (not trained on); the rest is the completion.
    #[arg(long, default_value_t = 256)]
    prompt_len: usize,
    /// qwen2.5-0.5b or qwen2.5-1.5b (shapes only: the weights are random).
    #[arg(long, default_value = "qwen2.5-0.5b")]
    model: String,
    /// Transformer layers (the model's own when not given; fewer for a CPU-sized run).
    #[arg(long)]
    layers: Option<usize>,
    /// Activation checkpointing (trainer.activation_checkpointing): keep each layer's
    /// input only and run the layer again in the backward.
    #[arg(long)]
    recompute: bool,
    /// Timed steps after one warm-up step; the median counts.
    #[arg(long, default_value_t = 3)]
    steps: usize,
    /// A Python with torch and transformers: also run the PyTorch step in this run.
    #[arg(long)]
    torch_python: Option<PathBuf>,
    /// The PyTorch step's script.
    #[arg(long, default_value = "scripts/bench_train_torch.py")]
    torch_script: PathBuf,
}

/// Qwen2.5-0.5B's or -1.5B's shapes, with `layers` transformer layers when given.
fn qwen25(model: &str, layers: Option<usize>) -> Result<ModelConfig> {
    let config = ModelConfig::qwen25(model)
        .ok_or_else(|| format!("--model must be qwen2.5-0.5b or qwen2.5-1.5b, not {model:?}"))?;
    Ok(ModelConfig {
        num_hidden_layers: layers.unwrap_or(config.num_hidden_layers),
        ..config
    })
}

/// Model FLOPs per token of a sequence of `t` tokens: 2·params per matrix product pass plus
/// causal attention (QKᵀ and PV over t/2 keys on average): (forward, forward + backward).
fn flops_per_token(config: &ModelConfig, params: usize, t: usize) -> (f64, f64) {
    let attention = 2.0 * t as f64 * (config.q_dim() * config.num_hidden_layers) as f64;
    let forward = 2.0 * params as f64 + attention;
    (forward, 3.0 * forward)
}

/// The step's samples: groups of 4 with mixed rewards (every sample carries an advantage),
/// random tokens, the completion masked for training.
fn samples(args: &Args, vocab: usize) -> Vec<Sample> {
    let mut rng = Rng::new(1);
    (0..args.sequences)
        .map(|i| Sample {
            group: (i / 4) as u64,
            tokens: (0..args.seq_len)
                .map(|_| ((rng.next_f32() * vocab as f32) as u32).min(vocab as u32 - 1))
                .collect(),
            loss_mask: (0..args.seq_len)
                .map(|t| u8::from(t >= args.prompt_len))
                .collect(),
            rollout_logprobs: vec![0.0; args.seq_len],
            reward: [1.0, 0.0, 0.5, 0.0][i % 4],
        })
        .collect()
}

/// The PyTorch anchor's objective: PPO clip 0.2 (no dual clip), k3 KL at 0.04, token mean,
/// grad-norm clip 1.0, old log-probabilities recomputed, no importance correction.
fn step_config(args: &Args) -> StepConfig {
    StepConfig {
        clip: Clip {
            low: 0.2,
            high: 0.2,
            dual: None,
        },
        kl: Some((KlEstimator::LowVarKl, 0.04)),
        micro_batch_tokens: args.sequences * args.seq_len,
        activations: if args.recompute {
            Activations::Recompute
        } else {
            Activations::Keep
        },
        old_logprobs: OldLogprobs::Recompute,
        tis_cap: None,
        ..StepConfig::default()
    }
}

/// Seconds of one step's parts.
#[derive(Clone, Copy, Debug)]
struct Timing {
    logprobs: f64,
    train: f64,
}

/// Runs warm-up + `steps` GRPO steps; returns each timed step's parts. `sync` waits for the
/// device's queued work (and fails on a device error).
fn run_steps<B: Backend>(
    policy: &mut Model<B>,
    reference: &Model<B>,
    samples: &[Sample],
    config: &StepConfig,
    steps: usize,
    mut before_timed: impl FnMut(),
) -> Result<Vec<Timing>> {
    let mut optimizer = AdamW::new(policy, 0.01);
    let mut timings = Vec::new();
    for step in 0..=steps {
        if step == 1 {
            before_timed();
        }
        let started = Instant::now();
        let metrics = train_step(
            policy,
            Some(reference),
            &mut optimizer,
            samples,
            config,
            1e-6,
        );
        policy
            .backend
            .check()
            .map_err(|e| format!("the step failed on the device: {e}"))?;
        let total = started.elapsed().as_secs_f64();
        ensure(metrics.updates == 1 && metrics.trained_tokens > 0, || {
            format!("the step trained nothing: {metrics:?}")
        })?;
        if step > 0 {
            timings.push(Timing {
                logprobs: metrics.old_logprob_seconds,
                train: total - metrics.old_logprob_seconds,
            });
        }
    }
    Ok(timings)
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// One row of the table: seconds, tokens/s, MFU.
struct Row {
    name: String,
    logprobs: f64,
    train: f64,
    peak_bytes: Option<u64>,
}

/// The process's peak resident memory (VmHWM), 0 where /proc does not say.
fn peak_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
            line.split_whitespace().nth(1)?.parse::<u64>().ok()
        })
        .map_or(0, |kib| kib * 1024)
}

fn torch_rows(args: &Args, config: &ModelConfig, python: &PathBuf) -> Result<Vec<Row>> {
    let script = if args.torch_script.exists() {
        args.torch_script.clone()
    } else {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(&args.torch_script)
    };
    let output = std::process::Command::new(python)
        .arg(&script)
        .args(["--sequences", &args.sequences.to_string()])
        .args(["--seq-len", &args.seq_len.to_string()])
        .args(["--prompt-len", &args.prompt_len.to_string()])
        .args(["--model", &args.model])
        .args(["--layers", &config.num_hidden_layers.to_string()])
        .args(["--steps", &args.steps.to_string()])
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| format!("running {}: {e}", script.display()))?;
    ensure(output.status.success(), || {
        format!("{} failed ({})", script.display(), output.status)
    })?;
    let mut rows = Vec::new();
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let Ok(row) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let field = |name: &str| {
            row[name]
                .as_f64()
                .ok_or_else(|| format!("the PyTorch row lacks {name}: {line}"))
        };
        rows.push(Row {
            name: format!("PyTorch {}", row["mode"].as_str().unwrap_or("?")),
            logprobs: field("logprobs_s")?,
            train: field("train_s")?,
            peak_bytes: row["peak_bytes"].as_u64(),
        });
    }
    ensure(!rows.is_empty(), || {
        "the PyTorch script printed no rows".into()
    })?;
    Ok(rows)
}

fn main() -> std::process::ExitCode {
    match bench(&Args::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("arl-bench-train: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn bench(args: &Args) -> Result<()> {
    ensure(args.prompt_len + 1 < args.seq_len, || {
        "--prompt-len must leave a completion of at least 2 tokens in --seq-len".into()
    })?;
    ensure(args.steps > 0, || "--steps must be at least 1".into())?;
    let config = qwen25(&args.model, args.layers)?;
    let started = Instant::now();
    let host = Model::<Cpu>::new(config.clone(), Weights::random(&config, 7, 0.02));
    let params = host.weights().parameter_count();
    eprintln!(
        "random {} shapes, {} layers, {:.3}B parameters ({:.1} s)",
        args.model,
        config.num_hidden_layers,
        params as f64 / 1e9,
        started.elapsed().as_secs_f64()
    );
    let samples = samples(args, config.vocab_size);
    let step = step_config(args);
    let (timings, peak, device) = match args.device.as_str() {
        "cpu" => {
            let mut policy = host.clone();
            let timings = run_steps(&mut policy, &host, &samples, &step, args.steps, || {})?;
            (
                timings,
                peak_rss_bytes(),
                format!(
                    "CPU, {} threads",
                    std::thread::available_parallelism().map_or(1, |n| n.get())
                ),
            )
        }
        "cuda" => {
            let gpu = arl_model::cuda::Cuda::new(0).map_err(|e| format!("opening GPU 0: {e}"))?;
            let device = gpu.info().name.clone();
            let mut policy = host.to_backend(gpu.clone());
            let reference = host.to_backend(gpu.clone());
            drop(host);
            let timings = run_steps(&mut policy, &reference, &samples, &step, args.steps, || {
                if let Err(e) = gpu.reset_peak_memory() {
                    eprintln!("peak memory unavailable: {e}");
                }
                gpu.take_profile();
            })?;
            print_profile(&gpu.take_profile(), args.steps);
            (timings, gpu.peak_memory().unwrap_or(0) as u64, device)
        }
        other => return Err(format!("--device must be cpu or cuda, not {other:?}")),
    };
    let mut rows = vec![Row {
        name: "ARL".into(),
        logprobs: median(timings.iter().map(|t| t.logprobs).collect()),
        train: median(timings.iter().map(|t| t.train).collect()),
        peak_bytes: Some(peak),
    }];
    if let Some(python) = &args.torch_python {
        rows.extend(torch_rows(args, &config, python)?);
    }
    print_table(args, &config, params, &device, &rows);
    Ok(())
}

/// With ARL_CUDA_PROFILE=1: where a step's device time goes, each kernel timed alone.
fn print_profile(rows: &[(&'static str, u64, f64)], steps: usize) {
    if rows.is_empty() {
        return;
    }
    let total: f64 = rows.iter().map(|r| r.2).sum();
    println!(
        "\nper step, ARL_CUDA_PROFILE=1 (GPU time of each kernel between events, each run alone):\n"
    );
    println!(
        "| {:<24} | {:>7} | {:>9} | {:>6} |",
        "kernel or product", "calls", "ms", "share"
    );
    println!("|{:-<26}|{:->9}|{:->11}|{:->8}|", "", "", "", "");
    for (name, calls, seconds) in rows.iter().take(24) {
        println!(
            "| {:<24} | {:>7} | {:>9.2} | {:>5.1}% |",
            name,
            calls / steps as u64,
            seconds * 1e3 / steps as f64,
            100.0 * seconds / total
        );
    }
}

fn print_table(args: &Args, config: &ModelConfig, params: usize, device: &str, rows: &[Row]) {
    let tokens = (args.sequences * args.seq_len) as f64;
    let (forward, train) = flops_per_token(config, params, args.seq_len);
    // The whole step: two forwards without gradients (old and reference) and a training pass.
    let whole = 2.0 * forward + train;
    println!(
        "\nGRPO step, {} ({} layers{}), {} × {} tokens ({} prompt), on {device}; MFU against {:.0} TFLOP/s\n",
        args.model,
        config.num_hidden_layers,
        if args.recompute {
            ", activations recomputed"
        } else {
            ""
        },
        args.sequences,
        args.seq_len,
        args.prompt_len,
        PEAK_BF16_FLOPS / 1e12
    );
    println!(
        "| {:<17} | {:>10} | {:>12} | {:>6} | {:>12} | {:>6} | {:>9} |",
        "", "train ms", "train tok/s", "MFU", "step tok/s", "MFU", "peak GiB"
    );
    println!(
        "|{:-<19}|{:->12}|{:->14}|{:->8}|{:->14}|{:->8}|{:->11}|",
        "", "", "", "", "", "", ""
    );
    for row in rows {
        let step = row.logprobs + row.train;
        println!(
            "| {:<17} | {:>10.1} | {:>12.0} | {:>5.1}% | {:>12.0} | {:>5.1}% | {:>9} |",
            row.name,
            row.train * 1e3,
            tokens / row.train,
            100.0 * tokens * train / row.train / PEAK_BF16_FLOPS,
            tokens / step,
            100.0 * tokens * whole / step / PEAK_BF16_FLOPS,
            row.peak_bytes.map_or("—".into(), |b| format!(
                "{:.2}",
                b as f64 / f64::from(1u32 << 30)
            ))
        );
    }
    println!(
        "\ntrain = policy forward + backward + AdamW; step = old and reference log-probabilities + train."
    );
    let arl = &rows[0];
    for other in &rows[1..] {
        println!(
            "ARL / {}: train {:.2}×, whole step {:.2}×",
            other.name,
            other.train / arl.train,
            (other.logprobs + other.train) / (arl.logprobs + arl.train)
        );
    }
}
