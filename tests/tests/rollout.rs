//! Trials for real: the real engine (SmolLM2) behind the real proxy (both binaries), the
//! controller, dataset service, image builder, sandbox service and reward service
//! in-process, and `arl-rollout` replicas as processes. A run over the bundled Harbor
//! tasks: every trial leases a sandbox, talks to the model through the proxy, is graded,
//! and becomes a trajectory built from the proxy's records token for token. A replica
//! killed mid-trial: the trial is failed once as `infrastructure` and retried once by
//! another replica — never lost, never counted twice. Build the binaries first
//! (`cargo build --bins`; `make test` does).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use arl_controller::{Controller, ControllerConfig};
use arl_dataset::service::DatasetService;
use arl_imagebuilder::local::{LocalBuilder, LocalConfig};
use arl_imagebuilder::service::{ImageBuilder, Recipes};
use arl_reward::service::{RewardConfig, RewardService};
use arl_runtime::bus::BusConfig;
use arl_runtime::{Bus, Metrics, Shutdown};
use arl_sandbox::config::SandboxConfig;
use arl_sandbox::service::SandboxService;
use arl_schemas::events::{
    Example, FailureClass, LlmCallV2, RewardScoredV2, RunRequestedV1, SampleStatus, TrajectoryV1,
    TrialFailedV1, TrialFinishedV1, TrialStartedV1,
};
use arl_schemas::spec::RunSpec;
use arl_schemas::{Domain, Event, Namespace, RunId};
use arl_testkit::{
    Children, NatsServer, built_binary, free_port, http, model_dir, test_namespace, wait_for,
};

fn home() -> PathBuf {
    PathBuf::from(std::env::var_os("HOME").unwrap())
}

/// The rollout replicas' `--ack-wait-s`: how soon a held trial of a dead replica comes back.
const ACK_WAIT_S: u64 = 3;

struct Stack {
    server: NatsServer,
    ns: Namespace,
    bus: Bus,
    children: std::sync::Mutex<Children>,
    engine_port: u16,
    shutdown: Shutdown,
    files: tempfile::TempDir,
}

impl Stack {
    async fn start() -> Self {
        Self::start_with(false).await
    }

    async fn start_with(agents: bool) -> Self {
        let stack = Self::start_without_engine(agents).await;
        stack.start_engine().await;
        stack
    }

    /// Everything but the reward service: the test grades (publishes `reward.scored`)
    /// when its scenario says so.
    async fn start_graded_by_test() -> Self {
        let stack = Self::start_parts(false, false).await;
        stack.start_engine().await;
        stack
    }

    /// Starts the engine behind the proxy and waits until it serves.
    async fn start_engine(&self) {
        let port = self.engine_port;
        let engine = spawn(
            &self.server,
            &self.ns,
            "arl-inference",
            &[
                "--model",
                "smollm2-135m-instruct",
                "--listen",
                &format!("127.0.0.1:{port}"),
            ],
        );
        self.children.lock().unwrap().0.push(engine);
        wait_for("the engine", Duration::from_secs(60), || async {
            let url = format!("http://127.0.0.1:{port}/v1/models");
            let r = http(&url, "GET", &[], b"").await.ok()?;
            (r.status == 200).then_some(())
        })
        .await;
    }

    /// Everything but the engine. `agents`: the proxy also listens on a Unix socket that
    /// every sandbox relays to, and sandboxes get a copy of the agents venv
    /// (mini-swe-agent) at /opt/arl-agents.
    async fn start_without_engine(agents: bool) -> Self {
        Self::start_parts(agents, true).await
    }

    async fn start_parts(agents: bool, reward: bool) -> Self {
        let files = tempfile::Builder::new()
            .prefix("arl-rollout-")
            .tempdir()
            .unwrap();
        std::fs::set_permissions(files.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let root = files.path().join("environments");
        std::fs::create_dir_all(&root).unwrap();
        let server = NatsServer::start().unwrap();
        let ns = test_namespace();
        let (engine_port, proxy_port) = (free_port().unwrap(), free_port().unwrap());
        let socket = files.path().join("proxy.sock");
        let agents_dir = files.path().join("agents");
        if agents {
            copy_agents_venv(&agents_dir);
        }
        let unix = socket.display().to_string();
        let mut proxy_args = vec![
            "--backend".to_owned(),
            format!("arl=http://127.0.0.1:{engine_port}"),
            "--listen".to_owned(),
            format!("127.0.0.1:{proxy_port}"),
        ];
        if agents {
            proxy_args.extend(["--listen-unix".to_owned(), unix]);
        }
        let proxy_args: Vec<&str> = proxy_args.iter().map(String::as_str).collect();
        let children = Children(vec![spawn(&server, &ns, "arl-proxy", &proxy_args)]);
        let bus = Bus::connect(
            BusConfig::new(server.url(), ns.clone(), "test"),
            Metrics::new(),
        )
        .await
        .unwrap();
        bus.provision().await.unwrap();
        let shutdown = Shutdown::new();
        Controller::new(
            bus.clone(),
            ControllerConfig {
                model_dir: model_dir(),
                admission_concurrency: 2,
                tensorboard_dir: None,
                ..ControllerConfig::default()
            },
        )
        .await
        .unwrap()
        .start(&shutdown);
        DatasetService::new(bus.clone()).start(&shutdown);
        let builder = LocalBuilder::new(LocalConfig {
            root: root.clone(),
            pyenv_root: home().join(".pyenv"),
            pip_cache: home().join(".cache/arl/pip"),
            timeout: Duration::from_secs(300),
        });
        ImageBuilder::new(bus.clone(), Arc::new(builder), Recipes::default()).start(&shutdown);
        let mut config = SandboxConfig::local(
            files.path().join("state"),
            root,
            built_binary("arl-sandbox-init"),
        );
        config.pool_min_idle = 0;
        if agents {
            config.proxy_socket = Some(socket);
            config.agents_dir = Some(agents_dir);
        }
        SandboxService::start_local(
            bus.clone(),
            config,
            "127.0.0.1:0".parse().unwrap(),
            &shutdown,
        )
        .await
        .unwrap();
        if reward {
            RewardService::new(bus.clone(), RewardConfig::default()).start(&shutdown, 2);
        }
        Self {
            server,
            ns,
            bus,
            children: std::sync::Mutex::new(children),
            engine_port,
            shutdown,
            files,
        }
    }

    fn rollout(&self) -> Child {
        self.rollout_with_concurrency(2)
    }

    fn rollout_with_concurrency(&self, concurrency: usize) -> Child {
        spawn(
            &self.server,
            &self.ns,
            "arl-rollout",
            &[
                "--concurrency",
                &concurrency.to_string(),
                "--ack-wait-s",
                &ACK_WAIT_S.to_string(),
            ],
        )
    }

    /// A run of `n` samples per task over three one-step addition problems (math trials
    /// need no sandbox; one call each).
    async fn submit_math(&self, n: u32) -> RunId {
        let data = self.math_dataset(3);
        self.submit_with(n, |spec| {
            spec.data.dataset = data.display().to_string();
            spec.data.source = arl_schemas::spec::DataSource::Gsm8k;
            spec.rollout.max_response_tokens = 16;
        })
        .await
    }

    /// A file of `count` one-step addition problems (GSM8K form).
    fn math_dataset(&self, count: u32) -> PathBuf {
        let data = self.files.path().join("math.jsonl");
        std::fs::write(
            &data,
            (1..=count)
                .map(|i| {
                    format!(
                        "{{\"question\": \"What is {i} + {i}?\", \"answer\": \"#### {}\"}}\n",
                        2 * i
                    )
                })
                .collect::<String>(),
        )
        .unwrap();
        data
    }

    async fn submit(&self, n: u32) -> RunId {
        self.submit_with(n, |_| {}).await
    }

    async fn submit_with(&self, n: u32, change: impl FnOnce(&mut RunSpec)) -> RunId {
        let mut spec = RunSpec::default();
        spec.data.dataset = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../examples/tasks")
            .display()
            .to_string();
        spec.data.val_size = 1;
        spec.data.train_batch_size = 1;
        spec.rollout.n = n;
        spec.rollout.max_turns = 2;
        spec.rollout.max_response_tokens = 48;
        spec.rollout.timeout_s = 300;
        spec.trainer.total_steps = 1;
        change(&mut spec);
        let run = RunId::generate();
        self.bus
            .publish(&RunRequestedV1 {
                run_id: run.clone(),
                spec,
                ..RunRequestedV1::example()
            })
            .await
            .unwrap();
        run
    }

    /// Every `llm.call` of the run (`arl.llm.<run>.call`).
    async fn calls(&self, run: &RunId) -> Vec<LlmCallV2> {
        self.bus
            .replay::<LlmCallV2>(Domain::Llm, self.ns.event_subject(Domain::Llm, run, "call"))
            .await
            .unwrap()
    }

    /// One trace per trial, across processes: the rollout's request, start and finish and
    /// the proxy's records of the trial's LLM calls (reached over HTTP with the trial's
    /// `traceparent`, or — for an agent that sends none — parented on the trace the trial
    /// key was issued in) share the trial's trace id; two trials never share one.
    async fn assert_one_trace_per_trial(&self, run: &RunId, trials: usize) {
        let mut trial_traces = std::collections::HashMap::new();
        for domain in [Domain::Trial, Domain::Llm] {
            for (trial, trace) in self.traces(run, domain).await {
                assert_eq!(
                    trace.len(),
                    32,
                    "{domain:?} event of {trial} without a trace"
                );
                let first = trial_traces.entry(trial.clone()).or_insert(trace.clone());
                assert_eq!(
                    *first, trace,
                    "{trial}: its {domain:?} events leave its trace"
                );
            }
        }
        assert_eq!(trial_traces.len(), trials, "{trial_traces:?}");
        let distinct: std::collections::HashSet<&String> = trial_traces.values().collect();
        assert_eq!(
            distinct.len(),
            trials,
            "two trials share a trace: {trial_traces:?}"
        );
    }

    /// (trial id, trace id from `traceparent`) of every stored message of `domain`'s
    /// stream for `run` that names a trial.
    async fn traces(&self, run: &RunId, domain: Domain) -> Vec<(String, String)> {
        let mut stream = self
            .bus
            .jetstream()
            .get_stream(self.ns.stream(domain))
            .await
            .unwrap();
        let last = stream.info().await.unwrap().state.last_sequence;
        let mut found = Vec::new();
        for sequence in 1..=last {
            let Ok(message) = stream.get_raw_message(sequence).await else {
                continue;
            };
            let body: serde_json::Value = serde_json::from_slice(&message.payload).unwrap();
            if body["run_id"] != run.as_str() {
                continue;
            }
            let Some(trial) = body["trial_id"].as_str() else {
                continue;
            };
            let trace = message
                .headers
                .get("traceparent")
                .map(|v| v.as_str().split('-').nth(1).unwrap_or("").to_owned())
                .unwrap_or_default();
            found.push((trial.to_owned(), trace));
        }
        found
    }

    async fn events<E: Event>(&self, run: &RunId, domain: Domain, event: &str) -> Vec<E> {
        self.bus
            .replay::<E>(domain, self.ns.event_subject(domain, run, event))
            .await
            .unwrap()
    }
}

/// A copy of the agents venv (`make deps`, built on /usr/bin/python3) where the sandbox
/// user can read it: hard links, so it costs no space.
fn copy_agents_venv(to: &Path) {
    let python = std::env::var_os("ARL_AGENTS_PYTHON")
        .map(PathBuf::from)
        .unwrap_or(home().join(".cache/arl/agents/bin/python"));
    let venv = python.parent().and_then(Path::parent).unwrap();
    assert!(
        venv.is_dir(),
        "{} is missing: run `make deps`",
        venv.display()
    );
    let linked = Command::new("cp")
        .arg("-al")
        .arg(venv)
        .arg(to)
        .status()
        .unwrap();
    if !linked.success() {
        let _ = std::fs::remove_dir_all(to);
        assert!(
            Command::new("cp")
                .arg("-a")
                .arg(venv)
                .arg(to)
                .status()
                .unwrap()
                .success()
        );
    }
}

fn spawn(server: &NatsServer, ns: &Namespace, name: &str, args: &[&str]) -> Child {
    Command::new(built_binary(name))
        .args(args)
        .env("NATS_URL", server.url())
        .env("ARL_PREFIX", ns.prefix().unwrap())
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap()
}

/// Every branch token comes from a recorded call: completions where the mask is 1 are
/// exactly the engine's completion ids, with its logprobs.
fn check_token_truth(trajectory: &TrajectoryV1, calls: &[LlmCallV2]) {
    assert_eq!(trajectory.calls.len(), calls.len());
    for span in &trajectory.calls {
        let call = calls
            .iter()
            .find(|c| c.turn_index == span.turn_index)
            .unwrap();
        let branch = &trajectory.branches[span.branch as usize];
        let (start, len) = (span.completion_start as usize, span.completion_len as usize);
        assert_eq!(
            &branch.token_ids[start..start + len],
            call.completion_token_ids.as_slice()
        );
        assert!(branch.loss_mask[start..start + len].iter().all(|m| *m == 1));
        assert_eq!(
            &branch.logprobs[start..start + len],
            call.logprobs.as_slice()
        );
        assert!(branch.token_ids[..start].starts_with(&[]));
        assert!(
            call.prompt_token_ids
                .starts_with(&branch.token_ids[..call.prompt_token_ids.len().min(start)])
        );
    }
    for branch in &trajectory.branches {
        assert_eq!(branch.token_ids.len(), branch.loss_mask.len());
        assert_eq!(branch.token_ids.len(), branch.logprobs.len());
    }
    let trained: usize = trajectory
        .branches
        .iter()
        .map(|b| b.loss_mask.iter().filter(|m| **m == 1).count())
        .sum();
    let sampled: usize = calls.iter().map(|c| c.completion_token_ids.len()).sum();
    assert_eq!(
        trained, sampled,
        "every sampled token is trained on, nothing else"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trials_on_bundled_tasks_become_graded_token_true_trajectories() {
    let stack = Stack::start().await;
    let _rollout = Children(vec![stack.rollout()]);
    let run = stack.submit(2).await;
    let trajectories = wait_for("two trajectories", Duration::from_secs(240), || async {
        let t: Vec<TrajectoryV1> = stack.events(&run, Domain::Trajectory, "ready").await;
        (t.len() >= 2).then_some(t)
    })
    .await;
    assert_eq!(trajectories.len(), 2);
    let started: Vec<TrialStartedV1> = stack.events(&run, Domain::Trial, "started").await;
    let finished: Vec<TrialFinishedV1> = stack.events(&run, Domain::Trial, "finished").await;
    let scored: Vec<RewardScoredV2> = stack.events(&run, Domain::Reward, "scored").await;
    let calls: Vec<LlmCallV2> = stack.calls(&run).await;
    assert_eq!((started.len(), finished.len(), scored.len()), (2, 2, 2));
    let mut samples: Vec<u32> = trajectories.iter().map(|t| t.slot.sample_index).collect();
    samples.sort();
    assert_eq!(samples, [0, 1]);
    stack.assert_one_trace_per_trial(&run, 2).await;
    for trajectory in &trajectories {
        assert_eq!(trajectory.status, SampleStatus::Scored, "{trajectory:?}");
        assert!(trajectory.num_turns >= 1 && trajectory.num_turns <= 2);
        let grade = scored
            .iter()
            .find(|s| s.trial_id == trajectory.trial_id)
            .unwrap();
        assert_eq!(trajectory.reward, grade.reward);
        let mine: Vec<LlmCallV2> = calls
            .iter()
            .filter(|c| c.trial_id == trajectory.trial_id)
            .cloned()
            .collect();
        assert_eq!(mine.len() as u32, trajectory.num_turns);
        assert!(mine.iter().all(|c| c.policy_version == 0));
        check_token_truth(trajectory, &mine);
    }
    stack.shutdown.trigger();
    stack.shutdown.wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_killed_mid_trial_fails_it_once_and_another_retries_it() {
    let stack = Stack::start().await;
    let mut first = stack.rollout();
    let run = stack.submit(2).await;
    wait_for("a trial to start", Duration::from_secs(120), || async {
        let s: Vec<TrialStartedV1> = stack.events(&run, Domain::Trial, "started").await;
        (!s.is_empty()).then_some(())
    })
    .await;
    first.kill().unwrap();
    first.wait().unwrap();
    let _second = Children(vec![stack.rollout()]);
    wait_for("both trajectories", Duration::from_secs(300), || async {
        let t: Vec<TrajectoryV1> = stack.events(&run, Domain::Trajectory, "ready").await;
        (t.len() >= 2).then_some(())
    })
    .await;
    // Give a duplicate the chance to show up before counting.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let trajectories: Vec<TrajectoryV1> = stack.events(&run, Domain::Trajectory, "ready").await;
    let failed: Vec<TrialFailedV1> = stack.events(&run, Domain::Trial, "failed").await;
    let lost: Vec<&TrialFailedV1> = failed
        .iter()
        .filter(|f| f.message.contains("replica"))
        .collect();
    assert!(
        !lost.is_empty(),
        "the killed replica's trials are failed: {failed:?}"
    );
    for f in &lost {
        assert_eq!(
            (f.class, f.will_retry, f.slot.attempt),
            (FailureClass::Infrastructure, true, 0)
        );
    }
    // One failure per lost attempt, one trajectory per slot, from the retry.
    let mut lost_ids: Vec<_> = lost.iter().map(|f| f.trial_id.clone()).collect();
    lost_ids.dedup();
    assert_eq!(lost_ids.len(), lost.len(), "failed twice: {lost:?}");
    assert_eq!(trajectories.len(), 2, "{trajectories:?}");
    let mut samples: Vec<u32> = trajectories.iter().map(|t| t.slot.sample_index).collect();
    samples.sort();
    assert_eq!(samples, [0, 1]);
    for f in &lost {
        let retried = trajectories
            .iter()
            .find(|t| t.trial_id == f.trial_id)
            .unwrap();
        assert_eq!(retried.slot.attempt, 1);
        assert_eq!(retried.status, SampleStatus::Scored);
    }
    stack.shutdown.trigger();
    stack.shutdown.wait().await;
}

/// The command agent: mini-swe-agent, unchanged, runs inside the trial's sandbox and
/// reaches the model through the sandbox's relay to the proxy with the trial's key; its
/// calls are recorded and become the trajectory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mini_swe_agent_trial_runs_in_the_sandbox_through_the_proxy() {
    let stack = Stack::start_with(true).await;
    let _rollout = Children(vec![stack.rollout()]);
    let run = stack
        .submit_with(2, |spec| {
            spec.rollout.agent = arl_schemas::spec::AgentKind::MiniSweAgent;
            spec.rollout.max_turns = 2;
        })
        .await;
    let trajectories = wait_for("the trajectories", Duration::from_secs(300), || async {
        let t: Vec<TrajectoryV1> = stack.events(&run, Domain::Trajectory, "ready").await;
        (t.len() >= 2).then_some(t)
    })
    .await;
    let failed: Vec<TrialFailedV1> = stack.events(&run, Domain::Trial, "failed").await;
    assert!(failed.is_empty(), "{failed:?}");
    let calls: Vec<LlmCallV2> = stack.calls(&run).await;
    for trajectory in &trajectories {
        assert_eq!(trajectory.status, SampleStatus::Scored, "{trajectory:?}");
        let mine: Vec<LlmCallV2> = calls
            .iter()
            .filter(|c| c.trial_id == trajectory.trial_id)
            .cloned()
            .collect();
        assert!(
            !mine.is_empty(),
            "mini-swe-agent made no call through the proxy"
        );
        assert_eq!(trajectory.num_turns as usize, mine.len());
        check_token_truth(trajectory, &mine);
    }
    // mini-swe-agent sends no traceparent: its calls still land in their trial's trace.
    stack.assert_one_trace_per_trial(&run, 2).await;
    stack.shutdown.trigger();
    stack.shutdown.wait().await;
}

/// A command agent in sandboxes without a relay to the proxy is an `infrastructure`
/// failure; under `fail_group` every trial of the task's group is masked and the group is
/// marked failed for the trainer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_under_fail_group_masks_the_whole_group() {
    let stack = Stack::start().await;
    let _rollout = Children(vec![stack.rollout()]);
    let run = stack
        .submit_with(2, |spec| {
            spec.rollout.agent = arl_schemas::spec::AgentKind::MiniSweAgent;
            spec.rollout.on_failure.infrastructure = arl_schemas::spec::FailureAction::FailGroup;
        })
        .await;
    let trajectories = wait_for("the trajectories", Duration::from_secs(120), || async {
        let t: Vec<TrajectoryV1> = stack.events(&run, Domain::Trajectory, "ready").await;
        (t.len() >= 2).then_some(t)
    })
    .await;
    assert!(
        trajectories
            .iter()
            .all(|t| t.status == SampleStatus::Masked),
        "{trajectories:?}"
    );
    let failed: Vec<TrialFailedV1> = stack.events(&run, Domain::Trial, "failed").await;
    assert_eq!(failed.len(), 2);
    assert!(
        failed
            .iter()
            .all(|f| f.class == FailureClass::Infrastructure && !f.will_retry)
    );
    let slot = &trajectories[0].slot;
    let key = arl_schemas::state::failed_group_key(&run, slot.split, slot.step, &slot.task_id);
    let flag = stack
        .bus
        .modify_record::<bool>(arl_schemas::Bucket::Trials, &key, |_| false)
        .await
        .unwrap();
    assert_eq!(
        flag,
        Some(true),
        "the trainer is told to leave the group out"
    );
    stack.shutdown.trigger();
    stack.shutdown.wait().await;
}

/// A VeRL-format run (issue 28): GSM8K rows as VeRL's preprocessing writes them (nested
/// Parquet) are math trials whose one LLM call is the row's prompt exactly as written — no
/// prompt of ours — graded against the row's ground truth into token-true trajectories.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verl_rows_are_prompted_as_written_and_graded() {
    use arl_testkit::verl::{GSM8K_TRAIN, VerlRow, write_verl_parquet};
    let stack = Stack::start().await;
    let _rollout = Children(vec![stack.rollout()]);
    let rows = VerlRow::gsm8k_split("train", &GSM8K_TRAIN[..2]);
    let data = stack.files.path().join("train.parquet");
    write_verl_parquet(&data, &rows).unwrap();
    let run = stack
        .submit_with(2, |spec| {
            spec.data.dataset = data.display().to_string();
            spec.data.source = arl_schemas::spec::DataSource::Verl;
            spec.rollout.max_response_tokens = 16;
        })
        .await;
    // One task trains (n = 2), the other validates (before and after the step).
    let trajectories = wait_for("two trajectories", Duration::from_secs(180), || async {
        let t: Vec<TrajectoryV1> = stack.events(&run, Domain::Trajectory, "ready").await;
        (t.len() >= 2).then_some(t)
    })
    .await;
    let prompts: Vec<serde_json::Value> = rows
        .iter()
        .map(|row| {
            let (role, content) = &row.prompt[0];
            serde_json::json!([{"role": role, "content": content}])
        })
        .collect();
    let calls = stack.calls(&run).await;
    let scored: Vec<RewardScoredV2> = stack.events(&run, Domain::Reward, "scored").await;
    for trajectory in &trajectories {
        assert_eq!(trajectory.status, SampleStatus::Scored, "{trajectory:?}");
        let mine: Vec<LlmCallV2> = calls
            .iter()
            .filter(|c| c.trial_id == trajectory.trial_id)
            .cloned()
            .collect();
        assert_eq!(mine.len(), 1, "a math trial is one call");
        assert!(
            prompts.contains(&mine[0].request_messages),
            "sent as written: {}",
            mine[0].request_messages
        );
        let grade = scored
            .iter()
            .find(|s| s.trial_id == trajectory.trial_id)
            .unwrap();
        assert_eq!(trajectory.reward, grade.reward);
        check_token_truth(trajectory, &mine);
    }
    stack.shutdown.trigger();
    stack.shutdown.wait().await;
}

/// The engine comes up 30 s after everything else (as when it loads a large model): the
/// trials that started meanwhile wait for it — none fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trials_wait_for_an_engine_that_starts_late_and_none_fails() {
    let stack = Stack::start_without_engine(false).await;
    let _rollout = Children(vec![stack.rollout()]);
    let run = stack.submit_math(2).await;
    wait_for("the trials to start", Duration::from_secs(60), || async {
        let s: Vec<TrialStartedV1> = stack.events(&run, Domain::Trial, "started").await;
        (s.len() >= 2).then_some(())
    })
    .await;
    // The scenario itself is the delay: the engine is not there for 30 s.
    tokio::time::sleep(Duration::from_secs(30)).await;
    stack.start_engine().await;
    let trajectories = wait_for("two trajectories", Duration::from_secs(180), || async {
        let t: Vec<TrajectoryV1> = stack.events(&run, Domain::Trajectory, "ready").await;
        (t.len() >= 2).then_some(t)
    })
    .await;
    let failed: Vec<TrialFailedV1> = stack.events(&run, Domain::Trial, "failed").await;
    assert!(failed.is_empty(), "{failed:?}");
    assert!(
        trajectories
            .iter()
            .all(|t| t.status == SampleStatus::Scored),
        "{trajectories:?}"
    );
    stack.shutdown.trigger();
    stack.shutdown.wait().await;
}

/// The trial saga: a replica that runs one trial at a time finishes both trials of a group
/// while neither is graded (the hand-off to grading holds no slot), the grades come after
/// twice the ack wait and while no replica runs at all (a live subscription would have
/// missed them), and a replica started afterwards joins each grade with its recorded calls
/// into a token-true trajectory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grades_slower_than_the_ack_wait_hold_no_slot_and_any_replica_joins_them() {
    let stack = Stack::start_graded_by_test().await;
    let mut first = stack.rollout_with_concurrency(1);
    let run = stack.submit_math(2).await;
    let finished = wait_for(
        "both trials handed to grading",
        Duration::from_secs(180),
        || async {
            let f: Vec<TrialFinishedV1> = stack.events(&run, Domain::Trial, "finished").await;
            (f.len() >= 2).then_some(f)
        },
    )
    .await;
    // The scenario itself is the delay: grading takes longer than the ack wait, twice.
    tokio::time::sleep(Duration::from_secs(2 * ACK_WAIT_S)).await;
    first.kill().unwrap();
    first.wait().unwrap();
    let trajectories: Vec<TrajectoryV1> = stack.events(&run, Domain::Trajectory, "ready").await;
    assert!(trajectories.is_empty(), "no grade yet: {trajectories:?}");
    // Graded while no replica runs: sample 0 solved, sample 1 not.
    for trial in &finished {
        let reward = if trial.slot.sample_index == 0 {
            1.0
        } else {
            0.0
        };
        stack
            .bus
            .publish(&RewardScoredV2 {
                run_id: run.clone(),
                trial_id: trial.trial_id.clone(),
                slot: trial.slot.clone(),
                reward,
                resolved: reward > 0.0,
                tests: None,
                ..RewardScoredV2::example()
            })
            .await
            .unwrap();
    }
    let _second = Children(vec![stack.rollout_with_concurrency(1)]);
    let trajectories = wait_for("both trajectories", Duration::from_secs(60), || async {
        let t: Vec<TrajectoryV1> = stack.events(&run, Domain::Trajectory, "ready").await;
        (t.len() >= 2).then_some(t)
    })
    .await;
    let failed: Vec<TrialFailedV1> = stack.events(&run, Domain::Trial, "failed").await;
    assert!(failed.is_empty(), "{failed:?}");
    let calls = stack.calls(&run).await;
    for trajectory in &trajectories {
        assert_eq!(trajectory.status, SampleStatus::Scored, "{trajectory:?}");
        let want = if trajectory.slot.sample_index == 0 {
            1.0
        } else {
            0.0
        };
        assert_eq!(trajectory.reward, want);
        let mine: Vec<LlmCallV2> = calls
            .iter()
            .filter(|c| c.trial_id == trajectory.trial_id)
            .cloned()
            .collect();
        assert_eq!(mine.len(), 1, "a math trial is one call");
        assert_eq!(trajectory.num_turns, 1);
        check_token_truth(trajectory, &mine);
    }
    // Each trial ran once: the killed replica had handed both off.
    let started: Vec<TrialStartedV1> = stack.events(&run, Domain::Trial, "started").await;
    assert_eq!(started.len(), 2, "{started:?}");
    stack.shutdown.trigger();
    stack.shutdown.wait().await;
}

/// A scripted engine for the swe-text agent (a test double for the model): the first turn
/// writes a file of `bytes` random bytes (base64) into the work tree, the next submits.
async fn scripted_engine(port: u16, bytes: usize, shutdown: &Shutdown) {
    use serde_json::json;
    let answer = move |text: String| {
        json!({"id": "chatcmpl-1", "object": "chat.completion", "model": "policy",
               "prompt_token_ids": [1, 2, 3], "policy_version": 0,
               "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                            "token_ids": [7, 8], "finish_reason": "stop",
                            "logprobs": {"content": [{"token": "a", "logprob": -0.1},
                                                     {"token": "b", "logprob": -0.2}]}}],
               "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})
    };
    let router = axum::Router::new()
        .route(
            "/v1/chat/completions",
            axum::routing::post(
                move |axum::Json(body): axum::Json<serde_json::Value>| async move {
                    let first_turn = body["messages"].as_array().map_or(0, Vec::len) <= 2;
                    let command = if first_turn {
                        format!("head -c {bytes} /dev/urandom | base64 > big.txt")
                    } else {
                        "submit".to_owned()
                    };
                    axum::Json(answer(format!("```bash\n{command}\n```")))
                },
            ),
        )
        .route(
            "/v1/models",
            axum::routing::get(|| async {
                axum::Json(
                    json!({"object": "list", "data": [{"id": "policy", "object": "model",
                    "policy_version": 0, "run_id": null, "ready": true}]}),
                )
            }),
        );
    arl_runtime::http::serve(
        format!("127.0.0.1:{port}").parse().unwrap(),
        router,
        shutdown,
    )
    .await
    .unwrap();
}

/// An agent whose diff is too large to be an event (over the bus's 1 MiB) fails its trial
/// as `agent_error`, saying so, at once — not a message retried until it dies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_diff_too_large_for_an_event_fails_the_trial_as_the_agents_doing() {
    let stack = Stack::start_without_engine(false).await;
    scripted_engine(stack.engine_port, 2 << 20, &stack.shutdown).await;
    let _rollout = Children(vec![stack.rollout()]);
    let run = stack
        .submit_with(2, |spec| {
            spec.rollout.agent = arl_schemas::spec::AgentKind::SweText;
            spec.trainer.val_before_train = false;
        })
        .await;
    let failed = wait_for("the trials' failures", Duration::from_secs(180), || async {
        let failed: Vec<TrialFailedV1> = stack.events(&run, Domain::Trial, "failed").await;
        (failed.len() >= 2).then_some(failed)
    })
    .await;
    for failure in &failed {
        assert_eq!(failure.class, FailureClass::AgentError, "{failure:?}");
        assert!(
            failure.message.contains("trial.finished is")
                && failure.message.contains("-byte limit of one event"),
            "{failure:?}"
        );
    }
    let finished: Vec<TrialFinishedV1> = stack.events(&run, Domain::Trial, "finished").await;
    assert!(finished.is_empty(), "{finished:?}");
    stack.shutdown.trigger();
    stack.shutdown.wait().await;
}
