//! Agents through the real `arl-proxy` to the real `arl-inference` (SmolLM2): the official
//! `openai` SDK holds a two-turn conversation; every call is recorded with ids that decode
//! to the text the agent got, and the second call's prompt extends the first call's
//! prompt plus completion (what trajectory assembly relies on). Build the binaries first
//! (`cargo build --bins`; `make test` does).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use arl_model::load::LoadedModel;
use arl_runtime::bus::BusConfig;
use arl_runtime::{Bus, Metrics};
use arl_schemas::events::LlmCallV1;
use arl_schemas::rpc::{ProxyOp, TrialKeyGrantV1, TrialKeyRequestV1};
use arl_schemas::{Domain, Event, Namespace, RunId, TrialId};
use arl_testkit::{Children, NatsServer, built_binary, free_port, http, test_namespace, wait_for};

fn home_cache(rel: &str) -> PathBuf {
    PathBuf::from(std::env::var_os("HOME").unwrap())
        .join(".cache/arl")
        .join(rel)
}

/// A private nats-server with the real engine (SmolLM2) and the real proxy in front of it.
struct Stack {
    _children: Children,
    ns: Namespace,
    bus: Bus,
    _server: NatsServer,
}

impl Stack {
    async fn start() -> Self {
        let server = NatsServer::start().unwrap();
        let ns = test_namespace();
        let (engine_port, proxy_port) = (free_port().unwrap(), free_port().unwrap());
        let spawn = |name: &str, args: &[String]| {
            Command::new(built_binary(name))
                .args(args)
                .env("NATS_URL", server.url())
                .env("ARL_PREFIX", ns.prefix().unwrap())
                .env("RUST_LOG", "warn")
                .stdout(Stdio::null())
                .stderr(Stdio::inherit())
                .spawn()
                .unwrap()
        };
        let children = Children(vec![
            spawn(
                "arl-inference",
                &[
                    "--model".into(),
                    "smollm2-135m-instruct".into(),
                    "--listen".into(),
                    format!("127.0.0.1:{engine_port}"),
                ],
            ),
            spawn(
                "arl-proxy",
                &[
                    "--backend".into(),
                    format!("arl=http://127.0.0.1:{engine_port}"),
                    "--listen".into(),
                    format!("127.0.0.1:{proxy_port}"),
                ],
            ),
        ]);
        wait_for("the engine", Duration::from_secs(60), || async {
            let url = format!("http://127.0.0.1:{engine_port}/v1/models");
            let r = http(&url, "GET", &[], b"").await.ok()?;
            (r.status == 200).then_some(())
        })
        .await;
        let bus = Bus::connect(
            BusConfig::new(server.url(), ns.clone(), "test"),
            Metrics::new(),
        )
        .await
        .unwrap();
        Self {
            _children: children,
            ns,
            bus,
            _server: server,
        }
    }

    /// A trial key from the proxy (waiting for it to answer).
    async fn key(&self, run: &str, trial: &str) -> TrialKeyGrantV1 {
        let request = TrialKeyRequestV1 {
            run_id: RunId::new(run).unwrap(),
            trial_id: TrialId::new(trial).unwrap(),
            policy_version: 0,
            max_staleness: None,
        };
        wait_for("the proxy", Duration::from_secs(30), || async {
            self.bus
                .request(
                    self.ns.proxy_rpc("any", ProxyOp::Issue),
                    &request,
                    Duration::from_secs(2),
                )
                .await
                .ok()
        })
        .await
    }

    /// The `llm.call` events, once there are `count` of them.
    async fn recorded_calls(&self, count: usize) -> Vec<LlmCallV1> {
        let stream = self
            .bus
            .jetstream()
            .get_stream(self.ns.stream(Domain::Llm))
            .await
            .unwrap();
        wait_for("the recorded calls", Duration::from_secs(10), || async {
            let info = stream.clone().get_info().await.ok()?;
            let mut calls = Vec::new();
            for seq in info.state.first_sequence..=info.state.last_sequence {
                if let Ok(m) = stream.get_raw_message(seq).await {
                    calls.push(LlmCallV1::decode(&m.payload).ok()?);
                }
            }
            (calls.len() == count).then_some(calls)
        })
        .await
    }
}

fn smollm2_tokenizer() -> arl_model::tokenizer::Tokenizer {
    let model_dir = std::env::var_os("ARL_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or(home_cache("models"));
    LoadedModel::open(&model_dir.join("SmolLM2-135M-Instruct.Q4_1.gguf"))
        .unwrap()
        .tokenizer
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_sdk_through_the_proxy_is_recorded_token_for_token() {
    let stack = Stack::start().await;
    let grant = stack.key("run-sdk", "trial-sdk").await;

    let python = std::env::var_os("ARL_TOOLS_PYTHON")
        .map(PathBuf::from)
        .unwrap_or(home_cache("tools/bin/python"));
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/proxy_sdk.py");
    let output = tokio::process::Command::new(python)
        .arg(script)
        .arg(&grant.base_url)
        .output()
        .await
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let seen: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();

    let calls = stack.recorded_calls(2).await;
    let tokenizer = smollm2_tokenizer();
    for (turn, call) in calls.iter().enumerate() {
        assert_eq!(call.turn_index as usize, turn);
        assert_eq!(call.logprobs.len(), call.completion_token_ids.len());
        let text = tokenizer.decode(&call.completion_token_ids, true).unwrap();
        assert_eq!(text, seen["answers"][turn].as_str().unwrap(), "turn {turn}");
    }
    let mut extended = calls[0].prompt_token_ids.clone();
    extended.extend(&calls[0].completion_token_ids);
    assert!(
        calls[1].prompt_token_ids.starts_with(&extended),
        "turn 1's prompt {:?} does not extend turn 0's prompt + completion {:?}",
        calls[1].prompt_token_ids,
        extended
    );
}

/// mini-swe-agent, unchanged (its text-based config; PyPI `mini-swe-agent` in the agents
/// venv), pointed at the proxy through its `api_base`, runs three steps against SmolLM2.
/// It runs inside bubblewrap with a read-only host and a scratch work dir, since whatever
/// commands the model writes are executed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mini_swe_agent_runs_through_the_proxy_and_every_step_is_recorded() {
    let stack = Stack::start().await;
    let grant = stack.key("run-msa", "trial-msa").await;

    let python = std::env::var_os("ARL_AGENTS_PYTHON")
        .map(PathBuf::from)
        .unwrap_or(home_cache("agents/bin/python"));
    assert!(
        python.exists(),
        "{} is missing: run `make deps`",
        python.display()
    );
    let venv = python
        .parent()
        .and_then(Path::parent)
        .unwrap()
        .to_path_buf();
    let work = tempfile::tempdir().unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/mini_swe_agent.py");
    let work_dir = work.path().to_str().unwrap();
    let output = tokio::process::Command::new("bwrap")
        .args([
            "--ro-bind",
            "/",
            "/",
            "--dev",
            "/dev",
            "--proc",
            "/proc",
            "--tmpfs",
            "/tmp",
        ])
        // The agents venv may itself live under /tmp (a CI cache there).
        .arg("--ro-bind")
        .arg(&venv)
        .arg(&venv)
        .args([
            "--bind",
            work_dir,
            work_dir,
            "--unshare-pid",
            "--die-with-parent",
            "--chdir",
            work_dir,
        ])
        .arg("--setenv")
        .args(["HOME", work_dir])
        .arg(&python)
        // The program comes on stdin: the checkout may be under /tmp, hidden in the jail.
        .arg("-")
        .arg(&grant.base_url)
        .arg(work_dir)
        .arg(work.path().join("messages.json"))
        .stdin(std::fs::File::open(&script).unwrap())
        .output()
        .await
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let seen: serde_json::Value =
        serde_json::from_slice(&std::fs::read(work.path().join("messages.json")).unwrap()).unwrap();
    // The text of each LLM call, in order: an accepted step is an assistant message; a
    // rejected one (format error) is kept in the feedback message's `extra`.
    let assistant: Vec<&str> = seen["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| match m["role"].as_str() {
            Some("assistant") => m["content"].as_str(),
            _ => m["extra"]["model_response"].as_str(),
        })
        .collect();
    assert!(!assistant.is_empty(), "the agent made no LLM call");

    let calls = stack.recorded_calls(assistant.len()).await;
    let tokenizer = smollm2_tokenizer();
    for (call, text) in calls.iter().zip(&assistant) {
        assert_eq!(call.trial_id.as_str(), "trial-msa");
        assert_eq!(
            &tokenizer.decode(&call.completion_token_ids, true).unwrap(),
            text
        );
    }
    // Every step resends the agent's history: each prompt extends the first (system +
    // task). Rejected responses are not kept in mini-swe-agent's history, so only accepted
    // steps extend the previous prompt + completion (the SDK test checks that case).
    // (The first prompt ends with the template's generation prompt, which the later ones
    // have after their own last message instead.)
    let generation_prompt = tokenizer.encode("<|im_start|>assistant\n").unwrap();
    let first = &calls[0].prompt_token_ids;
    let history = first
        .strip_suffix(generation_prompt.as_slice())
        .unwrap_or(first);
    for call in &calls[1..] {
        assert!(
            call.prompt_token_ids.starts_with(history),
            "turn {}",
            call.turn_index
        );
        assert!(call.prompt_token_ids.len() > first.len());
    }
}
