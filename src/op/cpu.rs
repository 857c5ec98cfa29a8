//! Multi-threaded split-KV attention on the CPU.
//!
//! The decode pass (a few query tokens per sequence): one rayon task per `(batch, kv head,
//! split)` streams its chunk of K/V in tiles, converts each row to f32 once, scores it against
//! every query row of the GQA group and keeps an online (running-max, base-2) softmax per row.
//! Longer queries (prefill) run the tiled pass of [`prefill`] instead. Either pass leaves a
//! normalised partial output and its log-sum-exp per split; a second parallel pass merges the
//! splits of each `(batch, token, q head)`.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, Device, Layout, Result};
use float8::F8E4M3;
use half::{bf16, f16, slice::HalfFloatSliceExt};
use rayon::prelude::*;

mod loops;
mod prefill;
mod row_softmax;
mod tile_products;

use super::call::DecodeCall;
use super::merge::{merge_normalised, MergeState};
use super::plan::{SplitPlan, MIN_CHUNK};
use super::validate::{self, DecodeDims, RowStrides};
#[cfg(target_arch = "x86_64")]
use loops::Fused;
use loops::InnerLoops;
use loops::Portable;

/// Positions scored together before their values are accumulated. Large enough to amortise the
/// softmax rescale, small enough for the scores to stay in L1.
const TILE: usize = 32;

/// A storage element the CPU path can read and write.
pub(crate) trait Element: Copy + Send + Sync + 'static {
    const ZERO: Self;
    /// `src` converted to f32 into `dst`, of the same length.
    fn to_f32_slice(src: &[Self], dst: &mut [f32]);
    /// `src` as f32, either borrowed (f32 input) or converted into `buf`.
    #[inline]
    fn row_f32<'a>(src: &'a [Self], buf: &'a mut [f32]) -> &'a [f32] {
        Self::to_f32_slice(src, buf);
        buf
    }
    fn from_f32_slice(src: &[f32], dst: &mut [Self]);
}

impl Element for f32 {
    const ZERO: Self = 0.0;
    #[inline]
    fn to_f32_slice(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src)
    }
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
    fn to_f32_slice(src: &[f16], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst)
    }
    fn from_f32_slice(src: &[f32], dst: &mut [f16]) {
        dst.convert_from_f32_slice(src)
    }
}

impl Element for bf16 {
    const ZERO: Self = bf16::ZERO;
    #[inline]
    fn to_f32_slice(src: &[bf16], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst)
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
    fn to_f32_slice(src: &[F8E4M3], dst: &mut [f32]) {
        for (dst, &x) in dst.iter_mut().zip(src) {
            *dst = e4m3_to_f32(x.to_bits());
        }
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
    let plan = split_plan(call);
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
        window_right: call.window_right,
        softcap: call.softcap,
        poison_scratch: poisons_scratch(),
    };
    decode(&inputs, plan)
}

/// Whether the tests asked this thread to fill the split scratch with NaN (feature `test-hooks`).
fn poisons_scratch() -> bool {
    #[cfg(feature = "test-hooks")]
    return crate::test_hooks::poisoning();
    #[cfg(not(feature = "test-hooks"))]
    false
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
    /// A query sees this many positions after its own (0: causal).
    pub window_right: usize,
    /// Scores become `c·tanh(s/c)` with this c.
    pub softcap: Option<f32>,
    /// Fill the split scratch and the output with NaN before the passes run (test hook).
    pub poison_scratch: bool,
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

/// Query tokens per sequence up to which the decode pass runs; more run the tiled pass
/// ([`prefill`]). The decode pass computes each token's row exactly as a one-token call at its
/// position would, which verification of drafted tokens relies on (see
/// `CachedAttention::forward_as_steps`); it covers the tokens the attention layer verifies.
const DECODE_PASS_MAX_QUERY_TOKENS: usize = validate::MAX_QUERY_TOKENS;

/// Whether `q_len` query tokens per sequence run the tiled pass.
fn uses_tiled_pass(q_len: usize) -> bool {
    q_len > DECODE_PASS_MAX_QUERY_TOKENS
}

/// The split plan of a validated call on the CPU: the forced count clamped to the sequence, or
/// the heuristic's for the pass that runs it.
pub(crate) fn split_plan(call: &DecodeCall) -> SplitPlan {
    if uses_tiled_pass(call.dims.q_len) {
        prefill::split_plan(call, parallel_slots())
    } else {
        call.split_plan(parallel_slots(), MIN_CHUNK)
    }
}

/// Runs the op. Returns the output `(b, q_len, h_q, d)` contiguous in `T`, and the natural-log
/// LSE `(b, h_q, q_len)` in f32.
pub(crate) fn decode<T: Element, KV: Element>(
    inputs: &DecodeInputs<'_, T, KV>,
    plan: SplitPlan,
) -> (Vec<T>, Vec<f32>) {
    let dims = inputs.dims;
    let d = dims.head_dim;
    let rows = dims.q_len * dims.group_size(); // query rows of one (batch, kv head)
    let tasks = dims.batch * dims.kv_heads * plan.num_splits;

    // The partial passes write every element; the test hook's NaN would show one they miss.
    let fill = if inputs.poison_scratch { f32::NAN } else { 0.0 };
    let mut partial_out = vec![fill; tasks * rows * d];
    let mut partial_lse = vec![fill; tasks * rows];
    if uses_tiled_pass(dims.q_len) {
        prefill::attend(inputs, plan, &mut partial_out, &mut partial_lse);
    } else {
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
    }
    merge_splits(
        dims,
        plan.num_splits,
        (&partial_out, &partial_lse),
        inputs.poison_scratch,
    )
}

/// Merges the normalised partial rows and base-2 LSEs of every `(batch, kv head, split)`,
/// `q_len × group` rows each (row `i · group + m`: query token `i` of the group's head `m`),
/// into the output `(b, q_len, h_q, d)` in `T` and the natural-log LSE `(b, h_q, q_len)`.
fn merge_splits<T: Element>(
    dims: DecodeDims,
    num_splits: usize,
    (partial_out, partial_lse): (&[f32], &[f32]),
    poison: bool,
) -> (Vec<T>, Vec<f32>) {
    let group = dims.group_size();
    let d = dims.head_dim;
    let q_len = dims.q_len;
    let rows = q_len * group;
    // Output rows in (batch, token, q head) order.
    let fill = if poison { f32::NAN } else { 0.0 };
    let mut out = vec![fill; dims.batch * q_len * dims.q_heads * d];
    let mut row_lse = vec![fill; dims.batch * q_len * dims.q_heads];
    out.par_chunks_mut(d)
        .zip(row_lse.par_iter_mut())
        .enumerate()
        .for_each(|(row, (out, lse))| {
            let q_head = row % dims.q_heads;
            let token = (row / dims.q_heads) % q_len;
            let batch = row / (dims.q_heads * q_len);
            let (kv_head, member) = (q_head / group, q_head % group);
            let first_task = (batch * dims.kv_heads + kv_head) * num_splits;
            let splits = (0..num_splits).map(|s| {
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
    // Query token i is position seq_len − q_len + i and sees the keys before and at it (and
    // window_right after it), or with a window the last window_left + 1 up to it.
    let position_end = |row: usize| (seq_len + row / group + 1).saturating_sub(dims.q_len);
    let visible = |row: usize| {
        (seq_len + row / group + 1 + inputs.window_right)
            .saturating_sub(dims.q_len)
            .min(seq_len)
    };
    let first_seen = |row: usize| match inputs.window_left {
        Some(w) => position_end(row).saturating_sub(w + 1),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::op::validate::DecodeDims;

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
            window_right: 0,
            softcap: None,
            poison_scratch: false,
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
