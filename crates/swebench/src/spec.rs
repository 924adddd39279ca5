//! SWE-bench's spec table, embedded (`specs/swebench-4.1.0.json`).

use std::collections::BTreeMap;
use std::sync::OnceLock;

use serde::Deserialize;

/// The `swebench` release the embedded table comes from.
pub const SWEBENCH_VERSION: &str = "4.1.0";

/// One repository version's spec, as SWE-bench writes it (fields it has that no build
/// here uses — CPU quotas, conda-only switches — are not read).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct Spec {
    /// The Python minor version (`3.6`).
    pub python: String,
    /// `requirements.txt` (the repository's requirements file), `environment.yml` (a
    /// conda environment file) or a list of packages to install.
    #[serde(default)]
    pub packages: Option<String>,
    /// Pinned packages installed after `packages`.
    #[serde(default)]
    pub pip_packages: Vec<String>,
    /// Steps before the install: edits of the work tree, system packages.
    #[serde(default)]
    pub pre_install: Vec<String>,
    /// Installs the repository into the environment.
    pub install: String,
    /// Lines the eval script runs before the tests.
    #[serde(default)]
    pub eval_commands: Vec<String>,
    /// The test command; the directives follow it.
    pub test_cmd: String,
}

#[derive(Debug, Deserialize)]
struct Table {
    swebench_version: String,
    specs: BTreeMap<String, BTreeMap<String, Spec>>,
    /// Where a repository's requirements file is, first match wins.
    requirements_paths: BTreeMap<String, Vec<String>>,
    /// Extensions of changed files that are not tests (left out of the directives).
    non_test_exts: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    #[error("the embedded SWE-bench spec table is unreadable: {0}")]
    Table(String),
    #[error(
        "SWE-bench {SWEBENCH_VERSION} has no spec for repository {repo:?} (it has: {known}): give the instance a recorded recipe (--swebench-recipes)"
    )]
    UnknownRepository { repo: String, known: String },
    #[error(
        "SWE-bench {SWEBENCH_VERSION} has no spec for {repo} version {version:?} (it has: {known}): check the row's `version`, or give the instance a recorded recipe (--swebench-recipes)"
    )]
    UnknownVersion {
        repo: String,
        version: String,
        known: String,
    },
    #[error(
        "{repo} {version}: its SWE-bench spec needs {what}, which builds here cannot do; give the instance a recorded recipe (--swebench-recipes)"
    )]
    Unsupported {
        repo: String,
        version: String,
        what: String,
    },
    #[error(
        "{repo} {version} needs Python {python} (its SWE-bench spec), and no {python}.x is installed under {pyenv}: install one with `pyenv install {python}` (building it needs python.org)"
    )]
    InterpreterMissing {
        repo: String,
        version: String,
        python: String,
        pyenv: String,
    },
    #[error(
        "the test patch of this {repo} instance changes no test file (only data or docs): there is nothing to run"
    )]
    NoDirectives { repo: String },
    #[error("the task has no SWE-bench version: its dataset row needs a `version` field")]
    NoVersion,
}

fn table() -> Result<&'static Table, SpecError> {
    static TABLE: OnceLock<Result<Table, String>> = OnceLock::new();
    TABLE
        .get_or_init(|| {
            serde_json::from_str(include_str!("../specs/swebench-4.1.0.json"))
                .map_err(|e| e.to_string())
        })
        .as_ref()
        .map_err(|e| SpecError::Table(e.clone()))
}

/// The spec of `repo` (`owner/name`) at `version` (the dataset's `version` field).
pub fn spec(repo: &str, version: &str) -> Result<&'static Spec, SpecError> {
    let table = table()?;
    let versions = table
        .specs
        .get(repo)
        .ok_or_else(|| SpecError::UnknownRepository {
            repo: repo.to_owned(),
            known: table.specs.keys().cloned().collect::<Vec<_>>().join(", "),
        })?;
    versions
        .get(version)
        .ok_or_else(|| SpecError::UnknownVersion {
            repo: repo.to_owned(),
            version: version.to_owned(),
            known: versions.keys().cloned().collect::<Vec<_>>().join(", "),
        })
}

/// The paths a repository keeps its requirements file at, first match wins.
pub fn requirements_paths(repo: &str) -> Result<&'static [String], SpecError> {
    Ok(table()?
        .requirements_paths
        .get(repo)
        .map_or(&[][..], Vec::as_slice))
}

pub(crate) fn non_test_exts() -> Result<&'static [String], SpecError> {
    Ok(&table()?.non_test_exts)
}

/// The release the table was read from (its file names it too; this checks they agree).
pub fn table_version() -> Result<&'static str, SpecError> {
    Ok(&table()?.swebench_version)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_embedded_table_is_swebench_4_1_0() {
        assert_eq!(table_version().unwrap(), SWEBENCH_VERSION);
        let django = spec("django/django", "3.1").unwrap();
        assert_eq!(django.python, "3.6");
        assert_eq!(django.packages.as_deref(), Some("requirements.txt"));
        assert_eq!(django.install, "python -m pip install -e .");
        assert_eq!(
            requirements_paths("django/django").unwrap(),
            ["tests/requirements/py3.txt"]
        );
        assert!(requirements_paths("sphinx-doc/sphinx").unwrap().is_empty());
        assert!(non_test_exts().unwrap().iter().any(|e| e == ".txt"));
    }

    #[test]
    fn unknown_repositories_and_versions_name_what_is_known() {
        let error = spec("octo/cat", "1.0").unwrap_err().to_string();
        assert!(error.contains("octo/cat") && error.contains("django/django"));
        let error = spec("django/django", "9.9").unwrap_err().to_string();
        assert!(
            error.contains("\"9.9\"") && error.contains("3.1"),
            "{error}"
        );
    }
}
