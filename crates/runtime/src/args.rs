//! Command-line and environment settings every service binary shares.

use std::net::SocketAddr;
use std::path::PathBuf;

use arl_schemas::{Namespace, NamespaceError};

use crate::auth::NatsAuth;
use crate::bus::BusConfig;

#[derive(Clone, Debug, clap::Args)]
pub struct CommonArgs {
    /// NATS server to connect to.
    #[arg(long, env = "NATS_URL", default_value = "nats://127.0.0.1:4222")]
    pub nats_url: String,

    /// Prefix of every subject, stream and bucket name; isolates tenants and tests that
    /// share one NATS server.
    #[arg(long, env = "ARL_PREFIX", default_value = "")]
    pub prefix: String,

    /// Address of the `/health` and `/metrics` endpoints (port 0 picks a free port).
    #[arg(long, env = "ARL_HTTP_ADDR", default_value = "127.0.0.1:0")]
    pub http_addr: SocketAddr,

    #[command(flatten)]
    pub nats: NatsAuth,
}

impl CommonArgs {
    pub fn namespace(&self) -> Result<Namespace, NamespaceError> {
        Namespace::from_option(Some(self.prefix.as_str()))
    }

    /// How the service `client_name` connects: URL, namespace, credentials, TLS.
    pub fn bus_config(&self, client_name: &str) -> Result<BusConfig, NamespaceError> {
        let mut config = BusConfig::new(&self.nats_url, self.namespace()?, client_name);
        config.auth = self.nats.clone();
        Ok(config)
    }
}

/// Where policy versions and checkpoints live on one machine: `$ARL_RUNS_DIR`, else
/// `~/.cache/arl/runs`. The trainer writes there; the engine loads only from there.
pub fn default_runs_dir() -> PathBuf {
    machine_dir("ARL_RUNS_DIR", "runs")
}

/// Where `make models` installs models on one machine: `$ARL_MODEL_DIR`, else
/// `~/.cache/arl/models`.
pub fn default_model_dir() -> PathBuf {
    machine_dir("ARL_MODEL_DIR", "models")
}

/// `$variable`, else `~/.cache/arl/<name>`.
fn machine_dir(variable: &str, name: &str) -> PathBuf {
    if let Some(dir) = std::env::var_os(variable) {
        return PathBuf::from(dir);
    }
    std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."))
        .join(".cache/arl")
        .join(name)
}

/// An installed model's name (`arl_schemas::spec::MODEL_NAMES`) to its file in
/// [`default_model_dir`]; anything else is a path.
pub fn model_path_or_name(path: &str) -> PathBuf {
    match arl_schemas::spec::MODEL_NAMES
        .iter()
        .find(|(name, _)| *name == path)
    {
        Some((_, file)) => default_model_dir().join(file),
        None => PathBuf::from(path),
    }
}
