//! The OpenAI-compatible HTTP API: `/v1/chat/completions`, `/v1/completions`,
//! `/v1/models`. Every response carries `prompt_token_ids`, each choice its `token_ids`
//! (vLLM's `return_token_ids` names) and the `policy_version` that produced it.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{Value, json};

use crate::engine::{EngineHandle, ServedModel};
use crate::generation::run;
pub use crate::metrics::InferenceMetrics;
use crate::metrics::RequestLabel;
use crate::protocol::{ApiError, ChatRequest, CompletionRequest, parse_body};
use crate::request::{Endpoint, chat_job, completion_job};

#[derive(Clone)]
pub struct AppState {
    pub engine: EngineHandle,
    /// The name `/v1/models` reports first and responses carry (`--served-model-name`).
    pub model_name: String,
    /// Other names requests may use: the `--model` the engine was started with, as given
    /// (`smollm2-135m-instruct`, a folder), as vLLM serves a model under its `--model`.
    pub aliases: Vec<String>,
    pub metrics: InferenceMetrics,
}

pub fn router(state: AppState) -> Router {
    arl_runtime::http::continue_traces(
        Router::new()
            .route("/v1/chat/completions", post(chat_completions))
            .route("/v1/completions", post(completions))
            .route("/v1/models", get(models))
            .with_state(state),
    )
}

impl AppState {
    /// Every name requests may use: the served name, then the aliases.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        std::iter::once(self.model_name.as_str()).chain(self.aliases.iter().map(String::as_str))
    }

    pub fn serves(&self, name: &str) -> bool {
        self.names().any(|served| served == name)
    }
}

/// One entry per name the model answers to, as vLLM lists a model under each of its names.
async fn models(State(state): State<AppState>) -> Json<Value> {
    let current = state.engine.current();
    let data: Vec<Value> = state
        .names()
        .map(|name| {
            json!({
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "arl",
                "root": state.model_name,
                "max_model_len": state.engine.max_len(),
                "policy_version": current.as_ref().map(|m| m.version),
                // With the version, the policy's identity: whose trained weights (null
                // for the model the engine started with).
                "run_id": current.as_ref().and_then(|m| m.run_id.as_ref()),
                "ready": current.is_some(),
            })
        })
        .collect();
    Json(json!({ "object": "list", "data": data }))
}

async fn chat_completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let result = async {
        crate::protocol::refuse_unhonoured(&body, arl_schemas::openai::Endpoint::Chat)?;
        let request: ChatRequest = parse_body(&body)?;
        let job = chat_job(&state, &headers, request)?;
        run(&state, job, Endpoint::Chat).await
    }
    .await;
    respond(&state, Endpoint::Chat, result)
}

async fn completions(State(state): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    let result = async {
        crate::protocol::refuse_unhonoured(&body, arl_schemas::openai::Endpoint::Completion)?;
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

pub(crate) fn current_model(state: &AppState) -> Result<Arc<ServedModel>, ApiError> {
    state.engine.current().ok_or_else(|| {
        crate::protocol::submit_error(crate::engine::SubmitError::NoWeights, "model")
    })
}
