//! Grading a Harbor task: in a clean sandbox of the task's environment, apply the trial's
//! patch, put the task's hidden `tests/` folder in place, run `tests/test.sh` (it writes
//! the reward to `$LOGS_DIR/verifier/reward.txt`, as Harbor's verifier reads it) and
//! report that number.

use crate::grading::GradingError;
use crate::swebench::EvalPlan;

/// Where the tests are written inside the work tree (the agent never saw this sandbox).
pub const TESTS_DIR: &str = ".arl-eval/tests";
const REWARD_MARKER: &str = ">>>>> Reward:";

/// `tests`: the task's `tests/` files as (path relative to `tests/`, content).
pub fn eval_plan(candidate: &str, tests: &[(String, String)], workdir: &str) -> EvalPlan {
    let mut files: Vec<(String, String)> = tests
        .iter()
        .map(|(path, content)| (format!("{TESTS_DIR}/{path}"), content.clone()))
        .collect();
    let mut script = String::from("exec 2>&1\n");
    if !candidate.trim().is_empty() {
        files.push((
            crate::swebench::CANDIDATE_PATCH.to_owned(),
            candidate.to_owned(),
        ));
        script.push_str(&format!(
            "git apply -v {} || echo '>>>>> Patch Apply Failed'\n",
            crate::swebench::CANDIDATE_PATCH
        ));
    }
    script.push_str(&format!(
        "export APP_DIR={workdir} LOGS_DIR=/tmp/arl-logs\nmkdir -p \"$LOGS_DIR/verifier\"\n\
         bash {TESTS_DIR}/test.sh\necho \"{REWARD_MARKER} $(cat \"$LOGS_DIR/verifier/reward.txt\" 2>/dev/null)\"\n"
    ));
    EvalPlan {
        files,
        command: script,
    }
}

/// The reward the test script wrote; a missing or non-numeric one is a grading error.
pub fn reward_from_log(log: &str) -> Result<f64, GradingError> {
    let line = log
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix(REWARD_MARKER))
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

    #[test]
    fn the_reward_is_read_from_the_marker_or_is_an_error() {
        assert_eq!(reward_from_log("ok\n>>>>> Reward: 1\n"), Ok(1.0));
        assert_eq!(reward_from_log(">>>>> Reward: 0.5"), Ok(0.5));
        assert_eq!(
            reward_from_log(">>>>> Reward: "),
            Err(GradingError::NoTestOutput)
        );
        assert_eq!(reward_from_log("nothing"), Err(GradingError::NoTestOutput));
    }

    #[test]
    fn plans_write_the_hidden_tests_and_apply_the_patch_first() {
        let plan = eval_plan("diff\n", &[("test.sh".into(), "echo".into())], "/app");
        assert_eq!(plan.files[0].0, ".arl-eval/tests/test.sh");
        assert!(
            plan.command.find("git apply").unwrap()
                < plan.command.find("bash .arl-eval/tests/test.sh").unwrap()
        );
        assert!(plan.command.contains("APP_DIR=/app"));
    }
}
