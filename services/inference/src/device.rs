//! Where the engine runs a policy's weights: on the CPU (the model core's block-format
//! decode kernels) or on a GPU (the CUDA backend: weights uploaded once per version and
//! frozen as bf16 for its products, every sequence's KV cache in device memory, logits
//! brought back for sampling).
//!
//! The engine never mixes the two: a device is chosen at start (`--device`), every version
//! it serves is prepared for it ([`Device::prepare`]) and every cache is made by the
//! version that fills it.

use arl_model::backend::{Backend, BackendError};
use arl_model::cuda::{Cuda, CudaError};
use arl_model::load::LoadedModel;
use arl_model::model::{KvCache, Model, SeqInput};
use arl_model::ops::Cpu;

/// `--device`: what runs the model.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum DeviceKind {
    /// The CPU kernels (threads sized by `--threads`).
    #[default]
    Cpu,
    /// One NVIDIA GPU (`--gpu`), through the CUDA backend.
    Cuda,
}

/// An opened device (cheap to clone).
#[derive(Clone, Debug, Default)]
pub enum Device {
    #[default]
    Cpu,
    Cuda(Cuda),
}

impl Device {
    /// Opens the device `--device` names; `gpu` is the ordinal for cuda.
    pub fn open(kind: DeviceKind, gpu: usize) -> Result<Self, CudaError> {
        match kind {
            DeviceKind::Cpu => Ok(Device::Cpu),
            DeviceKind::Cuda => Cuda::new(gpu).map(Device::Cuda),
        }
    }

    pub fn name(&self) -> String {
        match self {
            Device::Cpu => "cpu".into(),
            Device::Cuda(gpu) => format!("cuda ({})", gpu.info().name),
        }
    }

    /// `loaded`'s weights as this device runs them: the CPU runs the loaded model itself;
    /// a GPU gets a copy in its memory (an upload failure, such as too little memory,
    /// is the error).
    pub fn prepare(&self, loaded: &LoadedModel) -> Result<Runner, BackendError> {
        match self {
            Device::Cpu => Ok(Runner::Cpu),
            Device::Cuda(gpu) => {
                let mut model = loaded.model.to_backend(gpu.clone());
                model.freeze();
                model.backend.check()?;
                Ok(Runner::Cuda(Box::new(model)))
            }
        }
    }
}

/// One version's weights where the engine runs them.
#[derive(Debug)]
pub enum Runner {
    /// The loaded (host) model itself.
    Cpu,
    Cuda(Box<Model<Cuda>>),
}

/// A sequence's KV cache, on the device of the version that filled it.
#[derive(Clone, Debug)]
pub enum Cache {
    Cpu(KvCache<Cpu>),
    Cuda(KvCache<Cuda>),
}

impl Runner {
    /// An empty cache for this version.
    pub fn new_cache(&self, host: &Model) -> Cache {
        match self {
            Runner::Cpu => Cache::Cpu(KvCache::new(host)),
            Runner::Cuda(model) => Cache::Cuda(KvCache::new(model)),
        }
    }

    /// Forgets everything in `cache` after its first `len` positions.
    pub fn truncate(&self, host: &Model, cache: &mut Cache, len: usize) {
        match (self, cache) {
            (Runner::Cpu, Cache::Cpu(cache)) => cache.truncate(host, len),
            (Runner::Cuda(model), Cache::Cuda(cache)) => cache.truncate(model, len),
            // A cache from another device is never truncated by this version: the engine
            // makes every cache with the version that fills it (see `forward`).
            _ => {}
        }
    }

    /// One forward pass over a batch of sequences (new tokens and their caches): the
    /// logits after each one's last new token. A device failure (out of memory, a driver
    /// error) is the error; the caches it touched are then not to be used again.
    pub fn forward(
        &self,
        host: &Model,
        batch: Vec<(&[u32], &mut Cache)>,
    ) -> Result<Vec<Vec<f32>>, BackendError> {
        match self {
            Runner::Cpu => {
                let inputs = inputs(batch, |cache| match cache {
                    Cache::Cpu(cache) => Some(cache),
                    Cache::Cuda(_) => None,
                })?;
                Ok(run(host, inputs))
            }
            Runner::Cuda(model) => {
                let inputs = inputs(batch, |cache| match cache {
                    Cache::Cuda(cache) => Some(cache),
                    Cache::Cpu(_) => None,
                })?;
                let logits = run(model, inputs);
                model.backend.check()?;
                Ok(logits)
            }
        }
    }
}

fn run<B: Backend>(model: &Model<B>, mut inputs: Vec<SeqInput<'_, B>>) -> Vec<Vec<f32>> {
    model.forward(&mut inputs)
}

/// The batch as the model takes it, every cache on `B`'s device.
fn inputs<'a, B: Backend>(
    batch: Vec<(&'a [u32], &'a mut Cache)>,
    on_device: impl Fn(&'a mut Cache) -> Option<&'a mut KvCache<B>>,
) -> Result<Vec<SeqInput<'a, B>>, BackendError> {
    batch
        .into_iter()
        .map(|(tokens, cache)| {
            on_device(cache)
                .map(|cache| SeqInput { tokens, cache })
                .ok_or_else(|| BackendError {
                    kind: arl_model::backend::BackendErrorKind::Device,
                    message: "a KV cache from another device reached this version (a bug)".into(),
                })
        })
        .collect()
}
