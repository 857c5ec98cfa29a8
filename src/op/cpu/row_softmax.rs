//! The online softmax of a block of query rows in the tiled pass: a running maximum and sum per
//! row, every step a vector operation across the rows (a tile's scores are stored key by key,
//! the block's rows side by side).

use super::loops::InnerLoops;
use crate::op::merge::SoftmaxStats;

/// The running softmax of each row of a block.
#[derive(Debug, Default)]
pub(super) struct RowSoftmax {
    /// The largest score (base 2) each row has seen, −inf before any.
    max: Vec<f32>,
    /// Each row's weights summed, relative to its maximum.
    sum: Vec<f32>,
    /// The maximum each row's weights are taken against: its running maximum, or 0 while that
    /// is −inf (so that no −inf − −inf arises).
    shift: Vec<f32>,
    /// Per tile: the tile's largest score per row, then the factor rescaling what the row has
    /// accumulated.
    rescale: Vec<f32>,
}

impl RowSoftmax {
    /// Starts `rows` empty rows.
    pub fn reset(&mut self, rows: usize) {
        for (v, x) in [
            (&mut self.max, f32::NEG_INFINITY),
            (&mut self.sum, 0.0),
            (&mut self.shift, 0.0),
            (&mut self.rescale, 1.0),
        ] {
            v.clear();
            v.resize(rows, x);
        }
    }

    /// Folds a tile's scores, `n` keys × rows (−inf where a row does not see a key), into the
    /// running softmax: turns them into the weights `exp2(score − max)` (exactly 0 for −inf),
    /// and rescales the rows' accumulated outputs `out_t` (`d × rows`) where their maximum
    /// moved.
    #[inline(always)]
    pub fn fold<S: InnerLoops>(&mut self, scores: &mut [f32], n: usize, out_t: &mut [f32]) {
        let rows = self.max.len();
        let scores = &mut scores[..n * rows];
        let tile_max = &mut self.rescale;
        tile_max.fill(f32::NEG_INFINITY);
        for keys in scores.chunks_exact(rows) {
            for (m, &s) in tile_max.iter_mut().zip(keys) {
                *m = m.max(s);
            }
        }
        let mut moved = false;
        let per_row = self.max.iter_mut().zip(&mut self.shift).zip(&mut self.sum);
        for (((max, shift), sum), rescale) in per_row.zip(self.rescale.iter_mut()) {
            let raised = max.max(*rescale);
            // exp2(−inf − raised) is 2^-126 rather than 0, but multiplies a row still empty.
            *rescale = if raised == *max {
                1.0
            } else {
                S::exp2_nonpositive(*max - raised)
            };
            moved |= *rescale != 1.0;
            *sum *= *rescale;
            *max = raised;
            *shift = if raised == f32::NEG_INFINITY {
                0.0
            } else {
                raised
            };
        }
        if moved {
            for out in out_t.chunks_exact_mut(rows) {
                for (o, &r) in out.iter_mut().zip(&self.rescale) {
                    *o *= r;
                }
            }
        }
        for keys in scores.chunks_exact_mut(rows) {
            let per_row = keys.iter_mut().zip(&self.shift).zip(&mut self.sum);
            for ((s, &shift), sum) in per_row {
                let weight = if *s == f32::NEG_INFINITY {
                    0.0
                } else {
                    S::exp2_nonpositive(*s - shift)
                };
                *s = weight;
                *sum += weight;
            }
        }
    }

    /// Row `row`'s normalising factor and base-2 LSE; `None` if it saw no key.
    pub fn finish(&self, row: usize) -> Option<(f32, f32)> {
        SoftmaxStats::new(self.max[row], self.sum[row]).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::super::loops::Portable;
    use super::*;

    /// Two tiles over three rows (one seeing nothing, one whose maximum moves) against one
    /// softmax over all scores.
    #[test]
    fn tiles_fold_into_one_softmax() {
        let rows = 3;
        let ninf = f32::NEG_INFINITY;
        // Key-major: key j's scores for rows 0, 1, 2.
        let tiles: [&[f32]; 2] = [&[0.5, ninf, 1.0, -1.0, ninf, 2.0], &[3.0, ninf, -2.0]];
        let values = [1.0f32, 2.0, -1.0];
        let mut softmax = RowSoftmax::default();
        softmax.reset(rows);
        let mut out_t = vec![0f32; rows];
        let mut key = 0;
        for tile in tiles {
            let n = tile.len() / rows;
            let mut weights = tile.to_vec();
            softmax.fold::<Portable>(&mut weights, n, &mut out_t);
            for j in 0..n {
                for r in 0..rows {
                    out_t[r] += weights[j * rows + r] * values[key + j];
                }
            }
            key += n;
        }
        for r in [0, 2] {
            let scores: Vec<f32> = tiles.concat().chunks(rows).map(|k| k[r]).collect();
            let total: f32 = scores.iter().map(|s| s.exp2()).sum();
            let want: f32 = scores
                .iter()
                .zip(values)
                .map(|(s, v)| s.exp2() * v)
                .sum::<f32>()
                / total;
            let (inv, lse) = softmax.finish(r).expect("row sees keys");
            assert!((out_t[r] * inv - want).abs() < 1e-5, "row {r}");
            assert!((lse - total.log2()).abs() < 1e-5, "row {r} LSE");
        }
        assert_eq!(softmax.finish(1), None);
        assert_eq!(out_t[1], 0.0);
    }
}
