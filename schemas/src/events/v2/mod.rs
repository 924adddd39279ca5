//! Version 2 of the events that changed. Never edit a struct here once it has been
//! published.

mod llm;
mod reward;
mod sandbox;
mod train;
mod weights;

pub use llm::*;
pub use reward::*;
pub use sandbox::*;
pub use train::*;
pub use weights::*;
