//! The image builder service: for every task of every `task.batch`, make sure its
//! environment exists, then say so (`image.ready`, with the location and whether it was
//! cached) or say why not (`image.failed`, with a reason and the build log's tail). A build
//! failure is reported once and not retried; only bus trouble is.
//!
//! In cluster mode an image found in the registry is ready as it is; a missing one is built
//! from a context written under the contexts folder — by `buildctl` against a buildkitd
//! ([`Builds::Buildctl`]) or by a Kubernetes Job ([`Builds::Jobs`]) — and reported with the
//! digest the registry then names for it (`…:latest@sha256:…`).

use std::path::PathBuf;
use std::sync::Arc;

use arl_runtime::consumer::run_consumer;
use arl_runtime::{Bus, ConsumerSpec, Delivery, HandlerError, Shutdown};
use arl_schemas::RunId;
use arl_schemas::events::{
    EnvironmentLocation, ImageFailedV1, ImageFailureReason, ImageReadyV1, TaskBatchV1, TaskKind,
    TaskRef,
};

use crate::buildkit::{BuildKit, prepare_context};
use crate::jobs::{JobBuild, JobBuildError, JobBuilds, build_name};
use crate::local::{BuildError, LocalBuilder};
pub use crate::recipe::Recipes;
use crate::recipe::{Recipe, SweTask};
use crate::registry::Registry;

/// Cluster mode: environments are OCI images in a registry, built by BuildKit when missing.
#[derive(Clone, Debug)]
pub struct Cluster {
    pub registry: Registry,
    pub builds: Builds,
    /// Where build contexts are written (with [`Builds::Jobs`], the root of the volume the
    /// Jobs mount).
    pub contexts: PathBuf,
}

/// Who runs BuildKit for a missing image.
#[derive(Clone, Debug)]
pub enum Builds {
    /// `buildctl` here, against a buildkitd.
    Buildctl(BuildKit),
    /// A Kubernetes Job per build, rootless BuildKit in the pod.
    Jobs(Arc<JobBuilds>),
}

pub struct ImageBuilder {
    bus: Bus,
    local: Arc<LocalBuilder>,
    recipes: Recipes,
    cluster: Option<Cluster>,
    /// Local snapshots beyond this many bytes are collected, least recently used first.
    cache_limit: Option<u64>,
}

/// A ready environment, local or in the registry.
struct Ready {
    location: EnvironmentLocation,
    cached: bool,
}

/// Why a task has no environment.
struct Failure {
    reason: ImageFailureReason,
    message: String,
    log_tail: String,
}

impl ImageBuilder {
    pub fn new(bus: Bus, local: Arc<LocalBuilder>, recipes: Recipes) -> Self {
        Self {
            bus,
            local,
            recipes,
            cluster: None,
            cache_limit: None,
        }
    }

    pub fn with_cache_limit(mut self, bytes: u64) -> Self {
        self.cache_limit = Some(bytes);
        self
    }

    /// Builds registry images instead of local snapshots.
    pub fn with_cluster(mut self, cluster: Cluster) -> Self {
        self.cluster = Some(cluster);
        self
    }

    pub fn start(self, shutdown: &Shutdown) {
        let ns = self.bus.namespace();
        let mut spec = ConsumerSpec::for_event::<TaskBatchV1>(ns, "imagebuilder");
        // A cold build takes minutes: keep the batch alive while it runs.
        spec.keep_alive = true;
        spec.concurrency = 4;
        let bus = self.bus.clone();
        let builder = Arc::new(self);
        shutdown.spawn(run_consumer(
            bus,
            spec,
            move |delivery: Delivery| {
                let builder = builder.clone();
                async move { builder.on_batch(delivery).await }
            },
            shutdown.clone(),
        ));
    }

    async fn on_batch(&self, delivery: Delivery) -> Result<(), HandlerError> {
        let batch: TaskBatchV1 = delivery.decode()?;
        let dataset = if batch.tasks.iter().any(|t| t.kind == TaskKind::Harbor) {
            self.dataset_path(&batch.run_id).await?
        } else {
            None
        };
        // Math tasks run in a generic sandbox: nothing to build, nothing to announce.
        for task in batch.tasks.iter().filter(|t| t.kind != TaskKind::Math) {
            let started = std::time::Instant::now();
            // A SWE-bench instance is built from its row (its commit must be a recorded
            // recipe's, where there is one).
            let manifest = if task.kind == TaskKind::Swebench {
                self.bus.dataset_manifest(&task.dataset_digest).await?
            } else {
                None
            };
            let row = manifest
                .as_ref()
                .and_then(|m| m.task(&task.task_id))
                .and_then(SweTask::of);
            let outcome = match self.recipe(task, dataset.as_ref(), row) {
                Ok(recipe) => match &self.cluster {
                    Some(cluster) => {
                        self.ensure_image(cluster, &recipe, &batch.run_id, task)
                            .await
                    }
                    None => self
                        .local
                        .ensure(&recipe)
                        .await
                        .map_err(failure)
                        .map(|built| Ready {
                            location: EnvironmentLocation::LocalSnapshot {
                                path: built.dir.display().to_string(),
                            },
                            cached: built.cached,
                        }),
                },
                Err(failure) => Err(failure),
            };
            let at = chrono::Utc::now();
            match outcome {
                Ok(ready) => {
                    self.bus
                        .publish(&ImageReadyV1 {
                            run_id: batch.run_id.clone(),
                            task_id: task.task_id.clone(),
                            environment: task.environment.clone(),
                            location: ready.location,
                            cached: ready.cached,
                            build_seconds: started.elapsed().as_secs_f64(),
                            at,
                        })
                        .await?;
                }
                Err(failure) => {
                    tracing::warn!(task = %task.task_id, reason = ?failure.reason, message = %failure.message, "environment failed");
                    self.bus
                        .publish(&ImageFailedV1 {
                            run_id: batch.run_id.clone(),
                            task_id: task.task_id.clone(),
                            environment: task.environment.clone(),
                            reason: failure.reason,
                            message: failure.message,
                            log_tail: failure.log_tail,
                            at,
                        })
                        .await?;
                }
            }
        }
        if let (Some(limit), None) = (self.cache_limit, &self.cluster) {
            match self.local.collect_garbage(limit).await {
                Ok(removed) if !removed.is_empty() => {
                    tracing::info!(
                        ?removed,
                        "environments collected to stay under the cache limit"
                    );
                }
                Ok(_) => {}
                Err(err) => tracing::warn!(error = %err, "garbage collection failed"),
            }
        }
        Ok(())
    }

    /// The recipe's image: found in the registry, or built and pushed by BuildKit.
    async fn ensure_image(
        &self,
        cluster: &Cluster,
        recipe: &Recipe,
        run: &RunId,
        task: &TaskRef,
    ) -> Result<Ready, Failure> {
        let instance = recipe.name.rsplit('/').next().unwrap_or(&recipe.name);
        let registry_failure = |e: crate::registry::RegistryError| Failure {
            reason: ImageFailureReason::RegistryError,
            message: e.to_string(),
            log_tail: String::new(),
        };
        let reference = cluster.registry.reference(instance);
        let pinned = |digest: String| EnvironmentLocation::OciImage {
            reference: if digest.is_empty() {
                reference.clone()
            } else {
                format!("{reference}@{digest}")
            },
        };
        if let Some(digest) = cluster
            .registry
            .manifest_digest(instance)
            .await
            .map_err(registry_failure)?
        {
            return Ok(Ready {
                location: pinned(digest),
                cached: true,
            });
        }
        let build_failure = |e: crate::buildkit::BuildKitError| Failure {
            reason: ImageFailureReason::BuildError,
            message: e.to_string(),
            log_tail: String::new(),
        };
        match &cluster.builds {
            Builds::Buildctl(buildkit) => {
                let context = cluster.contexts.join(recipe.name.replace('/', "_"));
                let _ = std::fs::remove_dir_all(&context);
                prepare_context(recipe, &self.recipes.pyenv_root, &context)
                    .map_err(build_failure)?;
                buildkit
                    .build(&context, &reference)
                    .await
                    .map_err(build_failure)?;
            }
            Builds::Jobs(jobs) => {
                // The build's name is its Job's and its context folder's: the Job mounts
                // that folder of the contexts volume.
                let name = build_name(instance);
                let context = cluster.contexts.join(&name);
                prepare_context(recipe, &self.recipes.pyenv_root, &context)
                    .map_err(build_failure)?;
                let built = jobs
                    .build(&JobBuild {
                        name: &name,
                        reference: &reference,
                        run,
                        task: &task.task_id,
                    })
                    .await;
                // A failed build's context stays with its Job when failed Jobs are kept.
                if (built.is_ok() || !jobs.config().keep_failed)
                    && let Err(e) = std::fs::remove_dir_all(&context)
                {
                    tracing::warn!(context = %context.display(), error = %e, "build context not removed");
                }
                built.map_err(job_failure)?;
            }
        }
        let digest = cluster
            .registry
            .manifest_digest(instance)
            .await
            .map_err(registry_failure)?
            .ok_or_else(|| Failure {
                reason: ImageFailureReason::RegistryError,
                message: format!("BuildKit pushed {reference}, but the registry does not have it"),
                log_tail: String::new(),
            })?;
        Ok(Ready {
            location: pinned(digest),
            cached: false,
        })
    }

    /// The run's dataset location (Harbor task folders live under it), from its state:
    /// a run without one is waited for, then given up (`HandlerError::RunGone`).
    async fn dataset_path(&self, run: &RunId) -> Result<Option<PathBuf>, HandlerError> {
        let state = self
            .bus
            .run_state(run)
            .await?
            .ok_or_else(|| HandlerError::RunGone {
                run: run.clone(),
                reason: format!("run {run} has no state (not written yet, or deleted mid-run)"),
            })?;
        Ok(state.dataset_path.map(PathBuf::from))
    }

    fn recipe(
        &self,
        task: &TaskRef,
        dataset: Option<&PathBuf>,
        row: Option<SweTask<'_>>,
    ) -> Result<Recipe, Failure> {
        self.recipes
            .recipe(
                task.kind,
                &task.environment.name,
                dataset.map(PathBuf::as_path),
                row,
            )
            .map_err(|e| Failure {
                reason: ImageFailureReason::InstallError,
                message: e.to_string(),
                log_tail: String::new(),
            })
    }
}

fn failure(error: BuildError) -> Failure {
    let (reason, log_tail) = match &error {
        BuildError::InterpreterMissing { .. } => {
            (ImageFailureReason::InterpreterMissing, String::new())
        }
        BuildError::MissingCommit(tail) => (ImageFailureReason::MissingCommit, tail.clone()),
        BuildError::InstallError { tail, .. } => (ImageFailureReason::InstallError, tail.clone()),
        BuildError::Timeout(_, tail) => (ImageFailureReason::Timeout, tail.clone()),
        BuildError::Io(_) | BuildError::SystemPackages(_) => {
            (ImageFailureReason::InstallError, String::new())
        }
    };
    Failure {
        reason,
        message: error.to_string(),
        log_tail,
    }
}

fn job_failure(error: JobBuildError) -> Failure {
    let reason = match &error {
        JobBuildError::Timeout { .. } => ImageFailureReason::Timeout,
        JobBuildError::Failed { .. }
        | JobBuildError::NotStarted { .. }
        | JobBuildError::Forbidden { .. }
        | JobBuildError::Api { .. } => ImageFailureReason::BuildError,
    };
    Failure {
        reason,
        log_tail: error.log_tail().to_owned(),
        message: error.to_string(),
    }
}
