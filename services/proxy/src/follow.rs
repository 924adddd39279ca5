//! The weight follower for external engines (`--follow-weights`): ARL's own engine loads
//! each `weights.published` itself and says in every answer which policy produced it;
//! vLLM and SGLang do neither. For them the proxy does both: when a run publishes a
//! version, it has each followed engine load the version folder through the engine's own
//! API, and only then routes that (run, policy_version) to it — and it stamps a call with
//! the version only when no weight update overlapped the call
//! ([`crate::backends::Backend::attest`]). What an engine serves is read from its weight
//! version at start (`arl:<run>:<version>`, which the follower gives it), never assumed.
//! When the run whose weights it serves ends, it gets another live run's newest version,
//! or else the model it was started with back (read at start), as ARL's engine does.
//!
//! - vLLM ≥ 0.11 started with `VLLM_SERVER_DEV_MODE=1`: `POST /pause?mode=wait` (calls in
//!   flight finish on the old weights; new ones wait), `POST /collective_rpc` with
//!   `reload_weights` from the folder, `POST /update_weight_version`, `POST /resume`;
//!   `GET /weight_info` says what it serves.
//! - SGLang: `POST /update_weights_from_disk` with `model_path` and `weight_version`
//!   (it pauses and flushes its cache itself); `GET /model_info` says what it serves.
//!
//! The folder must be readable by the engine at the path the trainer published it under
//! (one machine, or a volume mounted at the same path): the trainer's `--weights-store
//! file`. Versions in the object store are refused (dead-lettered) with that advice.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use arl_runtime::consumer::run_consumer;
use arl_runtime::{Bus, ConsumerSpec, Delivery, HandlerError, Shutdown};
use arl_schemas::events::{WEIGHTS_FILE, WeightsLocation, WeightsPublishedV2};
use arl_schemas::{Domain, RunId};
use bytes::Bytes;
use serde_json::{Value, json};

use crate::backends::{Backend, Backends, Dialect, Served};
use crate::client::HttpClient;

/// How long a followed engine may take to drain its calls in flight and reload.
const UPDATE_TIMEOUT: Duration = Duration::from_secs(600);
/// How long any other request to an engine's control API may take.
const CONTROL_TIMEOUT: Duration = Duration::from_secs(30);
/// The weight version an engine serving the model it started with reports (vLLM's and
/// SGLang's default).
const BASE_VERSION: &str = "default";
/// How often an engine whose weight version could not be read is asked again.
const LEARN_PERIOD: Duration = Duration::from_secs(2);

/// What one followed engine's weight update needs.
struct Follower {
    client: HttpClient,
    /// One update (or first read) at a time per engine, by index in [`Backends::list`].
    locks: Vec<tokio::sync::Mutex<()>>,
    backends: Arc<Backends>,
    weights_dir: PathBuf,
    /// The newest version each run still going has published, and the runs that ended:
    /// an older version arriving late, or one of an ended run, is not loaded.
    live: Mutex<LiveRuns>,
    /// The model each engine was started with (read while it served it), by index: what
    /// it goes back to when the run whose weights it serves ends and no other run has a
    /// trained version.
    base: Vec<Mutex<Option<String>>>,
}

#[derive(Debug, Default)]
struct LiveRuns {
    newest: HashMap<RunId, WeightsPublishedV2>,
    ended: HashSet<RunId>,
}

/// Starts following: reads what each followed engine serves, then loads every new
/// version (of `run`, or of every run) into each.
pub fn follow(
    bus: &Bus,
    backends: Arc<Backends>,
    client: HttpClient,
    durable: &str,
    run: Option<&RunId>,
    weights_dir: PathBuf,
    shutdown: &Shutdown,
) {
    let follower = Arc::new(Follower {
        client,
        locks: backends
            .list
            .iter()
            .map(|_| tokio::sync::Mutex::new(()))
            .collect(),
        base: backends.list.iter().map(|_| Mutex::default()).collect(),
        backends,
        weights_dir,
        live: Mutex::default(),
    });
    for index in 0..follower.backends.list.len() {
        if follower.backends.list[index].followed {
            let (follower, stop) = (follower.clone(), shutdown.clone());
            shutdown.spawn(async move {
                tokio::select! {
                    () = follower.learn(index) => {}
                    () = stop.triggered() => {}
                }
            });
        }
    }
    let ns = bus.namespace();
    let ends = ConsumerSpec::run_ends(ns, format!("{durable}-run-ends"));
    let on_end = follower.clone();
    shutdown.spawn(run_consumer(
        bus.clone(),
        ends,
        move |delivery: Delivery| {
            let follower = on_end.clone();
            async move { follower.on_run_end(&delivery).await }
        },
        shutdown.clone(),
    ));
    let filter = match run {
        Some(run) => ns.event_subject(Domain::Weights, run, "published"),
        None => ns.event_filter(Domain::Weights, "published"),
    };
    let mut spec = ConsumerSpec::new(Domain::Weights, durable, vec![filter]).ordered();
    // Draining and reloading takes a while; it is not a stuck handler.
    spec.keep_alive = true;
    shutdown.spawn(run_consumer(
        bus.clone(),
        spec,
        move |delivery: Delivery| {
            let follower = follower.clone();
            async move { follower.on_weights(&delivery).await }
        },
        shutdown.clone(),
    ));
}

impl Follower {
    /// Reads what engine `index` serves until it answers (it may still be starting).
    async fn learn(&self, index: usize) {
        let backend = &self.backends.list[index];
        loop {
            {
                let _one_at_a_time = self.locks[index].lock().await;
                if backend.served() != Served::Pending {
                    return; // an update got there first
                }
                match weight_version(&self.client, backend).await {
                    Ok((version, model_path)) => {
                        let served = Served::from_weight_version(&version);
                        tracing::info!(backend = %backend.url, weight_version = %version, ?served, ?model_path, "followed engine serves");
                        if served == Served::Base {
                            *lock(&self.base[index]) = model_path;
                        }
                        backend.set_served(served);
                        return;
                    }
                    Err(reason) => {
                        tracing::debug!(backend = %backend.url, %reason, "weight version not readable yet");
                    }
                }
            }
            tokio::time::sleep(LEARN_PERIOD).await;
        }
    }

    async fn on_weights(&self, delivery: &Delivery) -> Result<(), HandlerError> {
        let event = delivery.decode_weights_published()?;
        {
            let mut live = lock(&self.live);
            if live.ended.contains(&event.run_id) {
                return Ok(()); // a late copy of an ended run's version: nobody samples it
            }
            if live
                .newest
                .get(&event.run_id)
                .is_some_and(|seen| seen.policy_version > event.policy_version)
            {
                return Ok(()); // a late copy of a version already superseded
            }
            live.newest.insert(event.run_id.clone(), event.clone());
        }
        self.load_everywhere(&event, |_| true).await
    }

    /// Loads `event`'s version into every followed engine that `which` selects.
    async fn load_everywhere(
        &self,
        event: &WeightsPublishedV2,
        which: impl Fn(&Backend) -> bool,
    ) -> Result<(), HandlerError> {
        let event = event.clone();
        let dir = self.version_folder(&event).await?;
        let mut failures = Vec::new();
        for index in 0..self.backends.list.len() {
            if !self.backends.list[index].followed || !which(&self.backends.list[index]) {
                continue;
            }
            if let Err(reason) = self.update(index, &dir, &event).await {
                failures.push(format!("{}: {reason}", self.backends.list[index].url));
            }
        }
        if failures.is_empty() {
            Ok(())
        } else {
            Err(HandlerError::retry(format!(
                "run {} version {} not loaded into {}",
                event.run_id,
                event.policy_version,
                failures.join("; ")
            )))
        }
    }

    /// When the run whose weights an engine serves ends: the newest version of another
    /// run still going, else the model the engine started with — so that the next run's
    /// first trials (version 0) find their policy, and a run going on beside the ended
    /// one is not left waiting for a version it already published.
    async fn on_run_end(&self, delivery: &Delivery) -> Result<(), HandlerError> {
        let ended = delivery.ended_run()?;
        let next = {
            let mut live = lock(&self.live);
            live.newest.remove(&ended);
            live.ended.insert(ended.clone());
            live.newest.values().max_by_key(|w| w.at).cloned()
        };
        let serves_ended =
            |b: &Backend| matches!(b.served(), Served::Run { run, .. } if run == ended);
        if let Some(next) = next {
            return self.load_everywhere(&next, serves_ended).await;
        }
        let mut failures = Vec::new();
        for index in 0..self.backends.list.len() {
            let backend = &self.backends.list[index];
            if backend.followed
                && serves_ended(backend)
                && let Err(reason) = self.restore_base(index).await
            {
                failures.push(format!("{}: {reason}", backend.url));
            }
        }
        if failures.is_empty() {
            Ok(())
        } else {
            Err(HandlerError::retry(format!(
                "run {ended} ended; its weights are still served by {}",
                failures.join("; ")
            )))
        }
    }

    /// Loads engine `index`'s start model back (ARL's weight version `default` again).
    async fn restore_base(&self, index: usize) -> Result<(), String> {
        let backend = &self.backends.list[index];
        let Some(base) = lock(&self.base[index]).clone() else {
            backend.begin_update();
            backend.end_update(Served::Pending);
            return Err(
                "the model it started with is not known (the proxy first saw it serving a \
                 run's version), so it cannot go back to it: restart the engine"
                    .into(),
            );
        };
        let _one_at_a_time = self.locks[index].lock().await;
        backend.begin_update();
        let dir = Path::new(&base);
        let loaded = match backend.dialect {
            Dialect::Vllm => vllm_reload(&self.client, &backend.url, dir, BASE_VERSION).await,
            Dialect::Sglang => sglang_reload(&self.client, &backend.url, dir, BASE_VERSION).await,
            Dialect::Arl => Err("ARL's engine follows weights itself".to_owned()),
        };
        match loaded {
            Ok(()) => {
                tracing::info!(backend = %backend.url, %base, "followed engine serves its start model again");
                backend.end_update(Served::Base);
                Ok(())
            }
            Err(reason) => {
                backend.end_update(Served::Pending);
                Err(reason)
            }
        }
    }

    /// The version's folder, inside the weights folder, holding the published bytes.
    async fn version_folder(&self, event: &WeightsPublishedV2) -> Result<PathBuf, HandlerError> {
        let path = match &event.location {
            WeightsLocation::Folder { path } => PathBuf::from(path),
            WeightsLocation::ObjectStore { .. } => {
                return Err(HandlerError::dead_letter(format!(
                    "run {} version {} was published to the object store ({}); vLLM and \
                     SGLang load a folder they can read: run the trainer with \
                     --weights-store file on a filesystem the engines share",
                    event.run_id,
                    event.policy_version,
                    event.location.uri(&event.run_id, event.policy_version)
                )));
            }
        };
        let dir = confined(&path, &self.weights_dir).map_err(HandlerError::dead_letter)?;
        let (file, expected) = (dir.join(WEIGHTS_FILE), event.sha256.clone());
        let found = tokio::task::spawn_blocking(move || arl_runtime::digest::sha256_file(&file))
            .await
            .map_err(|e| HandlerError::retry(format!("checking the weights: {e}")))?
            .map_err(|e| HandlerError::retry(format!("{}: {e}", dir.display())))?
            .0;
        if found != expected {
            // A copy still being written: tried again.
            return Err(HandlerError::retry(format!(
                "{}: sha256 is {found}, the event says {expected} (incomplete copy?)",
                dir.join(WEIGHTS_FILE).display()
            )));
        }
        Ok(dir)
    }

    /// Loads the version into engine `index` unless it serves it (or a newer one of the
    /// run) already. Calls in flight across the update are not attested.
    async fn update(
        &self,
        index: usize,
        dir: &Path,
        event: &WeightsPublishedV2,
    ) -> Result<(), String> {
        let backend = &self.backends.list[index];
        let _one_at_a_time = self.locks[index].lock().await;
        if let Served::Run { run, version } = backend.served()
            && run == event.run_id
            && version >= event.policy_version
        {
            return Ok(());
        }
        let weight_version = Served::weight_version(&event.run_id, event.policy_version);
        backend.begin_update();
        let loaded = match backend.dialect {
            Dialect::Vllm => vllm_reload(&self.client, &backend.url, dir, &weight_version).await,
            Dialect::Sglang => {
                sglang_reload(&self.client, &backend.url, dir, &weight_version).await
            }
            Dialect::Arl => Err("ARL's engine follows weights itself".to_owned()),
        };
        if backend.dialect == Dialect::Vllm && ties_embeddings(dir) {
            tracing::warn!(
                backend = %backend.url,
                "this model ties its output layer to its embedding: vLLM's CPU build keeps a \
                 prepacked copy of a tied output layer that reload_weights does not refresh \
                 (seen with vLLM 0.32), so there the new version would answer through the old \
                 output layer; GPU builds reload it"
            );
        }
        match loaded {
            Ok(()) => {
                tracing::info!(backend = %backend.url, run = %event.run_id, policy_version = event.policy_version, "followed engine serves new weights");
                backend.end_update(Served::Run {
                    run: event.run_id.clone(),
                    version: event.policy_version,
                });
                Ok(())
            }
            Err(reason) => {
                // Half-loaded weights are no policy: nothing is routed there until a
                // retry of the update succeeds.
                backend.end_update(Served::Pending);
                Err(reason)
            }
        }
    }
}

/// vLLM: drain, reload from the folder, name the version, resume — resuming even when the
/// reload failed, so that the engine is never left paused.
async fn vllm_reload(
    client: &HttpClient,
    url: &str,
    dir: &Path,
    weight_version: &str,
) -> Result<(), String> {
    control(client, url, "/pause?mode=wait", json!({}), UPDATE_TIMEOUT)
        .await
        .map_err(|e| {
            format!("{e} (vLLM serves its weight-update API only when started with VLLM_SERVER_DEV_MODE=1)")
        })?;
    let reloaded = async {
        control(
            client,
            url,
            "/collective_rpc",
            json!({"method": "reload_weights", "kwargs": {"weights_path": dir.display().to_string()}}),
            UPDATE_TIMEOUT,
        )
        .await?;
        control(
            client,
            url,
            "/update_weight_version",
            json!({"new_version": weight_version}),
            CONTROL_TIMEOUT,
        )
        .await
    }
    .await;
    let resumed = control(client, url, "/resume", json!({}), CONTROL_TIMEOUT).await;
    reloaded?;
    resumed.map(|_| ())
}

/// SGLang: one request, which pauses, loads and flushes by itself; it answers 200 with
/// `success: false` and a message when the load failed.
async fn sglang_reload(
    client: &HttpClient,
    url: &str,
    dir: &Path,
    weight_version: &str,
) -> Result<(), String> {
    let answer = control(
        client,
        url,
        "/update_weights_from_disk",
        json!({
            "model_path": dir.display().to_string(),
            "weight_version": weight_version,
            "flush_cache": true,
            "abort_all_requests": false,
        }),
        UPDATE_TIMEOUT,
    )
    .await?;
    if answer["success"] == json!(true) {
        Ok(())
    } else {
        Err(format!(
            "/update_weights_from_disk failed: {}",
            answer["message"].as_str().unwrap_or("no message")
        ))
    }
}

/// What the engine says it serves, and the model folder it names: vLLM's `/weight_info`
/// and its `/v1/models` `root`; SGLang's `/model_info` (older builds: `/get_model_info`)
/// and its `model_path`.
async fn weight_version(
    client: &HttpClient,
    backend: &Backend,
) -> Result<(String, Option<String>), String> {
    let version = read_weight_version(client, backend).await?;
    let (path, field) = match backend.dialect {
        Dialect::Vllm => ("/v1/models", "root"),
        _ => ("/model_info", "model_path"),
    };
    let url = format!("{}{path}", backend.url);
    let model = match tokio::time::timeout(CONTROL_TIMEOUT, client.get(&url)).await {
        Ok(Ok((200, body))) => serde_json::from_slice::<Value>(&body).ok().and_then(|v| {
            let entry = if field == "root" { &v["data"][0] } else { &v };
            entry[field].as_str().map(str::to_owned)
        }),
        _ => None,
    };
    Ok((version, model))
}

/// The weight version the engine reports.
async fn read_weight_version(client: &HttpClient, backend: &Backend) -> Result<String, String> {
    let paths: &[&str] = match backend.dialect {
        Dialect::Vllm => &["/weight_info"],
        Dialect::Sglang => &["/model_info", "/get_model_info"],
        Dialect::Arl => return Err("ARL's engine says what it serves itself".into()),
    };
    let mut last = String::new();
    for path in paths {
        let url = format!("{}{path}", backend.url);
        match tokio::time::timeout(CONTROL_TIMEOUT, client.get(&url)).await {
            Ok(Ok((200, body))) => {
                let answer: Value = serde_json::from_slice(&body)
                    .map_err(|e| format!("{url} answered no JSON: {e}"))?;
                return match &answer["weight_version"] {
                    Value::String(version) => Ok(version.clone()),
                    Value::Null => Ok(String::new()),
                    other => Ok(other.to_string()),
                };
            }
            Ok(Ok((status, body))) => {
                last = format!("{url}: {status} {}", snippet(&body));
            }
            Ok(Err(e)) => last = format!("{url}: {e}"),
            Err(_) => last = format!("{url}: no answer in {CONTROL_TIMEOUT:?}"),
        }
    }
    Err(last)
}

/// Whether the version's `config.json` says `tie_word_embeddings`.
fn ties_embeddings(dir: &Path) -> bool {
    std::fs::read(dir.join("config.json"))
        .ok()
        .and_then(|bytes| serde_json::from_slice::<Value>(&bytes).ok())
        .is_some_and(|config| config["tie_word_embeddings"] == json!(true))
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// POST `body` to an engine's control API; its JSON answer, or what went wrong.
async fn control(
    client: &HttpClient,
    url: &str,
    path: &str,
    body: Value,
    timeout: Duration,
) -> Result<Value, String> {
    let target = format!("{url}{path}");
    let sent = client.post_collected(&target, Bytes::from(body.to_string()));
    match tokio::time::timeout(timeout, sent).await {
        Ok(Ok((200, answer))) => Ok(serde_json::from_slice(&answer).unwrap_or(Value::Null)),
        Ok(Ok((status, answer))) => Err(format!("POST {target}: {status} {}", snippet(&answer))),
        Ok(Err(e)) => Err(format!("POST {target}: {e}")),
        Err(_) => Err(format!("POST {target}: no answer in {timeout:?}")),
    }
}

/// The start of an answer, for errors.
fn snippet(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    text.chars().take(300).collect()
}

/// `dir` with links and `..` resolved, when it lies inside `root`: an engine is made to
/// load only what the trainer wrote, whoever names a path in an event.
fn confined(dir: &Path, root: &Path) -> Result<PathBuf, String> {
    let root = root.canonicalize().map_err(|e| {
        format!(
            "the weights folder {} cannot be read ({e}); pass --weights-dir",
            root.display()
        )
    })?;
    let resolved = dir
        .canonicalize()
        .map_err(|e| format!("weights at {}: {e}", dir.display()))?;
    if resolved.starts_with(&root) {
        Ok(resolved)
    } else {
        Err(format!(
            "weights at {} lie outside the weights folder {} (--weights-dir); refused",
            resolved.display(),
            root.display()
        ))
    }
}
