//! The CUDA backend (cudarc): every kernel of the [`Backend`] boundary on an NVIDIA GPU.
//!
//! - Buffers are f32 in device memory ([`GpuBuf`]); parameters, gradients and AdamW moments
//!   stay f32 (the master copy), reductions (RMSNorm, softmax, log-probabilities) run in f32.
//! - Matrix products convert their operands to bf16 and run on cuBLAS with f32 accumulation
//!   (`gemm.rs`); the gradient that flows back to earlier layers keeps 16 significant bits
//!   (two bf16 parts, one more product), because its rounding compounds layer after layer.
//!   The vocabulary head works in chunks of rows, so (N, V) logits never exist.
//! - Kernels are CUDA C (`kernels.cu`) compiled by NVRTC when the device is opened.
//! - Everything is ordered on one stream. The trait's kernels return nothing, so a failure
//!   (out of memory, a driver error) is kept as the device's first fault; later work is
//!   skipped until [`Backend::check`] reports (and clears) it — the caller fails the step
//!   with the cause and reloads what the step was changing.
//!
//! `unsafe` is allowed in this module only: kernel launches and raw device pointers. Each
//! block says why it is sound. The shapes and bounds each kernel relies on are those the
//! trait documents; the callers (`model.rs`, `train.rs`) size every buffer from the config.

#![allow(unsafe_code)]

mod device;
mod gemm;
mod graph;
mod kv;
mod sample;

use std::sync::Arc;

use cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};

pub use device::{CudaError, Device, DeviceInfo, MIN_COMPUTE_CAPABILITY, devices};
pub use graph::GraphStats;
pub use kv::{BLOCK_TOKENS, KvPool, PagedKv, PagedStep};
pub use sample::{Pick, Picked, TOP_MAX};

use crate::backend::{
    AdamStep, Backend, CacheWrite, KvRows, PackedProduct, Product, ProductGrad, Span,
};
use crate::ops::PackedMatrix;

const BLOCK: u32 = 256;
/// Rows each thread sums in the column reductions (bias and RMSNorm weight gradients).
const ROWS_PER_BLOCK: usize = 256;
/// Bytes of f32 logits the head materialises at once (a chunk of rows × V).
const HEAD_CHUNK_BYTES: usize = 256 << 20;

/// The CUDA backend: a handle on one opened GPU (cheap to clone).
#[derive(Clone, Debug)]
pub struct Cuda {
    device: Arc<Device>,
    /// The KV pool this handle's caches take blocks from (an engine's own, sized by its
    /// flags: [`Cuda::with_kv_pool`]); without one, the GPU's shared pool for the shape.
    kv: Option<Arc<KvPool>>,
}

/// A linear layer's weights as bf16, converted once for a version being served
/// ([`Backend::freeze`]): the products read them directly instead of converting the f32
/// weights at every call (for a decode step, most of its memory traffic). The GGUF block
/// formats have no GPU kernel: `pack` answers None and serving freezes the f32 weights.
#[derive(Clone)]
pub struct Bf16Matrix {
    rows: usize,
    cols: usize,
    data: Arc<gemm::Bf16>,
}

impl std::fmt::Debug for Bf16Matrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bf16Matrix")
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .finish()
    }
}

/// An f32 buffer on the GPU. `len` is its logical length; the allocation may be larger (KV
/// caches grow by doubling). A buffer whose allocation failed has none and is never read:
/// the device holds the fault. A graphed step's buffers are views of its arena (`view`,
/// their address) that own nothing.
pub struct GpuBuf {
    slice: Option<CudaSlice<f32>>,
    view: u64,
    len: usize,
    device: Arc<Device>,
}

impl std::fmt::Debug for GpuBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuBuf").field("len", &self.len).finish()
    }
}

impl Clone for GpuBuf {
    /// A deep copy on the device, as a CPU `Vec` clone is.
    fn clone(&self) -> Self {
        let cuda = Cuda {
            device: self.device.clone(),
            kv: None,
        };
        let mut copy = cuda.alloc(self.len, "copying a buffer");
        cuda.copy_within(&mut copy, 0, self, 0, self.len);
        copy
    }
}

impl GpuBuf {
    /// The device address of element `offset` (0 when there is no allocation, which only a
    /// faulted device or an empty buffer has; neither launches anything).
    fn ptr(&self, offset: usize) -> u64 {
        let base = match &self.slice {
            Some(slice) => slice.device_ptr(&self.device.stream).0,
            None => self.view,
        };
        if base == 0 {
            return 0;
        }
        base + (offset * size_of::<f32>()) as u64
    }
}

/// A small table of launch arguments on the device: an allocation of its own, or (while a
/// step is recorded for a graph) a slot of the staging area.
enum Table<T> {
    Owned(Arc<CudaSlice<T>>),
    Staged(u64),
}

impl<T> Table<T> {
    fn ptr(&self) -> u64 {
        match self {
            Table::Owned(slice) => slice.device_ptr(slice.stream()).0,
            Table::Staged(ptr) => *ptr,
        }
    }
}

impl<T> std::fmt::Debug for Table<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Table({:#x})", self.ptr())
    }
}

impl<T> Clone for Table<T> {
    fn clone(&self) -> Self {
        match self {
            Table::Owned(slice) => Table::Owned(slice.clone()),
            Table::Staged(ptr) => Table::Staged(*ptr),
        }
    }
}

/// The bytes of a slice of plain device values (i32, u32, i64, f32).
fn bytes_of<T: cudarc::driver::DeviceRepr>(values: &[T]) -> &[u8] {
    // SAFETY: DeviceRepr types are plain data without padding or invalid bit patterns as
    // bytes; the view covers exactly the slice's memory and borrows it.
    unsafe { std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), size_of_val(values)) }
}

impl From<CudaError> for crate::backend::BackendError {
    /// The failure as the backend reports it: out of memory, or a device failure.
    fn from(e: CudaError) -> Self {
        use crate::backend::BackendErrorKind;
        let kind = match e {
            CudaError::OutOfMemory { .. } => BackendErrorKind::OutOfMemory,
            _ => BackendErrorKind::Device,
        };
        Self {
            kind,
            message: e.to_string(),
        }
    }
}

impl Cuda {
    /// Opens GPU `ordinal` (see [`Device::open`] for what is checked).
    pub fn new(ordinal: usize) -> Result<Self, CudaError> {
        Ok(Self {
            device: Arc::new(Device::open(ordinal)?),
            kv: None,
        })
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.device.info
    }

    /// Waits for all queued work; returns (and clears) the first failure since the last
    /// check.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        if let Err(e) = self.device.stream.synchronize() {
            self.device.record(device::driver("synchronizing")(e));
        }
        self.device.take_fault().map_or(Ok(()), Err)
    }

    /// A new buffer holding `x` rounded to bf16 and widened back to f32: the values a bf16
    /// file of `x` holds (a trainer handing its version to an engine: [`crate::handoff`]).
    pub fn rounded_to_bf16(&self, x: &GpuBuf) -> GpuBuf {
        let out = self.alloc(x.len, "rounding to bf16");
        let (o, xp) = (out.ptr(0), x.ptr(0));
        if o != 0 && xp != 0 {
            let len = x.len as i64;
            self.launch("round_to_bf16", elementwise(x.len), args![o, xp, len]);
        }
        out
    }

    /// A copy in this handle's memory of `src`, a buffer of another handle on the same GPU
    /// in this process (handles of one GPU share its primary context, so its addresses are
    /// valid here). The other handle's work on `src` must have finished.
    pub fn copy_of(&self, src: &GpuBuf) -> GpuBuf {
        let mut copy = self.alloc(src.len, "copying a buffer handed over");
        self.copy_within(&mut copy, 0, src, 0, src.len);
        copy
    }

    /// (free, total) bytes of device memory.
    pub fn memory(&self) -> Result<(usize, usize), CudaError> {
        self.device
            .stream
            .context()
            .mem_get_info()
            .map_err(device::driver("reading free memory"))
    }

    /// The most bytes the stream's allocations held at once since the last
    /// [`Self::reset_peak_memory`] (they come from the device's default memory pool; cuBLAS's
    /// own workspace is not counted).
    pub fn peak_memory(&self) -> Result<usize, CudaError> {
        let mut bytes = 0u64;
        self.pool_attribute(&mut bytes, false)?;
        Ok(bytes as usize)
    }

    /// Starts a new high-water mark for [`Self::peak_memory`] at what is in use now.
    pub fn reset_peak_memory(&self) -> Result<(), CudaError> {
        let mut zero = 0u64;
        self.pool_attribute(&mut zero, true)
    }

    /// Reads (or, with `set`, writes) the default pool's used-memory high-water mark.
    fn pool_attribute(&self, value: &mut u64, set: bool) -> Result<(), CudaError> {
        use cudarc::driver::sys;
        let ctx = self.device.stream.context();
        if !ctx.has_async_alloc() {
            return Err(CudaError::Driver {
                what: "reading peak memory",
                reason: "this GPU or driver has no stream-ordered memory pools".into(),
            });
        }
        ctx.bind_to_thread()
            .map_err(device::driver("binding the context"))?;
        let mut pool = std::ptr::null_mut();
        let attribute = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH;
        // SAFETY: the device ordinal belongs to this context, `pool` and `value` outlive the
        // calls, and USED_MEM_HIGH takes a cuuint64_t.
        let result = unsafe {
            sys::cuDeviceGetDefaultMemPool(&raw mut pool, ctx.cu_device())
                .result()
                .and_then(|()| {
                    let value = (value as *mut u64).cast();
                    if set {
                        sys::cuMemPoolSetAttribute(pool, attribute, value).result()
                    } else {
                        sys::cuMemPoolGetAttribute(pool, attribute, value).result()
                    }
                })
        };
        result.map_err(device::driver("reading the memory pool"))
    }

    /// With `ARL_CUDA_PROFILE=1`: (kernel or product, calls, seconds) since the last call,
    /// slowest first; empty otherwise.
    pub fn take_profile(&self) -> Vec<(&'static str, u64, f64)> {
        let Some(Ok(mut profile)) = self.device.profile.as_ref().map(|p| p.lock()) else {
            return Vec::new();
        };
        let mut rows: Vec<_> = std::mem::take(&mut *profile)
            .into_iter()
            .map(|(name, (calls, seconds))| (name, calls, seconds))
            .collect();
        rows.sort_by(|a, b| b.2.total_cmp(&a.2));
        rows
    }

    /// Runs `f` (which queues work on the stream); when profiling, timed under `name` on the
    /// GPU (events before and after it, so the time is the device's, not the launch's) and
    /// drained before the next operation.
    fn timed<R>(&self, name: &'static str, f: impl FnOnce() -> R) -> R {
        let Some(profile) = &self.device.profile else {
            return f();
        };
        let stream = &self.device.stream;
        let event = || {
            stream
                .context()
                .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
        };
        let (Ok(start), Ok(end)) = (event(), event()) else {
            return f();
        };
        let _ = start.record(stream);
        let result = f();
        let _ = end.record(stream);
        if let (Ok(ms), Ok(mut profile)) = (start.elapsed_ms(&end), profile.lock()) {
            let entry = profile.entry(name).or_default();
            entry.0 += 1;
            entry.1 += f64::from(ms) / 1e3;
        }
        result
    }

    /// Records a failure: the device's, or only the recorded run's while a step is planned
    /// or captured (its eager run meets a real failure again and records it).
    fn fail(&self, error: CudaError) {
        if !self.spoil_by_fault(error.to_string()) {
            self.device.record(error);
        }
    }

    fn ok(&self) -> bool {
        !self.device.faulted()
    }

    /// A zeroed buffer: in a recorded step, a view of the arena; else its own allocation.
    fn alloc(&self, len: usize, what: &'static str) -> GpuBuf {
        self.arena_or_kept(len, true, what)
    }

    /// Room for `len` floats that the caller's kernels write before they read them: in a
    /// recorded step an arena view left as it is (no memset in the graph).
    fn scratch(&self, len: usize, what: &'static str) -> GpuBuf {
        self.arena_or_kept(len, false, what)
    }

    /// In a recorded step a view of the arena (zeroed in the graph when `zeroed`), else a
    /// zeroed buffer of its own.
    fn arena_or_kept(&self, len: usize, zeroed: bool, what: &'static str) -> GpuBuf {
        // New memory may sit where the last output's was (see `Twin`).
        self.drop_twin();
        if len > 0
            && let Some(view) = self.arena_alloc(len * size_of::<f32>(), zeroed)
        {
            return GpuBuf {
                slice: None,
                view,
                len,
                device: self.device.clone(),
            };
        }
        self.alloc_kept(len, what)
    }

    /// RoPE's tables on the device: positions, and the inverse frequencies' bits.
    fn rope_tables(
        &self,
        positions: &[usize],
        inv_freq: &[f32],
    ) -> Option<(Table<u32>, Table<u32>)> {
        let pos: Vec<u32> = positions.iter().map(|&p| p as u32).collect();
        let freq: Vec<u32> = inv_freq.iter().map(|f| f.to_bits()).collect();
        Some((self.upload_table(&pos)?, self.upload_table(&freq)?))
    }

    /// A zeroed buffer of its own, never an arena view (KV pool chunks outlive every step).
    /// While a step is captured nothing may be allocated: the capture is spoiled instead.
    fn alloc_kept(&self, len: usize, what: &'static str) -> GpuBuf {
        // New memory may sit where the last output's was (see `Twin`).
        self.drop_twin();
        let capturing = self.capturing();
        let slice = if len == 0 || !self.ok() || capturing {
            if capturing && len > 0 {
                self.spoil(format!("{what} while capturing a step"));
            }
            None
        } else {
            match self.device.stream.alloc_zeros::<f32>(len) {
                Ok(slice) => Some(slice),
                Err(e) => {
                    self.fail(match device::driver(what)(e) {
                        CudaError::OutOfMemory { what, .. } => CudaError::OutOfMemory {
                            what,
                            bytes: len * size_of::<f32>(),
                        },
                        other => other,
                    });
                    None
                }
            }
        };
        GpuBuf {
            slice,
            view: 0,
            len,
            device: self.device.clone(),
        }
    }

    /// A device copy of host values (indices, positions, targets) for one launch.
    fn upload_any<T: cudarc::driver::DeviceRepr>(&self, host: &[T]) -> Option<Table<T>> {
        if host.is_empty() || !self.ok() {
            return None;
        }
        if let Some(ptr) = self.stage_table(bytes_of(host), None) {
            return Some(Table::Staged(ptr));
        }
        match self.device.stream.clone_htod(host) {
            Ok(slice) => Some(Table::Owned(Arc::new(slice))),
            Err(e) => {
                self.fail(device::driver("uploading launch arguments")(e));
                None
            }
        }
    }

    /// A device copy of a small table, shared with the last callers that uploaded the same
    /// values (32-bit words: i32 indices as they are, f32 as their bits).
    fn upload_table(&self, host: &[u32]) -> Option<Table<u32>> {
        const KEPT: usize = 16;
        if !host.is_empty()
            && let Some(ptr) = self.stage_table(bytes_of(host), Some(host))
        {
            return Some(Table::Staged(ptr));
        }
        let mut tables = self.device.tables.lock().ok()?;
        if let Some(at) = tables.iter().position(|(values, _)| values == host) {
            let hit = tables.remove(at);
            let slice = hit.1.clone();
            tables.insert(0, hit);
            return Some(Table::Owned(slice));
        }
        let Table::Owned(slice) = self.upload_any(host)? else {
            return None;
        };
        tables.insert(0, (host.to_vec(), slice.clone()));
        tables.truncate(KEPT);
        Some(Table::Owned(slice))
    }

    /// dst[at..at+len] = src[from..from+len] (device to device).
    /// host = buf[offset..offset + host.len()], once the work queued before has run.
    fn read(&self, buf: &GpuBuf, offset: usize, host: &mut [f32], what: &'static str) {
        if host.is_empty() || !self.ok() || buf.ptr(0) == 0 || self.spoil("a read in a step") {
            return;
        }
        if offset + host.len() > buf.len {
            self.fail(CudaError::Driver {
                what,
                reason: format!(
                    "a read of {} past a buffer of {}",
                    offset + host.len(),
                    buf.len
                ),
            });
            return;
        }
        let stream = &self.device.stream;
        // SAFETY: the range lies inside the buffer (checked above), whose memory lives while it
        // is borrowed; a copy to pageable host memory returns once it is done, and the
        // synchronisation below makes sure of it before `host` is read.
        let copied = unsafe {
            cudarc::driver::result::memcpy_dtoh_async(host, buf.ptr(offset), stream.cu_stream())
        };
        if let Err(e) = copied.and_then(|()| stream.synchronize()) {
            self.fail(device::driver(what)(e));
        }
    }

    fn copy_within(&self, dst: &mut GpuBuf, at: usize, src: &GpuBuf, from: usize, len: usize) {
        self.drop_twin();
        if len == 0 || !self.ok() || dst.ptr(0) == 0 || src.ptr(0) == 0 {
            return;
        }
        let bytes = len * size_of::<f32>();
        let pass = self.note(&[3, dst.ptr(at), src.ptr(from), bytes as u64]);
        if pass == graph::Pass::Skip {
            return;
        }
        let stream = self.device.stream_for(pass);
        // SAFETY: both ranges lie inside their allocations (at + len ≤ dst capacity and
        // from + len ≤ src.len, checked by the callers), and the copy is ordered on the
        // stream every other use of these buffers is ordered on.
        let copied = unsafe {
            cudarc::driver::result::memcpy_dtod_async(
                dst.ptr(at),
                src.ptr(from),
                bytes,
                stream.cu_stream(),
            )
        };
        if let Err(e) = copied {
            self.fail(device::driver("copying on the device")(e));
        }
    }

    /// Launches kernel `name` over `cfg` with `args`, in the order and types of its
    /// signature in kernels.cu.
    fn launch(&self, name: &'static str, cfg: LaunchConfig, args: &[Arg]) {
        // Whatever this kernel writes, the last output's bf16 twin may no longer match it.
        self.drop_twin();
        self.launch_keeping_twin(name, cfg, args);
    }

    /// `launch` for a kernel that reads the last output's bf16 twin and writes only `out`
    /// (and a twin of its own): the twin stays alive for it unless `out` is what it rounds.
    fn launch_reading_twin(&self, name: &'static str, cfg: LaunchConfig, args: &[Arg], out: u64) {
        if self.twin_of() == Some(out) {
            self.drop_twin();
        }
        self.launch_keeping_twin(name, cfg, args);
    }

    fn launch_keeping_twin(&self, name: &'static str, cfg: LaunchConfig, args: &[Arg]) {
        if !self.ok() || cfg.grid_dim.0 == 0 || cfg.grid_dim.1 == 0 {
            return;
        }
        if let Some(sizes) = self.device.kernel_params.get(name)
            && !args.iter().map(Arg::size).eq(sizes.iter().copied())
        {
            let given: Vec<usize> = args.iter().map(Arg::size).collect();
            self.fail(CudaError::Driver {
                what: "launching a kernel",
                reason: format!(
                    "kernel {name} takes parameters of {sizes:?} bytes, the launch gave {given:?}"
                ),
            });
            return;
        }
        let pass = self.note_launch(name, &cfg, args);
        if pass == graph::Pass::Skip {
            return;
        }
        let Some(function) = self.device.kernels.get(name) else {
            self.fail(CudaError::Driver {
                what: "launching a kernel",
                reason: format!("kernel {name} was not loaded"),
            });
            return;
        };
        let mut builder = self.device.stream_for(pass).launch_builder(function);
        for arg in args {
            match arg {
                Arg::Ptr(v) | Arg::U64(v) => builder.arg(v),
                Arg::I32(v) => builder.arg(v),
                Arg::I64(v) => builder.arg(v),
                Arg::F32(v) => builder.arg(v),
            };
        }
        // SAFETY: every pointer argument is the device address of a live allocation large
        // enough for the shapes passed with it (see each call; temporaries are freed in
        // stream order, after the kernel), every other argument a scalar of the type the
        // kernel declares at that position.
        if let Err(e) = self.timed(name, || unsafe { builder.launch(cfg) }) {
            self.fail(device::driver("launching a kernel")(e));
        }
    }

    /// Turns the few-row product kernels (`gemv_bf16`, see `gemm.rs`) on or off for this
    /// device; off, every product runs on cuBLAS.
    pub fn set_gemv(&self, on: bool) {
        self.device
            .gemv_on
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }
}

/// A kernel's arguments, in its signature's order: `args![out, x, len]`.
macro_rules! args {
    ($($arg:expr),* $(,)?) => {
        &[$(Arg::from(&$arg)),*]
    };
}
use args;

/// One kernel argument.
enum Arg {
    Ptr(u64),
    U64(u64),
    I32(i32),
    I64(i64),
    F32(f32),
}

impl Arg {
    /// Its size in bytes, as the kernel's parameter must be.
    fn size(&self) -> usize {
        match self {
            Arg::Ptr(_) | Arg::U64(_) | Arg::I64(_) => 8,
            Arg::I32(_) | Arg::F32(_) => 4,
        }
    }

    /// The argument as a word of a step's signature (`graph.rs`).
    fn word(&self) -> u64 {
        match self {
            Arg::Ptr(v) | Arg::U64(v) => *v,
            Arg::I32(v) => u64::from(*v as u32),
            Arg::I64(v) => *v as u64,
            Arg::F32(v) => u64::from(v.to_bits()),
        }
    }
}

impl From<&u64> for Arg {
    fn from(v: &u64) -> Self {
        Arg::U64(*v)
    }
}

impl From<&i32> for Arg {
    fn from(v: &i32) -> Self {
        Arg::I32(*v)
    }
}

impl From<&i64> for Arg {
    fn from(v: &i64) -> Self {
        Arg::I64(*v)
    }
}

impl From<&f32> for Arg {
    fn from(v: &f32) -> Self {
        Arg::F32(*v)
    }
}

impl<T> From<&Table<T>> for Arg {
    fn from(table: &Table<T>) -> Self {
        Arg::Ptr(table.ptr())
    }
}

impl<T> From<&CudaSlice<T>> for Arg {
    fn from(slice: &CudaSlice<T>) -> Self {
        Arg::Ptr(slice.device_ptr(slice.stream()).0)
    }
}

/// `len` elements, one thread each.
fn elementwise(len: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (
            u32::try_from(len.div_ceil(BLOCK as usize)).unwrap_or(u32::MAX),
            1,
            1,
        ),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One block per (row, head) pair.
fn per_row_head(rows: usize, heads: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, heads as u32, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Column reductions: (columns / BLOCK, rows / ROWS_PER_BLOCK) blocks.
fn columns(n: usize, c: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (
            c.div_ceil(BLOCK as usize) as u32,
            n.div_ceil(ROWS_PER_BLOCK) as u32,
            1,
        ),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Per row of the spans: (first row of its sequence, its length, the row), as the generic
/// attention kernels read it (a block per entry).
fn span_table(spans: &[Span]) -> Vec<u32> {
    let mut table = Vec::new();
    for &(start, t) in spans {
        for row in start..start + t {
            table.extend([start as u32, t as u32, row as u32]);
        }
    }
    table
}

/// Per tile of `rows` consecutive rows of a sequence: (first row of the sequence, its
/// length, first row of the tile within it), as the tensor-core attention kernels read it.
fn tile_table(spans: &[Span], rows: usize) -> Vec<u32> {
    let mut table = Vec::new();
    for &(start, t) in spans {
        for first in (0..t).step_by(rows) {
            table.extend([start as u32, t as u32, first as u32]);
        }
    }
    table
}

/// The tensor-core attention kernels for a head size, with their tile shapes: query rows
/// per block of the forward and dq kernels, key rows and threads per block of dk/dv.
struct Flash {
    forward: &'static str,
    backward_dq: &'static str,
    backward_dkv: &'static str,
    key_rows: usize,
}

/// Query rows per block of the tensor-core forward and dq kernels (4 warps × 16).
const FLASH_QUERY_ROWS: usize = 64;

fn flash(hd: usize) -> Option<Flash> {
    if exact_attention() {
        return None;
    }
    match hd {
        64 => Some(Flash {
            forward: "flash_forward_64",
            backward_dq: "flash_backward_dq_64",
            backward_dkv: "flash_backward_dkv_64",
            key_rows: 64,
        }),
        128 => Some(Flash {
            forward: "flash_forward_128",
            backward_dq: "flash_backward_dq_128",
            backward_dkv: "flash_backward_dkv_128",
            key_rows: 32,
        }),
        _ => None,
    }
}

/// `ARL_CUDA_ATTENTION=exact`: every head size on the f32 kernels (scores, softmax and
/// products in f32, as the CPU computes them) instead of the bf16 tensor-core ones — slower,
/// for telling attention's bf16 rounding from other differences in a parity check.
fn exact_attention() -> bool {
    static EXACT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *EXACT.get_or_init(|| std::env::var("ARL_CUDA_ATTENTION").is_ok_and(|v| v == "exact"))
}

/// One block of 2 threads per row of a tile (a warp per 16 rows) per (tile, head).
fn per_tile(tiles: usize, heads: usize, rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (tiles as u32, heads as u32, 1),
        block_dim: (2 * rows as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl Backend for Cuda {
    type Buf = GpuBuf;
    type Packed = Bf16Matrix;
    type Kv = PagedKv;
    type KvStep = PagedStep;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn check(&self) -> Result<(), crate::backend::BackendError> {
        self.synchronize().map_err(Into::into)
    }

    fn graphed(&self, key: u64, step: &mut dyn FnMut() -> GpuBuf) -> GpuBuf {
        Cuda::graphed(self, key, step)
    }

    fn zeros(&self, len: usize) -> GpuBuf {
        self.alloc(len, "allocating a buffer")
    }

    fn upload(&self, host: &[f32]) -> GpuBuf {
        // New memory may sit where the last output's was (see `Twin`).
        self.drop_twin();
        if self.spoil("uploading a buffer in a step") {
            return self.alloc(host.len(), "uploading");
        }
        let mut buf = self.alloc(host.len(), "uploading");
        if let Some(slice) = buf.slice.as_mut()
            && let Err(e) = self.device.stream.memcpy_htod(host, slice)
        {
            self.fail(device::driver("uploading")(e));
        }
        buf
    }

    fn download(&self, buf: &GpuBuf) -> Vec<f32> {
        let mut host = vec![0f32; buf.len];
        self.read(buf, 0, &mut host, "downloading");
        host
    }

    fn len(&self, buf: &GpuBuf) -> usize {
        buf.len
    }

    fn pack(&self, _host: &PackedMatrix) -> Option<Bf16Matrix> {
        None
    }

    fn freeze(&self, w: &GpuBuf, rows: usize, cols: usize) -> Option<Bf16Matrix> {
        Some(Bf16Matrix {
            rows,
            cols,
            data: Arc::new(self.bf16(w, 0, rows * cols)),
        })
    }

    fn freeze_stacked(&self, parts: &[(&GpuBuf, usize)], cols: usize) -> Option<Bf16Matrix> {
        let rows: usize = parts.iter().map(|(_, r)| r).sum();
        let data = self.bf16_alloc(rows * cols);
        let base = data.ptr(self);
        if base == 0 {
            return None;
        }
        let mut at = 0u64;
        for (w, r) in parts {
            let len = r * cols;
            let (out, xp, len64) = (base + 2 * at, w.ptr(0), len as i64);
            self.launch(
                "to_bf16",
                elementwise(len.div_ceil(4)),
                args![out, xp, len64],
            );
            at += len as u64;
        }
        Some(Bf16Matrix {
            rows,
            cols,
            data: Arc::new(data),
        })
    }

    fn kv_new(&self, layers: usize, kv_dim: usize) -> PagedKv {
        self.kv_new_paged(layers, kv_dim)
    }

    fn kv_truncate(&self, kv: &mut PagedKv, len: usize) {
        self.kv_truncate_paged(kv, len);
    }

    fn kv_prepare(&self, seqs: &mut [KvRows<'_, PagedKv>]) -> PagedStep {
        self.kv_prepare_paged(seqs)
    }

    fn kv_write(
        &self,
        layer: usize,
        step: &PagedStep,
        seqs: &mut [KvRows<'_, PagedKv>],
        k: &GpuBuf,
        v: &GpuBuf,
    ) {
        if let Some(s) = seqs.first() {
            self.kv_write_paged(layer, step, s.kv.pool(), k, v);
        }
    }

    fn gather_rows(&self, out: &mut GpuBuf, x: &GpuBuf, rows: &[usize], c: usize) {
        let indices: Vec<i32> = rows.iter().map(|&r| r as i32).collect();
        let Some(indices) = self.upload_any(&indices) else {
            return;
        };
        let (o, x, n, c) = (out.ptr(0), x.ptr(0), rows.len() as i32, c as i32);
        self.launch(
            "gather_rows",
            elementwise(rows.len() * c as usize),
            args![o, x, indices, n, c],
        );
    }

    fn add_assign(&self, x: &mut GpuBuf, y: &GpuBuf) {
        let (xp, yp, len) = (x.ptr(0), y.ptr(0), x.len as i64);
        self.launch("add_assign", elementwise(x.len), args![xp, yp, len]);
    }

    fn scale(&self, x: &mut GpuBuf, factor: f32) {
        let (xp, len) = (x.ptr(0), x.len as i64);
        self.launch("scale", elementwise(x.len), args![xp, factor, len]);
    }

    fn sum_squares(&self, xs: &[&GpuBuf]) -> f64 {
        if xs.iter().all(|x| x.len == 0) || !self.ok() || self.spoil("a reduction in a step") {
            return 0.0;
        }
        let total = match self.device.stream.alloc_zeros::<f64>(1) {
            Ok(total) => total,
            Err(e) => {
                self.fail(device::driver("allocating a reduction")(e));
                return 0.0;
            }
        };
        let tp = total.device_ptr(&self.device.stream).0;
        for x in xs {
            let (xp, len) = (x.ptr(0), x.len as i64);
            let mut cfg = elementwise(x.len);
            cfg.grid_dim.0 = cfg.grid_dim.0.min(1024);
            self.launch("sum_squares", cfg, args![tp, xp, len]);
        }
        let mut host = [0f64];
        if self.ok()
            && let Err(e) = self.device.stream.memcpy_dtoh(&total, &mut host)
        {
            self.fail(device::driver("reading a reduction")(e));
        }
        host[0]
    }

    fn embedding_forward(&self, out: &mut GpuBuf, table: &GpuBuf, tokens: &[u32]) {
        let Some(ids) = self.upload_any(tokens) else {
            return;
        };
        let c = out.len / tokens.len();
        let (o, t, n, c32) = (out.ptr(0), table.ptr(0), tokens.len() as i32, c as i32);
        self.launch(
            "embedding_forward",
            elementwise(out.len),
            args![o, t, ids, n, c32],
        );
    }

    fn embedding_backward(&self, dtable: &mut GpuBuf, dout: &GpuBuf, tokens: &[u32]) {
        let Some(ids) = self.upload_any(tokens) else {
            return;
        };
        let c = dout.len / tokens.len();
        let (dt, d, n, c32) = (dtable.ptr(0), dout.ptr(0), tokens.len() as i32, c as i32);
        self.launch(
            "embedding_backward",
            elementwise(dout.len),
            args![dt, d, ids, n, c32],
        );
    }

    fn rmsnorm_forward(
        &self,
        out: &mut GpuBuf,
        rstd: &mut GpuBuf,
        x: &GpuBuf,
        w: &GpuBuf,
        eps: f32,
    ) {
        let (n, c) = (rstd.len, w.len as i32);
        let (o, r, xp, wp) = (out.ptr(0), rstd.ptr(0), x.ptr(0), w.ptr(0));
        let twin = self.bf16_alloc(out.len);
        let tp = twin.ptr(self);
        self.launch(
            "rmsnorm_forward",
            per_row_head(n, 1),
            args![o, r, xp, wp, c, eps, tp],
        );
        self.keep_twin(out, twin);
    }

    fn add_rmsnorm_forward(
        &self,
        x: &mut GpuBuf,
        y: &GpuBuf,
        out: &mut GpuBuf,
        rstd: &mut GpuBuf,
        w: &GpuBuf,
        eps: f32,
    ) {
        let (n, c) = (rstd.len, w.len as i32);
        let (xp, yp, o, r, wp) = (x.ptr(0), y.ptr(0), out.ptr(0), rstd.ptr(0), w.ptr(0));
        let twin = self.bf16_alloc(out.len);
        let tp = twin.ptr(self);
        self.launch(
            "add_rmsnorm_forward",
            per_row_head(n, 1),
            args![xp, yp, o, r, wp, c, eps, tp],
        );
        self.keep_twin(out, twin);
    }

    fn rmsnorm_backward(
        &self,
        dx: &mut GpuBuf,
        dw: &mut GpuBuf,
        dout: &GpuBuf,
        x: &GpuBuf,
        w: &GpuBuf,
        rstd: &GpuBuf,
    ) {
        let (n, c) = (rstd.len, w.len);
        let (dxp, dwp, dp, xp, wp, rp) = (
            dx.ptr(0),
            dw.ptr(0),
            dout.ptr(0),
            x.ptr(0),
            w.ptr(0),
            rstd.ptr(0),
        );
        let (n32, c32, rows) = (n as i32, c as i32, ROWS_PER_BLOCK as i32);
        self.launch(
            "rmsnorm_backward_dx",
            per_row_head(n, 1),
            args![dxp, dp, xp, wp, rp, c32],
        );
        self.launch(
            "rmsnorm_backward_dw",
            columns(n, c),
            args![dwp, dp, xp, rp, n32, c32, rows],
        );
    }

    fn matmul_forward(
        &self,
        out: &mut GpuBuf,
        x: &GpuBuf,
        w: &GpuBuf,
        bias: Option<&GpuBuf>,
        n: usize,
        i: usize,
        o: usize,
    ) {
        self.matmul_forward_shared(x, n, i, &mut [Product { out, w, bias, o }]);
    }

    fn matmul_forward_shared(
        &self,
        x: &GpuBuf,
        n: usize,
        i: usize,
        products: &mut [Product<'_, GpuBuf>],
    ) {
        // x goes to bf16 once for every product that reads it.
        let x_bf = self.bf16(x, 0, n * i);
        for p in products {
            let w_bf = self.bf16(p.w, 0, p.o * i);
            let bias = p.bias.map(|b| b.ptr(0));
            self.product_forward(p.out.ptr(0), &x_bf, &w_bf, bias, n, i, p.o);
        }
    }

    fn matmul_packed(
        &self,
        out: &mut GpuBuf,
        x: &GpuBuf,
        w: &Bf16Matrix,
        bias: Option<&GpuBuf>,
        n: usize,
    ) {
        // The same product as `matmul_forward`, less the weights' conversion.
        let x_bf = self.bf16(x, 0, n * w.cols);
        let bias = bias.map(|b| b.ptr(0));
        self.product_forward(out.ptr(0), &x_bf, &w.data, bias, n, w.cols, w.rows);
    }

    fn matmul_packed_shared(
        &self,
        x: &GpuBuf,
        n: usize,
        products: &mut [PackedProduct<'_, GpuBuf, Bf16Matrix>],
    ) {
        // x goes to bf16 once for every product that reads it.
        let Some(cols) = products.first().map(|p| p.w.cols) else {
            return;
        };
        let x_bf = self.bf16(x, 0, n * cols);
        for p in products {
            let (w, bias) = (p.w, p.bias.map(|b| b.ptr(0)));
            self.product_forward(p.out.ptr(0), &x_bf, &w.data, bias, n, w.cols, w.rows);
        }
    }

    fn matmul_backward(
        &self,
        dx: &mut GpuBuf,
        dw: &mut GpuBuf,
        db: Option<&mut GpuBuf>,
        dout: &GpuBuf,
        x: &GpuBuf,
        w: &GpuBuf,
        n: usize,
        i: usize,
        o: usize,
    ) {
        let grad = ProductGrad { dw, db, dout, w, o };
        self.matmul_backward_shared(dx, x, n, i, &mut [grad]);
    }

    fn matmul_backward_shared(
        &self,
        dx: &mut GpuBuf,
        x: &GpuBuf,
        n: usize,
        i: usize,
        grads: &mut [ProductGrad<'_, GpuBuf>],
    ) {
        let x_bf = self.bf16(x, 0, n * i);
        for g in grads {
            // The input gradient carries dout to every earlier layer, so dout keeps 16
            // significant bits there (hi + lo); the weight gradient ends here and takes bf16.
            let dout_bf = self.bf16_split(g.dout, 0, n * g.o);
            let w_bf = self.bf16(g.w, 0, g.o * i);
            self.gemm_dx_split(dx.ptr(0), &dout_bf, &w_bf, n, i, g.o);
            self.gemm_dw(g.dw.ptr(0), &dout_bf.0, &x_bf, n, i, g.o);
            if let Some(db) = g.db.as_deref_mut() {
                let (dbp, dp, n32, o32, rows) = (
                    db.ptr(0),
                    g.dout.ptr(0),
                    n as i32,
                    g.o as i32,
                    ROWS_PER_BLOCK as i32,
                );
                self.launch(
                    "column_sums",
                    columns(n, g.o),
                    args![dbp, dp, n32, o32, rows],
                );
            }
        }
    }

    fn rope_apply(
        &self,
        x: &mut GpuBuf,
        heads: usize,
        positions: &[usize],
        inv_freq: &[f32],
        sign: f32,
    ) {
        let Some((pos, freq)) = self.rope_tables(positions, inv_freq) else {
            return;
        };
        let half = inv_freq.len();
        let (xp, n, h, half32) = (x.ptr(0), positions.len() as i32, heads as i32, half as i32);
        self.launch(
            "rope_apply",
            elementwise(positions.len() * heads * half),
            args![xp, pos, freq, n, h, half32, sign],
        );
    }

    fn qkv_split_rope(
        &self,
        (q, k, v): (&mut GpuBuf, &mut GpuBuf, &mut GpuBuf),
        qkv: &GpuBuf,
        biases: [Option<&GpuBuf>; 3],
        (heads, kv_heads, hd): (usize, usize, usize),
        positions: &[usize],
        inv_freq: &[f32],
        factor: f32,
        cache: Option<CacheWrite<'_, '_, PagedStep, PagedKv>>,
    ) {
        let Some((pos, freq)) = self.rope_tables(positions, inv_freq) else {
            return;
        };
        let [bq, bk, bv] = biases.map(|b| b.map_or(0, |b| b.ptr(0)));
        let (qp, kp, vp, x) = (q.ptr(0), k.ptr(0), v.ptr(0), qkv.ptr(0));
        // Where each row's keys and values go in the cache (none: 0).
        let (slots, layer_offset, v_offset) = cache
            .and_then(|c| Some((c.layer, c.step, c.seqs.first()?.kv.pool())))
            .map_or((0, 0, 0), |(layer, step, pool)| {
                self.kv_slots(layer, step, pool)
            });
        let (n, h, kvh, half) = (
            positions.len() as i32,
            heads as i32,
            kv_heads as i32,
            (hd / 2) as i32,
        );
        self.launch(
            "qkv_split_rope",
            elementwise(positions.len() * (heads + 2 * kv_heads) * (hd / 2)),
            args![
                qp,
                kp,
                vp,
                x,
                bq,
                bk,
                bv,
                pos,
                freq,
                n,
                h,
                kvh,
                half,
                factor,
                slots,
                layer_offset,
                v_offset
            ],
        );
    }

    fn swiglu_stacked(&self, out: &mut GpuBuf, gate_up: &GpuBuf, i_dim: usize) {
        let (o, gu, n, inner) = (
            out.ptr(0),
            gate_up.ptr(0),
            (out.len / i_dim.max(1)) as i32,
            i_dim as i32,
        );
        let twin = self.bf16_alloc(out.len);
        let tp = twin.ptr(self);
        let cfg = elementwise(out.len);
        self.launch("swiglu_stacked", cfg, args![o, gu, n, inner, tp]);
        self.keep_twin(out, twin);
    }

    fn matmul_packed_swiglu(
        &self,
        out: &mut GpuBuf,
        gate_up: &mut GpuBuf,
        x: &GpuBuf,
        w: &Bf16Matrix,
        n: usize,
        i_dim: usize,
    ) {
        // x goes to bf16 once, for the fused kernel or the product it falls back to.
        let x_bf = self.bf16(x, 0, n * w.cols);
        if out.len != n * i_dim
            || w.rows != 2 * i_dim
            || !self.swiglu_product(out, &x_bf, &w.data, n, w.cols)
        {
            let gu = gate_up.ptr(0);
            self.product_forward(gu, &x_bf, &w.data, None, n, w.cols, w.rows);
            drop(x_bf);
            self.swiglu_stacked(out, gate_up, i_dim);
        }
    }

    fn swiglu_forward(&self, out: &mut GpuBuf, gate: &GpuBuf, up: &GpuBuf) {
        let (o, g, u, len) = (out.ptr(0), gate.ptr(0), up.ptr(0), gate.len as i64);
        let cfg = elementwise(gate.len.div_ceil(4));
        self.launch("swiglu_forward", cfg, args![o, g, u, len]);
    }

    fn swiglu_backward(
        &self,
        dgate: &mut GpuBuf,
        dup: &mut GpuBuf,
        dout: &GpuBuf,
        gate: &GpuBuf,
        up: &GpuBuf,
    ) {
        let (dg, du, d, g, u, len) = (
            dgate.ptr(0),
            dup.ptr(0),
            dout.ptr(0),
            gate.ptr(0),
            up.ptr(0),
            gate.len as i64,
        );
        self.launch(
            "swiglu_backward",
            elementwise(gate.len.div_ceil(4)),
            args![dg, du, d, g, u, len],
        );
    }

    fn attention_forward(
        &self,
        out: &mut GpuBuf,
        lse: &mut GpuBuf,
        q: &GpuBuf,
        k: &GpuBuf,
        v: &GpuBuf,
        spans: &[Span],
        heads: usize,
        kv_heads: usize,
        hd: usize,
    ) {
        let (o, lp, qp, kp, vp) = (out.ptr(0), lse.ptr(0), q.ptr(0), k.ptr(0), v.ptr(0));
        let (h, kvh) = (heads as i32, kv_heads as i32);
        if let Some(flash) = flash(hd) {
            let table = tile_table(spans, FLASH_QUERY_ROWS);
            let Some(tiles) = self.upload_table(&table) else {
                return;
            };
            // The tensor-core kernels read bf16 operands: converted once here, not per block.
            let (qb, kb, vb) = (
                self.bf16(q, 0, q.len),
                self.bf16(k, 0, k.len),
                self.bf16(v, 0, v.len),
            );
            let (qp, kp, vp) = (qb.ptr(self), kb.ptr(self), vb.ptr(self));
            self.launch(
                flash.forward,
                per_tile(table.len() / 3, heads, FLASH_QUERY_ROWS),
                args![o, lp, qp, kp, vp, tiles, h, kvh],
            );
            return;
        }
        let Some(table) = self.upload_table(&span_table(spans)) else {
            return;
        };
        let n: usize = spans.iter().map(|s| s.1).sum();
        let hd32 = hd as i32;
        self.launch(
            "attention_forward",
            per_row_head(n, heads),
            args![o, lp, qp, kp, vp, table, h, kvh, hd32],
        );
    }

    fn attention_backward(
        &self,
        dq: &mut GpuBuf,
        dk: &mut GpuBuf,
        dv: &mut GpuBuf,
        dout: &GpuBuf,
        out: &GpuBuf,
        lse: &GpuBuf,
        q: &GpuBuf,
        k: &GpuBuf,
        v: &GpuBuf,
        spans: &[Span],
        heads: usize,
        kv_heads: usize,
        hd: usize,
    ) {
        let n: usize = spans.iter().map(|s| s.1).sum();
        // D = Σ dout·out per (row, head): Σ_j P_ij dP_ij without the probabilities.
        let dot = self.alloc(n * heads, "attention backward");
        let (dotp, dp, op, pairs, hd32) = (
            dot.ptr(0),
            dout.ptr(0),
            out.ptr(0),
            (n * heads) as i64,
            hd as i32,
        );
        self.launch(
            "attention_rowdot",
            elementwise(n * heads * 32),
            args![dotp, dp, op, pairs, hd32],
        );
        let (dqp, dkp, dvp, lp) = (dq.ptr(0), dk.ptr(0), dv.ptr(0), lse.ptr(0));
        let (qp, kp, vp) = (q.ptr(0), k.ptr(0), v.ptr(0));
        let (h, kvh) = (heads as i32, kv_heads as i32);
        if let Some(flash) = flash(hd) {
            let query_table = tile_table(spans, FLASH_QUERY_ROWS);
            let key_table = tile_table(spans, flash.key_rows);
            let (Some(query_tiles), Some(key_tiles)) = (
                self.upload_table(&query_table),
                self.upload_table(&key_table),
            ) else {
                return;
            };
            let (qb, kb, vb, db) = (
                self.bf16(q, 0, q.len),
                self.bf16(k, 0, k.len),
                self.bf16(v, 0, v.len),
                self.bf16(dout, 0, dout.len),
            );
            let (qp, kp, vp, dp) = (qb.ptr(self), kb.ptr(self), vb.ptr(self), db.ptr(self));
            self.launch(
                flash.backward_dq,
                per_tile(query_table.len() / 3, heads, FLASH_QUERY_ROWS),
                args![dqp, dp, lp, qp, kp, vp, dotp, query_tiles, h, kvh],
            );
            self.launch(
                flash.backward_dkv,
                per_tile(key_table.len() / 3, kv_heads, flash.key_rows),
                args![dkp, dvp, dp, lp, qp, kp, vp, dotp, key_tiles, h, kvh],
            );
            return;
        }
        let Some(table) = self.upload_table(&span_table(spans)) else {
            return;
        };
        self.launch(
            "attention_backward_dq",
            per_row_head(n, heads),
            args![dqp, dp, lp, qp, kp, vp, dotp, table, h, kvh, hd32],
        );
        self.launch(
            "attention_backward_dkv",
            per_row_head(n, kv_heads),
            args![dkp, dvp, dp, lp, qp, kp, vp, dotp, table, h, kvh, hd32],
        );
    }

    fn kv_attention(
        &self,
        layer: usize,
        step: &PagedStep,
        out: &mut GpuBuf,
        q: &GpuBuf,
        k: &GpuBuf,
        v: &GpuBuf,
        seqs: &[KvRows<'_, PagedKv>],
        heads: usize,
        kv_heads: usize,
        hd: usize,
    ) {
        if let Some(s) = seqs.first() {
            let pool = s.kv.pool();
            self.kv_attention_paged(layer, step, pool, out, (q, k, v), heads, kv_heads, hd);
        }
    }

    fn head_forward(
        &self,
        lse: &mut GpuBuf,
        entropy: &mut GpuBuf,
        logprob: &mut GpuBuf,
        h: &GpuBuf,
        w: &GpuBuf,
        targets: &[Option<u32>],
        c: usize,
        vocab: usize,
    ) {
        let n = targets.len();
        let Some(targets) = self.upload_any(&target_ids(targets)) else {
            return;
        };
        let w_bf = self.bf16(w, 0, vocab * c);
        let chunk = head_chunk_rows(vocab);
        let logits = self.alloc(chunk.min(n) * vocab, "the head's logits");
        let (lp, ep, pp, zp, v32) = (
            lse.ptr(0),
            entropy.ptr(0),
            logprob.ptr(0),
            logits.ptr(0),
            vocab as i32,
        );
        for r0 in (0..n).step_by(chunk) {
            let rows = chunk.min(n - r0);
            let h_bf = self.bf16(h, r0 * c, rows * c);
            self.gemm_bf16_forward(zp, &h_bf, &w_bf, rows, c, vocab);
            let r032 = r0 as i32;
            self.launch(
                "head_stats",
                per_row_head(rows, 1),
                args![lp, ep, pp, zp, targets, r032, v32],
            );
        }
    }

    fn head_backward(
        &self,
        dh: &mut GpuBuf,
        dw: &mut GpuBuf,
        h: &GpuBuf,
        w: &GpuBuf,
        lse: &GpuBuf,
        entropy: &GpuBuf,
        targets: &[Option<u32>],
        d_logprob: &[f32],
        d_entropy: &[f32],
        c: usize,
        vocab: usize,
    ) {
        let n = targets.len();
        let (Some(target_ids), Some(d_lp), Some(d_h)) = (
            self.upload_any(&target_ids(targets)),
            self.upload_any(d_logprob),
            self.upload_any(d_entropy),
        ) else {
            return;
        };
        let w_bf = self.bf16(w, 0, vocab * c);
        let chunk = head_chunk_rows(vocab);
        let logits = self.alloc(chunk.min(n) * vocab, "the head's logits");
        let (lp, ep, zp, v32) = (lse.ptr(0), entropy.ptr(0), logits.ptr(0), vocab as i32);
        for r0 in (0..n).step_by(chunk) {
            let rows = chunk.min(n - r0);
            let r1 = r0 + rows;
            // Rows without a gradient (prompt tokens) cost nothing.
            if (r0..r1).all(|r| d_logprob[r] == 0.0 && d_entropy[r] == 0.0) {
                continue;
            }
            let h_bf = self.bf16(h, r0 * c, rows * c);
            self.gemm_bf16_forward(zp, &h_bf, &w_bf, rows, c, vocab);
            let r032 = r0 as i32;
            let dz_bf = (self.bf16_alloc(rows * vocab), self.bf16_alloc(rows * vocab));
            let (hi, lo) = (dz_bf.0.ptr(self), dz_bf.1.ptr(self));
            self.launch(
                "head_dlogits",
                per_row_head(rows, 1),
                args![hi, lo, zp, lp, ep, d_lp, d_h, target_ids, r032, v32],
            );
            self.gemm_dx_split(dh.ptr(r0 * c), &dz_bf, &w_bf, rows, c, vocab);
            self.gemm_dw(dw.ptr(0), &dz_bf.0, &h_bf, rows, c, vocab);
        }
    }

    fn adamw(
        &self,
        param: &mut GpuBuf,
        grad: &GpuBuf,
        m: &mut GpuBuf,
        v: &mut GpuBuf,
        s: AdamStep,
    ) {
        let (pp, gp, mp, vp, len) = (
            param.ptr(0),
            grad.ptr(0),
            m.ptr(0),
            v.ptr(0),
            param.len as i64,
        );
        self.launch(
            "adamw",
            elementwise(param.len),
            args![
                pp,
                gp,
                mp,
                vp,
                len,
                s.lr,
                s.beta1,
                s.beta2,
                s.eps,
                s.weight_decay,
                s.correction1,
                s.correction2
            ],
        );
    }
}

/// For tests and benchmarks: GPU 0, or `Ok(None)` after printing why `test` skips (no
/// driver, no GPU — CI). With `ARL_REQUIRE_GPU=1` (runs on the GPU machine) a missing GPU
/// is an error instead, so a broken device can never pass as a skip.
pub fn for_tests(test: &str) -> Result<Option<Cuda>, CudaError> {
    match Cuda::new(0) {
        Ok(cuda) => Ok(Some(cuda)),
        Err(e) if std::env::var_os("ARL_REQUIRE_GPU").is_some_and(|v| v == "1") => Err(e),
        Err(e) => {
            eprintln!("{test}: skipped, no usable GPU: {e}");
            Ok(None)
        }
    }
}

/// Targets as the kernels read them: the id, or −1 where a row predicts nothing.
fn target_ids(targets: &[Option<u32>]) -> Vec<i32> {
    targets.iter().map(|t| t.map_or(-1, |t| t as i32)).collect()
}

/// Rows of logits per head chunk: HEAD_CHUNK_BYTES of f32 at most, at least one row.
fn head_chunk_rows(vocab: usize) -> usize {
    (HEAD_CHUNK_BYTES / vocab.max(1).saturating_mul(size_of::<f32>())).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A launch whose arguments do not match the kernel's parameters is refused with an
    /// error naming both (the driver would read past them: a crash, not an error).
    #[test]
    fn a_launch_with_the_wrong_arguments_is_an_error() {
        let Some(g) = for_tests("a_launch_with_the_wrong_arguments_is_an_error").unwrap() else {
            return;
        };
        if g.device.kernel_params.is_empty() {
            eprintln!("skipped: this driver does not report kernel parameters");
            return;
        }
        let x = g.upload(&[1.0, 2.0, 3.0, 4.0]);
        let (xp, factor, len) = (x.ptr(0), 2.0f32, 4i64);
        g.launch("scale", elementwise(1), args![xp, factor, len]);
        g.check().unwrap();
        assert_eq!(g.download(&x), [2.0, 4.0, 6.0, 8.0]);
        g.launch("scale", elementwise(1), args![xp, factor]);
        let err = g.check().unwrap_err().to_string();
        assert!(
            err.contains("kernel scale takes parameters of [8, 4, 8] bytes"),
            "{err}"
        );
    }

    #[test]
    fn the_span_table_gives_every_row_its_sequence() {
        let table = span_table(&[(0, 2), (2, 3)]);
        assert_eq!(table, vec![0, 2, 0, 0, 2, 1, 2, 3, 2, 2, 3, 3, 2, 3, 4]);
        // Spans that skip rows (a step's fresh prompts among decoding rows) name theirs.
        assert_eq!(span_table(&[(5, 2)]), vec![5, 2, 5, 5, 2, 6]);
    }

    #[test]
    fn the_tile_table_covers_every_row_once() {
        // A sequence of 70 rows takes two tiles of 64; one of 3 rows, one tile.
        let table = tile_table(&[(0, 70), (70, 3)], 64);
        assert_eq!(table, vec![0, 70, 0, 0, 70, 64, 70, 3, 0]);
        assert!(flash(64).is_some() && flash(128).is_some() && flash(8).is_none());
    }

    #[test]
    fn head_chunks_bound_the_logits() {
        assert_eq!(head_chunk_rows(151_936), 441);
        assert_eq!(head_chunk_rows(usize::MAX / 2), 1);
    }
}
