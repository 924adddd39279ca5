//! The exec and file API of a lease, over HTTP. Every call needs the lease's bearer token.
//! File operations run inside the sandbox (`cat`, `find`, `tar`, `git`), so a path, even a
//! symlink planted by the agent, resolves in the sandbox's view and never on the host.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use arl_schemas::LeaseId;
use arl_schemas::rpc::{ExecRequest, ExecResult, FileEntry, FileKind};
use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;

use crate::backend::{Backend, ExecOutput, ExecSpec};
use crate::lease::Lease;
use crate::service::SandboxService;

/// Largest upload (tar or file) accepted.
const MAX_UPLOAD: usize = 256 << 20;
/// Largest download (tar or file) returned.
const MAX_DOWNLOAD: usize = 256 << 20;
const FILE_OP_TIMEOUT: Duration = Duration::from_secs(120);

pub fn router<B: Backend>(service: SandboxService<B>) -> Router {
    let router = Router::new()
        .route("/leases/{lease_id}/exec", post(exec::<B>))
        .route(
            "/leases/{lease_id}/files",
            get(read_file::<B>).put(write_file::<B>),
        )
        .route("/leases/{lease_id}/list", get(list::<B>))
        .route(
            "/leases/{lease_id}/tar",
            get(download_tar::<B>).put(upload_tar::<B>),
        )
        .route("/leases/{lease_id}/diff", get(diff::<B>))
        .layer(DefaultBodyLimit::max(MAX_UPLOAD))
        .with_state(service);
    arl_runtime::http::continue_traces(router)
}

/// An error answer in the shape every ARL HTTP API uses: `{"error": {"code", "message",
/// "type", "param"}}` (clients read `code` and `message`).
#[derive(Debug)]
pub struct ApiError(arl_runtime::http::ApiError);

impl ApiError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        let kind = if status.is_client_error() {
            "invalid_request_error"
        } else {
            "server_error"
        };
        Self(arl_runtime::http::ApiError::new(status, kind, message).with_code(code))
    }

    fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "bad_request", message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        self.0.into_response()
    }
}

impl From<arl_schemas::rpc::RpcError> for ApiError {
    fn from(err: arl_schemas::rpc::RpcError) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", err.message)
    }
}

/// The lease named in the URL, if the bearer token is its own.
fn authorize<B: Backend>(
    service: &SandboxService<B>,
    lease_id: &str,
    headers: &HeaderMap,
) -> Result<Arc<Lease<B::Sandbox>>, ApiError> {
    let not_found = || {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no lease {lease_id} here"),
        )
    };
    let id = LeaseId::new(lease_id).map_err(|_| not_found())?;
    let lease = service
        .inner
        .leases
        .get(&id)
        .ok_or_else(|| ended_by_service(service, &id).unwrap_or_else(not_found))?;
    let presented = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    if !presented.is_some_and(|token| lease.token_is(token)) {
        return Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "missing or wrong bearer token; use the token from the lease grant",
        ));
    }
    Ok(lease)
}

#[derive(Debug, Deserialize)]
struct PathQuery {
    #[serde(default)]
    path: String,
}

/// The absolute path inside the sandbox of a path relative to the work tree.
fn sandbox_path<S>(lease: &Lease<S>, relative: &str) -> Result<String, ApiError> {
    let relative = relative.trim_start_matches("./");
    if relative.starts_with('/')
        || relative.contains('\0')
        || relative.split('/').any(|p| p == "..")
    {
        return Err(ApiError::bad_request(format!(
            "path {relative:?} must be relative to the work tree, without '..'"
        )));
    }
    let workdir = &lease.workdir;
    Ok(if relative.is_empty() || relative == "." {
        workdir.clone()
    } else {
        format!("{workdir}/{relative}")
    })
}

async fn run_in<B: Backend>(
    service: &SandboxService<B>,
    lease: &Lease<B::Sandbox>,
    command: &str,
    env: BTreeMap<String, String>,
    stdin: Option<Vec<u8>>,
    timeout: Duration,
    output_limit: usize,
) -> Result<ExecOutput, ApiError> {
    let spec = ExecSpec {
        command: command.to_owned(),
        env,
        stdin,
        timeout,
        output_limit,
    };
    let output = service.exec(lease, spec).await?;
    match ended_by_service(service, lease.id()) {
        Some(ended) => Err(ended),
        None => Ok(output),
    }
}

/// `410 Gone` for a lease the service ended itself (its disk limit), saying why.
fn ended_by_service<B: Backend>(service: &SandboxService<B>, id: &LeaseId) -> Option<ApiError> {
    let why = service.inner.leases.end_of(id)?;
    Some(ApiError::new(
        StatusCode::GONE,
        "lease_ended",
        format!("lease {id} was ended: {why}"),
    ))
}

fn file_error(output: &ExecOutput, what: &str) -> ApiError {
    let stderr = String::from_utf8_lossy(&output.stderr).trim().to_owned();
    if stderr.contains("No such file") {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("{what}: {stderr}"),
        )
    } else if stderr.contains("Is a directory") || stderr.contains("Not a directory") {
        ApiError::bad_request(format!("{what}: {stderr}"))
    } else {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            format!("{what} failed: {stderr}"),
        )
    }
}

/// Runs a file operation `command` in the lease's sandbox with `$ARL_PATH` set to the
/// work-tree path `relative` resolves to: authorization, path checks and limits in one place.
async fn file_op<B: Backend>(
    service: &SandboxService<B>,
    lease_id: &str,
    headers: &HeaderMap,
    relative: &str,
    command: &str,
    stdin: Option<Vec<u8>>,
    output_limit: usize,
) -> Result<ExecOutput, ApiError> {
    let lease = authorize(service, lease_id, headers)?;
    let path = sandbox_path(&lease, relative)?;
    let env = BTreeMap::from([("ARL_PATH".to_owned(), path)]);
    run_in(
        service,
        &lease,
        command,
        env,
        stdin,
        FILE_OP_TIMEOUT,
        output_limit,
    )
    .await
}

async fn exec<B: Backend>(
    State(service): State<SandboxService<B>>,
    Path(lease_id): Path<String>,
    headers: HeaderMap,
    request: Result<axum::Json<ExecRequest>, JsonRejection>,
) -> Result<axum::Json<ExecResult>, ApiError> {
    let lease = authorize(&service, &lease_id, &headers)?;
    let axum::Json(request) = request.map_err(|e| ApiError::bad_request(e.body_text()))?;
    if !(request.timeout_s > 0.0 && request.timeout_s <= 3600.0) {
        return Err(ApiError::bad_request(format!(
            "timeout_s must be in (0, 3600], got {}",
            request.timeout_s
        )));
    }
    if let Some(bad) = request.env.keys().find(|k| {
        k.is_empty()
            || !k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            || k.starts_with("ARL_")
    }) {
        return Err(ApiError::bad_request(format!(
            "environment variable name {bad:?} is not allowed (letters, digits, '_'; no ARL_ prefix)"
        )));
    }
    let output = run_in(
        &service,
        &lease,
        &request.command,
        request.env,
        request.stdin.map(String::into_bytes),
        Duration::from_secs_f64(request.timeout_s),
        service.inner.config.exec_output_limit,
    )
    .await?;
    Ok(axum::Json(ExecResult {
        exit_code: output.exit_code,
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
        timed_out: output.timed_out,
        truncated: output.truncated,
        duration_ms: output.duration.as_secs_f64() * 1e3,
    }))
}

async fn read_file<B: Backend>(
    State(service): State<SandboxService<B>>,
    Path(lease_id): Path<String>,
    Query(query): Query<PathQuery>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let output = file_op(
        &service,
        &lease_id,
        &headers,
        &query.path,
        "cat -- \"$ARL_PATH\"",
        None,
        MAX_DOWNLOAD,
    )
    .await?;
    if output.exit_code != 0 {
        return Err(file_error(&output, &format!("reading {}", query.path)));
    }
    Ok((
        [(header::CONTENT_TYPE, "application/octet-stream")],
        output.stdout,
    )
        .into_response())
}

async fn write_file<B: Backend>(
    State(service): State<SandboxService<B>>,
    Path(lease_id): Path<String>,
    Query(query): Query<PathQuery>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<StatusCode, ApiError> {
    let command = "mkdir -p -- \"$(dirname -- \"$ARL_PATH\")\" && cat > \"$ARL_PATH\"";
    let output = file_op(
        &service,
        &lease_id,
        &headers,
        &query.path,
        command,
        Some(body.to_vec()),
        64 << 10,
    )
    .await?;
    if output.exit_code != 0 {
        return Err(file_error(&output, &format!("writing {}", query.path)));
    }
    Ok(StatusCode::NO_CONTENT)
}

async fn list<B: Backend>(
    State(service): State<SandboxService<B>>,
    Path(lease_id): Path<String>,
    Query(query): Query<PathQuery>,
    headers: HeaderMap,
) -> Result<axum::Json<Vec<FileEntry>>, ApiError> {
    let command = "find \"$ARL_PATH\" -mindepth 1 -maxdepth 1 -printf '%y\\t%s\\t%f\\n'";
    let output = file_op(
        &service,
        &lease_id,
        &headers,
        &query.path,
        command,
        None,
        16 << 20,
    )
    .await?;
    if output.exit_code != 0 {
        return Err(file_error(&output, &format!("listing {}", query.path)));
    }
    let text = String::from_utf8_lossy(&output.stdout);
    let mut entries: Vec<FileEntry> = text
        .lines()
        .filter_map(|line| {
            let mut parts = line.splitn(3, '\t');
            let kind = match parts.next()? {
                "f" => FileKind::File,
                "d" => FileKind::Dir,
                "l" => FileKind::Symlink,
                _ => FileKind::Other,
            };
            let size = parts.next()?.parse().unwrap_or(0);
            Some(FileEntry {
                name: parts.next()?.to_owned(),
                kind,
                size,
            })
        })
        .collect();
    entries.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(axum::Json(entries))
}

async fn download_tar<B: Backend>(
    State(service): State<SandboxService<B>>,
    Path(lease_id): Path<String>,
    Query(query): Query<PathQuery>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let output = file_op(
        &service,
        &lease_id,
        &headers,
        &query.path,
        "tar -C \"$ARL_PATH\" -cf - .",
        None,
        MAX_DOWNLOAD,
    )
    .await?;
    if output.exit_code != 0 {
        return Err(file_error(&output, &format!("archiving {}", query.path)));
    }
    if output.truncated {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "too_large",
            format!("the archive is larger than {MAX_DOWNLOAD} bytes; ask for a sub-folder"),
        ));
    }
    Ok(([(header::CONTENT_TYPE, "application/x-tar")], output.stdout).into_response())
}

async fn upload_tar<B: Backend>(
    State(service): State<SandboxService<B>>,
    Path(lease_id): Path<String>,
    Query(query): Query<PathQuery>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<StatusCode, ApiError> {
    let command = "mkdir -p -- \"$ARL_PATH\" && tar -C \"$ARL_PATH\" -xf - --no-same-owner";
    let output = file_op(
        &service,
        &lease_id,
        &headers,
        &query.path,
        command,
        Some(body.to_vec()),
        64 << 10,
    )
    .await?;
    if output.exit_code != 0 {
        let stderr = String::from_utf8_lossy(&output.stderr).trim().to_owned();
        return Err(ApiError::bad_request(format!(
            "extracting the archive failed: {stderr}"
        )));
    }
    Ok(StatusCode::NO_CONTENT)
}

async fn diff<B: Backend>(
    State(service): State<SandboxService<B>>,
    Path(lease_id): Path<String>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let lease = authorize(&service, &lease_id, &headers)?;
    // Staging everything makes new files part of the diff, as SWE-bench's harness does.
    let command = "git -c safe.directory='*' add -A && \
                   git -c safe.directory='*' -c core.quotepath=off diff --cached --binary \"$ARL_BASE\"";
    let env = BTreeMap::from([("ARL_BASE".to_owned(), lease.base.clone())]);
    let output = run_in(
        &service,
        &lease,
        command,
        env,
        None,
        FILE_OP_TIMEOUT,
        MAX_DOWNLOAD,
    )
    .await?;
    if output.exit_code != 0 {
        return Err(file_error(&output, "git diff"));
    }
    Ok((
        [(header::CONTENT_TYPE, "text/x-diff; charset=utf-8")],
        output.stdout,
    )
        .into_response())
}
