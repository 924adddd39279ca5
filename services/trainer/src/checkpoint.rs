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

/// Starts `run_dir` from another run's checkpoint at `step` (`trainer.resume_from`): the
/// folder is linked (copied where links cannot be made) into `run_dir` under the same
/// name, so the run opens from it as from its own. Does nothing when `run_dir` already
/// holds a checkpoint (the run was opened before). Errors say which checkpoints the other
/// run still has.
pub fn seed_from(source_dir: &Path, step: u32, run_dir: &Path) -> Result<(), CheckpointError> {
    if latest_checkpoint(run_dir).is_some() {
        return Ok(());
    }
    let kept = versions(source_dir);
    let found = kept.iter().find(|(_, state)| state.step == step);
    let Some((source, _)) = found.filter(|(_, state)| state.optimizer_step.is_some()) else {
        let checkpoints: Vec<String> = kept
            .iter()
            .filter(|(_, state)| state.optimizer_step.is_some())
            .map(|(_, state)| format!("step-{}", state.step))
            .collect();
        let what = if found.is_some() {
            "holds weights but no optimizer state (a checkpoint is saved every              trainer.save_every steps and at the end)"
        } else {
            "is not on this trainer (pruned, or never saved here)"
        };
        return Err(CheckpointError::Load {
            path: version_dir(source_dir, step).display().to_string(),
            reason: format!(
                "step-{step} {what}; checkpoints kept: {}",
                if checkpoints.is_empty() {
                    "none".to_owned()
                } else {
                    checkpoints.join(", ")
                }
            ),
        });
    };
    let dir = version_dir(run_dir, step);
    let tmp = run_dir.join(format!(".step-{step:06}.tmp"));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io(&tmp))?;
    }
    link_tree(source, &tmp)?;
    std::fs::rename(&tmp, &dir).map_err(io(&dir))
}

/// Hard-links every file of `from` into `to` (version folders are never written after
/// they are renamed into place, so sharing their files is safe), copying across devices.
fn link_tree(from: &Path, to: &Path) -> Result<(), CheckpointError> {
    std::fs::create_dir_all(to).map_err(io(to))?;
    for entry in std::fs::read_dir(from).map_err(io(from))? {
        let entry = entry.map_err(io(from))?;
        let (source, target) = (entry.path(), to.join(entry.file_name()));
        if entry.file_type().map_err(io(&source))?.is_dir() {
            link_tree(&source, &target)?;
        } else if std::fs::hard_link(&source, &target).is_err() {
            std::fs::copy(&source, &target).map_err(io(&source))?;
        }
    }
    Ok(())
}

/// Describes a version folder already on disk, as [`save`] describes the one it wrote.
pub fn describe(dir: &Path) -> Result<Saved, CheckpointError> {
    let weights = dir.join(WEIGHTS_FILE);
    let (sha256, size_bytes) = sha256_file(&weights).map_err(io(&weights))?;
    let files = published_files(dir).map_err(io(dir))?;
    Ok(Saved {
        dir: dir.to_path_buf(),
        sha256,
        size_bytes,
        files,
    })
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
    fn a_resumed_run_starts_from_the_named_checkpoint_only() {
        let tmp = tempfile::tempdir().unwrap();
        let (source, resumed) = (tmp.path().join("a"), tmp.path().join("b"));
        version(&source, 2, true);
        version(&source, 3, false);
        version(&source, 4, true);
        // Weights without optimizer state, and a step never kept: refused, naming what is.
        for (step, says) in [(3, "no optimizer state"), (1, "is not on this trainer")] {
            let error = seed_from(&source, step, &resumed).unwrap_err().to_string();
            assert!(error.contains(says), "{error}");
            assert!(
                error.contains("checkpoints kept: step-2, step-4"),
                "{error}"
            );
        }
        seed_from(&source, 2, &resumed).unwrap();
        let (dir, state) = latest_checkpoint(&resumed).unwrap();
        assert_eq!((dir, state.step), (version_dir(&resumed, 2), 2));
        assert!(version_dir(&resumed, 2).join("optimizer/m").is_dir());
        // Opened before: the run's own checkpoints stand.
        seed_from(&source, 4, &resumed).unwrap();
        assert_eq!(latest_checkpoint(&resumed).unwrap().1.step, 2);
        assert_eq!(describe(&version_dir(&resumed, 2)).unwrap().files.len(), 3);
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
