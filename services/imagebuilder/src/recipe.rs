//! What an environment is made of: the interpreter it needs, the source repository holding
//! its base commit, and one setup script. The recipe's digest (of everything that shapes
//! the result) names the build, so a changed recipe is rebuilt and an unchanged one reused.
//!
//! A SWE-bench instance's recipe is its recorded one when an instances file has it (the
//! `instances.json` form of `../shared/data/swebench`: setup commands written out), else
//! derived from SWE-bench's own spec for its repository and version ([`arl_swebench`]).
//! A derived recipe whose install links the work tree shares one dependency environment
//! with every instance of the same repository, version and spec ([`SharedEnvironment`]):
//! only the work tree is built per instance.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use arl_runtime::digest::sha256_hex;
use arl_schemas::dataset::{Grading, TaskRecord};
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
    #[error("SWE-bench instance {0}: {1}")]
    Spec(String, arl_swebench::SpecError),
    #[error(
        "the dataset's base_commit {row} is not the commit its environment recipe ({environment}) builds, {built}: the patches would be graded on another tree"
    )]
    CommitMismatch {
        row: String,
        built: String,
        environment: String,
    },
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
    /// A git URL the script clones (no local copy of the repository: the build needs the
    /// network to reach it).
    Remote(String),
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
    /// The dependency environment this one shares with the other instances of its
    /// repository, version and spec; `script` then builds the work tree only.
    pub shared: Option<SharedEnvironment>,
    /// Debian packages the setup needs on the building machine (a build cannot install them).
    pub system_packages: Vec<String>,
}

/// A dependency environment (`/opt/arl`) built once and mounted read-only into every
/// environment that shares it. It is built from the snapshot of the first instance that
/// needs it, as SWE-bench's harness builds its environment image at one commit per version
/// (its `environment_setup_commit`, which the snapshots here do not hold).
#[derive(Clone, Debug, PartialEq)]
pub struct SharedEnvironment {
    /// Its folder under the environments root (`shared/swebench/django__django-3.1-<digest>`).
    pub name: String,
    /// Builds the environment, the work tree of the instance at hand included.
    pub script: String,
    pub digest: String,
}

/// Written into a shared environment by its build: the top-level `*.egg-info` folders its
/// install left in the work tree (a setuptools develop install keeps the project's metadata
/// there), which each instance's tree then makes for itself.
pub const TREE_METADATA: &str = "/opt/arl/tree-metadata";

/// Written into a shared environment whose install compiled extension modules into the
/// work tree (an editable install of a project with C code): another instance's tree would
/// lack them, so each instance then builds an environment of its own.
pub const TREE_COMPILED: &str = "/opt/arl/tree-compiled";

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
    /// Bare repositories (`<name>.git`, e.g. `django.git` for `django/django`) holding the
    /// base commits of instances without a recorded recipe; one missing is cloned from
    /// GitHub by the build.
    pub swebench_repos: Option<PathBuf>,
    pub pyenv_root: PathBuf,
}

/// What a SWE-bench task's row says about its environment.
#[derive(Clone, Copy, Debug)]
pub struct SweTask<'a> {
    pub instance_id: &'a str,
    pub repo: &'a str,
    pub version: Option<&'a str>,
    pub base_commit: &'a str,
}

impl<'a> SweTask<'a> {
    pub fn of(record: &'a TaskRecord) -> Option<Self> {
        match &record.grading {
            Grading::Swebench {
                repo,
                base_commit,
                version,
                ..
            } => Some(Self {
                instance_id: record.task_id.as_str(),
                repo,
                version: version.as_deref(),
                base_commit,
            }),
            _ => None,
        }
    }
}

impl Recipes {
    /// The SWE-bench instances of `files` (`instances.json` form; a later file's instance
    /// replaces an earlier one of the same id); interpreters are found under `pyenv_root`,
    /// source repositories of the others in `repos` (default: `repos/` beside the last
    /// instances file, if it exists).
    pub fn load(
        files: &[PathBuf],
        repos: Option<PathBuf>,
        pyenv_root: PathBuf,
    ) -> Result<Self, RecipeError> {
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
        recipes.swebench_repos = repos.or_else(|| {
            let beside = recipes.swebench_dir.join("repos");
            (!files.is_empty() && beside.is_dir()).then_some(beside)
        });
        Ok(recipes)
    }

    /// The recipe of a task's environment: `swebench/<id>` from the instances file, else
    /// from its row (`row`) and SWE-bench's spec; `harbor/<task>` from the task's folder
    /// under `dataset`.
    pub fn recipe(
        &self,
        kind: TaskKind,
        environment: &str,
        dataset: Option<&Path>,
        row: Option<SweTask<'_>>,
    ) -> Result<Recipe, RecipeError> {
        match kind {
            TaskKind::Swebench => {
                let id = environment.strip_prefix("swebench/").unwrap_or(environment);
                if let Some(instance) = self.swebench.get(id) {
                    if let Some(row) = row
                        && row.base_commit != instance.base_commit
                    {
                        return Err(RecipeError::CommitMismatch {
                            row: row.base_commit.to_owned(),
                            built: instance.base_commit.clone(),
                            environment: environment.to_owned(),
                        });
                    }
                    return Recipe::from_swe(instance, &self.swebench_dir, &self.pyenv_root);
                }
                let row = row.ok_or_else(|| RecipeError::NoSweRecipe(id.to_owned()))?;
                Recipe::from_spec(&row, self.source_of(row.repo), &self.pyenv_root)
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

impl Recipes {
    /// Where a repository's commits come from: `<repos>/<name>.git`, or GitHub.
    fn source_of(&self, repo: &str) -> Source {
        let name = repo.rsplit('/').next().unwrap_or(repo);
        self.swebench_repos
            .as_ref()
            .map(|repos| repos.join(format!("{name}.git")))
            .filter(|path| path.is_dir())
            .map_or_else(
                || Source::Remote(format!("https://github.com/{repo}.git")),
                Source::GitRepository,
            )
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
        check_instance(&instance.instance_id, &instance.base_commit)?;
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
            shared: None,
            system_packages: Vec::new(),
        })
    }

    /// The recipe SWE-bench's spec gives an instance with no recorded one: the snapshot
    /// from `source`, the spec's dependencies, its edits of the tree and its install, in
    /// the harness's order. An editable install shares its dependency environment.
    pub fn from_spec(
        row: &SweTask<'_>,
        source: Source,
        pyenv_root: &Path,
    ) -> Result<Self, RecipeError> {
        check_instance(row.instance_id, row.base_commit)?;
        let spec_error = |e| RecipeError::Spec(row.instance_id.to_owned(), e);
        let version = row
            .version
            .ok_or(arl_swebench::SpecError::NoVersion)
            .map_err(spec_error)?;
        let setup = arl_swebench::plan_setup(row.repo, version, pyenv_root).map_err(spec_error)?;
        let unpack = unpack_line(&source, row.base_commit);
        let whole = [
            std::slice::from_ref(&unpack),
            &setup.dependencies,
            &setup.prepare_tree,
            std::slice::from_ref(&setup.install),
        ]
        .concat()
        .join("\n");
        let pyenv = pyenv_root.to_string_lossy();
        let shared = setup.editable.then(|| {
            let digest = sha256_hex(
                format!(
                    "swebench-shared\n{}\n{version}\n{}\n{pyenv}\n{}\n{}\n{}",
                    row.repo,
                    setup.python,
                    setup.dependencies.join("\n"),
                    setup.prepare_tree.join("\n"),
                    setup.install,
                )
                .as_bytes(),
            );
            SharedEnvironment {
                name: format!(
                    "shared/swebench/{}-{version}-{}",
                    row.repo.replace('/', "__"),
                    &digest[..12]
                ),
                script: format!(
                    "{whole}\n(ls -d *.egg-info 2>/dev/null || true) > {TREE_METADATA}\n\
                     if [ -n \"$(find . -name '*.so' -print -quit)\" ]; then touch {TREE_COMPILED}; fi"
                ),
                digest,
            }
        });
        let script = match &shared {
            // The tree of this instance over the shared environment (read-only here):
            // the same edits, and the project's metadata where its install keeps it in
            // the tree.
            Some(_) => [
                std::slice::from_ref(&unpack),
                &setup.prepare_tree,
                &[
                    setup.activate.clone(),
                    format!("if [ -s {TREE_METADATA} ]; then python setup.py -q egg_info; fi"),
                ],
            ]
            .concat()
            .join("\n"),
            None => whole,
        };
        let digest = sha256_hex(
            format!(
                "swebench-spec\n{}\n{}\n{}\n{pyenv}\n{script}\n{}",
                row.instance_id,
                row.base_commit,
                setup.python,
                shared.as_ref().map_or("", |s| s.digest.as_str()),
            )
            .as_bytes(),
        );
        Ok(Self {
            name: format!("swebench/{}", row.instance_id),
            workdir: TESTBED.into(),
            python: Some(setup.python),
            source,
            script,
            digest,
            shared,
            system_packages: setup.system_packages,
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
            shared: None,
            system_packages: Vec::new(),
        })
    }
}

/// An instance id usable as a folder name, and a commit id.
fn check_instance(instance_id: &str, base_commit: &str) -> Result<(), RecipeError> {
    let invalid = |reason: &str| RecipeError::Invalid(instance_id.to_owned(), reason.into());
    let id_ok = !instance_id.is_empty()
        && instance_id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c));
    if !id_ok {
        return Err(invalid(
            "instance_id must be letters, digits, '.', '_' or '-'",
        ));
    }
    if base_commit.len() < 7 || !base_commit.chars().all(|c| c.is_ascii_hexdigit()) {
        return Err(invalid("base_commit must be a hex commit id"));
    }
    Ok(())
}

/// The line that puts the snapshot of `commit` into the work tree.
fn unpack_line(source: &Source, commit: &str) -> String {
    match source {
        Source::Remote(url) => format!(
            "git clone --quiet --bare {url} \"$WORK/source.git\"\n\
             git --git-dir=\"$WORK/source.git\" archive --format=tar {commit} | tar -x -C \"$TESTBED\""
        ),
        _ => format!(
            "git --git-dir=\"$SOURCE_REPO\" archive --format=tar {commit} | tar -x -C \"$TESTBED\""
        ),
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

    /// A pyenv root with the interpreters SWE-bench's specs for django 3.1 and sphinx need.
    fn pyenv() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for (version, minor) in [("3.6.15", "3.6"), ("3.9.18", "3.9")] {
            let bin = dir.path().join("versions").join(version).join("bin");
            std::fs::create_dir_all(&bin).unwrap();
            std::fs::write(bin.join(format!("python{minor}")), "").unwrap();
        }
        dir
    }

    fn row<'a>(id: &'a str, repo: &'a str, version: &'a str, commit: &'a str) -> SweTask<'a> {
        SweTask {
            instance_id: id,
            repo,
            version: Some(version),
            base_commit: commit,
        }
    }

    /// The recipe of a SWE-bench task, by its row (its environment named as the dataset
    /// service names it).
    fn swe_recipe(recipes: &Recipes, row: SweTask<'_>) -> Result<Recipe, RecipeError> {
        recipes.recipe(
            TaskKind::Swebench,
            &format!("swebench/{}", row.instance_id),
            None,
            Some(row),
        )
    }

    #[test]
    fn instances_of_one_version_share_one_dependency_environment() {
        let pyenv = pyenv();
        let repos = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(repos.path().join("django.git")).unwrap();
        let recipes = Recipes {
            swebench_repos: Some(repos.path().to_path_buf()),
            pyenv_root: pyenv.path().to_path_buf(),
            ..Recipes::default()
        };
        let recipe =
            |id, commit| swe_recipe(&recipes, row(id, "django/django", "3.1", commit)).unwrap();
        let a = recipe("django__django-11790", "aaaaaaa1");
        let b = recipe("django__django-12143", "bbbbbbb2");
        let (sa, sb) = (a.shared.clone().unwrap(), b.shared.clone().unwrap());
        assert_eq!(sa.name, sb.name);
        assert_eq!(sa.digest, sb.digest);
        assert!(sa.name.starts_with("shared/swebench/django__django-3.1-"));
        assert_eq!(a.python.as_deref(), Some("3.6.15"));
        assert_eq!(
            a.source,
            Source::GitRepository(repos.path().join("django.git"))
        );
        assert_ne!(a.digest, b.digest);
        // The shared build installs everything from its first instance's tree…
        assert!(sa.script.contains("archive --format=tar aaaaaaa1"));
        assert!(
            sa.script
                .contains("python -m pip install -r \"$WORK/requirements.txt\"")
        );
        assert!(sa.script.contains("python -m pip install -e ."));
        // …an instance's own build makes only its tree.
        assert!(b.script.contains("archive --format=tar bbbbbbb2"));
        assert!(!b.script.contains("pip install"), "{}", b.script);
        assert!(b.script.contains("setup.py -q egg_info"));
    }

    #[test]
    fn a_recorded_recipe_overrides_the_spec_and_a_missing_repository_is_cloned() {
        let pyenv = pyenv();
        let instances = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../../shared/data/swebench/instances.json");
        let recipes = Recipes::load(
            std::slice::from_ref(&instances),
            None,
            pyenv.path().to_path_buf(),
        )
        .unwrap();
        assert!(recipes.swebench_repos.as_ref().unwrap().ends_with("repos"));
        let recorded = swe_recipe(
            &recipes,
            row(
                "django__django-11880",
                "django/django",
                "3.1",
                "06909fe084f87a65459a83bd69d7cdbe4fce9a7c",
            ),
        )
        .unwrap();
        assert!(recorded.shared.is_none() && recorded.script.contains("EOF_59812759871"));
        // A row whose commit is not the recorded recipe's is refused, not built.
        let mismatch = swe_recipe(
            &recipes,
            row(
                "django__django-11880",
                "django/django",
                "3.1",
                "0123456789abcdef",
            ),
        )
        .unwrap_err();
        assert!(
            matches!(mismatch, RecipeError::CommitMismatch { .. }),
            "{mismatch}"
        );
        let sphinx = swe_recipe(
            &recipes,
            row(
                "sphinx-doc__sphinx-11445",
                "sphinx-doc/sphinx",
                "7.2",
                "71db08c0",
            ),
        )
        .unwrap();
        assert_eq!(sphinx.system_packages, ["graphviz"]);
        assert!(
            matches!(sphinx.source, Source::GitRepository(ref p) if p.ends_with("repos/sphinx.git"))
        );
        let astropy = swe_recipe(
            &recipes,
            row(
                "astropy__astropy-12907",
                "astropy/astropy",
                "4.3",
                "d16bfe05",
            ),
        )
        .unwrap();
        // No copy of astropy here: the build clones it.
        assert!(
            matches!(astropy.source, Source::Remote(ref url) if url == "https://github.com/astropy/astropy.git")
        );
        let requests = Recipe::from_spec(
            &row("psf__requests-2317", "psf/requests", "2.4", "091991be"),
            Source::Remote("https://github.com/psf/requests.git".into()),
            pyenv.path(),
        )
        .unwrap();
        // `pip install .` copies the project: nothing to share.
        assert!(requests.shared.is_none());
        assert!(
            requests
                .script
                .starts_with("git clone --quiet --bare https://github.com/psf/requests.git")
        );
        let error = swe_recipe(
            &recipes,
            SweTask {
                version: None,
                ..row("django__django-99999", "django/django", "", "abcdef01")
            },
        )
        .unwrap_err()
        .to_string();
        assert!(error.contains("version"), "{error}");
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
