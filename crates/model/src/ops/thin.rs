//! Thin products: out (N, O) = x (N, I) · Wᵀ for a handful of token rows (a decode step, one
//! token per sequence) against a large weight matrix, in f32, Q4_1 or Q8_0.
//!
//! A decode step is bound by reading W, so the kernel reads each block of 32 weights once
//! for the whole batch: it turns the block into f32 (two 16-lane vectors) and multiplies it
//! into every token's accumulator. Rows go in groups of R (R · NT ≥ 8 independent
//! accumulator chains, so FMA latency is hidden even at batch 1) and tokens in groups of
//! NT ≤ 8. The arithmetic is the f32 path's: Q4_1's w = d·q + m and Q8_0's w = d·q, exactly
//! as `quant.rs` dequantizes them, accumulated in f32 per lane — so a token's result does not
//! depend on the other tokens of the batch.
//!
//! The kernels are written once over [`Lanes`] (16 f32 lanes) with two implementations:
//! AVX-512 (one zmm) and AVX2+FMA (two ymm), chosen at run time; elsewhere a portable
//! implementation on arrays, which the compiler vectorizes as it can.
#![allow(unsafe_code)]

use rayon::prelude::*;

pub(crate) const BLOCK: usize = 32;
/// Bytes ahead of the block in use that the kernel asks the cache for.
const PREFETCH_AHEAD: usize = 512;
/// Tokens per kernel call at most (AVX-512; fewer where registers are fewer).
const MAX_NT: usize = 8;

/// A weight matrix the thin kernel can read block by block: each row is a sequence of
/// records of `BLOCK_BYTES`, one per 32 weights.
pub(crate) trait WeightRows: Sync {
    const BLOCK_BYTES: usize;
    fn rows(&self) -> usize;
    fn cols(&self) -> usize;
    /// The first record of row r (r < rows).
    fn row_start(&self, r: usize) -> *const u8;
    /// The record at p as two 16-lane halves of f32 weights.
    ///
    /// # Safety
    /// p is a row's start plus b · BLOCK_BYTES for a block b < cols / 32; the CPU supports
    /// `L`'s instructions.
    unsafe fn decode<L: Lanes>(p: *const u8) -> (L, L);
}

/// 16 f32 lanes.
pub(crate) trait Lanes: Copy {
    /// Values of `Self` the registers hold at once.
    const REGISTERS: usize;
    /// # Safety (every method)
    /// The CPU supports the implementation's instructions; pointers are valid for the
    /// 16 elements (or 16 bytes) read.
    unsafe fn zero() -> Self;
    unsafe fn splat(v: f32) -> Self;
    /// The little-endian f16 at p, exactly as f32, in every lane.
    unsafe fn splat_f16(p: *const u8) -> Self;
    unsafe fn load(p: *const f32) -> Self;
    /// a · b + c (fused where the CPU has FMA)
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self;
    /// a · b and a + b, rounded separately (as the f32 dequantization computes d·q + m).
    unsafe fn mul(a: Self, b: Self) -> Self;
    unsafe fn add(a: Self, b: Self) -> Self;
    /// 16 signed bytes as floats.
    unsafe fn from_i8(p: *const u8) -> Self;
    /// The low and the high nibbles of 16 bytes, as floats.
    unsafe fn nibbles(p: *const u8) -> (Self, Self);
    /// The Q4_1 record at p (f16 d, f16 m, 16 bytes of codes) as its 32 weights, low
    /// nibbles then high, each d·q + m rounded as `quant.rs` rounds it.
    #[inline(always)]
    unsafe fn q4_1(p: *const u8) -> (Self, Self) {
        // SAFETY: as the trait's methods (p holds a 20-byte record).
        unsafe {
            let (d, m) = (Self::splat_f16(p), Self::splat_f16(p.add(2)));
            let (lo, hi) = Self::nibbles(p.add(4));
            (
                Self::add(Self::mul(d, lo), m),
                Self::add(Self::mul(d, hi), m),
            )
        }
    }
    unsafe fn sum(self) -> f32;
    unsafe fn store(self, p: *mut f32);
    /// Asks for the cache line at p ahead of its use (a hint: p need not be valid).
    unsafe fn prefetch(p: *const u8);
}

/// out (N, O) = x (N, I) · Wᵀ. x: (N, I) row-major; out: (N, O), overwritten.
pub(crate) fn matmul<W: WeightRows>(w: &W, out: &mut [f32], x: &[f32], n: usize) {
    let (o, i) = (w.rows(), w.cols());
    assert!(
        i.is_multiple_of(BLOCK) && x.len() >= n * i && out.len() >= n * o,
        "thin matmul shapes"
    );
    // Each task owns a range of W's rows, so it writes the same columns of every token's
    // output row: out is cut into (token, task) pieces, gathered per task.
    let rows_per_task = rows_per_task(o);
    let tasks = o.div_ceil(rows_per_task);
    let mut pieces: Vec<Vec<&mut [f32]>> = (0..tasks).map(|_| Vec::with_capacity(n)).collect();
    for row in out[..n * o].chunks_mut(o) {
        for (task, piece) in row.chunks_mut(rows_per_task).enumerate() {
            pieces[task].push(piece);
        }
    }
    let isa = Isa::detect();
    pieces
        .into_par_iter()
        .enumerate()
        .for_each(|(task, mut out)| {
            let first = task * rows_per_task;
            let rows = out.first().map_or(0, |p| p.len());
            let group = isa.max_nt();
            for t0 in (0..n).step_by(group) {
                let nt = group.min(n - t0);
                isa.run(w, &x[t0 * i..(t0 + nt) * i], first, rows, nt, |r, t, v| {
                    out[t0 + t][r - first] = v;
                });
            }
        });
}

/// A few tasks per thread, in multiples of 8 rows.
fn rows_per_task(rows: usize) -> usize {
    let tasks = 4 * rayon::current_num_threads().max(1);
    rows.div_ceil(tasks).next_multiple_of(8).max(16)
}

#[derive(Clone, Copy)]
enum Isa {
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    Portable,
}

impl Isa {
    fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return Isa::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c")
            {
                return Isa::Avx2;
            }
        }
        Isa::Portable
    }

    /// Most token rows one kernel call takes: their accumulators must fit the registers
    /// (as `rows_any` tiles them).
    fn max_nt(self) -> usize {
        match self {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => MAX_NT,
            _ => 4,
        }
    }

    /// Rows first..first+rows of W times nt token rows of x; `put(r, t, value)`.
    fn run<W: WeightRows>(
        self,
        w: &W,
        x: &[f32],
        first: usize,
        rows: usize,
        nt: usize,
        put: impl FnMut(usize, usize, f32),
    ) {
        assert!(first + rows <= w.rows() && x.len() >= nt * w.cols() && nt <= self.max_nt());
        match self {
            // SAFETY: the CPU has the instructions (detected above); the bounds the kernel
            // relies on (rows of W, nt rows of x) were asserted just above.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { x86::rows_avx512(w, x, first, rows, nt, put) },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { x86::rows_avx2(w, x, first, rows, nt, put) },
            // SAFETY: the portable lanes use no special instructions; bounds as above.
            Isa::Portable => unsafe {
                rows_any::<portable::Lanes16, W>(w, x, first, rows, nt, put)
            },
        }
    }
}

/// Dispatches nt to a kernel with compile-time token and row counts.
///
/// # Safety
/// As [`kernel`], for every row group.
// `r + R <= end` reads as written for every tile, R = 1 included.
#[allow(clippy::int_plus_one)]
#[inline(always)]
unsafe fn rows_any<L: Lanes, W: WeightRows>(
    w: &W,
    x: &[f32],
    first: usize,
    rows: usize,
    nt: usize,
    mut put: impl FnMut(usize, usize, f32),
) {
    macro_rules! go {
        ($r:literal, $nt:literal) => {{
            let mut r = first;
            while r + $r <= first + rows {
                // SAFETY: rows r..r+R exist and x holds nt ≥ NT rows (caller's contract).
                unsafe { kernel::<L, W, $r, $nt>(w, x, r, &mut put) };
                r += $r;
            }
            while r < first + rows {
                unsafe { kernel::<L, W, 1, $nt>(w, x, r, &mut put) };
                r += 1;
            }
        }};
    }
    // Tiles of R rows × NT tokens whose accumulators (R·NT lane groups) and decoded blocks
    // (2·R) fit the registers: AVX-512 has 32 of 16 lanes, AVX2 16 of 8 (two per group).
    // On AVX-512, two rows at every batch size measured fastest (Zen 4, SmolLM2 Q4_1): at
    // batch 1 ahead of 4 and 8 rows by 20-45%, at batch 8 ahead of 3 rows by ~15% — wider
    // tiles spilled registers once Q4_1 decoding held a lookup table (`Lanes::q4_1`).
    if L::REGISTERS >= 32 {
        match nt {
            1 => go!(2, 1),
            2 => go!(2, 2),
            3 => go!(2, 3),
            4 => go!(2, 4),
            5 => go!(2, 5),
            6 => go!(2, 6),
            7 => go!(2, 7),
            _ => go!(2, 8),
        }
    } else {
        match nt {
            1 => go!(4, 1),
            2 => go!(2, 2),
            3 => go!(1, 3),
            _ => go!(1, 4),
        }
    }
}

/// R rows of W from r0, times NT token rows of x: every block of 32 weights is read and
/// converted once, then multiplied into all NT accumulators.
///
/// # Safety
/// r0 + R ≤ rows of W; x holds NT rows of `cols` floats; the CPU supports `L`.
#[inline(always)]
unsafe fn kernel<L: Lanes, W: WeightRows, const R: usize, const NT: usize>(
    w: &W,
    x: &[f32],
    r0: usize,
    put: &mut impl FnMut(usize, usize, f32),
) {
    let cols = w.cols();
    let xp = x.as_ptr();
    // SAFETY (whole body): the caller's contract bounds every row of W and every block
    // read from x (t < NT rows, b < cols/32).
    // Index loops: the accumulators are registers indexed by compile-time constants.
    #[allow(clippy::needless_range_loop)]
    unsafe {
        let mut acc = [[L::zero(); NT]; R];
        let starts: [*const u8; R] = std::array::from_fn(|r| w.row_start(r0 + r));
        for b in 0..cols / BLOCK {
            let offset = b * W::BLOCK_BYTES;
            for start in &starts {
                // Streaming from memory: ask for each row's data a few lines ahead.
                L::prefetch(start.wrapping_add(offset + PREFETCH_AHEAD));
            }
            let mut lo = [L::zero(); R];
            let mut hi = [L::zero(); R];
            for r in 0..R {
                (lo[r], hi[r]) = W::decode::<L>(starts[r].add(offset));
            }
            for t in 0..NT {
                let xt = xp.add(t * cols + b * BLOCK);
                let (x_lo, x_hi) = (L::load(xt), L::load(xt.add(16)));
                for r in 0..R {
                    acc[r][t] = L::fma(hi[r], x_hi, L::fma(lo[r], x_lo, acc[r][t]));
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            for (t, a) in acc.iter().enumerate() {
                put(r0 + r, t, a.sum());
            }
        }
    }
}

/// One query row of the `q.len() / hd` heads sharing kv head `kv_head` attends over the
/// first `visible` cached positions: out (g, hd) = softmax(q · Kᵀ · scale) · V per head, with
/// K and V rows of kv head `kv_head` in caches of (len, kv_heads, hd). Each cached row is
/// read once for the whole group (grouped-query attention's point). `scores` is scratch.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend_group(
    out: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    visible: usize,
    kv_head: usize,
    kv_heads: usize,
    hd: usize,
    scores: &mut Vec<f32>,
) {
    let stride = kv_heads * hd;
    let heads = q.len() / hd.max(1);
    assert!(
        hd > 0
            && heads > 0
            && q.len() == heads * hd
            && out.len() == q.len()
            && visible > 0
            && k.len() >= (visible - 1) * stride + (kv_head + 1) * hd
            && v.len() >= (visible - 1) * stride + (kv_head + 1) * hd,
        "attend_group shapes"
    );
    let scale = 1.0 / (hd as f32).sqrt();
    scores.clear();
    scores.resize(heads * visible, 0.0);
    let base = kv_head * hd;
    if !hd.is_multiple_of(16) {
        for ((o, q), scores) in out
            .chunks_mut(hd)
            .zip(q.chunks(hd))
            .zip(scores.chunks_mut(visible))
        {
            for (j, s) in scores.iter_mut().enumerate() {
                let kj = &k[j * stride + base..][..hd];
                *s = q.iter().zip(kj).map(|(a, b)| a * b).sum::<f32>() * scale;
            }
            super::softmax(scores);
            o.iter_mut().for_each(|o| *o = 0.0);
            for (j, p) in scores.iter().enumerate() {
                let vj = &v[j * stride + base..][..hd];
                o.iter_mut().zip(vj).for_each(|(o, v)| *o += p * v);
            }
        }
        return;
    }
    let parts = Attend {
        q,
        k: &k[base..],
        v: &v[base..],
        hd,
        stride,
        scale,
    };
    // SAFETY: the CPU has the instructions of the chosen implementation (detected); the
    // rows read (visible rows of hd floats at `stride`) were bounds-checked above.
    match Isa::detect() {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { x86::attend_avx512(&parts, scores, out) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::attend_avx2(&parts, scores, out) },
        Isa::Portable => unsafe { attend::<portable::Lanes16>(&parts, scores, out) },
    }
}

/// The operands of one [`attend_group`]: q holds the group's heads, (g, hd); k and v start
/// at the kv head's first element.
struct Attend<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    hd: usize,
    stride: usize,
    scale: f32,
}

/// Heads of a group handled together: their accumulators fill the registers.
const HEADS_AT_ONCE: usize = 4;

/// # Safety
/// hd is a multiple of 16; k and v hold visible = scores.len() / heads rows at `stride`;
/// out and q hold heads · hd floats; the CPU supports `L`.
#[inline(always)]
unsafe fn attend<L: Lanes>(a: &Attend<'_>, scores: &mut [f32], out: &mut [f32]) {
    let hd = a.hd;
    let heads = a.q.len() / hd;
    let visible = scores.len() / heads;
    // SAFETY (whole body): the caller's contract bounds every row read and written.
    unsafe {
        for h0 in (0..heads).step_by(HEADS_AT_ONCE) {
            let q = a.q.as_ptr().add(h0 * hd);
            let s = &mut scores[h0 * visible..];
            match heads - h0 {
                1 => key_scores::<L, 1>(a, q, s, visible),
                2 => key_scores::<L, 2>(a, q, s, visible),
                3 => key_scores::<L, 3>(a, q, s, visible),
                _ => key_scores::<L, 4>(a, q, s, visible),
            }
        }
        for row in scores.chunks_mut(visible) {
            super::softmax(row);
        }
        // out = Σ_j p_j v_j per head, in slices of hd held in registers across all j.
        for h0 in (0..heads).step_by(HEADS_AT_ONCE) {
            let p = &scores[h0 * visible..];
            let o = out.as_mut_ptr().add(h0 * hd);
            let mut c0 = 0;
            while c0 < hd {
                let (v, o) = (a.v.as_ptr().add(c0), o.add(c0));
                let step = if hd - c0 >= 64 { 64 } else { 16 };
                match (heads - h0, step) {
                    (1, 64) => weighted_rows::<L, 4, 1>(p, visible, v, a.stride, o, hd),
                    (2, 64) => weighted_rows::<L, 4, 2>(p, visible, v, a.stride, o, hd),
                    (3, 64) => weighted_rows::<L, 4, 3>(p, visible, v, a.stride, o, hd),
                    (_, 64) => weighted_rows::<L, 4, 4>(p, visible, v, a.stride, o, hd),
                    (1, _) => weighted_rows::<L, 1, 1>(p, visible, v, a.stride, o, hd),
                    (2, _) => weighted_rows::<L, 1, 2>(p, visible, v, a.stride, o, hd),
                    (3, _) => weighted_rows::<L, 1, 3>(p, visible, v, a.stride, o, hd),
                    (_, _) => weighted_rows::<L, 1, 4>(p, visible, v, a.stride, o, hd),
                }
                c0 += step;
            }
        }
    }
}

/// Cached rows ahead of the one in use that attention asks the cache for: a kv head's rows
/// are `stride` apart, a pattern the hardware prefetcher follows poorly.
const ROWS_AHEAD: usize = 6;

/// Asks for the cache lines of `width` floats of `rows` rows from p (a hint: p need not be
/// valid).
#[inline(always)]
unsafe fn prefetch_rows<L: Lanes>(p: *const f32, rows: usize, stride: usize, width: usize) {
    for row in 0..rows {
        for c in (0..width).step_by(16) {
            // SAFETY: a prefetch never faults, whatever the address.
            unsafe { L::prefetch(p.wrapping_add(row * stride + c).cast()) };
        }
    }
}

/// scores[h·visible + j] = q_h · k_j · scale for H heads (q rows of hd from q), each key row
/// read once for all H, two keys at a time.
///
/// # Safety
/// As [`attend`]; q holds H rows of hd; scores holds H rows of `visible`.
// Index loops: the accumulators are registers indexed by compile-time constants.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn key_scores<L: Lanes, const H: usize>(
    a: &Attend<'_>,
    q: *const f32,
    scores: &mut [f32],
    visible: usize,
) {
    let hd = a.hd;
    // SAFETY (whole body): the caller's contract bounds every row read and written.
    unsafe {
        let k = a.k.as_ptr();
        let mut j = 0;
        while j < visible {
            let keys = (visible - j).min(2);
            prefetch_rows::<L>(k.wrapping_add((j + ROWS_AHEAD) * a.stride), 2, a.stride, hd);
            let mut acc = [[L::zero(); H]; 2];
            for c in (0..hd).step_by(16) {
                for u in 0..keys {
                    let kc = L::load(k.add((j + u) * a.stride + c));
                    for h in 0..H {
                        acc[u][h] = L::fma(L::load(q.add(h * hd + c)), kc, acc[u][h]);
                    }
                }
            }
            for u in 0..keys {
                for h in 0..H {
                    scores[h * visible + j + u] = acc[u][h].sum() * a.scale;
                }
            }
            j += keys;
        }
    }
}

/// out_h[..16·G] = Σ_j p_hj · v[j·stride..][..16·G] for H heads (p rows of `visible`, out
/// rows of `hd`): G lane groups of H heads held in registers; each row of v read once.
///
/// # Safety
/// v holds `visible` rows at `stride` of at least 16·G floats; p holds H rows of `visible`;
/// out holds H rows of hd ≥ 16·G floats; the CPU supports `L`.
// Index loops: the accumulators are registers indexed by compile-time constants.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn weighted_rows<L: Lanes, const G: usize, const H: usize>(
    p: &[f32],
    visible: usize,
    v: *const f32,
    stride: usize,
    out: *mut f32,
    hd: usize,
) {
    // SAFETY (whole body): the caller's contract bounds every row read and the output.
    unsafe {
        let mut acc = [[L::zero(); G]; H];
        for j in 0..visible {
            let vj = v.add(j * stride);
            prefetch_rows::<L>(vj.wrapping_add(ROWS_AHEAD * stride), 1, stride, 16 * G);
            let vg: [L; G] = std::array::from_fn(|g| L::load(vj.add(g * 16)));
            for h in 0..H {
                let ph = L::splat(p[h * visible + j]);
                for g in 0..G {
                    acc[h][g] = L::fma(ph, vg[g], acc[h][g]);
                }
            }
        }
        for h in 0..H {
            for g in 0..G {
                acc[h][g].store(out.add(h * hd + g * 16));
            }
        }
    }
}

/// W in f32, (rows, cols) row-major.
pub(crate) struct F32Rows<'a> {
    w: &'a [f32],
    rows: usize,
    cols: usize,
}

impl<'a> F32Rows<'a> {
    pub(crate) fn new(w: &'a [f32], rows: usize, cols: usize) -> Self {
        assert!(
            w.len() >= rows * cols,
            "thin matmul: W is smaller than its shape"
        );
        Self { w, rows, cols }
    }
}

impl WeightRows for F32Rows<'_> {
    const BLOCK_BYTES: usize = BLOCK * 4;

    fn rows(&self) -> usize {
        self.rows
    }

    fn cols(&self) -> usize {
        self.cols
    }

    fn row_start(&self, r: usize) -> *const u8 {
        self.w[r * self.cols..].as_ptr().cast()
    }

    #[inline(always)]
    unsafe fn decode<L: Lanes>(p: *const u8) -> (L, L) {
        // SAFETY: p is a block of 32 floats inside w (the trait's contract).
        unsafe {
            let p = p.cast::<f32>();
            (L::load(p), L::load(p.add(16)))
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{Attend, Lanes, WeightRows, attend, rows_any};

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn rows_avx512<W: WeightRows>(
        w: &W,
        x: &[f32],
        first: usize,
        rows: usize,
        nt: usize,
        put: impl FnMut(usize, usize, f32),
    ) {
        // SAFETY: AVX-512F is present (this function's contract); bounds by the caller.
        unsafe { rows_any::<Zmm, W>(w, x, first, rows, nt, put) }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn rows_avx2<W: WeightRows>(
        w: &W,
        x: &[f32],
        first: usize,
        rows: usize,
        nt: usize,
        put: impl FnMut(usize, usize, f32),
    ) {
        // SAFETY: AVX2, FMA and F16C are present (this function's contract); bounds by the caller.
        unsafe { rows_any::<Ymm2, W>(w, x, first, rows, nt, put) }
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn attend_avx512(a: &Attend<'_>, scores: &mut [f32], out: &mut [f32]) {
        // SAFETY: AVX-512F is present (this function's contract); bounds by the caller.
        unsafe { attend::<Zmm>(a, scores, out) }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn attend_avx2(a: &Attend<'_>, scores: &mut [f32], out: &mut [f32]) {
        // SAFETY: AVX2, FMA and F16C are present (this function's contract); bounds by the caller.
        unsafe { attend::<Ymm2>(a, scores, out) }
    }

    #[derive(Clone, Copy)]
    pub(super) struct Zmm(__m512);

    /// The codes 0..16 as floats, lane q holding q.
    #[repr(align(64))]
    struct Codes([f32; 16]);
    const CODES: Codes = Codes([
        0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
    ]);

    // SAFETY (every method): only reached from `rows_avx512`, on a CPU with AVX-512F;
    // pointers valid for 16 elements by the trait's contract.
    impl Lanes for Zmm {
        const REGISTERS: usize = 32;
        #[inline(always)]
        unsafe fn zero() -> Self {
            unsafe { Zmm(_mm512_setzero_ps()) }
        }
        #[inline(always)]
        unsafe fn splat(v: f32) -> Self {
            unsafe { Zmm(_mm512_set1_ps(v)) }
        }
        #[inline(always)]
        unsafe fn splat_f16(p: *const u8) -> Self {
            unsafe {
                let bits = p.cast::<i16>().read_unaligned();
                Zmm(_mm512_cvtph_ps(_mm256_set1_epi16(bits)))
            }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            unsafe { Zmm(_mm512_loadu_ps(p)) }
        }
        #[inline(always)]
        unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
            unsafe { Zmm(_mm512_fmadd_ps(a.0, b.0, c.0)) }
        }
        #[inline(always)]
        unsafe fn mul(a: Self, b: Self) -> Self {
            unsafe { Zmm(_mm512_mul_ps(a.0, b.0)) }
        }
        #[inline(always)]
        unsafe fn add(a: Self, b: Self) -> Self {
            unsafe { Zmm(_mm512_add_ps(a.0, b.0)) }
        }
        #[inline(always)]
        unsafe fn from_i8(p: *const u8) -> Self {
            unsafe {
                let q = _mm_loadu_si128(p.cast());
                Zmm(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)))
            }
        }
        #[inline(always)]
        unsafe fn nibbles(p: *const u8) -> (Self, Self) {
            unsafe {
                let q = _mm_loadu_si128(p.cast());
                let mask = _mm_set1_epi8(0x0f);
                let lo = _mm_and_si128(q, mask);
                let hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
                (
                    Zmm(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo))),
                    Zmm(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi))),
                )
            }
        }
        /// A code has only 16 values: work out d·q + m once for each (the same two
        /// roundings per value) and look the 32 weights up with two lane permutes, instead
        /// of converting and scaling all 32 — about half the vector operations of a block,
        /// which are most of a batch-1 decode's arithmetic.
        #[inline(always)]
        unsafe fn q4_1(p: *const u8) -> (Self, Self) {
            unsafe {
                let (d, m) = (Self::splat_f16(p), Self::splat_f16(p.add(2)));
                let codes = _mm_loadu_si128(p.add(4).cast());
                let codes_f32 = _mm512_load_ps(CODES.0.as_ptr());
                let table = _mm512_add_ps(_mm512_mul_ps(d.0, codes_f32), m.0);
                // vpermps reads each index lane's low 4 bits: the low nibble as the byte
                // is, the high one after a shift.
                let bytes = _mm512_cvtepu8_epi32(codes);
                (
                    Zmm(_mm512_permutexvar_ps(bytes, table)),
                    Zmm(_mm512_permutexvar_ps(_mm512_srli_epi32::<4>(bytes), table)),
                )
            }
        }
        #[inline(always)]
        unsafe fn sum(self) -> f32 {
            unsafe { _mm512_reduce_add_ps(self.0) }
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32) {
            unsafe { _mm512_storeu_ps(p, self.0) }
        }
        #[inline(always)]
        unsafe fn prefetch(p: *const u8) {
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast()) }
        }
    }

    /// 16 lanes as two AVX2 registers.
    #[derive(Clone, Copy)]
    pub(super) struct Ymm2(__m256, __m256);

    // SAFETY (every method): only reached from `rows_avx2`, on a CPU with AVX2, FMA and F16C;
    // pointers valid for 16 elements by the trait's contract.
    impl Lanes for Ymm2 {
        const REGISTERS: usize = 8;
        #[inline(always)]
        unsafe fn zero() -> Self {
            unsafe { Ymm2(_mm256_setzero_ps(), _mm256_setzero_ps()) }
        }
        #[inline(always)]
        unsafe fn splat(v: f32) -> Self {
            unsafe { Ymm2(_mm256_set1_ps(v), _mm256_set1_ps(v)) }
        }
        #[inline(always)]
        unsafe fn splat_f16(p: *const u8) -> Self {
            unsafe {
                let bits = p.cast::<i16>().read_unaligned();
                let v = _mm256_cvtph_ps(_mm_set1_epi16(bits));
                Ymm2(v, v)
            }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            unsafe { Ymm2(_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))) }
        }
        #[inline(always)]
        unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
            unsafe {
                Ymm2(
                    _mm256_fmadd_ps(a.0, b.0, c.0),
                    _mm256_fmadd_ps(a.1, b.1, c.1),
                )
            }
        }
        #[inline(always)]
        unsafe fn mul(a: Self, b: Self) -> Self {
            unsafe { Ymm2(_mm256_mul_ps(a.0, b.0), _mm256_mul_ps(a.1, b.1)) }
        }
        #[inline(always)]
        unsafe fn add(a: Self, b: Self) -> Self {
            unsafe { Ymm2(_mm256_add_ps(a.0, b.0), _mm256_add_ps(a.1, b.1)) }
        }
        #[inline(always)]
        unsafe fn from_i8(p: *const u8) -> Self {
            unsafe { bytes_to_f32(_mm_loadu_si128(p.cast()), true) }
        }
        #[inline(always)]
        unsafe fn nibbles(p: *const u8) -> (Self, Self) {
            unsafe {
                let q = _mm_loadu_si128(p.cast());
                let mask = _mm_set1_epi8(0x0f);
                let lo = _mm_and_si128(q, mask);
                let hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
                (bytes_to_f32(lo, false), bytes_to_f32(hi, false))
            }
        }
        #[inline(always)]
        unsafe fn sum(self) -> f32 {
            unsafe {
                let s = _mm256_add_ps(self.0, self.1);
                let s = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
                let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
                let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
                _mm_cvtss_f32(s)
            }
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32) {
            unsafe {
                _mm256_storeu_ps(p, self.0);
                _mm256_storeu_ps(p.add(8), self.1);
            }
        }
        #[inline(always)]
        unsafe fn prefetch(p: *const u8) {
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast()) }
        }
    }

    #[inline(always)]
    unsafe fn bytes_to_f32(q: __m128i, signed: bool) -> Ymm2 {
        // SAFETY: AVX2 is present (callers' contract).
        unsafe {
            let high = _mm_srli_si128(q, 8);
            let (a, b) = if signed {
                (_mm256_cvtepi8_epi32(q), _mm256_cvtepi8_epi32(high))
            } else {
                (_mm256_cvtepu8_epi32(q), _mm256_cvtepu8_epi32(high))
            };
            Ymm2(_mm256_cvtepi32_ps(a), _mm256_cvtepi32_ps(b))
        }
    }
}

mod portable {
    /// 16 lanes as an array; the compiler vectorizes what it can.
    #[derive(Clone, Copy)]
    pub(super) struct Lanes16([f32; 16]);

    // SAFETY (every method): plain Rust; pointers valid for 16 elements by the trait's
    // contract.
    impl super::Lanes for Lanes16 {
        const REGISTERS: usize = 8;
        #[inline(always)]
        unsafe fn zero() -> Self {
            Lanes16([0.0; 16])
        }
        #[inline(always)]
        unsafe fn splat(v: f32) -> Self {
            Lanes16([v; 16])
        }
        #[inline(always)]
        unsafe fn splat_f16(p: *const u8) -> Self {
            let bits: [u8; 2] = unsafe { std::ptr::read_unaligned(p.cast()) };
            Lanes16([half::f16::from_le_bytes(bits).to_f32(); 16])
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            unsafe { Lanes16(std::ptr::read_unaligned(p.cast())) }
        }
        #[inline(always)]
        unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
            // Not `mul_add`: without FMA hardware that is a slow library call.
            Lanes16(std::array::from_fn(|j| a.0[j] * b.0[j] + c.0[j]))
        }
        #[inline(always)]
        unsafe fn mul(a: Self, b: Self) -> Self {
            Lanes16(std::array::from_fn(|j| a.0[j] * b.0[j]))
        }
        #[inline(always)]
        unsafe fn add(a: Self, b: Self) -> Self {
            Lanes16(std::array::from_fn(|j| a.0[j] + b.0[j]))
        }
        #[inline(always)]
        unsafe fn from_i8(p: *const u8) -> Self {
            let q: [u8; 16] = unsafe { std::ptr::read_unaligned(p.cast()) };
            Lanes16(q.map(|b| f32::from(b as i8)))
        }
        #[inline(always)]
        unsafe fn nibbles(p: *const u8) -> (Self, Self) {
            let q: [u8; 16] = unsafe { std::ptr::read_unaligned(p.cast()) };
            (
                Lanes16(q.map(|b| f32::from(b & 0x0f))),
                Lanes16(q.map(|b| f32::from(b >> 4))),
            )
        }
        #[inline(always)]
        unsafe fn sum(self) -> f32 {
            self.0.iter().sum()
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32) {
            unsafe { std::ptr::write_unaligned(p.cast(), self.0) }
        }
        #[inline(always)]
        unsafe fn prefetch(_p: *const u8) {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(len: usize, seed: u32) -> Vec<f32> {
        (0..len)
            .map(|j| {
                (((j as u32).wrapping_mul(2654435761).wrapping_add(seed)) % 1000) as f32 / 500.0
                    - 1.0
            })
            .collect()
    }

    /// Every instruction set this CPU has gives the reference result, for every batch
    /// size up to two kernel groups, and a token's result does not depend on its batch.
    #[test]
    fn f32_rows_match_naive_on_every_isa_and_batch() {
        let (o, i) = (37, 96);
        let w = data(o * i, 1);
        let x = data(17 * i, 2);
        let rows = F32Rows::new(&w, o, i);
        let mut isas = vec![Isa::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c")
            {
                isas.push(Isa::Avx2);
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                isas.push(Isa::Avx512);
            }
        }
        for isa in isas {
            let mut alone = vec![0f32; o];
            isa.run(&rows, &x[..i], 0, o, 1, |r, _, v| alone[r] = v);
            for nt in 1..=isa.max_nt() {
                let mut out = vec![0f32; o * nt];
                isa.run(&rows, &x[..nt * i], 0, o, nt, |r, t, v| out[t * o + r] = v);
                for t in 0..nt {
                    for r in 0..o {
                        let want: f32 = (0..i).map(|c| w[r * i + c] * x[t * i + c]).sum();
                        let got = out[t * o + r];
                        assert!(
                            (got - want).abs() < 1e-4 * (1.0 + want.abs()),
                            "nt {nt} [{t},{r}]"
                        );
                    }
                }
                // Token 0 alone and in a batch: the same bits.
                assert!(
                    (0..o).all(|r| out[r].to_bits() == alone[r].to_bits()),
                    "nt {nt}"
                );
            }
        }
    }

    #[test]
    fn attend_group_matches_the_definition() {
        for (hd, group) in [(8, 1), (8, 3), (64, 1), (64, 3), (64, 7), (48, 5), (128, 2)] {
            let (kv_heads, len) = (3, 37);
            let (k, v, queries) = (
                data(len * kv_heads * hd, 3),
                data(len * kv_heads * hd, 4),
                data(group * hd, 5),
            );
            for (kv_head, visible) in [(0, 1), (2, 37), (1, 20)] {
                let mut outs = vec![0f32; group * hd];
                attend_group(
                    &mut outs,
                    &queries,
                    &k,
                    &v,
                    visible,
                    kv_head,
                    kv_heads,
                    hd,
                    &mut Vec::new(),
                );
                for (q, out) in queries.chunks(hd).zip(outs.chunks(hd)) {
                    let at = |j: usize| (j * kv_heads + kv_head) * hd;
                    let scores: Vec<f64> = (0..visible)
                        .map(|j| {
                            (0..hd).map(|c| f64::from(q[c] * k[at(j) + c])).sum::<f64>()
                                / (hd as f64).sqrt()
                        })
                        .collect();
                    let max = scores.iter().copied().fold(f64::MIN, f64::max);
                    let total: f64 = scores.iter().map(|s| (s - max).exp()).sum();
                    for c in 0..hd {
                        let want: f64 = (0..visible)
                            .map(|j| (scores[j] - max).exp() / total * f64::from(v[at(j) + c]))
                            .sum();
                        assert!(
                            (f64::from(out[c]) - want).abs() < 1e-5,
                            "hd {hd} group {group} kv {kv_head} [{c}]"
                        );
                    }
                }
            }
        }
    }
}
