//! The sandbox service: isolated environments for untrusted agent code, leased over NATS
//! and driven over HTTP.
//!
//! - [`environment`]: the environment snapshots sandboxes are made from.
//! - [`backend`]: the boundary every backend implements; [`bwrap`] is the local one
//!   (bubblewrap namespaces, no network but the proxy relay, cgroup or rlimit limits),
//!   [`kube`] the cluster one (Pods from the environment's image, or OpenKruise
//!   SandboxClaims; exec through the Kubernetes API).
//! - [`cgroup`]: per-lease memory, pids and CPU limits.
//! - [`pool`]: warm pools of prepared sandboxes per environment (deadpool).
//! - [`lease`]: the lease table: ttl, renew, expiry.
//! - [`api`]: the exec and file API per lease (axum).
//! - [`service`]: lease/renew/release over NATS, events, reaping at start.

pub mod api;
pub mod backend;
pub mod bwrap;
pub mod cgroup;
pub mod config;
pub mod disk;
pub mod environment;
pub mod hosted;
pub mod kruise;
pub mod kube;
pub mod lease;
pub mod pool;
pub mod seccomp;
pub mod service;

pub use config::SandboxConfig;
pub use service::SandboxService;
