//! From an OpenAI request body to a [`Job`]: the chat template or the raw prompt, tool
//! prompts, sampling parameters and stop strings, checked with the field at fault.

use std::sync::Arc;

use arl_model::chat::ChatMessage;
use axum::http::HeaderMap;
use serde_json::Value;

use crate::api::AppState;
use crate::api::current_model;
use crate::engine::{SamplingParams, ServedModel};
use crate::protocol::{ApiError, ChatRequest, CommonParams, CompletionRequest, Content, Prompt};
use crate::tools::{self};

/// Everything a generation needs, endpoint-independent.
pub(crate) struct Job {
    pub(crate) model: Arc<ServedModel>,
    pub(crate) prompt: Vec<u32>,
    pub(crate) n: usize,
    pub(crate) params: SamplingParams,
    pub(crate) stop_strings: Vec<String>,
    pub(crate) session: Option<String>,
    pub(crate) tools: bool,
    pub(crate) stream: bool,
    pub(crate) include_usage: bool,
    /// Log-probabilities asked for, with this many alternatives per token.
    pub(crate) logprobs: Option<usize>,
}

/// Responses a job's endpoint formats.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Endpoint {
    Chat,
    Completion,
}

impl Endpoint {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Endpoint::Chat => "chat",
            Endpoint::Completion => "completions",
        }
    }
}

pub(crate) fn chat_job(
    state: &AppState,
    headers: &HeaderMap,
    request: ChatRequest,
) -> Result<Job, ApiError> {
    let model = current_model(state)?;
    let loaded = &model.loaded;
    let tools_given = request.tools.as_ref().is_some_and(|t| !t.is_empty());
    let tool_choice_none = match &request.tool_choice {
        None => false,
        Some(Value::String(choice)) if choice == "auto" => false,
        Some(Value::String(choice)) if choice == "none" => true,
        Some(other) => {
            return Err(ApiError::invalid(
                format!(
                    "tool_choice {other} is not supported: this engine does not constrain decoding; use \"auto\" or \"none\""
                ),
                Some("tool_choice"),
            ));
        }
    };
    let prompt = match &request.common.prompt_token_ids {
        Some(ids) => ids.clone(),
        None => {
            let template = loaded.chat_template.as_ref().ok_or_else(|| {
                ApiError::invalid(
                    "this model has no chat template; use /v1/completions",
                    Some("messages"),
                )
            })?;
            if request.messages.is_empty() {
                return Err(ApiError::invalid(
                    "messages must not be empty",
                    Some("messages"),
                ));
            }
            let mut messages = request
                .messages
                .iter()
                .map(to_template_message)
                .collect::<Result<Vec<_>, _>>()?;
            let template_knows_tools = loaded
                .chat_template_source
                .as_deref()
                .is_some_and(|s| s.contains("tools"));
            let tools = request
                .tools
                .as_ref()
                .filter(|_| tools_given && !tool_choice_none);
            let tools_value = tools.map(|t| Value::Array(t.clone()));
            if let (Some(tools), false) = (tools, template_knows_tools) {
                messages.insert(0, ChatMessage::new("system", &tools::system_prompt(tools)));
            }
            let text = template
                .render(
                    &messages,
                    tools_value.as_ref().filter(|_| template_knows_tools),
                    true,
                )
                .map_err(|e| {
                    ApiError::invalid(
                        format!("cannot render the chat template: {e}"),
                        Some("messages"),
                    )
                })?;
            loaded
                .tokenizer
                .encode(&text)
                .map_err(|e| ApiError::invalid(format!("cannot tokenize: {e}"), Some("messages")))?
        }
    };
    let max_tokens = request.max_completion_tokens.or(request.common.max_tokens);
    let top_logprobs = if request.logprobs {
        Some(request.top_logprobs.unwrap_or(0).min(20))
    } else {
        None
    };
    job(
        state,
        headers,
        model.clone(),
        prompt,
        &request.common,
        max_tokens,
        top_logprobs,
        tools_given && !tool_choice_none,
    )
}

/// A message as the chat template expects it: text content; tool-call arguments as
/// objects (templates serialize them), not JSON strings.
pub(crate) fn to_template_message(
    m: &crate::protocol::ChatMessageIn,
) -> Result<ChatMessage, ApiError> {
    let content = match &m.content {
        None => None,
        Some(Content::Text(t)) => Some(t.clone()),
        Some(Content::Parts(parts)) => {
            let mut text = String::new();
            for part in parts {
                if part.kind != "text" {
                    return Err(ApiError::invalid(
                        format!(
                            "content part type {:?} is not supported; send text",
                            part.kind
                        ),
                        Some("messages"),
                    ));
                }
                text.push_str(part.text.as_deref().unwrap_or(""));
            }
            Some(text)
        }
    };
    let tool_calls = m.tool_calls.as_ref().map(|calls| {
        Value::Array(
            calls
                .iter()
                .map(|call| {
                    let mut call = call.clone();
                    if let Some(args) = call.pointer_mut("/function/arguments")
                        && let Some(text) = args.as_str()
                        && let Ok(parsed) = serde_json::from_str::<Value>(text)
                    {
                        *args = parsed;
                    }
                    call
                })
                .collect(),
        )
    });
    // Templates concatenate content; an assistant turn that only called tools has none.
    let content = content.or_else(|| tool_calls.as_ref().map(|_| String::new()));
    Ok(ChatMessage {
        role: m.role.clone(),
        content,
        tool_calls,
        tool_call_id: m.tool_call_id.clone(),
        name: m.name.clone(),
    })
}

pub(crate) fn completion_job(
    state: &AppState,
    headers: &HeaderMap,
    request: CompletionRequest,
) -> Result<Job, ApiError> {
    let model = current_model(state)?;
    if request.echo {
        return Err(ApiError::invalid("echo is not supported", Some("echo")));
    }
    let prompt = match (&request.common.prompt_token_ids, request.prompt) {
        (Some(ids), _) => ids.clone(),
        (None, Some(Prompt::Tokens(ids))) => ids,
        (None, Some(Prompt::Text(text))) => model
            .loaded
            .tokenizer
            .encode(&text)
            .map_err(|e| ApiError::invalid(format!("cannot tokenize: {e}"), Some("prompt")))?,
        (None, Some(Prompt::Texts(mut texts))) if texts.len() == 1 => model
            .loaded
            .tokenizer
            .encode(&texts.remove(0))
            .map_err(|e| ApiError::invalid(format!("cannot tokenize: {e}"), Some("prompt")))?,
        (None, Some(Prompt::Batch(mut batch))) if batch.len() == 1 => batch.remove(0),
        (None, Some(_)) => {
            return Err(ApiError::invalid(
                "one prompt per request (send several requests; they are batched)",
                Some("prompt"),
            ));
        }
        (None, None) => return Err(ApiError::invalid("prompt is required", Some("prompt"))),
    };
    // OpenAI's default for this endpoint.
    let max_tokens = Some(request.common.max_tokens.unwrap_or(16));
    job(
        state,
        headers,
        model,
        prompt,
        &request.common,
        max_tokens,
        request.logprobs.map(|k| k.min(20)),
        false,
    )
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn job(
    state: &AppState,
    headers: &HeaderMap,
    model: Arc<ServedModel>,
    prompt: Vec<u32>,
    common: &CommonParams,
    max_tokens: Option<usize>,
    top_logprobs: Option<usize>,
    tools: bool,
) -> Result<Job, ApiError> {
    if let Some(name) = &common.model
        && !state.serves(name)
    {
        let served: Vec<&str> = state.names().collect();
        return Err(ApiError::new(
            axum::http::StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("the model {name:?} does not exist; this server serves {served:?}"),
        )
        .with_param("model")
        .with_code("model_not_found"));
    }
    if prompt.is_empty() {
        return Err(ApiError::invalid("the prompt is empty", Some("prompt")));
    }
    let vocab = model.loaded.model.config.vocab_size;
    if let Some(bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::invalid(
            format!("token id {bad} is outside the vocabulary (size {vocab})"),
            Some("prompt_token_ids"),
        ));
    }
    let n = common.n.unwrap_or(1);
    if !(1..=16).contains(&n) {
        return Err(ApiError::invalid(
            format!("n must be in [1, 16], got {n}"),
            Some("n"),
        ));
    }
    let temperature = common.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::invalid(
            format!("temperature must be in [0, 2], got {temperature}"),
            Some("temperature"),
        ));
    }
    let top_p = common.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::invalid(
            format!("top_p must be in (0, 1], got {top_p}"),
            Some("top_p"),
        ));
    }
    let top_k = match common.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => k as usize,
        Some(k) => {
            return Err(ApiError::invalid(
                format!("top_k must be -1, 0 or positive, got {k}"),
                Some("top_k"),
            ));
        }
    };
    let max_len = state.engine.max_len();
    if prompt.len() >= max_len {
        return Err(crate::protocol::submit_error(
            crate::engine::SubmitError::ContextLength {
                max: max_len,
                prompt: prompt.len(),
            },
            "messages",
        ));
    }
    let room = max_len - prompt.len();
    let max_tokens = match max_tokens {
        Some(0) => {
            return Err(ApiError::invalid(
                "max_tokens must be at least 1",
                Some("max_tokens"),
            ));
        }
        Some(m) => m.min(room),
        None => room,
    };
    let stop_strings = common
        .stop
        .clone()
        .map(|s| s.into_vec())
        .unwrap_or_default();
    if stop_strings.len() > 4 {
        return Err(ApiError::invalid("at most 4 stop sequences", Some("stop")));
    }
    let mut stop_ids = if common.ignore_eos {
        Vec::new()
    } else {
        model.loaded.tokenizer.stop_ids().to_vec()
    };
    stop_ids.extend(common.stop_token_ids.iter().flatten());
    let session = headers
        .get("x-session-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        .or_else(|| common.user.clone());
    Ok(Job {
        model,
        prompt,
        n,
        params: SamplingParams {
            temperature,
            top_p,
            top_k,
            seed: common.seed,
            max_tokens,
            stop_ids,
            top_logprobs: top_logprobs.unwrap_or(0),
        },
        stop_strings,
        session,
        tools,
        stream: common.stream,
        include_usage: common
            .stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage),
        logprobs: top_logprobs,
    })
}
