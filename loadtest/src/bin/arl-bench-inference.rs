//! `arl-bench-inference`: the inference server's throughput and latency at 1, 4 and 16
//! concurrent requests, against llama.cpp's own server (PyPI xllamacpp) on the same GGUF,
//! prompts and concurrency, measured in the same run. Both are driven over HTTP with
//! `/v1/completions` (token-id prompts, greedy, `ignore_eos`, a fixed number of tokens).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use arl_inference::api::{self, AppState, InferenceMetrics};
use arl_inference::device::Device;
use arl_inference::engine::{EngineConfig, EngineHandle, ServedModel};
use arl_model::load::LoadedModel;
use arl_runtime::{Metrics, Shutdown};
use arl_testkit::Children;
use serde_json::{Value, json};

const CONCURRENCY: [usize; 3] = [1, 4, 16];
const MAX_TOKENS: usize = 48;
/// Requests per concurrent client at each level.
const ROUNDS: usize = 3;

fn cache_dir() -> PathBuf {
    std::env::var_os("ARL_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/arl")
        })
}

struct Level {
    tokens_per_second: f64,
    p50: f64,
    p99: f64,
}

/// `concurrency` clients, each sending ROUNDS requests back to back.
async fn drive(base: &str, prompts: &[Vec<u32>], concurrency: usize) -> anyhow::Result<Level> {
    let next = Arc::new(AtomicUsize::new(0));
    let total = concurrency * ROUNDS;
    let started = Instant::now();
    let clients = (0..concurrency).map(|_| {
        let next = next.clone();
        async move {
            let mut seen = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= total {
                    return Ok::<_, anyhow::Error>(seen);
                }
                let body = json!({"prompt": prompts[i % prompts.len()], "max_tokens": MAX_TOKENS,
                                  "temperature": 0, "ignore_eos": true});
                let sent = Instant::now();
                let response = arl_testkit::http(
                    &format!("{base}/v1/completions"),
                    "POST",
                    &[("content-type", "application/json")],
                    body.to_string().as_bytes(),
                )
                .await?;
                anyhow::ensure!(response.status == 200, "{}", response.text());
                let value: Value = serde_json::from_slice(&response.body)?;
                let tokens = value["usage"]["completion_tokens"].as_u64().unwrap_or(0);
                seen.push((sent.elapsed().as_secs_f64(), tokens));
            }
        }
    });
    let results = futures::future::try_join_all(clients).await?;
    let wall = started.elapsed().as_secs_f64();
    let mut latencies: Vec<f64> = results.iter().flatten().map(|r| r.0).collect();
    let tokens: u64 = results.iter().flatten().map(|r| r.1).sum();
    latencies.sort_by(f64::total_cmp);
    let at = |q: f64| latencies[((latencies.len() - 1) as f64 * q).round() as usize];
    Ok(Level {
        tokens_per_second: tokens as f64 / wall,
        p50: at(0.5),
        p99: at(0.99),
    })
}

fn start_llama_cpp(model: &Path, port: u16, threads: usize) -> anyhow::Result<Children> {
    let python = std::env::var_os("ARL_TOOLS_PYTHON")
        .map(PathBuf::from)
        .unwrap_or(cache_dir().join("tools/bin/python"));
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/llamacpp_server.py");
    let mut child = std::process::Command::new(python)
        .arg(script)
        .arg(model)
        .arg(port.to_string())
        .arg(CONCURRENCY[CONCURRENCY.len() - 1].to_string())
        .arg(threads.to_string())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .context("starting llama.cpp's server (run `make deps`)")?;
    let stdout = child.stdout.take().context("no stdout")?;
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line)?;
    anyhow::ensure!(
        line.starts_with("ready"),
        "llama.cpp server did not start: {line:?}"
    );
    Ok(Children(vec![child]))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // As arl-inference does at start.
    arl_model::ops::retain_freed_memory();
    let path = std::env::var_os("ARL_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or(cache_dir().join("models"))
        .join("SmolLM2-135M-Instruct.Q4_1.gguf");
    let loaded = LoadedModel::open(&path)
        .with_context(|| format!("{} (run `make models`)", path.display()))?;
    let prompts: Vec<Vec<u32>> = (0..16)
        .map(|i| {
            loaded.tokenizer.encode(&format!(
                "<|im_start|>user\nQuestion {i}: explain, step by step, how a {} works and why it matters.<|im_end|>\n<|im_start|>assistant\n",
                ["bicycle", "compiler", "refrigerator", "bridge"][i % 4]
            ))
        })
        .collect::<Result<_, _>>()?;

    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let engine = EngineHandle::start(
        EngineConfig {
            max_batch: 16,
            queue_limit: 256,
            ..EngineConfig::default()
        },
        Some(ServedModel::new(None, 0, loaded, &Device::Cpu)?),
    )?;
    let shutdown = Shutdown::new();
    let metrics = InferenceMetrics::register(&Metrics::new(), "policy", &engine);
    let state = AppState {
        engine,
        model_name: "policy".into(),
        aliases: Vec::new(),
        metrics,
    };
    let arl =
        arl_runtime::http::serve("127.0.0.1:0".parse()?, api::router(state), &shutdown).await?;
    let port = arl_testkit::free_port()?;
    let _llama = start_llama_cpp(&path, port, threads)?;
    let servers = [
        ("ARL", format!("http://{arl}")),
        ("llama.cpp", format!("http://127.0.0.1:{port}")),
    ];
    let mut results: Vec<Vec<Level>> = Vec::new();
    for (_, base) in &servers {
        drive(base, &prompts[..1], 1).await?; // warm-up
        let mut levels = Vec::new();
        for c in CONCURRENCY {
            levels.push(drive(base, &prompts, c).await?);
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        results.push(levels);
    }
    println!(
        "\nInference server, SmolLM2-135M-Instruct (Q4_1 GGUF), {MAX_TOKENS} tokens per request, /v1/completions over HTTP, {threads} threads"
    );
    println!(
        "{:>11} {:>11} {:>11} {:>7}   {:>17} {:>17}",
        "concurrent", "ARL tok/s", "llama tok/s", "ratio", "ARL p50/p99 s", "llama p50/p99 s"
    );
    for (i, c) in CONCURRENCY.iter().enumerate() {
        let (a, l) = (&results[0][i], &results[1][i]);
        println!(
            "{:>11} {:>11.1} {:>11.1} {:>6.2}x   {:>8.2}/{:<8.2} {:>8.2}/{:<8.2}",
            c,
            a.tokens_per_second,
            l.tokens_per_second,
            a.tokens_per_second / l.tokens_per_second,
            a.p50,
            a.p99,
            l.p50,
            l.p99
        );
    }
    shutdown.trigger();
    Ok(())
}
