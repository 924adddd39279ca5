//! The trainer service against a real nats-server: trajectories in, steps trained,
//! versions written and published; messages held until their step commits; a restarted
//! trainer resumes from its checkpoint and loses nothing.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use arl_model::config::ModelConfig;
use arl_model::load::LoadedModel;
use arl_model::model::Model;
use arl_model::weights::Weights;
use arl_runtime::bus::BusConfig;
use arl_runtime::objects::{ObjectError, StoredFile};
use arl_runtime::{Bus, Metrics, Shutdown};
use arl_schemas::events::{
    CallSpan, Example, SampleStatus, Split, TaskBatchV1, TaskRef, TrainStepV2, TrajectoryBranch,
    TrajectoryV1, WEIGHTS_FILE, WeightsLocation, WeightsPublishedV2,
};
use arl_schemas::spec::RunSpec;
use arl_schemas::state::{RunStatus, TrialRecordV1};
use arl_schemas::{Bucket, Domain, Event, Namespace, ObjectStore, RunId, TaskId, TrialId};
use arl_testkit::{NatsServer, running_run_state, smollm2, test_namespace, wait_for};

/// Waits until `condition` holds.
async fn until<F, Fut>(what: &str, seconds: u64, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    wait_for(what, Duration::from_secs(seconds), || {
        let check = condition();
        async move { check.await.then_some(()) }
    })
    .await;
}
use arl_trainer::checkpoint;
use arl_trainer::service::{Trainer, TrainerConfig, WeightsStore};

/// A tiny llama with SmolLM2's real tokenizer, saved in Hugging Face layout.
fn tiny_model(dir: &Path) -> PathBuf {
    let mut loaded = LoadedModel::open(&smollm2()).unwrap();
    let config = ModelConfig {
        hidden_size: 32,
        intermediate_size: 48,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        ..loaded.model.config.clone()
    };
    loaded.model = Model::new(config.clone(), Weights::random(&config, 5, 0.05));
    let path = dir.join("base");
    loaded.save_hf(&path).unwrap();
    path
}

fn spec() -> RunSpec {
    let mut spec = RunSpec::default();
    spec.data.train_batch_size = 2;
    spec.rollout.n = 2;
    spec.trainer.total_steps = 3;
    spec.trainer.save_every = 1;
    spec.optim.lr = 1e-3;
    spec.optim.weight_decay = 0.0;
    spec
}

async fn put_run_state(bus: &Bus, run: &RunId, spec: RunSpec, model: &Path) {
    let state = running_run_state(run, "trainer-test", &spec, model);
    assert_eq!(state.status, RunStatus::Running);
    let kv = bus.bucket(Bucket::RunState).await.unwrap();
    kv.put(run.as_str(), state.encode().unwrap().into())
        .await
        .unwrap();
}

/// The training `task.batch` of `step` with `tasks` tasks (`task-0`…), as the dataset
/// service publishes it: the trainer reads each step's size from it.
async fn publish_batch(bus: &Bus, run: &RunId, step: u32, tasks: u32, samples: u32) {
    let template = TaskBatchV1::example().tasks[0].clone();
    let batch = TaskBatchV1 {
        run_id: run.clone(),
        step,
        split: Split::Train,
        samples_per_task: samples,
        tasks: (0..tasks)
            .map(|task| TaskRef {
                task_id: TaskId::new(format!("task-{task}")).unwrap(),
                ..template.clone()
            })
            .collect(),
    };
    bus.publish(&batch).await.unwrap();
}

/// Every step's batch: two tasks of `rollout.n` samples.
async fn publish_batches(bus: &Bus, run: &RunId, spec: &RunSpec) {
    for step in 1..=spec.trainer.total_steps {
        publish_batch(bus, run, step, 2, spec.rollout.n).await;
    }
}

/// Publishes a trajectory as the rollout service does: its trial's attempt claimed in
/// `ARL_TRIALS` first (the trainer refuses trajectories of trials nobody requested).
async fn offer(bus: &Bus, t: &TrajectoryV1) {
    claim(bus, &t.trial_id, t.slot.attempt).await;
    bus.publish(t).await.unwrap();
}

/// Claims `attempt` of a trial in `ARL_TRIALS`, as the rollout service does.
async fn claim(bus: &Bus, trial: &TrialId, attempt: u32) {
    bus.modify_record::<TrialRecordV1>(Bucket::Trials, trial.as_str(), |r| {
        *r = Some(TrialRecordV1 {
            attempt,
            done: false,
        });
        true
    })
    .await
    .unwrap();
}

/// Trial `sample` of task `task` at `step`: a prompt and a response the reward pays for
/// when `reward` is 1.
fn trajectory(run: &RunId, step: u32, task: u32, sample: u32, reward: f64) -> TrajectoryV1 {
    let prompt = [1u32, 100 + task, 200 + task, 300];
    let response: [u32; 4] = if reward > 0.0 {
        [42, 43, 44, 2]
    } else {
        [500 + sample, 600, 700, 2]
    };
    let tokens: Vec<u32> = prompt.iter().chain(&response).copied().collect();
    let mut mask = vec![0u8; prompt.len()];
    mask.extend([1u8; 4]);
    let logprobs: Vec<f32> = mask
        .iter()
        .map(|m| if *m == 1 { -10.8 } else { 0.0 })
        .collect();
    let mut t = TrajectoryV1::example();
    t.run_id = run.clone();
    t.trial_id = TrialId::new(format!("trial-{step}-{task}-{sample}")).unwrap();
    t.slot.task_id = TaskId::new(format!("task-{task}")).unwrap();
    t.slot.step = step;
    t.slot.split = Split::Train;
    t.slot.sample_index = sample;
    t.slot.attempt = 0;
    t.status = SampleStatus::Scored;
    t.reward = reward;
    t.num_turns = 2;
    t.branches = vec![TrajectoryBranch {
        token_ids: tokens,
        loss_mask: mask,
        logprobs,
    }];
    t.calls = vec![CallSpan {
        turn_index: 0,
        branch: 0,
        completion_start: 4,
        completion_len: 4,
        policy_version: u64::from(step - 1),
    }];
    t
}

/// One step's four trajectories: two tasks × two trials, one rewarded per task.
fn step_batch(run: &RunId, step: u32) -> Vec<TrajectoryV1> {
    let mut all = Vec::new();
    for task in 0..2 {
        for sample in 0..2 {
            all.push(trajectory(run, step, task, sample, f64::from(sample)));
        }
    }
    all
}

async fn connect(server: &NatsServer, ns: &Namespace) -> Bus {
    let bus = Bus::connect(
        BusConfig::new(server.url(), ns.clone(), "test"),
        Metrics::new(),
    )
    .await
    .unwrap();
    bus.provision().await.unwrap();
    bus
}

fn start_trainer(bus: &Bus, runs_dir: &Path) -> Shutdown {
    start_trainer_with(bus, runs_dir, WeightsStore::File)
}

fn start_trainer_with(bus: &Bus, runs_dir: &Path, weights_store: WeightsStore) -> Shutdown {
    let shutdown = Shutdown::new();
    let config = TrainerConfig {
        runs_dir: runs_dir.to_path_buf(),
        keep_versions: 2,
        capacity: 64,
        ack_wait: Duration::from_secs(2),
        gpu: Some(0),
        weights_store,
    };
    Trainer::new(bus.clone(), config).start(&shutdown);
    shutdown
}

/// The version folder a `weights.published` of the `file` store names.
fn folder(event: &WeightsPublishedV2) -> PathBuf {
    match &event.location {
        WeightsLocation::Folder { path } => PathBuf::from(path),
        other => panic!("not a folder: {other:?}"),
    }
}

async fn events<E: Event>(bus: &Bus, run: &RunId) -> Vec<E> {
    let (domain, event) = E::TYPE.split_once('.').unwrap();
    let domain = [Domain::Train, Domain::Weights, Domain::Run]
        .into_iter()
        .find(|d| d.token() == domain)
        .unwrap();
    let stream = bus
        .jetstream()
        .get_stream(bus.namespace().stream(domain))
        .await
        .unwrap();
    let subject = bus.namespace().event_subject(domain, run, event);
    let mut found = Vec::new();
    let info = stream.get_info().await.unwrap();
    for seq in info.state.first_sequence..=info.state.last_sequence {
        if let Ok(message) = stream.get_raw_message(seq).await
            && message.subject.as_str() == subject
        {
            found.push(E::decode(&message.payload).unwrap());
        }
    }
    found
}

/// Trajectory messages the trainer holds without ack.
async fn held(bus: &Bus) -> usize {
    let stream = bus
        .jetstream()
        .get_stream(bus.namespace().stream(Domain::Trajectory))
        .await
        .unwrap();
    let mut consumer: async_nats::jetstream::consumer::PullConsumer =
        stream.get_consumer("trainer").await.unwrap();
    consumer.info().await.unwrap().num_ack_pending
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trains_steps_publishes_versions_and_resumes_after_a_restart() {
    let server = NatsServer::start().unwrap();
    let ns = test_namespace();
    let bus = connect(&server, &ns).await;
    let tmp = tempfile::tempdir().unwrap();
    let base = tiny_model(tmp.path());
    let runs_dir = tmp.path().join("runs");
    let run = RunId::new("run-trainer-1").unwrap();
    put_run_state(&bus, &run, spec(), &base).await;
    publish_batches(&bus, &run, &spec()).await;

    // Step 1: three of four trajectories are held, nothing is trained.
    let trainer = start_trainer(&bus, &runs_dir);
    let batch = step_batch(&run, 1);
    for t in &batch[..3] {
        offer(&bus, t).await;
    }
    until("three trajectories held", 60, || async {
        held(&bus).await == 3
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await; // past ack_wait: still held, not trained
    assert_eq!(held(&bus).await, 3);
    assert!(events::<TrainStepV2>(&bus, &run).await.is_empty());
    // The fourth completes the batch: the step trains and every message is acked.
    offer(&bus, &batch[3]).await;
    until("step 1 published", 120, || async {
        events::<WeightsPublishedV2>(&bus, &run).await.len() == 1
    })
    .await;
    let steps = events::<TrainStepV2>(&bus, &run).await;
    let m = &steps[0].metrics;
    assert!(m.pg_loss.is_finite() && m.grad_norm > 0.0, "{m:?}");
    assert_eq!(
        (m.trajectories, m.reward_mean, m.num_turns_mean),
        (4, 0.5, 2.0)
    );
    assert!(m.tokens_per_second > 0.0 && m.lr > 0.0);
    until("step 1 acked", 30, || async { held(&bus).await == 0 }).await;

    // The version is a loadable Hugging Face folder whose checksum is the one published.
    let v1 = &events::<WeightsPublishedV2>(&bus, &run).await[0];
    assert_eq!((v1.policy_version, v1.step), (1, 1));
    let dir = folder(v1);
    let (sha, size) = arl_runtime::digest::sha256_file(&dir.join("model.safetensors")).unwrap();
    assert_eq!((sha.as_str(), size), (v1.sha256.as_str(), v1.size_bytes));
    let trained = LoadedModel::open(&dir).unwrap();
    let original = LoadedModel::open(&base).unwrap();
    assert_ne!(
        trained.model.weights().embed.data,
        original.model.weights().embed.data
    );
    // The rewarded response became more likely.
    let rewarded = &batch[1].branches[0].token_ids;
    let lp = |m: &LoadedModel| {
        m.model.forward_train(&[rewarded]).1[0][3..]
            .iter()
            .sum::<f32>()
    };
    assert!(
        lp(&trained) > lp(&original),
        "{} vs {}",
        lp(&trained),
        lp(&original)
    );

    // Step 2: two trajectories held, then the trainer stops (crash or redeploy).
    let batch = step_batch(&run, 2);
    for t in &batch[..2] {
        offer(&bus, t).await;
    }
    until("two trajectories held", 30, || async {
        held(&bus).await == 2
    })
    .await;
    trainer.trigger();
    tokio::time::timeout(Duration::from_secs(30), trainer.wait())
        .await
        .expect("the trainer stops promptly with messages held");

    // A new trainer resumes from step 1's checkpoint; a late duplicate of step 1 is acked
    // without training; the held step-2 messages come back and the step trains whole.
    let trainer = start_trainer(&bus, &runs_dir);
    offer(&bus, &trajectory(&run, 1, 0, 0, 0.0)).await;
    for t in &batch[2..] {
        offer(&bus, t).await;
    }
    until("step 2 published", 120, || async {
        events::<WeightsPublishedV2>(&bus, &run).await.len() == 2
    })
    .await;
    let steps = events::<TrainStepV2>(&bus, &run).await;
    assert_eq!(steps.len(), 2);
    assert_eq!(steps[1].metrics.trajectories, 4);
    let (_, state) = checkpoint::latest_checkpoint(&runs_dir.join(run.as_str())).unwrap();
    assert_eq!(
        (state.step, state.optimizer_step),
        (2, Some(2)),
        "AdamW resumed at step 1"
    );
    until("step 2 acked", 30, || async { held(&bus).await == 0 }).await;
    trainer.trigger();
    trainer.wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_trajectories_are_dead_lettered_and_untrainable_runs_fail() {
    let server = NatsServer::start().unwrap();
    let ns = test_namespace();
    let bus = connect(&server, &ns).await;
    let tmp = tempfile::tempdir().unwrap();
    let runs_dir = tmp.path().join("runs");
    let trainer = start_trainer(&bus, &runs_dir);

    // Misaligned arrays: dead-lettered with the reason.
    let run = RunId::new("run-trainer-bad").unwrap();
    put_run_state(&bus, &run, spec(), &tmp.path().join("no-such-model")).await;
    publish_batches(&bus, &run, &spec()).await;
    let mut bad = trajectory(&run, 1, 1, 1, 1.0);
    bad.branches[0].loss_mask.pop();
    offer(&bus, &bad).await;
    let dlq = bus
        .jetstream()
        .get_stream(ns.stream(Domain::DeadLetter))
        .await
        .unwrap();
    until("the dead letter", 30, || async {
        dlq.clone().get_info().await.unwrap().state.messages == 1
    })
    .await;

    // A trajectory of a trial the rollout service never requested (no ARL_TRIALS entry),
    // or of an attempt it never claimed: refused, never trained on.
    let forged = trajectory(&run, 1, 2, 0, 1.0);
    bus.publish(&forged).await.unwrap();
    let mut beyond = trajectory(&run, 1, 2, 1, 1.0);
    claim(&bus, &beyond.trial_id, 0).await;
    beyond.slot.attempt = 1;
    bus.publish(&beyond).await.unwrap();
    until("the forged trajectories dead-lettered", 30, || async {
        dlq.clone().get_info().await.unwrap().state.messages == 3
    })
    .await;

    // A model that cannot be loaded fails the run with the reason.
    offer(&bus, &trajectory(&run, 1, 0, 0, 1.0)).await;
    until("run.failed", 30, || async {
        !events::<arl_schemas::events::RunFailedV1>(&bus, &run)
            .await
            .is_empty()
    })
    .await;
    let failed = &events::<arl_schemas::events::RunFailedV1>(&bus, &run).await[0];
    assert_eq!(failed.service, "trainer");
    assert!(failed.reason.contains("no-such-model"), "{}", failed.reason);
    trainer.trigger();
    trainer.wait().await;
}

/// The object store's files of a published version, fetched into `dir`.
async fn fetch_all(bus: &Bus, event: &WeightsPublishedV2, dir: &Path) -> Vec<String> {
    let WeightsLocation::ObjectStore { bucket, files } = &event.location else {
        panic!("not in the object store: {:?}", event.location)
    };
    assert_eq!(bucket, &bus.namespace().object_store(ObjectStore::Weights));
    std::fs::create_dir_all(dir).unwrap();
    for file in files {
        let expected = StoredFile {
            sha256: file.sha256.clone(),
            size_bytes: file.size_bytes,
        };
        bus.get_file(
            ObjectStore::Weights,
            &file.object,
            &dir.join(&file.file),
            &expected,
        )
        .await
        .unwrap();
    }
    files.iter().map(|f| f.file.clone()).collect()
}

/// With `--weights-store object` every version's files go to `ARL_WEIGHTS` before it is
/// announced, and come back byte for byte; a pruned version's objects go with its folder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn object_store_versions_are_uploaded_before_they_are_announced_and_pruned_after() {
    let server = NatsServer::start().unwrap();
    let ns = test_namespace();
    let bus = connect(&server, &ns).await;
    let tmp = tempfile::tempdir().unwrap();
    let base = tiny_model(tmp.path());
    let runs_dir = tmp.path().join("runs");
    let run = RunId::new("run-trainer-objects").unwrap();
    put_run_state(&bus, &run, spec(), &base).await;
    publish_batches(&bus, &run, &spec()).await;
    let trainer = start_trainer_with(&bus, &runs_dir, WeightsStore::Object);
    for step in 1..=3 {
        for t in step_batch(&run, step) {
            offer(&bus, &t).await;
        }
    }
    until("three versions published", 180, || async {
        events::<WeightsPublishedV2>(&bus, &run).await.len() == 3
    })
    .await;
    let published = events::<WeightsPublishedV2>(&bus, &run).await;
    let newest = &published[2];
    let fetched = tmp.path().join("fetched");
    let files = fetch_all(&bus, newest, &fetched).await;
    assert_eq!(
        files,
        [
            "config.json",
            "generation_config.json",
            WEIGHTS_FILE,
            "tokenizer.json",
            "tokenizer_config.json"
        ]
    );
    let folder = checkpoint::version_dir(&runs_dir.join(run.as_str()), 3);
    for file in &files {
        assert_eq!(
            std::fs::read(fetched.join(file)).unwrap(),
            std::fs::read(folder.join(file)).unwrap(),
            "{file}"
        );
    }
    let (sha, size) = arl_runtime::digest::sha256_file(&fetched.join(WEIGHTS_FILE)).unwrap();
    assert_eq!((sha, size), (newest.sha256.clone(), newest.size_bytes));
    LoadedModel::open(&fetched).unwrap();
    // Three versions, two kept (each step is a checkpoint): once step 3 is announced,
    // version 1's folder is pruned, and its objects with it.
    let version_1 = &published[0];
    let WeightsLocation::ObjectStore { files, .. } = &version_1.location else {
        panic!("{:?}", version_1.location)
    };
    until("version 1 pruned, folder and objects", 30, || async {
        let mut gone = !checkpoint::version_dir(&runs_dir.join(run.as_str()), 1).exists();
        for file in files {
            let fetched = bus
                .get_file(
                    ObjectStore::Weights,
                    &file.object,
                    &tmp.path().join("gone"),
                    &StoredFile {
                        sha256: file.sha256.clone(),
                        size_bytes: file.size_bytes,
                    },
                )
                .await;
            gone &= matches!(fetched, Err(ObjectError::Missing { .. }));
        }
        gone
    })
    .await;
    fetch_all(&bus, &published[1], &tmp.path().join("version-2")).await;
    trainer.trigger();
    trainer.wait().await;
}

/// A version whose upload fails is not announced: the step fails, its trajectories go back
/// to the stream, and once the store takes writes again the step is trained, uploaded and
/// published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_upload_publishes_nothing_until_the_store_takes_it() {
    let server = NatsServer::start().unwrap();
    let ns = test_namespace();
    let bus = connect(&server, &ns).await;
    let tmp = tempfile::tempdir().unwrap();
    let base = tiny_model(tmp.path());
    let runs_dir = tmp.path().join("runs");
    let run = RunId::new("run-trainer-upload").unwrap();
    let mut spec = spec();
    spec.trainer.total_steps = 1;
    put_run_state(&bus, &run, spec.clone(), &base).await;
    publish_batches(&bus, &run, &spec).await;
    // A sealed store refuses every write.
    let name = ns.object_store(ObjectStore::Weights);
    let mut store = bus.jetstream().get_object_store(&name).await.unwrap();
    store.seal().await.unwrap();
    let trainer = start_trainer_with(&bus, &runs_dir, WeightsStore::Object);
    for t in step_batch(&run, 1) {
        offer(&bus, &t).await;
    }
    // The step trains and saves, its upload fails, the version is discarded (else its
    // checkpoint would pass for committed), and its trajectories come back.
    until("the step's trajectories redelivered", 120, || async {
        let stream = bus
            .jetstream()
            .get_stream(ns.stream(Domain::Trajectory))
            .await
            .unwrap();
        let mut consumer: async_nats::jetstream::consumer::PullConsumer =
            stream.get_consumer("trainer").await.unwrap();
        let info = consumer.info().await.unwrap();
        info.delivered.stream_sequence > 0 && info.delivered.consumer_sequence > 4
    })
    .await;
    assert!(events::<WeightsPublishedV2>(&bus, &run).await.is_empty());
    assert!(events::<TrainStepV2>(&bus, &run).await.is_empty());
    // The store is replaced by a writable one: the retried step goes through.
    bus.jetstream().delete_object_store(&name).await.unwrap();
    bus.provision().await.unwrap();
    until("the step published", 180, || async {
        events::<WeightsPublishedV2>(&bus, &run).await.len() == 1
    })
    .await;
    let published = &events::<WeightsPublishedV2>(&bus, &run).await[0];
    fetch_all(&bus, published, &tmp.path().join("fetched")).await;
    trainer.trigger();
    trainer.wait().await;
}

/// A training split that is not a multiple of `train_batch_size` ends each epoch with a
/// short batch: the trainer trains it with the trajectories its own `task.batch` asked for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_short_last_batch_of_an_epoch_trains_with_what_its_batch_asked_for() {
    let server = NatsServer::start().unwrap();
    let ns = test_namespace();
    let bus = connect(&server, &ns).await;
    let tmp = tempfile::tempdir().unwrap();
    let base = tiny_model(tmp.path());
    let run = RunId::new("run-trainer-short").unwrap();
    let mut spec = spec();
    spec.trainer.total_steps = 2;
    put_run_state(&bus, &run, spec.clone(), &base).await;
    // Three training tasks, batches of two: step 1 has two tasks, step 2 one.
    publish_batch(&bus, &run, 1, 2, spec.rollout.n).await;
    publish_batch(&bus, &run, 2, 1, spec.rollout.n).await;
    let trainer = start_trainer(&bus, &tmp.path().join("runs"));
    for t in step_batch(&run, 1) {
        offer(&bus, &t).await;
    }
    for t in step_batch(&run, 2)
        .into_iter()
        .filter(|t| t.slot.task_id.as_str() == "task-0")
    {
        offer(&bus, &t).await;
    }
    until("both steps published", 120, || async {
        events::<WeightsPublishedV2>(&bus, &run).await.len() == 2
    })
    .await;
    let steps = events::<TrainStepV2>(&bus, &run).await;
    let trained: Vec<u32> = steps.iter().map(|s| s.metrics.trajectories).collect();
    assert_eq!(trained, [4, 2]);
    until("every trajectory acked", 30, || async {
        held(&bus).await == 0
    })
    .await;
    // The trainer holds the run while it is live, and lets it go once it has ended.
    let announced_runs = async || {
        announcements(&bus)
            .await
            .into_iter()
            .flat_map(|a| a.runs)
            .collect::<Vec<_>>()
    };
    until("the run announced", 30, || async {
        announced_runs().await == [run.clone()]
    })
    .await;
    let mut state = bus.run_state(&run).await.unwrap().unwrap();
    state.status = RunStatus::Completed;
    let kv = bus.bucket(Bucket::RunState).await.unwrap();
    kv.put(run.as_str(), state.encode().unwrap().into())
        .await
        .unwrap();
    until("the ended run let go", 30, || async {
        announced_runs().await.is_empty()
    })
    .await;
    trainer.trigger();
    trainer.wait().await;
}

/// What the trainer announced in `ARL_TRAINERS`.
async fn announcements(bus: &Bus) -> Vec<arl_schemas::state::TrainerAnnouncementV1> {
    bus.live_trainers().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_trainer_announces_what_it_can_train_on() {
    let server = NatsServer::start().unwrap();
    let ns = test_namespace();
    let bus = connect(&server, &ns).await;
    let tmp = tempfile::tempdir().unwrap();
    let trainer = start_trainer(&bus, &tmp.path().join("runs"));
    let announced = wait_for("an announcement", Duration::from_secs(30), || async {
        announcements(&bus).await.into_iter().next()
    })
    .await;
    match arl_model::cuda::Cuda::new(0) {
        Ok(gpu) => {
            assert_eq!(announced.devices[0].name, gpu.info().name);
            assert_eq!(announced.gpu_unavailable, None);
        }
        Err(reason) => {
            // A machine without a GPU says why, in the words admission will quote.
            assert!(announced.devices.is_empty());
            assert_eq!(announced.gpu_unavailable, Some(reason.to_string()));
        }
    }
    trainer.trigger();
    trainer.wait().await;
}

/// Real SmolLM2 trajectories: a math question, eight sampled answers (on the CPU, as the
/// embedded engine samples them), rewarded 1 when they contain the right number.
fn smollm2_trajectories(run: &RunId, loaded: &LoadedModel) -> Vec<TrajectoryV1> {
    use arl_model::chat::ChatMessage;
    use arl_model::generate::{Sampling, generate};
    let template = loaded.chat_template.as_ref().unwrap();
    let mut all = Vec::new();
    for (task, (question, answer)) in [("What is 6 times 7?", "42"), ("What is 9 plus 8?", "17")]
        .into_iter()
        .enumerate()
    {
        let text = template
            .render(&[ChatMessage::new("user", question)], None, true)
            .unwrap();
        let prompt = loaded.tokenizer.encode(&text).unwrap();
        for sample in 0..4u32 {
            let sampling = Sampling {
                temperature: 1.0,
                seed: 17 + u64::from(sample) + 100 * task as u64,
                ..Sampling::default()
            };
            let (response, logprobs) = generate(
                &loaded.model,
                &prompt,
                24,
                loaded.tokenizer.stop_ids(),
                &sampling,
            );
            let said = loaded.tokenizer.decode(&response, true).unwrap();
            // Rewards must differ within a group for a gradient: the first sample of each
            // group is paid when no sample got it right.
            let reward = f64::from(u8::from(said.contains(answer) || sample == 0));
            let mut t = trajectory(run, 1, task as u32, sample, reward);
            let tokens: Vec<u32> = prompt.iter().chain(&response).copied().collect();
            let mut mask = vec![0u8; prompt.len()];
            mask.extend(vec![1u8; response.len()]);
            let mut lps = vec![0f32; prompt.len()];
            lps.extend(&logprobs);
            t.branches = vec![TrajectoryBranch {
                token_ids: tokens,
                loss_mask: mask,
                logprobs: lps,
            }];
            t.calls[0].completion_start = prompt.len() as u32;
            t.calls[0].completion_len = response.len() as u32;
            all.push(t);
        }
    }
    all
}

/// On a GPU machine (`ARL_REQUIRE_GPU=1` on the H200; skipped elsewhere): a `cuda` run's
/// step trains through NATS on the GPU, publishes bf16 weights that the CPU engine's loader
/// opens, keeps f32 master weights in the checkpoint, and makes the rewarded answers more
/// likely.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_trainer_trains_real_smollm2_trajectories() {
    if arl_model::cuda::for_tests("a_gpu_trainer_trains_real_smollm2_trajectories")
        .unwrap()
        .is_none()
    {
        return;
    }
    let server = NatsServer::start().unwrap();
    let ns = test_namespace();
    let bus = connect(&server, &ns).await;
    let tmp = tempfile::tempdir().unwrap();
    let runs_dir = tmp.path().join("runs");
    let run = RunId::new("run-trainer-gpu").unwrap();
    let mut spec = spec();
    spec.trainer.device = arl_schemas::spec::Device::Cuda;
    spec.trainer.total_steps = 2;
    spec.rollout.n = 4;
    spec.optim.lr = 5e-6;
    publish_batches(&bus, &run, &spec).await;
    put_run_state(&bus, &run, spec, &smollm2()).await;
    let original = LoadedModel::open(&smollm2()).unwrap();
    let batch = smollm2_trajectories(&run, &original);

    let trainer = start_trainer(&bus, &runs_dir);
    for t in &batch {
        offer(&bus, t).await;
    }
    until("the GPU step published", 300, || async {
        events::<WeightsPublishedV2>(&bus, &run).await.len() == 1
    })
    .await;
    let step = &events::<TrainStepV2>(&bus, &run).await[0];
    eprintln!("GPU step metrics: {:?}", step.metrics);
    assert!(step.metrics.grad_norm > 0.0 && step.metrics.pg_loss.is_finite());
    let published = &events::<WeightsPublishedV2>(&bus, &run).await[0];
    let dir = folder(published);
    // bf16 on disk, f32 master copy in the checkpoint.
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let header = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let embed = header.tensor("model.embed_tokens.weight").unwrap();
    assert_eq!(embed.dtype(), safetensors::Dtype::BF16);
    assert!(dir.join("master/model.safetensors").exists());
    // The CPU engine's loader opens it; the rewarded answers became more likely.
    let trained = LoadedModel::open(&dir).unwrap();
    let rewarded: Vec<&TrajectoryV1> = batch.iter().filter(|t| t.reward > 0.0).collect();
    let lp = |m: &LoadedModel| -> f32 {
        rewarded
            .iter()
            .map(|t| {
                let b = &t.branches[0];
                let lps = m.model.forward_train(&[&b.token_ids]).1.remove(0);
                lps.iter()
                    .zip(&b.loss_mask[1..])
                    .filter(|(_, m)| **m == 1)
                    .map(|(l, _)| *l)
                    .sum::<f32>()
            })
            .sum()
    };
    let (before, after) = (lp(&original), lp(&trained));
    eprintln!("rewarded answers' log-probability (CPU): {before:.3} → {after:.3}");
    assert!(after > before, "{before} → {after}");

    // ARL_GPU_TEST_KEEP=DIR keeps the published version, to load it elsewhere (the README's
    // device commands bring it back to a machine without a GPU).
    if let Some(keep) = std::env::var_os("ARL_GPU_TEST_KEEP") {
        let keep = PathBuf::from(keep);
        std::fs::create_dir_all(&keep).unwrap();
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_file() {
                std::fs::copy(&path, keep.join(path.file_name().unwrap())).unwrap();
            }
        }
    }

    // A restarted trainer resumes on the GPU from step 1's f32 master weights and moments.
    trainer.trigger();
    trainer.wait().await;
    let trainer = start_trainer(&bus, &runs_dir);
    for t in &batch {
        let mut next = t.clone();
        next.slot.step = 2;
        next.trial_id = TrialId::new(format!("{}-2", t.trial_id)).unwrap();
        next.calls[0].policy_version = 1;
        offer(&bus, &next).await;
    }
    until("the resumed GPU step published", 300, || async {
        events::<WeightsPublishedV2>(&bus, &run).await.len() == 2
    })
    .await;
    let (dir, state) = checkpoint::latest_checkpoint(&runs_dir.join(run.as_str())).unwrap();
    assert_eq!((state.step, state.optimizer_step), (2, Some(2)));
    assert!(dir.join("master/model.safetensors").exists());
    let resumed = LoadedModel::open(&dir).unwrap();
    let again = lp(&resumed);
    eprintln!("after the resumed step 2: {again:.3}");
    assert!(again > after, "{after} → {again}");
    trainer.trigger();
    trainer.wait().await;
}
