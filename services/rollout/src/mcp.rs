//! A Model Context Protocol client over the streamable HTTP transport: what the `mcp-tools`
//! agent discovers and calls tools with. It speaks revision 2025-06-18 (and whatever the
//! server counter-offers among those it knows), reads answers sent as JSON or as an event
//! stream, and ends its session with DELETE. Plain `http://` only: the agent's servers are
//! the proxy and servers beside the deployment.

use std::time::Duration;

use arl_schemas::events::FailureClass;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};
use tracing::Instrument;

use crate::llm::TrialError;

const PROTOCOL_VERSION: &str = "2025-06-18";
const KNOWN_VERSIONS: [&str; 3] = ["2025-03-26", "2025-06-18", "2025-11-25"];
/// A call that takes longer than this is abandoned (the server's own tool limits are
/// shorter; this guards against a server that never answers).
const CALL_TIMEOUT: Duration = Duration::from_secs(300);

/// A tool a server offers.
#[derive(Clone, Debug, PartialEq)]
pub struct McpTool {
    pub name: String,
    pub description: String,
    pub input_schema: Value,
}

/// What a tool call returned: its text content, and whether the tool said it failed.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolOutput {
    pub text: String,
    pub is_error: bool,
}

/// One session with one MCP server.
pub struct McpSession {
    http: Client<HttpConnector, Full<Bytes>>,
    url: String,
    session: Option<String>,
    version: String,
    next_id: u64,
}

impl McpSession {
    /// `initialize`, then `notifications/initialized`.
    pub async fn open(url: &str) -> Result<Self, TrialError> {
        let mut session = Self {
            http: Client::builder(TokioExecutor::new()).build(HttpConnector::new()),
            url: url.to_owned(),
            session: None,
            version: PROTOCOL_VERSION.to_owned(),
            next_id: 0,
        };
        let result = session
            .request(
                "initialize",
                json!({
                    "protocolVersion": PROTOCOL_VERSION,
                    "capabilities": {},
                    "clientInfo": {"name": "arl-rollout", "version": env!("CARGO_PKG_VERSION")},
                }),
            )
            .await?;
        let offered = result["protocolVersion"].as_str().unwrap_or_default();
        if !KNOWN_VERSIONS.contains(&offered) {
            return Err(infrastructure(format!(
                "MCP server {url} speaks protocol {offered:?}; this client knows {}",
                KNOWN_VERSIONS.join(", ")
            )));
        }
        session.version = offered.to_owned();
        session
            .post(&json!({"jsonrpc": "2.0", "method": "notifications/initialized"}))
            .await?;
        Ok(session)
    }

    /// Every tool of the server (following `nextCursor`).
    pub async fn list_tools(&mut self) -> Result<Vec<McpTool>, TrialError> {
        let mut tools = Vec::new();
        let mut cursor: Option<String> = None;
        loop {
            let params = match &cursor {
                Some(c) => json!({"cursor": c}),
                None => json!({}),
            };
            let result = self.request("tools/list", params).await?;
            for tool in result["tools"].as_array().into_iter().flatten() {
                let Some(name) = tool["name"].as_str() else {
                    continue;
                };
                tools.push(McpTool {
                    name: name.to_owned(),
                    description: tool["description"].as_str().unwrap_or_default().to_owned(),
                    input_schema: tool["inputSchema"].clone(),
                });
            }
            cursor = result["nextCursor"].as_str().map(str::to_owned);
            if cursor.is_none() {
                return Ok(tools);
            }
        }
    }

    /// `tools/call`. A tool's own failure is an output with `is_error`; a protocol error
    /// (an unknown tool) is one too, for the model to read; only a server that cannot be
    /// reached is the infrastructure's.
    pub async fn call_tool(
        &mut self,
        name: &str,
        arguments: &Value,
    ) -> Result<ToolOutput, TrialError> {
        let span = tracing::info_span!(
            "mcp_call",
            otel.name = "mcp tool call",
            otel.kind = "client",
            openinference.span.kind = "TOOL",
            tool = name,
        );
        let answer = self
            .exchange("tools/call", json!({"name": name, "arguments": arguments}))
            .instrument(span)
            .await?;
        if let Some(error) = answer.get("error") {
            return Ok(ToolOutput {
                text: format!(
                    "tool error: {}",
                    error["message"].as_str().unwrap_or("(no message)")
                ),
                is_error: true,
            });
        }
        let result = &answer["result"];
        let text = result["content"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|part| match part["type"].as_str() {
                Some("text") => part["text"].as_str().map(str::to_owned),
                Some(other) => Some(format!("[{other} content]")),
                None => None,
            })
            .collect::<Vec<_>>()
            .join("\n");
        Ok(ToolOutput {
            text,
            is_error: result["isError"].as_bool().unwrap_or(false),
        })
    }

    /// Ends the session (DELETE); a server that does not answer is left to its TTL.
    pub async fn close(self) {
        let Some(session) = &self.session else {
            return;
        };
        let request = hyper::Request::delete(&self.url)
            .header("mcp-session-id", session)
            .header("mcp-protocol-version", &self.version)
            .body(Full::new(Bytes::new()));
        if let Ok(request) = request {
            let _ = tokio::time::timeout(Duration::from_secs(10), self.http.request(request)).await;
        }
    }

    async fn request(&mut self, method: &str, params: Value) -> Result<Value, TrialError> {
        let answer = self.exchange(method, params).await?;
        if let Some(error) = answer.get("error") {
            return Err(infrastructure(format!(
                "MCP server {} refused {method}: {}",
                self.url,
                error["message"].as_str().unwrap_or("(no message)")
            )));
        }
        Ok(answer["result"].clone())
    }

    /// Sends one request and returns its JSON-RPC answer (result or error).
    async fn exchange(&mut self, method: &str, params: Value) -> Result<Value, TrialError> {
        self.next_id += 1;
        let id = self.next_id;
        let body = json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params});
        let (status, content_type, bytes) = self.post(&body).await?;
        let answer = if content_type.starts_with("text/event-stream") {
            sse_answer(&bytes, id)
        } else {
            serde_json::from_slice::<Value>(&bytes).ok()
        };
        match answer {
            Some(answer) if answer.get("result").is_some() || answer.get("error").is_some() => {
                Ok(answer)
            }
            _ => Err(infrastructure(format!(
                "MCP server {} answered {method} with {status} and no JSON-RPC answer: {}",
                self.url,
                arl_runtime::text::head(&String::from_utf8_lossy(&bytes), 300)
            ))),
        }
    }

    async fn post(&mut self, message: &Value) -> Result<(u16, String, Bytes), TrialError> {
        let mut request = hyper::Request::post(&self.url)
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .header(hyper::header::ACCEPT, "application/json, text/event-stream");
        if let Some(session) = &self.session {
            request = request
                .header("mcp-session-id", session)
                .header("mcp-protocol-version", &self.version);
        }
        let mut request = request
            .body(Full::new(Bytes::from(message.to_string())))
            .map_err(|e| infrastructure(format!("building an MCP request: {e}")))?;
        arl_runtime::telemetry::inject_http(request.headers_mut());
        let response = tokio::time::timeout(CALL_TIMEOUT, self.http.request(request))
            .await
            .map_err(|_| infrastructure(format!("MCP server {} did not answer", self.url)))?
            .map_err(|e| infrastructure(format!("MCP server {}: {e}", self.url)))?;
        if let Some(session) = response
            .headers()
            .get("mcp-session-id")
            .and_then(|v| v.to_str().ok())
        {
            self.session = Some(session.to_owned());
        }
        let status = response.status().as_u16();
        let content_type = response
            .headers()
            .get(hyper::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        let bytes = response
            .into_body()
            .collect()
            .await
            .map_err(|e| infrastructure(format!("reading MCP server {}: {e}", self.url)))?
            .to_bytes();
        if status == 404 && self.session.is_some() {
            return Err(infrastructure(format!(
                "MCP server {} ended the session",
                self.url
            )));
        }
        Ok((status, content_type, bytes))
    }
}

/// The JSON-RPC answer to request `id` in an event stream (`data:` lines of each event).
fn sse_answer(bytes: &[u8], id: u64) -> Option<Value> {
    let text = String::from_utf8_lossy(bytes);
    text.replace("\r\n", "\n")
        .split("\n\n")
        .filter_map(|event| {
            let data: Vec<&str> = event
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect();
            serde_json::from_str::<Value>(&data.join("\n")).ok()
        })
        .find(|message| message["id"] == json!(id))
}

fn infrastructure(message: String) -> TrialError {
    TrialError::new(FailureClass::Infrastructure, message)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_is_found_in_an_event_stream() {
        let stream = b"event: message\r\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\"}\r\n\r\n\
            event: message\ndata: {\"jsonrpc\":\"2.0\",\"id\":3,\ndata: \"result\":{\"ok\":true}}\n\n";
        assert_eq!(
            sse_answer(stream, 3),
            Some(json!({"jsonrpc": "2.0", "id": 3, "result": {"ok": true}}))
        );
        assert_eq!(sse_answer(stream, 4), None);
    }
}
