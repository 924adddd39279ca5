//! The bundled Harbor tasks are real: unsolved they score 0, with the reference solution
//! they score 1.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::Command;

fn tasks_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/tasks")
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

fn reward(task: &Path, app: &Path, logs: &Path) -> String {
    let status = Command::new("bash")
        .arg(task.join("tests/test.sh"))
        .env("APP_DIR", app)
        .env("LOGS_DIR", logs)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .unwrap();
    assert!(status.status.success(), "test.sh itself must not fail");
    std::fs::read_to_string(logs.join("verifier/reward.txt"))
        .unwrap()
        .trim()
        .to_owned()
}

#[test]
fn every_task_fails_unsolved_and_passes_with_its_solution() {
    let mut seen = 0;
    for entry in std::fs::read_dir(tasks_dir()).unwrap() {
        let task = entry.unwrap().path();
        for file in [
            "task.toml",
            "instruction.md",
            "environment/Dockerfile",
            "tests/test.sh",
            "solution/solve.sh",
        ] {
            assert!(task.join(file).is_file(), "{} lacks {file}", task.display());
        }
        let work = tempfile::tempdir().unwrap();
        let app = work.path().join("app");
        copy_dir(&task.join("environment/app"), &app);
        assert_eq!(
            reward(&task, &app, &work.path().join("logs0")),
            "0",
            "{} passes unsolved",
            task.display()
        );

        let solved = Command::new("bash")
            .arg(task.join("solution/solve.sh"))
            .env("APP_DIR", &app)
            .status()
            .unwrap();
        assert!(solved.success());
        assert_eq!(
            reward(&task, &app, &work.path().join("logs1")),
            "1",
            "{} fails solved",
            task.display()
        );
        seen += 1;
    }
    assert!(seen >= 3, "only {seen} example tasks");
}
