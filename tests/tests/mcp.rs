//! The trial's sandbox tools as an MCP server, checked with the official MCP Python SDK
//! (PyPI `mcp`, in the tools venv) as the client: the real `arl-proxy` (a process) issues
//! two trials' keys, each with its MCP URL; the sandbox service (in-process, real
//! bubblewrap) leases each session's sandbox. `mcp_sdk.py` lists and calls the tools —
//! `print(6*7)`, a timeout, a crash, the memory limit, files, two sessions kept apart, a
//! wrong key, the key as a bearer token — then the test ends trial A (revokes its key) and
//! the script checks that A's session is over while B's goes on. Every sandbox is given
//! back. Build the binaries first (`cargo build --bins`; `make test` does).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Stdio};
use std::time::Duration;

use arl_runtime::bus::BusConfig;
use arl_runtime::{Bus, Metrics, Shutdown};
use arl_sandbox::config::SandboxConfig;
use arl_sandbox::service::SandboxService;
use arl_schemas::rpc::{
    ProxyOp, TrialKeyGrantV1, TrialKeyRequestV1, TrialKeyRevokeV1, TrialKeyRevokedV1,
};
use arl_schemas::{RunId, TrialId};
use arl_testkit::{Children, NatsServer, built_binary, free_port, test_namespace, wait_for};

fn tools_python() -> String {
    std::env::var("ARL_TOOLS_PYTHON").unwrap_or_else(|_| {
        format!(
            "{}/.cache/arl/tools/bin/python",
            std::env::var("HOME").unwrap()
        )
    })
}

async fn issue(bus: &Bus, trial: &str) -> TrialKeyGrantV1 {
    let request = TrialKeyRequestV1 {
        run_id: RunId::new("mcp-run").unwrap(),
        trial_id: TrialId::new(trial).unwrap(),
        policy_version: 0,
        max_staleness: None,
    };
    let subject = bus.namespace().proxy_rpc("any", ProxyOp::Issue);
    wait_for("the proxy to issue keys", Duration::from_secs(60), || {
        let (bus, subject, request) = (bus.clone(), subject.clone(), request.clone());
        async move {
            bus.request::<_, TrialKeyGrantV1>(subject, &request, Duration::from_secs(2))
                .await
                .ok()
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mcp_sdk_uses_a_trials_sandbox_tools() {
    let server = NatsServer::start().unwrap();
    let ns = test_namespace();
    let files = tempfile::tempdir().unwrap();
    std::fs::set_permissions(files.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let bus = Bus::connect(
        BusConfig::new(server.url(), ns.clone(), "test"),
        Metrics::new(),
    )
    .await
    .unwrap();
    bus.provision().await.unwrap();
    let shutdown = Shutdown::new();
    let mut config = SandboxConfig::local(
        files.path().join("state"),
        files.path().join("environments"),
        built_binary("arl-sandbox-init"),
    );
    config.pool_min_idle = 0;
    let sandbox = SandboxService::start_local(
        bus.clone(),
        config,
        "127.0.0.1:0".parse().unwrap(),
        &shutdown,
    )
    .await
    .unwrap();
    // No engine: the MCP server needs none (the backend is a closed port).
    let proxy_port = free_port().unwrap();
    let _proxy = Children(vec![
        Command::new(built_binary("arl-proxy"))
            .args([
                "--backend".to_owned(),
                format!("arl=http://127.0.0.1:{}", free_port().unwrap()),
                "--listen".to_owned(),
                format!("127.0.0.1:{proxy_port}"),
                "--mcp-memory-mb".to_owned(),
                "512".to_owned(),
            ])
            .env("NATS_URL", server.url())
            .env("ARL_PREFIX", ns.prefix().unwrap())
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap(),
    ]);
    let (a, b) = (issue(&bus, "trial-a").await, issue(&bus, "trial-b").await);
    let base = format!("http://127.0.0.1:{proxy_port}");
    assert_eq!(
        a.mcp_url.as_deref(),
        Some(format!("{base}/{}/mcp", a.trial_key).as_str())
    );

    let mut script = Command::new(tools_python())
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/mcp_sdk.py"))
        .args([
            a.mcp_url.clone().unwrap(),
            b.mcp_url.clone().unwrap(),
            base,
            a.trial_key.clone(),
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut stdin = script.stdin.take().unwrap();
    let stdout = script.stdout.take().unwrap();
    let (lines, mut rx) = tokio::sync::mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            eprintln!("mcp_sdk.py: {line}");
            if lines.send(line).is_err() {
                break;
            }
        }
    });
    let mut printed = Vec::new();
    let read_line = async |rx: &mut tokio::sync::mpsc::UnboundedReceiver<String>| {
        tokio::time::timeout(Duration::from_secs(180), rx.recv())
            .await
            .expect("mcp_sdk.py went quiet for 3 minutes")
    };
    loop {
        let line = read_line(&mut rx).await.expect("mcp_sdk.py ended early");
        let revoke = line == "revoke A";
        printed.push(line);
        if revoke {
            break;
        }
    }
    // Both sessions of A and B hold a sandbox; trial A ends.
    assert!(sandbox.active_leases() >= 2, "{}", sandbox.active_leases());
    let revoked: TrialKeyRevokedV1 = bus
        .request(
            bus.namespace().proxy_rpc(&a.instance, ProxyOp::Revoke),
            &TrialKeyRevokeV1 {
                trial_key: a.trial_key.clone(),
            },
            Duration::from_secs(30),
        )
        .await
        .unwrap();
    assert_eq!(revoked.calls, 0, "tool calls are not LLM calls");
    writeln!(stdin, "revoked").unwrap();
    while let Some(line) = read_line(&mut rx).await {
        printed.push(line);
    }
    let status = script.wait().unwrap();
    assert!(
        status.success(),
        "mcp_sdk.py failed:\n{}",
        printed.join("\n")
    );
    assert_eq!(
        printed.last().map(String::as_str),
        Some(r#"{"passed": true}"#)
    );
    // Trial B's key is still live: its session's sandbox stays until it ends too.
    bus.request::<_, TrialKeyRevokedV1>(
        bus.namespace().proxy_rpc(&b.instance, ProxyOp::Revoke),
        &TrialKeyRevokeV1 {
            trial_key: b.trial_key.clone(),
        },
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    wait_for(
        "every MCP sandbox to be given back",
        Duration::from_secs(30),
        || async { (sandbox.active_leases() == 0).then_some(()) },
    )
    .await;
    shutdown.trigger();
}
