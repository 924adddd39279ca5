//! The sandbox service for real: bubblewrap, cgroups, a private nats-server. Must run as
//! root (it drops each sandbox to an unprivileged user and writes cgroups).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use arl_runtime::bus::BusConfig;
use arl_runtime::rpc::RequestError;
use arl_runtime::{Bus, Metrics, Shutdown};
use arl_sandbox::{SandboxConfig, SandboxService};
use arl_schemas::events::{EnvironmentRef, LeaseEnd, SandboxReleasedV2};
use arl_schemas::rpc::{
    ExecResult, FileEntry, LeaseGrantV1, LeaseRequestV1, ReleaseRequestV2, ReleasedV1,
    RenewRequestV1, RenewRequestV2, RenewedV1, RpcErrorCode, SandboxLimits, SandboxOp,
};
use arl_schemas::{Domain, Namespace, RunId};
use arl_testkit::{HttpResponse, NatsServer, http, test_namespace, wait_for};

struct Harness {
    server: NatsServer,
    ns: Namespace,
    bus: Bus,
    files: tempfile::TempDir,
    shutdown: Shutdown,
    service: SandboxService,
}

fn init_binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_arl-sandbox-init"))
}

/// A Harbor-like environment: the fix-mean example task's files.
fn make_environments(root: &Path) {
    let tree = root.join("harbor/fix-mean/tree");
    std::fs::create_dir_all(&tree).unwrap();
    let example =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/tasks/fix-mean/environment/app");
    for entry in std::fs::read_dir(example).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), tree.join(entry.file_name())).unwrap();
    }
}

fn config(files: &Path) -> SandboxConfig {
    let mut config = SandboxConfig::local(
        files.join("state"),
        files.join("environments"),
        init_binary(),
    );
    config.pool_min_idle = 1;
    config.max_leases = 300;
    config
}

impl Harness {
    async fn start() -> Self {
        Self::start_with(|_| {}).await
    }

    async fn start_with(adjust: impl FnOnce(&mut SandboxConfig)) -> Self {
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
            .prefix("arl-sbx-")
            .tempdir()
            .unwrap();
        make_environments(&files.path().join("environments"));
        let mut config = config(files.path());
        adjust(&mut config);
        let shutdown = Shutdown::new();
        let service = SandboxService::start_local(
            bus.clone(),
            config,
            "127.0.0.1:0".parse().unwrap(),
            &shutdown,
        )
        .await
        .unwrap();
        Self {
            server,
            ns,
            bus,
            files,
            shutdown,
            service,
        }
    }

    async fn lease_with(&self, limits: SandboxLimits, ttl_s: u64) -> LeaseGrantV1 {
        let request = LeaseRequestV1 {
            run_id: RunId::new("run-sbx").unwrap(),
            trial_id: None,
            environment: EnvironmentRef {
                name: "harbor/fix-mean".into(),
                digest: None,
            },
            ttl_s,
            limits,
        };
        self.bus
            .request(
                self.ns.sandbox_rpc("any", SandboxOp::Lease),
                &request,
                Duration::from_secs(60),
            )
            .await
            .unwrap()
    }

    async fn lease(&self) -> LeaseGrantV1 {
        self.lease_with(SandboxLimits::default(), 600).await
    }

    async fn release(&self, grant: &LeaseGrantV1) {
        let _: ReleasedV1 = self
            .bus
            .request(
                self.ns.sandbox_rpc(&grant.instance, SandboxOp::Release),
                &ReleaseRequestV2 {
                    lease_id: grant.lease_id.clone(),
                    token: grant.token.clone(),
                },
                Duration::from_secs(30),
            )
            .await
            .unwrap();
    }

    async fn stop(self) {
        self.shutdown.trigger();
        self.shutdown.wait().await;
    }
}

async fn call(grant: &LeaseGrantV1, method: &str, path: &str, body: &[u8]) -> HttpResponse {
    let auth = format!("Bearer {}", grant.token);
    let headers = [
        ("Authorization", auth.as_str()),
        ("Content-Type", "application/json"),
    ];
    http(&format!("{}{path}", grant.endpoint), method, &headers, body)
        .await
        .unwrap()
}

async fn exec_with(grant: &LeaseGrantV1, command: &str, timeout_s: f64) -> ExecResult {
    let body = serde_json::json!({"command": command, "timeout_s": timeout_s});
    let response = call(grant, "POST", "/exec", body.to_string().as_bytes()).await;
    assert_eq!(response.status, 200, "{}", response.text());
    response.json()
}

async fn exec(grant: &LeaseGrantV1, command: &str) -> ExecResult {
    exec_with(grant, command, 30.0).await
}

#[tokio::test(flavor = "multi_thread")]
async fn lease_exec_files_diff_release() {
    let h = Harness::start().await;
    let grant = h.lease().await;
    assert_eq!(grant.workdir, "/app");

    let result = exec(&grant, "echo hello; pwd; id -u; ls").await;
    assert_eq!(result.exit_code, 0, "{result:?}");
    assert_eq!(result.stdout, "hello\n/app\n65534\nstats.py\n");

    // Files: write, read, list.
    assert_eq!(
        call(&grant, "PUT", "/files?path=notes/todo.txt", b"fix mean\n")
            .await
            .status,
        204
    );
    let read = call(&grant, "GET", "/files?path=notes/todo.txt", b"").await;
    assert_eq!((read.status, read.text().as_str()), (200, "fix mean\n"));
    assert_eq!(
        call(&grant, "GET", "/files?path=missing.txt", b"")
            .await
            .status,
        404
    );
    assert_eq!(
        call(&grant, "GET", "/files?path=../etc/passwd", b"")
            .await
            .status,
        400
    );
    let listed: Vec<FileEntry> = call(&grant, "GET", "/list?path=", b"").await.json();
    let names: Vec<_> = listed.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names, [".git", "notes", "stats.py"]);

    // Fix the bug and see it in the diff against the base.
    let fixed = exec(
        &grant,
        "sed -i 's/values\\[1:\\]/values/; s/len(values) - 1/len(values)/' stats.py",
    )
    .await;
    assert_eq!(fixed.exit_code, 0, "{fixed:?}");
    let diff = call(&grant, "GET", "/diff", b"").await;
    assert_eq!(diff.status, 200);
    let diff = diff.text();
    assert!(
        diff.contains("-    for v in values[1:]:") && diff.contains("+    for v in values:"),
        "{diff}"
    );
    assert!(diff.contains("+++ b/notes/todo.txt"), "{diff}");

    // Tar out, tar in.
    let tar = call(&grant, "GET", "/tar?path=notes", b"").await;
    assert_eq!(tar.status, 200);
    assert!(tar.body.len() >= 512);
    assert_eq!(
        call(&grant, "PUT", "/tar?path=copy", &tar.body)
            .await
            .status,
        204
    );
    assert_eq!(
        call(&grant, "GET", "/files?path=copy/todo.txt", b"")
            .await
            .text(),
        "fix mean\n"
    );

    // Auth.
    let mut stolen = grant.clone();
    stolen.token = "guess".into();
    assert_eq!(call(&stolen, "GET", "/diff", b"").await.status, 401);

    // Renew and release need the lease's token: without it, or with another, they are
    // refused and the lease lives on.
    let renew = h.ns.sandbox_rpc(&grant.instance, SandboxOp::Renew);
    let release = h.ns.sandbox_rpc(&grant.instance, SandboxOp::Release);
    let refusal = |answer: Result<RenewedV1, RequestError>| match answer {
        Err(RequestError::Refused(err)) => err,
        other => panic!("expected a refusal, got {other:?}"),
    };
    let tokenless = h
        .bus
        .request(
            renew.clone(),
            &RenewRequestV1 {
                lease_id: grant.lease_id.clone(),
                ttl_s: 900,
            },
            Duration::from_secs(10),
        )
        .await;
    let err = refusal(tokenless);
    assert_eq!(err.code, RpcErrorCode::BadRequest);
    assert!(err.message.contains("RenewRequestV2"), "{}", err.message);
    let wrong = h
        .bus
        .request(
            renew.clone(),
            &RenewRequestV2 {
                lease_id: grant.lease_id.clone(),
                token: stolen.token.clone(),
                ttl_s: 900,
            },
            Duration::from_secs(10),
        )
        .await;
    assert_eq!(refusal(wrong).code, RpcErrorCode::Unauthorized);
    for request in [
        serde_json::json!({"lease_id": grant.lease_id}),
        serde_json::json!({"lease_id": grant.lease_id, "token": "guess"}),
    ] {
        let refused: Result<ReleasedV1, RequestError> = h
            .bus
            .request(release.clone(), &request, Duration::from_secs(10))
            .await;
        assert!(
            matches!(refused, Err(RequestError::Refused(_))),
            "{refused:?}"
        );
    }
    assert_eq!(call(&grant, "GET", "/diff", b"").await.status, 200);

    // Renew, then release, with the token.
    let renewed: RenewedV1 = h
        .bus
        .request(
            renew,
            &RenewRequestV2 {
                lease_id: grant.lease_id.clone(),
                token: grant.token.clone(),
                ttl_s: 900,
            },
            Duration::from_secs(10),
        )
        .await
        .unwrap();
    assert!(renewed.expires_at > grant.expires_at);
    let lease_dir = h
        .files
        .path()
        .join("state/leases")
        .join(grant.lease_id.as_str());
    assert!(lease_dir.exists());
    h.release(&grant).await;
    assert!(!lease_dir.exists());
    assert_eq!(call(&grant, "GET", "/diff", b"").await.status, 404);
    let released: Vec<SandboxReleasedV2> = h
        .bus
        .replay(
            Domain::Sandbox,
            h.ns.event_subject(Domain::Sandbox, &RunId::new("run-sbx").unwrap(), "released"),
        )
        .await
        .unwrap();
    assert_eq!(released.len(), 1);
    assert_eq!(released[0].reason, LeaseEnd::Released);
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_lease_requests_get_clear_errors() {
    let h = Harness::start().await;
    let request = |name: &str, ttl_s| LeaseRequestV1 {
        run_id: RunId::new("run-sbx").unwrap(),
        trial_id: None,
        environment: EnvironmentRef {
            name: name.into(),
            digest: None,
        },
        ttl_s,
        limits: SandboxLimits::default(),
    };
    let subject = h.ns.sandbox_rpc("any", SandboxOp::Lease);
    for (req, code) in [
        (request("harbor/none", 60), "not_found"),
        (request("../etc", 60), "bad_request"),
        (request("harbor/fix-mean", 0), "bad_request"),
    ] {
        let err = h
            .bus
            .request::<_, LeaseGrantV1>(subject.clone(), &req, Duration::from_secs(10))
            .await
            .unwrap_err();
        assert!(err.to_string().starts_with(code), "{err}");
    }
    // Not even JSON: still an answer.
    let reply = h
        .bus
        .client()
        .request(subject, "nope".into())
        .await
        .unwrap();
    assert!(String::from_utf8_lossy(&reply.payload).contains("bad_request"));
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unrenewed_lease_expires_and_is_destroyed() {
    let h = Harness::start().await;
    let grant = h.lease_with(SandboxLimits::default(), 1).await;
    let lease_dir = h
        .files
        .path()
        .join("state/leases")
        .join(grant.lease_id.as_str());
    assert!(lease_dir.exists());
    wait_for("the lease to expire", Duration::from_secs(10), || async {
        (!lease_dir.exists()).then_some(())
    })
    .await;
    assert_eq!(
        call(&grant, "POST", "/exec", br#"{"command":"true"}"#)
            .await
            .status,
        404
    );
    let released: Vec<SandboxReleasedV2> =
        wait_for("the released event", Duration::from_secs(10), || async {
            let events: Vec<SandboxReleasedV2> = h
                .bus
                .replay(
                    Domain::Sandbox,
                    h.ns.event_subject(
                        Domain::Sandbox,
                        &RunId::new("run-sbx").unwrap(),
                        "released",
                    ),
                )
                .await
                .unwrap();
            (!events.is_empty()).then_some(events)
        })
        .await;
    assert_eq!(released[0].reason, LeaseEnd::Expired);
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn two_hundred_concurrent_leases() {
    let h = Harness::start().await;
    let started = Instant::now();
    let grants = futures::future::join_all((0..200).map(|_| h.lease())).await;
    let leased = started.elapsed();
    let results = futures::future::join_all(grants.iter().enumerate().map(|(i, g)| async move {
        let r = exec(g, &format!("echo {i} > mine.txt && cat mine.txt")).await;
        (i, r)
    }))
    .await;
    for (i, result) in results {
        assert_eq!(result.stdout.trim(), i.to_string(), "{result:?}");
    }
    assert_eq!(h.service.active_leases(), 200);
    futures::future::join_all(grants.iter().map(|g| h.release(g))).await;
    assert_eq!(h.service.active_leases(), 0);
    eprintln!(
        "200 leases in {leased:?}, exec+release in {:?}",
        started.elapsed() - leased
    );
    h.stop().await;
}

/// Bursts of leases on one environment whose warm pool keeps several idle (each lease
/// starts a refill): every lease is granted. Refills that each held part of `min_idle`
/// and waited for the rest once filled the pool between them, and every lease waited
/// behind them forever (the sandboxed load test stalled on it).
#[tokio::test(flavor = "multi_thread")]
async fn bursts_of_leases_on_a_refilling_warm_pool_are_all_granted() {
    let h = Harness::start_with(|config| {
        config.pool_min_idle = 4;
        config.pool_max_size = 6;
    })
    .await;
    for _ in 0..3 {
        let grants = futures::future::join_all((0..32).map(|_| h.lease())).await;
        futures::future::join_all(grants.iter().map(|g| h.release(g))).await;
    }
    assert_eq!(h.service.active_leases(), 0);
    h.stop().await;
}

// --- Isolation. Each of these fails if the corresponding isolation is removed. ---

#[tokio::test(flavor = "multi_thread")]
async fn sandboxed_code_cannot_open_tcp_connections() {
    let h = Harness::start().await;
    let grant = h.lease().await;
    let nats_port = h.server.port();
    let script = format!(
        "python3 - <<'PY'\nimport socket\nfor host, port in [('127.0.0.1', {nats_port}), ('1.1.1.1', 53), ('10.0.0.1', 80)]:\n    s = socket.socket()\n    s.settimeout(2)\n    try:\n        s.connect((host, port))\n        print('CONNECTED', host, port)\n    except OSError as e:\n        print('refused', host, port, e.errno)\nPY"
    );
    let result = exec(&grant, &script).await;
    assert_eq!(result.exit_code, 0, "{result:?}");
    assert!(!result.stdout.contains("CONNECTED"), "{}", result.stdout);
    assert_eq!(
        result.stdout.matches("refused").count(),
        3,
        "{}",
        result.stdout
    );
    // The host can reach the same port, so the difference is the sandbox.
    assert!(std::net::TcpStream::connect(("127.0.0.1", nats_port)).is_ok());
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn sandboxed_code_cannot_write_outside_its_work_tree() {
    let h = Harness::start().await;
    let grant = h.lease().await;
    let marker = format!("arl-escape-{}", grant.lease_id);
    let script = format!(
        "for p in /usr/{marker} /etc/{marker} /var/{marker} /{marker} /root/{marker} /opt/{marker}; do \
         if touch $p 2>/dev/null; then echo WROTE $p; else echo denied $p; fi; done; \
         touch /app/inside && echo ok-inside; touch /tmp/{marker} && echo ok-tmp"
    );
    let result = exec(&grant, &script).await;
    assert!(!result.stdout.contains("WROTE"), "{}", result.stdout);
    assert_eq!(
        result.stdout.matches("denied").count(),
        6,
        "{}",
        result.stdout
    );
    assert!(result.stdout.contains("ok-inside"));
    for dir in ["/usr", "/etc", "/var", "/", "/tmp", "/opt"] {
        assert!(
            !Path::new(dir).join(&marker).exists(),
            "{dir}/{marker} exists on the host"
        );
    }
    let inside = h
        .files
        .path()
        .join("state/leases")
        .join(grant.lease_id.as_str())
        .join("tree/inside");
    assert!(inside.exists());
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn sandboxed_code_cannot_see_host_processes() {
    let h = Harness::start().await;
    let grant = h.lease().await;
    let mut host_process = std::process::Command::new("sleep")
        .arg("30.4242")
        .spawn()
        .unwrap();
    let result = exec(
        &grant,
        "ls /proc | grep -c '^[0-9]'; cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '",
    )
    .await;
    host_process.kill().unwrap();
    let _ = host_process.wait();
    let mut lines = result.stdout.lines();
    let visible: usize = lines.next().unwrap().trim().parse().unwrap();
    assert!(
        visible <= 6,
        "{visible} processes visible: {}",
        result.stdout
    );
    assert!(!result.stdout.contains("30.4242"), "{}", result.stdout);
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn sandboxes_cannot_read_each_others_files() {
    let h = Harness::start().await;
    let (a, b) = (h.lease().await, h.lease().await);
    assert_eq!(exec(&a, "echo s3cret > secret.txt").await.exit_code, 0);
    let a_tree = h
        .files
        .path()
        .join("state/leases")
        .join(a.lease_id.as_str())
        .join("tree");
    assert!(a_tree.join("secret.txt").exists());
    let script = format!(
        "cat /app/secret.txt 2>&1; cat {}/secret.txt 2>&1; ls {} 2>&1; grep -rs s3cret /tmp /run /app; echo done",
        a_tree.display(),
        h.files.path().display()
    );
    let result = exec(&b, &script).await;
    assert!(!result.stdout.contains("s3cret"), "{}", result.stdout);
    assert!(result.stdout.contains("done"));
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn no_new_user_namespaces_privileges_or_unbounded_tmp_inside() {
    let h = Harness::start().await;
    let grant = h
        .lease_with(
            SandboxLimits {
                memory_mb: Some(64),
                ..Default::default()
            },
            600,
        )
        .await;
    // A nested user namespace (a root of its own) is refused.
    let nested = exec(&grant, "unshare -Ur id -u 2>&1; echo exit=$?").await;
    assert!(
        !nested.stdout.contains("\n0\n") && !nested.stdout.starts_with("0\n"),
        "{nested:?}"
    );
    assert!(!nested.stdout.contains("exit=0"), "{nested:?}");
    // No capabilities, and no-new-privs: a setuid binary gains nothing.
    let status = exec(
        &grant,
        "grep -E '^(CapEff|CapPrm|NoNewPrivs)' /proc/self/status",
    )
    .await;
    assert!(
        status.stdout.contains("CapEff:\t0000000000000000"),
        "{status:?}"
    );
    assert!(
        status.stdout.contains("CapPrm:\t0000000000000000"),
        "{status:?}"
    );
    assert!(status.stdout.contains("NoNewPrivs:\t1"), "{status:?}");
    let su = exec(&grant, "su -c id root </dev/null 2>&1; echo exit=$?").await;
    assert!(!su.stdout.contains("exit=0"), "{su:?}");
    // /tmp holds at most the lease's memory: filling it stops at its size.
    let fill = exec(
        &grant,
        "dd if=/dev/zero of=/tmp/fill bs=1M count=256 2>&1; echo exit=$?; du -m /tmp/fill",
    )
    .await;
    assert!(!fill.stdout.contains("exit=0"), "{fill:?}");
    let written: u64 = fill
        .stdout
        .lines()
        .last()
        .and_then(|l| l.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(u64::MAX);
    assert!(written <= 64, "{written} MiB in /tmp: {fill:?}");
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn filling_the_disk_ends_the_lease_and_leaves_the_host_unchanged() {
    let h = Harness::start().await;
    let grant = h
        .lease_with(
            SandboxLimits {
                disk_mb: Some(32),
                ..Default::default()
            },
            600,
        )
        .await;
    let lease_dir = h
        .files
        .path()
        .join("state/leases")
        .join(grant.lease_id.as_str());
    // No single file grows past the limit, even between two looks of the watchdog.
    let one_file = exec(
        &grant,
        "dd if=/dev/zero of=big bs=1M count=48 2>&1; echo exit=$?; du -m big",
    )
    .await;
    assert!(!one_file.stdout.contains("exit=0"), "{one_file:?}");
    let written: u64 = one_file
        .stdout
        .lines()
        .last()
        .and_then(|l| l.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(u64::MAX);
    assert!(written <= 32, "{written} MiB in one file: {one_file:?}");
    exec(&grant, "rm big").await;
    // Many files under the limit each, hidden deeper than PATH_MAX: the watchdog ends the
    // lease, kills the command and deletes the tree.
    let body = serde_json::json!({
        "command": "python3 -c \"
import os, time
for _ in range(1500):
    os.mkdir('dddd'); os.chdir('dddd')
for f in range(4):
    with open(f'f{f}', 'wb') as out: out.write(bytes(16 << 20))
time.sleep(60)
\"",
        "timeout_s": 90.0,
    });
    let started = Instant::now();
    let filled = call(&grant, "POST", "/exec", body.to_string().as_bytes()).await;
    assert_eq!(filled.status, 410, "{}", filled.text());
    assert!(
        filled.text().contains("disk limit of 32 MB"),
        "{}",
        filled.text()
    );
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );
    wait_for(
        "the tree to be deleted",
        Duration::from_secs(10),
        || async { (!lease_dir.exists()).then_some(()) },
    )
    .await;
    // The holder's next call is told why, not just "not found".
    let after = call(&grant, "POST", "/exec", br#"{"command":"true"}"#).await;
    assert_eq!(after.status, 410, "{}", after.text());
    assert!(after.text().contains("limits.disk_mb"), "{}", after.text());
    let released: Vec<SandboxReleasedV2> =
        wait_for("the released event", Duration::from_secs(10), || async {
            let events: Vec<SandboxReleasedV2> = h
                .bus
                .replay(
                    Domain::Sandbox,
                    h.ns.event_subject(
                        Domain::Sandbox,
                        &RunId::new("run-sbx").unwrap(),
                        "released",
                    ),
                )
                .await
                .unwrap();
            (!events.is_empty()).then_some(events)
        })
        .await;
    assert_eq!(released[0].reason, LeaseEnd::DiskLimit);
    assert!(
        released[0]
            .detail
            .as_deref()
            .is_some_and(|d| d.contains("disk limit of 32 MB")),
        "{released:?}"
    );
    // A lease with room is not ended for writing within it.
    let roomy = h
        .lease_with(
            SandboxLimits {
                disk_mb: Some(64),
                ..Default::default()
            },
            600,
        )
        .await;
    let within = exec(
        &roomy,
        "dd if=/dev/zero of=f bs=1M count=16 2>/dev/null; sleep 3; echo ok",
    )
    .await;
    assert_eq!(within.stdout.trim(), "ok", "{within:?}");
    h.release(&roomy).await;
    h.stop().await;
}

/// A tar of `(name, kind)` members written by Python's tarfile: `("x", "file:body")`,
/// `("l", "link:/target")`. Members may be absolute or climb with `..`: that is the test.
fn crafted_tar(members: &[(&str, &str)]) -> Vec<u8> {
    let script = r#"
import io, sys, tarfile, json
out = io.BytesIO()
with tarfile.open(fileobj=out, mode="w") as tar:
    for name, kind in json.loads(sys.argv[1]):
        info = tarfile.TarInfo(name)
        if kind.startswith("link:"):
            info.type, info.linkname = tarfile.SYMTYPE, kind[5:]
            tar.addfile(info)
        else:
            body = kind[5:].encode()
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
sys.stdout.buffer.write(out.getvalue())
"#;
    let members = serde_json::to_string(members).unwrap();
    let out = std::process::Command::new("python3")
        .args(["-c", script, &members])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// Through the file and tar API: `..`, absolute members and symlinks planted by the agent
/// all resolve inside the sandbox, where the host's files are read-only or absent.
#[tokio::test(flavor = "multi_thread")]
async fn symlink_and_dotdot_tricks_through_the_file_and_tar_api_stay_inside() {
    let h = Harness::start().await;
    let grant = h.lease().await;
    let marker = format!("arl-tar-{}", grant.lease_id);
    // A planted link to a host secret reads the sandbox's view of it (an unreadable or
    // absent file), never the host's.
    std::fs::write(format!("/root/{marker}"), "host secret").unwrap();
    exec(
        &grant,
        &format!("ln -s /root/{marker} secret && ln -s /root root-link"),
    )
    .await;
    let read = call(&grant, "GET", "/files?path=secret", b"").await;
    assert!(!read.text().contains("host secret"), "{}", read.text());
    let through = call(
        &grant,
        "GET",
        &format!("/files?path=root-link/{marker}"),
        b"",
    )
    .await;
    assert!(
        !through.text().contains("host secret"),
        "{}",
        through.text()
    );
    let tarred = call(&grant, "GET", "/tar?path=root-link", b"").await;
    assert!(
        !String::from_utf8_lossy(&tarred.body).contains("host secret"),
        "the tar of a link to /root holds the host's file"
    );
    // Writing through a planted link to a host folder: refused inside, host unchanged.
    exec(&grant, "ln -s /usr usr-link").await;
    let write = call(
        &grant,
        "PUT",
        &format!("/files?path=usr-link/{marker}"),
        b"x",
    )
    .await;
    assert_ne!(write.status, 200, "{}", write.text());
    assert!(!Path::new("/usr").join(&marker).exists());
    // Tar members that climb out, are absolute, or go through a link they planted first.
    let tar = crafted_tar(&[
        (&format!("../../{marker}-up"), "file:x"),
        (&format!("/tmp/{marker}-abs"), "file:x"),
        ("etc-link", "link:/etc"),
        (&format!("etc-link/{marker}-via-link"), "file:x"),
        ("inside.txt", "file:fine"),
    ]);
    let _ = call(&grant, "PUT", "/tar?path=upload", &tar).await;
    for host in [
        format!("/{marker}-up"),
        format!("/tmp/{marker}-abs"),
        format!("/etc/{marker}-via-link"),
    ] {
        assert!(!Path::new(&host).exists(), "{host} was written on the host");
    }
    assert!(
        h.files
            .path()
            .join("state/leases")
            .join(grant.lease_id.as_str())
            .join("tree/upload/inside.txt")
            .exists(),
        "an ordinary member is extracted"
    );
    std::fs::remove_file(format!("/root/{marker}")).unwrap();
    h.stop().await;
}

// The probe's syscall numbers are x86_64's.
#[cfg(target_arch = "x86_64")]
#[tokio::test(flavor = "multi_thread")]
async fn ipv6_udp_raw_and_packet_sockets_and_risky_syscalls_are_refused() {
    let h = Harness::start().await;
    let grant = h.lease().await;
    let probe = r#"
import ctypes, os, socket
cases = [("ipv6", socket.AF_INET6, socket.SOCK_STREAM, 0),
         ("udp", socket.AF_INET, socket.SOCK_DGRAM, 0),
         ("udp-nonblock", socket.AF_INET, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK, 0),
         ("raw", socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP),
         ("packet", socket.AF_PACKET, socket.SOCK_RAW, 0)]
for name, family, kind, proto in cases:
    try:
        socket.socket(family, kind, proto).close()
        print("OPENED", name)
    except OSError as e:
        print("refused", name, e.errno)
socket.socket(socket.AF_INET, socket.SOCK_STREAM).close()
socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).close()
print("tcp and unix ok")
libc = ctypes.CDLL(None, use_errno=True)
for name, number in [("keyctl", 250), ("bpf", 321), ("userfaultfd", 323), ("io_uring_setup", 425)]:
    result = libc.syscall(number, 0, 0, 0, 0)
    print("refused" if result == -1 and ctypes.get_errno() == 1 else "ALLOWED", name)
print(open("/proc/self/status").read().split("Seccomp:")[1].split()[0], "seccomp")
"#;
    let result = exec(&grant, &format!("python3 - <<'PY'\n{probe}\nPY")).await;
    let out = &result.stdout;
    assert!(
        !out.contains("OPENED") && !out.contains("ALLOWED"),
        "{result:?}"
    );
    assert_eq!(out.matches("refused").count(), 9, "{result:?}");
    assert!(out.contains("tcp and unix ok"), "{result:?}");
    assert!(
        out.contains("2 seccomp"),
        "a filter is installed: {result:?}"
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_fork_bomb_is_contained() {
    let h = Harness::start().await;
    let grant = h
        .lease_with(
            SandboxLimits {
                pids: Some(64),
                ..Default::default()
            },
            600,
        )
        .await;
    let started = Instant::now();
    let bomb = exec_with(
        &grant,
        "bomb() { bomb | bomb & }; bomb; sleep 3; echo survived",
        5.0,
    )
    .await;
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "{:?}",
        started.elapsed()
    );
    // The service still answers, and the sandbox works again.
    let other = h.lease().await;
    assert_eq!(exec(&other, "echo fine").await.stdout, "fine\n");
    let again = exec(&grant, "echo alive").await;
    assert_eq!(again.stdout, "alive\n", "{again:?} after {bomb:?}");
    let host_threads = std::fs::read_to_string("/proc/loadavg").unwrap();
    let running: u64 = host_threads
        .split_whitespace()
        .nth(3)
        .unwrap()
        .split('/')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    assert!(running < 20_000, "{running} tasks on the host");
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_memory_hog_is_contained() {
    let h = Harness::start().await;
    let grant = h
        .lease_with(
            SandboxLimits {
                memory_mb: Some(128),
                ..Default::default()
            },
            600,
        )
        .await;
    let hog = exec(
        &grant,
        "python3 -c \"x = bytearray(1024 * 1024 * 1024); print('allocated', len(x))\"",
    )
    .await;
    assert_ne!(hog.exit_code, 0, "{hog:?}");
    assert!(!hog.stdout.contains("allocated"), "{hog:?}");
    assert_eq!(exec(&grant, "echo still-here").await.stdout, "still-here\n");
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_runaway_command_is_killed_at_its_timeout_with_its_children() {
    let h = Harness::start().await;
    let grant = h.lease().await;
    let started = Instant::now();
    let result = exec_with(&grant, "(sleep 100.31 &); sleep 100.32", 1.0).await;
    let took = started.elapsed();
    assert!(result.timed_out, "{result:?}");
    assert_eq!(result.exit_code, -1);
    assert!(took < Duration::from_secs(5), "{took:?}");
    let leftovers = std::process::Command::new("pgrep")
        .args(["-f", "sleep 100.3"])
        .output()
        .unwrap();
    assert!(
        leftovers.stdout.is_empty(),
        "left running: {}",
        String::from_utf8_lossy(&leftovers.stdout)
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_proxy_socket_is_reachable_and_nothing_else() {
    let socket_dir = tempfile::Builder::new()
        .prefix("arl-proxy-")
        .tempdir()
        .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(socket_dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let socket = socket_dir.path().join("proxy.sock");
    let listener = tokio::net::UnixListener::bind(&socket).unwrap();
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o666)).unwrap();
    let proxy = axum::Router::new().route(
        "/v1/models",
        axum::routing::get(|| async { "{\"data\":[\"proxy-ok\"]}" }),
    );
    let server = tokio::spawn(async move { axum::serve(listener, proxy).await });

    let h = Harness::start_with(|config| config.proxy_socket = Some(socket.clone())).await;
    let grant = h.lease().await;
    assert_eq!(grant.proxy_url.as_deref(), Some("http://127.0.0.1:8000/v1"));
    let script = "python3 -c \"import os, urllib.request; print(urllib.request.urlopen(os.environ['ARL_PROXY_URL'] + '/models', timeout=5).read().decode())\"";
    let result = exec(&grant, script).await;
    assert_eq!(result.exit_code, 0, "{result:?}");
    assert!(result.stdout.contains("proxy-ok"), "{result:?}");
    server.abort();
    h.stop().await;
}

/// An environment's read-only mounts (an interpreter, a virtual environment) and variables
/// appear in every command; the mounts cannot be written.
#[tokio::test(flavor = "multi_thread")]
async fn environment_mounts_and_variables_reach_every_command() {
    use std::os::unix::fs::PermissionsExt;
    let harness = Harness::start().await;
    let root = harness.files.path().join("environments");
    let tools = root.join("shared/tools");
    std::fs::create_dir_all(&tools).unwrap();
    std::fs::write(
        tools.join("hello"),
        "#!/bin/sh\necho hello from the mount\n",
    )
    .unwrap();
    std::fs::set_permissions(tools.join("hello"), std::fs::Permissions::from_mode(0o755)).unwrap();
    let env_dir = root.join("harbor/with-tools");
    std::fs::create_dir_all(env_dir.join("tree")).unwrap();
    std::fs::write(
        env_dir.join("environment.json"),
        r#"{"workdir": "/testbed", "mounts": [{"source": "shared/tools", "target": "/opt/tools"}],
            "env": {"PATH": "/opt/tools:/usr/bin:/bin", "GREETING": "hi"}}"#,
    )
    .unwrap();
    // The sandbox user must be able to reach the mount's source.
    for dir in [
        harness.files.path(),
        root.as_path(),
        root.join("shared").as_path(),
        tools.as_path(),
    ] {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let request = LeaseRequestV1 {
        run_id: RunId::new("run-sbx").unwrap(),
        trial_id: None,
        environment: EnvironmentRef {
            name: "harbor/with-tools".into(),
            digest: None,
        },
        ttl_s: 600,
        limits: SandboxLimits::default(),
    };
    let grant: LeaseGrantV1 = harness
        .bus
        .request(
            harness.ns.sandbox_rpc("any", SandboxOp::Lease),
            &request,
            Duration::from_secs(60),
        )
        .await
        .unwrap();
    assert_eq!(grant.workdir, "/testbed");
    let out = exec(&grant, "hello && echo \"$GREETING\" && pwd").await;
    assert_eq!(out.exit_code, 0, "{out:?}");
    assert_eq!(out.stdout, "hello from the mount\nhi\n/testbed\n");
    let write = exec(&grant, "touch /opt/tools/x").await;
    assert_ne!(write.exit_code, 0, "the mount is writable: {write:?}");
    harness.release(&grant).await;

    // A mount that leaves the environments root is refused with the reason.
    std::fs::write(
        env_dir.join("environment.json"),
        r#"{"mounts": [{"source": "../../", "target": "/opt/x"}]}"#,
    )
    .unwrap();
    let refused: Result<LeaseGrantV1, _> = harness
        .bus
        .request(
            harness.ns.sandbox_rpc("any", SandboxOp::Lease),
            &request,
            Duration::from_secs(30),
        )
        .await;
    let error = refused.unwrap_err().to_string();
    assert!(error.contains("inside the environments root"), "{error}");
    harness.stop().await;
}
