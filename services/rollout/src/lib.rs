//! Rollout: trials at scale, with token truth and explicit failures.
//!
//! - [`service`]: the work queue of trials, each one's life, and the failure policy;
//! - [`agent`]: the built-in agents (tool calling, text protocol, math);
//! - [`llm`]: their OpenAI client through the token proxy, failures classified;
//! - [`metrics`]: outcome, branch, mask and parse-failure counters;
//! - [`trajectory`]: the training sample from the proxy's records (token truth);
//! - [`watch`]: one subscription per replica delivering calls and grades to their trials.

pub mod agent;
pub mod llm;
pub mod metrics;
pub mod service;
pub mod trajectory;
pub mod watch;
