//! The model core under every model-facing service: Qwen2, Qwen3 and Llama-family models on CPU
//! ([`ops::Cpu`], the reference) and NVIDIA GPUs ([`cuda::Cuda`]), behind one compute
//! boundary ([`backend::Backend`]).
//!
//! - [`gguf`], [`quant`]: llama.cpp's GGUF files and their tensor types.
//! - [`config`]: the architecture, from Hugging Face `config.json` or GGUF metadata.
//! - [`hub`]: Hugging Face Hub names resolved from the local HF cache.
pub mod backend;
pub mod chat;
pub mod config;
pub mod cuda;
pub mod generate;
pub mod gguf;
pub mod handoff;
pub mod hub;
pub mod load;
pub mod model;
pub mod ops;
pub mod quant;
pub mod tensor;
pub mod tokenizer;
pub mod train;
pub mod weights;
