//! `arl-bench-mcp`: what a tool call through the proxy's MCP server costs next to the same
//! command run directly on a lease (`Lease::exec`, the sandbox's own exec API), measured
//! in the same run on the same sandbox service (bubblewrap): p50/p99 per call, and calls/s
//! one at a time and with many sessions at once. The MCP side is a real client's round
//! trip: JSON-RPC `tools/call` over HTTP to the proxy, which checks the key and the
//! session and execs on the session's own lease. Run as root (bubblewrap sandboxes).

use std::sync::Arc;
use std::time::{Duration, Instant};

use arl_proxy::api::{self, Proxy, ProxyConfig};
use arl_proxy::backends::{Backends, Dialect};
use arl_proxy::keys::Keys;
use arl_proxy::mcp::{Mcp, McpConfig};
use arl_runtime::bus::BusConfig;
use arl_runtime::{Bus, Metrics, Shutdown};
use arl_sandbox::{SandboxConfig, SandboxService};
use arl_sandbox_client::{Lease, SandboxClient};
use arl_schemas::events::EnvironmentRef;
use arl_schemas::rpc::{
    ExecRequest, LeaseRequestV1, ProxyOp, SandboxLimits, TrialKeyGrantV1, TrialKeyRequestV1,
};
use arl_schemas::{RunId, TrialId};
use clap::Parser;
use serde_json::{Value, json};

#[derive(Debug, Parser)]
#[command(about = "MCP tool-call overhead vs a direct sandbox exec, same run")]
struct Args {
    /// Calls measured one at a time, per side.
    #[arg(long, default_value_t = 200)]
    calls: usize,
    /// Sessions (each with its own sandbox) calling at once, for the throughput rows.
    #[arg(long, default_value_t = 8)]
    sessions: usize,
}

/// The command both sides run: the cheapest there is, so that what is measured is the
/// path to it.
const COMMAND: &str = "true";

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let server = arl_testkit::NatsServer::start()?;
    let files = tempfile::Builder::new()
        .prefix("arl-bench-mcp-")
        .tempdir()?;
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(files.path(), std::fs::Permissions::from_mode(0o755))?;
    }
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
    let shutdown = Shutdown::new();
    let mut config = SandboxConfig::local(
        files.path().join("state"),
        files.path().join("environments"),
        init,
    );
    config.pool_min_idle = 0;
    SandboxService::start_local(bus.clone(), config, "127.0.0.1:0".parse()?, &shutdown).await?;

    let keys = Arc::new(Keys::default());
    let mcp = Mcp::new(
        keys.clone(),
        SandboxClient::new(bus.clone()),
        McpConfig::default(),
    );
    // No engine: tool calls need none.
    let backends = Arc::new(Backends::new(vec![(
        Dialect::Arl,
        "http://127.0.0.1:9".into(),
    )]));
    let proxy = Proxy::new(
        bus.clone(),
        keys.clone(),
        mcp.clone(),
        backends,
        ProxyConfig::default(),
    );
    let addr =
        arl_runtime::http::serve("127.0.0.1:0".parse()?, api::router(proxy), &shutdown).await?;
    arl_proxy::service::serve_keys(&bus, keys, mcp, "p1", &format!("http://{addr}"), &shutdown)
        .await?;

    // Direct: a lease of the same environment, exec over its HTTP API.
    let sandbox = SandboxClient::new(bus.clone());
    let lease = scratch_lease(&sandbox).await?;
    let mut direct = Vec::with_capacity(args.calls);
    for _ in 0..args.calls {
        let started = Instant::now();
        exec(&lease).await?;
        direct.push(started.elapsed());
    }

    // Through MCP: one session, first call leases its sandbox (not measured).
    let http = HttpJson::default();
    let mut session = McpCaller::open(&bus, &http, "trial-0").await?;
    session.call().await?;
    let mut through_mcp = Vec::with_capacity(args.calls);
    for _ in 0..args.calls {
        let started = Instant::now();
        session.call().await?;
        through_mcp.push(started.elapsed());
    }

    // Throughput: `sessions` at once for a fixed number of calls each, both sides.
    let per_session = (args.calls / 2).max(10);
    let mut leases = Vec::new();
    for _ in 0..args.sessions {
        leases.push(scratch_lease(&sandbox).await?);
    }
    let started = Instant::now();
    let runs = leases.iter().map(|lease| async move {
        for _ in 0..per_session {
            exec(lease).await?;
        }
        anyhow::Ok(())
    });
    futures::future::try_join_all(runs).await?;
    let direct_rate = (args.sessions * per_session) as f64 / started.elapsed().as_secs_f64();
    let mut sessions = Vec::new();
    for i in 0..args.sessions {
        let mut s = McpCaller::open(&bus, &http, &format!("trial-{}", i + 1)).await?;
        s.call().await?;
        sessions.push(s);
    }
    let started = Instant::now();
    let runs = sessions.iter_mut().map(|s| async move {
        for _ in 0..per_session {
            s.call().await?;
        }
        anyhow::Ok(())
    });
    futures::future::try_join_all(runs).await?;
    let mcp_rate = (args.sessions * per_session) as f64 / started.elapsed().as_secs_f64();

    println!(
        "\nMCP tool call (`run_shell {COMMAND}`) vs the same command on a lease directly, bubblewrap sandboxes, same run"
    );
    println!(
        "| path | p50 ms | p99 ms | p50 / direct | calls/s, 1 at a time | calls/s, {} sessions at once |",
        args.sessions
    );
    println!("|---|---|---|---|---|---|");
    let (d50, d99) = percentiles(&mut direct);
    let (m50, m99) = percentiles(&mut through_mcp);
    println!(
        "| direct: Lease::exec (sandbox exec API) | {:.2} | {:.2} | 1.00 | {:.0} | {:.0} |",
        d50 * 1e3,
        d99 * 1e3,
        1.0 / d50,
        direct_rate
    );
    println!(
        "| MCP: tools/call through the proxy | {:.2} | {:.2} | {:.2} | {:.0} | {:.0} |",
        m50 * 1e3,
        m99 * 1e3,
        m50 / d50,
        1.0 / m50,
        mcp_rate
    );
    println!(
        "\nMCP overhead per call (p50): {:.2} ms; throughput with {} sessions: {:.2}x the direct path's",
        (m50 - d50) * 1e3,
        args.sessions,
        mcp_rate / direct_rate
    );
    shutdown.trigger();
    Ok(())
}

/// A lease of the environment MCP sessions use, for the direct side.
async fn scratch_lease(sandbox: &SandboxClient) -> anyhow::Result<Lease> {
    let request = LeaseRequestV1 {
        run_id: RunId::new("run-bench")?,
        trial_id: None,
        environment: EnvironmentRef {
            name: "scratch".into(),
            digest: None,
        },
        ttl_s: 600,
        limits: SandboxLimits::default(),
    };
    Ok(sandbox.lease(&request, Duration::from_secs(60)).await?)
}

async fn exec(lease: &Lease) -> anyhow::Result<()> {
    let result = lease
        .exec(&ExecRequest {
            command: COMMAND.into(),
            timeout_s: 10.0,
            env: Default::default(),
            stdin: None,
        })
        .await?;
    anyhow::ensure!(
        result.exit_code == 0,
        "{COMMAND} exited {}",
        result.exit_code
    );
    Ok(())
}

fn percentiles(samples: &mut [Duration]) -> (f64, f64) {
    samples.sort();
    let at = |q: f64| samples[((samples.len() as f64 - 1.0) * q).round() as usize].as_secs_f64();
    (at(0.5), at(0.99))
}

/// A pooled HTTP/1.1 client posting JSON.
#[derive(Clone)]
struct HttpJson(
    hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        http_body_util::Full<bytes::Bytes>,
    >,
);

impl Default for HttpJson {
    fn default() -> Self {
        Self(
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build_http(),
        )
    }
}

/// One MCP session of one trial, calling `run_shell` as a client would.
struct McpCaller {
    http: HttpJson,
    url: String,
    session: String,
    next_id: u64,
}

impl McpCaller {
    async fn open(bus: &Bus, http: &HttpJson, trial: &str) -> anyhow::Result<Self> {
        let grant: TrialKeyGrantV1 = bus
            .request(
                bus.namespace().proxy_rpc("any", ProxyOp::Issue),
                &TrialKeyRequestV1 {
                    run_id: RunId::new("run-bench")?,
                    trial_id: TrialId::new(trial)?,
                    policy_version: 0,
                    max_staleness: None,
                },
                Duration::from_secs(10),
            )
            .await?;
        let url = grant
            .mcp_url
            .ok_or_else(|| anyhow::anyhow!("the key grant has no mcp_url"))?;
        let mut caller = Self {
            http: http.clone(),
            url,
            session: String::new(),
            next_id: 0,
        };
        let (session, _) = caller
            .post(
                json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
                "protocolVersion": "2025-06-18", "capabilities": {},
                "clientInfo": {"name": "arl-bench-mcp", "version": "0"}}}),
            )
            .await?;
        caller.session =
            session.ok_or_else(|| anyhow::anyhow!("initialize gave no Mcp-Session-Id"))?;
        Ok(caller)
    }

    async fn call(&mut self) -> anyhow::Result<()> {
        self.next_id += 1;
        let (_, answer) = self
            .post(
                json!({"jsonrpc": "2.0", "id": self.next_id, "method": "tools/call",
                "params": {"name": "run_shell", "arguments": {"command": COMMAND}}}),
            )
            .await?;
        anyhow::ensure!(
            answer["result"]["isError"] == false,
            "run_shell {COMMAND}: {answer}"
        );
        Ok(())
    }

    async fn post(&self, body: Value) -> anyhow::Result<(Option<String>, Value)> {
        use http_body_util::BodyExt;
        let mut request = hyper::Request::post(&self.url)
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream");
        if !self.session.is_empty() {
            request = request
                .header("mcp-session-id", &self.session)
                .header("mcp-protocol-version", "2025-06-18");
        }
        let response = self
            .http
            .0
            .request(request.body(http_body_util::Full::new(body.to_string().into()))?)
            .await?;
        let session = response
            .headers()
            .get("mcp-session-id")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let bytes = response.into_body().collect().await?.to_bytes();
        Ok((session, serde_json::from_slice(&bytes)?))
    }
}
