//! The colocated layout: `arl serve trainer + inference` in one process. The trainer hands
//! each version it publishes to the engine beside it in memory; the engine serves it
//! without reading the file — here it could not: its `--weights-dir` is not where the
//! trainer writes, so a version it loaded from a file would be refused. A second engine, in
//! its own process, loads the same version from the file, and both answer a greedy request
//! with the same tokens and log-probabilities. Build the binaries first (`make test` does).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use arl_model::config::ModelConfig;
use arl_model::load::LoadedModel;
use arl_model::model::Model;
use arl_model::weights::Weights;
use arl_runtime::bus::BusConfig;
use arl_runtime::{Bus, Metrics};
use arl_schemas::events::{
    CallSpan, Example, SampleStatus, Split, TaskBatchV1, TaskRef, TrajectoryBranch, TrajectoryV1,
};
use arl_schemas::spec::RunSpec;
use arl_schemas::state::TrialRecordV1;
use arl_schemas::{Bucket, Namespace, RunId, TaskId, TrialId};
use arl_testkit::{
    NatsServer, built_binary, free_port, http, running_run_state, smollm2, test_namespace, wait_for,
};

/// A tiny llama with SmolLM2's real tokenizer, in Hugging Face layout.
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

async fn put_run_state(bus: &Bus, run: &RunId, spec: &RunSpec, model: &Path) {
    let state = running_run_state(run, "colocated", spec, model);
    let kv = bus.bucket(Bucket::RunState).await.unwrap();
    kv.put(run.as_str(), state.encode().unwrap().into())
        .await
        .unwrap();
}

/// Step `step`'s batch (two tasks of two samples) and its four trajectories, one rewarded
/// per task, each trial claimed first as the rollout service does.
async fn publish_step(bus: &Bus, run: &RunId, step: u32) {
    let template = TaskBatchV1::example().tasks[0].clone();
    let batch = TaskBatchV1 {
        run_id: run.clone(),
        step,
        split: Split::Train,
        samples_per_task: 2,
        tasks: (0..2)
            .map(|task| TaskRef {
                task_id: TaskId::new(format!("task-{task}")).unwrap(),
                ..template.clone()
            })
            .collect(),
    };
    bus.publish(&batch).await.unwrap();
    for task in 0..2u32 {
        for sample in 0..2u32 {
            let t = trajectory(run, step, task, sample);
            bus.modify_record::<TrialRecordV1>(Bucket::Trials, t.trial_id.as_str(), |r| {
                *r = Some(TrialRecordV1 {
                    attempt: 0,
                    done: false,
                });
                true
            })
            .await
            .unwrap();
            bus.publish(&t).await.unwrap();
        }
    }
}

fn trajectory(run: &RunId, step: u32, task: u32, sample: u32) -> TrajectoryV1 {
    let prompt = [1u32, 100 + task, 200 + task, 300];
    let response = if sample == 1 {
        [42, 43, 44, 2]
    } else {
        [500, 600, 700, 2]
    };
    let mut mask = vec![0u8; prompt.len()];
    mask.extend([1u8; 4]);
    let mut t = TrajectoryV1::example();
    t.run_id = run.clone();
    t.trial_id = TrialId::new(format!("trial-{step}-{task}-{sample}")).unwrap();
    t.slot.task_id = TaskId::new(format!("task-{task}")).unwrap();
    t.slot.step = step;
    t.slot.split = Split::Train;
    t.slot.sample_index = sample;
    t.slot.attempt = 0;
    t.status = SampleStatus::Scored;
    t.reward = f64::from(sample);
    t.num_turns = 2;
    t.branches = vec![TrajectoryBranch {
        token_ids: prompt.iter().chain(&response).copied().collect(),
        logprobs: mask
            .iter()
            .map(|m| if *m == 1 { -10.8 } else { 0.0 })
            .collect(),
        loss_mask: mask,
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

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn command(program: &str, server: &NatsServer, ns: &Namespace) -> Command {
    let mut command = Command::new(built_binary(program));
    command
        .env("NATS_URL", server.url())
        .env("ARL_PREFIX", ns.prefix().unwrap())
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    command
}

/// (run, version) the engine at `port` serves.
async fn serving(port: u16) -> Option<(Option<String>, Option<u64>)> {
    let answer = http(
        &format!("http://127.0.0.1:{port}/v1/models"),
        "GET",
        &[],
        b"",
    )
    .await
    .ok()?;
    let models: serde_json::Value = answer.json();
    let model = &models["data"][0];
    Some((
        model["run_id"].as_str().map(str::to_owned),
        model["policy_version"].as_u64(),
    ))
}

/// A greedy completion's token ids and log-probabilities.
async fn greedy(port: u16) -> (serde_json::Value, serde_json::Value) {
    let body = serde_json::json!({
        "model": "policy", "prompt": "The answer is", "max_tokens": 12,
        "temperature": 0, "logprobs": 1, "return_token_ids": true
    });
    let answer = http(
        &format!("http://127.0.0.1:{port}/v1/completions"),
        "POST",
        &[("content-type", "application/json")],
        body.to_string().as_bytes(),
    )
    .await
    .unwrap();
    assert_eq!(answer.status, 200, "{}", answer.text());
    let answer: serde_json::Value = answer.json();
    let choice = &answer["choices"][0];
    (
        choice["token_ids"].clone(),
        choice["logprobs"]["token_logprobs"].clone(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_colocated_engine_serves_each_version_from_memory_as_its_file_holds_it() {
    let files = tempfile::tempdir().unwrap();
    let base = tiny_model(files.path());
    let (runs_dir, elsewhere) = (files.path().join("runs"), files.path().join("elsewhere"));
    std::fs::create_dir_all(&elsewhere).unwrap();
    let server = NatsServer::start().unwrap();
    let ns = test_namespace();
    let bus = Bus::connect(
        BusConfig::new(server.url(), ns.clone(), "test"),
        Metrics::new(),
    )
    .await
    .unwrap();
    bus.provision().await.unwrap();
    let run = RunId::new("run-colocated").unwrap();
    let mut spec = RunSpec::default();
    spec.data.train_batch_size = 2;
    spec.rollout.n = 2;
    spec.trainer.total_steps = 2;
    spec.trainer.save_every = 1;
    spec.optim.lr = 1e-3;
    put_run_state(&bus, &run, &spec, &base).await;

    let (colocated_port, file_port) = (free_port().unwrap(), free_port().unwrap());
    let base_arg = base.display().to_string();
    let _colocated = Killed(
        command("arl", &server, &ns)
            .args(["serve", "trainer", "--gpu", "none", "--runs-dir"])
            .arg(&runs_dir)
            .args(["+", "inference", "--model", &base_arg, "--weights-dir"])
            .arg(&elsewhere)
            .arg("--listen")
            .arg(format!("127.0.0.1:{colocated_port}"))
            .spawn()
            .unwrap(),
    );
    let _from_file = Killed(
        command("arl-inference", &server, &ns)
            .args([
                "--model",
                &base_arg,
                "--instance",
                "from-file",
                "--weights-dir",
            ])
            .arg(&runs_dir)
            .arg("--listen")
            .arg(format!("127.0.0.1:{file_port}"))
            .spawn()
            .unwrap(),
    );
    for port in [colocated_port, file_port] {
        wait_for("the engine", Duration::from_secs(60), || async move {
            serving(port).await.filter(|(_, v)| *v == Some(0))
        })
        .await;
    }
    for step in 1..=spec.trainer.total_steps {
        publish_step(&bus, &run, step).await;
        let wanted = (Some(run.to_string()), Some(u64::from(step)));
        for port in [colocated_port, file_port] {
            let wanted = wanted.clone();
            wait_for(
                &format!("version {step} served on port {port}"),
                Duration::from_secs(120),
                || {
                    let wanted = wanted.clone();
                    async move { serving(port).await.filter(|s| *s == wanted) }
                },
            )
            .await;
        }
        let (colocated, from_file) = (greedy(colocated_port).await, greedy(file_port).await);
        assert!(
            colocated.0.as_array().is_some_and(|t| !t.is_empty()),
            "{colocated:?}"
        );
        assert_eq!(
            colocated, from_file,
            "version {step}: the handed weights answer otherwise than the file's"
        );
    }
}
