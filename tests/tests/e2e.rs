//! The real `arl` and `arl-controller` binaries against a private `nats-server -js`.
//! Build them first: `cargo build --bins` (`make test` does).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use arl_runtime::bus::BusConfig;
use arl_runtime::{Bus, Metrics};
use arl_schemas::events::{EvaluationCompletedV1, Example, TrainStepV2};
use arl_schemas::state::{RunStateV1, RunStatus};
use arl_schemas::{Bucket, Namespace, RunId};
use arl_testkit::{NatsServer, built_binary, free_port, http, test_namespace, wait_for};

struct Deployment {
    server: NatsServer,
    ns: Namespace,
    files: tempfile::TempDir,
    controller: Option<Child>,
}

impl Deployment {
    fn start() -> Self {
        let mut deployment = Self::without_controller();
        deployment.start_controller();
        deployment
    }

    fn without_controller() -> Self {
        let server = NatsServer::start().unwrap();
        let files = tempfile::tempdir().unwrap();
        let models = files.path().join("models");
        std::fs::create_dir_all(&models).unwrap();
        // Admission only reads the header; the real model is the model core's business.
        std::fs::write(
            models.join("SmolLM2-135M-Instruct.Q4_1.gguf"),
            b"GGUF\x03\0\0\0",
        )
        .unwrap();
        std::fs::create_dir_all(files.path().join("tasks/fix-add")).unwrap();
        std::fs::write(
            files.path().join("tasks/fix-add/task.toml"),
            "version = \"1.0\"\n",
        )
        .unwrap();
        std::fs::write(
            files.path().join("smoke.toml"),
            "name = \"e2e\"\n[data]\ndataset = \"tasks\"\n[trainer]\ntotal_steps = 2\n",
        )
        .unwrap();
        Self {
            server,
            ns: test_namespace(),
            files,
            controller: None,
        }
    }

    fn env(&self, command: &mut Command) {
        command
            .env("NATS_URL", self.server.url())
            .env("ARL_PREFIX", self.ns.prefix().unwrap())
            .env("ARL_MODEL_DIR", self.files.path().join("models"))
            .env("RUST_LOG", "warn");
    }

    fn start_controller(&mut self) {
        let mut command = Command::new(built_binary("arl-controller"));
        self.env(&mut command);
        command.stdout(Stdio::null()).stderr(Stdio::inherit());
        self.controller = Some(command.spawn().unwrap());
    }

    /// SIGKILL: no graceful shutdown, no flushing.
    fn kill_controller(&mut self) {
        let mut child = self.controller.take().unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
    }

    fn arl(&self, args: &[&str]) -> Output {
        let mut command = Command::new(built_binary("arl"));
        self.env(&mut command);
        command
            .args(args)
            .current_dir(self.files.path())
            .output()
            .unwrap()
    }

    async fn bus(&self) -> Bus {
        Bus::connect(
            BusConfig::new(self.server.url(), self.ns.clone(), "e2e"),
            Metrics::new(),
        )
        .await
        .unwrap()
    }

    async fn state(&self, bus: &Bus, run_id: &RunId) -> Option<RunStateV1> {
        let kv = bus.bucket(Bucket::RunState).await.ok()?;
        Some(RunStateV1::decode(&kv.get(run_id.as_str()).await.ok()??).unwrap())
    }
}

impl Drop for Deployment {
    fn drop(&mut self) {
        if let Some(mut child) = self.controller.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// SIGTERM, then the exit status (within 20 s).
async fn terminate(child: &mut Child) -> std::process::ExitStatus {
    let sent = Command::new("kill")
        .arg("-TERM")
        .arg(child.id().to_string())
        .status()
        .unwrap();
    assert!(sent.success());
    wait_for("the process to exit", Duration::from_secs(20), || {
        let exited = child.try_wait().unwrap();
        async move { exited }
    })
    .await
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[tokio::test(flavor = "multi_thread")]
async fn submit_status_and_list_through_the_real_binaries() {
    let deployment = Deployment::start();
    let submitted = deployment.arl(&["run", "submit", "smoke.toml", "--wait"]);
    assert!(submitted.status.success(), "{}", text(&submitted.stderr));
    let run_id = text(&submitted.stdout).trim().to_owned();
    assert!(run_id.starts_with("run-"), "{run_id}");
    assert!(
        text(&submitted.stderr).contains("accepted"),
        "{}",
        text(&submitted.stderr)
    );

    let status = deployment.arl(&["run", "status", &run_id]);
    assert!(status.status.success());
    let shown = text(&status.stdout);
    assert!(shown.contains("status      accepted"), "{shown}");
    assert!(shown.contains("step 0/2"), "{shown}");

    let listed = deployment.arl(&["run", "list"]);
    assert!(text(&listed.stdout).contains(&run_id));
    let json = deployment.arl(&["run", "status", &run_id, "--json"]);
    let state: RunStateV1 = serde_json_from(&json.stdout);
    assert_eq!(state.status, RunStatus::Accepted);
}

fn serde_json_from(bytes: &[u8]) -> RunStateV1 {
    RunStateV1::decode(bytes).unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_cli_explains_what_is_wrong_with_exit_codes() {
    let deployment = Deployment::start();
    std::fs::write(
        deployment.files.path().join("bad.toml"),
        "[rollout]\nn = 0\ntop_p = 7\n",
    )
    .unwrap();
    let bad = deployment.arl(&["run", "submit", "bad.toml"]);
    assert_eq!(bad.status.code(), Some(2));
    let message = text(&bad.stderr);
    assert!(
        message.contains("rollout.n: must be at least 1"),
        "{message}"
    );
    assert!(message.contains("rollout.top_p"), "{message}");

    let missing = deployment.arl(&["run", "submit", "nope.toml"]);
    assert_eq!(missing.status.code(), Some(2));
    assert!(text(&missing.stderr).contains("cannot read nope.toml"));

    let unknown = deployment.arl(&["run", "status", "run-unknown"]);
    assert_eq!(unknown.status.code(), Some(4));
    assert!(text(&unknown.stderr).contains("arl run list"));

    let mut command = Command::new(built_binary("arl"));
    let offline = command
        .args(["run", "list"])
        .env("NATS_URL", "nats://127.0.0.1:1")
        .output()
        .unwrap();
    assert_eq!(offline.status.code(), Some(3));
    assert!(
        text(&offline.stderr).contains("cannot connect to NATS"),
        "{}",
        text(&offline.stderr)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_killed_controller_restarts_with_the_run_intact_and_watch_sees_it_finish() {
    let mut deployment = Deployment::start();
    let submitted = deployment.arl(&["run", "submit", "smoke.toml", "--wait"]);
    assert!(submitted.status.success(), "{}", text(&submitted.stderr));
    let run_id = RunId::new(text(&submitted.stdout).trim()).unwrap();
    let bus = deployment.bus().await;

    let step = |n: u32| TrainStepV2 {
        run_id: run_id.clone(),
        step: n,
        policy_version: u64::from(n),
        ..TrainStepV2::example()
    };
    bus.publish(&step(1)).await.unwrap();
    wait_for("step 1 recorded", Duration::from_secs(30), || async {
        deployment
            .state(&bus, &run_id)
            .await
            .filter(|s| s.step == 1)
    })
    .await;

    deployment.kill_controller();
    bus.publish(&step(2)).await.unwrap();
    let eval = EvaluationCompletedV1 {
        run_id: run_id.clone(),
        step: 2,
        ..EvaluationCompletedV1::example()
    };
    bus.publish(&eval).await.unwrap();
    let while_down = deployment.state(&bus, &run_id).await.unwrap();
    assert_eq!(while_down.step, 1);
    assert_eq!(while_down.status, RunStatus::Running);

    deployment.start_controller();
    let watched = deployment.arl(&["run", "watch", run_id.as_str(), "--timeout-s", "60"]);
    assert!(watched.status.success(), "{}", text(&watched.stderr));
    let shown = text(&watched.stdout);
    assert!(shown.contains("status      completed"), "{shown}");
    assert!(shown.contains("progress    100%"), "{shown}");
    let state = deployment.state(&bus, &run_id).await.unwrap();
    assert_eq!(state.steps.len(), 2);
    assert_eq!(state.name, "e2e");
}

/// `arl run watch` outlives its watch failing: nats-server stalls (stopped for 15 s, as an
/// overloaded machine starves it) so the watch misses its idle heartbeats, then restarts;
/// the watch is opened again and still sees the run complete.
#[tokio::test(flavor = "multi_thread")]
async fn run_watch_follows_a_run_across_a_stalled_and_restarted_nats_server() {
    let mut deployment = Deployment::start();
    let submitted = deployment.arl(&["run", "submit", "smoke.toml", "--wait"]);
    assert!(submitted.status.success(), "{}", text(&submitted.stderr));
    let run_id = RunId::new(text(&submitted.stdout).trim()).unwrap();
    let mut watch = Command::new(built_binary("arl"));
    deployment.env(&mut watch);
    let watch = watch
        .args(["run", "watch", run_id.as_str(), "--timeout-s", "120"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let pid = deployment.server.pid().unwrap().to_string();
    let signal = |name: &str| {
        let sent = Command::new("kill").args([name, &pid]).status().unwrap();
        assert!(sent.success(), "kill {name} {pid}");
    };
    signal("-STOP");
    tokio::time::sleep(Duration::from_secs(15)).await;
    signal("-CONT");
    tokio::time::sleep(Duration::from_secs(2)).await;
    deployment.server.restart().unwrap();
    let bus = deployment.bus().await;
    for n in 1..=2 {
        bus.publish(&TrainStepV2 {
            run_id: run_id.clone(),
            step: n,
            policy_version: u64::from(n),
            ..TrainStepV2::example()
        })
        .await
        .unwrap();
    }
    bus.publish(&EvaluationCompletedV1 {
        run_id: run_id.clone(),
        step: 2,
        ..EvaluationCompletedV1::example()
    })
    .await
    .unwrap();
    let watched = tokio::task::spawn_blocking(move || watch.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    assert!(watched.status.success(), "{}", text(&watched.stderr));
    assert!(
        text(&watched.stdout).contains("status      completed"),
        "{}",
        text(&watched.stdout)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_stops_the_controller_gracefully() {
    let mut deployment = Deployment::start();
    // Wait until it serves: a submitted run gets decided.
    let submitted = deployment.arl(&["run", "submit", "smoke.toml", "--wait"]);
    assert!(submitted.status.success(), "{}", text(&submitted.stderr));
    let mut child = deployment.controller.take().unwrap();
    let status = terminate(&mut child).await;
    assert!(status.success(), "controller exited with {status}");
}

/// One executable, any set of services: `arl serve controller + dataset` runs both in one
/// process, each with its own flags and ops endpoints; a run submitted to it is admitted
/// (the controller) and its dataset loaded (the dataset service); SIGTERM drains both.
#[tokio::test(flavor = "multi_thread")]
async fn arl_serve_hosts_several_services_in_one_process() {
    let deployment = Deployment::without_controller();
    let (controller_port, dataset_port) = (free_port().unwrap(), free_port().unwrap());
    let mut command = Command::new(built_binary("arl"));
    deployment.env(&mut command);
    let mut served = command
        .args(["serve", "controller", "--http-addr"])
        .arg(format!("127.0.0.1:{controller_port}"))
        .args(["+", "dataset", "--http-addr"])
        .arg(format!("127.0.0.1:{dataset_port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    for (service, port) in [("controller", controller_port), ("dataset", dataset_port)] {
        let ready = wait_for(service, Duration::from_secs(30), || async move {
            let r = http(&format!("http://127.0.0.1:{port}/ready"), "GET", &[], b"")
                .await
                .ok()?;
            (r.status == 200).then_some(r.json::<serde_json::Value>())
        })
        .await;
        assert_eq!(ready["service"], service, "{ready}");
    }
    let submitted = deployment.arl(&["run", "submit", "smoke.toml", "--wait"]);
    assert!(submitted.status.success(), "{}", text(&submitted.stderr));
    let run_id = RunId::new(text(&submitted.stdout).trim()).unwrap();
    let bus = deployment.bus().await;
    // The dataset service of the same process loaded the run's dataset: registered, or
    // refused with its reason — either way it answered.
    let state = wait_for(
        "the dataset service's answer",
        Duration::from_secs(30),
        || {
            let (bus, run_id) = (bus.clone(), run_id.clone());
            let deployment = &deployment;
            async move {
                let state = deployment.state(&bus, &run_id).await?;
                (state.dataset_digest.is_some() || state.status == RunStatus::Failed)
                    .then_some(state)
            }
        },
    )
    .await;
    assert!(
        state.dataset_digest.is_some()
            || state
                .failure_reason
                .as_deref()
                .is_some_and(|e| e.contains("dataset")),
        "{state:?}"
    );
    let status = terminate(&mut served).await;
    assert!(status.success(), "arl serve exited with {status}");
}
