//! What an environment is made of. A SWE-bench instance (the `instances.json` form of
//! `../shared/data/swebench`: the harness's setup commands for that repository and version)
//! becomes a recipe: the interpreter it needs, the source repository holding its base
//! commit, and one setup script. The recipe's digest (of everything that shapes the
//! result) names the build, so a changed recipe is rebuilt and an unchanged one reused.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use arl_runtime::digest::sha256_hex;
use arl_schemas::events::TaskKind;
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
    #[error(
        "no setup recipe for SWE-bench instance {0}: give the image builder an instances file that has it (--swebench-recipes)"
    )]
    NoSweRecipe(String),
    #[error("run has no dataset path to find Harbor task {0}")]
    NoDataset(String),
    #[error("math tasks have no environment to build")]
    NothingToBuild,
}

/// Where an environment's files come from.
#[derive(Clone, Debug, PartialEq)]
pub enum Source {
    /// A bare git repository, mounted read-only at [`SOURCE_REPO`] (the script checks out).
    GitRepository(PathBuf),
    /// A folder whose contents become the work tree.
    Folder(PathBuf),
    /// A tar archive (of the repository at its base commit), mounted read-only at
    /// [`SOURCE_REPO`] for the script to unpack.
    Tarball(PathBuf),
}

/// How to build one environment.
#[derive(Clone, Debug, PartialEq)]
pub struct Recipe {
    /// The environment's name under the environments root (`swebench/<instance_id>`).
    pub name: String,
    /// Where the work tree is, in the build and in every sandbox.
    pub workdir: String,
    /// A pyenv version to mount at its pyenv path, if the setup needs one.
    pub python: Option<String>,
    pub source: Source,
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

/// Where recipes come from.
#[derive(Clone, Debug, Default)]
pub struct Recipes {
    /// SWE-bench instances with their setup commands (`instances.json` form), by id.
    pub swebench: HashMap<String, SweInstance>,
    /// Folder the instances' `source_repo` paths are relative to.
    pub swebench_dir: PathBuf,
    pub pyenv_root: PathBuf,
}

impl Recipes {
    /// The SWE-bench instances of `files` (`instances.json` form; a later file's instance
    /// replaces an earlier one of the same id); interpreters are found under `pyenv_root`.
    pub fn load(files: &[PathBuf], pyenv_root: PathBuf) -> Result<Self, RecipeError> {
        let mut recipes = Self {
            pyenv_root,
            ..Self::default()
        };
        for file in files {
            for instance in load_instances(file)? {
                recipes
                    .swebench
                    .insert(instance.instance_id.clone(), instance);
            }
            if let Some(dir) = file.parent() {
                recipes.swebench_dir = dir.to_path_buf();
            }
        }
        Ok(recipes)
    }

    /// The recipe of a task's environment (`swebench/<id>` from the instances,
    /// `harbor/<task>` from the task's folder under `dataset`).
    pub fn recipe(
        &self,
        kind: TaskKind,
        environment: &str,
        dataset: Option<&Path>,
    ) -> Result<Recipe, RecipeError> {
        match kind {
            TaskKind::Swebench => {
                let id = environment.strip_prefix("swebench/").unwrap_or(environment);
                let instance = self
                    .swebench
                    .get(id)
                    .ok_or_else(|| RecipeError::NoSweRecipe(id.to_owned()))?;
                Recipe::from_swe(instance, &self.swebench_dir, &self.pyenv_root)
            }
            TaskKind::Harbor => {
                let task = environment.strip_prefix("harbor/").unwrap_or(environment);
                let dataset = dataset.ok_or_else(|| RecipeError::NoDataset(task.to_owned()))?;
                Recipe::from_harbor(&dataset.join(task))
            }
            TaskKind::Math => Err(RecipeError::NothingToBuild),
        }
    }
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
            workdir: TESTBED.into(),
            python: Some(instance.python.clone()),
            source: if instance.source_repo.ends_with(".tar")
                || instance.source_repo.ends_with(".tar.gz")
                || instance.source_repo.ends_with(".tgz")
            {
                Source::Tarball(source_repo)
            } else {
                Source::GitRepository(source_repo)
            },
            script,
            digest,
        })
    }

    /// The recipe of a Harbor task folder (`environment/Dockerfile`): its `WORKDIR` is the
    /// work tree and the folder it `COPY`s there is its content. Other instructions need
    /// a container build (the cluster path) and are refused here with the line.
    pub fn from_harbor(task_dir: &Path) -> Result<Self, RecipeError> {
        let task = task_dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let invalid = |reason: String| RecipeError::Invalid(task.clone(), reason);
        let dockerfile_path = task_dir.join("environment/Dockerfile");
        let dockerfile =
            std::fs::read_to_string(&dockerfile_path).map_err(|e| RecipeError::Read {
                path: dockerfile_path.display().to_string(),
                reason: e.to_string(),
            })?;
        let mut workdir = "/app".to_owned();
        let mut copied = None;
        for line in dockerfile
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
        {
            let (instruction, rest) = line.split_once(char::is_whitespace).unwrap_or((line, ""));
            match instruction.to_ascii_uppercase().as_str() {
                "FROM" | "ENV" | "LABEL" => {}
                "WORKDIR" => workdir = rest.trim().to_owned(),
                "COPY" => {
                    let parts: Vec<&str> = rest.split_whitespace().collect();
                    match parts.as_slice() {
                        [from, to] if to.trim_end_matches('/') == workdir.trim_end_matches('/') => {
                            copied = Some(
                                copy_source(task_dir, from)
                                    .map_err(|reason| invalid(format!("{line:?}: {reason}")))?,
                            );
                        }
                        _ => {
                            return Err(invalid(format!(
                                "{line:?}: only `COPY <folder>/ <WORKDIR>/` can be built locally"
                            )));
                        }
                    }
                }
                _ => {
                    return Err(invalid(format!(
                        "{line:?}: needs a container build; local snapshots take WORKDIR and COPY only"
                    )));
                }
            }
        }
        let folder = copied
            .ok_or_else(|| invalid("the Dockerfile copies nothing into its WORKDIR".into()))?;
        if !folder.is_dir() {
            return Err(invalid(format!("{} is not a folder", folder.display())));
        }
        let digest =
            sha256_hex(format!("harbor\n{task}\n{workdir}\n{}", folder_digest(&folder)).as_bytes());
        Ok(Self {
            name: format!("harbor/{task}"),
            workdir,
            python: None,
            source: Source::Folder(folder),
            script: String::new(),
            digest,
        })
    }
}

/// The folder a Harbor `COPY` names, which must lie inside the task's `environment/` (its
/// build context): an absolute path, `..` or a link out of it would put files of the
/// building machine into the environment.
fn copy_source(task_dir: &Path, from: &str) -> Result<std::path::PathBuf, String> {
    let relative = Path::new(from.trim_end_matches('/'));
    if relative.is_absolute()
        || relative.components().any(|c| {
            !matches!(
                c,
                std::path::Component::Normal(_) | std::path::Component::CurDir
            )
        })
    {
        return Err(format!(
            "COPY sources must be folders inside environment/ (no absolute path, no `..`), got {from:?}"
        ));
    }
    let context = task_dir.join("environment");
    let folder = context.join(relative);
    if let (Ok(resolved), Ok(root)) = (folder.canonicalize(), context.canonicalize())
        && !resolved.starts_with(&root)
    {
        return Err(format!(
            "COPY source {from:?} leads out of environment/ (to {})",
            resolved.display()
        ));
    }
    Ok(folder)
}

/// A digest of a folder's file names and contents (sorted, so stable).
fn folder_digest(folder: &Path) -> String {
    let mut entries = Vec::new();
    let mut stack = vec![folder.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(read) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in read.flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else {
                let name = path
                    .strip_prefix(folder)
                    .unwrap_or(&path)
                    .to_string_lossy()
                    .into_owned();
                entries.push((name, sha256_hex(&std::fs::read(&path).unwrap_or_default())));
            }
        }
    }
    entries.sort();
    sha256_hex(format!("{entries:?}").as_bytes())
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
        assert_eq!(
            r.source,
            Source::GitRepository("/data/repos/django.git".into())
        );
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
    fn harbor_tasks_become_folder_recipes() {
        let tasks = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/tasks");
        let r = Recipe::from_harbor(&tasks.join("fix-mean")).unwrap();
        assert_eq!(
            (r.name.as_str(), r.workdir.as_str()),
            ("harbor/fix-mean", "/app")
        );
        assert!(matches!(r.source, Source::Folder(ref f) if f.ends_with("environment/app")));
        assert_eq!(
            r.digest,
            Recipe::from_harbor(&tasks.join("fix-mean")).unwrap().digest
        );
        assert_ne!(
            r.digest,
            Recipe::from_harbor(&tasks.join("fix-fizzbuzz"))
                .unwrap()
                .digest
        );
        let dir = std::env::temp_dir().join(format!("arl-harbor-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("environment")).unwrap();
        std::fs::write(
            dir.join("environment/Dockerfile"),
            "FROM python:3.11\nRUN pip install numpy\n",
        )
        .unwrap();
        let error = Recipe::from_harbor(&dir).unwrap_err().to_string();
        assert!(
            error.contains("RUN pip install numpy") && error.contains("container build"),
            "{error}"
        );
        // COPY sources outside the build context: refused with the line.
        std::os::unix::fs::symlink("/etc", dir.join("environment/etc-link")).unwrap();
        for from in ["/etc", "../../", "app/../../x", "etc-link"] {
            std::fs::write(
                dir.join("environment/Dockerfile"),
                format!("FROM python:3.11\nWORKDIR /app\nCOPY {from} /app/\n"),
            )
            .unwrap();
            let error = Recipe::from_harbor(&dir).unwrap_err().to_string();
            assert!(
                error.contains("environment/") && error.contains(from),
                "{from}: {error}"
            );
        }
        std::fs::remove_dir_all(dir).unwrap();
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
