//! `arl-bench-engine`: the batching engine itself (no HTTP) on the CPU or a GPU — decode
//! tokens/s at several batch sizes, p50/p99 time per output token, prefill tokens/s — and,
//! with `--torch-python`, Hugging Face `generate()` on the same device, shapes and batch
//! sizes in the same run (scripts/bench_generate_torch.py), the figure to compare with.
//!
//! `--model smollm2` serves SmolLM2-135M's GGUF weights; `qwen2.5-0.5b` serves random
//! weights of Qwen2.5-0.5B's shapes (nothing to download; the prompts are random token
//! ids). Every request is greedy with no stop token, so each decodes exactly
//! `--new-tokens`.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use arl_inference::device::{Device, DeviceKind, GpuMemory};
use arl_inference::engine::{
    EngineConfig, EngineHandle, Event, Request, SamplingParams, ServedModel,
};
use arl_model::config::ModelConfig;
use arl_model::cuda::Cuda;
use arl_model::generate::Rng;
use arl_model::load::LoadedModel;
use arl_model::model::Model;
use arl_model::tokenizer::Tokenizer;
use arl_model::weights::Weights;
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "Decode and prefill throughput of the inference engine, next to HF generate()")]
struct Args {
    #[arg(long, value_enum, default_value_t = DeviceKind::Cpu)]
    device: DeviceKind,
    /// GPU ordinal with --device cuda.
    #[arg(long, default_value_t = 0)]
    gpu: usize,
    /// smollm2 (the GGUF `make models` installs) or qwen2.5-0.5b (random weights).
    #[arg(long, default_value = "smollm2")]
    model: String,
    /// Sequences decoded together, one measurement each.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
    batches: Vec<usize>,
    #[arg(long, default_value_t = 32)]
    prompt_len: usize,
    #[arg(long, default_value_t = 128)]
    new_tokens: usize,
    /// Prefill: this many prompts of --prefill-len tokens at once, one token generated.
    #[arg(long, default_value_t = 8)]
    prefill_prompts: usize,
    #[arg(long, default_value_t = 512)]
    prefill_len: usize,
    /// A Python with torch and transformers: also time HF generate() in this run.
    #[arg(long)]
    torch_python: Option<PathBuf>,
    #[arg(long, default_value = "scripts/bench_generate_torch.py")]
    torch_script: PathBuf,
}

type Result<T> = std::result::Result<T, String>;

/// The model to serve: SmolLM2's own weights, or random ones of Qwen2.5's shapes (with a
/// one-token tokenizer: the engine reads token ids, and nothing here is text).
fn load(name: &str) -> Result<LoadedModel> {
    if name == "smollm2" {
        let path = arl_runtime::args::default_model_dir().join("SmolLM2-135M-Instruct.Q4_1.gguf");
        return LoadedModel::open(&path)
            .map_err(|e| format!("{} (run `make models`): {e}", path.display()));
    }
    let config = ModelConfig::qwen25(name).ok_or_else(|| {
        format!("--model must be smollm2, qwen2.5-0.5b or qwen2.5-1.5b, not {name:?}")
    })?;
    let tokenizer = Tokenizer::from_json(
        r#"{"version":"1.0","model":{"type":"WordLevel","vocab":{"<unk>":0},"unk_token":"<unk>"}}"#,
    )
    .map_err(|e| e.to_string())?;
    Ok(LoadedModel {
        model: Model::new(config.clone(), Weights::random(&config, 7, 0.02)),
        tokenizer,
        chat_template: None,
        source: format!("random {name} weights"),
        format: "random",
        chat_template_source: None,
    })
}

/// One measurement: `prompts` submitted at once, each greedy for `tokens` tokens.
struct Run {
    /// Seconds from submission to the last token.
    total_s: f64,
    /// Tokens generated after each sequence's first, over the time from the last first
    /// token to the last token: the steady decode rate of the whole batch.
    decode_tok_s: f64,
    /// Time between consecutive tokens of a sequence, over all sequences (seconds).
    per_token: Vec<f64>,
}

fn run(engine: &EngineHandle, prompts: &[Vec<u32>], tokens: usize) -> Result<Run> {
    let started = Instant::now();
    let mut receivers = Vec::new();
    for prompt in prompts {
        let (events, receiver) = tokio::sync::mpsc::unbounded_channel();
        engine
            .submit(Request {
                prompt: prompt.clone(),
                n: 1,
                params: SamplingParams::greedy(tokens, 0),
                session: None,
                events,
                cancel: vec![Arc::new(AtomicBool::new(false))],
            })
            .map_err(|e| e.to_string())?;
        receivers.push(receiver);
    }
    // A thread per request stamps each token as it arrives (read one after another, later
    // requests' tokens would be stamped when read, not when sent).
    let stamped: Vec<Result<Vec<f64>>> = std::thread::scope(|scope| {
        let readers: Vec<_> = receivers
            .into_iter()
            .map(|mut receiver| {
                scope.spawn(move || {
                    let mut times = Vec::new();
                    loop {
                        match receiver.blocking_recv() {
                            Some(Event::Token { .. }) => {
                                times.push(started.elapsed().as_secs_f64())
                            }
                            Some(Event::Finished { .. }) => return Ok(times),
                            Some(Event::Aborted { message, .. }) => {
                                return Err(format!("aborted: {message}"));
                            }
                            Some(Event::Started { .. }) => {}
                            None => return Err("the engine stopped".to_owned()),
                        }
                    }
                })
            })
            .collect();
        readers
            .into_iter()
            .map(|r| r.join().unwrap_or_else(|_| Err("a reader panicked".into())))
            .collect()
    });
    let (mut firsts, mut lasts, mut per_token, mut after_first) =
        (Vec::new(), Vec::new(), Vec::new(), 0);
    for times in stamped {
        let times = times?;
        let (Some(&first), Some(&last)) = (times.first(), times.last()) else {
            return Err("a request finished without a token".into());
        };
        per_token.extend(times.windows(2).map(|w| w[1] - w[0]));
        after_first += times.len() - 1;
        firsts.push(first);
        lasts.push(last);
    }
    let last = lasts.iter().copied().fold(0.0, f64::max);
    let decode_from = firsts.iter().copied().fold(0.0, f64::max);
    Ok(Run {
        total_s: last,
        decode_tok_s: after_first as f64 / (last - decode_from).max(1e-9),
        per_token,
    })
}

fn percentile(values: &mut [f64], p: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort_by(f64::total_cmp);
    values[((values.len() - 1) as f64 * p).round() as usize]
}

fn random_prompts(count: usize, len: usize, vocab: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut rng = Rng::new(seed);
    // Ids the tokenizer and every model here know (SmolLM2's vocabulary is the smallest).
    let ids = vocab.min(49_152) as f32;
    (0..count)
        .map(|_| {
            (0..len)
                .map(|_| (rng.next_f32() * (ids - 1.0)) as u32)
                .collect()
        })
        .collect()
}

/// HF generate() rows from the script: (batch, decode tok/s, per-token ms).
fn torch_rows(args: &Args, python: &PathBuf) -> Result<Vec<serde_json::Value>> {
    let batches: Vec<String> = args.batches.iter().map(ToString::to_string).collect();
    let output = std::process::Command::new(python)
        .arg(&args.torch_script)
        .args(["--model", &args.model, "--prompt-len"])
        .arg(args.prompt_len.to_string())
        .arg("--new-tokens")
        .arg(args.new_tokens.to_string())
        .arg("--batches")
        .arg(batches.join(","))
        .output()
        .map_err(|e| format!("{}: {e}", python.display()))?;
    if !output.status.success() {
        return Err(format!(
            "{} failed: {}",
            args.torch_script.display(),
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).map_err(|e| format!("{l}: {e}")))
        .collect()
}

/// With ARL_CUDA_PROFILE=1 on a GPU: (kernel or product, calls, seconds) since the last
/// call; empty otherwise.
fn take_profile(device: &Device) -> Vec<(&'static str, u64, f64)> {
    match device {
        Device::Cuda { gpu, .. } => gpu.take_profile(),
        Device::Cpu => Vec::new(),
    }
}

/// Decode tokens/s of `prompts` with a GPU setting (`set`: graphs, the few-row kernels)
/// turned off for the run and back on after it; None on the CPU, which has neither.
fn decode_without(
    device: &Device,
    set: fn(&Cuda, bool),
    engine: &EngineHandle,
    prompts: &[Vec<u32>],
    tokens: usize,
) -> Result<Option<f64>> {
    let Device::Cuda { gpu, .. } = device else {
        return Ok(None);
    };
    set(gpu, false);
    let without = run(engine, prompts, tokens);
    set(gpu, true);
    Ok(Some(without?.decode_tok_s))
}

/// The engine's steps so far and their host time (µs): [steps, forward, draw, emit].
fn step_times(engine: &EngineHandle) -> [u64; 4] {
    use std::sync::atomic::Ordering::Relaxed;
    let s = &engine.stats;
    [&s.steps, &s.forward_us, &s.draw_us, &s.emit_us].map(|c| c.load(Relaxed))
}

/// (replayed, captured, eager) decode steps so far on a GPU.
fn graph_stats(device: &Device) -> Option<arl_model::cuda::GraphStats> {
    match device {
        Device::Cuda { gpu, .. } => Some(gpu.graph_stats()),
        Device::Cpu => None,
    }
}

/// Where a decode step's device time went (each kernel run alone and timed on the GPU, so the
/// run itself is slower than the table's figures).
fn print_profile(rows: &[(&'static str, u64, f64)], batch: usize, steps: usize) {
    if rows.is_empty() {
        return;
    }
    let total: f64 = rows.iter().map(|r| r.2).sum();
    println!(
        "\nbatch {batch}, per decode step, ARL_CUDA_PROFILE=1 (GPU time of each kernel between events, each run alone; {:.2} ms in all):",
        total * 1e3 / steps as f64
    );
    for (name, calls, seconds) in rows.iter().take(16) {
        println!(
            "  {name:<24} {:>6} calls {:>8.3} ms {:>5.1}%",
            calls / steps as u64,
            seconds * 1e3 / steps as f64,
            100.0 * seconds / total
        );
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    arl_model::ops::retain_freed_memory();
    let started = Instant::now();
    let loaded = load(&args.model)?;
    let widest = args
        .batches
        .iter()
        .copied()
        .max()
        .unwrap_or(1)
        .max(args.prefill_prompts);
    // Every batch's prompts in one step: decode is what is measured.
    let prefill_chunk = (widest * args.prompt_len).max(args.prefill_prompts * args.prefill_len);
    // A KV cache for the widest batch (with room to spare), not most of the GPU: HF
    // generate() runs on the same GPU while this process still holds it.
    let config = &loaded.model.config;
    let per_token = config.num_hidden_layers * 2 * config.kv_dim() * size_of::<f32>();
    let longest = args.prefill_len.max(args.prompt_len + args.new_tokens) + 16;
    let memory = GpuMemory {
        kv_cache_bytes: Some(2 * widest * longest * per_token),
        max_batch: widest,
        prefill_chunk,
        ..GpuMemory::default()
    };
    let device =
        Device::open(args.device, args.gpu, memory).map_err(|e| format!("--device: {e}"))?;
    let vocab = loaded.model.config.vocab_size;
    let served = ServedModel::new(None, 0, loaded, &device).map_err(|e| e.to_string())?;
    eprintln!(
        "{} on {} ready in {:.1} s",
        args.model,
        device.name(),
        started.elapsed().as_secs_f64()
    );
    let engine = EngineHandle::start(
        EngineConfig {
            max_batch: widest,
            queue_limit: widest,
            prefill_chunk,
            max_model_len: args.prefill_len.max(args.prompt_len + args.new_tokens) + 1,
            prefix_cache_tokens: 0,
            device: device.clone(),
            ..EngineConfig::default()
        },
        Some(served),
    )
    .map_err(|e| e.to_string())?;

    // Warm-up (kernel compilation, allocator pools).
    run(&engine, &random_prompts(2, args.prompt_len, vocab, 1), 4)?;

    let prefill_prompts = random_prompts(args.prefill_prompts, args.prefill_len, vocab, 2);
    let prefill = run(&engine, &prefill_prompts, 1)?;
    let prefill_tok_s = (args.prefill_prompts * args.prefill_len) as f64 / prefill.total_s;

    let mut rows = Vec::new();
    for (i, &batch) in args.batches.iter().enumerate() {
        let prompts = random_prompts(batch, args.prompt_len, vocab, 10 + i as u64);
        // The same decode without CUDA graphs first, and with every product on cuBLAS:
        // what the graphs and the few-row kernels buy, in this run.
        let eager = decode_without(
            &device,
            Cuda::set_graphs,
            &engine,
            &prompts,
            args.new_tokens,
        )?;
        let plain = decode_without(&device, Cuda::set_gemv, &engine, &prompts, args.new_tokens)?;
        take_profile(&device);
        let before = graph_stats(&device);
        let steps_before = step_times(&engine);
        let mut measured = run(&engine, &prompts, args.new_tokens)?;
        let host = {
            let after = step_times(&engine);
            let steps = (after[0] - steps_before[0]).max(1) as f64;
            let part = |i: usize| (after[i] - steps_before[i]) as f64 / steps;
            format!(
                "{steps:.0} steps, host µs per step: forward {:.0}, draw {:.0}, emit {:.0}",
                part(1),
                part(2),
                part(3)
            )
        };
        let graphs = graph_stats(&device).zip(before).map(|(after, before)| {
            let planned = (after.replayed + after.captured + after.eager)
                - (before.replayed + before.captured + before.eager);
            let timed = (after.replays_timed - before.replays_timed).max(1) as f64;
            let captured = after.captured - before.captured;
            format!(
                "{}/{captured}/{}, plan {:.0} µs, capture {:.1} ms, graph GPU {:.0} µs",
                after.replayed - before.replayed,
                after.eager - before.eager,
                (after.plan_us - before.plan_us) as f64 / planned.max(1) as f64,
                (after.capture_us - before.capture_us) as f64 / 1e3 / captured.max(1) as f64,
                (after.replay_gpu_us - before.replay_gpu_us) as f64 / timed
            )
        });
        print_profile(&take_profile(&device), batch, args.new_tokens);
        eprintln!("batch {batch}: {host}");
        if let Device::Cuda { gpu, .. } = &device
            && let Some(why) = gpu.graph_failure()
        {
            eprintln!("batch {batch}: a graph capture failed: {why}");
        }
        let p50 = percentile(&mut measured.per_token, 0.5) * 1e3;
        let p99 = percentile(&mut measured.per_token, 0.99) * 1e3;
        rows.push((batch, measured.decode_tok_s, p50, p99, eager, plain, graphs));
    }
    let torch = match &args.torch_python {
        Some(python) => torch_rows(&args, python)?,
        None => Vec::new(),
    };

    println!(
        "\narl-bench-engine: {} on {}, {}-token prompts, {} new tokens, greedy",
        args.model,
        device.name(),
        args.prompt_len,
        args.new_tokens
    );
    println!(
        "prefill: {:.0} tok/s ({} prompts of {} tokens at once)",
        prefill_tok_s, args.prefill_prompts, args.prefill_len
    );
    println!(
        "{:>6} {:>14} {:>18} {:>16} {:>8} {:>18} {:>22} {:>56}",
        "batch",
        "ARL tok/s",
        "ARL ms/token p50/p99",
        "HF generate tok/s",
        "ratio",
        "no graphs tok/s",
        "cuBLAS only tok/s",
        "steps replayed/captured/eager, host plan per step, each capture, GPU per step"
    );
    for (batch, tok_s, p50, p99, eager, plain, graphs) in rows {
        let hf = torch
            .iter()
            .find(|r| r["batch"].as_u64() == Some(batch as u64))
            .and_then(|r| r["tok_s"].as_f64());
        let (hf_text, ratio) = match hf {
            Some(hf) => (format!("{hf:.0}"), format!("{:.2}x", tok_s / hf)),
            None => ("-".into(), "-".into()),
        };
        let eager = eager.map_or("-".into(), |e| format!("{e:.0} ({:.2}x)", tok_s / e));
        let plain = plain.map_or("-".into(), |e| format!("{e:.0} ({:.2}x)", tok_s / e));
        let graphs = graphs.unwrap_or_else(|| "-".into());
        println!(
            "{batch:>6} {tok_s:>14.0} {:>10.2}/{:<7.2} {hf_text:>16} {ratio:>8} {eager:>18} {plain:>22} {graphs:>56}",
            p50, p99
        );
    }
    Ok(())
}
