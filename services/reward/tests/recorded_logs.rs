//! Every saved evaluation log in `../shared/data/swebench/logs` (each instance before and
//! after its gold patch) grades exactly as the real harness recorded it in
//! `instances.json`: resolution, FAIL_TO_PASS and PASS_TO_PASS counts. (Those logs were
//! made with the harness's plain markers; the reward service's own plans add a nonce to
//! them and a canary to the run, which `grade` checks — the parsing is the same.)
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use arl_reward::grading::{GradingError, report, statuses};
use serde_json::Value;

/// The official harness's markers.
const MARKERS: (&str, &str) = (">>>>> Start Test Output", ">>>>> End Test Output");

fn data() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data/swebench")
}

/// FAIL_TO_PASS and PASS_TO_PASS of every instance in the 50-row table.
fn test_lists() -> HashMap<String, (Vec<String>, Vec<String>)> {
    let text = std::fs::read_to_string(data().join("verified_mini_50.jsonl")).unwrap();
    text.lines()
        .map(|line| {
            let row: Value = serde_json::from_str(line).unwrap();
            let list = |field: &str| -> Vec<String> {
                serde_json::from_str(row[field].as_str().unwrap()).unwrap()
            };
            (
                row["instance_id"].as_str().unwrap().to_owned(),
                (list("FAIL_TO_PASS"), list("PASS_TO_PASS")),
            )
        })
        .collect()
}

#[test]
fn saved_logs_grade_exactly_as_recorded() {
    let instances: Vec<Value> =
        serde_json::from_slice(&std::fs::read(data().join("instances.json")).unwrap()).unwrap();
    let lists = test_lists();
    let mut graded = 0;
    for instance in &instances {
        let id = instance["instance_id"].as_str().unwrap();
        let repo = instance["repo"].as_str().unwrap();
        let (f2p, p2p) = &lists[id];
        for run in ["before", "after"] {
            let recorded = &instance["grading"][run];
            let log =
                std::fs::read_to_string(data().join(recorded["log"].as_str().unwrap())).unwrap();
            let found = statuses(repo, &log, MARKERS.0, MARKERS.1).unwrap();
            let report = report(&found, f2p, p2p);
            let ours = serde_json::to_value(&report).unwrap();
            assert_eq!(
                ours["resolution"], recorded["resolution_status"],
                "{id} {run}"
            );
            assert_eq!(ours["fail_to_pass"], recorded["FAIL_TO_PASS"], "{id} {run}");
            assert_eq!(ours["pass_to_pass"], recorded["PASS_TO_PASS"], "{id} {run}");
            assert_eq!(report.resolved(), recorded["resolved"].as_bool().unwrap());
            graded += 1;
        }
    }
    assert_eq!(graded, 12);
}

#[test]
fn a_log_without_test_output_is_a_grading_error_not_a_zero() {
    assert_eq!(
        statuses(
            "django/django",
            "pip install failed\n",
            MARKERS.0,
            MARKERS.1
        )
        .unwrap_err(),
        GradingError::NoTestOutput
    );
    assert!(matches!(
        statuses(
            "someone/else",
            ">>>>> Start Test Output\n>>>>> End Test Output",
            MARKERS.0,
            MARKERS.1
        ),
        Err(GradingError::UnknownRepository(_))
    ));
}
