//! Command-line and environment settings every service binary shares.

use std::net::SocketAddr;

use arl_schemas::{Namespace, NamespaceError};

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
}

impl CommonArgs {
    pub fn namespace(&self) -> Result<Namespace, NamespaceError> {
        Namespace::from_option(Some(self.prefix.as_str()))
    }
}
