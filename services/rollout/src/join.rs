//! The trial saga's second hand-off: a finished attempt's grade joined with its recorded
//! calls into `trajectory.ready`.
//!
//! Two durable consumers, shared by every replica: `reward.scored`, and `trial.failed` —
//! of which only the grader's count here: a failure for an attempt whose record says it
//! was handed to grading (the rollout announces its own failures before it hands off, or
//! instead). The record in `ARL_TRIALS` (written at the hand-off) carries what the grade
//! does not: the task, where the proxy stored the attempt's calls, the parse failures.
//! Whichever replica takes a grade reads the calls at those stream sequences and publishes; no
//! replica waits for a grade, and one that dies between hand-offs holds nothing.

use std::sync::Arc;
use std::time::Duration;
use tracing::Instrument;

use arl_runtime::{ConsumerSpec, Delivery, HandlerError, Shutdown};
use arl_schemas::events::{
    FailureClass, RewardScoredV2, SampleStatus, TrialFailedV1, TrialRequestedV1, TrialSlot,
};
use arl_schemas::state::{FinishedAttemptV1, TrialRecordV2};
use arl_schemas::{Bucket, RunId, TrialId};

use crate::llm::TrialError;
use crate::service::{AgentCounts, Rollout, SERVICE};

/// The durable consumer of grading failures on the trials stream (where `rollout` is
/// already the consumer of requests).
const FAILURES: &str = "rollout-grading-failures";
/// Deliveries of a grade before it is dead-lettered: a grade can arrive a moment before
/// its hand-off is recorded (the record is written just after `trial.finished`).
const GRADE_DELIVERIES: i64 = 20;

/// Starts the join's consumers.
pub(crate) fn start(rollout: &Arc<Rollout>, shutdown: &Shutdown) {
    let ns = rollout.bus.namespace();
    let retry_backoff = vec![
        Duration::from_secs(1),
        Duration::from_secs(5),
        Duration::from_secs(15),
        Duration::from_secs(30),
    ];
    // Kept alive while handled: a grading failure under a retry policy backs off before
    // requesting the next attempt.
    let mut grades = ConsumerSpec::for_event::<RewardScoredV2>(ns, SERVICE);
    grades.keep_alive = true;
    grades.max_deliver = GRADE_DELIVERIES;
    grades.retry_backoff = retry_backoff.clone();
    let mut failures = ConsumerSpec::for_event::<TrialFailedV1>(ns, FAILURES);
    failures.keep_alive = true;
    failures.max_deliver = GRADE_DELIVERIES;
    failures.retry_backoff = retry_backoff;
    rollout.consume(shutdown, grades, |r, d| async move { r.on_scored(d).await });
    rollout.consume(
        shutdown,
        failures,
        |r, d| async move { r.on_failed(d).await },
    );
}

impl Rollout {
    /// What a grade of `attempt` joins with: the attempt's hand-off, when it was handed
    /// to grading; None when it is done, superseded or was never handed off (nothing to
    /// join). An attempt still claimed without a recorded hand-off asks for the grade
    /// again later: its record is written just after `trial.finished`, or — for a failure
    /// the rollout announced itself — it is about to be done or retried.
    async fn handed_off(
        &self,
        trial: &TrialId,
        attempt: u32,
    ) -> Result<Option<FinishedAttemptV1>, HandlerError> {
        match self.bus.trial_record(trial).await? {
            Some(r) if r.attempt == attempt && !r.done => match r.finished {
                Some(finished) => Ok(Some(finished)),
                None => Err(HandlerError::retry(format!(
                    "trial {trial} attempt {attempt} is neither handed off nor done yet"
                ))),
            },
            _ => Ok(None),
        }
    }

    /// Clears an attempt's hand-off (it is claimed, not handed off, again).
    async fn withdraw_hand_off(&self, request: &TrialRequestedV1) -> Result<(), HandlerError> {
        let attempt = request.slot.attempt;
        self.bus
            .modify_record::<TrialRecordV2>(
                Bucket::Trials,
                request.trial_id.as_str(),
                |r| match r {
                    Some(r) if r.attempt == attempt && !r.done => {
                        r.finished = None;
                        true
                    }
                    _ => false,
                },
            )
            .await?;
        Ok(())
    }

    /// A grade: the trajectory of the attempt it grades.
    async fn on_scored(&self, delivery: Delivery) -> Result<(), HandlerError> {
        let scored: RewardScoredV2 = delivery.decode()?;
        let Some(finished) = self
            .handed_off(&scored.trial_id, scored.slot.attempt)
            .await?
        else {
            return Ok(());
        };
        let request = request_of(&scored.run_id, &scored.trial_id, &scored.slot, &finished);
        let read = match call_sequences(&finished) {
            Ok(sequences) => self.recorded_calls(&request, &sequences).await,
            Err(error) => Err(error),
        };
        let calls = match read {
            Ok(calls) => calls,
            // The proxy stores each record before its answer ends, so they are all there
            // unless the stream lost some: after the last delivery that fails the trial.
            Err(error) if delivery.attempt >= GRADE_DELIVERIES - 1 => {
                let spec = self.bus.run_context(&scored.run_id).await?.spec;
                // The rollout announces this failure itself: the attempt is taken back
                // from grading first, so its own `trial.failed` is not joined as a grade.
                self.withdraw_hand_off(&request).await?;
                return self.fail(&request, &spec, error, None, true).await;
            }
            Err(error) => return Err(HandlerError::retry(error.message)),
        };
        let status = if self.group_failed(&request).await? {
            SampleStatus::Masked
        } else {
            SampleStatus::Scored
        };
        self.metrics.trial("scored", None);
        self.metrics.turns.inc_by(u64::from(finished.calls));
        self.metrics
            .parse_failures
            .inc_by(u64::from(finished.parse_failures));
        let turns = u32::try_from(calls.len()).unwrap_or(u32::MAX);
        self.publish_trajectory(
            &request,
            status,
            scored.reward,
            &calls,
            turns,
            AgentCounts {
                parse_failures: finished.parse_failures,
                tool_calls: finished.tool_calls,
            },
        )
        .instrument(tracing::info_span!(
            "trajectory_handoff",
            otel.name = "trajectory hand-off",
            turns,
            reward = scored.reward,
            masked = status == SampleStatus::Masked,
        ))
        .await?;
        self.mark_done(&request).await
    }

    /// A `trial.failed`: the grader's (the attempt was handed to grading) goes through the
    /// run's failure policy; the rollout's own announcements are passed by.
    async fn on_failed(&self, delivery: Delivery) -> Result<(), HandlerError> {
        let failed: TrialFailedV1 = delivery.decode()?;
        let Some(finished) = self
            .handed_off(&failed.trial_id, failed.slot.attempt)
            .await?
        else {
            return Ok(());
        };
        let spec = self.bus.run_context(&failed.run_id).await?.spec;
        let request = request_of(&failed.run_id, &failed.trial_id, &failed.slot, &finished);
        let error = TrialError::new(failed.class, failed.message);
        // The grader already announced the failure.
        self.fail(
            &request,
            &spec,
            error,
            call_sequences(&finished).ok(),
            false,
        )
        .await
    }
}

/// Where a handed-off attempt's calls are stored. An error for a hand-off recorded before
/// the proxy reported sequences (its calls are on a per-trial subject, which is no longer
/// read): the attempt goes through its run's failure policy as `infrastructure`.
fn call_sequences(finished: &FinishedAttemptV1) -> Result<Vec<u64>, TrialError> {
    if finished.call_sequences.len() == finished.calls as usize {
        Ok(finished.call_sequences.clone())
    } else {
        Err(TrialError::new(
            FailureClass::Infrastructure,
            format!(
                "the hand-off counted {} calls but recorded where {} are stored (it was \
                 written by an older rollout service)",
                finished.calls,
                finished.call_sequences.len()
            ),
        ))
    }
}

/// The request of a handed-off attempt, as it was made (a retry repeats it).
fn request_of(
    run: &RunId,
    trial: &TrialId,
    slot: &TrialSlot,
    finished: &FinishedAttemptV1,
) -> TrialRequestedV1 {
    TrialRequestedV1 {
        run_id: run.clone(),
        trial_id: trial.clone(),
        slot: slot.clone(),
        task: finished.task.clone(),
    }
}
