//! Input rows quantized to 8 bits, once per product and row: blocks of 32 values, each with an
//! f32 scale (value ≈ scale × quant), the scale times the sum of its quants (what a weight
//! block's offset multiplies: Q4_1's min, Q4_0's −8, Q4_K's mins) and the sums of its quants per
//! half block (Q6_K's −32, which comes with a scale per 16 values).

/// Values per block.
pub const BLOCK: usize = 32;

/// Quantized input rows, kept between products so that a decode step allocates nothing once
/// its buffers have grown to the largest row.
#[derive(Debug, Default, Clone)]
pub struct QuantizedRows {
    /// `BLOCK` quants per block, rows one after another.
    pub quants: Vec<i8>,
    /// Per block: the scale.
    pub scales: Vec<f32>,
    /// Per block: the scale × Σ quants.
    pub sums: Vec<f32>,
    /// Per half block (16 values): Σ quants.
    pub half_sums: Vec<i32>,
    /// The quants again with each pair of blocks `(2p, 2p + 1)` of a row as the nibble forms
    /// read them: the first halves of both blocks, then the second halves (a row's odd last
    /// block as it is). A pair of stored nibble blocks then splits into its low nibbles (first
    /// halves) and high nibbles (second halves) with one mask and one shift each.
    pub paired: Vec<i8>,
    /// Blocks per row.
    pub blocks_per_row: usize,
}

impl QuantizedRows {
    /// Quantizes `values`, rows of `in_features` values (a multiple of `BLOCK`), in place of what
    /// was held before; each block's scale maps its largest magnitude to 127.
    pub fn quantize(&mut self, values: &[f32], in_features: usize) {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 was detected; the function is the portable code below compiled with
            // it (rounding then needs no library call).
            unsafe { self.quantize_avx2(values, in_features) };
            return;
        }
        self.quantize_portable(values, in_features);
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    fn quantize_avx2(&mut self, values: &[f32], in_features: usize) {
        self.quantize_portable(values, in_features);
    }

    #[inline(always)]
    fn quantize_portable(&mut self, values: &[f32], in_features: usize) {
        let blocks = values.len() / BLOCK;
        self.blocks_per_row = in_features / BLOCK;
        self.quants.resize(blocks * BLOCK, 0);
        self.scales.resize(blocks, 0.0);
        self.sums.resize(blocks, 0.0);
        self.half_sums.resize(2 * blocks, 0);
        self.paired.resize(blocks * BLOCK, 0);
        for ((((block, q), block_scale), sum), halves) in values
            .chunks_exact(BLOCK)
            .zip(self.quants.chunks_exact_mut(BLOCK))
            .zip(self.scales.iter_mut())
            .zip(self.sums.iter_mut())
            .zip(self.half_sums.chunks_exact_mut(2))
        {
            let scale = quantize_block(block, q);
            let low: i32 = q[..BLOCK / 2].iter().map(|&q| i32::from(q)).sum();
            let high: i32 = q[BLOCK / 2..].iter().map(|&q| i32::from(q)).sum();
            halves.copy_from_slice(&[low, high]);
            *block_scale = scale;
            *sum = scale * (low + high) as f32;
        }
        let (half, row_len) = (BLOCK / 2, self.blocks_per_row * BLOCK);
        if row_len == 0 {
            return;
        }
        for (row, paired) in self
            .quants
            .chunks_exact(row_len)
            .zip(self.paired.chunks_exact_mut(row_len))
        {
            let mut pairs = row.chunks_exact(2 * BLOCK);
            let mut out = paired.chunks_exact_mut(2 * BLOCK);
            for (pair, out) in (&mut pairs).zip(&mut out) {
                out[..half].copy_from_slice(&pair[..half]);
                out[half..BLOCK].copy_from_slice(&pair[BLOCK..BLOCK + half]);
                out[BLOCK..BLOCK + half].copy_from_slice(&pair[half..BLOCK]);
                out[BLOCK + half..].copy_from_slice(&pair[BLOCK + half..]);
            }
            out.into_remainder().copy_from_slice(pairs.remainder());
        }
    }

    /// Input row `row`.
    pub fn row(&self, row: usize) -> ActRow<'_> {
        let blocks = row * self.blocks_per_row..(row + 1) * self.blocks_per_row;
        ActRow {
            quants: &self.quants[blocks.start * BLOCK..blocks.end * BLOCK],
            paired: &self.paired[blocks.start * BLOCK..blocks.end * BLOCK],
            scales: &self.scales[blocks.clone()],
            sums: &self.sums[blocks.clone()],
            half_sums: &self.half_sums[2 * blocks.start..2 * blocks.end],
        }
    }
}

/// Quantizes one block of `BLOCK` values into `quants`, its largest magnitude mapped to 127;
/// returns the scale (value ≈ scale × quant).
#[inline(always)]
pub fn quantize_block(block: &[f32], quants: &mut [i8]) -> f32 {
    let max = block.iter().fold(0f32, |m, v| m.max(v.abs()));
    // A block of zeros (or one whose magnitude is not finite) quantizes to zeros.
    let inverse = if max > 0.0 && max.is_finite() {
        127.0 / max
    } else {
        0.0
    };
    for (q, v) in quants.iter_mut().zip(block) {
        // In [-127, 127]: never -128, so that negating a quant cannot overflow.
        *q = (v * inverse).round().clamp(-127.0, 127.0) as i8;
    }
    max / 127.0
}

/// One quantized input row.
#[derive(Debug, Clone, Copy)]
pub struct ActRow<'a> {
    pub quants: &'a [i8],
    /// The row's quants paired for the nibble forms (see [`QuantizedRows::paired`]).
    pub paired: &'a [i8],
    pub scales: &'a [f32],
    pub sums: &'a [f32],
    pub half_sums: &'a [i32],
}

impl<'a> ActRow<'a> {
    /// Blocks of `BLOCK` values.
    pub fn blocks(&self) -> usize {
        self.scales.len()
    }

    /// The row from block `first` on.
    pub fn tail(&self, first: usize) -> ActRow<'a> {
        ActRow {
            quants: &self.quants[first * BLOCK..],
            paired: &self.paired[first * BLOCK..],
            scales: &self.scales[first..],
            sums: &self.sums[first..],
            half_sums: &self.half_sums[2 * first..],
        }
    }
}
