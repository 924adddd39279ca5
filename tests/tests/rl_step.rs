//! One reinforcement-learning step across the real `arl-controller`, `arl-inference` and
//! `arl-trainer` binaries on a private nats-server, with the real SmolLM2: trials sampled
//! from the engine (the test plays the rollout service, which is not built yet) become
//! trajectories; the trainer trains on them and publishes version 1; the engine loads it
//! and serves it; the controller records the step. Build the binaries first
//! (`cargo build --bins`; `make test` does).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use arl_runtime::bus::BusConfig;
use arl_runtime::{Bus, Metrics};
use arl_schemas::events::{
    CallSpan, Example, SampleStatus, Split, TaskBatchV1, TaskRef, TrainStepV2, TrajectoryBranch,
    TrajectoryV1, TrialSlot,
};
use arl_schemas::state::{RunStateV1, TrialRecordV1};
use arl_schemas::{Bucket, Event, RunId, TaskId, TrialId};
use arl_testkit::{Children, NatsServer, built_binary, free_port, http, test_namespace, wait_for};
use serde_json::{Value, json};

async fn chat(base: &str, body: &Value) -> Value {
    let response = http(
        &format!("{base}/v1/chat/completions"),
        "POST",
        &[("content-type", "application/json")],
        body.to_string().as_bytes(),
    )
    .await
    .unwrap();
    assert_eq!(response.status, 200, "{}", response.text());
    response.json()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_grpo_step_flows_from_engine_to_trainer_and_back() {
    let server = NatsServer::start().unwrap();
    let ns = test_namespace();
    let prefix = ns.prefix().unwrap().to_owned();
    let files = tempfile::tempdir().unwrap();
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let spec = files.path().join("step.toml");
    std::fs::write(
        &spec,
        format!(
            "name = \"rl-step\"\n[data]\ndataset = \"{}\"\ntrain_batch_size = 2\nval_size = 1\n\
             [rollout]\nn = 2\n[optim]\nlr = 1e-5\n[trainer]\ntotal_steps = 1\n",
            repo.join("examples/tasks").display()
        ),
    )
    .unwrap();
    let port = free_port().unwrap();
    let base = format!("http://127.0.0.1:{port}");
    let spawn = |name: &str, args: &[&str]| {
        Command::new(built_binary(name))
            .args(args)
            .env("NATS_URL", server.url())
            .env("ARL_PREFIX", &prefix)
            .env("ARL_RUNS_DIR", files.path().join("runs"))
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap()
    };
    let _processes = Children(vec![
        spawn("arl-controller", &[]),
        spawn("arl-trainer", &[]),
        spawn(
            "arl-inference",
            &[
                "--model",
                "smollm2-135m-instruct",
                "--listen",
                &format!("127.0.0.1:{port}"),
            ],
        ),
    ]);

    // Submit the run; the controller admits it.
    let submitted = Command::new(built_binary("arl"))
        .args(["run", "submit", spec.to_str().unwrap(), "--wait"])
        .env("NATS_URL", server.url())
        .env("ARL_PREFIX", &prefix)
        .output()
        .unwrap();
    assert!(
        submitted.status.success(),
        "{}",
        String::from_utf8_lossy(&submitted.stderr)
    );
    let run_id = RunId::new(
        String::from_utf8_lossy(&submitted.stdout)
            .split_whitespace()
            .find(|w| w.starts_with("run-"))
            .unwrap(),
    )
    .unwrap();

    wait_for("the engine", Duration::from_secs(60), || async {
        let r = http(&format!("{base}/v1/models"), "GET", &[], b"")
            .await
            .ok()?;
        (r.status == 200).then_some(())
    })
    .await;

    // The rollout's part: two tasks × two trials sampled from policy version 0.
    let bus = Bus::connect(
        BusConfig::new(server.url(), ns.clone(), "test"),
        Metrics::new(),
    )
    .await
    .unwrap();
    let tasks = [
        ("capital", "What is the capital of France?"),
        ("sum", "What is 2 + 3?"),
    ];
    // As the dataset service does: the step's batch, which tells the trainer its size.
    let template = TaskBatchV1::example().tasks[0].clone();
    bus.publish(&TaskBatchV1 {
        run_id: run_id.clone(),
        step: 1,
        split: Split::Train,
        samples_per_task: 2,
        tasks: tasks
            .iter()
            .map(|(task, _)| TaskRef {
                task_id: TaskId::new(*task).unwrap(),
                ..template.clone()
            })
            .collect(),
    })
    .await
    .unwrap();
    for (task, question) in tasks {
        for sample in 0..2u32 {
            let answer = chat(
                &base,
                &json!({"messages": [{"role": "user", "content": question}], "temperature": 1.0,
                        "seed": 100 + sample, "max_tokens": 16, "logprobs": true}),
            )
            .await;
            assert_eq!(answer["policy_version"], 0);
            let prompt: Vec<u32> =
                serde_json::from_value(answer["prompt_token_ids"].clone()).unwrap();
            let completion: Vec<u32> =
                serde_json::from_value(answer["choices"][0]["token_ids"].clone()).unwrap();
            let logprobs: Vec<f32> = answer["choices"][0]["logprobs"]["content"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| e["logprob"].as_f64().unwrap() as f32)
                .collect();
            let mut token_ids = prompt.clone();
            token_ids.extend(&completion);
            let mut loss_mask = vec![0u8; prompt.len()];
            loss_mask.extend(vec![1u8; completion.len()]);
            let mut rollout_logprobs = vec![0f32; prompt.len()];
            rollout_logprobs.extend(&logprobs);
            let trajectory = TrajectoryV1 {
                run_id: run_id.clone(),
                trial_id: TrialId::new(format!("trial-{task}-{sample}")).unwrap(),
                slot: TrialSlot {
                    task_id: TaskId::new(task).unwrap(),
                    step: 1,
                    split: Split::Train,
                    sample_index: sample,
                    attempt: 0,
                },
                status: SampleStatus::Scored,
                // A synthetic reward: the groups need a spread for GRPO to learn anything.
                reward: f64::from(sample),
                num_turns: 1,
                branches: vec![TrajectoryBranch {
                    token_ids,
                    loss_mask,
                    logprobs: rollout_logprobs,
                }],
                calls: vec![CallSpan {
                    turn_index: 0,
                    branch: 0,
                    completion_start: prompt.len() as u32,
                    completion_len: completion.len() as u32,
                    policy_version: 0,
                }],
                unproven_tokens: 0,
                tool_parse_failures: 0,
                tool_calls: 0,
            };
            // As the rollout service does: the attempt claimed, then its trajectory.
            bus.modify_record::<TrialRecordV1>(Bucket::Trials, trajectory.trial_id.as_str(), |r| {
                *r = Some(TrialRecordV1 {
                    attempt: 0,
                    done: false,
                });
                true
            })
            .await
            .unwrap();
            bus.publish(&trajectory).await.unwrap();
        }
    }

    // The engine picks up the trainer's version 1 and serves it.
    wait_for(
        "policy version 1 served",
        Duration::from_secs(240),
        || async {
            let r = http(&format!("{base}/v1/models"), "GET", &[], b"")
                .await
                .ok()?;
            (r.json::<Value>()["data"][0]["policy_version"] == 1).then_some(())
        },
    )
    .await;
    let answer = chat(
        &base,
        &json!({"messages": [{"role": "user", "content": "What is the capital of France?"}],
                "temperature": 0, "max_tokens": 12}),
    )
    .await;
    assert_eq!(answer["policy_version"], 1);
    assert!(
        !answer["choices"][0]["token_ids"]
            .as_array()
            .unwrap()
            .is_empty()
    );

    // The controller recorded the step and the new version.
    let kv = bus.bucket(Bucket::RunState).await.unwrap();
    let state = wait_for(
        "the step in the run state",
        Duration::from_secs(30),
        || async {
            let entry = kv.get(run_id.as_str()).await.ok()??;
            let state = RunStateV1::decode(&entry).ok()?;
            (state.step == 1 && state.policy_version == 1).then_some(state)
        },
    )
    .await;
    let step = &state.steps[0];
    assert!(step.pg_loss.is_finite() && step.grad_norm > 0.0, "{step:?}");
    assert!(state.checkpoint_uri.unwrap().contains("step-000001"));
    let stream = bus
        .jetstream()
        .get_stream(ns.stream(arl_schemas::Domain::Train))
        .await
        .unwrap();
    let message = stream
        .get_last_raw_message_by_subject(&ns.event_subject(
            arl_schemas::Domain::Train,
            &run_id,
            "step",
        ))
        .await
        .unwrap();
    let event = TrainStepV2::decode(&message.payload).unwrap();
    assert_eq!(
        (event.metrics.trajectories, event.metrics.reward_mean),
        (4, 0.5)
    );
    // Two groups of two, rewards 0 and 1 in each: every sample carries an advantage.
    assert_eq!(
        (
            event.batch.trajectories,
            event.batch.groups,
            event.batch.zero_advantage_groups,
            event.batch.samples_trained
        ),
        (4, 2, 0, 4),
        "{:?}",
        event.batch
    );
    assert_eq!(step.batch.as_ref(), Some(&event.batch));
}
