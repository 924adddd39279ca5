//! A real Kafka-protocol broker for tests and benchmarks: tansu (crates.io, a test tool
//! here; `make deps` installs it and writes its PostgreSQL schema) on its PostgreSQL
//! storage engine, in a database of its own on the machine's PostgreSQL. What the broker
//! acknowledged survives a SIGKILL: [`KafkaBroker::kill`] then [`KafkaBroker::spawn`]
//! brings the same broker back on the same port.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use anyhow::{Context, bail};

/// The machine's PostgreSQL (trust authentication on loopback, as on these machines);
/// `ARL_TEST_POSTGRES` points elsewhere.
fn postgres() -> String {
    std::env::var("ARL_TEST_POSTGRES")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".into())
}

fn tansu_home() -> PathBuf {
    PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".cache/arl/tansu-0.6.0")
}

/// `$ARL_TANSU`, else where `make deps` installs it.
pub fn tansu() -> PathBuf {
    std::env::var_os("ARL_TANSU")
        .map(PathBuf::from)
        .unwrap_or_else(|| tansu_home().join("bin/tansu"))
}

pub struct KafkaBroker {
    child: Option<Child>,
    pub port: u16,
    database: String,
    /// SASL/SCRAM required of every client.
    authentication: bool,
}

impl KafkaBroker {
    /// A broker with a fresh database, listening on a free loopback port.
    pub fn start() -> anyhow::Result<KafkaBroker> {
        let schema = std::env::var_os("ARL_TANSU_SCHEMA")
            .map(PathBuf::from)
            .unwrap_or_else(|| tansu_home().join("postgres-schema.sql"));
        if !schema.exists() || !tansu().exists() {
            bail!(
                "tansu or its schema ({}, {}) is missing: run `make deps`",
                tansu().display(),
                schema.display()
            );
        }
        let id = uuid::Uuid::new_v4().simple().to_string();
        let database = format!("arl_kafka_{}", &id[..12]);
        psql("postgres", &["-c", &format!("create database {database}")])?;
        psql(&database, &["-f", &schema.display().to_string()])?;
        let mut broker = KafkaBroker {
            child: None,
            port: crate::free_port()?,
            database,
            authentication: false,
        };
        broker.spawn()?;
        Ok(broker)
    }

    /// Starts the broker process (again, after [`Self::kill`]) on the same port and data.
    pub fn spawn(&mut self) -> anyhow::Result<()> {
        let url = self.url();
        let mut command = Command::new(tansu());
        command
            .args(["broker", "--cluster-id", "arl-test", "--listener-url", &url])
            .args(["--advertised-listener-url", &url])
            // The local server's certificate names localhost only, and tests cross no
            // network: no TLS to PostgreSQL.
            .args([
                "--storage-engine",
                &format!("{}/{}?sslmode=disable", postgres(), self.database),
            ])
            .env("RUST_LOG", "error")
            .stdout(Stdio::null());
        if self.authentication {
            command.arg("--authentication");
        }
        self.child = Some(command.spawn().context("starting tansu")?);
        Ok(())
    }

    /// From now on every client must authenticate with SASL/SCRAM (users made before with
    /// [`Self::add_user`]; tansu's own tools cannot authenticate, so topics and users come
    /// first). The broker restarts on the same port and data.
    pub fn require_authentication(&mut self) -> anyhow::Result<()> {
        self.kill();
        self.authentication = true;
        self.spawn()
    }

    /// SIGKILL: no chance to flush anything the storage engine has not committed.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// `tcp://127.0.0.1:<port>`, as tansu's tools take it.
    pub fn url(&self) -> String {
        format!("tcp://127.0.0.1:{}", self.port)
    }

    /// `127.0.0.1:<port>`, Kafka clients' `bootstrap.servers`.
    pub fn bootstrap_servers(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Creates `topic` with `partitions` partitions, waiting for the broker to answer.
    pub fn create_topic(&self, topic: &str, partitions: u32) -> anyhow::Result<()> {
        self.tool(&[
            "topic",
            "create",
            topic,
            "--partitions",
            &partitions.to_string(),
            "--broker",
            &self.url(),
        ])
    }

    /// A SCRAM-SHA-512 user.
    pub fn add_user(&self, name: &str, password: &str) -> anyhow::Result<()> {
        self.tool(&["user", "create", name, password, "--broker", &self.url()])
    }

    /// Runs a tansu subcommand, retrying while the broker is still starting.
    fn tool(&self, args: &[&str]) -> anyhow::Result<()> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            let output = Command::new(tansu()).args(args).output()?;
            if output.status.success() {
                return Ok(());
            }
            if std::time::Instant::now() > deadline {
                bail!(
                    "tansu {args:?}: {}",
                    String::from_utf8_lossy(&output.stderr).trim()
                );
            }
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
    }
}

impl Drop for KafkaBroker {
    fn drop(&mut self) {
        self.kill();
        let _ = psql(
            "postgres",
            &[
                "-c",
                &format!("drop database if exists {} with (force)", self.database),
            ],
        );
    }
}

fn psql(database: &str, args: &[&str]) -> anyhow::Result<()> {
    let target = format!("{}/{database}", postgres());
    let output = Command::new("psql")
        .arg(&target)
        .args(["-q", "-v", "ON_ERROR_STOP=1"])
        .args(args)
        .output()
        .context("running psql (PostgreSQL's client)")?;
    if !output.status.success() {
        bail!(
            "psql {args:?} on {target}: {} (is PostgreSQL running? `make kafka-deps` starts it)",
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(())
}
