//! The trainer service: takes trajectories from JetStream, assembles each step's batch
//! (`train_batch_size` tasks × `n` trials), trains, writes the new policy version, and
//! publishes `weights.published` and `train.step`.
//!
//! Where engines find a version is the trainer's `--weights-store`: `file` names the
//! version folder (engines share the filesystem); `object` uploads the folder's files to
//! the `ARL_WEIGHTS` object store first, each checked by digest, and names them — a
//! version whose upload failed is never announced. Pruned versions' objects are deleted
//! with their folders.
//!
//! Delivery contract: a trajectory's message is held (kept alive, not acked) until the
//! step that used it is committed — written as a checkpoint with optimizer state. A crash
//! before that makes JetStream redeliver it, and the restarted trainer resumes from its
//! last checkpoint and trains the step again. Trajectories of steps already committed are
//! acked at once (duplicates, or redeliveries after a crash past the commit).

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arl_model::backend::{BackendError, BackendErrorKind};
use arl_model::cuda::Cuda;
use arl_model::handoff::{self, VersionKey};
use arl_model::train::Activations;
use arl_runtime::args::default_runs_dir;
use arl_runtime::consumer::run_consumer;
use arl_runtime::objects::ObjectError;
use arl_runtime::{Bus, BusError, ConsumerSpec, Delivery, HandlerError, RunContext, Shutdown};
use arl_schemas::events::{
    BatchCounts, RunAcceptedV1, RunFailedV1, Split, StepTiming, TaskBatchV1, TrainMetrics,
    TrainStepV2, TrajectoryV1, WEIGHTS_FILE, WeightsFormat, WeightsLocation, WeightsPublishedV2,
};
use arl_schemas::spec::{Device, KlLossType, LossAggMode, LrScheduler, OldLogprobSource, RunSpec};
use arl_schemas::state::{GpuDeviceV1, TRAINER_TTL_SECONDS, TrainerAnnouncementV1};
use arl_schemas::{Domain, RunId};
use tokio::sync::{Mutex, oneshot};

use crate::batch::{self, Admission, StepBatch};
use crate::checkpoint::{self, TrainerState};
use crate::metrics::TrainerMetrics;
use crate::objective::{Clip, KlEstimator, LossAggregation};
use crate::policy::{OpenSpec, Policy};
use crate::schedule::{Decay, LrSchedule};
use crate::step::{OldLogprobs, StepConfig};

#[derive(Clone, Debug)]
pub struct TrainerConfig {
    /// Policy versions and checkpoints go to `<runs_dir>/<run_id>/step-<N>/`.
    pub runs_dir: PathBuf,
    /// Versions kept on disk besides the newest checkpoint.
    pub keep_versions: usize,
    /// Trajectories held at once (all runs): at least `save_every` × batch × n.
    pub capacity: usize,
    pub ack_wait: Duration,
    /// The GPU `cuda` runs train on; None = this trainer offers none.
    pub gpu: Option<usize>,
    /// Where engines fetch published versions from.
    pub weights_store: WeightsStore,
}

impl Default for TrainerConfig {
    fn default() -> Self {
        Self {
            runs_dir: default_runs_dir(),
            keep_versions: 2,
            capacity: 4096,
            ack_wait: Duration::from_secs(30),
            gpu: Some(0),
            weights_store: WeightsStore::File,
        }
    }
}

/// Where a published version's files are for engines (`--weights-store`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum WeightsStore {
    /// The version folder under `--runs-dir`: engines on this machine, or on a volume
    /// mounted on every node.
    #[default]
    File,
    /// The `ARL_WEIGHTS` JetStream object store: engines on any machine of the bus.
    Object,
}

#[derive(Debug, thiserror::Error)]
pub enum TrainerError {
    #[error(transparent)]
    Bus(#[from] BusError),
}

/// Told whether the step of a held trajectory committed.
type Waiter = oneshot::Sender<Committed>;
type Committed = Result<(), Arc<StepError>>;

/// Why a training step did not commit. Shared (`Arc`) with every trajectory of the step
/// waiting for it, which goes back to the stream with it.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    #[error("run {0} has no model loaded")]
    NoModel(RunId),
    #[error("reading failed groups: {0}")]
    FailedGroups(#[source] arl_runtime::BusError),
    #[error("training step {step} panicked: {source}")]
    Panicked {
        step: u32,
        #[source]
        source: tokio::task::JoinError,
    },
    #[error("training step {step} failed: {source}")]
    Device {
        step: u32,
        #[source]
        source: BackendError,
    },
    #[error("cannot save step {step}: {source}")]
    Save {
        step: u32,
        #[source]
        source: crate::policy::PolicyError,
    },
    /// The version is discarded; the step is trained again from the last checkpoint when
    /// its trajectories come back, and published then.
    #[error("cannot publish step {step}: {source}")]
    Publish {
        step: u32,
        #[source]
        source: arl_runtime::BusError,
    },
    /// The version is not in the object store: it is not announced (engines could not
    /// fetch it) and is discarded; the step is trained and uploaded again on the retry.
    #[error(
        "cannot upload step {step}'s weights to the object store, so they are not published: {source}"
    )]
    Upload {
        step: u32,
        #[source]
        source: ObjectError,
    },
}

/// One step's trajectories and the handlers waiting for it to commit.
struct PendingStep {
    batch: StepBatch,
    waiters: Vec<Waiter>,
    first_at: Instant,
}

/// A run's training state. `policy` is None once the run's last step is committed.
struct RunTrainer {
    run_id: RunId,
    spec: RunSpec,
    dir: PathBuf,
    policy: Option<Policy>,
    /// Trajectories each step needs, from the step's own `task.batch` (tasks × samples):
    /// the last batch of an epoch may be short.
    step_sizes: HashMap<u32, usize>,
    /// The last committed step (0 = none); the policy version equals it.
    step: u32,
    /// The last trained step (ahead of `step` between checkpoints).
    trained: u32,
    pending: BTreeMap<u32, PendingStep>,
    /// Waiters of trained steps not yet in a checkpoint.
    uncommitted: Vec<Waiter>,
    failed: Option<String>,
    /// A step failed part-way (the in-memory model may be ahead of the disk): the run is
    /// reopened from its last checkpoint on the next trajectory.
    broken: bool,
    /// A step failed in a way retrying cannot mend (out of GPU memory): the run fails.
    unrecoverable: Option<String>,
}

impl RunTrainer {
    /// Trajectories step `step` needs; None until its batch has been read.
    fn expected(&self, step: u32) -> Option<usize> {
        self.step_sizes.get(&step).copied()
    }
}

#[derive(Clone)]
pub struct Trainer {
    bus: Bus,
    config: TrainerConfig,
    runs: Arc<Mutex<HashMap<RunId, Arc<Mutex<RunTrainer>>>>>,
    /// The GPU this trainer opened at start, or why it has none.
    gpu: Arc<Result<Cuda, String>>,
    instance: String,
    metrics: TrainerMetrics,
}

impl Trainer {
    /// Opens the configured GPU (a machine without one gets the reason, announced and
    /// given to any `cuda` run that reaches this trainer anyway).
    pub fn new(bus: Bus, config: TrainerConfig) -> Self {
        let gpu = match config.gpu {
            Some(ordinal) => Cuda::new(ordinal).map_err(|e| e.to_string()),
            None => Err("this trainer was started without a GPU (--gpu none)".to_owned()),
        };
        match &gpu {
            Ok(gpu) => tracing::info!(gpu = %gpu.info().name, "GPU opened"),
            Err(reason) => tracing::info!(%reason, "no GPU; cpu runs only"),
        }
        Self {
            config,
            runs: Arc::default(),
            gpu: Arc::new(gpu),
            instance: format!("trainer-{}", uuid::Uuid::now_v7().simple()),
            metrics: TrainerMetrics::register(bus.metrics()),
            bus,
        }
    }

    /// What this trainer announces in `ARL_TRAINERS`.
    async fn announcement(&self) -> TrainerAnnouncementV1 {
        let (devices, gpu_unavailable) = match self.gpu.as_ref() {
            Ok(gpu) => {
                let info = gpu.info();
                let device = GpuDeviceV1 {
                    ordinal: info.ordinal as u32,
                    name: info.name.clone(),
                    memory_bytes: info.total_memory_bytes,
                    compute_capability: format!(
                        "{}.{}",
                        info.compute_capability.0, info.compute_capability.1
                    ),
                };
                (vec![device], None)
            }
            Err(reason) => (Vec::new(), Some(reason.clone())),
        };
        TrainerAnnouncementV1 {
            instance: self.instance.clone(),
            host: arl_runtime::host::host_name(),
            devices,
            gpu_unavailable,
            runs: self.runs.lock().await.keys().cloned().collect(),
            held_capacity: Some(self.config.capacity as u64),
            at: chrono::Utc::now(),
        }
    }

    /// Refreshes the announcement every third of its TTL until shutdown, first letting go
    /// of runs that have ended.
    async fn announce(self: Arc<Self>, shutdown: Shutdown) {
        let every = Duration::from_secs(TRAINER_TTL_SECONDS / 3);
        loop {
            self.forget_ended_runs().await;
            let announcement = self.announcement().await;
            if let Err(err) = self.bus.announce_trainer(&announcement).await {
                tracing::warn!(%err, "cannot announce this trainer");
            }
            tokio::select! {
                () = tokio::time::sleep(every) => {}
                () = shutdown.triggered() => return,
            }
        }
    }

    /// Drops the training state of every run that has ended (completed, failed or
    /// cancelled): a trainer serving runs back to back holds only the live ones. A late
    /// trajectory of an ended run is acked without reopening it (see [`Trainer::run`]).
    async fn forget_ended_runs(&self) {
        let known: Vec<RunId> = self.runs.lock().await.keys().cloned().collect();
        for run_id in known {
            match self.bus.run_state(&run_id).await {
                Ok(Some(state)) if state.status.is_terminal() => {
                    self.runs.lock().await.remove(&run_id);
                    tracing::info!(run = %run_id, status = ?state.status, "run ended; its training state released");
                }
                Ok(_) => {}
                Err(err) => tracing::debug!(%err, run = %run_id, "run state not read"),
            }
        }
    }

    /// Starts the announcements and the trajectory consumer.
    pub fn start(self, shutdown: &Shutdown) {
        let ns = self.bus.namespace();
        let mut spec =
            ConsumerSpec::for_event::<TrajectoryV1>(ns, "trainer").held(self.config.capacity);
        spec.ack_wait = self.config.ack_wait;
        spec.max_deliver = 20;
        let mut accepted = ConsumerSpec::for_event::<RunAcceptedV1>(ns, "trainer");
        // Opening a run loads its model.
        accepted.keep_alive = true;
        let bus = self.bus.clone();
        let trainer = Arc::new(self);
        shutdown.spawn(trainer.clone().announce(shutdown.clone()));
        let on_accepted = trainer.clone();
        shutdown.spawn(run_consumer(
            bus.clone(),
            accepted,
            move |delivery: Delivery| {
                let trainer = on_accepted.clone();
                async move { trainer.on_run_accepted(delivery).await }
            },
            shutdown.clone(),
        ));
        let stopping = shutdown.clone();
        shutdown.spawn(run_consumer(
            bus,
            spec,
            move |delivery: Delivery| {
                let (trainer, stopping) = (trainer.clone(), stopping.clone());
                async move { trainer.on_trajectory(delivery, &stopping).await }
            },
            shutdown.clone(),
        ));
    }

    /// A run resumed from another's checkpoint (`trainer.resume_from`) is opened at once
    /// and its checkpoint published as its first policy version: its first trials wait on
    /// that version, so nothing else would open it.
    async fn on_run_accepted(&self, delivery: Delivery) -> Result<(), HandlerError> {
        let accepted: RunAcceptedV1 = delivery.decode()?;
        let context = self.bus.run_context(&accepted.run_id).await?;
        let Some(from) = context.spec.trainer.resume_from else {
            return Ok(());
        };
        let Some(run) = self.run(&accepted.run_id).await? else {
            return Ok(());
        };
        let run = run.lock().await;
        // A run that failed to open said why (run.failed); one that trained past its
        // checkpoint has published newer versions.
        if run.failed.is_some() || run.trained != from.step {
            return Ok(());
        }
        let dir = checkpoint::version_dir(&run.dir, from.step);
        let saved = tokio::task::spawn_blocking(move || checkpoint::describe(&dir))
            .await
            .map_err(|e| HandlerError::retry(format!("describing the checkpoint: {e}")))?
            .map_err(HandlerError::retry)?;
        let location = self
            .locate(&run.run_id, from.step, &saved)
            .await
            .map_err(HandlerError::retry)?;
        let weights = WeightsPublishedV2 {
            run_id: run.run_id.clone(),
            policy_version: u64::from(from.step),
            step: from.step,
            format: WeightsFormat::HfSafetensors,
            sha256: saved.sha256,
            size_bytes: saved.size_bytes,
            location,
            at: chrono::Utc::now(),
        };
        self.bus.publish(&weights).await?;
        tracing::info!(run = %run.run_id, from = %from.run_id, step = from.step, "resumed from a checkpoint");
        Ok(())
    }

    async fn on_trajectory(
        &self,
        delivery: Delivery,
        shutdown: &Shutdown,
    ) -> Result<(), HandlerError> {
        let trajectory: TrajectoryV1 = delivery.decode()?;
        batch::validate(&trajectory).map_err(HandlerError::dead_letter)?;
        if trajectory.slot.split != Split::Train {
            // Validation trials are graded by the evaluator, never trained on.
            return Ok(());
        }
        // Only trajectories of trials the rollout service ran are trained on.
        self.bus
            .check_requested(
                &trajectory.trial_id,
                trajectory.slot.attempt,
                "trajectory.ready",
                delivery.published,
            )
            .await?;
        // The run's Arc is released before waiting, so a reopened run's old state (and the
        // waiters in it) can be dropped.
        let waiter = {
            let Some(run) = self.run(&trajectory.run_id).await? else {
                tracing::info!(run = %trajectory.run_id, "trajectory of a finished run; acked");
                return Ok(());
            };
            let mut run = run.lock().await;
            self.learn_step_size(&mut run, trajectory.slot.step).await?;
            match self.admit(&mut run, trajectory)? {
                None => return Ok(()),
                Some(waiter) => {
                    self.train_ready_steps(&mut run).await;
                    waiter
                }
            }
        };
        let committed = tokio::select! {
            committed = waiter => committed,
            // Not acked: the next trainer gets it back.
            () = shutdown.triggered() => return Err(HandlerError::retry("trainer stopping")),
        };
        match committed {
            Ok(Ok(())) => Ok(()),
            Ok(Err(reason)) => Err(HandlerError::retry(reason)),
            Err(_) => Err(HandlerError::retry(
                "the trainer dropped the step before committing it",
            )),
        }
    }

    /// Reads how many trajectories `step` needs from the step's own `task.batch` (tasks ×
    /// samples per task), once per step.
    async fn learn_step_size(&self, run: &mut RunTrainer, step: u32) -> Result<(), HandlerError> {
        if run.failed.is_some() || step <= run.step || run.step_sizes.contains_key(&step) {
            return Ok(());
        }
        let ns = self.bus.namespace();
        let batches: Vec<TaskBatchV1> = self
            .bus
            .replay(
                Domain::Task,
                ns.event_subject(Domain::Task, &run.run_id, "batch"),
            )
            .await?;
        let batch = batches
            .into_iter()
            .find(|b| b.split == Split::Train && b.step == step)
            .ok_or_else(|| {
                HandlerError::retry(format!(
                    "no training task.batch of step {step} for run {} yet",
                    run.run_id
                ))
            })?;
        let size = batch.tasks.len() * batch.samples_per_task as usize;
        run.step_sizes.insert(step, size);
        Ok(())
    }

    /// Places a trajectory in its step's batch; None when there is nothing to wait for.
    fn admit(
        &self,
        run: &mut RunTrainer,
        trajectory: TrajectoryV1,
    ) -> Result<Option<oneshot::Receiver<Committed>>, HandlerError> {
        let step = trajectory.slot.step;
        if run.failed.is_some() || step <= run.step {
            return Ok(None);
        }
        if step > run.spec.trainer.total_steps {
            return Err(HandlerError::dead_letter(format!(
                "trajectory for step {step}, but run {} has only {} steps",
                run.run_id, run.spec.trainer.total_steps
            )));
        }
        if step <= run.trained {
            // Trained, not yet checkpointed: this is a redelivery; hold it with the others.
            let (tx, rx) = oneshot::channel();
            run.uncommitted.push(tx);
            return Ok(Some(rx));
        }
        let pending = run.pending.entry(step).or_insert_with(|| PendingStep {
            batch: StepBatch::new(step),
            waiters: Vec::new(),
            first_at: Instant::now(),
        });
        if pending.batch.offer(trajectory) == Admission::Duplicate {
            tracing::debug!(step, "duplicate trajectory");
        }
        let (tx, rx) = oneshot::channel();
        pending.waiters.push(tx);
        Ok(Some(rx))
    }

    /// Trains every consecutive step whose batch is whole.
    async fn train_ready_steps(&self, run: &mut RunTrainer) {
        loop {
            let next = run.trained + 1;
            let ready = run
                .pending
                .get(&next)
                .zip(run.expected(next))
                .is_some_and(|(p, expected)| p.batch.len() >= expected);
            if !ready || run.failed.is_some() {
                return;
            }
            let Some(pending) = run.pending.remove(&next) else {
                return;
            };
            if let Err(reason) = self.train(run, pending).await {
                if let Some(cause) = run.unrecoverable.take() {
                    self.publish_failure(&run.run_id, &cause).await;
                    run.failed = Some(cause);
                    run.policy = None;
                } else {
                    tracing::error!(run = %run.run_id, step = next, %reason, "step failed; the run reopens from its last checkpoint");
                    run.broken = true;
                }
                let waiters = run.uncommitted.drain(..).chain(
                    std::mem::take(&mut run.pending)
                        .into_values()
                        .flat_map(|p| p.waiters),
                );
                for waiter in waiters.collect::<Vec<_>>() {
                    let _ = waiter.send(Err(reason.clone()));
                }
                return;
            }
        }
    }

    async fn train(
        &self,
        run: &mut RunTrainer,
        pending: PendingStep,
    ) -> Result<(), Arc<StepError>> {
        let step = pending.batch.step;
        let waited = pending.first_at.elapsed().as_secs_f64();
        let started = Instant::now();
        let result = self.train_and_save(run, &pending.batch).await;
        let (saved, step_metrics, assembled, save_seconds, is_checkpoint) = match result {
            Ok(done) => done,
            Err(reason) => {
                let reason = Arc::new(reason);
                for waiter in pending.waiters {
                    let _ = waiter.send(Err(reason.clone()));
                }
                return Err(reason);
            }
        };
        run.trained = step;
        run.uncommitted.extend(pending.waiters);
        let upload_started = Instant::now();
        let location = match self.locate(&run.run_id, step, &saved).await {
            Ok(location) => location,
            Err(source) => {
                discard(&saved.dir).await;
                return Err(Arc::new(StepError::Upload { step, source }));
            }
        };
        // Writing the version where engines find it: the upload counts as saving.
        let save_seconds = save_seconds + upload_started.elapsed().as_secs_f64();
        let at = chrono::Utc::now();
        let weights = WeightsPublishedV2 {
            run_id: run.run_id.clone(),
            policy_version: u64::from(step),
            step,
            format: WeightsFormat::HfSafetensors,
            sha256: saved.sha256.clone(),
            size_bytes: saved.size_bytes,
            location,
            at,
        };
        let total = started.elapsed().as_secs_f64();
        let update = (total - save_seconds - step_metrics.old_logprob_seconds).max(0.0);
        let train_step_event = TrainStepV2 {
            run_id: run.run_id.clone(),
            step,
            policy_version: u64::from(step),
            metrics: TrainMetrics {
                pg_loss: step_metrics.pg_loss,
                kl: step_metrics.kl,
                entropy: step_metrics.entropy,
                clip_fraction: step_metrics.clip_fraction,
                grad_norm: step_metrics.grad_norm,
                lr: step_metrics.lr,
                reward_mean: step_metrics.reward_mean,
                reward_max: step_metrics.reward_max,
                response_length_mean: step_metrics.response_length_mean,
                num_turns_mean: assembled.num_turns_mean,
                tool_calls_mean: assembled.tool_calls_mean,
                tokens_per_second: step_metrics.tokens_per_second,
                trajectories: assembled.trajectories as u32,
                groups_dropped: step_metrics.groups_dropped as u32,
            },
            batch: BatchCounts {
                trajectories: count(assembled.trajectories),
                masked: count(assembled.masked),
                stale: count(assembled.stale),
                groups: count(step_metrics.groups),
                zero_advantage_groups: count(step_metrics.zero_advantage_groups),
                samples_trained: count(step_metrics.samples_trained),
                unproven_tokens: count(assembled.unproven_tokens),
            },
            timing: StepTiming {
                wait_for_trajectories: waited,
                old_logprobs: step_metrics.old_logprob_seconds,
                update,
                save: save_seconds,
                total: total + waited,
            },
            at,
        };
        for published in [
            self.bus.publish(&weights).await.map(|_| ()),
            self.bus.publish(&train_step_event).await.map(|_| ()),
        ] {
            if let Err(source) = published {
                discard(&saved.dir).await;
                return Err(Arc::new(StepError::Publish { step, source }));
            }
        }
        self.prune(&run.run_id, &run.dir).await;
        self.metrics.step(&train_step_event);
        tracing::info!(
            run = %run.run_id, step, pg_loss = step_metrics.pg_loss, grad_norm = step_metrics.grad_norm,
            reward_mean = step_metrics.reward_mean, samples = assembled.samples.len(),
            samples_trained = step_metrics.samples_trained,
            zero_advantage_groups = step_metrics.zero_advantage_groups,
            tokens_per_second = step_metrics.tokens_per_second,
            response_length_mean = step_metrics.response_length_mean,
            waited_s = waited, update_s = update, save_s = save_seconds, "step trained"
        );
        if step_metrics.samples_trained == 0 {
            tracing::warn!(
                run = %run.run_id, step, groups = step_metrics.groups, masked = assembled.masked,
                "step trained nothing: every group's rewards were equal or every trial was masked"
            );
        }
        if is_checkpoint {
            run.step = step;
            for waiter in run.uncommitted.drain(..) {
                let _ = waiter.send(Ok(()));
            }
        }
        if step >= run.spec.trainer.total_steps {
            // The run's training is over: free the model.
            run.policy = None;
        }
        Ok(())
    }

    /// Where engines find a saved version: its folder, or (`--weights-store object`) its
    /// files uploaded to `ARL_WEIGHTS`, the weights file's digest the one the save computed.
    async fn locate(
        &self,
        run_id: &RunId,
        step: u32,
        saved: &checkpoint::Saved,
    ) -> Result<WeightsLocation, ObjectError> {
        match self.config.weights_store {
            WeightsStore::File => Ok(WeightsLocation::Folder {
                path: saved.dir.display().to_string(),
            }),
            WeightsStore::Object => {
                let version = u64::from(step);
                let location = self
                    .bus
                    .put_weights(run_id, version, &saved.dir, &saved.files)
                    .await?;
                if let WeightsLocation::ObjectStore { bucket, files } = &location {
                    let uploaded = files.iter().find(|f| f.file == WEIGHTS_FILE);
                    if uploaded.map(|f| &f.sha256) != Some(&saved.sha256) {
                        // The file changed on disk between the save and the upload.
                        return Err(ObjectError::WrongDigest {
                            store: bucket.clone(),
                            name: arl_schemas::ObjectStore::weights_object(
                                run_id,
                                version,
                                WEIGHTS_FILE,
                            ),
                            found: uploaded.map(|f| f.sha256.clone()).unwrap_or_default(),
                            expected: saved.sha256.clone(),
                        });
                    }
                }
                tracing::info!(run = %run_id, step, files = saved.files.len(), "weights uploaded to the object store");
                Ok(location)
            }
        }
    }

    /// Once a version is announced: deletes the run's old versions (`keep_versions`
    /// besides the newest checkpoint) and, with the object store, their objects. A failure
    /// leaves garbage, not a wrong result: it is logged, and the step goes on.
    async fn prune(&self, run_id: &RunId, run_dir: &std::path::Path) {
        let (dir, keep) = (run_dir.to_path_buf(), self.config.keep_versions);
        let pruned = match tokio::task::spawn_blocking(move || checkpoint::prune(&dir, keep)).await
        {
            Ok(Ok(pruned)) => pruned,
            Ok(Err(error)) => {
                tracing::warn!(run = %run_id, %error, "cannot prune old versions");
                return;
            }
            Err(error) => {
                tracing::warn!(run = %run_id, %error, "pruning old versions panicked");
                return;
            }
        };
        if self.config.weights_store != WeightsStore::Object {
            return;
        }
        for version in &pruned {
            let policy_version = u64::from(version.step);
            match self
                .bus
                .delete_weights(run_id, policy_version, &version.files)
                .await
            {
                Ok(deleted) => {
                    tracing::debug!(run = %run_id, policy_version, deleted, "pruned version's objects deleted")
                }
                Err(error) => {
                    tracing::warn!(run = %run_id, policy_version, %error, "cannot delete a pruned version's objects; they stay in the object store")
                }
            }
        }
    }

    /// Runs the step on a blocking thread and writes the version.
    async fn train_and_save(
        &self,
        run: &mut RunTrainer,
        batch: &StepBatch,
    ) -> Result<(checkpoint::Saved, StepOutcome, batch::Assembled, f64, bool), StepError> {
        let step = batch.step;
        let spec = run.spec.clone();
        let failed = self
            .failed_groups(&run.run_id, batch)
            .await
            .map_err(StepError::FailedGroups)?;
        let assembled = batch.assemble_without(
            u64::from(run.trained),
            spec.algorithm.max_staleness,
            &failed,
        );
        let Some(mut policy) = run.policy.take() else {
            return Err(StepError::NoModel(run.run_id.clone()));
        };
        let is_checkpoint =
            step.is_multiple_of(spec.trainer.save_every) || step >= spec.trainer.total_steps;
        let dir = run.dir.clone();
        let samples = assembled.samples.clone();
        let run_id = run.run_id.clone();
        let joined = tokio::task::spawn_blocking(move || {
            let config = step_config(&spec);
            let lr = lr_schedule(&spec).at(step);
            let started = Instant::now();
            let metrics = match policy.train(&samples, &config, lr as f32) {
                Ok(metrics) => metrics,
                // The policy may be half-updated: it is dropped, and the run reopens.
                Err(error) => return Err(error),
            };
            let seconds = started.elapsed().as_secs_f64();
            let tokens: usize = samples.iter().map(|s| s.tokens.len()).sum();
            let outcome = StepOutcome {
                pg_loss: metrics.pg_loss,
                kl: metrics.kl,
                entropy: metrics.entropy,
                clip_fraction: metrics.clip_fraction,
                grad_norm: metrics.grad_norm,
                lr,
                reward_mean: metrics.reward_mean,
                reward_max: metrics.reward_max,
                response_length_mean: metrics.response_length_mean,
                tokens_per_second: (tokens * config.epochs.max(1)) as f64 / seconds.max(1e-9),
                groups_dropped: metrics.groups_dropped,
                groups: metrics.groups,
                zero_advantage_groups: metrics.zero_advantage_groups,
                samples_trained: metrics.samples_trained,
                old_logprob_seconds: metrics.old_logprob_seconds,
            };
            let save_started = Instant::now();
            let state = TrainerState {
                step,
                policy_version: u64::from(step),
                optimizer_step: None,
            };
            let saved = policy.save(&dir, &state, is_checkpoint);
            if let Ok(saved) = &saved {
                hand_off(&policy, &run_id, step, &saved.sha256);
            }
            let save_seconds = save_started.elapsed().as_secs_f64();
            Ok((policy, saved, outcome, save_seconds))
        })
        .await;
        let joined = joined.map_err(|source| StepError::Panicked { step, source })?;
        let (policy, saved, outcome, save_seconds) = match joined {
            Ok(done) => done,
            Err(source) => {
                // The same step needs the same memory again: retrying cannot help.
                let out_of_memory = source.kind == BackendErrorKind::OutOfMemory;
                let error = StepError::Device { step, source };
                if out_of_memory {
                    run.unrecoverable = Some(error.to_string());
                }
                return Err(error);
            }
        };
        run.policy = Some(policy);
        let saved = saved.map_err(|source| StepError::Save { step, source })?;
        Ok((saved, outcome, assembled, save_seconds, is_checkpoint))
    }

    /// The run's trainer, opened on first use (resuming from its last checkpoint); None
    /// for a run that is over or unknown.
    async fn run(&self, run_id: &RunId) -> Result<Option<Arc<Mutex<RunTrainer>>>, HandlerError> {
        let mut runs = self.runs.lock().await;
        if let Some(run) = runs.get(run_id) {
            // A run busy training is not broken (it is marked so only under its lock).
            let broken = run.try_lock().is_ok_and(|r| r.broken);
            if !broken {
                return Ok(Some(run.clone()));
            }
            runs.remove(run_id);
        }
        let context = self.bus.run_context(run_id).await?;
        if context.state.status.is_terminal() {
            return Ok(None);
        }
        if let Err(why) = self.gpu.as_ref()
            && context.spec.trainer.device == Device::Cuda
        {
            // Admission saw a trainer with a GPU: that one takes the run's trajectories.
            return Err(HandlerError::retry(format!(
                "run {run_id} trains on a GPU and this trainer has none ({why}); left to a GPU trainer"
            )));
        }
        let opened = self.open(run_id, context).await;
        let run = Arc::new(Mutex::new(opened));
        runs.insert(run_id.clone(), run.clone());
        Ok(Some(run))
    }

    /// The tasks of the batch whose group the rollout failed (`fail_group`).
    async fn failed_groups(
        &self,
        run: &RunId,
        batch: &batch::StepBatch,
    ) -> Result<Vec<arl_schemas::TaskId>, arl_runtime::BusError> {
        let mut failed = Vec::new();
        for task in batch.tasks() {
            let key = arl_schemas::state::failed_group_key(
                run,
                arl_schemas::events::Split::Train,
                batch.step,
                &task,
            );
            let flag = self
                .bus
                .get_record::<bool>(arl_schemas::Bucket::Trials, &key)
                .await?;
            if flag == Some(true) {
                failed.push(task);
            }
        }
        Ok(failed)
    }

    /// Loads the model (from the last checkpoint, or the run's base model); a run that
    /// cannot be trained is failed with the reason.
    async fn open(&self, run_id: &RunId, context: RunContext) -> RunTrainer {
        let RunContext { state, spec } = context;
        let dir = self.config.runs_dir.join(run_id.as_str());
        let mut run = RunTrainer {
            run_id: run_id.clone(),
            spec: spec.clone(),
            step_sizes: HashMap::new(),
            dir: dir.clone(),
            policy: None,
            unrecoverable: None,
            step: 0,
            trained: 0,
            pending: BTreeMap::new(),
            uncommitted: Vec::new(),
            failed: None,
            broken: false,
        };
        let Some(model_path) = state.model_path else {
            return self.fail(run, "the run state has no model path").await;
        };
        let open = OpenSpec {
            base: PathBuf::from(&model_path),
            device: spec.trainer.device,
            weight_decay: spec.optim.weight_decay as f32,
            with_reference: spec.algorithm.kl_coef > 0.0,
        };
        let total = spec.trainer.total_steps;
        let gpu = self.gpu.clone();
        let source = spec
            .trainer
            .resume_from
            .as_ref()
            .map(|from| (self.config.runs_dir.join(from.run_id.as_str()), from.step));
        let loaded = tokio::task::spawn_blocking(move || -> Result<_, String> {
            if let Some((source_dir, step)) = &source {
                checkpoint::seed_from(source_dir, *step, &dir).map_err(|e| e.to_string())?;
            }
            let resume = checkpoint::latest_checkpoint(&dir);
            if let Some((_, state)) = &resume
                && state.step >= total
            {
                return Ok((None, state.step));
            }
            let step = resume.as_ref().map_or(0, |(_, state)| state.step);
            let gpu = gpu.as_ref().as_ref().map_err(String::as_str);
            let resume = resume.as_ref().map(|(path, state)| (path.as_path(), state));
            Policy::open(&open, resume, gpu)
                .map(|policy| (Some(policy), step))
                .map_err(|e| e.to_string())
        })
        .await
        .map_err(|e| e.to_string())
        .and_then(|r| r);
        match loaded {
            Ok((policy, step)) => {
                tracing::info!(run = %run_id, resumed_at = step, device = ?run.spec.trainer.device, "run opened");
                run.policy = policy;
                run.step = step;
                run.trained = step;
                run
            }
            Err(reason) => {
                let reason = format!("cannot load the model: {reason}");
                self.fail(run, &reason).await
            }
        }
    }

    async fn fail(&self, mut run: RunTrainer, reason: &str) -> RunTrainer {
        self.publish_failure(&run.run_id, reason).await;
        run.failed = Some(reason.to_owned());
        run
    }

    async fn publish_failure(&self, run_id: &RunId, reason: &str) {
        tracing::error!(run = %run_id, %reason, "run cannot be trained");
        let event = RunFailedV1 {
            run_id: run_id.clone(),
            failed_at: chrono::Utc::now(),
            service: "trainer".into(),
            reason: reason.to_owned(),
        };
        if let Err(err) = self.bus.publish(&event).await {
            tracing::error!(error = %err, "cannot publish run.failed");
        }
    }
}

/// What a step reports, computed on the blocking thread.
struct StepOutcome {
    pg_loss: f64,
    kl: f64,
    entropy: f64,
    clip_fraction: f64,
    grad_norm: f64,
    lr: f64,
    reward_mean: f64,
    reward_max: f64,
    response_length_mean: f64,
    tokens_per_second: f64,
    groups_dropped: usize,
    groups: usize,
    zero_advantage_groups: usize,
    samples_trained: usize,
    old_logprob_seconds: f64,
}

/// Deletes the version folder of a step that could not be announced, so that the run,
/// reopened, resumes from the last announced checkpoint and trains the step again; left in
/// place, a checkpoint folder would count as committed and the step would never be
/// announced.
async fn discard(dir: &std::path::Path) {
    if let Err(error) = tokio::fs::remove_dir_all(dir).await {
        tracing::error!(path = %dir.display(), %error, "cannot discard a version that was not announced");
    }
}

fn count(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// The step's settings from the run spec.
pub fn step_config(spec: &RunSpec) -> StepConfig {
    let a = &spec.algorithm;
    StepConfig {
        estimator: a.adv_estimator,
        clip: Clip {
            low: a.clip_ratio_low,
            high: a.clip_ratio_high,
            dual: (a.clip_ratio_c > 1.0).then_some(a.clip_ratio_c),
        },
        kl: (a.kl_coef > 0.0).then_some((
            match a.kl_loss_type {
                KlLossType::LowVarKl => KlEstimator::LowVarKl,
                KlLossType::K1 => KlEstimator::K1,
                KlLossType::K2 => KlEstimator::K2,
            },
            a.kl_coef,
        )),
        entropy_coef: a.entropy_coeff,
        aggregation: match a.loss_agg_mode {
            LossAggMode::TokenMean => LossAggregation::TokenMean,
            LossAggMode::SeqMeanTokenSum => LossAggregation::SeqMeanTokenSum,
            LossAggMode::SeqMeanTokenMean => LossAggregation::SeqMeanTokenMean,
        },
        weight_decay: spec.optim.weight_decay as f32,
        grad_clip: spec.optim.grad_clip,
        micro_batch_tokens: spec.trainer.micro_batch_tokens as usize,
        activations: if spec.trainer.activation_checkpointing {
            Activations::Recompute
        } else {
            Activations::Keep
        },
        mini_batches: spec.trainer.ppo_mini_batches as usize,
        epochs: spec.trainer.ppo_epochs as usize,
        old_logprobs: match a.old_logprobs {
            OldLogprobSource::Recompute => OldLogprobs::Recompute,
            OldLogprobSource::Rollout => OldLogprobs::Rollout,
        },
        // On-policy samples need no correction; stale ones are reweighted (TIS).
        // Corrects both staleness and the engine/trainer numerical mismatch.
        tis_cap: (a.tis_cap >= 1.0).then_some(a.tis_cap),
        dynamic_sampling: a.filter_groups,
    }
}

pub fn lr_schedule(spec: &RunSpec) -> LrSchedule {
    let o = &spec.optim;
    LrSchedule {
        peak: o.lr,
        warmup_steps: o.lr_warmup_steps,
        total_steps: spec.trainer.total_steps,
        decay: match o.lr_scheduler {
            LrScheduler::Constant => Decay::Constant,
            LrScheduler::Cosine => Decay::Cosine {
                min_ratio: o.min_lr_ratio,
            },
        },
    }
}

/// Hands the version just saved to the engines of this process, if any listen
/// (`arl serve trainer + inference`); they take it instead of reading its file. A failure
/// costs only that: they read the file.
fn hand_off(policy: &Policy, run_id: &RunId, step: u32, sha256: &str) {
    let key = VersionKey {
        run_id: run_id.to_string(),
        policy_version: u64::from(step),
        sha256: sha256.to_owned(),
    };
    match policy.hand_off(key) {
        Ok(Some(version)) => {
            let on_gpu = version.device.is_some();
            handoff::offer(version);
            tracing::info!(run = %run_id, step, on_gpu, "version handed over to this process's engine");
        }
        Ok(None) => {}
        Err(error) => {
            tracing::warn!(run = %run_id, step, %error, "cannot hand the version over in memory; engines read its file");
        }
    }
}
