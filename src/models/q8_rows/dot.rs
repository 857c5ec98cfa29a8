//! Rows of 8-bit blocks (32 values, one f32 scale each: value ≈ scale × quant) and the dot
//! products of one weight row with several input rows.
//!
//! Each input row accumulates on its own, in the same order whatever the number of rows, so a
//! row's product does not depend on how many rows share the call. What the rows share is the
//! work on the weight: each weight block is loaded and made absolute once for all of them.

/// Values per block.
pub const BLOCK: usize = 32;

/// Input rows one pass over a weight row accumulates at once: each holds an accumulator
/// register, and the rest of the 16 AVX registers hold the shared weight block and temporaries.
const ROWS_PER_PASS: usize = 4;

/// Rows of blocks: `quants` holds `BLOCK` quants per block, `scales` one scale per block.
#[derive(Debug, Clone, Copy)]
pub struct BlockRows<'a> {
    pub quants: &'a [i8],
    pub scales: &'a [f32],
}

impl<'a> BlockRows<'a> {
    /// Blocks `range` (in blocks).
    fn blocks(&self, range: std::ops::Range<usize>) -> BlockRows<'a> {
        BlockRows {
            quants: &self.quants[range.start * BLOCK..range.end * BLOCK],
            scales: &self.scales[range],
        }
    }
}

/// Quantizes `values` (a multiple of `BLOCK` long) into `quants` and `scales`: each block's
/// scale maps its largest magnitude to 127.
pub fn quantize(values: &[f32], quants: &mut [i8], scales: &mut [f32]) {
    for ((block, q), scale) in values
        .chunks_exact(BLOCK)
        .zip(quants.chunks_exact_mut(BLOCK))
        .zip(scales.iter_mut())
    {
        let max = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        *scale = max / 127.0;
        let inverse = if max > 0.0 { 127.0 / max } else { 0.0 };
        for (q, v) in q.iter_mut().zip(block) {
            *q = (v * inverse).round() as i8;
        }
    }
}

/// `ys[r] = weight · (input row r)`, an input row being as many blocks as `weight` has.
pub fn dot_rows(weight: BlockRows, inputs: BlockRows, ys: &mut [f32]) {
    let blocks_per_row = weight.scales.len();
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        let mut first = 0;
        while first < ys.len() {
            let rows = (ys.len() - first).min(ROWS_PER_PASS);
            let pass = inputs.blocks(first * blocks_per_row..(first + rows) * blocks_per_row);
            // SAFETY: AVX2 and FMA were detected above.
            unsafe { avx2::dot_rows(weight, pass, &mut ys[first..first + rows]) };
            first += rows;
        }
        return;
    }
    for (r, y) in ys.iter_mut().enumerate() {
        *y = dot_scalar(
            weight,
            inputs.blocks(r * blocks_per_row..(r + 1) * blocks_per_row),
        );
    }
}

/// One product without SIMD: per block, the integer dot times both scales.
fn dot_scalar(weight: BlockRows, input: BlockRows) -> f32 {
    let mut sum = 0f32;
    for (j, (w, x)) in weight
        .quants
        .chunks_exact(BLOCK)
        .zip(input.quants.chunks_exact(BLOCK))
        .enumerate()
    {
        let dot: i32 = w.iter().zip(x).map(|(&w, &x)| w as i32 * x as i32).sum();
        sum += weight.scales[j] * input.scales[j] * dot as f32;
    }
    sum
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{BlockRows, BLOCK, ROWS_PER_PASS};

    /// Up to [`ROWS_PER_PASS`] rows, each accumulating 8 lanes of products scaled per block,
    /// summed at the end.
    #[target_feature(enable = "avx2,fma")]
    pub fn dot_rows(weight: BlockRows, inputs: BlockRows, ys: &mut [f32]) {
        let blocks_per_row = weight.scales.len();
        let rows = ys.len().min(ROWS_PER_PASS);
        assert!(
            weight.quants.len() == blocks_per_row * BLOCK
                && inputs.scales.len() >= rows * blocks_per_row
                && inputs.quants.len() >= rows * blocks_per_row * BLOCK
        );
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); ROWS_PER_PASS];
        for j in 0..blocks_per_row {
            // SAFETY: the assert above keeps every 32-byte load inside its slice.
            let w = unsafe { _mm256_loadu_si256(weight.quants.as_ptr().add(j * BLOCK).cast()) };
            // maddubs multiplies unsigned by signed bytes: |w| times x with w's sign.
            let w_abs = _mm256_sign_epi8(w, w);
            let w_scale = weight.scales[j];
            for (r, acc) in acc.iter_mut().enumerate().take(rows) {
                let at = r * blocks_per_row + j;
                // SAFETY: as above.
                let x =
                    unsafe { _mm256_loadu_si256(inputs.quants.as_ptr().add(at * BLOCK).cast()) };
                let pairs = _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(x, w));
                let dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(ones, pairs));
                let scale = _mm256_set1_ps(w_scale * inputs.scales[at]);
                *acc = _mm256_fmadd_ps(scale, dot, *acc);
            }
        }
        for (y, acc) in ys.iter_mut().zip(acc) {
            *y = sum_lanes(acc);
        }
    }

    #[target_feature(enable = "avx2,fma")]
    fn sum_lanes(x: __m256) -> f32 {
        let sum = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
        let sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
        _mm_cvtss_f32(_mm_add_ss(sum, _mm_movehdup_ps(sum)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quantized(values: &[f32]) -> (Vec<i8>, Vec<f32>) {
        let mut quants = vec![0i8; values.len()];
        let mut scales = vec![0f32; values.len() / BLOCK];
        quantize(values, &mut quants, &mut scales);
        (quants, scales)
    }

    fn values(seed: usize, len: usize) -> Vec<f32> {
        (0..len)
            .map(|i| (((i * 7919 + seed * 104_729) % 2001) as f32 - 1000.0) / 37.0)
            .collect()
    }

    #[test]
    fn quantizing_keeps_each_value_within_half_a_step() {
        let v = values(3, 4 * BLOCK);
        let (quants, scales) = quantized(&v);
        for (i, (&value, &q)) in v.iter().zip(&quants).enumerate() {
            let scale = scales[i / BLOCK];
            assert!(
                (value - scale * q as f32).abs() <= 0.5 * scale * 1.0001,
                "value {i}"
            );
        }
        let (zeros, zero_scales) = quantized(&[0.0; BLOCK]);
        assert!(zeros.iter().all(|&q| q == 0) && zero_scales == [0.0]);
    }

    /// Every row count, through the SIMD passes (with a short last pass) where they run: each
    /// product within f32 rounding of the exact dot of the quantized values, and equal to the
    /// same row's product alone.
    #[test]
    fn products_are_exact_to_rounding_and_independent_of_the_rows_beside_them() {
        let blocks_per_row = 7;
        let n = blocks_per_row * BLOCK;
        let (wq, ws) = quantized(&values(1, n));
        let weight = BlockRows {
            quants: &wq,
            scales: &ws,
        };
        for rows in [1, 3, 4, 5, 9] {
            let (xq, xs) = quantized(&values(rows + 2, rows * n));
            let inputs = BlockRows {
                quants: &xq,
                scales: &xs,
            };
            let mut ys = vec![f32::NAN; rows];
            dot_rows(weight, inputs, &mut ys);
            for (r, &y) in ys.iter().enumerate() {
                let row = inputs.blocks(r * blocks_per_row..(r + 1) * blocks_per_row);
                let exact: f64 = (0..n)
                    .map(|i| {
                        let j = i / BLOCK;
                        f64::from(ws[j])
                            * f64::from(wq[i])
                            * f64::from(row.scales[j])
                            * f64::from(row.quants[i])
                    })
                    .sum();
                let magnitude: f64 = (0..n)
                    .map(|i| {
                        (f64::from(ws[i / BLOCK]) * f64::from(wq[i])).abs()
                            * (f64::from(row.scales[i / BLOCK]) * f64::from(row.quants[i])).abs()
                    })
                    .sum();
                assert!(
                    (f64::from(y) - exact).abs() <= 1e-5 * magnitude,
                    "row {r} of {rows}: {y} vs {exact}"
                );
                let mut alone = [f32::NAN];
                dot_rows(weight, row, &mut alone);
                assert_eq!(y.to_bits(), alone[0].to_bits(), "row {r} of {rows}");
                let scalar = dot_scalar(weight, row);
                assert!((f64::from(scalar) - exact).abs() <= 1e-5 * magnitude);
            }
        }
    }
}
