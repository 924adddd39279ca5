//! Where the engine runs a policy's weights: on the CPU (the model core's block-format
//! decode kernels) or on a GPU (the CUDA backend: weights uploaded once per version and
//! frozen as bf16 for its products, every sequence's KV cache in blocks of one pool in
//! device memory, each step's next tokens drawn there: [`Logits`]).
//!
//! GPU memory is split once, when the first version is loaded: that version's weights,
//! room for one more version (a hot swap loads the new weights while requests finish on
//! the old), a workspace for one step's activations and logits, and the KV pool — the
//! rest of `--gpu-memory-utilization` of the card, or exactly `--kv-cache-memory`. The
//! engine admits requests to the pool's blocks ([`Runner::kv_room`]); the rest wait.
//!
//! The engine never mixes the two: a device is chosen at start (`--device`), every version
//! it serves is prepared for it ([`Device::prepare`]) and every cache is made by the
//! version that fills it.

use arl_model::backend::{Backend, BackendError};
use std::borrow::Cow;
use std::sync::{Arc, Mutex, PoisonError};

use arl_model::backend::BackendErrorKind;
use arl_model::config::ModelConfig;
use arl_model::cuda::{Cuda, CudaError, GpuBuf, KvPool, Pick, Picked};
use arl_model::handoff::{DeviceWeights, Listener};
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

/// How a GPU's memory is shared out (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GpuMemory {
    /// The fraction of the card's memory the engine may use in all, as vLLM's
    /// `--gpu-memory-utilization` (what other processes hold counts against it).
    pub utilization: f64,
    /// The KV pool's size in bytes, whatever the rest comes to.
    pub kv_cache_bytes: Option<usize>,
    /// Sequences decoded together and prompt tokens a step feeds: the workspace's size.
    pub max_batch: usize,
    pub prefill_chunk: usize,
}

impl Default for GpuMemory {
    fn default() -> Self {
        Self {
            utilization: 0.9,
            kv_cache_bytes: None,
            max_batch: 16,
            prefill_chunk: 256,
        }
    }
}

/// An opened device (cheap to clone; clones share the KV pool).
#[derive(Clone, Debug, Default)]
pub enum Device {
    #[default]
    Cpu,
    Cuda {
        gpu: Cuda,
        memory: GpuMemory,
        /// The engine's KV pool, made and sized when the first version is prepared.
        pool: Arc<Mutex<Option<Arc<KvPool>>>>,
    },
}

impl Device {
    /// Opens the device `--device` names; `gpu` is the ordinal for cuda, `memory` how its
    /// memory is shared out.
    pub fn open(kind: DeviceKind, gpu: usize, memory: GpuMemory) -> Result<Self, CudaError> {
        match kind {
            DeviceKind::Cpu => Ok(Device::Cpu),
            DeviceKind::Cuda => Cuda::new(gpu).map(|gpu| Device::cuda(gpu, memory)),
        }
    }

    /// An opened GPU whose memory is shared out as `memory` says.
    pub fn cuda(gpu: Cuda, memory: GpuMemory) -> Self {
        Device::Cuda {
            gpu,
            memory,
            pool: Arc::default(),
        }
    }

    /// How this engine listens for versions handed over in this process.
    pub fn listener(&self) -> Listener {
        match self {
            Device::Cpu => Listener::Cpu,
            Device::Cuda { gpu, .. } => Listener::Gpu(gpu.info().ordinal),
        }
    }

    pub fn name(&self) -> String {
        match self {
            Device::Cpu => "cpu".into(),
            Device::Cuda { gpu, .. } => format!("cuda ({})", gpu.info().name),
        }
    }

    /// `loaded`'s weights as this device runs them: the CPU runs the loaded model itself;
    /// a GPU gets a copy in its memory (an upload failure, such as too little memory,
    /// is the error) — copied device to device from `on_gpu` when that is a buffer of this
    /// process on the same GPU (a version the trainer of this process handed over:
    /// [`arl_model::handoff`]), else uploaded.
    pub fn prepare(
        &self,
        loaded: &LoadedModel,
        on_gpu: Option<&DeviceWeights>,
    ) -> Result<Runner, BackendError> {
        match self {
            Device::Cpu => Ok(Runner::Cpu),
            Device::Cuda { gpu, memory, pool } => {
                let free_before = free_memory(gpu)?;
                let mut model = match on_gpu {
                    Some(handed) if handed.ordinal == gpu.info().ordinal => Model::on_backend(
                        loaded.model.config.clone(),
                        handed.weights.map(|t| gpu.copy_of(&t.data)),
                        gpu.clone(),
                    ),
                    _ => loaded.model.to_backend(gpu.clone()),
                };
                model.freeze();
                model.backend.check()?;
                let version_bytes = free_before.saturating_sub(free_memory(gpu)?);
                let (layers, kv_dim) = (model.config.num_hidden_layers, model.config.kv_dim());
                let mut slot = pool.lock().unwrap_or_else(PoisonError::into_inner);
                let pool = match &*slot {
                    Some(pool) if pool.fits(layers, kv_dim) => pool.clone(),
                    _ => {
                        // The first version (or one of another shape) sizes the pool.
                        let pool = gpu.new_kv_pool(layers, kv_dim);
                        size_pool(gpu, &pool, memory, &model.config, version_bytes)?;
                        *slot = Some(pool.clone());
                        pool
                    }
                };
                drop(slot);
                model.backend = gpu.with_kv_pool(pool.clone());
                Ok(Runner::Cuda {
                    model: Box::new(model),
                    pool,
                })
            }
        }
    }
}

fn free_memory(gpu: &Cuda) -> Result<usize, BackendError> {
    gpu.memory()
        .map(|(free, _)| free)
        .map_err(BackendError::from)
}

/// Allocates the KV pool's blocks: `--kv-cache-memory`, or what `--gpu-memory-utilization`
/// leaves after what is in use (this version), one more version and the workspace.
fn size_pool(
    gpu: &Cuda,
    pool: &KvPool,
    memory: &GpuMemory,
    config: &ModelConfig,
    version_bytes: usize,
) -> Result<(), BackendError> {
    let (free, total) = gpu.memory().map_err(BackendError::from)?;
    let workspace = workspace_bytes(config, memory);
    let bytes = match memory.kv_cache_bytes {
        Some(bytes) => bytes,
        None => {
            let allowed = (memory.utilization * total as f64) as usize;
            let in_use = total - free;
            allowed
                .saturating_sub(in_use)
                .saturating_sub(version_bytes)
                .saturating_sub(workspace)
        }
    };
    let blocks = bytes / pool.block_bytes();
    let tokens = blocks * pool.block_tokens();
    if tokens == 0 {
        return Err(BackendError {
            kind: BackendErrorKind::OutOfMemory,
            message: format!(
                "no GPU memory is left for the KV cache ({} MiB free of {} MiB, {} MiB per version, a {} MiB workspace); raise --gpu-memory-utilization, set --kv-cache-memory, or lower --max-batch / --prefill-chunk",
                free >> 20,
                total >> 20,
                version_bytes >> 20,
                workspace >> 20
            ),
        });
    }
    pool.reserve(blocks).map_err(BackendError::from)?;
    tracing::info!(
        kv_cache_mib = (blocks * pool.block_bytes()) >> 20,
        kv_cache_tokens = tokens,
        version_mib = version_bytes >> 20,
        workspace_mib = workspace >> 20,
        "GPU KV cache allocated"
    );
    Ok(())
}

/// A step's activations at its widest (every sequence decoding plus a prefill chunk), its
/// logits, bf16 copies of its inputs, twice over for what the allocator holds back, and
/// 256 MiB for cuBLAS and the kernels' tables.
fn workspace_bytes(config: &ModelConfig, memory: &GpuMemory) -> usize {
    let rows = memory.max_batch + memory.prefill_chunk;
    let (c, i) = (config.hidden_size, config.intermediate_size);
    let per_row = 5 * c + 3 * config.q_dim() + 4 * config.kv_dim() + 4 * i;
    let logits = memory.max_batch * config.vocab_size;
    // A graphed decode step's arena keeps every layer's bf16 product inputs (nothing in
    // it is freed during the step).
    let graph_arena = config.num_hidden_layers
        * memory.max_batch
        * (2 * c + config.q_dim() + i)
        * size_of::<u16>();
    2 * (rows * per_row + logits) * size_of::<f32>() + graph_arena + (256 << 20)
}

/// One version's weights where the engine runs them.
#[derive(Debug)]
pub enum Runner {
    /// The loaded (host) model itself.
    Cpu,
    /// On a GPU, with the block pool its caches take from.
    Cuda {
        model: Box<Model<Cuda>>,
        pool: Arc<KvPool>,
    },
}

/// A GPU version's KV pool: how many positions a block holds and how many blocks there are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvRoom {
    pub block_tokens: usize,
    pub blocks: usize,
}

impl KvRoom {
    /// Blocks holding `tokens` positions.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_tokens)
    }
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
            Runner::Cuda { model, .. } => Cache::Cuda(KvCache::new(model)),
        }
    }

    /// The KV pool requests are admitted to; None on the CPU (caches grow as needed and
    /// `--max-batch` bounds them).
    pub fn kv_room(&self) -> Option<KvRoom> {
        match self {
            Runner::Cpu => None,
            Runner::Cuda { pool, .. } => Some(KvRoom {
                block_tokens: pool.block_tokens(),
                blocks: pool.capacity_blocks().unwrap_or(0),
            }),
        }
    }

    /// Blocks the pool has free now (None on the CPU).
    pub fn kv_free_blocks(&self) -> Option<usize> {
        match self {
            Runner::Cpu => None,
            Runner::Cuda { pool, .. } => Some(pool.free_blocks()),
        }
    }

    /// Blocks feeding `count` more tokens to `cache` would take from the pool (0 on the CPU).
    pub fn blocks_to_feed(cache: &Cache, count: usize) -> usize {
        match cache {
            Cache::Cpu(_) => 0,
            Cache::Cuda(cache) => cache.kv.blocks_to_write(cache.len, count),
        }
    }

    /// Forgets everything in `cache` after its first `len` positions.
    pub fn truncate(&self, host: &Model, cache: &mut Cache, len: usize) {
        match (self, cache) {
            (Runner::Cpu, Cache::Cpu(cache)) => cache.truncate(host, len),
            (Runner::Cuda { model, .. }, Cache::Cuda(cache)) => cache.truncate(model, len),
            // A cache from another device is never truncated by this version: the engine
            // makes every cache with the version that fills it (see `forward`).
            _ => {}
        }
    }

    /// One forward pass over a batch of sequences (new tokens and their caches): the
    /// logits after each one's last new token, a row per sequence in the batch's order. A
    /// device failure (out of memory, a driver error) is the error; the caches it touched
    /// are then not to be used again.
    pub fn forward(
        &self,
        host: &Model,
        batch: Vec<(&[u32], &mut Cache)>,
    ) -> Result<Logits, BackendError> {
        match self {
            Runner::Cpu => {
                let mut inputs = inputs(batch, |cache| match cache {
                    Cache::Cpu(cache) => Some(cache),
                    Cache::Cuda(_) => None,
                })?;
                Ok(Logits::Host(host.forward(&mut inputs)))
            }
            Runner::Cuda { model, .. } => {
                let mut inputs = inputs(batch, |cache| match cache {
                    Cache::Cuda(cache) => Some(cache),
                    Cache::Cpu(_) => None,
                })?;
                let rows = model.forward_logits(&mut inputs);
                model.backend.check()?;
                Ok(Logits::Cuda {
                    backend: model.backend.clone(),
                    rows,
                    vocab: model.config.vocab_size,
                })
            }
        }
    }
}

/// A forward pass's logits, a row per sequence: on the host, or left on the GPU, where the
/// engine's draws are made and only what they drew comes back.
pub enum Logits {
    Host(Vec<Vec<f32>>),
    Cuda {
        backend: Cuda,
        rows: GpuBuf,
        vocab: usize,
    },
}

impl Logits {
    /// Whether draws from these rows can be made where they are ([`Logits::draw`]).
    pub fn on_device(&self) -> bool {
        matches!(self, Logits::Cuda { .. })
    }

    /// Makes `picks` on the device (only for [`Logits::on_device`] rows).
    pub fn draw(&self, picks: &[Pick]) -> Result<Vec<Picked>, BackendError> {
        match self {
            Logits::Cuda {
                backend,
                rows,
                vocab,
            } => Ok(backend.sample_rows(rows, *vocab, picks)?),
            Logits::Host(_) => Err(BackendError {
                kind: BackendErrorKind::Device,
                message: "host logits were sent to the device for sampling (a bug)".into(),
            }),
        }
    }

    /// Row `row` on the host (copied from the GPU when it is there).
    pub fn row(&self, row: usize) -> Result<Cow<'_, [f32]>, BackendError> {
        match self {
            Logits::Host(rows) => Ok(Cow::Borrowed(&rows[row])),
            Logits::Cuda {
                backend,
                rows,
                vocab,
            } => Ok(Cow::Owned(backend.download_row(rows, *vocab, row)?)),
        }
    }
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
                    kind: BackendErrorKind::Device,
                    message: "a KV cache from another device reached this version (a bug)".into(),
                })
        })
        .collect()
}
