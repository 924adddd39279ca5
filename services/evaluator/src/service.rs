//! The evaluator. After each training step that is an evaluation step (every
//! `eval_every` steps, and the last), it publishes the validation split as a task batch
//! (`split = validation`, `rollout.val_n` samples per task) and opens a tally in the
//! `ARL_EVAL_STATE` bucket; it then counts each validation trial's outcome —
//! `reward.scored` (resolved or not) or a final `trial.failed` (not resolved) — once per
//! (task, sample), the latest attempt winning, and when every sample is in publishes
//! `eval.completed` with the resolution rate, its 95% interval and pass@k.

use std::collections::BTreeMap;
use std::sync::Arc;

use arl_runtime::consumer::run_consumer;
use arl_runtime::{Bus, ConsumerSpec, Delivery, HandlerError, Shutdown};
use arl_schemas::events::{
    DatasetRegisteredV1, EvaluationCompletedV1, PassAtK, RewardScoredV2, Split, TaskBatchV1,
    TaskRef, TrainStep, TrainStepV2, TrialFailedV1, TrialSlot,
};
use arl_schemas::{Bucket, Event, RunId, TaskId};
use serde::{Deserialize, Serialize};

use crate::stats;

const SERVICE: &str = "evaluator";

/// One evaluation in progress, kept in `ARL_EVAL_STATE` under `<run>.<step>`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Tally {
    pub run_id: RunId,
    pub step: u32,
    pub policy_version: u64,
    pub tasks: Vec<TaskId>,
    pub samples_per_task: u32,
    /// `"<sample_index>:<task_id>"` → (attempt, resolved).
    pub results: BTreeMap<String, (u32, bool)>,
}

impl Tally {
    fn key(run: &RunId, step: u32) -> String {
        format!("{run}.{step}")
    }

    pub fn expected(&self) -> usize {
        self.tasks.len() * self.samples_per_task as usize
    }

    /// Records one sample's outcome; false when a later attempt is already recorded.
    pub fn record(&mut self, slot: &TrialSlot, resolved: bool) -> bool {
        let key = format!("{}:{}", slot.sample_index, slot.task_id);
        match self.results.get(&key) {
            Some((attempt, _)) if *attempt > slot.attempt => false,
            Some(previous) if *previous == (slot.attempt, resolved) => false,
            _ => {
                self.results.insert(key, (slot.attempt, resolved));
                true
            }
        }
    }

    /// The evaluation's statistics once every sample is in.
    pub fn summary(&self) -> Option<EvaluationCompletedV1> {
        if self.results.len() < self.expected() {
            return None;
        }
        let n = self.samples_per_task;
        let per_task: Vec<u32> = self
            .tasks
            .iter()
            .map(|task| {
                (0..n)
                    .filter(|i| {
                        self.results
                            .get(&format!("{i}:{task}"))
                            .is_some_and(|(_, resolved)| *resolved)
                    })
                    .count() as u32
            })
            .collect();
        let resolved: u32 = per_task.iter().sum();
        let total = u32::try_from(self.expected()).unwrap_or(u32::MAX);
        let (ci95_low, ci95_high) = stats::wilson95(resolved, total);
        let pass_at_k = if per_task.is_empty() {
            Vec::new()
        } else {
            (1..=n)
                .map(|k| PassAtK {
                    k,
                    value: per_task
                        .iter()
                        .map(|c| stats::pass_at_k(n, *c, k))
                        .sum::<f64>()
                        / per_task.len() as f64,
                })
                .collect()
        };
        Some(EvaluationCompletedV1 {
            run_id: self.run_id.clone(),
            step: self.step,
            policy_version: self.policy_version,
            tasks: u32::try_from(self.tasks.len()).unwrap_or(u32::MAX),
            samples_per_task: n,
            resolved_samples: resolved,
            resolution_rate: if total == 0 {
                0.0
            } else {
                f64::from(resolved) / f64::from(total)
            },
            ci95_low,
            ci95_high,
            pass_at_k,
            at: chrono::Utc::now(),
        })
    }
}

/// Steps after which the validation split runs: every `eval_every`-th and the last.
pub fn is_eval_step(step: u32, eval_every: u32, total_steps: u32) -> bool {
    step == total_steps || (eval_every > 0 && step.is_multiple_of(eval_every))
}

#[derive(Clone)]
pub struct Evaluator {
    bus: Bus,
}

impl Evaluator {
    pub fn new(bus: Bus) -> Self {
        Self { bus }
    }

    pub fn start(&self, shutdown: &Shutdown) {
        let ns = self.bus.namespace();
        let this = Arc::new(self.clone());
        let consumers = [
            ConsumerSpec::for_event::<TrainStepV2>(ns, SERVICE),
            ConsumerSpec::for_event::<RewardScoredV2>(ns, SERVICE),
            ConsumerSpec::for_event::<TrialFailedV1>(ns, SERVICE),
            ConsumerSpec::for_event::<DatasetRegisteredV1>(ns, SERVICE),
        ];
        for spec in consumers {
            let this = this.clone();
            shutdown.spawn(run_consumer(
                self.bus.clone(),
                spec,
                move |delivery: Delivery| {
                    let this = this.clone();
                    async move { this.on_event(delivery).await }
                },
                shutdown.clone(),
            ));
        }
    }

    async fn on_event(&self, delivery: Delivery) -> Result<(), HandlerError> {
        let dead = |e: arl_schemas::DecodeError| HandlerError::dead_letter(e);
        match delivery.event_type().as_deref() {
            Some(TrainStepV2::TYPE) => {
                self.on_train_step(delivery.decode_train_step().map_err(dead)?)
                    .await
            }
            Some(DatasetRegisteredV1::TYPE) => {
                self.on_dataset(delivery.decode().map_err(dead)?).await
            }
            Some(RewardScoredV2::TYPE) => {
                let scored: RewardScoredV2 = delivery.decode().map_err(dead)?;
                self.on_outcome(&scored.run_id, &scored.slot, scored.resolved)
                    .await
            }
            Some(TrialFailedV1::TYPE) => {
                let failed: TrialFailedV1 = delivery.decode().map_err(dead)?;
                if failed.will_retry {
                    // Another attempt follows; it decides the sample.
                    return Ok(());
                }
                if self.run_has_ended(&failed.run_id).await? {
                    // The run's end stopped the trial (the rollout says so with a failure):
                    // it says nothing of the policy, so the evaluation is left incomplete
                    // rather than completed with a rate that counts it as unresolved.
                    return Ok(());
                }
                self.on_outcome(&failed.run_id, &failed.slot, false).await
            }
            other => Err(HandlerError::dead_letter(format!(
                "the evaluator takes train.step, task.dataset, reward.scored (v2) and trial.failed, got {other:?}"
            ))),
        }
    }

    /// The run's dataset is registered: with `val_before_train`, the policy it starts from
    /// is evaluated — the base model (policy version 0) as step 0, or a resumed run's
    /// checkpoint as its step.
    async fn on_dataset(&self, registered: DatasetRegisteredV1) -> Result<(), HandlerError> {
        let arl_runtime::RunContext { state, spec } =
            self.bus.run_context(&registered.run_id).await?;
        if !spec.trainer.val_before_train || state.status.is_terminal() {
            return Ok(());
        }
        let first = spec.trainer.first_step();
        self.evaluate(
            &registered.run_id,
            first,
            u64::from(first),
            &registered.digest,
            &spec,
        )
        .await
    }

    async fn on_train_step(&self, trained: TrainStep) -> Result<(), HandlerError> {
        let run_id = trained.run_id();
        // A run state without a spec (a rejected request) has nothing to evaluate with:
        // default settings would measure something the user never asked for.
        let arl_runtime::RunContext { state, spec } = self.bus.run_context(run_id).await?;
        if !is_eval_step(trained.step(), spec.trainer.eval_every, state.total_steps) {
            return Ok(());
        }
        let digest = state.dataset_digest.clone().ok_or_else(|| {
            HandlerError::retry(format!("run {run_id} has no registered dataset yet"))
        })?;
        self.evaluate(
            run_id,
            trained.step(),
            trained.policy_version(),
            &digest,
            &spec,
        )
        .await
    }

    /// Opens the tally of the evaluation at `step` and publishes the validation batch.
    async fn evaluate(
        &self,
        run_id: &RunId,
        step: u32,
        policy_version: u64,
        digest: &str,
        spec: &arl_schemas::spec::RunSpec,
    ) -> Result<(), HandlerError> {
        let manifest = self.bus.dataset_manifest(digest).await?.ok_or_else(|| {
            HandlerError::dead_letter(format!("dataset {digest} is not registered"))
        })?;
        let tally = Tally {
            run_id: run_id.clone(),
            step,
            policy_version,
            tasks: manifest.validation.clone(),
            samples_per_task: spec.rollout.val_n,
            results: BTreeMap::new(),
        };
        // The tally exists before the batch, so no outcome can arrive without one.
        let stored = self
            .bus
            .modify_record::<Tally>(
                Bucket::EvalState,
                &Tally::key(&tally.run_id, tally.step),
                |t| {
                    if t.is_some() {
                        return false;
                    }
                    *t = Some(tally.clone());
                    true
                },
            )
            .await?;
        let tasks: Vec<TaskRef> = manifest
            .validation
            .iter()
            .filter_map(|id| manifest.task(id))
            .map(|task| TaskRef {
                task_id: task.task_id.clone(),
                kind: task.kind,
                dataset_digest: manifest.digest.clone(),
                environment: task.environment.clone(),
            })
            .collect();
        tracing::info!(run = %run_id, step, tasks = tasks.len(), "evaluation started");
        self.bus
            .publish(&TaskBatchV1 {
                run_id: run_id.clone(),
                step,
                split: Split::Validation,
                samples_per_task: spec.rollout.val_n,
                tasks,
            })
            .await?;
        // An empty validation split is complete at once.
        if let Some(summary) = stored.and_then(|t| t.summary()) {
            self.bus.publish(&summary).await?;
        }
        Ok(())
    }

    async fn run_has_ended(&self, run: &RunId) -> Result<bool, HandlerError> {
        let state = self.bus.run_state(run).await?;
        Ok(state.is_some_and(|s| s.status.is_terminal()))
    }

    async fn on_outcome(
        &self,
        run: &RunId,
        slot: &TrialSlot,
        resolved: bool,
    ) -> Result<(), HandlerError> {
        if slot.split != Split::Validation {
            return Ok(());
        }
        let key = Tally::key(run, slot.step);
        let mut known = true;
        let tally = self
            .bus
            .modify_record::<Tally>(Bucket::EvalState, &key, |t| match t {
                None => {
                    known = false;
                    false
                }
                Some(t) => t.record(slot, resolved),
            })
            .await?;
        if !known {
            return Err(HandlerError::dead_letter(format!(
                "validation trial of run {run} step {} without an evaluation",
                slot.step
            )));
        }
        // Publishing again on a redelivery is harmless: eval.completed de-duplicates by
        // (run, step).
        if let Some(summary) = tally.and_then(|t| t.summary()) {
            tracing::info!(run = %run, step = slot.step, rate = summary.resolution_rate, "evaluation completed");
            self.bus.publish(&summary).await?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(task: &str, sample: u32, attempt: u32) -> TrialSlot {
        TrialSlot {
            task_id: TaskId::new(task).unwrap(),
            step: 2,
            split: Split::Validation,
            sample_index: sample,
            attempt,
        }
    }

    #[test]
    fn a_tally_completes_once_every_sample_is_in_and_later_attempts_win() {
        let mut tally = Tally {
            run_id: RunId::new("run-x").unwrap(),
            step: 2,
            policy_version: 2,
            tasks: vec![TaskId::new("a").unwrap(), TaskId::new("b").unwrap()],
            samples_per_task: 2,
            results: BTreeMap::new(),
        };
        assert!(tally.record(&slot("a", 0, 0), false));
        assert!(tally.record(&slot("a", 0, 1), true), "a retry replaces");
        assert!(
            !tally.record(&slot("a", 0, 0), false),
            "an older attempt does not"
        );
        assert!(tally.record(&slot("a", 1, 0), false));
        assert!(tally.record(&slot("b", 0, 0), true));
        assert!(tally.summary().is_none());
        assert!(tally.record(&slot("b", 1, 0), true));
        let summary = tally.summary().unwrap();
        assert_eq!(summary.resolved_samples, 3);
        assert_eq!(summary.resolution_rate, 0.75);
        // a: 1 of 2, b: 2 of 2 → pass@1 = (0.5 + 1) / 2, pass@2 = (1 + 1) / 2.
        assert_eq!(summary.pass_at_k[0].value, 0.75);
        assert_eq!(summary.pass_at_k[1].value, 1.0);
        assert!(summary.ci95_low < 0.75 && summary.ci95_high > 0.75);
    }

    #[test]
    fn evaluation_steps_are_every_nth_and_the_last() {
        let steps: Vec<u32> = (1..=5).filter(|s| is_eval_step(*s, 2, 5)).collect();
        assert_eq!(steps, [2, 4, 5]);
        let steps: Vec<u32> = (1..=3).filter(|s| is_eval_step(*s, 0, 3)).collect();
        assert_eq!(steps, [3]);
    }
}
