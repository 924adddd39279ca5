//! Tokenizers, built with the `tokenizers` crate from a `tokenizer.json` or from GGUF
//! metadata. For GGUF, the Hugging Face tokenizer description is rebuilt from the vocab,
//! merges and token types, with the pre-tokenizer that `tokenizer.ggml.pre` names — the
//! step where GGUF conversions go wrong, so each supported name maps to the exact regex
//! of the original tokenizer.

use std::path::Path;

use serde_json::{Value, json};

use crate::gguf::GgufFile;

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("cannot load the tokenizer: {0}")]
    Load(String),
    #[error("GGUF tokenizer: {0}")]
    Gguf(String),
    #[error("tokenizer.ggml.pre = {0:?} is not supported (known: qwen2, smollm, llama-bpe, gpt2)")]
    PreTokenizer(String),
    #[error("encoding failed: {0}")]
    Encode(String),
    #[error("decoding failed: {0}")]
    Decode(String),
}

#[derive(Debug, Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Ids that end generation (eos, and `<|im_end|>`/`<|endoftext|>` when present).
    stop_ids: Vec<u32>,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
}

const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

impl Tokenizer {
    pub fn from_file(path: &Path) -> Result<Self, TokenizerError> {
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| TokenizerError::Load(e.to_string()))?;
        Ok(Self::wrap(inner, None, None))
    }

    pub fn from_json(json: &str) -> Result<Self, TokenizerError> {
        let inner: tokenizers::Tokenizer = json
            .parse()
            .map_err(|e: tokenizers::Error| TokenizerError::Load(e.to_string()))?;
        Ok(Self::wrap(inner, None, None))
    }

    fn wrap(inner: tokenizers::Tokenizer, bos_id: Option<u32>, eos_id: Option<u32>) -> Self {
        let mut stop_ids: Vec<u32> = ["<|im_end|>", "<|endoftext|>", "<|eot_id|>", "</s>"]
            .iter()
            .filter_map(|t| inner.token_to_id(t))
            .collect();
        stop_ids.extend(eos_id);
        stop_ids.sort_unstable();
        stop_ids.dedup();
        Self {
            inner,
            stop_ids,
            bos_id,
            eos_id,
        }
    }

    /// Rebuilds the tokenizer from GGUF metadata (`tokenizer.ggml.*`).
    pub fn from_gguf(file: &GgufFile) -> Result<Self, TokenizerError> {
        let json = hf_json_from_gguf(file)?;
        let inner: tokenizers::Tokenizer = serde_json::to_string(&json)
            .map_err(|e| TokenizerError::Gguf(e.to_string()))?
            .parse()
            .map_err(|e: tokenizers::Error| TokenizerError::Gguf(e.to_string()))?;
        let id = |k: &str| file.u64(k).and_then(|v| u32::try_from(v).ok());
        Ok(Self::wrap(
            inner,
            id("tokenizer.ggml.bos_token_id"),
            id("tokenizer.ggml.eos_token_id"),
        ))
    }

    /// Token ids of `text`, special tokens (`<|im_start|>`) recognized as such.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let encoding = self
            .inner
            .encode_fast(text, false)
            .map_err(|e| TokenizerError::Encode(e.to_string()))?;
        Ok(encoding.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| TokenizerError::Decode(e.to_string()))
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn stop_ids(&self) -> &[u32] {
        &self.stop_ids
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    pub fn eos_id(&self) -> Option<u32> {
        self.eos_id
    }

    /// The `tokenizer.json` text, for checkpoints.
    pub fn to_json(&self) -> Result<String, TokenizerError> {
        self.inner
            .to_string(false)
            .map_err(|e| TokenizerError::Load(e.to_string()))
    }
}

fn pre_tokenizer(pre: &str) -> Result<(Value, Value), TokenizerError> {
    let byte_level = |use_regex: bool, trim: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": trim, "use_regex": use_regex});
    let split = |regex: &str| json!({"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false});
    Ok(match pre {
        "qwen2" => (
            json!({"type": "NFC"}),
            json!({"type": "Sequence", "pretokenizers": [split(QWEN2_REGEX), byte_level(false, false)]}),
        ),
        "llama-bpe" | "llama3" => (
            Value::Null,
            json!({"type": "Sequence", "pretokenizers": [split(LLAMA3_REGEX), byte_level(false, false)]}),
        ),
        // SmolLM's own tokenizer: digits one by one, then GPT-2's byte-level regex.
        "smollm" => (
            Value::Null,
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true},
                byte_level(true, true)
            ]}),
        ),
        "gpt2" | "default" => (Value::Null, byte_level(true, true)),
        other => return Err(TokenizerError::PreTokenizer(other.to_owned())),
    })
}

fn hf_json_from_gguf(file: &GgufFile) -> Result<Value, TokenizerError> {
    let model = file.string("tokenizer.ggml.model").unwrap_or_default();
    if model != "gpt2" {
        return Err(TokenizerError::Gguf(format!(
            "tokenizer.ggml.model = {model:?}; only byte-level BPE (\"gpt2\") is supported"
        )));
    }
    let tokens = file
        .get("tokenizer.ggml.tokens")
        .and_then(|v| v.as_array())
        .ok_or_else(|| TokenizerError::Gguf("tokenizer.ggml.tokens is missing".into()))?;
    let types: Vec<u64> = file
        .get("tokenizer.ggml.token_type")
        .and_then(|v| v.as_array())
        .map(|a| a.iter().map(|v| v.as_u64().unwrap_or(1)).collect())
        .unwrap_or_default();
    let merges: Vec<Value> = file
        .get("tokenizer.ggml.merges")
        .and_then(|v| v.as_array())
        .ok_or_else(|| TokenizerError::Gguf("tokenizer.ggml.merges is missing".into()))?
        .iter()
        .filter_map(|m| m.as_str())
        .filter_map(|m| m.split_once(' ').map(|(a, b)| json!([a, b])))
        .collect();

    let mut vocab = serde_json::Map::new();
    let mut added = Vec::new();
    for (id, token) in tokens.iter().enumerate() {
        let Some(text) = token.as_str() else { continue };
        // Every token keeps its id in the vocab (added tokens look theirs up there);
        // 3 = control and 4 = user-defined are also matched whole, never split by BPE.
        vocab.entry(text.to_owned()).or_insert(json!(id));
        let kind = types.get(id).copied().unwrap_or(1);
        if kind == 3 || kind == 4 {
            added.push(json!({
                "id": id, "content": text, "single_word": false, "lstrip": false, "rstrip": false,
                "normalized": false, "special": kind == 3
            }));
        }
    }
    let pre = file.string("tokenizer.ggml.pre").unwrap_or("default");
    let (normalizer, pre_tokenizer) = pre_tokenizer(pre)?;
    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "",
            "end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": merges
        }
    }))
}
