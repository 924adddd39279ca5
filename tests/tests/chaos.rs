//! Chaos (issue 26): `arl up --supervise` runs smoke.rs's reduced training run while a
//! service — or nats-server itself — is SIGKILLed mid-run and started again by `arl up`.
//! The run must still end, and its streams, replayed afterwards, must show every guarantee
//! held: one `train.step` per step, one `weights.published` per policy version, one
//! `trajectory.ready` per training slot, and every requested trial attempt ending in
//! exactly one outcome (finished and graded, or failed; a failure that retries followed by
//! its next attempt's request).
//!
//! `make test` runs the reduced form: one run, three victims in turn (the rollout while
//! the first training trial runs, nats-server while its grade is due, the trainer while it
//! holds the step's batch). `make chaos` adds one run per victim (`--ignored`), each
//! service and nats-server. Real binaries (`cargo build --workspace --bins` first), a real
//! nats-server (`make deps`), SmolLM2 (`make models`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use arl_runtime::bus::BusConfig;
use arl_runtime::{Bus, Metrics};
use arl_schemas::state::{RunStateV1, RunStatus};
use arl_schemas::{Domain, Namespace, RunId, TrialId};
use arl_testkit::{Children, built_binary, wait_for};
use serde_json::Value;

/// Where in the run a victim is killed: once the first event of this kind of the run's
/// training split is stored.
#[derive(Clone, Copy, Debug)]
enum Moment {
    /// A training trial runs: the first step is in flight.
    TrialStarted,
    /// A training trial handed off to the grader: its grade is due.
    TrialFinished,
    /// The trainer holds part of the step's batch.
    TrajectoryReady,
    /// The step's whole batch (n = 2 trajectories) is stored: the trainer is training it.
    BatchWhole,
}

impl Moment {
    /// The event, and how many of the training split's make the moment.
    fn subject(self) -> (Domain, &'static str, usize) {
        match self {
            Moment::TrialStarted => (Domain::Trial, "started", 1),
            Moment::TrialFinished => (Domain::Trial, "finished", 1),
            Moment::TrajectoryReady => (Domain::Trajectory, "ready", 1),
            Moment::BatchWhole => (Domain::Trajectory, "ready", 2),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_survives_the_rollout_nats_server_and_trainer_killed_in_turn() {
    chaos(&[
        ("arl-rollout", Moment::TrialStarted),
        ("nats-server", Moment::TrialFinished),
        ("arl-trainer", Moment::TrajectoryReady),
    ])
    .await;
}

macro_rules! victim {
    ($test:ident, $victim:literal, $moment:expr) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        #[ignore = "the full chaos suite, one run per victim: make chaos"]
        async fn $test() {
            chaos(&[($victim, $moment)]).await;
        }
    };
}

victim!(a_killed_controller, "arl-controller", Moment::TrialStarted);
victim!(a_killed_dataset, "arl-dataset", Moment::TrialStarted);
victim!(a_killed_rollout, "arl-rollout", Moment::TrialStarted);
victim!(a_killed_proxy, "arl-proxy", Moment::TrialStarted);
victim!(a_killed_inference, "arl-inference", Moment::TrialStarted);
victim!(a_killed_reward, "arl-reward", Moment::TrialFinished);
victim!(a_killed_trainer, "arl-trainer", Moment::TrajectoryReady);
victim!(a_trainer_killed_training, "arl-trainer", Moment::BatchWhole);
victim!(a_killed_evaluator, "arl-evaluator", Moment::TrialStarted);
victim!(a_killed_sandbox, "arl-sandbox", Moment::TrialStarted);
victim!(
    a_killed_imagebuilder,
    "arl-imagebuilder",
    Moment::TrialStarted
);
victim!(a_killed_nats_server, "nats-server", Moment::TrialFinished);

/// `arl up --supervise`, the reduced run, each victim SIGKILLed at its moment and seen
/// started again; then the run's end and its streams are checked.
async fn chaos(victims: &[(&str, Moment)]) {
    let started = Instant::now();
    let up = Supervised::start().await;
    let run = up.submit();
    println!("{run} submitted ({:.0} s)", started.elapsed().as_secs_f64());
    for &(victim, moment) in victims {
        up.wait_for_moment(&run, moment).await;
        up.kill(victim).await;
        println!(
            "{victim} killed at {moment:?} and started again ({:.0} s)",
            started.elapsed().as_secs_f64()
        );
    }
    let state = up.finish(&run).await;
    println!(
        "{run} ended {:?} ({:.0} s)",
        state.status,
        started.elapsed().as_secs_f64()
    );
    audit(&up.bus, &state).await;
}

/// `arl up --supervise` on a fresh state folder, and a bus client of it.
struct Supervised {
    state: tempfile::TempDir,
    url: String,
    up: Children,
    bus: Bus,
}

impl Supervised {
    async fn start() -> Self {
        let state = tempfile::Builder::new()
            .prefix("arl-chaos-")
            .tempdir()
            .unwrap();
        let mut up = Children(vec![
            Command::new(built_binary("arl"))
                .args(["up", "--supervise", "--state-dir"])
                .arg(state.path())
                .env_remove("NATS_URL")
                .env_remove("ARL_PREFIX")
                .stdout(Stdio::null())
                .stderr(Stdio::inherit())
                .spawn()
                .unwrap(),
        ]);
        // Written only once every service reports ready.
        let url =
            arl_testkit::wait_for_arl_up(&mut up.0[0], state.path(), Duration::from_secs(300))
                .await;
        let mut config = BusConfig::new(&url, Namespace::default(), "chaos");
        config.publish_timeout = Duration::from_secs(5);
        let bus = Bus::connect(config, Metrics::new()).await.unwrap();
        Self {
            state,
            url,
            up,
            bus,
        }
    }

    fn arl(&self, args: &[&str]) -> std::process::Output {
        Command::new(built_binary("arl"))
            .args(args)
            .env("NATS_URL", &self.url)
            .env_remove("ARL_PREFIX")
            .output()
            .unwrap()
    }

    /// smoke.rs's reduced run: the bundled Harbor tasks, n = 2, one step, an evaluation
    /// before and after it.
    fn submit(&self) -> RunId {
        let tasks = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/tasks");
        let spec = self.state.path().join("reduced.toml");
        std::fs::write(
            &spec,
            format!(
                "name = \"chaos\"\n[data]\ndataset = \"{}\"\nval_size = 1\ntrain_batch_size = 1\n\
                 [rollout]\nn = 2\nmax_turns = 2\nmax_response_tokens = 64\ntimeout_s = 120\n\
                 [trainer]\ntotal_steps = 1\n",
                tasks.display()
            ),
        )
        .unwrap();
        let submitted = self.arl(&["run", "submit", spec.to_str().unwrap()]);
        assert!(
            submitted.status.success(),
            "{}",
            String::from_utf8_lossy(&submitted.stderr)
        );
        RunId::new(String::from_utf8(submitted.stdout).unwrap().trim()).unwrap()
    }

    fn pid_file(&self, victim: &str) -> PathBuf {
        self.state.path().join("pids").join(victim)
    }

    /// The victim's pid while it runs (`arl up` keeps `<state>/pids/<name>` current).
    fn pid(&self, victim: &str) -> Option<u32> {
        let pid: u32 = std::fs::read_to_string(self.pid_file(victim))
            .ok()?
            .trim()
            .parse()
            .ok()?;
        running(pid).then_some(pid)
    }

    async fn wait_for_moment(&self, run: &RunId, moment: Moment) {
        let (domain, event, needed) = moment.subject();
        let subject = Namespace::default().event_subject(domain, run, event);
        wait_for(
            &format!("{moment:?} in {run}"),
            Duration::from_secs(600),
            || async {
                self.assert_up();
                let stored = stored(&self.bus, domain, subject.clone()).await;
                let train = stored.iter().filter(|e| e["slot"]["split"] == "train");
                if train.count() >= needed {
                    Some(())
                } else {
                    tokio::time::sleep(Duration::from_millis(250)).await;
                    None
                }
            },
        )
        .await;
    }

    /// SIGKILL, then wait until `arl up` has started the victim again (a new pid, running).
    async fn kill(&self, victim: &str) {
        let pid = self
            .pid(victim)
            .unwrap_or_else(|| panic!("{victim} is not running"));
        let killed = Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status()
            .unwrap();
        assert!(killed.success(), "kill -KILL {pid} ({victim})");
        wait_for(
            &format!("{victim} started again"),
            Duration::from_secs(60),
            || async {
                self.assert_up();
                let again = self.pid(victim).filter(|p| *p != pid);
                if again.is_none() {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                again
            },
        )
        .await;
        // The CLI (`arl run watch`) does not wait for a server: the restarted one must be
        // taking connections first (and this bus back on it).
        if victim == "nats-server" {
            let address = self.url.trim_start_matches("nats://").to_owned();
            wait_for("nats-server back", Duration::from_secs(60), || async {
                let back =
                    std::net::TcpStream::connect(&address).is_ok() && self.bus.is_connected();
                if !back {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                back.then_some(())
            })
            .await;
        }
    }

    /// `arl up --supervise` never stops on its own.
    fn assert_up(&self) {
        // Read through /proc (try_wait needs &mut): an exited, unreaped child is a zombie.
        assert!(running(self.up.0[0].id()), "arl up --supervise exited");
    }

    /// Follows the run to its end (`arl run watch`); its final state. The run must end
    /// as smoke.rs's does: completed, or failed only because its step trained nothing
    /// (SmolLM2 rarely solves a task: two equal rewards train nothing).
    async fn finish(&self, run: &RunId) -> RunStateV1 {
        let watched = self.arl(&["run", "watch", run.as_str(), "--timeout-s", "900"]);
        self.assert_up();
        let shown = format!(
            "{}\n{}",
            String::from_utf8_lossy(&watched.stdout),
            String::from_utf8_lossy(&watched.stderr)
        );
        let state = self.bus.run_state(run).await.unwrap().unwrap();
        assert!(state.status.is_terminal(), "{run} did not end: {shown}");
        let trained = state
            .steps
            .iter()
            .any(|s| s.batch.as_ref().is_some_and(|b| b.samples_trained > 0));
        if trained {
            assert_eq!(state.status, RunStatus::Completed, "{shown}");
            assert!(watched.status.success(), "{shown}");
            let evaluated: Vec<u32> = state.evaluations.iter().map(|e| e.step).collect();
            assert_eq!(
                evaluated,
                vec![0, 1],
                "evaluations before and after the step"
            );
        } else {
            assert_eq!(state.status, RunStatus::Failed, "{shown}");
            let reason = state.failure_reason.clone().unwrap_or_default();
            assert!(reason.contains("every step trained nothing"), "{reason}");
        }
        state
    }
}

/// Whether process `pid` exists and is not a zombie.
fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            stat.rsplit_once(") ")
                .map(|(_, rest)| !rest.starts_with('Z'))
        })
        .unwrap_or(false)
}

/// Every message stored on `filter` in `domain`'s stream, oldest first — read raw, so
/// that nothing is skipped for failing to decode as one version.
async fn stored(bus: &Bus, domain: Domain, filter: String) -> Vec<Value> {
    use async_nats::jetstream::consumer::{self, pull};
    use futures::StreamExt;
    let config = pull::Config {
        filter_subject: filter.clone(),
        ack_policy: consumer::AckPolicy::None,
        deliver_policy: consumer::DeliverPolicy::All,
        inactive_threshold: Duration::from_secs(30),
        ..Default::default()
    };
    let mut consumer: consumer::Consumer<pull::Config> = bus
        .jetstream()
        .create_consumer_on_stream(config, bus.namespace().stream(domain))
        .await
        .unwrap_or_else(|e| panic!("a consumer on {filter}: {e}"));
    let mut messages = Vec::new();
    loop {
        let mut batch = consumer
            .fetch()
            .max_messages(512)
            .expires(Duration::from_millis(250))
            .messages()
            .await
            .unwrap();
        let mut received = 0;
        while let Some(message) = batch.next().await {
            let message = message.unwrap();
            received += 1;
            messages.push(
                serde_json::from_slice(&message.payload).unwrap_or_else(|e| {
                    panic!("a message on {} is not JSON: {e}", message.subject)
                }),
            );
        }
        // An empty fetch ends the read only when the server says nothing is pending.
        if received == 0 && consumer.info().await.unwrap().num_pending == 0 {
            return messages;
        }
    }
}

/// A trial attempt: (trial id, attempt).
type Attempt = (String, u64);
/// A trial's slot: (split, step, task, sample index).
type Slot = (String, u64, String, u64);

fn attempt(event: &Value) -> Attempt {
    (
        event["trial_id"].as_str().unwrap().to_owned(),
        event["slot"]["attempt"].as_u64().unwrap(),
    )
}

fn slot(event: &Value) -> Slot {
    let slot = &event["slot"];
    (
        slot["split"].as_str().unwrap().to_owned(),
        slot["step"].as_u64().unwrap(),
        slot["task_id"].as_str().unwrap().to_owned(),
        slot["sample_index"].as_u64().unwrap(),
    )
}

/// How many events share each key.
fn counted<K: Ord>(keys: impl Iterator<Item = K>) -> BTreeMap<K, usize> {
    let mut counts = BTreeMap::new();
    for key in keys {
        *counts.entry(key).or_default() += 1;
    }
    counts
}

/// Waits until every requested attempt of the run has settled: failed, or finished and
/// graded, or — taken up once the run was over — marked done in `ARL_TRIALS` without
/// running (the rollout publishes nothing for those, not even `trial.started`). Returns
/// the last kind, which only a run that has ended may have. An attempt that started and
/// then neither failed nor was graded is lost: this waits for it until it times out, then
/// names each unsettled attempt and what its events and trial record say.
async fn settled(bus: &Bus, run: &RunId) -> BTreeSet<Attempt> {
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let (not_run, unsettled) = settlement(bus, run).await;
        if unsettled.is_empty() {
            return not_run;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after 300 s waiting for every requested attempt to settle; \
             unsettled:\n{}",
            unsettled.join("\n")
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The run's attempts taken up without running, and a line for each attempt that has
/// not settled yet.
async fn settlement(bus: &Bus, run: &RunId) -> (BTreeSet<Attempt>, Vec<String>) {
    let ns = Namespace::default();
    let read = |domain: Domain, event: &'static str| {
        stored(bus, domain, ns.event_subject(domain, run, event))
    };
    let attempts =
        |events: Vec<Value>| -> BTreeSet<Attempt> { events.iter().map(attempt).collect() };
    let finished = attempts(read(Domain::Trial, "finished").await);
    let failed = attempts(read(Domain::Trial, "failed").await);
    let scored = attempts(read(Domain::Reward, "scored").await);
    let started = attempts(read(Domain::Trial, "started").await);
    let mut not_run = BTreeSet::new();
    let mut unsettled = Vec::new();
    for request in attempts(read(Domain::Trial, "requested").await) {
        // Failed (before or after a hand-off), or graded.
        if failed.contains(&request) || scored.contains(&request) {
            continue;
        }
        let trial = TrialId::new(request.0.clone()).unwrap();
        let record = bus.trial_record(&trial).await.unwrap();
        let skipped = record
            .as_ref()
            .is_some_and(|r| r.done && r.finished.is_none() && u64::from(r.attempt) == request.1);
        // One that started and ended without an outcome would be a lost trial.
        if skipped && !finished.contains(&request) && !started.contains(&request) {
            not_run.insert(request);
            continue;
        }
        unsettled.push(format!(
            "  {} attempt {}: started {}, finished {}, record {:?}",
            request.0,
            request.1,
            started.contains(&request),
            finished.contains(&request),
            record
        ));
    }
    (not_run, unsettled)
}

/// A run's events, as stored (bodies only).
#[derive(Default)]
struct Streams {
    steps: Vec<Value>,
    weights: Vec<Value>,
    requested: Vec<Value>,
    finished: Vec<Value>,
    failed: Vec<Value>,
    scored: Vec<Value>,
    trajectories: Vec<Value>,
    /// Attempts taken up once the run was over, marked done without running.
    not_run: BTreeSet<Attempt>,
}

/// The run's streams, replayed once every attempt has settled; every guarantee the chaos
/// must not break is checked against them.
async fn audit(bus: &Bus, state: &RunStateV1) {
    let ns = Namespace::default();
    let run = &state.run_id;
    let not_run = settled(bus, run).await;
    let read = |domain: Domain, event: &'static str| {
        stored(bus, domain, ns.event_subject(domain, run, event))
    };
    let streams = Streams {
        steps: read(Domain::Train, "step").await,
        weights: read(Domain::Weights, "published").await,
        requested: read(Domain::Trial, "requested").await,
        finished: read(Domain::Trial, "finished").await,
        failed: read(Domain::Trial, "failed").await,
        scored: read(Domain::Reward, "scored").await,
        trajectories: read(Domain::Trajectory, "ready").await,
        not_run,
    };
    let trained: BTreeMap<u64, Option<usize>> = state
        .steps
        .iter()
        .map(|s| {
            let counted = s.batch.as_ref().map(|b| b.trajectories as usize);
            (u64::from(s.step), counted)
        })
        .collect();
    println!(
        "audit of {run}: {} attempts requested ({} retried, {} not run: requested once the run \
         was over), {} finished, {} failed, {} scored, {} trajectories, {} train.step, {} \
         weights.published",
        streams.requested.len(),
        streams
            .failed
            .iter()
            .filter(|f| f["will_retry"] == true)
            .count(),
        streams.not_run.len(),
        streams.finished.len(),
        streams.failed.len(),
        streams.scored.len(),
        streams.trajectories.len(),
        streams.steps.len(),
        streams.weights.len(),
    );
    let mut problems = problems(&streams, state.total_steps, &trained);
    // The announced weights are the weights on disk: a version trained again after a
    // crash and announced again within JetStream's de-duplication window is stored once,
    // so the event would name the first training's bytes.
    for version in &streams.weights {
        let location = &version["location"];
        if location["kind"] != "folder" {
            continue;
        }
        let file = Path::new(location["path"].as_str().unwrap()).join("model.safetensors");
        match arl_runtime::digest::sha256_file(&file) {
            Ok((digest, _)) if version["sha256"] == digest.as_str() => {}
            Ok((digest, _)) => problems.push(format!(
                "{} holds sha256 {digest}; version {} announced {}",
                file.display(),
                version["policy_version"],
                version["sha256"]
            )),
            Err(err) => println!("{} not checked: {err}", file.display()),
        }
    }
    assert!(problems.is_empty(), "{run}:\n{}", problems.join("\n"));
}

/// What breaks a guarantee in a run's events: `total_steps` steps, and per step the
/// trajectories its trainer counted.
fn problems(
    streams: &Streams,
    total_steps: u32,
    trained: &BTreeMap<u64, Option<usize>>,
) -> Vec<String> {
    let Streams {
        steps,
        weights,
        requested,
        finished,
        failed,
        scored,
        trajectories,
        not_run,
    } = streams;
    let mut problems = Vec::new();

    // One train.step per step, the run's steps exactly.
    let per_step = counted(steps.iter().map(|e| e["step"].as_u64().unwrap()));
    let expected: BTreeMap<u64, usize> = (1..=u64::from(total_steps)).map(|s| (s, 1)).collect();
    if per_step != expected {
        problems.push(format!(
            "train.step per step: {per_step:?}, expected {expected:?}"
        ));
    }
    // One weights.published per (run, policy version).
    let per_version = counted(
        weights
            .iter()
            .map(|e| e["policy_version"].as_u64().unwrap()),
    );
    if per_version != expected {
        problems.push(format!(
            "weights.published per policy version: {per_version:?}, expected {expected:?}"
        ));
    }
    // Each attempt requested once.
    let requests = counted(requested.iter().map(attempt));
    for (attempt, count) in &requests {
        if *count != 1 {
            problems.push(format!("{attempt:?} requested {count} times"));
        }
    }
    // Each requested attempt has exactly one outcome: finished and then graded once
    // (reward.scored or the grader's trial.failed), or failed before any hand-off.
    let finishes = counted(finished.iter().map(attempt));
    let failures = counted(failed.iter().map(attempt));
    let grades = counted(scored.iter().map(attempt));
    let count = |map: &BTreeMap<Attempt, usize>, key: &Attempt| map.get(key).copied().unwrap_or(0);
    for attempt in requests.keys().filter(|a| !not_run.contains(a)) {
        let outcome = (
            count(&finishes, attempt),
            count(&grades, attempt),
            count(&failures, attempt),
        );
        if !matches!(outcome, (1, 1, 0) | (1, 0, 1) | (0, 0, 1)) {
            problems.push(format!(
                "{attempt:?}: {} finished, {} scored, {} failed — not exactly one outcome",
                outcome.0, outcome.1, outcome.2
            ));
        }
    }
    for attempt in finishes.keys().chain(failures.keys()).chain(grades.keys()) {
        if !requests.contains_key(attempt) {
            problems.push(format!(
                "{attempt:?} has an outcome but was never requested"
            ));
        }
    }
    // A failure that retries is followed by the next attempt's request.
    for failure in failed {
        if failure["will_retry"] == true {
            let (trial, n) = attempt(failure);
            if !requests.contains_key(&(trial.clone(), n + 1)) {
                problems.push(format!(
                    "{trial} attempt {n} will retry, but {} was never requested",
                    n + 1
                ));
            }
        }
    }
    // Exactly one trajectory per training slot, from its last attempt.
    let last_attempt: BTreeMap<Slot, u64> =
        requested.iter().fold(BTreeMap::new(), |mut last, e| {
            let n = e["slot"]["attempt"].as_u64().unwrap();
            let entry = last.entry(slot(e)).or_insert(n);
            *entry = (*entry).max(n);
            last
        });
    let per_slot = counted(trajectories.iter().map(slot));
    for (slot, last) in last_attempt.iter().filter(|(s, _)| s.0 == "train") {
        let count = per_slot.get(slot).copied().unwrap_or(0);
        if count != 1 {
            problems.push(format!("training slot {slot:?}: {count} trajectories"));
        }
        let from = trajectories
            .iter()
            .find(|t| &self::slot(t) == slot)
            .map(|t| t["slot"]["attempt"].as_u64().unwrap());
        if from.is_some_and(|n| n != *last) {
            problems.push(format!(
                "training slot {slot:?}: trajectory of attempt {from:?}, the last attempt is {last}"
            ));
        }
    }
    for slot in per_slot.keys() {
        if !last_attempt.contains_key(slot) {
            problems.push(format!(
                "a trajectory for {slot:?}, which was never requested"
            ));
        }
    }
    // What the trainer counted agrees with the stream.
    for (step, counted) in trained {
        let in_stream = per_slot
            .keys()
            .filter(|s| s.0 == "train" && s.1 == *step)
            .count();
        if *counted != Some(in_stream) {
            problems.push(format!(
                "step {step}: the trainer counted {counted:?} trajectories, the stream holds \
                 {in_stream}"
            ));
        }
    }
    if !last_attempt.keys().any(|s| s.0 == "train") {
        problems.push("no training trial was requested".into());
    }
    problems
}

/// The audit has teeth: a clean run's events pass, and each broken guarantee — a step
/// trained twice, weights published twice, a lost trial, an attempt with two outcomes, a
/// retry never requested, a slot trained twice — is named.
#[test]
fn the_audit_names_each_broken_guarantee() {
    let slot = |split: &str, sample: u64, attempt: u64| {
        serde_json::json!({"split": split, "step": 1, "task_id": "fix-mean",
                           "sample_index": sample, "attempt": attempt})
    };
    let trial = |split: &str, sample: u64, attempt: u64| {
        serde_json::json!({"trial_id": format!("t-{split}-{sample}"),
                           "slot": slot(split, sample, attempt)})
    };
    let with = |mut event: Value, key: &str, value: Value| {
        event[key] = value;
        event
    };
    // Sample 0 fails once (its replica lost) and is retried; sample 1 and the validation
    // trial run once; every finished attempt is graded.
    let clean = || Streams {
        steps: vec![serde_json::json!({"step": 1})],
        weights: vec![serde_json::json!({"policy_version": 1})],
        requested: vec![
            trial("train", 0, 0),
            trial("train", 0, 1),
            trial("train", 1, 0),
            trial("validation", 0, 0),
        ],
        finished: vec![
            trial("train", 0, 1),
            trial("train", 1, 0),
            trial("validation", 0, 0),
        ],
        failed: vec![with(trial("train", 0, 0), "will_retry", true.into())],
        scored: vec![
            trial("train", 0, 1),
            trial("train", 1, 0),
            trial("validation", 0, 0),
        ],
        trajectories: vec![trial("train", 0, 1), trial("train", 1, 0)],
        not_run: BTreeSet::new(),
    };
    let trained = BTreeMap::from([(1, Some(2))]);
    assert_eq!(problems(&clean(), 1, &trained), Vec::<String>::new());

    type Breaks = fn(&mut Streams);
    let broken: [(&str, Breaks); 7] = [
        ("train.step per step", |s| {
            s.steps.push(serde_json::json!({"step": 1}))
        }),
        ("weights.published per policy version", |s| {
            s.weights.push(serde_json::json!({"policy_version": 1}))
        }),
        ("not exactly one outcome", |s| {
            s.finished.retain(|e| e["slot"]["split"] != "validation");
            s.scored.retain(|e| e["slot"]["split"] != "validation");
        }),
        ("not exactly one outcome", |s| {
            let grade = s.scored[1].clone();
            s.failed.push(grade);
        }),
        ("was never requested", |s| {
            s.requested.retain(|e| e["slot"]["attempt"] != 1);
        }),
        ("2 trajectories", |s| {
            let again = s.trajectories[1].clone();
            s.trajectories.push(again);
        }),
        ("trajectory of attempt", |s| {
            s.trajectories[0]["slot"]["attempt"] = 0.into();
        }),
    ];
    for (named, breaks) in broken {
        let mut streams = clean();
        breaks(&mut streams);
        let found = problems(&streams, 1, &trained);
        assert!(
            found.iter().any(|p| p.contains(named)),
            "expected a problem naming {named:?}: {found:?}"
        );
    }
    // The trainer's count disagreeing with the stream is named too.
    let found = problems(&clean(), 1, &BTreeMap::from([(1, Some(1))]));
    assert!(
        found.iter().any(|p| p.contains("the trainer counted")),
        "{found:?}"
    );
}
