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
    /// The name `/v1/models` reports and requests may use.
    pub model_name: String,
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

pub(crate) fn current_model(state: &AppState) -> Result<Arc<ServedModel>, ApiError> {
    state.engine.current().ok_or_else(|| {
        crate::protocol::submit_error(crate::engine::SubmitError::NoWeights, "model")
    })
}
