//! Policy versions on disk. Every step writes `<run_dir>/step-<N>/` in Hugging Face layout
//! (config.json, model.safetensors, tokenizer files), which any engine can load; every
//! `save_every` steps and at the end it also holds the optimizer state, which makes it a
//! checkpoint a restarted trainer resumes from. A folder is written under a temporary name
//! and renamed into place, so a folder that exists is complete.
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
    if dir.exists() {
        // A step re-trained after a restart replaces what the crashed run left.
        std::fs::remove_dir_all(&dir).map_err(io(&dir))?;
    }
    std::fs::rename(&tmp, &dir).map_err(io(&dir))?;
    Ok(Saved {
        dir,
        sha256,
        size_bytes,
    })
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
/// be loading the recent ones; resume needs the checkpoint).
pub fn prune(run_dir: &Path, keep: usize) -> Result<(), CheckpointError> {
    let all = versions(run_dir);
    let checkpoint = latest_checkpoint(run_dir).map(|(dir, _)| dir);
    let cutoff = all.len().saturating_sub(keep);
    for (dir, _) in &all[..cutoff] {
        if Some(dir) != checkpoint.as_ref() {
            std::fs::remove_dir_all(dir).map_err(io(dir))?;
        }
    }
    Ok(())
}
