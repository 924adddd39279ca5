//! The OpenAI-compatible HTTP API: `/v1/chat/completions`, `/v1/completions`,
//! `/v1/models`. Every response carries `prompt_token_ids`, each choice its `token_ids`
//! (vLLM's `return_token_ids` names) and the `policy_version` that produced it.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use arl_model::chat::ChatMessage;
use arl_model::tokenizer::Tokenizer;
use arl_runtime::Metrics;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::engine::{EngineHandle, Event, Request, Sampled, SamplingParams, ServedModel};
use crate::protocol::{
    ApiError, ChatRequest, ChoiceText, CommonParams, CompletionRequest, Content, Delta, Prompt,
    finish_name, parse_body,
};
use crate::tools::{self, Parsed};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabel {
    pub endpoint: &'static str,
    pub status: u16,
}

/// The service's own metric families.
#[derive(Clone, Debug, Default)]
pub struct InferenceMetrics {
    pub requests: Family<RequestLabel, Counter>,
    pub prompt_tokens: Counter,
    pub cached_prompt_tokens: Counter,
    pub completion_tokens: Counter,
    pub tool_call_parse_failures: Counter,
}

impl InferenceMetrics {
    pub fn register(metrics: &Metrics) -> Self {
        let m = Self::default();
        metrics.register(
            "inference_requests",
            "Requests by endpoint and status",
            m.requests.clone(),
        );
        metrics.register(
            "inference_prompt_tokens",
            "Prompt tokens received",
            m.prompt_tokens.clone(),
        );
        metrics.register(
            "inference_cached_prompt_tokens",
            "Prompt tokens served from a session's KV cache",
            m.cached_prompt_tokens.clone(),
        );
        metrics.register(
            "inference_completion_tokens",
            "Tokens generated",
            m.completion_tokens.clone(),
        );
        metrics.register(
            "inference_tool_call_parse_failures",
            "Completions that opened a tool call that did not parse (returned as text)",
            m.tool_call_parse_failures.clone(),
        );
        m
    }
}

#[derive(Clone)]
pub struct AppState {
    pub engine: EngineHandle,
    /// The name `/v1/models` reports and requests may use.
    pub model_name: String,
    pub metrics: InferenceMetrics,
}

pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .with_state(state)
}

async fn models(State(state): State<AppState>) -> Json<Value> {
    let current = state.engine.current();
    Json(json!({
        "object": "list",
        "data": [{
            "id": state.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "arl",
            "max_model_len": state.engine.max_len(),
            "policy_version": current.as_ref().map(|m| m.version),
            // With the version, the policy's identity: whose trained weights (null for
            // the model the engine started with).
            "run_id": current.as_ref().and_then(|m| m.run_id.as_ref()),
            "ready": current.is_some(),
        }],
    }))
}

/// Everything a generation needs, endpoint-independent.
struct Job {
    model: Arc<ServedModel>,
    prompt: Vec<u32>,
    n: usize,
    params: SamplingParams,
    stop_strings: Vec<String>,
    session: Option<String>,
    tools: bool,
    stream: bool,
    include_usage: bool,
    /// Log-probabilities asked for, with this many alternatives per token.
    logprobs: Option<usize>,
}

/// Responses a job's endpoint formats.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Chat,
    Completion,
}

impl Endpoint {
    fn name(self) -> &'static str {
        match self {
            Endpoint::Chat => "chat",
            Endpoint::Completion => "completions",
        }
    }
}

async fn chat_completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let result = async {
        let request: ChatRequest = parse_body(&body)?;
        let job = chat_job(&state, &headers, request)?;
        run(&state, job, Endpoint::Chat).await
    }
    .await;
    respond(&state, Endpoint::Chat, result)
}

async fn completions(State(state): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    let result = async {
        let request: CompletionRequest = parse_body(&body)?;
        let job = completion_job(&state, &headers, request)?;
        run(&state, job, Endpoint::Completion).await
    }
    .await;
    respond(&state, Endpoint::Completion, result)
}

fn respond(state: &AppState, endpoint: Endpoint, result: Result<Response, ApiError>) -> Response {
    let response = result.unwrap_or_else(IntoResponse::into_response);
    state
        .metrics
        .requests
        .get_or_create(&RequestLabel {
            endpoint: endpoint.name(),
            status: response.status().as_u16(),
        })
        .inc();
    response
}

fn current_model(state: &AppState) -> Result<Arc<ServedModel>, ApiError> {
    state.engine.current().ok_or_else(|| {
        crate::protocol::submit_error(crate::engine::SubmitError::NoWeights, "model")
    })
}

fn chat_job(state: &AppState, headers: &HeaderMap, request: ChatRequest) -> Result<Job, ApiError> {
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
fn to_template_message(m: &crate::protocol::ChatMessageIn) -> Result<ChatMessage, ApiError> {
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

fn completion_job(
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
fn job(
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
        && name != &state.model_name
    {
        return Err(ApiError::new(
            axum::http::StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!(
                "the model {name:?} does not exist; this server serves {:?}",
                state.model_name
            ),
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

/// Live state of one response.
struct Generation {
    endpoint: Endpoint,
    id: String,
    created: u64,
    model_name: String,
    prompt: Vec<u32>,
    tokenizer: Arc<Tokenizer>,
    logprobs: Option<usize>,
    tools: bool,
    choices: Vec<ChoiceText>,
    policy_version: u64,
    cached_tokens: usize,
    events: mpsc::UnboundedReceiver<Event>,
}

async fn run(state: &AppState, job: Job, endpoint: Endpoint) -> Result<Response, ApiError> {
    let logprobs = job.logprobs;
    let (tx, rx) = mpsc::unbounded_channel();
    let cancel: Vec<Arc<AtomicBool>> = (0..job.n)
        .map(|_| Arc::new(AtomicBool::new(false)))
        .collect();
    let tokenizer = Arc::new(job.model.loaded.tokenizer.clone());
    let choices = cancel
        .iter()
        .map(|c| {
            ChoiceText::new(
                tokenizer.clone(),
                job.stop_strings.clone(),
                job.tools,
                c.clone(),
            )
        })
        .collect();
    state.metrics.prompt_tokens.inc_by(job.prompt.len() as u64);
    state
        .engine
        .submit(Request {
            prompt: job.prompt.clone(),
            n: job.n,
            params: job.params.clone(),
            session: job.session.clone(),
            events: tx,
            cancel,
        })
        .map_err(|e| {
            crate::protocol::submit_error(
                e,
                if endpoint == Endpoint::Chat {
                    "messages"
                } else {
                    "prompt"
                },
            )
        })?;
    let mut generation = Generation {
        endpoint,
        id: format!(
            "{}-{}",
            if endpoint == Endpoint::Chat {
                "chatcmpl"
            } else {
                "cmpl"
            },
            uuid::Uuid::now_v7().simple()
        ),
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        model_name: state.model_name.clone(),
        prompt: job.prompt,
        tokenizer,
        logprobs,
        tools: job.tools,
        choices,
        policy_version: job.model.version,
        cached_tokens: 0,
        events: rx,
    };
    // The first event says which version serves the request (or that it cannot start).
    match generation.events.recv().await {
        Some(Event::Started {
            policy_version,
            cached_tokens,
        }) => {
            generation.policy_version = policy_version;
            generation.cached_tokens = cached_tokens;
            state
                .metrics
                .cached_prompt_tokens
                .inc_by(cached_tokens as u64);
        }
        Some(Event::Aborted { message }) => return Err(aborted(message)),
        _ => return Err(aborted("the engine dropped the request".into())),
    }
    if job.stream {
        Ok(stream_response(
            state.clone(),
            generation,
            job.include_usage,
        ))
    } else {
        let body = collect(state, generation).await?;
        Ok(Json(body).into_response())
    }
}

fn aborted(message: String) -> ApiError {
    ApiError::new(
        axum::http::StatusCode::SERVICE_UNAVAILABLE,
        "service_unavailable",
        message,
    )
    .with_code("weights_changed")
}

impl Generation {
    fn all_finished(&self) -> bool {
        self.choices.iter().all(|c| c.finish.is_some())
    }

    /// Applies one engine event; returns (choice, token, delta) when a choice changed.
    fn apply(&mut self, event: Event) -> Result<Option<(usize, Option<Sampled>, Delta)>, ApiError> {
        match event {
            Event::Token { choice, token } => {
                let Some(c) = self.choices.get_mut(choice) else {
                    return Ok(None);
                };
                if c.finish.is_some() {
                    return Ok(None);
                }
                let delta = c.push(token.clone());
                Ok(Some((choice, Some(token), delta)))
            }
            Event::Finished { choice, reason } => {
                let Some(c) = self.choices.get_mut(choice) else {
                    return Ok(None);
                };
                Ok(Some((choice, None, c.end(reason))))
            }
            Event::Aborted { message } => Err(aborted(message)),
            Event::Started { .. } => Ok(None),
        }
    }

    fn completion_tokens(&self) -> usize {
        self.choices.iter().map(|c| c.tokens.len()).sum()
    }

    fn usage(&self) -> Value {
        let completion = self.completion_tokens();
        json!({
            "prompt_tokens": self.prompt.len(),
            "completion_tokens": completion,
            "total_tokens": self.prompt.len() + completion,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        })
    }

    fn token_text(&self, id: u32) -> String {
        self.tokenizer.decode(&[id], false).unwrap_or_default()
    }

    /// Chat-format log-probability entries of some tokens.
    fn chat_logprobs(&self, tokens: &[Sampled]) -> Value {
        let entry = |id: u32, logprob: f32| {
            let token = self.token_text(id);
            json!({"token": token, "logprob": logprob, "bytes": token.as_bytes()})
        };
        let content: Vec<Value> = tokens
            .iter()
            .map(|t| {
                let mut e = entry(t.id, t.logprob);
                e["top_logprobs"] =
                    Value::Array(t.top.iter().map(|&(id, lp)| entry(id, lp)).collect());
                e
            })
            .collect();
        json!({"content": content})
    }

    /// Legacy completion-format log-probabilities.
    fn completion_logprobs(&self, tokens: &[Sampled], offset: usize) -> Value {
        let mut text_offset = Vec::new();
        let mut at = offset;
        let mut texts = Vec::new();
        for t in tokens {
            let text = self.token_text(t.id);
            text_offset.push(at);
            at += text.len();
            texts.push(text);
        }
        json!({
            "tokens": texts,
            "token_logprobs": tokens.iter().map(|t| t.logprob).collect::<Vec<_>>(),
            "top_logprobs": tokens.iter().map(|t| {
                t.top.iter().map(|&(id, lp)| (self.token_text(id), json!(lp))).collect::<serde_json::Map<_, _>>()
            }).collect::<Vec<_>>(),
            "text_offset": text_offset,
        })
    }

    /// A finished choice's tool calls, or its held text as content (counted when malformed).
    fn tool_outcome(
        &self,
        choice: usize,
        metrics: &InferenceMetrics,
    ) -> (String, Option<Vec<Value>>) {
        let c = &self.choices[choice];
        if !self.tools {
            return (String::new(), None);
        }
        match tools::parse(c.held()) {
            Parsed::Calls(content, calls) if !calls.is_empty() => {
                let calls = calls
                    .into_iter()
                    .enumerate()
                    .map(|(i, call)| {
                        json!({
                            "index": i,
                            "id": format!("call_{}", uuid::Uuid::now_v7().simple()),
                            "type": "function",
                            "function": {"name": call.name, "arguments": call.arguments},
                        })
                    })
                    .collect();
                (content, Some(calls))
            }
            Parsed::Malformed(reason) => {
                metrics.tool_call_parse_failures.inc();
                tracing::info!(%reason, "malformed tool call returned as text");
                (c.held().to_owned(), None)
            }
            Parsed::Calls(content, _) | Parsed::Text(content) => (content, None),
        }
    }
}

/// Waits for every choice and builds the whole response.
async fn collect(state: &AppState, mut g: Generation) -> Result<Value, ApiError> {
    let mut shown: Vec<String> = vec![String::new(); g.choices.len()];
    while !g.all_finished() {
        let Some(event) = g.events.recv().await else {
            return Err(aborted("the engine dropped the request".into()));
        };
        if let Some((choice, _, delta)) = g.apply(event)? {
            shown[choice].push_str(&delta.text);
        }
    }
    state
        .metrics
        .completion_tokens
        .inc_by(g.completion_tokens() as u64);
    let choices: Vec<Value> = (0..g.choices.len())
        .map(|i| {
            let c = &g.choices[i];
            let token_ids: Vec<u32> = c.tokens.iter().map(|t| t.id).collect();
            let (tool_text, tool_calls) = g.tool_outcome(i, &state.metrics);
            let text = format!("{}{}", shown[i], tool_text);
            let finish = if tool_calls.is_some() {
                json!("tool_calls")
            } else {
                finish_name(c.finish)
            };
            match g.endpoint {
                Endpoint::Chat => {
                    let mut message = json!({"role": "assistant", "content": text});
                    if let Some(calls) = tool_calls {
                        message["tool_calls"] = Value::Array(calls);
                        if text.is_empty() {
                            message["content"] = Value::Null;
                        }
                    }
                    json!({
                        "index": i,
                        "message": message,
                        "logprobs": g.logprobs.map(|_| g.chat_logprobs(&c.tokens)),
                        "finish_reason": finish,
                        "token_ids": token_ids,
                    })
                }
                Endpoint::Completion => json!({
                    "index": i,
                    "text": text,
                    "logprobs": g.logprobs.map(|_| g.completion_logprobs(&c.tokens, 0)),
                    "finish_reason": finish,
                    "token_ids": token_ids,
                }),
            }
        })
        .collect();
    Ok(json!({
        "id": g.id,
        "object": if g.endpoint == Endpoint::Chat { "chat.completion" } else { "text_completion" },
        "created": g.created,
        "model": g.model_name,
        "choices": choices,
        "usage": g.usage(),
        "prompt_token_ids": g.prompt,
        "policy_version": g.policy_version,
    }))
}

/// Server-sent events: one chunk per token per choice, then usage (if asked), then
/// `[DONE]`. The first chunk carries `prompt_token_ids`.
fn stream_response(state: AppState, g: Generation, include_usage: bool) -> Response {
    struct Streaming {
        state: AppState,
        g: Generation,
        include_usage: bool,
        pending: VecDeque<SseEvent>,
        first: bool,
        done: bool,
        text_offset: Vec<usize>,
    }
    let n = g.choices.len();
    let start = Streaming {
        state,
        g,
        include_usage,
        pending: VecDeque::new(),
        first: true,
        done: false,
        text_offset: vec![0; n],
    };
    let stream = futures::stream::unfold(start, |mut s| async move {
        loop {
            if let Some(event) = s.pending.pop_front() {
                return Some((Ok::<_, Infallible>(event), s));
            }
            if s.done {
                return None;
            }
            if s.g.all_finished() {
                s.state
                    .metrics
                    .completion_tokens
                    .inc_by(s.g.completion_tokens() as u64);
                if s.include_usage {
                    let chunk = s.chunk(Value::Array(Vec::new()), Some(s.g.usage()));
                    s.pending
                        .push_back(SseEvent::default().data(chunk.to_string()));
                }
                s.pending.push_back(SseEvent::default().data("[DONE]"));
                s.done = true;
                continue;
            }
            let Some(event) = s.g.events.recv().await else {
                let error = aborted("the engine dropped the request".into());
                s.pending
                    .push_back(SseEvent::default().data(error.body().to_string()));
                s.done = true;
                continue;
            };
            match s.g.apply(event) {
                Ok(Some((choice, token, delta))) => s.emit(choice, token, delta),
                Ok(None) => {}
                Err(error) => {
                    s.pending
                        .push_back(SseEvent::default().data(error.body().to_string()));
                    s.done = true;
                }
            }
        }
    });

    impl Streaming {
        fn chunk(&mut self, choices: Value, usage: Option<Value>) -> Value {
            let mut chunk = json!({
                "id": self.g.id,
                "object": if self.g.endpoint == Endpoint::Chat { "chat.completion.chunk" } else { "text_completion" },
                "created": self.g.created,
                "model": self.g.model_name,
                "choices": choices,
                "policy_version": self.g.policy_version,
            });
            if self.first {
                chunk["prompt_token_ids"] = json!(self.g.prompt);
                self.first = false;
            }
            if let Some(usage) = usage {
                chunk["usage"] = usage;
            }
            chunk
        }

        fn emit(&mut self, choice: usize, token: Option<Sampled>, delta: Delta) {
            let tokens: Vec<Sampled> = token.into_iter().collect();
            let (tool_text, tool_calls) = if delta.finished.is_some() {
                self.g.tool_outcome(choice, &self.state.metrics)
            } else {
                (String::new(), None)
            };
            let text = format!("{}{}", delta.text, tool_text);
            let finish = match (&tool_calls, delta.finished) {
                (Some(_), _) => json!("tool_calls"),
                (None, reason) => finish_name(reason),
            };
            let logprobs = match (self.g.logprobs, self.g.endpoint) {
                (None, _) => Value::Null,
                (Some(_), Endpoint::Chat) => self.g.chat_logprobs(&tokens),
                (Some(_), Endpoint::Completion) => {
                    let lp = self
                        .g
                        .completion_logprobs(&tokens, self.text_offset[choice]);
                    self.text_offset[choice] += text.len();
                    lp
                }
            };
            let token_ids: Vec<u32> = tokens.iter().map(|t| t.id).collect();
            let entry = match self.g.endpoint {
                Endpoint::Chat => {
                    let mut d = json!({});
                    if self.first {
                        d["role"] = json!("assistant");
                    }
                    if !text.is_empty() {
                        d["content"] = json!(text);
                    }
                    if let Some(calls) = tool_calls {
                        d["tool_calls"] = Value::Array(calls);
                    }
                    json!({"index": choice, "delta": d, "logprobs": logprobs, "finish_reason": finish, "token_ids": token_ids})
                }
                Endpoint::Completion => json!({
                    "index": choice, "text": text, "logprobs": logprobs,
                    "finish_reason": finish, "token_ids": token_ids,
                }),
            };
            let chunk = self.chunk(Value::Array(vec![entry]), None);
            self.pending
                .push_back(SseEvent::default().data(chunk.to_string()));
        }
    }

    Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response()
}
