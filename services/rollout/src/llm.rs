//! The built-in agents' OpenAI client: chat completions through the token proxy with the
//! trial's key, and the failure class of each way a call can fail.

use std::time::{Duration, Instant};

use arl_schemas::events::FailureClass;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};

/// Why a trial stopped early, with its class.
#[derive(Clone, Debug, PartialEq)]
pub struct TrialError {
    pub class: FailureClass,
    pub message: String,
}

impl TrialError {
    pub fn new(class: FailureClass, message: impl Into<String>) -> Self {
        Self {
            class,
            message: message.into(),
        }
    }
}

/// Sampling settings of every call of a trial.
#[derive(Clone, Debug)]
pub struct Sampling {
    pub temperature: f64,
    pub top_p: f64,
    pub max_tokens: u32,
}

/// One answer: the assistant message and why generation stopped.
#[derive(Clone, Debug)]
pub struct Answer {
    pub message: Value,
    pub finish_reason: String,
}

#[derive(Clone, Debug)]
pub struct LlmClient {
    http: Client<HttpConnector, Full<Bytes>>,
}

impl Default for LlmClient {
    fn default() -> Self {
        Self {
            http: Client::builder(TokioExecutor::new()).build(HttpConnector::new()),
        }
    }
}

impl LlmClient {
    /// `POST {base_url}/chat/completions`; waits out 429s for capacity until `deadline`.
    pub async fn chat(
        &self,
        base_url: &str,
        messages: &[Value],
        tools: Option<&Value>,
        sampling: &Sampling,
        deadline: Instant,
    ) -> Result<Answer, TrialError> {
        let mut body = json!({
            "model": "policy",
            "messages": messages,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_tokens": sampling.max_tokens,
        });
        if let Some(tools) = tools {
            body["tools"] = tools.clone();
        }
        let body = Bytes::from(body.to_string());
        loop {
            let request = hyper::Request::post(format!("{base_url}/chat/completions"))
                .header(hyper::header::CONTENT_TYPE, "application/json")
                .body(Full::new(body.clone()))
                .map_err(|e| infrastructure(format!("building the LLM request: {e}")))?;
            let response = self
                .http
                .request(request)
                .await
                .map_err(|e| infrastructure(format!("the token proxy did not answer: {e}")))?;
            let status = response.status();
            let retry_after = response
                .headers()
                .get(hyper::header::RETRY_AFTER)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<u64>().ok());
            let bytes = response
                .into_body()
                .collect()
                .await
                .map_err(|e| infrastructure(format!("reading the LLM answer: {e}")))?
                .to_bytes();
            let value: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
            if status.is_success() {
                let choice = &value["choices"][0];
                return Ok(Answer {
                    message: choice["message"].clone(),
                    finish_reason: choice["finish_reason"]
                        .as_str()
                        .unwrap_or("stop")
                        .to_owned(),
                });
            }
            let message = value["error"]["message"].as_str().map_or_else(
                || String::from_utf8_lossy(&bytes).into_owned(),
                str::to_owned,
            );
            match status.as_u16() {
                400 if value["error"]["code"] == "context_length_exceeded"
                    || message.contains("context") =>
                {
                    return Err(TrialError::new(FailureClass::ContextOverflow, message));
                }
                // Over the run's capacity: wait. Too stale: a fresh attempt gets a newer
                // policy version.
                429 if !message.contains("stale") => {
                    let wait = Duration::from_secs(retry_after.unwrap_or(1).clamp(1, 30));
                    if Instant::now() + wait >= deadline {
                        return Err(TrialError::new(
                            FailureClass::Timeout,
                            format!("the budget ran out while the proxy asked to wait: {message}"),
                        ));
                    }
                    tokio::time::sleep(wait).await;
                }
                400 => return Err(TrialError::new(FailureClass::AgentError, message)),
                code => {
                    return Err(infrastructure(format!(
                        "LLM call answered {code}: {message}"
                    )));
                }
            }
        }
    }
}

fn infrastructure(message: String) -> TrialError {
    TrialError::new(FailureClass::Infrastructure, message)
}
