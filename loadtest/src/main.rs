//! `arl-loadtest`: how fast the controller admits runs, next to what the bus alone can do.
//!
//! Both are measured in one process against one private `nats-server -js`:
//! - baseline: publish an event of the same size with `Bus::publish` (acked by JetStream),
//!   consume it with the runtime's consumer loop, and see it arrive;
//! - admission: publish a run request and wait for the controller's `run.accepted`
//!   (decode, validate, check files, compare-and-set the state, publish two events).
//!
//! Requests and loops are bounded by `--runs`; everything stops by itself.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use arl_controller::{Controller, ControllerConfig};
use arl_runtime::bus::BusConfig;
use arl_runtime::consumer::run_consumer;
use arl_runtime::{Bus, ConsumerSpec, Metrics, Shutdown};
use arl_schemas::events::{Example, RunProgressV1, RunRequestedV1};
use arl_schemas::spec::RunSpec;
use arl_schemas::{Domain, RunId};
use clap::Parser;
use futures::StreamExt;
use tokio::sync::oneshot;

#[derive(Debug, Parser)]
#[command(about = "Load test of run admission against a JetStream round-trip baseline")]
struct Args {
    /// Requests per scenario.
    #[arg(long, default_value_t = 2000)]
    runs: usize,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
}

#[derive(Debug)]
struct Figures {
    name: &'static str,
    per_second: f64,
    p50: Duration,
    p99: Duration,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let server = arl_testkit::NatsServer::start()?;
    let files = tempfile::tempdir()?;
    let spec = fixture_spec(files.path())?;

    let baseline = baseline(&server, &args).await?;
    let admission = admission(&server, &args, files.path(), spec).await?;

    println!(
        "\n{} requests, {} in flight, nats-server on loopback\n",
        args.runs, args.concurrency
    );
    println!(
        "{:<34} {:>10} {:>10} {:>10}",
        "scenario", "per s", "p50 ms", "p99 ms"
    );
    for f in [&baseline, &admission] {
        println!(
            "{:<34} {:>10.0} {:>10.2} {:>10.2}",
            f.name,
            f.per_second,
            f.p50.as_secs_f64() * 1e3,
            f.p99.as_secs_f64() * 1e3
        );
    }
    println!(
        "\nadmission / baseline: throughput {:.2}x, p50 latency {:.2}x",
        admission.per_second / baseline.per_second,
        admission.p50.as_secs_f64() / baseline.p50.as_secs_f64()
    );
    Ok(())
}

fn fixture_spec(dir: &std::path::Path) -> anyhow::Result<RunSpec> {
    std::fs::create_dir_all(dir.join("models"))?;
    std::fs::write(
        dir.join("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
        b"GGUF\x03\0\0\0",
    )?;
    std::fs::create_dir_all(dir.join("tasks/t"))?;
    std::fs::write(dir.join("tasks/t/task.toml"), "")?;
    let mut spec = RunSpec::default();
    spec.data.dataset = dir.join("tasks").display().to_string();
    Ok(spec)
}

async fn connect(server: &arl_testkit::NatsServer) -> anyhow::Result<Bus> {
    let bus = Bus::connect(
        BusConfig::new(server.url(), arl_testkit::test_namespace(), "loadtest"),
        Metrics::new(),
    )
    .await?;
    bus.provision().await?;
    Ok(bus)
}

/// Requests in flight, keyed by run id, and the latencies seen so far.
#[derive(Default)]
struct Clock {
    pending: HashMap<String, (Instant, oneshot::Sender<()>)>,
    latencies: Vec<Duration>,
}

impl Clock {
    /// Records the answer to `key`, if it is one we are waiting for.
    fn observe(clock: &Mutex<Clock>, key: &str) {
        let mut clock = clock.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((start, done)) = clock.pending.remove(key) {
            clock.latencies.push(start.elapsed());
            let _ = done.send(());
        }
    }
}

async fn baseline(server: &arl_testkit::NatsServer, args: &Args) -> anyhow::Result<Figures> {
    let bus = connect(server).await?;
    let clock = Arc::new(Mutex::new(Clock::default()));
    let shutdown = Shutdown::new();
    let seen = clock.clone();
    let spec = ConsumerSpec::new(
        Domain::Run,
        "baseline",
        vec![bus.namespace().event_filter(Domain::Run, "progress")],
    );
    shutdown.spawn(run_consumer(
        bus.clone(),
        spec,
        move |delivery| {
            let seen = seen.clone();
            async move {
                if let Ok(event) = delivery.decode::<RunProgressV1>() {
                    Clock::observe(&seen, event.run_id.as_str());
                }
                Ok(())
            }
        },
        shutdown.clone(),
    ));
    let figures = drive("baseline: publish → consume", args, clock, move |run_id| {
        let bus = bus.clone();
        async move {
            let event = RunProgressV1 {
                run_id,
                ..RunProgressV1::example()
            };
            bus.publish(&event).await?;
            Ok(())
        }
    })
    .await;
    shutdown.trigger();
    shutdown.wait().await;
    figures
}

async fn admission(
    server: &arl_testkit::NatsServer,
    args: &Args,
    dir: &std::path::Path,
    spec: RunSpec,
) -> anyhow::Result<Figures> {
    let bus = connect(server).await?;
    let shutdown = Shutdown::new();
    let config = ControllerConfig {
        model_dir: dir.join("models"),
        admission_concurrency: 16,
        tensorboard_dir: None,
        ..ControllerConfig::default()
    };
    Controller::new(bus.clone(), config).await?.start(&shutdown);

    let clock = Arc::new(Mutex::new(Clock::default()));
    let mut accepted = bus
        .client()
        .subscribe(bus.namespace().event_filter(Domain::Run, "accepted"))
        .await
        .context("subscribing to accepted runs")?;
    let seen = clock.clone();
    let ns = bus.namespace().clone();
    let listener = shutdown.spawn(async move {
        while let Some(message) = accepted.next().await {
            if let Some(run) = ns.run_token(&message.subject) {
                Clock::observe(&seen, run);
            }
        }
    });
    let publisher = bus.clone();
    let figures = drive(
        "admission: request → accepted",
        args,
        clock,
        move |run_id| {
            let (bus, spec) = (publisher.clone(), spec.clone());
            async move {
                bus.publish(&RunRequestedV1 {
                    run_id,
                    spec,
                    ..RunRequestedV1::example()
                })
                .await?;
                Ok(())
            }
        },
    )
    .await;
    listener.abort();
    shutdown.trigger();
    shutdown.wait().await;
    figures
}

/// `args.concurrency` closed-loop workers each send a request and wait for its answer
/// before sending the next, until `args.runs` have been answered.
async fn drive<F, Fut>(
    name: &'static str,
    args: &Args,
    clock: Arc<Mutex<Clock>>,
    send: F,
) -> anyhow::Result<Figures>
where
    F: Fn(RunId) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = anyhow::Result<()>> + Send,
{
    let started = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    for worker in 0..args.concurrency {
        let (clock, send) = (clock.clone(), send.clone());
        let share = (worker..args.runs)
            .step_by(args.concurrency)
            .collect::<Vec<_>>();
        workers.spawn(async move {
            for _ in share {
                let run_id = RunId::generate();
                let (done, answered) = oneshot::channel();
                {
                    let mut clock = clock.lock().unwrap_or_else(|e| e.into_inner());
                    clock
                        .pending
                        .insert(run_id.to_string(), (Instant::now(), done));
                }
                send(run_id).await?;
                tokio::time::timeout(Duration::from_secs(60), answered)
                    .await
                    .map_err(|_| anyhow::anyhow!("{name}: no answer within 60 s"))??;
            }
            anyhow::Ok(())
        });
    }
    while let Some(joined) = workers.join_next().await {
        joined??;
    }
    let elapsed = started.elapsed();
    let mut latencies = clock
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .latencies
        .clone();
    latencies.sort();
    anyhow::ensure!(!latencies.is_empty(), "{name}: nothing measured");
    let at = |q: f64| latencies[((latencies.len() as f64 - 1.0) * q) as usize];
    Ok(Figures {
        name,
        per_second: latencies.len() as f64 / elapsed.as_secs_f64(),
        p50: at(0.5),
        p99: at(0.99),
    })
}
