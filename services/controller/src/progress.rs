//! Folding the pipeline's events into a run's state. Pure functions: the service reads
//! the state, applies one event here, and writes it back with compare-and-set.

use arl_schemas::events::{
    DatasetRegisteredV1, EvaluationCompletedV1, FailureClass, RunCancelRequestedV1, RunCancelledV1,
    RunCompletedV1, RunFailedV1, RunPhase, RunProgressV1, Split, TrainStep, TrialFailedV1,
    WeightsPublishedV2,
};
use arl_schemas::state::{EvaluationSummary, RunStateV1, RunStatus, StepSummary};
use chrono::Utc;

/// Records that the event at `sequence` of `stream` is being applied. False if it was
/// applied before (a redelivery): applying it again would count it twice.
pub fn first_time(state: &mut RunStateV1, stream: &str, sequence: u64) -> bool {
    let applied = state.applied.entry(stream.to_owned()).or_insert(0);
    if sequence <= *applied {
        return false;
    }
    *applied = sequence;
    true
}

fn start_running(state: &mut RunStateV1) {
    if state.status == RunStatus::Accepted {
        state.status = RunStatus::Running;
    }
}

pub fn apply_train_step(state: &mut RunStateV1, event: &TrainStep) {
    start_running(state);
    if event.step() > state.step {
        state.step = event.step();
        state.policy_version = state.policy_version.max(event.policy_version());
    }
    if !state.steps.iter().any(|s| s.step == event.step()) {
        let metrics = event.metrics();
        state.steps.push(StepSummary {
            step: event.step(),
            policy_version: event.policy_version(),
            reward_mean: metrics.reward_mean,
            pg_loss: metrics.pg_loss,
            grad_norm: metrics.grad_norm,
            seconds: event.timing().total,
            batch: event.batch().cloned(),
            tool_calls_mean: Some(metrics.tool_calls_mean),
        });
        state.steps.sort_by_key(|s| s.step);
    }
    state.phase = if state.step >= state.total_steps {
        RunPhase::Evaluating
    } else {
        RunPhase::Rollout
    };
}

pub fn apply_dataset(state: &mut RunStateV1, event: &DatasetRegisteredV1) {
    state.dataset_digest = Some(event.digest.clone());
}

pub fn apply_evaluation(state: &mut RunStateV1, event: &EvaluationCompletedV1) {
    start_running(state);
    state.evaluations.retain(|e| e.step != event.step);
    state.evaluations.push(EvaluationSummary {
        step: event.step,
        resolution_rate: event.resolution_rate,
        ci95_low: event.ci95_low,
        ci95_high: event.ci95_high,
        pass_at_k: event.pass_at_k.iter().map(|p| (p.k, p.value)).collect(),
    });
    state.evaluations.sort_by_key(|e| e.step);
}

pub fn apply_trial_finished(state: &mut RunStateV1) {
    start_running(state);
    state.trials_finished += 1;
}

pub fn apply_trial_failed(state: &mut RunStateV1, event: &TrialFailedV1) {
    start_running(state);
    state.failures.add(event.class);
    let gave_up = !event.will_retry && event.class == FailureClass::Infrastructure;
    if gave_up && event.slot.split == Split::Train {
        *state
            .infrastructure_failures
            .entry(event.slot.step)
            .or_insert(0) += 1;
    }
}

pub fn apply_weights(state: &mut RunStateV1, event: &WeightsPublishedV2) {
    state.policy_version = state.policy_version.max(event.policy_version);
    state.checkpoint_uri = Some(event.uri());
}

/// A user's cancel ends a run that has not ended; a run that has keeps its end.
pub fn apply_cancel_request(state: &mut RunStateV1, event: &RunCancelRequestedV1) {
    if state.status.is_terminal() {
        return;
    }
    state.status = RunStatus::Cancelled;
    state.phase = RunPhase::Finishing;
    let why = if event.reason.is_empty() {
        String::new()
    } else {
        format!(": {}", event.reason)
    };
    state.failure_reason = Some(format!("cancelled by {}{why}", event.requested_by));
}

/// The controller's `run.cancelled` for a run it ended so.
pub fn cancelled_event(state: &RunStateV1, request: &RunCancelRequestedV1) -> RunCancelledV1 {
    RunCancelledV1 {
        run_id: state.run_id.clone(),
        cancelled_at: state.updated_at,
        requested_by: request.requested_by.clone(),
        reason: request.reason.clone(),
        step: state.step,
    }
}

pub fn apply_run_failed(state: &mut RunStateV1, event: &RunFailedV1) {
    if state.status.is_terminal() {
        return;
    }
    state.status = RunStatus::Failed;
    state.failure_reason = Some(format!("{}: {}", event.service, event.reason));
}

/// Steps this run trains itself: all of them, or those after the checkpoint it resumed
/// from.
fn steps_to_train(state: &RunStateV1) -> u32 {
    let first = state.spec.as_ref().map_or(0, |s| s.trainer.first_step());
    state.total_steps.saturating_sub(first)
}

/// The service name the controller signs its own failure decisions with.
pub const CONTROLLER: &str = "controller";

/// Ends the run `failed` when it can no longer learn anything: every trial of a step
/// failed as `infrastructure`, or every step is in and none trained a sample. Returns true
/// when this call failed it. Order-independent: whichever of the trial failures and the
/// step report arrives last decides.
pub fn fail_if_fruitless(state: &mut RunStateV1) -> bool {
    if state.status.is_terminal() {
        return false;
    }
    let lost = state.steps.iter().find_map(|s| {
        let batch = s.batch.as_ref()?;
        let failed = state.infrastructure_failures.get(&s.step).copied()?;
        (batch.trajectories > 0 && failed >= batch.trajectories).then_some((s.step, failed))
    });
    let reason = if let Some((step, failed)) = lost {
        format!(
            "every trial of step {step} ({failed}) failed as infrastructure, so the step had \
             nothing to train on: check the sandbox and inference services (their logs and \
             `arl run status`'s failures), then submit the run again"
        )
    } else if state.total_steps > 0
        && state.steps.len() >= steps_to_train(state) as usize
        && state.steps.iter().all(StepSummary::trained_nothing)
    {
        let groups: u32 = state
            .steps
            .iter()
            .filter_map(|s| s.batch.as_ref().map(|b| b.groups))
            .sum();
        format!(
            "every step trained nothing: in all {} steps ({groups} groups) each group's \
             trials got the same reward, so no sample had an advantage. The tasks are too \
             hard (or too easy) for this model: choose easier tasks, raise rollout.n, or \
             check the reward",
            state.steps.len()
        )
    } else {
        return false;
    };
    state.status = RunStatus::Failed;
    state.failure_reason = Some(format!("{CONTROLLER}: {reason}"));
    true
}

/// The `run.failed` the controller announces for its own decision (none when the run did
/// not fail by the controller's hand).
pub fn failed_event(state: &RunStateV1) -> Option<RunFailedV1> {
    let reason = state.failure_reason.as_deref()?;
    let reason = reason.strip_prefix(CONTROLLER)?.strip_prefix(": ")?;
    (state.status == RunStatus::Failed).then(|| RunFailedV1 {
        run_id: state.run_id.clone(),
        failed_at: state.updated_at,
        service: CONTROLLER.into(),
        reason: reason.to_owned(),
    })
}

/// Marks the run completed once every step is trained and the final evaluation is in.
/// Returns true when this call completed it.
pub fn complete_if_done(state: &mut RunStateV1) -> bool {
    let trained = state.total_steps > 0 && state.step >= state.total_steps;
    let evaluated = state
        .evaluations
        .iter()
        .any(|e| e.step >= state.total_steps);
    if state.status.is_terminal() || !trained || !evaluated {
        return false;
    }
    state.status = RunStatus::Completed;
    state.phase = RunPhase::Finishing;
    true
}

pub fn progress_event(state: &RunStateV1) -> RunProgressV1 {
    RunProgressV1 {
        run_id: state.run_id.clone(),
        at: state.updated_at,
        sequence: state.progress_sequence,
        phase: state.phase,
        step: state.step,
        total_steps: state.total_steps,
        trials_finished: state.trials_finished,
        failures: state.failures.clone(),
        percent: state.percent(),
    }
}

pub fn completed_event(state: &RunStateV1) -> RunCompletedV1 {
    RunCompletedV1 {
        run_id: state.run_id.clone(),
        completed_at: Utc::now(),
        steps: state.step,
        final_policy_version: state.policy_version,
        checkpoint_uri: state.checkpoint_uri.clone(),
        final_resolution_rate: state.evaluations.last().map(|e| e.resolution_rate),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arl_schemas::RunId;
    use arl_schemas::events::{Example, FailureCounts, TrainStepV1, TrainStepV2};

    #[test]
    fn a_cancel_ends_a_live_run_and_leaves_an_ended_one_alone() {
        let mut request = RunCancelRequestedV1::example();
        request.reason = String::new();
        let mut state = accepted(3);
        apply_cancel_request(&mut state, &request);
        assert_eq!(state.status, RunStatus::Cancelled);
        assert!(state.status.is_terminal());
        assert_eq!(
            state.failure_reason.as_deref(),
            Some("cancelled by ada@workstation")
        );
        assert_eq!(cancelled_event(&state, &request).run_id, state.run_id);
        let mut done = accepted(3);
        done.status = RunStatus::Completed;
        apply_cancel_request(&mut done, &request);
        assert_eq!(done.status, RunStatus::Completed);
        assert_eq!(done.failure_reason, None);
    }

    fn failure(class: FailureClass, step: u32, will_retry: bool) -> TrialFailedV1 {
        let mut event = TrialFailedV1::example();
        event.class = class;
        event.slot.step = step;
        event.slot.split = Split::Train;
        event.will_retry = will_retry;
        event
    }

    fn step(n: u32, trajectories: u32, samples_trained: u32) -> TrainStep {
        let mut event = TrainStepV2::example();
        event.step = n;
        event.policy_version = u64::from(n);
        event.batch.trajectories = trajectories;
        event.batch.masked = trajectories - samples_trained.min(trajectories);
        event.batch.samples_trained = samples_trained;
        TrainStep::V2(event)
    }

    fn accepted(total_steps: u32) -> RunStateV1 {
        RunStateV1 {
            run_id: RunId::new("r").unwrap(),
            name: "t".into(),
            status: RunStatus::Accepted,
            phase: RunPhase::Preparing,
            submitted_by: "t".into(),
            submitted_at: Utc::now(),
            updated_at: Utc::now(),
            spec: None,
            model_path: None,
            dataset_path: None,
            dataset_digest: None,
            errors: vec![],
            total_steps,
            step: 0,
            policy_version: 0,
            trials_finished: 0,
            failures: FailureCounts::default(),
            steps: vec![],
            evaluations: vec![],
            infrastructure_failures: Default::default(),
            checkpoint_uri: None,
            failure_reason: None,
            progress_sequence: 1,
            applied: Default::default(),
        }
    }

    #[test]
    fn a_published_version_names_where_it_is_either_way() {
        use arl_schemas::events::{WeightsPublishedV1, WeightsPublishedV2};
        let mut state = accepted(2);
        let folder = WeightsPublishedV2::upgrade(WeightsPublishedV1::example()).unwrap();
        apply_weights(&mut state, &folder);
        assert_eq!(state.policy_version, 1);
        assert_eq!(
            state.checkpoint_uri,
            Some(WeightsPublishedV1::example().uri)
        );
        let mut objects = WeightsPublishedV2::example();
        objects.policy_version = 2;
        apply_weights(&mut state, &objects);
        assert_eq!(state.policy_version, 2);
        assert_eq!(
            state.checkpoint_uri.as_deref(),
            Some("nats-object-store://ARL_WEIGHTS/run-0193a1b2c3d4/2/")
        );
    }

    #[test]
    fn redeliveries_are_not_applied_twice() {
        let mut state = accepted(2);
        assert!(first_time(&mut state, "ARL_TRIALS", 5));
        apply_trial_failed(&mut state, &failure(FailureClass::Timeout, 1, false));
        assert!(!first_time(&mut state, "ARL_TRIALS", 5));
        assert!(!first_time(&mut state, "ARL_TRIALS", 4));
        assert!(first_time(&mut state, "ARL_TRAIN", 5));
        assert_eq!(state.failures.timeout, 1);
        assert_eq!(state.status, RunStatus::Running);
    }

    #[test]
    fn completes_after_the_last_step_and_its_evaluation() {
        let mut state = accepted(2);
        let mut step = TrainStepV2::example();
        step.step = 2;
        step.policy_version = 2;
        apply_train_step(&mut state, &TrainStep::V2(step));
        assert_eq!(state.phase, RunPhase::Evaluating);
        assert!(!complete_if_done(&mut state));
        assert!(state.percent() > 90.0 && state.percent() < 100.0);
        let mut eval = EvaluationCompletedV1::example();
        eval.step = 2;
        apply_evaluation(&mut state, &eval);
        assert!(complete_if_done(&mut state));
        assert!(!complete_if_done(&mut state));
        assert_eq!(state.percent(), 100.0);
        assert_eq!(completed_event(&state).final_policy_version, 2);
    }

    #[test]
    fn a_step_whose_every_trial_failed_as_infrastructure_fails_the_run() {
        // Failures first, then the step report.
        let mut state = accepted(3);
        for _ in 0..3 {
            apply_trial_failed(&mut state, &failure(FailureClass::Infrastructure, 1, false));
        }
        // Retried failures and other classes do not count.
        apply_trial_failed(&mut state, &failure(FailureClass::Infrastructure, 1, true));
        apply_trial_failed(&mut state, &failure(FailureClass::Timeout, 1, false));
        assert!(!fail_if_fruitless(&mut state));
        apply_train_step(&mut state, &step(1, 4, 0));
        assert!(
            !fail_if_fruitless(&mut state),
            "3 of 4 trials failed: not all"
        );
        apply_trial_failed(&mut state, &failure(FailureClass::Infrastructure, 1, false));
        assert!(fail_if_fruitless(&mut state));
        assert_eq!(state.status, RunStatus::Failed);
        let reason = state.failure_reason.clone().unwrap();
        assert!(
            reason.contains("every trial of step 1 (4) failed as infrastructure"),
            "{reason}"
        );
        let event = failed_event(&state).unwrap();
        assert_eq!(event.service, CONTROLLER);
        assert!(!fail_if_fruitless(&mut state), "decided once");

        // The step report first, then the failures.
        let mut state = accepted(3);
        apply_train_step(&mut state, &step(2, 2, 0));
        apply_trial_failed(&mut state, &failure(FailureClass::Infrastructure, 2, false));
        assert!(!fail_if_fruitless(&mut state));
        apply_trial_failed(&mut state, &failure(FailureClass::Infrastructure, 2, false));
        assert!(fail_if_fruitless(&mut state));
    }

    #[test]
    fn a_run_whose_every_step_trained_nothing_fails_and_one_that_trained_completes() {
        let mut state = accepted(2);
        apply_train_step(&mut state, &step(1, 8, 0));
        assert!(
            !fail_if_fruitless(&mut state),
            "one idle step is a warning, not a failure"
        );
        apply_train_step(&mut state, &step(2, 8, 0));
        assert!(fail_if_fruitless(&mut state));
        let reason = state.failure_reason.clone().unwrap();
        assert!(reason.contains("every step trained nothing"), "{reason}");
        let mut eval = EvaluationCompletedV1::example();
        eval.step = 2;
        apply_evaluation(&mut state, &eval);
        assert!(!complete_if_done(&mut state), "a failed run stays failed");

        let mut state = accepted(2);
        apply_train_step(&mut state, &step(1, 8, 0));
        apply_train_step(&mut state, &step(2, 8, 5));
        assert!(!fail_if_fruitless(&mut state));
        apply_evaluation(&mut state, &eval);
        assert!(complete_if_done(&mut state));
        assert!(failed_event(&state).is_none());

        // A step reported by a version-1 trainer has no counts: its gradient norm decides.
        let mut state = accepted(1);
        let mut v1 = TrainStepV1::example();
        v1.step = 1;
        apply_train_step(&mut state, &TrainStep::V1(v1));
        assert!(
            !fail_if_fruitless(&mut state),
            "grad_norm 0.87 trained something"
        );
    }
}
