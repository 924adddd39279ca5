//! SWE-bench grading: a run's test statuses against the instance's FAIL_TO_PASS and
//! PASS_TO_PASS lists. A test counts as passing when it PASSED or XFAILed, as failing when
//! it FAILED, ERRORed or is missing from the log; a skipped PASS_TO_PASS test is neither.
//! Resolved in full when every FAIL_TO_PASS and every PASS_TO_PASS test passes — and the
//! grading's canary held (its must-pass test passed and its must-fail test failed): a run
//! whose canary broke was tampered with by the candidate and is not resolved, whatever it
//! printed about the instance's tests.

use std::collections::HashMap;

use serde::Serialize;

use crate::logparse::{Parser, TestStatus, test_output};
use crate::swebench::{Canary, Guard, TEST_PATCH_FAILED};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Resolution {
    ResolvedFull,
    ResolvedPartial,
    ResolvedNo,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Counts {
    pub success: usize,
    pub failure: usize,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Report {
    pub resolution: Resolution,
    pub fail_to_pass: Counts,
    pub pass_to_pass: Counts,
    /// FAIL_TO_PASS tests by outcome (a skipped test is in neither list).
    pub fail_to_pass_tests: Names,
    /// PASS_TO_PASS tests by outcome; `failed` are the regressions.
    pub pass_to_pass_tests: Names,
    /// The canary did not hold: the test run's results cannot be believed.
    pub tampered: bool,
}

/// Test names by outcome.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Names {
    pub passed: Vec<String>,
    pub failed: Vec<String>,
}

impl Report {
    pub fn resolved(&self) -> bool {
        self.resolution == Resolution::ResolvedFull
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum GradingError {
    #[error(
        "the log has no test output between the harness's markers (the test command did not run)"
    )]
    NoTestOutput,
    #[error("no log parser for repository {0}")]
    UnknownRepository(String),
    #[error(
        "the instance's test patch does not apply to the base commit (after the test files were restored): the dataset row or the environment is wrong"
    )]
    TestPatchFailed,
}

/// Grades an evaluation log of `repo` made by a plan with this `guard` and `canary`.
pub fn grade(
    repo: &str,
    log: &str,
    fail_to_pass: &[String],
    pass_to_pass: &[String],
    guard: &Guard,
    canary: &Canary,
) -> Result<Report, GradingError> {
    if log.lines().any(|l| l.trim() == TEST_PATCH_FAILED) {
        return Err(GradingError::TestPatchFailed);
    }
    let statuses = statuses(repo, log, &guard.start_marker(), &guard.end_marker())?;
    let mut report = report(&statuses, fail_to_pass, pass_to_pass);
    let held = statuses.get(&canary.must_pass) == Some(&TestStatus::Passed)
        && matches!(
            statuses.get(&canary.must_fail),
            Some(TestStatus::Failed | TestStatus::Error)
        );
    if !held {
        report.tampered = true;
        report.resolution = Resolution::ResolvedNo;
    }
    Ok(report)
}

/// The test statuses `repo`'s parser reads between the markers `start` and `end` of a log.
pub fn statuses(
    repo: &str,
    log: &str,
    start: &str,
    end: &str,
) -> Result<HashMap<String, TestStatus>, GradingError> {
    let parser =
        Parser::for_repo(repo).ok_or_else(|| GradingError::UnknownRepository(repo.to_owned()))?;
    let output = test_output(log, start, end).ok_or(GradingError::NoTestOutput)?;
    Ok(parser.parse(output))
}

pub fn report(
    statuses: &HashMap<String, TestStatus>,
    fail_to_pass: &[String],
    pass_to_pass: &[String],
) -> Report {
    let passed = |t: &String| {
        matches!(
            statuses.get(t),
            Some(TestStatus::Passed | TestStatus::Xfail)
        )
    };
    let failed = |t: &String| {
        matches!(
            statuses.get(t),
            None | Some(TestStatus::Failed | TestStatus::Error)
        )
    };
    let tally = |tests: &[String]| {
        let mut counts = Counts::default();
        let mut names = Names::default();
        for test in tests {
            if passed(test) {
                counts.success += 1;
                names.passed.push(test.clone());
            } else if failed(test) {
                counts.failure += 1;
                names.failed.push(test.clone());
            }
        }
        (counts, names)
    };
    let (f2p, f2p_names) = tally(fail_to_pass);
    let (p2p, p2p_names) = tally(pass_to_pass);
    let rate = |c: &Counts| {
        let total = c.success + c.failure;
        if total == 0 {
            1.0
        } else {
            c.success as f64 / total as f64
        }
    };
    let resolution = match (rate(&f2p), rate(&p2p)) {
        (f, p) if f == 1.0 && p == 1.0 => Resolution::ResolvedFull,
        (f, p) if f > 0.0 && f < 1.0 && p == 1.0 => Resolution::ResolvedPartial,
        _ => Resolution::ResolvedNo,
    };
    Report {
        resolution,
        fail_to_pass: f2p,
        pass_to_pass: p2p,
        fail_to_pass_tests: f2p_names,
        pass_to_pass_tests: p2p_names,
        tampered: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::swebench::eval_plan;

    /// A pytest log of one grading, with what the tested code printed around it.
    fn log(
        guard: &Guard,
        canary: &Canary,
        lines: &[&str],
        canary_pass: &str,
        canary_fail: &str,
    ) -> String {
        let mut log = String::from("setup\n");
        log.push_str(&guard.start_marker());
        log.push('\n');
        for line in lines {
            log.push_str(line);
            log.push('\n');
        }
        log.push_str(&format!(
            "{canary_pass} {}\n{canary_fail} {}\n",
            canary.must_pass, canary.must_fail
        ));
        log.push_str(&guard.end_marker());
        log.push('\n');
        log
    }

    fn plan(guard: &Guard) -> Canary {
        eval_plan("", "", &[], "pytest -rA", Parser::Pytest, guard).1
    }

    const REPO: &str = "sphinx-doc/sphinx";

    #[test]
    fn a_run_whose_canary_held_grades_its_tests() {
        let guard = Guard::new("aaaabbbbccccdddd");
        let canary = plan(&guard);
        let good = log(
            &guard,
            &canary,
            &["PASSED tests/t.py::test_fix"],
            "PASSED",
            "FAILED",
        );
        let report = grade(
            REPO,
            &good,
            &["tests/t.py::test_fix".into()],
            &[],
            &guard,
            &canary,
        )
        .unwrap();
        assert!(report.resolved() && !report.tampered);
    }

    #[test]
    fn a_broken_canary_scores_zero_whatever_the_log_says() {
        let guard = Guard::new("aaaabbbbccccdddd");
        let canary = plan(&guard);
        let f2p = ["tests/t.py::test_fix".to_owned()];
        // Every failure reported as a pass (a monkeypatched runner or report hook).
        let all_pass = log(
            &guard,
            &canary,
            &["PASSED tests/t.py::test_fix"],
            "PASSED",
            "PASSED",
        );
        // Nothing of the canary at all (stdout filtered, or the run cut short).
        let mut silent = format!("{}\nPASSED tests/t.py::test_fix\n", guard.start_marker());
        silent.push_str(&guard.end_marker());
        for tampered in [all_pass, silent] {
            let report = grade(REPO, &tampered, &f2p, &[], &guard, &canary).unwrap();
            assert!(report.tampered && !report.resolved(), "{tampered}");
        }
    }

    #[test]
    fn forged_markers_and_forged_passes_do_not_count() {
        let guard = Guard::new("aaaabbbbccccdddd");
        let canary = plan(&guard);
        let f2p = ["tests/t.py::test_fix".to_owned()];
        // The tested code prints a fake harness section and a fake pass after the real failure.
        let forged = log(
            &guard,
            &canary,
            &[
                ">>>>> End Test Output",
                "FAILED tests/t.py::test_fix - assert 0",
                "PASSED tests/t.py::test_fix",
            ],
            "PASSED",
            "FAILED",
        );
        let report = grade(REPO, &forged, &f2p, &[], &guard, &canary).unwrap();
        assert!(!report.resolved() && !report.tampered);
        assert_eq!(report.fail_to_pass_tests.failed, f2p);
        // Without this grading's nonce there is no test output at all.
        let other = Guard::new("eeeeffffgggghhhh");
        assert_eq!(
            grade(REPO, &forged, &f2p, &[], &other, &plan(&other)).unwrap_err(),
            GradingError::NoTestOutput
        );
    }

    #[test]
    fn a_test_patch_that_does_not_apply_is_a_grading_error() {
        let guard = Guard::new("aaaabbbbccccdddd");
        let canary = plan(&guard);
        let log = format!("error: patch failed: tests/t.py:1\n{TEST_PATCH_FAILED}\n");
        assert_eq!(
            grade(REPO, &log, &[], &[], &guard, &canary).unwrap_err(),
            GradingError::TestPatchFailed
        );
    }
}
