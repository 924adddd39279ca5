//! Following `weights.published` (either version; version 1 is read as a folder): each
//! new policy version is found — a folder under the weights folder, or fetched from the
//! object store into it (`fetch.rs`) — checked (sha256), loaded beside the serving one on
//! a blocking thread, and swapped in between decode steps.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use arl_model::handoff::{self, HandedVersion, VersionKey};
use arl_model::load::LoadedModel;
use arl_runtime::consumer::run_consumer;
use arl_runtime::digest::sha256_file;
use arl_runtime::{Bus, ConsumerSpec, Delivery, HandlerError, Shutdown};
use arl_schemas::events::{WEIGHTS_FILE, WeightsLocation, WeightsPublishedV2};
use arl_schemas::{Domain, RunId};

use crate::engine::{EngineHandle, ServedModel};
use crate::fetch;

/// The newest version each run still going has published, as this engine has seen them:
/// when the run whose weights it serves ends, the engine turns to another live run's newest
/// version (its trials wait for it: the proxy routes a trial only to an engine serving
/// its run), and to the base model only when no live run has a trained version.
#[derive(Debug, Default)]
struct LiveRuns {
    newest: HashMap<RunId, WeightsPublishedV2>,
    ended: HashSet<RunId>,
}

type Live = Arc<Mutex<LiveRuns>>;

fn lock(live: &Live) -> std::sync::MutexGuard<'_, LiveRuns> {
    live.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Consumes weight versions (of one run, or of every run) and swaps them in; only
/// weights under `weights_dir` are loaded, and versions in the object store are fetched
/// into it (`<weights_dir>/<run_id>/version-<N>/`). With a `base` model (the one the engine started
/// with), when the run whose weights it serves ends, the engine serves the newest version
/// of another run still going, or else goes back to the base model, so that the next
/// run's first trials (version 0) find their policy: a run's version 0 is the base model,
/// never another run's trained weights, and a run going on beside an ended one is never
/// left without its own.
pub fn follow(
    bus: &Bus,
    engine: EngineHandle,
    durable: &str,
    run: Option<&RunId>,
    weights_dir: PathBuf,
    base: Option<PathBuf>,
    shutdown: &Shutdown,
) {
    let ns = bus.namespace();
    let live = Live::default();
    if let Some(base) = base {
        follow_run_ends(
            bus,
            engine.clone(),
            durable,
            base,
            weights_dir.clone(),
            live.clone(),
            shutdown,
        );
    }
    let filter = match run {
        Some(run) => ns.event_subject(Domain::Weights, run, "published"),
        None => ns.event_filter(Domain::Weights, "published"),
    };
    let mut spec = ConsumerSpec::new(Domain::Weights, durable, vec![filter]).ordered();
    // Loading a version takes a while; it is not a stuck handler.
    spec.keep_alive = true;
    let fetcher = bus.clone();
    // Versions this process's trainer (if any) hands over, while the consumer runs.
    let listening = handoff::listen(engine.device().listener());
    shutdown.spawn(run_consumer(
        bus.clone(),
        spec,
        move |delivery: Delivery| {
            let _listening = &listening;
            let (bus, engine, weights_dir) = (fetcher.clone(), engine.clone(), weights_dir.clone());
            let live = live.clone();
            async move { on_weights(&bus, &engine, &weights_dir, &live, &delivery).await }
        },
        shutdown.clone(),
    ));
}

async fn on_weights(
    bus: &Bus,
    engine: &EngineHandle,
    weights_dir: &Path,
    live: &Live,
    delivery: &Delivery,
) -> Result<(), HandlerError> {
    let event = delivery.decode_weights_published()?;
    {
        let mut live = lock(live);
        if live.ended.contains(&event.run_id) {
            return Ok(()); // a late copy of an ended run's version: nobody samples from it
        }
        let newer = live
            .newest
            .get(&event.run_id)
            .is_none_or(|seen| seen.policy_version < event.policy_version);
        if newer {
            live.newest.insert(event.run_id.clone(), event.clone());
        }
    }
    serve(bus, engine, weights_dir, &event).await
}

/// Loads `event`'s version (unless this run's version or a newer one is served already)
/// and swaps it in.
async fn serve(
    bus: &Bus,
    engine: &EngineHandle,
    weights_dir: &Path,
    event: &WeightsPublishedV2,
) -> Result<(), HandlerError> {
    if engine
        .current()
        .is_some_and(|m| m.is_at_least(&event.run_id, event.policy_version))
    {
        return Ok(()); // already serving this run's version or a newer one
    }
    // A version this process's trainer handed over is taken from memory; any other is
    // read from its folder, fetched there first from the object store.
    let source = match take_handed(event) {
        Some(handed) => Source::Handed(Box::new(handed)),
        None => {
            let (dir, fetched) = version_dir(bus, weights_dir, event).await?;
            Source::File { dir, fetched }
        }
    };
    let fetched = matches!(source, Source::File { fetched: true, .. });
    let handed = matches!(source, Source::Handed(_));
    let expected = event.sha256.clone();
    let version = event.policy_version;
    let (run, device) = (event.run_id.clone(), engine.device().clone());
    let served = tokio::task::spawn_blocking(move || match source {
        Source::Handed(handed) => {
            ServedModel::handed(Some(run), version, *handed, &device).map_err(WeightsError::Device)
        }
        Source::File { dir, .. } => {
            let loaded = load_checked(&dir, &expected)?;
            ServedModel::new(Some(run), version, loaded, &device).map_err(WeightsError::Device)
        }
    })
    .await
    .map_err(|e| HandlerError::retry(format!("loading version {version} panicked: {e}")))?
    .map_err(HandlerError::retry)?;
    engine.swap(served).map_err(HandlerError::retry)?;
    if handed {
        tracing::info!(run = %event.run_id, policy_version = version,
            "serving new weights, handed over in memory by this process's trainer");
    } else {
        tracing::info!(run = %event.run_id, policy_version = version, uri = %event.uri(), "serving new weights");
    }
    if fetched {
        let (weights_dir, run) = (weights_dir.to_path_buf(), event.run_id.clone());
        // Only disk space is at stake: a failure to clean up is logged, never retried.
        let _ = tokio::task::spawn_blocking(move || {
            fetch::prune_older(&weights_dir, &run, version);
        })
        .await;
    }
    Ok(())
}

/// Where a version's weights come from.
enum Source {
    /// From this process's trainer, in memory.
    Handed(Box<HandedVersion>),
    /// Its folder (`fetched`: from the object store, into the weights folder).
    File { dir: PathBuf, fetched: bool },
}

/// `event`'s version folder: the one it names under the weights folder, or its objects
/// fetched into it. A location this engine may never load from, or objects that are gone
/// or not what was published, are refused for good; a copy still being written, a fetch
/// cut short, or one that fails to load, is tried again.
async fn version_dir(
    bus: &Bus,
    weights_dir: &Path,
    event: &WeightsPublishedV2,
) -> Result<(PathBuf, bool), HandlerError> {
    match &event.location {
        WeightsLocation::Folder { path } => {
            let dir = confined(Path::new(path), weights_dir).map_err(HandlerError::dead_letter)?;
            Ok((dir, false))
        }
        WeightsLocation::ObjectStore { bucket, files } => {
            let dir = fetch::fetch(bus, weights_dir, event, bucket, files)
                .await
                .map_err(|e| {
                    if e.is_permanent() {
                        HandlerError::dead_letter(e)
                    } else {
                        HandlerError::retry(e)
                    }
                })?;
            Ok((dir, true))
        }
    }
}

/// The version `event` publishes, if this process's trainer handed it over in memory
/// (exactly that file: the same run, version and sha256).
fn take_handed(event: &WeightsPublishedV2) -> Option<HandedVersion> {
    let key = VersionKey {
        run_id: event.run_id.to_string(),
        policy_version: event.policy_version,
        sha256: event.sha256.clone(),
    };
    handoff::take(&key)
}

/// On `run.completed` / `run.failed` / `run.cancelled` of the run whose weights are served: another live
/// run's newest version, else the base model.
fn follow_run_ends(
    bus: &Bus,
    engine: EngineHandle,
    durable: &str,
    base: PathBuf,
    weights_dir: PathBuf,
    live: Live,
    shutdown: &Shutdown,
) {
    // Every run's end: only the one whose weights are served changes anything.
    let spec = ConsumerSpec::run_ends(bus.namespace(), format!("{durable}-run-ends"));
    let fetcher = bus.clone();
    shutdown.spawn(run_consumer(
        bus.clone(),
        spec,
        move |delivery: Delivery| {
            let (engine, base) = (engine.clone(), base.clone());
            let (bus, weights_dir, live) = (fetcher.clone(), weights_dir.clone(), live.clone());
            async move { on_run_end(&bus, &engine, &base, &weights_dir, &live, &delivery).await }
        },
        shutdown.clone(),
    ));
}

async fn on_run_end(
    bus: &Bus,
    engine: &EngineHandle,
    base: &Path,
    weights_dir: &Path,
    live: &Live,
    delivery: &Delivery,
) -> Result<(), HandlerError> {
    let ended = delivery.ended_run()?;
    handoff::forget(ended.as_str());
    let next = {
        let mut live = lock(live);
        live.newest.remove(&ended);
        live.ended.insert(ended.clone());
        // The live run that published last: its trials are the likeliest to be waiting.
        live.newest.values().max_by_key(|w| w.at).cloned()
    };
    let serving_it = engine
        .current()
        .is_some_and(|m| m.run_id.as_ref() == Some(&ended));
    if !serving_it {
        return Ok(());
    }
    if let Some(next) = next {
        tracing::info!(run = %ended, next = %next.run_id, policy_version = next.policy_version,
            "the run ended; serving another live run's newest version");
        return serve(bus, engine, weights_dir, &next).await;
    }
    let (path, device) = (base.to_path_buf(), engine.device().clone());
    let served = tokio::task::spawn_blocking(move || {
        let loaded = LoadedModel::open(&path).map_err(|e| e.to_string())?;
        ServedModel::new(None, 0, loaded, &device).map_err(|e| e.to_string())
    })
    .await
    .map_err(|e| HandlerError::retry(format!("loading the base model panicked: {e}")))?
    .map_err(|e| HandlerError::retry(format!("loading the base model: {e}")))?;
    engine.swap(served).map_err(HandlerError::retry)?;
    tracing::info!(run = %ended, "the run ended; serving the base model again");
    Ok(())
}

/// Why a `weights.published` could not be served.
#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    #[error("the weights folder {root} cannot be read ({source}); weights cannot be loaded")]
    WeightsDir {
        root: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("weights at {path}: {source}")]
    Unreadable {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("weights at {path} lie outside the weights folder {root} (--weights-dir); refused")]
    Outside { path: PathBuf, root: PathBuf },
    #[error("{path}: sha256 is {found}, the event says {expected} (incomplete copy?)")]
    Checksum {
        path: PathBuf,
        found: String,
        expected: String,
    },
    #[error(transparent)]
    Load(#[from] arl_model::load::LoadError),
    #[error("putting the weights on the device: {0}")]
    Device(arl_model::backend::BackendError),
}

/// `dir` with links and `..` resolved, when it lies inside `root`: an engine loads only
/// what the trainer wrote, whoever names a path in an event.
fn confined(dir: &Path, root: &Path) -> Result<PathBuf, WeightsError> {
    let root = root
        .canonicalize()
        .map_err(|source| WeightsError::WeightsDir {
            root: root.to_path_buf(),
            source,
        })?;
    let resolved = dir
        .canonicalize()
        .map_err(|source| WeightsError::Unreadable {
            path: dir.to_path_buf(),
            source,
        })?;
    if !resolved.starts_with(&root) {
        return Err(WeightsError::Outside {
            path: resolved,
            root,
        });
    }
    Ok(resolved)
}

fn load_checked(dir: &Path, sha256: &str) -> Result<LoadedModel, WeightsError> {
    let file = dir.join(WEIGHTS_FILE);
    let (found, _) = sha256_file(&file).map_err(|source| WeightsError::Unreadable {
        path: file.clone(),
        source,
    })?;
    if found != sha256 {
        return Err(WeightsError::Checksum {
            path: file,
            found,
            expected: sha256.to_owned(),
        });
    }
    Ok(LoadedModel::open(dir)?)
}
