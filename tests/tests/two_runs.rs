//! Two runs at once on one deployment (issue 26): `arl up` starts every service once (one
//! engine, one proxy, one trainer …), two math runs that differ in name and seed are
//! submitted together, and both are followed to their end. Then the streams are replayed
//! and audited — a policy is (run, version), and nothing of one run may leak into the other:
//!
//! 1. every `llm.call` of a trial was served by a policy of the trial's own run: a version
//!    that run had published (0 = the base model) before the call ended, never older than
//!    the trial's key, and for a training trial within the run's staleness bound;
//! 2. every `task.batch`, `trajectory.ready`, `train.step`, `weights.published` and
//!    `eval.completed` of a run names only that run's dataset, trials and steps, and each
//!    run's steps are 1..N, each exactly once;
//! 3. the trainer keeps each run's checkpoints in a folder of its own, and the two runs'
//!    final weights differ;
//! 4. each evaluation counts exactly its own run's validation trials of that step.
//!
//! Build the binaries first (`cargo build --workspace --bins`; `make test` does).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use arl_runtime::bus::BusConfig;
use arl_runtime::{Bus, Metrics};
use arl_schemas::events::{
    DatasetRegisteredV1, EvaluationCompletedV1, LlmCallV2, RewardScoredV2, Split, TaskBatchV1,
    TrainStepV2, TrajectoryV1, TrialStartedV1, WeightsLocation, WeightsPublishedV2,
};
use arl_schemas::state::RunStatus;
use arl_schemas::{Event, Namespace, RunId, TrialId};
use arl_testkit::{Children, built_binary};

/// Steps per run: enough that each run publishes a version while the other's trials are
/// still being sampled.
const STEPS: u32 = 2;
/// Both runs train on-policy: a training trial of step s samples from version s - 1.
const MAX_STALENESS: u64 = 0;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_runs_at_once_never_share_a_policy_or_state() {
    let state = tempfile::Builder::new()
        .prefix("arl-two-runs-")
        .tempdir()
        .unwrap();
    let arl = built_binary("arl");
    let mut up = Children(vec![
        Command::new(&arl)
            .args(["up", "--state-dir"])
            .arg(state.path())
            .env_remove("NATS_URL")
            .env_remove("ARL_PREFIX")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap(),
    ]);
    let url =
        arl_testkit::wait_for_arl_up(&mut up.0[0], state.path(), Duration::from_secs(300)).await;

    // Two runs over the same problems: another name and seed, so another split and
    // another dataset digest.
    let tasks = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/arithmetic/tasks.jsonl");
    let spec = |name: &str, seed: u64| {
        let path = state.path().join(format!("{name}.toml"));
        std::fs::write(
            &path,
            format!(
                "name = \"{name}\"\n\
                 [data]\ndataset = \"{}\"\nsource = \"gsm8k\"\nval_size = 4\nseed = {seed}\n\
                 train_batch_size = 2\n\
                 [rollout]\nn = 8\nmax_turns = 1\ntemperature = 0.8\nmax_response_tokens = 24\n\
                 timeout_s = 600\nval_n = 1\nval_temperature = 0.0\n\
                 [algorithm]\nmax_staleness = {MAX_STALENESS}\nold_logprobs = \"rollout\"\n\
                 [optim]\nlr = 2e-5\n\
                 [trainer]\ntotal_steps = {STEPS}\neval_every = 0\nsave_every = 1\n",
                tasks.display()
            ),
        )
        .unwrap();
        path
    };
    let specs = [spec("two-runs-a", 7), spec("two-runs-b", 11)];
    // Submitted at once: both requests in flight together.
    let submissions: Vec<_> = specs
        .iter()
        .map(|s| {
            Command::new(&arl)
                .args(["run", "submit"])
                .arg(s)
                .env("NATS_URL", &url)
                .env_remove("ARL_PREFIX")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let runs: Vec<RunId> = submissions
        .into_iter()
        .map(|child| {
            let out = child.wait_with_output().unwrap();
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            RunId::new(String::from_utf8(out.stdout).unwrap().trim()).unwrap()
        })
        .collect();
    assert_ne!(runs[0], runs[1]);

    let mut config = BusConfig::new(&url, Namespace::default(), "test");
    config.publish_timeout = Duration::from_secs(5);
    let bus = Bus::connect(config, Metrics::new()).await.unwrap();
    // Both runs end (a CPU run of a few steps; generous for a machine shared with others).
    let mut finals = Vec::new();
    for run in &runs {
        let record = arl_testkit::wait_for(
            &format!("run {run} to end"),
            Duration::from_secs(900),
            || async {
                let record = bus.run_state(run).await.ok()??;
                if record.status.is_terminal() {
                    return Some(record);
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
                None
            },
        )
        .await;
        finals.push(record);
    }
    assert!(
        up.0[0].try_wait().unwrap().is_none(),
        "arl up stopped during the runs"
    );
    // SmolLM2 solves some problems: a step trains when a group's rewards differ. A run
    // completes, or — when every one of its steps trained nothing — fails saying so (the
    // designed end, as in smoke.rs); either way all its steps ran.
    let mut trained = Vec::new();
    for record in &finals {
        let shown = format!(
            "run {} ended {:?}: {:?} (failures {:?}, steps {:?})",
            record.run_id, record.status, record.failure_reason, record.failures, record.steps
        );
        let learned = record.steps.iter().any(|s| !s.trained_nothing());
        if learned {
            assert_eq!(record.status, RunStatus::Completed, "{shown}");
        } else {
            assert_eq!(record.status, RunStatus::Failed, "{shown}");
            let reason = record.failure_reason.clone().unwrap_or_default();
            assert!(reason.contains("every step trained nothing"), "{shown}");
        }
        assert_eq!(record.failures.infrastructure, 0, "{shown}");
        assert_eq!(record.step, STEPS, "{shown}");
        assert_eq!(record.policy_version, u64::from(STEPS), "{shown}");
        trained.push(learned);
    }

    let audit = Audit::replay(&bus).await;
    audit.print_timeline(&runs);
    for (run, learned) in runs.iter().zip(&trained) {
        let other = runs.iter().find(|r| *r != run).unwrap();
        audit.each_call_is_served_by_its_own_runs_policy(run);
        audit.each_event_names_only_its_own_run(run, other, *learned);
        audit.each_evaluation_counts_its_own_validation_trials(run);
    }
    audit.checkpoints_are_apart_and_final_weights_differ(
        &runs,
        &state.path().join("runs"),
        trained.iter().any(|t| *t),
    );
    drop(up);
}

/// Everything the two runs stored, replayed from JetStream.
struct Audit {
    datasets: Vec<DatasetRegisteredV1>,
    batches: Vec<TaskBatchV1>,
    started: Vec<TrialStartedV1>,
    calls: Vec<LlmCallV2>,
    scored: Vec<RewardScoredV2>,
    trajectories: Vec<TrajectoryV1>,
    steps: Vec<TrainStepV2>,
    weights: Vec<WeightsPublishedV2>,
    evaluations: Vec<EvaluationCompletedV1>,
}

async fn replay<E: Event>(bus: &Bus, event: &str) -> Vec<E> {
    let ns = Namespace::default();
    bus.replay(E::DOMAIN, ns.event_filter(E::DOMAIN, event))
        .await
        .unwrap()
}

impl Audit {
    async fn replay(bus: &Bus) -> Self {
        Self {
            datasets: replay(bus, "dataset").await,
            batches: replay(bus, "batch").await,
            started: replay(bus, "started").await,
            calls: replay(bus, "call").await,
            scored: replay(bus, "scored").await,
            trajectories: replay(bus, "ready").await,
            steps: replay(bus, "step").await,
            weights: replay(bus, "published").await,
            evaluations: replay(bus, "completed").await,
        }
    }

    /// When each run's versions and evaluations came, for whoever reads a failure.
    fn print_timeline(&self, runs: &[RunId]) {
        let mut lines: Vec<(chrono::DateTime<chrono::Utc>, String)> = Vec::new();
        for w in &self.weights {
            lines.push((
                w.at,
                format!("{} published version {}", w.run_id, w.policy_version),
            ));
        }
        for e in &self.evaluations {
            lines.push((e.at, format!("{} evaluated step {}", e.run_id, e.step)));
        }
        lines.sort();
        for (at, line) in lines {
            let run = runs
                .iter()
                .position(|r| line.starts_with(r.as_str()))
                .unwrap_or(9);
            eprintln!(
                "{} run {}: {line}",
                at.format("%H:%M:%S%.3f"),
                ["A", "B"].get(run).unwrap_or(&"?")
            );
        }
    }

    fn dataset_digest(&self, run: &RunId) -> String {
        let found: Vec<&DatasetRegisteredV1> =
            self.datasets.iter().filter(|d| &d.run_id == run).collect();
        assert_eq!(found.len(), 1, "run {run}'s task.dataset: {found:?}");
        found[0].digest.clone()
    }

    fn weights_of(&self, run: &RunId) -> Vec<&WeightsPublishedV2> {
        self.weights.iter().filter(|w| &w.run_id == run).collect()
    }

    /// (1): the policy that served each call is one of the trial's own run.
    fn each_call_is_served_by_its_own_runs_policy(&self, run: &RunId) {
        let published: BTreeMap<u64, &WeightsPublishedV2> = self
            .weights_of(run)
            .into_iter()
            .map(|w| (w.policy_version, w))
            .collect();
        let trials: BTreeMap<&TrialId, &TrialStartedV1> = self
            .started
            .iter()
            .filter(|t| &t.run_id == run)
            .map(|t| (&t.trial_id, t))
            .collect();
        let calls: Vec<&LlmCallV2> = self.calls.iter().filter(|c| &c.run_id == run).collect();
        assert!(!calls.is_empty(), "run {run} recorded no LLM call");
        for call in calls {
            // The call scope is the trial id, or `<trial>-a<N>` for a later attempt.
            let trial = trials
                .iter()
                .filter(|(id, _)| {
                    call.trial_id == ***id
                        || call
                            .trial_id
                            .as_str()
                            .strip_prefix(id.as_str())
                            .is_some_and(|rest| rest.starts_with("-a"))
                })
                .max_by_key(|(id, _)| id.as_str().len())
                .map(|(_, t)| *t)
                .unwrap_or_else(|| {
                    panic!(
                        "call {} of run {run} belongs to none of its trials",
                        call.trial_id
                    )
                });
            let version = call.policy_version;
            let what = format!(
                "call {}#{} of run {run} (trial key at version {}) says version {version}",
                call.trial_id, call.turn_index, trial.policy_version
            );
            assert!(
                version >= trial.policy_version,
                "{what}: older than its key"
            );
            // The engine names the policy that answered (llm.call v2): it must be this
            // run's own (or the base model at version 0), never the other run's.
            assert!(
                call.served_run_id.is_some() || call.served_version == Some(0),
                "{what}: the engine named no run for a trained version"
            );
            assert!(
                call.served_by_own_run() && call.served_version == Some(version),
                "{what}: served by run {:?} at version {:?}",
                call.served_run_id,
                call.served_version
            );
            if version > 0 {
                let weights = published
                    .get(&version)
                    .unwrap_or_else(|| panic!("{what}, which run {run} never published"));
                let ended = call.timing.started_at
                    + chrono::Duration::milliseconds(call.timing.latency_ms.ceil() as i64 + 1);
                assert!(
                    weights.at <= ended,
                    "{what}, which run {run} published only at {} (the call ended by {ended}): \
                     another run's weights served it",
                    weights.at
                );
            }
            if trial.slot.split == Split::Train {
                let on_policy = u64::from(trial.slot.step) - 1;
                assert!(
                    version <= on_policy && version + MAX_STALENESS >= on_policy,
                    "{what}: a training trial of step {} samples version {} (max_staleness {MAX_STALENESS})",
                    trial.slot.step,
                    on_policy
                );
            }
        }
    }

    /// (2): each run's events name only its own dataset, trials and steps.
    fn each_event_names_only_its_own_run(&self, run: &RunId, other: &RunId, completed: bool) {
        let digest = self.dataset_digest(run);
        assert_ne!(
            digest,
            self.dataset_digest(other),
            "another seed is another split, so another registered dataset"
        );
        let own_trial = |id: &TrialId| {
            id.as_str().starts_with(&format!("{run}-")) && !id.as_str().starts_with(other.as_str())
        };
        let batches: Vec<&TaskBatchV1> = self.batches.iter().filter(|b| &b.run_id == run).collect();
        for batch in &batches {
            for task in &batch.tasks {
                assert_eq!(
                    task.dataset_digest, digest,
                    "run {run}'s {:?} batch of step {} names a task of another dataset",
                    batch.split, batch.step
                );
            }
        }
        let train_steps: Vec<u32> = batches
            .iter()
            .filter(|b| b.split == Split::Train)
            .map(|b| b.step)
            .collect();
        assert_eq!(
            train_steps.iter().copied().collect::<BTreeSet<_>>(),
            (1..=STEPS).collect::<BTreeSet<_>>(),
            "run {run}'s training batches"
        );
        assert_eq!(train_steps.len(), STEPS as usize, "one batch per step");
        for t in self.started.iter().filter(|t| &t.run_id == run) {
            assert!(own_trial(&t.trial_id), "run {run} started {}", t.trial_id);
        }
        let trajectories: Vec<&TrajectoryV1> = self
            .trajectories
            .iter()
            .filter(|t| &t.run_id == run)
            .collect();
        assert!(!trajectories.is_empty());
        for t in &trajectories {
            assert!(
                own_trial(&t.trial_id),
                "run {run}'s trajectory {}",
                t.trial_id
            );
            assert!(t.slot.step >= 1 && t.slot.step <= STEPS, "{:?}", t.slot);
            for span in &t.calls {
                let call = self
                    .calls
                    .iter()
                    .find(|c| {
                        c.trial_id.as_str().starts_with(t.trial_id.as_str())
                            && c.turn_index == span.turn_index
                    })
                    .unwrap_or_else(|| {
                        panic!("trajectory {} names a call never recorded", t.trial_id)
                    });
                assert_eq!(
                    &call.run_id, run,
                    "trajectory {} holds another run's call",
                    t.trial_id
                );
            }
        }
        let steps: Vec<u32> = self
            .steps
            .iter()
            .filter(|s| &s.run_id == run)
            .map(|s| s.step)
            .collect();
        assert_eq!(
            steps,
            (1..=STEPS).collect::<Vec<_>>(),
            "run {run}'s train.step"
        );
        for s in self.steps.iter().filter(|s| &s.run_id == run) {
            assert_eq!(s.policy_version, u64::from(s.step));
            // The step trained its own run's trajectories of that step, every one.
            let own = trajectories
                .iter()
                .filter(|t| t.slot.step == s.step)
                .count();
            assert!(
                s.batch.trajectories as usize <= own,
                "run {run}'s step {} counts {} trajectories; the run stored {own}",
                s.step,
                s.batch.trajectories
            );
        }
        let versions: Vec<(u64, u32)> = self
            .weights_of(run)
            .iter()
            .map(|w| (w.policy_version, w.step))
            .collect();
        assert_eq!(
            versions,
            (1..=STEPS).map(|s| (u64::from(s), s)).collect::<Vec<_>>(),
            "run {run}'s weights.published"
        );
        let evaluated: Vec<u32> = self
            .evaluations
            .iter()
            .filter(|e| &e.run_id == run)
            .map(|e| e.step)
            .collect();
        // Before training, and after the last step (a run that failed for having trained
        // nothing may end before its last evaluation).
        assert!(
            evaluated == [0, STEPS] || (!completed && evaluated == [0]),
            "run {run}'s eval.completed: {evaluated:?}"
        );
    }

    /// (4): an evaluation counts its own run's validation trials of its step, and only them.
    fn each_evaluation_counts_its_own_validation_trials(&self, run: &RunId) {
        for evaluation in self.evaluations.iter().filter(|e| &e.run_id == run) {
            let step = evaluation.step;
            let batch = self
                .batches
                .iter()
                .find(|b| &b.run_id == run && b.split == Split::Validation && b.step == step)
                .unwrap_or_else(|| panic!("run {run} has no validation batch of step {step}"));
            assert_eq!(evaluation.tasks as usize, batch.tasks.len());
            assert_eq!(evaluation.samples_per_task, batch.samples_per_task);
            // The latest attempt of each validation slot of this run and step.
            let mut latest: BTreeMap<(String, u32), &RewardScoredV2> = BTreeMap::new();
            for scored in self.scored.iter().filter(|s| {
                &s.run_id == run && s.slot.split == Split::Validation && s.slot.step == step
            }) {
                let key = (scored.slot.task_id.to_string(), scored.slot.sample_index);
                if latest
                    .get(&key)
                    .is_none_or(|seen| seen.slot.attempt <= scored.slot.attempt)
                {
                    latest.insert(key, scored);
                }
            }
            let tasks: BTreeSet<&str> = batch.tasks.iter().map(|t| t.task_id.as_str()).collect();
            for (task, _) in latest.keys() {
                assert!(
                    tasks.contains(task.as_str()),
                    "run {run}'s step {step} evaluation graded task {task}, not in its batch"
                );
            }
            let resolved = latest.values().filter(|s| s.resolved).count();
            assert_eq!(
                evaluation.resolved_samples as usize, resolved,
                "run {run}'s evaluation of step {step}: its own validation trials resolved {resolved}"
            );
        }
    }

    /// (3): each run's checkpoints live in their own folder; the final weights differ
    /// (unless neither run trained anything: then both are still the base model).
    fn checkpoints_are_apart_and_final_weights_differ(
        &self,
        runs: &[RunId],
        root: &Path,
        any_trained: bool,
    ) {
        let root = root.canonicalize().unwrap();
        let mut finals: Vec<(PathBuf, String)> = Vec::new();
        for run in runs {
            let own = root.join(run.as_str());
            let mut last = None;
            for w in self.weights_of(run) {
                let WeightsLocation::Folder { path } = &w.location else {
                    panic!("arl up publishes folders: {:?}", w.location);
                };
                let dir = Path::new(path).canonicalize().unwrap();
                assert!(
                    dir.starts_with(&own),
                    "run {run}'s version {} is in {}, not under {}",
                    w.policy_version,
                    dir.display(),
                    own.display()
                );
                last = Some((dir, w.sha256.clone()));
            }
            finals.push(last.unwrap());
        }
        let (a, b) = (&finals[0], &finals[1]);
        assert_ne!(a.0, b.0);
        if !any_trained {
            eprintln!("neither run trained anything: both final versions are the base model");
            return;
        }
        assert_ne!(a.1, b.1, "the two runs' final weights have one digest");
        let file = arl_schemas::events::WEIGHTS_FILE;
        assert_ne!(
            std::fs::read(a.0.join(file)).unwrap(),
            std::fs::read(b.0.join(file)).unwrap(),
            "the two runs' final weights are the same bytes"
        );
    }
}
