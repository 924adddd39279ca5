//! Test harness shared by every crate's integration tests.
//!
//! - [`NatsServer`]: a private `nats-server -js` on a free port with its own store folder,
//!   stopped and cleaned up when dropped; it can be restarted on the same port and store.
//! - [`test_namespace`]: a fresh subject/stream prefix per test.
//! - [`wait_for`]: poll a condition with a deadline — tests never sleep blindly.
//! - [`built_binary`], [`Children`], [`ProcessGroup`], [`free_port`]: end-to-end tests start the real
//!   binaries on free ports and never leave them running.
//! - [`verl`]: VeRL-format dataset files (GSM8K rows with VeRL's nested Parquet schema).
//! - [`smollm2`], [`running_run_state`]: the installed test model, and a run's state as the
//!   controller records it once running.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use arl_schemas::Namespace;

pub mod kafka;
pub mod verl;

/// The oldest server with the JetStream features ARL uses.
const MIN_VERSION: (u32, u32) = (2, 10);

/// A `nats-server -js` child process owned by one test.
#[derive(Debug)]
pub struct NatsServer {
    binary: PathBuf,
    port: u16,
    store: tempfile::TempDir,
    /// Server configuration beyond the port and the store (TLS, authorization).
    config: Option<String>,
    child: Option<Child>,
}

impl NatsServer {
    /// Starts a server on a free port with a fresh store and waits until it accepts
    /// connections.
    pub fn start() -> anyhow::Result<Self> {
        Self::start_configured(None)
    }

    /// Starts a server whose configuration file also holds `config` (nats-server's
    /// syntax: `tls { … }`, `authorization { … }`).
    pub fn start_with_config(config: &str) -> anyhow::Result<Self> {
        Self::start_configured(Some(config.to_owned()))
    }

    fn start_configured(config: Option<String>) -> anyhow::Result<Self> {
        let binary = find_nats_server()?;
        let port = free_port()?;
        let store = tempfile::Builder::new().prefix("arl-nats-").tempdir()?;
        let mut server = Self {
            binary,
            port,
            store,
            config,
            child: None,
        };
        server.spawn()?;
        Ok(server)
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server's process id while it runs (to pin it to cores, say).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn store_dir(&self) -> &Path {
        self.store.path()
    }

    /// Stops the server the way an operator would (SIGTERM, then wait).
    pub fn stop(&mut self) -> anyhow::Result<()> {
        if let Some(mut child) = self.child.take() {
            if !signal("-TERM", &child.id().to_string()) {
                child.kill()?;
            }
            let deadline = Instant::now() + Duration::from_secs(15);
            loop {
                if child.try_wait()?.is_some() {
                    break;
                }
                if Instant::now() > deadline {
                    child.kill()?;
                    child.wait()?;
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Ok(())
    }

    /// Stops and starts the server again on the same port and store.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.stop()?;
        self.spawn()
    }

    /// Starts a server that was stopped.
    pub fn resume(&mut self) -> anyhow::Result<()> {
        if self.child.is_some() {
            bail!("the server is already running");
        }
        self.spawn()
    }

    fn spawn(&mut self) -> anyhow::Result<()> {
        let log = std::fs::File::create(self.store.path().join("server.log"))?;
        let mut command = Command::new(&self.binary);
        command
            .args([
                "-js",
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-sd",
            ])
            .arg(self.store.path().join("jetstream"));
        if let Some(config) = &self.config {
            let file = self.store.path().join("server.conf");
            std::fs::write(&file, config)?;
            command.arg("-c").arg(file);
        }
        let child = command
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| format!("cannot start {}", self.binary.display()))?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                let log = std::fs::read_to_string(self.store.path().join("server.log"))
                    .unwrap_or_default();
                bail!("nats-server exited with {status} before accepting connections:\n{log}");
            }
            if Instant::now() > deadline {
                bail!(
                    "nats-server did not accept connections on port {} within 20 s",
                    self.port
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// `$ARL_NATS_SERVER`, else the one `make deps` installs, else `nats-server` on `PATH` if
/// it is recent enough.
pub fn find_nats_server() -> anyhow::Result<PathBuf> {
    let mut candidates = Vec::new();
    if let Some(path) = std::env::var_os("ARL_NATS_SERVER") {
        candidates.push(PathBuf::from(path));
    }
    if let Some(home) = std::env::var_os("HOME") {
        candidates.push(PathBuf::from(home).join(".cache/arl/tools/bin/nats-server"));
    }
    candidates.push(PathBuf::from("nats-server"));
    let mut rejected = Vec::new();
    for candidate in candidates {
        match server_version(&candidate) {
            Some(version) if version >= MIN_VERSION => return Ok(candidate),
            Some((major, minor)) => {
                rejected.push(format!("{} is {major}.{minor}", candidate.display()));
            }
            None => {}
        }
    }
    bail!(
        "no nats-server {}.{} or newer found ({}); run `make deps`, or set ARL_NATS_SERVER",
        MIN_VERSION.0,
        MIN_VERSION.1,
        if rejected.is_empty() {
            "none installed".to_owned()
        } else {
            rejected.join(", ")
        }
    )
}

fn server_version(binary: &Path) -> Option<(u32, u32)> {
    let output = Command::new(binary).arg("--version").output().ok()?;
    let text = String::from_utf8_lossy(&output.stdout);
    let version = text.trim().rsplit('v').next()?;
    let mut parts = version.split('.');
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

/// A port nothing listens on right now.
pub fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// A workspace binary beside the running test (`target/<profile>/deps/t-…` →
/// `target/<profile>/<name>`); `cargo build --bins` (`make test` does) must have built it.
pub fn built_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test's own path");
    let path = exe
        .parent()
        .and_then(Path::parent)
        .expect("tests run from target/<profile>/deps")
        .join(name);
    assert!(
        path.exists(),
        "{} is missing; run `cargo build --bins` first",
        path.display()
    );
    path
}

/// Child processes stopped and reaped when dropped, however the test ends: SIGTERM first,
/// so that one with processes of its own (`arl up` and its services) stops them, then
/// SIGKILL for any still running after 10 s.
pub struct Children(pub Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for child in &mut self.0 {
            if matches!(child.try_wait(), Ok(None)) {
                let _ = signal("-TERM", &child.id().to_string());
            }
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        for child in &mut self.0 {
            while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Waits for `arl up` (the child `up`, on `state_dir`) to write `nats-url`, which it does
/// once every service reports ready; the bus URL. Fails at once, with the exit status, when
/// `arl up` stops first (a service that could not start stops it) rather than at `timeout`.
pub async fn wait_for_arl_up(up: &mut Child, state_dir: &Path, timeout: Duration) -> String {
    let url_file = state_dir.join("nats-url");
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(url) = std::fs::read_to_string(&url_file)
            .ok()
            .filter(|url| !url.is_empty())
        {
            return url;
        }
        if let Ok(Some(status)) = up.try_wait() {
            panic!("arl up stopped before it was ready ({status}); its log is above");
        }
        if tokio::time::Instant::now() > deadline {
            panic!("timed out after {timeout:?} waiting for arl up");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A child started as the leader of its own process group
/// (`std::os::unix::process::CommandExt::process_group(0)`), killed with every process it
/// started when dropped — for servers whose workers would outlive it (vLLM's engine).
pub struct ProcessGroup(pub Child);

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        let _ = signal("-KILL", &format!("-{}", self.0.id()));
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Sends `signal` to `target` (a pid, or `-pgid` for a process group); whether it went.
fn signal(signal: &str, target: &str) -> bool {
    Command::new("kill")
        .args([signal, "--", target])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

/// Where `make models` installs models: `$ARL_MODEL_DIR`, else `~/.cache/arl/models` —
/// `arl_runtime::args::default_model_dir`, which testkit cannot call (the runtime's tests
/// use testkit).
pub fn model_dir() -> PathBuf {
    std::env::var_os("ARL_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/arl/models")
        })
}

/// SmolLM2-135M-Instruct's GGUF as `make models` installs it (in [`model_dir`]); a test
/// without it fails saying what to run.
pub fn smollm2() -> PathBuf {
    let path = model_dir().join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        path.exists(),
        "{} is missing: run `make models`",
        path.display()
    );
    path
}

/// The controller's record of run `run` training `spec` on `model`, admitted and running
/// at step 0, as services that check their run find it in the run-state bucket.
pub fn running_run_state(
    run: &arl_schemas::RunId,
    name: &str,
    spec: &arl_schemas::spec::RunSpec,
    model: &Path,
) -> arl_schemas::state::RunStateV1 {
    let state = serde_json::json!({
        "run_id": run, "name": name, "status": "running", "phase": "training",
        "submitted_by": "test", "submitted_at": "2026-11-30T00:00:00Z",
        "updated_at": "2026-11-30T00:00:00Z", "spec": spec,
        "model_path": model.display().to_string(), "total_steps": spec.trainer.total_steps,
        "step": 0, "policy_version": 0, "trials_finished": 0,
        "failures": {"infrastructure": 0, "agent_error": 0, "timeout": 0,
                     "context_overflow": 0, "grading_error": 0},
        "progress_sequence": 0
    });
    serde_json::from_value(state).expect("a valid run state")
}

/// A namespace no other test uses, so tests can share one server.
pub fn test_namespace() -> Namespace {
    let id = uuid::Uuid::new_v4().simple().to_string();
    Namespace::with_prefix(&format!("t{}", &id[..12])).expect("generated prefix is valid")
}

/// Polls `condition` every 20 ms until it returns `Some`, or fails after `timeout`.
pub async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, mut condition: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(value) = condition().await {
            return value;
        }
        if tokio::time::Instant::now() > deadline {
            panic!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A response from [`http`].
#[derive(Debug)]
pub struct HttpResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl HttpResponse {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json<T: serde::de::DeserializeOwned>(&self) -> T {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|err| panic!("not the JSON expected ({err}): {}", self.text()))
    }
}

/// A minimal HTTP/1.1 client for tests (one request per connection).
pub async fn http(
    url: &str,
    method: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> anyhow::Result<HttpResponse> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let rest = url.strip_prefix("http://").context("only http:// URLs")?;
    let (authority, path) = rest
        .split_once('/')
        .map_or((rest, "/".to_owned()), |(a, p)| (a, format!("/{p}")));
    let mut stream = tokio::net::TcpStream::connect(authority).await?;
    let mut request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str("\r\n");
    stream.write_all(request.as_bytes()).await?;
    stream.write_all(body).await?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await?;
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .context("no end of headers")?;
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .context("no status line")?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let mut body = raw[split + 4..].to_vec();
    if headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"))
    {
        body = dechunk(&body)?;
    }
    Ok(HttpResponse {
        status,
        headers,
        body,
    })
}

fn dechunk(mut data: &[u8]) -> anyhow::Result<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let line_end = data
            .windows(2)
            .position(|w| w == b"\r\n")
            .context("bad chunk")?;
        let size = usize::from_str_radix(String::from_utf8_lossy(&data[..line_end]).trim(), 16)?;
        data = &data[line_end + 2..];
        if size == 0 {
            return Ok(out);
        }
        out.extend_from_slice(&data[..size]);
        data = &data[size + 2..];
    }
}
