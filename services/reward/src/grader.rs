//! Grading one candidate for one task: the reward service's core, with no event in it.
//! The service feeds it every finished trial; `arl dataset validate` feeds it each task's
//! gold solution and an empty patch — so a dataset is checked by the very code that will
//! grade the policy on it.
//!
//! SWE-bench and Harbor candidates are evaluated in a fresh lease of the task's
//! environment (through `arl-sandbox-client`), math answers by exact match.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use arl_sandbox_client::{SandboxClient, SandboxError};
use arl_schemas::dataset::{Grading, HarborFile, TaskRecord, final_number, number_matches};
use arl_schemas::events::{FailureClass, TestReport, TestSetOutcome};
use arl_schemas::rpc::{ExecRequest, LeaseRequestV1, SandboxLimits};
use arl_schemas::{RunId, TrialId};
use serde::Deserialize;

use crate::grading::{GradingError, grade};
use crate::logparse::Parser;
use crate::swebench::{EvalPlan, Guard};

/// How a SWE-bench instance's tests are run (the `instances.json` form's fields).
#[derive(Clone, Debug, Deserialize)]
pub struct TestCommand {
    pub instance_id: String,
    #[serde(default)]
    pub eval_env: Vec<String>,
    pub test_command: String,
}

/// Reads test commands from an `instances.json` file.
pub fn load_test_commands(path: &Path) -> Result<Vec<TestCommand>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
}

#[derive(Clone, Debug)]
pub struct RewardConfig {
    /// SWE-bench instances' test commands, by instance id.
    pub test_commands: HashMap<String, TestCommand>,
    /// Longest a test run may take.
    pub test_timeout: Duration,
    /// Longest to wait for a grading sandbox.
    pub lease_timeout: Duration,
}

impl Default for RewardConfig {
    fn default() -> Self {
        Self {
            test_commands: HashMap::new(),
            test_timeout: Duration::from_secs(1800),
            lease_timeout: Duration::from_secs(300),
        }
    }
}

/// Whose grading a sandbox is leased for: its lease events and spans name them.
#[derive(Clone, Debug)]
pub struct LeaseOwner {
    pub run_id: RunId,
    pub trial_id: Option<TrialId>,
}

/// What grading found.
#[derive(Clone, Debug, PartialEq)]
pub struct Grade {
    /// Share of the tests that passed, 0–1 (SWE-bench and math: 0 or 1).
    pub score: f64,
    pub resolved: bool,
    /// SWE-bench's FAIL_TO_PASS / PASS_TO_PASS outcome.
    pub tests: Option<TestReport>,
    /// The tests that failed, by name, where the grading knows names (SWE-bench; Harbor
    /// tasks verified with pytest).
    pub failed_tests: Vec<String>,
    /// The grading's canary broke: the candidate tampered with the test run (scored 0).
    pub tampered: bool,
}

/// Why grading did not produce a grade.
#[derive(Debug)]
pub enum GradeFailure {
    /// The grading cannot be done (no test output, no test command, …), with its class.
    Class(FailureClass, String),
    /// The sandbox could not be had or reached: worth another try.
    Sandbox(SandboxError),
}

impl std::fmt::Display for GradeFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Class(class, message) => write!(f, "{}: {message}", class.as_str()),
            Self::Sandbox(error) => write!(f, "infrastructure: {error}"),
        }
    }
}

/// Grades candidates in sandboxes leased through `sandboxes`. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Grader {
    sandboxes: SandboxClient,
    config: Arc<RewardConfig>,
}

impl Grader {
    pub fn new(sandboxes: SandboxClient, config: RewardConfig) -> Self {
        Self {
            sandboxes,
            config: Arc::new(config),
        }
    }

    /// Grades `candidate` (a patch, or a math answer) for `task`; an empty patch grades
    /// the environment's base as it is.
    pub async fn grade(
        &self,
        owner: &LeaseOwner,
        task: &TaskRecord,
        candidate: &str,
    ) -> Result<Grade, GradeFailure> {
        match &task.grading {
            Grading::Math { answer } => Ok(grade_answer(candidate, answer)),
            Grading::Swebench {
                repo,
                test_patch,
                fail_to_pass,
                pass_to_pass,
                version,
                ..
            } => {
                let tests = SwebenchTests {
                    repo,
                    version: version.as_deref(),
                    test_patch,
                    fail_to_pass,
                    pass_to_pass,
                };
                self.swebench(owner, task, candidate, &tests).await
            }
            Grading::Harbor { tests } => self.harbor(owner, task, candidate, tests).await,
        }
    }

    async fn swebench(
        &self,
        owner: &LeaseOwner,
        task: &TaskRecord,
        candidate: &str,
        tests: &SwebenchTests<'_>,
    ) -> Result<Grade, GradeFailure> {
        let command = self.test_command(task, tests)?;
        let parser = Parser::for_repo(tests.repo).ok_or_else(|| {
            grading_failure(GradingError::UnknownRepository(tests.repo.to_owned()), "")
        })?;
        // A fresh secret per grading: the candidate cannot know its markers or canary.
        let guard = Guard::new(&uuid::Uuid::new_v4().simple().to_string());
        let (plan, canary) = crate::swebench::eval_plan(
            candidate,
            tests.test_patch,
            &command.eval_env,
            &command.test_command,
            parser,
            &guard,
        );
        let (log, ()) = self.run_plan(owner, task, |_| (plan, ())).await?;
        let report = grade(
            tests.repo,
            &log,
            tests.fail_to_pass,
            tests.pass_to_pass,
            &guard,
            &canary,
        )
        .map_err(|e| grading_failure(e, &log))?;
        let failed_tests = report
            .fail_to_pass_tests
            .failed
            .iter()
            .chain(&report.pass_to_pass_tests.failed)
            .cloned()
            .collect();
        Ok(Grade {
            score: if report.resolved() { 1.0 } else { 0.0 },
            resolved: report.resolved(),
            tests: Some(TestReport {
                fail_to_pass: TestSetOutcome {
                    passed: report.fail_to_pass_tests.passed,
                    failed: report.fail_to_pass_tests.failed,
                },
                pass_to_pass: TestSetOutcome {
                    passed: report.pass_to_pass_tests.passed,
                    failed: report.pass_to_pass_tests.failed,
                },
            }),
            failed_tests,
            tampered: report.tampered,
        })
    }

    /// How an instance's tests run: its recorded command if an instances file has one, else
    /// the one SWE-bench's spec for its repository and version gives with the directives
    /// of its test patch.
    fn test_command(
        &self,
        task: &TaskRecord,
        tests: &SwebenchTests<'_>,
    ) -> Result<TestCommand, GradeFailure> {
        if let Some(recorded) = self.config.test_commands.get(task.task_id.as_str()) {
            return Ok(recorded.clone());
        }
        let derived = tests
            .version
            .ok_or(arl_swebench::SpecError::NoVersion)
            .and_then(|version| arl_swebench::test_run(tests.repo, version, tests.test_patch));
        match derived {
            Ok(run) => Ok(TestCommand {
                instance_id: task.task_id.to_string(),
                eval_env: run.eval_env,
                test_command: run.test_command,
            }),
            Err(error) => Err(GradeFailure::Class(
                FailureClass::GradingError,
                format!(
                    "no test command for SWE-bench instance {}: {error}",
                    task.task_id
                ),
            )),
        }
    }

    async fn harbor(
        &self,
        owner: &LeaseOwner,
        task: &TaskRecord,
        candidate: &str,
        tests: &[HarborFile],
    ) -> Result<Grade, GradeFailure> {
        let files: Vec<(String, String)> = tests
            .iter()
            .map(|f| (f.path.clone(), f.content.clone()))
            .collect();
        let guard = Guard::new(&uuid::Uuid::new_v4().simple().to_string());
        let (log, verdict) = self
            .run_plan(owner, task, |workdir| {
                crate::harbor::eval_plan(candidate, &files, workdir, &guard)
            })
            .await?;
        let grade =
            crate::harbor::grade(&log, &guard, &verdict).map_err(|e| grading_failure(e, &log))?;
        if let Some((passed, failed)) = grade.tests {
            tracing::info!(task = %task.task_id, passed, failed, "pytest results of the verifier");
        }
        Ok(Grade {
            score: grade.score.clamp(0.0, 1.0),
            resolved: grade.score >= 1.0,
            // The report's shape is SWE-bench's (FAIL_TO_PASS / PASS_TO_PASS).
            tests: None,
            failed_tests: grade.failed_tests,
            tampered: grade.tampered,
        })
    }

    /// Runs an evaluation plan in a fresh sandbox of the task's environment (`plan` makes it
    /// for the lease's workdir, with what reading its log needs); the log, and that.
    async fn run_plan<R>(
        &self,
        owner: &LeaseOwner,
        task: &TaskRecord,
        plan: impl FnOnce(&str) -> (EvalPlan, R),
    ) -> Result<(String, R), GradeFailure> {
        let timeout_s = self.config.test_timeout.as_secs();
        let request = LeaseRequestV1 {
            run_id: owner.run_id.clone(),
            trial_id: owner.trial_id.clone(),
            environment: task.environment.clone(),
            ttl_s: timeout_s + 300,
            limits: SandboxLimits::default(),
        };
        let lease = self
            .sandboxes
            .lease(&request, self.config.lease_timeout)
            .await
            .map_err(GradeFailure::Sandbox)?;
        let (plan, reading) = plan(&lease.grant.workdir);
        let result = async {
            if !plan.files.is_empty() {
                lease.write_all(&plan.files).await?;
            }
            lease
                .exec(&ExecRequest {
                    command: plan.command.clone(),
                    timeout_s: timeout_s as f64,
                    env: Default::default(),
                    stdin: None,
                })
                .await
        }
        .await;
        lease.release().await;
        let run = result.map_err(GradeFailure::Sandbox)?;
        let mut log = run.stdout;
        log.push_str(&run.stderr);
        if run.timed_out {
            return Err(GradeFailure::Class(
                FailureClass::GradingError,
                format!(
                    "the tests ran past {timeout_s} s and were stopped; log tail:\n{}",
                    tail(&log)
                ),
            ));
        }
        Ok((log, reading))
    }
}

/// What a SWE-bench grading needs of the task's hidden data.
struct SwebenchTests<'a> {
    repo: &'a str,
    version: Option<&'a str>,
    test_patch: &'a str,
    fail_to_pass: &'a [String],
    pass_to_pass: &'a [String],
}

/// A math answer graded by exact match of its final answer (no sandbox).
pub fn grade_answer(candidate: &str, answer: &str) -> Grade {
    let (form, found) = final_number(candidate);
    let resolved = found.is_some_and(|found| number_matches(&found, answer));
    // In the trial's grade span: what share of a run's answers keep the asked-for form.
    tracing::debug!(form = form.as_str(), resolved, "math answer");
    Grade {
        score: if resolved { 1.0 } else { 0.0 },
        resolved,
        tests: None,
        failed_tests: Vec::new(),
        tampered: false,
    }
}

fn grading_failure(error: GradingError, log: &str) -> GradeFailure {
    GradeFailure::Class(
        FailureClass::GradingError,
        format!("{error}; log tail:\n{}", tail(log)),
    )
}

fn tail(log: &str) -> &str {
    arl_runtime::text::tail(log, 2000)
}
