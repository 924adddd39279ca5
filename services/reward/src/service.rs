//! The reward service: every `trial.finished` is graded in a clean sandbox of its task's
//! environment (or, for math, by exact match) and answered with `reward.scored` — the
//! reward and its breakdown — or with `trial.failed` of class `grading_error` (the
//! grading could not be done: no test output, unknown task) or `infrastructure` (no
//! sandbox after retries). Never a silent zero.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::Instrument;

use arl_runtime::consumer::run_consumer;
use arl_runtime::{Bus, ConsumerSpec, Delivery, HandlerError, Shutdown};
use arl_sandbox_client::{SandboxClient, SandboxError};
use arl_schemas::dataset::{Grading, TaskRecord, answer_matches};
use arl_schemas::events::{
    FailureClass, RewardBreakdown, RewardScoredV2, TestReport, TestSetOutcome, TrialFailedV1,
    TrialFinishedV1,
};
use arl_schemas::rpc::{ExecRequest, LeaseRequestV1, SandboxLimits};
use arl_schemas::spec::RunSpec;
use serde::Deserialize;

use crate::grading::{GradingError, grade};
use crate::logparse::Parser;
use crate::swebench::{EvalPlan, Guard};

const SERVICE: &str = "reward";
/// Deliveries of one trial before a sandbox that cannot be had becomes an
/// `infrastructure` failure (the consumer's own limit is higher, so this one decides).
const SANDBOX_ATTEMPTS: i64 = 3;

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

#[derive(Clone)]
pub struct RewardService {
    bus: Bus,
    sandboxes: SandboxClient,
    config: Arc<RewardConfig>,
}

/// What grading found.
#[derive(Debug)]
struct Grade {
    /// Share of the tests that passed, 0–1 (SWE-bench and math: 0 or 1).
    score: f64,
    resolved: bool,
    tests: Option<TestReport>,
}

/// Why grading did not produce a grade.
#[derive(Debug)]
enum Failure {
    Class(FailureClass, String),
    /// The sandbox could not be had or reached: worth another delivery.
    Sandbox(SandboxError),
}

impl RewardService {
    pub fn new(bus: Bus, config: RewardConfig) -> Self {
        Self {
            sandboxes: SandboxClient::new(bus.clone()),
            bus,
            config: Arc::new(config),
        }
    }

    pub fn start(&self, shutdown: &Shutdown, concurrency: usize) {
        let ns = self.bus.namespace();
        let mut spec = ConsumerSpec::for_event::<TrialFinishedV1>(ns, SERVICE);
        spec.keep_alive = true;
        spec.concurrency = concurrency.max(1);
        spec.max_deliver = SANDBOX_ATTEMPTS + 2;
        let service = self.clone();
        shutdown.spawn(run_consumer(
            self.bus.clone(),
            spec,
            move |delivery: Delivery| {
                let service = service.clone();
                async move { service.on_trial_finished(delivery).await }
            },
            shutdown.clone(),
        ));
    }

    async fn on_trial_finished(&self, delivery: Delivery) -> Result<(), HandlerError> {
        let trial: TrialFinishedV1 = delivery.decode()?;
        // Only the rollout's own trials are graded: a forged trial.finished could
        // otherwise buy a reward for a trial nobody ran.
        self.bus
            .check_requested(&trial.trial_id, trial.slot.attempt, "trial.finished")
            .await?;
        let arl_runtime::RunContext { state, spec } = self.bus.run_context(&trial.run_id).await?;
        let task = match &state.dataset_digest {
            None => {
                return Err(HandlerError::retry(format!(
                    "run {} has no registered dataset yet",
                    trial.run_id
                )));
            }
            Some(digest) => self
                .bus
                .dataset_manifest(digest)
                .await?
                .and_then(|m| m.task(&trial.slot.task_id).cloned()),
        };
        let started = Instant::now();
        let span = tracing::info_span!(
            "grade",
            trial = %trial.trial_id,
            task = %trial.slot.task_id,
            kind = tracing::field::Empty,
            reward = tracing::field::Empty,
            resolved = tracing::field::Empty,
        );
        let outcome = match &task {
            Some(task) => {
                span.record("kind", format!("{:?}", task.kind).as_str());
                self.grade(&trial, task).instrument(span.clone()).await
            }
            None => Err(Failure::Class(
                FailureClass::GradingError,
                format!(
                    "task {} is not in the run's registered dataset",
                    trial.slot.task_id
                ),
            )),
        };
        match outcome {
            Ok(grade) => {
                let scored = scored(&trial, &spec, grade, started.elapsed());
                span.record("reward", scored.reward);
                span.record("resolved", scored.resolved);
                tracing::info!(trial = %trial.trial_id, reward = scored.reward, resolved = scored.resolved, "graded");
                self.bus.publish(&scored).await?;
                Ok(())
            }
            Err(Failure::Sandbox(error)) if delivery.attempt < SANDBOX_ATTEMPTS => {
                Err(HandlerError::retry(error))
            }
            Err(Failure::Sandbox(error)) => {
                self.fail(&trial, FailureClass::Infrastructure, error.to_string())
                    .await
            }
            Err(Failure::Class(class, message)) => self.fail(&trial, class, message).await,
        }
    }

    async fn fail(
        &self,
        trial: &TrialFinishedV1,
        class: FailureClass,
        message: String,
    ) -> Result<(), HandlerError> {
        tracing::warn!(trial = %trial.trial_id, class = class.as_str(), %message, "grading failed");
        self.bus
            .publish(&TrialFailedV1 {
                run_id: trial.run_id.clone(),
                trial_id: trial.trial_id.clone(),
                slot: trial.slot.clone(),
                class,
                message,
                will_retry: false,
                failed_at: chrono::Utc::now(),
            })
            .await?;
        Ok(())
    }

    async fn grade(&self, trial: &TrialFinishedV1, task: &TaskRecord) -> Result<Grade, Failure> {
        match &task.grading {
            Grading::Math { answer } => {
                let resolved = answer_matches(&trial.patch, answer);
                Ok(Grade {
                    score: if resolved { 1.0 } else { 0.0 },
                    resolved,
                    tests: None,
                })
            }
            Grading::Swebench {
                repo,
                test_patch,
                fail_to_pass,
                pass_to_pass,
                ..
            } => {
                let command = self
                    .config
                    .test_commands
                    .get(task.task_id.as_str())
                    .ok_or_else(|| {
                        Failure::Class(
                            FailureClass::GradingError,
                            format!(
                                "no test command for SWE-bench instance {}: give the reward service an instances file that has it (--swebench-recipes)",
                                task.task_id
                            ),
                        )
                    })?;
                let parser = Parser::for_repo(repo).ok_or_else(|| {
                    grading_failure(GradingError::UnknownRepository(repo.clone()), "")
                })?;
                // A fresh secret per grading: the candidate cannot know its markers or canary.
                let guard = Guard::new(&uuid::Uuid::new_v4().simple().to_string());
                let (plan, canary) = crate::swebench::eval_plan(
                    &trial.patch,
                    test_patch,
                    &command.eval_env,
                    &command.test_command,
                    parser,
                    &guard,
                );
                let (log, ()) = self.run_plan(trial, task, |_| (plan, ())).await?;
                let report = grade(repo, &log, fail_to_pass, pass_to_pass, &guard, &canary)
                    .map_err(|e| grading_failure(e, &log))?;
                if report.tampered {
                    tracing::warn!(trial = %trial.trial_id, "the grading canary broke: the candidate tampered with the test run; scored 0");
                }
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
                })
            }
            Grading::Harbor { tests } => {
                let files: Vec<(String, String)> = tests
                    .iter()
                    .map(|f| (f.path.clone(), f.content.clone()))
                    .collect();
                let guard = Guard::new(&uuid::Uuid::new_v4().simple().to_string());
                let (log, verdict) = self
                    .run_plan(trial, task, |workdir| {
                        crate::harbor::eval_plan(&trial.patch, &files, workdir, &guard)
                    })
                    .await?;
                let grade = crate::harbor::grade(&log, &guard, &verdict)
                    .map_err(|e| grading_failure(e, &log))?;
                if grade.tampered {
                    tracing::warn!(trial = %trial.trial_id, "the grading canary broke: the candidate tampered with the test run; scored 0");
                }
                if let Some((passed, failed)) = grade.tests {
                    tracing::info!(trial = %trial.trial_id, passed, failed, "pytest results of the verifier");
                }
                Ok(Grade {
                    score: grade.score.clamp(0.0, 1.0),
                    resolved: grade.score >= 1.0,
                    // The report's shape is SWE-bench's (FAIL_TO_PASS / PASS_TO_PASS).
                    tests: None,
                })
            }
        }
    }

    /// Runs an evaluation plan in a fresh sandbox of the task's environment (`plan` makes it
    /// for the lease's workdir, with what reading its log needs); the log, and that.
    async fn run_plan<R>(
        &self,
        trial: &TrialFinishedV1,
        task: &TaskRecord,
        plan: impl FnOnce(&str) -> (EvalPlan, R),
    ) -> Result<(String, R), Failure> {
        let timeout_s = self.config.test_timeout.as_secs();
        let request = LeaseRequestV1 {
            run_id: trial.run_id.clone(),
            // Under the trial's id: its sandbox events belong to the trial's trace.
            trial_id: Some(trial.trial_id.clone()),
            environment: task.environment.clone(),
            ttl_s: timeout_s + 300,
            limits: SandboxLimits::default(),
        };
        let lease = self
            .sandboxes
            .lease(&request, self.config.lease_timeout)
            .await
            .map_err(Failure::Sandbox)?;
        let (plan, reading) = plan(&lease.grant.workdir);
        let result = async {
            for (path, content) in &plan.files {
                lease.write(path, content).await?;
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
        let run = result.map_err(Failure::Sandbox)?;
        let mut log = run.stdout;
        log.push_str(&run.stderr);
        if run.timed_out {
            return Err(Failure::Class(
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

fn grading_failure(error: GradingError, log: &str) -> Failure {
    Failure::Class(
        FailureClass::GradingError,
        format!("{error}; log tail:\n{}", tail(log)),
    )
}

fn tail(log: &str) -> &str {
    arl_runtime::text::tail(log, 2000)
}

/// Lines a patch adds or removes.
pub fn changed_lines(patch: &str) -> usize {
    patch
        .lines()
        .filter(|l| {
            (l.starts_with('+') && !l.starts_with("+++"))
                || (l.starts_with('-') && !l.starts_with("---"))
        })
        .count()
}

/// The reward of a grade under the run's reward spec: `pass` × score, and the bonuses
/// only for a resolved trial.
pub fn breakdown(
    spec: &RunSpec,
    resolved: bool,
    score: f64,
    patch: &str,
    seconds: f64,
) -> RewardBreakdown {
    let short = resolved && changed_lines(patch) < 20;
    let fast = resolved && seconds < f64::from(spec.rollout.timeout_s) / 4.0;
    RewardBreakdown {
        pass: spec.reward.pass * score,
        short_patch_bonus: if short {
            spec.reward.short_patch_bonus
        } else {
            0.0
        },
        fast_bonus: if fast { spec.reward.fast_bonus } else { 0.0 },
    }
}

fn scored(
    trial: &TrialFinishedV1,
    spec: &RunSpec,
    grade: Grade,
    grading: Duration,
) -> RewardScoredV2 {
    let breakdown = breakdown(
        spec,
        grade.resolved,
        grade.score,
        &trial.patch,
        trial.duration_seconds,
    );
    RewardScoredV2 {
        run_id: trial.run_id.clone(),
        trial_id: trial.trial_id.clone(),
        slot: trial.slot.clone(),
        reward: breakdown.pass + breakdown.short_patch_bonus + breakdown.fast_bonus,
        breakdown,
        resolved: grade.resolved,
        tests: grade.tests,
        grading_seconds: grading.as_secs_f64(),
        at: chrono::Utc::now(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bonuses_go_only_to_resolved_short_or_fast_trials() {
        let mut spec = RunSpec::default();
        spec.reward.short_patch_bonus = 0.1;
        spec.reward.fast_bonus = 0.05;
        spec.rollout.timeout_s = 400;
        let short = "--- a/x\n+++ b/x\n-old\n+new\n";
        let long: String = (0..30).map(|i| format!("+line {i}\n")).collect();
        let b = breakdown(&spec, true, 1.0, short, 50.0);
        assert_eq!(
            (b.pass, b.short_patch_bonus, b.fast_bonus),
            (1.0, 0.1, 0.05)
        );
        let b = breakdown(&spec, true, 1.0, &long, 150.0);
        assert_eq!((b.pass, b.short_patch_bonus, b.fast_bonus), (1.0, 0.0, 0.0));
        let b = breakdown(&spec, false, 0.0, short, 1.0);
        assert_eq!((b.pass, b.short_patch_bonus, b.fast_bonus), (0.0, 0.0, 0.0));
        let b = breakdown(&spec, false, 0.5, &long, 1.0);
        assert_eq!(
            b.pass, 0.5,
            "a Harbor score below 1 is a partial pass reward"
        );
        assert_eq!(changed_lines(short), 2);
    }
}
