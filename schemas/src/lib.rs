//! Wire contracts of ARL: every event that crosses NATS, the names of subjects, streams,
//! consumers and buckets, and the run spec a user submits.
//!
//! Services depend on this crate and never on each other. A published event version is
//! never edited: a change adds `…V2` beside `…V1`, and readers upgrade old versions.

pub mod catalog;
pub mod dataset;
pub mod event;
pub mod events;
pub mod ids;
pub mod namespace;
pub mod openai;
pub mod permissions;
pub mod rpc;
pub mod spec;
pub mod spec_layers;
pub mod state;
pub mod verl;

pub use event::{DecodeError, Event, FieldError};
pub use ids::{IdError, LeaseId, RunId, TaskId, TrialId};
pub use namespace::{Bucket, Domain, Namespace, NamespaceError, ObjectStore};
