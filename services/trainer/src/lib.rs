//! The GRPO trainer.
//!
//! - [`objective`]: the math of one update — group advantages, the PPO-clipped token loss
//!   with its gradient, KL to a reference, entropy bonus, truncated importance sampling and
//!   loss aggregation — each against hand-computed values.
//! - [`step`]: one step on the model core (old/reference log-probs, epochs, mini- and
//!   micro-batches, gradient clipping, AdamW); [`schedule`]: the learning rate.
//! - [`batch`]: a step's batch assembled from trajectories; [`checkpoint`]: policy versions
//!   and resumable checkpoints on disk; [`policy`]: a run's model, reference and optimizer
//!   on the CPU or a GPU; [`service`]: the NATS service around them; [`metrics`]: what
//!   each step did, for Prometheus.

pub mod batch;
pub mod checkpoint;
pub mod hosted;
pub mod metrics;
pub mod objective;
pub mod policy;
pub mod schedule;
pub mod service;
pub mod step;
