//! Matrix multiplication for linear layers: out = x · Wᵀ (+ b), with W stored (O, I) as in
//! PyTorch. Large products go to `matrixmultiply`'s packed SIMD kernels, one block of rows
//! per thread; thin ones (decode: a few tokens) are dot products over W's rows, split
//! across threads by output.
#![allow(unsafe_code)]

use rayon::prelude::*;

/// Fewest rows handed to one sgemm call.
const MIN_ROW_BLOCK: usize = 64;
/// Up to this many rows, the thin kernel wins: it reads W once for all rows, where sgemm
/// would first copy (pack) all of W.
const THIN: usize = 16;

/// out = x · Wᵀ + b. x: (N, I); w: (O, I); b: (O); out: (N, O), overwritten.
pub fn matmul_forward(
    out: &mut [f32],
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    n: usize,
    i: usize,
    o: usize,
) {
    if n <= THIN {
        return matmul_rows(out, x, w, bias, n, i, o);
    }
    assert!(
        x.len() >= n * i && w.len() >= o * i && out.len() >= n * o,
        "matmul shapes"
    );
    let block = row_block(n);
    out[..n * o]
        .par_chunks_mut(block * o)
        .zip(x[..n * i].par_chunks(block * i))
        .for_each(|(out, x)| {
            let rows = x.len() / i;
            sgemm(rows, i, o, x, i, 1, w, 1, i, out, o, 0.0);
        });
    if let Some(b) = bias {
        add_bias(&mut out[..n * o], b, o);
    }
}

/// out = x · Wᵀ + b with every row of out computed by the thin kernel, whatever N is: a
/// row's result does not depend on the other rows (sgemm's does, through its blocking).
pub fn matmul_rows(
    out: &mut [f32],
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    n: usize,
    i: usize,
    o: usize,
) {
    assert!(
        x.len() >= n * i && w.len() >= o * i && out.len() >= n * o,
        "matmul shapes"
    );
    thin_forward(&mut out[..n * o], &x[..n * i], &w[..o * i], n, i, o);
    if let Some(b) = bias {
        add_bias(&mut out[..n * o], b, o);
    }
}

/// Every row of out (rows of o) += b.
pub(super) fn add_bias(out: &mut [f32], b: &[f32], o: usize) {
    out.par_chunks_mut(o)
        .for_each(|row| row.iter_mut().zip(b).for_each(|(y, b)| *y += b));
}

/// dx += dout · W; dw += doutᵀ · x; db += Σ_rows dout.
#[allow(clippy::too_many_arguments)]
pub fn matmul_backward(
    dx: &mut [f32],
    dw: &mut [f32],
    db: Option<&mut [f32]>,
    dout: &[f32],
    x: &[f32],
    w: &[f32],
    n: usize,
    i: usize,
    o: usize,
) {
    assert!(
        dx.len() >= n * i && dw.len() >= o * i && dout.len() >= n * o && x.len() >= n * i,
        "matmul shapes"
    );
    // dx (N, I) += dout (N, O) · w (O, I)
    let block = row_block(n);
    dx[..n * i]
        .par_chunks_mut(block * i)
        .zip(dout[..n * o].par_chunks(block * o))
        .for_each(|(dx, dout)| {
            let rows = dout.len() / o;
            sgemm(rows, o, i, dout, o, 1, w, i, 1, dx, i, 1.0);
        });
    // dw (O, I) += doutᵀ (O, N) · x (N, I), split over blocks of W's rows.
    let block = row_block(o);
    dw[..o * i]
        .par_chunks_mut(block * i)
        .enumerate()
        .for_each(|(b, dw)| {
            let rows = dw.len() / i;
            let dout_t = &dout[b * block..];
            // A = doutᵀ restricted to outputs [b*block, +rows): element (r, t) at dout[t*o + r].
            sgemm(rows, n, i, dout_t, 1, o, x, i, 1, dw, i, 1.0);
        });
    if let Some(db) = db {
        for row in dout[..n * o].chunks(o) {
            db.iter_mut().zip(row).for_each(|(d, g)| *d += g);
        }
    }
}

/// Rows per sgemm call: a few calls per thread. Each call packs the whole other operand
/// again, so small blocks spend as long packing as multiplying; a few per thread still
/// lets work-stealing even out a machine shared with other processes.
fn row_block(rows: usize) -> usize {
    let calls = 2 * rayon::current_num_threads().max(1);
    rows.div_ceil(calls).next_multiple_of(8).max(MIN_ROW_BLOCK)
}

fn thin_forward(out: &mut [f32], x: &[f32], w: &[f32], n: usize, i: usize, o: usize) {
    if i.is_multiple_of(super::thin::BLOCK) {
        let rows = super::thin::F32Rows::new(w, o, i);
        return super::thin::matmul(&rows, out, x, n);
    }
    // Transposed result: out_t (O, N), so each thread owns whole W rows.
    let mut out_t = vec![0f32; o * n];
    out_t
        .par_chunks_mut(n * 16)
        .zip(w.par_chunks(i * 16))
        .for_each(|(out_t, w)| {
            for (r, w_row) in w.chunks_exact(i).enumerate() {
                for t in 0..n {
                    out_t[r * n + t] = dot(&x[t * i..][..i], w_row);
                }
            }
        });
    super::transpose_into(out, &out_t, o, n);
}

/// A dot product with independent accumulators, so the compiler vectorizes it.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        let (a, b) = (&a[c * 8..c * 8 + 8], &b[c * 8..c * 8 + 8]);
        for k in 0..8 {
            acc[k] += a[k] * b[k];
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for k in chunks * 8..a.len() {
        sum += a[k] * b[k];
    }
    sum
}

/// C (m, n) = A (m, k) · B (k, n) + beta · C, with explicit row/column strides for A and
/// B and row-major C. Bounds are checked here; this is the only unsafe call.
#[allow(clippy::too_many_arguments)]
pub(super) fn sgemm(
    m: usize,
    k: usize,
    n: usize,
    a: &[f32],
    rsa: usize,
    csa: usize,
    b: &[f32],
    rsb: usize,
    csb: usize,
    c: &mut [f32],
    rsc: usize,
    beta: f32,
) {
    if m == 0 || n == 0 {
        return;
    }
    let last = |rows: usize, cols: usize, rs: usize, cs: usize| (rows - 1) * rs + (cols - 1) * cs;
    assert!(
        k == 0 || last(m, k, rsa, csa) < a.len(),
        "sgemm: A out of bounds"
    );
    assert!(
        k == 0 || last(k, n, rsb, csb) < b.len(),
        "sgemm: B out of bounds"
    );
    assert!(last(m, n, rsc, 1) < c.len(), "sgemm: C out of bounds");
    // SAFETY: every index the kernel touches, (r*rs + col*cs) for r < rows, col < cols,
    // was checked to lie inside its slice above; C does not alias A or B (it is `&mut`).
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.as_ptr(),
            rsa as isize,
            csa as isize,
            b.as_ptr(),
            rsb as isize,
            csb as isize,
            beta,
            c.as_mut_ptr(),
            rsc as isize,
            1,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(x: &[f32], w: &[f32], n: usize, i: usize, o: usize) -> Vec<f32> {
        let mut out = vec![0f32; n * o];
        for t in 0..n {
            for r in 0..o {
                out[t * o + r] = (0..i).map(|c| x[t * i + c] * w[r * i + c]).sum();
            }
        }
        out
    }

    fn data(len: usize, seed: u32) -> Vec<f32> {
        (0..len)
            .map(|j| {
                (((j as u32).wrapping_mul(2654435761).wrapping_add(seed)) % 1000) as f32 / 500.0
                    - 1.0
            })
            .collect()
    }

    #[test]
    fn forward_matches_naive_for_thin_and_wide() {
        for &(n, i, o) in &[(1, 37, 70), (3, 64, 33), (130, 48, 90)] {
            let (x, w) = (data(n * i, 1), data(o * i, 2));
            let mut out = vec![0f32; n * o];
            matmul_forward(&mut out, &x, &w, None, n, i, o);
            let want = naive(&x, &w, n, i, o);
            for (a, b) in out.iter().zip(&want) {
                assert!((a - b).abs() < 1e-3, "{a} vs {b} at {n}x{i}x{o}");
            }
        }
    }

    #[test]
    fn backward_matches_naive() {
        let (n, i, o) = (70, 20, 130);
        let (x, w, dout) = (data(n * i, 3), data(o * i, 4), data(n * o, 5));
        let (mut dx, mut dw, mut db) = (vec![0f32; n * i], vec![0f32; o * i], vec![0f32; o]);
        matmul_backward(&mut dx, &mut dw, Some(&mut db), &dout, &x, &w, n, i, o);
        for t in 0..n {
            for c in 0..i {
                let want: f32 = (0..o).map(|r| dout[t * o + r] * w[r * i + c]).sum();
                assert!((dx[t * i + c] - want).abs() < 1e-3);
            }
        }
        for r in 0..o {
            for c in 0..i {
                let want: f32 = (0..n).map(|t| dout[t * o + r] * x[t * i + c]).sum();
                assert!((dw[r * i + c] - want).abs() < 1e-3, "dw[{r},{c}]");
            }
            let want: f32 = (0..n).map(|t| dout[t * o + r]).sum();
            assert!((db[r] - want).abs() < 1e-3);
        }
    }
}
