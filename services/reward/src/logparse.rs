//! Test-log parsers with the SWE-bench harness's semantics: a log becomes a map from test
//! name to status, exactly as the harness would read it (names included — its pytest names
//! stop at the first space, and the dataset's FAIL_TO_PASS / PASS_TO_PASS lists were written
//! with those names).

use std::collections::HashMap;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TestStatus {
    Passed,
    Failed,
    Skipped,
    Error,
    Xfail,
}

impl TestStatus {
    fn from_word(word: &str) -> Option<Self> {
        Some(match word {
            "PASSED" => Self::Passed,
            "FAILED" => Self::Failed,
            "SKIPPED" => Self::Skipped,
            "ERROR" => Self::Error,
            "XFAIL" => Self::Xfail,
            _ => return None,
        })
    }
}

/// Which parser a repository's logs need.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Parser {
    /// Django's own runner (`runtests.py --verbosity 2`): `name (module.Class) ... ok`.
    Django,
    /// pytest with `-rA`: `PASSED path::test` summary lines (color codes removed).
    Pytest,
}

impl Parser {
    /// The parser for a SWE-bench repository (`owner/name`).
    pub fn for_repo(repo: &str) -> Option<Self> {
        match repo {
            "django/django" => Some(Self::Django),
            "sphinx-doc/sphinx"
            | "pytest-dev/pytest"
            | "astropy/astropy"
            | "psf/requests"
            | "pylint-dev/pylint"
            | "matplotlib/matplotlib"
            | "scikit-learn/scikit-learn"
            | "pydata/xarray"
            | "mwaskom/seaborn"
            | "pallets/flask" => Some(Self::Pytest),
            _ => None,
        }
    }

    pub fn parse(self, log: &str) -> HashMap<String, TestStatus> {
        match self {
            Self::Django => parse_django(log),
            Self::Pytest => parse_pytest(&strip_ansi(log)),
        }
    }
}

/// The part of an evaluation log between the harness's markers, if both are there (the
/// last start marker, then the first end marker after it).
pub fn test_output<'a>(log: &'a str, start: &str, end: &str) -> Option<&'a str> {
    let from = log.rfind(start)?;
    let to = log[from..].find(end)? + from;
    Some(&log[from..to])
}

/// Records a status for a test; when a log says two things about one test, the worse one
/// stands (an error or failure over a pass): a line the tested code printed itself cannot
/// turn the runner's failure into a pass.
fn record(statuses: &mut HashMap<String, TestStatus>, name: &str, status: TestStatus) {
    let rank = |s: TestStatus| match s {
        TestStatus::Error => 4,
        TestStatus::Failed => 3,
        TestStatus::Skipped => 2,
        TestStatus::Xfail => 1,
        TestStatus::Passed => 0,
    };
    statuses
        .entry(name.to_owned())
        .and_modify(|s| {
            if rank(status) > rank(*s) {
                *s = status;
            }
        })
        .or_insert(status);
}

fn parse_django(log: &str) -> HashMap<String, TestStatus> {
    let mut statuses = HashMap::new();
    // The test whose line last said " ... ": its "ok" may come lines later.
    let mut pending: Option<String> = None;
    for raw in log.lines() {
        let line = raw.trim();
        if line.contains("--version is equivalent to version") {
            record(
                &mut statuses,
                "--version is equivalent to version",
                TestStatus::Passed,
            );
        }
        if let Some((name, _)) = line.split_once(" ... ") {
            pending = Some(name.to_owned());
        }
        if let Some(name) = [" ... ok", " ... OK", " ...  OK"]
            .iter()
            .find_map(|suffix| line.strip_suffix(suffix))
        {
            record(&mut statuses, name, TestStatus::Passed);
        }
        if let Some((name, _)) = line.split_once(" ... skipped") {
            record(&mut statuses, name, TestStatus::Skipped);
        }
        if let Some(name) = line.strip_suffix(" ... FAIL") {
            record(&mut statuses, name, TestStatus::Failed);
        }
        if let Some(name) = line.strip_suffix(" ... ERROR") {
            record(&mut statuses, name, TestStatus::Error);
        }
        for (prefix, status) in [("FAIL:", TestStatus::Failed), ("ERROR:", TestStatus::Error)] {
            if line.starts_with(prefix)
                && let Some(name) = line.split_whitespace().nth(1)
            {
                record(&mut statuses, name, status);
            }
        }
        // "ok" on a line of its own: the pending test passed after printing something.
        if line.starts_with("ok")
            && let Some(name) = &pending
        {
            record(&mut statuses, name, TestStatus::Passed);
        }
    }
    statuses
}

fn parse_pytest(log: &str) -> HashMap<String, TestStatus> {
    let mut statuses = HashMap::new();
    for raw in log.lines() {
        let line = raw.trim();
        let Some(word) = line.split_whitespace().next() else {
            continue;
        };
        let Some(status) = TestStatus::from_word(word) else {
            continue;
        };
        // "FAILED path::test - reason": the reason is not part of the name.
        let line = if status == TestStatus::Failed {
            line.replace(" - ", " ")
        } else {
            line.to_owned()
        };
        if let Some(name) = line.split_whitespace().nth(1) {
            record(&mut statuses, name, status);
        }
    }
    statuses
}

/// Removes terminal color sequences (`ESC [ … m`).
fn strip_ansi(log: &str) -> String {
    let mut out = String::with_capacity(log.len());
    let mut chars = log.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' && chars.peek() == Some(&'[') {
            chars.next();
            for d in chars.by_ref() {
                if d.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn django_lines_map_to_statuses() {
        let log = "test_a (m.C) ... ok\ntest_b (m.C) ... FAIL\ntest_c (m.C) ... skipped 'no db'\n\
                   test_d (m.C)\nDocstring of d ... System check identified no issues.\nok\n\
                   ERROR: test_e (m.C)\n";
        let s = Parser::Django.parse(log);
        assert_eq!(s["test_a (m.C)"], TestStatus::Passed);
        assert_eq!(s["test_b (m.C)"], TestStatus::Failed);
        assert_eq!(s["test_c (m.C)"], TestStatus::Skipped);
        assert_eq!(s["Docstring of d"], TestStatus::Passed);
        assert_eq!(s["test_e"], TestStatus::Error);
    }

    #[test]
    fn pytest_summary_lines_with_colors_and_reasons() {
        let log = "\u{1b}[32mPASSED\u{1b}[0m tests/t.py::\u{1b}[1mtest_x[a + b]\u{1b}[0m\n\
                   FAILED tests/t.py::test_y - AssertionError: 1 != 2\nXFAIL tests/t.py::test_z\n";
        let s = Parser::Pytest.parse(log);
        assert_eq!(s["tests/t.py::test_x[a"], TestStatus::Passed);
        assert_eq!(s["tests/t.py::test_y"], TestStatus::Failed);
        assert_eq!(s["tests/t.py::test_z"], TestStatus::Xfail);
    }

    #[test]
    fn test_output_is_cut_at_the_markers() {
        let (start, end) = (">>>>> Start Test Output n1", ">>>>> End Test Output n1");
        assert_eq!(
            test_output(
                "setup\n+ : '>>>>> Start Test Output n1'\nx ... ok\n+ : '>>>>> End Test Output n1'\n",
                start,
                end
            ),
            Some(">>>>> Start Test Output n1'\nx ... ok\n+ : '")
        );
        assert_eq!(test_output("no markers", start, end), None);
        // Markers without the nonce (printed by the tested code) are not markers.
        assert_eq!(
            test_output(
                ">>>>> Start Test Output\nx ... ok\n>>>>> End Test Output\n",
                start,
                end
            ),
            None
        );
    }

    #[test]
    fn a_later_or_earlier_pass_never_hides_a_failure() {
        let log = "PASSED tests/t.py::test_y\nFAILED tests/t.py::test_y - boom\nPASSED tests/t.py::test_y\n";
        assert_eq!(
            Parser::Pytest.parse(log)["tests/t.py::test_y"],
            TestStatus::Failed
        );
        let log = "test_a (m.C) ... ok\ntest_a (m.C) ... FAIL\n";
        assert_eq!(
            Parser::Django.parse(log)["test_a (m.C)"],
            TestStatus::Failed
        );
    }
}
