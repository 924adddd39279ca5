//! The controller's consumers: admission of run requests, and the ordered folds of the
//! pipeline's events into run state.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arl_runtime::consumer::run_consumer;
use arl_runtime::{Bus, ConsumerSpec, Delivery, HandlerError, Shutdown};
use arl_schemas::events::{
    DatasetRegisteredV1, EvaluationCompletedV1, RunAcceptedV1, RunCancelRequestedV1, RunFailedV1,
    RunPhase, RunRejectedV1, RunRequestedV1, TrainStepV2, TrialFailedV1, TrialFinishedV1,
    WeightsPublishedV2,
};
use arl_schemas::state::{RunStateV1, RunStatus};
use arl_schemas::{Domain, Event, RunId};
use chrono::Utc;

use crate::admission::{Admission, admit};
use crate::progress;
use crate::store::{RunStore, StoreError};
use crate::tensorboard::{self, TensorBoard};

/// A run's scalars at a step, as read from one event.
type RunScalars = (RunId, u32, Vec<tensorboard::Scalar>);

/// The durable consumer names of the controller.
const ADMISSION: &str = "controller-admission";
const FOLD: &str = "controller";
const TENSORBOARD: &str = "controller-tensorboard";

#[derive(Clone, Debug)]
pub struct ControllerConfig {
    /// Where installed models are looked up by name.
    pub model_dir: PathBuf,
    /// Run requests admitted at once.
    pub admission_concurrency: usize,
    /// Where each run's TensorBoard scalars are written (none: not written).
    pub tensorboard_dir: Option<PathBuf>,
    /// How often a run's trial counts are announced in `run.progress` while they change.
    /// Phase and status changes are announced at once.
    pub progress_interval: Duration,
}

impl Default for ControllerConfig {
    fn default() -> Self {
        Self {
            model_dir: arl_runtime::args::default_model_dir(),
            admission_concurrency: 8,
            tensorboard_dir: None,
            progress_interval: Duration::from_secs(1),
        }
    }
}

#[derive(Clone, Debug)]
pub struct Controller {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    bus: Bus,
    store: RunStore,
    config: ControllerConfig,
    /// Runs whose trial counts changed since their last `run.progress`. Announcing every
    /// folded trial (hundreds a second under load) would fill the run stream and its
    /// de-duplication window with ids nobody needs, so they wait for the next flush.
    unannounced: Mutex<HashSet<RunId>>,
}

impl From<StoreError> for ControllerError {
    fn from(err: StoreError) -> Self {
        ControllerError::Store(err)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    #[error(transparent)]
    Store(StoreError),
}

fn retry(err: StoreError) -> HandlerError {
    HandlerError::retry(err)
}

impl Controller {
    /// Needs a provisioned namespace (`Bus::provision`).
    pub async fn new(bus: Bus, config: ControllerConfig) -> Result<Self, ControllerError> {
        let store = RunStore::open(&bus).await?;
        Ok(Self {
            inner: Arc::new(Inner {
                bus,
                store,
                config,
                unannounced: Mutex::default(),
            }),
        })
    }

    /// Starts every consumer on tasks tracked by `shutdown`, and returns.
    pub fn start(&self, shutdown: &Shutdown) {
        let ns = self.inner.bus.namespace().clone();
        let mut admission = ConsumerSpec::for_event::<RunRequestedV1>(&ns, ADMISSION);
        admission.concurrency = self.inner.config.admission_concurrency;
        self.consume(shutdown, admission, |c, d| async move {
            c.on_run_requested(&d).await
        });

        // train.step comes in two versions: its fold reads both.
        self.fold_decoded::<TrainStepV2, _>(
            shutdown,
            Delivery::decode_train_step,
            progress::apply_train_step,
        );
        self.fold::<EvaluationCompletedV1>(shutdown, progress::apply_evaluation);
        // So does weights.published (version 1 is read as version 2).
        self.fold_decoded::<WeightsPublishedV2, _>(
            shutdown,
            Delivery::decode_weights_published,
            progress::apply_weights,
        );
        self.fold::<DatasetRegisteredV1>(shutdown, progress::apply_dataset);
        self.fold::<RunFailedV1>(shutdown, progress::apply_run_failed);
        let cancels = ConsumerSpec::for_event::<RunCancelRequestedV1>(
            &ns,
            format!(
                "{FOLD}-{}",
                RunCancelRequestedV1::TYPE.trim_start_matches("run.")
            ),
        )
        .ordered();
        self.consume(shutdown, cancels, |c, d| async move {
            c.on_cancel_requested(&d).await
        });
        // Trial outcomes share one ordered consumer so their counts stay exact.
        let trials = ConsumerSpec::for_event::<TrialFinishedV1>(&ns, FOLD)
            .and_event::<TrialFailedV1>(&ns)
            .ordered();
        self.consume(shutdown, trials, |c, d| async move {
            c.on_trial_outcome(&d).await
        });
        if let Some(dir) = &self.inner.config.tensorboard_dir {
            self.track(shutdown, Arc::new(TensorBoard::new(dir.clone())));
        }
        self.flush_progress(shutdown);
    }

    /// Announces the runs whose trial counts changed, every `progress_interval`, and once
    /// more at shutdown. It starts with every live run: a controller that stopped between
    /// a trial's fold and the next flush owes that run an announcement.
    fn flush_progress(&self, shutdown: &Shutdown) {
        let controller = self.clone();
        let shutdown_ = shutdown.clone();
        shutdown.spawn(async move {
            if let Err(err) = controller.mark_live_runs().await {
                tracing::warn!(error = %err, "could not list the live runs to re-announce");
            }
            let mut tick = tokio::time::interval(controller.inner.config.progress_interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = tick.tick() => controller.announce_unannounced().await,
                    _ = shutdown_.triggered() => {
                        controller.announce_unannounced().await;
                        return;
                    }
                }
            }
        });
    }

    async fn mark_live_runs(&self) -> Result<(), StoreError> {
        for run_id in self.inner.bus.run_ids().await? {
            let live = self
                .inner
                .store
                .get(&run_id)
                .await?
                .is_some_and(|stored| !stored.state.status.is_terminal());
            if live {
                self.unannounced().insert(run_id);
            }
        }
        Ok(())
    }

    fn unannounced(&self) -> std::sync::MutexGuard<'_, HashSet<RunId>> {
        // The set stays valid whatever a panicking holder did to it.
        self.inner
            .unannounced
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// One flush: each waiting run's stored state, announced. A run whose announcement
    /// fails waits for the next flush.
    async fn announce_unannounced(&self) {
        let runs = std::mem::take(&mut *self.unannounced());
        for run_id in runs {
            let announced = match self.inner.store.get(&run_id).await {
                Ok(Some(stored)) => self
                    .announce(&stored.state)
                    .await
                    .map_err(|e| e.to_string()),
                Ok(None) => Ok(()),
                Err(err) => Err(err.to_string()),
            };
            if let Err(err) = announced {
                tracing::warn!(run = %run_id, error = %err, "run.progress not announced; retrying at the next flush");
                self.unannounced().insert(run_id);
            }
        }
    }

    /// Writes every step's and evaluation's figures to TensorBoard event files.
    fn track(&self, shutdown: &Shutdown, board: Arc<TensorBoard>) {
        self.track_event::<TrainStepV2>(shutdown, board.clone(), |delivery| {
            let step = delivery.decode_train_step()?;
            Ok((
                step.run_id().clone(),
                step.step(),
                tensorboard::step_scalars(&step),
            ))
        });
        self.track_event::<EvaluationCompletedV1>(shutdown, board, |delivery| {
            let eval: EvaluationCompletedV1 = delivery.decode()?;
            Ok((
                eval.run_id.clone(),
                eval.step,
                tensorboard::eval_scalars(&eval),
            ))
        });
    }

    /// A durable consumer of `E` whose events `read` turns into a run's scalars at a step.
    fn track_event<E: Event>(
        &self,
        shutdown: &Shutdown,
        board: Arc<TensorBoard>,
        read: fn(&Delivery) -> Result<RunScalars, arl_schemas::DecodeError>,
    ) {
        let spec = ConsumerSpec::for_event::<E>(self.inner.bus.namespace(), TENSORBOARD);
        self.consume(shutdown, spec, move |_, delivery| {
            let board = board.clone();
            async move {
                let (run, step, scalars) = read(&delivery)?;
                board
                    .write(&run, step, &scalars)
                    .map_err(HandlerError::retry)
            }
        });
    }

    fn consume<F, Fut>(&self, shutdown: &Shutdown, spec: ConsumerSpec, handler: F)
    where
        F: Fn(Controller, Delivery) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<(), HandlerError>> + Send + 'static,
    {
        let controller = self.clone();
        shutdown.spawn(run_consumer(
            self.inner.bus.clone(),
            spec,
            move |delivery| handler(controller.clone(), delivery),
            shutdown.clone(),
        ));
    }

    /// An ordered consumer that applies events of type `E` to their run's state.
    fn fold<E: Event>(&self, shutdown: &Shutdown, apply: fn(&mut RunStateV1, &E)) {
        self.fold_decoded::<E, E>(shutdown, Delivery::decode::<E>, apply);
    }

    /// [`Controller::fold`] for an event of type `E` read by `decode` (one that comes in
    /// several versions).
    fn fold_decoded<E: Event, T: Send + Sync + 'static>(
        &self,
        shutdown: &Shutdown,
        decode: fn(&Delivery) -> Result<T, arl_schemas::DecodeError>,
        apply: fn(&mut RunStateV1, &T),
    ) {
        let ns = self.inner.bus.namespace();
        // The run stream has the admission consumer too: one durable per folded event.
        let durable = if E::DOMAIN == Domain::Run {
            format!("{FOLD}-{}", E::TYPE.trim_start_matches("run."))
        } else {
            FOLD.into()
        };
        let spec = ConsumerSpec::for_event::<E>(ns, durable).ordered();
        self.consume(shutdown, spec, move |controller, delivery| async move {
            let event = decode(&delivery)?;
            let run_id = run_of(&controller, &delivery)?;
            controller
                .apply(&delivery, E::DOMAIN, &run_id, |state| apply(state, &event))
                .await
        });
    }

    /// Ends the run `cancelled` (unless it already ended) and says so in `run.cancelled`.
    async fn on_cancel_requested(&self, delivery: &Delivery) -> Result<(), HandlerError> {
        let request: RunCancelRequestedV1 = delivery.decode()?;
        let run_id = run_of(self, delivery)?;
        self.apply(delivery, Domain::Run, &run_id, |state| {
            progress::apply_cancel_request(state, &request);
        })
        .await?;
        let stored = self.inner.store.get(&run_id).await.map_err(retry)?;
        if let Some(stored) = stored
            && stored.state.status == RunStatus::Cancelled
        {
            tracing::info!(run = %run_id, by = %request.requested_by, "run cancelled");
            let cancelled = progress::cancelled_event(&stored.state, &request);
            self.inner.bus.publish(&cancelled).await?;
        }
        Ok(())
    }

    async fn on_trial_outcome(&self, delivery: &Delivery) -> Result<(), HandlerError> {
        let run_id = run_of(self, delivery)?;
        let dead = |e: arl_schemas::DecodeError| HandlerError::dead_letter(e);
        match delivery.event_type().as_deref() {
            Some(TrialFinishedV1::TYPE) => {
                delivery.decode::<TrialFinishedV1>().map_err(dead)?;
                self.apply(
                    delivery,
                    Domain::Trial,
                    &run_id,
                    progress::apply_trial_finished,
                )
                .await
            }
            Some(TrialFailedV1::TYPE) => {
                let event = delivery.decode::<TrialFailedV1>().map_err(dead)?;
                self.apply(delivery, Domain::Trial, &run_id, |state| {
                    progress::apply_trial_failed(state, &event);
                })
                .await
            }
            other => Err(HandlerError::dead_letter(format!(
                "expected a trial.finished or trial.failed event, got {other:?}"
            ))),
        }
    }

    /// Applies one event to a run's state exactly once, then (re-)announces the state: at
    /// once when it changed the run's phase or status or came from outside the trial
    /// stream, at the next flush when it only counted a trial.
    async fn apply(
        &self,
        delivery: &Delivery,
        domain: Domain,
        run_id: &RunId,
        apply: impl Fn(&mut RunStateV1),
    ) -> Result<(), HandlerError> {
        let stream = domain.token();
        let mut course_before = None;
        let updated = self
            .inner
            .store
            .modify(run_id, |state| {
                if !progress::first_time(state, stream, delivery.stream_sequence) {
                    return false;
                }
                course_before = Some((state.phase, state.status));
                // Late events (a trial that finished after the final evaluation) still
                // count; only the status is final.
                apply(state);
                progress::fail_if_fruitless(state);
                progress::complete_if_done(state);
                state.progress_sequence += 1;
                true
            })
            .await
            .map_err(retry)?;
        let Some(state) = updated else {
            return Err(HandlerError::dead_letter(format!(
                "run {run_id} is unknown to the controller"
            )));
        };
        let course_changed =
            course_before.is_some_and(|before| before != (state.phase, state.status));
        if domain == Domain::Trial && !course_changed {
            self.unannounced().insert(run_id.clone());
        } else {
            // Publishing again after a redelivery is harmless: the message ids
            // de-duplicate.
            self.announce(&state).await?;
        }
        // The controller's own `run.failed` (not when folding a `run.failed`: that would
        // only echo it).
        if domain != Domain::Run
            && let Some(failed) = progress::failed_event(&state)
        {
            tracing::warn!(run = %run_id, reason = %failed.reason, "run failed");
            self.inner.bus.publish(&failed).await?;
        }
        Ok(())
    }

    async fn announce(&self, state: &RunStateV1) -> Result<(), HandlerError> {
        let bus = &self.inner.bus;
        bus.publish(&progress::progress_event(state)).await?;
        if state.status == RunStatus::Completed {
            bus.publish(&progress::completed_event(state)).await?;
        }
        Ok(())
    }

    async fn on_run_requested(&self, delivery: &Delivery) -> Result<(), HandlerError> {
        let ns = self.inner.bus.namespace();
        // Only a `cuda` run needs the live trainers (a bucket listing per request would
        // slow every admission).
        let wants_gpu = arl_schemas::catalog::decode_run_request(&delivery.payload)
            .is_ok_and(|r| r.spec.trainer.device == arl_schemas::spec::Device::Cuda);
        let trainers = if wants_gpu {
            self.inner
                .bus
                .live_trainers()
                .await
                .map_err(|e| HandlerError::retry(format!("reading live trainers: {e}")))?
        } else {
            Vec::new()
        };
        let admission = admit(
            &delivery.subject,
            ns.run_token(&delivery.subject),
            &delivery.payload,
            &self.inner.config.model_dir,
            &trainers,
        )
        .map_err(HandlerError::dead_letter)?;
        let admission = self.check_resume(admission).await?;
        let fresh = initial_state(admission);
        // The first decision stands: a redelivered (or re-submitted) request only
        // re-announces it.
        let created = self.inner.store.create(&fresh).await.map_err(retry)?;
        let state = match created {
            Some(_) => fresh,
            None => {
                let stored = self.inner.store.get(&fresh.run_id).await.map_err(retry)?;
                match stored {
                    Some(stored) => stored.state,
                    None => return Err(HandlerError::retry("run state vanished")),
                }
            }
        };
        match state.status {
            RunStatus::Rejected => {
                tracing::info!(run = %state.run_id, errors = state.errors.len(), "run rejected");
                self.inner
                    .bus
                    .publish(&RunRejectedV1 {
                        run_id: state.run_id.clone(),
                        rejected_at: state.submitted_at.max(state.updated_at),
                        errors: state.errors.clone(),
                    })
                    .await?;
            }
            _ => {
                tracing::info!(run = %state.run_id, "run accepted");
                self.inner
                    .bus
                    .publish(&RunAcceptedV1 {
                        run_id: state.run_id.clone(),
                        accepted_at: state.updated_at,
                        total_steps: state.total_steps,
                        model_path: state.model_path.clone().unwrap_or_default(),
                        dataset_path: state.dataset_path.clone().unwrap_or_default(),
                    })
                    .await?;
                self.announce(&state).await?;
            }
        }
        Ok(())
    }
}

impl Controller {
    /// A run that resumes from another's checkpoint needs that run here, with the step
    /// committed (whether the trainer still keeps its folder is the trainer's to say).
    async fn check_resume(&self, admission: Admission) -> Result<Admission, HandlerError> {
        let Admission::Accept { request, resources } = admission else {
            return Ok(admission);
        };
        let Some(from) = request.spec.trainer.resume_from.clone() else {
            return Ok(Admission::Accept { request, resources });
        };
        let source = self.inner.store.get(&from.run_id).await.map_err(retry)?;
        let problem = match source.map(|s| s.state) {
            None => format!(
                "no run {} on this deployment (`arl run list` shows them)",
                from.run_id
            ),
            Some(source) if source.step < from.step => format!(
                "run {} committed {} steps, so it has no step-{} to resume from",
                from.run_id, source.step, from.step
            ),
            Some(_) => return Ok(Admission::Accept { request, resources }),
        };
        Ok(Admission::Reject {
            run_id: request.run_id.clone(),
            request: Some(request),
            errors: vec![arl_schemas::FieldError::new("trainer.resume_from", problem)],
        })
    }
}

fn run_of(controller: &Controller, delivery: &Delivery) -> Result<RunId, HandlerError> {
    let token = controller
        .inner
        .bus
        .namespace()
        .run_token(&delivery.subject);
    token.and_then(|t| RunId::new(t).ok()).ok_or_else(|| {
        HandlerError::dead_letter(format!("no run id in subject {}", delivery.subject))
    })
}

fn initial_state(admission: Admission) -> RunStateV1 {
    let now = Utc::now();
    let (run_id, request, errors, resources) = match admission {
        Admission::Accept { request, resources } => (
            request.run_id.clone(),
            Some(request),
            vec![],
            Some(resources),
        ),
        Admission::Reject {
            run_id,
            request,
            errors,
        } => (run_id, request, errors, None),
    };
    let request_first_step = request
        .as_ref()
        .filter(|_| resources.is_some())
        .map_or(0, |r| r.spec.trainer.first_step());
    let status = if resources.is_some() {
        RunStatus::Accepted
    } else {
        RunStatus::Rejected
    };
    RunStateV1 {
        run_id,
        name: request
            .as_ref()
            .map(|r| r.spec.name.clone())
            .unwrap_or_default(),
        status,
        phase: RunPhase::Preparing,
        submitted_by: request
            .as_ref()
            .map(|r| r.submitted_by.clone())
            .unwrap_or_default(),
        submitted_at: request.as_ref().map_or(now, |r| r.submitted_at),
        updated_at: now,
        total_steps: request.as_ref().map_or(0, |r| r.spec.trainer.total_steps),
        spec: request.map(|r| r.spec),
        model_path: resources
            .as_ref()
            .map(|r| r.model_path.display().to_string()),
        dataset_path: resources
            .as_ref()
            .map(|r| r.dataset_path.display().to_string()),
        dataset_digest: None,
        errors,
        // A resumed run starts where its checkpoint ends.
        step: request_first_step,
        policy_version: 0,
        trials_finished: 0,
        failures: Default::default(),
        steps: vec![],
        evaluations: vec![],
        infrastructure_failures: Default::default(),
        checkpoint_uri: None,
        failure_reason: None,
        progress_sequence: 1,
        applied: Default::default(),
    }
}
