//! Opening a GPU: the driver and libraries (dlopened, so a machine without CUDA builds and
//! runs everything else), the context and stream, the kernels compiled by NVRTC for the
//! device's architecture, and the cuBLAS handle. Every way this can fail is a
//! [`CudaError`] that names the cause and what to do.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream};
use cudarc::nvrtc::{CompileOptions, compile_ptx_with_opts};

/// The CUDA C source of every kernel.
pub(super) const KERNELS: &str = include_str!("kernels.cu");

/// Every `extern "C"` kernel of `kernels.cu`, loaded once at start.
const KERNEL_NAMES: &[&str] = &[
    "to_bf16",
    "to_bf16_split",
    "round_to_bf16",
    "add_assign",
    "scale",
    "sum_squares",
    "gather_rows",
    "add_bias",
    "column_sums",
    "embedding_forward",
    "embedding_backward",
    "rmsnorm_forward",
    "add_rmsnorm_forward",
    "rmsnorm_backward_dx",
    "rmsnorm_backward_dw",
    "rope_apply",
    "swiglu_forward",
    "swiglu_stacked",
    "gemv_bf16",
    "gemv_bf16_swiglu",
    "qkv_split_rope",
    "swiglu_backward",
    "attention_forward",
    "attention_rowdot",
    "attention_backward_dq",
    "attention_backward_dkv",
    "flash_forward_64",
    "flash_backward_dq_64",
    "flash_backward_dkv_64",
    "flash_forward_128",
    "flash_backward_dq_128",
    "flash_backward_dkv_128",
    "attention_paged",
    "attention_decode_1",
    "attention_decode_2",
    "attention_decode_4",
    "attention_decode_8",
    "attention_decode_merge",
    "kv_write",
    "head_stats",
    "head_dlogits",
    "sample_rows",
    "adamw",
];

/// bf16 matrix products on tensor cores need Ampere (8.0) or newer.
pub const MIN_COMPUTE_CAPABILITY: (i32, i32) = (8, 0);

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CudaError {
    #[error(
        "no CUDA driver: libcuda.so could not be loaded on this machine; install the NVIDIA driver, or run on the CPU (trainer.device = \"cpu\"; arl-inference --device cpu)"
    )]
    NoDriver,
    #[error(
        "CUDA library {library} could not be loaded; install the CUDA 13 runtime libraries ({library}) next to the driver"
    )]
    MissingLibrary { library: &'static str },
    #[error(
        "no CUDA GPU: the driver reports {found} device(s), device {ordinal} was asked for; run on the CPU (trainer.device = \"cpu\"; arl-inference --device cpu) or name a GPU that exists"
    )]
    NoDevice { ordinal: usize, found: usize },
    #[error(
        "GPU {name} has compute capability {major}.{minor}; the CUDA backend needs {}.{} or newer (bf16 tensor cores)",
        MIN_COMPUTE_CAPABILITY.0,
        MIN_COMPUTE_CAPABILITY.1
    )]
    Unsupported {
        name: String,
        major: i32,
        minor: i32,
    },
    #[error(
        "out of GPU memory: {what} needed {bytes} bytes more than were free; lower trainer.micro_batch_tokens (training) or --max-batch / --max-model-len (arl-inference), or use a GPU with more memory"
    )]
    OutOfMemory { what: &'static str, bytes: usize },
    #[error("NVRTC could not compile the kernels for {arch}: {log}")]
    Compile { arch: String, log: String },
    #[error("CUDA driver error in {what}: {reason}")]
    Driver { what: &'static str, reason: String },
    #[error("cuBLAS error in {what}: {reason}")]
    Cublas { what: &'static str, reason: String },
}

/// What a GPU is, for trainers' announcements and error messages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    pub total_memory_bytes: u64,
    pub compute_capability: (i32, i32),
    /// Streaming multiprocessors: how many blocks a kernel needs to fill the device.
    pub multiprocessors: usize,
}

/// One opened GPU: context, the stream every operation is ordered on, kernels, cuBLAS, and
/// the first failure of an asynchronous operation (sticky: once set, later work is skipped
/// and [`crate::backend::Backend::check`] reports it).
pub struct Device {
    pub info: DeviceInfo,
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) kernels: HashMap<&'static str, CudaFunction>,
    /// Each kernel's parameter sizes in bytes, as the driver reports them (CUDA 12.4 and
    /// later; absent before): a launch whose arguments do not match is refused with an
    /// error, where the driver would read past them.
    pub(crate) kernel_params: HashMap<&'static str, Vec<usize>>,
    pub(crate) blas: Mutex<CudaBlas>,
    pub(crate) fault: Mutex<Option<CudaError>>,
    /// With `ARL_CUDA_PROFILE=1`: per kernel or product, (calls, seconds), each timed alone
    /// (the stream is drained before and after it, so the total runs slower than usual).
    pub(crate) profile: Option<Mutex<BTreeMap<&'static str, (u64, f64)>>>,
    /// Small host tables uploaded lately (positions, RoPE frequencies, attention tile
    /// tables), newest first: every layer of a pass asks for the same ones, and each host
    /// upload can stall the stream.
    pub(crate) tables: Mutex<Vec<UploadedTable>>,
    /// The paged KV caches' block pools, one per model shape (weak: a pool lives while a
    /// cache or its owner holds it).
    pub(crate) kv_pools: Mutex<Vec<std::sync::Weak<super::kv::KvPool>>>,
    /// Decode steps' graphs, their arena and staging area (`graph.rs`).
    pub(super) graphs: Mutex<super::graph::Graphs>,
    pub(super) graphs_on: AtomicBool,
    /// Whether products of a few rows run on `gemv_bf16` (`gemm.rs`): on unless
    /// `ARL_CUDA_GEMV=0`.
    pub(super) gemv_on: AtomicBool,
    /// Whether a thread is recording a step now (the fast path of every operation reads
    /// only this), and its recording.
    /// The last output's bf16 rounding, while nothing has written it since (`gemm.rs`).
    pub(super) twin: Mutex<Option<super::gemm::Twin>>,
    pub(super) recording: AtomicBool,
    pub(super) recording_slot: Mutex<Option<super::graph::Recording>>,
    /// Held by a graphed step from its plan to its launch: one recording at a time.
    pub(super) step_lock: Mutex<()>,
    /// Where steps are captured, with a cuBLAS handle of its own: a stream nothing else
    /// uses, so work that other threads queue meanwhile never lands in a graph. Graphs are
    /// launched on `stream`, in order with everything else.
    pub(super) capture_stream: Arc<CudaStream>,
    pub(super) capture_blas: Mutex<CudaBlas>,
    /// cuBLAS's workspace, given to both handles so that neither allocates inside a
    /// capture (shared: all their work runs on `stream`, one product at a time).
    pub(super) _blas_workspace: CudaSlice<u8>,
}

/// A host table's values and its copy on the device.
pub(crate) type UploadedTable = (Vec<u32>, Arc<CudaSlice<u32>>);

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device").field("info", &self.info).finish()
    }
}

/// The GPUs this machine has, or why none can be used.
pub fn devices() -> Result<Vec<DeviceInfo>, CudaError> {
    ensure_driver()?;
    let count = CudaContext::device_count().map_err(driver("counting devices"))?;
    let mut found = Vec::new();
    for ordinal in 0..usize::try_from(count).unwrap_or(0) {
        let ctx = CudaContext::new(ordinal).map_err(driver("opening a device"))?;
        found.push(info(&ctx, ordinal)?);
    }
    Ok(found)
}

fn ensure_driver() -> Result<(), CudaError> {
    // SAFETY: only tries to dlopen the library; nothing is called through it.
    #[allow(unsafe_code)]
    let present = unsafe { cudarc::driver::sys::is_culib_present() };
    if present {
        Ok(())
    } else {
        Err(CudaError::NoDriver)
    }
}

fn info(ctx: &Arc<CudaContext>, ordinal: usize) -> Result<DeviceInfo, CudaError> {
    Ok(DeviceInfo {
        ordinal,
        name: ctx.name().map_err(driver("reading the device name"))?,
        total_memory_bytes: ctx
            .total_mem()
            .map_err(driver("reading the device memory"))? as u64,
        compute_capability: ctx
            .compute_capability()
            .map_err(driver("reading the compute capability"))?,
        multiprocessors: ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(driver("reading the multiprocessor count"))?
            .max(1) as usize,
    })
}

pub(crate) fn driver(what: &'static str) -> impl Fn(cudarc::driver::DriverError) -> CudaError {
    move |e| {
        if e.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            CudaError::OutOfMemory { what, bytes: 0 }
        } else {
            CudaError::Driver {
                what,
                reason: e.to_string(),
            }
        }
    }
}

impl Device {
    /// Opens GPU `ordinal`: checks the driver, libraries and architecture, compiles the
    /// kernels (PTX for the device's own compute capability; the driver turns it into
    /// native code, `sm_90` on an H100/H200).
    pub fn open(ordinal: usize) -> Result<Self, CudaError> {
        ensure_driver()?;
        // SAFETY: as in `ensure_driver`, these only try to dlopen.
        #[allow(unsafe_code)]
        let (nvrtc, cublas) = unsafe {
            (
                cudarc::nvrtc::sys::is_culib_present(),
                cudarc::cublas::sys::is_culib_present(),
            )
        };
        if !nvrtc {
            return Err(CudaError::MissingLibrary {
                library: "libnvrtc.so.13",
            });
        }
        if !cublas {
            return Err(CudaError::MissingLibrary {
                library: "libcublas.so.13",
            });
        }
        let count = CudaContext::device_count().map_err(driver("counting devices"))?;
        let found = usize::try_from(count).unwrap_or(0);
        if ordinal >= found {
            return Err(CudaError::NoDevice { ordinal, found });
        }
        let ctx = CudaContext::new(ordinal).map_err(driver("creating a context"))?;
        let info = info(&ctx, ordinal)?;
        let (major, minor) = info.compute_capability;
        if (major, minor) < MIN_COMPUTE_CAPABILITY {
            return Err(CudaError::Unsupported {
                name: info.name,
                major,
                minor,
            });
        }
        // One stream orders everything, so no per-buffer events are needed.
        // SAFETY: called before any buffer exists; every later operation uses `stream`.
        #[allow(unsafe_code)]
        unsafe {
            ctx.disable_event_tracking();
        }
        // A stream of our own: the legacy default stream cannot be captured into a graph.
        let stream = ctx.new_stream().map_err(driver("creating a stream"))?;
        let arch = ptx_arch(major, minor);
        let ptx = compile_ptx_with_opts(
            KERNELS,
            CompileOptions {
                arch: Some(arch),
                // Precise division and square roots: the CPU reference uses IEEE f32.
                prec_div: Some(true),
                prec_sqrt: Some(true),
                ..Default::default()
            },
        )
        .map_err(|e| CudaError::Compile {
            arch: arch.to_owned(),
            log: match e {
                cudarc::nvrtc::CompileError::CompileError { log, .. } => {
                    log.to_string_lossy().into_owned()
                }
                other => format!("{other:?}"),
            },
        })?;
        let module = ctx
            .load_module(ptx)
            .map_err(driver("loading the kernels"))?;
        let mut kernels = HashMap::new();
        let mut kernel_params = HashMap::new();
        for name in KERNEL_NAMES {
            let function = module
                .load_function(name)
                .map_err(driver("loading a kernel"))?;
            if let Some(sizes) = param_sizes(&function) {
                kernel_params.insert(*name, sizes);
            }
            kernels.insert(*name, function);
        }
        let blas = CudaBlas::new(stream.clone()).map_err(|e| CudaError::Cublas {
            what: "creating the handle",
            reason: e.to_string(),
        })?;
        let capture_stream = ctx.new_stream().map_err(driver("creating a stream"))?;
        let capture_blas =
            CudaBlas::new(capture_stream.clone()).map_err(|e| CudaError::Cublas {
                what: "creating the capture handle",
                reason: e.to_string(),
            })?;
        let blas_workspace = blas_workspace(&stream, &[&blas, &capture_blas])?;
        Ok(Self {
            info,
            stream,
            kernels,
            kernel_params,
            blas: Mutex::new(blas),
            fault: Mutex::new(None),
            tables: Mutex::new(Vec::new()),
            kv_pools: Mutex::new(Vec::new()),
            profile: std::env::var_os("ARL_CUDA_PROFILE")
                .is_some_and(|v| v == "1")
                .then(|| Mutex::new(BTreeMap::new())),
            graphs: Mutex::default(),
            graphs_on: AtomicBool::new(
                std::env::var_os("ARL_CUDA_GRAPHS").is_none_or(|v| v != "0"),
            ),
            gemv_on: AtomicBool::new(std::env::var_os("ARL_CUDA_GEMV").is_none_or(|v| v != "0")),
            twin: Mutex::new(None),
            recording: AtomicBool::new(false),
            recording_slot: Mutex::new(None),
            step_lock: Mutex::new(()),
            capture_stream,
            capture_blas: Mutex::new(capture_blas),
            _blas_workspace: blas_workspace,
        })
    }

    /// The stream an operation of this pass goes to.
    pub(super) fn stream_for(&self, pass: super::graph::Pass) -> &Arc<CudaStream> {
        match pass {
            super::graph::Pass::Capture => &self.capture_stream,
            _ => &self.stream,
        }
    }

    /// Whether decode steps run as graphs: on unless `ARL_CUDA_GRAPHS=0`, or profiling
    /// (which times each kernel alone).
    pub(crate) fn graphs_enabled(&self) -> bool {
        self.graphs_on.load(std::sync::atomic::Ordering::Relaxed) && self.profile.is_none()
    }

    /// The first failure since the last call, if any; clears it. Failed operations were
    /// skipped, so the device is usable again (what they should have written is not).
    pub fn take_fault(&self) -> Option<CudaError> {
        self.fault.lock().ok().and_then(|mut f| f.take())
    }

    /// Keeps the first failure; later ones are consequences of it.
    pub(crate) fn record(&self, error: CudaError) {
        if let Ok(mut fault) = self.fault.lock()
            && fault.is_none()
        {
            *fault = Some(error);
        }
    }

    pub(crate) fn faulted(&self) -> bool {
        self.fault.lock().map_or(true, |f| f.is_some())
    }
}

/// Bytes of cuBLAS's workspace (what NVIDIA suggests for Hopper).
const BLAS_WORKSPACE: usize = 32 << 20;

/// A workspace of our own for cuBLAS: without one it may allocate in a product, which a
/// graph capture cannot hold.
fn blas_workspace(
    stream: &Arc<CudaStream>,
    handles: &[&CudaBlas],
) -> Result<CudaSlice<u8>, CudaError> {
    use cudarc::driver::DevicePtr;
    // SAFETY: cuBLAS only uses the workspace as scratch; nothing reads it uninitialised.
    #[allow(unsafe_code)]
    let workspace = unsafe { stream.alloc::<u8>(BLAS_WORKSPACE) }
        .map_err(driver("allocating cuBLAS's workspace"))?;
    let ptr = workspace.device_ptr(stream).0;
    for blas in handles {
        // SAFETY: the handle is live, and the workspace outlives it (both belong to the
        // Device, the workspace declared after the handles, so dropped after them).
        #[allow(unsafe_code)]
        let status = unsafe {
            cudarc::cublas::sys::cublasSetWorkspace_v2(
                *blas.handle(),
                ptr as *mut std::ffi::c_void,
                BLAS_WORKSPACE,
            )
        };
        if status != cudarc::cublas::sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Err(CudaError::Cublas {
                what: "setting the workspace",
                reason: format!("{status:?}"),
            });
        }
    }
    Ok(workspace)
}

/// The PTX target for a compute capability: the device's own where NVRTC knows it, else
/// the newest older one (the driver JIT-compiles PTX forward to any newer GPU).
fn ptx_arch(major: i32, minor: i32) -> &'static str {
    match (major, minor) {
        (8, 0) => "compute_80",
        (8, 6) => "compute_86",
        (8, 7) => "compute_87",
        (8, 9) => "compute_89",
        (9, _) => "compute_90",
        (10, 0) => "compute_100",
        (12, 0) => "compute_120",
        (m, _) if m >= 10 => "compute_90",
        _ => "compute_80",
    }
}

/// The sizes of `function`'s parameters, in order; None where the driver cannot say.
fn param_sizes(function: &CudaFunction) -> Option<Vec<usize>> {
    // A kernel of this file takes a few dozen arguments at most.
    const MOST: usize = 64;
    let mut sizes = Vec::new();
    for index in 0..MOST {
        let (mut offset, mut size) = (0usize, 0usize);
        // SAFETY: the function handle is live (borrowed from its loaded module) and both
        // out-pointers point at locals.
        let result = unsafe {
            cudarc::driver::sys::cuFuncGetParamInfo(
                function.cu_function(),
                index,
                &raw mut offset,
                &raw mut size,
            )
        };
        match result {
            cudarc::driver::sys::CUresult::CUDA_SUCCESS => sizes.push(size),
            // Past the last parameter.
            cudarc::driver::sys::CUresult::CUDA_ERROR_INVALID_VALUE => return Some(sizes),
            _ => return None,
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hopper_compiles_for_its_own_architecture() {
        assert_eq!(ptx_arch(9, 0), "compute_90");
        assert_eq!(ptx_arch(8, 6), "compute_86");
        assert_eq!(ptx_arch(11, 0), "compute_90");
    }

    #[test]
    fn every_kernel_name_is_defined_in_the_source() {
        for name in KERNEL_NAMES {
            let needle = format!(" {name}(");
            assert!(
                KERNELS
                    .lines()
                    .any(|line| line.contains("__global__") && line.contains(&needle)),
                "{name} is not in kernels.cu"
            );
        }
    }
}
