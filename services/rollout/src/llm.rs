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

    /// A sandbox call that failed: the agent's fault when the service ended the lease for
    /// what the agent did in it (filling its disk), the infrastructure's otherwise.
    pub fn from_sandbox(error: arl_sandbox_client::SandboxError) -> Self {
        let class = match error {
            arl_sandbox_client::SandboxError::Ended { .. } => FailureClass::AgentError,
            _ => FailureClass::Infrastructure,
        };
        Self::new(class, error.to_string())
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
    /// `POST {base_url}/chat/completions`; waits out 429s for capacity, and 503s while no
    /// engine is up (still loading, restarting), until `deadline`.
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
        let mut no_engine_since: Option<Instant> = None;
        let mut backoff = Backoff::new();
        loop {
            let mut request = hyper::Request::post(format!("{base_url}/chat/completions"))
                .header(hyper::header::CONTENT_TYPE, "application/json")
                .body(Full::new(body.clone()))
                .map_err(|e| infrastructure(format!("building the LLM request: {e}")))?;
            // The call belongs to the trial's trace (the proxy and the engine continue it).
            arl_runtime::telemetry::inject_http(request.headers_mut());
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
            // The class is decided by the error's code (the proxy gives vLLM's
            // context errors OpenAI's code), never by the message's wording.
            let code = value["error"]["code"].as_str();
            match status.as_u16() {
                400 if code == Some("context_length_exceeded") => {
                    return Err(TrialError::new(FailureClass::ContextOverflow, message));
                }
                // Over the run's capacity, or the policy is loading: wait. Too stale: a
                // fresh attempt gets a newer policy version.
                429 if code != Some("policy_too_stale") => {
                    let wait = Duration::from_secs(retry_after.unwrap_or(1).clamp(1, 30));
                    if Instant::now() + wait >= deadline {
                        return Err(TrialError::new(
                            FailureClass::Timeout,
                            format!("the budget ran out while the proxy asked to wait: {message}"),
                        ));
                    }
                    tokio::time::sleep(wait).await;
                }
                // No engine is up yet (loading its weights) or right now: nothing was
                // generated, so wait for one rather than fail the trial.
                503 if value["error"]["code"] == "no_backend" => {
                    let since = *no_engine_since.get_or_insert_with(Instant::now);
                    let wait = backoff.next_wait();
                    if Instant::now() + wait >= deadline {
                        return Err(infrastructure(format!(
                            "no inference engine answered for {:.0} s: {message}",
                            since.elapsed().as_secs_f64()
                        )));
                    }
                    tracing::info!(
                        wait_ms = wait.as_millis() as u64,
                        "no engine up yet; waiting"
                    );
                    tokio::time::sleep(wait).await;
                }
                // The conversation outgrew what one `llm.call` record may hold: the
                // agent's context, like a prompt past the model's window.
                413 => return Err(TrialError::new(FailureClass::ContextOverflow, message)),
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

/// Exponential back-off with jitter: 0.5 s doubling to 30 s, each wait drawn from
/// [½, 1] of its step so that many waiting trials do not retry in lock-step.
pub struct Backoff {
    step: Duration,
}

impl Backoff {
    pub const FIRST: Duration = Duration::from_millis(500);
    pub const MAX: Duration = Duration::from_secs(30);

    pub fn new() -> Self {
        Self { step: Self::FIRST }
    }

    /// The wait before attempt `attempt` (0 = none) of a retried trial.
    pub fn before_attempt(attempt: u32) -> Duration {
        if attempt == 0 {
            return Duration::ZERO;
        }
        let step = Self::FIRST
            .saturating_mul(1u32 << (attempt - 1).min(16))
            .min(Self::MAX);
        jitter(step)
    }

    pub fn next_wait(&mut self) -> Duration {
        let wait = jitter(self.step);
        self.step = (self.step * 2).min(Self::MAX);
        wait
    }
}

impl Default for Backoff {
    fn default() -> Self {
        Self::new()
    }
}

/// A duration drawn uniformly from [step/2, step].
fn jitter(step: Duration) -> Duration {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    // The clock's sub-second digits are spread enough for spreading retries.
    let fraction = f64::from(nanos % 1_000_000) / 1_000_000.0;
    step.mul_f64(0.5 + 0.5 * fraction)
}

fn infrastructure(message: String) -> TrialError {
    TrialError::new(FailureClass::Infrastructure, message)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_ended_for_its_disk_is_the_agents_fault_other_sandbox_trouble_is_not() {
        let ended = arl_sandbox_client::SandboxError::Ended {
            operation: "exec",
            lease: "lease-1".into(),
            reason: "lease lease-1 was ended: its work tree grew by 40 MB".into(),
        };
        let ended = TrialError::from_sandbox(ended);
        assert_eq!(ended.class, FailureClass::AgentError);
        assert!(ended.message.contains("grew by 40 MB"), "{ended:?}");
        let api = arl_sandbox_client::SandboxError::Api {
            operation: "exec",
            lease: "lease-1".into(),
            reason: "HTTP 500".into(),
        };
        assert_eq!(
            TrialError::from_sandbox(api).class,
            FailureClass::Infrastructure
        );
    }

    #[test]
    fn retries_back_off_exponentially_with_jitter_up_to_a_bound() {
        assert_eq!(Backoff::before_attempt(0), Duration::ZERO);
        for attempt in 1..=12u32 {
            let step = Backoff::FIRST
                .saturating_mul(1 << (attempt - 1))
                .min(Backoff::MAX);
            let wait = Backoff::before_attempt(attempt);
            assert!(
                wait >= step / 2 && wait <= step,
                "attempt {attempt}: {wait:?}"
            );
        }
        let mut backoff = Backoff::new();
        let waits: Vec<Duration> = (0..10).map(|_| backoff.next_wait()).collect();
        assert!(waits[0] <= Duration::from_millis(500));
        assert!(waits.iter().all(|w| *w <= Backoff::MAX));
        assert!(waits[9] >= Backoff::MAX / 2, "{waits:?}");
    }
}
