//! Folding the pipeline's events into a run's state. Pure functions: the service reads
//! the state, applies one event here, and writes it back with compare-and-set.

use arl_schemas::events::{
    DatasetRegisteredV1, EvaluationCompletedV1, FailureClass, RunCompletedV1, RunFailedV1,
    RunPhase, RunProgressV1, TrainStepV1, WeightsPublishedV1,
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

pub fn apply_train_step(state: &mut RunStateV1, event: &TrainStepV1) {
    start_running(state);
    if event.step > state.step {
        state.step = event.step;
        state.policy_version = state.policy_version.max(event.policy_version);
    }
    if !state.steps.iter().any(|s| s.step == event.step) {
        state.steps.push(StepSummary {
            step: event.step,
            policy_version: event.policy_version,
            reward_mean: event.metrics.reward_mean,
            pg_loss: event.metrics.pg_loss,
            grad_norm: event.metrics.grad_norm,
            seconds: event.timing.total,
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

pub fn apply_trial_failed(state: &mut RunStateV1, class: FailureClass) {
    start_running(state);
    state.failures.add(class);
}

pub fn apply_weights(state: &mut RunStateV1, event: &WeightsPublishedV1) {
    state.policy_version = state.policy_version.max(event.policy_version);
    state.checkpoint_uri = Some(event.uri.clone());
}

pub fn apply_run_failed(state: &mut RunStateV1, event: &RunFailedV1) {
    if state.status.is_terminal() {
        return;
    }
    state.status = RunStatus::Failed;
    state.failure_reason = Some(format!("{}: {}", event.service, event.reason));
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
    use arl_schemas::events::{Example, FailureCounts};

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
            checkpoint_uri: None,
            failure_reason: None,
            progress_sequence: 1,
            applied: Default::default(),
        }
    }

    #[test]
    fn redeliveries_are_not_applied_twice() {
        let mut state = accepted(2);
        assert!(first_time(&mut state, "ARL_TRIALS", 5));
        apply_trial_failed(&mut state, FailureClass::Timeout);
        assert!(!first_time(&mut state, "ARL_TRIALS", 5));
        assert!(!first_time(&mut state, "ARL_TRIALS", 4));
        assert!(first_time(&mut state, "ARL_TRAIN", 5));
        assert_eq!(state.failures.timeout, 1);
        assert_eq!(state.status, RunStatus::Running);
    }

    #[test]
    fn completes_after_the_last_step_and_its_evaluation() {
        let mut state = accepted(2);
        let mut step = TrainStepV1::example();
        step.step = 2;
        step.policy_version = 2;
        apply_train_step(&mut state, &step);
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
}
