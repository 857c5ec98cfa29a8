//! The two matrix products of the tiled pass, register-blocked: the scores of a block of query
//! rows against a tile of keys (`Q · Kᵀ`), and the probabilities of those rows times the tile's
//! values added to their outputs (`O += P · V`).
//!
//! Each product walks micro-tiles of up to [`MICRO_ROWS`] rows by [`COLS`] columns whose sums
//! live in registers for the whole inner loop: per step, one row of the other operand is loaded
//! as [`COLS`]-wide vectors and each of the micro-tile's rows contributes one broadcast value.
//! The loops have constant bounds, so the compiler unrolls them into vector multiply-adds.

use super::loops::InnerLoops;

/// Columns of a micro-tile: two 8-wide vectors. Tiles of keys and every supported head dim are
/// multiples of it.
pub(super) const COLS: usize = 16;

/// Rows of a micro-tile: with [`COLS`] columns, twelve 8-wide sums, which leaves registers for
/// the loaded row and the broadcast value.
const MICRO_ROWS: usize = 6;

/// `scores[r][j] = Σ_c queries[r][c] · keys_t[c][j]` for every row and the columns `0..cols`
/// rounded up to [`COLS`].
///
/// - `queries`: rows × `d`, row-major;
/// - `keys_t`: the tile's keys transposed, `d` × `tile` (row c holds coordinate c of each key);
/// - `scores`: rows × `tile`; columns past `cols` may be written with whatever `keys_t` holds.
#[inline(always)]
pub(super) fn scores<S: InnerLoops>(
    queries: &[f32],
    keys_t: &[f32],
    (d, tile, cols): (usize, usize, usize),
    scores: &mut [f32],
) {
    let rows = queries.len() / d;
    let cols = cols.div_ceil(COLS) * COLS;
    debug_assert!(cols <= tile && keys_t.len() >= d * tile && scores.len() >= rows * tile);
    for first in (0..rows).step_by(MICRO_ROWS) {
        let queries = &queries[first * d..];
        let scores = &mut scores[first * tile..];
        for col in (0..cols).step_by(COLS) {
            let at = (d, tile, col);
            match (rows - first).min(MICRO_ROWS) {
                6 => scores_micro::<S, 6>(queries, keys_t, at, scores),
                5 => scores_micro::<S, 5>(queries, keys_t, at, scores),
                4 => scores_micro::<S, 4>(queries, keys_t, at, scores),
                3 => scores_micro::<S, 3>(queries, keys_t, at, scores),
                2 => scores_micro::<S, 2>(queries, keys_t, at, scores),
                _ => scores_micro::<S, 1>(queries, keys_t, at, scores),
            }
        }
    }
}

/// [`scores`] for `R` rows and the [`COLS`] columns from `col`.
#[inline(always)]
fn scores_micro<S: InnerLoops, const R: usize>(
    queries: &[f32],
    keys_t: &[f32],
    (d, tile, col): (usize, usize, usize),
    scores: &mut [f32],
) {
    let queries: [&[f32]; R] = std::array::from_fn(|r| &queries[r * d..][..d]);
    let mut acc = [[0f32; COLS]; R];
    for c in 0..d {
        let keys = &keys_t[c * tile + col..][..COLS];
        for r in 0..R {
            let q = queries[r][c];
            for j in 0..COLS {
                acc[r][j] = S::mul_add(q, keys[j], acc[r][j]);
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        scores[r * tile + col..][..COLS].copy_from_slice(acc);
    }
}

/// `out[r][c] += Σ_{j < keys} probs[r][j] · values[j][c]` for every row and coordinate.
///
/// - `probs`: rows × `tile`, row-major;
/// - `values`: at least `keys` rows of `d`;
/// - `out`: rows × `d`.
#[inline(always)]
pub(super) fn accumulate<S: InnerLoops>(
    probs: &[f32],
    values: &[f32],
    (d, tile, keys): (usize, usize, usize),
    out: &mut [f32],
) {
    let rows = out.len() / d;
    debug_assert!(probs.len() >= rows * tile && values.len() >= keys * d && d % COLS == 0);
    for first in (0..rows).step_by(MICRO_ROWS) {
        let probs = &probs[first * tile..];
        let out = &mut out[first * d..];
        for col in (0..d).step_by(COLS) {
            let at = (d, tile, keys, col);
            match (rows - first).min(MICRO_ROWS) {
                6 => accumulate_micro::<S, 6>(probs, values, at, out),
                5 => accumulate_micro::<S, 5>(probs, values, at, out),
                4 => accumulate_micro::<S, 4>(probs, values, at, out),
                3 => accumulate_micro::<S, 3>(probs, values, at, out),
                2 => accumulate_micro::<S, 2>(probs, values, at, out),
                _ => accumulate_micro::<S, 1>(probs, values, at, out),
            }
        }
    }
}

/// [`accumulate`] for `R` rows and the [`COLS`] coordinates from `col`.
#[inline(always)]
fn accumulate_micro<S: InnerLoops, const R: usize>(
    probs: &[f32],
    values: &[f32],
    (d, tile, keys, col): (usize, usize, usize, usize),
    out: &mut [f32],
) {
    let probs: [&[f32]; R] = std::array::from_fn(|r| &probs[r * tile..][..keys]);
    let mut acc = [[0f32; COLS]; R];
    for (r, acc) in acc.iter_mut().enumerate() {
        acc.copy_from_slice(&out[r * d + col..][..COLS]);
    }
    for j in 0..keys {
        let value = &values[j * d + col..][..COLS];
        for r in 0..R {
            let p = probs[r][j];
            for i in 0..COLS {
                acc[r][i] = S::mul_add(p, value[i], acc[r][i]);
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        out[r * d + col..][..COLS].copy_from_slice(acc);
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

    /// Every row count up to two micro-tiles and a ragged column count, against plain sums.
    #[test]
    fn products_match_plain_sums() {
        let (d, tile) = (80, 48);
        for rows in 1..=2 * MICRO_ROWS + 1 {
            let queries = sequence(rows * d, 7);
            let keys_t = sequence(d * tile, 11);
            let cols = 37;
            let mut got = vec![f32::NAN; rows * tile];
            scores::<Portable>(&queries, &keys_t, (d, tile, cols), &mut got);
            for r in 0..rows {
                for j in 0..cols {
                    let want: f32 = (0..d)
                        .map(|c| queries[r * d + c] * keys_t[c * tile + j])
                        .sum();
                    assert!((got[r * tile + j] - want).abs() < 1e-4, "scores {r},{j}");
                }
            }

            let probs = sequence(rows * tile, 13);
            let values = sequence(tile * d, 17);
            let start = sequence(rows * d, 19);
            let mut out = start.clone();
            accumulate::<Portable>(&probs, &values, (d, tile, cols), &mut out);
            for r in 0..rows {
                for c in 0..d {
                    let want = start[r * d + c]
                        + (0..cols)
                            .map(|j| probs[r * tile + j] * values[j * d + c])
                            .sum::<f32>();
                    assert!((out[r * d + c] - want).abs() < 1e-4, "accumulate {r},{c}");
                }
            }
        }
    }
}
