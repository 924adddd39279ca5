//! The CPU kernels: every numerical kernel the model uses, as forward/backward pairs on
//! row-major f32 slices, with shapes in comments (llm.c style). [`Cpu`] exposes them
//! through the [`Backend`](crate::backend::Backend) boundary; they are the reference a
//! CUDA backend (cudarc) must agree with.
//!
//! Notation: N tokens, C channels (hidden size), O outputs, I inputs, V vocabulary,
//! nh heads, hd head size.

mod cpu;
mod gemm;
mod head;
mod memory;
mod packed;
mod thin;

pub use cpu::{ContiguousKv, Cpu};
pub use gemm::{matmul_backward, matmul_forward};
pub use memory::{
    heap_in_use_bytes, prepare_process, retain_freed_memory, size_thread_pool, zeroed,
};
pub use packed::PackedMatrix;
pub(crate) use thin::attend_group;

use rayon::prelude::*;

/// out = x / rms(x) * w, per row. `rstd` keeps 1/rms for the backward pass.
/// x, out: (N, C); w: (C); rstd: (N)
pub fn rmsnorm_forward(out: &mut [f32], rstd: &mut [f32], x: &[f32], w: &[f32], eps: f32) {
    let c = w.len();
    out.par_chunks_mut(c)
        .zip(rstd.par_iter_mut())
        .zip(x.par_chunks(c))
        .for_each(|((o, r), x)| {
            let ms = x.iter().map(|v| v * v).sum::<f32>() / c as f32;
            let s = 1.0 / (ms + eps).sqrt();
            *r = s;
            for ((o, x), w) in o.iter_mut().zip(x).zip(w) {
                *o = x * s * w;
            }
        });
}

/// dx += d(rmsnorm)/dx · dout; dw += Σ_rows dout · x · rstd.
pub fn rmsnorm_backward(
    dx: &mut [f32],
    dw: &mut [f32],
    dout: &[f32],
    x: &[f32],
    w: &[f32],
    rstd: &[f32],
) {
    let c = w.len();
    // dx rows are independent; dw is a reduction over rows (done per thread, then summed).
    dx.par_chunks_mut(c)
        .zip(dout.par_chunks(c))
        .zip(x.par_chunks(c))
        .zip(rstd.par_iter())
        .for_each(|(((dx, dout), x), &s)| {
            // y = x*s*w; dy/dx = s*w*δ - x*s^3*(Σ dout*w*x)/C
            let dot: f32 = dout.iter().zip(w).zip(x).map(|((d, w), x)| d * w * x).sum();
            let k = s * s * s * dot / c as f32;
            for (((dx, d), w), x) in dx.iter_mut().zip(dout).zip(w).zip(x) {
                *dx += s * w * d - k * x;
            }
        });
    let partial = dout
        .par_chunks(c)
        .zip(x.par_chunks(c))
        .zip(rstd.par_iter())
        .fold(
            || vec![0f32; c],
            |mut acc, ((d, x), &s)| {
                for ((a, d), x) in acc.iter_mut().zip(d).zip(x) {
                    *a += d * x * s;
                }
                acc
            },
        )
        .reduce(
            || vec![0f32; c],
            |mut a, b| {
                a.iter_mut().zip(&b).for_each(|(a, b)| *a += b);
                a
            },
        );
    dw.iter_mut().zip(&partial).for_each(|(d, p)| *d += p);
}

/// Rotary position embedding in Hugging Face's `rotate_half` layout, in place.
/// x: (N, nh, hd); positions: (N); inv_freq: (hd/2). `sign` = -1 undoes it (backward).
pub fn rope_apply(x: &mut [f32], heads: usize, positions: &[usize], inv_freq: &[f32], sign: f32) {
    let hd = inv_freq.len() * 2;
    let half = hd / 2;
    x.par_chunks_mut(heads * hd)
        .zip(positions.par_iter())
        .for_each(|(row, &pos)| {
            let angles: Vec<(f32, f32)> = inv_freq
                .iter()
                .map(|f| {
                    let a = pos as f32 * f;
                    (a.cos(), sign * a.sin())
                })
                .collect();
            for head in row.chunks_mut(hd) {
                for (i, &(cos, sin)) in angles.iter().enumerate() {
                    let (x1, x2) = (head[i], head[i + half]);
                    head[i] = x1 * cos - x2 * sin;
                    head[i + half] = x2 * cos + x1 * sin;
                }
            }
        });
}

/// SwiGLU: out = silu(gate) * up. gate, up, out: (N, I)
pub fn swiglu_forward(out: &mut [f32], gate: &[f32], up: &[f32]) {
    out.par_iter_mut()
        .zip(gate.par_iter())
        .zip(up.par_iter())
        .for_each(|((o, g), u)| {
            *o = g / (1.0 + (-g).exp()) * u;
        });
}

/// dgate, dup += from dout.
pub fn swiglu_backward(dgate: &mut [f32], dup: &mut [f32], dout: &[f32], gate: &[f32], up: &[f32]) {
    dgate
        .par_iter_mut()
        .zip(dup.par_iter_mut())
        .zip(dout.par_iter())
        .zip(gate.par_iter())
        .zip(up.par_iter())
        .for_each(|((((dg, du), d), g), u)| {
            let sig = 1.0 / (1.0 + (-g).exp());
            let silu = g * sig;
            *du += d * silu;
            *dg += d * u * (sig * (1.0 + g * (1.0 - sig)));
        });
}

/// Causal self-attention of one sequence with grouped-query heads. Per head, the scores
/// and the weighted sum are two sgemm products (the masked upper triangle is computed and
/// discarded: at these lengths the packed SIMD kernels more than pay for it).
/// q: (T, nh, hd); k, v: (T, nkv, hd); out: (T, nh, hd); lse: (T, nh), the log-sum-exp of
/// each row's scaled scores — all the backward keeps: it recomputes the probabilities.
#[allow(clippy::too_many_arguments)]
pub fn attention_forward(
    out: &mut [f32],
    lse: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    t: usize,
    heads: usize,
    kv_heads: usize,
    hd: usize,
) {
    let group = heads / kv_heads;
    let per_head: Vec<(Vec<f32>, Vec<f32>)> = (0..heads)
        .into_par_iter()
        .map(|h| {
            let kvh = h / group;
            let mut p = vec![0f32; t * t];
            let lse_h = head_scores(&mut p, q, k, None, h, kvh, t, heads, kv_heads, hd);
            // O_h (T, hd) = P (T, T) · V_h (T, hd)
            let mut out_h = vec![0f32; t * hd];
            gemm::sgemm(
                t,
                t,
                hd,
                &p,
                t,
                1,
                &v[kvh * hd..],
                kv_heads * hd,
                1,
                &mut out_h,
                hd,
                0.0,
            );
            (out_h, lse_h)
        })
        .collect();
    for (h, (out_h, lse_h)) in per_head.iter().enumerate() {
        for i in 0..t {
            out[(i * heads + h) * hd..][..hd].copy_from_slice(&out_h[i * hd..][..hd]);
            lse[i * heads + h] = lse_h[i];
        }
    }
}

/// Head h's causal probabilities P (T, T) into `p` (0 above the diagonal). Without `lse`
/// each row is normalised and its log-sum-exp returned; with the forward's `lse` (T, nh) the
/// probabilities are rebuilt from it (the backward), and the returned vector is empty.
#[allow(clippy::too_many_arguments)]
fn head_scores(
    p: &mut [f32],
    q: &[f32],
    k: &[f32],
    lse: Option<&[f32]>,
    h: usize,
    kvh: usize,
    t: usize,
    heads: usize,
    kv_heads: usize,
    hd: usize,
) -> Vec<f32> {
    let scale = 1.0 / (hd as f32).sqrt();
    // S (T, T) = Q_h (T, hd) · K_hᵀ (hd, T)
    gemm::sgemm(
        t,
        hd,
        t,
        &q[h * hd..],
        heads * hd,
        1,
        &k[kvh * hd..],
        1,
        kv_heads * hd,
        p,
        t,
        0.0,
    );
    let mut row_lse = Vec::with_capacity(if lse.is_none() { t } else { 0 });
    for (i, row) in p.chunks_mut(t).enumerate() {
        row[..=i].iter_mut().for_each(|s| *s *= scale);
        match lse {
            None => row_lse.push(log_softmax_exp(&mut row[..=i])),
            Some(lse) => {
                let l = lse[i * heads + h];
                row[..=i].iter_mut().for_each(|s| *s = (*s - l).exp());
            }
        }
        row[i + 1..].iter_mut().for_each(|s| *s = 0.0);
    }
    row_lse
}

/// In-place softmax of one row of scores; returns its log-sum-exp.
fn log_softmax_exp(row: &mut [f32]) -> f32 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in row.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    row.iter_mut().for_each(|v| *v /= sum);
    max + sum.ln()
}

/// Attention of `t` new query rows at positions start.. over a cache of start + t keys.
/// q, out: (t, nh, hd); k, v: (start + t, nkv, hd)
#[allow(clippy::too_many_arguments)]
pub fn attention_cached(
    out: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    start: usize,
    heads: usize,
    kv_heads: usize,
    hd: usize,
) {
    // One task per (query row, kv head): the heads sharing a kv head read its rows once.
    let group = heads / kv_heads;
    out.par_chunks_mut(group * hd)
        .enumerate()
        .with_min_len(2)
        .for_each_init(Vec::new, |scores, (task, o)| {
            let (i, kv_head) = (task / kv_heads, task % kv_heads);
            let qi = &q[task * group * hd..][..group * hd];
            thin::attend_group(o, qi, k, v, start + i + 1, kv_head, kv_heads, hd, scores);
        });
}

/// Backward of [`attention_forward`]: dq, dk, dv += from dout, per head as sgemm
/// products, with the probabilities rebuilt from q, k and the forward's `lse`.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    dout: &[f32],
    lse: &[f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    t: usize,
    heads: usize,
    kv_heads: usize,
    hd: usize,
) {
    let group = heads / kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let (qs, kvs) = (heads * hd, kv_heads * hd);
    // Per head: (dq_h, dk_h, dv_h) computed in parallel, then added (kv heads are shared).
    let grads: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = (0..heads)
        .into_par_iter()
        .map(|h| {
            let kvh = h / group;
            let mut p = vec![0f32; t * t];
            head_scores(&mut p, q, k, Some(lse), h, kvh, t, heads, kv_heads, hd);
            let (q_h, do_h) = (&q[h * hd..], &dout[h * hd..]);
            let (k_h, v_h) = (&k[kvh * hd..], &v[kvh * hd..]);
            let (mut dq_h, mut dk_h, mut dv_h) =
                (vec![0f32; t * hd], vec![0f32; t * hd], vec![0f32; t * hd]);
            // dP (T, T) = dO_h (T, hd) · V_hᵀ ; dV_h (T, hd) = Pᵀ (T, T) · dO_h
            let mut ds = vec![0f32; t * t];
            gemm::sgemm(t, hd, t, do_h, qs, 1, v_h, 1, kvs, &mut ds, t, 0.0);
            gemm::sgemm(t, t, hd, &p, 1, t, do_h, qs, 1, &mut dv_h, hd, 0.0);
            // softmax backward: dS_ij = P_ij (dP_ij − Σ_l P_il dP_il), times the score scale
            for (p_i, ds_i) in p.chunks(t).zip(ds.chunks_mut(t)) {
                let dot: f32 = p_i.iter().zip(ds_i.iter()).map(|(a, b)| a * b).sum();
                for (d, &pij) in ds_i.iter_mut().zip(p_i) {
                    *d = pij * (*d - dot) * scale;
                }
            }
            // dQ_h (T, hd) = dS · K_h ; dK_h (T, hd) = dSᵀ · Q_h
            gemm::sgemm(t, t, hd, &ds, t, 1, k_h, kvs, 1, &mut dq_h, hd, 0.0);
            gemm::sgemm(t, t, hd, &ds, 1, t, q_h, qs, 1, &mut dk_h, hd, 0.0);
            (dq_h, dk_h, dv_h)
        })
        .collect();
    for (h, (dq_h, dk_h, dv_h)) in grads.iter().enumerate() {
        let kvh = h / group;
        for i in 0..t {
            dq[(i * heads + h) * hd..][..hd]
                .iter_mut()
                .zip(&dq_h[i * hd..][..hd])
                .for_each(|(a, b)| *a += b);
            dk[(i * kv_heads + kvh) * hd..][..hd]
                .iter_mut()
                .zip(&dk_h[i * hd..][..hd])
                .for_each(|(a, b)| *a += b);
            dv[(i * kv_heads + kvh) * hd..][..hd]
                .iter_mut()
                .zip(&dv_h[i * hd..][..hd])
                .for_each(|(a, b)| *a += b);
        }
    }
}

/// out (N, O) = transpose of out_t (O, N): the thin matmul kernels work per weight row.
fn transpose_into(out: &mut [f32], out_t: &[f32], o: usize, n: usize) {
    for r in 0..o {
        for t in 0..n {
            out[t * o + r] = out_t[r * n + t];
        }
    }
}

/// Embedding lookup: out row t = table row tokens[t]. table: (V, C); out: (N, C)
pub fn embedding_forward(out: &mut [f32], table: &[f32], tokens: &[u32]) {
    let c = out.len() / tokens.len().max(1);
    for (row, &t) in out.chunks_mut(c).zip(tokens) {
        row.copy_from_slice(&table[t as usize * c..][..c]);
    }
}

/// dtable row tokens[t] += dout row t.
pub fn embedding_backward(dtable: &mut [f32], dout: &[f32], tokens: &[u32]) {
    let c = dout.len() / tokens.len().max(1);
    for (row, &t) in dout.chunks(c).zip(tokens) {
        dtable[t as usize * c..][..c]
            .iter_mut()
            .zip(row)
            .for_each(|(d, g)| *d += g);
    }
}

/// Log-softmax statistics of one row of logits: (log Σ exp, entropy).
pub fn logsumexp_entropy(logits: &[f32]) -> (f32, f32) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&z| f64::from((z - max).exp())).sum();
    let lse = max + sum.ln() as f32;
    // H = lse - Σ p z
    let expected: f64 = logits
        .iter()
        .map(|&z| f64::from((z - lse).exp()) * f64::from(z))
        .sum();
    (lse, lse - expected as f32)
}

/// In-place softmax of one row.
pub fn softmax(row: &mut [f32]) {
    log_softmax_exp(row);
}
