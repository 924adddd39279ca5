//! The reward service: every `trial.finished` is graded in a clean sandbox of its task's
//! environment (or, for math, by exact match) and answered with `reward.scored` — the
//! reward and its breakdown — or with `trial.failed` of class `grading_error` (the
//! grading could not be done: no test output, unknown task) or `infrastructure` (no
//! sandbox after retries). Never a silent zero.

use std::time::{Duration, Instant};
use tracing::Instrument;

use arl_runtime::consumer::run_consumer;
use arl_runtime::{Bus, ConsumerSpec, Delivery, HandlerError, Shutdown};
use arl_sandbox_client::SandboxClient;
use arl_schemas::events::{
    FailureClass, RewardBreakdown, RewardScoredV2, TrialFailedV1, TrialFinishedV1,
};
use arl_schemas::spec::RunSpec;

use crate::grader::{Grade, GradeFailure, Grader, LeaseOwner};
pub use crate::grader::{RewardConfig, TestCommand, load_test_commands};

const SERVICE: &str = "reward";
/// Deliveries of one trial before a sandbox that cannot be had becomes an
/// `infrastructure` failure (the consumer's own limit is higher, so this one decides).
const SANDBOX_ATTEMPTS: i64 = 3;

#[derive(Clone)]
pub struct RewardService {
    bus: Bus,
    grader: Grader,
}

impl RewardService {
    pub fn new(bus: Bus, config: RewardConfig) -> Self {
        Self {
            grader: Grader::new(SandboxClient::new(bus.clone()), config),
            bus,
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
            .check_requested(
                &trial.trial_id,
                trial.slot.attempt,
                "trial.finished",
                delivery.published,
            )
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
                let owner = LeaseOwner {
                    run_id: trial.run_id.clone(),
                    // Under the trial's id: its sandbox events belong to the trial's trace.
                    trial_id: Some(trial.trial_id.clone()),
                };
                self.grader
                    .grade(&owner, task, &trial.patch)
                    .instrument(span.clone())
                    .await
            }
            None => Err(GradeFailure::Class(
                FailureClass::GradingError,
                format!(
                    "task {} is not in the run's registered dataset",
                    trial.slot.task_id
                ),
            )),
        };
        match outcome {
            Ok(grade) => {
                if grade.tampered {
                    tracing::warn!(trial = %trial.trial_id, "the grading canary broke: the candidate tampered with the test run; scored 0");
                }
                let scored = scored(&trial, &spec, grade, started.elapsed());
                span.record("reward", scored.reward);
                span.record("resolved", scored.resolved);
                tracing::info!(trial = %trial.trial_id, reward = scored.reward, resolved = scored.resolved, "graded");
                self.bus.publish(&scored).await?;
                Ok(())
            }
            Err(GradeFailure::Sandbox(error)) if delivery.attempt < SANDBOX_ATTEMPTS => {
                Err(HandlerError::retry(error))
            }
            Err(GradeFailure::Sandbox(error)) => {
                self.fail(&trial, FailureClass::Infrastructure, error.to_string())
                    .await
            }
            Err(GradeFailure::Class(class, message)) => self.fail(&trial, class, message).await,
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
