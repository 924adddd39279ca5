//! The sandboxed scenario's fixtures and baseline: Harbor tasks whose environment is a
//! tiny work tree (written straight into the environments folder, as the image builder
//! would leave it — building environments is not what is under test here), and the
//! sandbox service's own rate for the same sandbox work, measured against the same service
//! process in the same run.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use arl_runtime::Bus;
use arl_sandbox_client::SandboxClient;
use arl_schemas::RunId;
use arl_schemas::events::EnvironmentRef;
use arl_schemas::rpc::{ExecRequest, LeaseRequestV1, SandboxLimits};
use futures::StreamExt;

/// The verifier: reward 1 when the agent left `done` in the work tree.
const TEST_SH: &str = "#!/bin/bash\nmkdir -p \"$LOGS_DIR/verifier\"\n\
if [ -f \"$APP_DIR/done\" ]; then echo 1; else echo 0; fi > \"$LOGS_DIR/verifier/reward.txt\"\n";

/// `count` Harbor task folders under `<dir>/harbor-tasks` and their environments
/// (`harbor/<task>/tree`, 10 small files) under `environments`; returns the tasks folder.
pub fn write_tasks(dir: &Path, environments: &Path, count: u32) -> anyhow::Result<PathBuf> {
    let tasks = dir.join("harbor-tasks");
    for i in 0..count {
        let task = tasks.join(format!("touch-{i}"));
        std::fs::create_dir_all(task.join("environment"))?;
        std::fs::create_dir_all(task.join("tests"))?;
        std::fs::write(
            task.join("task.toml"),
            "version = \"1.0\"\n\n[verifier]\ntimeout_sec = 60.0\n\n[agent]\ntimeout_sec = 300.0\n",
        )?;
        std::fs::write(
            task.join("instruction.md"),
            "Create an empty file named `done` in the work tree.\n",
        )?;
        std::fs::write(
            task.join("environment/Dockerfile"),
            "FROM debian:stable-slim\nWORKDIR /app\n",
        )?;
        std::fs::write(task.join("tests/test.sh"), TEST_SH)?;
        let tree = environments.join(format!("harbor/touch-{i}/tree"));
        std::fs::create_dir_all(&tree)?;
        for f in 0..10 {
            std::fs::write(tree.join(format!("f{f}.txt")), vec![b'#'; 1024])?;
        }
    }
    Ok(tasks)
}

/// What the sandbox service alone does per second of one sandboxed trial's sandbox work,
/// straight over its API with no other service in the way — the calls a trial makes: a
/// lease for the agent, its command (`touch done`, as the stand-in's agent runs it), the
/// diff, a release; then a lease for the grader, the tests and the patch uploaded, the
/// verifier's script run, a release. `total` such trials, `concurrency` at a time.
/// Returns (trials per second, every lease's latency in ms, failures); a lease not
/// granted within 30 s counts as failed (said), not as a rate.
pub async fn sandbox_work_rate(
    bus: &Bus,
    environments: u32,
    total: usize,
    concurrency: usize,
) -> anyhow::Result<(f64, Vec<f64>, usize)> {
    let run = RunId::new("run-loadtest-sandbox-baseline")?;
    let client = SandboxClient::new(bus.clone());
    let started = Instant::now();
    let results: Vec<anyhow::Result<[f64; 2]>> = futures::stream::iter(0..total)
        .map(|i| {
            let request = LeaseRequestV1 {
                run_id: run.clone(),
                trial_id: None,
                environment: EnvironmentRef {
                    name: format!("harbor/touch-{}", i as u32 % environments.max(1)),
                    digest: None,
                },
                ttl_s: 600,
                limits: SandboxLimits::default(),
            };
            let client = client.clone();
            async move {
                let (agent, patch) = leased(&client, &request, &[], "touch done").await?;
                let staged = [
                    (STAGED_TEST.to_owned(), TEST_SH.to_owned()),
                    ("candidate.diff".to_owned(), patch),
                ];
                let (grader, _) = leased(&client, &request, &staged, VERIFY).await?;
                Ok([agent, grader])
            }
        })
        .buffer_unordered(concurrency)
        .collect()
        .await;
    let elapsed = started.elapsed().as_secs_f64();
    let mut latencies = Vec::new();
    let mut failed = Vec::new();
    for result in results {
        match result {
            Ok(ms) => latencies.extend(ms),
            Err(err) => failed.push(err.to_string()),
        }
    }
    if let Some(first) = failed.first() {
        println!(
            "sandbox baseline: {} of {total} trials' sandbox work failed (e.g. {first})",
            failed.len()
        );
    }
    let done = total - failed.len();
    Ok((done as f64 / elapsed, latencies, failed.len()))
}

/// The verifier as the grader runs it: the task's `tests/test.sh`, uploaded beside the
/// tree with the candidate patch, applied first.
const STAGED_TEST: &str = ".arl-eval/tests/test.sh";
const VERIFY: &str = "v=$(mktemp -d) && mv .arl-eval/tests $v/tests && \
git apply candidate.diff && rm candidate.diff && \
APP_DIR=$PWD LOGS_DIR=$v/logs bash $v/tests/test.sh && cat $v/logs/verifier/reward.txt";

/// One lease: granted, `files` uploaded (when there are any), `command` run in it, its
/// diff taken (an agent's lease) and released. Returns the grant's latency (ms) and the
/// diff (empty for a grader's lease).
async fn leased(
    client: &SandboxClient,
    request: &LeaseRequestV1,
    files: &[(String, String)],
    command: &str,
) -> anyhow::Result<(f64, String)> {
    let asked = Instant::now();
    let lease = client.lease(request, Duration::from_secs(30)).await?;
    let took = asked.elapsed().as_secs_f64() * 1e3;
    let result = async {
        if !files.is_empty() {
            lease.write_all(files).await?;
        }
        let ran = lease
            .exec(&ExecRequest {
                command: command.to_owned(),
                timeout_s: 60.0,
                env: Default::default(),
                stdin: None,
            })
            .await?;
        let diff = if files.is_empty() {
            lease.diff().await?
        } else {
            String::new()
        };
        Ok::<_, arl_sandbox_client::SandboxError>((ran, diff))
    }
    .await;
    lease.release().await;
    let (ran, diff) = result?;
    anyhow::ensure!(
        ran.exit_code == 0,
        "`{command}` exited {} in the sandbox: {}{}",
        ran.exit_code,
        ran.stdout,
        ran.stderr
    );
    Ok((took, diff))
}
