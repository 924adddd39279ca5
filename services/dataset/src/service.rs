//! The dataset service: on `run.accepted` it loads the run's dataset, validates every row,
//! registers the manifest in the `ARL_DATASETS` object store under its digest, announces
//! it (`task.dataset`) and publishes the first step's task batch; on each `train.step` it
//! publishes the batch that keeps rollout `max_staleness` steps ahead of the trainer. A
//! dataset that fails validation (and the run did not allow it) fails the run with the
//! rows named.

use std::path::PathBuf;
use std::sync::Arc;

use arl_runtime::consumer::run_consumer;
use arl_runtime::{Bus, ConsumerSpec, Delivery, HandlerError, Shutdown};
use arl_schemas::dataset::DatasetManifestV1;
use arl_schemas::events::{
    DatasetRegisteredV1, RunAcceptedV1, RunFailedV1, Split, TaskBatchV1, TaskRef, TrainStepV2,
};
use arl_schemas::state::RunStateV1;
use arl_schemas::{ObjectStore, RunId};

use crate::{manifest, split};

const SERVICE: &str = "dataset";

#[derive(Clone)]
pub struct DatasetService {
    bus: Bus,
}

impl DatasetService {
    pub fn new(bus: Bus) -> Self {
        Self { bus }
    }

    pub fn start(&self, shutdown: &Shutdown) {
        let ns = self.bus.namespace();
        let mut accepted = ConsumerSpec::for_event::<RunAcceptedV1>(ns, SERVICE);
        // Loading 500 SWE-bench rows with their test patches takes a moment.
        accepted.keep_alive = true;
        accepted.concurrency = 2;
        let steps = ConsumerSpec::for_event::<TrainStepV2>(ns, SERVICE);
        let service = Arc::new(self.clone());
        let on_accepted = service.clone();
        shutdown.spawn(run_consumer(
            self.bus.clone(),
            accepted,
            move |delivery: Delivery| {
                let service = on_accepted.clone();
                async move { service.on_run_accepted(delivery).await }
            },
            shutdown.clone(),
        ));
        shutdown.spawn(run_consumer(
            self.bus.clone(),
            steps,
            move |delivery: Delivery| {
                let service = service.clone();
                async move { service.on_train_step(delivery).await }
            },
            shutdown.clone(),
        ));
    }

    async fn on_run_accepted(&self, delivery: Delivery) -> Result<(), HandlerError> {
        let accepted: RunAcceptedV1 = delivery.decode()?;
        let arl_runtime::RunContext { spec, .. } = self.bus.run_context(&accepted.run_id).await?;
        let path = PathBuf::from(&accepted.dataset_path);
        let data = spec.data.clone();
        let built = tokio::task::spawn_blocking(move || manifest::build(&data, &path))
            .await
            .map_err(|e| HandlerError::retry(format!("loader task failed: {e}")))?;
        let manifest = match built {
            Ok(manifest) => manifest,
            Err(error) => {
                tracing::warn!(run = %accepted.run_id, %error, "dataset refused");
                self.bus
                    .publish(&RunFailedV1 {
                        run_id: accepted.run_id.clone(),
                        failed_at: chrono::Utc::now(),
                        service: SERVICE.into(),
                        reason: format!("dataset {}: {error}", accepted.dataset_path),
                    })
                    .await?;
                return Ok(());
            }
        };
        let body = serde_json::to_vec(&manifest)
            .map_err(|e| HandlerError::dead_letter(format!("cannot encode the manifest: {e}")))?;
        self.bus
            .put_object(ObjectStore::Datasets, &manifest.digest, &body)
            .await?;
        for row in &manifest.invalid_rows {
            tracing::warn!(run = %accepted.run_id, %row, "row left out");
        }
        self.bus
            .publish(&DatasetRegisteredV1 {
                run_id: accepted.run_id.clone(),
                digest: manifest.digest.clone(),
                source: manifest.source.clone(),
                train_tasks: count(manifest.train.len()),
                validation_tasks: count(manifest.validation.len()),
                invalid_rows: count(manifest.invalid_rows.len()),
                at: chrono::Utc::now(),
            })
            .await?;
        tracing::info!(run = %accepted.run_id, digest = %manifest.digest, train = manifest.train.len(), validation = manifest.validation.len(), "dataset registered");
        let ahead = spec.algorithm.max_staleness + 1;
        // A resumed run's first step is the one after its checkpoint.
        let first = spec.trainer.first_step() + 1;
        let last = (first + ahead - 1).min(accepted.total_steps);
        for step in first..=last {
            self.publish_batch(&accepted.run_id, &spec, &manifest, step)
                .await?;
        }
        Ok(())
    }

    async fn on_train_step(&self, delivery: Delivery) -> Result<(), HandlerError> {
        let trained = delivery.decode_train_step()?;
        let arl_runtime::RunContext { state, spec } =
            self.bus.run_context(trained.run_id()).await?;
        let next = trained.step() + 1 + spec.algorithm.max_staleness;
        if next > state.total_steps {
            return Ok(());
        }
        let manifest = self.manifest(&state).await?;
        self.publish_batch(trained.run_id(), &spec, &manifest, next)
            .await
    }

    async fn publish_batch(
        &self,
        run: &RunId,
        spec: &arl_schemas::spec::RunSpec,
        manifest: &DatasetManifestV1,
        step: u32,
    ) -> Result<(), HandlerError> {
        let train: Vec<String> = manifest
            .train
            .iter()
            .map(|id| id.as_str().to_owned())
            .collect();
        let ids = split::batch(
            &train,
            spec.data.seed,
            spec.data.train_batch_size as usize,
            step,
        );
        let batch = TaskBatchV1 {
            run_id: run.clone(),
            step,
            split: Split::Train,
            samples_per_task: spec.rollout.n,
            tasks: task_refs(manifest, ids.iter().map(String::as_str)),
        };
        self.bus.publish(&batch).await?;
        tracing::info!(run = %run, step, tasks = batch.tasks.len(), "task batch published");
        Ok(())
    }

    async fn manifest(
        &self,
        state: &RunStateV1,
    ) -> Result<std::sync::Arc<DatasetManifestV1>, HandlerError> {
        let Some(digest) = &state.dataset_digest else {
            // The controller folds `task.dataset` into the state; it may not have yet.
            return Err(HandlerError::retry(format!(
                "run {} has no registered dataset yet",
                state.run_id
            )));
        };
        read_manifest(&self.bus, digest).await
    }
}

async fn read_manifest(
    bus: &Bus,
    digest: &str,
) -> Result<std::sync::Arc<DatasetManifestV1>, HandlerError> {
    bus.dataset_manifest(digest)
        .await?
        .ok_or_else(|| HandlerError::dead_letter(format!("dataset {digest} is not registered")))
}

fn count(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// The batch entries of `ids`, in that order, from the manifest.
pub fn task_refs<'a>(
    manifest: &DatasetManifestV1,
    ids: impl Iterator<Item = &'a str>,
) -> Vec<TaskRef> {
    ids.filter_map(|id| manifest.tasks.iter().find(|t| t.task_id.as_str() == id))
        .map(|task| TaskRef {
            task_id: task.task_id.clone(),
            kind: task.kind,
            dataset_digest: manifest.digest.clone(),
            environment: task.environment.clone(),
        })
        .collect()
}
