//! The local backend: bubblewrap.
//!
//! Every command runs in fresh mount, pid, ipc, uts, network, user and cgroup namespaces
//! as an unprivileged host user, with the host's system folders read-only, a private
//! `/tmp`, and the lease's work tree as the only writable place. The network namespace
//! has only loopback; `arl-sandbox-init` relays one loopback port to the token proxy's Unix
//! socket. Limits come from the lease's cgroups (or rlimits). On timeout or release the
//! whole process tree dies: killing bubblewrap ends the pid namespace, and the cgroup is
//! swept.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use arl_schemas::LeaseId;
use arl_schemas::events::{EnvironmentRef, LeaseEnd, SandboxBackend};
use tokio::io::AsyncWriteExt;
use tokio_util::sync::CancellationToken;

use crate::backend::{Activation, Backend, BackendError, ExecOutput, ExecSpec, Prepared, capture};
use crate::cgroup::{CgroupSupport, LeaseCgroup};
use crate::config::{ResolvedLimits, SandboxConfig};
use crate::environment::{self, Environment, EnvironmentError};
use crate::lease::LeaseRecord;

/// A prepared work tree in a warm pool: `dir/tree` holds the files.
#[derive(Debug)]
pub struct WarmTree {
    dir: PathBuf,
    /// Disk the fresh tree holds: a lease's disk limit counts growth beyond it.
    bytes: u64,
    environment: Environment,
}

/// A leased work tree and what its commands need.
#[derive(Clone, Debug)]
pub struct SandboxHandle {
    pub lease_id: LeaseId,
    /// Holds `tree/` and the lease's record.
    pub dir: PathBuf,
    pub workdir: String,
    /// Read-only (host folder, path inside) mounts of the environment.
    pub mounts: Vec<(PathBuf, String)>,
    /// The environment's variables (a request's own variables override them).
    pub env: std::collections::BTreeMap<String, String>,
    pub cgroup: LeaseCgroup,
    pub limits: ResolvedLimits,
    /// Disk the tree held when leased.
    pub baseline_bytes: u64,
    /// Cancelled when the lease ends: running commands are killed.
    pub ended: CancellationToken,
}

/// Inside the sandbox.
const INIT_PATH: &str = "/run/arl/init";
const PROXY_SOCKET_PATH: &str = "/run/arl/proxy.sock";

#[derive(Debug)]
pub struct Bubblewrap {
    /// Environment snapshots: `<dir>/<name>/tree`.
    environments_dir: PathBuf,
    /// Leased trees: `<dir>/<lease id>/`.
    leases_dir: PathBuf,
    /// Prepared trees: `<dir>/<environment slot>/<id>/`.
    warm_dir: PathBuf,
    init_binary: PathBuf,
    /// The BPF program of [`crate::seccomp`], handed to bubblewrap on fd 3.
    seccomp_filter: PathBuf,
    proxy_socket: Option<PathBuf>,
    agents_dir: Option<PathBuf>,
    proxy_port: u16,
    uid: u32,
    gid: u32,
    cgroups: CgroupSupport,
}

impl Bubblewrap {
    /// Checks that bubblewrap and setpriv are installed, copies the init binary where the
    /// sandbox user can read it, and detects cgroups.
    pub fn new(config: &SandboxConfig) -> Result<Self, BackendError> {
        for tool in ["bwrap", "setpriv", "git", "tar"] {
            let found = std::process::Command::new(tool)
                .arg("--version")
                .output()
                .is_ok();
            if !found {
                return Err(BackendError::Spawn(format!(
                    "{tool} is not installed; on Debian: apt-get install bubblewrap util-linux git tar"
                )));
            }
        }
        let bin_dir = config.state_dir.join("bin");
        std::fs::create_dir_all(&bin_dir).map_err(|e| BackendError::Spawn(e.to_string()))?;
        let init = bin_dir.join("arl-sandbox-init");
        // Copy, then rename: a sandbox left by a killed instance may still be running the
        // old copy, which cannot be overwritten in place.
        let staged = bin_dir.join(format!(".arl-sandbox-init.{}", std::process::id()));
        std::fs::copy(&config.init_binary, &staged)
            .and_then(|_| std::fs::rename(&staged, &init))
            .map_err(|e| {
                BackendError::Spawn(format!(
                    "cannot install {} (build it with `cargo build --bins`): {e}",
                    config.init_binary.display()
                ))
            })?;
        set_mode(&init, 0o755)?;
        let seccomp_filter = bin_dir.join("seccomp.bpf");
        let filter = crate::seccomp::filter_bytes().map_err(BackendError::Spawn)?;
        std::fs::write(&seccomp_filter, filter).map_err(|e| {
            BackendError::Spawn(format!("cannot write {}: {e}", seccomp_filter.display()))
        })?;
        make_traversable(&config.state_dir)?;
        set_mode(&bin_dir, 0o755)?;
        let scope = uuid::Uuid::new_v5(
            &uuid::Uuid::NAMESPACE_URL,
            config.state_dir.to_string_lossy().as_bytes(),
        );
        let cgroups = CgroupSupport::detect(&scope.simple().to_string()[..12]);
        tracing::info!(limits = cgroups.describe(), "bubblewrap backend ready");
        Ok(Self {
            environments_dir: config.environments_dir.clone(),
            leases_dir: config.state_dir.join("leases"),
            warm_dir: config.state_dir.join("warm"),
            init_binary: init,
            seccomp_filter,
            proxy_socket: config.proxy_socket.clone(),
            agents_dir: config.agents_dir.clone(),
            proxy_port: config.proxy_port,
            uid: config.sandbox_uid,
            gid: config.sandbox_gid,
            cgroups,
        })
    }

    pub fn cgroups(&self) -> &CgroupSupport {
        &self.cgroups
    }

    /// The bubblewrap arguments for one command of `sandbox`.
    fn bwrap_args(&self, sandbox: &SandboxHandle, spec: &ExecSpec) -> Vec<String> {
        let mut args: Vec<String> = Vec::new();
        let mut push = |parts: &[&str]| args.extend(parts.iter().map(|s| (*s).to_owned()));
        // No further user namespaces inside (`unshare -Ur` would hand the command a root
        // of its own, and with it every kernel interface such a root may reach); that
        // needs the user namespace asked for by name. bwrap also sets no-new-privs and
        // gives the command no capabilities.
        push(&[
            "--seccomp",
            "3",
            "--unshare-all",
            "--unshare-user",
            "--disable-userns",
            "--die-with-parent",
            "--new-session",
            "--hostname",
            "sandbox",
        ]);
        push(&["--ro-bind", "/usr", "/usr", "--ro-bind", "/etc", "/etc"]);
        for top in ["bin", "lib", "lib64", "sbin", "lib32", "libx32"] {
            let host = Path::new("/").join(top);
            match std::fs::read_link(&host) {
                Ok(target) => {
                    let target = target.to_string_lossy().into_owned();
                    push(&["--symlink", &target, &format!("/{top}")]);
                }
                Err(_) if host.is_dir() => {
                    push(&["--ro-bind", &format!("/{top}"), &format!("/{top}")])
                }
                Err(_) => {}
            }
        }
        // /tmp is memory: as large as the lease's memory limit, no larger.
        let tmp_bytes = (sandbox.limits.memory_mb * 1024 * 1024).to_string();
        push(&["--proc", "/proc", "--dev", "/dev"]);
        push(&["--size", &tmp_bytes, "--tmpfs", "/tmp", "--tmpfs", "/run"]);
        push(&["--ro-bind", &self.init_binary.to_string_lossy(), INIT_PATH]);
        if let Some(socket) = &self.proxy_socket {
            push(&["--bind-try", &socket.to_string_lossy(), PROXY_SOCKET_PATH]);
        }
        let tree = sandbox.dir.join("tree");
        push(&[
            "--bind",
            &tree.to_string_lossy(),
            &sandbox.workdir,
            "--chdir",
            &sandbox.workdir,
        ]);
        for (source, target) in &sandbox.mounts {
            push(&["--ro-bind", &source.to_string_lossy(), target]);
        }
        if let Some(agents) = &self.agents_dir {
            push(&["--ro-bind-try", &agents.to_string_lossy(), AGENTS_PATH]);
        }
        // Everything not mounted writable above (the root tmpfs included) is read-only.
        push(&["--remount-ro", "/"]);
        push(&["--clearenv"]);
        push(&["--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin"]);
        push(&["--setenv", "HOME", "/tmp", "--setenv", "LANG", "C.UTF-8"]);
        for (name, value) in &sandbox.env {
            push(&["--setenv", name, value]);
        }
        if self.proxy_socket.is_some() {
            let url = format!("http://127.0.0.1:{}/v1", self.proxy_port);
            push(&["--setenv", "ARL_PROXY_URL", &url]);
        }
        for (name, value) in &spec.env {
            push(&["--setenv", name, value]);
        }
        push(&["--", INIT_PATH]);
        if self.proxy_socket.is_some() {
            let relay = format!("127.0.0.1:{}={PROXY_SOCKET_PATH}", self.proxy_port);
            push(&["--relay", &relay]);
        }
        push(&["--", "/bin/sh", "-c", &spec.command]);
        args
    }
}

/// Where third-party agents are mounted in every sandbox (beside, not under, the
/// environment's `/opt/arl`).
pub const AGENTS_PATH: &str = "/opt/arl-agents";

fn set_mode(path: &Path, mode: u32) -> Result<(), BackendError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|e| BackendError::Spawn(format!("chmod {}: {e}", path.display())))
}

/// Lets the sandbox user reach lease trees under `dir` without listing anything.
fn make_traversable(dir: &Path) -> Result<(), BackendError> {
    std::fs::create_dir_all(dir).map_err(|e| BackendError::Spawn(e.to_string()))?;
    set_mode(dir, 0o711)?;
    let mut current = dir.parent();
    while let Some(parent) = current {
        // Parents must be traversable (x) for the sandbox user; do not loosen more.
        use std::os::unix::fs::PermissionsExt;
        if let Ok(meta) = std::fs::metadata(parent)
            && meta.permissions().mode() & 0o001 == 0
        {
            tracing::warn!(
                folder = %parent.display(),
                "the sandbox user cannot traverse this folder; put state_dir elsewhere"
            );
        }
        current = parent.parent();
    }
    Ok(())
}

async fn run(program: &str, args: &[&str], dir: Option<&Path>) -> Result<String, String> {
    let mut command = tokio::process::Command::new(program);
    command.args(args).stdin(Stdio::null());
    if let Some(dir) = dir {
        command.current_dir(dir);
    }
    let output = command
        .output()
        .await
        .map_err(|e| format!("{program}: {e}"))?;
    if !output.status.success() {
        return Err(format!(
            "{program} {} failed ({}): {}",
            args.join(" "),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

impl Bubblewrap {
    /// Copies the environment's snapshot into `dir/tree`, committed to git (its base).
    async fn copy_snapshot(
        &self,
        environment: &Environment,
        dir: &Path,
    ) -> Result<String, BackendError> {
        let fail = |reason: String| BackendError::Prepare {
            environment: environment.name.clone(),
            reason,
        };
        tokio::fs::create_dir_all(dir)
            .await
            .map_err(|e| fail(e.to_string()))?;
        set_mode(dir, 0o711)?;
        let tree = dir.join("tree");
        let source = format!("{}/.", environment.tree.display());
        run(
            "cp",
            &["-a", "--reflink=auto", &source, &tree.to_string_lossy()],
            None,
        )
        .await
        .map_err(fail)?;
        // No automatic gc or maintenance: `git commit` would otherwise start one detached in
        // the background on a big tree (django has more loose objects than gc.auto), which
        // then locks refs and writes root-owned packs while the tree is being chowned.
        let git = [
            "-c",
            "gc.auto=0",
            "-c",
            "maintenance.auto=false",
            "-c",
            "user.name=arl",
            "-c",
            "user.email=arl@localhost",
            "-c",
            "safe.directory=*",
        ];
        let base = if tree.join(".git").exists() {
            let mut args = git.to_vec();
            args.extend(["rev-parse", "HEAD"]);
            run("git", &args, Some(&tree)).await.map_err(fail)?
        } else {
            let steps: [&[&str]; 3] = [
                &["init", "-q"],
                &["add", "-A"],
                &["commit", "-q", "--allow-empty", "--no-verify", "-m", "base"],
            ];
            for step in steps {
                let mut args = git.to_vec();
                args.extend_from_slice(step);
                run("git", &args, Some(&tree)).await.map_err(fail)?;
            }
            let mut args = git.to_vec();
            args.extend(["rev-parse", "HEAD"]);
            run("git", &args, Some(&tree)).await.map_err(fail)?
        };
        let owner = format!("{}:{}", self.uid, self.gid);
        run("chown", &["-R", &owner, &tree.to_string_lossy()], None)
            .await
            .map_err(fail)?;
        Ok(base)
    }

    /// Moves a prepared tree to its lease's folder, records whose it is, and makes its
    /// limits.
    async fn place(
        &self,
        tree: &WarmTree,
        dir: &Path,
        lease: &Activation<'_>,
    ) -> Result<LeaseCgroup, BackendError> {
        std::fs::rename(&tree.dir, dir)
            .and_then(|()| lease.record.write(dir))
            .map_err(|err| BackendError::Spawn(format!("cannot place the work tree: {err}")))?;
        let lease_id = &lease.record.lease_id;
        self.cgroups
            .create(lease_id.as_str(), lease.limits)
            .map_err(|e| {
                BackendError::Limits(format!("{} for {lease_id}: {e}", self.cgroups.describe()))
            })
    }

    async fn remove(&self, dir: &Path) {
        if let Err(err) = tokio::fs::remove_dir_all(dir).await
            && err.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(dir = %dir.display(), %err, "cannot delete a sandbox's files");
        }
    }
}

impl Backend for Bubblewrap {
    type Environment = Environment;
    type Idle = WarmTree;
    type Sandbox = SandboxHandle;

    fn kind(&self) -> SandboxBackend {
        SandboxBackend::Bubblewrap
    }

    fn resolve(&self, environment: &EnvironmentRef) -> Result<Environment, EnvironmentError> {
        environment::resolve(&self.environments_dir, environment)
    }

    async fn prepare(&self, environment: &Environment) -> Result<Prepared<WarmTree>, BackendError> {
        let slot = uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_URL, environment.name.as_bytes());
        let dir = self
            .warm_dir
            .join(slot.simple().to_string())
            .join(uuid::Uuid::new_v4().simple().to_string());
        let made = match self.copy_snapshot(environment, &dir).await {
            Ok(base) => crate::disk::measure(&dir.join("tree"))
                .await
                .map(|(bytes, _)| (base, bytes))
                .map_err(|err| BackendError::Prepare {
                    environment: environment.name.clone(),
                    reason: format!("cannot measure the prepared tree: {err}"),
                }),
            Err(err) => Err(err),
        };
        match made {
            Ok((base, bytes)) => Ok(Prepared {
                base,
                workdir: environment.workdir.clone(),
                sandbox: WarmTree {
                    dir,
                    bytes,
                    environment: environment.clone(),
                },
            }),
            Err(err) => {
                self.remove(&dir).await;
                Err(err)
            }
        }
    }

    async fn activate(
        &self,
        prepared: Prepared<WarmTree>,
        lease: Activation<'_>,
    ) -> Result<SandboxHandle, BackendError> {
        let tree = prepared.sandbox;
        let dir = self.leases_dir.join(lease.record.lease_id.as_str());
        match self.place(&tree, &dir, &lease).await {
            Ok(cgroup) => Ok(SandboxHandle {
                lease_id: lease.record.lease_id.clone(),
                dir,
                workdir: tree.environment.workdir.clone(),
                mounts: tree.environment.mounts.clone(),
                env: tree.environment.env.clone(),
                cgroup,
                limits: lease.limits.clone(),
                baseline_bytes: tree.bytes,
                ended: lease.ended,
            }),
            Err(err) => {
                self.remove(if dir.exists() { &dir } else { &tree.dir })
                    .await;
                Err(err)
            }
        }
    }

    async fn exec(
        &self,
        sandbox: &SandboxHandle,
        spec: ExecSpec,
    ) -> Result<ExecOutput, BackendError> {
        let started = Instant::now();
        // A root shell joins the lease's cgroups (or sets rlimits), drops to the sandbox
        // user and becomes bubblewrap; the command starts already limited.
        let mut script = String::from(
            "while [ \"$1\" != -- ]; do echo $$ > \"$1\" || exit 125; shift; done; shift; ",
        );
        // No file larger than the tree's disk limit (dash counts 512-byte blocks): the disk
        // watchdog may look only every few seconds.
        script.push_str(&format!(
            "ulimit -t {} 2>/dev/null; ulimit -f {} 2>/dev/null; ",
            sandbox.limits.cpu_seconds,
            sandbox.limits.disk_mb.saturating_mul(2048)
        ));
        if sandbox.cgroup.is_empty() {
            // Without cgroups: memory per process, and processes per user (every sandbox
            // runs as the same user, so this bounds them together, not each lease).
            script.push_str(&format!(
                "ulimit -v {} 2>/dev/null; ulimit -u {} 2>/dev/null; ",
                sandbox.limits.memory_mb * 1024,
                sandbox.limits.pids
            ));
        }
        // bubblewrap reads the seccomp filter from fd 3 (`--seccomp 3`).
        script.push_str("exec 3<\"$ARL_SECCOMP_FILTER\"; exec \"$@\"");
        let mut command = tokio::process::Command::new("/bin/sh");
        command.env("ARL_SECCOMP_FILTER", &self.seccomp_filter);
        command.arg("-c").arg(script).arg("arl-exec");
        command.args(sandbox.cgroup.procs_files());
        command.arg("--");
        command.args([
            "setpriv",
            &format!("--reuid={}", self.uid),
            &format!("--regid={}", self.gid),
            "--clear-groups",
            "--",
            "bwrap",
        ]);
        command.args(self.bwrap_args(sandbox, &spec));
        command
            .stdin(if spec.stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let mut child = command
            .spawn()
            .map_err(|e| BackendError::Spawn(e.to_string()))?;

        if let (Some(input), Some(mut stdin)) = (spec.stdin, child.stdin.take()) {
            tokio::spawn(async move {
                // The command may exit without reading; a broken pipe is its business.
                let _ = stdin.write_all(&input).await;
            });
        }
        let stdout = child.stdout.take();
        let stderr = child.stderr.take();
        let limit = spec.output_limit;
        let out_task = tokio::spawn(capture(stdout, limit));
        let err_task = tokio::spawn(capture(stderr, limit));

        let (exit_code, timed_out) = tokio::select! {
            status = child.wait() => {
                let status = status.map_err(|e| BackendError::Spawn(e.to_string()))?;
                (exit_code_of(status), false)
            }
            () = tokio::time::sleep(spec.timeout) => {
                kill_tree(&mut child, &sandbox.cgroup).await;
                (-1, true)
            }
            () = sandbox.ended.cancelled() => {
                kill_tree(&mut child, &sandbox.cgroup).await;
                (-1, false)
            }
        };
        let (stdout, out_truncated) = out_task.await.unwrap_or_default();
        let (stderr, err_truncated) = err_task.await.unwrap_or_default();
        Ok(ExecOutput {
            exit_code,
            stdout,
            stderr,
            timed_out,
            truncated: out_truncated || err_truncated,
            duration: started.elapsed(),
        })
    }

    async fn destroy(&self, sandbox: &SandboxHandle) {
        sandbox.cgroup.destroy().await;
        self.remove(&sandbox.dir).await;
    }

    /// Ends the lease once its work tree has grown past its disk limit ([`crate::disk`]).
    async fn watch(&self, sandbox: &SandboxHandle) -> (LeaseEnd, String) {
        let tree = sandbox.dir.join("tree");
        let mut pause = Duration::from_secs(1);
        loop {
            tokio::time::sleep(pause).await;
            let (bytes, took) = match crate::disk::measure(&tree).await {
                Ok(measured) => measured,
                Err(err) => {
                    if !sandbox.ended.is_cancelled() {
                        tracing::warn!(lease = %sandbox.lease_id, %err, "cannot measure a work tree");
                    }
                    pause = Duration::from_secs(10);
                    continue;
                }
            };
            pause = crate::disk::next_check_in(took);
            let grown = bytes.saturating_sub(sandbox.baseline_bytes);
            if let Some(why) = crate::disk::over_limit(grown, sandbox.limits.disk_mb) {
                return (LeaseEnd::DiskLimit, why);
            }
        }
    }

    async fn reap_leftovers(&self) -> Vec<LeaseRecord> {
        let mut records = Vec::new();
        for dir in read_dirs(&self.leases_dir) {
            if let Some(record) = LeaseRecord::read(&dir) {
                records.push(record);
            }
            self.remove(&dir).await;
        }
        for cgroup in self.cgroups.leftovers() {
            cgroup.destroy().await;
        }
        self.wind_down().await;
        records
    }

    async fn wind_down(&self) {
        for dir in read_dirs(&self.warm_dir) {
            self.remove(&dir).await;
        }
    }
}

fn read_dirs(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .map(|e| e.path())
                .filter(|p| p.is_dir())
                .collect()
        })
        .unwrap_or_default()
}

fn exit_code_of(status: std::process::ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    status
        .code()
        .or_else(|| status.signal().map(|s| 128 + s))
        .unwrap_or(-1)
}

/// Kills bubblewrap (which takes its pid namespace with it) and sweeps the cgroup for
/// anything that escaped into a new session.
async fn kill_tree(child: &mut tokio::process::Child, cgroup: &LeaseCgroup) {
    let _ = child.start_kill();
    let _ = tokio::time::timeout(Duration::from_secs(5), child.wait()).await;
    if !cgroup.is_empty() {
        let swept = LeaseCgroup {
            dirs: cgroup.dirs.clone(),
        };
        swept.kill_all().await;
    }
}
