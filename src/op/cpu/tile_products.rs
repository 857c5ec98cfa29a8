//! The two matrix products of the tiled pass, register-blocked and vectorised across query rows:
//! the scores of a block of rows against a tile of keys (`S = K · Qᵀ`), and the tile's values
//! weighted by the rows' probabilities added to their outputs (`Oᵀ += Vᵀ · P`).
//!
//! The block's queries, scores and outputs are stored transposed, one row of the block per
//! column: `q_t` is `d × rows`, the scores `keys × rows`, the outputs `d × rows`; `rows` is a
//! multiple of [`ROWS`]. Keys and values are rows of `d`, wherever they are stored. A micro-tile
//! holds [`ROWS`] rows (three 8-wide vectors) by [`BROADCASTS`] keys or coordinates in
//! registers; per step it loads [`ROWS`] contiguous values of the transposed operand and
//! broadcasts one value of each of its keys or coordinates. The loops have constant bounds, so
//! the compiler unrolls them into vector multiply-adds.

use super::loops::InnerLoops;

/// Query rows of a micro-tile: two 8-wide vectors.
pub(super) const ROWS: usize = 2 * LANES;

/// The width of the vectors the micro-tiles are written in.
const LANES: usize = 8;

/// [`LANES`] values that the inner loops treat as one vector register: written lane by lane,
/// which the compiler turns into one vector instruction per operation.
#[derive(Clone, Copy)]
struct Lanes([f32; LANES]);

impl Lanes {
    const ZERO: Self = Self([0.0; LANES]);

    #[inline(always)]
    fn load(src: &[f32]) -> Self {
        let mut lanes = [0f32; LANES];
        lanes.copy_from_slice(&src[..LANES]);
        Self(lanes)
    }

    #[inline(always)]
    fn store(self, dst: &mut [f32]) {
        dst[..LANES].copy_from_slice(&self.0);
    }

    /// `self + a · b`, lane by lane.
    #[inline(always)]
    fn mul_add<S: InnerLoops>(self, a: f32, b: Self) -> Self {
        let mut out = self.0;
        for (out, &b) in out.iter_mut().zip(&b.0) {
            *out = S::mul_add(a, b, *out);
        }
        Self(out)
    }
}

/// The [`ROWS`] values from `at`, as vectors.
#[inline(always)]
fn load_rows(src: &[f32], at: usize) -> [Lanes; ROWS / LANES] {
    std::array::from_fn(|v| Lanes::load(&src[at + v * LANES..]))
}

/// Writes [`ROWS`] values from `at`.
#[inline(always)]
fn store_rows(rows: &[Lanes; ROWS / LANES], dst: &mut [f32], at: usize) {
    for (v, lanes) in rows.iter().enumerate() {
        lanes.store(&mut dst[at + v * LANES..]);
    }
}

/// Keys (for the scores) or coordinates (for the outputs) of a micro-tile: with [`ROWS`] rows,
/// eight 8-wide sums, as many as keep both FMA units busy, few enough to stay in registers.
pub(super) const BROADCASTS: usize = 4;

/// `scores[j][r] = Σ_c keys[j][c] · q_t[c][r]` for every key (a multiple of [`BROADCASTS`]) and
/// row.
///
/// - `q_t`: `d × rows`;
/// - `keys`: rows of `d`;
/// - `scores`: at least one row of `rows` per key.
#[inline(always)]
pub(super) fn scores<S: InnerLoops>(q_t: &[f32], keys: &[&[f32]], rows: usize, scores: &mut [f32]) {
    let quads = keys
        .chunks_exact(BROADCASTS)
        .zip(scores.chunks_exact_mut(BROADCASTS * rows));
    for (keys, scores) in quads {
        let (k0, k1, k2, k3) = (keys[0], keys[1], keys[2], keys[3]);
        for first in (0..rows).step_by(ROWS) {
            let mut acc = [[Lanes::ZERO; ROWS / LANES]; BROADCASTS];
            let steps = k0
                .iter()
                .zip(k1)
                .zip(k2)
                .zip(k3)
                .zip(q_t.chunks_exact(rows));
            for ((((&a, &b), &c), &e), q) in steps {
                let q = load_rows(q, first);
                for (acc, k) in acc.iter_mut().zip([a, b, c, e]) {
                    for (acc, q) in acc.iter_mut().zip(q) {
                        *acc = acc.mul_add::<S>(k, q);
                    }
                }
            }
            for (scores, acc) in scores.chunks_exact_mut(rows).zip(&acc) {
                store_rows(acc, scores, first);
            }
        }
    }
}

/// `out_t[c][r] += Σ_j values[j][c] · probs[j][r]` for every coordinate and row.
///
/// - `probs`: one row of `rows` per value;
/// - `values`: rows of `d`;
/// - `out_t`: `d × rows`.
#[inline(always)]
pub(super) fn accumulate<S: InnerLoops>(
    probs: &[f32],
    values: &[&[f32]],
    rows: usize,
    out_t: &mut [f32],
) {
    let quads = out_t.chunks_exact_mut(BROADCASTS * rows).enumerate();
    for (quad, out_t) in quads {
        let coords = quad * BROADCASTS..(quad + 1) * BROADCASTS;
        for first in (0..rows).step_by(ROWS) {
            let mut acc = [[Lanes::ZERO; ROWS / LANES]; BROADCASTS];
            for (acc, out) in acc.iter_mut().zip(out_t.chunks_exact(rows)) {
                *acc = load_rows(out, first);
            }
            let steps = probs.chunks_exact(rows).zip(values);
            for (p, v) in steps {
                let p = load_rows(p, first);
                for (acc, &v) in acc.iter_mut().zip(&v[coords.clone()]) {
                    for (acc, p) in acc.iter_mut().zip(p) {
                        *acc = acc.mul_add::<S>(v, p);
                    }
                }
            }
            for (out, acc) in out_t.chunks_exact_mut(rows).zip(&acc) {
                store_rows(acc, out, first);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::loops::Portable;
    use super::*;

    fn sequence(n: usize, seed: u32) -> Vec<f32> {
        let mut state = seed | 1;
        (0..n)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                state as f32 / u32::MAX as f32 - 0.5
            })
            .collect()
    }

    /// One and two micro-tiles of rows, against plain sums; the values of a ragged count of keys.
    #[test]
    fn products_match_plain_sums() {
        let (d, n, tile) = (80, 37, 40);
        for rows in [ROWS, 2 * ROWS] {
            let q_t = sequence(d * rows, 7);
            let keys = sequence(tile * d, 11);
            let key_rows: Vec<&[f32]> = keys.chunks_exact(d).collect();
            let mut got = vec![f32::NAN; tile * rows];
            scores::<Portable>(&q_t, &key_rows, rows, &mut got);
            for j in 0..tile {
                for r in 0..rows {
                    let want: f32 = (0..d).map(|c| keys[j * d + c] * q_t[c * rows + r]).sum();
                    assert!((got[j * rows + r] - want).abs() < 1e-4, "scores {j},{r}");
                }
            }

            // Probabilities past the n-th key hold NaN, which must not be read.
            let mut probs = sequence(tile * rows, 13);
            probs[n * rows..].fill(f32::NAN);
            let values = sequence(tile * d, 17);
            let start = sequence(d * rows, 19);
            let mut out_t = start.clone();
            let value_rows: Vec<&[f32]> = values.chunks_exact(d).take(n).collect();
            accumulate::<Portable>(&probs, &value_rows, rows, &mut out_t);
            for c in 0..d {
                for r in 0..rows {
                    let want = start[c * rows + r]
                        + (0..n)
                            .map(|j| values[j * d + c] * probs[j * rows + r])
                            .sum::<f32>();
                    assert!(
                        (out_t[c * rows + r] - want).abs() < 1e-4,
                        "accumulate {c},{r}"
                    );
                }
            }
        }
    }
}
