//! The gateway: `/{trial_key}/v1/...` or `/v1/...` with `Authorization: Bearer <key>`.
//! `GET /v1/models` lists what the trial's engine serves.
//! Each chat or text completion is checked, sent to a backend (asking it for token ids and
//! logprobs), returned to the client — streamed chunk by chunk as it arrives — and recorded
//! as an `llm.call` event. The record is stored before the client sees the end of the
//! answer: when it cannot be stored, the client gets a 503 (or, streaming, an error in
//! place of `[DONE]`), never an unrecorded answer.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use arl_runtime::consumer::run_consumer;
use arl_runtime::{Bus, BusError, ConsumerSpec, Delivery, HandlerError, Shutdown};
use arl_schemas::RunId;
use arl_schemas::events::{CallTiming, FinishReason, LlmCallV2};
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::StreamExt;
use http_body_util::BodyExt;
use serde_json::{Map, Value, json};
use tracing::Instrument;

use crate::backends::{Backends, Dialect, Served};
use crate::client::{ClientError, HttpClient};
use crate::keys::{Keys, Trial};
use crate::mcp::Mcp;
use crate::metrics::{ProxyMetrics, StatusLabel};

#[derive(Clone, Debug)]
pub struct ProxyConfig {
    /// Request bodies above this are refused before they are read whole.
    pub max_body_bytes: usize,
    /// Calls in flight per run before new ones get 429.
    pub max_in_flight_per_run: usize,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        Self {
            max_body_bytes: 8 << 20,
            max_in_flight_per_run: 256,
        }
    }
}

#[derive(Clone)]
pub struct Proxy {
    pub bus: Bus,
    pub keys: Arc<Keys>,
    pub mcp: Arc<Mcp>,
    pub backends: Arc<Backends>,
    pub client: HttpClient,
    pub config: ProxyConfig,
    runs: Arc<Mutex<HashMap<RunId, Arc<RunLoad>>>>,
    metrics: ProxyMetrics,
}

/// What the proxy knows of a run: calls in flight, the newest policy version seen.
#[derive(Debug, Default)]
struct RunLoad {
    in_flight: AtomicUsize,
    latest_version: AtomicU64,
}

impl Proxy {
    pub fn new(
        bus: Bus,
        keys: Arc<Keys>,
        mcp: Arc<Mcp>,
        backends: Arc<Backends>,
        config: ProxyConfig,
    ) -> Self {
        Self {
            mcp,
            metrics: ProxyMetrics::register(bus.metrics()),
            bus,
            keys,
            backends,
            client: HttpClient::new(),
            config,
            runs: Arc::default(),
        }
    }

    fn run_load(&self, run: &RunId) -> Arc<RunLoad> {
        self.runs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(run.clone())
            .or_default()
            .clone()
    }

    /// Runs the proxy keeps a load for (calls in flight, newest version seen).
    pub fn tracked_runs(&self) -> usize {
        self.runs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// Drops each run's load when the run ends (`run.completed`, `run.failed`,
    /// `run.cancelled`): without it a long-lived proxy kept one for every run it ever
    /// served. A call still in flight keeps its own handle; a call of an ended run after
    /// that starts a new load.
    pub fn forget_ended_runs(&self, durable: &str, shutdown: &Shutdown) {
        let ends = ConsumerSpec::run_ends(self.bus.namespace(), format!("{durable}-run-loads"));
        let runs = self.runs.clone();
        shutdown.spawn(run_consumer(
            self.bus.clone(),
            ends,
            move |delivery: Delivery| {
                let runs = runs.clone();
                async move {
                    let ended = delivery.ended_run()?;
                    runs.lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .remove(&ended);
                    Ok::<(), HandlerError>(())
                }
            },
            shutdown.clone(),
        ));
    }
}

pub fn router(proxy: Proxy) -> Router {
    // One shared copy: a call then clones a pointer, not the bus and its clients.
    let proxy = Arc::new(proxy);
    Router::new()
        .route("/v1/chat/completions", post(chat_bearer))
        .route("/v1/completions", post(completion_bearer))
        .route("/{key}/v1/chat/completions", post(chat_path))
        .route("/{key}/v1/completions", post(completion_path))
        .route("/v1/models", get(models_bearer))
        .route("/{key}/v1/models", get(models_path))
        .route(
            "/mcp",
            post(mcp_post_bearer).delete(mcp_delete_bearer).get(mcp_get),
        )
        .route(
            "/{key}/mcp",
            post(mcp_post_path).delete(mcp_delete_path).get(mcp_get),
        )
        .with_state(proxy)
}

/// Every request to an engine names the policy its trial was issued for,
/// `<run_id>:<policy_version>`, so that an engine can check it (engines that do not know
/// it ignore it; the load test's stand-in engine answers as that policy).
pub const POLICY_HEADER: &str = "arl-policy";

/// How long `/v1/models` waits for an engine's list.
const MODELS_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

async fn models_bearer(State(p): State<Arc<Proxy>>, headers: HeaderMap) -> Response {
    models(&p, bearer(&headers).as_deref()).await
}

async fn models_path(State(p): State<Arc<Proxy>>, Path(key): Path<String>) -> Response {
    models(&p, Some(&key)).await
}

async fn mcp_post_bearer(State(p): State<Arc<Proxy>>, headers: HeaderMap, body: Bytes) -> Response {
    p.mcp
        .post(bearer(&headers).as_deref(), &headers, &body)
        .await
}

async fn mcp_post_path(
    State(p): State<Arc<Proxy>>,
    Path(key): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    p.mcp.post(Some(&key), &headers, &body).await
}

async fn mcp_delete_bearer(State(p): State<Arc<Proxy>>, headers: HeaderMap) -> Response {
    p.mcp.delete(bearer(&headers).as_deref(), &headers).await
}

async fn mcp_delete_path(
    State(p): State<Arc<Proxy>>,
    Path(key): Path<String>,
    headers: HeaderMap,
) -> Response {
    p.mcp.delete(Some(&key), &headers).await
}

async fn mcp_get() -> Response {
    crate::mcp::no_event_stream()
}

/// `GET /v1/models` for a trial (an OpenAI client lists models before it calls): the list
/// of the first engine serving the trial's policy, as that engine gives it — so the names
/// a client sees are the names the engine accepts.
async fn models(p: &Proxy, key: Option<&str>) -> Response {
    let Some(trial) = key.and_then(|k| p.keys.get(k)) else {
        return error(
            StatusCode::UNAUTHORIZED,
            "invalid_api_key",
            "unknown or revoked trial key: use the base URL the rollout service issued for this trial",
        );
    };
    for index in p.backends.candidates(trial.backend()) {
        let backend = &p.backends.list[index];
        if !backend.serves(&trial.run_id, trial.policy_version) {
            continue;
        }
        let url = format!("{}/v1/models", backend.url);
        match tokio::time::timeout(MODELS_TIMEOUT, p.client.get(&url)).await {
            Ok(Ok((200, body))) => {
                return ([(header::CONTENT_TYPE, "application/json")], body).into_response();
            }
            Ok(Ok((status, _))) => {
                tracing::warn!(backend = %backend.url, status, "the engine's /v1/models failed; trying another");
            }
            Ok(Err(err)) => {
                tracing::warn!(backend = %backend.url, error = %err, "the engine's /v1/models failed; trying another");
            }
            Err(_) => {
                tracing::warn!(backend = %backend.url, "the engine's /v1/models did not answer in 10 s; trying another");
            }
        }
    }
    no_backend()
}

/// OpenAI's error body.
pub fn error(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Response {
    arl_runtime::http::ApiError::new(status, kind, message).into_response()
}

/// A 429 that asks the caller to wait `retry_after` seconds; `code` says why, for callers
/// that act on the reason (never the message text): `run_capacity` (the run's calls in
/// flight are at their limit), `policy_loading` (no engine serves the trial's policy
/// yet), `policy_swapped` (the engine changed policy during the call), or
/// `policy_too_stale` (the trial is too far behind; waiting does not help).
fn wait_and_retry(
    code: &'static str,
    retry_after: &'static str,
    message: impl Into<String>,
) -> Response {
    let mut response = arl_runtime::http::ApiError::new(
        StatusCode::TOO_MANY_REQUESTS,
        "rate_limit_exceeded",
        message,
    )
    .with_code(code)
    .into_response();
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static(retry_after));
    response
}

/// An engine's refusal, passed on — with OpenAI's `context_length_exceeded` code where
/// the engine says the prompt is too long in its own way (vLLM: `param` `input_tokens`
/// or `input_text`), so that callers decide by the code.
fn engine_refusal(status: StatusCode, dialect: Dialect, body: Bytes) -> Response {
    let mut value: Value = match serde_json::from_slice(&body) {
        Ok(value) => value,
        Err(_) => {
            return (status, [(header::CONTENT_TYPE, "application/json")], body).into_response();
        }
    };
    let too_long = dialect == Dialect::Vllm
        && status == StatusCode::BAD_REQUEST
        && matches!(
            value["error"]["param"].as_str(),
            Some("input_tokens" | "input_text")
        );
    if too_long && let Some(error) = value["error"].as_object_mut() {
        error.insert("code".into(), json!("context_length_exceeded"));
    }
    (status, axum::Json(value)).into_response()
}

fn bearer(headers: &HeaderMap) -> Option<String> {
    headers
        .get(header::AUTHORIZATION)?
        .to_str()
        .ok()?
        .strip_prefix("Bearer ")
        .map(str::to_owned)
}

async fn chat_bearer(State(p): State<Arc<Proxy>>, request: Request) -> Response {
    let key = bearer(request.headers());
    call(p, key, Kind::Chat, request).await
}

async fn completion_bearer(State(p): State<Arc<Proxy>>, request: Request) -> Response {
    let key = bearer(request.headers());
    call(p, key, Kind::Completion, request).await
}

async fn chat_path(
    State(p): State<Arc<Proxy>>,
    Path(key): Path<String>,
    request: Request,
) -> Response {
    call(p, Some(key), Kind::Chat, request).await
}

async fn completion_path(
    State(p): State<Arc<Proxy>>,
    Path(key): Path<String>,
    request: Request,
) -> Response {
    call(p, Some(key), Kind::Completion, request).await
}

/// The OpenAI endpoints the proxy serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Chat,
    Completion,
}

impl Kind {
    fn path(self) -> &'static str {
        match self {
            Kind::Chat => "/v1/chat/completions",
            Kind::Completion => "/v1/completions",
        }
    }

    /// Request fields passed on: the ones ARL knows ([`arl_schemas::openai`]); anything
    /// else is refused (a typo must not be ignored).
    fn allowed(self, field: &str) -> bool {
        let endpoint = match self {
            Kind::Chat => arl_schemas::openai::Endpoint::Chat,
            Kind::Completion => arl_schemas::openai::Endpoint::Completion,
        };
        arl_schemas::openai::field(endpoint, field).is_some()
    }
}

async fn call(p: Arc<Proxy>, key: Option<String>, kind: Kind, request: Request) -> Response {
    // The call's span continues the caller's trace, or else the trace its trial key was
    // issued in (a third-party agent sends no traceparent); the record and the backend
    // request carry it on.
    // `openinference.*` and `llm.*` are the attributes LLM trace UIs (Phoenix) chart.
    let span = tracing::info_span!(
        "llm_call",
        otel.kind = "server",
        openinference.span.kind = "LLM",
        llm.model_name = tracing::field::Empty,
        llm.token_count.prompt = tracing::field::Empty,
        llm.token_count.completion = tracing::field::Empty,
        path = kind.path(),
        run = tracing::field::Empty,
        trial = tracing::field::Empty,
        turn = tracing::field::Empty,
        model = tracing::field::Empty,
        backend = tracing::field::Empty,
        policy_version = tracing::field::Empty,
        prompt_tokens = tracing::field::Empty,
        completion_tokens = tracing::field::Empty,
        latency_ms = tracing::field::Empty,
        time_to_first_token_ms = tracing::field::Empty,
        finish_reason = tracing::field::Empty,
    );
    let trial = key.as_deref().and_then(|k| p.keys.get(k));
    if request.headers().contains_key("traceparent") {
        arl_runtime::telemetry::set_parent_from_http(&span, request.headers());
    } else if let Some(trial) = &trial {
        trial.trace.adopt(&span);
    }
    let metrics = p.metrics.clone();
    let response = forward(p, trial, kind, request, span.clone())
        .instrument(span)
        .await;
    metrics
        .calls
        .get_or_create(&StatusLabel {
            status: response.status().as_u16(),
        })
        .inc();
    response
}

async fn forward(
    p: Arc<Proxy>,
    trial: Option<Arc<Trial>>,
    kind: Kind,
    request: Request,
    span: tracing::Span,
) -> Response {
    let started = Instant::now();
    let started_at = chrono::Utc::now();
    let Some(trial) = trial else {
        return error(
            StatusCode::UNAUTHORIZED,
            "invalid_api_key",
            "unknown or revoked trial key: use the base URL the rollout service issued for this trial",
        );
    };
    let body = match read_body(request, p.config.max_body_bytes).await {
        Ok(body) => body,
        Err(response) => return response,
    };
    let mut fields = match parse_request(&body, kind) {
        Ok(fields) => fields,
        Err(message) => return error(StatusCode::BAD_REQUEST, "invalid_request_error", message),
    };
    let load = p.run_load(&trial.run_id);
    if let Some(response) = backpressure(&p, &trial, &load) {
        return response;
    }
    // Never on weights older than the trial was issued for: an engine still loading the
    // new version is passed over; when none serves it yet, the agent waits and retries.
    let candidates: Vec<usize> = p
        .backends
        .candidates(trial.backend())
        .into_iter()
        .filter(|&i| p.backends.list[i].serves(&trial.run_id, trial.policy_version))
        .collect();
    if candidates.is_empty() {
        return wait_and_retry(
            "policy_loading",
            "1",
            format!(
                "no engine serves run {}'s policy version {} yet (it is loading, or serves another run); retry shortly",
                trial.run_id, trial.policy_version
            ),
        );
    }
    let guard = InFlight::enter(&load);

    let stream = fields.get("stream").and_then(Value::as_bool) == Some(true);
    let call = CallContext {
        trial: trial.clone(),
        turn_index: trial.turns.fetch_add(1, Ordering::SeqCst),
        request_messages: fields
            .get("messages")
            .or_else(|| fields.get("prompt"))
            .cloned()
            .unwrap_or(Value::Null),
        tools: fields.get("tools").cloned(),
        model: fields
            .get("model")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned(),
        started,
        started_at,
        load: load.clone(),
    };
    span.record("run", call.trial.run_id.as_str());
    span.record("trial", call.trial.trial_id.as_str());
    span.record("turn", call.turn_index);
    span.record("model", call.model.as_str());
    span.record("llm.model_name", call.model.as_str());
    // Turns of one trial share an engine-side session (prefix cache).
    fields
        .entry("user")
        .or_insert_with(|| json!(trial.trial_id.as_str()));

    let policy = format!("{}:{}", trial.run_id, trial.policy_version);
    for index in candidates {
        let backend = p.backends.list[index].clone();
        let mut body = fields.clone();
        backend.dialect.decorate(&mut body, kind == Kind::Chat);
        let bytes = Bytes::from(Value::Object(body).to_string());
        let on_backend = InFlight::enter(&backend);
        // What a followed engine serves is known for this call only if no weight update
        // begins before its answer is complete.
        let attestation = backend
            .followed
            .then(|| (backend.clone(), backend.update_count()));
        let sent = p
            .client
            .post_json_with(
                &format!("{}{}", backend.url, kind.path()),
                bytes,
                Some((POLICY_HEADER, &policy)),
            )
            .await;
        let response = match sent {
            Ok(response) => response,
            Err(ClientError::Connect(reason)) => {
                tracing::warn!(backend = %backend.url, %reason, "backend refused; trying another");
                p.backends.mark_down(index);
                continue;
            }
            Err(ClientError::Other(reason)) => {
                return error(StatusCode::BAD_GATEWAY, "backend_error", reason);
            }
        };
        trial.stick_to(index);
        let status = response.status();
        if !status.is_success() {
            // The engine refused the request (bad input, overload): nothing was generated.
            let body = response.into_body().collect().await.map(|b| b.to_bytes());
            return engine_refusal(status, backend.dialect, body.unwrap_or_default());
        }
        let recorder = Recorder {
            proxy: p.clone(),
            call,
            backend: backend.url.clone(),
            attestation,
            record: Record::default(),
            span: span.clone(),
            _in_flight: (guard, on_backend),
        };
        return if stream {
            recorder.stream(response.into_body())
        } else {
            recorder.whole(response.into_body()).await
        };
    }
    // Nothing was generated: the call keeps its turn index for the caller's retry.
    trial.turns.fetch_sub(1, Ordering::SeqCst);
    no_backend()
}

/// 503 when no engine accepted the call (all down, or still loading): callers wait and
/// retry (`Retry-After`); the error code says it is this case, not a failed answer.
fn no_backend() -> Response {
    let body = json!({"error": {
        "message": "no backend accepted the connection (engines down or still loading); retry later",
        "type": "service_unavailable", "param": null, "code": "no_backend"}});
    (
        StatusCode::SERVICE_UNAVAILABLE,
        [(header::RETRY_AFTER, "1")],
        axum::Json(body),
    )
        .into_response()
}

/// Reads the body, refusing one over `limit` before reading it whole.
async fn read_body(request: Request, limit: usize) -> Result<Bytes, Response> {
    let too_large = || {
        error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("request body is larger than {limit} bytes"),
        )
    };
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|n| n > limit) {
        return Err(too_large());
    }
    axum::body::to_bytes(request.into_body(), limit)
        .await
        .map_err(|_| too_large())
}

/// A request body's fields, checked: a JSON object of known fields, with `messages` (chat)
/// or a prompt (completion), and at most one sample. Errors say what was wrong.
pub fn parse_request(body: &[u8], kind: Kind) -> Result<Map<String, Value>, String> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| format!("request body is not valid JSON: {e}"))?;
    let Value::Object(fields) = value else {
        return Err("request body must be a JSON object".into());
    };
    if let Some(unknown) = fields.keys().find(|f| !kind.allowed(f)) {
        return Err(format!("unknown field {unknown:?}"));
    }
    match kind {
        Kind::Chat if !fields.get("messages").is_some_and(Value::is_array) => {
            return Err("messages must be an array".into());
        }
        Kind::Completion
            if !fields.contains_key("prompt") && !fields.contains_key("prompt_token_ids") =>
        {
            return Err("prompt is required".into());
        }
        _ => {}
    }
    if fields.get("n").is_some_and(|n| n.as_u64() != Some(1)) {
        return Err("n must be 1 through the proxy: each trial is one sample".into());
    }
    Ok(fields)
}

/// 429 when the run has too many calls in flight or the engine has moved too far past the
/// trial's policy version.
fn backpressure(p: &Proxy, trial: &Trial, load: &RunLoad) -> Option<Response> {
    let busy = load.in_flight.load(Ordering::SeqCst) >= p.config.max_in_flight_per_run;
    let latest = load.latest_version.load(Ordering::SeqCst);
    let stale = trial
        .max_staleness
        .is_some_and(|limit| latest > trial.policy_version + limit);
    if busy {
        Some(wait_and_retry(
            "run_capacity",
            "1",
            "the run's LLM-call capacity is in use",
        ))
    } else if stale {
        Some(wait_and_retry(
            "policy_too_stale",
            "5",
            "the trial's policy version is too stale for this run (max_staleness)",
        ))
    } else {
        None
    }
}

/// What counts its calls in flight: a run's load, a backend.
pub(crate) trait CountsInFlight {
    fn in_flight(&self) -> &AtomicUsize;
}

impl CountsInFlight for RunLoad {
    fn in_flight(&self) -> &AtomicUsize {
        &self.in_flight
    }
}

impl CountsInFlight for crate::backends::Backend {
    fn in_flight(&self) -> &AtomicUsize {
        &self.in_flight
    }
}

/// One call counted in flight on `T` from `enter` until dropped, whichever way the call
/// ends (refused, failed, answered, or its client gone mid-stream).
struct InFlight<T: CountsInFlight>(Arc<T>);

impl<T: CountsInFlight> InFlight<T> {
    fn enter(on: &Arc<T>) -> Self {
        on.in_flight().fetch_add(1, Ordering::SeqCst);
        Self(on.clone())
    }
}

impl<T: CountsInFlight> Drop for InFlight<T> {
    fn drop(&mut self) {
        self.0.in_flight().fetch_sub(1, Ordering::SeqCst);
    }
}

struct CallContext {
    trial: Arc<Trial>,
    turn_index: u32,
    request_messages: Value,
    tools: Option<Value>,
    model: String,
    started: Instant,
    started_at: chrono::DateTime<chrono::Utc>,
    load: Arc<RunLoad>,
}

/// What the backend said, gathered from a whole response or from stream chunks.
#[derive(Debug, Default)]
struct Record {
    prompt_token_ids: Vec<u32>,
    completion_token_ids: Vec<u32>,
    logprobs: Vec<f32>,
    finish_reason: Option<String>,
    policy_version: Option<u64>,
    /// The run whose weights answered, as the backend names it: `Some(None)` for its base
    /// model, `None` when it does not say (vLLM, SGLang).
    served_run: Option<Option<String>>,
    model: Option<String>,
    first_token_ms: Option<f64>,
}

impl Record {
    /// Why the answer may not be recorded for a trial of `run`: the backend says another
    /// run's weights (or a trained version of no run) produced it. The proxy routes by the
    /// policy each engine last said it serves, but an engine can swap between that health
    /// check and the call's admission; a policy is (run, version), and a call recorded
    /// under its trial's run with another run's version would train one run on another's
    /// samples.
    fn foreign_policy(&self, run: &RunId) -> Option<String> {
        let version = self.policy_version?;
        match self.served_run.as_ref()? {
            Some(served) if served == run.as_str() => None,
            None if version == 0 => None,
            Some(served) => Some(format!(
                "run {served}'s policy version {version} answered a call of run {run}"
            )),
            None => Some(format!(
                "policy version {version} of no run answered a call of run {run}"
            )),
        }
    }

    /// Takes in a response body or one chunk (choice 0 only: the proxy allows n = 1), in
    /// any dialect: ARL and vLLM put the prompt's ids at the top and each choice's ids in
    /// the choice (streamed as deltas); SGLang's text completions put both in the choice,
    /// and its chat answers carry them once, whole, in `sglext`.
    fn absorb(&mut self, v: &Value) {
        if let Some(ids) = v.get("prompt_token_ids").and_then(Value::as_array) {
            self.prompt_token_ids = token_ids(ids);
        }
        if let Some(ext) = v.get("sglext") {
            if let Some(ids) = ext.get("input_ids").and_then(Value::as_array) {
                self.prompt_token_ids = token_ids(ids);
            }
            if let Some(ids) = ext
                .get("output_ids")
                .and_then(|o| o.get(0))
                .and_then(Value::as_array)
            {
                self.completion_token_ids = token_ids(ids);
            }
        }
        if let Some(version) = v.get("policy_version").and_then(Value::as_u64) {
            self.policy_version = Some(version);
        }
        if let Some(run) = v.get("run_id") {
            self.served_run = Some(run.as_str().map(str::to_owned));
        }
        if let Some(model) = v.get("model").and_then(Value::as_str) {
            self.model = Some(model.to_owned());
        }
        let Some(choice) = v.get("choices").and_then(|c| c.get(0)) else {
            return;
        };
        if let Some(ids) = choice.get("prompt_token_ids").and_then(Value::as_array) {
            self.prompt_token_ids = token_ids(ids);
        }
        if let Some(ids) = choice.get("token_ids").and_then(Value::as_array) {
            self.completion_token_ids
                .extend(ids.iter().filter_map(|i| i.as_u64()).map(|i| i as u32));
        }
        let logprobs = choice.get("logprobs");
        if let Some(content) = logprobs
            .and_then(|l| l.get("content"))
            .and_then(Value::as_array)
        {
            self.logprobs.extend(
                content
                    .iter()
                    .filter_map(|e| e.get("logprob").and_then(Value::as_f64))
                    .map(|l| l as f32),
            );
        } else if let Some(values) = logprobs
            .and_then(|l| l.get("token_logprobs"))
            .and_then(Value::as_array)
        {
            self.logprobs
                .extend(values.iter().filter_map(Value::as_f64).map(|l| l as f32));
        }
        if let Some(reason) = choice.get("finish_reason").and_then(Value::as_str) {
            self.finish_reason = Some(reason.to_owned());
        }
    }
}

fn token_ids(values: &[Value]) -> Vec<u32> {
    values
        .iter()
        .filter_map(Value::as_u64)
        .map(|i| i as u32)
        .collect()
}

struct Recorder {
    proxy: Arc<Proxy>,
    call: CallContext,
    backend: String,
    /// A followed backend and its update count when the call was sent
    /// ([`crate::backends::Backend::attest`]).
    attestation: Option<(Arc<crate::backends::Backend>, u64)>,
    record: Record,
    /// The call's span: the record is stored in it, whenever the stream ends.
    span: tracing::Span,
    /// The call counts on its run and on its backend while the recorder lives.
    _in_flight: (InFlight<RunLoad>, InFlight<crate::backends::Backend>),
}

/// Why a call's record was not stored.
enum Unrecorded {
    /// Over the bus's event limit: the trial's context grew too large to record (413).
    TooLarge(String),
    /// The bus or the backend's answer is at fault (503).
    Unavailable(String),
}

impl Unrecorded {
    fn reason(&self) -> &str {
        match self {
            Unrecorded::TooLarge(reason) | Unrecorded::Unavailable(reason) => reason,
        }
    }
}

impl Recorder {
    /// For a followed engine (which names no policy), the policy ARL loaded into it —
    /// when no weight update overlapped the call; otherwise the call stays recorded with
    /// no serving version (and is not trained on).
    fn attest(&mut self) {
        let Some((backend, sent_at)) = &self.attestation else {
            return;
        };
        match backend.attest(*sent_at) {
            Some(Served::Base) => {
                self.record.policy_version = Some(0);
                self.record.served_run = Some(None);
            }
            Some(Served::Run { run, version }) => {
                self.record.policy_version = Some(version);
                self.record.served_run = Some(Some(run.to_string()));
            }
            Some(Served::Unknown | Served::Pending) | None => {}
        }
    }

    /// Stores the call's record; why not when it cannot be.
    async fn store(&mut self) -> Result<(), Unrecorded> {
        self.attest();
        let r = &self.record;
        if r.completion_token_ids.is_empty() && r.prompt_token_ids.is_empty() {
            return Err(Unrecorded::Unavailable(
                "the backend returned no token ids (is it asked in its dialect?)".into(),
            ));
        }
        let version = r.policy_version.unwrap_or(self.call.trial.policy_version);
        self.call
            .load
            .latest_version
            .fetch_max(version, Ordering::SeqCst);
        let event = LlmCallV2 {
            run_id: self.call.trial.run_id.clone(),
            trial_id: self.call.trial.trial_id.clone(),
            turn_index: self.call.turn_index,
            request_messages: self.call.request_messages.clone(),
            tools: self.call.tools.clone(),
            prompt_token_ids: r.prompt_token_ids.clone(),
            completion_token_ids: r.completion_token_ids.clone(),
            logprobs: r.logprobs.clone(),
            policy_version: version,
            served_run_id: r
                .served_run
                .clone()
                .flatten()
                .and_then(|run| RunId::new(run).ok()),
            served_version: r.policy_version,
            finish_reason: match r.finish_reason.as_deref() {
                Some("stop") => FinishReason::Stop,
                Some("length") => FinishReason::Length,
                Some("tool_calls") => FinishReason::ToolCalls,
                _ => FinishReason::Abort,
            },
            timing: CallTiming {
                started_at: self.call.started_at,
                latency_ms: self.call.started.elapsed().as_secs_f64() * 1000.0,
                time_to_first_token_ms: r.first_token_ms,
            },
            backend: self.backend.clone(),
            model: r.model.clone().unwrap_or_else(|| self.call.model.clone()),
        };
        let metrics = &self.proxy.metrics;
        metrics.call_seconds.observe(event.timing.latency_ms / 1e3);
        if let Some(ttft) = event.timing.time_to_first_token_ms {
            metrics.time_to_first_token_seconds.observe(ttft / 1e3);
        }
        metrics
            .prompt_tokens
            .inc_by(event.prompt_token_ids.len() as u64);
        metrics
            .completion_tokens
            .inc_by(event.completion_token_ids.len() as u64);
        let span = &self.span;
        span.record("backend", event.backend.as_str());
        span.record("policy_version", event.policy_version);
        span.record("prompt_tokens", event.prompt_token_ids.len());
        span.record("completion_tokens", event.completion_token_ids.len());
        span.record("llm.token_count.prompt", event.prompt_token_ids.len());
        span.record(
            "llm.token_count.completion",
            event.completion_token_ids.len(),
        );
        span.record("latency_ms", event.timing.latency_ms);
        if let Some(ttft) = event.timing.time_to_first_token_ms {
            span.record("time_to_first_token_ms", ttft);
        }
        span.record(
            "finish_reason",
            match event.finish_reason {
                FinishReason::Stop => "stop",
                FinishReason::Length => "length",
                FinishReason::ToolCalls => "tool_calls",
                FinishReason::Abort => "abort",
            },
        );
        let stored = self
            .proxy
            .bus
            .publish(&event)
            .instrument(self.span.clone())
            .await
            .map_err(|e| {
                let reason = format!("the call could not be recorded: {e}");
                match e {
                    BusError::TooLarge { .. } => Unrecorded::TooLarge(reason),
                    _ => Unrecorded::Unavailable(reason),
                }
            })?;
        // A duplicate's acknowledgement names the sequence of the record first stored.
        self.call.trial.record(stored.sequence);
        Ok(())
    }

    /// An answer of another run's policy is dropped unrecorded: the call keeps its turn
    /// index for the caller's retry (429, as while no engine serves the trial's policy),
    /// and the backend is known to serve that policy until its next health check.
    fn refuse_foreign(&self, reason: &str) -> Response {
        tracing::warn!(%reason, backend = %self.backend, "answer of another policy dropped");
        self.call.trial.turns.fetch_sub(1, Ordering::SeqCst);
        if let Some(backend) = self
            .proxy
            .backends
            .list
            .iter()
            .find(|b| b.url == self.backend)
        {
            backend.set_served(
                match (&self.record.served_run, self.record.policy_version) {
                    (Some(Some(run)), Some(version)) => RunId::new(run.as_str())
                        .map_or(Served::Unknown, |run| Served::Run { run, version }),
                    (Some(None), Some(0)) => Served::Base,
                    _ => Served::Unknown,
                },
            );
        }
        wait_and_retry(
            "policy_swapped",
            "1",
            format!(
                "{reason} (the engine swapped after routing); nothing was recorded; retry shortly"
            ),
        )
    }

    async fn whole(mut self, body: hyper::body::Incoming) -> Response {
        let bytes = match body.collect().await {
            Ok(collected) => collected.to_bytes(),
            Err(e) => return error(StatusCode::BAD_GATEWAY, "backend_error", e.to_string()),
        };
        match serde_json::from_slice::<Value>(&bytes) {
            Ok(value) => self.record.absorb(&value),
            Err(e) => {
                return error(
                    StatusCode::BAD_GATEWAY,
                    "backend_error",
                    format!("the backend's answer is not JSON: {e}"),
                );
            }
        }
        if let Some(reason) = self.record.foreign_policy(&self.call.trial.run_id) {
            return self.refuse_foreign(&reason);
        }
        match self.store().await {
            Ok(()) => (
                StatusCode::OK,
                [(header::CONTENT_TYPE, "application/json")],
                bytes,
            )
                .into_response(),
            Err(Unrecorded::TooLarge(reason)) => {
                error(StatusCode::PAYLOAD_TOO_LARGE, "record_too_large", reason)
            }
            Err(Unrecorded::Unavailable(reason)) => error(
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                reason,
            ),
        }
    }

    /// Passes each server-sent event through as soon as it is complete; `[DONE]` is sent
    /// only after the record is stored.
    fn stream(self, body: hyper::body::Incoming) -> Response {
        let chunks = body.into_data_stream();
        let state = (self, chunks, Vec::<u8>::new(), false);
        let stream = futures::stream::unfold(
            state,
            |(mut rec, mut chunks, mut buffer, done)| async move {
                if done {
                    return None;
                }
                loop {
                    if let Some(end) = find_event_end(&buffer) {
                        let event: Vec<u8> = buffer.drain(..end).collect();
                        let data = event_data(&event);
                        if data.as_deref() == Some("[DONE]") {
                            let tail = match rec.store().await {
                                Ok(()) => event,
                                Err(unrecorded) => sse_error(unrecorded.reason()),
                            };
                            return Some((
                                Ok::<_, std::io::Error>(Bytes::from(tail)),
                                (rec, chunks, buffer, true),
                            ));
                        }
                        if let Some(value) =
                            data.and_then(|d| serde_json::from_str::<Value>(&d).ok())
                        {
                            if rec.record.first_token_ms.is_none() {
                                rec.record.first_token_ms =
                                    Some(rec.call.started.elapsed().as_secs_f64() * 1000.0);
                            }
                            rec.record.absorb(&value);
                            // Nothing of another run's policy reaches the client, and
                            // nothing of it is recorded.
                            if let Some(reason) = rec.record.foreign_policy(&rec.call.trial.run_id)
                            {
                                let tail = sse_error(&format!(
                                    "{reason} (the engine swapped after routing); nothing was recorded; retry"
                                ));
                                rec.call.trial.turns.fetch_sub(1, Ordering::SeqCst);
                                return Some((Ok(Bytes::from(tail)), (rec, chunks, buffer, true)));
                            }
                        }
                        return Some((Ok(Bytes::from(event)), (rec, chunks, buffer, false)));
                    }
                    match chunks.next().await {
                        Some(Ok(bytes)) => buffer.extend_from_slice(&bytes),
                        Some(Err(e)) => {
                            let tail = sse_error(&format!("the backend stream broke: {e}"));
                            return Some((Ok(Bytes::from(tail)), (rec, chunks, buffer, true)));
                        }
                        None => {
                            // Ended without [DONE]: record what came, then say it was cut short.
                            let reason = match rec.store().await {
                                Ok(()) => "the backend ended the stream early".to_owned(),
                                Err(unrecorded) => unrecorded.reason().to_owned(),
                            };
                            return Some((
                                Ok(Bytes::from(sse_error(&reason))),
                                (rec, chunks, buffer, true),
                            ));
                        }
                    }
                }
            },
        );
        Response::builder()
            .status(StatusCode::OK)
            .header(header::CONTENT_TYPE, "text/event-stream")
            .header(header::CACHE_CONTROL, "no-cache")
            .body(Body::from_stream(stream))
            .unwrap_or_else(|_| {
                error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal_error",
                    "response",
                )
            })
    }
}

/// End of the first complete SSE event (after its blank line).
fn find_event_end(buffer: &[u8]) -> Option<usize> {
    buffer
        .windows(2)
        .position(|w| w == b"\n\n")
        .map(|i| i + 2)
        .or_else(|| {
            buffer
                .windows(4)
                .position(|w| w == b"\r\n\r\n")
                .map(|i| i + 4)
        })
}

/// The `data:` payload of one event.
fn event_data(event: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(event).ok()?;
    let data: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(str::trim_start)
        .collect();
    (!data.is_empty()).then(|| data.join("\n"))
}

fn sse_error(reason: &str) -> Vec<u8> {
    let body = json!({"error": {"message": reason, "type": "service_unavailable", "param": null, "code": null}});
    format!("data: {body}\n\n").into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_checked_field_by_field() {
        let ok =
            br#"{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": true}"#;
        assert!(parse_request(ok, Kind::Chat).is_ok());
        let typo = br#"{"messages": [], "temprature": 0.5}"#;
        assert!(
            parse_request(typo, Kind::Chat)
                .unwrap_err()
                .contains("temprature")
        );
        assert!(
            parse_request(b"{", Kind::Chat)
                .unwrap_err()
                .contains("not valid JSON")
        );
        assert!(
            parse_request(br#"{"messages": [], "n": 2}"#, Kind::Chat)
                .unwrap_err()
                .contains("n must be 1")
        );
        assert!(
            parse_request(br#"{"max_tokens": 3}"#, Kind::Completion)
                .unwrap_err()
                .contains("prompt")
        );
    }

    #[test]
    fn records_gather_ids_from_chunks_and_whole_answers() {
        let mut r = Record::default();
        r.absorb(&json!({"prompt_token_ids": [1, 2], "policy_version": 3, "choices": [{"token_ids": [7], "logprobs": {"content": [{"logprob": -0.5}]}}]}));
        r.absorb(&json!({"choices": [{"token_ids": [8], "logprobs": {"content": [{"logprob": -0.25}]}, "finish_reason": "stop"}]}));
        assert_eq!(
            (r.prompt_token_ids, r.completion_token_ids),
            (vec![1, 2], vec![7, 8])
        );
        assert_eq!((r.logprobs, r.policy_version), (vec![-0.5, -0.25], Some(3)));
        assert_eq!(r.finish_reason.as_deref(), Some("stop"));
        let mut c = Record::default();
        c.absorb(&json!({"choices": [{"token_ids": [5], "logprobs": {"token_logprobs": [-1.0]}}]}));
        assert_eq!(c.logprobs, vec![-1.0]);
    }

    #[test]
    fn answers_of_another_runs_policy_are_not_the_trials() {
        let run = RunId::new("run-a").unwrap();
        let answer = |body: Value| {
            let mut r = Record::default();
            r.absorb(&body);
            r.foreign_policy(&run)
        };
        assert_eq!(
            answer(json!({"policy_version": 2, "run_id": "run-a"})),
            None
        );
        assert_eq!(
            answer(json!({"policy_version": 0, "run_id": null})),
            None,
            "the base model is every run's version 0"
        );
        assert_eq!(
            answer(json!({"policy_version": 2})),
            None,
            "a backend that does not say (vLLM) is trusted"
        );
        let other = answer(json!({"policy_version": 2, "run_id": "run-b"})).unwrap();
        assert!(
            other.contains("run-b") && other.contains("run-a"),
            "{other}"
        );
        assert!(
            !other.contains("stale"),
            "agents retry a 429 unless it says stale"
        );
        assert!(answer(json!({"policy_version": 1, "run_id": null})).is_some());
    }

    #[test]
    fn sse_events_are_split_at_blank_lines() {
        let buffer = b"data: {\"a\":1}\n\ndata: [DONE]\n\n";
        let end = find_event_end(buffer).unwrap();
        assert_eq!(event_data(&buffer[..end]).as_deref(), Some("{\"a\":1}"));
        assert_eq!(event_data(&buffer[end..]).as_deref(), Some("[DONE]"));
        assert_eq!(find_event_end(b"data: partial"), None);
    }
}
