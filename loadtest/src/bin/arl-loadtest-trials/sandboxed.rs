//! The sandboxed scenario's fixtures and baseline: Harbor tasks whose environment is a
//! tiny work tree (written straight into the environments folder, as the image builder
//! would leave it — building environments is not what is under test here), and the
//! sandbox service's own lease-creation rate, measured against the same service process
//! in the same run.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use arl_runtime::Bus;
use arl_schemas::RunId;
use arl_schemas::events::EnvironmentRef;
use arl_schemas::rpc::{
    LeaseGrantV1, LeaseRequestV1, ReleaseRequestV2, ReleasedV1, SandboxLimits, SandboxOp,
};
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

/// The sandbox service's own rate: `total` leases (each released at once) of the tasks'
/// environments, `concurrency` at a time, straight over its NATS API. Returns (leases per
/// second, every lease's latency in ms); a lease not granted within 30 s counts as
/// failed (said), not as a rate.
pub async fn lease_rate(
    bus: &Bus,
    environments: u32,
    total: usize,
    concurrency: usize,
) -> anyhow::Result<(f64, Vec<f64>, usize)> {
    let run = RunId::new("run-loadtest-lease-rate")?;
    let started = Instant::now();
    let results: Vec<anyhow::Result<f64>> = futures::stream::iter(0..total)
        .map(|i| {
            let run = run.clone();
            async move {
                let request = LeaseRequestV1 {
                    run_id: run,
                    trial_id: None,
                    environment: EnvironmentRef {
                        name: format!("harbor/touch-{}", i as u32 % environments.max(1)),
                        digest: None,
                    },
                    ttl_s: 600,
                    limits: SandboxLimits::default(),
                };
                let ns = bus.namespace();
                let asked = Instant::now();
                let grant: LeaseGrantV1 = bus
                    .request(
                        ns.sandbox_rpc("any", SandboxOp::Lease),
                        &request,
                        Duration::from_secs(30),
                    )
                    .await?;
                let took = asked.elapsed().as_secs_f64() * 1e3;
                let _: ReleasedV1 = bus
                    .request(
                        ns.sandbox_rpc(&grant.instance, SandboxOp::Release),
                        &ReleaseRequestV2 {
                            lease_id: grant.lease_id.clone(),
                            token: grant.token.clone(),
                        },
                        Duration::from_secs(60),
                    )
                    .await?;
                Ok(took)
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
            Ok(ms) => latencies.push(ms),
            Err(err) => failed.push(err.to_string()),
        }
    }
    if let Some(first) = failed.first() {
        println!(
            "sandbox lease-rate baseline: {} of {total} leases failed (e.g. {first})",
            failed.len()
        );
    }
    Ok((latencies.len() as f64 / elapsed, latencies, failed.len()))
}
