//! SIMD dot products of stored Q4_0, Q4_1 and Q8_0 rows with 8-bit input rows on x86-64:
//! AVX-512 VNNI on 256-bit registers (`vpdpbusd`: 32 unsigned × signed byte products summed in
//! fours into 8 i32 lanes, one instruction) for the nibble forms, and AVX2 (`vpmaddubsw` then
//! `vpmaddwd`) for all three (Q8_0's AVX2 form measured faster than a VNNI one on Zen 4).
//!
//! Every function here is `#[target_feature]`: the caller must have detected the features at
//! run time (see `super::Kernel::detect`). Each checks the lengths of its slices once, before any
//! load, so that every unaligned load below stays inside them; the loads are the only unsafe
//! operations.
//!
//! Nibble forms are unsigned (0..15), which is exactly the unsigned operand these instructions
//! take: the products need no sign trick, and the forms' offsets (Q4_1's min, Q4_0's −8) are
//! applied once per block through the input block's scaled sum. Q8_0's signed weights go in as
//! magnitudes, their signs moved onto the inputs (the inputs are in [-127, 127], so negating
//! one never overflows).

use std::arch::x86_64::*;

use super::act::{ActRow, BLOCK};

/// Checks that `row` holds `x.blocks()` blocks of `block_bytes` and that `x` is whole: every
/// pointer below stays inside the slices after this.
fn check(row: &[u8], x: ActRow, block_bytes: usize) {
    let blocks = x.blocks();
    assert!(
        row.len() >= blocks * block_bytes
            && x.quants.len() >= blocks * BLOCK
            && x.sums.len() >= blocks,
        "stored rows: a weight row of {} bytes for {blocks} blocks of {block_bytes}",
        row.len()
    );
}

/// `[scale × x_scale, offset × x_sum]` for two blocks at once, as `[a0, b0, a1, b1]`: the two
/// blocks' f16 `(scale, offset)` pairs, widened, times the inputs' `(scale, scaled sum)`.
/// `pair0`/`pair1` hold each block's scale in their low 16 bits and its offset's f16 in the
/// high 16 bits (Q4_0 passes its scale twice and `offset_factor` −8).
#[target_feature(enable = "avx2,f16c")]
fn scale_pairs(pair0: u32, pair1: u32, x: ActRow, j: usize, offset_factor: f32) -> __m128 {
    let halves = _mm_set_epi32(0, 0, pair1 as i32, pair0 as i32);
    let w = _mm_mul_ps(
        _mm_cvtph_ps(halves),
        _mm_set_ps(offset_factor, 1.0, offset_factor, 1.0),
    );
    let x = _mm_setr_ps(x.scales[j], x.sums[j], x.scales[j + 1], x.sums[j + 1]);
    _mm_mul_ps(w, x)
}

fn read_u16(bytes: &[u8], at: usize) -> u32 {
    u32::from(u16::from_le_bytes([bytes[at], bytes[at + 1]]))
}

/// A block's `(scale, offset)` halves as [`scale_pairs`] takes them.
fn q4_pair<const MIN: bool>(block: &[u8]) -> u32 {
    let d = read_u16(block, 0);
    if MIN {
        d | (read_u16(block, 2) << 16)
    } else {
        d | (d << 16)
    }
}

/// Up to 8 blocks' first 4 bytes (their f16 scale, and Q4_1's f16 min) from `blocks` (the
/// blocks from the first one on, `bytes` each): lanes `>= count` are 0.
///
/// # Safety
/// `blocks` must hold at least `count` (≤ 8) whole blocks of `bytes` ≥ 4.
#[target_feature(enable = "avx512f,avx512vl,avx2")]
unsafe fn block_heads_8(blocks: *const u8, bytes: usize, count: usize) -> (__m256i, __mmask8) {
    let mask: __mmask8 = if count >= 8 { 0xFF } else { (1u8 << count) - 1 };
    let starts = _mm256_mullo_epi32(
        _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0),
        _mm256_set1_epi32(bytes as i32),
    );
    // SAFETY: the lanes of the mask read 4 bytes at the start of one of the first `count`
    // blocks, inside them by the caller's promise; masked-off lanes read nothing.
    let heads = unsafe {
        _mm256_mmask_i32gather_epi32::<1>(_mm256_setzero_si256(), mask, starts, blocks.cast())
    };
    (heads, mask)
}

/// Stored Q4_1 (`MIN`) or Q4_0 row · `x`: per 8 blocks, their scales gathered and multiplied by
/// the inputs' at once; then per pair of blocks, one 256-bit load of both blocks' nibbles, split
/// into low and high nibbles, each dotted with the paired inputs (see
/// `QuantizedRows::paired`): the 8 i32 sums are block j's in lanes 0..4 and block j + 1's in
/// lanes 4..8. 256-bit operations: on cores that split 512-bit ones in two (Zen 4) they do the
/// same work in fewer shuffles.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c,fma")]
pub fn q4_vnni<const MIN: bool>(row: &[u8], x: ActRow) -> f32 {
    q4_vnni_rows::<MIN, 1>([row], x)[0]
}

/// [`q4_vnni`] for `R` weight rows at once: the inputs are loaded once for all of them, each row
/// has its own accumulators (so no row waits on another's additions), and each row's sum is
/// exactly what [`q4_vnni`] returns for it alone (the same operations in the same order).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c,fma")]
pub fn q4_vnni_rows<const MIN: bool, const R: usize>(rows: [&[u8]; R], x: ActRow) -> [f32; R] {
    let bytes = if MIN { 20 } else { 18 };
    let qs = bytes - BLOCK / 2;
    for row in rows {
        check(row, x, bytes);
    }
    assert!(x.paired.len() >= x.blocks() * BLOCK);
    let blocks = x.blocks();
    let low = _mm256_set1_epi8(0x0F);
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    let mut offsets = [_mm256_setzero_ps(); R];
    let mut first = 0;
    while first < blocks {
        let count = (blocks - first).min(8);
        // SAFETY: `check`: blocks `first..first + count` of every row are whole, and `x` holds
        // their scales, sums and (paired) quants; each pointer below addresses one of them.
        unsafe {
            let mask: __mmask8 = if count >= 8 { 0xFF } else { (1u8 << count) - 1 };
            let x_scales = _mm256_maskz_loadu_ps(mask, x.scales.as_ptr().add(first));
            let x_sums = _mm256_maskz_loadu_ps(mask, x.sums.as_ptr().add(first));
            let mut scales = [_mm256_setzero_ps(); R];
            let mut bases = [std::ptr::null::<u8>(); R];
            for r in 0..R {
                bases[r] = rows[r].as_ptr().add(first * bytes);
                let (heads, _) = block_heads_8(bases[r], bytes, count);
                let d = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(heads));
                scales[r] = _mm256_mul_ps(d, x_scales);
                let offset = if MIN {
                    _mm256_cvtph_ps(_mm256_cvtepi32_epi16(_mm256_srli_epi32::<16>(heads)))
                } else {
                    _mm256_mul_ps(d, _mm256_set1_ps(-8.0))
                };
                offsets[r] = _mm256_fmadd_ps(offset, x_sums, offsets[r]);
            }
            let mut pair = _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0);
            let xp = x.paired.as_ptr().add(first * BLOCK);
            let mut j = 0;
            while j + 2 <= count {
                let x_lo = _mm256_loadu_si256(xp.add(j * BLOCK).cast());
                let x_hi = _mm256_loadu_si256(xp.add(j * BLOCK + BLOCK).cast());
                for r in 0..R {
                    let q0 = _mm_loadu_si128(bases[r].add(j * bytes + qs).cast());
                    let q1 = _mm_loadu_si128(bases[r].add((j + 1) * bytes + qs).cast());
                    let both = _mm256_set_m128i(q1, q0);
                    let lo = _mm256_and_si256(both, low);
                    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(both), low);
                    let sums = _mm256_dpbusd_epi32(
                        _mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, x_lo),
                        hi,
                        x_hi,
                    );
                    let s = _mm256_permutevar8x32_ps(scales[r], pair);
                    let a = &mut acc[r][(j / 2) % 2];
                    *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), s, *a);
                }
                pair = _mm256_add_epi32(pair, _mm256_set1_epi32(2));
                j += 2;
            }
            if j < count {
                // A row's odd last block: its paired quants are its own, in order.
                let xv = _mm256_loadu_si256(xp.add(j * BLOCK).cast());
                let at = _mm256_set1_epi32(j as i32);
                for r in 0..R {
                    let q = _mm_loadu_si128(bases[r].add(j * bytes + qs).cast());
                    let nibbles =
                        _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(q), q), low);
                    let sums = _mm256_dpbusd_epi32(_mm256_setzero_si256(), nibbles, xv);
                    let s = _mm256_permutevar8x32_ps(scales[r], at);
                    acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), s, acc[r][1]);
                }
            }
        }
        first += count;
    }
    let mut out = [0f32; R];
    for r in 0..R {
        out[r] = sum_256(_mm256_add_ps(
            _mm256_add_ps(acc[r][0], acc[r][1]),
            offsets[r],
        ));
    }
    out
}

/// Stored Q4_1 (`MIN`) or Q4_0 row · `x` with AVX2, two blocks per step.
#[target_feature(enable = "avx2,f16c,fma")]
pub fn q4_avx2<const MIN: bool>(row: &[u8], x: ActRow) -> f32 {
    let bytes = if MIN { 20 } else { 18 };
    let qs = bytes - BLOCK / 2;
    let offset_factor = if MIN { 1.0 } else { -8.0 };
    check(row, x, bytes);
    let blocks = x.blocks();
    let low = _mm_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    let mut acc = _mm256_setzero_ps();
    let mut offsets = _mm_setzero_ps();
    let mut j = 0;
    while j + 2 <= blocks {
        let b0 = &row[j * bytes..(j + 1) * bytes];
        let b1 = &row[(j + 1) * bytes..(j + 2) * bytes];
        let scales = scale_pairs(q4_pair::<MIN>(b0), q4_pair::<MIN>(b1), x, j, offset_factor);
        offsets = _mm_add_ps(offsets, scales);
        for (i, block) in [b0, b1].into_iter().enumerate() {
            // SAFETY: as in `q4_vnni`: the last 16 bytes of a whole block, and 32 input quants
            // of block j + i < blocks.
            let (q, xq) = unsafe {
                (
                    _mm_loadu_si128(block.as_ptr().add(qs).cast()),
                    _mm256_loadu_si256(x.quants.as_ptr().add((j + i) * BLOCK).cast()),
                )
            };
            let nibbles = _mm256_set_m128i(
                _mm_and_si128(_mm_srli_epi16(q, 4), low),
                _mm_and_si128(q, low),
            );
            let sums = _mm256_madd_epi16(_mm256_maddubs_epi16(nibbles, xq), ones);
            let scale = _mm256_set1_ps(lane(scales, 2 * i));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc);
        }
        j += 2;
    }
    let mut sum = sum_256(acc) + lanes_1_and_3(offsets);
    if j < blocks {
        sum += super::formats::dot_scalar(
            if MIN {
                super::Format::Q4_1
            } else {
                super::Format::Q4_0
            },
            &row[j * bytes..(j + 1) * bytes],
            x.tail(j),
        );
    }
    sum
}

/// Stored Q8_0 row · `x` with AVX2, one block per step.
#[target_feature(enable = "avx2,f16c,fma")]
pub fn q8_0_avx2(row: &[u8], x: ActRow) -> f32 {
    const BYTES: usize = 34;
    check(row, x, BYTES);
    let ones = _mm256_set1_epi16(1);
    let mut acc = _mm256_setzero_ps();
    for (j, block) in row.chunks_exact(BYTES).take(x.blocks()).enumerate() {
        // SAFETY: bytes 2..34 of a whole block; 32 input quants of block j < blocks.
        let (w, xq) = unsafe {
            (
                _mm256_loadu_si256(block.as_ptr().add(2).cast()),
                _mm256_loadu_si256(x.quants.as_ptr().add(j * BLOCK).cast()),
            )
        };
        // |w| (unsigned; -128 reads as 128) times x with w's sign: exact, and the pair sums
        // stay within i16 (2 × 128 × 127).
        let pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xq, w));
        let sums = _mm256_madd_epi16(pairs, ones);
        let d = half::f16::from_bits(read_u16(block, 0) as u16).to_f32();
        let scale = _mm256_set1_ps(d * x.scales[j]);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc);
    }
    sum_256(acc)
}

fn lane(v: __m128, i: usize) -> f32 {
    let mut lanes = [0f32; 4];
    // SAFETY: `lanes` is 16 bytes.
    unsafe { _mm_storeu_ps(lanes.as_mut_ptr(), v) };
    lanes[i]
}

fn lanes_1_and_3(v: __m128) -> f32 {
    lane(v, 1) + lane(v, 3)
}

#[target_feature(enable = "avx2")]
fn sum_256(x: __m256) -> f32 {
    let sum = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
    let sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
    _mm_cvtss_f32(_mm_add_ss(sum, _mm_movehdup_ps(sum)))
}
