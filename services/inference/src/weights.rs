//! Following `weights.published`: each new policy version is checked (sha256), loaded
//! beside the serving one on a blocking thread, and swapped in between decode steps.

use std::path::{Path, PathBuf};

use arl_model::load::LoadedModel;
use arl_runtime::consumer::run_consumer;
use arl_runtime::digest::sha256_file;
use arl_runtime::{Bus, ConsumerSpec, Delivery, HandlerError, Shutdown};
use arl_schemas::events::WeightsPublishedV1;
use arl_schemas::{Domain, RunId};

use crate::engine::{EngineHandle, ServedModel};

/// Consumes weight versions (of one run, or of every run) and swaps them in; only
/// weights under `weights_dir` are loaded.
pub fn follow(
    bus: &Bus,
    engine: EngineHandle,
    durable: &str,
    run: Option<&RunId>,
    weights_dir: PathBuf,
    shutdown: &Shutdown,
) {
    let ns = bus.namespace();
    let filter = match run {
        Some(run) => ns.event_subject(Domain::Weights, run, "published"),
        None => ns.event_filter(Domain::Weights, "published"),
    };
    let mut spec = ConsumerSpec::new(Domain::Weights, durable, vec![filter]).ordered();
    // Loading a version takes a while; it is not a stuck handler.
    spec.keep_alive = true;
    shutdown.spawn(run_consumer(
        bus.clone(),
        spec,
        move |delivery: Delivery| {
            let (engine, weights_dir) = (engine.clone(), weights_dir.clone());
            async move { on_weights(&engine, &weights_dir, &delivery).await }
        },
        shutdown.clone(),
    ));
}

async fn on_weights(
    engine: &EngineHandle,
    weights_dir: &Path,
    delivery: &Delivery,
) -> Result<(), HandlerError> {
    let event: WeightsPublishedV1 = delivery.decode()?;
    if engine
        .current()
        .is_some_and(|m| m.version >= event.policy_version)
    {
        return Ok(()); // already serving this version or a newer one
    }
    let dir = local_path(&event.uri).map_err(HandlerError::DeadLetter)?;
    let dir = confined(&dir, weights_dir).map_err(HandlerError::DeadLetter)?;
    let expected = event.sha256.clone();
    let version = event.policy_version;
    let loaded = tokio::task::spawn_blocking(move || load_checked(&dir, &expected))
        .await
        .map_err(|e| HandlerError::Retry(format!("loading version {version} panicked: {e}")))?
        .map_err(HandlerError::Retry)?;
    engine
        .swap(ServedModel { version, loaded })
        .map_err(|e| HandlerError::Retry(e.to_string()))?;
    tracing::info!(policy_version = version, uri = %event.uri, "serving new weights");
    Ok(())
}

/// `file:///path` (or a plain path) to a path; other schemes are not reachable here.
fn local_path(uri: &str) -> Result<PathBuf, String> {
    if let Some(path) = uri.strip_prefix("file://") {
        return Ok(PathBuf::from(path));
    }
    if uri.starts_with('/') {
        return Ok(PathBuf::from(uri));
    }
    Err(format!(
        "weights uri {uri:?}: only file:// locations can be loaded by this engine"
    ))
}

/// `dir` with links and `..` resolved, when it lies inside `root`: an engine loads only
/// what the trainer wrote, whoever names a path in an event.
fn confined(dir: &Path, root: &Path) -> Result<PathBuf, String> {
    let root = root.canonicalize().map_err(|e| {
        format!(
            "the weights folder {} cannot be read ({e}); weights cannot be loaded",
            root.display()
        )
    })?;
    let resolved = dir
        .canonicalize()
        .map_err(|e| format!("weights at {}: {e}", dir.display()))?;
    if !resolved.starts_with(&root) {
        return Err(format!(
            "weights at {} lie outside the weights folder {} (--weights-dir); refused",
            resolved.display(),
            root.display()
        ));
    }
    Ok(resolved)
}

fn load_checked(dir: &Path, sha256: &str) -> Result<LoadedModel, String> {
    let file = dir.join("model.safetensors");
    let (found, _) = sha256_file(&file).map_err(|e| format!("{}: {e}", file.display()))?;
    if found != sha256 {
        return Err(format!(
            "{}: sha256 is {found}, the event says {sha256} (incomplete copy?)",
            file.display()
        ));
    }
    LoadedModel::open(dir).map_err(|e| e.to_string())
}
