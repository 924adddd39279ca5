//! `arl up`: every ARL service on this machine, as child processes of this one, with a
//! private `nats-server` when NATS_URL is not given. The state (JetStream store,
//! environments, sandboxes, checkpoints, logs) lives under one folder. Ctrl-C stops
//! everything; a service that exits on its own stops everything too, with its log's tail
//! — `arl up` never restarts one behind your back. With `--supervise` it does, in the open:
//! a child that exits (any exit, SIGKILL included) is started again with the same
//! arguments after a backoff, and the restart is printed with the exit status; the private
//! nats-server keeps its port and store and syncs every JetStream write before it
//! acknowledges it, so its restart loses nothing. Each child's pid is in
//! `<state>/pids/<name>` while it runs (the chaos tests, `tests/tests/chaos.rs`, kill them
//! by it).
//!
//! "Up" means ready: each service's `/ready` answers 200 (the engine has its weights, the
//! proxy a backend that passed a health check, the trainer has probed its GPU …). Only
//! then does `arl up` say so and write `<state>/nats-url`, which `make run` waits for.
//!
//! What to watch it with is written beside it: `<state>/metrics-targets.json` (every
//! service's `/metrics` address, picked at start) and `<state>/prometheus.yml` (a scrape
//! config for them), TensorBoard scalars under `<state>/tensorboard`, and with `--traces`
//! a Phoenix trace UI that every service exports its spans to.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use arl_schemas::permissions::Role;

use crate::cli::{BusArgs, UpArgs};
use crate::run::CliError;

/// One service under `arl up`: its binary, arguments, and the port of its ops endpoints
/// (`/ready`, `/health`, `/metrics`).
struct ServiceSpec {
    name: &'static str,
    args: Vec<String>,
    ops_port: u16,
}

/// The services, in start order, with their arguments under `arl up`.
fn services(
    args: &UpArgs,
    state: &Path,
    engine: u16,
    proxy: u16,
) -> Result<Vec<ServiceSpec>, CliError> {
    let s = |p: &Path| p.display().to_string();
    let environments = state.join("environments");
    let socket = state.join("proxy.sock");
    let mut recipes = Vec::new();
    for file in &args.swebench_recipes {
        recipes.push("--swebench-recipes".to_owned());
        recipes.push(s(file));
    }
    let sandbox_api = free_port()?;
    let mut sandbox = vec![
        "--api-addr".into(),
        format!("127.0.0.1:{sandbox_api}"),
        "--state-dir".into(),
        s(&state.join("sandbox")),
        "--environments-dir".into(),
        s(&environments),
        "--proxy-socket".into(),
        s(&socket),
        "--pool-min-idle".into(),
        "0".into(),
    ];
    if let Some(agents) = &args.agents_dir {
        sandbox.extend(["--agents-dir".into(), s(agents)]);
    }
    let mut imagebuilder = vec!["--environments-dir".into(), s(&environments)];
    imagebuilder.extend(recipes.iter().cloned());
    let controller = vec!["--tensorboard-dir".into(), s(&state.join("tensorboard"))];
    let list = vec![
        ("arl-controller", controller, None),
        ("arl-dataset", vec![], None),
        ("arl-imagebuilder", imagebuilder, None),
        ("arl-sandbox", sandbox, Some(sandbox_api)),
        (
            "arl-inference",
            vec![
                "--model".into(),
                args.model.clone(),
                "--listen".into(),
                format!("127.0.0.1:{engine}"),
                "--weights-dir".into(),
                s(&state.join("runs")),
            ],
            Some(engine),
        ),
        (
            "arl-proxy",
            vec![
                "--backend".into(),
                format!("arl=http://127.0.0.1:{engine}"),
                "--listen".into(),
                format!("127.0.0.1:{proxy}"),
                "--listen-unix".into(),
                s(&socket),
            ],
            Some(proxy),
        ),
        ("arl-reward", recipes, None),
        (
            "arl-rollout",
            vec!["--concurrency".into(), args.rollout_concurrency.to_string()],
            None,
        ),
        (
            "arl-trainer",
            vec!["--runs-dir".into(), s(&state.join("runs"))],
            None,
        ),
        ("arl-evaluator", vec![], None),
    ];
    list.into_iter()
        .map(|(name, args, ops)| {
            Ok(ServiceSpec {
                name,
                args,
                // Services whose ops routes share their API's listener use that port;
                // the others get one through ARL_HTTP_ADDR.
                ops_port: match ops {
                    Some(port) => port,
                    None => free_port()?,
                },
            })
        })
        .collect()
}

/// Why the sandbox user (uid 65534, "others" to every folder here) cannot reach `dir`:
/// the outermost folder on its path without the search (x) permission for others.
pub(crate) fn untraversable(dir: &Path) -> Option<(PathBuf, u32)> {
    use std::os::unix::fs::PermissionsExt;
    let absolute = std::path::absolute(dir).ok()?;
    let mut path: Vec<&Path> = absolute.ancestors().collect();
    path.reverse();
    path.into_iter().find_map(|folder| {
        let mode = std::fs::metadata(folder).ok()?.permissions().mode();
        (mode & 0o001 == 0).then(|| (folder.to_path_buf(), mode & 0o777))
    })
}

/// GET `/ready` on a service's ops port: Ok when ready, else what it waits for.
async fn ready(port: u16) -> Result<(), String> {
    probe(port, "/ready").await
}

/// GET `path` on a loopback port: Ok on 200, else why not (a JSON `waiting_for` if given).
async fn probe(port: u16, path: &str) -> Result<(), String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let connect = tokio::net::TcpStream::connect(("127.0.0.1", port));
    let mut stream = match tokio::time::timeout(Duration::from_secs(2), connect).await {
        Ok(Ok(stream)) => stream,
        _ => return Err("starting".into()),
    };
    let request = format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
    if stream.write_all(request.as_bytes()).await.is_err() {
        return Err("starting".into());
    }
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut answer));
    if !matches!(read.await, Ok(Ok(_))) {
        return Err("not answering".into());
    }
    let text = String::from_utf8_lossy(&answer);
    if text.starts_with("HTTP/1.1 200") || text.starts_with("HTTP/1.0 200") {
        return Ok(());
    }
    let waiting = text
        .split_once("\r\n\r\n")
        .and_then(|(_, body)| serde_json::from_str::<serde_json::Value>(body).ok())
        .and_then(|body| body["waiting_for"].as_str().map(str::to_owned))
        .unwrap_or_else(|| "not ready".into());
    Err(format!("waiting for {waiting}"))
}

/// The nats-server to start ([`arl_runtime::nats_server::find`]), refused when it cannot
/// run or reports a version older than ARL needs — before anything starts on it.
pub(crate) fn nats_server_program() -> Result<PathBuf, String> {
    use arl_runtime::nats_server::{MIN_VERSION, find, version_of};
    let program = find();
    let named_by = if std::env::var_os("ARL_NATS_SERVER").is_some_and(|p| !p.is_empty()) {
        "ARL_NATS_SERVER"
    } else {
        "the nats-server found"
    };
    match version_of(&program) {
        Some(version) if version >= MIN_VERSION => Ok(program),
        Some(version) => Err(format!(
            "{named_by} ({}): nats-server {version} is too old: ARL needs {MIN_VERSION} or \
             newer; run `make deps` (it installs one into ~/.cache/arl/tools/bin) or set \
             ARL_NATS_SERVER to a newer one",
            program.display()
        )),
        None => Err(format!(
            "{named_by} ({}) does not run or report its version (`{} --version`); run \
             `make deps` (it installs nats-server {MIN_VERSION}+ into ~/.cache/arl/tools/bin) \
             or set ARL_NATS_SERVER to a nats-server {MIN_VERSION} or newer",
            program.display(),
            program.display()
        )),
    }
}

/// A free TCP port on loopback, below the kernel's range of ephemeral ports. A port picked
/// here is bound by its service only seconds later (and again at each restart), while every
/// service opens connections; an ephemeral port (what port 0 gives) may meanwhile become
/// the local end of one of those, and then the listener never binds — a restart loop under
/// `--supervise`. Outside that range only another listener can take it.
///
/// A port is free when drawn but bound only later, so two draws of one `arl up` could name
/// the same port (one chance in a few hundred for a dozen services): the ports handed out
/// are remembered and never handed out again by this process.
pub(crate) fn free_port() -> Result<u16, CliError> {
    use std::hash::{BuildHasher, Hasher};
    static HANDED_OUT: std::sync::Mutex<std::collections::BTreeSet<u16>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    let mut handed_out = HANDED_OUT
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    const FLOOR: u16 = 10_000;
    let ceiling = ephemeral_floor();
    if ceiling > FLOOR + 1_000 {
        for _ in 0..200 {
            // A random draw: RandomState is seeded from the OS for each instance.
            let draw = std::collections::hash_map::RandomState::new()
                .build_hasher()
                .finish();
            let port = FLOOR + (draw % u64::from(ceiling - FLOOR)) as u16;
            if !handed_out.contains(&port)
                && std::net::TcpListener::bind(("127.0.0.1", port)).is_ok()
            {
                handed_out.insert(port);
                return Ok(port);
            }
        }
    }
    loop {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(io)?;
        let port = listener.local_addr().map_err(io)?.port();
        if handed_out.insert(port) {
            return Ok(port);
        }
    }
}

/// The lowest ephemeral port (`/proc/sys/net/ipv4/ip_local_port_range`; Linux's default
/// 32768 where it cannot be read).
fn ephemeral_floor() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

fn io(err: std::io::Error) -> CliError {
    CliError::Usage(err.to_string())
}

/// The first wait before a supervised child is started again; it doubles with each exit
/// up to [`MAX_BACKOFF`], and is back to this once the child stayed up [`STABLE_AFTER`].
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
const MAX_BACKOFF: Duration = Duration::from_secs(10);
const STABLE_AFTER: Duration = Duration::from_secs(60);

/// After a child that ran for `up_for` exits with the backoff at `current`: how long to
/// wait before starting it again, and the backoff for its next exit.
fn backoff(current: Duration, up_for: Duration) -> (Duration, Duration) {
    let delay = if up_for >= STABLE_AFTER {
        FIRST_BACKOFF
    } else {
        current
    };
    (delay, (delay * 2).min(MAX_BACKOFF))
}

/// One child of `arl up` and what it takes to start it again.
struct Supervised {
    name: String,
    program: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
    log: PathBuf,
    /// None while it waits to be started again.
    process: Option<Child>,
    started: Instant,
    /// The wait before the next restart.
    backoff: Duration,
    restart_at: Option<Instant>,
    restarts: u32,
}

/// Every child of `arl up`, in start order; stopped (last first) when dropped.
struct Children {
    list: Vec<Supervised>,
    logs: PathBuf,
    /// `<state>/pids`: one file per running child, named like its log, holding its pid.
    pids: PathBuf,
    /// Restart a child that exits instead of stopping everything.
    supervise: bool,
}

impl Drop for Children {
    fn drop(&mut self) {
        for child in self.list.iter_mut().rev() {
            if let Some(process) = child.process.as_mut() {
                let _ = process.kill();
                let _ = process.wait();
            }
            let _ = std::fs::remove_file(self.pids.join(&child.name));
        }
    }
}

impl Children {
    fn new(state: &Path, logs: &Path, supervise: bool) -> Result<Self, CliError> {
        let pids = state.join("pids");
        std::fs::create_dir_all(&pids).map_err(io)?;
        Ok(Self {
            list: Vec::new(),
            logs: logs.to_path_buf(),
            pids,
            supervise,
        })
    }

    /// Starts `program` as the child `name` (its log `<logs>/<name>.log`); returns the log.
    fn start(
        &mut self,
        name: &str,
        program: PathBuf,
        args: Vec<String>,
        env: Vec<(String, String)>,
    ) -> Result<PathBuf, CliError> {
        let log = self.logs.join(format!("{name}.log"));
        let mut child = Supervised {
            name: name.to_owned(),
            program,
            args,
            env,
            log: log.clone(),
            process: None,
            started: Instant::now(),
            backoff: FIRST_BACKOFF,
            restart_at: None,
            restarts: 0,
        };
        let process = spawn(&child, false)?;
        write_pid(&self.pids, name, process.id()).map_err(io)?;
        child.process = Some(process);
        self.list.push(child);
        Ok(log)
    }

    /// Looks at every child: without `--supervise`, the first that exited stops `arl up`
    /// (exit code 1, after printing its log's tail); with it, one that exited is started
    /// again once its backoff has passed.
    fn check(&mut self) -> Option<std::process::ExitCode> {
        let now = Instant::now();
        for index in 0..self.list.len() {
            let child = &mut self.list[index];
            let Some(process) = child.process.as_mut() else {
                if child.restart_at.is_some_and(|at| at <= now) {
                    self.restart(index);
                }
                continue;
            };
            let Ok(Some(status)) = process.try_wait() else {
                continue;
            };
            child.process = None;
            let _ = std::fs::remove_file(self.pids.join(&child.name));
            if !self.supervise {
                eprintln!(
                    "{} exited ({status}); stopping ARL. Its log ends:\n{}",
                    child.name,
                    tail(&child.log)
                );
                return Some(std::process::ExitCode::from(1));
            }
            let up_for = child.started.elapsed();
            let (delay, next) = backoff(child.backoff, up_for);
            child.backoff = next;
            child.restart_at = Some(now + delay);
            eprintln!(
                "{} exited ({status}) after {:.1} s; restarting it in {} s (--supervise). \
                 Its log ends:\n{}",
                child.name,
                up_for.as_secs_f64(),
                delay.as_secs(),
                tail(&child.log)
            );
        }
        None
    }

    /// Starts the `index`-th child again, with the same program, arguments and environment;
    /// a start that fails is tried again after the next backoff.
    fn restart(&mut self, index: usize) {
        let child = &mut self.list[index];
        child.restart_at = None;
        child.restarts += 1;
        child.started = Instant::now();
        match spawn(child, true) {
            Ok(process) => {
                let _ = write_pid(&self.pids, &child.name, process.id());
                eprintln!(
                    "{} restarted (pid {}, restart {})",
                    child.name,
                    process.id(),
                    child.restarts
                );
                child.process = Some(process);
            }
            Err(err) => {
                let (delay, next) = backoff(child.backoff, Duration::ZERO);
                child.backoff = next;
                child.restart_at = Some(Instant::now() + delay);
                eprintln!("{err}; trying again in {} s", delay.as_secs());
            }
        }
    }
}

/// `<pids>/<name>` ← `pid`, replaced whole (written aside, then renamed), so a reader
/// never sees half a number.
fn write_pid(pids: &Path, name: &str, pid: u32) -> std::io::Result<()> {
    let aside = pids.join(format!(".{name}.new"));
    std::fs::write(&aside, format!("{pid}\n"))?;
    std::fs::rename(aside, pids.join(name))
}

/// Starts `child`'s program; a restart appends to its log (after a line saying so)
/// instead of starting a new one.
fn spawn(child: &Supervised, again: bool) -> Result<Child, CliError> {
    let file = if again {
        use std::io::Write;
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(&child.log)
            .map_err(io)?;
        let _ = writeln!(
            file,
            "--- arl up --supervise: started again ({})",
            chrono::Utc::now().to_rfc3339()
        );
        file
    } else {
        std::fs::File::create(&child.log).map_err(io)?
    };
    // Through setpriv, each child gets SIGTERM when `arl up` dies, however it dies (even
    // SIGKILL): nothing is left running. The trace UI holds nothing that needs draining
    // (and its Python server can take long to stop): it is killed outright. setpriv
    // execs the program, so the child's pid is the program's.
    let signal = if child.name == "phoenix" {
        "KILL"
    } else {
        "TERM"
    };
    let mut command = Command::new("setpriv");
    command
        .args(["--pdeathsig", signal, "--"])
        .arg(&child.program);
    command
        .args(&child.args)
        .envs(child.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .stdout(Stdio::null())
        .stderr(file)
        .spawn()
        .map_err(|e| {
            CliError::Usage(format!(
                "cannot start {} through setpriv: {e} (build the services first: cargo build \
                 --workspace --bins; setpriv comes with util-linux)",
                child.program.display()
            ))
        })
}

fn tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

pub async fn execute(
    bus: &BusArgs,
    args: UpArgs,
    nats_url_given: bool,
) -> Result<std::process::ExitCode, CliError> {
    let state = args.state_dir.clone();
    let logs = state.join("logs");
    std::fs::create_dir_all(&logs).map_err(io)?;
    // Sandboxes run as an unprivileged user, which must reach their trees and the socket.
    for dir in [&state, &state.join("environments")] {
        std::fs::create_dir_all(dir).map_err(io)?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).map_err(io)?;
    }
    // arl up opens the state folder itself; the folders above it must let the user in.
    if let Some((folder, mode)) = untraversable(&state) {
        return Err(CliError::Usage(format!(
            "--state-dir {}: sandboxes run as an unprivileged user, which cannot traverse {} \
             (mode {mode:o}); choose a folder it can reach (e.g. under /tmp) or `chmod o+x {}`",
            state.display(),
            folder.display(),
            folder.display()
        )));
    }
    let bin = std::env::current_exe()
        .map_err(io)?
        .parent()
        .map(Path::to_path_buf)
        .ok_or_else(|| CliError::Usage("cannot tell where arl is installed".into()))?;
    let mut children = Children::new(&state, &logs, args.supervise)?;
    if args.least_privilege && nats_url_given {
        return Err(CliError::Usage(
            "--least-privilege configures arl up's own nats-server; unset NATS_URL".into(),
        ));
    }
    let namespace = arl_schemas::Namespace::from_option(Some(bus.prefix.as_str()))
        .map_err(|e| CliError::Usage(e.to_string()))?;
    let least_privilege = if args.least_privilege {
        Some(crate::natsconf::write(&state.join("nats"), &namespace).map_err(io)?)
    } else {
        None
    };
    let url = if nats_url_given {
        bus.nats_url.clone()
    } else {
        let server = nats_server_program().map_err(CliError::Usage)?;
        let port = free_port()?;
        let mut server_args = vec![
            "-js".into(),
            "-a".into(),
            "127.0.0.1".into(),
            "-p".into(),
            port.to_string(),
            "-sd".into(),
            state.join("jetstream").display().to_string(),
        ];
        if args.supervise {
            let config = supervised_server_config(&state, least_privilege.as_ref())?;
            server_args.extend(["-c".into(), config.display().to_string()]);
        } else if let Some(written) = &least_privilege {
            server_args.extend(["-c".into(), written.config.display().to_string()]);
        }
        children.start("nats-server", server, server_args, Vec::new())?;
        let url = format!("nats://127.0.0.1:{port}");
        for _ in 0..100 {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        url
    };
    let traces = if args.traces {
        Some(start_phoenix(&state, &mut children).await?)
    } else {
        None
    };
    let (engine, proxy) = (free_port()?, free_port()?);
    let mut env = vec![
        ("NATS_URL".to_owned(), url.clone()),
        ("ARL_PREFIX".to_owned(), bus.prefix.clone()),
    ];
    if let Some(ui) = &traces {
        env.push(("OTEL_EXPORTER_OTLP_ENDPOINT".to_owned(), ui.clone()));
    }
    let specs = services(&args, &state, engine, proxy)?;
    for service in &specs {
        let mut env = env.to_vec();
        env.push((
            "ARL_HTTP_ADDR".to_owned(),
            format!("127.0.0.1:{}", service.ops_port),
        ));
        if let Some(written) = &least_privilege {
            let role = Role::of_binary(service.name).ok_or_else(|| {
                CliError::Usage(format!("{} has no role on the bus", service.name))
            })?;
            env.push((
                "NATS_NKEY".to_owned(),
                written.seed(role).display().to_string(),
            ));
            env.push(("NATS_INBOX_PREFIX".to_owned(), role.inbox_prefix()));
        }
        // ARL's services are found beside `arl`.
        children.start(
            service.name,
            bin.join(service.name),
            service.args.clone(),
            env,
        )?;
    }
    println!(
        "starting ARL: NATS at {url}; state and logs in {}",
        state.display()
    );
    let mut interrupt = Box::pin(tokio::signal::ctrl_c());
    let mut terminate =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).map_err(io)?;
    let started = std::time::Instant::now();
    let mut last_report = started;
    loop {
        if let Some(code) = children.check() {
            return Ok(code);
        }
        let mut waiting = Vec::new();
        for service in &specs {
            if let Err(why) = ready(service.ops_port).await {
                waiting.push(format!("{} ({why})", service.name));
            }
        }
        if waiting.is_empty() {
            break;
        }
        if started.elapsed() > Duration::from_secs(args.ready_timeout_s) {
            eprintln!(
                "not ready after {} s: {}; see the logs in {}",
                args.ready_timeout_s,
                waiting.join(", "),
                logs.display()
            );
            return Ok(std::process::ExitCode::from(1));
        }
        if last_report.elapsed() >= Duration::from_secs(5) {
            println!("waiting for: {}", waiting.join(", "));
            last_report = std::time::Instant::now();
        }
        tokio::select! {
            _ = &mut interrupt => return Ok(std::process::ExitCode::SUCCESS),
            _ = terminate.recv() => return Ok(std::process::ExitCode::SUCCESS),
            _ = tokio::time::sleep(Duration::from_millis(250)) => {}
        }
    }
    // Written only now: whoever waits for this file (make run) submits to a ready system.
    std::fs::write(state.join("nats-url"), &url).map_err(io)?;
    println!(
        "ARL is up ({:.1} s): every service ready; NATS at {url}; state and logs in {}",
        started.elapsed().as_secs_f64(),
        state.display()
    );
    let endpoints: Vec<String> = specs
        .iter()
        .map(|s| format!("{}=http://127.0.0.1:{}", s.name, s.ops_port))
        .collect();
    println!(
        "ops endpoints (/ready /health /metrics): {}",
        endpoints.join(" ")
    );
    write_scrape_targets(&state, &specs).map_err(io)?;
    println!(
        "metrics: every address above serves /metrics; a Prometheus scrape config for them is {}",
        state.join("prometheus.yml").display()
    );
    println!(
        "training curves: tensorboard --logdir {}",
        state.join("tensorboard").display()
    );
    if let Some(ui) = &traces {
        std::fs::write(state.join("traces-url"), ui).map_err(io)?;
        println!(
            "traces: {ui} (Arize Phoenix; each trial is one trace, project \"{}\")",
            arl_runtime::telemetry::trace_project()
        );
    }
    match &least_privilege {
        Some(written) => println!(
            "submit a run with: NATS_URL={url} NATS_NKEY={} NATS_INBOX_PREFIX={} arl run submit examples/arithmetic.toml",
            written.seed(Role::Cli).display(),
            Role::Cli.inbox_prefix()
        ),
        None => {
            println!("submit a run with: NATS_URL={url} arl run submit examples/arithmetic.toml")
        }
    }
    loop {
        tokio::select! {
            _ = &mut interrupt => break,
            _ = terminate.recv() => break,
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
        if let Some(code) = children.check() {
            return Ok(code);
        }
    }
    println!("stopping ARL");
    Ok(std::process::ExitCode::SUCCESS)
}

/// `<state>/metrics-targets.json` (`{service: "http://host:port/metrics"}`) and
/// `<state>/prometheus.yml`, a scrape config with one job per service.
fn write_scrape_targets(state: &Path, specs: &[ServiceSpec]) -> std::io::Result<()> {
    let targets: serde_json::Map<String, serde_json::Value> = specs
        .iter()
        .map(|s| {
            (
                s.name.to_owned(),
                serde_json::Value::String(format!("http://127.0.0.1:{}/metrics", s.ops_port)),
            )
        })
        .collect();
    let json = serde_json::to_string_pretty(&targets).map_err(std::io::Error::other)?;
    std::fs::write(state.join("metrics-targets.json"), json)?;
    let mut yaml = String::from(
        "# Written by `arl up`: every ARL service's /metrics (ports are picked at each start).\n\
         global:\n  scrape_interval: 15s\nscrape_configs:\n",
    );
    for s in specs {
        yaml.push_str(&format!(
            "  - job_name: {}\n    static_configs:\n      - targets: [\"127.0.0.1:{}\"]\n",
            s.name, s.ops_port
        ));
    }
    std::fs::write(state.join("prometheus.yml"), yaml)
}

/// Starts Phoenix with its store under `<state>/phoenix`; returns its base URL (the UI,
/// and OTLP/HTTP at `/v1/traces`) once it answers.
async fn start_phoenix(state: &Path, children: &mut Children) -> Result<String, CliError> {
    let program = std::env::var_os("ARL_PHOENIX")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("phoenix"));
    let (http, grpc) = (free_port()?, free_port()?);
    let dir = state.join("phoenix");
    std::fs::create_dir_all(&dir).map_err(io)?;
    let env = [
        ("PHOENIX_HOST", "127.0.0.1".to_owned()),
        ("PHOENIX_PORT", http.to_string()),
        ("PHOENIX_GRPC_PORT", grpc.to_string()),
        ("PHOENIX_WORKING_DIR", dir.display().to_string()),
        // No telemetry home from a machine that may have no network.
        ("PHOENIX_TELEMETRY_ENABLED", "false".to_owned()),
    ]
    .map(|(k, v)| (k.to_owned(), v));
    let log = children
        .start("phoenix", program, vec!["serve".to_owned()], env.to_vec())
        .map_err(|e| {
            CliError::Usage(format!(
                "--traces needs Arize Phoenix: {e}; install it with `make observability` and set \
                 ARL_PHOENIX to its `phoenix` program (or put it on PATH)"
            ))
        })?;
    let started = std::time::Instant::now();
    while probe(http, "/healthz").await.is_err() {
        if started.elapsed() > Duration::from_secs(120) {
            return Err(CliError::Usage(format!(
                "Phoenix did not answer within 120 s; its log ends:\n{}",
                tail(&log)
            )));
        }
        // `check` prints the log's tail of whatever stopped.
        if children.check().is_some() {
            return Err(CliError::Usage(
                "Phoenix exited at start (see above)".into(),
            ));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    Ok(format!("http://127.0.0.1:{http}"))
}

/// `<state>/nats-server.conf` for `--supervise`: every JetStream write flushed and synced
/// before the server acknowledges it (`sync_interval: always`; the default syncs every
/// 2 min, so a server killed outright may lose events it acknowledged — then a trial or a
/// step would simply vanish), and the least-privilege users when asked for. A few
/// milliseconds per stored event, which ARL's event rates (tens a second) never notice.
fn supervised_server_config(
    state: &Path,
    least_privilege: Option<&crate::natsconf::Written>,
) -> Result<PathBuf, CliError> {
    let mut config = String::from(
        "# Written by `arl up --supervise`: nothing acknowledged is lost when the server is \
         killed.\njetstream {\n  sync_interval: always\n}\n",
    );
    if let Some(written) = least_privilege {
        config.push_str(&std::fs::read_to_string(&written.config).map_err(io)?);
    }
    let path = state.join("nats-server.conf");
    std::fs::write(&path, config).map_err(io)?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn the_backoff_doubles_to_ten_seconds_and_resets_after_a_stable_minute() {
        let short = Duration::from_secs(2);
        let mut wait = FIRST_BACKOFF;
        let mut delays = Vec::new();
        for _ in 0..6 {
            let (delay, next) = backoff(wait, short);
            delays.push(delay.as_secs());
            wait = next;
        }
        assert_eq!(delays, vec![1, 2, 4, 8, 10, 10]);
        let (delay, next) = backoff(wait, STABLE_AFTER);
        assert_eq!((delay, next), (FIRST_BACKOFF, FIRST_BACKOFF * 2));
    }

    #[test]
    fn ports_are_picked_below_the_ephemeral_range_and_are_free() {
        let floor = ephemeral_floor();
        for _ in 0..20 {
            let port = free_port().unwrap();
            assert!(port < floor || floor <= 11_000, "{port} ≥ {floor}");
            std::net::TcpListener::bind(("127.0.0.1", port)).unwrap();
        }
    }

    #[test]
    fn no_port_is_handed_out_twice() {
        // 1,000 draws over ~20,000 ports: without the memory of handed-out ports, two
        // would name the same one with near certainty (birthday bound).
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..1_000 {
            let port = free_port().unwrap();
            assert!(seen.insert(port), "port {port} handed out twice");
        }
    }

    fn pid_in(pids: &Path, name: &str) -> Option<u32> {
        std::fs::read_to_string(pids.join(name))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// Polls `children.check()` until `done` holds (10 s at most).
    fn check_until(children: &mut Children, mut done: impl FnMut(&mut Children) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !done(children) {
            assert!(
                children.check().is_none(),
                "a supervised child stopped arl up"
            );
            assert!(Instant::now() < deadline, "timed out");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    #[test]
    fn a_supervised_child_killed_outright_is_started_again_with_its_pid_file_current() {
        let tmp = tempfile::tempdir().unwrap();
        let logs = tmp.path().join("logs");
        std::fs::create_dir_all(&logs).unwrap();
        let mut children = Children::new(tmp.path(), &logs, true).unwrap();
        let args = vec![
            "-c".to_owned(),
            "echo sleeping >&2; exec sleep 60".to_owned(),
        ];
        children
            .start("sleeper", PathBuf::from("/bin/sh"), args, Vec::new())
            .unwrap();
        let pids = tmp.path().join("pids");
        let first = pid_in(&pids, "sleeper").unwrap();
        assert_eq!(
            children.list[0].process.as_ref().map(Child::id),
            Some(first)
        );
        let sleeping = |n: usize| {
            let log = logs.join("sleeper.log");
            move |_: &mut Children| {
                std::fs::read_to_string(&log).is_ok_and(|l| l.matches("sleeping").count() == n)
            }
        };
        check_until(&mut children, sleeping(1));
        let killed = Command::new("kill")
            .args(["-KILL", &first.to_string()])
            .status();
        assert!(killed.unwrap().success());
        check_until(&mut children, |c| {
            c.list[0].restarts == 1 && c.list[0].process.is_some()
        });
        let second = pid_in(&pids, "sleeper").unwrap();
        assert_ne!(first, second);
        assert_eq!(children.list[0].restarts, 1);
        assert_eq!(children.list[0].backoff, FIRST_BACKOFF * 2);
        // The log of every start is kept, the restart marked between them.
        check_until(&mut children, sleeping(2));
        let log = std::fs::read_to_string(logs.join("sleeper.log")).unwrap();
        assert!(log.contains("arl up --supervise: started again"), "{log}");
        drop(children);
        assert!(
            pid_in(&pids, "sleeper").is_none(),
            "a pid file outlived arl up"
        );
    }

    #[test]
    fn without_supervise_a_child_that_exits_stops_everything() {
        let tmp = tempfile::tempdir().unwrap();
        let mut children = Children::new(tmp.path(), tmp.path(), false).unwrap();
        let args = vec!["-c".to_owned(), "exit 3".to_owned()];
        children
            .start("quitter", PathBuf::from("/bin/sh"), args, Vec::new())
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while children.check().is_none() {
            assert!(Instant::now() < deadline, "the exit was not seen");
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(children.list[0].process.is_none());
        assert!(pid_in(&tmp.path().join("pids"), "quitter").is_none());
    }

    #[test]
    fn the_supervised_server_syncs_every_write_and_keeps_least_privilege_users() {
        let tmp = tempfile::tempdir().unwrap();
        let written =
            crate::natsconf::write(&tmp.path().join("nats"), &arl_schemas::Namespace::default())
                .unwrap();
        let path = supervised_server_config(tmp.path(), Some(&written)).unwrap();
        let config = std::fs::read_to_string(path).unwrap();
        assert!(config.contains("sync_interval: always"), "{config}");
        assert!(config.contains("authorization {"), "{config}");
    }

    #[test]
    fn a_state_dir_the_sandbox_user_cannot_reach_is_named_with_the_blocking_folder() {
        let tmp = tempfile::tempdir().unwrap();
        let closed = tmp.path().join("closed");
        let state = closed.join("state");
        std::fs::create_dir_all(&state).unwrap();
        std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::set_permissions(&closed, std::fs::Permissions::from_mode(0o700)).unwrap();
        assert_eq!(untraversable(&state), Some((closed.clone(), 0o700)));
        std::fs::set_permissions(&closed, std::fs::Permissions::from_mode(0o711)).unwrap();
        assert_eq!(untraversable(&state), None);
    }
}
