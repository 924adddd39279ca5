//! The controller against a real `nats-server -js`: admission, rejection with field
//! paths, undecodable input, restarts of the controller and of the server, duplicates.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use arl_controller::{Controller, ControllerConfig};
use arl_runtime::bus::BusConfig;
use arl_runtime::{Bus, Metrics, Shutdown, headers};
use arl_schemas::events::{
    EvaluationCompletedV1, Example, FailureClass, RunAcceptedV1, RunCompletedV1, RunProgressV1,
    RunRejectedV1, RunRequestedV1, TrainStepV2, TrialFailedV1, TrialFinishedV1,
};
use arl_schemas::spec::RunSpec;
use arl_schemas::state::{RunStateV1, RunStatus};
use arl_schemas::{Bucket, Domain, Event, Namespace, RunId, TrialId};
use arl_testkit::{NatsServer, test_namespace, wait_for};

/// A model folder holding a file with a GGUF header, and a Harbor dataset with one task:
/// enough for admission, which only checks that they are there and look right.
struct Resources {
    dir: tempfile::TempDir,
}

impl Resources {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("models")).unwrap();
        std::fs::write(
            dir.path().join("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
            b"GGUF\x03\0\0\0",
        )
        .unwrap();
        std::fs::create_dir_all(dir.path().join("tasks/fix-add")).unwrap();
        std::fs::write(
            dir.path().join("tasks/fix-add/task.toml"),
            "version = \"1.0\"\n",
        )
        .unwrap();
        Self { dir }
    }

    fn model_dir(&self) -> std::path::PathBuf {
        self.dir.path().join("models")
    }

    fn spec(&self) -> RunSpec {
        let mut spec = RunSpec {
            name: "smoke".into(),
            ..RunSpec::default()
        };
        spec.data.dataset = self.dir.path().join("tasks").display().to_string();
        spec
    }
}

struct Harness {
    server: NatsServer,
    ns: Namespace,
    bus: Bus,
    resources: Resources,
}

impl Harness {
    async fn start() -> Self {
        let server = NatsServer::start().unwrap();
        let ns = test_namespace();
        let bus = Bus::connect(
            BusConfig::new(server.url(), ns.clone(), "test"),
            Metrics::new(),
        )
        .await
        .unwrap();
        bus.provision().await.unwrap();
        Self {
            server,
            ns,
            bus,
            resources: Resources::new(),
        }
    }

    async fn controller(&self) -> Shutdown {
        self.controller_flushing_every(ControllerConfig::default().progress_interval)
            .await
    }

    async fn controller_flushing_every(&self, progress_interval: Duration) -> Shutdown {
        let shutdown = Shutdown::new();
        let config = ControllerConfig {
            model_dir: self.resources.model_dir(),
            admission_concurrency: 4,
            tensorboard_dir: None,
            progress_interval,
        };
        Controller::new(self.bus.clone(), config)
            .await
            .unwrap()
            .start(&shutdown);
        shutdown
    }

    fn request(&self, spec: RunSpec) -> RunRequestedV1 {
        RunRequestedV1 {
            run_id: RunId::generate(),
            spec,
            ..RunRequestedV1::example()
        }
    }

    async fn state(&self, run_id: &RunId) -> Option<RunStateV1> {
        let kv = self.bus.bucket(Bucket::RunState).await.ok()?;
        let bytes = kv.get(run_id.as_str()).await.ok()??;
        Some(RunStateV1::decode(&bytes).unwrap())
    }

    async fn wait_state(
        &self,
        run_id: &RunId,
        what: &str,
        check: impl Fn(&RunStateV1) -> bool,
    ) -> RunStateV1 {
        wait_for(what, Duration::from_secs(30), || async {
            self.state(run_id).await.filter(|s| check(s))
        })
        .await
    }

    /// Submits a run of the harness's spec and waits for its acceptance.
    async fn accepted_run(&self) -> RunId {
        let request = self.request(self.resources.spec());
        self.bus.publish(&request).await.unwrap();
        self.wait_state(&request.run_id, "accepted", |s| {
            s.status == RunStatus::Accepted
        })
        .await;
        request.run_id
    }

    /// Waits for a `run.progress` of `run` that counted `trials` finished trials.
    async fn wait_progress_counting(&self, run: &RunId, trials: u64, timeout: Duration) {
        wait_for(
            &format!("a progress with {trials} trials"),
            timeout,
            || async { (!progress_counting(self, run, trials).await.is_empty()).then_some(()) },
        )
        .await;
    }

    async fn events<E: Event>(&self, domain: Domain, run_id: &RunId, event: &str) -> Vec<E> {
        let filter = self.ns.event_subject(domain, run_id, event);
        self.bus.replay::<E>(domain, filter).await.unwrap()
    }

    /// A run's events of one kind once there is one: the controller stores a run's state
    /// before it publishes the event, so reading right after the state can find none yet.
    async fn wait_events<E: Event>(&self, domain: Domain, run_id: &RunId, event: &str) -> Vec<E> {
        wait_for(event, Duration::from_secs(10), || async {
            let events: Vec<E> = self.events(domain, run_id, event).await;
            (!events.is_empty()).then_some(events)
        })
        .await
    }

    /// Publishes raw bytes on a run's request subject, as a misbehaving client would.
    async fn publish_raw_request(&self, run_id: &str, body: Vec<u8>) {
        let subject = self
            .ns
            .event_subject(Domain::Run, &RunId::new(run_id).unwrap(), "requested");
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(headers::EVENT_TYPE, RunRequestedV1::TYPE);
        headers.insert(headers::EVENT_VERSION, "1");
        self.bus
            .publish_bytes(subject, headers, body.into())
            .await
            .unwrap();
    }
}

async fn stop(shutdown: Shutdown) {
    shutdown.trigger();
    shutdown.wait().await;
}

#[tokio::test]
async fn a_valid_request_is_accepted_and_recorded() {
    let h = Harness::start().await;
    let controller = h.controller().await;
    let request = h.request(h.resources.spec());
    h.bus.publish(&request).await.unwrap();

    let state = h
        .wait_state(&request.run_id, "accepted", |s| {
            s.status == RunStatus::Accepted
        })
        .await;
    assert_eq!(state.name, "smoke");
    assert_eq!(state.total_steps, 2);
    assert!(
        state
            .model_path
            .unwrap()
            .ends_with("SmolLM2-135M-Instruct.Q4_1.gguf")
    );
    let accepted: Vec<RunAcceptedV1> = h
        .wait_events(Domain::Run, &request.run_id, "accepted")
        .await;
    assert_eq!(accepted.len(), 1);
    let progress: Vec<RunProgressV1> =
        wait_for("first progress", Duration::from_secs(10), || async {
            let events: Vec<RunProgressV1> =
                h.events(Domain::Run, &request.run_id, "progress").await;
            (!events.is_empty()).then_some(events)
        })
        .await;
    assert_eq!(progress[0].sequence, 1);
    assert_eq!(progress[0].percent, 0.0);
    stop(controller).await;
}

fn spec_json(resources: &Resources) -> serde_json::Value {
    serde_json::to_value(resources.spec()).unwrap()
}

#[tokio::test]
async fn ten_kinds_of_bad_spec_are_rejected_with_the_field_path() {
    let h = Harness::start().await;
    let controller = h.controller().await;
    let missing = h
        .resources
        .dir
        .path()
        .join("nothing-here")
        .display()
        .to_string();
    let not_gguf = h.resources.dir.path().join("weights.gguf");
    std::fs::write(&not_gguf, b"not a model").unwrap();

    type Mutation = Box<dyn Fn(&mut serde_json::Value)>;
    let cases: Vec<(&str, Mutation)> = vec![
        ("spec.rollout.n", Box::new(|s| s["rollout"]["n"] = 0.into())),
        (
            "spec.rollout.temperature",
            Box::new(|s| s["rollout"]["temperature"] = (-1.0).into()),
        ),
        (
            "spec.rollout.top_p",
            Box::new(|s| s["rollout"]["top_p"] = 1.5.into()),
        ),
        (
            "spec.optim.lr",
            Box::new(|s| s["optim"]["lr"] = "fast".into()),
        ),
        (
            "spec.algorithm.adv_estimator",
            Box::new(|s| s["algorithm"]["adv_estimator"] = "ppo9".into()),
        ),
        (
            "spec.algorithm.clip_ratio_low",
            Box::new(|s| s["algorithm"]["clip_ratio_low"] = (-0.1).into()),
        ),
        (
            "spec.trainer.total_steps",
            Box::new(|s| s["trainer"]["total_steps"] = 0.into()),
        ),
        (
            "spec.trainer.device",
            Box::new(|s| s["trainer"]["device"] = "tpu".into()),
        ),
        (
            "spec.rollout.nn",
            Box::new(|s| s["rollout"]["nn"] = 3.into()),
        ),
        ("spec.data.dataset", {
            let missing = missing.clone();
            Box::new(move |s| s["data"]["dataset"] = missing.clone().into())
        }),
        ("spec.model.path", {
            let path = not_gguf.display().to_string();
            Box::new(move |s| s["model"]["path"] = path.clone().into())
        }),
        (
            "spec.data.train_batch_size",
            Box::new(|s| {
                s["data"]["train_size"] = 2.into();
                s["data"]["train_batch_size"] = 4.into();
            }),
        ),
    ];
    let mut runs = Vec::new();
    for (path, mutate) in &cases {
        let run_id = RunId::generate();
        let mut spec = spec_json(&h.resources);
        mutate(&mut spec);
        let body = serde_json::json!({
            "run_id": run_id,
            "submitted_at": "2026-11-30T12:00:00Z",
            "submitted_by": "test",
            "spec": spec,
        });
        h.publish_raw_request(run_id.as_str(), serde_json::to_vec(&body).unwrap())
            .await;
        runs.push((run_id, *path));
    }
    for (run_id, path) in runs {
        let state = h
            .wait_state(&run_id, "rejected", |s| s.status == RunStatus::Rejected)
            .await;
        let paths: Vec<_> = state.errors.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(paths, [path], "{:?}", state.errors);
        let rejected: Vec<RunRejectedV1> = h.wait_events(Domain::Run, &run_id, "rejected").await;
        assert_eq!(rejected.len(), 1);
        assert_eq!(rejected[0].errors, state.errors);
    }
    stop(controller).await;
}

#[tokio::test]
async fn undecodable_bytes_are_rejected_not_dropped() {
    let h = Harness::start().await;
    let controller = h.controller().await;
    h.publish_raw_request("run-garbage", b"\x89PNG\r\n\x1a\n not json".to_vec())
        .await;
    h.publish_raw_request("run-not-object", b"[1, 2, 3]".to_vec())
        .await;

    for run in ["run-garbage", "run-not-object"] {
        let run_id = RunId::new(run).unwrap();
        let state = h
            .wait_state(&run_id, "rejected", |s| s.status == RunStatus::Rejected)
            .await;
        assert!(!state.errors.is_empty());
        let rejected: Vec<RunRejectedV1> = h.wait_events(Domain::Run, &run_id, "rejected").await;
        assert_eq!(rejected.len(), 1, "{run}");
    }
    let garbage = h.state(&RunId::new("run-garbage").unwrap()).await.unwrap();
    assert!(
        garbage.errors[0].reason.contains("not valid JSON"),
        "{:?}",
        garbage.errors
    );
    stop(controller).await;
}

fn step(run_id: &RunId, step: u32) -> TrainStepV2 {
    TrainStepV2 {
        run_id: run_id.clone(),
        step,
        policy_version: u64::from(step),
        ..TrainStepV2::example()
    }
}

#[tokio::test]
async fn a_restarted_controller_carries_on_with_state_intact() {
    let h = Harness::start().await;
    let controller = h.controller().await;
    let run = h.accepted_run().await;
    h.bus.publish(&step(&run, 1)).await.unwrap();
    h.wait_state(&run, "step 1", |s| s.step == 1).await;
    stop(controller).await;

    // While it is down the pipeline goes on.
    let mut failed = TrialFailedV1::example();
    failed.run_id = run.clone();
    failed.class = FailureClass::Timeout;
    h.bus.publish(&failed).await.unwrap();
    let mut finished = TrialFinishedV1::example();
    finished.run_id = run.clone();
    h.bus.publish(&finished).await.unwrap();
    h.bus.publish(&step(&run, 2)).await.unwrap();
    let mut eval = EvaluationCompletedV1::example();
    eval.run_id = run.clone();
    eval.step = 2;
    h.bus.publish(&eval).await.unwrap();

    let controller = h.controller().await;
    let state = h
        .wait_state(&run, "completed, with both trials", |s| {
            s.status == RunStatus::Completed && s.trials_finished + s.failures.total() == 2
        })
        .await;
    assert_eq!(state.step, 2);
    assert_eq!(state.name, "smoke");
    assert_eq!(state.failures.timeout, 1);
    assert_eq!(state.trials_finished, 1);
    assert_eq!(state.steps.len(), 2);
    assert_eq!(state.evaluations.len(), 1);
    let completed: Vec<RunCompletedV1> = h.wait_events(Domain::Run, &run, "completed").await;
    assert_eq!(completed.len(), 1);
    assert_eq!(completed[0].final_policy_version, 2);
    stop(controller).await;
}

/// `count` finished trials of a run, each its own.
fn finished_trials(run: &RunId, count: u32) -> Vec<TrialFinishedV1> {
    (0..count)
        .map(|i| TrialFinishedV1 {
            run_id: run.clone(),
            trial_id: TrialId::new(format!("trial-{i}")).unwrap(),
            ..TrialFinishedV1::example()
        })
        .collect()
}

/// The `run.progress` events of a run that counted `trials` finished trials.
async fn progress_counting(h: &Harness, run: &RunId, trials: u64) -> Vec<RunProgressV1> {
    let progress: Vec<RunProgressV1> = h.events(Domain::Run, run, "progress").await;
    progress
        .into_iter()
        .filter(|p| p.trials_finished == trials)
        .collect()
}

/// A flood of trial outcomes is announced a flush at a time, not a trial at a time (each
/// `run.progress` is a message id the run stream keeps for its de-duplication window).
#[tokio::test]
async fn trial_counts_are_announced_once_a_flush_not_once_a_trial() {
    let h = Harness::start().await;
    let interval = Duration::from_millis(500);
    let controller = h.controller_flushing_every(interval).await;
    let run = h.accepted_run().await;

    let started = Instant::now();
    for finished in finished_trials(&run, 200) {
        h.bus.publish(&finished).await.unwrap();
    }
    h.wait_progress_counting(&run, 200, Duration::from_secs(30))
        .await;
    let flushes = started.elapsed().as_secs_f64() / interval.as_secs_f64();
    let progress: Vec<RunProgressV1> = h.events(Domain::Run, &run, "progress").await;
    let counting = progress.iter().filter(|p| p.trials_finished > 0).count();
    assert!(
        (counting as f64) <= flushes + 2.0,
        "{counting} progress events in {flushes:.1} flushes"
    );
    let sequences: Vec<u64> = progress.iter().map(|p| p.sequence).collect();
    assert!(
        sequences.windows(2).all(|w| w[0] < w[1]),
        "sequences must rise: {sequences:?}"
    );
    // The last one carries every fold.
    assert_eq!(progress.last().unwrap().sequence, 201);
    stop(controller).await;
}

/// A controller stopped between a trial's fold and the next flush leaves an announcement
/// owed; the next controller to start makes up for it, and a stopping one flushes.
#[tokio::test]
async fn a_starting_controller_announces_what_the_last_one_owed() {
    let h = Harness::start().await;
    let never = Duration::from_secs(3600);
    let first = h.controller_flushing_every(never).await;
    let run = h.accepted_run().await;
    let trials = finished_trials(&run, 5);
    for finished in &trials[..3] {
        h.bus.publish(finished).await.unwrap();
    }
    h.wait_state(&run, "3 trials", |s| s.trials_finished == 3)
        .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(progress_counting(&h, &run, 3).await.is_empty());

    let second = h.controller_flushing_every(never).await;
    h.wait_progress_counting(&run, 3, Duration::from_secs(10))
        .await;

    for finished in &trials[3..] {
        h.bus.publish(finished).await.unwrap();
    }
    h.wait_state(&run, "5 trials", |s| s.trials_finished == 5)
        .await;
    stop(first).await;
    stop(second).await;
    assert_eq!(progress_counting(&h, &run, 5).await.len(), 1);
}

#[tokio::test]
async fn duplicates_are_processed_once() {
    let h = Harness::start().await;
    let controller = h.controller().await;
    let request = h.request(h.resources.spec());
    let first = h.bus.publish(&request).await.unwrap();
    let second = h.bus.publish(&request).await.unwrap();
    assert!(second.duplicate);
    assert_eq!(first.sequence, second.sequence);
    let run = request.run_id.clone();
    h.wait_state(&run, "accepted", |s| s.status == RunStatus::Accepted)
        .await;

    // The same trial failure published twice (a retrying publisher) counts once.
    let mut failed = TrialFailedV1::example();
    failed.run_id = run.clone();
    h.bus.publish(&failed).await.unwrap();
    h.bus.publish(&failed).await.unwrap();
    let mut other = failed.clone();
    other.slot.attempt = 1;
    h.bus.publish(&other).await.unwrap();
    let state = h
        .wait_state(&run, "two failures", |s| s.failures.total() == 2)
        .await;
    assert_eq!(state.failures.context_overflow, 2);

    let accepted: Vec<RunAcceptedV1> = h.wait_events(Domain::Run, &run, "accepted").await;
    assert_eq!(accepted.len(), 1);
    stop(controller).await;
}

#[tokio::test]
async fn a_request_survives_a_server_restart_before_it_is_consumed() {
    let mut h = Harness::start().await;
    let request = h.request(h.resources.spec());
    h.bus.publish(&request).await.unwrap();
    h.server.restart().unwrap();
    let controller = h.controller().await;
    h.wait_state(&request.run_id, "accepted", |s| {
        s.status == RunStatus::Accepted
    })
    .await;
    stop(controller).await;
}

#[tokio::test]
async fn a_cuda_run_is_admitted_only_where_a_live_trainer_has_a_gpu() {
    use arl_schemas::spec::Device;
    use arl_schemas::state::{GpuDeviceV1, TrainerAnnouncementV1};
    let h = Harness::start().await;
    let controller = h.controller().await;
    let mut spec = h.resources.spec();
    spec.trainer.device = Device::Cuda;

    // Only a trainer without a GPU is alive: rejected before any rollout, with its reason.
    let mut trainer = TrainerAnnouncementV1 {
        instance: "trainer-cpu".into(),
        host: "node-a".into(),
        devices: Vec::new(),
        gpu_unavailable: Some("no CUDA driver: libcuda.so could not be loaded".into()),
        runs: Vec::new(),
        held_capacity: None,
        at: chrono::Utc::now(),
    };
    h.bus.announce_trainer(&trainer).await.unwrap();
    let request = h.request(spec.clone());
    h.bus.publish(&request).await.unwrap();
    let state = h
        .wait_state(&request.run_id, "rejected", |s| {
            s.status == RunStatus::Rejected
        })
        .await;
    assert_eq!(state.errors[0].path, "spec.trainer.device");
    assert!(
        state.errors[0].reason.contains("libcuda.so"),
        "{:?}",
        state.errors
    );

    // A trainer with a GPU announces itself: the same spec is accepted.
    trainer.instance = "trainer-gpu".into();
    trainer.gpu_unavailable = None;
    trainer.devices = vec![GpuDeviceV1 {
        ordinal: 0,
        name: "NVIDIA H200".into(),
        memory_bytes: 150_000_000_000,
        compute_capability: "9.0".into(),
    }];
    h.bus.announce_trainer(&trainer).await.unwrap();
    let request = h.request(spec);
    h.bus.publish(&request).await.unwrap();
    h.wait_state(&request.run_id, "accepted", |s| {
        s.status == RunStatus::Accepted
    })
    .await;
    stop(controller).await;
}
