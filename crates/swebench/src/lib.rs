//! SWE-bench's environment and test specs, mapped onto the builds this project makes.
//!
//! The table is SWE-bench's own (`MAP_REPO_VERSION_TO_SPECS` of the PyPI `swebench`
//! package, written to `specs/swebench-<version>.json` by `scripts/swebench-specs.py`): per
//! repository and version, the Python version, the packages, the pre-install steps, the
//! install command and the test command. SWE-bench's harness makes a conda environment
//! image and an instance image of it; here ([`setup`]) it becomes a pyenv interpreter with
//! a venv, the dependencies installed into it, the spec's edits of the work tree and its
//! install command. [`directives`] derives the test labels from a test patch as the
//! harness does, and [`test_run`] the command that runs them.

pub mod directives;
pub mod setup;
pub mod spec;

pub use directives::test_directives;
pub use setup::{Setup, plan_setup};
pub use spec::{Spec, SpecError, spec};

/// How an instance's tests are run: environment lines, then one command.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TestRun {
    pub eval_env: Vec<String>,
    pub test_command: String,
}

/// The test run of an instance of `repo` at `version` whose tests `test_patch` changes: the
/// spec's test command with the patch's directives, as SWE-bench's eval script runs it.
pub fn test_run(repo: &str, version: &str, test_patch: &str) -> Result<TestRun, SpecError> {
    let spec = spec(repo, version)?;
    let directives = test_directives(repo, test_patch)?;
    if directives.is_empty() {
        return Err(SpecError::NoDirectives {
            repo: repo.to_owned(),
        });
    }
    Ok(TestRun {
        eval_env: setup::eval_env(&spec.eval_commands),
        test_command: format!("{} {}", spec.test_cmd, directives.join(" ")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const FORMS_PATCH: &str = "diff --git a/tests/forms_tests/tests/test_forms.py b/tests/forms_tests/tests/test_forms.py\n--- a/tests/forms_tests/tests/test_forms.py\n+++ b/tests/forms_tests/tests/test_forms.py\n@@ -1 +1 @@\n-a\n+b\n";

    #[test]
    fn django_3_1_runs_the_recorded_command() {
        // instances.json's django__django-11880, recorded by running the harness's script.
        let run = test_run("django/django", "3.1", FORMS_PATCH).unwrap();
        assert_eq!(
            run.test_command,
            "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1 forms_tests.tests.test_forms"
        );
        assert_eq!(
            run.eval_env,
            [
                "export LANG=C.UTF-8",
                "export LANGUAGE=en_US:en",
                "export LC_ALL=C.UTF-8"
            ]
        );
    }

    #[test]
    fn a_patch_without_tests_is_an_error() {
        let patch = "diff --git a/docs/x.txt b/docs/x.txt\n";
        let error = test_run("sphinx-doc/sphinx", "4.1", patch).unwrap_err();
        assert!(error.to_string().contains("no test file"), "{error}");
    }
}
