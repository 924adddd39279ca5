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

/// The part of an evaluation log between the harness's markers, if both are there.
pub fn test_output(log: &str) -> Option<&str> {
    let start = log.find(">>>>> Start Test Output")?;
    let end = log[start..].find(">>>>> End Test Output")? + start;
    Some(&log[start..end])
}

fn parse_django(log: &str) -> HashMap<String, TestStatus> {
    let mut statuses = HashMap::new();
    // The test whose line last said " ... ": its "ok" may come lines later.
    let mut pending: Option<String> = None;
    for raw in log.lines() {
        let line = raw.trim();
        if line.contains("--version is equivalent to version") {
            statuses.insert(
                "--version is equivalent to version".to_owned(),
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
            statuses.insert(name.to_owned(), TestStatus::Passed);
        }
        if let Some((name, _)) = line.split_once(" ... skipped") {
            statuses.insert(name.to_owned(), TestStatus::Skipped);
        }
        if let Some(name) = line.strip_suffix(" ... FAIL") {
            statuses.insert(name.to_owned(), TestStatus::Failed);
        }
        if let Some(name) = line.strip_suffix(" ... ERROR") {
            statuses.insert(name.to_owned(), TestStatus::Error);
        }
        for (prefix, status) in [("FAIL:", TestStatus::Failed), ("ERROR:", TestStatus::Error)] {
            if line.starts_with(prefix)
                && let Some(name) = line.split_whitespace().nth(1)
            {
                statuses.insert(name.to_owned(), status);
            }
        }
        // "ok" on a line of its own: the pending test passed after printing something.
        if line.starts_with("ok")
            && let Some(name) = &pending
        {
            statuses.insert(name.clone(), TestStatus::Passed);
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
            statuses.insert(name.to_owned(), status);
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
        assert_eq!(
            test_output(
                "setup\n+ : '>>>>> Start Test Output'\nx ... ok\n+ : '>>>>> End Test Output'\n"
            ),
            Some(">>>>> Start Test Output'\nx ... ok\n+ : '")
        );
        assert_eq!(test_output("no markers"), None);
    }
}
