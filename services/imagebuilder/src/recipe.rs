//! What an environment is made of. A SWE-bench instance (the `instances.json` form of
//! `../shared/data/swebench`: the harness's setup commands for that repository and version)
//! becomes a recipe: the interpreter it needs, the source repository holding its base
//! commit, and one setup script. The recipe's digest (of everything that shapes the
//! result) names the build, so a changed recipe is rebuilt and an unchanged one reused.

use std::path::{Path, PathBuf};

use serde::Deserialize;

/// The fields of one `instances.json` entry the builder uses.
#[derive(Clone, Debug, Deserialize)]
pub struct SweInstance {
    pub instance_id: String,
    pub repo: String,
    pub version: String,
    pub base_commit: String,
    /// The bare repository holding `base_commit`, relative to the instances file.
    pub source_repo: String,
    /// The interpreter version the harness's spec names (e.g. `3.6.15`).
    pub python: String,
    pub setup_commands: Vec<String>,
    #[serde(default)]
    pub eval_env: Vec<String>,
    pub test_command: String,
}

#[derive(Debug, thiserror::Error)]
pub enum RecipeError {
    #[error("{path}: {reason}")]
    Read { path: String, reason: String },
    #[error("instance {0}: {1}")]
    Invalid(String, String),
}

/// How to build one environment.
#[derive(Clone, Debug, PartialEq)]
pub struct Recipe {
    /// The environment's name under the environments root (`swebench/<instance_id>`).
    pub name: String,
    /// A pyenv version to mount at its pyenv path, if the setup needs one.
    pub python: Option<String>,
    /// Mounted read-only at [`SOURCE_REPO`] during the build.
    pub source_repo: PathBuf,
    /// The setup commands, run in order by one bash.
    pub script: String,
    /// sha256 of everything that shapes the result.
    pub digest: String,
}

/// Where things are during a build and in every sandbox of the environment.
pub const TESTBED: &str = "/testbed";
pub const OPT: &str = "/opt/arl";
pub const ENV_DIR: &str = "/opt/arl/env";
pub const WORK: &str = "/opt/arl/work";
pub const SOURCE_REPO: &str = "/opt/arl-source.git";

pub fn load_instances(path: &Path) -> Result<Vec<SweInstance>, RecipeError> {
    let read = |reason: String| RecipeError::Read {
        path: path.display().to_string(),
        reason,
    };
    let bytes = std::fs::read(path).map_err(|e| read(e.to_string()))?;
    serde_json::from_slice(&bytes).map_err(|e| read(e.to_string()))
}

impl Recipe {
    /// The recipe of a SWE-bench instance; `instances_dir` resolves its `source_repo`,
    /// `pyenv_root` replaces `$HOME/.pyenv` in its commands (the build's HOME differs).
    pub fn from_swe(
        instance: &SweInstance,
        instances_dir: &Path,
        pyenv_root: &Path,
    ) -> Result<Self, RecipeError> {
        let invalid =
            |reason: &str| RecipeError::Invalid(instance.instance_id.clone(), reason.into());
        let id_ok = !instance.instance_id.is_empty()
            && instance
                .instance_id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c));
        if !id_ok {
            return Err(invalid(
                "instance_id must be letters, digits, '.', '_' or '-'",
            ));
        }
        if instance.base_commit.len() < 7
            || !instance.base_commit.chars().all(|c| c.is_ascii_hexdigit())
        {
            return Err(invalid("base_commit must be a hex commit id"));
        }
        if instance.setup_commands.is_empty() {
            return Err(invalid("setup_commands is empty"));
        }
        let pyenv = pyenv_root.to_string_lossy();
        let script = instance
            .setup_commands
            .iter()
            .map(|c| c.replace("$HOME/.pyenv", &pyenv))
            .collect::<Vec<_>>()
            .join("\n");
        let source_repo = instances_dir.join(&instance.source_repo);
        let digest = sha256_hex(
            format!(
                "swebench\n{}\n{}\n{}\n{}\n{}",
                instance.instance_id, instance.base_commit, instance.python, pyenv, script
            )
            .as_bytes(),
        );
        Ok(Self {
            name: format!("swebench/{}", instance.instance_id),
            python: Some(instance.python.clone()),
            source_repo,
            script,
            digest,
        })
    }
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    ring::digest::digest(&ring::digest::SHA256, bytes)
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn instance() -> SweInstance {
        SweInstance {
            instance_id: "django__django-11880".into(),
            repo: "django/django".into(),
            version: "3.1".into(),
            base_commit: "06909fe084f87a65459a83bd69d7cdbe4fce9a7c".into(),
            source_repo: "repos/django.git".into(),
            python: "3.6.15".into(),
            setup_commands: vec![
                "$HOME/.pyenv/versions/3.6.15/bin/python3.6 -m venv \"$ENV_DIR\"".into(),
            ],
            eval_env: vec![],
            test_command: "./tests/runtests.py".into(),
        }
    }

    #[test]
    fn recipes_are_named_resolved_and_digested() {
        let r =
            Recipe::from_swe(&instance(), Path::new("/data"), Path::new("/root/.pyenv")).unwrap();
        assert_eq!(r.name, "swebench/django__django-11880");
        assert_eq!(r.source_repo, Path::new("/data/repos/django.git"));
        assert!(
            r.script
                .starts_with("/root/.pyenv/versions/3.6.15/bin/python3.6 -m venv")
        );
        let mut changed = instance();
        changed.setup_commands.push("pip install x".into());
        let other =
            Recipe::from_swe(&changed, Path::new("/data"), Path::new("/root/.pyenv")).unwrap();
        assert_ne!(r.digest, other.digest);
        assert_eq!(
            r.digest,
            Recipe::from_swe(&instance(), Path::new("/data"), Path::new("/root/.pyenv"))
                .unwrap()
                .digest
        );
    }

    #[test]
    fn bad_instances_are_refused_with_the_field() {
        let mut bad = instance();
        bad.instance_id = "../x".into();
        assert!(
            Recipe::from_swe(&bad, Path::new("/d"), Path::new("/p"))
                .unwrap_err()
                .to_string()
                .contains("instance_id")
        );
        let mut bad = instance();
        bad.base_commit = "main".into();
        assert!(
            Recipe::from_swe(&bad, Path::new("/d"), Path::new("/p"))
                .unwrap_err()
                .to_string()
                .contains("base_commit")
        );
    }

    #[test]
    fn the_shared_instances_file_loads() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../../shared/data/swebench/instances.json");
        let instances = load_instances(&path).unwrap();
        assert_eq!(instances.len(), 6);
        for i in &instances {
            Recipe::from_swe(i, path.parent().unwrap(), Path::new("/root/.pyenv")).unwrap();
        }
    }
}
