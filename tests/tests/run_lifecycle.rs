//! A run's life past submit (issue 28): `arl run cancel` and `arl run resume --from step-N`
//! against `arl up` with every service, on a small math run.
//!
//! 1. Run A trains until step 1 is committed; `arl run cancel A --wait` ends it
//!    `cancelled` (exit 0), `run.cancelled` is published, cancelling it again is refused
//!    (exit 1), and each of A's attempts that started ends with an outcome (those the
//!    cancel stopped with a `trial.failed` saying so).
//! 2. `arl run resume A --from step-1` starts run B from A's checkpoint: B's first version
//!    is A's step-1 weights (same sha256), B's batches and steps are 2..N only, and every
//!    LLM call of B is served by B's own weights at version ≥ 1 — never the base model.
//! 3. Resuming from a step that is not a checkpoint (exit 2) or a run that does not exist
//!    (exit 4) is refused with a message saying why.
//!
//! Build the binaries first (`cargo build --workspace --bins`; `make test` does).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeSet;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use arl_runtime::bus::BusConfig;
use arl_runtime::{Bus, Metrics};
use arl_schemas::events::{
    LlmCallV2, RewardScoredV2, RunCancelledV1, Split, TaskBatchV1, TrainStepV2, TrialFailedV1,
    TrialStartedV1, WeightsPublishedV2,
};
use arl_schemas::state::{RunStateV1, RunStatus};
use arl_schemas::{Event, Namespace, RunId};
use arl_testkit::{Children, built_binary};

const STEPS: u32 = 3;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_is_cancelled_and_another_resumes_from_its_checkpoint() {
    let state = tempfile::Builder::new()
        .prefix("arl-lifecycle-")
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
    let cli = |args: &[&str]| -> Output {
        Command::new(&arl)
            .args(args)
            .env("NATS_URL", &url)
            .env_remove("ARL_PREFIX")
            .output()
            .unwrap()
    };

    let tasks = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/arithmetic/tasks.jsonl");
    let spec = state.path().join("lifecycle.toml");
    std::fs::write(
        &spec,
        format!(
            "name = \"lifecycle\"\n\
             [data]\ndataset = \"{}\"\nsource = \"gsm8k\"\nval_size = 2\nseed = 5\n\
             train_batch_size = 2\n\
             [rollout]\nn = 4\nmax_turns = 1\ntemperature = 0.8\nmax_response_tokens = 16\n\
             timeout_s = 600\nval_n = 1\nval_temperature = 0.0\n\
             [algorithm]\nmax_staleness = 0\nold_logprobs = \"rollout\"\n\
             [optim]\nlr = 2e-5\n\
             [trainer]\ntotal_steps = {STEPS}\neval_every = 0\nsave_every = 1\n",
            tasks.display()
        ),
    )
    .unwrap();
    let submitted = cli(&["run", "submit", spec.to_str().unwrap()]);
    assert!(submitted.status.success(), "{}", stderr(&submitted));
    let a = RunId::new(String::from_utf8(submitted.stdout).unwrap().trim()).unwrap();

    let mut config = BusConfig::new(&url, Namespace::default(), "test");
    config.publish_timeout = Duration::from_secs(5);
    let bus = Bus::connect(config, Metrics::new()).await.unwrap();
    wait_for_state(&bus, &a, "step 1 committed", |s| {
        s.step >= 1 || s.status.is_terminal()
    })
    .await;

    // (1) Cancel A.
    let cancelled = cli(&["run", "cancel", a.as_str(), "--reason", "testing", "--wait"]);
    assert!(cancelled.status.success(), "{}", stderr(&cancelled));
    let a_state = bus.run_state(&a).await.unwrap().unwrap();
    assert_eq!(a_state.status, RunStatus::Cancelled, "{a_state:?}");
    let reason = a_state.failure_reason.clone().unwrap_or_default();
    assert!(
        reason.starts_with("cancelled by ") && reason.ends_with(": testing"),
        "{reason}"
    );
    let again = cli(&["run", "cancel", a.as_str()]);
    assert_eq!(again.status.code(), Some(1), "{}", stderr(&again));
    assert!(stderr(&again).contains("already ended (cancelled)"));
    let notices: Vec<RunCancelledV1> = replay(&bus, "cancelled").await;
    assert!(
        notices
            .iter()
            .any(|n| n.run_id == a && n.reason == "testing")
    );

    // (3) Refusals.
    let not_a_checkpoint = cli(&["run", "resume", a.as_str(), "--from", "step-9"]);
    assert_eq!(
        not_a_checkpoint.status.code(),
        Some(2),
        "{}",
        stderr(&not_a_checkpoint)
    );
    assert!(
        stderr(&not_a_checkpoint).contains("has no checkpoint step-9"),
        "{}",
        stderr(&not_a_checkpoint)
    );
    let unknown = cli(&["run", "resume", "run-nosuchrun", "--from", "step-1"]);
    assert_eq!(unknown.status.code(), Some(4), "{}", stderr(&unknown));

    // (2) Resume from A's step 1 as B.
    let resumed = cli(&["run", "resume", a.as_str(), "--from", "step-1", "--wait"]);
    assert!(resumed.status.success(), "{}", stderr(&resumed));
    let b = RunId::new(String::from_utf8(resumed.stdout).unwrap().trim()).unwrap();
    assert_ne!(a, b);
    let b_state = wait_for_state(&bus, &b, "run B to end", |s| s.status.is_terminal()).await;
    assert!(
        up.0[0].try_wait().unwrap().is_none(),
        "arl up stopped during the runs"
    );
    let shown = format!("{b_state:#?}");
    let learned = b_state.steps.iter().any(|s| !s.trained_nothing());
    let expected = if learned {
        RunStatus::Completed
    } else {
        RunStatus::Failed
    };
    assert_eq!(b_state.status, expected, "{shown}");
    assert_eq!(b_state.step, STEPS, "{shown}");
    let b_steps: Vec<u32> = b_state.steps.iter().map(|s| s.step).collect();
    assert_eq!(b_steps, (2..=STEPS).collect::<Vec<_>>(), "{shown}");

    let weights: Vec<WeightsPublishedV2> = replay(&bus, "published").await;
    let a_step1 = weights
        .iter()
        .find(|w| w.run_id == a && w.policy_version == 1)
        .expect("A published version 1");
    let b_versions: Vec<&WeightsPublishedV2> = weights.iter().filter(|w| w.run_id == b).collect();
    assert_eq!(
        b_versions.first().map(|w| (w.policy_version, &w.sha256)),
        Some((1, &a_step1.sha256)),
        "B starts from A's step-1 weights: {b_versions:#?}"
    );
    assert!(b_versions.iter().all(|w| w.policy_version >= 1));

    let batches: Vec<TaskBatchV1> = replay(&bus, "batch").await;
    let b_train: Vec<u32> = batches
        .iter()
        .filter(|t| t.run_id == b && t.split == Split::Train)
        .map(|t| t.step)
        .collect();
    assert_eq!(b_train, (2..=STEPS).collect::<Vec<_>>());
    let a_batch = |step: u32| {
        batches
            .iter()
            .find(|t| t.run_id == a && t.split == Split::Train && t.step == step)
            .map(|t| {
                t.tasks
                    .iter()
                    .map(|r| r.task_id.clone())
                    .collect::<Vec<_>>()
            })
    };
    let b_batch = batches
        .iter()
        .find(|t| t.run_id == b && t.split == Split::Train && t.step == 2)
        .map(|t| {
            t.tasks
                .iter()
                .map(|r| r.task_id.clone())
                .collect::<Vec<_>>()
        });
    if let Some(a2) = a_batch(2) {
        assert_eq!(Some(a2), b_batch, "B's step 2 trains on A's step-2 tasks");
    }
    // Every attempt of A that started ends with an outcome, those the cancel stopped
    // included (B has run to its end since: none of A's can still be in flight).
    let started: Vec<TrialStartedV1> = replay(&bus, "started").await;
    let failed: Vec<TrialFailedV1> = replay(&bus, "failed").await;
    let scored: Vec<RewardScoredV2> = replay(&bus, "scored").await;
    let settled: BTreeSet<(&str, u32)> = failed
        .iter()
        .map(|f| (f.trial_id.as_str(), f.slot.attempt))
        .chain(scored.iter().map(|s| (s.trial_id.as_str(), s.slot.attempt)))
        .collect();
    for start in started.iter().filter(|s| s.run_id == a) {
        assert!(
            settled.contains(&(start.trial_id.as_str(), start.slot.attempt)),
            "{} attempt {} of the cancelled run started and has no outcome",
            start.trial_id,
            start.slot.attempt
        );
    }
    let steps: Vec<TrainStepV2> = replay(&bus, "step").await;
    assert!(steps.iter().filter(|s| s.run_id == b).all(|s| s.step >= 2));

    let calls: Vec<LlmCallV2> = replay(&bus, "call").await;
    let b_calls: Vec<&LlmCallV2> = calls.iter().filter(|c| c.run_id == b).collect();
    assert!(!b_calls.is_empty(), "run B recorded no LLM call");
    for call in b_calls {
        assert_eq!(call.served_run_id.as_ref(), Some(&b), "{call:?}");
        assert!(
            call.served_version.is_some_and(|v| v >= 1),
            "B's call served by version {:?}, not its checkpoint or later",
            call.served_version
        );
    }
    drop(up);
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

async fn wait_for_state(
    bus: &Bus,
    run: &RunId,
    what: &str,
    done: impl Fn(&RunStateV1) -> bool,
) -> RunStateV1 {
    let done = &done;
    arl_testkit::wait_for(
        &format!("run {run}: {what}"),
        Duration::from_secs(900),
        || async move {
            let state = bus.run_state(run).await.ok()??;
            if done(&state) {
                return Some(state);
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
            None
        },
    )
    .await
}

async fn replay<E: Event>(bus: &Bus, event: &str) -> Vec<E> {
    let ns = Namespace::default();
    bus.replay(E::DOMAIN, ns.event_filter(E::DOMAIN, event))
        .await
        .unwrap()
}
