//! The tiled pass for many query tokens per sequence (prefill): FlashAttention-2's forward on
//! CPU threads.
//!
//! A task takes a block of query rows of one `(batch, kv head)`, a run of query tokens times the
//! group's query heads (so that each K/V row is read once for the whole group), and one split of
//! the keys. It walks the keys its rows see in tiles, converts each tile to f32 once, scores the
//! whole block against it, folds the scores into an online softmax per row ([`RowSoftmax`]) and
//! accumulates the tile's values ([`tile_products`]). The block's queries, scores and outputs
//! are kept transposed, the rows side by side, so that every step is a vector operation across
//! rows and no tile is ever transposed. Keys past the block's last token, or before its first
//! token's window, are never read; within the tiles that are, a row's keys past its own position
//! or before its window weigh nothing. The tasks leave the decode pass's normalised partial rows
//! and base-2 LSEs, so the same merge combines the splits.

use std::cmp::Reverse;
use std::ops::Range;

use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
use super::loops::Fused;
use super::loops::{InnerLoops, Portable};
use super::row_softmax::RowSoftmax;
use super::tile_products::{self, BROADCASTS, ROWS};
use super::{DecodeInputs, Element};
use crate::op::call::DecodeCall;
use crate::op::plan::{self, SplitPlan, MIN_CHUNK};
use crate::op::validate::DecodeDims;

/// Query rows (tokens × group members) a task aims for, a multiple of [`ROWS`]: enough that each
/// converted K/V tile serves many rows, few enough that a block's queries, scores and outputs
/// stay in the core's cache and that a short prompt still makes several tasks.
const BLOCK_ROWS: usize = 6 * ROWS;

/// Keys per tile, a multiple of [`tile_products::BROADCASTS`]: enough to amortise the softmax's
/// per-tile steps, few enough that the tile's keys, values and scores stay in L1.
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
struct VisibleKeys {
    seq_len: usize,
    q_len: usize,
    window_left: Option<usize>,
    window_right: usize,
}

impl VisibleKeys {
    /// Token `i` is position `seq_len − q_len + i` and sees the keys up to it (and
    /// `window_right` after it), or with a window from `window_left` before it; none if it lies
    /// before the sequence's start and sees nothing after it.
    #[inline]
    fn keys(&self, token: usize) -> Range<usize> {
        let own_end = (self.seq_len + token + 1).saturating_sub(self.q_len);
        let end = (self.seq_len + token + 1 + self.window_right)
            .saturating_sub(self.q_len)
            .min(self.seq_len);
        let start = self
            .window_left
            .map_or(0, |w| own_end.saturating_sub(w + 1))
            .min(end);
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
    visible: VisibleKeys,
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
        let visible = VisibleKeys {
            seq_len: inputs
                .seqlens
                .map_or(dims.kv_len, |lens| lens[batch] as usize),
            q_len: dims.q_len,
            window_left: inputs.window_left,
            window_right: inputs.window_right,
        };
        let chunk = split * plan.chunk_size..(split + 1) * plan.chunk_size;
        let blocks = out
            .chunks_mut(block * group * d)
            .zip(lse.chunks_mut(block * group));
        for (i, (out, lse)) in blocks.enumerate() {
            let tokens = i * block..((i + 1) * block).min(dims.q_len);
            let first = visible.keys(tokens.start).start;
            let last = visible.keys(tokens.end - 1).end;
            let task = Task {
                batch,
                kv_head,
                keys: first.max(chunk.start)..last.min(chunk.end),
                tokens,
                visible,
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

/// A worker's buffers, reused across its tasks. A block's rows are padded to a multiple of
/// [`ROWS`]; the padding rows' queries are zero and their results never read.
#[derive(Default)]
struct Scratch {
    /// The block's queries, pre-scaled, transposed: d × rows.
    q_t: Vec<f32>,
    /// The block's outputs, transposed: d × rows.
    out_t: Vec<f32>,
    /// The current tile's scores, then weights: [`TILE_KEYS`] × rows.
    scores: Vec<f32>,
    /// The tile's keys and values converted to f32, where they are stored in another dtype:
    /// [`TILE_KEYS`] × d each.
    keys: Vec<f32>,
    values: Vec<f32>,
    softmax: RowSoftmax,
    /// Per row, the range of the tile's keys it sees, for a tile that some row sees only part of.
    live_start: Vec<u32>,
    live_end: Vec<u32>,
    /// One row converted to f32.
    row: Vec<f32>,
}

impl Scratch {
    /// Sizes the buffers for `rows` (padded) query rows of `d` coordinates; the queries and
    /// outputs start zero.
    fn prepare(&mut self, rows: usize, d: usize) {
        for v in [&mut self.q_t, &mut self.out_t] {
            v.clear();
            v.resize(d * rows, 0.0);
        }
        self.scores.resize(TILE_KEYS * rows, 0.0);
        self.keys.resize(TILE_KEYS * d, 0.0);
        self.values.resize(TILE_KEYS * d, 0.0);
        self.softmax.reset(rows);
        self.live_start.resize(rows, 0);
        self.live_end.resize(rows, 0);
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
    if task.keys.is_empty() {
        out.fill(0.0);
        lse.fill(f32::NEG_INFINITY);
        return;
    }
    let rows = (task.tokens.len() * group).div_ceil(ROWS) * ROWS;
    scratch.prepare(rows, d);
    load_queries(inputs, task, rows, scratch);
    let Scratch {
        q_t,
        out_t,
        scores,
        keys: key_buffer,
        values: value_buffer,
        softmax,
        live_start,
        live_end,
        ..
    } = scratch;
    // Soft-capping of the base-2 scores: c·tanh(s/c) in natural units.
    let cap = inputs.softcap.map(|c| c * std::f32::consts::LOG2_E);
    // Every row sees the keys from the last token's first to the first token's last.
    let seen_by_all =
        task.visible.keys(task.tokens.end - 1).start..task.visible.keys(task.tokens.start).end;
    for first in task.keys.clone().step_by(TILE_KEYS) {
        let keys = first..(first + TILE_KEYS).min(task.keys.end);
        let n = keys.len();
        // The tile's rows as f32, borrowed where they are stored as f32, converted otherwise.
        let mut key_rows: [&[f32]; TILE_KEYS] = [&[]; TILE_KEYS];
        let mut value_rows: [&[f32]; TILE_KEYS] = [&[]; TILE_KEYS];
        let buffers = key_buffer
            .chunks_exact_mut(d)
            .zip(value_buffer.chunks_exact_mut(d));
        let tile_rows = key_rows.iter_mut().zip(&mut value_rows).zip(buffers);
        for (((key, value), (key_buffer, value_buffer)), pos) in tile_rows.zip(keys.clone()) {
            let at = inputs.kv_row(inputs.k_strides, task.batch, pos, task.kv_head);
            *key = KV::row_f32(&inputs.k[at..at + d], key_buffer);
            let at = inputs.kv_row(inputs.v_strides, task.batch, pos, task.kv_head);
            *value = KV::row_f32(&inputs.v[at..at + d], value_buffer);
        }
        // The score product takes keys in whole micro-tiles: repeat the last one to fill its
        // micro-tile; those scores are never read.
        let scored = n.div_ceil(BROADCASTS) * BROADCASTS;
        let last = key_rows[n - 1];
        key_rows[n..scored].fill(last);
        tile_products::scores::<S>(q_t, &key_rows[..scored], rows, scores);
        let tile_scores = &mut scores[..n * rows];
        if let Some(c) = cap {
            tile_scores
                .iter_mut()
                .for_each(|s| *s = c * (*s / c).tanh());
        }
        if keys.start < seen_by_all.start || keys.end > seen_by_all.end {
            mask_unseen(task, keys, group, (live_start, live_end), tile_scores);
        }
        softmax.fold::<S>(scores, n, out_t);
        tile_products::accumulate::<S>(scores, &value_rows[..n], rows, out_t);
    }
    for (row, (out, lse)) in out.chunks_exact_mut(d).zip(lse.iter_mut()).enumerate() {
        match softmax.finish(row) {
            // The outputs are convex combinations of the stored values: scale them to the
            // real ones.
            Some((inv_sum, row_lse)) => {
                let factor = inv_sum * inputs.v_scale;
                let column = out_t[row..].iter().step_by(rows);
                for (o, &x) in out.iter_mut().zip(column) {
                    *o = x * factor;
                }
                *lse = row_lse;
            }
            None => {
                out.fill(0.0);
                *lse = f32::NEG_INFINITY;
            }
        }
    }
}

/// The task's queries as f32, transposed into `scratch.q_t` (`d × rows`, row `i · group + m`
/// being token `i` of the group's head `m`), pre-multiplied by scale·log2(e) and the keys'
/// scale, so that scores come out in base 2 against the real keys.
#[inline(always)]
fn load_queries<T: Element, KV>(
    inputs: &DecodeInputs<'_, T, KV>,
    task: &Task,
    rows: usize,
    scratch: &mut Scratch,
) {
    let d = inputs.dims.head_dim;
    let group = inputs.dims.group_size();
    let q_scale = inputs.softmax_scale * inputs.k_scale * std::f32::consts::LOG2_E;
    for i in 0..task.tokens.len() * group {
        let (token, member) = (task.tokens.start + i / group, i % group);
        let at = inputs
            .q_strides
            .row(task.batch, token, task.kv_head * group + member);
        let q = T::row_f32(&inputs.q[at..at + d], &mut scratch.row);
        for (dst, &x) in scratch.q_t[i..].iter_mut().step_by(rows).zip(q) {
            *dst = x * q_scale;
        }
    }
}

/// Sets to −inf the scores (`keys` × rows) of the tile's keys `keys` that a row does not see:
/// past its own position or before its window. Rows past the block's last see none.
#[inline(always)]
fn mask_unseen(
    task: &Task,
    keys: Range<usize>,
    group: usize,
    (live_start, live_end): (&mut [u32], &mut [u32]),
    scores: &mut [f32],
) {
    let real_rows = task.tokens.len() * group;
    let bounds = live_start.iter_mut().zip(live_end.iter_mut());
    for (row, (start, end)) in bounds.enumerate() {
        let seen = if row < real_rows {
            task.visible.keys(task.tokens.start + row / group)
        } else {
            0..0
        };
        // Offsets into the tile, within 0..=TILE_KEYS.
        *start = (seen.start.clamp(keys.start, keys.end) - keys.start) as u32;
        *end = (seen.end.clamp(keys.start, keys.end) - keys.start) as u32;
    }
    let rows = live_start.len();
    for (j, scores) in scores.chunks_exact_mut(rows).enumerate() {
        let j = j as u32;
        let bounds = live_start.iter().zip(live_end.iter());
        for (s, (&start, &end)) in scores.iter_mut().zip(bounds) {
            if j < start || j >= end {
                *s = f32::NEG_INFINITY;
            }
        }
    }
}
