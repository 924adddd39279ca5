//! `arl-bench-rollout`: what the rollout orchestration itself costs per trial. Every
//! service a trial touches runs for real on a private nats-server — controller, dataset
//! service, token proxy, reward service, rollout — but the agent is scripted (the built-in
//! math agent: one LLM call) and the model is a constant-answer backend, so the time is
//! the orchestration's: the work queue, the exactly-once record, the proxy key, the call
//! and its record, collecting the calls, the grade, the trajectory. At 100 and 2,000
//! trials in flight (one batch of that many trials, one rollout replica), next to the
//! same number of direct backend calls at the same concurrency, in the same run.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use arl_controller::{Controller, ControllerConfig};
use arl_dataset::service::DatasetService;
use arl_proxy::api::{self, Proxy, ProxyConfig};
use arl_proxy::backends::{Backends, Dialect};
use arl_proxy::client::HttpClient;
use arl_proxy::keys::Keys;
use arl_reward::service::{RewardConfig, RewardService};
use arl_rollout::service::{Rollout, RolloutConfig};
use arl_runtime::bus::BusConfig;
use arl_runtime::{Bus, Metrics, Shutdown};
use arl_schemas::events::{Example, RunRequestedV1};
use arl_schemas::spec::{DataSource, RunSpec};
use arl_schemas::{Domain, RunId};
use bytes::Bytes;
use futures::StreamExt;
use http_body_util::BodyExt;
use serde_json::json;

const LEVELS: [usize; 2] = [100, 2000];

async fn constant_backend(shutdown: &Shutdown) -> anyhow::Result<std::net::SocketAddr> {
    let whole = json!({"prompt_token_ids": [1, 2, 3], "policy_version": 0, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "2 + 2 = 4\n#### 4"}, "token_ids": [7, 8],
                     "logprobs": {"content": [{"logprob": -0.1}, {"logprob": -0.2}]}, "finish_reason": "stop"}]})
    .to_string();
    let router = axum::Router::new()
        .route(
            "/v1/chat/completions",
            axum::routing::post(move || {
                let whole = whole.clone();
                async move { ([("content-type", "application/json")], whole) }
            }),
        )
        .route(
            "/v1/models",
            axum::routing::get(|| async { axum::Json(json!({"data": []})) }),
        );
    Ok(arl_runtime::http::serve("127.0.0.1:0".parse()?, router, shutdown).await?)
}

/// `total` direct calls to the backend, `concurrency` at a time: the wall time.
async fn direct_calls(url: &str, concurrency: usize, total: usize) -> anyhow::Result<f64> {
    let client = HttpClient::new();
    let body = Bytes::from(
        json!({"model": "m", "messages": [{"role": "user", "content": "2+2?"}]}).to_string(),
    );
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let workers = (0..concurrency).map(|_| {
        let (client, body, next, url) =
            (client.clone(), body.clone(), next.clone(), url.to_owned());
        tokio::spawn(async move {
            while next.fetch_add(1, Ordering::Relaxed) < total {
                let response = client.post_json(&url, body.clone()).await?;
                anyhow::ensure!(response.status() == 200);
                response.into_body().collect().await?;
            }
            Ok::<_, anyhow::Error>(())
        })
    });
    for worker in futures::future::join_all(workers).await {
        worker??;
    }
    Ok(started.elapsed().as_secs_f64())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // Warnings (failed trials, retries) go to stderr; RUST_LOG=info shows every trial.
    let _telemetry = arl_runtime::telemetry::init("arl-bench-rollout", None)?;
    let levels: Vec<usize> = std::env::var("ARL_BENCH_LEVELS")
        .ok()
        .map(|v| v.split(',').filter_map(|l| l.trim().parse().ok()).collect())
        .unwrap_or_else(|| LEVELS.to_vec());
    let files = tempfile::tempdir()?;
    std::fs::write(
        files.path().join("SmolLM2-135M-Instruct.Q4_1.gguf"),
        b"GGUF\x03\0\0\0",
    )?;
    println!(
        "\nRollout orchestration (scripted math agent, constant-answer backend, every service real), one replica, one batch"
    );
    println!(
        "| trials in flight | trials | wall s | trials/s | direct calls wall s | orchestration per trial (ms of wall, (wall − direct) / trials) |"
    );
    println!("|---|---|---|---|---|---|");
    for level in levels {
        let server = arl_testkit::NatsServer::start()?;
        let ns = arl_testkit::test_namespace();
        let shutdown = Shutdown::new();
        let bus = Bus::connect(
            BusConfig::new(server.url(), ns.clone(), "bench"),
            Metrics::new(),
        )
        .await?;
        bus.provision().await?;
        let backend = constant_backend(&shutdown).await?;
        Controller::new(
            bus.clone(),
            ControllerConfig {
                model_dir: files.path().to_path_buf(),
                admission_concurrency: 2,
                tensorboard_dir: None,
                ..ControllerConfig::default()
            },
        )
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .start(&shutdown);
        DatasetService::new(bus.clone()).start(&shutdown);
        RewardService::new(bus.clone(), RewardConfig::default()).start(&shutdown, 64);
        let keys = Arc::new(Keys::default());
        let backends = Arc::new(Backends::new(vec![(
            Dialect::Arl,
            format!("http://{backend}"),
        )]));
        let mcp = arl_proxy::mcp::Mcp::new(
            keys.clone(),
            arl_sandbox_client::SandboxClient::new(bus.clone()),
            arl_proxy::mcp::McpConfig::default(),
        );
        let proxy = Proxy::new(
            bus.clone(),
            keys.clone(),
            mcp.clone(),
            backends,
            ProxyConfig {
                max_in_flight_per_run: 100_000,
                ..ProxyConfig::default()
            },
        );
        let proxy_addr =
            arl_runtime::http::serve("127.0.0.1:0".parse()?, api::router(proxy), &shutdown).await?;
        arl_proxy::service::serve_keys(
            &bus,
            keys,
            mcp,
            "p1",
            &format!("http://{proxy_addr}"),
            &shutdown,
        )
        .await?;
        Rollout::new(
            bus.clone(),
            RolloutConfig {
                concurrency: level,
                ..RolloutConfig::default()
            },
        )
        .start(&shutdown);

        // `level` trials: level / 2 math tasks, 2 samples each, one step.
        let tasks = level / 2;
        let dataset = files.path().join(format!("math-{level}.jsonl"));
        let rows: Vec<String> = (0..tasks)
            .map(|i| {
                json!({"id": format!("q{i}"), "question": "What is 2 + 2?", "answer": "#### 4"})
                    .to_string()
            })
            .collect();
        std::fs::write(&dataset, rows.join("\n"))?;
        let mut spec = RunSpec::default();
        spec.data.source = DataSource::Gsm8k;
        spec.data.dataset = dataset.display().to_string();
        spec.data.val_size = 0;
        spec.data.train_batch_size = tasks as u32;
        spec.rollout.n = 2;
        spec.trainer.total_steps = 1;
        let run = RunId::generate();
        // Counted as they are published (a core subscription: no stream reads in the loop).
        let filter = ns.event_subject(Domain::Trajectory, &run, "ready");
        let mut trajectories = bus.client().subscribe(filter).await?;
        let started = Instant::now();
        bus.publish(&RunRequestedV1 {
            run_id: run.clone(),
            spec,
            ..RunRequestedV1::example()
        })
        .await?;
        let mut count = 0;
        while count < level {
            let next = tokio::time::timeout(Duration::from_secs(120), trajectories.next()).await;
            anyhow::ensure!(
                matches!(next, Ok(Some(_))),
                "only {count} of {level} trajectories, then nothing for 120 s"
            );
            count += 1;
        }
        let done = started.elapsed().as_secs_f64();
        let direct = direct_calls(
            &format!("http://{backend}/v1/chat/completions"),
            level,
            level,
        )
        .await?;
        let per_trial_ms = (done - direct) / level as f64 * 1000.0;
        println!(
            "| {level} | {level} | {done:.2} | {:.0} | {direct:.3} | {per_trial_ms:.0} |",
            level as f64 / done
        );
        shutdown.trigger();
        shutdown.wait().await;
    }
    Ok(())
}
