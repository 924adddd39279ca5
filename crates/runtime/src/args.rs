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

    /// Copies JetStream keeps of each stream, bucket and object store this service
    /// creates: 3 on a cluster of three NATS servers, 1 on one.
    #[arg(long, env = "ARL_STREAM_REPLICAS", default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=5))]
    pub stream_replicas: u8,

    /// Bytes each event stream may hold (a full stream refuses new events rather than
    /// dropping unread ones). JetStream reserves them on disk when the stream is made.
    /// Unset: streams are bounded by age (14 days) only.
    #[arg(long, env = "ARL_STREAM_MAX_BYTES", value_parser = clap::value_parser!(u64).range(1..))]
    pub stream_max_bytes: Option<u64>,

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
        config.stream_replicas = usize::from(self.stream_replicas);
        config.stream_max_bytes = self.stream_max_bytes;
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

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        common: CommonArgs,
    }

    #[test]
    fn stream_replicas_reach_the_bus_config_and_zero_is_refused() {
        let cli = Cli::try_parse_from(["svc"]).unwrap();
        assert_eq!(cli.common.bus_config("svc").unwrap().stream_replicas, 1);
        let cli = Cli::try_parse_from(["svc", "--stream-replicas", "3"]).unwrap();
        assert_eq!(cli.common.bus_config("svc").unwrap().stream_replicas, 3);
        let err = Cli::try_parse_from(["svc", "--stream-replicas", "0"]).unwrap_err();
        assert!(err.to_string().contains("--stream-replicas"), "{err}");
    }
}
