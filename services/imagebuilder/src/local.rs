//! Local snapshots for the bubblewrap sandbox backend.
//!
//! Layout under the environments root (the sandbox service's `environments_dir`):
//! - `python/<version>/`: a world-readable copy of a pyenv interpreter, mounted in builds
//!   and sandboxes at its original pyenv path (its shared library is linked by absolute
//!   path, and `/root` is closed to the sandbox user);
//! - `<name>/tree/`: the work tree (mounted at `/testbed`, copied per lease);
//! - `<name>/opt/`: the virtual environment or interpreter copy (`/opt/arl/env`), mounted
//!   read-only;
//! - `<name>/environment.json`: workdir, mounts, `PATH`/`VIRTUAL_ENV`, the recipe digest;
//! - `shared/<name>/opt/`: a dependency environment several environments mount at
//!   `/opt/arl` instead of an `opt/` of their own (`shared.json` holds its digest); built
//!   once, from the work tree of the first environment that needs it.
//!
//! A build runs the recipe's script in bubblewrap with exactly those mounts (writable), the
//! source repository read-only, the network (for pip) and the pip cache, under a
//! temporary name; it is renamed into place only when it succeeded. One build per name at
//! a time; an unchanged recipe is reused.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use serde_json::json;

use crate::recipe::{
    ENV_DIR, OPT, Recipe, SOURCE_REPO, SharedEnvironment, Source, TREE_COMPILED, WORK,
};

#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error(
        "Python {version} is needed but not installed here ({path} is missing): install it with `pyenv install {version}`"
    )]
    InterpreterMissing { version: String, path: String },
    #[error("the source repository does not hold the base commit: {0}")]
    MissingCommit(String),
    #[error("a setup command failed (exit {code}); last lines of the log:\n{tail}")]
    InstallError { code: i32, tail: String },
    #[error("the build ran past {0:?}; last lines of the log:\n{1}")]
    Timeout(Duration, String),
    #[error(
        "the environment needs Debian packages this machine lacks: {}; install them (apt-get install {}) — a build cannot",
        .0.join(", "), .0.join(" ")
    )]
    SystemPackages(Vec<String>),
    #[error("{0}")]
    Io(String),
}

fn io(context: impl std::fmt::Display) -> impl Fn(std::io::Error) -> BuildError {
    move |e| BuildError::Io(format!("{context}: {e}"))
}

#[derive(Clone, Debug)]
pub struct LocalConfig {
    pub root: PathBuf,
    pub pyenv_root: PathBuf,
    pub pip_cache: PathBuf,
    pub timeout: Duration,
}

impl LocalConfig {
    /// Builds under `root`, with interpreters from `pyenv_root` (default `~/.pyenv`) and
    /// pip's cache in `pip_cache` (default `~/.cache/arl/pip`), each stopped after `timeout`.
    pub fn new(
        root: PathBuf,
        pyenv_root: Option<PathBuf>,
        pip_cache: Option<PathBuf>,
        timeout: Duration,
    ) -> Self {
        let home = PathBuf::from(std::env::var_os("HOME").unwrap_or_default());
        Self {
            root,
            pyenv_root: pyenv_root.unwrap_or_else(|| home.join(".pyenv")),
            pip_cache: pip_cache.unwrap_or_else(|| home.join(".cache/arl/pip")),
            timeout,
        }
    }
}

/// A ready environment.
#[derive(Clone, Debug)]
pub struct Built {
    pub dir: PathBuf,
    /// True when it existed and nothing was built.
    pub cached: bool,
    pub seconds: f64,
}

#[derive(Debug)]
pub struct LocalBuilder {
    config: LocalConfig,
    building: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Held while an interpreter is copied into the store: two builds of one batch that
    /// need the same Python would otherwise copy it at once, and one would lose.
    copying_interpreter: tokio::sync::Mutex<()>,
}

impl LocalBuilder {
    /// A builder over `config.root`. Staging folders a crashed builder left behind are
    /// removed (this builder owns the root; nothing else builds there).
    pub fn new(config: LocalConfig) -> Self {
        let _ = std::fs::remove_dir_all(config.root.join(".build"));
        Self {
            config,
            building: Mutex::default(),
            copying_interpreter: tokio::sync::Mutex::default(),
        }
    }

    /// The lock of one name: builds of it wait for each other.
    fn lock_for(&self, name: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.building
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(name.to_owned())
            .or_default()
            .clone()
    }

    /// Makes sure the recipe's environment exists; concurrent calls for one name build once.
    pub async fn ensure(&self, recipe: &Recipe) -> Result<Built, BuildError> {
        let lock = self.lock_for(&recipe.name);
        let _held = lock.lock().await;
        let started = Instant::now();
        let dir = self.config.root.join(&recipe.name);
        if built_digest(&dir).as_deref() == Some(recipe.digest.as_str()) {
            mark_used(&dir);
            return Ok(Built {
                dir,
                cached: true,
                seconds: started.elapsed().as_secs_f64(),
            });
        }
        check_system_packages(&recipe.system_packages)?;
        let interpreter = match &recipe.python {
            Some(version) => Some(self.interpreter(version).await?),
            None => None,
        };
        let (script, opt) = match &recipe.shared {
            Some(shared) => {
                let dir = self
                    .ensure_shared(recipe, shared, interpreter.as_ref())
                    .await?;
                let compiled = TREE_COMPILED
                    .trim_start_matches(OPT)
                    .trim_start_matches('/');
                if dir.join("opt").join(compiled).exists() {
                    // Its install compiled into the tree: this tree needs its own build.
                    (&shared.script, Opt::Own)
                } else {
                    (&recipe.script, Opt::Shared(dir))
                }
            }
            None => (&recipe.script, Opt::Own),
        };
        let staging = self.staging(&recipe.name);
        let result = self
            .build(recipe, script, interpreter.as_ref(), &opt, &staging)
            .await;
        if let Err(err) = result {
            self.keep_failure(&recipe.name, &staging).await;
            return Err(err);
        }
        publish(&staging, &dir).await?;
        mark_used(&dir);
        Ok(Built {
            dir,
            cached: false,
            seconds: started.elapsed().as_secs_f64(),
        })
    }

    /// The shared dependency environment of `recipe`, built from its snapshot if it is
    /// not there yet; its folder under the root. Shared environments are kept (like the
    /// interpreter copies): environments built on them mount them.
    async fn ensure_shared(
        &self,
        recipe: &Recipe,
        shared: &SharedEnvironment,
        interpreter: Option<&(PathBuf, String)>,
    ) -> Result<PathBuf, BuildError> {
        let lock = self.lock_for(&shared.name);
        let _held = lock.lock().await;
        let dir = self.config.root.join(&shared.name);
        if shared_digest(&dir).as_deref() == Some(shared.digest.as_str()) {
            return Ok(dir);
        }
        let staging = self.staging(&shared.name);
        let built = async {
            self.run_setup(
                &shared.script,
                &recipe.source,
                &recipe.workdir,
                interpreter,
                &Opt::Own,
                &staging,
            )
            .await?;
            let metadata = json!({"recipe_digest": shared.digest, "built_from": recipe.name});
            std::fs::write(
                staging.join("shared.json"),
                serde_json::to_vec_pretty(&metadata).unwrap_or_default(),
            )
            .map_err(io("writing shared.json"))?;
            // The tree was the first instance's, only there to install from.
            tokio::fs::remove_dir_all(staging.join("tree"))
                .await
                .map_err(io("removing the scratch tree"))?;
            readable(&staging).await
        }
        .await;
        if let Err(err) = built {
            self.keep_failure(&shared.name, &staging).await;
            return Err(err);
        }
        publish(&staging, &dir).await?;
        Ok(dir)
    }

    /// A fresh staging folder for a build of `name`.
    fn staging(&self, name: &str) -> PathBuf {
        self.config.root.join(".build").join(format!(
            "{}-{}",
            name.replace('/', "_"),
            uuid::Uuid::new_v4().simple()
        ))
    }

    /// A failed build's whole log stays for whoever investigates; the partial build goes.
    async fn keep_failure(&self, name: &str, staging: &Path) {
        let failed = self.config.root.join(".failed");
        let _ = tokio::fs::create_dir_all(&failed).await;
        let _ = tokio::fs::rename(
            staging.join("build.log"),
            failed.join(format!("{}.log", name.replace('/', "_"))),
        )
        .await;
        let _ = tokio::fs::remove_dir_all(staging).await;
    }

    /// The store copy of a pyenv interpreter and the path it is mounted at.
    async fn interpreter(&self, version: &str) -> Result<(PathBuf, String), BuildError> {
        let original = self.config.pyenv_root.join("versions").join(version);
        if !original.join("bin").is_dir() {
            return Err(BuildError::InterpreterMissing {
                version: version.to_owned(),
                path: original.display().to_string(),
            });
        }
        let copy = self.config.root.join("python").join(version);
        let _copying = self.copying_interpreter.lock().await;
        if !copy.is_dir() {
            let tmp = self
                .config
                .root
                .join("python")
                .join(format!(".{version}.tmp"));
            let _ = tokio::fs::remove_dir_all(&tmp).await;
            tokio::fs::create_dir_all(self.config.root.join("python"))
                .await
                .map_err(io("creating the interpreter store"))?;
            run_checked(
                tokio::process::Command::new("cp")
                    .arg("-a")
                    .arg(&original)
                    .arg(&tmp),
            )
            .await?;
            readable(&tmp).await?;
            tokio::fs::rename(&tmp, &copy)
                .await
                .map_err(io("publishing the interpreter copy"))?;
        }
        Ok((copy, original.to_string_lossy().into_owned()))
    }

    /// Builds the recipe's environment in `staging`: its script, then `environment.json`.
    async fn build(
        &self,
        recipe: &Recipe,
        script: &str,
        interpreter: Option<&(PathBuf, String)>,
        opt: &Opt,
        staging: &Path,
    ) -> Result<(), BuildError> {
        self.run_setup(
            script,
            &recipe.source,
            &recipe.workdir,
            interpreter,
            opt,
            staging,
        )
        .await?;
        let python_mount = interpreter.map(|(copy, target)| {
            json!({"source": copy.strip_prefix(&self.config.root).unwrap_or(copy).to_string_lossy(), "target": target})
        });
        let opt_source = match opt {
            Opt::Own => format!("{}/opt", recipe.name),
            Opt::Shared(dir) => format!(
                "{}/opt",
                dir.strip_prefix(&self.config.root)
                    .unwrap_or(dir)
                    .to_string_lossy()
            ),
        };
        let metadata = json!({
            "workdir": recipe.workdir,
            "mounts": python_mount.into_iter().chain([json!({
                "source": opt_source,
                "target": OPT,
            })]).collect::<Vec<_>>(),
            "env": {
                "PATH": format!("{ENV_DIR}/bin:/usr/local/bin:/usr/bin:/bin"),
                "VIRTUAL_ENV": ENV_DIR,
            },
            "recipe_digest": recipe.digest,
        });
        std::fs::write(
            staging.join("environment.json"),
            serde_json::to_vec_pretty(&metadata).unwrap_or_default(),
        )
        .map_err(io("writing environment.json"))?;
        readable(staging).await
    }

    /// Runs a setup script in bubblewrap: the work tree is `staging/tree`, `/opt/arl` is
    /// `staging/opt` (or a shared environment, read-only), the source is read-only; the
    /// log is `staging/build.log`.
    async fn run_setup(
        &self,
        script: &str,
        source: &Source,
        workdir: &str,
        interpreter: Option<&(PathBuf, String)>,
        opt: &Opt,
        staging: &Path,
    ) -> Result<(), BuildError> {
        // With a shared environment, /opt/arl is that one: nothing of its own to make.
        let own_opt = matches!(opt, Opt::Own).then_some("opt");
        for sub in std::iter::once("tree").chain(own_opt) {
            tokio::fs::create_dir_all(staging.join(sub))
                .await
                .map_err(io("creating the build folder"))?;
        }
        tokio::fs::create_dir_all(&self.config.pip_cache)
            .await
            .map_err(io("creating the pip cache"))?;
        let copied = matches!(source, Source::GitRepository(_));
        let (source, script) = match source {
            Source::GitRepository(repo) => {
                let copy = staging.join("source.git");
                copy_repository(repo, &copy).await?;
                (Some(copy), script.to_owned())
            }
            Source::Tarball(archive) => (Some(archive.clone()), script.to_owned()),
            Source::Folder(folder) => (
                Some(folder.clone()),
                format!("cp -a {SOURCE_REPO}/. \"$TESTBED\"/\n{script}"),
            ),
            Source::Remote(_) => (None, script.to_owned()),
        };
        let script = format!(
            "set -eo pipefail\nexport TESTBED={workdir} ENV_DIR={ENV_DIR} WORK={WORK} SOURCE_REPO={SOURCE_REPO}\nmkdir -p \"$WORK\"\ncd {workdir}\n{script}\n"
        );
        // Setup scripts come with the dataset: they run in a user namespace of their own
        // (its root is not the machine's), with no capabilities and no-new-privs, unable
        // to make further namespaces. They keep the network (pip, conda).
        let mut command = tokio::process::Command::new("bwrap");
        command.args([
            "--die-with-parent",
            "--unshare-user",
            "--disable-userns",
            "--cap-drop",
            "ALL",
            "--unshare-pid",
            "--unshare-ipc",
            "--unshare-uts",
        ]);
        command.args(system_mounts());
        command.args(["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]);
        command.arg("--bind").arg(staging.join("tree")).arg(workdir);
        match opt {
            Opt::Own => command.arg("--bind").arg(staging.join("opt")).arg(OPT),
            Opt::Shared(dir) => command.arg("--ro-bind").arg(dir.join("opt")).arg(OPT),
        };
        if let Some(source) = &source {
            command.arg("--ro-bind").arg(source).arg(SOURCE_REPO);
        }
        if let Some((copy, target)) = interpreter {
            command.arg("--ro-bind").arg(copy).arg(target);
        }
        command
            .arg("--bind")
            .arg(&self.config.pip_cache)
            .arg("/opt/arl-pip-cache");
        command.args([
            "--clearenv",
            "--setenv",
            "HOME",
            "/tmp",
            "--setenv",
            "LANG",
            "C.UTF-8",
        ]);
        command.args(["--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin"]);
        command.args([
            "--setenv",
            "PIP_CACHE_DIR",
            "/opt/arl-pip-cache",
            "--setenv",
            "PIP_DISABLE_PIP_VERSION_CHECK",
            "1",
        ]);
        command.args(["--chdir", workdir, "--", "/bin/bash", "-c", &script]);
        let log_path = staging.join("build.log");
        let log = std::fs::File::create(&log_path).map_err(io("creating the build log"))?;
        let log_err = log.try_clone().map_err(io("the build log"))?;
        command.stdout(log).stderr(log_err).kill_on_drop(true);
        let mut child = command.spawn().map_err(io("starting bubblewrap"))?;
        let status = match tokio::time::timeout(self.config.timeout, child.wait()).await {
            Ok(status) => status.map_err(io("waiting for the build"))?,
            Err(_) => {
                let _ = child.kill().await;
                return Err(BuildError::Timeout(self.config.timeout, tail(&log_path)));
            }
        };
        if !status.success() {
            let tail = tail(&log_path);
            if tail.contains("not a valid object name") || tail.contains("not a tree object") {
                return Err(BuildError::MissingCommit(tail));
            }
            return Err(BuildError::InstallError {
                code: status.code().unwrap_or(-1),
                tail,
            });
        }
        if let Some(copy) = source.filter(|_| copied) {
            tokio::fs::remove_dir_all(&copy)
                .await
                .map_err(io("removing the source copy"))?;
        }
        Ok(())
    }
}

/// Where an environment's `/opt/arl` is.
enum Opt {
    /// Its own, built with it (`<name>/opt`).
    Own,
    /// A shared environment's folder under the root, mounted read-only.
    Shared(PathBuf),
}

/// A private copy of a bare repository (they are small: shallow, one commit per
/// instance). Git only recognizes a repository with a `refs/` folder, which copies that
/// drop empty folders lose; it is recreated.
async fn copy_repository(from: &Path, to: &Path) -> Result<(), BuildError> {
    if !from.join("objects").is_dir() {
        return Err(BuildError::MissingCommit(format!(
            "{} is not a git repository (no objects/)",
            from.display()
        )));
    }
    run_checked(
        tokio::process::Command::new("cp")
            .arg("-a")
            .arg(from)
            .arg(to),
    )
    .await?;
    run_checked(
        tokio::process::Command::new("chmod")
            .args(["-R", "u+w"])
            .arg(to),
    )
    .await?;
    for sub in ["refs/heads", "refs/tags"] {
        tokio::fs::create_dir_all(to.join(sub))
            .await
            .map_err(io("completing the repository copy"))?;
    }
    Ok(())
}

impl LocalBuilder {
    /// Removes the least recently used environments until they take at most `limit_bytes`
    /// (interpreter copies are shared and kept). Returns the names removed. An environment
    /// being built or handed out again is simply rebuilt when asked for next.
    pub async fn collect_garbage(&self, limit_bytes: u64) -> Result<Vec<String>, BuildError> {
        let root = self.config.root.clone();
        let mut environments = tokio::task::spawn_blocking(move || environments(&root))
            .await
            .map_err(|e| BuildError::Io(e.to_string()))?;
        // Oldest use first.
        environments.sort_by_key(|e| e.last_used);
        let mut total: u64 = environments.iter().map(|e| e.bytes).sum();
        let mut removed = Vec::new();
        for env in environments {
            if total <= limit_bytes {
                break;
            }
            let lock = self.lock_for(&env.name);
            let _held = lock.lock().await;
            tokio::fs::remove_dir_all(&env.dir)
                .await
                .map_err(io(format!("removing {}", env.dir.display())))?;
            total = total.saturating_sub(env.bytes);
            removed.push(env.name);
        }
        Ok(removed)
    }
}

struct Stored {
    name: String,
    dir: PathBuf,
    bytes: u64,
    last_used: std::time::SystemTime,
}

/// Every complete environment under `root` (a folder with an `environment.json`).
fn environments(root: &Path) -> Vec<Stored> {
    let mut found = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let name = path
                .strip_prefix(root)
                .unwrap_or(&path)
                .to_string_lossy()
                .into_owned();
            if !path.is_dir() || name.starts_with('.') || name == "python" || name == "shared" {
                continue;
            }
            if path.join("environment.json").is_file() {
                let last_used = std::fs::metadata(path.join(".last_used"))
                    .and_then(|m| m.modified())
                    .unwrap_or(std::time::UNIX_EPOCH);
                found.push(Stored {
                    bytes: size_of(&path),
                    name,
                    dir: path,
                    last_used,
                });
            } else {
                stack.push(path);
            }
        }
    }
    found
}

/// Bytes of the files under `dir` (an environment's own disk: its tree and, unless it
/// shares one, its environment).
pub fn size_of(dir: &Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for entry in entries.flatten() {
            match entry.metadata() {
                Ok(m) if m.is_dir() => stack.push(entry.path()),
                Ok(m) => total += m.len(),
                Err(_) => {}
            }
        }
    }
    total
}

/// Records that an environment was handed out (garbage collection removes the oldest).
fn mark_used(dir: &Path) {
    let _ = std::fs::write(dir.join(".last_used"), b"");
}

/// Read-only system folders for a build (as in a sandbox).
fn system_mounts() -> Vec<String> {
    let mut args: Vec<String> = ["--ro-bind", "/usr", "/usr", "--ro-bind", "/etc", "/etc"]
        .map(String::from)
        .to_vec();
    for top in ["bin", "lib", "lib64", "sbin", "lib32", "libx32"] {
        let host = Path::new("/").join(top);
        match std::fs::read_link(&host) {
            Ok(target) => args.extend([
                "--symlink".into(),
                target.to_string_lossy().into_owned(),
                format!("/{top}"),
            ]),
            Err(_) if host.is_dir() => {
                args.extend(["--ro-bind".into(), format!("/{top}"), format!("/{top}")])
            }
            Err(_) => {}
        }
    }
    args
}

/// The Debian packages of `packages` that are not installed here (none are checked where
/// there is no dpkg: such a machine says nothing either way).
fn check_system_packages(packages: &[String]) -> Result<(), BuildError> {
    let missing: Vec<String> = packages
        .iter()
        .filter(|package| {
            std::process::Command::new("dpkg-query")
                .args(["-W", "-f=${Status}", package])
                .output()
                .is_ok_and(|out| {
                    !String::from_utf8_lossy(&out.stdout).contains("install ok installed")
                })
        })
        .cloned()
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(BuildError::SystemPackages(missing))
    }
}

/// The digest a shared environment was built from, if it is complete.
fn shared_digest(dir: &Path) -> Option<String> {
    let bytes = std::fs::read(dir.join("shared.json")).ok()?;
    let value: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
    value["recipe_digest"].as_str().map(str::to_owned)
}

/// The digest of the recipe an environment was built from, if it is complete.
fn built_digest(dir: &Path) -> Option<String> {
    let bytes = std::fs::read(dir.join("environment.json")).ok()?;
    let value: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
    value["recipe_digest"].as_str().map(str::to_owned)
}

/// Replaces `dir` with `staging` (an old build of the name is removed after).
async fn publish(staging: &Path, dir: &Path) -> Result<(), BuildError> {
    if let Some(parent) = dir.parent() {
        tokio::fs::create_dir_all(parent)
            .await
            .map_err(io("creating the environment's folder"))?;
    }
    let old = dir.with_extension(format!("old-{}", uuid::Uuid::new_v4().simple()));
    if dir.exists() {
        tokio::fs::rename(dir, &old)
            .await
            .map_err(io("moving the old build aside"))?;
    }
    tokio::fs::rename(staging, dir)
        .await
        .map_err(io("publishing the build"))?;
    let _ = tokio::fs::remove_dir_all(&old).await;
    Ok(())
}

/// Everything readable (and folders traversable) by the sandbox user.
async fn readable(path: &Path) -> Result<(), BuildError> {
    run_checked(
        tokio::process::Command::new("chmod")
            .args(["-R", "a+rX"])
            .arg(path),
    )
    .await
}

async fn run_checked(command: &mut tokio::process::Command) -> Result<(), BuildError> {
    let output = command
        .output()
        .await
        .map_err(io("running a build helper"))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(BuildError::Io(
            String::from_utf8_lossy(&output.stderr).trim().to_owned(),
        ))
    }
}

/// The last 40 lines of a log.
fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}
