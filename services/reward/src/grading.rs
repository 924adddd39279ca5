//! SWE-bench grading: a run's test statuses against the instance's FAIL_TO_PASS and
//! PASS_TO_PASS lists. A test counts as passing when it PASSED or XFAILed, as failing when
//! it FAILED, ERRORed or is missing from the log; a skipped PASS_TO_PASS test is neither.
//! Resolved in full when every FAIL_TO_PASS and every PASS_TO_PASS test passes.

use std::collections::HashMap;

use serde::Serialize;

use crate::logparse::{Parser, TestStatus, test_output};

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
}

/// Grades an evaluation log of `repo`.
pub fn grade(
    repo: &str,
    log: &str,
    fail_to_pass: &[String],
    pass_to_pass: &[String],
) -> Result<Report, GradingError> {
    let parser =
        Parser::for_repo(repo).ok_or_else(|| GradingError::UnknownRepository(repo.to_owned()))?;
    let output = test_output(log).ok_or(GradingError::NoTestOutput)?;
    Ok(report(&parser.parse(output), fail_to_pass, pass_to_pass))
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
    }
}
