//! Rollout: trials at scale, with token truth and explicit failures.
//!
//! - [`service`]: the work queue of trials, each one's agent run up to its hand-off to
//!   grading, and the failure policy;
//! - [`join`]: the saga's second hand-off — a grade joined with the recorded calls into
//!   `trajectory.ready`, on whichever replica takes it;
//! - [`agent`]: the built-in agents (tool calling, text protocol, math);
//! - [`llm`]: their OpenAI client through the token proxy, failures classified;
//! - [`mcp`]: their MCP client (the `mcp-tools` agent's tools);
//! - [`metrics`]: outcome, branch, mask and parse-failure counters;
//! - [`trajectory`]: the training sample from the proxy's records (token truth).

pub mod agent;
pub mod hosted;
pub mod join;
pub mod llm;
pub mod mcp;
pub mod metrics;
pub mod service;
pub mod trajectory;
