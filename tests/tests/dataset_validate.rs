//! `arl dataset validate SPEC`, the real binary: environments built by the image builder's
//! code, gold and empty patches graded by the reward service's grader in sandboxes of the
//! sandbox service, all inside the one `arl` process (with its private nats-server).
//!
//! - a SWE-bench instance picked by `data.task_ids` validates (gold resolves, empty does
//!   not), and broken rows are named: one whose base_commit is not the commit its
//!   environment recipe builds, one whose recipe's commit the repository does not hold;
//! - two django instances with no recorded recipe are built from SWE-bench's spec for
//!   django 3.1 and validate; they share one dependency environment;
//! - Harbor tasks: the examples' solutions pass and a no-op fails; a broken solution and
//!   a verifier that passes anything are named, with the failing pytest tests;
//! - math tasks have nothing to build (no server or sandbox is even started) and their
//!   answers are checked; a row that does not parse is named;
//! - unreadable specs and datasets are clear errors (exit 2).
//!
//! The whole of `examples/swebench-mini.toml` (six instances) is `make validate-swebench`.
//! SWE-bench environments are kept in `$TMPDIR/arl-environments` — the command's own
//! default, shared with `make validate-swebench` — so a second run builds nothing.
//! Needs `arl` and `arl-sandbox-init` built (`cargo build --bins`), pyenv's Python 3.6.15
//! and PyPI (pip) for a cold django build.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use arl_testkit::{built_binary, find_nats_server};
use serde_json::Value;

fn shared_swebench() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/data/swebench")
}

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples")
}

/// `arl dataset validate ARGS…` with only the settings a test gives (none of the
/// developer's ARL_SWEBENCH_RECIPES or ARL_ENVIRONMENTS_DIR).
fn validate(args: &[&str], env: &[(&str, &str)]) -> Output {
    let nats = find_nats_server().unwrap();
    Command::new(built_binary("arl"))
        .args(["dataset", "validate"])
        .args(args)
        .env_remove("ARL_SWEBENCH_RECIPES")
        .env_remove("ARL_SWEBENCH_REPOS")
        .env_remove("ARL_ENVIRONMENTS_DIR")
        .env("ARL_NATS_SERVER", nats)
        .envs(env.iter().copied())
        .output()
        .unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The command exited 0; otherwise what it printed is the failure message.
fn assert_succeeded(output: &Output) {
    assert!(
        output.status.success(),
        "{}\n{}",
        text(&output.stdout),
        text(&output.stderr)
    );
}

/// The task lines of `--json` output by task id, and the summary.
fn json_report(output: &Output) -> (Vec<Value>, Value) {
    let mut lines: Vec<Value> = text(&output.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    let summary = lines.pop().unwrap();
    (lines, summary["summary"].clone())
}

fn task<'a>(lines: &'a [Value], id: &str) -> &'a Value {
    lines
        .iter()
        .find(|l| l["task_id"] == id)
        .unwrap_or_else(|| panic!("no line for {id}: {lines:?}"))
}

fn is_valid(line: &Value) -> bool {
    line["gold_resolved"] == true && line["empty_resolved"] == false && line["error"].is_null()
}

/// A folder the sandbox user can traverse (environments and lease trees live under it).
fn scratch() -> tempfile::TempDir {
    let dir = tempfile::Builder::new()
        .prefix("arl-validate-test-")
        .tempdir()
        .unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    dir
}

fn write(path: &Path, content: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, content).unwrap();
}

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// The rows of the mini table, by instance id.
fn swebench_row(id: &str) -> Value {
    std::fs::read_to_string(shared_swebench().join("verified_mini_50.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .find(|r| r["instance_id"] == id)
        .unwrap()
}

/// Instances without a recorded recipe: SWE-bench's spec for their repository and version
/// gives their setup and test command (`crates/swebench`), and instances of one version
/// share one dependency environment, built once. (`make validate-swebench50` does all 50.)
#[test]
fn instances_without_a_recipe_are_built_from_swebench_specs_sharing_dependencies() {
    let files = scratch();
    // Its own kept folder: one validation builds in a folder at a time, and the other
    // SWE-bench test here runs beside this one in `$TMPDIR/arl-environments`.
    let environments = std::env::temp_dir().join("arl-environments-derived");
    let ids = ["django__django-12155", "django__django-12050"];
    let spec = files.path().join("derived.toml");
    write(
        &spec,
        &format!(
            "[data]\ndataset = {:?}\nsource = \"swebench\"\ntask_ids = {ids:?}\n",
            shared_swebench()
                .join("verified_mini_50.jsonl")
                .display()
                .to_string()
        ),
    );
    let repos = shared_swebench().join("repos");
    let output = validate(
        &[
            spec.to_str().unwrap(),
            "--json",
            "--swebench-repos",
            repos.to_str().unwrap(),
            "--environments-dir",
            environments.to_str().unwrap(),
        ],
        &[],
    );
    assert_succeeded(&output);
    let (lines, _) = json_report(&output);
    let mut mounts = Vec::new();
    for id in ids {
        let line = task(&lines, id);
        assert!(is_valid(line), "{line}");
        // The tree only: the dependencies are in the shared environment.
        assert!(line["disk_bytes"].as_u64().unwrap() > 1_000_000, "{line}");
        assert!(
            line["shared_environment"]
                .as_str()
                .unwrap()
                .starts_with("shared/swebench/django__django-3.1-"),
            "{line}"
        );
        let metadata: Value = serde_json::from_slice(
            &std::fs::read(
                environments
                    .join("swebench")
                    .join(id)
                    .join("environment.json"),
            )
            .unwrap(),
        )
        .unwrap();
        let opt = metadata["mounts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["target"] == "/opt/arl")
            .unwrap()["source"]
            .as_str()
            .unwrap()
            .to_owned();
        assert!(
            opt.starts_with("shared/swebench/django__django-3.1-"),
            "{opt}"
        );
        mounts.push(opt);
    }
    assert_eq!(mounts[0], mounts[1], "one dependency environment for both");
}

const WRONG_COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

#[test]
fn a_swebench_instance_validates_and_broken_rows_are_named() {
    let files = scratch();
    let recipes = shared_swebench().join("instances.json");
    let environments = std::env::temp_dir().join("arl-environments");
    let environments = environments.to_str().unwrap();

    // One real instance, picked by data.task_ids from the whole table.
    let spec = files.path().join("one.toml");
    write(
        &spec,
        &format!(
            "[data]\ndataset = {:?}\nsource = \"swebench\"\ntask_ids = [\"django__django-11880\"]\n",
            shared_swebench()
                .join("verified_mini_50.jsonl")
                .display()
                .to_string()
        ),
    );
    let spec = spec.display().to_string();
    let output = validate(
        &[
            &spec,
            "--json",
            "--swebench-recipes",
            recipes.to_str().unwrap(),
            "--environments-dir",
            environments,
        ],
        &[],
    );
    assert_succeeded(&output);
    let (lines, summary) = json_report(&output);
    assert_eq!(lines.len(), 1);
    let line = &lines[0];
    assert_eq!(line["task_id"], "django__django-11880");
    assert!(is_valid(line), "{line}");
    assert_eq!(line["failing_tests"], serde_json::json!([]));
    assert!(line["build_seconds"].as_f64().unwrap() >= 0.0);
    assert_eq!(
        (summary["tasks"].clone(), summary["valid"].clone()),
        (1.into(), 1.into())
    );

    // Broken rows, in a dataset beside the spec (its path relative to the spec's folder):
    // django__django-11951 with a base_commit its recipe does not build, and
    // django__django-9296 whose row and recipe agree on a commit the repository lacks.
    let mut wrong_row = swebench_row("django__django-11951");
    wrong_row["base_commit"] = WRONG_COMMIT.into();
    let mut missing_commit = swebench_row("django__django-9296");
    let real_commit = missing_commit["base_commit"].as_str().unwrap().to_owned();
    missing_commit["base_commit"] = WRONG_COMMIT.into();
    write(
        &files.path().join("data/rows.jsonl"),
        &format!("{wrong_row}\n{missing_commit}\n"),
    );
    let mut instances: Vec<Value> =
        serde_json::from_str(&std::fs::read_to_string(&recipes).unwrap()).unwrap();
    for instance in &mut instances {
        // The source repositories stay where they are.
        let repo = shared_swebench().join(instance["source_repo"].as_str().unwrap());
        instance["source_repo"] = repo.display().to_string().into();
        if instance["instance_id"] == "django__django-9296" {
            instance["base_commit"] = WRONG_COMMIT.into();
            let commands: Vec<Value> = instance["setup_commands"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| {
                    c.as_str()
                        .unwrap()
                        .replace(&real_commit, WRONG_COMMIT)
                        .into()
                })
                .collect();
            instance["setup_commands"] = commands.into();
        }
    }
    let broken_recipes = files.path().join("instances.json");
    write(&broken_recipes, &serde_json::to_string(&instances).unwrap());
    let spec = files.path().join("broken.toml");
    write(
        &spec,
        "[data]\ndataset = \"data/rows.jsonl\"\nsource = \"swebench\"\n",
    );
    let output = validate(
        &[
            spec.to_str().unwrap(),
            "--swebench-recipes",
            broken_recipes.to_str().unwrap(),
            "--environments-dir",
            environments,
        ],
        &[],
    );
    let table = text(&output.stdout);
    assert_eq!(
        output.status.code(),
        Some(1),
        "{table}\n{}",
        text(&output.stderr)
    );
    assert!(
        table.contains(&format!(
            "django__django-11951: the dataset's base_commit {WRONG_COMMIT} is not the commit its environment recipe"
        )),
        "{table}"
    );
    assert!(
        table.contains(
            "django__django-9296: environment build failed: the source repository does not hold the base commit"
        ),
        "{table}"
    );
    assert!(
        table.contains("2 tasks, 0 valid, 2 bad: django__django-11951, django__django-9296 ("),
        "{table}"
    );
}

/// fix-mean's solution made wrong (an integer mean; it also exits 3), verified with
/// pytest so the failing test is named.
const WRONG_SOLUTION: &str = r#"#!/usr/bin/env bash
set -eu
cd "${APP_DIR:-/app}"
cat > stats.py <<'PY'
def mean(values):
    if not values:
        raise ValueError("mean of an empty list")
    return sum(values) // len(values)
PY
exit 3
"#;

const PYTEST_VERIFIER: &str = r#"#!/usr/bin/env bash
set -u
cd "${APP_DIR:-/app}"
if PYTHONPATH="${APP_DIR:-/app}" python3 -m pytest -p no:cacheprovider "$(dirname "$0")/test_outputs.py"; then
    echo 1 > "$LOGS_DIR/verifier/reward.txt"
else
    echo 0 > "$LOGS_DIR/verifier/reward.txt"
fi
"#;

const PYTEST_TESTS: &str = r#"import pytest

from stats import mean


def test_mean_of_several():
    assert mean([1, 2, 3, 4]) == 2.5


def test_mean_of_one():
    assert mean([5]) == 5


def test_empty_raises():
    with pytest.raises(ValueError):
        mean([])
"#;

/// A verifier that passes whatever the work tree holds.
const ANYTHING_PASSES: &str = "#!/usr/bin/env bash\nmkdir -p \"$LOGS_DIR/verifier\"\necho 1 > \"$LOGS_DIR/verifier/reward.txt\"\n";

#[test]
fn harbor_solutions_must_pass_and_a_no_op_must_fail() {
    let files = scratch();
    let tasks = files.path().join("tasks");
    copy_tree(&examples().join("tasks"), &tasks);
    write(&tasks.join("fix-mean/solution/solve.sh"), WRONG_SOLUTION);
    write(&tasks.join("fix-mean/tests/test.sh"), PYTEST_VERIFIER);
    write(&tasks.join("fix-mean/tests/test_outputs.py"), PYTEST_TESTS);
    copy_tree(
        &examples().join("tasks/fix-fizzbuzz"),
        &tasks.join("passes-anything"),
    );
    write(
        &tasks.join("passes-anything/tests/test.sh"),
        ANYTHING_PASSES,
    );
    let spec = files.path().join("harbor.toml");
    write(&spec, "[data]\ndataset = \"tasks\"\nsource = \"harbor\"\n");
    let environments = files.path().join("environments");
    let output = validate(
        &[
            spec.to_str().unwrap(),
            "--json",
            "--environments-dir",
            environments.to_str().unwrap(),
        ],
        &[],
    );
    assert_eq!(
        output.status.code(),
        Some(1),
        "{}\n{}",
        text(&output.stdout),
        text(&output.stderr)
    );
    let (lines, summary) = json_report(&output);
    for id in ["fix-fizzbuzz", "write-is-palindrome"] {
        let line = task(&lines, id);
        assert!(is_valid(line), "{line}");
        assert_eq!(line["kind"], "harbor");
    }
    let broken = task(&lines, "fix-mean");
    assert_eq!(broken["gold_resolved"], false, "{broken}");
    assert_eq!(broken["empty_resolved"], false, "{broken}");
    let failing: Vec<&str> = broken["failing_tests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert!(
        failing.len() == 1 && failing[0].ends_with("test_mean_of_several"),
        "{broken}"
    );
    assert!(
        broken["note"]
            .as_str()
            .unwrap()
            .starts_with("solve.sh exited 3"),
        "{broken}"
    );
    let lenient = task(&lines, "passes-anything");
    assert_eq!(lenient["gold_resolved"], true, "{lenient}");
    assert_eq!(lenient["empty_resolved"], true, "{lenient}");
    assert_eq!(
        summary["bad"],
        serde_json::json!(["fix-mean", "passes-anything"])
    );
    assert_eq!(summary["valid"], 2);
}

#[test]
fn math_tasks_have_nothing_to_build_and_bad_answers_are_named() {
    // No server is started for math: a nats-server that does not exist changes nothing.
    let no_server = [("ARL_NATS_SERVER", "/nonexistent/nats-server")];
    let spec = examples().join("arithmetic.toml");
    let output = Command::new(built_binary("arl"))
        .args(["dataset", "validate", spec.to_str().unwrap(), "--json"])
        .envs(no_server)
        .output()
        .unwrap();
    assert_succeeded(&output);
    let (lines, summary) = json_report(&output);
    assert!(lines.len() > 100);
    for line in &lines {
        assert!(is_valid(line), "{line}");
        assert_eq!(line["kind"], "math");
        assert!(line["build_seconds"].is_null(), "{line}");
        assert!(
            line["note"]
                .as_str()
                .unwrap()
                .starts_with("nothing to build"),
            "{line}"
        );
    }
    assert_eq!(summary["valid"], lines.len());

    let files = scratch();
    write(
        &files.path().join("gsm.jsonl"),
        "{\"question\": \"2+2?\", \"answer\": \"2+2=4\\n#### 4\"}\n{\"question\": \"x?\", \"answer\": \"no final answer\"}\n",
    );
    let spec = files.path().join("gsm.toml");
    write(
        &spec,
        "[data]\ndataset = \"gsm.jsonl\"\nsource = \"gsm8k\"\n",
    );
    let output = Command::new(built_binary("arl"))
        .args(["dataset", "validate", spec.to_str().unwrap()])
        .envs(no_server)
        .output()
        .unwrap();
    let table = text(&output.stdout);
    assert_eq!(output.status.code(), Some(1), "{table}");
    assert!(
        table.contains(
            "gsm.jsonl:2: the row did not load: field answer: must end with `#### <number>`"
        ),
        "{table}"
    );
    assert!(table.contains("2 tasks, 1 valid, 1 bad: "), "{table}");
}

#[test]
fn unreadable_specs_and_datasets_are_named() {
    let files = scratch();
    let missing_spec = files.path().join("nope.toml");
    let output = validate(&[missing_spec.to_str().unwrap()], &[]);
    assert_eq!(output.status.code(), Some(2));
    let error = text(&output.stderr);
    assert!(
        error.contains(&format!("cannot read {}", missing_spec.display())),
        "{error}"
    );

    let spec = files.path().join("spec.toml");
    write(
        &spec,
        "[data]\ndataset = \"missing.jsonl\"\nsource = \"swebench\"\n",
    );
    let output = validate(&[spec.to_str().unwrap()], &[]);
    assert_eq!(output.status.code(), Some(2));
    let error = text(&output.stderr);
    assert!(
        error.contains(&format!(
            "cannot read {}",
            files.path().join("missing.jsonl").display()
        )),
        "{error}"
    );

    write(
        &spec,
        &format!(
            "[data]\ndataset = {:?}\nsource = \"swebench\"\ntask_ids = [\"django__django-1\"]\n",
            shared_swebench()
                .join("verified_mini_50.jsonl")
                .display()
                .to_string()
        ),
    );
    let output = validate(&[spec.to_str().unwrap()], &[]);
    assert_eq!(output.status.code(), Some(2));
    let error = text(&output.stderr);
    assert!(
        error.contains("data.task_ids names django__django-1, which the dataset does not have"),
        "{error}"
    );
}
