//! Matrix products on cuBLAS: operands converted to bf16, products accumulated in f32
//! (`CUBLAS_COMPUTE_32F`) into f32 outputs. Row-major (N, I) · (O, I)ᵀ products are issued as
//! their column-major transposes, so no operand is ever transposed in memory:
//!
//! - forward  out (N, O)  = x (N, I) · Wᵀ      ⇔ gemm(T, N, O, N, I)
//! - backward dx (N, I)  += dout (N, O) · W    ⇔ gemm(N, N, I, N, O), β = 1
//! - backward dW (O, I)  += doutᵀ · x (N, I)   ⇔ gemm(N, T, I, O, N), β = 1

use std::ffi::c_void;

use cudarc::cublas::sys::{cublasComputeType_t, cublasOperation_t, cudaDataType};
use cudarc::driver::{CudaSlice, DevicePtr};

use super::{Arg, Cuda, CudaError, GpuBuf, args};

/// A bf16 copy of (part of) a buffer, for one product: its own allocation, or a view of a
/// graphed step's arena (`view`, its address).
pub(super) struct Bf16 {
    slice: Option<CudaSlice<u16>>,
    view: u64,
}

impl Bf16 {
    /// No buffer (a kernel's optional bf16 output left out).
    pub(super) fn none() -> Self {
        Self {
            slice: None,
            view: 0,
        }
    }

    pub(super) fn ptr(&self, cuda: &Cuda) -> u64 {
        self.slice
            .as_ref()
            .map_or(self.view, |s| s.device_ptr(&cuda.device.stream).0)
    }
}

/// The bf16 rounding of the last kernel's output (`of`, `len` floats), written by that
/// kernel beside its f32 output (`keep_twin`) for the products that read it next, so that
/// they need no conversion launch of their own. Valid until the next launch or copy, which
/// drop it first thing: nothing can have written `of` in between. A gemm writes only its
/// own output, and drops the twin if that is `of`.
pub(super) struct Twin {
    of: u64,
    len: usize,
    bf16: Bf16,
}

impl Cuda {
    /// Keeps `twin`, just written by the last launch as the bf16 rounding of `out`.
    pub(super) fn keep_twin(&self, out: &GpuBuf, twin: Bf16) {
        if twin.ptr(self) != 0 {
            *self.twin_slot() = Some(Twin {
                of: out.ptr(0),
                len: out.len,
                bf16: twin,
            });
        }
    }

    pub(super) fn drop_twin(&self) {
        // Dropping an owned twin frees it in stream order, after the products that read it.
        self.twin_slot().take();
    }

    fn twin_slot(&self) -> std::sync::MutexGuard<'_, Option<Twin>> {
        self.device
            .twin
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// bf16 of x[offset..offset + len]: the last output's twin when that is all of x, else
    /// a conversion.
    pub(super) fn bf16(&self, x: &GpuBuf, offset: usize, len: usize) -> Bf16 {
        if offset == 0
            && let Some(twin) = self.twin_slot().as_ref()
            && twin.of == x.ptr(0)
            && twin.len == len
        {
            return Bf16 {
                slice: None,
                view: twin.bf16.ptr(self),
            };
        }
        let copy = self.bf16_alloc(len);
        let out = copy.ptr(self);
        if out != 0 {
            let (xp, len64) = (x.ptr(offset), len as i64);
            let cfg = super::elementwise(len.div_ceil(4));
            self.launch("to_bf16", cfg, args![out, xp, len64]);
        }
        copy
    }

    /// Room for `len` bf16 values (written by the caller's kernel before any read).
    pub(super) fn bf16_alloc(&self, len: usize) -> Bf16 {
        let none = Bf16::none();
        if len == 0 || !self.ok() {
            return none;
        }
        if let Some(view) = self.arena_alloc(len * 2, false) {
            return Bf16 { slice: None, view };
        }
        // SAFETY: every caller launches a kernel that writes all `len` elements before any
        // product reads them.
        match unsafe { self.device.stream.alloc::<u16>(len) } {
            Ok(slice) => Bf16 {
                slice: Some(slice),
                view: 0,
            },
            Err(e) => {
                self.fail(match super::device::driver("a bf16 copy")(e) {
                    CudaError::OutOfMemory { what, .. } => CudaError::OutOfMemory {
                        what,
                        bytes: len * 2,
                    },
                    other => other,
                });
                none
            }
        }
    }

    /// x[offset..offset + len] as hi + lo, both bf16: 16 significant bits for operands
    /// whose rounding would compound (gradients flowing back through the layers).
    pub(super) fn bf16_split(&self, x: &GpuBuf, offset: usize, len: usize) -> (Bf16, Bf16) {
        let (hi, lo) = (self.bf16_alloc(len), self.bf16_alloc(len));
        let (hp, lp) = (hi.ptr(self), lo.ptr(self));
        if hp == 0 || lp == 0 {
            return (hi, lo);
        }
        let (xp, len64) = (x.ptr(offset), len as i64);
        self.launch(
            "to_bf16_split",
            super::elementwise(len.div_ceil(4)),
            args![hp, lp, xp, len64],
        );
        (hi, lo)
    }

    /// dx (N, I) += dout (N, O) · W (O, I), with dout as hi + lo (see `bf16_split`).
    pub(super) fn gemm_dx_split(
        &self,
        dx: u64,
        dout: &(Bf16, Bf16),
        w: &Bf16,
        n: usize,
        i: usize,
        o: usize,
    ) {
        self.gemm_dx(dx, &dout.0, w, n, i, o);
        self.gemm_dx(dx, &dout.1, w, n, i, o);
    }

    /// out (N, O) = x (N, I) · Wᵀ from bf16 operands. Overwrites.
    pub(super) fn gemm_bf16_forward(
        &self,
        out: u64,
        x: &Bf16,
        w: &Bf16,
        n: usize,
        i: usize,
        o: usize,
    ) {
        let (a, b) = (w.ptr(self), x.ptr(self));
        self.gemm(
            Op::T,
            Op::N,
            (o, n, i),
            (a, i),
            (b, i),
            (out, o),
            0.0,
            "forward product",
        );
    }

    /// dx (N, I) += dout (N, O) · W (O, I).
    pub(super) fn gemm_dx(&self, dx: u64, dout: &Bf16, w: &Bf16, n: usize, i: usize, o: usize) {
        let (a, b) = (w.ptr(self), dout.ptr(self));
        self.gemm(
            Op::N,
            Op::N,
            (i, n, o),
            (a, i),
            (b, o),
            (dx, i),
            1.0,
            "input gradient",
        );
    }

    /// dW (O, I) += doutᵀ (O, N) · x (N, I).
    pub(super) fn gemm_dw(&self, dw: u64, dout: &Bf16, x: &Bf16, n: usize, i: usize, o: usize) {
        let (a, b) = (x.ptr(self), dout.ptr(self));
        self.gemm(
            Op::N,
            Op::T,
            (i, o, n),
            (a, i),
            (b, o),
            (dw, i),
            1.0,
            "weight gradient",
        );
    }

    /// Column-major C (m, n) = α·op(A)·op(B) + β·C, A and B bf16, C f32.
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        op_a: Op,
        op_b: Op,
        (m, n, k): (usize, usize, usize),
        (a, lda): (u64, usize),
        (b, ldb): (u64, usize),
        (c, ldc): (u64, usize),
        beta: f32,
        what: &'static str,
    ) {
        if !self.ok() || m == 0 || n == 0 {
            return;
        }
        if k == 0 || a == 0 || b == 0 || c == 0 {
            // An empty inner dimension adds nothing (and a missing operand is a recorded fault).
            return;
        }
        let dims = [m, n, k, lda, ldb, ldc].map(|d| i32::try_from(d).unwrap_or(i32::MAX));
        let signature = [
            4,
            op_a as u64,
            op_b as u64,
            m as u64,
            n as u64,
            k as u64,
            a,
            lda as u64,
            b,
            ldb as u64,
            c,
            ldc as u64,
            u64::from(beta.to_bits()),
        ];
        if self.twin_slot().as_ref().is_some_and(|t| t.of == c) {
            self.drop_twin();
        }
        let pass = self.note(&signature);
        if pass == super::graph::Pass::Skip {
            return;
        }
        let alpha = 1.0f32;
        let handle = if pass == super::graph::Pass::Capture {
            &self.device.capture_blas
        } else {
            &self.device.blas
        };
        let Ok(blas) = handle.lock() else {
            self.fail(CudaError::Cublas {
                what,
                reason: "the cuBLAS handle's lock was poisoned".into(),
            });
            return;
        };
        if let Err(e) = self.device.stream.context().bind_to_thread() {
            self.fail(super::device::driver("binding the context")(e));
            return;
        }
        // SAFETY: a, b and c are device addresses of live allocations holding at least
        // lda·(k or m), ldb·(n or k) and ldc·n elements of the stated types (bf16, bf16,
        // f32) — the callers derive every size from the same shapes; the handle is bound to
        // the stream all buffers are ordered on; α and β are host scalars that outlive the call.
        let result = self.timed(what, || unsafe {
            cudarc::cublas::result::gemm_ex(
                *blas.handle(),
                op_a.into(),
                op_b.into(),
                dims[0],
                dims[1],
                dims[2],
                (&raw const alpha).cast::<c_void>(),
                a as *const c_void,
                cudaDataType::CUDA_R_16BF,
                dims[3],
                b as *const c_void,
                cudaDataType::CUDA_R_16BF,
                dims[4],
                (&raw const beta).cast::<c_void>(),
                c as *mut c_void,
                cudaDataType::CUDA_R_32F,
                dims[5],
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cudarc::cublas::sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        });
        if let Err(e) = result {
            self.fail(CudaError::Cublas {
                what,
                reason: e.to_string(),
            });
        }
    }
}

#[derive(Clone, Copy)]
enum Op {
    N,
    T,
}

impl From<Op> for cublasOperation_t {
    fn from(op: Op) -> Self {
        match op {
            Op::N => cublasOperation_t::CUBLAS_OP_N,
            Op::T => cublasOperation_t::CUBLAS_OP_T,
        }
    }
}
