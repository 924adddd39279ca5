//! Matrix products on cuBLAS — and forward products of a few rows on `gemv_bf16`
//! (kernels.cu) — operands converted to bf16, products accumulated in f32
//! (`CUBLAS_COMPUTE_32F`) into f32 outputs. Row-major (N, I) · (O, I)ᵀ products are issued as
//! their column-major transposes, so no operand is ever transposed in memory:
//!
//! - forward  out (N, O)  = x (N, I) · Wᵀ      ⇔ gemm(T, N, O, N, I)
//! - backward dx (N, I)  += dout (N, O) · W    ⇔ gemm(N, N, I, N, O), β = 1
//! - backward dW (O, I)  += doutᵀ · x (N, I)   ⇔ gemm(N, T, I, O, N), β = 1

use std::ffi::c_void;
use std::sync::atomic::Ordering;

use cudarc::cublas::sys::{cublasComputeType_t, cublasOperation_t, cudaDataType};
use cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig};

use super::{Arg, Cuda, CudaError, GpuBuf, args};

/// Products of at most this many rows run on `gemv_bf16` (kernels.cu's `GEMV_ROWS`).
pub(super) const GEMV_ROWS: usize = 8;

/// Warps each of `groups` tiles of 16 columns of a product with rows of `i` gets on
/// `multiprocessors` (see `Cuda::gemv_split`).
fn gemv_split(multiprocessors: usize, i: usize, groups: usize) -> usize {
    let (fill, kblocks) = (2 * multiprocessors, i.div_ceil(64));
    let mut split = 1;
    while split < 8 && groups * split / 8 < fill && 2 * split <= kblocks {
        split *= 2;
    }
    split
}

/// A `gemv_bf16*` launch: 256 threads, 8 / split tiles of 16 columns a block.
fn gemv_blocks(groups: usize, split: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((groups * split).div_ceil(8) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

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

    /// The address of the buffer the kept twin rounds, if one is kept.
    pub(super) fn twin_of(&self) -> Option<u64> {
        self.twin_slot().as_ref().map(|t| t.of)
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

    /// out (N, O) = x (N, I) · Wᵀ (+ bias (O)) from bf16 operands: `gemv_bf16` for a few
    /// rows, cuBLAS and a bias launch for more. Overwrites.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn product_forward(
        &self,
        out: u64,
        x: &Bf16,
        w: &Bf16,
        bias: Option<u64>,
        n: usize,
        i: usize,
        o: usize,
    ) {
        // A warp (group) of gemv_bf16 takes a tile of 16 columns.
        let tiles = o.div_ceil(16);
        if let Some(split) = self.gemv_split(x, w, n, i, tiles) {
            let (xp, wp, bp) = (x.ptr(self), w.ptr(self), bias.unwrap_or(0));
            let (n32, i32_, o32, s32) = (n as i32, i as i32, o as i32, split as i32);
            self.launch_reading_twin(
                "gemv_bf16",
                gemv_blocks(tiles, split),
                args![out, xp, wp, bp, n32, i32_, o32, s32],
                out,
            );
            return;
        }
        self.gemm_bf16_forward(out, x, w, n, i, o);
        if let Some(bias) = bias {
            // x may be the last output's twin, which further products of it still read.
            let (n32, o32) = (n as i32, o as i32);
            let cfg = super::elementwise(n * o);
            self.launch_reading_twin("add_bias", cfg, args![out, bias, n32, o32], out);
        }
    }

    /// out (N, I) = silu(x · W_gateᵀ) · (x · W_upᵀ) from the stacked W (2·I, K), with its bf16
    /// twin, in one `gemv_bf16_swiglu` pass; false (nothing done) where the rows are too many
    /// for it.
    pub(super) fn swiglu_product(
        &self,
        out: &GpuBuf,
        x: &Bf16,
        w: &Bf16,
        n: usize,
        k: usize,
    ) -> bool {
        let inner = out.len / n.max(1);
        let tiles = inner.div_ceil(16);
        let Some(split) = self.gemv_split(x, w, n, k, tiles) else {
            return false;
        };
        let twin = self.bf16_alloc(out.len);
        let (op, tp, xp, wp) = (out.ptr(0), twin.ptr(self), x.ptr(self), w.ptr(self));
        let (n32, k32, inner32, s32) = (n as i32, k as i32, inner as i32, split as i32);
        self.launch_reading_twin(
            "gemv_bf16_swiglu",
            gemv_blocks(tiles, split),
            args![op, tp, xp, wp, n32, k32, inner32, s32],
            op,
        );
        self.keep_twin(out, twin);
        true
    }

    /// How many warps `gemv_bf16` gives each of `groups` tiles of 16 columns for an
    /// (n, i) · (·, i)ᵀ product, or None where cuBLAS takes it: more than `GEMV_ROWS` rows,
    /// a shape or address the kernel's 16-byte loads cannot take, or `ARL_CUDA_GEMV=0`. The
    /// split grows while the blocks are too few to fill the device twice and every warp
    /// still has a K-block of 64; it depends on the shape and the device only, never on n
    /// (see kernels.cu).
    fn gemv_split(&self, x: &Bf16, w: &Bf16, n: usize, i: usize, groups: usize) -> Option<usize> {
        let usable = (1..=GEMV_ROWS).contains(&n)
            && i.is_multiple_of(8)
            && i32::try_from(i.max(16 * groups)).is_ok()
            && x.ptr(self).is_multiple_of(16)
            && w.ptr(self).is_multiple_of(16)
            && self.device.gemv_on.load(Ordering::Relaxed);
        if !usable {
            return None;
        }
        Some(gemv_split(self.device.info.multiprocessors, i, groups))
    }

    /// out (N, O) = x (N, I) · Wᵀ from bf16 operands on cuBLAS. Overwrites.
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
        if self.twin_of() == Some(c) {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_rows_of_few_columns_split_across_warps() {
        // An H100's 132 multiprocessors and Qwen2.5-0.5B's decode products, in tiles of 16.
        assert_eq!(gemv_split(132, 896, 72), 8, "q/k/v: 72 tiles, 14 K-blocks");
        assert_eq!(gemv_split(132, 4864, 56), 8, "down: 56 tiles, 76 K-blocks");
        assert_eq!(gemv_split(132, 896, 9_496), 1, "the head fills the device");
        assert_eq!(gemv_split(132, 128, 8), 2, "a K-block a warp at least");
    }

    #[test]
    fn the_row_limit_is_the_kernels() {
        let define = format!("#define GEMV_ROWS {GEMV_ROWS}\n");
        assert!(
            super::super::device::KERNELS.contains(&define),
            "kernels.cu: {define}"
        );
    }
}
