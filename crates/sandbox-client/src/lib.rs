//! The client side of a sandbox lease. Leasing and releasing go over NATS request/reply to
//! the sandbox service (`arl.rpc.sandbox.<instance|any>.<op>`); commands and files go to
//! the lease's own HTTP API with its bearer token. Services that run code in sandboxes
//! (rollout, reward) share this instead of each speaking the protocol.

use std::time::Duration;

use arl_runtime::Bus;
use arl_runtime::rpc::RequestError;
use arl_schemas::rpc::{
    ExecRequest, ExecResult, LeaseGrantV1, LeaseRequestV1, ReleaseRequestV2, ReleasedV1, SandboxOp,
};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tracing::Instrument;

mod archive;
pub use archive::ArchiveError;

#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("lease of {environment} refused: {source}")]
    Lease {
        environment: String,
        source: RequestError,
    },
    #[error("{operation} on lease {lease}: {reason}")]
    Api {
        operation: &'static str,
        lease: String,
        reason: String,
    },
    /// The sandbox service ended the lease for what ran in it (its disk limit).
    #[error("{operation} on lease {lease}: {reason}")]
    Ended {
        operation: &'static str,
        lease: String,
        reason: String,
    },
}

/// Leases sandboxes. Cheap to clone.
#[derive(Clone, Debug)]
pub struct SandboxClient {
    bus: Bus,
    http: Client<HttpConnector, Full<Bytes>>,
}

/// A granted lease. Release it with [`Lease::release`]; one that is dropped expires at
/// its TTL.
#[derive(Clone, Debug)]
pub struct Lease {
    pub grant: LeaseGrantV1,
    client: SandboxClient,
}

impl SandboxClient {
    pub fn new(bus: Bus) -> Self {
        Self {
            bus,
            http: Client::builder(TokioExecutor::new()).build(HttpConnector::new()),
        }
    }

    /// Asks any sandbox instance for a lease; waits up to `timeout` (a cold environment
    /// may take a while to prepare).
    pub async fn lease(
        &self,
        request: &LeaseRequestV1,
        timeout: Duration,
    ) -> Result<Lease, SandboxError> {
        let ns = self.bus.namespace();
        let span = tracing::info_span!(
            "sandbox_lease",
            otel.name = "sandbox lease",
            otel.kind = "client",
            environment = %request.environment.name,
        );
        let grant: LeaseGrantV1 = self
            .bus
            .request(ns.sandbox_rpc("any", SandboxOp::Lease), request, timeout)
            .instrument(span)
            .await
            .map_err(|source| SandboxError::Lease {
                environment: request.environment.name.clone(),
                source,
            })?;
        Ok(Lease {
            grant,
            client: self.clone(),
        })
    }
}

impl Lease {
    /// Writes a file (path relative to the work tree), creating its folders.
    pub async fn write(&self, path: &str, content: &str) -> Result<(), SandboxError> {
        let url = format!("{}/files?path={}", self.grant.endpoint, encode_query(path));
        self.call(
            "write",
            hyper::Method::PUT,
            &url,
            Bytes::from(content.to_owned()),
        )
        .await
        .map(|_| ())
    }

    /// Writes several files (paths relative to the work tree) in one upload, creating their
    /// folders: one process in the sandbox instead of one per file.
    pub async fn write_all(&self, files: &[(String, String)]) -> Result<(), SandboxError> {
        let tar = archive::ustar(files).map_err(|e| self.error("write", e.to_string()))?;
        let url = format!("{}/tar?path=.", self.grant.endpoint);
        self.call("write", hyper::Method::PUT, &url, Bytes::from(tar))
            .await
            .map(|_| ())
    }

    /// Reads a file (path relative to the work tree) as text.
    pub async fn read(&self, path: &str) -> Result<String, SandboxError> {
        let url = format!("{}/files?path={}", self.grant.endpoint, encode_query(path));
        let bytes = self
            .call("read", hyper::Method::GET, &url, Bytes::new())
            .await?;
        String::from_utf8(bytes.to_vec())
            .map_err(|_| self.error("read", format!("{path} is not UTF-8 text")))
    }

    /// Runs `command` with `/bin/sh -c` in the work tree.
    pub async fn exec(&self, request: &ExecRequest) -> Result<ExecResult, SandboxError> {
        let span = tracing::info_span!(
            "sandbox_exec",
            otel.name = "sandbox exec",
            openinference.span.kind = "TOOL",
            otel.kind = "client",
            lease = %self.grant.lease_id,
            command = %arl_runtime::text::head(&request.command, 200),
            exit_code = tracing::field::Empty,
            timed_out = tracing::field::Empty,
        );
        let body = serde_json::to_vec(request).map_err(|e| self.error("exec", e.to_string()))?;
        let url = format!("{}/exec", self.grant.endpoint);
        let answer = self
            .call("exec", hyper::Method::POST, &url, Bytes::from(body))
            .instrument(span.clone())
            .await?;
        let result: ExecResult =
            serde_json::from_slice(&answer).map_err(|e| self.error("exec", e.to_string()))?;
        span.record("exit_code", result.exit_code);
        span.record("timed_out", result.timed_out);
        Ok(result)
    }

    /// `git diff` of the work tree against its base, as the agent left it.
    pub async fn diff(&self) -> Result<String, SandboxError> {
        let url = format!("{}/diff", self.grant.endpoint);
        let span = tracing::info_span!(
            "sandbox_diff",
            otel.name = "sandbox diff",
            otel.kind = "client",
            lease = %self.grant.lease_id,
            bytes = tracing::field::Empty,
        );
        let answer = self
            .call("diff", hyper::Method::GET, &url, Bytes::new())
            .instrument(span.clone())
            .await?;
        span.record("bytes", answer.len());
        String::from_utf8(answer.to_vec()).map_err(|e| self.error("diff", e.to_string()))
    }

    /// Gives the sandbox back (it is destroyed). Errors are logged, not returned: an
    /// unreleased lease still ends at its TTL.
    pub async fn release(self) {
        let ns = self.client.bus.namespace();
        let subject = ns.sandbox_rpc(&self.grant.instance, SandboxOp::Release);
        let request = ReleaseRequestV2 {
            lease_id: self.grant.lease_id.clone(),
            token: self.grant.token.clone(),
        };
        let span = tracing::info_span!(
            "sandbox_release",
            otel.name = "sandbox release",
            otel.kind = "client",
            lease = %self.grant.lease_id,
        );
        let released: Result<ReleasedV1, _> = self
            .client
            .bus
            .request(subject, &request, Duration::from_secs(30))
            .instrument(span)
            .await;
        if let Err(err) = released {
            tracing::warn!(lease = %self.grant.lease_id, error = %err, "release failed; the lease ends at its TTL");
        }
    }

    async fn call(
        &self,
        operation: &'static str,
        method: hyper::Method,
        url: &str,
        body: Bytes,
    ) -> Result<Bytes, SandboxError> {
        let mut request = hyper::Request::builder()
            .method(method)
            .uri(url)
            .header(
                hyper::header::AUTHORIZATION,
                format!("Bearer {}", self.grant.token),
            )
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .body(Full::new(body))
            .map_err(|e| self.error(operation, e.to_string()))?;
        // The sandbox continues the trial's trace.
        arl_runtime::telemetry::inject_http(request.headers_mut());
        let response = self
            .client
            .http
            .request(request)
            .await
            .map_err(|e| self.error(operation, e.to_string()))?;
        let status = response.status();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| self.error(operation, e.to_string()))?
            .to_bytes();
        if status == hyper::StatusCode::GONE {
            return Err(SandboxError::Ended {
                operation,
                lease: self.grant.lease_id.to_string(),
                reason: String::from_utf8_lossy(&body).into_owned(),
            });
        }
        if !status.is_success() {
            return Err(self.error(
                operation,
                format!("HTTP {status}: {}", String::from_utf8_lossy(&body)),
            ));
        }
        Ok(body)
    }

    fn error(&self, operation: &'static str, reason: String) -> SandboxError {
        SandboxError::Api {
            operation,
            lease: self.grant.lease_id.to_string(),
            reason,
        }
    }
}

/// Percent-encodes a query value (RFC 3986 unreserved characters and `/` stay).
fn encode_query(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for byte in value.bytes() {
        if byte.is_ascii_alphanumeric() || b"-._~/".contains(&byte) {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_values_are_percent_encoded() {
        assert_eq!(encode_query(".arl-eval/a b&c.py"), ".arl-eval/a%20b%26c.py");
        assert_eq!(encode_query("é"), "%C3%A9");
    }
}
