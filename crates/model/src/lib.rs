//! The model core under every model-facing service: Qwen2 and Llama-family models on CPU.
//!
//! - [`gguf`], [`quant`]: llama.cpp's GGUF files and their tensor types.
//! - [`config`]: the architecture, from Hugging Face `config.json` or GGUF metadata.
pub mod chat;
pub mod config;
pub mod gguf;
pub mod quant;
pub mod tokenizer;
