//! `arl-bench-proxy`: what the token proxy adds to a call. A constant-answer backend (so
//! only the proxy's own cost is measured) is called directly and through the proxy — which
//! checks, forwards and records every call in JetStream on a private nats-server — at 1, 64
//! and 512 concurrent callers, streaming and not, over keep-alive HTTP/1.1. Prints p50/p99
//! latency of both, the overhead, and calls/s.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use arl_proxy::api::{self, Proxy, ProxyConfig};
use arl_proxy::backends::{Backends, Dialect};
use arl_proxy::client::HttpClient;
use arl_proxy::keys::Keys;
use arl_runtime::bus::BusConfig;
use arl_runtime::{Bus, Metrics, Shutdown};
use arl_schemas::rpc::TrialKeyRequestV1;
use arl_schemas::{RunId, TrialId};
use axum::response::IntoResponse;
use bytes::Bytes;
use http_body_util::BodyExt;
use serde_json::json;

const LEVELS: [usize; 3] = [1, 64, 512];

async fn constant_backend(shutdown: &Shutdown) -> anyhow::Result<std::net::SocketAddr> {
    let whole = json!({"prompt_token_ids": [1, 2, 3], "policy_version": 0, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "token_ids": [7, 8],
                     "logprobs": {"content": [{"logprob": -0.1}, {"logprob": -0.2}]}, "finish_reason": "stop"}]})
    .to_string();
    let streamed = format!(
        "data: {}\n\ndata: {}\n\ndata: [DONE]\n\n",
        json!({"prompt_token_ids": [1, 2, 3], "policy_version": 0, "choices": [{"index": 0, "delta": {"content": "o"}, "token_ids": [7], "logprobs": {"content": [{"logprob": -0.1}]}}]}),
        json!({"choices": [{"index": 0, "delta": {"content": "k"}, "token_ids": [8], "logprobs": {"content": [{"logprob": -0.2}]}, "finish_reason": "stop"}]})
    );
    let router = axum::Router::new().route(
        "/v1/chat/completions",
        axum::routing::post(move |body: Bytes| {
            let (whole, streamed) = (whole.clone(), streamed.clone());
            async move {
                if body.windows(14).any(|w| w == b"\"stream\":true") {
                    ([("content-type", "text/event-stream")], streamed).into_response()
                } else {
                    ([("content-type", "application/json")], whole).into_response()
                }
            }
        }),
    );
    Ok(arl_runtime::http::serve("127.0.0.1:0".parse()?, router, shutdown).await?)
}

struct Level {
    p50_ms: f64,
    p99_ms: f64,
    calls_per_s: f64,
}

async fn drive(
    client: &HttpClient,
    url: &str,
    stream: bool,
    concurrency: usize,
    total: usize,
) -> anyhow::Result<Level> {
    let body = Bytes::from(
        json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream})
            .to_string(),
    );
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let workers = (0..concurrency).map(|_| {
        let (client, body, next, url) =
            (client.clone(), body.clone(), next.clone(), url.to_owned());
        tokio::spawn(async move {
            let mut latencies = Vec::new();
            while next.fetch_add(1, Ordering::Relaxed) < total {
                let sent = Instant::now();
                let response = client.post_json(&url, body.clone()).await?;
                anyhow::ensure!(response.status() == 200, "status {}", response.status());
                let bytes = response.into_body().collect().await?.to_bytes();
                anyhow::ensure!(!bytes.is_empty());
                latencies.push(sent.elapsed().as_secs_f64() * 1000.0);
            }
            Ok::<_, anyhow::Error>(latencies)
        })
    });
    let mut latencies = Vec::new();
    for worker in futures::future::join_all(workers).await {
        latencies.extend(worker??);
    }
    let wall = started.elapsed().as_secs_f64();
    latencies.sort_by(f64::total_cmp);
    let at = |q: f64| latencies[((latencies.len() - 1) as f64 * q).round() as usize];
    Ok(Level {
        p50_ms: at(0.5),
        p99_ms: at(0.99),
        calls_per_s: latencies.len() as f64 / wall,
    })
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let server = arl_testkit::NatsServer::start()?;
    let shutdown = Shutdown::new();
    let bus = Bus::connect(
        BusConfig::new(server.url(), arl_testkit::test_namespace(), "bench"),
        Metrics::new(),
    )
    .await?;
    bus.provision().await?;
    let backend = constant_backend(&shutdown).await?;
    let keys = Arc::new(Keys::default());
    let key = keys.issue(&TrialKeyRequestV1 {
        run_id: RunId::new("run-bench")?,
        trial_id: TrialId::new("trial-bench")?,
        policy_version: 0,
        max_staleness: None,
    });
    let proxy = Proxy::new(
        bus,
        keys,
        Arc::new(Backends::new(vec![(
            Dialect::Arl,
            format!("http://{backend}"),
        )])),
        ProxyConfig {
            max_in_flight_per_run: 100_000,
            ..ProxyConfig::default()
        },
    );
    let proxy_addr =
        arl_runtime::http::serve("127.0.0.1:0".parse()?, api::router(proxy), &shutdown).await?;
    let client = HttpClient::new();
    let direct = format!("http://{backend}/v1/chat/completions");
    let through = format!("http://{proxy_addr}/{key}/v1/chat/completions");
    // Warm-up: connections, JetStream.
    drive(&client, &through, false, 64, 2000).await?;
    drive(&client, &direct, false, 64, 2000).await?;

    println!(
        "\nToken proxy overhead (constant-answer backend, every call recorded in JetStream), loopback"
    );
    println!(
        "{:>10} {:>7} {:>16} {:>16} {:>16} {:>11} {:>11}",
        "concurrent",
        "stream",
        "direct p50/p99",
        "proxy p50/p99",
        "added p50/p99",
        "direct c/s",
        "proxy c/s"
    );
    for stream in [false, true] {
        for concurrency in LEVELS {
            let total = (concurrency * 40).clamp(2000, 20_000);
            let d = drive(&client, &direct, stream, concurrency, total).await?;
            let p = drive(&client, &through, stream, concurrency, total).await?;
            println!(
                "{:>10} {:>7} {:>7.2}/{:<8.2} {:>7.2}/{:<8.2} {:>7.2}/{:<8.2} {:>11.0} {:>11.0}",
                concurrency,
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
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    shutdown.trigger();
    Ok(())
}
