//! Multi-threaded split-KV decode on the CPU.
//!
//! One rayon task per `(batch, kv head, split)` streams its chunk of K/V in tiles, converts each
//! row to f32 once, scores it against every query head of the GQA group and keeps an online
//! (running-max, base-2) softmax per head. Each task leaves a normalised partial output and its
//! log-sum-exp; a second parallel pass merges the splits of each `(batch, q head)`.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, Device, Layout, Result};
use float8::F8E4M3;
use half::{bf16, f16, slice::HalfFloatSliceExt};
use rayon::prelude::*;

use super::call::DecodeCall;
use super::merge::{merge_normalised, MergeState};
use super::plan::{SplitPlan, MIN_CHUNK};
use super::validate::{self, DecodeDims, RowStrides};

/// Positions scored together before their values are accumulated. Large enough to amortise the
/// softmax rescale, small enough for the scores to stay in L1.
const TILE: usize = 32;

/// A storage element the CPU path can read and write.
pub(crate) trait Element: Copy + Send + Sync + 'static {
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

/// One e4m3 value as f32, exactly, in branch-free integer steps that the compiler vectorizes
/// (a table lookup per element is a scalar gather). The exponent and mantissa bits move into an
/// f32 whose exponent is offset by 120, which keeps every result a normal f32: subnormal e4m3
/// values (exponent 0) are built as 2^-6 · (1 + m/8) and lose the implicit 2^-6 by subtraction.
#[inline(always)]
fn e4m3_to_f32(bits: u8) -> f32 {
    let bits = u32::from(bits);
    let magnitude = bits & 0x7f;
    let subnormal = magnitude < 0x08;
    let exponent_fix = if subnormal { 1 << 23 } else { 0 };
    let value = f32::from_bits((magnitude << 20) + (120 << 23) + exponent_fix)
        - if subnormal { 1.0 / 64.0 } else { 0.0 };
    let value = f32::from_bits(value.to_bits() | ((bits & 0x80) << 24));
    // 0x7f and 0xff are e4m3's NaNs (it has no infinities).
    if magnitude == 0x7f {
        f32::NAN
    } else {
        value
    }
}

impl Element for F8E4M3 {
    const ZERO: Self = F8E4M3::ZERO;
    #[inline]
    fn row_f32<'a>(src: &'a [F8E4M3], buf: &'a mut [f32]) -> &'a [f32] {
        for (dst, &x) in buf.iter_mut().zip(src) {
            *dst = e4m3_to_f32(x.to_bits());
        }
        buf
    }
    fn from_f32_slice(src: &[f32], dst: &mut [F8E4M3]) {
        for (dst, &x) in dst.iter_mut().zip(src) {
            *dst = F8E4M3::from_f32(x);
        }
    }
}

/// Tasks the CPU path aims for: a few per thread so that uneven chunks still balance.
pub(crate) fn parallel_slots() -> usize {
    4 * rayon::current_num_threads()
}

/// Runs a validated call on CPU storage: the output in q's dtype, and the natural-log LSE
/// `(b, h_q, q_len)`.
pub(crate) fn forward(
    call: &DecodeCall,
    (q, q_layout): (&CpuStorage, &Layout),
    (k, k_layout): (&CpuStorage, &Layout),
    (v, v_layout): (&CpuStorage, &Layout),
) -> Result<(CpuStorage, Vec<f32>)> {
    let seqlens = match call.seqlens_k {
        None => None,
        Some(seqlens) => Some(seqlens.to_device(&Device::Cpu)?.to_vec1::<u32>()?),
    };
    let table = match (call.dims.pages, call.block_table, &seqlens) {
        (Some(pages), Some(table), Some(lens)) => {
            let table = table
                .to_device(&Device::Cpu)?
                .flatten_all()?
                .to_vec1::<u32>()?;
            validate::check_block_table_values(&table, lens, pages)?;
            Some(table)
        }
        (None, None, _) => None,
        _ => bail!("split-kv attention: a paged call needs its block table and seqlens_k"),
    };
    if let Some(lens) = &seqlens {
        validate::check_seqlen_values(lens, call.dims.kv_len)?;
    }
    let pages = table
        .as_deref()
        .zip(call.dims.pages)
        .map(|(table, dims)| PageTable {
            table,
            page_size: dims.page_size,
            max_pages: dims.max_pages,
        });
    let plan = call.split_plan(parallel_slots(), MIN_CHUNK);
    let layouts = [q_layout, k_layout, v_layout];
    let rows = KvRowsOf {
        seqlens: seqlens.as_deref(),
        pages,
    };
    match (k, v) {
        (CpuStorage::F8E4M3(k), CpuStorage::F8E4M3(v)) => {
            decode_storage(call, rows, layouts, plan, (q, k, v))
        }
        _ => match (q, k, v) {
            (CpuStorage::F32(_), CpuStorage::F32(k), CpuStorage::F32(v)) => {
                decode_storage(call, rows, layouts, plan, (q, k, v))
            }
            (CpuStorage::F16(_), CpuStorage::F16(k), CpuStorage::F16(v)) => {
                decode_storage(call, rows, layouts, plan, (q, k, v))
            }
            (CpuStorage::BF16(_), CpuStorage::BF16(k), CpuStorage::BF16(v)) => {
                decode_storage(call, rows, layouts, plan, (q, k, v))
            }
            _ => bail!(
                "split-kv attention: unsupported dtypes q {:?}, k {:?}, v {:?}; use f32, f16 or \
                 bf16 for all three, or f8e4m3 for k and v",
                q.dtype(),
                k.dtype(),
                v.dtype()
            ),
        },
    }
}

/// Which K/V positions each sequence has and where they lie, read from the host copies of the
/// call's lengths and block table.
#[derive(Debug, Clone, Copy)]
struct KvRowsOf<'a> {
    seqlens: Option<&'a [u32]>,
    pages: Option<PageTable<'a>>,
}

/// A paged call's block table on the host, its values checked.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PageTable<'a> {
    /// `(batch, max_pages)`, row-major.
    pub table: &'a [u32],
    pub page_size: usize,
    pub max_pages: usize,
}

impl PageTable<'_> {
    /// The page holding position `pos` of sequence `batch`, and the row within it.
    #[inline]
    fn locate(&self, batch: usize, pos: usize) -> (usize, usize) {
        let page = self.table[batch * self.max_pages + pos / self.page_size] as usize;
        (page, pos % self.page_size)
    }
}

/// [`decode_slices`] for q's storage, whatever its dtype, over K/V of element type `KV`.
fn decode_storage<KV: Element>(
    call: &DecodeCall,
    rows: KvRowsOf,
    layouts: [&Layout; 3],
    plan: SplitPlan,
    (q, k, v): (&CpuStorage, &[KV], &[KV]),
) -> Result<(CpuStorage, Vec<f32>)> {
    Ok(match q {
        CpuStorage::F32(q) => {
            let (out, lse) = decode_slices(call, rows, layouts, plan, (q, k, v));
            (CpuStorage::F32(out), lse)
        }
        CpuStorage::F16(q) => {
            let (out, lse) = decode_slices(call, rows, layouts, plan, (q, k, v));
            (CpuStorage::F16(out), lse)
        }
        CpuStorage::BF16(q) => {
            let (out, lse) = decode_slices(call, rows, layouts, plan, (q, k, v));
            (CpuStorage::BF16(out), lse)
        }
        other => bail!(
            "split-kv attention: unsupported dtype {:?} for q; use f32, f16 or bf16",
            other.dtype()
        ),
    })
}

/// [`decode`] over q slices of element type `T` and k, v slices of `KV`, laid out as `layouts`
/// (q, k, v).
fn decode_slices<T: Element, KV: Element>(
    call: &DecodeCall,
    rows: KvRowsOf,
    [q_layout, k_layout, v_layout]: [&Layout; 3],
    plan: SplitPlan,
    (q, k, v): (&[T], &[KV], &[KV]),
) -> (Vec<T>, Vec<f32>) {
    let inputs = DecodeInputs {
        q,
        q_strides: RowStrides::of(q_layout),
        k,
        k_strides: RowStrides::of(k_layout),
        v,
        v_strides: RowStrides::of(v_layout),
        seqlens: rows.seqlens,
        pages: rows.pages,
        dims: call.dims,
        softmax_scale: call.softmax_scale,
        k_scale: call.k_scale,
        v_scale: call.v_scale,
        window_left: call.window_left,
        softcap: call.softcap,
    };
    decode(&inputs, plan)
}

/// One decode call's inputs, borrowed from candle's storage.
pub(crate) struct DecodeInputs<'a, T, KV> {
    pub q: &'a [T],
    pub q_strides: RowStrides,
    pub k: &'a [KV],
    pub k_strides: RowStrides,
    pub v: &'a [KV],
    pub v_strides: RowStrides,
    /// Per-sequence lengths, each at most `dims.kv_len`; `None` means all equal `dims.kv_len`.
    pub seqlens: Option<&'a [u32]>,
    /// Paged K/V: k and v are pools of pages, found through this table.
    pub pages: Option<PageTable<'a>>,
    pub dims: DecodeDims,
    pub softmax_scale: f32,
    /// The real K and V are the stored values times these.
    pub k_scale: f32,
    pub v_scale: f32,
    /// A query sees at most this many positions before its own.
    pub window_left: Option<usize>,
    /// Scores become `c·tanh(s/c)` with this c.
    pub softcap: Option<f32>,
}

impl<T, KV> DecodeInputs<'_, T, KV> {
    /// Where position `pos` of sequence `batch`'s K/V head `head` starts in k or v, laid out as
    /// `strides`.
    #[inline]
    fn kv_row(&self, strides: RowStrides, batch: usize, pos: usize, head: usize) -> usize {
        match &self.pages {
            None => strides.row(batch, pos, head),
            Some(pages) => {
                let (page, row) = pages.locate(batch, pos);
                strides.row(page, row, head)
            }
        }
    }
}

/// Runs the op. Returns the output `(b, q_len, h_q, d)` contiguous in `T`, and the natural-log
/// LSE `(b, h_q, q_len)` in f32.
pub(crate) fn decode<T: Element, KV: Element>(
    inputs: &DecodeInputs<'_, T, KV>,
    plan: SplitPlan,
) -> (Vec<T>, Vec<f32>) {
    let dims = inputs.dims;
    let group = dims.group_size();
    let d = dims.head_dim;
    let q_len = dims.q_len;
    let rows = q_len * group; // query rows of one (batch, kv head)
    let tasks = dims.batch * dims.kv_heads * plan.num_splits;

    let mut partial_out = vec![0f32; tasks * rows * d];
    let mut partial_lse = vec![0f32; tasks * rows];
    partial_out
        .par_chunks_mut(rows * d)
        .zip(partial_lse.par_chunks_mut(rows))
        .enumerate()
        .for_each(|(task, (out, lse))| {
            let split = task % plan.num_splits;
            let kv_head = (task / plan.num_splits) % dims.kv_heads;
            let batch = task / (plan.num_splits * dims.kv_heads);
            attend_chunk_best(inputs, plan, batch, kv_head, split, out, lse);
        });

    // Output rows in (batch, token, q head) order.
    let mut out = vec![0f32; dims.batch * q_len * dims.q_heads * d];
    let mut row_lse = vec![0f32; dims.batch * q_len * dims.q_heads];
    out.par_chunks_mut(d)
        .zip(row_lse.par_iter_mut())
        .enumerate()
        .for_each(|(row, (out, lse))| {
            let q_head = row % dims.q_heads;
            let token = (row / dims.q_heads) % q_len;
            let batch = row / (dims.q_heads * q_len);
            let (kv_head, member) = (q_head / group, q_head % group);
            let first_task = (batch * dims.kv_heads + kv_head) * plan.num_splits;
            let splits = (0..plan.num_splits).map(|s| {
                let part = (first_task + s) * rows + token * group + member;
                (partial_lse[part], &partial_out[part * d..(part + 1) * d])
            });
            *lse = merge_normalised(splits, out, Portable::axpy) * std::f32::consts::LN_2;
        });
    // The LSE in (batch, q head, token) order.
    let mut lse = vec![0f32; row_lse.len()];
    for (row, &x) in row_lse.iter().enumerate() {
        let q_head = row % dims.q_heads;
        let token = (row / dims.q_heads) % q_len;
        let batch = row / (dims.q_heads * q_len);
        lse[(batch * dims.q_heads + q_head) * q_len + token] = x;
    }

    let mut out_t = vec![T::ZERO; out.len()];
    T::from_f32_slice(&out, &mut out_t);
    (out_t, lse)
}

/// [`attend_chunk`] compiled for the best instruction set this CPU has.
fn attend_chunk_best<T: Element, KV: Element>(
    inputs: &DecodeInputs<'_, T, KV>,
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
    attend_chunk::<T, KV, Portable>(inputs, plan, batch, kv_head, split, out, lse)
}

/// [`attend_chunk`] with AVX2 and FMA enabled: 8-wide fused multiply-adds in the inner loops.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_chunk_avx2<T: Element, KV: Element>(
    inputs: &DecodeInputs<'_, T, KV>,
    plan: SplitPlan,
    batch: usize,
    kv_head: usize,
    split: usize,
    out: &mut [f32],
    lse: &mut [f32],
) {
    attend_chunk::<T, KV, Fused>(inputs, plan, batch, kv_head, split, out, lse)
}

/// The partial pass of one `(batch, kv head, split)`: writes the normalised outputs (`rows × d`)
/// and base-2 LSEs of its query rows, `q_len × group` of them, row `i · group + m` being query
/// token `i` of the group's head `m`.
#[inline(always)]
fn attend_chunk<T: Element, KV: Element, S: InnerLoops>(
    inputs: &DecodeInputs<'_, T, KV>,
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
    let rows = dims.q_len * group;
    let seq_len = inputs
        .seqlens
        .map_or(dims.kv_len, |lens| lens[batch] as usize);
    // Query token i is position seq_len − q_len + i and sees the keys before and at it, or
    // with a window the last window_left + 1 of them.
    let visible = |row: usize| (seq_len + row / group + 1).saturating_sub(dims.q_len);
    let first_seen = |row: usize| match inputs.window_left {
        Some(w) => visible(row).saturating_sub(w + 1),
        None => 0,
    };
    // Positions before the first token's window are never read.
    let start = (split * plan.chunk_size).max(first_seen(0));
    let end = (split * plan.chunk_size + plan.chunk_size).min(seq_len);
    out.fill(0.0);
    if start >= end {
        lse.fill(f32::NEG_INFINITY);
        return;
    }
    // Soft-capping of the base-2 scores: c·tanh(s/c) in natural units.
    let cap = inputs.softcap.map(|c| c * std::f32::consts::LOG2_E);

    // Queries pre-multiplied by scale·log2(e) and the keys' scale, so scores come out in base 2
    // against the real keys.
    let mut queries = vec![0f32; rows * d];
    let mut row_buf = vec![0f32; d];
    let q_scale = inputs.softmax_scale * inputs.k_scale * std::f32::consts::LOG2_E;
    for (row, query) in queries.chunks_exact_mut(d).enumerate() {
        let (token, member) = (row / group, row % group);
        let at = inputs.q_strides.row(batch, token, kv_head * group + member);
        let q = T::row_f32(&inputs.q[at..at + d], &mut row_buf);
        for (dst, &x) in query.iter_mut().zip(q) {
            *dst = x * q_scale;
        }
    }

    let mut states: Vec<MergeState> = out.chunks_exact_mut(d).map(MergeState::new).collect();
    let mut probs = vec![0f32; rows * TILE];
    for tile_start in (start..end).step_by(TILE) {
        let tile_len = TILE.min(end - tile_start);
        for t in 0..tile_len {
            let pos = tile_start + t;
            let at = inputs.kv_row(inputs.k_strides, batch, pos, kv_head);
            let key = KV::row_f32(&inputs.k[at..at + d], &mut row_buf);
            for (row, query) in queries.chunks_exact(d).enumerate() {
                probs[row * TILE + t] = if pos < visible(row) && pos >= first_seen(row) {
                    let score = S::dot(query, key);
                    cap.map_or(score, |c| c * (score / c).tanh())
                } else {
                    f32::NEG_INFINITY
                };
            }
        }
        for (row, state) in states.iter_mut().enumerate() {
            let scores = &mut probs[row * TILE..row * TILE + tile_len];
            state.raise_max(scores.iter().copied().fold(f32::NEG_INFINITY, f32::max));
            let max = state.max();
            for s in scores.iter_mut() {
                // A masked key weighs exactly nothing (the polynomial exp2 stops at 2^-126).
                *s = if *s == f32::NEG_INFINITY {
                    0.0
                } else {
                    S::exp2_nonpositive(*s - max)
                };
            }
            state.add_weight(scores.iter().sum());
        }
        for t in 0..tile_len {
            let at = inputs.kv_row(inputs.v_strides, batch, tile_start + t, kv_head);
            let value = KV::row_f32(&inputs.v[at..at + d], &mut row_buf);
            for (row, state) in states.iter_mut().enumerate() {
                S::axpy(probs[row * TILE + t], value, state.acc_mut());
            }
        }
    }
    for (state, lse) in states.into_iter().zip(lse.iter_mut()) {
        *lse = state.finish();
    }
    // The outputs are convex combinations of the stored values: scale them to the real ones.
    if inputs.v_scale != 1.0 {
        out.iter_mut().for_each(|x| *x *= inputs.v_scale);
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
    use crate::op::validate::DecodeDims;

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
            q_len: 1,
            pages: None,
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
            pages: None,
            dims,
            softmax_scale: 2.0,
            k_scale: 1.0,
            v_scale: 1.0,
            window_left: None,
            softcap: None,
        };
        let plan = SplitPlan {
            num_splits: 1,
            chunk_size: len,
        };
        let (mut out_a, mut lse_a) = (vec![0f32; group * d], vec![0f32; group]);
        let (mut out_b, mut lse_b) = (vec![0f32; group * d], vec![0f32; group]);
        attend_chunk::<f32, f32, Portable>(&inputs, plan, 0, 0, 0, &mut out_a, &mut lse_a);
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

    #[test]
    fn e4m3_widening_is_exact_for_every_bit_pattern() {
        for bits in 0..=255u8 {
            let want = F8E4M3::from_bits(bits).to_f32();
            let got = super::e4m3_to_f32(bits);
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{bits:#04x}: {got} against {want}"
            );
        }
    }
}
