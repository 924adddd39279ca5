//! Streamed answers: server-sent events, one chunk per token per choice, then usage (if
//! asked), then `[DONE]`.

use std::collections::VecDeque;
use std::convert::Infallible;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::api::AppState;
use crate::engine::Sampled;
use crate::generation::{Generation, engine_dropped};
use crate::protocol::{Delta, finish_name};
use crate::request::Endpoint;

/// Server-sent events: one chunk per token per choice, then usage (if asked), then
/// `[DONE]`. The first chunk carries `prompt_token_ids`.
pub(crate) fn stream_response(state: AppState, g: Generation, include_usage: bool) -> Response {
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
                let error = engine_dropped();
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
                "run_id": self.g.run_id,
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
