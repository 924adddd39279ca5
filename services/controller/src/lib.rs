//! The controller owns a run's life from the run request to completion.
//!
//! - [`admission`] decides whether a run request is accepted: the request must decode,
//!   every field must be in range, and the model and dataset must be reachable here.
//! - [`progress`] folds the pipeline's events (train steps, evaluations, trials, weights,
//!   failures) into the run's state, and says when the run is complete.
//! - [`store`] keeps each run's state in the `ARL_RUN_STATE` key-value bucket, with
//!   compare-and-set writes, so a restarted controller carries on where it stopped.
//! - [`tensorboard`] writes every step's and evaluation's figures as TensorBoard scalars
//!   (VeRL's names), when the controller is given a folder for them.
//! - [`service`] wires these to the bus.

pub mod admission;
pub mod hosted;
pub mod progress;
pub mod resources;
pub mod service;
pub mod store;
pub mod tensorboard;

pub use service::{Controller, ControllerConfig};
