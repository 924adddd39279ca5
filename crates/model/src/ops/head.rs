//! The vocabulary head fused with the log-probability objective, on the CPU.
//!
//! The (N, V) logits are never stored: the vocabulary is cut into blocks of `VOCAB_BLOCK`
//! rows of W, each block's (R, VB) logits tile is computed by one sgemm, reduced to
//! per-row statistics (its max, Σ exp, Σ exp·z) and dropped. Threads own vocabulary blocks,
//! so the large operand (W, 49,152 × 576 for SmolLM2) is read and packed once per row chunk
//! instead of once per handful of rows, and the block statistics are combined in block
//! order — the result does not depend on the number of threads.

use rayon::prelude::*;

use super::gemm::sgemm;
use super::memory::zeroed;

/// Rows of W in one vocabulary block: a (ROW_CHUNK, VOCAB_BLOCK) f32 tile is 8 MiB at most.
const VOCAB_BLOCK: usize = 2048;
/// Rows of h handled per pass over the vocabulary.
const ROW_CHUNK: usize = 1024;

/// Per row of one vocabulary block: max z, Σ exp(z − max), Σ exp(z − max)·z.
#[derive(Clone, Copy)]
struct BlockStats {
    max: f32,
    sum: f64,
    zsum: f64,
}

/// One vocabulary block's view of a row chunk: stats per row, and (row, logit) of the
/// targets that fall in the block.
type BlockPart = (Vec<BlockStats>, Vec<(usize, f32)>);

/// lse, entropy and logprob of the target (0 where there is none) per row of h.
/// h: (N, C); w: (V, C); lse, entropy, logprob: (N)
#[allow(clippy::too_many_arguments)]
pub fn head_forward(
    lse: &mut [f32],
    entropy: &mut [f32],
    logprob: &mut [f32],
    h: &[f32],
    w: &[f32],
    targets: &[Option<u32>],
    c: usize,
    vocab: usize,
) {
    let n = targets.len();
    for r0 in (0..n).step_by(ROW_CHUNK) {
        let rows = ROW_CHUNK.min(n - r0);
        let h = &h[r0 * c..(r0 + rows) * c];
        let targets = &targets[r0..r0 + rows];
        // Per block: its stats per row, and the target logits that fall in it.
        let blocks: Vec<BlockPart> = (0..vocab.div_ceil(VOCAB_BLOCK))
            .into_par_iter()
            .map(|b| {
                let (v0, vb) = block_range(b, vocab);
                let mut z = zeroed(rows * vb); // (R, VB)
                logits_tile(&mut z, h, w, rows, c, v0, vb);
                let stats = z.chunks(vb).map(block_stats).collect();
                let hits = targets
                    .iter()
                    .enumerate()
                    .filter_map(|(r, t)| {
                        let t = (*t)? as usize;
                        (v0..v0 + vb).contains(&t).then(|| (r, z[r * vb + t - v0]))
                    })
                    .collect();
                (stats, hits)
            })
            .collect();
        for r in 0..rows {
            let max = blocks
                .iter()
                .map(|(s, _)| s[r].max)
                .fold(f32::NEG_INFINITY, f32::max);
            let (mut sum, mut zsum) = (0f64, 0f64);
            for (s, _) in &blocks {
                let scale = f64::from(s[r].max - max).exp();
                sum += s[r].sum * scale;
                zsum += s[r].zsum * scale;
            }
            let l = f64::from(max) + sum.ln();
            lse[r0 + r] = l as f32;
            entropy[r0 + r] = (l - zsum / sum) as f32;
            logprob[r0 + r] = 0.0;
        }
        for (_, hits) in &blocks {
            for &(r, z) in hits {
                logprob[r0 + r] = z - lse[r0 + r];
            }
        }
    }
}

/// dh, dw += the gradient of Σ d_logprob·logprob + d_entropy·entropy through the head.
/// Rows whose upstream gradients are both zero are skipped (a prompt row, say).
/// h, dh: (N, C); w, dw: (V, C); lse, entropy, d_logprob, d_entropy: (N)
#[allow(clippy::too_many_arguments)]
pub fn head_backward(
    dh: &mut [f32],
    dw: &mut [f32],
    h: &[f32],
    w: &[f32],
    lse: &[f32],
    entropy: &[f32],
    targets: &[Option<u32>],
    d_logprob: &[f32],
    d_entropy: &[f32],
    c: usize,
    vocab: usize,
) {
    let active: Vec<usize> = (0..targets.len())
        .filter(|&r| d_logprob[r] != 0.0 || d_entropy[r] != 0.0)
        .collect();
    for rows in active.chunks(ROW_CHUNK) {
        let m = rows.len();
        // The active rows of h, packed together: (M, C).
        let mut hm = vec![0f32; m * c];
        for (dst, &r) in hm.chunks_mut(c).zip(rows) {
            dst.copy_from_slice(&h[r * c..][..c]);
        }
        let dhm = dw[..vocab * c]
            .par_chunks_mut(VOCAB_BLOCK * c)
            .enumerate()
            .fold(
                || vec![0f32; m * c],
                |mut dhm, (b, dw_block)| {
                    let (v0, vb) = block_range(b, vocab);
                    let mut z = zeroed(m * vb); // (M, VB): logits, then their gradient
                    logits_tile(&mut z, &hm, w, m, c, v0, vb);
                    for (zr, &r) in z.chunks_mut(vb).zip(rows) {
                        let (l, ent, d_lp, d_h) = (lse[r], entropy[r], d_logprob[r], d_entropy[r]);
                        for zj in zr.iter_mut() {
                            let logp = *zj - l;
                            let p = logp.exp();
                            // ∂logp_t/∂z_j = δ_tj − p_j ; ∂H/∂z_j = −p_j (log p_j + H)
                            *zj = -d_lp * p - d_h * p * (logp + ent);
                        }
                        if let Some(t) = targets[r].map(|t| t as usize)
                            && (v0..v0 + vb).contains(&t)
                        {
                            zr[t - v0] += d_lp;
                        }
                    }
                    // dW[v0..v0+vb] (VB, C) += dzᵀ (VB, M) · hm (M, C)
                    sgemm(vb, m, c, &z, 1, vb, &hm, c, 1, dw_block, c, 1.0);
                    // dhm (M, C) += dz (M, VB) · W[v0..v0+vb] (VB, C)
                    sgemm(m, vb, c, &z, vb, 1, &w[v0 * c..], c, 1, &mut dhm, c, 1.0);
                    dhm
                },
            )
            .reduce(
                || vec![0f32; m * c],
                |mut a, b| {
                    a.iter_mut().zip(&b).for_each(|(a, b)| *a += b);
                    a
                },
            );
        for (src, &r) in dhm.chunks(c).zip(rows) {
            dh[r * c..][..c]
                .iter_mut()
                .zip(src)
                .for_each(|(d, g)| *d += g);
        }
    }
}

/// First vocabulary row and row count of block b.
fn block_range(b: usize, vocab: usize) -> (usize, usize) {
    let v0 = b * VOCAB_BLOCK;
    (v0, VOCAB_BLOCK.min(vocab - v0))
}

/// z (R, VB) = h (R, C) · W[v0..v0+vb]ᵀ.
fn logits_tile(z: &mut [f32], h: &[f32], w: &[f32], rows: usize, c: usize, v0: usize, vb: usize) {
    // B (C, VB): element (k, j) is W[(v0 + j)·C + k].
    sgemm(rows, c, vb, h, c, 1, &w[v0 * c..], 1, c, z, vb, 0.0);
}

fn block_stats(z: &[f32]) -> BlockStats {
    let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let (mut sum, mut zsum) = (0f64, 0f64);
    for &zj in z {
        let e = f64::from((zj - max).exp());
        sum += e;
        zsum += e * f64::from(zj);
    }
    BlockStats { max, sum, zsum }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(len: usize, seed: u32) -> Vec<f32> {
        (0..len)
            .map(|j| {
                (((j as u32).wrapping_mul(2654435761).wrapping_add(seed)) % 1000) as f32 / 250.0
                    - 2.0
            })
            .collect()
    }

    /// The head over full rows of logits, in f64: the definition.
    fn reference(h: &[f32], w: &[f32], target: u32, c: usize, vocab: usize) -> (f64, f64, f64) {
        let z: Vec<f64> = (0..vocab)
            .map(|j| {
                (0..c)
                    .map(|k| f64::from(h[k]) * f64::from(w[j * c + k]))
                    .sum()
            })
            .collect();
        let max = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let lse = max + z.iter().map(|v| (v - max).exp()).sum::<f64>().ln();
        let entropy = -z.iter().map(|v| (v - lse).exp() * (v - lse)).sum::<f64>();
        (lse, entropy, z[target as usize] - lse)
    }

    #[test]
    fn blocked_statistics_match_full_rows_across_block_edges() {
        // 2 blocks and a partial one; targets in each.
        let (n, c, vocab) = (5, 16, 2 * VOCAB_BLOCK + 37);
        let (h, w) = (data(n * c, 1), data(vocab * c, 2));
        let w: Vec<f32> = w.iter().map(|x| x * 0.3).collect();
        let targets: Vec<Option<u32>> = [3, 2050, 4100, 4132, 17].map(Some).to_vec();
        let (mut lse, mut ent, mut lp) = (vec![0f32; n], vec![0f32; n], vec![0f32; n]);
        head_forward(&mut lse, &mut ent, &mut lp, &h, &w, &targets, c, vocab);
        for r in 0..n {
            let t = targets[r].unwrap_or(0);
            let (l, e, p) = reference(&h[r * c..][..c], &w, t, c, vocab);
            assert!((f64::from(lse[r]) - l).abs() < 1e-3, "lse {r}");
            assert!((f64::from(ent[r]) - e).abs() < 1e-3, "entropy {r}");
            assert!((f64::from(lp[r]) - p).abs() < 1e-3, "logprob {r}");
        }
    }

    #[test]
    fn backward_skips_rows_without_gradient_and_matches_finite_differences() {
        let (n, c, vocab) = (3, 8, VOCAB_BLOCK + 5);
        let h = data(n * c, 3);
        let w: Vec<f32> = data(vocab * c, 4).iter().map(|x| x * 0.2).collect();
        let targets = vec![Some(1), Some(2049), None];
        let (d_lp, d_h) = (vec![1.0f32, 0.0, 0.0], vec![0.5f32, 0.0, 0.0]);
        let (mut lse, mut ent, mut lp) = (vec![0f32; n], vec![0f32; n], vec![0f32; n]);
        head_forward(&mut lse, &mut ent, &mut lp, &h, &w, &targets, c, vocab);
        let (mut dh, mut dw) = (vec![0f32; n * c], vec![0f32; vocab * c]);
        head_backward(
            &mut dh, &mut dw, &h, &w, &lse, &ent, &targets, &d_lp, &d_h, c, vocab,
        );
        // Rows 1 and 2 carry no gradient.
        assert!(dh[c..].iter().all(|g| *g == 0.0));
        // Row 0: L = logprob + 0.5·entropy, by central differences in f64.
        let objective = |h0: &[f32]| {
            let (_, e, p) = reference(h0, &w, 1, c, vocab);
            p + 0.5 * e
        };
        for k in 0..c {
            let (mut up, mut down) = (h[..c].to_vec(), h[..c].to_vec());
            up[k] += 1e-2;
            down[k] -= 1e-2;
            let numeric = (objective(&up) - objective(&down)) / 2e-2;
            assert!(
                (f64::from(dh[k]) - numeric).abs() < 1e-2 * (1.0 + numeric.abs()),
                "dh[{k}] {} vs {numeric}",
                dh[k]
            );
        }
    }
}
