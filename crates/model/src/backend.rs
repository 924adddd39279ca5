//! The compute boundary. `Model<B>` (inference, `model.rs`) and its training passes
//! (`train.rs`) hold every parameter, activation and cache in `B::Buf` and touch them only
//! through this trait: they never index a buffer, never spawn threads, never read
//! device memory except the results they return (logits, log-probabilities).
//!
//! [`Cpu`](crate::ops::Cpu) (host `Vec<f32>`, rayon, matrixmultiply, AVX2 block kernels)
//! is the implementation and the reference. A CUDA backend (cudarc) implements this trait
//! with `Buf = CudaSlice<f32>`; `Model::<Cpu>::to_backend` moves a loaded model onto it.
//!
//! Conventions: row-major f32; N tokens, C hidden, KV = nkv·hd, I intermediate,
//! V vocabulary, O/I outputs/inputs of a linear layer (W stored (O, I) as in PyTorch).
//! "Overwrites" kernels replace `out`; "accumulates" kernels add into gradients, so
//! gradients of parameters used twice (tied head) sum without extra code.

use std::fmt::Debug;
use std::ops::Range;

use crate::ops::PackedMatrix;

/// One sequence's rows in a batch of concatenated sequences: (first row, length).
pub type Span = (usize, usize);

/// One sequence's new tokens in a forward pass with a KV cache: rows `rows` of the step's
/// q, k, v and out are its positions `start..start + rows.len()`.
#[derive(Debug)]
pub struct KvRows<'a, Kv> {
    pub kv: &'a mut Kv,
    pub rows: Range<usize>,
    pub start: usize,
}

/// Where [`Backend::qkv_split_rope`] also puts the new keys and values: layer `layer` of
/// the step's caches, as [`Backend::kv_write`] would.
pub struct CacheWrite<'s, 'a, Step, Kv> {
    pub layer: usize,
    pub step: &'s Step,
    pub seqs: &'s mut [KvRows<'a, Kv>],
}

/// One AdamW update's constants.
#[derive(Clone, Copy, Debug)]
pub struct AdamStep {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    /// Bias corrections 1 − β₁ᵗ and 1 − β₂ᵗ.
    pub correction1: f32,
    pub correction2: f32,
}

/// One product of [`Backend::matmul_forward_shared`]: out (N, O) = x · Wᵀ + b.
#[derive(Debug)]
pub struct Product<'a, Buf> {
    pub out: &'a mut Buf,
    pub w: &'a Buf,
    pub bias: Option<&'a Buf>,
    pub o: usize,
}

/// One product of [`Backend::matmul_packed_shared`]: out (N, O) = x · Wᵀ + b, W in the
/// backend's block (or frozen) form.
#[derive(Debug)]
pub struct PackedProduct<'a, Buf, P> {
    pub out: &'a mut Buf,
    pub w: &'a P,
    pub bias: Option<&'a Buf>,
}

/// One product's gradients in [`Backend::matmul_backward_shared`]: dw (O, I), db (O) from
/// its output's gradient dout (N, O).
#[derive(Debug)]
pub struct ProductGrad<'a, Buf> {
    pub dw: &'a mut Buf,
    pub db: Option<&'a mut Buf>,
    pub dout: &'a Buf,
    pub w: &'a Buf,
    pub o: usize,
}

/// Why a backend's queued work failed, in words that name the cause and what to do.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct BackendError {
    pub kind: BackendErrorKind,
    pub message: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendErrorKind {
    /// The work needs more device memory than there is: retrying the same work fails again.
    OutOfMemory,
    /// A driver or library failure.
    Device,
}

pub trait Backend: Clone + Debug + Send + Sync + 'static {
    /// An f32 buffer in the backend's memory.
    type Buf: Clone + Debug + Send + Sync;
    /// A linear layer's weights in a block format (quantized) for small-batch products.
    type Packed: Clone + Debug + Send + Sync;
    /// One sequence's keys and values in every layer, as this backend keeps them (the CPU:
    /// a growing buffer per layer; CUDA: blocks of a shared pool). A clone is a fork: it
    /// holds the same positions, and what either writes later the other does not see.
    type Kv: Clone + Debug + Send + Sync;
    /// What a forward pass's cache writes and attention read, prepared once per pass
    /// ([`Self::kv_prepare`]) and used by every layer.
    type KvStep: Send;

    fn name(&self) -> &'static str;

    /// Waits for queued work and reports the first failure since the backend was opened.
    /// Kernels return nothing, so a device backend keeps a failure until it is asked here;
    /// callers check after a forward pass or a step, before trusting or saving results.
    fn check(&self) -> Result<(), BackendError> {
        Ok(())
    }

    // ---- memory ----
    fn zeros(&self, len: usize) -> Self::Buf;
    fn upload(&self, host: &[f32]) -> Self::Buf;
    fn download(&self, buf: &Self::Buf) -> Vec<f32>;
    fn len(&self, buf: &Self::Buf) -> usize;
    /// A host block-format matrix in this backend's form; None when it has no kernel for it.
    fn pack(&self, host: &PackedMatrix) -> Option<Self::Packed>;
    /// A linear layer's (rows, cols) weights in the form this backend's products read
    /// fastest, for weights that no longer change (a version being served); None where the
    /// plain product already reads `w` as it is. The product's numbers do not change.
    fn freeze(&self, w: &Self::Buf, rows: usize, cols: usize) -> Option<Self::Packed> {
        let _ = (w, rows, cols);
        None
    }
    /// Linear layers that read one input (q, k and v; gate and up) frozen as one matrix,
    /// their rows stacked in order (Σ rows, cols), so that one product gives all of them
    /// side by side in each output row; None where the backend has no such form (the
    /// default). `parts`: each layer's weights and rows.
    fn freeze_stacked(&self, parts: &[(&Self::Buf, usize)], cols: usize) -> Option<Self::Packed> {
        let _ = (parts, cols);
        None
    }
    /// An empty cache for `layers` layers of `kv_dim` (nkv·hd) keys and values a position.
    fn kv_new(&self, layers: usize, kv_dim: usize) -> Self::Kv;
    /// Forgets every position from `len` on (for prefix reuse).
    fn kv_truncate(&self, kv: &mut Self::Kv, len: usize);
    /// Readies a forward pass: room in every cache for its new positions (each cache holds
    /// exactly its first `start` positions). A backend that finds no room records
    /// `OutOfMemory` for [`Self::check`], as a failed allocation does.
    fn kv_prepare(&self, seqs: &mut [KvRows<'_, Self::Kv>]) -> Self::KvStep;
    /// Layer `layer`'s keys and values of the new rows (k, v: (N, kv_dim)) into each
    /// sequence's cache at its positions.
    fn kv_write(
        &self,
        layer: usize,
        step: &Self::KvStep,
        seqs: &mut [KvRows<'_, Self::Kv>],
        k: &Self::Buf,
        v: &Self::Buf,
    );
    /// out row r = x row rows[r]; rows of c elements. Overwrites.
    fn gather_rows(&self, out: &mut Self::Buf, x: &Self::Buf, rows: &[usize], c: usize);
    /// x += y
    fn add_assign(&self, x: &mut Self::Buf, y: &Self::Buf);
    /// x *= factor
    fn scale(&self, x: &mut Self::Buf, factor: f32);
    /// Σ x² over every buffer of `xs`, accumulated in f64 (one answer for all: a device
    /// backend waits once, not once per tensor).
    fn sum_squares(&self, xs: &[&Self::Buf]) -> f64;

    /// Runs `f` where this backend's kernels are cheapest to issue (the CPU backend's
    /// thread pool); identity elsewhere.
    fn scope<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        f()
    }

    /// Runs `step`, one decode step's forward (every sequence one new token), as this
    /// backend repeats such steps fastest: CUDA replays a graph kept under `key`. `step`
    /// must start each call from the same state (it may run more than once).
    fn graphed(&self, _key: u64, step: &mut dyn FnMut() -> Self::Buf) -> Self::Buf {
        step()
    }

    // ---- kernels ----
    /// out (N, C) = table rows of tokens. table: (V, C). Overwrites.
    fn embedding_forward(&self, out: &mut Self::Buf, table: &Self::Buf, tokens: &[u32]);
    /// dtable rows of tokens += dout rows. Accumulates.
    fn embedding_backward(&self, dtable: &mut Self::Buf, dout: &Self::Buf, tokens: &[u32]);

    /// out = x · rstd · w per row; rstd (N) keeps 1/rms. x, out: (N, C); w: (C). Overwrites.
    /// The row is w's length: Qwen3's per-head q/k norms pass (N, nh·hd) as (N·nh, hd).
    fn rmsnorm_forward(
        &self,
        out: &mut Self::Buf,
        rstd: &mut Self::Buf,
        x: &Self::Buf,
        w: &Self::Buf,
        eps: f32,
    );
    /// x += y, then out = rmsnorm(x) as [`Self::rmsnorm_forward`]: a residual add and the
    /// next norm, which a device backend fuses into one pass.
    fn add_rmsnorm_forward(
        &self,
        x: &mut Self::Buf,
        y: &Self::Buf,
        out: &mut Self::Buf,
        rstd: &mut Self::Buf,
        w: &Self::Buf,
        eps: f32,
    ) {
        self.add_assign(x, y);
        self.rmsnorm_forward(out, rstd, x, w, eps);
    }
    /// dx, dw += from dout. Accumulates.
    fn rmsnorm_backward(
        &self,
        dx: &mut Self::Buf,
        dw: &mut Self::Buf,
        dout: &Self::Buf,
        x: &Self::Buf,
        w: &Self::Buf,
        rstd: &Self::Buf,
    );

    /// out (N, O) = x (N, I) · Wᵀ + b. Overwrites.
    #[allow(clippy::too_many_arguments)]
    fn matmul_forward(
        &self,
        out: &mut Self::Buf,
        x: &Self::Buf,
        w: &Self::Buf,
        bias: Option<&Self::Buf>,
        n: usize,
        i: usize,
        o: usize,
    );
    /// The same product with each row of out computed by one fixed arithmetic, whatever N
    /// is (inference: a sequence's result must not depend on its batch). The default is
    /// `matmul_forward`, for backends whose product already is.
    #[allow(clippy::too_many_arguments)]
    fn matmul_rows(
        &self,
        out: &mut Self::Buf,
        x: &Self::Buf,
        w: &Self::Buf,
        bias: Option<&Self::Buf>,
        n: usize,
        i: usize,
        o: usize,
    ) {
        self.matmul_forward(out, x, w, bias, n, i, o);
    }
    /// The same product from block-format weights (O, I), each row computed as
    /// `matmul_rows` does. Overwrites.
    fn matmul_packed(
        &self,
        out: &mut Self::Buf,
        x: &Self::Buf,
        w: &Self::Packed,
        bias: Option<&Self::Buf>,
        n: usize,
    );
    /// Several products of one input x (N, I) — q, k and v of one normed hidden state; gate
    /// and up — each overwriting its `out`. By default one `matmul_forward` each; a backend
    /// may read (or convert) x once for all of them.
    fn matmul_forward_shared(
        &self,
        x: &Self::Buf,
        n: usize,
        i: usize,
        products: &mut [Product<'_, Self::Buf>],
    ) {
        for p in products {
            self.matmul_forward(p.out, x, p.w, p.bias, n, i, p.o);
        }
    }
    /// [`Self::matmul_packed`] for several products of one input x (q, k and v; gate and
    /// up), each row computed as `matmul_packed` does. By default one call each; a backend
    /// may read (or convert) x once for all of them.
    fn matmul_packed_shared(
        &self,
        x: &Self::Buf,
        n: usize,
        products: &mut [PackedProduct<'_, Self::Buf, Self::Packed>],
    ) {
        for p in products {
            self.matmul_packed(p.out, x, p.w, p.bias, n);
        }
    }
    /// The backward of [`Self::matmul_forward_shared`]: dx += Σ dout·W over the products,
    /// and each product's dw, db as `matmul_backward` gives them. Accumulates.
    fn matmul_backward_shared(
        &self,
        dx: &mut Self::Buf,
        x: &Self::Buf,
        n: usize,
        i: usize,
        grads: &mut [ProductGrad<'_, Self::Buf>],
    ) {
        for g in grads {
            self.matmul_backward(dx, g.dw, g.db.as_deref_mut(), g.dout, x, g.w, n, i, g.o);
        }
    }
    /// dx += dout · W; dw += doutᵀ · x; db += Σ_rows dout. Accumulates.
    #[allow(clippy::too_many_arguments)]
    fn matmul_backward(
        &self,
        dx: &mut Self::Buf,
        dw: &mut Self::Buf,
        db: Option<&mut Self::Buf>,
        dout: &Self::Buf,
        x: &Self::Buf,
        w: &Self::Buf,
        n: usize,
        i: usize,
        o: usize,
    );

    /// Rotary embedding in place (`rotate_half` layout). x: (N, heads, hd); positions (N);
    /// inv_freq (hd/2). sign −1 applies the inverse rotation (the backward pass).
    fn rope_apply(
        &self,
        x: &mut Self::Buf,
        heads: usize,
        positions: &[usize],
        inv_freq: &[f32],
        sign: f32,
    );

    /// q (N, nh·hd), k and v (N, nkv·hd) from the product of stacked q, k and v weights
    /// (`qkv`: (N, nh·hd + 2·nkv·hd)), each with its bias, q and k rotated at `positions` and
    /// scaled by `factor`: what separate products, `rope_apply` and `scale` give; then, with
    /// `cache`, k and v into each sequence's cache as `kv_write` puts them. Overwrites. By
    /// default through the host (a backend that stacks does it all in one pass).
    #[allow(clippy::too_many_arguments)]
    fn qkv_split_rope(
        &self,
        (q, k, v): (&mut Self::Buf, &mut Self::Buf, &mut Self::Buf),
        qkv: &Self::Buf,
        biases: [Option<&Self::Buf>; 3],
        (heads, kv_heads, hd): (usize, usize, usize),
        positions: &[usize],
        inv_freq: &[f32],
        factor: f32,
        cache: Option<CacheWrite<'_, '_, Self::KvStep, Self::Kv>>,
    ) {
        let host = self.download(qkv);
        let widths = [heads * hd, kv_heads * hd, kv_heads * hd];
        let mut parts = split_columns(&host, &widths).into_iter();
        for ((out, bias), width) in [&mut *q, &mut *k, &mut *v]
            .into_iter()
            .zip(biases)
            .zip(widths)
        {
            let mut part = parts.next().unwrap_or_default();
            if let Some(bias) = bias {
                let bias = self.download(bias);
                for row in part.chunks_mut(width) {
                    row.iter_mut().zip(&bias).for_each(|(x, b)| *x += b);
                }
            }
            *out = self.upload(&part);
        }
        self.rope_apply(q, heads, positions, inv_freq, 1.0);
        self.rope_apply(k, kv_heads, positions, inv_freq, 1.0);
        if factor != 1.0 {
            self.scale(q, factor);
            self.scale(k, factor);
        }
        if let Some(cache) = cache {
            self.kv_write(cache.layer, cache.step, cache.seqs, k, v);
        }
    }
    /// out = silu(gate) · up (N, I) from the product of stacked gate and up weights
    /// (`gate_up`: (N, 2·I)); what `swiglu_forward` gives on separate products. Overwrites.
    /// By default through the host (a backend that stacks does it in one pass).
    fn swiglu_stacked(&self, out: &mut Self::Buf, gate_up: &Self::Buf, i_dim: usize) {
        let host = self.download(gate_up);
        let mut parts = split_columns(&host, &[i_dim, i_dim]).into_iter();
        let (gate, up) = (
            parts.next().unwrap_or_default(),
            parts.next().unwrap_or_default(),
        );
        self.swiglu_forward(out, &self.upload(&gate), &self.upload(&up));
    }

    /// out (N, I) = silu(gate) · up of the stacked product x (N, C) · [W_gate; W_up]ᵀ, as
    /// `matmul_packed` into `gate_up` (N, 2·I) then `swiglu_stacked` give it. A backend may
    /// fuse the two and leave `gate_up` unwritten. Overwrites `out`.
    fn matmul_packed_swiglu(
        &self,
        out: &mut Self::Buf,
        gate_up: &mut Self::Buf,
        x: &Self::Buf,
        w: &Self::Packed,
        n: usize,
        i_dim: usize,
    ) {
        self.matmul_packed(gate_up, x, w, None, n);
        self.swiglu_stacked(out, gate_up, i_dim);
    }

    /// out = silu(gate) · up, all (N, I). Overwrites.
    fn swiglu_forward(&self, out: &mut Self::Buf, gate: &Self::Buf, up: &Self::Buf);
    /// dgate, dup += from dout. Accumulates.
    fn swiglu_backward(
        &self,
        dgate: &mut Self::Buf,
        dup: &mut Self::Buf,
        dout: &Self::Buf,
        gate: &Self::Buf,
        up: &Self::Buf,
    );

    /// Causal grouped-query attention of each span on its own, flash-style: q, out:
    /// (N, nh, hd); k, v: (N, nkv, hd); lse: (N, nh), the log-sum-exp of each row's scaled
    /// scores. No (T, T) probabilities are kept: the backward rebuilds them from q, k and
    /// lse. Overwrites.
    #[allow(clippy::too_many_arguments)]
    fn attention_forward(
        &self,
        out: &mut Self::Buf,
        lse: &mut Self::Buf,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        spans: &[Span],
        heads: usize,
        kv_heads: usize,
        hd: usize,
    );
    /// dq, dk, dv += from dout, given the forward's output `out` and `lse`. Accumulates.
    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
        &self,
        dq: &mut Self::Buf,
        dk: &mut Self::Buf,
        dv: &mut Self::Buf,
        dout: &Self::Buf,
        out: &Self::Buf,
        lse: &Self::Buf,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        spans: &[Span],
        heads: usize,
        kv_heads: usize,
        hd: usize,
    );
    /// Every new row of q (N, nh, hd) attends over its sequence's layer-`layer` cache up to
    /// and including its own position (written by [`Self::kv_write`]); writes the same rows
    /// of out. k and v are the rows that write took: a backend may attend over them
    /// directly where a sequence's cache started empty this pass (a fresh prompt).
    #[allow(clippy::too_many_arguments)]
    fn kv_attention(
        &self,
        layer: usize,
        step: &Self::KvStep,
        out: &mut Self::Buf,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        seqs: &[KvRows<'_, Self::Kv>],
        heads: usize,
        kv_heads: usize,
        hd: usize,
    );

    /// The head without materializing (N, V) logits: per row of h (N, C), with logits
    /// z = h · Wᵀ (W: (V, C)), writes lse = log Σ exp z, the entropy of softmax z, and
    /// z[target] − lse (0 where there is no target).
    #[allow(clippy::too_many_arguments)]
    fn head_forward(
        &self,
        lse: &mut Self::Buf,
        entropy: &mut Self::Buf,
        logprob: &mut Self::Buf,
        h: &Self::Buf,
        w: &Self::Buf,
        targets: &[Option<u32>],
        c: usize,
        vocab: usize,
    );
    /// dh, dw += the gradient of Σ d_logprob·logprob + d_entropy·entropy (per row,
    /// host slices of N) through the head. Accumulates.
    #[allow(clippy::too_many_arguments)]
    fn head_backward(
        &self,
        dh: &mut Self::Buf,
        dw: &mut Self::Buf,
        h: &Self::Buf,
        w: &Self::Buf,
        lse: &Self::Buf,
        entropy: &Self::Buf,
        targets: &[Option<u32>],
        d_logprob: &[f32],
        d_entropy: &[f32],
        c: usize,
        vocab: usize,
    );

    /// One AdamW step on one tensor; weight decay as given (0 for norms and biases).
    fn adamw(
        &self,
        param: &mut Self::Buf,
        grad: &Self::Buf,
        m: &mut Self::Buf,
        v: &mut Self::Buf,
        step: AdamStep,
    );
}

/// Rows of `widths` side by side (each row of `x` is Σ widths long) as one row-major
/// matrix per width.
fn split_columns(x: &[f32], widths: &[usize]) -> Vec<Vec<f32>> {
    let row: usize = widths.iter().sum();
    let mut parts: Vec<Vec<f32>> = widths.iter().map(|_| Vec::new()).collect();
    for r in x.chunks(row.max(1)) {
        let mut from = 0;
        for (part, &w) in parts.iter_mut().zip(widths) {
            part.extend_from_slice(&r[from..from + w]);
            from += w;
        }
    }
    parts
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::Cpu;

    fn values(len: usize, seed: u32) -> Vec<f32> {
        (0..len)
            .map(|i| (((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 1000) as f32 / 500.0 - 1.0)
            .collect()
    }

    /// The stacked forms' default split (what a backend without its own kernel runs)
    /// gives what separate products, bias adds, RoPE and scaling give.
    #[test]
    fn stacked_products_split_as_separate_ones() {
        let (n, heads, kv_heads, hd, i_dim) = (3, 4, 2, 8, 6);
        let (qd, kvd) = (heads * hd, kv_heads * hd);
        let (q0, k0, v0) = (values(n * qd, 1), values(n * kvd, 2), values(n * kvd, 3));
        let (bq, bk, bv) = (values(qd, 4), values(kvd, 5), values(kvd, 6));
        let qkv: Vec<f32> = (0..n)
            .flat_map(|r| {
                [
                    &q0[r * qd..(r + 1) * qd],
                    &k0[r * kvd..(r + 1) * kvd],
                    &v0[r * kvd..(r + 1) * kvd],
                ]
                .concat()
            })
            .collect();
        let positions = [0, 5, 17];
        let inv_freq: Vec<f32> = (0..hd / 2)
            .map(|i| 1.0 / 10_000f32.powf(2.0 * i as f32 / hd as f32))
            .collect();
        let be = Cpu;
        let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
        be.qkv_split_rope(
            (&mut q, &mut k, &mut v),
            &qkv,
            [Some(&bq), Some(&bk), None],
            (heads, kv_heads, hd),
            &positions,
            &inv_freq,
            0.5,
            None,
        );
        let with_bias = |x: &[f32], b: &[f32]| -> Vec<f32> {
            x.chunks(b.len())
                .flat_map(|r| r.iter().zip(b).map(|(x, b)| x + b))
                .collect()
        };
        let (mut want_q, mut want_k) = (with_bias(&q0, &bq), with_bias(&k0, &bk));
        be.rope_apply(&mut want_q, heads, &positions, &inv_freq, 1.0);
        be.rope_apply(&mut want_k, kv_heads, &positions, &inv_freq, 1.0);
        be.scale(&mut want_q, 0.5);
        be.scale(&mut want_k, 0.5);
        assert_eq!(q, want_q);
        assert_eq!(k, want_k);
        assert_eq!(v, v0, "v has no bias here");
        let _ = bv;

        let (gate, up) = (values(n * i_dim, 7), values(n * i_dim, 8));
        let gate_up: Vec<f32> = (0..n)
            .flat_map(|r| {
                [
                    &gate[r * i_dim..(r + 1) * i_dim],
                    &up[r * i_dim..(r + 1) * i_dim],
                ]
                .concat()
            })
            .collect();
        let (mut act, mut want) = (vec![0.0; n * i_dim], vec![0.0; n * i_dim]);
        be.swiglu_stacked(&mut act, &gate_up, i_dim);
        be.swiglu_forward(&mut want, &gate, &up);
        assert_eq!(act, want);
    }
}
