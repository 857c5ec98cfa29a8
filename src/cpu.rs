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
            attend_chunk_best(inputs, plan, batch, kv_head, split, out, lse);
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
            Portable::axpy(w / total, split_out(s), out);
        }
    }
    max + total.ln()
}

/// [`attend_chunk`] compiled for the best instruction set this CPU has.
fn attend_chunk_best<T: Element>(
    inputs: &DecodeInputs<'_, T>,
    plan: SplitPlan,
    batch: usize,
    kv_head: usize,
    split: usize,
    out: &mut [f32],
    lse: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU supports AVX2 and FMA, checked just above.
        return unsafe { attend_chunk_avx2(inputs, plan, batch, kv_head, split, out, lse) };
    }
    attend_chunk::<T, Portable>(inputs, plan, batch, kv_head, split, out, lse)
}

/// [`attend_chunk`] with AVX2 and FMA enabled: 8-wide fused multiply-adds in the inner loops.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_chunk_avx2<T: Element>(
    inputs: &DecodeInputs<'_, T>,
    plan: SplitPlan,
    batch: usize,
    kv_head: usize,
    split: usize,
    out: &mut [f32],
    lse: &mut [f32],
) {
    attend_chunk::<T, Fused>(inputs, plan, batch, kv_head, split, out, lse)
}

/// The partial pass of one `(batch, kv head, split)`: writes the group's normalised outputs
/// (`group × d`) and natural-log LSEs.
#[inline(always)]
fn attend_chunk<T: Element, S: InnerLoops>(
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
                probs[member * TILE + t] = S::dot(query, key);
            }
        }
        for member in 0..group {
            let scores = &mut probs[member * TILE..member * TILE + tile_len];
            let tile_max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let new_max = running_max[member].max(tile_max);
            let rescale = (running_max[member] - new_max).exp2();
            for s in scores.iter_mut() {
                *s = S::exp2_nonpositive(*s - new_max);
            }
            let tile_sum: f32 = scores.iter().sum();
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
                S::axpy(probs[member * TILE + t], value, acc);
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

/// The arithmetic of the partial pass's inner loops, in one form per instruction set. Only the
/// multiply-add differs; everything else is written once on top of it.
trait InnerLoops {
    /// `a * b + c`.
    fn mul_add(a: f32, b: f32, c: f32) -> f32;

    /// `a · b`, with [`LANES`] independent accumulators so that the adds do not wait on one
    /// dependency chain. Every supported head dim is a multiple of `LANES`.
    #[inline(always)]
    fn dot(a: &[f32], b: &[f32]) -> f32 {
        let mut acc = [0f32; LANES];
        let split = a.len() - a.len() % LANES;
        for (x, y) in a[..split]
            .chunks_exact(LANES)
            .zip(b[..split].chunks_exact(LANES))
        {
            for i in 0..LANES {
                acc[i] = Self::mul_add(x[i], y[i], acc[i]);
            }
        }
        let tail: f32 = a[split..].iter().zip(&b[split..]).map(|(x, y)| x * y).sum();
        acc.iter().sum::<f32>() + tail
    }

    /// `acc += alpha * x`.
    #[inline(always)]
    fn axpy(alpha: f32, x: &[f32], acc: &mut [f32]) {
        for (a, &v) in acc.iter_mut().zip(x) {
            *a = Self::mul_add(alpha, v, *a);
        }
    }

    /// `2^x` for `x ≤ 0` (a score minus the running max), within 1.9e-7 relative, in a form the
    /// compiler vectorises (libm's `exp2f` is a call per element). Inputs below -126 give 2^-126,
    /// which weighs nothing next to the running sum (at least 1); NaN stays NaN.
    #[inline(always)]
    fn exp2_nonpositive(x: f32) -> f32 {
        // Near-minimax polynomial for 2^f on [-1, 0] (constant and linear terms exact).
        const C: [f32; 7] = [
            1.0,
            std::f32::consts::LN_2,
            0.240_225_69,
            0.055_495_9,
            0.009_588_331,
            0.001_282_349_7,
            0.000_111_416_89,
        ];
        let x = if x < -126.0 { -126.0 } else { x };
        // x = whole + frac with whole = trunc(x) in [-126, 0] and frac in (-1, 0].
        let whole = x as i32;
        let frac = x - whole as f32;
        let mut p = C[6];
        for &c in C[..6].iter().rev() {
            p = Self::mul_add(p, frac, c);
        }
        p * f32::from_bits(((whole + 127) as u32) << 23)
    }
}

/// Independent accumulators per dot product: two 8-wide vectors.
const LANES: usize = 16;

/// Separate multiplies and adds, which the compiler vectorises for the target's baseline.
struct Portable;

impl InnerLoops for Portable {
    #[inline(always)]
    fn mul_add(a: f32, b: f32, c: f32) -> f32 {
        a * b + c
    }
}

/// Fused multiply-adds; only fast where FMA is enabled (inside [`attend_chunk_avx2`]).
#[cfg(target_arch = "x86_64")]
struct Fused;

#[cfg(target_arch = "x86_64")]
impl InnerLoops for Fused {
    #[inline(always)]
    fn mul_add(a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::validate::DecodeDims;

    fn check_exp2<S: InnerLoops>() {
        let mut worst = 0f64;
        for i in 0..=200_000 {
            let x = -130.0 * i as f32 / 200_000.0;
            let got = S::exp2_nonpositive(x) as f64;
            let want = (x.max(-126.0) as f64).exp2();
            worst = worst.max((got / want - 1.0).abs());
        }
        assert!(worst < 3e-7, "exp2 relative error {worst}");
        assert_eq!(S::exp2_nonpositive(0.0), 1.0);
        assert!(S::exp2_nonpositive(f32::NEG_INFINITY) <= f32::MIN_POSITIVE);
        assert!(S::exp2_nonpositive(f32::NAN).is_nan());
    }

    #[test]
    fn exp2_is_accurate() {
        check_exp2::<Portable>();
        #[cfg(target_arch = "x86_64")]
        check_exp2::<Fused>();
    }

    /// The portable loops against whichever this CPU dispatches to, on one chunk.
    #[test]
    fn portable_and_dispatched_loops_agree() {
        let (group, d, len) = (3, 64, 1000);
        let mut state = 0x2545_f491_u32;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            state as f32 / u32::MAX as f32 - 0.5
        };
        let q: Vec<f32> = (0..group * d).map(|_| next()).collect();
        let k: Vec<f32> = (0..len * d).map(|_| next()).collect();
        let v: Vec<f32> = (0..len * d).map(|_| next()).collect();
        let dims = DecodeDims {
            batch: 1,
            q_heads: group,
            kv_heads: 1,
            head_dim: d,
            kv_len: len,
        };
        let q_strides = RowStrides {
            offset: 0,
            batch: group * d,
            seq: group * d,
            head: d,
        };
        let kv_strides = RowStrides {
            offset: 0,
            batch: len * d,
            seq: d,
            head: d,
        };
        let inputs = DecodeInputs {
            q: &q,
            q_strides,
            k: &k,
            k_strides: kv_strides,
            v: &v,
            v_strides: kv_strides,
            seqlens: None,
            dims,
            softmax_scale: 2.0,
        };
        let plan = SplitPlan {
            num_splits: 1,
            chunk_size: len,
        };
        let (mut out_a, mut lse_a) = (vec![0f32; group * d], vec![0f32; group]);
        let (mut out_b, mut lse_b) = (vec![0f32; group * d], vec![0f32; group]);
        attend_chunk::<f32, Portable>(&inputs, plan, 0, 0, 0, &mut out_a, &mut lse_a);
        attend_chunk_best(&inputs, plan, 0, 0, 0, &mut out_b, &mut lse_b);
        let worst = out_a
            .iter()
            .zip(&out_b)
            .chain(lse_a.iter().zip(&lse_b))
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            worst < 1e-5,
            "portable and dispatched loops differ by {worst}"
        );
    }
}
