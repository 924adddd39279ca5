//! The fast stand-in engine behind the proxy: an OpenAI-compatible `/v1/chat/completions`
//! that answers at once with token ids and logprobs (ARL's dialect), so that the time
//! measured is the orchestration's, not a model's (engines are measured by
//! `arl-bench-inference`).
//!
//! It names no policy in `/v1/models` (the proxy then treats it as a backend that serves
//! every version) and answers each call as the policy the proxy says the trial was issued
//! for (its `arl-policy` header: `run_id` and `policy_version`), as an engine that always
//! has the trial's weights would. So no trial waits on an engine that "still serves" an
//! old version, every call has a known serving version (and is trained on), and the
//! trainer's real pace still gates the rollout through `max_staleness`.
//!
//! A sandboxed (Harbor) trial's agent is `swe-text`: its first turn gets one shell command
//! (`touch done`, which the task's verifier checks) and its next one `submit` — or, every
//! other trial, `submit` at once (reward 0).
//!
//! Every other math answer is wrong (`#### 5` instead of `#### 4`), so that a group has mixed
//! rewards and the trainer's steps have something to train on.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use arl_runtime::Shutdown;
use serde_json::json;

fn answer(content: &str) -> serde_json::Value {
    json!({"prompt_token_ids": [1, 2, 3], "model": "stand-in",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                     "token_ids": [7, 8],
                     "logprobs": {"content": [{"logprob": -0.1}, {"logprob": -0.2}]},
                     "finish_reason": "stop"}]})
}

/// `answer` as served by the policy of the `arl-policy` header (`<run_id>:<version>`).
fn as_policy(mut answer: serde_json::Value, headers: &axum::http::HeaderMap) -> String {
    let policy = headers
        .get("arl-policy")
        .and_then(|v| v.to_str().ok())
        .and_then(|p| p.rsplit_once(':'))
        .and_then(|(run, version)| Some((run.to_owned(), version.parse::<u64>().ok()?)));
    if let Some((run, version)) = policy {
        answer["run_id"] = json!(run);
        answer["policy_version"] = json!(version);
    }
    answer.to_string()
}

/// Which answer a request gets: a shell agent's (its prompt names `submit`) first turn the
/// command or `submit`, its later turns `submit`; a math question alternately right and
/// wrong.
fn pick(request: &[u8], n: u64) -> usize {
    let body: serde_json::Value = serde_json::from_slice(request).unwrap_or_default();
    let messages = body["messages"].as_array().cloned().unwrap_or_default();
    let shell = messages
        .iter()
        .any(|m| m["content"].as_str().is_some_and(|c| c.contains("submit")));
    let answered = messages.iter().any(|m| m["role"] == "assistant");
    match (shell, answered) {
        // Every other shell trial submits at once, leaving no `done`: reward 0.
        (true, false) if n.is_multiple_of(2) => 2,
        (true, _) => 3,
        _ => (n % 2) as usize,
    }
}

/// Serves the stand-in on a free loopback port until `shutdown`; returns its address.
/// Each answer is held `delay_ms` (read per call; 0 answers at once): a long agent turn,
/// which keeps trials in flight without spending CPU.
pub async fn serve(
    shutdown: &Shutdown,
    delay_ms: Arc<AtomicU64>,
) -> anyhow::Result<std::net::SocketAddr> {
    let answers = Arc::new([
        answer("2 + 2 = 4\n#### 4"),
        answer("2 + 2 = 5\n#### 5"),
        answer("```bash\ntouch done\n```"),
        answer("```\nsubmit\n```"),
    ]);
    let calls = Arc::new(AtomicU64::new(0));
    let router = axum::Router::new()
        .route(
            "/v1/chat/completions",
            axum::routing::post(
                move |headers: axum::http::HeaderMap, request: axum::body::Bytes| {
                    let (answers, calls) = (answers.clone(), calls.clone());
                    let delay = Duration::from_millis(delay_ms.load(Ordering::Relaxed));
                    async move {
                        if !delay.is_zero() {
                            tokio::time::sleep(delay).await;
                        }
                        let n = calls.fetch_add(1, Ordering::Relaxed);
                        let body = as_policy(answers[pick(&request, n)].clone(), &headers);
                        ([("content-type", "application/json")], body)
                    }
                },
            ),
        )
        .route(
            "/v1/models",
            axum::routing::get(|| async {
                axum::Json(json!({"object": "list", "data": [{"id": "stand-in"}]}))
            }),
        );
    Ok(arl_runtime::http::serve("127.0.0.1:0".parse()?, router, shutdown).await?)
}
