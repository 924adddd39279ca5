//! Tool-use RL over MCP, end to end: `arl up` serving Qwen2.5-Coder-0.5B-Instruct, and a
//! reduced `examples/gsm-tools.toml` (two problems, two trials each, one GRPO step) with
//! the `mcp-tools` agent. Trials call `run_code` through the proxy's MCP server (counted in
//! each trajectory and in the step's metrics); trajectories are token-true — the tokens
//! trained on (mask 1) are exactly the engine's completions as the proxy recorded them, so
//! the tool outputs in later prompts are masked; the trainer trains a step. Needs `make
//! models` (the Qwen GGUF) and the binaries built (`cargo build --bins`; `make test` does).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use arl_runtime::bus::BusConfig;
use arl_runtime::{Bus, Metrics};
use arl_schemas::events::{LlmCallV2, TrainStepV2, TrajectoryV1};
use arl_schemas::{Domain, Namespace, RunId};
use arl_testkit::{Children, built_binary};

const MODEL: &str = "qwen2.5-coder-0.5b-instruct";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_using_agent_trains_through_mcp() {
    let models = arl_testkit::model_dir();
    if !models.join(format!("{MODEL}.gguf")).exists() {
        eprintln!("skipped: {MODEL}.gguf is not installed (make models)");
        return;
    }
    let state = tempfile::Builder::new()
        .prefix("arl-gsm-tools-")
        .tempdir()
        .unwrap();
    let arl = built_binary("arl");
    let mut up = Children(vec![
        Command::new(&arl)
            .args(["up", "--model", MODEL, "--state-dir"])
            .arg(state.path())
            .env_remove("NATS_URL")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap(),
    ]);
    let url =
        arl_testkit::wait_for_arl_up(&mut up.0[0], state.path(), Duration::from_secs(300)).await;
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/gsm-tools.toml");
    let submitted = Command::new(&arl)
        .args(["run", "submit"])
        .arg(&example)
        .args([
            "--set",
            "data.train_batch_size=2",
            "--set",
            "data.val_size=1",
            "--set",
            "rollout.n=2",
            "--set",
            "rollout.max_turns=3",
            // Greedy: the same two problems get the same replies every time, so whether
            // the model calls a tool does not depend on sampling luck (at 0.7 it once
            // named only tools that do not exist).
            "--set",
            "rollout.temperature=0",
            "--set",
            "rollout.max_response_tokens=96",
            "--set",
            "trainer.total_steps=1",
            "--set",
            "trainer.save_every=1",
        ])
        .env("NATS_URL", &url)
        .env_remove("ARL_PREFIX")
        .output()
        .unwrap();
    assert!(
        submitted.status.success(),
        "{}",
        String::from_utf8_lossy(&submitted.stderr)
    );
    let run = String::from_utf8(submitted.stdout)
        .unwrap()
        .trim()
        .to_owned();
    let watched = Command::new(&arl)
        .args(["run", "watch", &run, "--timeout-s", "1200"])
        .env("NATS_URL", &url)
        .env_remove("ARL_PREFIX")
        .output()
        .unwrap();
    assert!(
        up.0[0].try_wait().unwrap().is_none(),
        "arl up stopped during the run"
    );
    let bus = Bus::connect(
        BusConfig::new(url.clone(), Namespace::default(), "test"),
        Metrics::new(),
    )
    .await
    .unwrap();
    let run_id = RunId::new(run.as_str()).unwrap();
    let record = bus.run_state(&run_id).await.unwrap().unwrap();
    assert_eq!(
        record.failures.infrastructure,
        0,
        "{:?}\n{}",
        record.failures,
        String::from_utf8_lossy(&watched.stderr)
    );
    assert_eq!(record.steps.len(), 1, "the step trained");

    let trajectories: Vec<TrajectoryV1> = bus
        .replay(
            Domain::Trajectory,
            Namespace::default().event_subject(Domain::Trajectory, &run_id, "ready"),
        )
        .await
        .unwrap();
    assert_eq!(trajectories.len(), 4);
    let tool_calls: u32 = trajectories.iter().map(|t| t.tool_calls).sum();
    let turns: Vec<u32> = trajectories.iter().map(|t| t.num_turns).collect();
    assert!(tool_calls > 0, "no trial called a tool (turns: {turns:?})");
    let steps: Vec<TrainStepV2> = bus
        .replay(
            Domain::Train,
            Namespace::default().event_subject(Domain::Train, &run_id, "step"),
        )
        .await
        .unwrap();
    assert_eq!(steps.len(), 1);
    let rewards: Vec<f64> = trajectories.iter().map(|t| t.reward).collect();
    eprintln!(
        "turns {turns:?}, tool calls {tool_calls}, rewards {rewards:?}, samples trained {}",
        steps[0].batch.samples_trained
    );
    let mean = steps[0].metrics.tool_calls_mean;
    assert!(
        (mean - f64::from(tool_calls) / 4.0).abs() < 1e-9,
        "{mean} vs {tool_calls} calls in 4 trajectories"
    );
    // The run's state (what `arl run status` shows) keeps the same figure.
    assert_eq!(record.steps[0].tool_calls_mean, Some(mean));

    // Token truth: trained tokens are exactly the completions the proxy recorded; the
    // prompts that carry tool outputs are masked.
    let calls: Vec<LlmCallV2> = bus
        .replay(
            Domain::Llm,
            Namespace::default().event_subject(Domain::Llm, &run_id, "call"),
        )
        .await
        .unwrap();
    let mut tool_outputs_masked = 0;
    for trajectory in trajectories.iter().filter(|t| t.tool_calls > 0) {
        let mine: Vec<&LlmCallV2> = calls
            .iter()
            .filter(|c| c.trial_id == trajectory.trial_id)
            .collect();
        assert_eq!(mine.len(), trajectory.calls.len());
        // A prompt that does not extend the previous one token for token (the template
        // re-tokenizes what the model wrote) starts a new branch: count over all of them.
        let trained: usize = trajectory
            .branches
            .iter()
            .map(|b| b.loss_mask.iter().filter(|&&m| m == 1).count())
            .sum();
        let completions: usize = trajectory
            .calls
            .iter()
            .map(|c| c.completion_len as usize)
            .sum();
        assert_eq!(
            trained, completions,
            "only completion tokens are trained on"
        );
        for span in &trajectory.calls {
            let call = mine
                .iter()
                .find(|c| c.turn_index == span.turn_index)
                .unwrap();
            let (start, len) = (span.completion_start as usize, span.completion_len as usize);
            let branch = &trajectory.branches[span.branch as usize];
            assert_eq!(
                &branch.token_ids[start..start + len],
                call.completion_token_ids.as_slice()
            );
            // Every call after the first follows a tool's output (a `tool` message, or a
            // `user` one answering a call the model wrote as text).
            let after_a_tool = call.request_messages.as_array().is_some_and(|m| {
                m.last().is_some_and(|last| {
                    last["role"] == "tool"
                        || last["content"]
                            .as_str()
                            .is_some_and(|c| c.contains(" returned:\n"))
                })
            });
            if after_a_tool {
                // The call's prompt ends with the tool's output: all of it masked.
                assert!(
                    branch.loss_mask[..start]
                        .iter()
                        .rev()
                        .take(8)
                        .all(|&m| m == 0),
                    "the tokens before a completion that follows a tool output are masked"
                );
                tool_outputs_masked += 1;
            }
        }
    }
    assert!(tool_outputs_masked > 0, "no call followed a tool's output");
    drop(up);
}
