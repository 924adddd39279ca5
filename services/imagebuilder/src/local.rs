//! Local snapshots for the bubblewrap sandbox backend.
//!
//! Layout under the environments root (the sandbox service's `environments_dir`):
//! - `python/<version>/`: a world-readable copy of a pyenv interpreter, mounted in builds
//!   and sandboxes at its original pyenv path (its shared library is linked by absolute
//!   path, and `/root` is closed to the sandbox user);
//! - `<name>/tree/`: the work tree (mounted at `/testbed`, copied per lease);
//! - `<name>/opt/`: the virtual environment or interpreter copy (`/opt/arl/env`), mounted
//!   read-only;
//! - `<name>/environment.json`: workdir, mounts, `PATH`/`VIRTUAL_ENV`, the recipe digest.
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

use crate::recipe::{ENV_DIR, OPT, Recipe, SOURCE_REPO, Source, WORK};

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

    /// Makes sure the recipe's environment exists; concurrent calls for one name build once.
    pub async fn ensure(&self, recipe: &Recipe) -> Result<Built, BuildError> {
        let lock = self
            .building
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(recipe.name.clone())
            .or_default()
            .clone();
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
        let interpreter = match &recipe.python {
            Some(version) => Some(self.interpreter(version).await?),
            None => None,
        };
        let staging = self.config.root.join(".build").join(format!(
            "{}-{}",
            recipe.name.replace('/', "_"),
            uuid::Uuid::new_v4().simple()
        ));
        let result = self.build(recipe, interpreter.as_ref(), &staging).await;
        if let Err(err) = result {
            // The whole log stays for whoever investigates; the partial build goes.
            let failed = self.config.root.join(".failed");
            let _ = tokio::fs::create_dir_all(&failed).await;
            let _ = tokio::fs::rename(
                staging.join("build.log"),
                failed.join(format!("{}.log", recipe.name.replace('/', "_"))),
            )
            .await;
            let _ = tokio::fs::remove_dir_all(&staging).await;
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

    async fn build(
        &self,
        recipe: &Recipe,
        interpreter: Option<&(PathBuf, String)>,
        staging: &Path,
    ) -> Result<(), BuildError> {
        for sub in ["tree", "opt"] {
            tokio::fs::create_dir_all(staging.join(sub))
                .await
                .map_err(io("creating the build folder"))?;
        }
        tokio::fs::create_dir_all(&self.config.pip_cache)
            .await
            .map_err(io("creating the pip cache"))?;
        let workdir = recipe.workdir.as_str();
        let (source, script) = match &recipe.source {
            Source::GitRepository(repo) => {
                let copy = staging.join("source.git");
                copy_repository(repo, &copy).await?;
                (copy, recipe.script.clone())
            }
            Source::Tarball(archive) => (archive.clone(), recipe.script.clone()),
            Source::Folder(folder) => (
                folder.clone(),
                format!("cp -a {SOURCE_REPO}/. \"$TESTBED\"/\n{}", recipe.script),
            ),
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
        command.arg("--bind").arg(staging.join("opt")).arg(OPT);
        command.arg("--ro-bind").arg(&source).arg(SOURCE_REPO);
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
        let python_mount = interpreter.map(|(copy, target)| {
            json!({"source": copy.strip_prefix(&self.config.root).unwrap_or(copy).to_string_lossy(), "target": target})
        });
        let metadata = json!({
            "workdir": workdir,
            "mounts": python_mount.into_iter().chain([json!({
                "source": format!("{}/opt", recipe.name),
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
        if matches!(recipe.source, Source::GitRepository(_)) {
            tokio::fs::remove_dir_all(&source)
                .await
                .map_err(io("removing the source copy"))?;
        }
        readable(staging).await
    }
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
            let lock = self
                .building
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .entry(env.name.clone())
                .or_default()
                .clone();
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
            if !path.is_dir() || name.starts_with('.') || name == "python" {
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

fn size_of(dir: &Path) -> u64 {
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
