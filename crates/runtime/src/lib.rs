//! The runtime every ARL service stands on. This crate, and no other, owns:
//! - the NATS connection (credentials and TLS: [`auth`]), JetStream stream/consumer/bucket provisioning and typed publish
//!   ([`bus`]);
//! - the consumer loop: ack after durable work, nak with backoff, dead-letter after
//!   `max_deliver`, bounded concurrency ([`consumer`]);
//! - tracing logs and OTLP export, and the W3C `traceparent` on NATS headers
//!   ([`telemetry`]);
//! - `/health` and `/metrics` over HTTP ([`http`], [`metrics`]);
//! - graceful shutdown on SIGINT/SIGTERM ([`shutdown`]);
//! - one service shape: any [`host::Service`] run with all of the above, alone or with
//!   others in one process ([`host`]);
//! - ordered, durable reads of a stream for forwarding elsewhere, acknowledged up to a
//!   floor ([`feed`]);
//! - the SHA-256 form digests are exchanged in ([`digest`]);
//! - files in JetStream object stores, streamed and checked by digest, and the policy
//!   versions of `ARL_WEIGHTS` ([`objects`]);
//! - comparing secrets in constant time ([`secret`]);
//! - the oldest nats-server ARL runs on, and where `arl up` finds one ([`nats_server`]).

pub mod args;
pub mod auth;
pub mod bus;
pub mod consumer;
pub mod digest;
pub mod feed;
pub mod headers;
pub mod host;
pub mod http;
pub mod metrics;
pub mod nats_server;
pub mod objects;
pub mod rpc;
mod run_watch;
pub mod secret;
pub mod shutdown;
pub mod telemetry;
pub mod text;

pub use args::CommonArgs;
pub use bus::{Bus, BusError, Published};
pub use consumer::{ConsumerSpec, Delivery, HandlerError};
pub use metrics::Metrics;
pub use shutdown::Shutdown;

/// A run as a handler sees it: the controller's record and the spec it was accepted
/// with ([`Bus::run_context`]).
#[derive(Clone, Debug)]
pub struct RunContext {
    pub state: arl_schemas::state::RunStateV1,
    pub spec: arl_schemas::spec::RunSpec,
}
