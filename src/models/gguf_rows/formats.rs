//! The GGUF block forms read as stored, and their dot products with a quantized input row
//! without SIMD: the portable path, and the reference the SIMD forms are tested against.
//!
//! Layouts (ggml's `block_*` structs, little-endian, f16 scales):
//! - Q4_0, 18 bytes per 32 values: `d`, 16 bytes of nibbles; value = d × (nibble − 8).
//! - Q4_1, 20 bytes: `d`, `m`, 16 bytes of nibbles; value = d × nibble + m.
//! - Q8_0, 34 bytes: `d`, 32 signed quants; value = d × quant.
//! - Q4_K, 144 bytes per 256 values: `d`, `dmin`, 12 bytes of 6-bit scales and mins for eight
//!   sub-blocks of 32, 128 bytes of nibbles; value = d × scale × nibble − dmin × min.
//! - Q6_K, 210 bytes per 256 values: 128 bytes of low nibbles, 64 of high bit pairs, 16 signed
//!   8-bit scales (one per 16 values), `d`; value = d × scale × (6-bit quant − 32).
//!
//! In each 32-value block of nibbles, byte `l` holds value `l` in its low nibble and value
//! `l + 16` in its high one.

use candle_core::quantized::GgmlDType;

use super::act::{ActRow, BLOCK};

/// A block form this module multiplies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Format {
    Q4_0,
    Q4_1,
    Q8_0,
    Q4K,
    Q6K,
}

/// Values per super-block of the k-quants.
pub const SUPER: usize = 256;

impl Format {
    /// The form of a GGUF type, if it is one of these.
    pub fn of(dtype: GgmlDType) -> Option<Self> {
        Some(match dtype {
            GgmlDType::Q4_0 => Self::Q4_0,
            GgmlDType::Q4_1 => Self::Q4_1,
            GgmlDType::Q8_0 => Self::Q8_0,
            GgmlDType::Q4K => Self::Q4K,
            GgmlDType::Q6K => Self::Q6K,
            _ => return None,
        })
    }

    /// Values per stored block.
    pub fn block_values(self) -> usize {
        match self {
            Self::Q4_0 | Self::Q4_1 | Self::Q8_0 => BLOCK,
            Self::Q4K | Self::Q6K => SUPER,
        }
    }

    /// Bytes per stored block.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q8_0 => 34,
            Self::Q4K => 144,
            Self::Q6K => 210,
        }
    }
}

pub fn f16_at(bytes: &[u8], at: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([bytes[at], bytes[at + 1]])).to_f32()
}

/// Σ u × x over two equal-length slices, in integers.
fn int_dot(u: &[u8], x: &[i8]) -> i32 {
    u.iter()
        .zip(x)
        .map(|(&u, &x)| i32::from(u) * i32::from(x))
        .sum()
}

/// One stored weight row (`row` holds whole blocks covering `x`'s values) times `x`, without
/// SIMD. Integer sums per scale group, then floats.
pub fn dot_scalar(format: Format, row: &[u8], x: ActRow) -> f32 {
    let bytes = format.block_bytes();
    let mut sum = 0f32;
    match format {
        Format::Q4_0 | Format::Q4_1 => {
            let qs_at = if format == Format::Q4_1 { 4 } else { 2 };
            for (j, block) in row.chunks_exact(bytes).enumerate() {
                let mut nibbles = [0u8; BLOCK];
                for (l, &b) in block[qs_at..qs_at + BLOCK / 2].iter().enumerate() {
                    nibbles[l] = b & 0x0F;
                    nibbles[l + BLOCK / 2] = b >> 4;
                }
                let dot = int_dot(&nibbles, &x.quants[j * BLOCK..(j + 1) * BLOCK]);
                let (x_scale, x_sum) = (x.scales[j], x.sums[j]);
                let d = f16_at(block, 0);
                let offset = match format {
                    Format::Q4_1 => f16_at(block, 2),
                    _ => -8.0 * d,
                };
                sum += d * x_scale * dot as f32 + offset * x_sum;
            }
        }
        Format::Q8_0 => {
            for (j, block) in row.chunks_exact(bytes).enumerate() {
                let dot: i32 = block[2..2 + BLOCK]
                    .iter()
                    .zip(&x.quants[j * BLOCK..(j + 1) * BLOCK])
                    .map(|(&w, &x)| i32::from(w as i8) * i32::from(x))
                    .sum();
                sum += f16_at(block, 0) * x.scales[j] * dot as f32;
            }
        }
        Format::Q4K => {
            for (s, block) in row.chunks_exact(bytes).enumerate() {
                let (quants, scales, mins) = unpack_q4k(block);
                for j in 0..SUPER / BLOCK {
                    let b = s * SUPER / BLOCK + j;
                    let dot = int_dot(
                        &quants[j * BLOCK..(j + 1) * BLOCK],
                        &x.quants[b * BLOCK..(b + 1) * BLOCK],
                    );
                    let (x_scale, x_sum) = (x.scales[b], x.sums[b]);
                    sum += scales[j] * x_scale * dot as f32 - mins[j] * x_sum;
                }
            }
        }
        Format::Q6K => {
            for (s, block) in row.chunks_exact(bytes).enumerate() {
                let (quants, scales) = unpack_q6k(block);
                for g in 0..SUPER / 16 {
                    let h = s * SUPER / 16 + g; // half block of the input
                    let dot = int_dot(
                        &quants[g * 16..(g + 1) * 16],
                        &x.quants[h * 16..(h + 1) * 16],
                    ) - 32 * x.half_sums[h];
                    sum += scales[g] * x.scales[h / 2] * dot as f32;
                }
            }
        }
    }
    sum
}

/// Q4_K's 6-bit scale and min of sub-block `j` (ggml's `get_scale_min_k4`).
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// A Q4_K super-block as 256 nibbles in value order, with each sub-block's `d × scale` and
/// `dmin × min`.
pub fn unpack_q4k(block: &[u8]) -> ([u8; SUPER], [f32; 8], [f32; 8]) {
    let d = f16_at(block, 0);
    let dmin = f16_at(block, 2);
    let packed = &block[4..16];
    let qs = &block[16..144];
    let mut quants = [0u8; SUPER];
    let (mut scales, mut mins) = ([0f32; 8], [0f32; 8]);
    for j in 0..8 {
        let (sc, m) = scale_min_k4(j, packed);
        scales[j] = d * f32::from(sc);
        mins[j] = dmin * f32::from(m);
        // Sub-blocks 2p and 2p + 1 share 32 bytes: low nibbles, then high ones.
        let bytes = &qs[(j / 2) * 32..(j / 2) * 32 + 32];
        for (q, &b) in quants[j * BLOCK..(j + 1) * BLOCK].iter_mut().zip(bytes) {
            *q = if j % 2 == 0 { b & 0x0F } else { b >> 4 };
        }
    }
    (quants, scales, mins)
}

/// A Q6_K super-block as 256 unsigned 6-bit quants (value + 32) in value order, with each
/// group of 16's `d × scale`.
pub fn unpack_q6k(block: &[u8]) -> ([u8; SUPER], [f32; 16]) {
    let (ql, qh, sc) = (&block[..128], &block[128..192], &block[192..208]);
    let d = f16_at(block, 208);
    let mut quants = [0u8; SUPER];
    for half in 0..2 {
        let (ql, qh) = (
            &ql[half * 64..half * 64 + 64],
            &qh[half * 32..half * 32 + 32],
        );
        let out = &mut quants[half * 128..half * 128 + 128];
        for l in 0..32 {
            out[l] = (ql[l] & 0x0F) | ((qh[l] & 3) << 4);
            out[l + 32] = (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4);
            out[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
            out[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
        }
    }
    let mut scales = [0f32; 16];
    for (s, &c) in scales.iter_mut().zip(sc) {
        *s = d * f32::from(c as i8);
    }
    (quants, scales)
}
