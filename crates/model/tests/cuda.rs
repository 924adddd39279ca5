//! The CUDA backend agrees with the CPU reference: every kernel forward and backward on
//! random data, the log-probabilities of tiny models and of SmolLM2-135M, and one GRPO
//! step's gradients (per-tensor cosine similarity ≥ 0.999 on bf16-representable weights).
//!
//! Without a usable GPU every test prints why and passes (CI has none); with
//! `ARL_REQUIRE_GPU=1` (the device run in the README) a missing GPU fails them instead.
//!
//! Tolerances: matrix products take bf16 operands (8 bits of mantissa, relative rounding
//! ≤ 2⁻⁹ per operand) with f32 accumulation, so their outputs differ from f32 products by
//! about 2⁻⁸·√I relative to the operands' scale; every other kernel is f32 on both sides
//! and agrees to ~1e-5.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use arl_model::backend::{AdamStep, Backend, KvRows};
use arl_model::config::{Architecture, ModelConfig};
use arl_model::cuda::Cuda;
use arl_model::load::LoadedModel;
use arl_model::model::{KvCache, Model, SeqInput};
use arl_model::ops::Cpu;
use arl_model::weights::Weights;

fn gpu(test: &str) -> Option<Cuda> {
    arl_model::cuda::for_tests(test).unwrap()
}

/// Deterministic values in (−scale, scale).
fn random(len: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// max |a − b| ≤ atol + rtol·max|b|, with the worst element named.
fn assert_close(what: &str, got: &[f32], want: &[f32], atol: f32, rtol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let (worst, at) = got
        .iter()
        .zip(want)
        .enumerate()
        .map(|(i, (g, w))| ((g - w).abs(), i))
        .fold(
            (0f32, 0),
            |a, b| if b.0 > a.0 || b.0.is_nan() { b } else { a },
        );
    assert!(
        worst <= atol + rtol * scale && !worst.is_nan(),
        "{what}: |Δ| = {worst} at {at} (got {}, want {}), bound {} (scale {scale})",
        got[at],
        want[at],
        atol + rtol * scale
    );
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| f64::from(*x) * f64::from(*y))
        .sum();
    let na: f64 = a.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    if na == 0.0 && nb == 0.0 {
        1.0
    } else {
        dot / (na * nb)
    }
}

/// bf16 products, relative to the largest output: operands rounded to 2⁻⁹, f32 sums.
const BF16_RTOL: f32 = 0.02;

#[test]
fn elementwise_and_norm_kernels_match_the_cpu() {
    let Some(g) = gpu("elementwise_and_norm_kernels_match_the_cpu") else {
        return;
    };
    for &(n, c) in &[(3usize, 5usize), (17, 96), (64, 576)] {
        let x = random(n * c, 1, 1.0);
        let w = random(c, 2, 1.0);
        let dout = random(n * c, 3, 1.0);
        // RMSNorm forward and backward.
        let (mut out, mut rstd) = (vec![0.0; n * c], vec![0.0; n]);
        Cpu.rmsnorm_forward(&mut out, &mut rstd, &x, &w, 1e-5);
        let (mut g_out, mut g_rstd) = (g.zeros(n * c), g.zeros(n));
        let (gx, gw, gd) = (g.upload(&x), g.upload(&w), g.upload(&dout));
        g.rmsnorm_forward(&mut g_out, &mut g_rstd, &gx, &gw, 1e-5);
        assert_close("rmsnorm out", &g.download(&g_out), &out, 1e-5, 1e-5);
        assert_close("rmsnorm rstd", &g.download(&g_rstd), &rstd, 1e-5, 1e-5);
        let (mut dx, mut dw) = (random(n * c, 4, 0.1), random(c, 5, 0.1));
        let (mut g_dx, mut g_dw) = (g.upload(&dx), g.upload(&dw));
        Cpu.rmsnorm_backward(&mut dx, &mut dw, &dout, &x, &w, &rstd);
        g.rmsnorm_backward(&mut g_dx, &mut g_dw, &gd, &gx, &gw, &g_rstd);
        assert_close("rmsnorm dx", &g.download(&g_dx), &dx, 1e-4, 1e-5);
        assert_close("rmsnorm dw", &g.download(&g_dw), &dw, 1e-4, 1e-5);

        // SwiGLU forward and backward.
        let up = random(n * c, 6, 2.0);
        let gate = random(n * c, 7, 4.0);
        let mut act = vec![0.0; n * c];
        Cpu.swiglu_forward(&mut act, &gate, &up);
        let (g_gate, g_up) = (g.upload(&gate), g.upload(&up));
        let mut g_act = g.zeros(n * c);
        g.swiglu_forward(&mut g_act, &g_gate, &g_up);
        assert_close("swiglu", &g.download(&g_act), &act, 1e-5, 1e-6);
        let (mut dg, mut du) = (random(n * c, 8, 0.1), random(n * c, 9, 0.1));
        let (mut g_dg, mut g_du) = (g.upload(&dg), g.upload(&du));
        Cpu.swiglu_backward(&mut dg, &mut du, &dout, &gate, &up);
        g.swiglu_backward(&mut g_dg, &mut g_du, &gd, &g_gate, &g_up);
        assert_close("swiglu dgate", &g.download(&g_dg), &dg, 1e-5, 1e-5);
        assert_close("swiglu dup", &g.download(&g_du), &du, 1e-5, 1e-5);

        // add, scale, sum of squares, gather, embedding.
        let mut sum = x.clone();
        Cpu.add_assign(&mut sum, &dout);
        Cpu.scale(&mut sum, 0.37);
        let mut g_sum = g.upload(&x);
        g.add_assign(&mut g_sum, &gd);
        g.scale(&mut g_sum, 0.37);
        assert_close("add+scale", &g.download(&g_sum), &sum, 1e-6, 1e-6);
        let (ss_cpu, ss_gpu) = (
            Cpu.sum_squares(&[&sum, &x]),
            g.sum_squares(&[&g_sum, &g.upload(&x)]),
        );
        assert!(
            (ss_cpu - ss_gpu).abs() <= 1e-9 * ss_cpu.max(1.0),
            "{ss_cpu} vs {ss_gpu}"
        );
        let rows = [n - 1, 0, n / 2];
        let mut gathered = vec![0.0; 3 * c];
        Cpu.gather_rows(&mut gathered, &x, &rows, c);
        let mut g_gathered = g.zeros(3 * c);
        g.gather_rows(&mut g_gathered, &gx, &rows, c);
        assert_eq!(g.download(&g_gathered), gathered, "gather_rows");
        let vocab = 11;
        let table = random(vocab * c, 10, 1.0);
        let tokens: Vec<u32> = (0..n as u32).map(|t| (t * 7) % vocab as u32).collect();
        let mut emb = vec![0.0; n * c];
        Cpu.embedding_forward(&mut emb, &table, &tokens);
        let mut g_emb = g.zeros(n * c);
        g.embedding_forward(&mut g_emb, &g.upload(&table), &tokens);
        assert_eq!(g.download(&g_emb), emb, "embedding forward");
        let mut dtable = vec![0.0; vocab * c];
        Cpu.embedding_backward(&mut dtable, &dout, &tokens);
        let mut g_dtable = g.zeros(vocab * c);
        g.embedding_backward(&mut g_dtable, &gd, &tokens);
        assert_close(
            "embedding backward",
            &g.download(&g_dtable),
            &dtable,
            1e-5,
            1e-6,
        );

        // AdamW.
        let step = AdamStep {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.1,
            correction1: 0.1,
            correction2: 0.001,
        };
        let (mut p, mut m, mut v) = (x.clone(), random(n * c, 11, 0.1), random(n * c, 12, 0.1));
        v.iter_mut().for_each(|v| *v = v.abs());
        let (mut gp, mut gm, mut gv) = (g.upload(&p), g.upload(&m), g.upload(&v));
        Cpu.adamw(&mut p, &dout, &mut m, &mut v, step);
        g.adamw(&mut gp, &gd, &mut gm, &mut gv, step);
        assert_close("adamw param", &g.download(&gp), &p, 1e-5, 1e-5);
        assert_close("adamw m", &g.download(&gm), &m, 1e-6, 1e-6);
        assert_close("adamw v", &g.download(&gv), &v, 1e-6, 1e-6);
    }
    g.check().unwrap();
}

/// Attention of a sequence's rows `start + cached_from..start + t` of q (a packed batch of
/// n rows) over a one-layer cache of its keys and values (the same rows of k and v).
#[allow(clippy::too_many_arguments)]
fn cached_attention<B: Backend>(
    be: &B,
    q: &B::Buf,
    k: &B::Buf,
    v: &B::Buf,
    start: usize,
    cached_from: usize,
    t: usize,
    (heads, kv_heads, hd): (usize, usize, usize),
) -> Vec<f32> {
    let mut cache = be.kv_new(1, kv_heads * hd);
    let earlier = start..start + cached_from;
    if !earlier.is_empty() {
        let mut rows = [KvRows {
            kv: &mut cache,
            rows: earlier,
            start: 0,
        }];
        let step = be.kv_prepare(&mut rows);
        be.kv_write(0, &step, &mut rows, k, v);
    }
    let mut out = be.zeros(be.len(q));
    let mut rows = [KvRows {
        kv: &mut cache,
        rows: start + cached_from..start + t,
        start: cached_from,
    }];
    let step = be.kv_prepare(&mut rows);
    be.kv_write(0, &step, &mut rows, k, v);
    be.kv_attention(0, &step, &mut out, q, k, v, &rows, heads, kv_heads, hd);
    be.download(&out)
}

#[test]
fn rope_and_attention_match_the_cpu() {
    let Some(g) = gpu("rope_and_attention_match_the_cpu") else {
        return;
    };
    // (heads, kv heads, head size, sequence lengths): the tiny models' head sizes and 48 on
    // the generic f32 kernels; SmolLM2's and Qwen2.5-0.5B's 64 and Qwen's 128 on tensor
    // cores (bf16 operands), with packed sequences of uneven lengths, shorter and longer than
    // a tile, and Qwen2.5-0.5B's seven query heads per kv head.
    for &(heads, kv_heads, hd, ref lens) in &[
        (4usize, 2usize, 4usize, vec![1usize, 5, 3]),
        (4, 2, 8, vec![7, 2]),
        (3, 1, 48, vec![40, 9]),
        (9, 3, 64, vec![33, 64]),
        (14, 2, 64, vec![1, 17, 65, 130]),
        (2, 1, 128, vec![1100]),
        (4, 1, 128, vec![5, 40, 97]),
    ] {
        // Tensor cores round q, k, v, P and dS to bf16: compared as the products are.
        let (atol, rtol) = if matches!(hd, 64 | 128) {
            (1e-3, BF16_RTOL)
        } else {
            (1e-5, 1e-4)
        };
        let mut spans = Vec::new();
        let mut positions = Vec::new();
        let mut n = 0;
        for &t in lens {
            spans.push((n, t));
            positions.extend(0..t);
            n += t;
        }
        let (c, kv) = (heads * hd, kv_heads * hd);
        let inv_freq: Vec<f32> = (0..hd / 2)
            .map(|i| 1.0 / 10_000f32.powf(2.0 * i as f32 / hd as f32))
            .collect();
        let (mut q, mut k, v) = (
            random(n * c, 20, 1.0),
            random(n * kv, 21, 1.0),
            random(n * kv, 22, 1.0),
        );
        let (mut gq, mut gk, gv) = (g.upload(&q), g.upload(&k), g.upload(&v));
        Cpu.rope_apply(&mut q, heads, &positions, &inv_freq, 1.0);
        Cpu.rope_apply(&mut k, kv_heads, &positions, &inv_freq, 1.0);
        g.rope_apply(&mut gq, heads, &positions, &inv_freq, 1.0);
        g.rope_apply(&mut gk, kv_heads, &positions, &inv_freq, 1.0);
        assert_close("rope q", &g.download(&gq), &q, 1e-4, 1e-5);
        assert_close("rope k", &g.download(&gk), &k, 1e-4, 1e-5);
        let mut back = q.clone();
        Cpu.rope_apply(&mut back, heads, &positions, &inv_freq, -1.0);
        let mut g_back = gq.clone();
        g.rope_apply(&mut g_back, heads, &positions, &inv_freq, -1.0);
        assert_close("rope inverse", &g.download(&g_back), &back, 1e-4, 1e-5);
        // Continue from the GPU's own rotated values so only attention is compared below.
        let (q, k) = (g.download(&gq), g.download(&gk));

        let (mut out, mut lse) = (vec![0.0; n * c], vec![0.0; n * heads]);
        Cpu.attention_forward(&mut out, &mut lse, &q, &k, &v, &spans, heads, kv_heads, hd);
        let (mut g_out, mut g_lse) = (g.zeros(n * c), g.zeros(n * heads));
        g.attention_forward(
            &mut g_out, &mut g_lse, &gq, &gk, &gv, &spans, heads, kv_heads, hd,
        );
        let what = format!("hd {hd}, {heads}/{kv_heads} heads, lengths {lens:?}");
        assert_close(
            &format!("attention out ({what})"),
            &g.download(&g_out),
            &out,
            atol,
            rtol,
        );
        assert_close(
            &format!("attention lse ({what})"),
            &g.download(&g_lse),
            &lse,
            atol,
            rtol,
        );

        let dout = random(n * c, 23, 1.0);
        let (mut dq, mut dk, mut dv) = (
            random(n * c, 24, 0.1),
            random(n * kv, 25, 0.1),
            random(n * kv, 26, 0.1),
        );
        let (mut g_dq, mut g_dk, mut g_dv) = (g.upload(&dq), g.upload(&dk), g.upload(&dv));
        Cpu.attention_backward(
            &mut dq, &mut dk, &mut dv, &dout, &out, &lse, &q, &k, &v, &spans, heads, kv_heads, hd,
        );
        g.attention_backward(
            &mut g_dq,
            &mut g_dk,
            &mut g_dv,
            &g.upload(&dout),
            &g_out,
            &g_lse,
            &gq,
            &gk,
            &gv,
            &spans,
            heads,
            kv_heads,
            hd,
        );
        for (name, got, want) in [("dq", &g_dq, &dq), ("dk", &g_dk, &dk), ("dv", &g_dv, &dv)] {
            let got = g.download(got);
            assert_close(
                &format!("attention {name} ({what})"),
                &got,
                want,
                atol.max(1e-4),
                rtol,
            );
            let similarity = cosine(&got, want);
            assert!(
                similarity > 0.9999,
                "attention {name} ({what}): cosine {similarity}"
            );
        }

        // The last sequence's final rows again, against a cache of all its keys: the
        // earlier ones written in a pass of their own, then the new rows' (on the GPU a
        // paged cache, blocks of 16 positions, so longer sequences span several).
        let (start, t) = *spans.last().unwrap();
        let new = t.min(3);
        let cached_from = t - new;
        let rows = start + cached_from..start + t;
        let cached = cached_attention(
            &Cpu,
            &q,
            &k,
            &v,
            start,
            cached_from,
            t,
            (heads, kv_heads, hd),
        );
        let (gk_host, gv_host) = (g.upload(&k), g.upload(&v));
        let g_cached = cached_attention(
            &g,
            &gq,
            &gk_host,
            &gv_host,
            start,
            cached_from,
            t,
            (heads, kv_heads, hd),
        );
        let r = rows.start * c..rows.end * c;
        assert_close(
            "attention cached",
            &g_cached[r.clone()],
            &cached[r.clone()],
            1e-5,
            1e-4,
        );
        assert_close("cached = full", &cached[r.clone()], &out[r], 1e-5, 1e-4);
        // The whole sequence as a fresh prompt into an empty cache: on the GPU it attends
        // over its own new rows with the dense kernels, as training does.
        let g_fresh = cached_attention(
            &g,
            &gq,
            &gk_host,
            &gv_host,
            start,
            0,
            t,
            (heads, kv_heads, hd),
        );
        let r = start * c..(start + t) * c;
        assert_close(
            &format!("attention of a fresh prompt ({what})"),
            &g_fresh[r.clone()],
            &out[r],
            atol,
            rtol,
        );
    }
    g.check().unwrap();
}

/// q, k and v (and gate and up) frozen as one stacked matrix give, through one product
/// and the split kernels, what separate frozen products, bias adds, RoPE and scaling give;
/// Qwen2.5-0.5B's shapes (14/2 heads of 64, biases) and a YaRN-like factor.
#[test]
fn stacked_products_split_as_separate_ones_do() {
    let Some(g) = gpu("stacked_products_split_as_separate_ones_do") else {
        return;
    };
    let (n, c, heads, kv_heads, hd, i_dim) = (5usize, 896usize, 14usize, 2usize, 64usize, 4864);
    let (qd, kvd) = (heads * hd, kv_heads * hd);
    let x = g.upload(&random(n * c, 40, 1.0));
    let (wq, wk, wv) = (
        g.upload(&random(qd * c, 41, 0.05)),
        g.upload(&random(kvd * c, 42, 0.05)),
        g.upload(&random(kvd * c, 43, 0.05)),
    );
    let (bq, bk, bv) = (
        g.upload(&random(qd, 44, 1.0)),
        g.upload(&random(kvd, 45, 1.0)),
        g.upload(&random(kvd, 46, 1.0)),
    );
    let positions = [3usize, 17, 40, 41, 1000];
    let inv_freq: Vec<f32> = (0..hd / 2)
        .map(|i| 1.0 / 1_000_000f32.powf(2.0 * i as f32 / hd as f32))
        .collect();
    for factor in [1.0f32, 1.2] {
        let stacked = g
            .freeze_stacked(&[(&wq, qd), (&wk, kvd), (&wv, kvd)], c)
            .unwrap();
        let mut qkv = g.zeros(n * (qd + 2 * kvd));
        g.matmul_packed(&mut qkv, &x, &stacked, None, n);
        let (mut q, mut k, mut v) = (g.zeros(n * qd), g.zeros(n * kvd), g.zeros(n * kvd));
        g.qkv_split_rope(
            (&mut q, &mut k, &mut v),
            &qkv,
            [Some(&bq), Some(&bk), Some(&bv)],
            (heads, kv_heads, hd),
            &positions,
            &inv_freq,
            factor,
            None,
        );
        let separate = |w: &_, b: &_, rows: usize, rope_heads: Option<usize>| {
            let mut out = g.zeros(n * rows);
            g.matmul_packed(&mut out, &x, &g.freeze(w, rows, c).unwrap(), Some(b), n);
            if let Some(h) = rope_heads {
                g.rope_apply(&mut out, h, &positions, &inv_freq, 1.0);
                if factor != 1.0 {
                    g.scale(&mut out, factor);
                }
            }
            g.download(&out)
        };
        let what = |name: &str| format!("stacked {name}, factor {factor}");
        assert_close(
            &what("q"),
            &g.download(&q),
            &separate(&wq, &bq, qd, Some(heads)),
            1e-5,
            1e-5,
        );
        assert_close(
            &what("k"),
            &g.download(&k),
            &separate(&wk, &bk, kvd, Some(kv_heads)),
            1e-5,
            1e-5,
        );
        assert_close(
            &what("v"),
            &g.download(&v),
            &separate(&wv, &bv, kvd, None),
            1e-5,
            1e-5,
        );
    }

    let (w_gate, w_up) = (
        g.upload(&random(i_dim * c, 47, 0.05)),
        g.upload(&random(i_dim * c, 48, 0.05)),
    );
    let stacked = g
        .freeze_stacked(&[(&w_gate, i_dim), (&w_up, i_dim)], c)
        .unwrap();
    let mut gate_up = g.zeros(n * 2 * i_dim);
    g.matmul_packed(&mut gate_up, &x, &stacked, None, n);
    let mut act = g.zeros(n * i_dim);
    g.swiglu_stacked(&mut act, &gate_up, i_dim);
    let (mut gate, mut up, mut want) = (g.zeros(n * i_dim), g.zeros(n * i_dim), g.zeros(n * i_dim));
    g.matmul_packed(
        &mut gate,
        &x,
        &g.freeze(&w_gate, i_dim, c).unwrap(),
        None,
        n,
    );
    g.matmul_packed(&mut up, &x, &g.freeze(&w_up, i_dim, c).unwrap(), None, n);
    g.swiglu_forward(&mut want, &gate, &up);
    assert_close(
        "stacked swiglu",
        &g.download(&act),
        &g.download(&want),
        1e-5,
        1e-5,
    );
    g.check().unwrap();
}

/// Products of up to 8 rows run on the few-row kernel: a row's results are the same bits
/// in any batch of up to 8, and match cuBLAS's within f32 summation order.
#[test]
fn few_row_products_do_not_depend_on_the_batch_and_match_cublas() {
    let Some(g) = gpu("few_row_products_do_not_depend_on_the_batch_and_match_cublas") else {
        return;
    };
    // Qwen2.5-0.5B's decode shapes: q/k/v stacked (with bias), o, the stacked gate/up with
    // its SwiGLU, down (whose long rows split across warps).
    let (c, qkv, i_dim, rows) = (896usize, 1152usize, 4864usize, 9usize);
    let x = random(rows * c, 70, 1.0);
    let w_qkv = g.upload(&random(qkv * c, 71, 0.05));
    let b_qkv = g.upload(&random(qkv, 72, 1.0));
    let w_o = g.upload(&random(c * c, 73, 0.05));
    let w_gate_up = g.upload(&random(2 * i_dim * c, 74, 0.05));
    let w_down = g.upload(&random(c * i_dim, 75, 0.02));
    let qkv_w = g.freeze(&w_qkv, qkv, c).unwrap();
    let o_w = g.freeze(&w_o, c, c).unwrap();
    let gate_up_w = g.freeze(&w_gate_up, 2 * i_dim, c).unwrap();
    let down_w = g.freeze(&w_down, c, i_dim).unwrap();
    // Each product of the first n rows, as one host vector per product.
    let products = |n: usize| -> Vec<Vec<f32>> {
        let gx = g.upload(&x[..n * c]);
        let mut out_qkv = g.zeros(n * qkv);
        g.matmul_packed(&mut out_qkv, &gx, &qkv_w, Some(&b_qkv), n);
        let mut out_o = g.zeros(n * c);
        g.matmul_packed(&mut out_o, &gx, &o_w, None, n);
        let (mut act, mut gate_up) = (g.zeros(n * i_dim), g.zeros(n * 2 * i_dim));
        g.matmul_packed_swiglu(&mut act, &mut gate_up, &gx, &gate_up_w, n, i_dim);
        // Down reads the SwiGLU's output (its bf16 twin, where the fused kernel left one).
        let mut out_down = g.zeros(n * c);
        g.matmul_packed(&mut out_down, &act, &down_w, None, n);
        [out_qkv, out_o, act, out_down]
            .map(|b| g.download(&b))
            .to_vec()
    };
    let names = ["qkv + bias", "o", "swiglu(gate, up)", "down"];
    let widths = [qkv, c, i_dim, c];
    let all = products(8);
    for n in 1..8 {
        for ((got, whole), (name, width)) in
            products(n).iter().zip(&all).zip(names.iter().zip(widths))
        {
            assert!(
                got[..] == whole[..n * width],
                "{name}: the first {n} rows differ from the same rows in a batch of 8"
            );
        }
    }
    // cuBLAS (and the separate bias and SwiGLU launches) give the same within f32 sums in
    // another order; 9 rows take cuBLAS whatever the setting.
    g.set_gemv(false);
    let cublas = products(rows);
    g.set_gemv(true);
    let nine = products(rows);
    for (((fast, reference), nine), name) in all.iter().zip(&cublas).zip(&nine).zip(names) {
        let reference = &reference[..fast.len()];
        assert_close(
            &format!("{name}: few-row kernel vs cuBLAS"),
            fast,
            reference,
            1e-4,
            1e-4,
        );
        assert_close(
            &format!("{name}: 9 rows vs 8"),
            &nine[..fast.len()],
            fast,
            1e-4,
            1e-4,
        );
    }
    g.check().unwrap();
}

/// A norm's output goes to the products that read it next in bf16 without a conversion
/// of its own (its kernel writes both): that copy must never outlive the values it mirrors
/// — a later write to the output, or new memory where it was, is read as it is.
#[test]
fn products_read_what_their_input_holds_now() {
    let Some(g) = gpu("products_read_what_their_input_holds_now") else {
        return;
    };
    let (n, c, o) = (3usize, 64usize, 40usize);
    let (x, norm_w, w) = (
        random(n * c, 60, 1.0),
        random(c, 61, 1.0),
        random(o * c, 62, 0.1),
    );
    let (gx, gnorm, gw) = (g.upload(&x), g.upload(&norm_w), g.upload(&w));
    let product = |input: &arl_model::cuda::GpuBuf| {
        let mut out = g.zeros(n * o);
        g.matmul_forward(&mut out, input, &gw, None, n, c, o);
        g.download(&out)
    };
    let (mut h, mut rstd) = (g.zeros(n * c), g.zeros(n));
    g.rmsnorm_forward(&mut h, &mut rstd, &gx, &gnorm, 1e-5);
    let fresh = product(&h);
    let converted = {
        let copy = g.upload(&g.download(&h));
        product(&copy)
    };
    assert_eq!(
        fresh, converted,
        "the norm's own bf16 copy rounds as a conversion does"
    );
    g.rmsnorm_forward(&mut h, &mut rstd, &gx, &gnorm, 1e-5);
    g.scale(&mut h, 2.0);
    let scaled = product(&h);
    assert_close(
        "a product after a write to its input",
        &scaled,
        &fresh.iter().map(|v| 2.0 * v).collect::<Vec<_>>(),
        1e-4,
        1e-4,
    );
    g.rmsnorm_forward(&mut h, &mut rstd, &gx, &gnorm, 1e-5);
    drop(h);
    let zeros = g.zeros(n * c);
    assert!(
        product(&zeros).iter().all(|&v| v == 0.0),
        "new memory reads as zeros"
    );
    g.check().unwrap();
}

#[test]
fn matrix_products_and_the_head_match_the_cpu_within_bf16() {
    let Some(g) = gpu("matrix_products_and_the_head_match_the_cpu_within_bf16") else {
        return;
    };
    for &(n, i, o) in &[
        (1usize, 4usize, 3usize),
        (7, 16, 24),
        (130, 576, 1536),
        (64, 896, 4864),
        (1, 896, 4864),
        (8, 4864, 896),
    ] {
        let x = random(n * i, 30, 1.0);
        let w = random(o * i, 31, 1.0);
        let b = random(o, 32, 1.0);
        let mut out = vec![0.0; n * o];
        Cpu.matmul_forward(&mut out, &x, &w, Some(&b), n, i, o);
        let (gx, gw, gb) = (g.upload(&x), g.upload(&w), g.upload(&b));
        let mut g_out = g.zeros(n * o);
        g.matmul_forward(&mut g_out, &gx, &gw, Some(&gb), n, i, o);
        assert_close(
            &format!("matmul ({n},{i},{o})"),
            &g.download(&g_out),
            &out,
            1e-3,
            BF16_RTOL,
        );

        let dout = random(n * o, 33, 1.0);
        let (mut dx, mut dw, mut db) = (
            random(n * i, 34, 1.0),
            random(o * i, 35, 1.0),
            random(o, 36, 1.0),
        );
        let (mut g_dx, mut g_dw, mut g_db) = (g.upload(&dx), g.upload(&dw), g.upload(&db));
        Cpu.matmul_backward(&mut dx, &mut dw, Some(&mut db), &dout, &x, &w, n, i, o);
        g.matmul_backward(
            &mut g_dx,
            &mut g_dw,
            Some(&mut g_db),
            &g.upload(&dout),
            &gx,
            &gw,
            n,
            i,
            o,
        );
        // A served version's frozen bf16 weights: the same product without converting
        // the weights.
        let frozen = g.freeze(&gw, o, i).unwrap();
        let mut g_packed = g.zeros(n * o);
        g.matmul_packed(&mut g_packed, &gx, &frozen, Some(&gb), n);
        assert_close(
            &format!("frozen matmul ({n},{i},{o})"),
            &g.download(&g_packed),
            &out,
            1e-3,
            BF16_RTOL,
        );
        assert_close("matmul dx", &g.download(&g_dx), &dx, 1e-3, BF16_RTOL);
        assert_close("matmul dw", &g.download(&g_dw), &dw, 1e-3, BF16_RTOL);
        assert_close("matmul db", &g.download(&g_db), &db, 1e-3, 1e-5);
    }

    // The fused head on SmolLM2's vocabulary and on one wider than a chunk's rows.
    for &(n, c, vocab) in &[
        (5usize, 8usize, 50usize),
        (40, 576, 49_152),
        (230, 64, 300_000),
    ] {
        let h = random(n * c, 40, 1.0);
        let w = random(vocab * c, 41, 0.2);
        let targets: Vec<Option<u32>> = (0..n)
            .map(|r| (r % 4 != 3).then_some(((r * 7919) % vocab) as u32))
            .collect();
        let (mut lse, mut ent, mut lp) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
        Cpu.head_forward(&mut lse, &mut ent, &mut lp, &h, &w, &targets, c, vocab);
        let (gh, gw) = (g.upload(&h), g.upload(&w));
        let (mut g_lse, mut g_ent, mut g_lp) = (g.zeros(n), g.zeros(n), g.zeros(n));
        g.head_forward(
            &mut g_lse, &mut g_ent, &mut g_lp, &gh, &gw, &targets, c, vocab,
        );
        // Logits carry bf16 rounding (~2⁻⁹ per operand over C terms); bounds in nats.
        let atol = 0.02 * (c as f32).sqrt() / 8.0 + 1e-3;
        assert_close("head lse", &g.download(&g_lse), &lse, atol, 0.0);
        assert_close("head entropy", &g.download(&g_ent), &ent, atol, 0.0);
        assert_close("head logprob", &g.download(&g_lp), &lp, 2.0 * atol, 0.0);

        let d_lp: Vec<f32> = (0..n)
            .map(|r| {
                if r % 5 == 2 {
                    0.0
                } else {
                    0.5 + r as f32 * 0.01
                }
            })
            .collect();
        let d_h: Vec<f32> = (0..n).map(|r| 0.1 * (r % 3) as f32).collect();
        let (mut dh, mut dw) = (vec![0.0; n * c], vec![0.0; vocab * c]);
        Cpu.head_backward(
            &mut dh, &mut dw, &h, &w, &lse, &ent, &targets, &d_lp, &d_h, c, vocab,
        );
        let (mut g_dh, mut g_dw) = (g.zeros(n * c), g.zeros(vocab * c));
        g.head_backward(
            &mut g_dh, &mut g_dw, &gh, &gw, &g_lse, &g_ent, &targets, &d_lp, &d_h, c, vocab,
        );
        let (g_dh, g_dw) = (g.download(&g_dh), g.download(&g_dw));
        assert!(
            cosine(&g_dh, &dh) >= 0.999,
            "head dh cosine {}",
            cosine(&g_dh, &dh)
        );
        assert!(
            cosine(&g_dw, &dw) >= 0.999,
            "head dw cosine {}",
            cosine(&g_dw, &dw)
        );
    }
    g.check().unwrap();
}

fn tiny(architecture: Architecture, head_dim: usize) -> ModelConfig {
    ModelConfig {
        architecture,
        vocab_size: 50,
        hidden_size: 4 * head_dim,
        intermediate_size: 24,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        rope_scaling: None,
        max_position_embeddings: 64,
        tie_word_embeddings: architecture == Architecture::Llama,
    }
}

/// A GRPO-shaped gradient: an advantage-weighted logprob term per trained token (the
/// predictions from index `trained_from` on: the response) and an entropy term.
fn grpo_gradients<B: Backend>(
    model: &Model<B>,
    sequences: &[&[u32]],
    trained_from: usize,
) -> (Vec<Vec<f32>>, Weights) {
    let (pass, logprobs) = model.forward_train(sequences);
    let d_lp: Vec<Vec<f32>> = logprobs
        .iter()
        .enumerate()
        .map(|(s, r)| {
            let advantage = if s % 2 == 0 { 0.8 } else { -0.6 };
            (0..r.len())
                .map(|t| {
                    if t < trained_from {
                        0.0
                    } else {
                        advantage / r.len() as f32
                    }
                })
                .collect()
        })
        .collect();
    let d_h: Vec<Vec<f32>> = logprobs.iter().map(|r| vec![-0.001; r.len()]).collect();
    let mut grads = model.zeros_like_weights();
    model.backward(&pass, &d_lp, &d_h, &mut grads);
    model.backend.check().unwrap();
    (logprobs, grads.map(|t| model.backend.download(&t.data)))
}

fn assert_gradients_agree(what: &str, cpu: &Weights, gpu: &Weights) {
    assert_gradients_agree_to(what, cpu, gpu, 0.999);
}

/// Every tensor's gradient has cosine similarity ≥ `bound` with the CPU's.
fn assert_gradients_agree_to(what: &str, cpu: &Weights, gpu: &Weights, bound: f64) {
    let mut cosines: Vec<(f64, String)> = cpu
        .named()
        .iter()
        .zip(gpu.named())
        .map(|((name, a), (_, b))| (cosine(&b.data, &a.data), name.clone()))
        .collect();
    cosines.sort_by(|a, b| a.0.total_cmp(&b.0));
    let lowest: Vec<String> = cosines
        .iter()
        .take(4)
        .map(|(c, n)| format!("{n} {c:.6}"))
        .collect();
    eprintln!(
        "{what}: {} tensors, lowest gradient cosines: {}",
        cosines.len(),
        lowest.join(", ")
    );
    let (worst, name) = &cosines[0];
    assert!(
        *worst >= bound,
        "{what}: {name} gradient cosine {worst:.6} < {bound}"
    );
}

#[test]
fn tiny_models_agree_in_logprobs_and_gradients() {
    let Some(g) = gpu("tiny_models_agree_in_logprobs_and_gradients") else {
        return;
    };
    let sequences: [&[u32]; 3] = [&[1, 5, 9, 2, 33, 7, 7], &[3, 11, 18, 49, 0], &[4, 4]];
    // Qwen3: per-head q/k norms and a head size of its own (q 32 wide in a 20-wide model).
    let qwen3 = ModelConfig {
        hidden_size: 20,
        tie_word_embeddings: false,
        ..tiny(Architecture::Qwen3 { head_dim: 8 }, 8)
    };
    // Head size 64 takes the tensor-core attention (bf16 q, k, v, P and dS).
    let configs = [Architecture::Llama, Architecture::Qwen2]
        .into_iter()
        .flat_map(|a| [tiny(a, 4), tiny(a, 8)])
        .chain([qwen3, tiny(Architecture::Qwen2, 64)]);
    for config in configs {
        {
            let (architecture, head_dim) = (config.architecture, config.head_dim());
            // Weights shrink with 1/√hidden, as initialisers do, so the wider model's
            // logits spread as the narrow ones' do.
            let scale = 0.3 * (32.0 / config.hidden_size as f32).sqrt().min(1.0);
            let cpu = Model::new(config.clone(), Weights::random(&config, 3, scale));
            let on_gpu = cpu.to_backend(g.clone());
            let (lp_cpu, grads_cpu) = grpo_gradients(&cpu, &sequences, 2);
            let (lp_gpu, grads_gpu) = grpo_gradients(&on_gpu, &sequences, 2);
            let what = format!("{architecture:?} hd {head_dim}");
            // bf16 operands: ~2⁻⁸ relative per product, a few hundredths of a nat here; on
            // tensor-core attention (head size 64) q, k, v and P are bf16 too.
            let rtol = if head_dim == 64 { 0.005 } else { 0.0 };
            assert_close(&what, &lp_gpu.concat(), &lp_cpu.concat(), 0.05, rtol);
            assert_gradients_agree(&what, &grads_cpu, &grads_gpu);

            // Decoding with a KV cache gives the same logits as the training forward.
            let mut cache = KvCache::new(&on_gpu);
            let logits = on_gpu.forward(&mut [SeqInput {
                tokens: sequences[0],
                cache: &mut cache,
            }]);
            let mut cpu_cache = KvCache::new(&cpu);
            let cpu_logits = cpu.forward(&mut [SeqInput {
                tokens: sequences[0],
                cache: &mut cpu_cache,
            }]);
            assert_close(
                &format!("{what} decode logits"),
                &logits[0],
                &cpu_logits[0],
                0.05,
                0.0,
            );
            let next = on_gpu.forward(&mut [SeqInput {
                tokens: &[9],
                cache: &mut cache,
            }]);
            let cpu_next = cpu.forward(&mut [SeqInput {
                tokens: &[9],
                cache: &mut cpu_cache,
            }]);
            assert_close(
                &format!("{what} cached decode"),
                &next[0],
                &cpu_next[0],
                0.05,
                0.0,
            );

            // Frozen for serving (the weights' bf16 copies made once, as the engine does,
            // q/k/v and gate/up stacked): the same products, so the same logits up to the
            // order cuBLAS sums a wider product in.
            let mut frozen = on_gpu.clone();
            frozen.freeze();
            assert!(frozen.has_packed_weights(), "{what}: nothing frozen");
            let mut frozen_cache = KvCache::new(&frozen);
            let frozen_logits = frozen.forward(&mut [SeqInput {
                tokens: sequences[0],
                cache: &mut frozen_cache,
            }]);
            frozen.backend.check().unwrap();
            assert_close(
                &format!("{what} frozen decode"),
                &frozen_logits[0],
                &logits[0],
                1e-4,
                0.0,
            );
            // The next token attends over keys and values the frozen path wrote into its
            // cache (stacked: in the same pass that splits and rotates them).
            let frozen_next = frozen.forward(&mut [SeqInput {
                tokens: &[9],
                cache: &mut frozen_cache,
            }]);
            assert_close(
                &format!("{what} frozen cached decode"),
                &frozen_next[0],
                &next[0],
                1e-4,
                0.0,
            );

            // Sequences of different lengths prefilled, then decoded, together (every
            // cache append and every row's attention in one launch each) give each one's
            // logits alone.
            let mut caches: Vec<KvCache<Cuda>> =
                sequences.iter().map(|_| KvCache::new(&frozen)).collect();
            let mut together = Vec::new();
            for step in [None, Some(9u32)] {
                let tokens: Vec<Vec<u32>> = sequences
                    .iter()
                    .map(|s| step.map_or(s.to_vec(), |t| vec![t]))
                    .collect();
                let mut inputs: Vec<SeqInput<'_, Cuda>> = caches
                    .iter_mut()
                    .zip(&tokens)
                    .map(|(cache, tokens)| SeqInput { tokens, cache })
                    .collect();
                together.push(frozen.forward(&mut inputs));
            }
            for (i, sequence) in sequences.iter().enumerate() {
                let mut cache = KvCache::new(&frozen);
                for (step, tokens) in [sequence.to_vec(), vec![9]].iter().enumerate() {
                    let alone = frozen.forward(&mut [SeqInput {
                        tokens,
                        cache: &mut cache,
                    }]);
                    assert_close(
                        &format!("{what} sequence {i} step {step}, batched vs alone"),
                        &together[step][i],
                        &alone[0],
                        1e-3,
                        0.0,
                    );
                }
            }
            frozen.backend.check().unwrap();
        }
    }
}

#[test]
fn smollm2_agrees_in_logprobs_and_grpo_gradients() {
    let Some(g) = gpu("smollm2_agrees_in_logprobs_and_grpo_gradients") else {
        return;
    };
    let loaded = LoadedModel::open(&common::smollm2()).unwrap();
    // A group of eight answers to one question, as a GRPO step sees them: the prompt, then
    // each sampled answer (sampled on the CPU from the same model).
    let template = loaded.chat_template.as_ref().unwrap();
    let question = "Tom has 17 apples and buys 25 more. How many apples does he have? Answer with the number after ####.";
    let text = template
        .render(
            &[arl_model::chat::ChatMessage::new("user", question)],
            None,
            true,
        )
        .unwrap();
    let prompt = loaded.tokenizer.encode(&text).unwrap();
    let sequences: Vec<Vec<u32>> = (0..8u64)
        .map(|seed| {
            let sampling = arl_model::generate::Sampling {
                temperature: 1.0,
                seed: seed + 1,
                ..Default::default()
            };
            let (answer, _) = arl_model::generate::generate(
                &loaded.model,
                &prompt,
                48,
                loaded.tokenizer.stop_ids(),
                &sampling,
            );
            prompt.iter().chain(&answer).copied().collect()
        })
        .collect();
    let sequences: Vec<&[u32]> = sequences.iter().map(Vec::as_slice).collect();
    let from = prompt.len() - 1;

    // First as checkpoints are published (bf16 safetensors, as Hugging Face ships SmolLM2):
    // the weights are bf16 numbers, so the GPU's rounding of them is exact and every
    // difference left is the kernels' own (bf16 activations in products, f32 elsewhere).
    let mut published = loaded.model.clone();
    for (_, t) in published.weights_mut().named_mut() {
        t.data
            .iter_mut()
            .for_each(|v| *v = half::bf16::from_f32(*v).to_f32());
    }
    let on_gpu = published.to_backend(g.clone());
    let (_, grads_cpu) = grpo_gradients(&published, &sequences, from);
    let (_, grads_gpu) = grpo_gradients(&on_gpu, &sequences, from);
    assert_gradients_agree(
        "SmolLM2 (bf16 weights) one GRPO step",
        &grads_cpu,
        &grads_gpu,
    );

    // Then the GGUF's dequantized Q4_1 weights, as they are.
    let on_gpu = loaded.model.to_backend(g.clone());
    let (lp_cpu, grads_cpu) = grpo_gradients(&loaded.model, &sequences, from);
    let (lp_gpu, grads_gpu) = grpo_gradients(&on_gpu, &sequences, from);
    let (cpu_all, gpu_all) = (lp_cpu.concat(), lp_gpu.concat());
    let mean_abs: f32 = cpu_all
        .iter()
        .zip(&gpu_all)
        .map(|(a, b)| (a - b).abs())
        .sum::<f32>()
        / cpu_all.len() as f32;
    eprintln!(
        "SmolLM2 log-probabilities: mean |Δ| {mean_abs:.4} nats over {} tokens",
        cpu_all.len()
    );
    // bf16 products through 30 layers: about a hundredth of a nat on average, < 0.5 anywhere.
    assert!(mean_abs < 0.05, "mean |Δ logprob| {mean_abs}");
    assert_close("SmolLM2 logprobs", &gpu_all, &cpu_all, 0.5, 0.0);
    // These weights are not bf16 numbers. Rounding them to bf16 alone — every product then
    // exact f32 on the CPU — already moves the most sensitive tensors (RMSNorm weights,
    // whose gradients sum over tokens with much cancellation) to a cosine of 0.9989 against
    // the f32 gradient (measured on the CPU on this very batch); the GPU's bf16 activations
    // add to that. This bound is what bf16 weights allow, not the kernels' accuracy, which
    // the check above holds to 0.999.
    assert_gradients_agree_to("SmolLM2 (Q4_1 weights)", &grads_cpu, &grads_gpu, 0.997);
}

#[test]
fn a_machine_without_a_gpu_gets_a_clear_error() {
    match Cuda::new(0) {
        Ok(g) => eprintln!("GPU present ({}); nothing to check here", g.info().name),
        Err(e) => {
            let text = e.to_string();
            assert!(
                text.contains("driver") || text.contains("GPU") || text.contains("library"),
                "{text}"
            );
            assert!(
                text.contains("cpu") || text.contains("install"),
                "says what to do: {text}"
            );
        }
    }
    assert!(Cuda::new(4096).is_err(), "device 4096 does not exist");
}

#[test]
fn running_out_of_gpu_memory_is_a_clear_error_and_the_device_recovers() {
    let Some(g) = gpu("running_out_of_gpu_memory_is_a_clear_error_and_the_device_recovers") else {
        return;
    };
    // 4 TB of f32: no GPU has it. Nothing panics; the check names the cause and the fix.
    let huge = g.zeros(1 << 40);
    let mut small = g.upload(&[1.0, 2.0]);
    g.scale(&mut small, 3.0); // skipped: the device holds the fault
    let error = g.check().unwrap_err();
    assert_eq!(
        error.kind,
        arl_model::backend::BackendErrorKind::OutOfMemory
    );
    assert!(
        error.message.contains("out of GPU memory"),
        "{}",
        error.message
    );
    assert!(
        error.message.contains("micro_batch_tokens"),
        "{}",
        error.message
    );
    drop(huge);
    // The fault was reported and cleared: the device works again.
    let mut small = g.upload(&[1.0, 2.0]);
    g.scale(&mut small, 3.0);
    assert_eq!(g.download(&small), vec![3.0, 6.0]);
    g.check().unwrap();
}

#[test]
fn paged_caches_share_blocks_copy_on_write_and_give_them_back() {
    let Some(g) = gpu("paged_caches_share_blocks_copy_on_write_and_give_them_back") else {
        return;
    };
    let config = tiny(Architecture::Qwen2, 8);
    let cpu = Model::new(config.clone(), Weights::random(&config, 5, 0.3));
    let model = cpu.to_backend(g.clone());
    let pool = g.kv_pool(config.num_hidden_layers, config.kv_dim());
    pool.reserve(64).unwrap();
    assert_eq!(pool.free_blocks(), 64);
    let vocab = config.vocab_size as u32;
    // 21 positions: one full block and a partly filled second one.
    let prompt: Vec<u32> = (0..21).map(|i| (i * 7 + 3) % vocab).collect();
    let feed = |cache: &mut KvCache<Cuda>, tokens: &[u32]| {
        model.forward(&mut [SeqInput { tokens, cache }]).remove(0)
    };
    // The logits after `tokens`, from a cache of their own.
    let fresh = |tokens: &[u32]| {
        let mut cache = KvCache::new(&model);
        feed(&mut cache, tokens)
    };

    let mut parent = KvCache::new(&model);
    feed(&mut parent, &prompt);
    assert_eq!(pool.free_blocks(), 62);
    let mut fork = parent.clone();
    assert_eq!(pool.free_blocks(), 62, "a fork shares its parent's blocks");
    assert_eq!(
        fork.kv.blocks_to_write(21, 1),
        1,
        "a write into the shared block copies it"
    );
    let parent_next = feed(&mut parent, &[5]);
    let fork_next = feed(&mut fork, &[9]);
    assert_eq!(
        pool.free_blocks(),
        61,
        "one copy of the shared, partly filled block"
    );
    let with = |extra: &[u32]| [prompt.as_slice(), extra].concat();
    assert_close(
        "parent after the fork",
        &parent_next,
        &fresh(&with(&[5])),
        1e-3,
        0.0,
    );
    assert_close(
        "fork after the fork",
        &fork_next,
        &fresh(&with(&[9])),
        1e-3,
        0.0,
    );

    // The fork cut back into the first block and grown another way; the parent goes on
    // undisturbed (the blocks they still share are never written).
    fork.truncate(&model, 10);
    assert_eq!(pool.free_blocks(), 62, "the fork's own copy went back");
    let regrown = feed(&mut fork, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]);
    let regrown_want = fresh(&[&prompt[..10], &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]].concat());
    assert_close("fork regrown", &regrown, &regrown_want, 1e-3, 0.0);
    let parent_after = feed(&mut parent, &[7]);
    assert_close(
        "parent after",
        &parent_after,
        &fresh(&with(&[5, 7])),
        1e-3,
        0.0,
    );

    drop((parent, fork));
    assert_eq!(pool.free_blocks(), 64, "every block back in the pool");
    g.check().unwrap();
}

/// The host's answer to a pick: the sampler's draw (the same uniform, from a generator in
/// the same state), the raw log-probability, and the top n by value (ties to the smaller id).
fn host_pick(
    row: &[f32],
    pick: &arl_model::cuda::Pick,
    rng: &arl_model::generate::Rng,
) -> arl_model::cuda::Picked {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = row.iter().map(|&z| f64::from((z - max).exp())).sum();
    let lse = max + sum.ln() as f32;
    let sampling = arl_model::generate::Sampling {
        temperature: pick.temperature,
        ..Default::default()
    };
    let (id, _) = arl_model::generate::sample(row, &sampling, &mut rng.clone());
    let mut order: Vec<u32> = (0..row.len() as u32).collect();
    order.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
    arl_model::cuda::Picked {
        id,
        logprob: row[id as usize] - lse,
        top: order[..pick.top_n]
            .iter()
            .map(|&t| (t, row[t as usize] - lse))
            .collect(),
    }
}

#[test]
fn draws_on_the_device_are_the_hosts() {
    use arl_model::cuda::{Pick, TOP_MAX};
    use arl_model::generate::Rng;
    let Some(gpu) = gpu("draws_on_the_device_are_the_hosts") else {
        return;
    };
    // Qwen2.5's vocabulary: rows of random logits, one with a spike, one of many ties.
    let vocab = 151_936;
    let mut rows = random(3 * vocab, 41, 8.0);
    rows[vocab + 70_001] = 40.0;
    for (j, z) in rows[2 * vocab..].iter_mut().enumerate() {
        *z = ((j * 7919) % 13) as f32 * 0.5;
    }
    let logits = gpu.upload(&rows);
    let row = |r: usize| &rows[r * vocab..(r + 1) * vocab];

    let mut picks = Vec::new();
    let mut generators = Vec::new();
    for r in 0..3 {
        for (temperature, top_n) in [(0.0, 0), (0.0, TOP_MAX), (1.0, 3), (0.7, 0), (1.3, 1)] {
            for seed in 0..4u64 {
                let rng = Rng::new(seed * 10 + r as u64);
                let uniform = rng.clone().next_f32();
                picks.push(Pick {
                    row: r,
                    temperature,
                    uniform,
                    top_n,
                    top_k: 0,
                    top_p: 1.0,
                });
                generators.push(rng);
            }
        }
    }
    let drawn = gpu.sample_rows(&logits, vocab, &picks).unwrap();
    let mut distinct = std::collections::HashSet::new();
    for ((pick, rng), got) in picks.iter().zip(&generators).zip(&drawn) {
        let want = host_pick(row(pick.row), pick, rng);
        assert_eq!(got.id, want.id, "{pick:?}: token");
        assert!(
            (got.logprob - want.logprob).abs() < 1e-5,
            "{pick:?}: {got:?} vs {want:?}"
        );
        assert_eq!(got.top.len(), want.top.len(), "{pick:?}: alternatives");
        for ((gi, gl), (wi, wl)) in got.top.iter().zip(&want.top) {
            assert_eq!(gi, wi, "{pick:?}: alternative ids");
            assert!((gl - wl).abs() < 1e-5, "{pick:?}: {got:?} vs {want:?}");
        }
        if pick.temperature > 0.0 && pick.row == 0 {
            distinct.insert(got.id);
        }
    }
    // Tempered draws of a flat row land on different tokens; the spike takes its row.
    assert!(
        distinct.len() >= 4,
        "only {} distinct draws",
        distinct.len()
    );
    assert!(drawn[20..40].iter().all(|d| d.id == 70_001));

    // A pick outside what the kernel does is an error, not a read past the buffer.
    let past = Pick {
        row: 3,
        temperature: 0.0,
        uniform: 0.0,
        top_n: 0,
        top_k: 0,
        top_p: 1.0,
    };
    assert!(gpu.sample_rows(&logits, vocab, &[past]).is_err());
    assert_eq!(gpu.download_row(&logits, vocab, 1).unwrap(), row(1));
}

/// The tokens top-k then top-p keep of a row (the logits at or above the threshold) and
/// the one the inverse CDF names at `uniform`, walking them in vocabulary order.
fn kept_and_drawn(row: &[f32], pick: &arl_model::cuda::Pick, top_p: f32) -> (Vec<bool>, u32) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let weight = |z: f32| f64::from(((z - max) / pick.temperature).exp());
    let mut order: Vec<usize> = (0..row.len()).collect();
    order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
    let mut floor = f32::NEG_INFINITY;
    if pick.top_k > 0 && pick.top_k < row.len() {
        floor = row[order[pick.top_k - 1]];
    }
    if top_p < 1.0 {
        let whole: f64 = row
            .iter()
            .filter(|&&z| z >= floor)
            .map(|&z| weight(z))
            .sum();
        let mut running = 0.0;
        for &j in &order {
            running += weight(row[j]);
            if running >= f64::from(top_p) * whole {
                floor = floor.max(row[j]);
                break;
            }
        }
    }
    let kept: Vec<bool> = row.iter().map(|&z| z >= floor).collect();
    let total: f64 = (0..row.len())
        .filter(|&j| kept[j])
        .map(|j| weight(row[j]))
        .sum();
    let target = f64::from(pick.uniform) * total;
    let mut running = 0.0;
    let mut drawn = 0;
    for j in (0..row.len()).filter(|&j| kept[j]) {
        running += weight(row[j]);
        drawn = j as u32;
        if target < running {
            break;
        }
    }
    (kept, drawn)
}

#[test]
fn top_k_and_top_p_keep_the_hosts_tokens_on_the_device() {
    use arl_model::cuda::Pick;
    use arl_model::generate::Rng;
    let Some(gpu) = gpu("top_k_and_top_p_keep_the_hosts_tokens_on_the_device") else {
        return;
    };
    let vocab = 151_936;
    let rows = random(2 * vocab, 43, 6.0);
    let logits = gpu.upload(&rows);
    let mut picks = Vec::new();
    let mut rng = Rng::new(5);
    for row in 0..2 {
        for (temperature, top_k, top_p) in [
            (1.0, 1, 1.0),
            (1.0, 50, 1.0),
            (0.7, 0, 0.9),
            (1.0, 0, 0.5),
            (1.2, 40, 0.8),
            (1.0, 1000, 0.95),
        ] {
            for _ in 0..4 {
                picks.push(Pick {
                    row,
                    temperature,
                    uniform: rng.next_f32(),
                    top_n: 2,
                    top_k,
                    top_p,
                });
            }
        }
    }
    let drawn = gpu.sample_rows(&logits, vocab, &picks).unwrap();
    let mut exact = 0;
    for (pick, got) in picks.iter().zip(&drawn) {
        let row = &rows[pick.row * vocab..(pick.row + 1) * vocab];
        // The device's sums are f32: a nucleus within rounding of p may keep one more or
        // one fewer token, so the draw is held to the looser set, and to the exact token
        // where a slightly smaller and a slightly larger p keep the same.
        let (looser, _) = kept_and_drawn(row, pick, (pick.top_p + 1e-4).min(1.0));
        let (stricter, want) =
            kept_and_drawn(row, pick, pick.top_p - 1e-4 * f32::from(pick.top_p < 1.0));
        assert!(
            looser[got.id as usize],
            "{pick:?}: token {} was not kept",
            got.id
        );
        if looser == stricter {
            assert_eq!(got.id, want, "{pick:?}");
            exact += 1;
        }
        if pick.top_k == 1 {
            assert_eq!(got.id, got.top[0].0, "{pick:?}: top-1 is greedy");
        }
    }
    // Only nuclei that ±1e-4 of p leaves unchanged are held to the exact token: with
    // 151,936 random logits a nucleus of p = 0.5 to 0.95 holds tens of thousands of tokens
    // and moves with p, so those picks (half of them) are held to the kept set alone.
    assert!(exact >= picks.len() / 2, "only {exact} exact draws");
    gpu.check().unwrap();
}

/// Decode steps replayed from CUDA graphs give the logits eager steps give: as sequences
/// leave and join the batch, as caches cross block boundaries, and when a fork's first
/// write copies the partly filled block it shares (the step's plan makes that copy).
#[test]
fn graphed_decode_steps_equal_eager_ones() {
    let Some(g) = gpu("graphed_decode_steps_equal_eager_ones") else {
        return;
    };
    let config = tiny(Architecture::Qwen2, 16);
    let mut model =
        Model::new(config.clone(), Weights::random(&config, 11, 0.3)).to_backend(g.clone());
    model.freeze();
    let vocab = config.vocab_size as u32;
    let prompts: Vec<Vec<u32>> = [5u32, 13, 20]
        .iter()
        .map(|&len| (0..len).map(|i| (i * 11 + len) % vocab).collect())
        .collect();
    // Every step's logits, a row per live sequence (in cache order).
    let decode = |graphs: bool| -> Vec<Vec<Vec<f32>>> {
        g.set_graphs(graphs);
        let mut caches: Vec<KvCache<Cuda>> = prompts.iter().map(|_| KvCache::new(&model)).collect();
        let mut inputs: Vec<SeqInput<'_, Cuda>> = prompts
            .iter()
            .zip(caches.iter_mut())
            .map(|(tokens, cache)| SeqInput { tokens, cache })
            .collect();
        model.forward(&mut inputs);
        drop(inputs);
        let mut live = vec![true, true, true];
        let mut steps = Vec::new();
        for step in 0..30u32 {
            match step {
                8 => live[1] = false,
                14 => {
                    // Sequence 0 is at 19 positions: the fork shares its second block.
                    caches.push(caches[0].clone());
                    live.push(true);
                }
                20 => live[1] = true,
                _ => {}
            }
            let tokens: Vec<[u32; 1]> = (0..caches.len())
                .map(|s| [(step * 7 + s as u32 * 3 + 1) % vocab])
                .collect();
            let mut inputs: Vec<SeqInput<'_, Cuda>> = caches
                .iter_mut()
                .zip(&tokens)
                .zip(&live)
                .filter(|(_, live)| **live)
                .map(|((cache, tokens), _)| SeqInput { tokens, cache })
                .collect();
            steps.push(model.forward(&mut inputs));
        }
        g.check().unwrap();
        steps
    };
    let eager = decode(false);
    assert_eq!(
        g.graph_stats(),
        Default::default(),
        "no graphs while they are off"
    );
    let graphed = decode(true);
    for (step, (got, want)) in graphed.iter().zip(&eager).enumerate() {
        assert_eq!(got.len(), want.len());
        for (row, (got, want)) in got.iter().zip(want).enumerate() {
            assert_close(&format!("step {step} row {row}"), got, want, 1e-5, 0.0);
        }
    }
    let stats = g.graph_stats();
    eprintln!(
        "graphed decode: {stats:?}, last failure {:?}",
        g.graph_failure()
    );
    assert_eq!(stats.failed, 0, "{:?}", g.graph_failure());
    assert!(
        stats.captured >= 3,
        "batches of 3, 2 and 4 were captured: {stats:?}"
    );
    assert!(stats.replayed >= 15, "most steps were replayed: {stats:?}");
    assert!(
        stats.eager <= 8,
        "a batch size's first step runs eagerly, and few others: {stats:?}"
    );
}

/// A graphed step's logits are the caller's own: a second model's graphed step (two runs'
/// versions served in one engine step) leaves the first one's unchanged.
#[test]
fn a_graphed_steps_logits_outlive_the_next_graphed_step() {
    let Some(g) = gpu("a_graphed_steps_logits_outlive_the_next_graphed_step") else {
        return;
    };
    let config = tiny(Architecture::Qwen2, 16);
    let models: Vec<Model<Cuda>> = [21, 22]
        .iter()
        .map(|&seed| {
            let mut m = Model::new(config.clone(), Weights::random(&config, seed, 0.3))
                .to_backend(g.clone());
            m.freeze();
            m
        })
        .collect();
    let prompt: Vec<u32> = (0..9).collect();
    // Per step, both models' logits, each read only after the other model's step.
    let decode = |graphs: bool| -> Vec<[Vec<f32>; 2]> {
        g.set_graphs(graphs);
        let mut caches: Vec<KvCache<Cuda>> = models.iter().map(KvCache::new).collect();
        for (model, cache) in models.iter().zip(caches.iter_mut()) {
            model.forward(&mut [SeqInput {
                tokens: &prompt,
                cache,
            }]);
        }
        (0..6u32)
            .map(|step| {
                let token = [step + 1];
                let [a, b] = &mut caches[..] else {
                    unreachable!()
                };
                let first = models[0].forward_logits(&mut [SeqInput {
                    tokens: &token,
                    cache: a,
                }]);
                let second = models[1].forward_logits(&mut [SeqInput {
                    tokens: &token,
                    cache: b,
                }]);
                [g.download(&first), g.download(&second)]
            })
            .collect()
    };
    let eager = decode(false);
    let graphed = decode(true);
    assert!(g.graph_stats().replayed >= 6, "{:?}", g.graph_stats());
    for (step, (got, want)) in graphed.iter().zip(&eager).enumerate() {
        for m in 0..2 {
            assert_close(
                &format!("step {step} model {m}"),
                &got[m],
                &want[m],
                1e-5,
                0.0,
            );
        }
    }
    g.check().unwrap();
}
