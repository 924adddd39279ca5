//! Hugging Face Hub names (`Qwen/Qwen2.5-0.5B-Instruct`) where a model path is expected,
//! resolved offline from the local Hub cache the way `huggingface_hub` lays it out:
//! `<cache>/models--Qwen--Qwen2.5-0.5B-Instruct/snapshots/<rev>/`, with `refs/main`
//! naming `<rev>`. The cache is `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
//! `$XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub`. Nothing is
//! downloaded: a name not in the cache is an error that says where it looked.

use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error(
        "{0}: no such file or directory (and not a Hugging Face Hub name such as Qwen/Qwen2.5-0.5B-Instruct)"
    )]
    NotFound(String),
    #[error(
        "{name} is neither a path nor in the local Hugging Face cache: looked for {looked}; \
         download it first (e.g. `hf download {name}`), or set HF_HUB_CACHE / HF_HOME to the cache that has it"
    )]
    NotCached { name: String, looked: String },
}

/// The Hub cache folder of this environment.
pub fn hub_cache() -> PathBuf {
    let var = |name: &str| {
        std::env::var_os(name)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(dir) = var("HF_HUB_CACHE") {
        return dir;
    }
    let hf_home = var("HF_HOME").unwrap_or_else(|| {
        var("XDG_CACHE_HOME")
            .unwrap_or_else(|| {
                var("HOME")
                    .unwrap_or_else(|| PathBuf::from("."))
                    .join(".cache")
            })
            .join("huggingface")
    });
    hf_home.join("hub")
}

/// Whether `name` has the shape of a Hub repository id: `owner/name`, each part of
/// letters, digits, `-`, `_` and `.`, not starting with `.` or `-`.
pub fn is_hub_name(name: &str) -> bool {
    let part = |p: &str| {
        !p.is_empty()
            && p.len() <= 96
            && !p.starts_with(['.', '-'])
            && p.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    matches!(name.split_once('/'), Some((owner, repo)) if part(owner) && part(repo) && !repo.contains('/'))
}

/// A Hub name's snapshot folder in `cache` (the revision `refs/main` names).
pub fn resolve_in(cache: &Path, name: &str) -> Result<PathBuf, HubError> {
    let repo = cache.join(format!("models--{}", name.replace('/', "--")));
    let refs = repo.join("refs").join("main");
    let not_cached = |looked: String| HubError::NotCached {
        name: name.to_owned(),
        looked,
    };
    let rev = std::fs::read_to_string(&refs)
        .map_err(|_| not_cached(refs.display().to_string()))?
        .trim()
        .to_owned();
    // A revision is a commit hash: never a path of its own.
    if rev.is_empty() || !rev.chars().all(|c| c.is_ascii_alphanumeric()) {
        return Err(not_cached(format!(
            "{} (it holds {rev:?}, not a revision)",
            refs.display()
        )));
    }
    let snapshot = repo.join("snapshots").join(&rev);
    if snapshot.is_dir() {
        Ok(snapshot)
    } else {
        Err(not_cached(snapshot.display().to_string()))
    }
}

/// What a model path names: an existing file or folder as it is, else a Hub name from
/// the local cache.
pub fn resolve_model_path(path: &Path) -> Result<PathBuf, HubError> {
    if path.exists() {
        return Ok(path.to_path_buf());
    }
    match path.to_str() {
        Some(name) if is_hub_name(name) => resolve_in(&hub_cache(), name),
        _ => Err(HubError::NotFound(path.display().to_string())),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;

    #[test]
    fn hub_names_are_told_from_paths() {
        for name in [
            "Qwen/Qwen2.5-0.5B-Instruct",
            "HuggingFaceTB/SmolLM2-135M-Instruct",
        ] {
            assert!(is_hub_name(name), "{name}");
        }
        for path in [
            "model.gguf",
            "/abs/dir",
            "./a/b",
            "a/b/c",
            "../x",
            "a/",
            "/a",
            "a b/c",
        ] {
            assert!(!is_hub_name(path), "{path}");
        }
    }

    #[test]
    fn a_cached_name_resolves_to_the_snapshot_refs_main_names() {
        let cache = tempfile::tempdir().unwrap();
        let repo = cache.path().join("models--Qwen--Qwen2.5-0.5B-Instruct");
        let rev = "7ae557604adf67be50417f59c2c2f167def9a775";
        std::fs::create_dir_all(repo.join("snapshots").join(rev)).unwrap();
        std::fs::create_dir_all(repo.join("snapshots/0000000000000000000000000000000000000000"))
            .unwrap();
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::write(repo.join("refs/main"), format!("{rev}\n")).unwrap();
        assert_eq!(
            resolve_in(cache.path(), "Qwen/Qwen2.5-0.5B-Instruct").unwrap(),
            repo.join("snapshots").join(rev)
        );
    }

    #[test]
    fn a_name_not_in_the_cache_says_where_it_looked() {
        let cache = tempfile::tempdir().unwrap();
        let err = resolve_in(cache.path(), "Qwen/Qwen3-0.6B")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("models--Qwen--Qwen3-0.6B/refs/main") && err.contains("HF_HUB_CACHE"),
            "{err}"
        );
    }
}
