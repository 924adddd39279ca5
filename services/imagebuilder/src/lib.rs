//! The image builder: every task's environment exists before its trials start.
//!
//! - [`recipe`]: what an environment is made of (SWE-bench instances), with a digest;
//! - [`local`]: local snapshots for the bubblewrap sandbox, built in bubblewrap;
//! - [`registry`]: cluster images checked through the OCI distribution API;
//! - [`buildkit`]: a missing cluster image's build context and `buildctl` command;
//! - [`jobs`]: that build as a Kubernetes Job (rootless BuildKit), watched to its outcome;
//! - [`service`]: task batches in, `image.ready` / `image.failed` out;
//! - [`hosted`]: the flags, and how the service starts.

pub mod buildkit;
pub mod hosted;
pub mod jobs;
pub mod local;
pub mod recipe;
pub mod registry;
pub mod service;
