//! The LSE-weighted merge of partial attention results on the CPU, the one place that folds
//! (max, sum, weighted rows) states: scores of a tile into a running softmax, and the splits of a
//! sequence into its output. Base 2 throughout, as on the GPU.

/// The statistics of a running softmax: the largest score (base 2) seen and the sum of weights
/// relative to it. Callers that keep the weighted rows of many states in one buffer hold these
/// alone and rescale and normalise the rows themselves.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct SoftmaxStats {
    max: f32,
    sum: f32,
}

impl SoftmaxStats {
    /// Nothing added yet.
    pub const EMPTY: Self = Self {
        max: f32::NEG_INFINITY,
        sum: 0.0,
    };

    /// The statistics of a softmax whose running maximum is `max` and whose weights relative to
    /// it sum to `sum`.
    pub fn new(max: f32, sum: f32) -> Self {
        Self { max, sum }
    }

    /// The running maximum.
    pub fn max(&self) -> f32 {
        self.max
    }

    /// Raises the running maximum to at least `max`, so that parts up to `max` can be added with
    /// weights `exp2(score - self.max())` ≤ 1. Returns the factor the rows accumulated so far
    /// must be multiplied by: 1 when the maximum did not move, 0 while nothing has been added.
    pub fn raise_max(&mut self, max: f32) -> f32 {
        if max <= self.max {
            return 1.0;
        }
        let rescale = (self.max - max).exp2();
        self.sum *= rescale;
        self.max = max;
        rescale
    }

    /// Adds `weight`, relative to the running maximum, to the sum.
    pub fn add_weight(&mut self, weight: f32) {
        self.sum += weight;
    }

    /// The factor that normalises the accumulated rows, and the log-sum-exp in base 2; `None`
    /// when nothing with weight was added.
    pub fn finish(self) -> Option<(f32, f32)> {
        if self.sum <= 0.0 || self.max == f32::NEG_INFINITY {
            return None;
        }
        Some((1.0 / self.sum, self.max + self.sum.log2()))
    }
}

/// A running merge: [`SoftmaxStats`] and the rows weighted the same way, accumulated into the
/// caller's buffer.
pub(crate) struct MergeState<'a> {
    stats: SoftmaxStats,
    acc: &'a mut [f32],
}

impl<'a> MergeState<'a> {
    /// An empty state accumulating into `acc`, which it zeroes.
    pub fn new(acc: &'a mut [f32]) -> Self {
        acc.fill(0.0);
        Self {
            stats: SoftmaxStats::EMPTY,
            acc,
        }
    }

    /// The running maximum.
    pub fn max(&self) -> f32 {
        self.stats.max()
    }

    /// Raises the running maximum to at least `max`, rescaling what has been accumulated (see
    /// [`SoftmaxStats::raise_max`]).
    pub fn raise_max(&mut self, max: f32) {
        let rescale = self.stats.raise_max(max);
        if rescale != 1.0 {
            self.acc.iter_mut().for_each(|a| *a *= rescale);
        }
    }

    /// Adds a part of weight `weight` relative to the running maximum, whose own weights sum to
    /// `part_sum`, with rows `row` (already weighted within the part), through `axpy`.
    pub fn add(
        &mut self,
        weight: f32,
        part_sum: f32,
        row: &[f32],
        axpy: impl FnOnce(f32, &[f32], &mut [f32]),
    ) {
        if weight > 0.0 {
            self.stats.add_weight(weight * part_sum);
            axpy(weight, row, self.acc);
        }
    }

    /// Adds `weight` to the sum alone, for callers that accumulate the rows themselves.
    pub fn add_weight(&mut self, weight: f32) {
        self.stats.add_weight(weight);
    }

    /// The accumulated rows, for callers that accumulate them themselves.
    pub fn acc_mut(&mut self) -> &mut [f32] {
        self.acc
    }

    /// Normalises the rows by the sum and returns the log-sum-exp in base 2: −inf, with zero
    /// rows, when nothing with weight was added.
    pub fn finish(self) -> f32 {
        match self.stats.finish() {
            Some((inv_sum, lse)) => {
                self.acc.iter_mut().for_each(|a| *a *= inv_sum);
                lse
            }
            None => {
                self.acc.fill(0.0);
                f32::NEG_INFINITY
            }
        }
    }
}

/// Merges normalised parts given by their base-2 LSEs and rows into `out`; returns the merged
/// base-2 LSE. A part with LSE −inf weighs nothing; if all do, `out` is zero and the LSE −inf.
pub(crate) fn merge_normalised<'r>(
    parts: impl Iterator<Item = (f32, &'r [f32])> + Clone,
    out: &mut [f32],
    axpy: impl Fn(f32, &[f32], &mut [f32]),
) -> f32 {
    let mut state = MergeState::new(out);
    state.raise_max(
        parts
            .clone()
            .map(|(lse, _)| lse)
            .fold(f32::NEG_INFINITY, f32::max),
    );
    let max = state.max();
    for (lse, row) in parts {
        if lse != f32::NEG_INFINITY {
            state.add((lse - max).exp2(), 1.0, row, &axpy);
        }
    }
    state.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
        y.iter_mut().zip(x).for_each(|(y, x)| *y += a * x);
    }

    #[test]
    fn merging_parts_equals_one_softmax_over_all_scores() {
        // Scores (base 2) and one-column values, cut into parts of two and three.
        let scores = [0.5f32, -1.0, 2.0, 0.25, -3.0];
        let values = [1.0f32, 2.0, -1.0, 4.0, 0.5];
        let total: f32 = scores.iter().map(|s| s.exp2()).sum();
        let want = scores
            .iter()
            .zip(values)
            .map(|(s, v)| s.exp2() * v)
            .sum::<f32>()
            / total;
        let part = |range: std::ops::Range<usize>| {
            let mut row = [0f32];
            let mut state = MergeState::new(&mut row);
            let max = scores[range.clone()]
                .iter()
                .copied()
                .fold(f32::MIN, f32::max);
            state.raise_max(max);
            for i in range {
                state.add((scores[i] - max).exp2(), 1.0, &values[i..i + 1], axpy);
            }
            let lse = state.finish();
            (lse, row[0])
        };
        let (lse_a, a) = part(0..2);
        let (lse_b, b) = part(2..5);
        let mut out = [0f32];
        let parts = [(lse_a, &[a][..]), (lse_b, &[b][..])];
        let lse = merge_normalised(parts.iter().copied(), &mut out, axpy);
        assert!((out[0] - want).abs() < 1e-6, "{} vs {want}", out[0]);
        assert!((lse - total.log2()).abs() < 1e-6);
    }

    #[test]
    fn empty_parts_weigh_nothing() {
        let mut out = [7f32, 7.0];
        let parts = [
            (f32::NEG_INFINITY, &[1f32, 1.0][..]),
            (0.0, &[2f32, 3.0][..]),
        ];
        let lse = merge_normalised(parts.iter().copied(), &mut out, axpy);
        assert_eq!(out, [2.0, 3.0]);
        assert_eq!(lse, 0.0);
        let none = [(f32::NEG_INFINITY, &[1f32, 1.0][..])];
        let lse = merge_normalised(none.iter().copied(), &mut out, axpy);
        assert_eq!(out, [0.0, 0.0]);
        assert_eq!(lse, f32::NEG_INFINITY);
    }
}
