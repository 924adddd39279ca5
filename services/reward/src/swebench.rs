//! How a SWE-bench patch is evaluated in a clean sandbox of the instance's environment
//! (a fresh lease: the work tree is at the base commit and the agent never saw the tests).
//!
//! The candidate is the policy's patch, and the policy is an adversary of this grader: it
//! learns whatever raises its reward. So, in order:
//!
//! 1. apply the candidate;
//! 2. undo what it did to the test machinery — every file the test patch touches, and
//!    anything of the candidate's under a test folder, a test file, a `conftest.py`, a
//!    runner configuration (`pytest.ini`, `tox.ini`, `tests/runtests.py`) or an
//!    interpreter start-up hook (`sitecustomize.py`, `usercustomize.py`, `*.pth`) goes back
//!    to the base commit (deleted if the base has no such file) — as the official harness
//!    restores test files before applying the test patch, and further;
//! 3. apply the instance's test patch; if it does not apply, the grading is an error, never
//!    a run of whatever is there;
//! 4. add a canary: two tests of unguessable names, one that must pass and one that must
//!    fail, run with the instance's tests. A candidate that turns failures into passes
//!    inside the test process (a monkeypatched runner, a report plugin, `os._exit(0)`, a
//!    filtered stdout) breaks the canary too, and the grade is then 0;
//! 5. run the test command between markers that carry the same nonce, so that output the
//!    candidate prints cannot pose as the harness's.
//!
//! The log goes to [`crate::grading::grade`].

use std::collections::BTreeSet;

use crate::logparse::Parser;

/// Files to write into the work tree (relative paths), then one command to run there.
#[derive(Clone, Debug, PartialEq)]
pub struct EvalPlan {
    pub files: Vec<(String, String)>,
    pub command: String,
}

/// Where the patches are written, inside the work tree.
pub const CANDIDATE_PATCH: &str = ".arl-eval/candidate.patch";
pub const TEST_PATCH: &str = ".arl-eval/test.patch";
/// Printed when the test patch does not apply: the grading cannot be done.
pub const TEST_PATCH_FAILED: &str = ">>>>> Test Patch Apply Failed";

/// The secret of one grading: the markers' suffix and the canary's names derive from it.
/// Made from fresh randomness for every grading (see [`Guard::new`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Guard {
    nonce: String,
}

/// The two canary tests of one grading, by the names the repository's log parser gives them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Canary {
    pub must_pass: String,
    pub must_fail: String,
}

impl Guard {
    /// `nonce`: at least 12 letters and digits, unpredictable (a v4 uuid's simple form).
    pub fn new(nonce: &str) -> Self {
        let nonce: String = nonce
            .chars()
            .filter(char::is_ascii_alphanumeric)
            .map(|c| c.to_ascii_lowercase())
            .collect();
        Self { nonce }
    }

    pub fn start_marker(&self) -> String {
        format!(">>>>> Start Test Output {}", self.nonce)
    }

    pub fn end_marker(&self) -> String {
        format!(">>>>> End Test Output {}", self.nonce)
    }

    /// Name `i` of three: `t` + a third of the nonce's letters and digits.
    pub(crate) fn word(&self, i: usize) -> String {
        let third = self.nonce.len() / 3;
        format!("t{}", &self.nonce[i * third..(i + 1) * third])
    }

    /// The canary's files, the argument that adds it to the test command, and its tests.
    fn canary(&self, parser: Parser) -> (Vec<(String, String)>, String, Canary) {
        let (module, pass, fail) = (self.word(0), self.word(1), self.word(2));
        match parser {
            Parser::Pytest => {
                let path = format!("test_{module}.py");
                let body = format!(
                    "def test_{pass}():\n    assert 1 + 1 == 2\n\n\ndef test_{fail}():\n    assert 1 + 1 == 3\n"
                );
                let canary = Canary {
                    must_pass: format!("{path}::test_{pass}"),
                    must_fail: format!("{path}::test_{fail}"),
                };
                (vec![(path.clone(), body)], path, canary)
            }
            Parser::Django => {
                // A test package beside the instance's under tests/, run by its label.
                let dir = format!("tests/{module}");
                let body = format!(
                    "from django.test import SimpleTestCase\n\n\nclass Checks(SimpleTestCase):\n    def test_{pass}(self):\n        self.assertEqual(1 + 1, 2)\n\n    def test_{fail}(self):\n        self.assertEqual(1 + 1, 3)\n"
                );
                let canary = Canary {
                    must_pass: format!("test_{pass} ({module}.tests.Checks)"),
                    must_fail: format!("test_{fail} ({module}.tests.Checks)"),
                };
                (
                    vec![
                        (format!("{dir}/__init__.py"), String::new()),
                        (format!("{dir}/tests.py"), body),
                    ],
                    module,
                    canary,
                )
            }
        }
    }
}

/// The paths a unified diff touches: (every path it names, the ones it creates).
pub fn patch_paths(patch: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    let (mut touched, mut created) = (BTreeSet::new(), BTreeSet::new());
    let mut current: Option<String> = None;
    for line in patch.lines() {
        if let Some(rest) = line.strip_prefix("diff --git ") {
            // `a/X b/Y`: both sides count (a rename moves X to Y).
            let mut sides = rest.split(' ').filter_map(|s| {
                s.strip_prefix("a/")
                    .or_else(|| s.strip_prefix("b/"))
                    .map(str::to_owned)
            });
            if let (Some(a), Some(b)) = (sides.next(), sides.next()) {
                touched.insert(a);
                touched.insert(b.clone());
                current = Some(b);
            }
        } else if let Some(path) = line.strip_prefix("+++ b/") {
            touched.insert(path.to_owned());
        } else if let Some(path) = line.strip_prefix("--- a/") {
            touched.insert(path.to_owned());
        } else if line.starts_with("new file mode")
            && let Some(path) = &current
        {
            created.insert(path.clone());
        }
    }
    (touched, created)
}

/// Whether a path belongs to the test machinery, which a candidate may not change.
pub fn is_protected(path: &str) -> bool {
    let parts: Vec<&str> = path.split('/').collect();
    let name = parts.last().copied().unwrap_or_default();
    let in_test_dir = parts[..parts.len().saturating_sub(1)]
        .iter()
        .any(|p| matches!(*p, "tests" | "test" | "testing"));
    in_test_dir
        || matches!(name, "tests" | "test" | "testing")
        || (name.starts_with("test_") && name.ends_with(".py"))
        || name.ends_with("_test.py")
        || matches!(
            name,
            "conftest.py"
                | "pytest.ini"
                | "tox.ini"
                | "runtests.py"
                | "sitecustomize.py"
                | "usercustomize.py"
        )
        || name.ends_with(".pth")
}

/// Single-quoted for `/bin/sh`.
pub(crate) fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// Shell lines that put `paths` back as the base commit has them: a file the base has is
/// checked out again (which also replaces a symlink the candidate put there); one it has
/// not is removed.
pub(crate) fn restore_to_base(paths: &BTreeSet<String>) -> String {
    let mut script = String::new();
    for path in paths {
        let q = quote(path);
        script.push_str(&format!(
            "if git -c safe.directory='*' cat-file -e HEAD:{q} 2>/dev/null; then rm -rf -- {q}; \
             git -c safe.directory='*' checkout -q HEAD -- {q}; else rm -rf -- {q}; fi\n"
        ));
    }
    script
}

/// The candidate's changes to the test machinery ([`is_protected`] paths), to be undone.
pub(crate) fn protected_changes(candidate: &str) -> BTreeSet<String> {
    let (paths, _) = patch_paths(candidate);
    paths.into_iter().filter(|p| is_protected(p)).collect()
}

/// The evaluation of `candidate` (an empty patch is allowed: it grades the base commit)
/// for an instance whose logs `parser` reads; the canary's tests to look for in the log.
pub fn eval_plan(
    candidate: &str,
    test_patch: &str,
    eval_env: &[String],
    test_command: &str,
    parser: Parser,
    guard: &Guard,
) -> (EvalPlan, Canary) {
    let mut files = vec![(TEST_PATCH.to_owned(), test_patch.to_owned())];
    // Run by the sandbox's `/bin/sh` (POSIX): no bash options; every step runs regardless.
    // One stream, in order, like the harness's logs (the test runners write to stderr).
    let mut script = String::from("exec 2>&1\n");
    for line in eval_env {
        script.push_str(line);
        script.push('\n');
    }
    let (test_paths, _) = patch_paths(test_patch);
    let mut restore: BTreeSet<String> = test_paths;
    if !candidate.trim().is_empty() {
        files.push((CANDIDATE_PATCH.to_owned(), candidate.to_owned()));
        // A patch that does not apply is the agent's failure: the tests then run on what
        // is there, and the log says why.
        script.push_str(&format!(
            "git apply -v {CANDIDATE_PATCH} || echo '>>>>> Patch Apply Failed'\n"
        ));
        restore.extend(protected_changes(candidate));
    }
    script.push_str(&restore_to_base(&restore));
    script.push_str(&format!(
        "if ! git apply -v {TEST_PATCH}; then echo '{TEST_PATCH_FAILED}'; exit 0; fi\n"
    ));
    let (canary_files, canary_arg, canary) = guard.canary(parser);
    files.extend(canary_files);
    script.push_str(&format!(
        "echo '{}'\n{test_command} {canary_arg}\necho '{}'\n",
        guard.start_marker(),
        guard.end_marker()
    ));
    (
        EvalPlan {
            files,
            command: script,
        },
        canary,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEST_PATCH_TEXT: &str = "diff --git a/tests/t.py b/tests/t.py\n--- a/tests/t.py\n+++ b/tests/t.py\n@@ -1 +1 @@\n-x\n+y\n\
        diff --git a/tests/new_test.py b/tests/new_test.py\nnew file mode 100644\n--- /dev/null\n+++ b/tests/new_test.py\n@@ -0,0 +1 @@\n+z\n";

    #[test]
    fn plans_apply_the_candidate_restore_tests_apply_the_test_patch_then_run_between_markers() {
        let guard = Guard::new("0123456789abcdef");
        let candidate = "diff --git a/src/m.py b/src/m.py\n--- a/src/m.py\n+++ b/src/m.py\n\
            diff --git a/conftest.py b/conftest.py\nnew file mode 100644\n--- /dev/null\n+++ b/conftest.py\n";
        let (plan, canary) = eval_plan(
            candidate,
            TEST_PATCH_TEXT,
            &["export LANG=C.UTF-8".into()],
            "pytest -rA tests/t.py",
            Parser::Pytest,
            &guard,
        );
        let at = |s: &str| {
            plan.command
                .find(s)
                .unwrap_or_else(|| panic!("{s} in {}", plan.command))
        };
        let apply_candidate = at("git apply -v .arl-eval/candidate.patch");
        let restore_tests = at("checkout -q HEAD -- 'tests/t.py'");
        let restore_conftest = at("rm -rf -- 'conftest.py'");
        let apply_tests = at("git apply -v .arl-eval/test.patch");
        let start = at(&guard.start_marker());
        let run = at("pytest -rA tests/t.py test_t01234.py");
        let end = at(&guard.end_marker());
        assert!(apply_candidate < restore_tests && restore_tests < apply_tests);
        assert!(restore_conftest < apply_tests && apply_tests < start && start < run && run < end);
        assert!(
            !plan.command.contains("'src/m.py'"),
            "the candidate's own fix stays"
        );
        assert!(plan.command.contains(TEST_PATCH_FAILED));
        assert!(plan.command.starts_with("exec 2>&1\nexport LANG=C.UTF-8\n"));
        assert_eq!(canary.must_pass, "test_t01234.py::test_t56789");
        assert_eq!(canary.must_fail, "test_t01234.py::test_tabcde");
        assert!(
            plan.files
                .iter()
                .any(|(p, body)| p == "test_t01234.py" && body.contains("1 + 1 == 3"))
        );

        let (empty, _) = eval_plan("  \n", "t", &[], "x", Parser::Django, &guard);
        assert!(!empty.command.contains("candidate"));
        assert!(empty.command.contains("\nx t01234\n"));
        assert!(
            empty
                .files
                .iter()
                .any(|(p, _)| p == "tests/t01234/tests.py")
        );
    }

    #[test]
    fn patch_paths_and_protection() {
        let (touched, created) = patch_paths(TEST_PATCH_TEXT);
        assert_eq!(
            touched.into_iter().collect::<Vec<_>>(),
            vec!["tests/new_test.py", "tests/t.py"]
        );
        assert_eq!(
            created.into_iter().collect::<Vec<_>>(),
            vec!["tests/new_test.py"]
        );
        for path in [
            "tests/forms_tests/tests/test_forms.py",
            "tests",
            "pkg/test/helpers.py",
            "conftest.py",
            "src/pkg/conftest.py",
            "test_thing.py",
            "pkg/thing_test.py",
            "tox.ini",
            "pytest.ini",
            "tests/runtests.py",
            "sitecustomize.py",
            "evil.pth",
        ] {
            assert!(is_protected(path), "{path}");
        }
        for path in [
            "django/forms/forms.py",
            "sphinx/pycode/ast.py",
            "setup.py",
            "src/testutils.py",
        ] {
            assert!(!is_protected(path), "{path}");
        }
    }

    #[test]
    fn paths_with_quotes_are_quoted() {
        assert_eq!(quote("a'b"), r"'a'\''b'");
    }
}
