//! Linear layers straight from llama.cpp's block formats, for decoding. A decode step
//! reads every weight once for a handful of tokens, so its speed is memory bandwidth:
//! reading Q4_1 (5 bits a weight) or Q8_0 (8.5 bits) instead of f32 is 4-6x less traffic.
//! The arithmetic stays f32 on the very values the f32 path dequantizes to (d·q + m for
//! Q4_1, d·q for Q8_0, each rounded as `quant.rs` rounds it).
//!
//! The products are [`thin`](super::thin)'s: each block is turned into f32 once per
//! decode step and multiplied into every token of the batch.
#![allow(unsafe_code)]

use super::thin::{self, BLOCK, Lanes};
use crate::quant::GgmlType;

/// A (rows, cols) weight in a block format: every block of 32 weights is one record of
/// `block_bytes()` in `blocks` — GGUF's own record, its f16 scale (and min) beside its
/// quants — rows one after another, so a decode step reads each row as one sequential
/// stream, and no more bytes than llama.cpp reads.
#[derive(Clone, Debug)]
pub struct PackedMatrix {
    pub rows: usize,
    pub cols: usize,
    kind: PackedKind,
    /// Q4_1: d (f16), m (f16), 16 bytes (low nibbles = values 0..16, high = 16..32).
    /// Q8_0: d (f16), 32 signed bytes.
    blocks: Vec<u8>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PackedKind {
    Q4_1,
    Q8_0,
}

impl PackedKind {
    /// Bytes of one block record.
    const fn block_bytes(self) -> usize {
        match self {
            PackedKind::Q4_1 => 20,
            PackedKind::Q8_0 => 34,
        }
    }
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
        let kind = match kind {
            GgmlType::Q4_1 => PackedKind::Q4_1,
            GgmlType::Q8_0 => PackedKind::Q8_0,
            _ => return None,
        };
        let row_bytes = cols / BLOCK * kind.block_bytes();
        if !cols.is_multiple_of(BLOCK) || data.len() < rows * row_bytes {
            return None;
        }
        let mut blocks = Vec::with_capacity(rows * row_bytes);
        for r in 0..rows {
            let source = row_order.map_or(r, |order| order[r]);
            blocks.extend_from_slice(&data[source * row_bytes..][..row_bytes]);
        }
        Some(Self {
            rows,
            cols,
            kind,
            blocks,
        })
    }

    /// out (N, rows) = x (N, cols) · selfᵀ, reading every block once for all N tokens.
    pub fn matmul(&self, out: &mut [f32], x: &[f32], n: usize) {
        match self.kind {
            PackedKind::Q4_1 => thin::matmul(&Q4_1Rows(self), out, x, n),
            PackedKind::Q8_0 => thin::matmul(&Q8_0Rows(self), out, x, n),
        }
    }

    /// The first block record of row r.
    fn row_start(&self, r: usize) -> *const u8 {
        self.blocks[r * (self.cols / BLOCK) * self.kind.block_bytes()..].as_ptr()
    }
}

/// A Q4_1 matrix as the thin kernel reads it.
struct Q4_1Rows<'a>(&'a PackedMatrix);
/// A Q8_0 matrix as the thin kernel reads it.
struct Q8_0Rows<'a>(&'a PackedMatrix);

impl thin::WeightRows for Q4_1Rows<'_> {
    const BLOCK_BYTES: usize = 20;

    fn rows(&self) -> usize {
        self.0.rows
    }

    fn cols(&self) -> usize {
        self.0.cols
    }

    fn row_start(&self, r: usize) -> *const u8 {
        self.0.row_start(r)
    }

    #[inline(always)]
    unsafe fn decode<L: Lanes>(p: *const u8) -> (L, L) {
        // SAFETY: p is a 20-byte record inside `blocks` (the trait's contract); the CPU
        // supports L (also the contract).
        unsafe { L::q4_1(p) }
    }
}

impl thin::WeightRows for Q8_0Rows<'_> {
    const BLOCK_BYTES: usize = 34;

    fn rows(&self) -> usize {
        self.0.rows
    }

    fn cols(&self) -> usize {
        self.0.cols
    }

    fn row_start(&self, r: usize) -> *const u8 {
        self.0.row_start(r)
    }

    #[inline(always)]
    unsafe fn decode<L: Lanes>(p: *const u8) -> (L, L) {
        // SAFETY: p is a 34-byte record inside `blocks` (the trait's contract); the CPU
        // supports L (also the contract).
        unsafe {
            let d = L::splat_f16(p);
            let q = p.add(2);
            (L::mul(d, L::from_i8(q)), L::mul(d, L::from_i8(q.add(16))))
        }
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

    /// Times a one-hot row, the product is the weight itself: every column of a packed
    /// matrix holds exactly the bits `quant.rs` dequantizes it to, on this CPU's kernel.
    #[test]
    fn packed_weights_are_the_dequantized_bits() {
        for kind in [GgmlType::Q4_1, GgmlType::Q8_0] {
            let (rows, cols) = (24, 64);
            let data = gguf_blocks(kind, rows, cols);
            let dense = kind.dequantize(&data, rows * cols).unwrap();
            let packed = PackedMatrix::from_gguf(kind, &data, rows, cols, None).unwrap();
            for c in 0..cols {
                let mut x = vec![0f32; cols];
                x[c] = 1.0;
                let mut out = vec![0f32; rows];
                packed.matmul(&mut out, &x, 1);
                for r in 0..rows {
                    assert_eq!(
                        out[r].to_bits(),
                        dense[r * cols + c].to_bits(),
                        "{kind:?} [{r},{c}]"
                    );
                }
            }
        }
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
