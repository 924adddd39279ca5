//! ggml tensor types and their dequantization to f32 (the reference layouts of
//! llama.cpp's `ggml-quants.c`). Blocks of 32 (or 256 for k-quants) values share scales.

use half::f16;

#[derive(Debug, thiserror::Error)]
pub enum QuantError {
    #[error("{kind:?} holds blocks of {block} values; {elements} is not a multiple")]
    Ragged {
        kind: GgmlType,
        block: usize,
        elements: usize,
    },
    #[error("{kind:?} needs {needed} bytes for {elements} values, got {got}")]
    Short {
        kind: GgmlType,
        elements: usize,
        needed: usize,
        got: usize,
    },
    #[error("tensor type {0:?} is not supported yet")]
    Unsupported(GgmlType),
    #[error("{elements} values of {kind:?} take more bytes than can be addressed")]
    TooLarge { kind: GgmlType, elements: usize },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Bf16,
}

const QK: usize = 32;
const QK_K: usize = 256;

impl GgmlType {
    pub fn from_raw(raw: u32) -> Option<Self> {
        Some(match raw {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            10 => GgmlType::Q2K,
            11 => GgmlType::Q3K,
            12 => GgmlType::Q4K,
            13 => GgmlType::Q5K,
            14 => GgmlType::Q6K,
            30 => GgmlType::Bf16,
            _ => return None,
        })
    }

    /// (values per block, bytes per block)
    fn block(self) -> (usize, usize) {
        match self {
            GgmlType::F32 => (1, 4),
            GgmlType::F16 | GgmlType::Bf16 => (1, 2),
            GgmlType::Q4_0 => (QK, 2 + QK / 2),
            GgmlType::Q4_1 => (QK, 4 + QK / 2),
            GgmlType::Q5_0 => (QK, 2 + 4 + QK / 2),
            GgmlType::Q5_1 => (QK, 4 + 4 + QK / 2),
            GgmlType::Q8_0 => (QK, 2 + QK),
            GgmlType::Q2K => (QK_K, QK_K / 16 + QK_K / 4 + 4),
            GgmlType::Q3K => (QK_K, QK_K / 8 + QK_K / 4 + 12 + 2),
            GgmlType::Q4K => (QK_K, 4 + 12 + QK_K / 2),
            GgmlType::Q5K => (QK_K, 4 + 12 + QK_K / 8 + QK_K / 2),
            GgmlType::Q6K => (QK_K, QK_K / 2 + QK_K / 4 + QK_K / 16 + 2),
        }
    }

    pub fn bytes_for(self, elements: usize) -> Result<usize, QuantError> {
        let (block, bytes) = self.block();
        if !elements.is_multiple_of(block) {
            return Err(QuantError::Ragged {
                kind: self,
                block,
                elements,
            });
        }
        // Blocks take fewer bytes than their elements' f32s, except for one-element
        // kinds (f32: 4 bytes each), which can overflow on a crafted count.
        (elements / block)
            .checked_mul(bytes)
            .ok_or(QuantError::TooLarge {
                kind: self,
                elements,
            })
    }

    pub fn dequantize(self, data: &[u8], elements: usize) -> Result<Vec<f32>, QuantError> {
        let needed = self.bytes_for(elements)?;
        if data.len() < needed {
            return Err(QuantError::Short {
                kind: self,
                elements,
                needed,
                got: data.len(),
            });
        }
        let data = &data[..needed];
        let mut out = vec![0f32; elements];
        let (block, bytes) = self.block();
        let blocks = data.chunks_exact(bytes).zip(out.chunks_exact_mut(block));
        match self {
            GgmlType::F32 => {
                blocks.for_each(|(b, o)| o[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            }
            GgmlType::F16 => blocks.for_each(|(b, o)| o[0] = f16_at(b, 0)),
            GgmlType::Bf16 => {
                blocks.for_each(|(b, o)| o[0] = half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            }
            GgmlType::Q4_0 => blocks.for_each(|(b, o)| {
                let d = f16_at(b, 0);
                for j in 0..QK / 2 {
                    let q = b[2 + j];
                    o[j] = d * (f32::from(q & 0x0f) - 8.0);
                    o[j + QK / 2] = d * (f32::from(q >> 4) - 8.0);
                }
            }),
            GgmlType::Q4_1 => blocks.for_each(|(b, o)| {
                let (d, m) = (f16_at(b, 0), f16_at(b, 2));
                for j in 0..QK / 2 {
                    let q = b[4 + j];
                    o[j] = d * f32::from(q & 0x0f) + m;
                    o[j + QK / 2] = d * f32::from(q >> 4) + m;
                }
            }),
            GgmlType::Q5_0 => blocks.for_each(|(b, o)| {
                let d = f16_at(b, 0);
                let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
                for j in 0..QK / 2 {
                    let q = b[6 + j];
                    let h0 = ((qh >> j) << 4) & 0x10;
                    let h1 = (qh >> (j + 12)) & 0x10;
                    o[j] = d * ((u32::from(q & 0x0f) | h0) as f32 - 16.0);
                    o[j + QK / 2] = d * ((u32::from(q >> 4) | h1) as f32 - 16.0);
                }
            }),
            GgmlType::Q5_1 => blocks.for_each(|(b, o)| {
                let (d, m) = (f16_at(b, 0), f16_at(b, 2));
                let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
                for j in 0..QK / 2 {
                    let q = b[8 + j];
                    let h0 = ((qh >> j) << 4) & 0x10;
                    let h1 = (qh >> (j + 12)) & 0x10;
                    o[j] = d * (u32::from(q & 0x0f) | h0) as f32 + m;
                    o[j + QK / 2] = d * (u32::from(q >> 4) | h1) as f32 + m;
                }
            }),
            GgmlType::Q8_0 => blocks.for_each(|(b, o)| {
                let d = f16_at(b, 0);
                for j in 0..QK {
                    o[j] = d * f32::from(b[2 + j] as i8);
                }
            }),
            GgmlType::Q4K => blocks.for_each(|(b, o)| dequantize_q4_k(b, o)),
            GgmlType::Q5K => blocks.for_each(|(b, o)| dequantize_q5_k(b, o)),
            GgmlType::Q6K => blocks.for_each(|(b, o)| dequantize_q6_k(b, o)),
            GgmlType::Q2K | GgmlType::Q3K => return Err(QuantError::Unsupported(self)),
        }
        Ok(out)
    }
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// The 6-bit scale and min of sub-block `j` of a k-quant's 12 packed scale bytes.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

fn dequantize_q4_k(b: &[u8], o: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    let qs = &b[16..16 + QK_K / 2];
    let mut is = 0;
    for (chunk, q) in o.chunks_exact_mut(64).zip(qs.chunks_exact(32)) {
        let (sc, m) = scale_min_k4(is, scales);
        let (d1, m1) = (d * f32::from(sc), dmin * f32::from(m));
        let (sc, m) = scale_min_k4(is + 1, scales);
        let (d2, m2) = (d * f32::from(sc), dmin * f32::from(m));
        for l in 0..32 {
            chunk[l] = d1 * f32::from(q[l] & 0x0f) - m1;
            chunk[l + 32] = d2 * f32::from(q[l] >> 4) - m2;
        }
        is += 2;
    }
}

fn dequantize_q5_k(b: &[u8], o: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    let qh = &b[16..16 + QK_K / 8];
    let qs = &b[16 + QK_K / 8..16 + QK_K / 8 + QK_K / 2];
    let (mut is, mut u1, mut u2) = (0, 1u8, 2u8);
    for (chunk, ql) in o.chunks_exact_mut(64).zip(qs.chunks_exact(32)) {
        let (sc, m) = scale_min_k4(is, scales);
        let (d1, m1) = (d * f32::from(sc), dmin * f32::from(m));
        let (sc, m) = scale_min_k4(is + 1, scales);
        let (d2, m2) = (d * f32::from(sc), dmin * f32::from(m));
        for l in 0..32 {
            let h1 = if qh[l] & u1 != 0 { 16.0 } else { 0.0 };
            let h2 = if qh[l] & u2 != 0 { 16.0 } else { 0.0 };
            chunk[l] = d1 * (f32::from(ql[l] & 0x0f) + h1) - m1;
            chunk[l + 32] = d2 * (f32::from(ql[l] >> 4) + h2) - m2;
        }
        is += 2;
        u1 <<= 2;
        u2 <<= 2;
    }
}

fn dequantize_q6_k(b: &[u8], o: &mut [f32]) {
    let ql_all = &b[..QK_K / 2];
    let qh_all = &b[QK_K / 2..QK_K / 2 + QK_K / 4];
    let sc_all = &b[QK_K / 2 + QK_K / 4..QK_K / 2 + QK_K / 4 + QK_K / 16];
    let d = f16_at(b, QK_K / 2 + QK_K / 4 + QK_K / 16);
    for half_block in 0..2 {
        let ql = &ql_all[half_block * 64..];
        let qh = &qh_all[half_block * 32..];
        let sc = &sc_all[half_block * 8..];
        let y = &mut o[half_block * 128..];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            y[l] = d * f32::from(sc[is] as i8) * q1 as f32;
            y[l + 32] = d * f32::from(sc[is + 2] as i8) * q2 as f32;
            y[l + 64] = d * f32::from(sc[is + 4] as i8) * q3 as f32;
            y[l + 96] = d * f32::from(sc[is + 6] as i8) * q4 as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q8_0_block_decodes() {
        let mut block = f16::from_f32(0.5).to_le_bytes().to_vec();
        block.extend((0..32).map(|i| (i as i8 - 16) as u8));
        let out = GgmlType::Q8_0.dequantize(&block, 32).unwrap();
        assert_eq!(out[0], -8.0);
        assert_eq!(out[31], 7.5);
    }

    #[test]
    fn q4_1_block_decodes_low_then_high_nibbles() {
        let mut block = f16::from_f32(2.0).to_le_bytes().to_vec();
        block.extend(f16::from_f32(-1.0).to_le_bytes());
        block.extend((0..16).map(|i| (i as u8) | (((15 - i) as u8) << 4)));
        let out = GgmlType::Q4_1.dequantize(&block, 32).unwrap();
        assert_eq!(out[0], -1.0); // 2*0 - 1
        assert_eq!(out[15], 29.0); // 2*15 - 1
        assert_eq!(out[16], 29.0); // high nibble of byte 0 = 15
        assert_eq!(out[31], -1.0);
    }

    #[test]
    fn sizes_are_checked() {
        assert!(matches!(
            GgmlType::Q8_0.dequantize(&[0; 10], 32),
            Err(QuantError::Short { .. })
        ));
        assert!(matches!(
            GgmlType::Q8_0.bytes_for(33),
            Err(QuantError::Ragged { .. })
        ));
    }
}
