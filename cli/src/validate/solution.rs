//! A Harbor task's reference solution, run the way Harbor's oracle agent runs it: the
//! task's `solution/` folder is put beside the environment and `solve.sh` is executed from
//! there in the work tree, in a sandbox of the task's environment. What it leaves — the
//! lease's diff, exactly as the rollout takes an agent's work — is the task's gold patch.
//!
//! Harbor uploads the folder to `/solution`; a sandbox's root is read-only, so here it is
//! copied to `/tmp/arl-solution` (private to the command) before `solve.sh` runs, and it
//! never shows in the diff. Like Harbor, a failing `solve.sh` does not stop the check:
//! the verifier decides, and its exit status is kept to explain a failure.

use std::path::Path;
use std::time::Duration;

use arl_reward::grader::LeaseOwner;
use arl_sandbox_client::{SandboxClient, SandboxError};
use arl_schemas::dataset::TaskRecord;
use arl_schemas::rpc::{ExecRequest, LeaseRequestV1, SandboxLimits};

/// Where the folder is staged in the work tree, and where `solve.sh` runs it from.
const STAGED: &str = ".arl-solution";
const SOLUTION_DIR: &str = "/tmp/arl-solution";

/// What the solution left, and how `solve.sh` ended.
#[derive(Clone, Debug, PartialEq)]
pub struct SolutionRun {
    /// The work tree's diff against its base: the gold patch.
    pub patch: String,
    pub exit_code: i32,
    pub timed_out: bool,
    /// The end of what `solve.sh` printed.
    pub output_tail: String,
}

impl SolutionRun {
    /// Why the solution may have failed, for a report; None when `solve.sh` succeeded.
    pub fn trouble(&self) -> Option<String> {
        if self.timed_out {
            return Some(format!("solve.sh ran out of time: {}", self.output_tail));
        }
        (self.exit_code != 0)
            .then(|| format!("solve.sh exited {}: {}", self.exit_code, self.output_tail))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SolutionError {
    #[error("cannot read the solution folder: {0}")]
    Read(String),
    #[error(transparent)]
    Sandbox(#[from] SandboxError),
}

/// Runs the solution in `solution_dir` in a fresh lease of `task`'s environment.
pub async fn run(
    sandboxes: &SandboxClient,
    owner: &LeaseOwner,
    task: &TaskRecord,
    solution_dir: &Path,
    timeout: Duration,
) -> Result<SolutionRun, SolutionError> {
    let files = read_folder(solution_dir)?;
    let request = LeaseRequestV1 {
        run_id: owner.run_id.clone(),
        trial_id: owner.trial_id.clone(),
        environment: task.environment.clone(),
        ttl_s: timeout.as_secs() + 300,
        limits: SandboxLimits::default(),
    };
    let lease = sandboxes.lease(&request, Duration::from_secs(300)).await?;
    let result = async {
        let staged: Vec<(String, String)> = files
            .iter()
            .map(|(path, content)| (format!("{STAGED}/{path}"), content.clone()))
            .collect();
        lease.write_all(&staged).await?;
        let ran = lease
            .exec(&ExecRequest {
                command: solve_command(),
                timeout_s: timeout.as_secs_f64(),
                env: Default::default(),
                stdin: None,
            })
            .await?;
        let patch = lease.diff().await?;
        Ok::<_, SandboxError>((ran, patch))
    }
    .await;
    lease.release().await;
    let (ran, patch) = result?;
    let output = format!("{}{}", ran.stdout, ran.stderr);
    Ok(SolutionRun {
        patch,
        exit_code: ran.exit_code,
        timed_out: ran.timed_out,
        output_tail: arl_runtime::text::tail(output.trim(), 1000).to_owned(),
    })
}

/// Moves the staged folder out of the work tree, then runs `solve.sh` from it (Harbor:
/// `chmod +x /solution/solve.sh && /solution/solve.sh`), in the work tree.
fn solve_command() -> String {
    format!(
        "mkdir -p {SOLUTION_DIR} && cp -R {STAGED}/. {SOLUTION_DIR}/ && rm -rf {STAGED} \
         && chmod +x {SOLUTION_DIR}/solve.sh && {SOLUTION_DIR}/solve.sh"
    )
}

/// Every file of the folder (path relative to it, text), in a stable order.
fn read_folder(dir: &Path) -> Result<Vec<(String, String)>, SolutionError> {
    let mut files = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(folder) = pending.pop() {
        let entries = std::fs::read_dir(&folder)
            .map_err(|e| SolutionError::Read(format!("{}: {e}", folder.display())))?;
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                pending.push(path);
                continue;
            }
            let content = std::fs::read_to_string(&path).map_err(|e| {
                SolutionError::Read(format!(
                    "{}: {e} (solution files are written into the sandbox as text)",
                    path.display()
                ))
            })?;
            let relative = path.strip_prefix(dir).unwrap_or(&path);
            files.push((relative.to_string_lossy().into_owned(), content));
        }
    }
    files.sort();
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_solution_folder_is_read_whole_and_run_from_outside_the_tree() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("data")).unwrap();
        std::fs::write(dir.path().join("solve.sh"), "#!/bin/bash\n").unwrap();
        std::fs::write(dir.path().join("data/fix.py"), "x = 1\n").unwrap();
        let files = read_folder(dir.path()).unwrap();
        let names: Vec<&str> = files.iter().map(|(p, _)| p.as_str()).collect();
        assert_eq!(names, ["data/fix.py", "solve.sh"]);
        let command = solve_command();
        let removed = command.find("rm -rf .arl-solution").unwrap();
        let runs = command.rfind("/tmp/arl-solution/solve.sh").unwrap();
        assert!(
            removed < runs,
            "the staged copy is gone before solve.sh runs"
        );
    }

    #[test]
    fn a_failing_solve_sh_is_explained() {
        let run = SolutionRun {
            patch: String::new(),
            exit_code: 2,
            timed_out: false,
            output_tail: "boom".into(),
        };
        assert_eq!(run.trouble().unwrap(), "solve.sh exited 2: boom");
        let fine = SolutionRun {
            exit_code: 0,
            ..run
        };
        assert_eq!(fine.trouble(), None);
    }
}
