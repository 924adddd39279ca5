//! A spec mapped onto a pyenv + venv build (there is no conda here).
//!
//! - The interpreter is the newest installed pyenv release of the spec's minor version; a
//!   missing one is an error naming it (building one needs python.org).
//! - The environment is a venv, or a copy of the interpreter where the test command runs
//!   tox with `--current-env`: that plugin links the running interpreter into tox's own
//!   environment, and through the link a venv's interpreter no longer sees the venv.
//! - Python 3.6 and older get the last pip that runs there before anything else: their
//!   bundled pip predates the manylinux tags today's wheels carry.
//! - Dependencies resolve as PyPI stood on [`PYPI_AS_OF`], SWE-bench Verified's release
//!   (every pin of the 4.1.0 table is older): what was published since can break an old
//!   instance — docutils 0.22 dropped `docutils.utils.roman`, which Sphinx 3 imports, and
//!   the gold patches of sphinx 3.5 then fail. pip applies the date from 26.0 on, which
//!   needs Python 3.9; environments of older Pythons resolve as of the build (their
//!   instances here, django 3.1, validate so).
//! - `packages`: the repository's requirements file (read from the snapshot, with the
//!   lines the harness drops left out), a package list (conda names; those of the specs are
//!   PyPI names too), or a conda `environment.yml`, which is refused.
//! - `pre_install`: edits of the work tree run as they are; `apt-get install` lines name
//!   Debian packages the machine must have (an unprivileged build cannot install them);
//!   locale generation is left out, and the en_US.UTF-8 locale of the eval commands becomes
//!   C.UTF-8, which exists everywhere and gives the same test output.

use std::path::Path;

use crate::spec::{Spec, SpecError, requirements_paths, spec};

/// The build of one instance's environment. Every command runs in one bash, in the work
/// tree (`$TESTBED`, the snapshot unpacked there), with `$ENV_DIR` (the environment) and
/// `$WORK` (scratch) set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Setup {
    /// The pyenv version the environment is made from (`3.6.15`).
    pub python: String,
    /// Make `$ENV_DIR` and install the dependencies into it (nothing of the project).
    pub dependencies: Vec<String>,
    /// Puts the environment first on `PATH` (for the steps after `dependencies`).
    pub activate: String,
    /// The spec's edits of the work tree.
    pub prepare_tree: Vec<String>,
    /// The spec's install command.
    pub install: String,
    /// The install links the work tree rather than copying it, so one environment serves
    /// every instance of the version (the tree is always at the same path).
    pub editable: bool,
    /// Debian packages the spec installs with apt-get.
    pub system_packages: Vec<String>,
}

/// The setup of an instance of `repo` at `version`, with interpreters under `pyenv_root`.
pub fn plan_setup(repo: &str, version: &str, pyenv_root: &Path) -> Result<Setup, SpecError> {
    let spec = spec(repo, version)?;
    let python = interpreter(repo, version, &spec.python, pyenv_root)?;
    let bin = pyenv_root.join("versions").join(&python).join("bin");
    let (mut dependencies, activate) = if spec.test_cmd.contains("--current-env") {
        let prefix = pyenv_root.join("versions").join(&python);
        let activate = "export PATH=\"$ENV_DIR/bin:$PATH\"".to_owned();
        (
            vec![
                format!("cp -a {} \"$ENV_DIR\"", quote(&prefix.to_string_lossy())),
                activate.clone(),
            ],
            activate,
        )
    } else {
        let python_bin = bin.join(format!("python{}", spec.python));
        let activate = "source \"$ENV_DIR/bin/activate\"".to_owned();
        (
            vec![
                format!(
                    "{} -m venv \"$ENV_DIR\"",
                    quote(&python_bin.to_string_lossy())
                ),
                activate.clone(),
            ],
            activate,
        )
    };
    if let Some((pip, dated)) = pip_for(&spec.python) {
        dependencies.push(format!("python -m pip install {pip}"));
        if dated {
            // For every pip after it in this build, the install and its build isolation.
            dependencies.push(format!("export PIP_UPLOADED_PRIOR_TO={PYPI_AS_OF}"));
        }
    }
    dependencies.extend(packages(repo, version, spec)?);
    if !spec.pip_packages.is_empty() {
        dependencies.push(format!(
            "python -m pip install {}",
            spec.pip_packages.join(" ")
        ));
    }
    let (prepare_tree, system_packages) = pre_install(&spec.pre_install);
    Ok(Setup {
        python,
        dependencies,
        activate,
        prepare_tree,
        editable: editable(&spec.install),
        install: spec.install.clone(),
        system_packages,
    })
}

/// The newest `<minor>.N` under `pyenv_root/versions` that has its `python<minor>`.
fn interpreter(
    repo: &str,
    version: &str,
    minor: &str,
    pyenv_root: &Path,
) -> Result<String, SpecError> {
    let versions = pyenv_root.join("versions");
    let newest = std::fs::read_dir(&versions)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name().to_string_lossy().into_owned();
            let patch: u32 = name.strip_prefix(minor)?.strip_prefix('.')?.parse().ok()?;
            entry
                .path()
                .join("bin")
                .join(format!("python{minor}"))
                .is_file()
                .then_some((patch, name))
        })
        .max();
    newest
        .map(|(_, name)| name)
        .ok_or_else(|| SpecError::InterpreterMissing {
            repo: repo.to_owned(),
            version: version.to_owned(),
            python: minor.to_owned(),
            pyenv: versions.display().to_string(),
        })
}

/// The day dependencies are resolved as of (UTC): SWE-bench Verified's release.
pub const PYPI_AS_OF: &str = "2024-08-13T00:00:00Z";

/// The pip to install first, and whether it can resolve as of [`PYPI_AS_OF`]: the last
/// release that runs on an old Python, where the bundled one is too old to read today's
/// wheel tags; pip 26.0.1 (the last for 3.9, with `--uploaded-prior-to`) from 3.9 on.
fn pip_for(minor: &str) -> Option<(&'static str, bool)> {
    let (major, minor) = minor.split_once('.')?;
    let version = (major.parse::<u32>().ok()?, minor.parse::<u32>().ok()?);
    match version {
        (2, _) | (3, 0..=5) => Some(("'pip<21'", false)),
        (3, 6) => Some(("pip==21.3.1", false)),
        (3, 7 | 8) => None,
        _ => Some(("pip==26.0.1", true)),
    }
}

fn packages(repo: &str, version: &str, spec: &Spec) -> Result<Vec<String>, SpecError> {
    match spec.packages.as_deref().map(str::trim) {
        None | Some("") => Ok(Vec::new()),
        Some("requirements.txt") => requirements(repo, version),
        Some("environment.yml") => Err(SpecError::Unsupported {
            repo: repo.to_owned(),
            version: version.to_owned(),
            what: "a conda environment.yml".into(),
        }),
        Some(list) => Ok(vec![format!("python -m pip install {list}")]),
    }
}

/// Installs the repository's requirements file as the harness does: its first file found
/// among the spec's paths, without comments, `-e .` and `.[test…]` lines (they would
/// install the project itself), nested `-r` files read from beside it, and yanked
/// `types-pkg_resources` replaced by `types-setuptools`.
fn requirements(repo: &str, version: &str) -> Result<Vec<String>, SpecError> {
    let paths = requirements_paths(repo)?;
    if paths.is_empty() {
        return Err(SpecError::Unsupported {
            repo: repo.to_owned(),
            version: version.to_owned(),
            what: "a requirements file, and SWE-bench names none for the repository".into(),
        });
    }
    let candidates = paths.iter().map(|p| quote(p)).collect::<Vec<_>>().join(" ");
    Ok(vec![
        format!(
            "requirements=; for f in {candidates}; do if [ -f \"$f\" ]; then requirements=$f; break; fi; done"
        ),
        format!(
            "if [ -z \"$requirements\" ]; then echo 'no requirements file in the snapshot (looked for {})' >&2; exit 1; fi",
            paths.join(", ")
        ),
        "sed -e '/^[[:space:]]*#/d' -e '/^[[:space:]]*-e \\./d' -e '/^[[:space:]]*\\.\\[test/d' \
         -e 's/^types-pkg_resources.*/types-setuptools/' \
         -e \"s#^[[:space:]]*-r[[:space:]]*#-r $TESTBED/$(dirname \"$requirements\")/#\" \
         \"$requirements\" > \"$WORK/requirements.txt\""
            .to_owned(),
        "python -m pip install -r \"$WORK/requirements.txt\"".to_owned(),
    ])
}

/// The pre-install lines that edit the tree, and the Debian packages the others install.
fn pre_install(lines: &[String]) -> (Vec<String>, Vec<String>) {
    let mut tree = Vec::new();
    let mut system = Vec::new();
    for line in lines {
        if line.contains("apt-get") {
            system.extend(apt_packages(line));
        } else if !(line.contains("locale-gen") || line.contains("/etc/")) {
            tree.push(line.clone());
        }
    }
    system.sort();
    system.dedup();
    (tree, system)
}

/// The packages of every `apt-get install` in a line; `locales` is not needed (the locale
/// becomes C.UTF-8).
fn apt_packages(line: &str) -> Vec<String> {
    let mut packages = Vec::new();
    for command in line.split("&&").flat_map(|c| c.split(';')) {
        let words: Vec<&str> = command.split_whitespace().collect();
        let Some(at) = words.iter().position(|w| *w == "install") else {
            continue;
        };
        if !words[..at].contains(&"apt-get") {
            continue;
        }
        packages.extend(
            words[at + 1..]
                .iter()
                .filter(|w| !w.starts_with('-') && **w != "locales")
                .map(|w| (*w).to_owned()),
        );
    }
    packages
}

fn editable(install: &str) -> bool {
    install
        .split_whitespace()
        .any(|w| w == "-e" || w == "--editable")
}

/// The eval commands with locale generation left out and en_US.UTF-8 as C.UTF-8.
pub(crate) fn eval_env(lines: &[String]) -> Vec<String> {
    lines
        .iter()
        .filter(|l| !(l.contains("locale-gen") || l.contains("/etc/")))
        .map(|l| l.replace("en_US.UTF-8", "C.UTF-8"))
        .collect()
}

/// Single-quoted for bash.
fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pyenv root with the given versions (each with its `python<minor>`).
    fn pyenv(versions: &[&str]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for v in versions {
            let minor: Vec<&str> = v.split('.').take(2).collect();
            let bin = dir.path().join("versions").join(v).join("bin");
            std::fs::create_dir_all(&bin).unwrap();
            std::fs::write(bin.join(format!("python{}", minor.join("."))), "").unwrap();
        }
        dir
    }

    #[test]
    fn django_3_1_is_a_venv_of_the_newest_3_6_with_its_requirements() {
        let root = pyenv(&["3.6.9", "3.6.15", "3.7.16"]);
        let setup = plan_setup("django/django", "3.1", root.path()).unwrap();
        assert_eq!(setup.python, "3.6.15");
        let venv = root.path().join("versions/3.6.15/bin/python3.6");
        assert_eq!(
            setup.dependencies[0],
            format!("'{}' -m venv \"$ENV_DIR\"", venv.display())
        );
        assert_eq!(setup.dependencies[2], "python -m pip install pip==21.3.1");
        assert!(setup.dependencies[3].contains("'tests/requirements/py3.txt'"));
        assert!(
            setup
                .dependencies
                .last()
                .unwrap()
                .ends_with("pip install -r \"$WORK/requirements.txt\"")
        );
        assert_eq!(setup.install, "python -m pip install -e .");
        assert!(setup.editable);
        // The harness's locale steps are not run (no root); nothing else is dropped.
        assert!(setup.prepare_tree.is_empty() && setup.system_packages.is_empty());
    }

    #[test]
    fn every_sphinx_version_of_the_mini_set_is_an_interpreter_copy_with_its_edits() {
        let root = pyenv(&["3.9.18"]);
        for version in [
            "3.1", "3.2", "3.3", "3.4", "3.5", "4.0", "4.1", "4.2", "4.3", "5.0", "5.2", "7.2",
        ] {
            let setup = plan_setup("sphinx-doc/sphinx", version, root.path()).unwrap();
            assert_eq!(setup.python, "3.9.18", "{version}");
            assert!(setup.dependencies[0].starts_with("cp -a "), "{version}");
            assert_eq!(
                setup.dependencies.last().unwrap(),
                "python -m pip install tox==4.16.0 tox-current-env==0.0.11 Jinja2==3.0.3"
            );
            assert_eq!(
                setup.dependencies[2..4],
                [
                    "python -m pip install pip==26.0.1",
                    "export PIP_UPLOADED_PRIOR_TO=2024-08-13T00:00:00Z"
                ]
            );
            assert_eq!(
                setup.prepare_tree[0], "sed -i 's/pytest/pytest -rA/' tox.ini",
                "{version}"
            );
            assert_eq!(setup.install, "python -m pip install -e .[test]");
            assert!(setup.editable);
        }
        let v41 = plan_setup("sphinx-doc/sphinx", "4.1", root.path()).unwrap();
        assert!(
            v41.prepare_tree
                .iter()
                .any(|l| l.starts_with("grep -q 'sphinxcontrib-htmlhelp>=2.0.0' setup.py"))
        );
        let v72 = plan_setup("sphinx-doc/sphinx", "7.2", root.path()).unwrap();
        assert_eq!(v72.system_packages, ["graphviz"]);
        assert_eq!(v72.prepare_tree.len(), 1);
    }

    #[test]
    fn what_cannot_be_built_here_is_named() {
        let root = pyenv(&["3.6.15", "3.9.18"]);
        // Django 2.2's spec wants Python 3.5, which pyenv here lacks.
        let error = plan_setup("django/django", "2.2", root.path()).unwrap_err();
        assert!(
            matches!(&error, SpecError::InterpreterMissing { python, .. } if python == "3.5"),
            "{error}"
        );
        assert!(error.to_string().contains("pyenv install 3.5"));
        let error = plan_setup("pydata/xarray", "0.12", root.path())
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("environment.yml") || error.contains("Python"),
            "{error}"
        );
    }

    #[test]
    fn apt_lines_name_packages_and_locale_steps_are_dropped() {
        let (tree, system) = pre_install(&[
            "apt-get update && apt-get install -y locales".into(),
            "echo 'en_US UTF-8' > /etc/locale.gen".into(),
            "locale-gen en_US.UTF-8".into(),
            "apt-get -y update && apt-get -y upgrade && DEBIAN_FRONTEND=noninteractive apt-get install -y imagemagick ffmpeg".into(),
            "sed -i 's/a/b/' setup.cfg".into(),
        ]);
        assert_eq!(tree, ["sed -i 's/a/b/' setup.cfg"]);
        assert_eq!(system, ["ffmpeg", "imagemagick"]);
        assert_eq!(
            eval_env(&[
                "sed -i '/en_US.UTF-8/s/^# //g' /etc/locale.gen && locale-gen".into(),
                "export LANG=en_US.UTF-8".into(),
                "export PYTHONIOENCODING=utf8".into(),
            ]),
            ["export LANG=C.UTF-8", "export PYTHONIOENCODING=utf8"]
        );
    }

    #[test]
    fn copying_installs_are_not_shareable() {
        assert!(!editable("python -m pip install ."));
        assert!(!editable("python setup.py install"));
        assert!(editable(
            "python -m pip install -v --no-use-pep517 --no-build-isolation -e ."
        ));
    }
}
