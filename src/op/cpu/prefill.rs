//! The tiled pass for many query tokens per sequence (prefill): FlashAttention-2's forward on
//! CPU threads.
//!
//! A task takes a block of query rows of one `(batch, kv head)`, a run of query tokens times the
//! group's query heads (so that each K/V row is read once for the whole group), and one split of
//! the keys. It walks the keys its rows see in tiles, converts each tile to f32 once (the keys
//! transposed for the score product), scores the whole block against the tile, folds the scores
//! into an online softmax per row and accumulates the tile's values ([`super::tile_products`]).
//! Keys past the block's last token, or before its first token's window, are never read; within
//! the tiles that are, a row's keys past its own position or before its window weigh nothing.
//! The tasks leave the decode pass's normalised partial rows and base-2 LSEs, so the same merge
//! combines the splits.

use std::cmp::Reverse;
use std::ops::Range;

use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
use super::loops::Fused;
use super::loops::{InnerLoops, Portable};
use super::tile_products;
use super::{DecodeInputs, Element};
use crate::op::call::DecodeCall;
use crate::op::merge::SoftmaxStats;
use crate::op::plan::{self, SplitPlan, MIN_CHUNK};
use crate::op::validate::DecodeDims;

/// Query rows (tokens × group members) a task aims for: enough that each converted K/V tile
/// serves many rows, few enough that a block's queries, scores and outputs stay in the core's
/// cache and that a short prompt still makes several tasks.
const BLOCK_ROWS: usize = 96;

/// Keys per tile: a multiple of [`tile_products::COLS`]. The transposed keys, the values and a
/// micro-tile's rows of scores stay in L1 while the products walk them.
const TILE_KEYS: usize = 64;

/// Query tokens per block: [`BLOCK_ROWS`] rows' worth, at least one.
fn block_tokens(dims: &DecodeDims) -> usize {
    (BLOCK_ROWS / dims.group_size()).clamp(1, dims.q_len.max(1))
}

/// The split plan of the tiled pass: the forced count clamped to the sequence, or splits of the
/// keys when the blocks of query rows of all `(batch, kv head)` pairs are too few to fill
/// `parallel_slots`.
pub(super) fn split_plan(call: &DecodeCall, parallel_slots: usize) -> SplitPlan {
    let dims = call.dims;
    match call.num_splits {
        Some(n) => plan::forced(dims.kv_len, n),
        None => {
            let blocks = dims.q_len.div_ceil(block_tokens(&dims));
            plan::plan_with_min_chunk(
                dims.batch,
                dims.kv_heads * blocks,
                dims.kv_len,
                parallel_slots,
                MIN_CHUNK,
            )
        }
    }
}

/// The keys each query token of one sequence sees.
#[derive(Debug, Clone, Copy)]
struct Causal {
    seq_len: usize,
    q_len: usize,
    window_left: Option<usize>,
}

impl Causal {
    /// Token `i` is position `seq_len − q_len + i` and sees the keys up to it, or with a window
    /// the last `window_left + 1` of them; none if it lies before the sequence's start.
    #[inline]
    fn keys(&self, token: usize) -> Range<usize> {
        let end = (self.seq_len + token + 1).saturating_sub(self.q_len);
        let start = self.window_left.map_or(0, |w| end.saturating_sub(w + 1));
        start..end
    }
}

/// One task: query tokens `tokens` of sequence `batch` at kv head `kv_head`, over `keys`, the
/// part of its split that they see.
#[derive(Debug, Clone)]
struct Task {
    batch: usize,
    kv_head: usize,
    tokens: Range<usize>,
    keys: Range<usize>,
    causal: Causal,
}

impl Task {
    /// Scores the task computes, to schedule the heaviest first.
    fn work(&self) -> usize {
        self.tokens.len() * self.keys.len()
    }
}

/// Runs the tiled pass: fills `partial_out` and `partial_lse` with the normalised rows and base-2
/// LSEs of every `(batch, kv head, split)` in the decode pass's layout (`q_len × group` rows each,
/// row `i · group + m` being query token `i` of the group's head `m`).
pub(super) fn attend<T: Element, KV: Element>(
    inputs: &DecodeInputs<'_, T, KV>,
    plan: SplitPlan,
    partial_out: &mut [f32],
    partial_lse: &mut [f32],
) {
    let dims = inputs.dims;
    let (d, group) = (dims.head_dim, dims.group_size());
    let rows = dims.q_len * group;
    let block = block_tokens(&dims);
    let mut tasks = Vec::new();
    let regions = partial_out
        .chunks_mut(rows * d)
        .zip(partial_lse.chunks_mut(rows));
    for (region, (out, lse)) in regions.enumerate() {
        let split = region % plan.num_splits;
        let kv_head = (region / plan.num_splits) % dims.kv_heads;
        let batch = region / (plan.num_splits * dims.kv_heads);
        let causal = Causal {
            seq_len: inputs
                .seqlens
                .map_or(dims.kv_len, |lens| lens[batch] as usize),
            q_len: dims.q_len,
            window_left: inputs.window_left,
        };
        let chunk = split * plan.chunk_size..(split + 1) * plan.chunk_size;
        let blocks = out
            .chunks_mut(block * group * d)
            .zip(lse.chunks_mut(block * group));
        for (i, (out, lse)) in blocks.enumerate() {
            let tokens = i * block..((i + 1) * block).min(dims.q_len);
            let first = causal.keys(tokens.start).start;
            let last = causal.keys(tokens.end - 1).end;
            let task = Task {
                batch,
                kv_head,
                keys: first.max(chunk.start)..last.min(chunk.end),
                tokens,
                causal,
            };
            tasks.push((task, out, lse));
        }
    }
    // The heaviest first, so that the tasks left at the end are short ones.
    tasks.sort_by_key(|(task, ..)| Reverse(task.work()));
    tasks
        .into_par_iter()
        .for_each_init(Scratch::default, |scratch, (task, out, lse)| {
            attend_block_best(inputs, &task, out, lse, scratch)
        });
}

/// A worker's buffers, reused across its tasks.
#[derive(Default)]
struct Scratch {
    /// The block's queries, pre-scaled: rows × d.
    queries: Vec<f32>,
    /// Scores, then probabilities, of the current tile: rows × [`TILE_KEYS`].
    scores: Vec<f32>,
    /// The tile's keys transposed: d × [`TILE_KEYS`].
    keys_t: Vec<f32>,
    /// The tile's values: [`TILE_KEYS`] × d.
    values: Vec<f32>,
    /// The running softmax of each row.
    stats: Vec<SoftmaxStats>,
    /// One row converted to f32.
    row: Vec<f32>,
}

impl Scratch {
    /// Sizes the buffers for `rows` query rows of `d` coordinates.
    fn prepare(&mut self, rows: usize, d: usize) {
        self.queries.resize(rows * d, 0.0);
        self.scores.resize(rows * TILE_KEYS, 0.0);
        self.keys_t.resize(d * TILE_KEYS, 0.0);
        self.values.resize(TILE_KEYS * d, 0.0);
        self.stats.clear();
        self.stats.resize(rows, SoftmaxStats::EMPTY);
        self.row.resize(d, 0.0);
    }
}

/// [`attend_block`] compiled for the best instruction set this CPU has.
fn attend_block_best<T: Element, KV: Element>(
    inputs: &DecodeInputs<'_, T, KV>,
    task: &Task,
    out: &mut [f32],
    lse: &mut [f32],
    scratch: &mut Scratch,
) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU supports AVX2 and FMA, checked just above.
        return unsafe { attend_block_avx2(inputs, task, out, lse, scratch) };
    }
    attend_block::<T, KV, Portable>(inputs, task, out, lse, scratch)
}

/// [`attend_block`] with AVX2 and FMA enabled.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_block_avx2<T: Element, KV: Element>(
    inputs: &DecodeInputs<'_, T, KV>,
    task: &Task,
    out: &mut [f32],
    lse: &mut [f32],
    scratch: &mut Scratch,
) {
    attend_block::<T, KV, Fused>(inputs, task, out, lse, scratch)
}

/// One task: writes the normalised outputs (`rows × d`) and base-2 LSEs of its query rows.
#[inline(always)]
fn attend_block<T: Element, KV: Element, S: InnerLoops>(
    inputs: &DecodeInputs<'_, T, KV>,
    task: &Task,
    out: &mut [f32],
    lse: &mut [f32],
    scratch: &mut Scratch,
) {
    let d = inputs.dims.head_dim;
    let group = inputs.dims.group_size();
    let rows = task.tokens.len() * group;
    out.fill(0.0);
    if task.keys.is_empty() {
        lse.fill(f32::NEG_INFINITY);
        return;
    }
    scratch.prepare(rows, d);
    load_queries(inputs, task, &mut scratch.queries, &mut scratch.row);
    // Soft-capping of the base-2 scores: c·tanh(s/c) in natural units.
    let cap = inputs.softcap.map(|c| c * std::f32::consts::LOG2_E);
    for first in task.keys.clone().step_by(TILE_KEYS) {
        let keys = first..(first + TILE_KEYS).min(task.keys.end);
        load_keys_t(inputs, task, keys.clone(), scratch);
        load_values(inputs, task, keys.clone(), scratch);
        let n = keys.len();
        tile_products::scores::<S>(
            &scratch.queries,
            &scratch.keys_t,
            (d, TILE_KEYS, n),
            &mut scratch.scores,
        );
        let rows_of_tile = scratch
            .scores
            .chunks_exact_mut(TILE_KEYS)
            .zip(&mut scratch.stats)
            .zip(out.chunks_exact_mut(d));
        for (row, ((scores, stats), out)) in rows_of_tile.enumerate() {
            let seen = task.causal.keys(task.tokens.start + row / group);
            let live =
                seen.start.saturating_sub(first).min(n)..seen.end.saturating_sub(first).min(n);
            fold_scores::<S>(&mut scores[..n], live, cap, stats, out);
        }
        tile_products::accumulate::<S>(&scratch.scores, &scratch.values, (d, TILE_KEYS, n), out);
    }
    let rows_done = scratch.stats.iter().zip(out.chunks_exact_mut(d));
    for ((stats, out), lse) in rows_done.zip(lse.iter_mut()) {
        match stats.finish() {
            // The outputs are convex combinations of the stored values: scale them to the
            // real ones.
            Some((inv_sum, row_lse)) => {
                let factor = inv_sum * inputs.v_scale;
                out.iter_mut().for_each(|x| *x *= factor);
                *lse = row_lse;
            }
            None => {
                out.fill(0.0);
                *lse = f32::NEG_INFINITY;
            }
        }
    }
}

/// The task's queries as f32 rows (token-major, then group member), pre-multiplied by
/// scale·log2(e) and the keys' scale, so that scores come out in base 2 against the real keys.
#[inline(always)]
fn load_queries<T: Element, KV>(
    inputs: &DecodeInputs<'_, T, KV>,
    task: &Task,
    queries: &mut [f32],
    row: &mut [f32],
) {
    let d = inputs.dims.head_dim;
    let group = inputs.dims.group_size();
    let q_scale = inputs.softmax_scale * inputs.k_scale * std::f32::consts::LOG2_E;
    for (i, query) in queries.chunks_exact_mut(d).enumerate() {
        let (token, member) = (task.tokens.start + i / group, i % group);
        let at = inputs
            .q_strides
            .row(task.batch, token, task.kv_head * group + member);
        let q = T::row_f32(&inputs.q[at..at + d], row);
        for (dst, &x) in query.iter_mut().zip(q) {
            *dst = x * q_scale;
        }
    }
}

/// Keys `keys` of the task's sequence and kv head, as f32, transposed into `scratch.keys_t`.
#[inline(always)]
fn load_keys_t<T, KV: Element>(
    inputs: &DecodeInputs<'_, T, KV>,
    task: &Task,
    keys: Range<usize>,
    scratch: &mut Scratch,
) {
    let d = inputs.dims.head_dim;
    for (j, pos) in keys.enumerate() {
        let at = inputs.kv_row(inputs.k_strides, task.batch, pos, task.kv_head);
        let key = KV::row_f32(&inputs.k[at..at + d], &mut scratch.row);
        for (c, &x) in key.iter().enumerate() {
            scratch.keys_t[c * TILE_KEYS + j] = x;
        }
    }
}

/// Values `keys` of the task's sequence and kv head, as f32 rows in `scratch.values`.
#[inline(always)]
fn load_values<T, KV: Element>(
    inputs: &DecodeInputs<'_, T, KV>,
    task: &Task,
    keys: Range<usize>,
    scratch: &mut Scratch,
) {
    let d = inputs.dims.head_dim;
    for (value, pos) in scratch.values.chunks_exact_mut(d).zip(keys) {
        let at = inputs.kv_row(inputs.v_strides, task.batch, pos, task.kv_head);
        KV::to_f32_slice(&inputs.v[at..at + d], value);
    }
}

/// Folds one row's scores of a tile into its running softmax: the scores outside `live` (keys
/// the row does not see) become weights of 0, the others `exp2(score − max)`; the row's output
/// `out` is rescaled when the maximum moves.
#[inline(always)]
fn fold_scores<S: InnerLoops>(
    scores: &mut [f32],
    live: Range<usize>,
    cap: Option<f32>,
    stats: &mut SoftmaxStats,
    out: &mut [f32],
) {
    if live.is_empty() {
        scores.fill(0.0);
        return;
    }
    let (before, rest) = scores.split_at_mut(live.start);
    let (seen, after) = rest.split_at_mut(live.len());
    before.fill(0.0);
    after.fill(0.0);
    if let Some(c) = cap {
        seen.iter_mut().for_each(|s| *s = c * (*s / c).tanh());
    }
    let max = max_of(seen);
    if max == f32::NEG_INFINITY {
        seen.fill(0.0);
        return;
    }
    let rescale = stats.raise_max(max);
    if rescale != 1.0 {
        out.iter_mut().for_each(|x| *x *= rescale);
    }
    let max = stats.max();
    seen.iter_mut()
        .for_each(|s| *s = S::exp2_nonpositive(*s - max));
    stats.add_weight(sum_of(seen));
}

/// Independent accumulators of [`max_of`] and [`sum_of`], so that they run as vector operations
/// rather than one dependent chain.
const REDUCE_LANES: usize = 8;

/// The largest of `xs`.
#[inline(always)]
fn max_of(xs: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; REDUCE_LANES];
    let chunks = xs.chunks_exact(REDUCE_LANES);
    let tail = chunks
        .remainder()
        .iter()
        .copied()
        .fold(f32::NEG_INFINITY, f32::max);
    for chunk in chunks {
        for (a, &x) in acc.iter_mut().zip(chunk) {
            *a = a.max(x);
        }
    }
    acc.iter().copied().fold(tail, f32::max)
}

/// The sum of `xs`.
#[inline(always)]
fn sum_of(xs: &[f32]) -> f32 {
    let mut acc = [0f32; REDUCE_LANES];
    let chunks = xs.chunks_exact(REDUCE_LANES);
    let tail: f32 = chunks.remainder().iter().sum();
    for chunk in chunks {
        for (a, &x) in acc.iter_mut().zip(chunk) {
            *a += x;
        }
    }
    acc.iter().sum::<f32>() + tail
}
