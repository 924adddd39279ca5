//! A [`Job`] submitted to the engine and followed to its answer: every choice's tokens,
//! text (stop strings, tool calls), log-probabilities and the policy version, gathered
//! into one response ([`collect`]) or streamed ([`crate::stream`]).

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use arl_model::tokenizer::Tokenizer;
use axum::Json;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::api::{AppState, InferenceMetrics};
use crate::engine::{Event, Request, Sampled};
use crate::metrics::Timeline;
use crate::protocol::{ApiError, ChoiceText, Delta, finish_name};
use crate::request::{Endpoint, Job};
use crate::stream::stream_response;
use crate::tools::{self, Parsed};

/// Live state of one response.
pub(crate) struct Generation {
    pub(crate) endpoint: Endpoint,
    pub(crate) id: String,
    pub(crate) created: u64,
    pub(crate) model_name: String,
    pub(crate) prompt: Vec<u32>,
    pub(crate) tokenizer: Arc<Tokenizer>,
    pub(crate) logprobs: Option<usize>,
    pub(crate) tools: bool,
    pub(crate) choices: Vec<ChoiceText>,
    pub(crate) policy_version: u64,
    /// The run whose trained weights answer (None: the model the engine started with).
    /// Answers name it beside the version: a policy is (run, version).
    pub(crate) run_id: Option<arl_schemas::RunId>,
    pub(crate) cached_tokens: usize,
    pub(crate) events: mpsc::UnboundedReceiver<Event>,
    /// Recorded into the metrics and the span when the generation ends (finished,
    /// aborted, or its client gone).
    timeline: Timeline,
    metrics: InferenceMetrics,
    /// The engine's part of the caller's trace: queue, prefill and decode times.
    span: tracing::Span,
}

pub(crate) async fn run(
    state: &AppState,
    job: Job,
    endpoint: Endpoint,
) -> Result<Response, ApiError> {
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
    let timeline = Timeline::new(Instant::now());
    let span = tracing::info_span!(
        "generate",
        model = %state.model_name,
        run = job.model.run_id.as_ref().map(|r| r.as_str()),
        policy_version = job.model.version,
        prompt_tokens = job.prompt.len(),
        n = job.n,
        cached_tokens = tracing::field::Empty,
        completion_tokens = tracing::field::Empty,
        queue_ms = tracing::field::Empty,
        prefill_ms = tracing::field::Empty,
        decode_ms = tracing::field::Empty,
        finish = tracing::field::Empty,
    );
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
        run_id: job.model.run_id.clone(),
        cached_tokens: 0,
        events: rx,
        timeline,
        metrics: state.metrics.clone(),
        span,
    };
    // The first event says which version serves the request (or that it cannot start).
    match generation.events.recv().await {
        Some(Event::Started {
            policy,
            cached_tokens,
        }) => {
            generation.policy_version = policy.version;
            generation.run_id = policy.run_id;
            generation.cached_tokens = cached_tokens;
            generation.timeline.admitted(Instant::now());
            state.metrics.prompt(generation.prompt.len(), cached_tokens);
        }
        Some(Event::Aborted { reason, message }) => return Err(aborted(reason.code(), message)),
        _ => return Err(engine_dropped()),
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

/// The engine's side of a request went away without an answer (the engine stopped).
pub(crate) fn engine_dropped() -> ApiError {
    aborted("engine_stopped", "the engine dropped the request".into())
}

/// A request the engine gave up (see [`crate::engine::AbortReason`]): 503 with `code`.
pub(crate) fn aborted(code: &'static str, message: String) -> ApiError {
    ApiError::new(
        axum::http::StatusCode::SERVICE_UNAVAILABLE,
        "service_unavailable",
        message,
    )
    .with_code(code)
}

impl Generation {
    pub(crate) fn all_finished(&self) -> bool {
        self.choices.iter().all(|c| c.finish.is_some())
    }

    /// Applies one engine event; returns (choice, token, delta) when a choice changed.
    pub(crate) fn apply(
        &mut self,
        event: Event,
    ) -> Result<Option<(usize, Option<Sampled>, Delta)>, ApiError> {
        match event {
            Event::Token { choice, token } => {
                let Some(c) = self.choices.get_mut(choice) else {
                    return Ok(None);
                };
                if c.finish.is_some() {
                    return Ok(None);
                }
                let delta = c.push(token.clone());
                self.timeline.token(Instant::now(), c.tokens.len());
                Ok(Some((choice, Some(token), delta)))
            }
            Event::Finished { choice, reason } => {
                let Some(c) = self.choices.get_mut(choice) else {
                    return Ok(None);
                };
                Ok(Some((choice, None, c.end(reason))))
            }
            Event::Aborted { reason, message } => Err(aborted(reason.code(), message)),
            Event::Started { .. } => Ok(None),
        }
    }

    pub(crate) fn completion_tokens(&self) -> usize {
        self.choices.iter().map(|c| c.tokens.len()).sum()
    }

    pub(crate) fn usage(&self) -> Value {
        let completion = self.completion_tokens();
        json!({
            "prompt_tokens": self.prompt.len(),
            "completion_tokens": completion,
            "total_tokens": self.prompt.len() + completion,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        })
    }

    pub(crate) fn token_text(&self, id: u32) -> String {
        self.tokenizer.decode(&[id], false).unwrap_or_default()
    }

    /// Chat-format log-probability entries of some tokens.
    pub(crate) fn chat_logprobs(&self, tokens: &[Sampled]) -> Value {
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
    pub(crate) fn completion_logprobs(&self, tokens: &[Sampled], offset: usize) -> Value {
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
    pub(crate) fn tool_outcome(
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

impl Drop for Generation {
    fn drop(&mut self) {
        let reasons: Vec<_> = self.choices.iter().map(|c| c.finish).collect();
        let tokens = self.completion_tokens();
        self.metrics.finished(&self.timeline, tokens, &reasons);
        let phases = self.timeline.phases();
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        self.span.record("cached_tokens", self.cached_tokens);
        self.span.record("completion_tokens", tokens);
        self.span.record("queue_ms", ms(phases.queue));
        self.span.record("prefill_ms", ms(phases.prefill));
        self.span.record("decode_ms", ms(phases.decode));
        let finish = match reasons.first().copied().flatten() {
            Some(crate::engine::FinishReason::Stop) => "stop",
            Some(crate::engine::FinishReason::Length) => "length",
            None => "abort",
        };
        self.span.record("finish", finish);
    }
}

/// Waits for every choice and builds the whole response.
pub(crate) async fn collect(state: &AppState, mut g: Generation) -> Result<Value, ApiError> {
    let mut shown: Vec<String> = vec![String::new(); g.choices.len()];
    while !g.all_finished() {
        let Some(event) = g.events.recv().await else {
            return Err(engine_dropped());
        };
        if let Some((choice, _, delta)) = g.apply(event)? {
            shown[choice].push_str(&delta.text);
        }
    }
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
        "run_id": g.run_id,
    }))
}
