//! What a validation found, per task and in all, and how it is shown: a table for people,
//! or one JSON object per line (each task, then the summary) for scripts. Pure.

use arl_schemas::events::TaskKind;
use serde::Serialize;

/// One task's findings.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TaskOutcome {
    pub task_id: String,
    pub kind: TaskKind,
    /// Seconds to have the environment ready (0-ish when it was cached); null when there
    /// is nothing to build or the build was never reached.
    pub build_seconds: Option<f64>,
    /// Disk the task's own environment takes (its tree, and its dependencies unless it
    /// shares them); null when nothing was built.
    pub disk_bytes: Option<u64>,
    /// The dependency environment it shares with the other instances of its repository
    /// and version, if it shares one (SWE-bench instances built from the specs).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shared_environment: Option<String>,
    /// Whether the reference solution resolves the task; null when it was not graded.
    pub gold_resolved: Option<bool>,
    /// Whether an empty patch (no answer) resolves it; null when it was not graded.
    pub empty_resolved: Option<bool>,
    /// The tests that failed with the reference solution (where the grading names them).
    pub failing_tests: Vec<String>,
    /// Why the task could not be checked (build, grading, data), if it could not.
    pub error: Option<String>,
    /// What else a reader should know (a math task has nothing to build).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

impl TaskOutcome {
    pub fn new(task_id: impl Into<String>, kind: TaskKind) -> Self {
        Self {
            task_id: task_id.into(),
            kind,
            build_seconds: None,
            disk_bytes: None,
            shared_environment: None,
            gold_resolved: None,
            empty_resolved: None,
            failing_tests: Vec::new(),
            error: None,
            note: None,
        }
    }

    /// Why this task is bad — empty when it is valid: it was checked, its reference
    /// solution resolves it, and no answer does not.
    pub fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        if let Some(error) = &self.error {
            problems.push(error.clone());
        }
        match self.gold_resolved {
            Some(false) => problems.push(format!(
                "its {} does not resolve it",
                reference_name(self.kind)
            )),
            None if self.error.is_none() => problems.push("its reference was not graded".into()),
            _ => {}
        }
        match self.empty_resolved {
            Some(true) => problems
                .push("an empty patch resolves it: its tests cannot tell a fix from none".into()),
            None if self.error.is_none() => problems.push("no empty patch was graded".into()),
            _ => {}
        }
        problems
    }

    pub fn is_valid(&self) -> bool {
        self.problems().is_empty()
    }
}

fn reference_name(kind: TaskKind) -> &'static str {
    match kind {
        TaskKind::Swebench => "gold patch",
        TaskKind::Harbor => "solution (solution/solve.sh)",
        TaskKind::Math => "reference answer",
    }
}

/// The whole validation.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Summary {
    pub tasks: usize,
    pub valid: usize,
    /// The bad tasks' ids, in dataset order.
    pub bad: Vec<String>,
    pub seconds: f64,
}

impl Summary {
    pub fn of(outcomes: &[TaskOutcome], seconds: f64) -> Self {
        let bad: Vec<String> = outcomes
            .iter()
            .filter(|o| !o.is_valid())
            .map(|o| o.task_id.clone())
            .collect();
        Self {
            tasks: outcomes.len(),
            valid: outcomes.len() - bad.len(),
            bad,
            seconds,
        }
    }

    /// The one line that closes the table.
    pub fn line(&self) -> String {
        let verdict = if self.bad.is_empty() {
            "every task is valid".to_owned()
        } else {
            format!("{} bad: {}", self.bad.len(), self.bad.join(", "))
        };
        format!(
            "{}, {} valid, {verdict} ({:.1} s)",
            tasks(self.tasks),
            self.valid,
            self.seconds
        )
    }
}

/// "1 task", "6 tasks".
pub fn tasks(count: usize) -> String {
    match count {
        1 => "1 task".to_owned(),
        n => format!("{n} tasks"),
    }
}

/// One JSON object per task, then `{"summary": …}`, each on its own line.
pub fn json_lines(outcomes: &[TaskOutcome], summary: &Summary) -> String {
    let mut out = String::new();
    for outcome in outcomes {
        out.push_str(&serde_json::to_string(outcome).unwrap_or_default());
        out.push('\n');
    }
    #[derive(Serialize)]
    struct Last<'a> {
        summary: &'a Summary,
    }
    out.push_str(&serde_json::to_string(&Last { summary }).unwrap_or_default());
    out.push('\n');
    out
}

/// The table, the bad tasks' reasons in full below it, and the summary line.
pub fn table(outcomes: &[TaskOutcome], summary: &Summary) -> String {
    let header = ["task", "kind", "build s", "gold", "empty", "failing tests"];
    let rows: Vec<[String; 6]> = outcomes.iter().map(row).collect();
    let mut widths = header.map(str::len);
    for row in &rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let line = |cells: [&str; 6]| {
        let mut text = String::new();
        for (i, (cell, width)) in cells.iter().zip(widths).enumerate() {
            // Numbers right-aligned; the last column is not padded.
            match i {
                2 => text.push_str(&format!("{cell:>width$}  ")),
                5 => text.push_str(cell),
                _ => text.push_str(&format!("{cell:<width$}  ")),
            }
        }
        text.trim_end().to_owned() + "\n"
    };
    let mut out = line(header);
    for row in &rows {
        out.push_str(&line(row.each_ref().map(String::as_str)));
    }
    let explained: Vec<String> = outcomes
        .iter()
        .filter(|o| !o.is_valid())
        .map(|o| match &o.note {
            Some(note) => format!("{}: {} ({note})", o.task_id, o.problems().join("; ")),
            None => format!("{}: {}", o.task_id, o.problems().join("; ")),
        })
        .collect();
    if !explained.is_empty() {
        out.push('\n');
        for reason in explained {
            out.push_str(&reason);
            out.push('\n');
        }
    }
    out.push('\n');
    out.push_str(&summary.line());
    out.push('\n');
    out
}

fn row(outcome: &TaskOutcome) -> [String; 6] {
    let resolved = |r: Option<bool>| match r {
        Some(true) => "resolved",
        Some(false) => "unresolved",
        None => "-",
    };
    let build = match (outcome.build_seconds, outcome.kind) {
        (Some(s), _) => format!("{s:.1}"),
        (None, TaskKind::Math) => "none".into(),
        (None, _) => "-".into(),
    };
    let failing = if let Some(error) = &outcome.error {
        format!("error: {}", first_line(error))
    } else if !outcome.failing_tests.is_empty() {
        outcome.failing_tests.join(", ")
    } else {
        outcome.note.clone().unwrap_or_default()
    };
    [
        outcome.task_id.clone(),
        format!("{:?}", outcome.kind).to_lowercase(),
        build,
        resolved(outcome.gold_resolved).into(),
        resolved(outcome.empty_resolved).into(),
        failing,
    ]
}

fn first_line(text: &str) -> &str {
    text.lines().next().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn valid(id: &str) -> TaskOutcome {
        TaskOutcome {
            build_seconds: Some(53.12),
            disk_bytes: Some(64_000_000),
            shared_environment: Some("shared/swebench/django__django-3.1-0123456789ab".into()),
            gold_resolved: Some(true),
            empty_resolved: Some(false),
            ..TaskOutcome::new(id, TaskKind::Swebench)
        }
    }

    #[test]
    fn a_task_is_valid_only_when_gold_resolves_and_empty_does_not() {
        assert!(valid("a").is_valid());
        let gold_fails = TaskOutcome {
            gold_resolved: Some(false),
            failing_tests: vec!["test_x (m.T)".into()],
            ..valid("b")
        };
        assert_eq!(
            gold_fails.problems(),
            ["its gold patch does not resolve it"]
        );
        let empty_passes = TaskOutcome {
            empty_resolved: Some(true),
            ..valid("c")
        };
        assert!(empty_passes.problems()[0].contains("an empty patch resolves it"));
        let broken = TaskOutcome {
            error: Some("environment build failed: no commit\nlog".into()),
            ..TaskOutcome::new("d", TaskKind::Swebench)
        };
        assert_eq!(
            broken.problems(),
            ["environment build failed: no commit\nlog"]
        );
        let ungraded = TaskOutcome::new("e", TaskKind::Harbor);
        assert_eq!(ungraded.problems().len(), 2, "nothing checked is not valid");
    }

    #[test]
    fn the_summary_names_every_bad_task_in_order() {
        let outcomes = [
            valid("a"),
            TaskOutcome {
                gold_resolved: Some(false),
                ..valid("b")
            },
            valid("c"),
            TaskOutcome {
                error: Some("x".into()),
                ..TaskOutcome::new("d", TaskKind::Swebench)
            },
        ];
        let summary = Summary::of(&outcomes, 12.34);
        assert_eq!((summary.tasks, summary.valid), (4, 2));
        assert_eq!(summary.bad, ["b", "d"]);
        assert_eq!(summary.line(), "4 tasks, 2 valid, 2 bad: b, d (12.3 s)");
        assert_eq!(
            Summary::of(&outcomes[..1], 1.0).line(),
            "1 task, 1 valid, every task is valid (1.0 s)"
        );
    }

    #[test]
    fn json_lines_are_one_object_per_task_then_the_summary() {
        let math = TaskOutcome {
            gold_resolved: Some(true),
            empty_resolved: Some(false),
            note: Some("nothing to build".into()),
            ..TaskOutcome::new("math-1", TaskKind::Math)
        };
        let outcomes = [valid("a"), math];
        let text = json_lines(&outcomes, &Summary::of(&outcomes, 2.0));
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 3);
        assert_eq!(lines[0]["task_id"], "a");
        assert_eq!(lines[0]["build_seconds"], 53.12);
        assert_eq!(lines[0]["disk_bytes"], 64_000_000);
        assert_eq!(
            lines[0]["shared_environment"],
            "shared/swebench/django__django-3.1-0123456789ab"
        );
        assert_eq!(lines[1]["disk_bytes"], serde_json::Value::Null);
        assert!(lines[1].get("shared_environment").is_none());
        assert_eq!(lines[0]["gold_resolved"], true);
        assert_eq!(lines[0]["empty_resolved"], false);
        assert_eq!(lines[0]["failing_tests"], serde_json::json!([]));
        assert_eq!(lines[0]["error"], serde_json::Value::Null);
        assert_eq!(lines[1]["kind"], "math");
        assert_eq!(lines[1]["build_seconds"], serde_json::Value::Null);
        assert_eq!(lines[2]["summary"]["tasks"], 2);
        assert_eq!(lines[2]["summary"]["bad"], serde_json::json!([]));
    }

    #[test]
    fn the_table_has_a_row_per_task_the_reasons_and_the_summary() {
        let outcomes = [
            valid("django__django-11880"),
            TaskOutcome {
                error: Some("environment build failed: no commit\nthe log".into()),
                ..TaskOutcome::new("django__django-9296", TaskKind::Swebench)
            },
        ];
        let text = table(&outcomes, &Summary::of(&outcomes, 60.0));
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].starts_with("task "), "{text}");
        assert!(lines[0].ends_with("failing tests"), "{text}");
        assert!(
            lines[1].contains("django__django-11880")
                && lines[1].contains("53.1")
                && lines[1].contains("resolved")
                && lines[1].contains("unresolved"),
            "{text}"
        );
        assert!(
            lines[2].contains("error: environment build failed: no commit"),
            "{text}"
        );
        assert!(!lines[2].contains("the log"), "one line per task: {text}");
        assert!(
            text.contains("django__django-9296: environment build failed: no commit\nthe log"),
            "the full reason below the table: {text}"
        );
        assert!(text.ends_with("2 tasks, 1 valid, 1 bad: django__django-9296 (60.0 s)\n"));
    }
}
