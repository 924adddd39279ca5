//! `arl-loadtest-trials` (`make loadtest`, `make soak`): thousands of concurrent trials
//! through the real services, each a separate process of the one `arl` executable
//! (`arl serve …` with the flags `arl up` gives it) on a private `nats-server -js`:
//! controller, dataset, two or more rollout replicas, proxy, reward, trainer (a tiny
//! random model, CPU) and evaluator. The agent is the built-in math agent (one LLM call)
//! and the engine behind the proxy a stand-in that answers at once (`standin.rs`), so what
//! is measured is the orchestration.
//!
//! After each scenario the streams are replayed (`ledger.rs`): every trial attempt must
//! have exactly one outcome and every graded training slot exactly one trajectory, or the
//! program exits 1 with the list. It prints one table: trials/s sustained, p50/p99 per
//! stage, JetStream bytes per trial, RSS per service per 1,000 trials in flight, CPU per
//! process, and the first limit hit — each target with pass/fail.

mod fleet;
mod ledger;
mod sandboxed;
mod standin;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arl_runtime::bus::BusConfig;
use arl_runtime::{Bus, Metrics, Shutdown};
use arl_schemas::events::{Example, RunRequestedV1};
use arl_schemas::spec::{AgentKind, DataSource, RunSpec};
use arl_schemas::state::DONE_TRIAL_RECORD_KEPT_SECONDS;
use arl_schemas::{Domain, RunId};
use clap::Parser;
use fleet::{Fleet, Measured};
use futures::StreamExt;

/// Trials the reward service grades at once (`arl up` gives it 4, sized for test runs;
/// math grades in microseconds), and the sandbox baseline's concurrency: the grader is
/// what holds a sandboxed trial's second lease.
const GRADES_AT_ONCE: usize = 64;

#[derive(Debug, Parser)]
#[command(about = "Thousands of concurrent trials through the real services as processes")]
struct Args {
    /// Tasks per training step (`data.train_batch_size`).
    #[arg(long, default_value_t = 1000)]
    tasks_per_step: u32,
    /// Samples per task (`rollout.n`): a step has tasks × samples trials.
    #[arg(long, default_value_t = 2)]
    samples: u32,
    /// Training steps of a run.
    #[arg(long, default_value_t = 3)]
    steps: u32,
    /// Validation tasks (graded by the evaluator at the last step).
    #[arg(long, default_value_t = 100)]
    val_tasks: u32,
    /// Rollout replicas (processes).
    #[arg(long, default_value_t = 2)]
    replicas: usize,
    /// Trials each replica runs at once (`arl-rollout --concurrency`). The replicas share
    /// one durable consumer of trial requests whose `max_ack_pending` is this same number
    /// (the last replica to start sets it), so it bounds the trials in flight of all
    /// replicas together: it is the in-flight target, not a share of it.
    #[arg(long, default_value_t = 2000)]
    concurrency: usize,
    /// Keep trials flowing this long (one run sized to last it at the throughput
    /// scenario's pace, then more runs if it ends early), sampling RSS and stream bytes
    /// every 30 s; fails when a process's memory keeps growing (see `soak_verdict`).
    #[arg(long, default_value_t = 0)]
    soak_seconds: u64,
    /// The `arl` executable (default: beside this one).
    #[arg(long)]
    arl: Option<PathBuf>,
    /// The in-flight scenario: one step whose every LLM call the stand-in holds this long,
    /// so that all its trials are in flight at once (0: skip it).
    #[arg(long, default_value_t = 30_000)]
    hold_ms: u64,
    /// Harbor tasks of the sandboxed scenario (one step; 0: skip it).
    #[arg(long, default_value_t = 20)]
    sandbox_tasks: u32,
    /// Samples per Harbor task.
    #[arg(long, default_value_t = 16)]
    sandbox_samples: u32,
    /// Prepared trees the sandbox service keeps per environment (`--pool-min-idle`): as
    /// many as a task's samples, so a step's agents can all start from a warm tree.
    #[arg(long, default_value_t = 4)]
    pool_min_idle: usize,
    /// Keep the state folder (service logs, JetStream store is the server's) after the end.
    #[arg(long)]
    keep_state: bool,
    /// Give up on a run that has not ended after this long.
    #[arg(long, default_value_t = 900)]
    run_timeout_s: u64,
}

/// The targets of issue 26 on a 2-core machine.
const TARGET_IN_FLIGHT: usize = 2000;
const TARGET_MATH_TRIALS_PER_S: f64 = 50.0;

/// One scenario: runs of one spec against the stand-in engine held at one delay.
struct Scenario {
    name: &'static str,
    /// How long the stand-in holds each answer (ms).
    delay_ms: u64,
    steps: u32,
    runs: Vec<RunId>,
    wall: f64,
    /// RSS (MiB) of each measured process just before the scenario, and its peak during it.
    idle_rss: Vec<f64>,
    peak_rss: Vec<f64>,
    /// CPU seconds of each measured process during the scenario.
    cpu: Vec<f64>,
    /// CPU seconds the whole machine was busy during the scenario.
    machine_cpu: f64,
}

/// Everything a scenario needs from the session.
struct Session<'a> {
    args: &'a Args,
    bus: &'a Bus,
    fleet: &'a mut Fleet,
    measured: &'a [Measured],
    sampler: &'a Sampler,
    delay_ms: &'a AtomicU64,
}

impl Session<'_> {
    /// Runs `steps`-step runs with the engine held `delay_ms` — one run, or back to back
    /// for `soak_seconds` — measuring every process while they go.
    async fn scenario(
        &mut self,
        name: &'static str,
        delay_ms: u64,
        spec: RunSpec,
        soak_seconds: u64,
    ) -> anyhow::Result<Scenario> {
        let steps = spec.trainer.total_steps;
        println!("scenario {name}: engine answers after {delay_ms} ms, {steps} steps");
        self.delay_ms.store(delay_ms, Ordering::Relaxed);
        let idle_rss: Vec<f64> = self
            .measured
            .iter()
            .map(|m| fleet::rss_mib(m.pid).unwrap_or(0.0))
            .collect();
        self.sampler.reset_peaks();
        let cpu_before: Vec<f64> = self
            .measured
            .iter()
            .map(|m| fleet::cpu_seconds(m.pid).unwrap_or(0.0))
            .collect();
        let machine_before = fleet::machine_busy_seconds().unwrap_or(0.0);
        let began = Instant::now();
        let mut runs = Vec::new();
        loop {
            runs.push(submit_and_wait(self.bus, self.fleet, spec.clone(), self.args).await?);
            if began.elapsed().as_secs() >= soak_seconds {
                break;
            }
        }
        let cpu = self
            .measured
            .iter()
            .zip(&cpu_before)
            .map(|(m, before)| fleet::cpu_seconds(m.pid).unwrap_or(*before) - before)
            .collect();
        Ok(Scenario {
            name,
            delay_ms,
            steps,
            runs,
            wall: began.elapsed().as_secs_f64(),
            idle_rss,
            peak_rss: self.sampler.peaks(),
            cpu,
            machine_cpu: fleet::machine_busy_seconds().unwrap_or(0.0) - machine_before,
        })
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<std::process::ExitCode> {
    let args = Args::parse();
    let arl = match &args.arl {
        Some(path) => path.clone(),
        None => std::env::current_exe()?.with_file_name("arl"),
    };
    anyhow::ensure!(
        arl.exists(),
        "{} is missing; build it with `cargo build --release -p arl-cli --bin arl`",
        arl.display()
    );
    // The server's Go profiling endpoint: the soak reads its live heap (after a GC).
    let profiling = arl_testkit::free_port()?;
    let server = arl_testkit::NatsServer::start_with_config(&format!("prof_port: {profiling}\n"))?;
    let live_heap_url = format!("http://127.0.0.1:{profiling}/debug/pprof/heap?debug=1&gc=1");
    let ns = arl_testkit::test_namespace();
    let prefix = ns.prefix().unwrap_or_default().to_owned();
    let state = tempfile::Builder::new().prefix("arl-loadtest-").tempdir()?;
    // Sandboxes run as an unprivileged user, which must reach their trees.
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(state.path(), std::fs::Permissions::from_mode(0o755))?;
    }
    let environments = state.path().join("environments");
    std::fs::create_dir_all(&environments)?;
    let harbor_tasks = sandboxed::write_tasks(state.path(), &environments, args.sandbox_tasks)?;
    let model = tiny_model(state.path())?;
    let shutdown = Shutdown::new();
    let delay_ms = Arc::new(AtomicU64::new(0));
    let engine = standin::serve(&shutdown, delay_ms.clone()).await?;

    let env = vec![
        ("NATS_URL".to_owned(), server.url()),
        ("ARL_PREFIX".to_owned(), prefix),
        // The services' logs (state folder, `--keep-state`): warnings unless
        // ARL_LOADTEST_LOG says otherwise (e.g. `info` to follow a stall).
        (
            "RUST_LOG".to_owned(),
            std::env::var("ARL_LOADTEST_LOG").unwrap_or_else(|_| "warn".to_owned()),
        ),
    ];
    let mut fleet = Fleet::new(arl, &state.path().join("logs"), env)?;
    start_services(&mut fleet, &args, state.path(), engine)?;
    let started = Instant::now();
    fleet.ready(Duration::from_secs(300)).await?;
    println!(
        "every service ready in {:.1} s (logs in {})",
        started.elapsed().as_secs_f64(),
        state.path().join("logs").display()
    );

    let bus = Bus::connect(
        BusConfig::new(server.url(), ns.clone(), "loadtest"),
        Metrics::new(),
    )
    .await?;
    bus.provision().await?;

    let mut measured = fleet.measured();
    if let Some(pid) = server.pid() {
        measured.push(Measured {
            name: "nats-server".into(),
            pid,
        });
    }
    measured.push(Measured {
        name: "loadtest (stand-in engine, measurement)".into(),
        pid: std::process::id(),
    });
    let trainer_metrics_url = fleet
        .ops_port("trainer")
        .map(|port| format!("http://127.0.0.1:{port}/metrics"));
    let sampler = Sampler::start(
        measured.clone(),
        &bus,
        live_heap_url,
        trainer_metrics_url,
        state.path().join("logs"),
    );
    let dataset = write_dataset(state.path(), args.tasks_per_step + args.val_tasks)?;

    let mut session = Session {
        args: &args,
        bus: &bus,
        fleet: &mut fleet,
        measured: &measured,
        sampler: &sampler,
        delay_ms: &delay_ms,
    };
    let math = run_spec(&args, &dataset, &model);
    let mut scenarios = Vec::new();
    scenarios.push(session.scenario("throughput", 0, math.clone(), 0).await?);
    if args.hold_ms > 0 {
        let mut one_step = math.clone();
        one_step.trainer.total_steps = 1;
        scenarios.push(
            session
                .scenario("in flight", args.hold_ms, one_step, 0)
                .await?,
        );
    }
    let mut lease_baseline = None;
    if args.sandbox_tasks > 0 {
        let mut harbor = RunSpec {
            name: "loadtest-sandboxed".into(),
            ..RunSpec::default()
        };
        harbor.model.path = model.display().to_string();
        harbor.data.source = DataSource::Harbor;
        harbor.data.dataset = harbor_tasks.display().to_string();
        harbor.data.val_size = 0;
        harbor.data.train_batch_size = args.sandbox_tasks;
        harbor.rollout.n = args.sandbox_samples;
        harbor.rollout.agent = AgentKind::SweText;
        harbor.trainer.total_steps = 1;
        // Both sides meet warm pools: one pass over every environment first.
        sandboxed::sandbox_work_rate(
            &bus,
            args.sandbox_tasks,
            args.sandbox_tasks as usize,
            GRADES_AT_ONCE,
        )
        .await?;
        scenarios.push(session.scenario("sandboxed", 0, harbor, 0).await?);
        let trials = (args.sandbox_tasks * args.sandbox_samples) as usize;
        println!("sandbox baseline: the sandbox work of {trials} trials, {GRADES_AT_ONCE} at once");
        lease_baseline = Some(
            sandboxed::sandbox_work_rate(&bus, args.sandbox_tasks, trials, GRADES_AT_ONCE).await?,
        );
    }
    if args.soak_seconds > 0 {
        // One run long enough to last the soak (a run is what a deployment soaks in; runs
        // back to back would add each run's own state), and more runs after it if it
        // ends early. Sized at 1.5 × the pace just measured: a long run went faster than
        // the first steps (2026-12-05: 96 steps planned for 600 s took 560 s), and a
        // second run's start was then judged as growth.
        let seconds_per_step = scenarios[0].wall / f64::from(args.steps.max(1));
        let mut long = math.clone();
        long.trainer.total_steps = ((1.5 * args.soak_seconds as f64 / seconds_per_step).ceil()
            as u32)
            .max(args.steps)
            .saturating_add(1);
        scenarios.push(session.scenario("soak", 0, long, args.soak_seconds).await?);
    }
    let samples = sampler.stop();
    let proxy_429s = proxy_status_count(&fleet, "429").await;

    let trials = ledger::read_stream(&bus, Domain::Trial).await?;
    let rewards = ledger::read_stream(&bus, Domain::Reward).await?;
    let trajectories = ledger::read_stream(&bus, Domain::Trajectory).await?;
    let calls = ledger::read_stream(&bus, Domain::Llm).await?;
    let sandbox_events = ledger::read_stream(&bus, Domain::Sandbox).await?;
    let stream_bytes = stream_bytes(&bus).await?;
    let all_runs: Vec<String> = scenarios
        .iter()
        .flat_map(|s| s.runs.iter().map(|r| r.to_string()))
        .collect();
    let whole = ledger::account(
        &all_runs,
        &trials,
        &rewards,
        &trajectories,
        &calls,
        &sandbox_events,
    );
    let ledgers: Vec<ledger::Ledger> = scenarios
        .iter()
        .map(|s| {
            let runs: Vec<String> = s.runs.iter().map(|r| r.to_string()).collect();
            ledger::account(
                &runs,
                &trials,
                &rewards,
                &trajectories,
                &calls,
                &sandbox_events,
            )
        })
        .collect();

    let sandboxed_runs: Vec<String> = scenarios
        .iter()
        .filter(|s| s.name == "sandboxed")
        .flat_map(|s| s.runs.iter().map(|r| r.to_string()))
        .collect();
    let trial_leases = ledger::rate_of(&sandboxed_runs, &sandbox_events, "leased");
    let report = Report {
        args: &args,
        lease_baseline,
        trial_leases,
        scenarios: &scenarios,
        ledgers: &ledgers,
        whole: &whole,
        measured: &measured,
        samples: &samples,
        stream_bytes,
        proxy_429s,
    };
    let soak_ok = report.print();
    shutdown.trigger();
    shutdown.wait().await;
    drop(fleet);
    if args.keep_state {
        println!("state and logs kept in {}", state.keep().display());
    }
    if !whole.problems.is_empty() {
        eprintln!(
            "\n{} trial attempts lost or duplicated:",
            whole.problems.len()
        );
        for problem in whole.problems.iter().take(50) {
            eprintln!("  {problem}");
        }
        return Ok(std::process::ExitCode::from(1));
    }
    if !soak_ok {
        return Ok(std::process::ExitCode::from(1));
    }
    Ok(std::process::ExitCode::SUCCESS)
}

/// Every service as its own process, with the flags `arl up` gives it (cli/src/up.rs),
/// except where a load test must differ (said at each).
fn start_services(
    fleet: &mut Fleet,
    args: &Args,
    state: &Path,
    engine: std::net::SocketAddr,
) -> anyhow::Result<()> {
    let s = |p: PathBuf| p.display().to_string();
    let port = || arl_testkit::free_port();
    let socket = state.join("proxy.sock");
    let sandbox_api = port()?;
    fleet.start(
        "sandbox",
        "sandbox",
        &[
            "--api-addr".into(),
            format!("127.0.0.1:{sandbox_api}"),
            "--state-dir".into(),
            s(state.join("sandbox")),
            "--environments-dir".into(),
            s(state.join("environments")),
            "--proxy-socket".into(),
            s(socket.clone()),
            // `arl up` keeps no warm trees (0); the issue asks for leases from warm pools.
            "--pool-min-idle".into(),
            args.pool_min_idle.to_string(),
            "--max-leases".into(),
            "4096".into(),
        ],
        sandbox_api,
    )?;
    fleet.start(
        "controller",
        "controller",
        &[
            "--tensorboard-dir".into(),
            s(state.join("tensorboard")),
            "--model-dir".into(),
            s(state.join("models")),
        ],
        port()?,
    )?;
    fleet.start("dataset", "dataset", &[], port()?)?;
    let proxy = port()?;
    fleet.start(
        "proxy",
        "proxy",
        &[
            "--backend".into(),
            format!("arl=http://{engine}"),
            "--listen".into(),
            format!("127.0.0.1:{proxy}"),
            "--listen-unix".into(),
            s(socket),
            // `arl up` keeps the default (256 LLM calls of one run at once); thousands of
            // trials of one run in flight need more, or the proxy's 429s are the limit.
            "--max-in-flight-per-run".into(),
            (args.replicas * args.concurrency).to_string(),
        ],
        proxy,
    )?;
    // Math grades in microseconds; `arl up`'s 4 at once is sized for test runs in
    // sandboxes (SWE-bench, Harbor).
    fleet.start(
        "reward",
        "reward",
        &["--concurrency".into(), GRADES_AT_ONCE.to_string()],
        port()?,
    )?;
    for replica in 0..args.replicas {
        fleet.start(
            &format!("rollout-{replica}"),
            "rollout",
            &["--concurrency".into(), args.concurrency.to_string()],
            port()?,
        )?;
    }
    fleet.start(
        "trainer",
        "trainer",
        &[
            "--runs-dir".into(),
            s(state.join("runs")),
            "--gpu".into(),
            "none".into(),
            "--capacity".into(),
            (4 * args.tasks_per_step * args.samples)
                .max(4096)
                .to_string(),
        ],
        port()?,
    )?;
    fleet.start("evaluator", "evaluator", &[], port()?)?;
    Ok(())
}

/// A tiny llama (hidden 32, 2 layers) with random weights and SmolLM2's tokenizer, in
/// Hugging Face layout: the trainer's steps cost milliseconds, so the orchestration is
/// what is measured (the trainer's speed is `arl-bench-model`'s).
fn tiny_model(dir: &Path) -> anyhow::Result<PathBuf> {
    use arl_model::config::ModelConfig;
    use arl_model::load::LoadedModel;
    use arl_model::model::Model;
    use arl_model::weights::Weights;
    let models = std::env::var_os("ARL_MODEL_DIR")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/arl/models")))
        .ok_or_else(|| anyhow::anyhow!("set ARL_MODEL_DIR"))?;
    let smollm2 = models.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    anyhow::ensure!(
        smollm2.exists(),
        "{} is missing (its tokenizer seeds the tiny model); run `make models`",
        smollm2.display()
    );
    let mut loaded = LoadedModel::open(&smollm2)?;
    let config = ModelConfig {
        hidden_size: 32,
        intermediate_size: 48,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        ..loaded.model.config.clone()
    };
    loaded.model = Model::new(config.clone(), Weights::random(&config, 5, 0.05));
    let path = dir.join("models/tiny");
    loaded.save_hf(&path)?;
    Ok(path)
}

fn write_dataset(dir: &Path, tasks: u32) -> anyhow::Result<PathBuf> {
    let rows: Vec<String> = (0..tasks)
        .map(|i| {
            serde_json::json!({"id": format!("q{i}"), "question": "What is 2 + 2?", "answer": "#### 4"})
                .to_string()
        })
        .collect();
    let path = dir.join("math.jsonl");
    std::fs::write(&path, rows.join("\n"))?;
    Ok(path)
}

fn run_spec(args: &Args, dataset: &Path, model: &Path) -> RunSpec {
    let mut spec = RunSpec {
        name: "loadtest".into(),
        ..RunSpec::default()
    };
    spec.model.path = model.display().to_string();
    spec.data.source = DataSource::Gsm8k;
    spec.data.dataset = dataset.display().to_string();
    spec.data.val_size = args.val_tasks;
    spec.data.train_batch_size = args.tasks_per_step;
    spec.rollout.n = args.samples;
    spec.trainer.total_steps = args.steps;
    spec
}

/// Submits one run and waits for it to end; fails when a service exits or it takes
/// longer than `--run-timeout-s`. Prints progress every 10 s.
async fn submit_and_wait(
    bus: &Bus,
    fleet: &mut Fleet,
    spec: RunSpec,
    args: &Args,
) -> anyhow::Result<RunId> {
    let run = RunId::generate();
    let ns = bus.namespace();
    let mut ended = bus
        .client()
        .subscribe(ns.event_subject(Domain::Run, &run, "*"))
        .await?;
    let mut ready = bus
        .client()
        .subscribe(ns.event_subject(Domain::Trajectory, &run, "ready"))
        .await?;
    bus.publish(&RunRequestedV1 {
        run_id: run.clone(),
        spec,
        ..RunRequestedV1::example()
    })
    .await?;
    let started = Instant::now();
    let mut trajectories = 0usize;
    let mut report = tokio::time::interval(Duration::from_secs(10));
    loop {
        tokio::select! {
            Some(message) = ended.next() => {
                let event = message.subject.rsplit('.').next().unwrap_or_default().to_owned();
                match event.as_str() {
                    "completed" => break,
                    "failed" | "rejected" => {
                        let body = String::from_utf8_lossy(&message.payload);
                        println!("run {run} ended {event}: {body}");
                        break;
                    }
                    _ => {}
                }
            }
            Some(_) = ready.next() => trajectories += 1,
            _ = report.tick() => {
                println!(
                    "  run {run}: {:.0} s, {trajectories} trajectories",
                    started.elapsed().as_secs_f64()
                );
                if let Some(exited) = fleet.exited() {
                    anyhow::bail!("{exited}");
                }
                // The soak's run is sized to last the soak: give it twice that.
                let limit = args.run_timeout_s.max(2 * args.soak_seconds);
                anyhow::ensure!(
                    started.elapsed() < Duration::from_secs(limit),
                    "run {run} did not end within {limit} s ({trajectories} trajectories)"
                );
            }
        }
    }
    // Trajectories of the last step may still be on their way to the trainer's stream.
    tokio::time::sleep(Duration::from_secs(2)).await;
    Ok(run)
}

/// Seconds between the points of the soak's series (RSS, stream bytes, the trainer's heap).
const SERIES_EVERY_S: u64 = 30;
/// Seconds between readings of nats-server's live heap: its samples swing by tens of MiB
/// with the buffers in use at the instant, so its trend needs more points than the
/// series (each reading costs the server one forced collection).
const NATS_HEAP_EVERY_S: u64 = 10;

/// RSS of each measured process sampled every second (its peak since the last
/// [`Sampler::reset_peaks`]), every [`SERIES_EVERY_S`] a point of the soak's series and
/// every [`NATS_HEAP_EVERY_S`] nats-server's live heap.
struct Sampler {
    samples: Arc<Mutex<Samples>>,
    task: tokio::task::JoinHandle<()>,
}

#[derive(Clone, Default)]
struct Samples {
    /// Peak RSS (MiB) per measured process.
    peak_rss: Vec<f64>,
    /// Every 30 s: (seconds since start, RSS per process, stream bytes).
    series: Vec<(f64, Vec<f64>, u64)>,
    /// Every 10 s: (seconds since start, nats-server's live heap after a GC).
    nats_live_heap: Vec<(f64, NatsHeap)>,
    /// Every 30 s: (seconds since start, the trainer's heap in use after its last step, MiB).
    trainer_heap: Vec<(f64, f64)>,
}

impl Sampler {
    fn start(
        measured: Vec<Measured>,
        bus: &Bus,
        live_heap_url: String,
        trainer_metrics_url: Option<String>,
        heap_profiles: PathBuf,
    ) -> Self {
        let samples = Arc::new(Mutex::new(Samples {
            peak_rss: vec![0.0; measured.len()],
            series: Vec::new(),
            nats_live_heap: Vec::new(),
            trainer_heap: Vec::new(),
        }));
        let (shared, bus) = (samples.clone(), bus.clone());
        // Aborted by `stop`: it holds nothing that needs an orderly end.
        let task = tokio::spawn(async move {
            let started = Instant::now();
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            for n in 0u64.. {
                tick.tick().await;
                let rss: Vec<f64> = measured
                    .iter()
                    .map(|m| fleet::rss_mib(m.pid).unwrap_or(0.0))
                    .collect();
                let (bytes, trainer_heap) = if n % SERIES_EVERY_S == 0 {
                    (
                        stream_bytes(&bus).await.ok(),
                        match &trainer_metrics_url {
                            Some(url) => trainer_heap_mib(url).await,
                            None => None,
                        },
                    )
                } else {
                    (None, None)
                };
                let heap = if n % NATS_HEAP_EVERY_S == 0 {
                    let keep = heap_profiles.join(format!("nats-heap-{n:05}s.txt"));
                    NatsHeap::read(&live_heap_url, &keep).await
                } else {
                    None
                };
                let mut s = shared.lock().unwrap_or_else(|e| e.into_inner());
                for (peak, now) in s.peak_rss.iter_mut().zip(&rss) {
                    *peak = peak.max(*now);
                }
                let at = started.elapsed().as_secs_f64();
                if let Some(bytes) = bytes {
                    s.series.push((at, rss, bytes));
                }
                if let Some(heap) = heap {
                    s.nats_live_heap.push((at, heap));
                }
                if let Some(mib) = trainer_heap {
                    s.trainer_heap.push((at, mib));
                }
            }
        });
        Self { samples, task }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Samples> {
        self.samples.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn reset_peaks(&self) {
        self.lock().peak_rss.iter_mut().for_each(|p| *p = 0.0);
    }

    fn peaks(&self) -> Vec<f64> {
        self.lock().peak_rss.clone()
    }

    fn stop(self) -> Samples {
        self.task.abort();
        self.lock().clone()
    }
}

/// nats-server's live heap after a collection (the profile is read with `gc=1`, so garbage
/// awaiting collection and memory the Go runtime keeps without using are not counted), and
/// the parts of it that are messages in flight: message-block caches and messages loaded
/// from the store for a consumer or a direct get.
#[derive(Clone, Debug, PartialEq)]
struct NatsHeap {
    /// `HeapAlloc`, MiB.
    live: f64,
    /// Bytes in use by allocation site (the innermost nats-server function on the
    /// allocating stack, else the innermost function), MiB: what tells a growing index
    /// from a buffer that comes and goes. Estimates from the profiler's samples
    /// ([`unsampled_bytes`]): together they come near `live`, each one within a few MiB.
    sites: BTreeMap<String, f64>,
    /// Bytes in use that `getMsgBlockBuf` allocated, MiB: the file store's block caches
    /// (up to 8 MiB each, one per block being written or read, pooled and dropped when the
    /// cache expires). They come and go in 8-MiB steps with which blocks are busy at the
    /// instant of the sample — a bounded cache, and noise of ±50 MiB in a 10-minute series.
    block_caches: f64,
    /// Bytes in use that `msgFromBufEx` allocated, MiB: copies of stored messages on their
    /// way to a consumer or answering a direct get, held until the server has written them
    /// to the client. A queue that follows the load — bounded by the deliveries in flight
    /// (the consumers' pending limits, the gets in progress) times the message size — that
    /// swung between 10 and 100 MiB from one sample to another in a 2-core soak.
    message_copies: f64,
}

const MIB: f64 = 1024.0 * 1024.0;

/// The package of nats-server's own functions in a heap profile's stacks.
const NATS_SERVER_PACKAGE: &str = "github.com/nats-io/nats-server/v2/server.";

/// Go's default `runtime.MemProfileRate`: one allocation sampled per 512 KiB.
const DEFAULT_MEM_PROFILE_RATE: f64 = 524_288.0;

/// A record's in-use bytes as allocated, from what the profiler sampled: an allocation of
/// `size` bytes is recorded with probability 1 − e^(−size/rate), so small objects (ids,
/// index entries) are mostly missing from the raw figures — scaled back as `go tool pprof`
/// does.
fn unsampled_bytes(objects: f64, bytes: f64, rate: f64) -> f64 {
    if objects <= 0.0 || bytes <= 0.0 {
        return 0.0;
    }
    bytes / (1.0 - (-(bytes / objects) / rate).exp())
}

/// `…server.init.func12`: a package-level closure, such as a `sync.Pool`'s `New`.
fn is_pool_constructor(function: &str) -> bool {
    function
        .rsplit_once(".init.func")
        .is_some_and(|(_, n)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

impl NatsHeap {
    /// Reads a profile, keeping its text in the file `keep` (for `--keep-state`).
    async fn read(url: &str, keep: &Path) -> Option<Self> {
        let text = arl_testkit::http(url, "GET", &[], b"").await.ok()?.text();
        if let Err(err) = std::fs::write(keep, &text) {
            eprintln!(
                "could not keep nats-server's heap profile in {}: {err}",
                keep.display()
            );
        }
        Self::parse(&text)
    }

    /// From a Go heap profile in text form (`debug=1`): a header naming the sampling rate
    /// (`heap profile: … @ heap/<2 × rate>`), records of `in-use objects: in-use bytes
    /// [allocated objects: allocated bytes] @ addresses`, each followed by its stack
    /// (`#\t0x… function+offset file:line`), then the runtime's `MemStats` as
    /// `# Name = value` lines.
    fn parse(text: &str) -> Option<Self> {
        let live = number_after(text, "# HeapAlloc = ")?;
        let mut lines = text.lines();
        let rate = lines
            .next()?
            .strip_prefix("heap profile: ")?
            .rsplit_once("@ heap/")
            .and_then(|(_, twice)| twice.trim().parse::<f64>().ok())
            .map_or(DEFAULT_MEM_PROFILE_RATE, |twice| twice / 2.0);
        let (mut block_caches, mut message_copies) = (0.0, 0.0);
        let mut sites: BTreeMap<String, f64> = BTreeMap::new();
        // Each record's estimated bytes and stack, ended by a blank line or the next one.
        let mut record: Option<(f64, Vec<&str>)> = None;
        let mut end_record = |record: Option<(f64, Vec<&str>)>| {
            let Some((bytes, frames)) = record else {
                return;
            };
            if frames.iter().any(|f| f.ends_with(".getMsgBlockBuf")) {
                block_caches += bytes;
            } else if frames.first().is_some_and(|f| f.ends_with(".msgFromBufEx")) {
                message_copies += bytes;
            }
            // A pool's constructor (`init.funcN`, a closure of a package-level sync.Pool)
            // says nothing; whoever took from the pool does.
            let own = || frames.iter().filter(|f| f.starts_with(NATS_SERVER_PACKAGE));
            let site = own()
                .find(|f| !is_pool_constructor(f))
                .or_else(|| own().next())
                .or(frames.first());
            if let Some(site) = site {
                let site = site.strip_prefix(NATS_SERVER_PACKAGE).unwrap_or(site);
                *sites.entry(site.to_owned()).or_default() += bytes;
            }
        };
        for line in lines {
            if let Some((head, _)) = line.split_once(" @ ") {
                end_record(record.take());
                let mut numbers = head
                    .split(|c: char| c == ':' || c.is_whitespace())
                    .filter(|w| !w.is_empty())
                    .map(|w| w.parse::<f64>().unwrap_or(0.0));
                let (objects, bytes) =
                    (numbers.next().unwrap_or(0.0), numbers.next().unwrap_or(0.0));
                record = Some((unsampled_bytes(objects, bytes, rate), Vec::new()));
            } else if let Some(frame) = line.strip_prefix("#\t") {
                // `#\t0x9a1b2b\tpackage.function+0x4a\tfile:line`
                let function = frame.split('\t').nth(1).unwrap_or_default();
                let function = function.rsplit_once("+0x").map_or(function, |(f, _)| f);
                if let Some((_, frames)) = &mut record {
                    frames.push(function);
                }
            } else {
                end_record(record.take());
            }
        }
        end_record(record);
        Some(Self {
            live: live / MIB,
            sites: sites
                .into_iter()
                .map(|(site, bytes)| (site, bytes / MIB))
                .collect(),
            block_caches: block_caches / MIB,
            message_copies: message_copies / MIB,
        })
    }

    /// What the soak judges: the server's own state (message ids, indexes, subject
    /// trees, consumer state) — the live heap less the messages in flight.
    fn judged(&self) -> f64 {
        self.live - self.block_caches - self.message_copies
    }
}

/// The trainer's heap in use after its last step (`arl_trainer_heap_in_use_bytes`), MiB;
/// None before its first step (0) or where it cannot be read.
async fn trainer_heap_mib(url: &str) -> Option<f64> {
    let text = arl_testkit::http(url, "GET", &[], b"").await.ok()?.text();
    trainer_heap_of(&text)
}

/// [`trainer_heap_mib`] from the metrics text.
fn trainer_heap_of(text: &str) -> Option<f64> {
    let bytes = number_after(text, "arl_trainer_heap_in_use_bytes ")?;
    (bytes > 0.0).then_some(bytes / MIB)
}

/// The number on the first line of `text` that starts with `prefix` (a Prometheus sample,
/// a Go `MemStats` line).
fn number_after(text: &str, prefix: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(prefix))?
        .trim()
        .parse()
        .ok()
}

/// Bytes stored in every event stream of the namespace.
async fn stream_bytes(bus: &Bus) -> anyhow::Result<u64> {
    let mut total = 0;
    for domain in Domain::ALL {
        let name = bus.namespace().stream(domain);
        if let Ok(mut stream) = bus.jetstream().get_stream(&name).await {
            total += stream.info().await.map(|i| i.state.bytes).unwrap_or(0);
        }
    }
    Ok(total)
}

/// LLM calls the proxy answered with `status`, from its `/metrics`.
async fn proxy_status_count(fleet: &Fleet, status: &str) -> Option<f64> {
    let port = fleet.ops_port("proxy")?;
    let url = format!("http://127.0.0.1:{port}/metrics");
    let text = arl_testkit::http(&url, "GET", &[], b"").await.ok()?.text();
    let label = format!("status=\"{status}\"");
    Some(
        text.lines()
            .filter(|l| l.contains("proxy_calls") && l.contains(&label) && !l.starts_with('#'))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .fold(0.0, |sum, n| sum + n),
    )
}

struct Report<'a> {
    args: &'a Args,
    /// The sandbox service's own rate for a trial's sandbox work (trials per s), its lease
    /// latencies (ms) and failures.
    lease_baseline: Option<(f64, Vec<f64>, usize)>,
    /// Leases the sandboxed trials took (agent and grading): (count, per s).
    trial_leases: (usize, f64),
    scenarios: &'a [Scenario],
    ledgers: &'a [ledger::Ledger],
    /// The accounting of every run together.
    whole: &'a ledger::Ledger,
    measured: &'a [Measured],
    samples: &'a Samples,
    stream_bytes: u64,
    proxy_429s: Option<f64>,
}

fn verdict(ok: bool) -> &'static str {
    if ok { "pass" } else { "FAIL" }
}

impl Report<'_> {
    /// Prints the tables; returns whether the soak (when there was one) passed.
    fn print(&self) -> bool {
        let a = self.args;
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        println!(
            "\n## Trials through the real services as processes ({} rollout replicas × {} concurrency, {} tasks × {} samples a step + {} validation tasks; {cores} cores, load average {})",
            a.replicas,
            a.concurrency,
            a.tasks_per_step,
            a.samples,
            a.val_tasks,
            load_average()
        );
        let throughput = &self.ledgers[0];
        let in_flight = self
            .scenarios
            .iter()
            .zip(self.ledgers)
            .map(|(_, l)| l.peak_in_flight)
            .max()
            .unwrap_or(0);
        let w = self.whole;
        println!("\n| target | value | target | verdict |");
        println!("|---|---|---|---|");
        println!(
            "| trial attempts lost or duplicated (of {} attempts: {} graded, {} failed) | {} | 0 | {} |",
            w.attempts,
            w.scored,
            w.failed,
            w.problems.len(),
            verdict(w.problems.is_empty())
        );
        // Only the in-flight scenario holds its trials long enough to have them all in
        // flight at once; without it the peak is shown, not judged.
        let in_flight_verdict = if a.hold_ms == 0 {
            "not run (--hold-ms 0)"
        } else {
            verdict(in_flight >= TARGET_IN_FLIGHT)
        };
        println!(
            "| trials in flight (peak, any scenario) | {in_flight} | ≥ {TARGET_IN_FLIGHT} | {in_flight_verdict} |"
        );
        println!(
            "| math trials/s sustained (throughput scenario: graded ÷ first start → last grade) | {:.1} | ≥ {TARGET_MATH_TRIALS_PER_S} | {} |",
            throughput.trials_per_second,
            verdict(throughput.trials_per_second >= TARGET_MATH_TRIALS_PER_S)
        );
        self.print_sandboxed();
        let soak = self.scenarios.iter().any(|s| s.name == "soak");
        let soak_ok = !soak || self.soak_verdict();
        println!(
            "| no unbounded memory growth over the soak (RSS; nats-server: live heap less messages in flight; trainer: heap in use) | {} | slope after warm-up ≤ max(2 MiB, 1% of mean)/min | {} |",
            if soak {
                "see the soak table"
            } else {
                "no soak (--soak-seconds 0)"
            },
            if soak { verdict(soak_ok) } else { "not run" }
        );
        println!(
            "| JetStream bytes per trial attempt (every stream ÷ attempts) | {:.0} | — | — |",
            self.stream_bytes as f64 / w.attempts.max(1) as f64
        );
        println!(
            "| proxy 429s | {} | — | — |",
            self.proxy_429s
                .map_or("unknown".into(), |n| format!("{n:.0}"))
        );

        for (scenario, l) in self.scenarios.iter().zip(self.ledgers) {
            self.print_scenario(scenario, l, cores);
        }
        if soak {
            self.print_soak();
        }
        soak_ok
    }

    fn print_sandboxed(&self) {
        let sandboxed = self
            .scenarios
            .iter()
            .zip(self.ledgers)
            .find(|(s, _)| s.name == "sandboxed");
        let (Some((rate, latencies, failed)), Some((_, l))) = (&self.lease_baseline, sandboxed)
        else {
            println!(
                "| sandboxed trials/s ÷ the sandbox's own rate for the same work | — | ≥ 0.8 | not run (--sandbox-tasks 0) |"
            );
            return;
        };
        let (count, trial_rate) = self.trial_leases;
        let ratio = l.trials_per_second / rate.max(1e-9);
        println!(
            "| sandboxed trials/s ({count} leases, agent + grading, {trial_rate:.1}/s) ÷ the sandbox's own rate for the same sandbox work in this run ({rate:.1} trials/s, {} at once, as the grader) | {ratio:.2} | ≥ 0.8 | {} |",
            GRADES_AT_ONCE,
            if *failed > 0 {
                "FAIL (no valid baseline: its leases went unanswered)"
            } else {
                verdict(ratio >= 0.8)
            }
        );
        let mut stage = ledger::Stage::default();
        latencies.iter().for_each(|ms| stage.push(*ms));
        if let Some((p50, p99)) = stage.quantiles() {
            println!(
                "| sandbox lease latency, own baseline (warm pools, {} at once) p50 / p99 ms | {p50:.1} / {p99:.1} | — | — |",
                GRADES_AT_ONCE
            );
        }
    }

    fn print_scenario(&self, s: &Scenario, l: &ledger::Ledger, cores: f64) {
        println!(
            "\n### {}: {} run(s) of {} steps, engine holds each call {} ms; {:.0} s",
            s.name,
            s.runs.len(),
            s.steps,
            s.delay_ms,
            s.wall
        );
        println!(
            "attempts {} (graded {}, failed {}), peak in flight {}, graded trials/s {:.1}, first request → last trajectory {:.1} s",
            l.attempts, l.scored, l.failed, l.peak_in_flight, l.trials_per_second, l.span_s
        );
        if l.leases > 0 {
            println!(
                "sandbox leases {} ({} from a warm pool)",
                l.leases, l.warm_leases
            );
        }
        for (class, (count, message)) in &l.failures {
            println!("failed attempts, {class}: {count} (e.g. \"{message}\")");
        }
        println!("\n| stage | p50 ms | p99 ms | samples |");
        println!("|---|---|---|---|");
        for (name, stage) in &l.stages {
            match stage.quantiles() {
                Some((p50, p99)) => {
                    println!("| {name} | {p50:.1} | {p99:.1} | {} |", stage.samples.len())
                }
                None => println!("| {name} | — | — | 0 |"),
            }
        }
        let per_thousand = (l.peak_in_flight as f64 / 1000.0).max(1e-9);
        println!(
            "\n| process | RSS before MiB | RSS peak MiB | (peak − before) per 1,000 in flight MiB | CPU s | cores |"
        );
        println!("|---|---|---|---|---|---|");
        let wall = s.wall.max(1e-9);
        let mut busiest = (String::new(), 0.0_f64);
        for (i, m) in self.measured.iter().enumerate() {
            let (before, peak) = (s.idle_rss[i], s.peak_rss[i]);
            let used = s.cpu[i] / wall;
            if used > busiest.1 {
                busiest = (m.name.clone(), used);
            }
            println!(
                "| {} | {before:.1} | {peak:.1} | {:.1} | {:.1} | {used:.2} |",
                m.name,
                (peak - before).max(0.0) / per_thousand,
                s.cpu[i],
            );
        }
        let ours = s.cpu.iter().sum::<f64>() / wall;
        let machine = s.machine_cpu / wall;
        println!(
            "\nCPU: these processes used {ours:.2} of {cores} cores; the machine was busy {machine:.2} (other work on it: {:.2})",
            (machine - ours).max(0.0)
        );
        let failed = l.failures.iter().max_by_key(|(_, (count, _))| *count);
        let limit = if let Some((class, (count, message))) = failed {
            format!(
                "{count} of {} attempts failed as {class} (retried by the run's policy), e.g. \"{message}\"",
                l.attempts
            )
        } else if self.proxy_429s.is_some_and(|n| n > 0.0) {
            "the proxy's per-run in-flight limit (it answered 429)".to_owned()
        } else if machine >= 0.9 * cores {
            format!(
                "CPU: the machine's {cores} cores were saturated ({machine:.2} busy, {:.2} of it others' work); the busiest process here: {} ({:.2} cores)",
                (machine - ours).max(0.0),
                busiest.0,
                busiest.1
            )
        } else if busiest.1 >= 0.9 {
            format!("CPU of {} ({:.2} cores)", busiest.0, busiest.1)
        } else if l.peak_in_flight >= self.args.replicas * self.args.concurrency {
            "the rollout replicas' concurrency (every slot busy)".into()
        } else {
            format!(
                "none saturated (machine {machine:.2} of {cores} cores, busiest {} at {:.2}): trials waited on hand-offs and on the trainer's steps (max_staleness)",
                busiest.0, busiest.1
            )
        };
        println!("first limit hit: {limit}");
    }

    fn print_soak(&self) {
        let series = &self.samples.series;
        println!(
            "\n### soak: {} samples every 30 s; stream bytes {} → {}",
            series.len(),
            series.first().map_or(0, |s| s.2),
            series.last().map_or(0, |s| s.2)
        );
        println!("\n| process | mean MiB after warm-up | slope MiB/min | limit | verdict |");
        println!("|---|---|---|---|---|");
        for (name, growth) in self.growth() {
            let shown = if growth.judged {
                verdict(growth.holds())
            } else {
                "shown (judged: nats-server's live heap less messages in flight, the trainer's heap in use)"
            };
            println!(
                "| {name} | {:.1} | {:.2} | {:.2} | {shown} |",
                growth.mean, growth.slope, growth.limit
            );
        }
        self.print_series();
        self.print_heap_sites();
    }

    /// Where nats-server's heap goes: the allocation sites whose bytes in use climb the
    /// most after the warm-up, and the largest ones, to tell an index that grows from a
    /// buffer that comes and goes (the profiles are kept in the logs folder).
    fn print_heap_sites(&self) {
        const SHOWN: usize = 8;
        let warm = after_warm_up(&self.samples.nats_live_heap);
        let names: std::collections::BTreeSet<&String> =
            warm.iter().flat_map(|(_, h)| h.sites.keys()).collect();
        let mut sites: Vec<(&String, Growth, f64)> = names
            .into_iter()
            .map(|name| {
                let points: Vec<(f64, f64)> = warm
                    .iter()
                    .map(|(at, h)| (at / 60.0, h.sites.get(name).copied().unwrap_or(0.0)))
                    .collect();
                let max = points.iter().map(|p| p.1).fold(0.0, f64::max);
                (name, Growth::of(&points, false), max)
            })
            .collect();
        if sites.is_empty() {
            return;
        }
        sites.sort_by(|a, b| b.1.slope.total_cmp(&a.1.slope));
        let mut shown: Vec<usize> = (0..sites.len().min(SHOWN)).collect();
        let mut by_size: Vec<usize> = (0..sites.len()).collect();
        by_size.sort_by(|&a, &b| sites[b].1.mean.total_cmp(&sites[a].1.mean));
        shown.extend(by_size.into_iter().filter(|i| *i >= SHOWN).take(SHOWN));
        println!(
            "\n| nats-server heap by allocation site (after warm-up; climbing most, then largest) | mean MiB | max MiB | slope MiB/min |"
        );
        println!("|---|---|---|---|");
        for i in shown {
            let (name, growth, max) = &sites[i];
            println!(
                "| {name} | {:.1} | {max:.1} | {:.2} |",
                growth.mean, growth.slope
            );
        }
    }

    /// Each process's RSS (and nats-server's live heap, the trainer's heap in use) every 2
    /// minutes, to see the shape of what the slopes summarise (a step when a run starts,
    /// or a steady climb).
    fn print_series(&self) {
        let series = &self.samples.series;
        let picked: Vec<usize> = (0..series.len()).step_by(4).collect();
        let minutes: Vec<String> = picked
            .iter()
            .map(|&i| format!("{:.0}", series[i].0 / 60.0))
            .collect();
        println!("\n| MiB at minute | {} |", minutes.join(" | "));
        println!("|---|{}", "---|".repeat(picked.len()));
        for (p, m) in self.measured.iter().enumerate() {
            let row: Vec<String> = picked
                .iter()
                .map(|&i| format!("{:.0}", series[i].1[p]))
                .collect();
            println!("| {} (RSS) | {} |", m.name, row.join(" | "));
        }
        let heap = &self.samples.nats_live_heap;
        let row = |f: fn(&NatsHeap) -> f64| -> String {
            (0..heap.len())
                .step_by((4 * SERIES_EVERY_S / NATS_HEAP_EVERY_S) as usize)
                .map(|i| format!("{:.0}", f(&heap[i].1)))
                .collect::<Vec<_>>()
                .join(" | ")
        };
        println!("| nats-server (live heap) | {} |", row(|h| h.live));
        println!(
            "| nats-server (of which message-block caches) | {} |",
            row(|h| h.block_caches)
        );
        println!(
            "| nats-server (of which messages loaded for delivery) | {} |",
            row(|h| h.message_copies)
        );
        let trainer: Vec<String> = self
            .samples
            .trainer_heap
            .iter()
            .step_by(4)
            .map(|(_, mib)| format!("{mib:.0}"))
            .collect();
        println!("| trainer (heap in use) | {} |", trainer.join(" | "));
    }

    /// Per process (RSS), nats-server's live heap and the trainer's heap in use: the trend
    /// over the samples after the warm-up.
    fn growth(&self) -> BTreeMap<String, Growth> {
        let series = &self.samples.series;
        let warm = &series[warm_up(series.iter().map(|s| s.0))..];
        let mut rows = BTreeMap::new();
        for (i, m) in self.measured.iter().enumerate() {
            let points: Vec<(f64, f64)> = warm.iter().map(|s| (s.0 / 60.0, s.1[i])).collect();
            // A Go process's RSS also holds garbage awaiting collection (up to the live
            // heap again, at GOGC=100) and freed memory the runtime returns lazily: for
            // nats-server the live heap says whether memory grows, and RSS is shown. The
            // trainer keeps freed memory for its next step (`retain_freed_memory`), so its
            // RSS is its heap's high-water mark: its heap in use is judged instead.
            let judged = m.name != "nats-server" && m.name != "trainer";
            rows.insert(format!("{} (RSS)", m.name), Growth::of(&points, judged));
        }
        let warm = after_warm_up(&self.samples.nats_live_heap);
        let points = |f: fn(&NatsHeap) -> f64| -> Vec<(f64, f64)> {
            warm.iter().map(|(at, h)| (at / 60.0, f(h))).collect()
        };
        rows.insert(
            "nats-server (live heap after a GC)".into(),
            Growth::of(&points(|h| h.live), false),
        );
        rows.insert(
            "nats-server (messages loaded for delivery)".into(),
            Growth::of(&points(|h| h.message_copies), false),
        );
        rows.insert(
            "nats-server (live heap less messages in flight)".into(),
            Growth::of(&points(NatsHeap::judged), true),
        );
        let points: Vec<(f64, f64)> = after_warm_up(&self.samples.trainer_heap)
            .iter()
            .map(|(at, mib)| (at / 60.0, *mib))
            .collect();
        rows.insert("trainer (heap in use)".into(), Growth::of(&points, true));
        rows
    }

    /// The soak's rule: after the warm-up ([`warm_up`]), the least-squares slope of each
    /// process's RSS (nats-server: its live heap less the messages in flight, read every
    /// [`NATS_HEAP_EVERY_S`]; the trainer: its heap in use) must stay at or under
    /// max(2 MiB, 1% of its mean) per minute — memory still climbing at that rate once the
    /// system is in its steady state grows without bound. Fewer than 3 samples after
    /// warm-up cannot pass.
    fn soak_verdict(&self) -> bool {
        let enough = |times: Vec<f64>| times.len() - warm_up(times.iter().copied()) >= 3;
        enough(self.samples.series.iter().map(|s| s.0).collect())
            && enough(self.samples.nats_live_heap.iter().map(|h| h.0).collect())
            && enough(self.samples.trainer_heap.iter().map(|h| h.0).collect())
            && self.growth().values().all(Growth::holds)
    }
}

/// How many of a series' first samples (their times, seconds since the start) are warm-up:
/// those in its first third, and at least those before the first done trial records expire
/// (they are kept [`DONE_TRIAL_RECORD_KEPT_SECONDS`], so the trial bucket only reaches its
/// steady size then) plus a minute.
fn warm_up(times: impl Iterator<Item = f64>) -> usize {
    let times: Vec<f64> = times.collect();
    let (Some(first), Some(last)) = (times.first(), times.last()) else {
        return 0;
    };
    let third = first + (last - first) / 3.0;
    let records_expire = first + (DONE_TRIAL_RECORD_KEPT_SECONDS + 60) as f64;
    let until = third.max(records_expire);
    times.iter().take_while(|&&t| t < until).count()
}

/// The samples of a (seconds since start, value) series after its [`warm_up`].
fn after_warm_up<T>(samples: &[(f64, T)]) -> &[(f64, T)] {
    &samples[warm_up(samples.iter().map(|s| s.0))..]
}

/// A memory series' trend after warm-up: its mean (MiB), least-squares slope (MiB/min) and
/// the slope allowed.
struct Growth {
    mean: f64,
    slope: f64,
    limit: f64,
    /// Whether the soak's verdict rests on it.
    judged: bool,
}

impl Growth {
    /// From points (minutes, MiB).
    fn of(points: &[(f64, f64)], judged: bool) -> Self {
        let n = (points.len() as f64).max(1.0);
        let mean_x = points.iter().map(|p| p.0).sum::<f64>() / n;
        let mean = points.iter().map(|p| p.1).sum::<f64>() / n;
        let cov: f64 = points.iter().map(|p| (p.0 - mean_x) * (p.1 - mean)).sum();
        let var: f64 = points.iter().map(|p| (p.0 - mean_x).powi(2)).sum();
        let slope = if var > 0.0 { cov / var } else { 0.0 };
        Self {
            mean,
            slope,
            limit: (0.01 * mean).max(2.0),
            judged,
        }
    }

    fn holds(&self) -> bool {
        !self.judged || self.slope <= self.limit
    }
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shape of nats-server 2.15's `/debug/pprof/heap?debug=1` (trimmed).
    const PROFILE: &str = "heap profile: 41: 26279936 [901: 99000000] @ heap/1048576
2: 16777216 [30: 251658240] @ 0x9a1000 0x9a1b2c 0x9a0f11 0x47c2a1
#\t0x9a0fff\tgithub.com/nats-io/nats-server/v2/server.init.func10+0x2e\t/src/server/filestore.go:1090
#\t0x9a1b2b\tgithub.com/nats-io/nats-server/v2/server.getMsgBlockBuf+0x4a\t/src/server/filestore.go:1127
#\t0x9a0f10\tgithub.com/nats-io/nats-server/v2/server.(*msgBlock).loadBlock+0x1cf\t/src/server/filestore.go:5801

38: 8454144 [870: 30000000] @ 0x9b0000 0x9b0100 0x47c2a1
#\t0x9affff\truntime.makemap_small+0x33\t/usr/local/go/src/runtime/map.go:91
#\t0x9b00ff\tgithub.com/nats-io/nats-server/v2/server.(*stree).insert+0x33\t/src/server/stree/stree.go:91
1: 1048576 [1: 1048576] @ 0x47c2a1
#\t0x47c2a0\truntime.malg+0x1f\t/usr/local/go/src/runtime/proc.go:4700

3: 1572864 [50: 9000000] @ 0x9c0000 0x9c0100
#\t0x9bffff\tgithub.com/nats-io/nats-server/v2/server.(*msgBlock).msgFromBufEx+0x6c4\t/src/server/filestore.go:6000
#\t0x9c00ff\tgithub.com/nats-io/nats-server/v2/server.(*consumer).getNextMsg+0x3c8\t/src/server/consumer.go:4000

# runtime.MemStats
# Alloc = 26000000
# HeapAlloc = 26214400
# HeapInuse = 30000000
";

    #[test]
    fn the_trainer_heap_is_read_from_its_gauge_and_absent_before_a_step() {
        let text = "# HELP arl_trainer_heap_in_use_bytes Bytes\n\
                    # TYPE arl_trainer_heap_in_use_bytes gauge\n\
                    arl_trainer_heap_in_use_bytes 209715200\n\
                    arl_trainer_steps_total 3\n";
        assert_eq!(trainer_heap_of(text), Some(200.0));
        assert_eq!(trainer_heap_of("arl_trainer_heap_in_use_bytes 0\n"), None);
        assert_eq!(trainer_heap_of("arl_trainer_steps_total 3\n"), None);
    }

    #[test]
    fn the_judged_heap_leaves_out_messages_in_flight_and_sites_are_scaled_for_sampling() {
        let heap = NatsHeap::parse(PROFILE).expect("a heap profile");
        let near = |got: f64, want: f64| (got - want).abs() < 1e-3;
        assert_eq!(heap.live, 25.0);
        // 8-MiB buffers are always sampled: as recorded. Messages loaded for a consumer:
        // 3 of 512 KiB, each sampled with probability 1 − e^(−1).
        assert!(near(heap.block_caches, 16.0), "{}", heap.block_caches);
        assert!(near(heap.message_copies, 2.373), "{}", heap.message_copies);
        assert!(near(heap.judged(), 6.627));
        // By the innermost nats-server function (the runtime's frames and a pool's
        // constructor passed over), scaled for sampling: 38 objects of ~217 KiB were
        // sampled with probability 1 − e^(−217/512) ≈ 0.346, one of 1 MiB with 0.865.
        let sites: Vec<(&str, f64)> = heap.sites.iter().map(|(k, v)| (k.as_str(), *v)).collect();
        assert_eq!(
            sites.iter().map(|s| s.0).collect::<Vec<_>>(),
            [
                "(*msgBlock).msgFromBufEx",
                "(*stree).insert",
                "getMsgBlockBuf",
                "runtime.malg"
            ]
        );
        assert!(near(sites[0].1, 2.373), "{sites:?}");
        assert!(near(sites[1].1, 23.316), "{sites:?}");
        assert!(near(sites[2].1, 16.0), "{sites:?}");
        assert!(near(sites[3].1, 1.1565), "{sites:?}");
        assert_eq!(
            NatsHeap::parse("heap profile: 0: 0 [0: 0] @ heap/1\n"),
            None
        );
    }

    #[test]
    fn warm_up_lasts_until_done_trial_records_expire_or_a_third() {
        let every_30_s = |seconds: u64| (0..=seconds / 30).map(|i| i as f64 * 30.0);
        // 10 minutes: the records kept 300 s, plus a minute, decide (samples 0..=330 s).
        assert_eq!(warm_up(every_30_s(600)), 12);
        // An hour: the first third decides.
        assert_eq!(warm_up(every_30_s(3600)), 40);
        assert_eq!(warm_up(std::iter::empty()), 0);
    }
}
