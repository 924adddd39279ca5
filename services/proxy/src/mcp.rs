//! The trial's sandbox tools as an MCP server: the Model Context Protocol over its
//! streamable HTTP transport (revisions 2025-03-26 to 2025-11-25, answered as JSON), at
//! `/<key>/mcp` or `/mcp` with `Authorization: Bearer <key>`. It lives in the proxy because
//! the trial's key does: a session is opened with the key the proxy issued, checked the
//! same way as an LLM call, and ends when the key is revoked (the trial ended), when the
//! client deletes it, or after `session_ttl` unused. Each session leases its own sandbox
//! (`environment`) on its first tool call and releases it when it ends.
//!
//! Tools: `run_code` (Python), `run_shell`, `read_file`, `write_file`. What goes wrong in
//! a tool (a bad argument, a timeout, a crash, a missing file) is a tool result with
//! `isError: true` that the model reads; only protocol misuse is a JSON-RPC error.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use arl_runtime::Shutdown;
use arl_sandbox_client::{Lease, SandboxClient, SandboxError};
use arl_schemas::events::EnvironmentRef;
use arl_schemas::rpc::{ExecRequest, ExecResult, LeaseRequestV1, SandboxLimits};
use axum::body::Bytes;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tracing::Instrument;

use crate::keys::{Keys, Trial};

/// Protocol revisions this server speaks, oldest first; a client offering another gets the
/// newest (the client then decides whether it can go on).
pub const PROTOCOL_VERSIONS: [&str; 3] = ["2025-03-26", "2025-06-18", "2025-11-25"];
const SESSION_HEADER: &str = "mcp-session-id";
const VERSION_HEADER: &str = "mcp-protocol-version";

/// JSON-RPC error codes.
const PARSE_ERROR: i64 = -32700;
const INVALID_REQUEST: i64 = -32600;
const METHOD_NOT_FOUND: i64 = -32601;
const INVALID_PARAMS: i64 = -32602;
/// Server-defined: the trial key is unknown or revoked.
const UNAUTHORIZED: i64 = -32001;

#[derive(Clone, Debug)]
pub struct McpConfig {
    /// The environment a session's sandbox is leased from.
    pub environment: String,
    /// A session unused this long ends (and its sandbox with it).
    pub session_ttl: Duration,
    /// The TTL of a session's lease: only a backstop for sandboxes of a proxy that died
    /// holding sessions (a live proxy releases each at its session's end), so longer than
    /// any trial.
    pub lease_ttl: Duration,
    /// Sessions one trial key may hold at once (each has a sandbox).
    pub sessions_per_trial: usize,
    /// The sandbox's memory, MB (`run_code` and `run_shell` share it).
    pub memory_mb: u64,
    /// A command's time limit when the call names none, and the most it may name.
    pub default_timeout_s: f64,
    pub max_timeout_s: f64,
    /// Characters of stdout and of stderr returned (head and tail kept).
    pub max_output_chars: usize,
}

impl Default for McpConfig {
    fn default() -> Self {
        Self {
            environment: "scratch".into(),
            session_ttl: Duration::from_secs(1800),
            lease_ttl: Duration::from_secs(3 * 3600),
            sessions_per_trial: 8,
            memory_mb: 1024,
            default_timeout_s: 10.0,
            max_timeout_s: 120.0,
            max_output_chars: 8000,
        }
    }
}

/// The MCP sessions of this proxy.
pub struct Mcp {
    keys: Arc<Keys>,
    sandbox: SandboxClient,
    config: McpConfig,
    sessions: Mutex<HashMap<String, Arc<Session>>>,
}

struct Session {
    key: String,
    trial: Arc<Trial>,
    /// Leased on the first tool call.
    lease: tokio::sync::Mutex<Option<Lease>>,
    last_used: Mutex<Instant>,
}

impl Session {
    fn touch(&self) {
        *self
            .last_used
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Instant::now();
    }

    fn idle(&self) -> Duration {
        self.last_used
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .elapsed()
    }
}

impl Mcp {
    pub fn new(keys: Arc<Keys>, sandbox: SandboxClient, config: McpConfig) -> Arc<Self> {
        Arc::new(Self {
            keys,
            sandbox,
            config,
            sessions: Mutex::default(),
        })
    }

    /// Ends sessions whose trial key was revoked or that went unused past the TTL, every
    /// few seconds until shutdown (revoke ends a trial's sessions at once; this catches
    /// the rest).
    pub fn sweep(self: &Arc<Self>, shutdown: &Shutdown) {
        let mcp = self.clone();
        let stop = shutdown.clone();
        shutdown.spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(5));
            loop {
                tokio::select! {
                    () = stop.triggered() => break,
                    _ = tick.tick() => {}
                }
                let stale: Vec<String> = mcp
                    .lock()
                    .iter()
                    .filter(|(_, s)| !mcp.live(s) || s.idle() > mcp.config.session_ttl)
                    .map(|(id, _)| id.clone())
                    .collect();
                for id in stale {
                    mcp.end(&id).await;
                }
            }
            // Shutting down: give every sandbox back.
            let all: Vec<String> = mcp.lock().keys().cloned().collect();
            for id in all {
                mcp.end(&id).await;
            }
        });
    }

    /// Ends every session of a trial key (called when the key is revoked).
    pub async fn end_trial(&self, key: &str) {
        let ids: Vec<String> = self
            .lock()
            .iter()
            .filter(|(_, s)| s.key == key)
            .map(|(id, _)| id.clone())
            .collect();
        for id in ids {
            self.end(&id).await;
        }
    }

    /// Sessions open now.
    pub fn open_sessions(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Session>>> {
        self.sessions.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether the session's key still names the trial it was opened for.
    fn live(&self, session: &Session) -> bool {
        self.keys
            .get(&session.key)
            .is_some_and(|t| Arc::ptr_eq(&t, &session.trial))
    }

    async fn end(&self, id: &str) {
        let Some(session) = self.lock().remove(id) else {
            return;
        };
        if let Some(lease) = session.lease.lock().await.take() {
            lease.release().await;
        }
        tracing::debug!(session = id, trial = %session.trial.trial_id, "MCP session ended");
    }

    /// `POST /mcp`: one JSON-RPC message.
    pub async fn post(&self, key: Option<&str>, headers: &HeaderMap, body: &Bytes) -> Response {
        if let Some(refused) = foreign_origin(headers) {
            return refused;
        }
        let Some((key, trial)) = key.and_then(|k| Some((k, self.keys.get(k)?))) else {
            return rpc_error(
                StatusCode::UNAUTHORIZED,
                Value::Null,
                UNAUTHORIZED,
                "unknown or revoked trial key: use the MCP URL the proxy issued with this \
                 trial's key (`mcp_url` of the key grant)",
            );
        };
        let message: Value = match serde_json::from_slice(body) {
            Ok(message) => message,
            Err(e) => {
                return rpc_error(
                    StatusCode::BAD_REQUEST,
                    Value::Null,
                    PARSE_ERROR,
                    &format!("the body is not JSON: {e}"),
                );
            }
        };
        if message.is_array() {
            return rpc_error(
                StatusCode::BAD_REQUEST,
                Value::Null,
                INVALID_REQUEST,
                "JSON-RPC batches are not accepted (MCP 2025-06-18 removed them): send one message per POST",
            );
        }
        let id = message.get("id").cloned();
        let Some(method) = message.get("method").and_then(Value::as_str) else {
            // A response or an error from the client: this server sends no requests.
            return StatusCode::ACCEPTED.into_response();
        };
        let id = match id {
            Some(id) if !id.is_null() => id,
            // A notification (`notifications/initialized`, `notifications/cancelled`).
            _ => return StatusCode::ACCEPTED.into_response(),
        };
        if let Some(version) = header_str(headers, VERSION_HEADER)
            && !PROTOCOL_VERSIONS.contains(&version)
        {
            return rpc_error(
                StatusCode::BAD_REQUEST,
                id,
                INVALID_REQUEST,
                &format!(
                    "MCP-Protocol-Version {version} is not supported; this server speaks {}",
                    PROTOCOL_VERSIONS.join(", ")
                ),
            );
        }
        let params = message.get("params").cloned().unwrap_or(Value::Null);
        if method == "initialize" {
            return self.initialize(key, trial, id, &params);
        }
        let Some(session_id) = header_str(headers, SESSION_HEADER) else {
            return rpc_error(
                StatusCode::BAD_REQUEST,
                id,
                INVALID_REQUEST,
                &format!(
                    "{method} needs a session: send initialize first, then its Mcp-Session-Id header"
                ),
            );
        };
        let session = self.lock().get(session_id).cloned();
        let Some(session) = session.filter(|s| s.key == key && self.live(s)) else {
            // The spec's answer for a session that ended: the client may start a new one.
            return rpc_error(
                StatusCode::NOT_FOUND,
                id,
                INVALID_REQUEST,
                "no such MCP session: it ended (the trial ended, it was deleted or unused too \
                 long) or belongs to another trial",
            );
        };
        session.touch();
        let answer = match method {
            "ping" => Ok(json!({})),
            "tools/list" => Ok(json!({ "tools": tool_definitions() })),
            "tools/call" => self.call_tool(&session, &params).await,
            other => Err((
                METHOD_NOT_FOUND,
                format!("method {other:?} is not served here"),
            )),
        };
        match answer {
            Ok(result) => rpc_result(id, result, None),
            Err((code, message)) => rpc_error(StatusCode::OK, id, code, &message),
        }
    }

    /// `DELETE /mcp`: the client ends its session.
    pub async fn delete(&self, key: Option<&str>, headers: &HeaderMap) -> Response {
        let owned = header_str(headers, SESSION_HEADER).filter(|id| {
            self.lock()
                .get(*id)
                .is_some_and(|s| Some(s.key.as_str()) == key)
        });
        match owned {
            Some(id) => {
                self.end(id).await;
                StatusCode::NO_CONTENT.into_response()
            }
            None => StatusCode::NOT_FOUND.into_response(),
        }
    }

    fn initialize(&self, key: &str, trial: Arc<Trial>, id: Value, params: &Value) -> Response {
        let open = self.lock().values().filter(|s| s.key == key).count();
        if open >= self.config.sessions_per_trial {
            return rpc_error(
                StatusCode::OK,
                id,
                INVALID_REQUEST,
                &format!(
                    "this trial already has {open} MCP sessions open, the most allowed (each \
                     holds a sandbox): end one with DELETE first"
                ),
            );
        }
        let offered = params["protocolVersion"].as_str().unwrap_or_default();
        let version = if PROTOCOL_VERSIONS.contains(&offered) {
            offered
        } else {
            PROTOCOL_VERSIONS[PROTOCOL_VERSIONS.len() - 1]
        };
        let session_id = uuid::Uuid::new_v4().simple().to_string();
        tracing::debug!(session = %session_id, trial = %trial.trial_id, "MCP session opened");
        self.lock().insert(
            session_id.clone(),
            Arc::new(Session {
                key: key.to_owned(),
                trial,
                lease: tokio::sync::Mutex::new(None),
                last_used: Mutex::new(Instant::now()),
            }),
        );
        let result = json!({
            "protocolVersion": version,
            "capabilities": {"tools": {"listChanged": false}},
            "serverInfo": {"name": "arl-sandbox-tools", "version": env!("CARGO_PKG_VERSION")},
            "instructions": "Tools that run in this trial's own sandbox: Python with run_code, \
                shell commands with run_shell, files with read_file and write_file. Paths are \
                relative to the sandbox's work folder.",
        });
        rpc_result(id, result, Some(&session_id))
    }

    async fn call_tool(&self, session: &Session, params: &Value) -> Result<Value, (i64, String)> {
        let name = params["name"].as_str().unwrap_or_default();
        let arguments = params
            .get("arguments")
            .cloned()
            .unwrap_or_else(|| json!({}));
        let tool = match Tool::parse(name, &arguments, &self.config) {
            Ok(tool) => tool,
            Err(ToolProblem::Unknown) => {
                return Err((
                    INVALID_PARAMS,
                    format!("unknown tool {name:?}: tools/list says which there are"),
                ));
            }
            // Wrong arguments are the model's to fix: a tool error it can read.
            Err(ToolProblem::Arguments(message)) => return Ok(tool_error(&message)),
        };
        let lease = match self.lease(session).await {
            Ok(lease) => lease,
            Err(e) => return Ok(tool_error(&format!("the sandbox is unavailable: {e}"))),
        };
        let span = tracing::info_span!(
            "mcp_tool",
            otel.name = "mcp tool",
            openinference.span.kind = "TOOL",
            tool = name,
            trial = %session.trial.trial_id,
        );
        Ok(self.run(&lease, tool).instrument(span).await)
    }

    async fn run(&self, lease: &Lease, tool: Tool) -> Value {
        match tool {
            Tool::RunCode { code, timeout_s } => {
                let request = ExecRequest {
                    command: "exec python3 -".into(),
                    timeout_s,
                    env: Default::default(),
                    stdin: Some(code),
                };
                self.exec_result(lease.exec(&request).await, timeout_s)
            }
            Tool::RunShell { command, timeout_s } => {
                let request = ExecRequest {
                    command,
                    timeout_s,
                    env: Default::default(),
                    stdin: None,
                };
                self.exec_result(lease.exec(&request).await, timeout_s)
            }
            Tool::ReadFile { path } => match lease.read(&path).await {
                Ok(text) => json!({"content": [{"type": "text", "text": text}], "isError": false}),
                Err(e) => tool_error(&format!("cannot read {path}: {}", sandbox_reason(&e))),
            },
            Tool::WriteFile { path, content } => match lease.write(&path, &content).await {
                Ok(()) => json!({
                    "content": [{"type": "text", "text": format!("wrote {} bytes to {path}", content.len())}],
                    "isError": false,
                }),
                Err(e) => tool_error(&format!("cannot write {path}: {}", sandbox_reason(&e))),
            },
        }
    }

    /// The session's sandbox, leased on first use.
    async fn lease(&self, session: &Session) -> Result<Lease, SandboxError> {
        let mut held = session.lease.lock().await;
        if let Some(lease) = held.as_ref() {
            return Ok(lease.clone());
        }
        let request = LeaseRequestV1 {
            run_id: session.trial.run_id.clone(),
            trial_id: Some(session.trial.trial_id.clone()),
            environment: EnvironmentRef {
                name: self.config.environment.clone(),
                digest: None,
            },
            ttl_s: self.config.lease_ttl.as_secs().max(60),
            limits: SandboxLimits {
                memory_mb: Some(self.config.memory_mb),
                ..SandboxLimits::default()
            },
        };
        let lease = self
            .sandbox
            .lease(&request, Duration::from_secs(60))
            .await?;
        *held = Some(lease.clone());
        Ok(lease)
    }

    fn exec_result(&self, result: Result<ExecResult, SandboxError>, timeout_s: f64) -> Value {
        let result = match result {
            Ok(result) => result,
            Err(e) => return tool_error(&format!("the sandbox failed: {}", sandbox_reason(&e))),
        };
        let limit = self.config.max_output_chars;
        let (stdout, stderr) = (
            arl_runtime::text::head_and_tail(&result.stdout, limit),
            arl_runtime::text::head_and_tail(&result.stderr, limit),
        );
        let mut text = String::new();
        if result.timed_out {
            text.push_str(&format!("timed out after {timeout_s} s and was killed\n"));
        } else if result.exit_code != 0 {
            text.push_str(&format!("exit code {}\n", result.exit_code));
        }
        if !stdout.is_empty() {
            text.push_str(&stdout);
        }
        if !stderr.is_empty() {
            if !text.is_empty() && !text.ends_with('\n') {
                text.push('\n');
            }
            text.push_str("[stderr]\n");
            text.push_str(&stderr);
        }
        json!({
            "content": [{"type": "text", "text": text}],
            "structuredContent": {
                "exit_code": result.exit_code,
                "stdout": stdout,
                "stderr": stderr,
                "timed_out": result.timed_out,
            },
            "isError": result.timed_out || result.exit_code != 0,
        })
    }
}

fn sandbox_reason(e: &SandboxError) -> String {
    match e {
        SandboxError::Api { reason, .. } | SandboxError::Ended { reason, .. } => reason.clone(),
        other => other.to_string(),
    }
}

/// A parsed tool call.
#[derive(Debug, PartialEq)]
enum Tool {
    RunCode { code: String, timeout_s: f64 },
    RunShell { command: String, timeout_s: f64 },
    ReadFile { path: String },
    WriteFile { path: String, content: String },
}

#[derive(Debug, PartialEq)]
enum ToolProblem {
    Unknown,
    Arguments(String),
}

impl Tool {
    fn parse(name: &str, arguments: &Value, config: &McpConfig) -> Result<Self, ToolProblem> {
        let text = |field: &str| -> Result<String, ToolProblem> {
            arguments[field].as_str().map(str::to_owned).ok_or_else(|| {
                ToolProblem::Arguments(format!(
                    "{name} needs a string argument {field:?}, got {}",
                    arguments.get(field).map_or("none".into(), Value::to_string)
                ))
            })
        };
        let timeout = || -> Result<f64, ToolProblem> {
            match arguments.get("timeout_s") {
                None | Some(Value::Null) => Ok(config.default_timeout_s),
                Some(v) => match v.as_f64() {
                    Some(s) if s > 0.0 && s <= config.max_timeout_s => Ok(s),
                    _ => Err(ToolProblem::Arguments(format!(
                        "timeout_s must be a number in (0, {}], got {v}",
                        config.max_timeout_s
                    ))),
                },
            }
        };
        if !arguments.is_object() {
            return Err(ToolProblem::Arguments(format!(
                "{name}'s arguments must be an object, got {arguments}"
            )));
        }
        Ok(match name {
            "run_code" => Tool::RunCode {
                code: text("code")?,
                timeout_s: timeout()?,
            },
            "run_shell" => Tool::RunShell {
                command: text("command")?,
                timeout_s: timeout()?,
            },
            "read_file" => Tool::ReadFile {
                path: text("path")?,
            },
            "write_file" => Tool::WriteFile {
                path: text("path")?,
                content: text("content")?,
            },
            _ => return Err(ToolProblem::Unknown),
        })
    }
}

/// What `tools/list` answers: JSON Schema for each tool's input and, where it has one,
/// its structured output.
pub fn tool_definitions() -> Value {
    let exec_output = json!({
        "type": "object",
        "properties": {
            "exit_code": {"type": "integer", "description": "128 + signal when killed by one; -1 when it timed out"},
            "stdout": {"type": "string"},
            "stderr": {"type": "string"},
            "timed_out": {"type": "boolean"},
        },
        "required": ["exit_code", "stdout", "stderr", "timed_out"],
    });
    let timeout = json!({"type": "number", "exclusiveMinimum": 0,
        "description": "Seconds before it is killed (default 10)."});
    json!([
        {
            "name": "run_code",
            "title": "Run Python",
            "description": "Run a Python 3 program in the sandbox and return what it printed. \
                Use print() to see values.",
            "inputSchema": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "The program."}, "timeout_s": timeout},
                "required": ["code"],
            },
            "outputSchema": exec_output,
        },
        {
            "name": "run_shell",
            "title": "Run a shell command",
            "description": "Run a command with /bin/sh in the sandbox's work folder.",
            "inputSchema": {
                "type": "object",
                "properties": {"command": {"type": "string"}, "timeout_s": timeout},
                "required": ["command"],
            },
            "outputSchema": exec_output,
        },
        {
            "name": "read_file",
            "title": "Read a file",
            "description": "Read a text file (path relative to the work folder).",
            "inputSchema": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
        {
            "name": "write_file",
            "title": "Write a file",
            "description": "Write a text file (path relative to the work folder), creating its folders.",
            "inputSchema": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                "required": ["path", "content"],
            },
        },
    ])
}

fn tool_error(message: &str) -> Value {
    json!({"content": [{"type": "text", "text": message}], "isError": true})
}

/// The transport's guard against DNS rebinding: a browser's request (it sends `Origin`)
/// from a page of another host than the one it addresses is refused (403). Agents send no
/// `Origin`.
fn foreign_origin(headers: &HeaderMap) -> Option<Response> {
    let origin = header_str(headers, "origin")?;
    let host = header_str(headers, "host").unwrap_or_default();
    let origin_host = origin
        .split_once("://")
        .map_or(origin, |(_, rest)| rest)
        .trim_end_matches('/');
    (origin_host != host).then(|| {
        rpc_error(
            StatusCode::FORBIDDEN,
            Value::Null,
            INVALID_REQUEST,
            &format!("requests from pages of {origin} are refused (it is not {host})"),
        )
    })
}

fn header_str<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name)?.to_str().ok()
}

fn rpc_result(id: Value, result: Value, session: Option<&str>) -> Response {
    let mut response =
        axum::Json(json!({"jsonrpc": "2.0", "id": id, "result": result})).into_response();
    if let Some(session) = session.and_then(|s| HeaderValue::from_str(s).ok()) {
        response.headers_mut().insert(SESSION_HEADER, session);
    }
    response
}

fn rpc_error(status: StatusCode, id: Value, code: i64, message: &str) -> Response {
    let body = json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message}});
    (status, axum::Json(body)).into_response()
}

/// `GET /mcp`: this server sends nothing unprompted, so it opens no event stream (the
/// transport's answer for that is 405).
pub fn no_event_stream() -> Response {
    (
        StatusCode::METHOD_NOT_ALLOWED,
        [(header::ALLOW, "POST, DELETE")],
        "this MCP server sends no server-initiated messages: POST requests, DELETE to end a session",
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tool_arguments_are_checked_and_bad_ones_are_the_models_to_fix() {
        let config = McpConfig::default();
        assert_eq!(
            Tool::parse("run_code", &json!({"code": "print(1)"}), &config),
            Ok(Tool::RunCode {
                code: "print(1)".into(),
                timeout_s: 10.0
            })
        );
        assert_eq!(
            Tool::parse(
                "run_shell",
                &json!({"command": "ls", "timeout_s": 2.5}),
                &config
            ),
            Ok(Tool::RunShell {
                command: "ls".into(),
                timeout_s: 2.5
            })
        );
        assert_eq!(
            Tool::parse("run_code", &json!({"timeout_s": 1}), &config),
            Err(ToolProblem::Arguments(
                "run_code needs a string argument \"code\", got none".into()
            ))
        );
        assert!(matches!(
            Tool::parse("run_code", &json!({"code": "1", "timeout_s": 999}), &config),
            Err(ToolProblem::Arguments(m)) if m.contains("timeout_s must be a number in (0, 120]")
        ));
        assert!(matches!(
            Tool::parse("run_code", &json!("print(1)"), &config),
            Err(ToolProblem::Arguments(_))
        ));
        assert_eq!(
            Tool::parse("rm_rf", &json!({}), &config),
            Err(ToolProblem::Unknown)
        );
    }

    #[test]
    fn a_page_of_another_host_is_refused() {
        let headers = |pairs: &[(&'static str, &'static str)]| {
            let mut map = HeaderMap::new();
            for (name, value) in pairs {
                map.insert(*name, HeaderValue::from_static(value));
            }
            map
        };
        assert!(foreign_origin(&headers(&[("host", "127.0.0.1:8200")])).is_none());
        let same = headers(&[
            ("host", "127.0.0.1:8200"),
            ("origin", "http://127.0.0.1:8200"),
        ]);
        assert!(foreign_origin(&same).is_none());
        let other = headers(&[
            ("host", "127.0.0.1:8200"),
            ("origin", "http://evil.example"),
        ]);
        let refused = foreign_origin(&other).map(|r| r.status());
        assert_eq!(refused, Some(StatusCode::FORBIDDEN));
    }

    #[test]
    fn every_tool_listed_is_one_the_server_parses() {
        let config = McpConfig::default();
        for tool in tool_definitions().as_array().unwrap_or(&Vec::new()) {
            let name = tool["name"].as_str().unwrap_or_default();
            let arguments: serde_json::Map<String, Value> = tool["inputSchema"]["required"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .map(|field| (field.to_owned(), json!("x")))
                .collect();
            assert!(
                Tool::parse(name, &Value::Object(arguments), &config).is_ok(),
                "{name}"
            );
        }
    }
}
