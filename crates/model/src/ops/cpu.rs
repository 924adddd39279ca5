//! The CPU backend: host `Vec<f32>` buffers, the kernels of this module's siblings, and
//! rayon's pool for parallelism.

use std::ops::Range;

use rayon::prelude::*;

use super::{PackedMatrix, gemm, head};
use crate::backend::{AdamStep, Backend, KvRows, Span};

#[derive(Clone, Copy, Debug, Default)]
pub struct Cpu;

type Buf = Vec<f32>;

/// The CPU's KV cache of one sequence: per layer, its keys and its values, (len, nkv, hd)
/// each in one growing buffer (decode kernels read them as plain slices).
#[derive(Clone, Debug)]
pub struct ContiguousKv {
    pub k: Vec<Buf>,
    pub v: Vec<Buf>,
    kv_dim: usize,
}

impl Backend for Cpu {
    type Buf = Vec<f32>;
    type Packed = PackedMatrix;
    type Kv = ContiguousKv;
    type KvStep = ();

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn zeros(&self, len: usize) -> Buf {
        super::zeroed(len)
    }

    fn upload(&self, host: &[f32]) -> Buf {
        host.to_vec()
    }

    fn download(&self, buf: &Buf) -> Vec<f32> {
        buf.clone()
    }

    fn len(&self, buf: &Buf) -> usize {
        buf.len()
    }

    fn pack(&self, host: &PackedMatrix) -> Option<PackedMatrix> {
        Some(host.clone())
    }

    fn kv_new(&self, layers: usize, kv_dim: usize) -> ContiguousKv {
        ContiguousKv {
            k: vec![Vec::new(); layers],
            v: vec![Vec::new(); layers],
            kv_dim,
        }
    }

    fn kv_truncate(&self, kv: &mut ContiguousKv, len: usize) {
        let keep = len * kv.kv_dim;
        for (k, v) in kv.k.iter_mut().zip(&mut kv.v) {
            k.truncate(keep);
            v.truncate(keep);
        }
    }

    fn kv_prepare(&self, _seqs: &mut [KvRows<'_, ContiguousKv>]) {}

    fn kv_write(
        &self,
        layer: usize,
        _step: &(),
        seqs: &mut [KvRows<'_, ContiguousKv>],
        k: &Buf,
        v: &Buf,
    ) {
        for s in seqs {
            let kv_dim = s.kv.kv_dim;
            debug_assert_eq!(
                s.kv.k[layer].len(),
                s.start * kv_dim,
                "writes follow the cache"
            );
            s.kv.k[layer].extend_from_slice(&k[rows_of(&s.rows, kv_dim)]);
            s.kv.v[layer].extend_from_slice(&v[rows_of(&s.rows, kv_dim)]);
        }
    }

    fn gather_rows(&self, out: &mut Buf, x: &Buf, rows: &[usize], c: usize) {
        for (dst, &row) in out.chunks_mut(c).zip(rows) {
            dst.copy_from_slice(&x[row * c..][..c]);
        }
    }

    fn add_assign(&self, x: &mut Buf, y: &Buf) {
        x.par_iter_mut()
            .with_min_len(4096)
            .zip(y.par_iter())
            .for_each(|(x, y)| *x += y);
    }

    fn scale(&self, x: &mut Buf, factor: f32) {
        x.par_iter_mut()
            .with_min_len(4096)
            .for_each(|x| *x *= factor);
    }

    fn sum_squares(&self, xs: &[&Buf]) -> f64 {
        xs.iter()
            .map(|x| {
                x.par_iter()
                    .with_min_len(4096)
                    .map(|g| f64::from(*g) * f64::from(*g))
                    .sum::<f64>()
            })
            .sum()
    }

    /// A decode step makes hundreds of small parallel calls; issued from a pool thread
    /// they are work-stolen, from outside each would be a cross-thread hand-off.
    fn scope<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        if rayon::current_thread_index().is_some() {
            return f();
        }
        rayon::join(f, || ()).0
    }

    fn embedding_forward(&self, out: &mut Buf, table: &Buf, tokens: &[u32]) {
        super::embedding_forward(out, table, tokens);
    }

    fn embedding_backward(&self, dtable: &mut Buf, dout: &Buf, tokens: &[u32]) {
        super::embedding_backward(dtable, dout, tokens);
    }

    fn rmsnorm_forward(&self, out: &mut Buf, rstd: &mut Buf, x: &Buf, w: &Buf, eps: f32) {
        super::rmsnorm_forward(out, rstd, x, w, eps);
    }

    fn rmsnorm_backward(
        &self,
        dx: &mut Buf,
        dw: &mut Buf,
        dout: &Buf,
        x: &Buf,
        w: &Buf,
        rstd: &Buf,
    ) {
        super::rmsnorm_backward(dx, dw, dout, x, w, rstd);
    }

    fn matmul_forward(
        &self,
        out: &mut Buf,
        x: &Buf,
        w: &Buf,
        bias: Option<&Buf>,
        n: usize,
        i: usize,
        o: usize,
    ) {
        gemm::matmul_forward(out, x, w, bias.map(|b| &b[..]), n, i, o);
    }

    fn matmul_rows(
        &self,
        out: &mut Buf,
        x: &Buf,
        w: &Buf,
        bias: Option<&Buf>,
        n: usize,
        i: usize,
        o: usize,
    ) {
        // sgemm's result for a row depends on how rows are blocked; the thin kernel's does not.
        gemm::matmul_rows(out, x, w, bias.map(|b| &b[..]), n, i, o);
    }

    fn matmul_packed(
        &self,
        out: &mut Buf,
        x: &Buf,
        w: &PackedMatrix,
        bias: Option<&Buf>,
        n: usize,
    ) {
        w.matmul(out, x, n);
        if let Some(b) = bias {
            gemm::add_bias(&mut out[..n * w.rows], b, w.rows);
        }
    }

    fn matmul_backward(
        &self,
        dx: &mut Buf,
        dw: &mut Buf,
        db: Option<&mut Buf>,
        dout: &Buf,
        x: &Buf,
        w: &Buf,
        n: usize,
        i: usize,
        o: usize,
    ) {
        gemm::matmul_backward(dx, dw, db.map(|b| &mut b[..]), dout, x, w, n, i, o);
    }

    fn rope_apply(
        &self,
        x: &mut Buf,
        heads: usize,
        positions: &[usize],
        inv_freq: &[f32],
        sign: f32,
    ) {
        super::rope_apply(x, heads, positions, inv_freq, sign);
    }

    fn swiglu_forward(&self, out: &mut Buf, gate: &Buf, up: &Buf) {
        super::swiglu_forward(out, gate, up);
    }

    fn swiglu_backward(&self, dgate: &mut Buf, dup: &mut Buf, dout: &Buf, gate: &Buf, up: &Buf) {
        super::swiglu_backward(dgate, dup, dout, gate, up);
    }

    fn attention_forward(
        &self,
        out: &mut Buf,
        lse: &mut Buf,
        q: &Buf,
        k: &Buf,
        v: &Buf,
        spans: &[Span],
        heads: usize,
        kv_heads: usize,
        hd: usize,
    ) {
        let (c, kv) = (heads * hd, kv_heads * hd);
        for &(start, t) in spans {
            let rows = start..start + t;
            super::attention_forward(
                &mut out[rows_of(&rows, c)],
                &mut lse[rows_of(&rows, heads)],
                &q[rows_of(&rows, c)],
                &k[rows_of(&rows, kv)],
                &v[rows_of(&rows, kv)],
                t,
                heads,
                kv_heads,
                hd,
            );
        }
    }

    fn attention_backward(
        &self,
        dq: &mut Buf,
        dk: &mut Buf,
        dv: &mut Buf,
        dout: &Buf,
        _out: &Buf,
        lse: &Buf,
        q: &Buf,
        k: &Buf,
        v: &Buf,
        spans: &[Span],
        heads: usize,
        kv_heads: usize,
        hd: usize,
    ) {
        let (c, kv) = (heads * hd, kv_heads * hd);
        for &(start, t) in spans {
            let rows = start..start + t;
            super::attention_backward(
                &mut dq[rows_of(&rows, c)],
                &mut dk[rows_of(&rows, kv)],
                &mut dv[rows_of(&rows, kv)],
                &dout[rows_of(&rows, c)],
                &lse[rows_of(&rows, heads)],
                &q[rows_of(&rows, c)],
                &k[rows_of(&rows, kv)],
                &v[rows_of(&rows, kv)],
                t,
                heads,
                kv_heads,
                hd,
            );
        }
    }

    fn kv_attention(
        &self,
        layer: usize,
        _step: &(),
        out: &mut Buf,
        q: &Buf,
        _k: &Buf,
        _v: &Buf,
        seqs: &[KvRows<'_, ContiguousKv>],
        heads: usize,
        kv_heads: usize,
        hd: usize,
    ) {
        // One parallel loop over every (row, head) of the step, not one per sequence: the
        // sequences' rows follow each other (as Model::forward lays them out).
        let first = seqs.first().map_or(0, |s| s.rows.start);
        let contiguous = seqs
            .iter()
            .scan(first, |next, s| {
                let ok = s.rows.start == *next;
                *next = s.rows.end;
                Some(ok)
            })
            .all(|ok| ok);
        if !contiguous {
            let c = heads * hd;
            for s in seqs {
                super::attention_cached(
                    &mut out[rows_of(&s.rows, c)],
                    &q[rows_of(&s.rows, c)],
                    &s.kv.k[layer],
                    &s.kv.v[layer],
                    s.start,
                    heads,
                    kv_heads,
                    hd,
                );
            }
            return;
        }
        let rows: Vec<(&ContiguousKv, usize)> = seqs
            .iter()
            .flat_map(|s| (0..s.rows.len()).map(move |i| (&*s.kv, s.start + i + 1)))
            .collect();
        // One task per (row, kv head): the heads sharing a kv head read its rows once.
        let group = heads / kv_heads;
        out[first * heads * hd..(first + rows.len()) * heads * hd]
            .par_chunks_mut(group * hd)
            .enumerate()
            .with_min_len(2)
            .for_each_init(Vec::new, |scores, (task, o)| {
                let (row, kv_head) = (task / kv_heads, task % kv_heads);
                let (kv, visible) = rows[row];
                let (k, v) = (&kv.k[layer], &kv.v[layer]);
                let qi = &q[((first + row) * kv_heads + kv_head) * group * hd..][..group * hd];
                super::attend_group(o, qi, k, v, visible, kv_head, kv_heads, hd, scores);
            });
    }

    fn head_forward(
        &self,
        lse: &mut Buf,
        entropy: &mut Buf,
        logprob: &mut Buf,
        h: &Buf,
        w: &Buf,
        targets: &[Option<u32>],
        c: usize,
        vocab: usize,
    ) {
        head::head_forward(lse, entropy, logprob, h, w, targets, c, vocab);
    }

    fn head_backward(
        &self,
        dh: &mut Buf,
        dw: &mut Buf,
        h: &Buf,
        w: &Buf,
        lse: &Buf,
        entropy: &Buf,
        targets: &[Option<u32>],
        d_logprob: &[f32],
        d_entropy: &[f32],
        c: usize,
        vocab: usize,
    ) {
        head::head_backward(
            dh, dw, h, w, lse, entropy, targets, d_logprob, d_entropy, c, vocab,
        );
    }

    fn adamw(&self, param: &mut Buf, grad: &Buf, m: &mut Buf, v: &mut Buf, s: AdamStep) {
        param
            .par_iter_mut()
            .with_min_len(1024)
            .zip(grad.par_iter())
            .zip(m.par_iter_mut())
            .zip(v.par_iter_mut())
            .for_each(|(((p, g), m), v)| {
                *m = s.beta1 * *m + (1.0 - s.beta1) * g;
                *v = s.beta2 * *v + (1.0 - s.beta2) * g * g;
                let update = (*m / s.correction1) / ((*v / s.correction2).sqrt() + s.eps);
                *p -= s.lr * (update + s.weight_decay * *p);
            });
    }
}

/// Element range of `rows` rows of width `width`.
fn rows_of(rows: &Range<usize>, width: usize) -> Range<usize> {
    rows.start * width..rows.end * width
}
