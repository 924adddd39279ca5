//! The embedded inference engine: an OpenAI-compatible server over the model core.
//!
//! - [`engine`]: continuous batching on one thread (chunked prefill, `n` forks, per-session
//!   prefix cache, weight swaps between decode steps); [`device`]: where it runs the model
//!   (the CPU's kernels or a GPU through the CUDA backend);
//! - [`api`]: the HTTP routes; [`request`]: a request body to a job; [`generation`]: a job
//!   run to its answer; [`stream`]: the streamed answer; [`protocol`]: request bodies,
//!   errors, and the per-choice text state (stop strings, incremental detokenization,
//!   tool-call hold-back);
//! - [`tools`]: Qwen / SmolLM2 tool-call formats; [`weights`]: follows `weights.published`;
//!   [`fetch`]: versions in the object store fetched into the weights folder;
//!   [`metrics`]: vLLM's metric names, request timelines.

pub mod api;
pub mod device;
pub mod engine;
pub mod fetch;
pub mod generation;
pub mod hosted;
pub mod metrics;
pub mod protocol;
pub mod request;
pub mod stream;
pub mod tools;
pub mod weights;
