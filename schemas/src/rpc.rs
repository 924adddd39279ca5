//! Request/reply messages (NATS core request-reply, not streams). A reply is either
//! `{"ok": …}` or `{"error": {"code": …, "message": …}}`.

use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::events::EnvironmentRef;
use crate::{LeaseId, RunId, TrialId};

/// The answer to a request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Reply<T> {
    Ok(T),
    Error(RpcError),
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema, thiserror::Error)]
#[error("{code}: {message}")]
pub struct RpcError {
    pub code: RpcErrorCode,
    pub message: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum RpcErrorCode {
    /// The request was malformed or named something that does not exist.
    BadRequest,
    NotFound,
    /// No capacity now; try again later.
    Busy,
    /// The request's credential (a lease's token) is missing or wrong.
    Unauthorized,
    /// The service failed (sandbox creation, disk, …).
    Internal,
}

impl std::fmt::Display for RpcErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RpcErrorCode::BadRequest => "bad_request",
            RpcErrorCode::NotFound => "not_found",
            RpcErrorCode::Busy => "busy",
            RpcErrorCode::Unauthorized => "unauthorized",
            RpcErrorCode::Internal => "internal",
        })
    }
}

impl RpcError {
    pub fn new(code: RpcErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
}

/// Resource limits of one sandbox. Absent fields take the service's defaults.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SandboxLimits {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mb: Option<u64>,
    /// Processes and threads at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pids: Option<u64>,
    /// CPU cores' worth of time (e.g. 1.0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpus: Option<f64>,
    /// CPU seconds one command may use.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_seconds: Option<u64>,
    /// MB the work tree may grow beyond the environment's own files (like a container's
    /// writable layer); no single file may be larger. A lease past it is ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_mb: Option<u64>,
}

/// Ask for a sandbox of an environment, held for `ttl_s` unless renewed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LeaseRequestV1 {
    pub run_id: RunId,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trial_id: Option<TrialId>,
    pub environment: EnvironmentRef,
    pub ttl_s: u64,
    #[serde(default)]
    pub limits: SandboxLimits,
}

/// A granted lease and how to reach it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct LeaseGrantV1 {
    pub lease_id: LeaseId,
    /// The sandbox service instance that holds the lease: renew and release go there.
    pub instance: String,
    /// Base URL of the lease's exec and file API.
    pub endpoint: String,
    /// Bearer token for the exec and file API.
    pub token: String,
    /// The work tree's path inside the sandbox.
    pub workdir: String,
    /// Inside the sandbox, the token proxy answers at this URL (when configured).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proxy_url: Option<String>,
    pub expires_at: DateTime<Utc>,
    pub warm: bool,
}

/// Renew without the lease's token. Refused since [`RenewRequestV2`]: anyone on the bus
/// could keep another's lease alive.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RenewRequestV1 {
    pub lease_id: LeaseId,
    pub ttl_s: u64,
}

/// Extends a lease to `ttl_s` from now. `token` is the lease grant's token.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RenewRequestV2 {
    pub lease_id: LeaseId,
    pub token: String,
    pub ttl_s: u64,
}

/// A renew request of any version, as a reader decodes it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum RenewRequest {
    V2(RenewRequestV2),
    V1(RenewRequestV1),
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct RenewedV1 {
    pub lease_id: LeaseId,
    pub expires_at: DateTime<Utc>,
}

/// Release without the lease's token. Refused since [`ReleaseRequestV2`]: anyone on the
/// bus could destroy another's sandbox.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReleaseRequestV1 {
    pub lease_id: LeaseId,
}

/// Ends a lease. `token` is the lease grant's token.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReleaseRequestV2 {
    pub lease_id: LeaseId,
    pub token: String,
}

/// A release request of any version, as a reader decodes it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ReleaseRequest {
    V2(ReleaseRequestV2),
    V1(ReleaseRequestV1),
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ReleasedV1 {
    pub lease_id: LeaseId,
}

/// Sandbox operations, for [`crate::Namespace::sandbox_rpc`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SandboxOp {
    Lease,
    Renew,
    Release,
}

impl SandboxOp {
    pub fn token(self) -> &'static str {
        match self {
            SandboxOp::Lease => "lease",
            SandboxOp::Renew => "renew",
            SandboxOp::Release => "release",
        }
    }
}

/// Ask the token proxy for a trial's key: every LLM call made with it is recorded for the
/// trial. Sent by the rollout service when a trial starts.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TrialKeyRequestV1 {
    pub run_id: RunId,
    pub trial_id: TrialId,
    /// The policy version serving when the trial started.
    pub policy_version: u64,
    /// Calls are refused (429) once the engine is more than this many versions ahead of
    /// `policy_version`; None = no limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_staleness: Option<u64>,
}

/// A trial's key and where to use it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TrialKeyGrantV1 {
    pub trial_key: String,
    /// An OpenAI base URL with the key in its path (`…/<key>/v1`); the key also works as
    /// `Authorization: Bearer <key>` on `…/v1`.
    pub base_url: String,
    /// The proxy instance holding the key: revoke goes there.
    pub instance: String,
    /// The trial's sandbox tools as an MCP server (streamable HTTP, `…/<key>/mcp`; the key
    /// also works as `Authorization: Bearer <key>` on `…/mcp`). None from a proxy older
    /// than this field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mcp_url: Option<String>,
}

/// Ends a trial's key; later calls with it get 401.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TrialKeyRevokeV1 {
    pub trial_key: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TrialKeyRevokedV1 {
    /// LLM calls recorded under the key.
    pub calls: u32,
    /// Where each recorded call is in the LLM stream (`llm.call` on the run's subject), in
    /// the order stored: how the rollout reads an attempt's calls. Empty from a proxy
    /// older than this field, which reported only the count.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub call_sequences: Vec<u64>,
}

/// Token proxy operations, for [`crate::Namespace::proxy_rpc`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProxyOp {
    Issue,
    Revoke,
}

impl ProxyOp {
    pub fn token(self) -> &'static str {
        match self {
            ProxyOp::Issue => "issue",
            ProxyOp::Revoke => "revoke",
        }
    }
}

/// The exec API of a lease (HTTP `POST {endpoint}/exec`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecRequest {
    /// Run by `/bin/sh -c` in the work tree.
    pub command: String,
    /// Seconds before the command and all its children are killed.
    #[serde(default = "default_exec_timeout")]
    pub timeout_s: f64,
    #[serde(default)]
    pub env: std::collections::BTreeMap<String, String>,
    /// Sent to the command's standard input.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdin: Option<String>,
}

fn default_exec_timeout() -> f64 {
    60.0
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ExecResult {
    /// The command's exit code; 128 + signal when killed by one; -1 when it timed out.
    pub exit_code: i32,
    pub stdout: String,
    pub stderr: String,
    pub timed_out: bool,
    /// True when output beyond the capture limit was dropped.
    pub truncated: bool,
    pub duration_ms: f64,
}

/// One entry of a directory listing.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct FileEntry {
    pub name: String,
    pub kind: FileKind,
    pub size: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum FileKind {
    File,
    Dir,
    Symlink,
    Other,
}
