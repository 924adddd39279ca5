//! Versions published through the `ARL_WEIGHTS` object store, fetched into this engine's
//! own weights folder as `<weights_dir>/<run_id>/version-<N>/`. Files are streamed to disk
//! and each checked against the digest and size the event names; the folder is written
//! under a temporary name and renamed into place once all of them match, so a folder that
//! exists is complete, and a redelivered event finds it and downloads nothing.
//!
//! What the event names is checked before anything is read: the bucket must be this
//! namespace's `ARL_WEIGHTS`, each file a plain name (it becomes a path here), the weights
//! file among them with the event's digest. An event that fails those checks, an object
//! that is gone, or one that does not hold the published bytes can never be served: the
//! caller dead-letters it ([`FetchError::is_permanent`]).

use std::collections::HashSet;
use std::path::{Component, Path, PathBuf};

use arl_runtime::Bus;
use arl_runtime::digest::sha256_file;
use arl_runtime::objects::{ObjectError, StoredFile};
use arl_schemas::events::{WEIGHTS_FILE, WeightsObject, WeightsPublishedV2};
use arl_schemas::{ObjectStore, RunId};

#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error(
        "weights in object store {bucket}: this engine reads only {expected}, its namespace's weights store"
    )]
    ForeignBucket { bucket: String, expected: String },
    #[error("weights.published of run {run} version {version} is inconsistent: {reason}")]
    BadManifest {
        run: RunId,
        version: u64,
        reason: String,
    },
    #[error("fetching version {version} of run {run}: {source}")]
    Object {
        run: RunId,
        version: u64,
        #[source]
        source: ObjectError,
    },
    #[error("the weights folder {path}: {source}")]
    Folder {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl FetchError {
    /// True when the event can never be served, however often it is tried.
    pub fn is_permanent(&self) -> bool {
        match self {
            FetchError::ForeignBucket { .. } | FetchError::BadManifest { .. } => true,
            FetchError::Object { source, .. } => source.is_permanent(),
            FetchError::Folder { .. } => false,
        }
    }
}

/// Where version `version` of `run` is fetched to.
pub fn version_dir(weights_dir: &Path, run: &RunId, version: u64) -> PathBuf {
    weights_dir
        .join(run.as_str())
        .join(format!("version-{version}"))
}

/// Fetches the files of `event` (an object-store location: `bucket`, `files`) into the
/// weights folder, unless a complete copy is already there; returns the version folder.
pub async fn fetch(
    bus: &Bus,
    weights_dir: &Path,
    event: &WeightsPublishedV2,
    bucket: &str,
    files: &[WeightsObject],
) -> Result<PathBuf, FetchError> {
    let expected = bus.namespace().object_store(ObjectStore::Weights);
    if bucket != expected {
        return Err(FetchError::ForeignBucket {
            bucket: bucket.to_owned(),
            expected,
        });
    }
    check_manifest(event, files).map_err(|reason| FetchError::BadManifest {
        run: event.run_id.clone(),
        version: event.policy_version,
        reason,
    })?;
    let dest = version_dir(weights_dir, &event.run_id, event.policy_version);
    if holds(&dest, files).await {
        return Ok(dest);
    }
    let run_dir = dest.parent().unwrap_or(weights_dir).to_path_buf();
    let folder_error = |path: &Path| {
        let path = path.to_path_buf();
        move |source| FetchError::Folder { path, source }
    };
    tokio::fs::create_dir_all(&run_dir)
        .await
        .map_err(folder_error(&run_dir))?;
    let tmp = run_dir.join(format!(
        ".version-{}.{}.tmp",
        event.policy_version,
        uuid::Uuid::now_v7().simple()
    ));
    let fetched = download(bus, event, files, &tmp).await;
    let placed = match fetched {
        Ok(()) => place(&tmp, &dest, files).await,
        Err(error) => Err(error),
    };
    if placed.is_err() {
        let _ = tokio::fs::remove_dir_all(&tmp).await;
    }
    placed.map(|()| dest)
}

/// Every file of the event a plain, distinct name; the weights file among them with the
/// event's digest and size.
fn check_manifest(event: &WeightsPublishedV2, files: &[WeightsObject]) -> Result<(), String> {
    let mut seen = HashSet::new();
    for file in files {
        let mut components = Path::new(&file.file).components();
        let plain = matches!(components.next(), Some(Component::Normal(_)))
            && components.next().is_none()
            && !file.file.starts_with('.')
            && !file.file.contains(['/', '\\']);
        if !plain {
            return Err(format!(
                "file name {:?} is not a plain file name",
                file.file
            ));
        }
        if !seen.insert(file.file.as_str()) {
            return Err(format!("file {:?} is named twice", file.file));
        }
    }
    let weights = files
        .iter()
        .find(|f| f.file == WEIGHTS_FILE)
        .ok_or_else(|| format!("no {WEIGHTS_FILE} among its files"))?;
    if weights.sha256 != event.sha256 || weights.size_bytes != event.size_bytes {
        return Err(format!(
            "its {WEIGHTS_FILE} object has sha256 {} ({} bytes), the event says {} ({} bytes)",
            weights.sha256, weights.size_bytes, event.sha256, event.size_bytes
        ));
    }
    Ok(())
}

/// Streams every file into `tmp`, each checked.
async fn download(
    bus: &Bus,
    event: &WeightsPublishedV2,
    files: &[WeightsObject],
    tmp: &Path,
) -> Result<(), FetchError> {
    tokio::fs::create_dir_all(tmp)
        .await
        .map_err(|source| FetchError::Folder {
            path: tmp.to_path_buf(),
            source,
        })?;
    for file in files {
        let expected = StoredFile {
            sha256: file.sha256.clone(),
            size_bytes: file.size_bytes,
        };
        bus.get_file(
            ObjectStore::Weights,
            &file.object,
            &tmp.join(&file.file),
            &expected,
        )
        .await
        .map_err(|source| FetchError::Object {
            run: event.run_id.clone(),
            version: event.policy_version,
            source,
        })?;
    }
    Ok(())
}

/// Renames the complete `tmp` to `dest`, replacing an incomplete or stale `dest`. Another
/// engine sharing the folder may have placed the same version first: its copy is used when
/// it holds the files.
async fn place(tmp: &Path, dest: &Path, files: &[WeightsObject]) -> Result<(), FetchError> {
    if tokio::fs::try_exists(dest).await.unwrap_or(false) {
        tokio::fs::remove_dir_all(dest)
            .await
            .map_err(|source| FetchError::Folder {
                path: dest.to_path_buf(),
                source,
            })?;
    }
    match tokio::fs::rename(tmp, dest).await {
        Ok(()) => Ok(()),
        Err(_) if holds(dest, files).await => {
            let _ = tokio::fs::remove_dir_all(tmp).await;
            Ok(())
        }
        Err(source) => Err(FetchError::Folder {
            path: dest.to_path_buf(),
            source,
        }),
    }
}

/// Whether `dir` holds every file with its digest and size (hashed on a blocking thread).
async fn holds(dir: &Path, files: &[WeightsObject]) -> bool {
    if !tokio::fs::try_exists(dir).await.unwrap_or(false) {
        return false;
    }
    let dir = dir.to_path_buf();
    let files = files.to_vec();
    tokio::task::spawn_blocking(move || {
        files.iter().all(|f| {
            sha256_file(&dir.join(&f.file))
                .is_ok_and(|(sha256, size)| sha256 == f.sha256 && size == f.size_bytes)
        })
    })
    .await
    .unwrap_or(false)
}

/// Deletes the run's fetched versions older than `serving` (best effort: a folder another
/// engine still reads from is gone for it too, and it fetches again).
pub fn prune_older(weights_dir: &Path, run: &RunId, serving: u64) {
    let run_dir = weights_dir.join(run.as_str());
    let Ok(entries) = std::fs::read_dir(&run_dir) else {
        return;
    };
    for entry in entries.filter_map(Result::ok) {
        let name = entry.file_name();
        let older = name
            .to_str()
            .and_then(|n| n.strip_prefix("version-"))
            .and_then(|v| v.parse::<u64>().ok())
            .is_some_and(|v| v < serving);
        if older && let Err(error) = std::fs::remove_dir_all(entry.path()) {
            tracing::warn!(path = %entry.path().display(), %error, "cannot delete a fetched version");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arl_schemas::events::{Example, WeightsLocation};

    fn example() -> (WeightsPublishedV2, Vec<WeightsObject>) {
        let event = WeightsPublishedV2::example();
        let WeightsLocation::ObjectStore { files, .. } = &event.location else {
            panic!("the example is in the object store")
        };
        let files = files.clone();
        (event, files)
    }

    #[test]
    fn the_example_manifest_is_consistent() {
        let (event, files) = example();
        assert_eq!(check_manifest(&event, &files), Ok(()));
    }

    #[test]
    fn file_names_that_are_paths_are_refused() {
        let (event, files) = example();
        for bad in [
            "../x",
            "/etc/passwd",
            "a/b",
            ".",
            "..",
            "",
            ".hidden",
            "a\\b",
        ] {
            let mut files = files.clone();
            files[0].file = bad.into();
            let reason = check_manifest(&event, &files).unwrap_err();
            assert!(reason.contains("plain file name"), "{bad:?}: {reason}");
        }
    }

    #[test]
    fn a_missing_or_disagreeing_weights_file_is_refused() {
        let (event, files) = example();
        let without: Vec<_> = files
            .iter()
            .filter(|f| f.file != WEIGHTS_FILE)
            .cloned()
            .collect();
        assert!(
            check_manifest(&event, &without)
                .unwrap_err()
                .contains("no model.safetensors")
        );
        let mut other = event.clone();
        other.sha256 = "00".repeat(32);
        assert!(
            check_manifest(&other, &files)
                .unwrap_err()
                .contains("the event says")
        );
        let mut twice = files.clone();
        twice.push(files[0].clone());
        assert!(
            check_manifest(&event, &twice)
                .unwrap_err()
                .contains("named twice")
        );
    }

    #[test]
    fn only_older_fetched_versions_of_the_run_are_pruned() {
        let tmp = tempfile::tempdir().unwrap();
        let run = RunId::new("run-1").unwrap();
        for version in [1, 2, 3] {
            std::fs::create_dir_all(version_dir(tmp.path(), &run, version)).unwrap();
        }
        // A trainer's folders beside them (one machine, one folder) are not the engine's.
        std::fs::create_dir_all(tmp.path().join("run-1/step-000001")).unwrap();
        prune_older(tmp.path(), &run, 3);
        let mut left: Vec<String> = std::fs::read_dir(tmp.path().join("run-1"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        left.sort();
        assert_eq!(left, ["step-000001", "version-3"]);
    }
}
