//! `/health`, `/ready` and `/metrics` over axum, plus whatever routes a service adds.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;

use crate::{Bus, Metrics, Shutdown};

#[derive(Clone)]
struct OpsState {
    bus: Bus,
    metrics: Metrics,
    service: &'static str,
    readiness: Readiness,
}

/// Whether a service can do its work yet — weights loaded, a healthy backend, a GPU
/// probed — as `/ready` reports it (what `arl up` and a Kubernetes readiness probe wait
/// on). `/health` says only that the process is alive and connected.
#[derive(Clone)]
pub struct Readiness(Arc<dyn Fn() -> Result<(), String> + Send + Sync>);

impl Readiness {
    /// Ready as soon as it serves (and NATS is connected).
    pub fn always() -> Self {
        Self(Arc::new(|| Ok(())))
    }

    /// Ready when `probe` says so; its error says what the service is waiting for.
    pub fn probe(probe: impl Fn() -> Result<(), String> + Send + Sync + 'static) -> Self {
        Self(Arc::new(probe))
    }

    /// Ready once `flag` is set (by the service, when its start-up work is done);
    /// until then it is waiting for `what`.
    pub fn flag(flag: Arc<std::sync::atomic::AtomicBool>, what: &'static str) -> Self {
        Self::probe(move || {
            if flag.load(std::sync::atomic::Ordering::SeqCst) {
                Ok(())
            } else {
                Err(what.to_owned())
            }
        })
    }

    pub fn check(&self) -> Result<(), String> {
        (self.0)()
    }
}

/// The operational routes every service exposes.
pub fn ops_router(
    service: &'static str,
    bus: Bus,
    metrics: Metrics,
    readiness: Readiness,
) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics_text))
        .with_state(OpsState {
            bus,
            metrics,
            service,
            readiness,
        })
}

async fn ready(State(state): State<OpsState>) -> impl IntoResponse {
    let waiting = if state.bus.is_connected() {
        state.readiness.check().err()
    } else {
        Some("the NATS connection".to_owned())
    };
    let status = if waiting.is_none() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = serde_json::json!({
        "service": state.service,
        "ready": waiting.is_none(),
        "waiting_for": waiting,
    });
    (status, axum::Json(body))
}

async fn health(State(state): State<OpsState>) -> impl IntoResponse {
    let connected = state.bus.is_connected();
    let status = if connected {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = serde_json::json!({
        "service": state.service,
        "status": if connected { "ok" } else { "degraded" },
        "nats": if connected { "connected" } else { "disconnected" },
    });
    (status, axum::Json(body))
}

async fn metrics_text(State(state): State<OpsState>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.metrics.encode(),
    )
}

/// Binds `addr` and serves `router` until shutdown. Returns the bound address (useful with
/// port 0).
pub async fn serve(
    addr: SocketAddr,
    router: Router,
    shutdown: &Shutdown,
) -> std::io::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    serve_listener(listener, router, shutdown)
}

/// Serves `router` on an already bound listener until shutdown (for services that must
/// know their address before they start serving).
pub fn serve_listener(
    listener: tokio::net::TcpListener,
    router: Router,
    shutdown: &Shutdown,
) -> std::io::Result<SocketAddr> {
    use axum::serve::ListenerExt;
    let bound = listener.local_addr()?;
    let token = shutdown.token();
    // Without TCP_NODELAY, an answer written in pieces (a streamed completion's events)
    // waits on the client's delayed ACK: 40 ms per stream on Linux.
    let listener = listener.tap_io(|tcp| {
        if let Err(err) = tcp.set_nodelay(true) {
            tracing::debug!(%err, "cannot set TCP_NODELAY");
        }
    });
    shutdown.spawn(async move {
        let served = axum::serve(listener, router)
            .with_graceful_shutdown(async move { token.cancelled().await })
            .await;
        if let Err(err) = served {
            tracing::error!(%err, "HTTP server stopped");
        }
    });
    tracing::info!(%bound, "serving HTTP");
    Ok(bound)
}

/// Serves `router` on a Unix socket at `path` (replacing a stale one) until shutdown. The
/// socket is made connectable by every local user: sandboxes reach the token proxy
/// through it as an unprivileged user, and their access is what the proxy's trial keys
/// check.
pub fn serve_unix(
    path: &std::path::Path,
    router: Router,
    shutdown: &Shutdown,
) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let _ = std::fs::remove_file(path);
    let listener = tokio::net::UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))?;
    let token = shutdown.token();
    shutdown.spawn(async move {
        let served = axum::serve(listener, router)
            .with_graceful_shutdown(async move { token.cancelled().await })
            .await;
        if let Err(err) = served {
            tracing::error!(%err, "HTTP server on a Unix socket stopped");
        }
    });
    tracing::info!(socket = %path.display(), "serving HTTP");
    Ok(())
}

/// An error answer in OpenAI's shape — `{"error": {"message", "type", "param", "code"}}` —
/// with its HTTP status: the one error body of every ARL HTTP API (the engine and the
/// proxy speak OpenAI's API; the sandbox's lease API answers the same way, and its
/// clients read `code` and `message`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `rate_limit_exceeded`, …
    pub kind: &'static str,
    /// The request field at fault, where there is one.
    pub param: Option<&'static str>,
    /// A stable, machine-readable reason: `model_not_found`, `queue_full`, …
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
        }
    }

    /// 400 `invalid_request_error`, naming the field at fault.
    pub fn invalid(message: impl Into<String>, param: Option<&'static str>) -> Self {
        Self {
            param,
            ..Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
        }
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn with_param(mut self, param: &'static str) -> Self {
        self.param = Some(param);
        self
    }

    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> axum::response::Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

/// Every request of `router` handled in a span that continues the caller's trace (its
/// `traceparent`): what an engine and the sandbox's lease API do with the trial's hops.
pub fn continue_traces(router: Router) -> Router {
    router.layer(axum::middleware::from_fn(continue_trace))
}

async fn continue_trace(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use tracing::Instrument;
    let span = tracing::info_span!(
        "http",
        otel.kind = "server",
        method = %request.method(),
        path = %request.uri().path(),
    );
    crate::telemetry::set_parent_from_http(&span, request.headers());
    next.run(request).instrument(span).await
}
