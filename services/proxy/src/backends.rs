//! The engines behind the proxy: least-loaded routing with per-trial affinity (so an
//! engine's prefix cache keeps serving the trial), health checks, and the dialect each
//! speaks for token ids and logprobs.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arl_runtime::Shutdown;
use arl_schemas::RunId;
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
    /// The policy the backend serves: from its `/v1/models` (ARL's engine), or as ARL
    /// loaded it (a followed vLLM or SGLang, [`crate::follow`]).
    served: Mutex<Served>,
    /// Whether ARL loads each new policy version into it and so knows what it serves.
    pub followed: bool,
    /// Weight updates begun plus ended (odd while one is under way): a call that saw the
    /// same even count when sent and when answered was served by one known policy.
    updates: AtomicU64,
}

/// The policy a backend says it serves. A policy is (run, version): two runs' version 3
/// are different weights.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Served {
    /// It does not say (vLLM and SGLang): it serves whatever the deployment put there.
    #[default]
    Unknown,
    /// The model it was started with (`policy_version` 0, no run).
    Base,
    /// A run's trained version.
    Run { run: RunId, version: u64 },
    /// Not known yet, or lost (a followed engine before ARL has read its weight version,
    /// or after a weight update failed half-way): nothing is routed to it.
    Pending,
}

impl Served {
    /// How a `weight_version` of an engine ARL loads reads: `arl:<run>:<version>` as
    /// [`Served::weight_version`] wrote it; anything else (vLLM and SGLang start at
    /// `"default"`) is the model the engine was started with.
    pub fn from_weight_version(text: &str) -> Self {
        text.strip_prefix("arl:")
            .and_then(|rest| rest.rsplit_once(':'))
            .and_then(|(run, version)| {
                Some(Served::Run {
                    run: RunId::new(run).ok()?,
                    version: version.parse().ok()?,
                })
            })
            .unwrap_or(Served::Base)
    }

    /// The `weight_version` ARL gives an engine it loaded `run`'s `version` into.
    pub fn weight_version(run: &RunId, version: u64) -> String {
        format!("arl:{run}:{version}")
    }
}

impl Backend {
    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::SeqCst)
    }

    /// Whether the backend can serve a trial of `run` issued at `version`: it serves that
    /// run's version or a newer one of the same run, or the base model to a trial of
    /// version 0 (or does not say).
    pub fn serves(&self, run: &RunId, version: u64) -> bool {
        match &*self.served.lock().unwrap_or_else(|e| e.into_inner()) {
            Served::Unknown => true,
            Served::Pending => false,
            Served::Base => version == 0,
            Served::Run {
                run: served_run,
                version: served,
            } => served_run == run && *served >= version,
        }
    }

    pub fn served(&self) -> Served {
        self.served
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub fn set_served(&self, served: Served) {
        *self.served.lock().unwrap_or_else(|e| e.into_inner()) = served;
    }

    /// Marks a weight update begun: calls in flight now can no longer be attested.
    pub fn begin_update(&self) {
        self.updates.fetch_add(1, Ordering::SeqCst);
    }

    /// Marks the update ended, with what the engine serves now.
    pub fn end_update(&self, served: Served) {
        self.set_served(served);
        self.updates.fetch_add(1, Ordering::SeqCst);
    }

    /// Taken when a call is sent to a followed backend; [`Self::attest`] at its end.
    pub fn update_count(&self) -> u64 {
        self.updates.load(Ordering::SeqCst)
    }

    /// The policy that served a call sent when [`Self::update_count`] was `sent_at`: known
    /// only for a followed backend with no weight update begun or under way since (a
    /// call overlapping an update may have been served by either version, or both).
    pub fn attest(&self, sent_at: u64) -> Option<Served> {
        let unchanged = sent_at.is_multiple_of(2) && self.update_count() == sent_at;
        match self.served() {
            Served::Base | Served::Run { .. } if self.followed && unchanged => Some(self.served()),
            _ => None,
        }
    }
}

/// A `--backend` that cannot be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BackendSpecError {
    #[error("backend dialect {0:?} is unknown; use arl=URL, vllm=URL or sglang=URL")]
    UnknownDialect(String),
    #[error("backend URL {0:?} must start with http://")]
    NotHttp(String),
}

/// Parses `dialect=url` (dialect `arl`, `vllm` or `sglang`; a bare URL means `arl`).
pub fn parse_backend(spec: &str) -> Result<(Dialect, String), BackendSpecError> {
    let (dialect, url) = match spec.split_once('=') {
        Some(("arl", url)) => (Dialect::Arl, url),
        Some(("vllm", url)) => (Dialect::Vllm, url),
        Some(("sglang", url)) => (Dialect::Sglang, url),
        Some((other, _)) => return Err(BackendSpecError::UnknownDialect(other.to_owned())),
        None => (Dialect::Arl, spec),
    };
    if !url.starts_with("http://") {
        return Err(BackendSpecError::NotHttp(url.to_owned()));
    }
    Ok((
        dialect,
        url.trim_end_matches('/').trim_end_matches("/v1").to_owned(),
    ))
}

/// The policy of the first model in a `/v1/models` answer: its `run_id` and
/// `policy_version` (ARL's engine names both; version 0 without a run is the base model).
fn served_policy(body: &[u8]) -> Served {
    let Ok(answer) = serde_json::from_slice::<Value>(body) else {
        return Served::Unknown;
    };
    let model = &answer["data"][0];
    let run = model["run_id"].as_str().and_then(|r| RunId::new(r).ok());
    match (model["policy_version"].as_u64(), run) {
        (Some(version), Some(run)) => Served::Run { run, version },
        (Some(0), None) => Served::Base,
        _ => Served::Unknown,
    }
}

#[derive(Debug)]
pub struct Backends {
    pub list: Vec<Arc<Backend>>,
}

impl Backends {
    pub fn new(specs: Vec<(Dialect, String)>) -> Self {
        Self::with_following(specs, false)
    }

    /// Backends of which ARL loads every policy version into the vLLM and SGLang ones
    /// when `follow` (`--follow-weights`): those serve nothing until ARL has read what
    /// they serve ([`Served::Pending`]).
    pub fn with_following(specs: Vec<(Dialect, String)>, follow: bool) -> Self {
        Self {
            list: specs
                .into_iter()
                .map(|(dialect, url)| {
                    let followed = follow && dialect != Dialect::Arl;
                    Arc::new(Backend {
                        url,
                        dialect,
                        in_flight: AtomicUsize::new(0),
                        // Healthy once a health check has answered (the first runs at
                        // start); until then a backend is still tried, last.
                        healthy: AtomicBool::new(false),
                        served: Mutex::new(if followed {
                            Served::Pending
                        } else {
                            Served::Unknown
                        }),
                        followed,
                        updates: AtomicU64::new(0),
                    })
                })
                .collect(),
        }
    }

    /// Backends to try for a trial, in order: `sticky`, the one it used before (if
    /// healthy), then the healthy ones least loaded first, then the unhealthy ones as a
    /// last resort. The trial's key holds `sticky` (`keys::Trial::backend`), so it goes
    /// with the key when the trial ends.
    pub fn candidates(&self, sticky: Option<usize>) -> Vec<usize> {
        let sticky = sticky.filter(|&i| self.list.get(i).is_some_and(|b| b.is_healthy()));
        let mut order: Vec<usize> = (0..self.list.len())
            .filter(|&i| Some(i) != sticky)
            .collect();
        order.sort_by_key(|&i| {
            let b = &self.list[i];
            (!b.is_healthy(), b.in_flight.load(Ordering::SeqCst))
        });
        sticky.into_iter().chain(order).collect()
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
                    // A followed engine does not say what it serves: ARL knows.
                    if let Ok(Ok((200, body))) = &answer
                        && !b.followed
                    {
                        b.set_served(served_policy(body));
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
    fn backends_serve_trials_of_their_run_and_version_or_older() {
        let b = Backends::new(vec![(Dialect::Arl, "http://a".into())]);
        let a = &b.list[0];
        let (run, other) = (RunId::new("run-a").unwrap(), RunId::new("run-b").unwrap());
        assert!(
            a.serves(&run, 7),
            "a backend that does not say serves every version"
        );
        a.set_served(served_policy(
            br#"{"object":"list","data":[{"id":"policy","policy_version":0,"run_id":null}]}"#,
        ));
        assert_eq!(a.served(), Served::Base);
        assert!(a.serves(&run, 0) && a.serves(&other, 0) && !a.serves(&run, 1));
        a.set_served(served_policy(
            br#"{"object":"list","data":[{"id":"policy","policy_version":2,"run_id":"run-a"}]}"#,
        ));
        assert!(a.serves(&run, 2) && a.serves(&run, 1));
        assert!(
            !a.serves(&run, 3),
            "a trial of version 3 waits until the engine has loaded it"
        );
        assert!(
            !a.serves(&other, 0) && !a.serves(&other, 2),
            "another run's weights are another policy"
        );
        assert_eq!(served_policy(br#"{"data":[]}"#), Served::Unknown);
        assert_eq!(
            served_policy(br#"{"data":[{"policy_version":2}]}"#),
            Served::Unknown,
            "a trained version that names no run identifies no policy"
        );
    }

    use super::*;

    #[test]
    fn a_followed_backend_serves_what_arl_loaded_and_attests_only_calls_clear_of_updates() {
        let b = Backends::with_following(
            vec![
                (Dialect::Vllm, "http://v".into()),
                (Dialect::Arl, "http://a".into()),
            ],
            true,
        );
        let (vllm, arl) = (&b.list[0], &b.list[1]);
        assert!(
            vllm.followed && !arl.followed,
            "ARL's engine reports its own"
        );
        let run = RunId::new("run-a").unwrap();
        assert!(
            !vllm.serves(&run, 0),
            "nothing until its weight version is read"
        );
        assert_eq!(vllm.attest(vllm.update_count()), None);

        vllm.set_served(Served::from_weight_version("default"));
        assert!(vllm.serves(&run, 0) && !vllm.serves(&run, 1));
        let before = vllm.update_count();
        assert_eq!(vllm.attest(before), Some(Served::Base));

        // A call sent before an update and answered after it: either version.
        vllm.begin_update();
        let during = vllm.update_count();
        assert_eq!(vllm.attest(before), None);
        assert_eq!(
            vllm.attest(during),
            None,
            "sent while the update was under way"
        );
        let version = Served::weight_version(&run, 1);
        assert_eq!(version, "arl:run-a:1");
        vllm.end_update(Served::from_weight_version(&version));
        let after = vllm.update_count();
        assert_eq!(
            vllm.attest(after),
            Some(Served::Run {
                run: run.clone(),
                version: 1
            })
        );
        assert!(vllm.serves(&run, 1) && !vllm.serves(&RunId::new("run-b").unwrap(), 0));
        assert_eq!(vllm.attest(before), None);
        assert_eq!(
            arl.attest(arl.update_count()),
            None,
            "not followed: it says itself"
        );
        assert_eq!(Served::from_weight_version("arl:x"), Served::Base);
        assert_eq!(Served::from_weight_version("arl:run-a:v2"), Served::Base);
    }

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
        assert_eq!(backends.candidates(None), vec![2, 1, 0]);
        assert_eq!(backends.candidates(Some(0)), vec![0, 2, 1]);
        backends.mark_down(0);
        assert_eq!(backends.candidates(Some(0)), vec![2, 1, 0]);
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
                .to_string()
                .contains("unknown")
        );
        assert_eq!(
            parse_backend("arl=h:1"),
            Err(BackendSpecError::NotHttp("h:1".into()))
        );
        assert!(
            BackendSpecError::NotHttp("h:1".into())
                .to_string()
                .contains("http://")
        );
    }
}
