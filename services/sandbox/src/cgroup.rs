//! Per-lease resource limits with cgroups (v2, or v1's memory/pids/cpu hierarchies), or
//! rlimits where the machine gives no writable cgroup file system.
//!
//! A process joins a lease's cgroups by writing its own pid into them before it execs the
//! sandbox (see `bwrap.rs`), so the untrusted command starts already limited.

use std::path::{Path, PathBuf};

use crate::config::ResolvedLimits;

/// What this machine offers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CgroupSupport {
    /// Unified hierarchy rooted here.
    V2(PathBuf),
    /// Separate hierarchies per controller.
    V1 {
        memory: PathBuf,
        pids: PathBuf,
        cpu: Option<PathBuf>,
    },
    /// No writable cgroups: fall back to rlimits.
    None,
}

impl CgroupSupport {
    /// Detects cgroups and checks that a group can be made under them. `scope` names this
    /// service's parent group; instances with the same state folder share it (so a
    /// restarted instance reaps its predecessor's groups) and others never touch it.
    pub fn detect(scope: &str) -> Self {
        let group = format!("arl-sandbox-{scope}");
        let group = group.as_str();
        let root = Path::new("/sys/fs/cgroup");
        if root.join("cgroup.controllers").is_file() {
            let parent = root.join(group);
            if std::fs::create_dir_all(&parent).is_ok() {
                // Let lease groups use the memory, pids and cpu controllers.
                let _ = std::fs::write(root.join("cgroup.subtree_control"), "+memory +pids +cpu");
                let _ = std::fs::write(parent.join("cgroup.subtree_control"), "+memory +pids +cpu");
                if parent.join("cgroup.subtree_control").is_file() {
                    return CgroupSupport::V2(parent);
                }
            }
            return CgroupSupport::None;
        }
        let memory = root.join("memory").join(group);
        let pids = root.join("pids").join(group);
        if std::fs::create_dir_all(&memory).is_ok() && std::fs::create_dir_all(&pids).is_ok() {
            let cpu = root.join("cpu").join(group);
            let cpu = std::fs::create_dir_all(&cpu).is_ok().then_some(cpu);
            return CgroupSupport::V1 { memory, pids, cpu };
        }
        CgroupSupport::None
    }

    pub fn describe(&self) -> &'static str {
        match self {
            CgroupSupport::V2(_) => "cgroup v2",
            CgroupSupport::V1 { .. } => "cgroup v1",
            CgroupSupport::None => "rlimits (no writable cgroups)",
        }
    }

    /// Creates the groups of one lease and writes its limits.
    pub fn create(&self, lease: &str, limits: &ResolvedLimits) -> std::io::Result<LeaseCgroup> {
        let memory_bytes = limits.memory_mb * 1024 * 1024;
        let cpu_period = 100_000u64;
        let cpu_quota = (limits.cpus * cpu_period as f64).round().max(1000.0) as u64;
        match self {
            CgroupSupport::V2(parent) => {
                let dir = parent.join(lease);
                std::fs::create_dir_all(&dir)?;
                std::fs::write(dir.join("memory.max"), memory_bytes.to_string())?;
                let _ = std::fs::write(dir.join("memory.swap.max"), "0");
                std::fs::write(dir.join("pids.max"), limits.pids.to_string())?;
                let _ = std::fs::write(dir.join("cpu.max"), format!("{cpu_quota} {cpu_period}"));
                Ok(LeaseCgroup { dirs: vec![dir] })
            }
            CgroupSupport::V1 { memory, pids, cpu } => {
                let memory_dir = memory.join(lease);
                let pids_dir = pids.join(lease);
                std::fs::create_dir_all(&memory_dir)?;
                std::fs::create_dir_all(&pids_dir)?;
                std::fs::write(
                    memory_dir.join("memory.limit_in_bytes"),
                    memory_bytes.to_string(),
                )?;
                let _ = std::fs::write(
                    memory_dir.join("memory.memsw.limit_in_bytes"),
                    memory_bytes.to_string(),
                );
                std::fs::write(pids_dir.join("pids.max"), limits.pids.to_string())?;
                let mut dirs = vec![memory_dir, pids_dir];
                if let Some(cpu) = cpu {
                    let cpu_dir = cpu.join(lease);
                    if std::fs::create_dir_all(&cpu_dir).is_ok() {
                        let _ = std::fs::write(
                            cpu_dir.join("cpu.cfs_period_us"),
                            cpu_period.to_string(),
                        );
                        let _ =
                            std::fs::write(cpu_dir.join("cpu.cfs_quota_us"), cpu_quota.to_string());
                        dirs.push(cpu_dir);
                    }
                }
                Ok(LeaseCgroup { dirs })
            }
            CgroupSupport::None => Ok(LeaseCgroup { dirs: vec![] }),
        }
    }

    /// Lease groups left by an earlier instance.
    pub fn leftovers(&self) -> Vec<LeaseCgroup> {
        let parents: Vec<PathBuf> = match self {
            CgroupSupport::V2(parent) => vec![parent.clone()],
            CgroupSupport::V1 { memory, pids, cpu } => {
                let mut p = vec![memory.clone(), pids.clone()];
                p.extend(cpu.clone());
                p
            }
            CgroupSupport::None => vec![],
        };
        parents
            .iter()
            .filter_map(|p| std::fs::read_dir(p).ok())
            .flat_map(|entries| entries.filter_map(Result::ok))
            .filter(|e| e.path().is_dir() && e.file_name().to_string_lossy().starts_with("lease-"))
            .map(|e| LeaseCgroup {
                dirs: vec![e.path()],
            })
            .collect()
    }
}

/// The cgroup directories of one lease (empty under rlimits).
#[derive(Clone, Debug, Default)]
pub struct LeaseCgroup {
    pub dirs: Vec<PathBuf>,
}

impl LeaseCgroup {
    /// The `cgroup.procs` files a process writes its pid into to join.
    pub fn procs_files(&self) -> Vec<PathBuf> {
        self.dirs.iter().map(|d| d.join("cgroup.procs")).collect()
    }

    pub fn is_empty(&self) -> bool {
        self.dirs.is_empty()
    }

    /// SIGKILLs every process in the groups, then removes the groups.
    pub async fn destroy(&self) {
        self.kill_all().await;
        for dir in &self.dirs {
            for _ in 0..20 {
                if std::fs::remove_dir(dir).is_ok() || !dir.exists() {
                    break;
                }
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        }
    }

    /// SIGKILLs every process in the groups until none is left (a fork bomb may be
    /// forking while we kill).
    pub async fn kill_all(&self) {
        for _ in 0..50 {
            let pids = self.pids();
            if pids.is_empty() {
                break;
            }
            let _ = tokio::process::Command::new("kill")
                .arg("-9")
                .args(&pids)
                .output()
                .await;
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }

    fn pids(&self) -> Vec<String> {
        let mut pids: Vec<String> = self
            .procs_files()
            .iter()
            .filter_map(|f| std::fs::read_to_string(f).ok())
            .flat_map(|text| text.lines().map(str::to_owned).collect::<Vec<_>>())
            .filter(|p| !p.is_empty())
            .collect();
        pids.sort();
        pids.dedup();
        pids
    }
}
