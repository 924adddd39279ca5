//! Linear layers straight from llama.cpp's block formats, for decoding. A decode step
//! reads every weight once for a handful of tokens, so its speed is memory bandwidth:
//! reading Q4_1 (5 bits a weight) or Q8_0 (8.5 bits) instead of f32 is 4-6x less traffic.
//! The arithmetic stays f32 on the very values the f32 path dequantizes to:
//! Σ (d·q + m)·x = d·Σ q·x + m·Σ x, with Σ x per block computed once per token.
//!
//! The kernels are plain Rust the compiler vectorizes; on x86-64 CPUs with AVX2 and FMA
//! (detected at run time) the same code is compiled again for those instructions.
#![allow(unsafe_code)]

use rayon::prelude::*;

use crate::quant::GgmlType;

const BLOCK: usize = 32;

/// A (rows, cols) weight in a block format.
#[derive(Clone, Debug)]
pub struct PackedMatrix {
    pub rows: usize,
    pub cols: usize,
    kind: PackedKind,
    /// Per block: scale d (f32) — and the min m for Q4_1.
    scales: Vec<f32>,
    mins: Vec<f32>,
    /// Q4_1: 16 bytes per block (low nibbles = values 0..16, high = 16..32).
    /// Q8_0: 32 signed bytes per block.
    quants: Vec<u8>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PackedKind {
    Q4_1,
    Q8_0,
}

impl PackedMatrix {
    /// Packs GGUF tensor bytes, reordering rows by `row_order` (HF row r = GGUF row
    /// `row_order[r]`). None for formats without a packed kernel.
    pub fn from_gguf(
        kind: GgmlType,
        data: &[u8],
        rows: usize,
        cols: usize,
        row_order: Option<&[usize]>,
    ) -> Option<Self> {
        let (kind, block_bytes) = match kind {
            GgmlType::Q4_1 => (PackedKind::Q4_1, 20),
            GgmlType::Q8_0 => (PackedKind::Q8_0, 34),
            _ => return None,
        };
        if !cols.is_multiple_of(BLOCK) || data.len() < rows * cols / BLOCK * block_bytes {
            return None;
        }
        let blocks_per_row = cols / BLOCK;
        let quant_bytes = if kind == PackedKind::Q4_1 { 16 } else { 32 };
        let mut scales = Vec::with_capacity(rows * blocks_per_row);
        let mut mins = Vec::new();
        let mut quants = Vec::with_capacity(rows * blocks_per_row * quant_bytes);
        for r in 0..rows {
            let source = row_order.map_or(r, |order| order[r]);
            let row =
                &data[source * blocks_per_row * block_bytes..][..blocks_per_row * block_bytes];
            for block in row.chunks_exact(block_bytes) {
                scales.push(half::f16::from_le_bytes([block[0], block[1]]).to_f32());
                if kind == PackedKind::Q4_1 {
                    mins.push(half::f16::from_le_bytes([block[2], block[3]]).to_f32());
                    quants.extend_from_slice(&block[4..20]);
                } else {
                    quants.extend_from_slice(&block[2..34]);
                }
            }
        }
        Some(Self {
            rows,
            cols,
            kind,
            scales,
            mins,
            quants,
        })
    }

    /// out (N, rows) = x (N, cols) · selfᵀ.
    pub fn matmul(&self, out: &mut [f32], x: &[f32], n: usize) {
        let (o, i) = (self.rows, self.cols);
        // Σ x per block and token, for Q4_1's min term.
        let block_sums: Vec<f32> = x[..n * i]
            .chunks_exact(BLOCK)
            .map(|b| b.iter().sum())
            .collect();
        let mut out_t = vec![0f32; o * n];
        let rows_per_task = 16;
        let avx2 = has_avx2_fma();
        out_t
            .par_chunks_mut(n * rows_per_task)
            .enumerate()
            .for_each(|(task, out_t)| {
                let first_row = task * rows_per_task;
                if avx2 {
                    // SAFETY: the CPU has AVX2 and FMA (checked at run time just above).
                    #[cfg(target_arch = "x86_64")]
                    unsafe {
                        self.rows_avx2(out_t, first_row, x, &block_sums, n);
                    }
                } else {
                    self.rows(out_t, first_row, x, &block_sums, n);
                }
            });
        super::transpose_into(out, &out_t, o, n);
    }

    /// out_t (rows of this task, N) for rows first_row...
    #[inline(always)]
    fn rows(&self, out_t: &mut [f32], first_row: usize, x: &[f32], block_sums: &[f32], n: usize) {
        let (i, blocks) = (self.cols, self.cols / BLOCK);
        for (local, out_row) in out_t.chunks_mut(n).enumerate() {
            let r = first_row + local;
            for (t, y) in out_row.iter_mut().enumerate() {
                let xt = &x[t * i..][..i];
                *y = match self.kind {
                    PackedKind::Q4_1 => {
                        self.row_dot_q4_1(r, xt, &block_sums[t * blocks..][..blocks])
                    }
                    PackedKind::Q8_0 => self.row_dot_q8_0(r, xt),
                };
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn rows_avx2(
        &self,
        out_t: &mut [f32],
        first_row: usize,
        x: &[f32],
        block_sums: &[f32],
        n: usize,
    ) {
        self.rows(out_t, first_row, x, block_sums, n);
    }

    /// Σ_j w_j x_j over one row; vector accumulators run across blocks, so the only
    /// horizontal sum is at the end.
    #[inline(always)]
    fn row_dot_q4_1(&self, r: usize, x: &[f32], block_sums: &[f32]) -> f32 {
        let blocks = self.cols / BLOCK;
        let quants = &self.quants[r * blocks * 16..][..blocks * 16];
        let (scales, mins) = (
            &self.scales[r * blocks..][..blocks],
            &self.mins[r * blocks..][..blocks],
        );
        let mut acc = [0f32; 16];
        let mut min_term = 0f32;
        for (b, (q, xb)) in quants
            .chunks_exact(16)
            .zip(x.chunks_exact(BLOCK))
            .enumerate()
        {
            let d = scales[b];
            let (lo, hi) = xb.split_at(16);
            for j in 0..16 {
                let (q_lo, q_hi) = (f32::from(q[j] & 0x0f), f32::from(q[j] >> 4));
                acc[j] += d * (q_lo * lo[j] + q_hi * hi[j]);
            }
            min_term += mins[b] * block_sums[b];
        }
        acc.iter().sum::<f32>() + min_term
    }

    #[inline(always)]
    fn row_dot_q8_0(&self, r: usize, x: &[f32]) -> f32 {
        let blocks = self.cols / BLOCK;
        let quants = &self.quants[r * blocks * 32..][..blocks * 32];
        let scales = &self.scales[r * blocks..][..blocks];
        let mut acc = [0f32; 32];
        for (b, (q, xb)) in quants
            .chunks_exact(32)
            .zip(x.chunks_exact(BLOCK))
            .enumerate()
        {
            let d = scales[b];
            for j in 0..32 {
                acc[j] += d * f32::from(q[j] as i8) * xb[j];
            }
        }
        acc.iter().sum::<f32>()
    }
}

fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gguf_blocks(kind: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
        let mut data = Vec::new();
        let mut seed = 7u32;
        let mut next = || {
            seed = seed.wrapping_mul(1_103_515_245).wrapping_add(12345);
            (seed >> 16) as u8
        };
        for _ in 0..rows * cols / BLOCK {
            data.extend(half::f16::from_f32(0.01 * f32::from(next() % 50 + 1)).to_le_bytes());
            if kind == GgmlType::Q4_1 {
                data.extend(half::f16::from_f32(-0.1 * f32::from(next() % 7)).to_le_bytes());
                data.extend((0..16).map(|_| next()));
            } else {
                data.extend((0..32).map(|_| next()));
            }
        }
        data
    }

    #[test]
    fn packed_matches_dequantized_f32() {
        for (kind, n) in [
            (GgmlType::Q4_1, 1),
            (GgmlType::Q4_1, 3),
            (GgmlType::Q8_0, 1),
            (GgmlType::Q8_0, 3),
        ] {
            let (rows, cols) = (48, 96);
            let data = gguf_blocks(kind, rows, cols);
            let dense = kind.dequantize(&data, rows * cols).unwrap();
            let packed = PackedMatrix::from_gguf(kind, &data, rows, cols, None).unwrap();
            let x: Vec<f32> = (0..n * cols)
                .map(|j| ((j * 37 % 101) as f32 - 50.0) / 50.0)
                .collect();
            let mut out = vec![0f32; n * rows];
            packed.matmul(&mut out, &x, n);
            for t in 0..n {
                for r in 0..rows {
                    let want: f32 = (0..cols)
                        .map(|c| dense[r * cols + c] * x[t * cols + c])
                        .sum();
                    assert!(
                        (out[t * rows + r] - want).abs() < 1e-3 * (1.0 + want.abs()),
                        "{kind:?} [{t},{r}]"
                    );
                }
            }
        }
    }
}
