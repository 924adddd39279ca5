//! The GRPO trainer. So far: [`objective`], the math of one update — group advantages,
//! the PPO-clipped token loss with its gradient, KL to a reference, entropy bonus,
//! truncated importance sampling and loss aggregation — each against hand-computed values.
//! The service (consuming trajectories, stepping the model core, publishing weights) is
//! built on it next.

pub mod objective;
pub mod schedule;
pub mod step;
