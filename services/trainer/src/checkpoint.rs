//! Policy versions on disk. Every step writes `<run_dir>/step-<N>/` in Hugging Face layout
//! (config.json, model.safetensors, tokenizer files), which any engine can load; every
//! `save_every` steps and at the end it also holds the optimizer state, which makes it a
//! checkpoint a restarted trainer resumes from. A folder is written under a temporary name
//! and renamed into place, so a folder that exists is complete.
//!
//! The folder's top-level files (config, weights, tokenizer) are what an engine loads
//! ([`Saved::files`]); `trainer_state.json` and the `optimizer/` and `master/` folders are
//! the trainer's own. With `--weights-store object` those files are also uploaded to the
//! object store, and a pruned version's objects are deleted with its folder ([`Pruned`]).
//!
//! A GPU trainer publishes bf16 weights (`model.safetensors`); its checkpoints also keep the
//! f32 master weights (`master/model.safetensors`), which resume reads instead, so a
//! restart loses no precision. CPU versions are f32 and need no separate master copy.

use std::path::{Path, PathBuf};

use arl_model::load::LoadedModel;
use arl_model::weights::{StoredDtype, Weights};
use arl_runtime::digest::sha256_file;
use serde::{Deserialize, Serialize};

const STATE_FILE: &str = "trainer_state.json";
const WEIGHTS_FILE: &str = "model.safetensors";

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{path}: {reason}")]
    Io { path: String, reason: String },
    #[error("{path}: {reason}")]
    Load { path: String, reason: String },
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> CheckpointError + '_ {
    move |e| CheckpointError::Io {
        path: path.display().to_string(),
        reason: e.to_string(),
    }
}

/// What a version folder says about itself.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    pub step: u32,
    pub policy_version: u64,
    /// AdamW's step count; present when the folder holds the optimizer state.
    pub optimizer_step: Option<u64>,
}

/// A written version: where, and the checksum engines verify.
#[derive(Clone, Debug)]
pub struct Saved {
    pub dir: PathBuf,
    pub sha256: String,
    pub size_bytes: u64,
    /// The files an engine loads (names in `dir`, sorted).
    pub files: Vec<String>,
}

/// A version folder [`prune`] deleted, and the files it published.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pruned {
    pub step: u32,
    pub files: Vec<String>,
}

pub fn version_dir(run_dir: &Path, step: u32) -> PathBuf {
    run_dir.join(format!("step-{step:06}"))
}

/// AdamW's state in host memory, for a checkpoint.
pub struct Moments<'a> {
    pub m: &'a Weights,
    pub v: &'a Weights,
    pub step: u64,
}

/// Writes step `state.step`'s weights as `dtype` (and, when `moments` are given, the
/// optimizer state — with the f32 master weights when `dtype` is not f32).
pub fn save(
    run_dir: &Path,
    model: &LoadedModel,
    moments: Option<Moments<'_>>,
    state: &TrainerState,
    dtype: StoredDtype,
) -> Result<Saved, CheckpointError> {
    let dir = version_dir(run_dir, state.step);
    let tmp = run_dir.join(format!(".step-{:06}.tmp", state.step));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io(&tmp))?;
    }
    model
        .save_hf_as(&tmp, dtype)
        .map_err(|e| CheckpointError::Io {
            path: tmp.display().to_string(),
            reason: e.to_string(),
        })?;
    let mut state = state.clone();
    state.optimizer_step = None;
    if let Some(moments) = moments {
        let master = (dtype != StoredDtype::F32).then_some(("master", model.model.weights()));
        let parts = [("optimizer/m", moments.m), ("optimizer/v", moments.v)];
        for (name, weights) in parts.into_iter().chain(master) {
            let path = tmp.join(name);
            std::fs::create_dir_all(&path).map_err(io(&path))?;
            weights
                .save_safetensors(&path.join(WEIGHTS_FILE))
                .map_err(|e| CheckpointError::Io {
                    path: path.display().to_string(),
                    reason: e.to_string(),
                })?;
        }
        state.optimizer_step = Some(moments.step);
    }
    let state_path = tmp.join(STATE_FILE);
    let json = serde_json::to_vec_pretty(&state).unwrap_or_default();
    std::fs::write(&state_path, json).map_err(io(&state_path))?;
    let weights = tmp.join(WEIGHTS_FILE);
    let (sha256, size_bytes) = sha256_file(&weights).map_err(io(&weights))?;
    let files = published_files(&tmp).map_err(io(&tmp))?;
    if dir.exists() {
        // A step re-trained after a restart replaces what the crashed run left.
        std::fs::remove_dir_all(&dir).map_err(io(&dir))?;
    }
    std::fs::rename(&tmp, &dir).map_err(io(&dir))?;
    Ok(Saved {
        dir,
        sha256,
        size_bytes,
        files,
    })
}

/// The files of version folder `dir` an engine loads: its top-level files but the
/// trainer's state, sorted.
pub fn published_files(dir: &Path) -> std::io::Result<Vec<String>> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        if !entry.file_type()?.is_file() {
            continue;
        }
        let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
            continue;
        };
        if name != STATE_FILE {
            files.push(name);
        }
    }
    files.sort();
    Ok(files)
}

/// The newest folder that holds optimizer state, with its state.
pub fn latest_checkpoint(run_dir: &Path) -> Option<(PathBuf, TrainerState)> {
    versions(run_dir)
        .into_iter()
        .rev()
        .find(|(_, state)| state.optimizer_step.is_some())
}

/// Every complete version folder, oldest first.
fn versions(run_dir: &Path) -> Vec<(PathBuf, TrainerState)> {
    let Ok(entries) = std::fs::read_dir(run_dir) else {
        return Vec::new();
    };
    let mut found: Vec<(PathBuf, TrainerState)> = entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("step-"))
        })
        .filter_map(|dir| {
            let text = std::fs::read(dir.join(STATE_FILE)).ok()?;
            let state: TrainerState = serde_json::from_slice(&text).ok()?;
            Some((dir, state))
        })
        .collect();
    found.sort_by_key(|(_, s)| s.step);
    found
}

/// What a checkpoint holds besides the published folder: AdamW's moments and step, and
/// the f32 master weights when the published ones are not f32.
pub struct Resume {
    pub m: Weights,
    pub v: Weights,
    pub step: u64,
    pub master: Option<Weights>,
}

/// Reads the optimizer state (and master weights, if any) saved in checkpoint `dir`.
pub fn load_resume(
    dir: &Path,
    loaded: &LoadedModel,
    state: &TrainerState,
) -> Result<Resume, CheckpointError> {
    let load = |name: &str| -> Result<Weights, CheckpointError> {
        let path = dir.join(name);
        Weights::from_safetensors_dir(&path, &loaded.model.config).map_err(|e| {
            CheckpointError::Load {
                path: path.display().to_string(),
                reason: e.to_string(),
            }
        })
    };
    let master = if dir.join("master").join(WEIGHTS_FILE).exists() {
        Some(load("master")?)
    } else {
        None
    };
    Ok(Resume {
        m: load("optimizer/m")?,
        v: load("optimizer/v")?,
        step: state.optimizer_step.unwrap_or(0),
        master,
    })
}

/// Deletes all but the newest `keep` versions and the newest checkpoint (engines may still
/// be loading the recent ones; resume needs the checkpoint); returns what it deleted.
pub fn prune(run_dir: &Path, keep: usize) -> Result<Vec<Pruned>, CheckpointError> {
    let all = versions(run_dir);
    let checkpoint = latest_checkpoint(run_dir).map(|(dir, _)| dir);
    let cutoff = all.len().saturating_sub(keep);
    let mut pruned = Vec::new();
    for (dir, state) in &all[..cutoff] {
        if Some(dir) != checkpoint.as_ref() {
            let files = published_files(dir).map_err(io(dir))?;
            std::fs::remove_dir_all(dir).map_err(io(dir))?;
            pruned.push(Pruned {
                step: state.step,
                files,
            });
        }
    }
    Ok(pruned)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A version folder as `save` leaves it, without real weights.
    fn version(run_dir: &Path, step: u32, checkpoint: bool) {
        let dir = version_dir(run_dir, step);
        std::fs::create_dir_all(dir.join("optimizer/m")).unwrap();
        for file in [WEIGHTS_FILE, "config.json", "tokenizer.json"] {
            std::fs::write(dir.join(file), b"{}").unwrap();
        }
        let state = TrainerState {
            step,
            policy_version: u64::from(step),
            optimizer_step: checkpoint.then_some(u64::from(step)),
        };
        std::fs::write(dir.join(STATE_FILE), serde_json::to_vec(&state).unwrap()).unwrap();
    }

    #[test]
    fn an_engine_gets_the_top_level_files_but_the_trainer_state() {
        let tmp = tempfile::tempdir().unwrap();
        version(tmp.path(), 1, true);
        assert_eq!(
            published_files(&version_dir(tmp.path(), 1)).unwrap(),
            ["config.json", WEIGHTS_FILE, "tokenizer.json"]
        );
    }

    #[test]
    fn pruning_keeps_the_newest_versions_and_checkpoint_and_names_what_went() {
        let tmp = tempfile::tempdir().unwrap();
        for step in 1..=5 {
            version(tmp.path(), step, step == 2);
        }
        let pruned = prune(tmp.path(), 2).unwrap();
        let steps: Vec<u32> = pruned.iter().map(|p| p.step).collect();
        assert_eq!(steps, [1, 3]);
        assert_eq!(
            pruned[0].files,
            ["config.json", WEIGHTS_FILE, "tokenizer.json"]
        );
        let left: Vec<u32> = versions(tmp.path()).iter().map(|(_, s)| s.step).collect();
        assert_eq!(left, [2, 4, 5]);
        assert!(prune(tmp.path(), 2).unwrap().is_empty());
    }
}
