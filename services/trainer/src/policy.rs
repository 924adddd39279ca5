//! The policy a run trains, on the device its spec names: the model, its reference copy
//! (for the KL term) and AdamW's state, on the CPU backend or on a GPU (the CUDA backend,
//! f32 master weights and moments in device memory, bf16 matrix products).
//!
//! Only this module knows which backend a run uses; the step (`step.rs`) is generic over
//! the backend, and versions on disk are the same Hugging Face folders either way (bf16
//! weights from a GPU, with the f32 master copy in checkpoints).

use std::path::{Path, PathBuf};

use arl_model::backend::{Backend, BackendError};
use arl_model::cuda::Cuda;
use arl_model::handoff::{self, DeviceWeights, HandedVersion, Listener, VersionKey};
use arl_model::load::LoadedModel;
use arl_model::model::Model;
use arl_model::ops::Cpu;
use arl_model::train::AdamW;
use arl_model::weights::{StoredDtype, Weights};
use arl_schemas::spec::Device;

use crate::checkpoint::{self, Moments, TrainerState};
use crate::step::{Sample, StepConfig, StepMetrics, train_step};

/// Why a run's policy could not be opened or saved.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    #[error(transparent)]
    Load(#[from] arl_model::load::LoadError),
    #[error(transparent)]
    Checkpoint(#[from] checkpoint::CheckpointError),
    #[error("trainer.device = \"cuda\", but this trainer has no usable GPU: {0}")]
    NoGpu(String),
    /// The GPU failed (out of memory, a driver error) while `doing`.
    #[error("{doing}: {source}")]
    Device {
        doing: &'static str,
        #[source]
        source: BackendError,
    },
}

/// What a run needs opened: where its base model is and how it trains.
#[derive(Clone, Debug)]
pub struct OpenSpec {
    pub base: PathBuf,
    pub device: Device,
    pub weight_decay: f32,
    pub with_reference: bool,
}

/// A run's model, reference and optimizer on one backend.
struct OnBackend<B: Backend> {
    model: Model<B>,
    reference: Option<Model<B>>,
    optimizer: AdamW<B>,
}

// One per open run: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
enum Engine {
    /// The weights are `Policy::loaded`'s own.
    Cpu {
        reference: Option<Model>,
        optimizer: AdamW<Cpu>,
    },
    Cuda(OnBackend<Cuda>),
}

pub struct Policy {
    /// Tokenizer, chat template and config for saving versions. On the CPU it also holds
    /// the trained weights; on a GPU its weights are refreshed from the device on save.
    loaded: LoadedModel,
    engine: Engine,
}

impl Policy {
    /// Opens the run's model: from checkpoint `resume` when given, else from the base; on
    /// the GPU `gpu` when the run's device is `cuda`.
    pub fn open(
        spec: &OpenSpec,
        resume: Option<(&Path, &TrainerState)>,
        gpu: Result<&Cuda, &str>,
    ) -> Result<Self, PolicyError> {
        let mut loaded = match resume {
            Some((dir, _)) => LoadedModel::open(dir),
            None => LoadedModel::open(&spec.base),
        }?;
        let mut moments = None;
        if let Some((dir, state)) = resume {
            let resumed = checkpoint::load_resume(dir, &loaded, state)?;
            if let Some(master) = resumed.master {
                *loaded.model.weights_mut() = master;
            }
            moments = Some((resumed.m, resumed.v, resumed.step));
        }
        let reference = if spec.with_reference {
            Some(LoadedModel::open(&spec.base)?.model)
        } else {
            None
        };
        let engine = match spec.device {
            Device::Cpu => Engine::Cpu {
                optimizer: optimizer(&loaded.model, moments, spec.weight_decay, |w| w),
                reference,
            },
            Device::Cuda => {
                let gpu = gpu.map_err(|why| PolicyError::NoGpu(why.to_owned()))?;
                let model = loaded.model.to_backend(gpu.clone());
                let optimizer = optimizer(&model, moments, spec.weight_decay, |w| {
                    w.map(|t| gpu.upload(&t.data))
                });
                let on_gpu = OnBackend {
                    reference: reference.map(|r| r.to_backend(gpu.clone())),
                    model,
                    optimizer,
                };
                on_gpu
                    .model
                    .backend
                    .check()
                    .map_err(|source| PolicyError::Device {
                        doing: "putting the model on the GPU",
                        source,
                    })?;
                Engine::Cuda(on_gpu)
            }
        };
        Ok(Self { loaded, engine })
    }

    /// One GRPO step; a device failure (out of memory, a driver error) is an error naming
    /// it, after which the in-memory policy must not be trusted (the caller reopens, or
    /// fails the run when retrying cannot help).
    pub fn train(
        &mut self,
        samples: &[Sample],
        config: &StepConfig,
        lr: f32,
    ) -> Result<StepMetrics, BackendError> {
        match &mut self.engine {
            Engine::Cpu {
                reference,
                optimizer,
            } => Ok(train_step(
                &mut self.loaded.model,
                reference.as_ref(),
                optimizer,
                samples,
                config,
                lr,
            )),
            Engine::Cuda(p) => {
                let metrics = train_step(
                    &mut p.model,
                    p.reference.as_ref(),
                    &mut p.optimizer,
                    samples,
                    config,
                    lr,
                );
                p.model.backend.check().map_err(|e| BackendError {
                    message: format!("the GPU step failed: {}", e.message),
                    ..e
                })?;
                Ok(metrics)
            }
        }
    }

    /// Writes this version (with the optimizer state when `with_optimizer`).
    pub fn save(
        &mut self,
        run_dir: &Path,
        state: &TrainerState,
        with_optimizer: bool,
    ) -> Result<checkpoint::Saved, PolicyError> {
        let saved = match &self.engine {
            Engine::Cpu { optimizer, .. } => {
                let moments = with_optimizer.then_some(Moments {
                    m: &optimizer.m,
                    v: &optimizer.v,
                    step: optimizer.step,
                });
                checkpoint::save(run_dir, &self.loaded, moments, state, StoredDtype::F32)
            }
            Engine::Cuda(p) => {
                let be = &p.model.backend;
                let download =
                    |w: &Weights<<Cuda as Backend>::Buf>| w.map(|t| be.download(&t.data));
                *self.loaded.model.weights_mut() = p.model.host_weights();
                let moments =
                    with_optimizer.then(|| (download(&p.optimizer.m), download(&p.optimizer.v)));
                be.check().map_err(|source| PolicyError::Device {
                    doing: "reading the weights off the GPU",
                    source,
                })?;
                let moments = moments.as_ref().map(|(m, v)| Moments {
                    m,
                    v,
                    step: p.optimizer.step,
                });
                checkpoint::save(run_dir, &self.loaded, moments, state, StoredDtype::Bf16)
            }
        }?;
        Ok(saved)
    }
}

impl Policy {
    /// The version [`Self::save`] just wrote, for engines of this process that listen
    /// ([`handoff`]): the weights as stored (f32 from the CPU, bf16 values from a GPU) and,
    /// for an engine on the same GPU, a device copy of them. None when no engine listens;
    /// a failure to make the device copy is an error (the caller logs it, and engines read
    /// the file as any other would).
    pub fn hand_off(&self, key: VersionKey) -> Result<Option<HandedVersion>, PolicyError> {
        let listeners = handoff::listeners();
        if listeners.is_empty() {
            return Ok(None);
        }
        let (dtype, device) = match &self.engine {
            Engine::Cpu { .. } => (StoredDtype::F32, None),
            Engine::Cuda(p) => {
                let be = &p.model.backend;
                let ordinal = be.info().ordinal;
                let device = listeners
                    .contains(&Listener::Gpu(ordinal))
                    .then(|| DeviceWeights {
                        ordinal,
                        weights: p.model.weights().map(|t| be.rounded_to_bf16(&t.data)),
                    });
                // The engine copies it on its own stream: it must be whole first.
                be.check().map_err(|source| PolicyError::Device {
                    doing: "copying the weights for this process's engine",
                    source,
                })?;
                (StoredDtype::Bf16, device)
            }
        };
        let source = format!(
            "run {} version {}, handed over by this process's trainer",
            key.run_id, key.policy_version
        );
        Ok(Some(HandedVersion {
            model: self.loaded.as_stored(dtype, source),
            device,
            key,
        }))
    }
}

/// AdamW for `model`, with the moments of a checkpoint (moved to the backend by `place`).
fn optimizer<B: Backend>(
    model: &Model<B>,
    moments: Option<(Weights, Weights, u64)>,
    weight_decay: f32,
    place: impl Fn(Weights) -> Weights<B::Buf>,
) -> AdamW<B> {
    let mut optimizer = AdamW::new(model, weight_decay);
    if let Some((m, v, step)) = moments {
        optimizer.m = place(m);
        optimizer.v = place(v);
        optimizer.step = step;
    }
    optimizer
}
