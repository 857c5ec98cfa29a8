//! Multi-threaded split-KV decode on the CPU.
//!
//! One rayon task per `(batch, kv head, split)` streams its chunk of K/V in tiles, converts each
//! row to f32 once, scores it against every query head of the GQA group and keeps an online
//! (running-max, base-2) softmax per head. Each task leaves a normalised partial output and its
//! log-sum-exp; a second parallel pass merges the splits of each `(batch, q head)`.

use crate::plan::SplitPlan;
use crate::validate::{DecodeDims, RowStrides};
use half::{bf16, f16, slice::HalfFloatSliceExt};
use rayon::prelude::*;

/// Positions scored together before their values are accumulated. Large enough to amortise the
/// softmax rescale, small enough for the scores to stay in L1.
const TILE: usize = 32;

/// A storage element the CPU path can read and write.
pub trait Element: Copy + Send + Sync + 'static {
    const ZERO: Self;
    /// `src` as f32, either borrowed (f32 input) or converted into `buf`.
    fn row_f32<'a>(src: &'a [Self], buf: &'a mut [f32]) -> &'a [f32];
    fn from_f32_slice(src: &[f32], dst: &mut [Self]);
}

impl Element for f32 {
    const ZERO: Self = 0.0;
    #[inline]
    fn row_f32<'a>(src: &'a [f32], _buf: &'a mut [f32]) -> &'a [f32] {
        src
    }
    fn from_f32_slice(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src)
    }
}

impl Element for f16 {
    const ZERO: Self = f16::ZERO;
    #[inline]
    fn row_f32<'a>(src: &'a [f16], buf: &'a mut [f32]) -> &'a [f32] {
        src.convert_to_f32_slice(buf);
        buf
    }
    fn from_f32_slice(src: &[f32], dst: &mut [f16]) {
        dst.convert_from_f32_slice(src)
    }
}

impl Element for bf16 {
    const ZERO: Self = bf16::ZERO;
    #[inline]
    fn row_f32<'a>(src: &'a [bf16], buf: &'a mut [f32]) -> &'a [f32] {
        src.convert_to_f32_slice(buf);
        buf
    }
    fn from_f32_slice(src: &[f32], dst: &mut [bf16]) {
        dst.convert_from_f32_slice(src)
    }
}

/// One decode call's inputs, borrowed from candle's storage.
pub struct DecodeInputs<'a, T> {
    pub q: &'a [T],
    pub q_strides: RowStrides,
    pub k: &'a [T],
    pub k_strides: RowStrides,
    pub v: &'a [T],
    pub v_strides: RowStrides,
    /// Per-sequence lengths, each at most `dims.kv_len`; `None` means all equal `dims.kv_len`.
    pub seqlens: Option<&'a [u32]>,
    pub dims: DecodeDims,
    pub softmax_scale: f32,
}

/// Runs the op. Returns the output `(b, 1, h_q, d)` contiguous in `T`, and the natural-log LSE
/// `(b, h_q)` in f32.
pub fn decode<T: Element>(inputs: &DecodeInputs<'_, T>, plan: SplitPlan) -> (Vec<T>, Vec<f32>) {
    let dims = inputs.dims;
    let group = dims.group_size();
    let d = dims.head_dim;
    let tasks = dims.batch * dims.kv_heads * plan.num_splits;

    let mut partial_out = vec![0f32; tasks * group * d];
    let mut partial_lse = vec![0f32; tasks * group];
    partial_out
        .par_chunks_mut(group * d)
        .zip(partial_lse.par_chunks_mut(group))
        .enumerate()
        .for_each(|(task, (out, lse))| {
            let split = task % plan.num_splits;
            let kv_head = (task / plan.num_splits) % dims.kv_heads;
            let batch = task / (plan.num_splits * dims.kv_heads);
            attend_chunk(inputs, plan, batch, kv_head, split, out, lse);
        });

    let mut out = vec![0f32; dims.batch * dims.q_heads * d];
    let mut lse = vec![0f32; dims.batch * dims.q_heads];
    out.par_chunks_mut(d)
        .zip(lse.par_iter_mut())
        .enumerate()
        .for_each(|(row, (out, lse))| {
            let (batch, q_head) = (row / dims.q_heads, row % dims.q_heads);
            let (kv_head, member) = (q_head / group, q_head % group);
            let first_task = (batch * dims.kv_heads + kv_head) * plan.num_splits;
            let split_lse = |s: usize| partial_lse[(first_task + s) * group + member];
            let split_out = |s: usize| {
                let start = ((first_task + s) * group + member) * d;
                &partial_out[start..start + d]
            };
            *lse = merge_splits(plan.num_splits, split_lse, split_out, out);
        });

    let mut out_t = vec![T::ZERO; out.len()];
    T::from_f32_slice(&out, &mut out_t);
    (out_t, lse)
}

/// Merges per-split normalised outputs by their LSEs into `out`; returns the merged LSE.
/// A split with lse = -inf has weight 0; if all are -inf, `out` is zero and the LSE is -inf.
fn merge_splits<'a>(
    num_splits: usize,
    split_lse: impl Fn(usize) -> f32,
    split_out: impl Fn(usize) -> &'a [f32],
    out: &mut [f32],
) -> f32 {
    let max = (0..num_splits)
        .map(&split_lse)
        .fold(f32::NEG_INFINITY, f32::max);
    out.fill(0.0);
    if max == f32::NEG_INFINITY {
        return f32::NEG_INFINITY;
    }
    let weights: Vec<f32> = (0..num_splits)
        .map(|s| (split_lse(s) - max).exp())
        .collect();
    let total: f32 = weights.iter().sum();
    for (s, &w) in weights.iter().enumerate() {
        if w > 0.0 {
            axpy(w / total, split_out(s), out);
        }
    }
    max + total.ln()
}

/// The partial pass of one `(batch, kv head, split)`: writes the group's normalised outputs
/// (`group × d`) and natural-log LSEs.
fn attend_chunk<T: Element>(
    inputs: &DecodeInputs<'_, T>,
    plan: SplitPlan,
    batch: usize,
    kv_head: usize,
    split: usize,
    out: &mut [f32],
    lse: &mut [f32],
) {
    let dims = inputs.dims;
    let d = dims.head_dim;
    let group = dims.group_size();
    let seq_len = inputs
        .seqlens
        .map_or(dims.kv_len, |lens| lens[batch] as usize);
    let start = split * plan.chunk_size;
    let end = (start + plan.chunk_size).min(seq_len);
    out.fill(0.0);
    if start >= end {
        lse.fill(f32::NEG_INFINITY);
        return;
    }

    // Queries pre-multiplied by scale·log2(e), so scores are already in base 2.
    let mut queries = vec![0f32; group * d];
    let mut row_buf = vec![0f32; d];
    let q_scale = inputs.softmax_scale * std::f32::consts::LOG2_E;
    for (member, query) in queries.chunks_exact_mut(d).enumerate() {
        let at = inputs.q_strides.row(batch, 0, kv_head * group + member);
        let q = T::row_f32(&inputs.q[at..at + d], &mut row_buf);
        for (dst, &x) in query.iter_mut().zip(q) {
            *dst = x * q_scale;
        }
    }

    let mut running_max = vec![f32::NEG_INFINITY; group];
    let mut running_sum = vec![0f32; group];
    let mut probs = vec![0f32; group * TILE];
    for tile_start in (start..end).step_by(TILE) {
        let tile_len = TILE.min(end - tile_start);
        for t in 0..tile_len {
            let at = inputs.k_strides.row(batch, tile_start + t, kv_head);
            let key = T::row_f32(&inputs.k[at..at + d], &mut row_buf);
            for (member, query) in queries.chunks_exact(d).enumerate() {
                probs[member * TILE + t] = dot(query, key);
            }
        }
        for member in 0..group {
            let scores = &mut probs[member * TILE..member * TILE + tile_len];
            let tile_max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let new_max = running_max[member].max(tile_max);
            let rescale = (running_max[member] - new_max).exp2();
            let mut tile_sum = 0f32;
            for s in scores.iter_mut() {
                *s = (*s - new_max).exp2();
                tile_sum += *s;
            }
            running_sum[member] = running_sum[member] * rescale + tile_sum;
            running_max[member] = new_max;
            if rescale != 1.0 {
                out[member * d..(member + 1) * d]
                    .iter_mut()
                    .for_each(|o| *o *= rescale);
            }
        }
        for t in 0..tile_len {
            let at = inputs.v_strides.row(batch, tile_start + t, kv_head);
            let value = T::row_f32(&inputs.v[at..at + d], &mut row_buf);
            for (member, acc) in out.chunks_exact_mut(d).enumerate() {
                axpy(probs[member * TILE + t], value, acc);
            }
        }
    }
    for member in 0..group {
        let inv = 1.0 / running_sum[member];
        out[member * d..(member + 1) * d]
            .iter_mut()
            .for_each(|o| *o *= inv);
        lse[member] = (running_max[member] + running_sum[member].log2()) * std::f32::consts::LN_2;
    }
}

/// Dot product with eight independent accumulators, which the compiler keeps in vector registers.
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (a_head, a_tail) = a.split_at(a.len() - a.len() % 8);
    let (b_head, b_tail) = b.split_at(a_head.len());
    for (x, y) in a_head.chunks_exact(8).zip(b_head.chunks_exact(8)) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let tail: f32 = a_tail.iter().zip(b_tail).map(|(x, y)| x * y).sum();
    acc.iter().sum::<f32>() + tail
}

/// `acc += alpha * x`.
#[inline]
fn axpy(alpha: f32, x: &[f32], acc: &mut [f32]) {
    for (a, &v) in acc.iter_mut().zip(x) {
        *a += alpha * v;
    }
}
