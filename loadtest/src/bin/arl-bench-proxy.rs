//! `arl-bench-proxy`: what the token proxy adds to a call. Each part runs as its own
//! process, as deployed: the real `arl-proxy` binary (built beside this one), a
//! constant-answer backend (this binary with `--serve-backend`, so only the proxy's own
//! cost is measured), a private nats-server where the proxy records every call in
//! JetStream, and the callers (this process), over keep-alive HTTP/1.1 on loopback. The
//! backend is called directly and through the proxy at 1, 64 and 512 concurrent callers,
//! streaming and not (closed loops: each caller calls again as soon as answered, so the
//! high levels run the machine saturated), then at fixed rates of 1,000 and 5,000 calls/s
//! (open loops: the load an RL run's agents put on it); the tables give p50/p99 latency of
//! both, the difference, and calls/s.
//!
//! On a machine with at least 8 cores each part gets cores of its own (`taskset`), so the
//! difference is what the proxy costs rather than the parts queueing for the same cores;
//! with fewer, all parts share every core, and at high concurrency the difference is then
//! mostly the proxy's and nats-server's CPU time taken from the callers and the backend.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use arl_proxy::client::HttpClient;
use arl_runtime::bus::BusConfig;
use arl_runtime::{Bus, Metrics, Shutdown};
use arl_schemas::rpc::{ProxyOp, TrialKeyGrantV1, TrialKeyRequestV1};
use arl_schemas::{Namespace, RunId, TrialId};
use axum::response::IntoResponse;
use bytes::Bytes;
use clap::Parser;
use http_body_util::BodyExt;
use serde_json::json;

#[derive(Debug, Parser)]
#[command(
    name = "arl-bench-proxy",
    about = "token proxy overhead and throughput"
)]
struct Args {
    /// Concurrent callers per level.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 64, 512])]
    levels: Vec<usize>,
    /// Run every part on every core even where there are enough to give each its own.
    #[arg(long)]
    no_pin: bool,
    /// Internal: serve the constant-answer backend on this port until killed.
    #[arg(long, hide = true)]
    serve_backend: Option<u16>,
}

/// Which cores each part runs on (taskset lists).
#[derive(Debug)]
struct Layout {
    callers: &'static str,
    backend: &'static str,
    proxy: &'static str,
    nats: &'static str,
}

impl Layout {
    /// The callers get the most cores: at 512 in flight they must outrun the proxy for
    /// the proxy to be what is measured.
    fn for_cores(cores: usize) -> Option<Layout> {
        match cores {
            16.. => Some(Layout {
                callers: "0-5",
                backend: "6-7",
                proxy: "8-11",
                nats: "12-13",
            }),
            8.. => Some(Layout {
                callers: "0-2",
                backend: "3",
                proxy: "4-6",
                nats: "7",
            }),
            _ => None,
        }
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(port) = args.serve_backend {
        return runtime(None)?.block_on(serve_backend(port));
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let layout = if args.no_pin || Command::new("taskset").arg("-V").output().is_err() {
        None
    } else {
        Layout::for_cores(cores)
    };
    // Before the runtime starts, so that its threads inherit the callers' cores.
    if let Some(layout) = &layout {
        pin(std::process::id(), layout.callers)?;
    }
    let threads = layout.as_ref().map(|l| cpu_count(l.callers));
    runtime(threads)?.block_on(bench(&args.levels, layout, cores))
}

fn runtime(threads: Option<usize>) -> std::io::Result<tokio::runtime::Runtime> {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(threads) = threads {
        builder.worker_threads(threads);
    }
    builder.enable_all().build()
}

fn cpu_count(list: &str) -> usize {
    list.split(',')
        .map(|range| match range.split_once('-') {
            Some((a, b)) => b.parse::<usize>().unwrap_or(0) + 1 - a.parse::<usize>().unwrap_or(0),
            None => 1,
        })
        .sum()
}

/// Moves every thread of `pid` to `cpus`.
fn pin(pid: u32, cpus: &str) -> anyhow::Result<()> {
    let status = Command::new("taskset")
        .args(["-a", "-p", "-c", cpus, &pid.to_string()])
        .stdout(Stdio::null())
        .status()
        .context("taskset")?;
    anyhow::ensure!(status.success(), "taskset -p -c {cpus} {pid}: {status}");
    Ok(())
}

/// A command run on `cpus` when there is a layout.
fn on_cores(cpus: Option<&str>, program: &std::path::Path) -> Command {
    match cpus {
        Some(cpus) => {
            let mut command = Command::new("taskset");
            command.args(["-c", cpus]).arg(program);
            command
        }
        None => Command::new(program),
    }
}

async fn serve_backend(port: u16) -> anyhow::Result<()> {
    let whole = json!({"prompt_token_ids": [1, 2, 3], "policy_version": 0, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "token_ids": [7, 8],
                     "logprobs": {"content": [{"logprob": -0.1}, {"logprob": -0.2}]}, "finish_reason": "stop"}]})
    .to_string();
    let streamed = format!(
        "data: {}\n\ndata: {}\n\ndata: [DONE]\n\n",
        json!({"prompt_token_ids": [1, 2, 3], "policy_version": 0, "choices": [{"index": 0, "delta": {"content": "o"}, "token_ids": [7], "logprobs": {"content": [{"logprob": -0.1}]}}]}),
        json!({"choices": [{"index": 0, "delta": {"content": "k"}, "token_ids": [8], "logprobs": {"content": [{"logprob": -0.2}]}, "finish_reason": "stop"}]})
    );
    let models =
        json!({"object": "list", "data": [{"id": "m", "object": "model", "policy_version": 0}]})
            .to_string();
    let router = axum::Router::new()
        .route(
            "/v1/chat/completions",
            axum::routing::post(move |body: Bytes| {
                let (whole, streamed) = (whole.clone(), streamed.clone());
                async move {
                    let request: serde_json::Value =
                        serde_json::from_slice(&body).unwrap_or_default();
                    if request["stream"] == true {
                        ([("content-type", "text/event-stream")], streamed).into_response()
                    } else {
                        ([("content-type", "application/json")], whole).into_response()
                    }
                }
            }),
        )
        .route(
            "/v1/models",
            axum::routing::get(move || {
                let models = models.clone();
                async move { ([("content-type", "application/json")], models).into_response() }
            }),
        );
    let shutdown = Shutdown::new();
    arl_runtime::http::serve(([127, 0, 0, 1], port).into(), router, &shutdown).await?;
    shutdown.triggered().await;
    Ok(())
}

struct Level {
    p50_ms: f64,
    p99_ms: f64,
    calls_per_s: f64,
}

impl Level {
    /// From every call's latency (ms) and the wall time (s) they took.
    fn of(mut latencies: Vec<f64>, wall_s: f64) -> Level {
        latencies.sort_by(f64::total_cmp);
        let at = |q: f64| latencies[((latencies.len() - 1) as f64 * q).round() as usize];
        Level {
            p50_ms: at(0.5),
            p99_ms: at(0.99),
            calls_per_s: latencies.len() as f64 / wall_s,
        }
    }
}

fn request_body(stream: bool) -> Bytes {
    Bytes::from(
        json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream})
            .to_string(),
    )
}

/// One call, checked; its latency in ms.
async fn timed_call(
    client: &HttpClient,
    url: &str,
    body: Bytes,
    stream: bool,
) -> anyhow::Result<f64> {
    let sent = Instant::now();
    let response = client.post_json(url, body).await?;
    anyhow::ensure!(response.status() == 200, "status {}", response.status());
    let bytes = response.into_body().collect().await?.to_bytes();
    check_answer(&bytes, stream)?;
    Ok(sent.elapsed().as_secs_f64() * 1000.0)
}

async fn drive(
    client: &HttpClient,
    url: &str,
    stream: bool,
    concurrency: usize,
    total: usize,
) -> anyhow::Result<Level> {
    let body = request_body(stream);
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let workers = (0..concurrency).map(|_| {
        let (client, body, next, url) =
            (client.clone(), body.clone(), next.clone(), url.to_owned());
        tokio::spawn(async move {
            let mut latencies = Vec::new();
            while next.fetch_add(1, Ordering::Relaxed) < total {
                latencies.push(timed_call(&client, &url, body.clone(), stream).await?);
            }
            Ok::<_, anyhow::Error>(latencies)
        })
    });
    let mut latencies = Vec::new();
    for worker in futures::future::join_all(workers).await {
        latencies.extend(worker??);
    }
    Ok(Level::of(latencies, started.elapsed().as_secs_f64()))
}

/// Calls started at a fixed `rate` whatever the answers' pace (an open loop, like many
/// agents each calling now and then), for `seconds`: the latency at a load the machine
/// carries, where the closed loops above measure it saturated.
async fn paced(
    client: &HttpClient,
    url: &str,
    stream: bool,
    rate: u32,
    seconds: u32,
) -> anyhow::Result<Level> {
    let body = request_body(stream);
    let total = rate * seconds;
    let interval = Duration::from_secs(1) / rate;
    let started = tokio::time::Instant::now();
    let mut calls = Vec::with_capacity(total as usize);
    for i in 0..total {
        tokio::time::sleep_until(started + interval * i).await;
        let (client, body, url) = (client.clone(), body.clone(), url.to_owned());
        calls.push(tokio::spawn(async move {
            timed_call(&client, &url, body, stream).await
        }));
    }
    let mut latencies = Vec::with_capacity(calls.len());
    for call in futures::future::join_all(calls).await {
        latencies.push(call??);
    }
    Ok(Level::of(latencies, started.elapsed().as_secs_f64()))
}

/// The whole answer came back, in the form asked for (an error event in place of
/// `[DONE]` would mean the call was not recorded).
fn check_answer(bytes: &[u8], stream: bool) -> anyhow::Result<()> {
    let text = std::str::from_utf8(bytes)?;
    let complete = if stream {
        text.contains("\"token_ids\":[8]") && text.ends_with("data: [DONE]\n\n")
    } else {
        text.starts_with('{') && text.contains("\"token_ids\":[7,8]")
    };
    anyhow::ensure!(complete, "unexpected answer (stream {stream}): {text}");
    Ok(())
}

async fn wait_listening(port: u16, what: &str, child: &mut Child) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_err()
    {
        if let Some(status) = child.try_wait()? {
            bail!("{what} exited with {status} before listening");
        }
        if Instant::now() > deadline {
            bail!("{what} did not listen on port {port} within 30 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// A trial key from the proxy, over NATS as the rollout service gets one.
async fn issue_key(bus: &Bus) -> anyhow::Result<TrialKeyGrantV1> {
    let request = TrialKeyRequestV1 {
        run_id: RunId::new("run-bench")?,
        trial_id: TrialId::new("trial-bench")?,
        policy_version: 0,
        max_staleness: None,
    };
    let subject = bus.namespace().proxy_rpc("any", ProxyOp::Issue);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match bus
            .request::<_, TrialKeyGrantV1>(subject.clone(), &request, Duration::from_secs(2))
            .await
        {
            Ok(grant) => return Ok(grant),
            Err(err) if Instant::now() > deadline => bail!("no trial key from arl-proxy: {err}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

async fn bench(levels: &[usize], layout: Option<Layout>, cores: usize) -> anyhow::Result<()> {
    let exe = std::env::current_exe()?;
    let proxy_bin: PathBuf = exe.with_file_name("arl-proxy");
    anyhow::ensure!(
        proxy_bin.exists(),
        "{} is missing: build it in the same profile (cargo build --release -p arl-proxy)",
        proxy_bin.display()
    );
    let server = arl_testkit::NatsServer::start()?;
    if let (Some(layout), Some(pid)) = (&layout, server.pid()) {
        pin(pid, layout.nats)?;
    }
    let logs = tempfile::Builder::new()
        .prefix("arl-bench-proxy-")
        .tempdir()?;
    // Stopped when the bench ends, however it ends.
    let mut parts = arl_testkit::Children(Vec::new());

    let backend_port = arl_testkit::free_port()?;
    let mut backend = on_cores(layout.as_ref().map(|l| l.backend), &exe)
        .args(["--serve-backend", &backend_port.to_string()])
        .stdout(Stdio::null())
        .spawn()
        .context("starting the backend")?;
    let listening = wait_listening(backend_port, "the backend", &mut backend).await;
    parts.0.push(backend);
    listening?;

    let proxy_port = arl_testkit::free_port()?;
    let proxy_log = logs.path().join("arl-proxy.log");
    let mut proxy = on_cores(layout.as_ref().map(|l| l.proxy), &proxy_bin)
        .args(["--nats-url", &server.url()])
        .args(["--listen", &format!("127.0.0.1:{proxy_port}")])
        .args(["--backend", &format!("arl=http://127.0.0.1:{backend_port}")])
        .args(["--max-in-flight-per-run", "1000000"])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&proxy_log)?)
        .spawn()
        .context("starting arl-proxy")?;
    let listening = wait_listening(proxy_port, "arl-proxy", &mut proxy).await;
    parts.0.push(proxy);
    listening.with_context(|| std::fs::read_to_string(&proxy_log).unwrap_or_default())?;

    let bus = Bus::connect(
        BusConfig::new(server.url(), Namespace::from_option(None)?, "bench"),
        Metrics::new(),
    )
    .await?;
    let grant = issue_key(&bus).await?;
    let client = HttpClient::new();
    let direct = format!("http://127.0.0.1:{backend_port}/v1/chat/completions");
    let through = format!("{}/chat/completions", grant.base_url);
    // Warm-up: connections, JetStream.
    drive(&client, &through, false, 64, 4000).await?;
    drive(&client, &direct, false, 64, 4000).await?;

    println!(
        "\nToken proxy overhead (arl-proxy process, constant-answer backend, every call recorded in JetStream), loopback"
    );
    match &layout {
        Some(l) => println!(
            "{cores} cores, each part on its own: callers {}, backend {}, arl-proxy {}, nats-server {}",
            l.callers, l.backend, l.proxy, l.nats
        ),
        None => println!(
            "{cores} cores shared by callers, backend, arl-proxy and nats-server (no pinning)"
        ),
    }
    print_header("concurrent");
    for stream in [false, true] {
        for &concurrency in levels {
            let total = (concurrency * 40).clamp(4000, 40_000);
            let d = drive(&client, &direct, stream, concurrency, total).await?;
            let p = drive(&client, &through, stream, concurrency, total).await?;
            print_row(&concurrency.to_string(), stream, &d, &p);
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    println!("\nOpen loop: calls started at a fixed rate for 4 s, each counted from its start");
    print_header("calls/s");
    for stream in [false, true] {
        for rate in [1_000, 5_000] {
            let d = paced(&client, &direct, stream, rate, 4).await?;
            let p = paced(&client, &through, stream, rate, 4).await?;
            print_row(&rate.to_string(), stream, &d, &p);
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    Ok(())
}

fn print_header(load: &str) {
    println!(
        "{load:>10} {:>7} {:>16} {:>16} {:>16} {:>11} {:>11}",
        "stream", "direct p50/p99", "proxy p50/p99", "added p50/p99", "direct c/s", "proxy c/s"
    );
}

fn print_row(load: &str, stream: bool, d: &Level, p: &Level) {
    println!(
        "{:>10} {:>7} {:>7.2}/{:<8.2} {:>7.2}/{:<8.2} {:>7.2}/{:<8.2} {:>11.0} {:>11.0}",
        load,
        stream,
        d.p50_ms,
        d.p99_ms,
        p.p50_ms,
        p.p99_ms,
        p.p50_ms - d.p50_ms,
        p.p99_ms - d.p99_ms,
        d.calls_per_s,
        p.calls_per_s
    );
}
