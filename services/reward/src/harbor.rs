//! Grading a Harbor task in a clean sandbox of the task's environment. The candidate (the
//! trial's patch) is the policy's work, and the policy is an adversary of this grader, so:
//!
//! 1. the task's hidden `tests/` are written to a staging folder of an unguessable name,
//!    then moved out of the work tree (to `/tmp/arl-verifier-<nonce>/tests`, read-only)
//!    *before* the candidate is applied: its patch cannot edit, replace or symlink them;
//! 2. the candidate is applied, and its changes to the test machinery (`conftest.py`,
//!    `pytest.ini`, `sitecustomize.py`, `*.pth`, test folders and files — see
//!    [`crate::swebench::is_protected`]) go back to the base;
//! 3. `tests/test.sh` runs with `APP_DIR` (the work tree) and a fresh `LOGS_DIR` beside the
//!    tests, as Harbor's verifier runs it;
//! 4. where the task's verifier runs pytest, its parsed results decide, not the single
//!    number: every pytest module of the tests gets a canary appended (a test that must
//!    pass and one that must fail, of unguessable names), pytest reports every test
//!    (`PYTEST_ADDOPTS=-rA`), and the grade is 1 only when every one of the task's tests
//!    passed and every canary held. `os._exit(0)` at import, a `conftest.py` that skips or
//!    xfails everything, a monkeypatched runner, a report rewritten to "passed" or a
//!    reward file written by the candidate's code all score 0;
//! 5. otherwise the reward is the number `test.sh` wrote to
//!    `$LOGS_DIR/verifier/reward.txt` (a regular file, not a link), read right after it
//!    returns and printed behind a marker that carries the nonce. Such a verifier trusts
//!    its own script's exit status: code that exits 0 at import fools it, which is why a
//!    task should verify with pytest.

use crate::grading::GradingError;
use crate::logparse::{Parser, TestStatus, test_output};
use crate::swebench::{
    CANDIDATE_PATCH, Canary, EvalPlan, Guard, protected_changes, quote, restore_to_base,
};

/// What the log of a Harbor grading is read for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// pytest's results decide; one canary per pytest module of the tests.
    Pytest(Vec<Canary>),
    /// The number the verifier wrote.
    RewardFile,
}

/// The evaluation of `candidate` against the task's `tests` (paths relative to `tests/`,
/// contents), in a work tree at `workdir`; and how its log is to be read.
pub fn eval_plan(
    candidate: &str,
    tests: &[(String, String)],
    workdir: &str,
    guard: &Guard,
) -> (EvalPlan, Verdict) {
    let stage = format!(".arl-eval/{}", guard.word(0));
    let verifier = format!("/tmp/arl-verifier-{}", guard.word(1));
    let runs_pytest = tests
        .iter()
        .any(|(path, body)| path == "test.sh" && body.contains("pytest"));
    let mut canaries = Vec::new();
    let mut files: Vec<(String, String)> = tests
        .iter()
        .enumerate()
        .map(|(i, (path, content))| {
            let mut content = content.clone();
            if runs_pytest && is_pytest_module(path) {
                let (code, canary) = canary(guard, i);
                content.push_str(&code);
                canaries.push(canary);
            }
            (format!("{stage}/tests/{path}"), content)
        })
        .collect();
    let verdict = if canaries.is_empty() {
        Verdict::RewardFile
    } else {
        Verdict::Pytest(canaries)
    };

    let v = quote(&verifier);
    let mut script = String::from("exec 2>&1\n");
    script.push_str(&format!(
        "mkdir -p {v}/logs/verifier && mv {stage}/tests {v}/tests && chmod -R a-w {v}/tests || \
         {{ echo 'cannot stage the tests'; exit 0; }}\n",
        stage = quote(&stage)
    ));
    if !candidate.trim().is_empty() {
        files.push((CANDIDATE_PATCH.to_owned(), candidate.to_owned()));
        script.push_str(&format!(
            "git apply -v {CANDIDATE_PATCH} || echo '>>>>> Patch Apply Failed'\n"
        ));
        script.push_str(&restore_to_base(&protected_changes(candidate)));
    }
    script.push_str("rm -rf .arl-eval\n");
    let addopts = if matches!(verdict, Verdict::Pytest(_)) {
        " PYTEST_ADDOPTS=-rA"
    } else {
        ""
    };
    let reward = format!("{v}/logs/verifier/reward.txt");
    script.push_str(&format!(
        "export APP_DIR={workdir} LOGS_DIR={v}/logs{addopts}\n\
         echo '{start}'\nbash {v}/tests/test.sh\necho '{end}'\n\
         if [ -f {reward} ] && [ ! -L {reward} ]; then echo \"{marker} $(head -c 64 {reward})\"; \
         else echo '{marker}'; fi\n",
        workdir = quote(workdir),
        start = guard.start_marker(),
        end = guard.end_marker(),
        marker = reward_marker(guard),
    ));
    (
        EvalPlan {
            files,
            command: script,
        },
        verdict,
    )
}

/// A file pytest collects by its default rules.
fn is_pytest_module(path: &str) -> bool {
    let name = path.rsplit('/').next().unwrap_or(path);
    name.ends_with(".py") && (name.starts_with("test_") || name.ends_with("_test.py"))
}

/// The canary appended to the `i`-th file of the tests: run after the file's own tests, so
/// that a verifier that stops at the first failure has run them all. pytest names a test
/// `<path from its rootdir>::<function>`, and the rootdir depends on how test.sh calls it,
/// so a canary is found by its function's unguessable name.
fn canary(guard: &Guard, i: usize) -> (String, Canary) {
    let (pass, fail) = (
        format!("test_{}_{i}", guard.word(1)),
        format!("test_{}_{i}", guard.word(2)),
    );
    let code = format!(
        "\n\n\ndef {pass}():\n    assert 1 + 1 == 2\n\n\ndef {fail}():\n    assert 1 + 1 == 3\n"
    );
    (
        code,
        Canary {
            must_pass: pass,
            must_fail: fail,
        },
    )
}

fn reward_marker(guard: &Guard) -> String {
    format!(">>>>> Reward {}:", guard.word(0))
}

/// A Harbor grade: the score and whether the task counts as solved.
#[derive(Clone, Debug, PartialEq)]
pub struct HarborGrade {
    pub score: f64,
    /// Tests that passed and failed, when pytest's results decided.
    pub tests: Option<(usize, usize)>,
    /// The failed (or skipped) tests by pytest's name, when pytest's results decided.
    pub failed_tests: Vec<String>,
    /// A canary broke: the test run was tampered with, and scored 0.
    pub tampered: bool,
}

/// Grades the log of a plan made with `guard` that is to be read as `verdict`.
pub fn grade(log: &str, guard: &Guard, verdict: &Verdict) -> Result<HarborGrade, GradingError> {
    match verdict {
        Verdict::RewardFile => Ok(HarborGrade {
            score: reward_from_log(log, guard)?,
            tests: None,
            failed_tests: Vec::new(),
            tampered: false,
        }),
        Verdict::Pytest(canaries) => {
            let output = test_output(log, &guard.start_marker(), &guard.end_marker())
                .ok_or(GradingError::NoTestOutput)?;
            let statuses = Parser::Pytest.parse(output);
            let function = |name: &str| name.rsplit("::").next().unwrap_or(name).to_owned();
            let status_of = |test: &str| {
                statuses
                    .iter()
                    .find(|(name, _)| function(name) == test)
                    .map(|(_, s)| *s)
            };
            // A module whose tests ran must show its canary holding; one at least ran.
            let ran: Vec<&Canary> = canaries
                .iter()
                .filter(|c| status_of(&c.must_pass).is_some() || status_of(&c.must_fail).is_some())
                .collect();
            let held = !ran.is_empty()
                && ran.iter().all(|c| {
                    status_of(&c.must_pass) == Some(TestStatus::Passed)
                        && matches!(
                            status_of(&c.must_fail),
                            Some(TestStatus::Failed | TestStatus::Error)
                        )
                });
            let is_canary = |name: &str| {
                let f = function(name);
                canaries
                    .iter()
                    .any(|c| c.must_pass == f || c.must_fail == f)
            };
            let mut passed = 0;
            let mut failed_tests = Vec::new();
            for (name, status) in &statuses {
                if is_canary(name) {
                    continue;
                }
                match status {
                    TestStatus::Passed | TestStatus::Xfail => passed += 1,
                    // A skipped test verified nothing.
                    TestStatus::Failed | TestStatus::Error | TestStatus::Skipped => {
                        failed_tests.push(name.clone())
                    }
                }
            }
            failed_tests.sort();
            let solved = held && passed > 0 && failed_tests.is_empty();
            Ok(HarborGrade {
                score: if solved { 1.0 } else { 0.0 },
                tests: Some((passed, failed_tests.len())),
                failed_tests,
                tampered: !held,
            })
        }
    }
}

/// The reward the test script wrote; a missing or non-numeric one is a grading error.
fn reward_from_log(log: &str, guard: &Guard) -> Result<f64, GradingError> {
    let marker = reward_marker(guard);
    let line = log
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix(marker.as_str()))
        .ok_or(GradingError::NoTestOutput)?;
    line.trim()
        .parse::<f64>()
        .ok()
        .filter(|r| r.is_finite())
        .ok_or(GradingError::NoTestOutput)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn guard() -> Guard {
        Guard::new("0123456789abcdefghijkl")
    }

    #[test]
    fn the_reward_is_read_from_the_nonce_marker_or_is_an_error() {
        let g = guard();
        let m = reward_marker(&g);
        let read = |log: &str| grade(log, &g, &Verdict::RewardFile).map(|g| g.score);
        assert_eq!(read(&format!("ok\n{m} 1\n")), Ok(1.0));
        assert_eq!(read(&format!("{m} 0.5")), Ok(0.5));
        assert_eq!(read(&format!("{m} ")), Err(GradingError::NoTestOutput));
        assert_eq!(read(&format!("{m} nan")), Err(GradingError::NoTestOutput));
        assert_eq!(read("nothing"), Err(GradingError::NoTestOutput));
        // The candidate printing a marker without the nonce changes nothing.
        assert_eq!(
            read(&format!("{m} 0\n>>>>> Reward: 1\n")),
            Ok(0.0),
            "only the nonce's marker counts"
        );
    }

    #[test]
    fn tests_are_staged_and_moved_out_of_the_tree_before_the_candidate_applies() {
        let tests = [
            (
                "test.sh".to_owned(),
                "python3 -m pytest $(dirname $0)".to_owned(),
            ),
            (
                "test_outputs.py".to_owned(),
                "def test_a():\n    pass\n".to_owned(),
            ),
            ("data.txt".to_owned(), "x".to_owned()),
        ];
        let candidate = "diff --git a/stats.py b/stats.py\n--- a/stats.py\n+++ b/stats.py\n\
            diff --git a/conftest.py b/conftest.py\nnew file mode 100644\n--- /dev/null\n+++ b/conftest.py\n";
        let g = guard();
        let (plan, verdict) = eval_plan(candidate, &tests, "/app", &g);
        let at = |s: &str| {
            plan.command
                .find(s)
                .unwrap_or_else(|| panic!("{s} in {}", plan.command))
        };
        let staged = format!(".arl-eval/{}/tests", g.word(0));
        assert!(
            plan.files
                .iter()
                .any(|(p, _)| *p == format!("{staged}/test.sh"))
        );
        let moved = at(&format!("mv '.arl-eval/{}'/tests", g.word(0)));
        let readonly = at("chmod -R a-w");
        let apply = at("git apply -v .arl-eval/candidate.patch");
        let restore = at("rm -rf -- 'conftest.py'");
        let run = at("/tests/test.sh");
        assert!(moved < readonly && readonly < apply && apply < restore && restore < run);
        assert!(plan.command.contains("PYTEST_ADDOPTS=-rA"));
        assert!(!plan.command.contains("'stats.py'"), "the fix itself stays");
        let Verdict::Pytest(canaries) = verdict else {
            panic!("a pytest verifier is read for its results");
        };
        assert_eq!(canaries.len(), 1, "one pytest module, one canary");
        let module = &plan
            .files
            .iter()
            .find(|(p, _)| p.ends_with("test_outputs.py"))
            .unwrap()
            .1;
        assert!(module.starts_with("def test_a():"));
        assert!(module.contains(&format!("def {}():", canaries[0].must_fail)));

        let script = [("test.sh".to_owned(), "python3 check.py".to_owned())];
        let (plan, verdict) = eval_plan("", &script, "/app", &g);
        assert_eq!(verdict, Verdict::RewardFile);
        assert!(!plan.command.contains("PYTEST_ADDOPTS"));
        assert!(!plan.command.contains("candidate"));
    }

    #[test]
    fn pytest_results_decide_and_a_broken_canary_scores_zero() {
        let g = guard();
        let c = Canary {
            must_pass: format!("test_{}_1", g.word(1)),
            must_fail: format!("test_{}_1", g.word(2)),
        };
        let verdict = Verdict::Pytest(vec![c.clone()]);
        let log = |lines: &[String]| {
            format!(
                "setup\n{}\n{}\n{}\n",
                g.start_marker(),
                lines.join("\n"),
                g.end_marker()
            )
        };
        let pass = format!("PASSED tests/test_outputs.py::{}", c.must_pass);
        let fail = format!(
            "FAILED tests/test_outputs.py::{} - assert 2 == 3",
            c.must_fail
        );
        let score = |lines: &[String]| grade(&log(lines), &g, &verdict).unwrap();

        let solved = score(&[
            "PASSED tests/test_outputs.py::test_mean".into(),
            pass.clone(),
            fail.clone(),
        ]);
        assert_eq!(
            (solved.score, solved.tests, solved.tampered),
            (1.0, Some((1, 0)), false)
        );
        let unsolved = score(&[
            "FAILED tests/test_outputs.py::test_mean - boom".into(),
            pass.clone(),
            fail.clone(),
        ]);
        assert_eq!((unsolved.score, unsolved.tests), (0.0, Some((0, 1))));
        // Everything reported passing (a monkeypatched runner): the must-fail canary too.
        let forged = score(&[
            "PASSED tests/test_outputs.py::test_mean".into(),
            pass.clone(),
            format!("PASSED tests/test_outputs.py::{}", c.must_fail),
        ]);
        assert!(forged.tampered && forged.score == 0.0);
        // Everything skipped (a conftest.py), or nothing reported (os._exit(0) at import).
        let skipped = score(&[
            "SKIPPED [1] tests/test_outputs.py::test_mean".into(),
            format!("SKIPPED tests/test_outputs.py::{}", c.must_pass),
        ]);
        assert_eq!(skipped.score, 0.0);
        assert!(score(&[]).tampered);
        // Only the canary ran: no test of the task passed.
        assert_eq!(score(&[pass, fail]).score, 0.0);
        // No markers at all: the verifier never ran.
        assert_eq!(
            grade("crash", &g, &verdict),
            Err(GradingError::NoTestOutput)
        );
    }
}
