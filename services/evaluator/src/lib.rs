//! Evaluator: the resolution rate on the validation split every `eval_every` steps and at
//! the end — [`service`] runs it over NATS, [`stats`] holds the estimators.

pub mod hosted;
pub mod service;
pub mod stats;
