//! The engines behind the proxy: least-loaded routing with per-trial affinity (so an
//! engine's prefix cache keeps serving the trial), health checks, and the dialect each
//! speaks for token ids and logprobs.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use arl_runtime::Shutdown;
use arl_schemas::TrialId;
use serde_json::{Value, json};

use crate::client::HttpClient;

/// How a backend is asked for token ids and logprobs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dialect {
    /// ARL's embedded engine: ids are always returned; logprobs on request.
    Arl,
    /// vLLM's OpenAI server: `return_token_ids` plus logprobs.
    Vllm,
    /// SGLang's OpenAI server: chat asks for `return_input_ids` / `return_output_ids`
    /// (the ids come back once per response in `sglext`, streaming or not); text
    /// completions ask for `return_token_ids` (per-choice `prompt_token_ids` and
    /// `token_ids`).
    Sglang,
}

impl Dialect {
    /// Adds what the backend needs to return ids and logprobs.
    pub fn decorate(self, body: &mut serde_json::Map<String, Value>, chat: bool) {
        if chat {
            body.insert("logprobs".into(), json!(true));
        } else if !body.get("logprobs").is_some_and(Value::is_u64) {
            body.insert("logprobs".into(), json!(0));
        }
        match self {
            Dialect::Arl => {}
            Dialect::Vllm => {
                body.insert("return_token_ids".into(), json!(true));
            }
            Dialect::Sglang if chat => {
                body.insert("return_input_ids".into(), json!(true));
                body.insert("return_output_ids".into(), json!(true));
            }
            Dialect::Sglang => {
                body.insert("return_token_ids".into(), json!(true));
            }
        }
    }
}

#[derive(Debug)]
pub struct Backend {
    /// Base URL, without `/v1`.
    pub url: String,
    pub dialect: Dialect,
    pub in_flight: AtomicUsize,
    healthy: AtomicBool,
    /// The policy version the backend serves, from its `/v1/models` (ARL's engine says;
    /// vLLM and SGLang do not: `UNKNOWN_VERSION`).
    served_version: AtomicU64,
}

/// A backend that does not report which policy version it serves.
pub const UNKNOWN_VERSION: u64 = u64::MAX;

impl Backend {
    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::SeqCst)
    }

    /// Whether the backend can serve a trial issued at `version`: it serves that
    /// version or a newer one (or does not say).
    pub fn serves(&self, version: u64) -> bool {
        let served = self.served_version.load(Ordering::SeqCst);
        served == UNKNOWN_VERSION || served >= version
    }

    pub fn set_served_version(&self, version: u64) {
        self.served_version.store(version, Ordering::SeqCst);
    }
}

/// Parses `dialect=url` (dialect `arl`, `vllm` or `sglang`; a bare URL means `arl`).
pub fn parse_backend(spec: &str) -> Result<(Dialect, String), String> {
    let (dialect, url) = match spec.split_once('=') {
        Some(("arl", url)) => (Dialect::Arl, url),
        Some(("vllm", url)) => (Dialect::Vllm, url),
        Some(("sglang", url)) => (Dialect::Sglang, url),
        Some((other, _)) => {
            return Err(format!(
                "backend dialect {other:?} is unknown; use arl=URL, vllm=URL or sglang=URL"
            ));
        }
        None => (Dialect::Arl, spec),
    };
    if !url.starts_with("http://") {
        return Err(format!("backend URL {url:?} must start with http://"));
    }
    Ok((
        dialect,
        url.trim_end_matches('/').trim_end_matches("/v1").to_owned(),
    ))
}

/// The `policy_version` of the first model in a `/v1/models` answer, if it names one.
fn served_version(body: &[u8]) -> u64 {
    serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| v["data"][0]["policy_version"].as_u64())
        .unwrap_or(UNKNOWN_VERSION)
}

#[derive(Debug)]
pub struct Backends {
    pub list: Vec<Arc<Backend>>,
    affinity: Mutex<HashMap<TrialId, usize>>,
}

impl Backends {
    pub fn new(specs: Vec<(Dialect, String)>) -> Self {
        Self {
            list: specs
                .into_iter()
                .map(|(dialect, url)| {
                    Arc::new(Backend {
                        url,
                        dialect,
                        in_flight: AtomicUsize::new(0),
                        // Healthy once a health check has answered (the first runs at
                        // start); until then a backend is still tried, last.
                        healthy: AtomicBool::new(false),
                        served_version: AtomicU64::new(UNKNOWN_VERSION),
                    })
                })
                .collect(),
            affinity: Mutex::default(),
        }
    }

    /// Backends to try for a trial, in order: the one it used before (if healthy), then
    /// the healthy ones least loaded first, then the unhealthy ones as a last resort.
    pub fn candidates(&self, trial: &TrialId) -> Vec<usize> {
        let sticky = self
            .affinity
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(trial)
            .copied()
            .filter(|&i| self.list.get(i).is_some_and(|b| b.is_healthy()));
        let mut order: Vec<usize> = (0..self.list.len())
            .filter(|&i| Some(i) != sticky)
            .collect();
        order.sort_by_key(|&i| {
            let b = &self.list[i];
            (!b.is_healthy(), b.in_flight.load(Ordering::SeqCst))
        });
        sticky.into_iter().chain(order).collect()
    }

    pub fn remember(&self, trial: &TrialId, backend: usize) {
        self.affinity
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(trial.clone(), backend);
    }

    pub fn forget(&self, trial: &TrialId) {
        self.affinity
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(trial);
    }

    /// Marks a backend down after a refused connection (the health check brings it back).
    /// Whether any backend answered its last health check (the proxy's readiness).
    pub fn any_healthy(&self) -> bool {
        self.list.iter().any(|b| b.is_healthy())
    }

    pub fn mark_down(&self, backend: usize) {
        if let Some(b) = self.list.get(backend) {
            b.healthy.store(false, Ordering::SeqCst);
        }
    }

    /// Polls every backend's `/v1/models` every `period`.
    pub fn watch_health(
        self: &Arc<Self>,
        client: HttpClient,
        period: Duration,
        shutdown: &Shutdown,
    ) {
        let backends = self.clone();
        let stop = shutdown.clone();
        shutdown.spawn(async move {
            loop {
                for b in &backends.list {
                    let url = format!("{}/v1/models", b.url);
                    let answer = tokio::time::timeout(period, client.get(&url)).await;
                    let ok = matches!(&answer, Ok(Ok((status, _))) if *status == 200);
                    if let Ok(Ok((200, body))) = &answer {
                        b.set_served_version(served_version(body));
                    }
                    if ok != b.is_healthy() {
                        tracing::info!(backend = %b.url, healthy = ok, "backend health changed");
                    }
                    b.healthy.store(ok, Ordering::SeqCst);
                }
                tokio::select! {
                    () = stop.triggered() => return,
                    () = tokio::time::sleep(period) => {}
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn backends_serve_trials_of_their_version_or_older() {
        let b = Backends::new(vec![(Dialect::Arl, "http://a".into())]);
        let a = &b.list[0];
        assert!(
            a.serves(7),
            "a backend that does not say serves every version"
        );
        a.set_served_version(served_version(
            br#"{"object":"list","data":[{"id":"policy","policy_version":2}]}"#,
        ));
        assert!(a.serves(2) && a.serves(1));
        assert!(
            !a.serves(3),
            "a trial of version 3 waits until the engine has loaded it"
        );
        assert_eq!(served_version(br#"{"data":[]}"#), UNKNOWN_VERSION);
    }

    use super::*;

    #[test]
    fn routing_prefers_the_trials_backend_then_the_least_loaded() {
        let backends = Backends::new(vec![
            (Dialect::Arl, "http://a".into()),
            (Dialect::Arl, "http://b".into()),
            (Dialect::Arl, "http://c".into()),
        ]);
        // Not ready until a health check has answered; then all three are healthy.
        assert!(!backends.any_healthy());
        backends
            .list
            .iter()
            .for_each(|b| b.healthy.store(true, Ordering::SeqCst));
        assert!(backends.any_healthy());
        backends.list[0].in_flight.store(5, Ordering::SeqCst);
        backends.list[1].in_flight.store(1, Ordering::SeqCst);
        let trial = TrialId::new("trial-1").unwrap();
        assert_eq!(backends.candidates(&trial), vec![2, 1, 0]);
        backends.remember(&trial, 0);
        assert_eq!(backends.candidates(&trial), vec![0, 2, 1]);
        backends.mark_down(0);
        assert_eq!(backends.candidates(&trial), vec![2, 1, 0]);
    }

    #[test]
    fn backend_specs_parse_with_clear_errors() {
        assert_eq!(
            parse_backend("vllm=http://h:8000/v1").unwrap(),
            (Dialect::Vllm, "http://h:8000".into())
        );
        assert_eq!(parse_backend("http://h").unwrap().0, Dialect::Arl);
        assert!(
            parse_backend("tgi=http://h")
                .unwrap_err()
                .contains("unknown")
        );
        assert!(parse_backend("arl=h:1").unwrap_err().contains("http://"));
    }
}
