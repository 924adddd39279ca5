//! The token proxy: an OpenAI-compatible gateway in front of the engines that records, for
//! every LLM call of every trial, the prompt and completion token ids, logprobs and policy
//! version.
//!
//! - [`keys`]: per-trial keys; [`service`]: issuing and revoking them over NATS;
//! - [`api`]: authentication, checks, backpressure, forwarding and recording;
//! - [`backends`]: routing, affinity, health and dialects; [`client`]: the HTTP client;
//! - [`mcp`]: the trial's sandbox tools as an MCP server, under the trial's key;
//! - [`follow`]: loading each new policy version into vLLM and SGLang (`--follow-weights`);
//! - [`metrics`]: every call as the proxy saw it (status, latency, tokens).

pub mod api;
pub mod backends;
pub mod client;
pub mod follow;
pub mod hosted;
pub mod keys;
pub mod mcp;
pub mod metrics;
pub mod service;
