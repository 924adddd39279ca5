//! The services under load, each a separate process of the one `arl` executable
//! (`arl serve <service> …`, the flags `arl up` gives it), and what each one costs:
//! resident memory (`VmRSS`) and CPU time (`utime + stime`) read from `/proc`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// One process under measurement: a service, the nats-server, or this process (the
/// stand-in engine and the measurement itself).
#[derive(Clone, Debug)]
pub struct Measured {
    pub name: String,
    pub pid: u32,
}

/// A service started by [`Fleet::start`].
struct Service {
    name: String,
    child: Child,
    ops_port: u16,
    log: PathBuf,
}

/// Every service process; each is sent SIGTERM, then killed after 10 s, when dropped.
pub struct Fleet {
    arl: PathBuf,
    logs: PathBuf,
    env: Vec<(String, String)>,
    services: Vec<Service>,
}

impl Fleet {
    /// `arl` is the executable; `env` what every service gets (NATS_URL, ARL_PREFIX …).
    pub fn new(arl: PathBuf, logs: &Path, env: Vec<(String, String)>) -> anyhow::Result<Self> {
        std::fs::create_dir_all(logs)?;
        Ok(Self {
            arl,
            logs: logs.to_path_buf(),
            env,
            services: Vec::new(),
        })
    }

    /// Starts `arl serve <service> <args>` as `name`; `ops_port` is where its `/ready`
    /// answers (ARL_HTTP_ADDR, or its API's own listener for the proxy and the sandbox).
    pub fn start(
        &mut self,
        name: &str,
        service: &str,
        args: &[String],
        ops_port: u16,
    ) -> anyhow::Result<()> {
        let log = self.logs.join(format!("{name}.log"));
        // Through setpriv, each service gets SIGTERM when this process dies however it
        // dies (as under `arl up`): nothing is left running.
        let child = Command::new("setpriv")
            .args(["--pdeathsig", "TERM", "--"])
            .arg(&self.arl)
            .arg("serve")
            .arg(service)
            .args(args)
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .env("ARL_HTTP_ADDR", format!("127.0.0.1:{ops_port}"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?)
            .spawn()
            .map_err(|e| anyhow::anyhow!("cannot start {}: {e}", self.arl.display()))?;
        self.services.push(Service {
            name: name.to_owned(),
            child,
            ops_port,
            log,
        });
        Ok(())
    }

    /// Waits until every service's `/ready` answers 200; fails with the log's tail of one
    /// that exited, or the list of those still waiting after `timeout`.
    pub async fn ready(&mut self, timeout: Duration) -> anyhow::Result<()> {
        let started = Instant::now();
        loop {
            let mut waiting = Vec::new();
            for service in &mut self.services {
                if let Ok(Some(status)) = service.child.try_wait() {
                    anyhow::bail!(
                        "{} exited ({status}) at start; its log ends:\n{}",
                        service.name,
                        tail(&service.log)
                    );
                }
                let url = format!("http://127.0.0.1:{}/ready", service.ops_port);
                let ok = arl_testkit::http(&url, "GET", &[], b"")
                    .await
                    .is_ok_and(|r| r.status == 200);
                if !ok {
                    waiting.push(service.name.clone());
                }
            }
            if waiting.is_empty() {
                return Ok(());
            }
            anyhow::ensure!(
                started.elapsed() < timeout,
                "not ready after {timeout:?}: {}",
                waiting.join(", ")
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// A service that has exited since it started, with its log's tail.
    pub fn exited(&mut self) -> Option<String> {
        self.services.iter_mut().find_map(|s| {
            matches!(s.child.try_wait(), Ok(Some(_)))
                .then(|| format!("{} exited; its log ends:\n{}", s.name, tail(&s.log)))
        })
    }

    pub fn measured(&self) -> Vec<Measured> {
        self.services
            .iter()
            .map(|s| Measured {
                name: s.name.clone(),
                pid: s.child.id(),
            })
            .collect()
    }

    /// The ops port of the service named `name`.
    pub fn ops_port(&self, name: &str) -> Option<u16> {
        self.services
            .iter()
            .find(|s| s.name == name)
            .map(|s| s.ops_port)
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        for service in &mut self.services {
            let _ = Command::new("kill")
                .args(["-TERM", &service.child.id().to_string()])
                .status();
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        for service in &mut self.services {
            while matches!(service.child.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = service.child.kill();
            let _ = service.child.wait();
        }
    }
}

fn tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

/// Resident memory of `pid` in MiB (`VmRSS` of `/proc/<pid>/status`); None once it is gone.
pub fn rss_mib(pid: u32) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

/// CPU seconds `pid` has used (user + system, all its threads), from `/proc/<pid>/stat`.
/// Clock ticks are taken as 100 a second (USER_HZ on every Linux target Rust supports).
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces; the fields after its ')' are fixed.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // Fields 14 and 15 of stat are utime and stime: indices 11 and 12 after the ')'.
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / 100.0)
}

/// CPU seconds the whole machine has been busy (every core; /proc/stat's first line,
/// everything but idle and iowait), to tell how much of it the others here took.
pub fn machine_busy_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let first = stat.lines().next()?;
    let ticks: Vec<f64> = first
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    let total: f64 = ticks.iter().take(8).sum();
    let idle = ticks.get(3)? + ticks.get(4)?;
    Some((total - idle) / 100.0)
}
