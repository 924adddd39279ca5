//! The ledger of a load test: every stored event of the trial, reward, trajectory and
//! LLM streams, replayed after the scenario, with the time JetStream stored it. From it:
//! the accounting (every trial attempt has exactly one outcome, every graded training slot
//! exactly one trajectory) and the stage latencies.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use arl_runtime::Bus;
use arl_schemas::Domain;
use futures::StreamExt;
use serde_json::Value;

/// One stored event: its subject's last token (`requested`, `scored` …), the time the
/// server stored it (seconds since the epoch) and its body.
pub struct Stored {
    pub event: String,
    pub at: f64,
    pub body: Value,
}

/// Every event stored in `domain`'s stream, oldest first.
pub async fn read_stream(bus: &Bus, domain: Domain) -> anyhow::Result<Vec<Stored>> {
    use async_nats::jetstream::consumer::{self, pull};
    let config = pull::Config {
        ack_policy: consumer::AckPolicy::None,
        deliver_policy: consumer::DeliverPolicy::All,
        inactive_threshold: Duration::from_secs(30),
        ..Default::default()
    };
    let consumer: consumer::Consumer<pull::Config> = bus
        .jetstream()
        .create_consumer_on_stream(config, bus.namespace().stream(domain))
        .await?;
    let mut stored = Vec::new();
    loop {
        let mut batch = consumer
            .fetch()
            .max_messages(1000)
            .expires(Duration::from_millis(500))
            .messages()
            .await?;
        let mut received = 0;
        while let Some(message) = batch.next().await {
            let message = message.map_err(|e| anyhow::anyhow!("{e}"))?;
            received += 1;
            let at = message
                .info()
                .map(|i| i.published.unix_timestamp_nanos() as f64 / 1e9)
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            let event = message
                .subject
                .rsplit('.')
                .next()
                .unwrap_or_default()
                .to_owned();
            let body = serde_json::from_slice(&message.payload).unwrap_or(Value::Null);
            stored.push(Stored { event, at, body });
        }
        if received == 0 {
            return Ok(stored);
        }
    }
}

/// A trial attempt: (run, trial, attempt).
type Attempt = (String, String, u64);
/// A training slot: (run, step, task, sample index).
type Slot = (String, u64, String, u64);

fn attempt(body: &Value) -> Attempt {
    (
        body["run_id"].as_str().unwrap_or_default().to_owned(),
        body["trial_id"].as_str().unwrap_or_default().to_owned(),
        body["slot"]["attempt"].as_u64().unwrap_or(0),
    )
}

fn slot(body: &Value) -> Slot {
    let s = &body["slot"];
    (
        body["run_id"].as_str().unwrap_or_default().to_owned(),
        s["step"].as_u64().unwrap_or(0),
        s["task_id"].as_str().unwrap_or_default().to_owned(),
        s["sample_index"].as_u64().unwrap_or(0),
    )
}

/// What happened to one attempt, by the times of its events.
#[derive(Default)]
struct Outcome {
    requested: Vec<f64>,
    started: Vec<f64>,
    finished: Vec<f64>,
    failed: Vec<f64>,
    scored: Vec<f64>,
    train: bool,
    slot: Option<Slot>,
}

/// Latency samples of one stage, in milliseconds.
#[derive(Default)]
pub struct Stage {
    pub samples: Vec<f64>,
}

impl Stage {
    pub fn push(&mut self, ms: f64) {
        self.samples.push(ms);
    }

    /// (p50, p99) in ms, or None without samples.
    pub fn quantiles(&self) -> Option<(f64, f64)> {
        let mut sorted = self.samples.clone();
        if sorted.is_empty() {
            return None;
        }
        sorted.sort_by(f64::total_cmp);
        let at = |q: f64| sorted[((sorted.len() as f64 - 1.0) * q).round() as usize];
        Some((at(0.5), at(0.99)))
    }
}

/// What the replay found.
pub struct Ledger {
    /// Trial attempts requested.
    pub attempts: usize,
    /// Attempts that ended graded (`reward.scored`).
    pub scored: usize,
    /// Attempts that ended failed (by the rollout or the grader).
    pub failed: usize,
    /// Each lost or duplicated thing, said in words.
    pub problems: Vec<String>,
    /// Stage latencies (ms), by name, in print order.
    pub stages: Vec<(&'static str, Stage)>,
    /// Sandbox leases taken, and how many of them came from a warm pool.
    pub leases: usize,
    pub warm_leases: usize,
    /// Failed attempts by class, with one message of each.
    pub failures: BTreeMap<String, (usize, String)>,
    /// Trials in flight (started, not finished or failed) at the busiest moment.
    pub peak_in_flight: usize,
    /// Graded attempts per second between the first start and the last grade.
    pub trials_per_second: f64,
    /// Seconds from the first request to the last trajectory.
    pub span_s: f64,
}

/// The events of `events` that belong to one of `runs`.
fn keep<'a>(runs: &[String], events: &'a [Stored]) -> Vec<&'a Stored> {
    events
        .iter()
        .filter(|e| {
            e.body["run_id"]
                .as_str()
                .is_some_and(|r| runs.iter().any(|run| run == r))
        })
        .collect()
}

/// Folds the replayed streams' events of `runs` into the accounting and the stage
/// latencies.
pub fn account(
    runs: &[String],
    trials: &[Stored],
    rewards: &[Stored],
    trajectories: &[Stored],
    calls: &[Stored],
    sandbox: &[Stored],
) -> Ledger {
    let (trials, rewards, trajectories, calls, sandbox) = (
        keep(runs, trials),
        keep(runs, rewards),
        keep(runs, trajectories),
        keep(runs, calls),
        keep(runs, sandbox),
    );
    let mut attempts: BTreeMap<Attempt, Outcome> = BTreeMap::new();
    let mut problems = Vec::new();
    let mut failures: BTreeMap<String, (usize, String)> = BTreeMap::new();
    for e in &trials {
        let key = attempt(&e.body);
        let outcome = attempts.entry(key).or_default();
        match e.event.as_str() {
            "requested" => {
                outcome.requested.push(e.at);
                outcome.train = e.body["slot"]["split"].as_str() == Some("train");
                outcome.slot = Some(slot(&e.body));
            }
            "started" => outcome.started.push(e.at),
            "finished" => outcome.finished.push(e.at),
            "failed" => {
                outcome.failed.push(e.at);
                let class = e.body["class"].as_str().unwrap_or("unknown").to_owned();
                let message = e.body["message"].as_str().unwrap_or_default();
                let entry = failures
                    .entry(class)
                    .or_insert_with(|| (0, message.chars().take(300).collect()));
                entry.0 += 1;
            }
            _ => {}
        }
    }
    for e in rewards.iter().filter(|e| e.event == "scored") {
        attempts
            .entry(attempt(&e.body))
            .or_default()
            .scored
            .push(e.at);
    }
    let mut trajectory_at: HashMap<Slot, Vec<f64>> = HashMap::new();
    for e in trajectories.iter().filter(|e| e.event == "ready") {
        trajectory_at.entry(slot(&e.body)).or_default().push(e.at);
    }

    let mut stages: Vec<(&'static str, Stage)> = [
        "queue: trial.requested → trial.started",
        "agent turn through the proxy (llm.call latency)",
        "trial: trial.started → trial.finished",
        "grade: trial.finished → reward.scored",
        "trajectory hand-off: reward.scored → trajectory.ready",
        "whole trial: trial.requested → trajectory.ready",
        "lease: trial.started → sandbox.leased (the agent's sandbox)",
        "sandbox held: sandbox.leased → sandbox.released (agent and grading)",
    ]
    .into_iter()
    .map(|name| (name, Stage::default()))
    .collect();
    for e in calls.iter().filter(|e| e.event == "call") {
        if let Some(ms) = e.body["timing"]["latency_ms"].as_f64() {
            stages[1].1.push(ms);
        }
    }

    // The agent's lease names its trial; the grader's lease is matched by lease id only.
    let mut trial_started: HashMap<(String, String), f64> = HashMap::new();
    for e in trials.iter().filter(|e| e.event == "started") {
        let (run, trial, _) = attempt(&e.body);
        trial_started.entry((run, trial)).or_insert(e.at);
    }
    let mut leased_at: HashMap<String, f64> = HashMap::new();
    // Per trial, its first lease (the agent's; the grader's comes after the trial ends).
    let mut first_lease: HashMap<(String, String), f64> = HashMap::new();
    let mut warm = 0;
    for e in &sandbox {
        let lease = e.body["lease_id"].as_str().unwrap_or_default().to_owned();
        match e.event.as_str() {
            "leased" => {
                leased_at.insert(lease, e.at);
                warm += usize::from(e.body["warm"].as_bool().unwrap_or(false));
                let run = e.body["run_id"].as_str().unwrap_or_default().to_owned();
                if let Some(trial) = e.body["trial_id"].as_str() {
                    first_lease.entry((run, trial.to_owned())).or_insert(e.at);
                }
            }
            "released" => {
                if let Some(leased) = leased_at.get(&lease) {
                    stages[7].1.push((e.at - leased) * 1e3);
                }
            }
            _ => {}
        }
    }
    for (trial, leased) in &first_lease {
        if let Some(started) = trial_started.get(trial) {
            stages[6].1.push((leased - started) * 1e3);
        }
    }

    let (mut scored, mut failed) = (0, 0);
    let mut graded_train_slots: HashMap<Slot, usize> = HashMap::new();
    // (time, +1 start / -1 end) for the in-flight sweep.
    let mut edges: Vec<(f64, i64)> = Vec::new();
    let (mut first_start, mut last_grade) = (f64::MAX, 0.0_f64);
    for ((run, trial, n), o) in &attempts {
        let name = format!("{run}/{trial} attempt {n}");
        match (
            o.requested.len(),
            o.finished.len(),
            o.failed.len(),
            o.scored.len(),
        ) {
            (1, 1, 0, 1) | (1, 1, 1, 0) | (1, 0, 1, 0) => {}
            (0, ..) => problems.push(format!("{name}: an outcome without a trial.requested")),
            (1, 0, 0, 0) => problems.push(format!("{name}: lost (requested, no outcome)")),
            (1, 1, 0, 0) => problems.push(format!("{name}: lost after trial.finished (no grade)")),
            (r, f, x, s) => problems.push(format!(
                "{name}: duplicated ({r} requested, {f} finished, {x} failed, {s} scored)"
            )),
        }
        if o.scored.len() == 1 {
            scored += 1;
        } else if !o.failed.is_empty() {
            failed += 1;
        }
        if let (Some(&requested), Some(&started)) = (o.requested.first(), o.started.first()) {
            stages[0].1.push((started - requested) * 1e3);
            first_start = first_start.min(started);
            edges.push((started, 1));
            if let Some(&end) = o.finished.first().or(o.failed.first()) {
                edges.push((end, -1));
            }
        }
        if let (Some(&started), Some(&finished)) = (o.started.first(), o.finished.first()) {
            stages[2].1.push((finished - started) * 1e3);
        }
        if let (Some(&finished), Some(&graded)) = (o.finished.first(), o.scored.first()) {
            stages[3].1.push((graded - finished) * 1e3);
            last_grade = last_grade.max(graded);
        }
        if let (true, [scored], Some(slot)) = (o.train, o.scored.as_slice(), &o.slot) {
            *graded_train_slots.entry(slot.clone()).or_default() += 1;
            if let Some(ready) = trajectory_at.get(slot).and_then(|t| t.first()) {
                stages[4].1.push((ready - scored) * 1e3);
                if let Some(&requested) = o.requested.first() {
                    stages[5].1.push((ready - requested) * 1e3);
                }
            }
        }
    }
    for (slot, count) in &trajectory_at {
        if count.len() > 1 {
            problems.push(format!(
                "{slot:?}: {} trajectories for one slot",
                count.len()
            ));
        }
    }
    for slot in graded_train_slots.keys() {
        if !trajectory_at.contains_key(slot) {
            problems.push(format!("{slot:?}: graded, but no trajectory.ready"));
        }
    }

    edges.sort_by(|a, b| a.0.total_cmp(&b.0).then(b.1.cmp(&a.1)));
    let (mut now, mut peak) = (0_i64, 0_i64);
    for (_, delta) in &edges {
        now += delta;
        peak = peak.max(now);
    }
    let first_request = trials
        .iter()
        .filter(|e| e.event == "requested")
        .map(|e| e.at)
        .fold(f64::MAX, f64::min);
    let last_trajectory = trajectories.iter().map(|e| e.at).fold(0.0, f64::max);
    let window = (last_grade - first_start).max(1e-9);
    Ledger {
        attempts: attempts.len(),
        scored,
        failed,
        problems,
        failures,
        stages,
        leases: leased_at.len(),
        warm_leases: warm,
        peak_in_flight: peak.max(0) as usize,
        trials_per_second: scored as f64 / window,
        span_s: (last_trajectory - first_request).max(0.0),
    }
}

/// How many `event`s of `runs` are in `events`, and their rate between the first and the
/// last of them (per second).
pub fn rate_of(runs: &[String], events: &[Stored], event: &str) -> (usize, f64) {
    let times: Vec<f64> = keep(runs, events)
        .into_iter()
        .filter(|e| e.event == event)
        .map(|e| e.at)
        .collect();
    let first = times.iter().copied().fold(f64::MAX, f64::min);
    let last = times.iter().copied().fold(0.0, f64::max);
    let rate = if times.len() > 1 {
        times.len() as f64 / (last - first).max(1e-9)
    } else {
        0.0
    };
    (times.len(), rate)
}
