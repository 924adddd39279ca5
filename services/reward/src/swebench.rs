//! How a SWE-bench patch is evaluated in a clean sandbox of the instance's environment
//! (a fresh lease: the work tree is at the base commit and the agent never saw the tests):
//! write the candidate patch and the instance's `test_patch` into the tree, apply them,
//! and run the test command between the harness's output markers. The log goes to
//! [`crate::grading::grade`].

/// Files to write into the work tree (relative paths), then one command to run there.
#[derive(Clone, Debug, PartialEq)]
pub struct EvalPlan {
    pub files: Vec<(String, String)>,
    pub command: String,
}

/// Where the patches are written, inside the work tree.
pub const CANDIDATE_PATCH: &str = ".arl-eval/candidate.patch";
pub const TEST_PATCH: &str = ".arl-eval/test.patch";

/// The evaluation of `candidate` (an empty patch is allowed: it grades the base commit).
pub fn eval_plan(
    candidate: &str,
    test_patch: &str,
    eval_env: &[String],
    test_command: &str,
) -> EvalPlan {
    let mut files = vec![(TEST_PATCH.to_owned(), test_patch.to_owned())];
    // Run by the sandbox's `/bin/sh` (POSIX): no bash options; every step runs regardless.
    // One stream, in order, like the harness's logs (the test runners write to stderr).
    let mut script = String::from("exec 2>&1\n");
    for line in eval_env {
        script.push_str(line);
        script.push('\n');
    }
    if !candidate.trim().is_empty() {
        files.push((CANDIDATE_PATCH.to_owned(), candidate.to_owned()));
        // A patch that does not apply is the agent's failure: the tests then run on what
        // is there, and the log says why.
        script.push_str(&format!(
            "git apply -v {CANDIDATE_PATCH} || echo '>>>>> Patch Apply Failed'\n"
        ));
    }
    script.push_str(&format!("git apply -v {TEST_PATCH}\n"));
    script.push_str(&format!(
        "echo '>>>>> Start Test Output'\n{test_command}\necho '>>>>> End Test Output'\n"
    ));
    EvalPlan {
        files,
        command: script,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_apply_the_candidate_then_the_tests_between_markers() {
        let plan = eval_plan(
            "diff --git a/x b/x\n",
            "diff --git a/t b/t\n",
            &["export LANG=C.UTF-8".into()],
            "./run-tests",
        );
        assert_eq!(plan.files.len(), 2);
        let apply_candidate = plan.command.find("candidate.patch").unwrap();
        let apply_tests = plan.command.find("test.patch").unwrap();
        let start = plan.command.find("echo '>>>>> Start Test Output'").unwrap();
        let run = plan.command.find("./run-tests").unwrap();
        assert!(apply_candidate < apply_tests && apply_tests < start && start < run);
        assert!(plan.command.starts_with("exec 2>&1\nexport LANG=C.UTF-8\n"));
        let empty = eval_plan("  \n", "t", &[], "x");
        assert_eq!(empty.files.len(), 1);
        assert!(!empty.command.contains("candidate"));
    }
}
