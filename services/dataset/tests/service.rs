//! The dataset service on a real `nats-server -js`, with the real controller admitting
//! runs: the run's dataset is validated, registered in the object store under its
//! digest (folded into the run's state), announced, and served step by step — the first
//! batch at acceptance, the next after each training step; a dataset with bad rows
//! fails the run with the rows named unless the run allows them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use arl_controller::{Controller, ControllerConfig};
use arl_dataset::service::DatasetService;
use arl_runtime::bus::BusConfig;
use arl_runtime::{Bus, Metrics, Shutdown};
use arl_schemas::dataset::Grading;
use arl_schemas::events::{
    DatasetRegisteredV1, Example, RunFailedV1, RunRequestedV1, Split, TaskBatchV1, TaskKind,
    TrainStepV1,
};
use arl_schemas::spec::{DataSource, RunSpec};
use arl_schemas::state::RunStatus;
use arl_schemas::{Domain, Event, Namespace, RunId};
use arl_testkit::{NatsServer, test_namespace, wait_for};

struct Harness {
    _server: NatsServer,
    ns: Namespace,
    bus: Bus,
    models: tempfile::TempDir,
    _shutdown: Shutdown,
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
        // Admission only checks that the model is there and looks like GGUF.
        let models = tempfile::tempdir().unwrap();
        std::fs::write(
            models.path().join("SmolLM2-135M-Instruct.Q4_1.gguf"),
            b"GGUF\x03\0\0\0",
        )
        .unwrap();
        let shutdown = Shutdown::new();
        let config = ControllerConfig {
            model_dir: models.path().to_path_buf(),
            admission_concurrency: 4,
            tensorboard_dir: None,
            ..ControllerConfig::default()
        };
        Controller::new(bus.clone(), config)
            .await
            .unwrap()
            .start(&shutdown);
        DatasetService::new(bus.clone()).start(&shutdown);
        Self {
            _server: server,
            ns,
            bus,
            models,
            _shutdown: shutdown,
        }
    }

    async fn submit(&self, spec: RunSpec) -> RunId {
        let _ = &self.models;
        let run_id = RunId::generate();
        self.bus
            .publish(&RunRequestedV1 {
                run_id: run_id.clone(),
                spec,
                ..RunRequestedV1::example()
            })
            .await
            .unwrap();
        run_id
    }

    async fn events<E: Event>(&self, domain: Domain, run: &RunId, event: &str) -> Vec<E> {
        let filter = self.ns.event_subject(domain, run, event);
        self.bus.replay::<E>(domain, filter).await.unwrap()
    }

    async fn wait_events<E: Event>(
        &self,
        domain: Domain,
        run: &RunId,
        event: &str,
        count: usize,
    ) -> Vec<E> {
        wait_for(event, Duration::from_secs(30), || async {
            let events = self.events::<E>(domain, run, event).await;
            (events.len() >= count).then_some(events)
        })
        .await
    }
}

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/tasks")
}

fn swebench() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data/swebench")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_harbor_run_is_registered_and_served_one_batch_per_step() {
    let h = Harness::start().await;
    let mut spec = RunSpec::default();
    spec.data.dataset = examples().display().to_string();
    spec.data.val_size = 1;
    spec.data.train_batch_size = 2;
    spec.rollout.n = 4;
    spec.trainer.total_steps = 2;
    let run = h.submit(spec).await;

    let registered = h
        .wait_events::<DatasetRegisteredV1>(Domain::Task, &run, "dataset", 1)
        .await;
    assert_eq!(
        (
            registered[0].train_tasks,
            registered[0].validation_tasks,
            registered[0].invalid_rows
        ),
        (2, 1, 0)
    );
    let digest = registered[0].digest.clone();
    assert!(digest.starts_with("sha256:"));
    // The controller records the digest; the manifest is in the object store.
    let state = wait_for(
        "the digest in the run state",
        Duration::from_secs(30),
        || async {
            h.bus
                .run_state(&run)
                .await
                .unwrap()
                .filter(|s| s.dataset_digest.is_some())
        },
    )
    .await;
    assert_eq!(state.dataset_digest.as_deref(), Some(digest.as_str()));
    let manifest = h.bus.dataset_manifest(&digest).await.unwrap().unwrap();
    assert_eq!(manifest.tasks.len(), 3);
    let fix_mean = manifest
        .tasks
        .iter()
        .find(|t| t.task_id.as_str() == "fix-mean")
        .unwrap();
    assert_eq!(fix_mean.kind, TaskKind::Harbor);
    assert_eq!(fix_mean.environment.name, "harbor/fix-mean");
    assert!(fix_mean.instruction.contains("mean"));
    let Grading::Harbor { tests } = &fix_mean.grading else {
        panic!("{:?}", fix_mean.grading)
    };
    let paths: Vec<&str> = tests.iter().map(|t| t.path.as_str()).collect();
    assert_eq!(paths, ["test.sh", "test_outputs.py"]);

    // Step 1's batch at acceptance: the two training tasks, 4 samples each.
    let batches = h
        .wait_events::<TaskBatchV1>(Domain::Task, &run, "batch", 1)
        .await;
    assert_eq!(batches.len(), 1);
    let first = &batches[0];
    assert_eq!(
        (first.step, first.split, first.samples_per_task),
        (1, Split::Train, 4)
    );
    let mut ids: Vec<&str> = first.tasks.iter().map(|t| t.task_id.as_str()).collect();
    ids.sort();
    let mut train: Vec<&str> = manifest.train.iter().map(|t| t.as_str()).collect();
    train.sort();
    assert_eq!(ids, train);
    assert!(first.tasks.iter().all(|t| t.dataset_digest == digest));

    // After step 1 trains, step 2's batch; after step 2 (the last) nothing more.
    for step in [1, 2] {
        h.bus
            .publish(&TrainStepV1 {
                run_id: run.clone(),
                step,
                policy_version: u64::from(step),
                ..TrainStepV1::example()
            })
            .await
            .unwrap();
    }
    let batches = h
        .wait_events::<TaskBatchV1>(Domain::Task, &run, "batch", 2)
        .await;
    assert_eq!(batches[1].step, 2);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        h.events::<TaskBatchV1>(Domain::Task, &run, "batch")
            .await
            .len(),
        2,
        "no batch past total_steps"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_rows_fail_the_run_unless_it_allows_them() {
    let h = Harness::start().await;
    let dir = tempfile::tempdir().unwrap();
    let good = std::fs::read_to_string(swebench().join("verified_mini_50.jsonl")).unwrap();
    let mut lines: Vec<String> = good.lines().take(5).map(str::to_owned).collect();
    let mut bad: serde_json::Value = serde_json::from_str(&lines[2]).unwrap();
    bad["FAIL_TO_PASS"] = "[\"unterminated".into();
    lines[2] = bad.to_string();
    let file = dir.path().join("rows.jsonl");
    std::fs::write(&file, lines.join("\n")).unwrap();

    let mut spec = RunSpec::default();
    spec.data.source = DataSource::Swebench;
    spec.data.dataset = file.display().to_string();
    spec.data.val_size = 1;
    let strict = h.submit(spec.clone()).await;
    let failed = h
        .wait_events::<RunFailedV1>(Domain::Run, &strict, "failed", 1)
        .await;
    assert_eq!(failed[0].service, "dataset");
    assert!(
        failed[0].reason.contains("rows.jsonl:3: FAIL_TO_PASS")
            && failed[0].reason.contains("allow_invalid_rows"),
        "{}",
        failed[0].reason
    );
    wait_for("the run failed", Duration::from_secs(30), || async {
        h.bus
            .run_state(&strict)
            .await
            .unwrap()
            .filter(|s| s.status == RunStatus::Failed)
    })
    .await;
    assert!(
        h.events::<TaskBatchV1>(Domain::Task, &strict, "batch")
            .await
            .is_empty()
    );

    spec.data.allow_invalid_rows = true;
    let lenient = h.submit(spec).await;
    let registered = h
        .wait_events::<DatasetRegisteredV1>(Domain::Task, &lenient, "dataset", 1)
        .await;
    assert_eq!(
        (
            registered[0].train_tasks,
            registered[0].validation_tasks,
            registered[0].invalid_rows
        ),
        (3, 1, 1)
    );
    let manifest = h
        .bus
        .dataset_manifest(&registered[0].digest)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(manifest.invalid_rows.len(), 1);
    assert_eq!(
        (
            manifest.invalid_rows[0].row.as_str(),
            manifest.invalid_rows[0].field.as_str()
        ),
        ("3", "FAIL_TO_PASS")
    );
    let batches = h
        .wait_events::<TaskBatchV1>(Domain::Task, &lenient, "batch", 1)
        .await;
    assert_eq!(batches[0].tasks[0].kind, TaskKind::Swebench);
}
