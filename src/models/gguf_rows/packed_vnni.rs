//! The AVX-512 VNNI tile of [`super::packed::PackedBlocks`]: `R` input rows × `G` groups of 16
//! outputs, one block of 32 values at a time. Per run of four values, each group's 64 quant
//! bytes are loaded once and `vpdpbusd` adds, for every row, the row's four quants (broadcast)
//! times each output's four into that output's i32 lane. At the end of a block the i32 sums are
//! scaled into f32 accumulators, with the block's offset times the input block's scaled sum.
//!
//! The function is `#[target_feature]`: the caller must have detected the features at run time
//! (see `super::Kernel::detect`). It checks the lengths of its slices once, before any load.

use std::arch::x86_64::*;

use super::act::BLOCK;
use super::packed::{TileInputs, GROUP, GROUP_BLOCK_BYTES};

/// Writes the outputs `0..cols` (at most `16 × G`, more than `16 × (G − 1)`) of input rows
/// `0..R` of the tile to `out`, row `r` at `r × stride`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub fn tile<const R: usize, const G: usize>(
    t: TileInputs,
    out: &mut [f32],
    stride: usize,
    cols: usize,
) {
    let blocks = t.blocks;
    let row_len = blocks * BLOCK;
    assert!(
        t.quants.len() >= G * blocks * GROUP_BLOCK_BYTES
            && t.scales.len() >= G * blocks * GROUP
            && t.offsets.len() >= G * blocks * GROUP
            && t.x_quants.len() >= R * row_len
            && t.x_scales.len() >= R * blocks
            && t.x_sums.len() >= R * blocks
            && cols <= G * GROUP
            && cols > (G - 1) * GROUP
            && out.len() >= (R - 1) * stride + cols,
        "packed blocks: a tile of {R} rows × {cols} outputs over slices too short"
    );
    let mut acc = [[_mm512_setzero_ps(); G]; R];
    for b in 0..blocks {
        let mut sums = [[_mm512_setzero_si512(); G]; R];
        for run in 0..BLOCK / 4 {
            let mut w = [_mm512_setzero_si512(); G];
            for (j, w) in w.iter_mut().enumerate() {
                let at = (j * blocks + b) * GROUP_BLOCK_BYTES + run * 4 * GROUP;
                // SAFETY: `at + 64 <= G × blocks × GROUP_BLOCK_BYTES`, checked above.
                *w = unsafe { _mm512_loadu_si512(t.quants.as_ptr().add(at).cast()) };
            }
            for (r, sums) in sums.iter_mut().enumerate() {
                let at = r * row_len + b * BLOCK + run * 4;
                // SAFETY: `at + 4 <= R × row_len`, checked above.
                let x = unsafe { t.x_quants.as_ptr().add(at).cast::<i32>().read_unaligned() };
                let x = _mm512_set1_epi32(x);
                for (s, &w) in sums.iter_mut().zip(&w) {
                    *s = _mm512_dpbusd_epi32(*s, w, x);
                }
            }
        }
        let mut scales = [_mm512_setzero_ps(); G];
        let mut offsets = [_mm512_setzero_ps(); G];
        for j in 0..G {
            let at = (j * blocks + b) * GROUP;
            // SAFETY: `at + 16 <= G × blocks × GROUP`, checked above.
            unsafe {
                scales[j] = _mm512_loadu_ps(t.scales.as_ptr().add(at));
                offsets[j] = _mm512_loadu_ps(t.offsets.as_ptr().add(at));
            }
        }
        for r in 0..R {
            let x_scale = _mm512_set1_ps(t.x_scales[r * blocks + b]);
            let x_sum = _mm512_set1_ps(t.x_sums[r * blocks + b]);
            for j in 0..G {
                let scale = _mm512_mul_ps(scales[j], x_scale);
                acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r][j]), scale, acc[r][j]);
                acc[r][j] = _mm512_fmadd_ps(offsets[j], x_sum, acc[r][j]);
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        for (j, &acc) in acc.iter().enumerate() {
            let left = cols - j * GROUP;
            let mask: __mmask16 = if left >= GROUP {
                0xFFFF
            } else {
                (1u16 << left) - 1
            };
            // SAFETY: lanes under the mask write `r × stride + j × 16 + (0..left)`, below
            // `(R − 1) × stride + cols <= out.len()`, checked above.
            unsafe {
                _mm512_mask_storeu_ps(out.as_mut_ptr().add(r * stride + j * GROUP), mask, acc)
            };
        }
    }
}

/// Quantizes whole blocks of `x` into `quants`, with each block's scale (largest magnitude /
/// 127) and scale × Σ quants, as `super::act::quantize_block` does but rounding halves to even.
#[target_feature(enable = "avx512f,avx512bw")]
pub fn quantize_rows(x: &[f32], quants: &mut [i8], scales: &mut [f32], sums: &mut [f32]) {
    let blocks = x.len() / BLOCK;
    assert!(
        quants.len() >= blocks * BLOCK && scales.len() >= blocks && sums.len() >= blocks,
        "packed blocks: quantized input buffers too short for {blocks} blocks"
    );
    let magnitude = _mm512_set1_epi32(0x7FFF_FFFF);
    for b in 0..blocks {
        // SAFETY: block `b` lies inside `x` and `quants` (`blocks` whole blocks, checked above).
        unsafe {
            let lo = _mm512_loadu_ps(x.as_ptr().add(b * BLOCK));
            let hi = _mm512_loadu_ps(x.as_ptr().add(b * BLOCK + 16));
            let abs = |v: __m512| {
                _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), magnitude))
            };
            let max = _mm512_reduce_max_ps(_mm512_max_ps(abs(lo), abs(hi)));
            // A block of zeros (or one whose magnitude is not finite) quantizes to zeros.
            let inverse = if max > 0.0 && max.is_finite() {
                127.0 / max
            } else {
                0.0
            };
            let inverse = _mm512_set1_ps(inverse);
            let q_lo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inverse));
            let q_hi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inverse));
            // Within ±127 (the largest magnitude maps to 127); saturation keeps NaN lanes in range.
            let clamp = |q: __m512i| {
                _mm512_max_epi32(
                    _mm512_min_epi32(q, _mm512_set1_epi32(127)),
                    _mm512_set1_epi32(-127),
                )
            };
            let (q_lo, q_hi) = (clamp(q_lo), clamp(q_hi));
            _mm_storeu_si128(
                quants.as_mut_ptr().add(b * BLOCK).cast(),
                _mm512_cvtsepi32_epi8(q_lo),
            );
            _mm_storeu_si128(
                quants.as_mut_ptr().add(b * BLOCK + 16).cast(),
                _mm512_cvtsepi32_epi8(q_hi),
            );
            let scale = max / 127.0;
            scales[b] = scale;
            sums[b] = scale * _mm512_reduce_add_epi32(_mm512_add_epi32(q_lo, q_hi)) as f32;
        }
    }
}

/// e^x for x in [−104, 89] (lanes outside are clamped first): 2^n × e^r with n = round(x /
/// ln 2) and |r| ≤ ln 2 / 2, e^r by its Taylor polynomial to r⁶ (relative error below 2e−7).
#[target_feature(enable = "avx512f")]
fn exp(x: __m512) -> __m512 {
    let x = _mm512_max_ps(
        _mm512_min_ps(x, _mm512_set1_ps(89.0)),
        _mm512_set1_ps(-104.0),
    );
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
        _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
    );
    // ln 2 in two parts, so that n × the first is exact.
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_145_75), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428_606_8e-6), r);
    let mut p = _mm512_set1_ps(1.0 / 720.0);
    for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    _mm512_scalef_ps(p, n)
}

/// `out[r][o] = silu(gate_up[r][o]) × gate_up[r][h + o]` over rows of `h` outputs, SiLU as
/// x / (1 + e^−x).
#[target_feature(enable = "avx512f")]
pub fn silu_mul(gate_up: &[f32], out: &mut [f32], h: usize) {
    for (y, out) in gate_up.chunks_exact(2 * h).zip(out.chunks_exact_mut(h)) {
        let (gate, up) = y.split_at(h);
        let mut o = 0;
        while o < h {
            let left = h - o;
            let mask: __mmask16 = if left >= 16 {
                0xFFFF
            } else {
                (1u16 << left) - 1
            };
            // SAFETY: the lanes under the mask address `o..o + min(16, left)`, inside `gate`,
            // `up` and `out` (each `h` long).
            unsafe {
                let g = _mm512_maskz_loadu_ps(mask, gate.as_ptr().add(o));
                let u = _mm512_maskz_loadu_ps(mask, up.as_ptr().add(o));
                let e = exp(_mm512_sub_ps(_mm512_setzero_ps(), g));
                let s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0), e));
                _mm512_mask_storeu_ps(out.as_mut_ptr().add(o), mask, _mm512_mul_ps(s, u));
            }
            o += 16;
        }
    }
}
