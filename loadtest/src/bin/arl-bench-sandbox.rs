//! `arl-bench-sandbox`: lease latency from a warm pool and cold, sandboxes created per
//! second, exec overhead and memory per idle sandbox — each next to a baseline measured
//! in the same run (a bare NATS request/reply; a bare `sh -c true`). Run as root.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use arl_runtime::bus::BusConfig;
use arl_runtime::{Bus, Metrics, Shutdown};
use arl_sandbox::{SandboxConfig, SandboxService};
use arl_schemas::events::EnvironmentRef;
use arl_schemas::rpc::{
    LeaseGrantV1, LeaseRequestV1, ReleaseRequestV2, ReleasedV1, SandboxLimits, SandboxOp,
};
use arl_schemas::{Namespace, RunId};
use futures::StreamExt;

fn percentile(sorted: &[Duration], q: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * q).round() as usize]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn row(name: &str, samples: &mut [Duration], baseline: Duration) {
    samples.sort();
    let p50 = percentile(samples, 0.5);
    println!(
        "{name:<46} {:>9.2} {:>9.2} {:>10.1}x",
        ms(p50),
        ms(percentile(samples, 0.99)),
        p50.as_secs_f64() / baseline.as_secs_f64()
    );
}

/// An environment of `files` files of 4 KiB in 10 folders.
fn make_environment(root: &Path, name: &str, files: usize) -> anyhow::Result<()> {
    let tree = root.join(name).join("tree");
    for i in 0..files {
        let dir = tree.join(format!("pkg{}", i % 10));
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join(format!("m{i}.py")), vec![b'#'; 4096])?;
    }
    Ok(())
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .map(str::to_owned)
        })
        .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        .unwrap_or(0)
}

fn du_kib(dir: &Path) -> u64 {
    std::process::Command::new("du")
        .arg("-sk")
        .arg(dir)
        .output()
        .ok()
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .unwrap_or(0)
}

struct Bench {
    bus: Bus,
    ns: Namespace,
    environments: PathBuf,
}

impl Bench {
    async fn lease(&self, environment: &str) -> anyhow::Result<(LeaseGrantV1, Duration)> {
        let request = LeaseRequestV1 {
            run_id: RunId::new("run-bench")?,
            trial_id: None,
            environment: EnvironmentRef {
                name: environment.into(),
                digest: None,
            },
            ttl_s: 600,
            limits: SandboxLimits::default(),
        };
        let subject = self.ns.sandbox_rpc("any", SandboxOp::Lease);
        let started = Instant::now();
        let grant: LeaseGrantV1 = self
            .bus
            .request(subject, &request, Duration::from_secs(120))
            .await?;
        Ok((grant, started.elapsed()))
    }

    async fn release(&self, grant: &LeaseGrantV1) -> anyhow::Result<()> {
        let _: ReleasedV1 = self
            .bus
            .request(
                self.ns.sandbox_rpc(&grant.instance, SandboxOp::Release),
                &ReleaseRequestV2 {
                    lease_id: grant.lease_id.clone(),
                    token: grant.token.clone(),
                },
                Duration::from_secs(60),
            )
            .await?;
        Ok(())
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let server = arl_testkit::NatsServer::start()?;
    let files = tempfile::Builder::new()
        .prefix("arl-bench-sbx-")
        .tempdir()?;
    let environments = files.path().join("environments");
    make_environment(&environments, "small", 20)?;
    make_environment(&environments, "medium", 2000)?;
    let ns = arl_testkit::test_namespace();
    let bus = Bus::connect(
        BusConfig::new(server.url(), ns.clone(), "bench"),
        Metrics::new(),
    )
    .await?;
    bus.provision().await?;
    let init = std::env::current_exe()?.with_file_name("arl-sandbox-init");
    anyhow::ensure!(
        init.exists(),
        "{} is missing; build with `cargo build --release --bins`",
        init.display()
    );
    let mut config = SandboxConfig::local(files.path().join("state"), environments.clone(), init);
    config.pool_min_idle = 4;
    config.pool_max_size = 8;
    config.max_leases = 1024;
    let shutdown = Shutdown::new();
    let service =
        SandboxService::start_local(bus.clone(), config, "127.0.0.1:0".parse()?, &shutdown).await?;
    let bench = Bench {
        bus: bus.clone(),
        ns: ns.clone(),
        environments,
    };

    // Baseline: a bare request/reply on the same server.
    let echo_subject = format!("{}.bench.echo", ns.prefix().unwrap_or("x"));
    let mut echo = bus.client().subscribe(echo_subject.clone()).await?;
    let client = bus.client().clone();
    let responder = tokio::spawn(async move {
        while let Some(message) = echo.next().await {
            if let Some(reply) = message.reply {
                let _ = client.publish(reply, message.payload).await;
            }
        }
    });
    let mut baseline = Vec::new();
    for _ in 0..300 {
        let started = Instant::now();
        bus.client()
            .request(echo_subject.clone(), vec![b'x'; 256].into())
            .await?;
        baseline.push(started.elapsed());
    }
    baseline.sort();
    let request_baseline = percentile(&baseline, 0.5);
    responder.abort();

    println!("\nsandbox service, bubblewrap backend");
    println!(
        "{:<46} {:>9} {:>9} {:>11}",
        "", "p50 ms", "p99 ms", "p50/base"
    );
    row(
        "baseline: NATS request/reply (256 B)",
        &mut baseline,
        request_baseline,
    );

    for environment in ["small", "medium"] {
        service.prewarm(&EnvironmentRef {
            name: environment.into(),
            digest: None,
        })?;
        let mut warm = Vec::new();
        for _ in 0..40 {
            // Let the pool refill, so each lease is the fast path being measured.
            let deadline = Instant::now() + Duration::from_secs(60);
            while service
                .idle_sandboxes()
                .get(environment)
                .copied()
                .unwrap_or(0)
                < 1
                && Instant::now() < deadline
            {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let (grant, took) = bench.lease(environment).await?;
            if grant.warm {
                warm.push(took);
            }
            bench.release(&grant).await?;
        }
        anyhow::ensure!(!warm.is_empty(), "no warm lease measured for {environment}");
        row(
            &format!("lease, warm pool ({environment} env)"),
            &mut warm,
            request_baseline,
        );
    }

    for (kind, size) in [("small", 20), ("medium", 2000)] {
        let mut cold = Vec::new();
        for i in 0..15 {
            let name = format!("{kind}-cold{i}");
            make_environment(&bench.environments, &name, size)?;
            let (grant, took) = bench.lease(&name).await?;
            anyhow::ensure!(!grant.warm, "a first lease cannot be warm");
            cold.push(took);
            bench.release(&grant).await?;
        }
        row(
            &format!("lease, cold ({kind} env, {size} files)"),
            &mut cold,
            request_baseline,
        );
    }

    // Exec overhead: `true` in a sandbox vs `sh -c true` on the host.
    let (grant, _) = bench.lease("small").await?;
    let mut host = Vec::new();
    for _ in 0..50 {
        let started = Instant::now();
        tokio::process::Command::new("sh")
            .args(["-c", "true"])
            .status()
            .await?;
        host.push(started.elapsed());
    }
    host.sort();
    let host_baseline = percentile(&host, 0.5);
    let mut sandboxed = Vec::new();
    let auth = format!("Bearer {}", grant.token);
    for _ in 0..50 {
        let started = Instant::now();
        let response = arl_testkit::http(
            &format!("{}/exec", grant.endpoint),
            "POST",
            &[
                ("Authorization", &auth),
                ("Content-Type", "application/json"),
            ],
            br#"{"command":"true"}"#,
        )
        .await?;
        anyhow::ensure!(response.status == 200, "exec failed: {}", response.text());
        sandboxed.push(started.elapsed());
    }
    println!();
    println!(
        "{:<46} {:>9} {:>9} {:>11}",
        "", "p50 ms", "p99 ms", "p50/host"
    );
    row("baseline: host `sh -c true`", &mut host, host_baseline);
    row(
        "exec `true` in a sandbox (HTTP + bwrap)",
        &mut sandboxed,
        host_baseline,
    );
    bench.release(&grant).await?;

    // Throughput: 100 cold leases of distinct environments, 8 at a time.
    for i in 0..100 {
        make_environment(&bench.environments, &format!("burst{i}"), 20)?;
    }
    let started = Instant::now();
    let granted: Vec<anyhow::Result<(LeaseGrantV1, Duration)>> = futures::stream::iter(0..100)
        .map(|i| {
            let bench = &bench;
            async move { bench.lease(&format!("burst{i}")).await }
        })
        .buffer_unordered(8)
        .collect()
        .await;
    let elapsed = started.elapsed();
    let mut burst = Vec::new();
    for grant in granted {
        burst.push(grant?.0);
    }
    println!(
        "\nsandboxes created per second (cold, 20-file env, 8 at a time): {:.1}",
        burst.len() as f64 / elapsed.as_secs_f64()
    );
    for grant in &burst {
        bench.release(grant).await?;
    }

    // Memory: an idle lease runs no process; it costs the service's bookkeeping and disk.
    let before = rss_kib();
    let mut idle = Vec::new();
    for _ in 0..200 {
        idle.push(bench.lease("small").await?.0);
    }
    let after = rss_kib();
    let disk = du_kib(&files.path().join("state/leases"));
    println!(
        "memory per idle sandbox: {:.1} KiB of service RSS ({} KiB for 200 leases), 0 processes; {} KiB of disk each",
        after.saturating_sub(before) as f64 / 200.0,
        after.saturating_sub(before),
        disk / 200
    );
    for grant in &idle {
        bench.release(grant).await?;
    }
    shutdown.trigger();
    shutdown.wait().await;
    Ok(())
}
