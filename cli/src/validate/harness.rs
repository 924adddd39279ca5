//! The real components `arl dataset validate` runs in this process — the code that
//! serves a run, without the run: the image builder's recipes and local builder
//! (bubblewrap snapshots), a private nats-server with the sandbox service on it
//! (bubblewrap leases), and the reward service's grader, leasing through the sandbox
//! client. Nothing here grades or builds on its own account.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use arl_imagebuilder::local::{LocalBuilder, LocalConfig};
use arl_imagebuilder::recipe::Recipes;
use arl_reward::grader::{Grader, LeaseOwner, RewardConfig, load_test_commands};
use arl_runtime::bus::BusConfig;
use arl_runtime::{Bus, Metrics, Shutdown};
use arl_sandbox::config::SandboxConfig;
use arl_sandbox::service::SandboxService;
use arl_sandbox_client::SandboxClient;
use arl_schemas::{Namespace, RunId};

use crate::run::CliError;

/// Where and how environments are built and tasks graded.
#[derive(Clone, Debug)]
pub struct HarnessConfig {
    /// The dataset (Harbor tasks' environments are folders under it).
    pub dataset: PathBuf,
    pub environments: PathBuf,
    pub swebench_recipes: Vec<PathBuf>,
    pub swebench_repos: Option<PathBuf>,
    pub pyenv_root: Option<PathBuf>,
    pub pip_cache: Option<PathBuf>,
    pub build_timeout: Duration,
    pub test_timeout: Duration,
}

/// The components, started. Stop it with [`Harness::stop`].
pub struct Harness {
    pub builder: LocalBuilder,
    pub recipes: Recipes,
    pub grader: Grader,
    pub sandboxes: SandboxClient,
    /// Every lease of this validation is taken for this run id (it names no real run).
    pub owner: LeaseOwner,
    pub test_timeout: Duration,
    pub dataset: PathBuf,
    shutdown: Shutdown,
    _server: PrivateServer,
    _lock: EnvironmentsLock,
    /// Sandbox state and the server's store; removed at the end.
    _scratch: tempfile::TempDir,
}

impl Harness {
    pub async fn start(config: HarnessConfig) -> Result<Self, CliError> {
        let lock = EnvironmentsLock::take(&config.environments)?;
        let local = LocalConfig::new(
            config.environments.clone(),
            config.pyenv_root,
            config.pip_cache,
            config.build_timeout,
        );
        let recipes = Recipes::load(
            &config.swebench_recipes,
            config.swebench_repos.clone(),
            local.pyenv_root.clone(),
        )
        .map_err(|e| CliError::Usage(format!("--swebench-recipes: {e}")))?;
        let grading = grading_config(&config.swebench_recipes, config.test_timeout)?;
        let scratch = scratch_folder()?;
        let server = PrivateServer::start(&scratch.path().join("nats")).await?;
        let bus = connect(&server.url).await?;
        let shutdown = Shutdown::new();
        start_sandboxes(&bus, scratch.path(), &config.environments, &shutdown).await?;
        let sandboxes = SandboxClient::new(bus);
        let run = format!("validate-{}", uuid::Uuid::now_v7().simple());
        Ok(Self {
            builder: LocalBuilder::new(local),
            recipes,
            grader: Grader::new(sandboxes.clone(), grading),
            sandboxes,
            owner: LeaseOwner {
                run_id: RunId::new(run).map_err(|e| CliError::Usage(e.to_string()))?,
                trial_id: None,
            },
            test_timeout: config.test_timeout,
            dataset: config.dataset,
            shutdown,
            _server: server,
            _lock: lock,
            _scratch: scratch,
        })
    }

    /// Stops the sandbox service (its leases with it), then the server.
    pub async fn stop(self) {
        self.shutdown.trigger();
        self.shutdown.wait().await;
    }
}

/// The reward service's settings, with the instances' test commands.
fn grading_config(recipes: &[PathBuf], test_timeout: Duration) -> Result<RewardConfig, CliError> {
    let mut config = RewardConfig {
        test_timeout,
        ..RewardConfig::default()
    };
    for file in recipes {
        for command in load_test_commands(file).map_err(CliError::Usage)? {
            config
                .test_commands
                .insert(command.instance_id.clone(), command);
        }
    }
    Ok(config)
}

/// A private folder the sandbox user can traverse (lease trees live under it).
fn scratch_folder() -> Result<tempfile::TempDir, CliError> {
    let scratch = tempfile::Builder::new()
        .prefix("arl-validate-")
        .tempdir()
        .map_err(|e| CliError::Unavailable(format!("cannot make a scratch folder: {e}")))?;
    std::fs::set_permissions(scratch.path(), std::fs::Permissions::from_mode(0o711))
        .map_err(|e| CliError::Unavailable(format!("{}: {e}", scratch.path().display())))?;
    Ok(scratch)
}

async fn connect(url: &str) -> Result<Bus, CliError> {
    let mut config = BusConfig::new(url, Namespace::default(), "arl-validate");
    config.wait_for_server = false;
    let bus = Bus::connect(config, Metrics::new()).await?;
    bus.provision().await?;
    Ok(bus)
}

/// The sandbox service on bubblewrap, as `arl-sandbox` runs it: its first process is the
/// `arl-sandbox-init` beside this executable.
async fn start_sandboxes(
    bus: &Bus,
    scratch: &Path,
    environments: &Path,
    shutdown: &Shutdown,
) -> Result<(), CliError> {
    let init = std::env::current_exe()
        .map_err(|e| CliError::Unavailable(format!("cannot tell where arl is: {e}")))?
        .with_file_name("arl-sandbox-init");
    let mut config =
        SandboxConfig::local(scratch.join("sandbox"), environments.to_path_buf(), init);
    // Every grading takes a fresh lease once; trees prepared ahead would be copied for
    // nothing on a machine whose cores the builds and tests need.
    config.pool_min_idle = 0;
    SandboxService::start_local(bus.clone(), config, ([127, 0, 0, 1], 0).into(), shutdown)
        .await
        .map_err(|e| CliError::Unavailable(format!("the sandbox service cannot start: {e}")))?;
    Ok(())
}

/// A nats-server of this process's own (JetStream on, loopback only, a throwaway store),
/// killed when dropped. The program is found and checked as for `arl up`
/// ([`crate::up::nats_server_program`]).
struct PrivateServer {
    url: String,
    _child: tokio::process::Child,
}

impl PrivateServer {
    async fn start(store: &Path) -> Result<Self, CliError> {
        let program = crate::up::nats_server_program().map_err(CliError::Unavailable)?;
        let port = crate::up::free_port()?;
        let log = store.with_extension("log");
        let unavailable = |reason: String| {
            CliError::Unavailable(format!(
                "{} (the private nats-server; set ARL_NATS_SERVER to a nats-server 2.10+): {reason}",
                program.display()
            ))
        };
        let log_file = std::fs::File::create(&log).map_err(|e| unavailable(e.to_string()))?;
        let child = tokio::process::Command::new(&program)
            .args(["-js", "-a", "127.0.0.1", "-p", &port.to_string(), "-sd"])
            .arg(store)
            .stdout(Stdio::null())
            .stderr(log_file)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| unavailable(e.to_string()))?;
        let server = Self {
            url: format!("nats://127.0.0.1:{port}"),
            _child: child,
        };
        for _ in 0..100 {
            if tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
            {
                return Ok(server);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let said = std::fs::read_to_string(&log).unwrap_or_default();
        Err(unavailable(format!(
            "not listening after 10 s: {}",
            said.trim()
        )))
    }
}

/// One validation builds in an environments folder at a time: the image builder's local
/// builder owns its root (it clears leftover staging folders when it starts), so a second
/// one there would break the first one's builds. A file holding the holder's pid; one
/// whose process is gone is taken over.
struct EnvironmentsLock {
    path: PathBuf,
}

impl EnvironmentsLock {
    fn take(environments: &Path) -> Result<Self, CliError> {
        prepare_environments(environments)?;
        let path = environments.join(".validate.lock");
        if let Some(holder) = std::fs::read_to_string(&path)
            .ok()
            .and_then(|pid| pid.trim().parse::<u32>().ok())
            .filter(|pid| *pid != std::process::id() && Path::new(&format!("/proc/{pid}")).exists())
        {
            return Err(CliError::Usage(format!(
                "another arl dataset validate (pid {holder}) is building in {}; wait for it, or give this one another --environments-dir",
                environments.display()
            )));
        }
        std::fs::write(&path, std::process::id().to_string())
            .map_err(|e| CliError::Usage(format!("{}: {e}", path.display())))?;
        Ok(Self { path })
    }
}

impl Drop for EnvironmentsLock {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The environments folder, made if missing, readable by the sandbox user (who runs in
/// the snapshots it holds) and reachable through every folder above it.
fn prepare_environments(environments: &Path) -> Result<(), CliError> {
    let usage = |e: std::io::Error| CliError::Usage(format!("{}: {e}", environments.display()));
    std::fs::create_dir_all(environments).map_err(usage)?;
    std::fs::set_permissions(environments, std::fs::Permissions::from_mode(0o755))
        .map_err(usage)?;
    if let Some((folder, mode)) = crate::up::untraversable(environments) {
        return Err(CliError::Usage(format!(
            "--environments-dir {}: sandboxes run as an unprivileged user, which cannot traverse {} \
             (mode {mode:o}); choose a folder it can reach (e.g. under /tmp) or `chmod o+x {}`",
            environments.display(),
            folder.display(),
            folder.display()
        )));
    }
    Ok(())
}
