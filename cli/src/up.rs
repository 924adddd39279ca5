//! `arl up`: every ARL service on this machine, as child processes of this one, with a
//! private `nats-server` when NATS_URL is not given. The state (JetStream store,
//! environments, sandboxes, checkpoints, logs) lives under one folder. Ctrl-C stops
//! everything; a service that exits on its own stops everything too, with its log's tail
//! — `arl up` never restarts one behind your back.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::cli::{BusArgs, UpArgs};
use crate::run::CliError;

/// The services, in start order, with their arguments under `arl up`.
fn services(
    args: &UpArgs,
    state: &Path,
    engine: u16,
    proxy: u16,
) -> Vec<(&'static str, Vec<String>)> {
    let s = |p: &Path| p.display().to_string();
    let environments = state.join("environments");
    let socket = state.join("proxy.sock");
    let mut recipes = Vec::new();
    for file in &args.swebench_recipes {
        recipes.push("--swebench-recipes".to_owned());
        recipes.push(s(file));
    }
    let mut sandbox = vec![
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
    vec![
        ("arl-controller", vec![]),
        ("arl-dataset", vec![]),
        ("arl-imagebuilder", imagebuilder),
        ("arl-sandbox", sandbox),
        (
            "arl-inference",
            vec![
                "--model".into(),
                args.model.clone(),
                "--listen".into(),
                format!("127.0.0.1:{engine}"),
            ],
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
        ),
        ("arl-reward", recipes),
        (
            "arl-rollout",
            vec!["--concurrency".into(), args.rollout_concurrency.to_string()],
        ),
        (
            "arl-trainer",
            vec!["--runs-dir".into(), s(&state.join("runs"))],
        ),
        ("arl-evaluator", vec![]),
    ]
}

/// A free TCP port on loopback.
fn free_port() -> Result<u16, CliError> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(io)?;
    Ok(listener.local_addr().map_err(io)?.port())
}

fn io(err: std::io::Error) -> CliError {
    CliError::Usage(err.to_string())
}

struct Children(Vec<(String, Child, PathBuf)>);

impl Drop for Children {
    fn drop(&mut self) {
        for (_, child, _) in self.0.iter_mut().rev() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn spawn(
    bin: &Path,
    name: &str,
    args: &[String],
    env: &[(&str, String)],
    logs: &Path,
) -> Result<(Child, PathBuf), CliError> {
    let log = logs.join(format!("{name}.log"));
    let file = std::fs::File::create(&log).map_err(io)?;
    let program = if name == "nats-server" {
        PathBuf::from(bin)
    } else {
        bin.join(name)
    };
    // Through setpriv, each child gets SIGTERM when `arl up` dies, however it dies (even
    // SIGKILL): nothing is left running.
    let mut command = Command::new("setpriv");
    command.args(["--pdeathsig", "TERM", "--"]).arg(&program);
    let child = command
        .args(args)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdout(Stdio::null())
        .stderr(file)
        .spawn()
        .map_err(|e| {
            CliError::Usage(format!(
                "cannot start {} through setpriv: {e} (build the services first: cargo build \
                 --workspace --bins; setpriv comes with util-linux)",
                program.display()
            ))
        })?;
    Ok((child, log))
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
    let bin = std::env::current_exe()
        .map_err(io)?
        .parent()
        .map(Path::to_path_buf)
        .ok_or_else(|| CliError::Usage("cannot tell where arl is installed".into()))?;
    let mut children = Children(Vec::new());
    let url = if nats_url_given {
        bus.nats_url.clone()
    } else {
        let server = std::env::var_os("ARL_NATS_SERVER")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("nats-server"));
        let port = free_port()?;
        let (child, log) = spawn(
            &server,
            "nats-server",
            &[
                "-js".into(),
                "-a".into(),
                "127.0.0.1".into(),
                "-p".into(),
                port.to_string(),
                "-sd".into(),
                state.join("jetstream").display().to_string(),
            ],
            &[],
            &logs,
        )?;
        children.0.push(("nats-server".into(), child, log));
        let url = format!("nats://127.0.0.1:{port}");
        for _ in 0..100 {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        url
    };
    let (engine, proxy) = (free_port()?, free_port()?);
    let env = [
        ("NATS_URL", url.clone()),
        ("ARL_PREFIX", bus.prefix.clone()),
    ];
    for (name, service_args) in services(&args, &state, engine, proxy) {
        let (child, log) = spawn(&bin, name, &service_args, &env, &logs)?;
        children.0.push((name.into(), child, log));
    }
    std::fs::write(state.join("nats-url"), &url).map_err(io)?;
    println!(
        "ARL is up: NATS at {url}; state and logs in {}",
        state.display()
    );
    println!("submit a run with: NATS_URL={url} arl run submit examples/smoke.toml");
    let mut interrupt = Box::pin(tokio::signal::ctrl_c());
    let mut terminate =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).map_err(io)?;
    loop {
        tokio::select! {
            _ = &mut interrupt => break,
            _ = terminate.recv() => break,
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
        for (name, child, log) in children.0.iter_mut() {
            if let Ok(Some(status)) = child.try_wait() {
                eprintln!(
                    "{name} exited ({status}); stopping ARL. Its log ends:\n{}",
                    tail(log)
                );
                return Ok(std::process::ExitCode::from(1));
            }
        }
    }
    println!("stopping ARL");
    Ok(std::process::ExitCode::SUCCESS)
}
