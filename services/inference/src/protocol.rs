//! OpenAI request bodies (with vLLM's extensions), the error body, and the per-choice text
//! state machine shared by streaming and non-streaming responses so both produce the same
//! tokens and text.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use arl_model::tokenizer::Tokenizer;
use axum::http::StatusCode;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::engine::{FinishReason, Sampled, SubmitError};
use crate::tools;

/// `"x"` or `["x", "y"]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            OneOrMany::One(s) => vec![s],
            OneOrMany::Many(v) => v,
        }
    }
}

/// Settings both endpoints share.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct CommonParams {
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub stream: bool,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub n: Option<usize>,
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_p: Option<f32>,
    #[serde(default)]
    pub top_k: Option<i64>,
    #[serde(default)]
    pub max_tokens: Option<usize>,
    #[serde(default)]
    pub stop: Option<OneOrMany>,
    #[serde(default)]
    pub stop_token_ids: Option<Vec<u32>>,
    /// Keep generating past the model's end-of-turn tokens (vLLM and llama.cpp's name).
    #[serde(default)]
    pub ignore_eos: bool,
    #[serde(default)]
    pub seed: Option<u64>,
    /// Turns with the same `user` share a KV-cache prefix (agent sessions).
    #[serde(default)]
    pub user: Option<String>,
    /// Token-in mode: the prompt as token ids; nothing is (re)tokenized.
    #[serde(default)]
    pub prompt_token_ids: Option<Vec<u32>>,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

#[derive(Clone, Debug, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessageIn>,
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
    #[serde(default)]
    pub tool_choice: Option<Value>,
    #[serde(default)]
    pub logprobs: bool,
    #[serde(default)]
    pub top_logprobs: Option<usize>,
    #[serde(default)]
    pub max_completion_tokens: Option<usize>,
    #[serde(flatten)]
    pub common: CommonParams,
}

#[derive(Clone, Debug, Deserialize)]
pub struct ChatMessageIn {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
    #[serde(default)]
    pub tool_calls: Option<Vec<Value>>,
    #[serde(default)]
    pub tool_call_id: Option<String>,
    #[serde(default)]
    pub name: Option<String>,
}

/// A message's content: a string or a list of parts (only text parts are supported).
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Clone, Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct CompletionRequest {
    #[serde(default)]
    pub prompt: Option<Prompt>,
    /// Top alternatives per token (OpenAI's legacy integer form).
    #[serde(default)]
    pub logprobs: Option<usize>,
    #[serde(default)]
    pub echo: bool,
    #[serde(flatten)]
    pub common: CommonParams,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
    Batch(Vec<Vec<u32>>),
}

pub use arl_runtime::http::ApiError;

/// What a refused submission means to an OpenAI client.
pub fn submit_error(err: SubmitError, param: &'static str) -> ApiError {
    let message = err.to_string();
    match err {
        SubmitError::NoWeights | SubmitError::Stopped => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            message,
        )
        .with_code("no_weights"),
        SubmitError::QueueFull(_) => ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_exceeded",
            message,
        )
        .with_code("queue_full"),
        SubmitError::ContextLength { .. } => {
            ApiError::invalid(message, Some(param)).with_code("context_length_exceeded")
        }
        SubmitError::KvCapacity { .. } => {
            ApiError::invalid(message, Some("max_tokens")).with_code("kv_cache_capacity_exceeded")
        }
    }
}

/// Decodes a JSON body, naming the field that is wrong.
pub fn parse_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let mut de = serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(&mut de).map_err(|err| {
        let path = err.path().to_string();
        let inner = err.into_inner();
        if path == "." || path.is_empty() {
            ApiError::invalid(format!("invalid request body: {inner}"), None)
        } else {
            ApiError::invalid(format!("invalid field {path}: {inner}"), None)
        }
    })
}

/// Request fields this engine honours; every other field ARL knows
/// ([`arl_schemas::openai`]) is accepted only at a value that asks nothing of it.
const HONOURED: &[&str] = &[
    "model",
    "stream",
    "stream_options",
    "n",
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "stop",
    "stop_token_ids",
    "seed",
    "logprobs",
    "user",
    "ignore_eos",
    "skip_special_tokens",
    "prompt_token_ids",
    "return_token_ids",
    "messages",
    "tools",
    "tool_choice",
    "top_logprobs",
    "max_completion_tokens",
    "prompt",
    "echo",
    "metadata",
    "store",
];

/// Refuses a request field this engine does not know, or cannot honour at the value given
/// (`frequency_penalty: 0.5`, `response_format` JSON, `chat_template_kwargs` with
/// variables): a 400 naming it, never an answer that silently ignored it.
pub fn refuse_unhonoured(
    body: &[u8],
    endpoint: arl_schemas::openai::Endpoint,
) -> Result<(), ApiError> {
    // A body that is no JSON object is refused, with where, by the typed parse after.
    let Ok(Value::Object(fields)) = serde_json::from_slice::<Value>(body) else {
        return Ok(());
    };
    for (name, value) in &fields {
        let Some(field) = arl_schemas::openai::field(endpoint, name) else {
            return Err(ApiError::invalid(
                format!(
                    "unknown field {name:?}: not a field of this endpoint that ARL knows (a typo?)"
                ),
                None,
            ));
        };
        if HONOURED.contains(&field.name) || field.inert.holds(value) {
            continue;
        }
        return Err(ApiError::invalid(
            format!(
                "{name} = {value} is not supported by ARL's engine (it accepts {} only); \
                 leave it out, or serve the model with vLLM or SGLang behind the proxy",
                field.inert.describe()
            ),
            Some(field.name),
        )
        .with_code("unsupported_parameter"));
    }
    Ok(())
}

/// What a choice shows after one more token.
#[derive(Debug, Default)]
pub struct Delta {
    /// Text newly safe to show.
    pub text: String,
    /// The choice ended (stop id, stop string or length).
    pub finished: Option<FinishReason>,
}

/// One choice's tokens and text as they arrive: incremental detokenization that never
/// splits a UTF-8 character, stop strings (text cut before them), and — when tools are on
/// — holding back anything that may be a tool call until the end.
pub struct ChoiceText {
    tokenizer: Arc<Tokenizer>,
    stop_strings: Vec<String>,
    tools: bool,
    cancel: Arc<AtomicBool>,
    pub tokens: Vec<Sampled>,
    /// Decoded text, cut at a stop string.
    pub text: String,
    /// Bytes of `text` already shown.
    shown: usize,
    pub finish: Option<FinishReason>,
}

impl ChoiceText {
    pub fn new(
        tokenizer: Arc<Tokenizer>,
        stop_strings: Vec<String>,
        tools: bool,
        cancel: Arc<AtomicBool>,
    ) -> Self {
        Self {
            tokenizer,
            stop_strings,
            tools,
            cancel,
            tokens: Vec::new(),
            text: String::new(),
            shown: 0,
            finish: None,
        }
    }

    pub fn push(&mut self, token: Sampled) -> Delta {
        if self.finish.is_some() {
            return Delta::default(); // generated after a stop string matched
        }
        self.tokens.push(token);
        let ids: Vec<u32> = self.tokens.iter().map(|t| t.id).collect();
        let decoded = self.tokenizer.decode(&ids, true).unwrap_or_default();
        // An incomplete UTF-8 sequence decodes to U+FFFD: wait for the rest.
        let complete = decoded.trim_end_matches('\u{FFFD}');
        self.text = complete.to_owned();
        if let Some(cut) = self.stop_match() {
            self.text.truncate(cut);
            self.finish = Some(FinishReason::Stop);
            self.cancel.store(true, Ordering::SeqCst);
            return Delta {
                text: self.take_shown(self.text.len()),
                finished: self.finish,
            };
        }
        let safe = self.safe_end();
        Delta {
            text: self.take_shown(safe),
            finished: None,
        }
    }

    /// The engine ended the choice.
    pub fn end(&mut self, reason: FinishReason) -> Delta {
        if self.finish.is_some() {
            return Delta::default();
        }
        self.finish = Some(reason);
        // Held-back text that could only have been the start of a stop string is content.
        let end = if self.tools {
            tools::hold_from(&self.text).unwrap_or(self.text.len())
        } else {
            self.text.len()
        };
        Delta {
            text: self.take_shown(end),
            finished: Some(reason),
        }
    }

    /// Text held back for tool-call parsing (shown as content if it is not a call).
    pub fn held(&self) -> &str {
        &self.text[self.shown.min(self.text.len())..]
    }

    fn take_shown(&mut self, end: usize) -> String {
        let end = end.max(self.shown).min(self.text.len());
        let piece = self.text[self.shown..end].to_owned();
        self.shown = end;
        piece
    }

    /// Byte offset of the earliest stop string in the text.
    fn stop_match(&self) -> Option<usize> {
        self.stop_strings
            .iter()
            .filter(|s| !s.is_empty())
            .filter_map(|s| self.text.find(s.as_str()))
            .min()
    }

    /// How much text can be shown: not a suffix that may grow into a stop string, and not
    /// a possible tool call.
    fn safe_end(&self) -> usize {
        let mut end = self.text.len();
        for stop in &self.stop_strings {
            for k in (1..stop.len()).rev() {
                if self.text.len() >= k
                    && self.text.is_char_boundary(self.text.len() - k)
                    && stop.starts_with(&self.text[self.text.len() - k..])
                {
                    end = end.min(self.text.len() - k);
                    break;
                }
            }
        }
        if self.tools
            && let Some(hold) = tools::hold_from(&self.text)
        {
            end = end.min(hold);
        }
        end
    }
}

/// `finish_reason` as OpenAI names it.
pub fn finish_name(reason: Option<FinishReason>) -> Value {
    match reason {
        Some(FinishReason::Stop) => json!("stop"),
        Some(FinishReason::Length) => json!("length"),
        None => Value::Null,
    }
}
