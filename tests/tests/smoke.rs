//! The reduced end-to-end run `make test` includes: `arl up` starts every service (and a
//! private nats-server), a run over the bundled Harbor tasks with SmolLM2 (n = 2, one
//! GRPO step, one evaluation) is submitted and followed with `arl run watch` to its end:
//! completed when the step trained, failed saying so when it trained nothing; every trial
//! reached the agent loop, the step wrote its weights, and no service exited on the way.
//! The run without least privilege also runs `arl up --traces` and is watched the way a
//! user would: each training trial is one trace in Phoenix (its REST API, and its UI in
//! headless Chromium), every printed metrics address parses as OpenMetrics text with the
//! engine's and trainer's families, and TensorBoard reads the run's scalars back. Build the
//! binaries first (`make test` does).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use arl_runtime::bus::BusConfig;
use arl_runtime::{Bus, Metrics};
use arl_schemas::events::{EnvironmentRef, Example, TrajectoryV1, WeightsPublishedV1};
use arl_schemas::permissions::Role;
use arl_schemas::rpc::{LeaseGrantV1, LeaseRequestV1, SandboxLimits, SandboxOp};
use arl_schemas::state::RunStatus;
use arl_schemas::{Domain, Namespace, RunId};
use arl_testkit::{Children, built_binary};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn arl_up_runs_a_reduced_training_run_to_completion() {
    reduced_run(false).await;
}

/// The same run with every service on its own NKey user of least privilege; then a
/// role's attempts beyond its permissions are refused by the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn arl_up_on_least_privilege_runs_and_each_role_is_held_to_its_subjects() {
    let (state, url, _up) = reduced_run(true).await;
    let nats = state.path().join("nats");
    // The rollout service may not publish weights; the CLI may not ask for a sandbox.
    let rollout = connect(&url, Some((&nats, Role::Rollout))).await;
    let mut forged = WeightsPublishedV1::example();
    forged.run_id = RunId::new("run-forged").unwrap();
    let refused = rollout.publish(&forged).await;
    assert!(refused.is_err(), "the rollout role published weights");
    let cli = connect(&url, Some((&nats, Role::Cli))).await;
    let lease = LeaseRequestV1 {
        run_id: RunId::new("run-forged").unwrap(),
        trial_id: None,
        environment: EnvironmentRef {
            name: "harbor/fix-mean".into(),
            digest: None,
        },
        ttl_s: 60,
        limits: SandboxLimits::default(),
    };
    let answer: Result<LeaseGrantV1, _> = cli
        .request(
            Namespace::default().sandbox_rpc("any", SandboxOp::Lease),
            &lease,
            Duration::from_secs(5),
        )
        .await;
    assert!(
        answer.is_err(),
        "the CLI role was granted a lease: {answer:?}"
    );
    // Without any credentials nothing gets in.
    let mut config = BusConfig::new(&url, Namespace::default(), "test");
    config.wait_for_server = false;
    assert!(Bus::connect(config, Metrics::new()).await.is_err());
}

/// A client of `arl up`'s bus: as `role` (its seed under `nats/`) on least privilege.
async fn connect(url: &str, role: Option<(&Path, Role)>) -> Bus {
    let mut config = BusConfig::new(url, Namespace::default(), "test");
    config.publish_timeout = Duration::from_secs(5);
    if let Some((dir, role)) = role {
        config.auth.nats_nkey = Some(dir.join(format!("{}.nk", role.name())));
        config.auth.nats_inbox_prefix = Some(role.inbox_prefix());
    }
    Bus::connect(config, Metrics::new()).await.unwrap()
}

/// `arl up` (on least privilege or not), one reduced run through the CLI, checked; returns
/// the state folder and the bus's URL.
async fn reduced_run(least_privilege: bool) -> (tempfile::TempDir, String, Children) {
    let state = tempfile::Builder::new()
        .prefix("arl-up-")
        .tempdir()
        .unwrap();
    let arl = built_binary("arl");
    let mut up_args = vec!["up", "--state-dir"];
    if least_privilege {
        up_args.insert(1, "--least-privilege");
    } else {
        up_args.insert(1, "--traces");
    }
    let mut up = Children(vec![
        Command::new(&arl)
            .args(&up_args)
            .arg(state.path())
            .env_remove("NATS_URL")
            .env("ARL_PHOENIX", observability_tool("phoenix"))
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap(),
    ]);
    // Written only once every service reports ready.
    let url =
        arl_testkit::wait_for_arl_up(&mut up.0[0], state.path(), Duration::from_secs(180)).await;

    let tasks = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/tasks");
    let spec = state.path().join("reduced.toml");
    std::fs::write(
        &spec,
        format!(
            "name = \"reduced\"\n[data]\ndataset = \"{}\"\nval_size = 1\ntrain_batch_size = 1\n\
             [rollout]\nn = 2\nmax_turns = 2\nmax_response_tokens = 64\ntimeout_s = 120\n\
             [trainer]\ntotal_steps = 1\n",
            tasks.display()
        ),
    )
    .unwrap();
    let nats = state.path().join("nats");
    let arl_at = |args: &[&str]| {
        let mut command = Command::new(&arl);
        command
            .args(args)
            .env("NATS_URL", &url)
            .env_remove("ARL_PREFIX");
        if least_privilege {
            command
                .env("NATS_NKEY", nats.join("cli.nk"))
                .env("NATS_INBOX_PREFIX", Role::Cli.inbox_prefix());
        }
        command.output().unwrap()
    };
    let as_role = |role: Role| least_privilege.then_some((nats.as_path(), role));
    let submitted = arl_at(&["run", "submit", spec.to_str().unwrap()]);
    assert!(
        submitted.status.success(),
        "{}",
        String::from_utf8_lossy(&submitted.stderr)
    );
    let run = String::from_utf8(submitted.stdout)
        .unwrap()
        .trim()
        .to_owned();
    let watched = arl_at(&["run", "watch", &run, "--timeout-s", "900"]);
    // No service exited on the way (arl up stops everything when one does).
    assert!(
        up.0[0].try_wait().unwrap().is_none(),
        "arl up stopped during the run"
    );

    let bus = connect(&url, as_role(Role::Cli)).await;
    let run_id = RunId::new(run.as_str()).unwrap();
    let state_record = bus.run_state(&run_id).await.unwrap().unwrap();
    // Submitted only once `arl up` was ready: no trial met an engine still loading.
    assert_eq!(
        state_record.failures.infrastructure, 0,
        "{:?}",
        state_record.failures
    );
    assert_eq!(state_record.steps.len(), 1);
    let step = &state_record.steps[0];
    assert!(step.pg_loss.is_finite() && step.grad_norm.is_finite());
    assert_eq!(state_record.policy_version, 1);
    let batch = step
        .batch
        .clone()
        .expect("the trainer reports batch counts");
    assert_eq!(batch.trajectories, 2);
    let shown = format!(
        "{}\n{}",
        String::from_utf8_lossy(&watched.stdout),
        String::from_utf8_lossy(&watched.stderr)
    );
    // SmolLM2 rarely solves a Harbor task: the one step trains only when the two trials'
    // rewards differ. Either way the run's end says what happened.
    if batch.samples_trained > 0 {
        assert!(watched.status.success(), "{shown}");
        assert_eq!(state_record.status, RunStatus::Completed);
        assert_eq!(state_record.percent(), 100.0);
        // Before training (val_before_train) and after the last step.
        let evaluated: Vec<u32> = state_record.evaluations.iter().map(|e| e.step).collect();
        assert_eq!(evaluated, vec![0, 1]);
    } else {
        assert!(
            !watched.status.success(),
            "a run that trained nothing: {shown}"
        );
        assert_eq!(state_record.status, RunStatus::Failed);
        let reason = state_record.failure_reason.clone().unwrap_or_default();
        assert!(reason.contains("every step trained nothing"), "{reason}");
        assert!(shown.contains("nothing trained"), "{shown}");
    }
    // The step's weights (published before its train.step; folded on their own stream).
    let checkpoint = arl_testkit::wait_for("the checkpoint", Duration::from_secs(30), || async {
        bus.run_state(&run_id).await.ok()??.checkpoint_uri
    })
    .await;
    let dir = checkpoint.strip_prefix("file://").unwrap();
    assert!(
        Path::new(dir).join("config.json").exists() || Path::new(dir).exists(),
        "{dir}"
    );
    // The trainer reads trajectories; on least privilege the CLI may not.
    let trainer = connect(&url, as_role(Role::Trainer)).await;
    let trajectories: Vec<TrajectoryV1> = trainer
        .replay(
            Domain::Trajectory,
            Namespace::default().event_subject(Domain::Trajectory, &run_id, "ready"),
        )
        .await
        .unwrap();
    assert_eq!(trajectories.len(), 2);
    assert!(
        trajectories.iter().all(|t| t.num_turns > 0),
        "every trial reached the agent loop"
    );
    if !least_privilege {
        let trials: Vec<String> = trajectories
            .iter()
            .map(|t| t.trial_id.to_string())
            .collect();
        traces_in_phoenix(state.path(), &trials).await;
        metrics_parse(state.path());
        let scalars = tensorboard_scalars(state.path(), &run).await;
        let pg_loss = scalars["actor/pg_loss"].as_array().unwrap();
        assert_eq!(pg_loss[0][0], 1, "{pg_loss:?}");
        let logged = pg_loss[0][1].as_f64().unwrap();
        assert!(
            (logged - step.pg_loss).abs() <= 1e-6 * step.pg_loss.abs().max(1.0),
            "{logged} vs {}",
            step.pg_loss
        );
        assert!(
            scalars["val/test_score/mean"]
                .as_array()
                .is_some_and(|v| !v.is_empty())
        );
    }
    let plot = arl_at(&[
        "run",
        "plot",
        &run,
        "--out",
        state.path().join("curve.svg").to_str().unwrap(),
    ]);
    assert!(plot.status.success());
    assert!(
        std::fs::read_to_string(state.path().join("curve.svg"))
            .unwrap()
            .starts_with("<svg")
    );

    // Killed outright, `arl up` still takes its services and nats-server with it.
    let pid = up.0[0].id();
    let services = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap();
    let services: Vec<&str> = services.split_whitespace().collect();
    assert_eq!(
        services.len(),
        if least_privilege { 11 } else { 12 },
        "nats-server, ten services (and Phoenix): {services:?}"
    );
    if least_privilege {
        // The caller checks refusals on the running bus; dropping `up` stops it.
        return (state, url, up);
    }
    up.0[0].kill().unwrap();
    up.0[0].wait().unwrap();
    let stopped = tokio::time::timeout(Duration::from_secs(30), async {
        while services.iter().any(|p| running(p)) {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    let survivors: Vec<String> = services
        .iter()
        .filter(|p| running(p))
        .map(|p| {
            let name = std::fs::read_to_string(format!("/proc/{p}/cmdline")).unwrap_or_default();
            format!("{p} ({})", name.replace('\0', " ").trim())
        })
        .collect();
    assert!(
        stopped.is_ok() && survivors.is_empty(),
        "still running 30 s after arl up was killed: {survivors:?}"
    );
    (state, url, up)
}

/// Whether process `pid` exists and is not a zombie.
fn running(pid: &str) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            stat.rsplit_once(") ")
                .map(|(_, rest)| !rest.starts_with('Z'))
        })
        .unwrap_or(false)
}

/// A program of the observability venv (`make observability`).
fn observability_tool(name: &str) -> std::path::PathBuf {
    let python = std::env::var_os("ARL_OBSERVABILITY_PYTHON")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::PathBuf::from(std::env::var("HOME").unwrap())
                .join(".cache/arl/observability/bin/python")
        });
    python.with_file_name(name)
}

/// `observability.py COMMAND PATH`'s JSON answer.
fn observability_py(command: &str, path: &Path) -> serde_json::Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/observability.py");
    let output = Command::new(observability_tool("python"))
        .arg(script)
        .arg(command)
        .arg(path)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "observability.py {command}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap()
}

/// The services a trial's trace must hold spans of.
const TRIAL_SERVICES: [&str; 5] = [
    "arl-rollout",
    "arl-proxy",
    "arl-inference",
    "arl-sandbox",
    "arl-reward",
];

/// A span attribute as Phoenix returns it: flat (`"service.name"`) or nested.
fn attribute<'a>(span: &'a serde_json::Value, key: &str) -> Option<&'a serde_json::Value> {
    let attributes = &span["attributes"];
    attributes.get(key).or_else(|| {
        key.split('.')
            .try_fold(attributes, |value, part| value.get(part))
    })
}

/// Every span of the `arl` project, through Phoenix's REST API.
async fn phoenix_spans(ui: &str) -> Vec<serde_json::Value> {
    let mut spans = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let mut url = format!("{ui}/v1/projects/arl/spans?limit=1000");
        if let Some(c) = &cursor {
            url.push_str(&format!("&cursor={c}"));
        }
        let Ok(response) = arl_testkit::http(&url, "GET", &[], b"").await else {
            return spans;
        };
        if response.status != 200 {
            return spans;
        }
        let page: serde_json::Value = response.json();
        spans.extend(page["data"].as_array().cloned().unwrap_or_default());
        match page["next_cursor"].as_str() {
            Some(next) => cursor = Some(next.to_owned()),
            None => return spans,
        }
    }
}

/// Each of `trials` is one trace in Phoenix holding spans of every service it crossed, and
/// no trace holds two trials; Chromium renders one trial's trace in Phoenix's UI (the DOM
/// names its spans; the screenshot is kept under the target folder's test-artifacts).
async fn traces_in_phoenix(state: &Path, trials: &[String]) {
    use std::collections::{BTreeMap, BTreeSet};
    let ui = std::fs::read_to_string(state.join("traces-url")).unwrap();
    // trace id → (trials whose root span it holds, services seen, span names)
    type Traces = BTreeMap<String, (BTreeSet<String>, BTreeSet<String>, BTreeSet<String>)>;
    let fold = |spans: &[serde_json::Value]| {
        let mut traces = Traces::new();
        for span in spans {
            let trace = span["context"]["trace_id"].as_str().unwrap_or_default();
            let entry = traces.entry(trace.to_owned()).or_default();
            if span["name"] == "trial"
                && let Some(trial) = attribute(span, "trial").and_then(|t| t.as_str())
            {
                entry.0.insert(trial.to_owned());
            }
            if let Some(service) = attribute(span, "service.name").and_then(|s| s.as_str()) {
                entry.1.insert(service.to_owned());
            }
            entry
                .2
                .insert(span["name"].as_str().unwrap_or_default().to_owned());
        }
        traces
    };
    let complete = |traces: &Traces| {
        trials.iter().all(|trial| {
            traces.values().any(|(held, services, _)| {
                held.contains(trial) && TRIAL_SERVICES.iter().all(|s| services.contains(*s))
            })
        })
    };
    // Spans leave each service in batches (every few seconds).
    let traces = arl_testkit::wait_for(
        "every trial's spans in Phoenix",
        Duration::from_secs(90),
        || async {
            let traces = fold(&phoenix_spans(&ui).await);
            if complete(&traces) {
                Some(traces)
            } else {
                tokio::time::sleep(Duration::from_secs(1)).await;
                None
            }
        },
    )
    .await;
    for (trace, (held, _, _)) in &traces {
        assert!(
            held.len() <= 1,
            "trace {trace} holds several trials: {held:?}"
        );
    }
    let (trace, (_, _, names)) = traces
        .iter()
        .find(|(_, (held, _, _))| held.contains(&trials[0]))
        .unwrap();
    for name in [
        "trial",
        "agent turn",
        "llm_call",
        "generate",
        "sandbox exec",
        "grade",
        "trajectory hand-off",
    ] {
        assert!(
            names.contains(name),
            "trace {trace} has no {name} span: {names:?}"
        );
    }

    // The same trace through the UI a person opens.
    let project: serde_json::Value =
        arl_testkit::http(&format!("{ui}/v1/projects/arl"), "GET", &[], b"")
            .await
            .unwrap()
            .json();
    let page = format!(
        "{ui}/projects/{}/traces/{trace}",
        project["data"]["id"].as_str().unwrap()
    );
    let artifacts =
        Path::new(&std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".into()))
            .join("test-artifacts");
    std::fs::create_dir_all(&artifacts).unwrap();
    let chromium = |mode: &str| {
        Command::new("chromium")
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                "--window-size=1600,1000",
                "--virtual-time-budget=20000",
                mode,
                &page,
            ])
            .stderr(Stdio::null())
            .output()
            .expect("chromium (apt-get install chromium; make deps installs it)")
    };
    let dom = String::from_utf8_lossy(&chromium("--dump-dom").stdout).into_owned();
    for name in ["trial", "llm_call", "generate"] {
        assert!(
            dom.contains(&format!(">{name}<")),
            "Phoenix's page for trace {trace} does not show a {name} span"
        );
    }
    let shot = artifacts.join("phoenix-trial-trace.png");
    let _ = chromium(&format!("--screenshot={}", shot.display()));
    let png = std::fs::read(&shot).unwrap();
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 20_000,
        "{} bytes",
        png.len()
    );
}

/// Every address in `metrics-targets.json` serves OpenMetrics text a strict parser takes,
/// with the engine's vLLM families and the trainer's step families.
fn metrics_parse(state: &Path) {
    let found = observability_py("metrics", &state.join("metrics-targets.json"));
    let services = found.as_object().unwrap();
    assert_eq!(services.len(), 10, "{:?}", services.keys());
    let expect = |service: &str, families: &[(&str, &str)]| {
        for (family, kind) in families {
            assert_eq!(
                found[service][family], *kind,
                "{service} has no {kind} {family}: {}",
                found[service]
            );
        }
    };
    expect(
        "arl-inference",
        &[
            ("vllm:time_to_first_token_seconds", "histogram"),
            ("vllm:time_per_output_token_seconds", "histogram"),
            ("vllm:e2e_request_latency_seconds", "histogram"),
            ("vllm:num_requests_running", "gauge"),
            ("vllm:num_requests_waiting", "gauge"),
            ("vllm:kv_cache_usage_perc", "gauge"),
            ("vllm:generation_tokens", "counter"),
        ],
    );
    expect(
        "arl-trainer",
        &[
            ("arl_trainer_steps", "counter"),
            ("arl_trainer_pg_loss", "gauge"),
            ("arl_trainer_grad_norm", "gauge"),
            ("arl_trainer_reward_mean", "gauge"),
            ("arl_trainer_tokens_per_second", "gauge"),
            ("arl_trainer_heap_in_use_bytes", "gauge"),
        ],
    );
    expect(
        "arl-proxy",
        &[
            ("arl_proxy_calls", "counter"),
            ("arl_proxy_call_seconds", "histogram"),
        ],
    );
    // The runtime's families are in every service's text.
    for service in services.keys() {
        expect(service, &[("arl_publish_retries", "counter")]);
    }
    // Every series the Grafana dashboard charts is one a service serves.
    let served: std::collections::BTreeSet<&str> = services
        .values()
        .flat_map(|families| families.as_object().unwrap().keys().map(String::as_str))
        .collect();
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/grafana/arl-dashboard.json"),
        )
        .unwrap(),
    )
    .unwrap();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().unwrap();
            let names = expr
                .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
                .filter(|t| t.starts_with("arl_") || t.starts_with("vllm:"));
            for name in names {
                let family = ["_bucket", "_total", "_sum", "_count"]
                    .iter()
                    .find_map(|suffix| name.strip_suffix(suffix))
                    .unwrap_or(name);
                assert!(
                    served.contains(family),
                    "the dashboard's panel {:?} charts {name}, which no service serves",
                    panel["title"]
                );
            }
        }
    }
}

/// The run's TensorBoard scalars as TensorBoard's own reader sees them, once the train
/// step and evaluations are in.
async fn tensorboard_scalars(state: &Path, run: &str) -> serde_json::Value {
    let logdir = state.join("tensorboard");
    arl_testkit::wait_for(
        "the run's TensorBoard scalars",
        Duration::from_secs(60),
        || async {
            if !logdir.exists() {
                tokio::time::sleep(Duration::from_secs(1)).await;
                return None;
            }
            let scalars = observability_py("tensorboard", &logdir)[run].clone();
            if scalars.get("actor/pg_loss").is_some()
                && scalars.get("val/test_score/mean").is_some()
            {
                Some(scalars)
            } else {
                tokio::time::sleep(Duration::from_secs(1)).await;
                None
            }
        },
    )
    .await
}
