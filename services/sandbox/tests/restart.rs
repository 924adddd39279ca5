//! The `arl-sandbox` binary killed with leases out: the next instance on the same state
//! folder reaps them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use arl_runtime::bus::BusConfig;
use arl_runtime::{Bus, Metrics};
use arl_schemas::events::{EnvironmentRef, LeaseEnd, SandboxReleasedV2};
use arl_schemas::rpc::{LeaseGrantV1, LeaseRequestV1, SandboxLimits, SandboxOp};
use arl_schemas::{Domain, Namespace, RunId};
use arl_testkit::{NatsServer, http, test_namespace, wait_for};

/// Kills the service if the test fails half-way.
struct Service(Child);

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start(server: &NatsServer, ns: &Namespace, files: &Path) -> Service {
    Service(
        Command::new(env!("CARGO_BIN_EXE_arl-sandbox"))
            .env("NATS_URL", server.url())
            .env("ARL_PREFIX", ns.prefix().unwrap())
            .env("RUST_LOG", "warn")
            .args(["--state-dir", &files.join("state").to_string_lossy()])
            .args([
                "--environments-dir",
                &files.join("environments").to_string_lossy(),
            ])
            .args(["--pool-min-idle", "0"])
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

async fn lease(bus: &Bus, ns: &Namespace) -> LeaseGrantV1 {
    let request = LeaseRequestV1 {
        run_id: RunId::new("run-reap").unwrap(),
        trial_id: None,
        environment: EnvironmentRef {
            name: "t/env".into(),
            digest: None,
        },
        ttl_s: 3600,
        limits: SandboxLimits::default(),
    };
    let subject = ns.sandbox_rpc("any", SandboxOp::Lease);
    wait_for(
        "the sandbox service to answer",
        Duration::from_secs(30),
        || async {
            bus.request::<_, LeaseGrantV1>(subject.clone(), &request, Duration::from_secs(30))
                .await
                .ok()
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_restarted_service_reaps_the_leases_of_a_killed_one() {
    let server = NatsServer::start().unwrap();
    let ns = test_namespace();
    let bus = Bus::connect(
        BusConfig::new(server.url(), ns.clone(), "test"),
        Metrics::new(),
    )
    .await
    .unwrap();
    bus.provision().await.unwrap();
    let files = tempfile::Builder::new()
        .prefix("arl-reap-")
        .tempdir()
        .unwrap();
    std::fs::create_dir_all(files.path().join("environments/t/env/tree")).unwrap();
    std::fs::write(files.path().join("environments/t/env/tree/a.txt"), "a\n").unwrap();

    let mut first = start(&server, &ns, files.path());
    let grants = [lease(&bus, &ns).await, lease(&bus, &ns).await];
    // A command still running in one of them when the service dies.
    let running = grants[0].clone();
    let body = r#"{"command": "sleep 1000.77", "timeout_s": 1000}"#;
    let background = tokio::spawn(async move {
        let auth = format!("Bearer {}", running.token);
        let headers = [
            ("Authorization", auth.as_str()),
            ("Content-Type", "application/json"),
        ];
        http(
            &format!("{}/exec", running.endpoint),
            "POST",
            &headers,
            body.as_bytes(),
        )
        .await
    });
    wait_for("the command to run", Duration::from_secs(10), || async {
        let found = Command::new("pgrep")
            .args(["-f", "sleep 1000.77"])
            .output()
            .unwrap();
        (!found.stdout.is_empty()).then_some(())
    })
    .await;
    first.0.kill().unwrap();
    first.0.wait().unwrap();
    let _ = background.await;
    // A killed service cannot clean up: its sandboxes may run on until the next
    // instance reaps them (below).
    let leases_dir = files.path().join("state/leases");
    assert_eq!(
        std::fs::read_dir(&leases_dir).unwrap().count(),
        2,
        "both leases left behind"
    );

    let mut second = start(&server, &ns, files.path());
    wait_for(
        "the leftovers to be reaped",
        Duration::from_secs(30),
        || async { (std::fs::read_dir(&leases_dir).unwrap().count() == 0).then_some(()) },
    )
    .await;
    let released: Vec<SandboxReleasedV2> =
        wait_for("two reaped events", Duration::from_secs(10), || async {
            let events: Vec<SandboxReleasedV2> = bus
                .replay(
                    Domain::Sandbox,
                    ns.event_subject(
                        Domain::Sandbox,
                        &RunId::new("run-reap").unwrap(),
                        "released",
                    ),
                )
                .await
                .unwrap();
            (events.len() == 2).then_some(events)
        })
        .await;
    assert!(released.iter().all(|e| e.reason == LeaseEnd::Reaped));
    let mut reaped: Vec<_> = released.iter().map(|e| e.lease_id.clone()).collect();
    let mut granted: Vec<_> = grants.iter().map(|g| g.lease_id.clone()).collect();
    reaped.sort();
    granted.sort();
    assert_eq!(reaped, granted);
    let leftover = Command::new("pgrep")
        .args(["-f", "sleep 1000.77"])
        .output()
        .unwrap();
    assert!(
        leftover.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&leftover.stdout)
    );
    // The new instance serves.
    let fresh = lease(&bus, &ns).await;
    assert!(!grants.iter().any(|g| g.lease_id == fresh.lease_id));
    let _ = Command::new("kill")
        .arg("-TERM")
        .arg(second.0.id().to_string())
        .status();
    let status = second.0.wait().unwrap();
    assert!(status.success(), "{status}");
}
