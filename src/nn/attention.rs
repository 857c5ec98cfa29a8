//! Attention over a [`KvCache`], the drop-in piece for candle models, or over one layer of a
//! [`crate::PagedKvCache`].
//!
//! A model computes q, k and v, applies RoPE, and hands them to [`CachedAttention::forward`]
//! with an [`AttentionStep`] saying which cache they go to and where its positions live. The
//! new keys and values are written into the cache in place; then the split-KV op attends q over
//! the cache views, with no copy of the cache, whatever the step: a decode step, a few tokens
//! being verified, a prompt or a chunk of one, a batch of sequences of different lengths, a
//! paged batch. Token i of t sees the cache up to its own position (causal, aligned to the end
//! of the cache), so a chunk of a prompt attends over the chunks before it.
//!
//! The naive backend ([`AttentionBackend::Naive`]) runs candle's textbook attention over the
//! same cache, for A/B checks. A head dim the op does not take runs a blocked causal attention
//! in candle's ops.
//!
//! Every path reads the cache's stored K/V with its scales (real = stored × scale), so an fp8
//! cache attends to the same real values on all of them.

mod paged;
mod step;

use candle_core::{bail, DType, Result, Tensor};

use super::cache::KvCache;
use crate::op::SplitKvAttention;
use step::StepKv;
pub use step::{AttentionStep, DeviceLengths};

/// Which attention runs over the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttentionBackend {
    /// The split-KV op for every step; a head dim the op does not take runs a blocked causal
    /// attention that skips the masked half and shares K/V across each GQA group.
    #[default]
    SplitKv,
    /// Candle's naive attention (repeat K/V per query head, full score matrix, mask, softmax),
    /// for A/B checks. It still reads the same cache.
    Naive,
}

/// Query rows per block of the blocked causal attention (see
/// [`CachedAttention::with_prefill_block`]).
const DEFAULT_PREFILL_BLOCK: usize = 128;

/// How a step attends: decided for every step in one place, [`CachedAttention::route`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    /// The split-KV op over the cache views.
    Op,
    /// The reference paths in candle's ops: blocked causal for the split-KV backend, naive for
    /// the naive one.
    Reference,
}

/// Causal attention of new tokens over a [`KvCache`] or a layer of a
/// [`PagedKvCache`](crate::PagedKvCache), run by [`CachedAttention::forward`].
///
/// - q: `(batch, t, q_heads, head_dim)`, k and v: `(batch, t, kv_heads, head_dim)`, all after
///   RoPE. `q_heads` must be a multiple of `kv_heads`. k and v are stored in the cache's dtype,
///   which may be narrower than q's (an f16 cache halves the bytes a decode step reads, an fp8
///   one halves them again), with the cache's scales.
/// - output: `(batch, t, q_heads, head_dim)` in q's dtype.
///
/// Token `i` of sequence `s` sits at position `len_s − t + i`, `len_s` its length after the step,
/// and attends to every cached position up to and including its own, or with a sliding window
/// to the last `window_left` before it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CachedAttention {
    softmax_scale: f32,
    backend: AttentionBackend,
    prefill_block: usize,
    window_left: Option<usize>,
    softcap: Option<f32>,
}

impl CachedAttention {
    /// Attention with `softmax_scale` (the multiplier of q·k before the softmax, usually
    /// `1 / sqrt(head_dim)`), the split-KV backend, no window and no soft-capping.
    pub fn new(softmax_scale: f32) -> Self {
        Self {
            softmax_scale,
            backend: AttentionBackend::SplitKv,
            prefill_block: DEFAULT_PREFILL_BLOCK,
            window_left: None,
            softcap: None,
        }
    }

    /// Picks the attention that runs over the cache (see [`AttentionBackend`]).
    pub fn with_backend(mut self, backend: AttentionBackend) -> Self {
        self.backend = backend;
        self
    }

    /// Sliding window: a token at position p sees positions p − `window_left` ..= p only (see
    /// [`SplitKvAttention::with_window_left`]); every path applies it.
    pub fn with_window_left(mut self, window_left: Option<usize>) -> Self {
        self.window_left = window_left;
        self
    }

    /// Scores (after the softmax scale) soft-capped as c·tanh(s/c) before the softmax (see
    /// [`SplitKvAttention::with_softcap`]); every path applies it.
    pub fn with_softcap(mut self, softcap: Option<f32>) -> Self {
        self.softcap = softcap;
        self
    }

    /// Query rows per block of the blocked causal attention (128 by default, at least 1): large
    /// enough for efficient matmuls, small enough that the diagonal block, half of it masked,
    /// is a small share of the work.
    pub fn with_prefill_block(mut self, rows: usize) -> Self {
        self.prefill_block = rows;
        self
    }

    /// The attention that runs over the cache.
    pub fn backend(&self) -> AttentionBackend {
        self.backend
    }

    /// Writes k and v into the cache `step` names, then attends q over it (see the type's docs
    /// and [`AttentionStep`]).
    pub fn forward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        step: AttentionStep<'_>,
    ) -> Result<Tensor> {
        let AttentionStep {
            kv,
            lse: lse_slot,
            as_decode_steps,
        } = step;
        let want_lse = lse_slot.is_some();
        let (out, lse) = match kv {
            StepKv::Host(cache) => self.forward_host(q, k, v, cache, want_lse, as_decode_steps)?,
            StepKv::Device(cache, lengths) => {
                self.forward_device(q, k, v, cache, lengths, want_lse)?
            }
            StepKv::Paged { cache, layer, step } => {
                self.forward_paged(q, k, v, (cache, layer, step), want_lse)?
            }
            StepKv::Mixed { cache, layer, step } => {
                if want_lse {
                    bail!(
                        "cached attention: the LSE of a mixed paged step is not implemented; \
                         ask for it on uniform steps (AttentionStep::paged)"
                    )
                }
                (self.forward_mixed(q, k, v, (cache, layer, step))?, None)
            }
        };
        if let Some(slot) = lse_slot {
            *slot = lse;
        }
        Ok(out)
    }

    /// The one place that decides how a step attends: the op for the split-KV backend over a
    /// head dim and query it takes (any number of tokens, except f32 queries on CUDA, whose
    /// kernels take a few), the reference paths otherwise.
    fn route(&self, q: &Tensor, kv_dtype: DType) -> Result<Route> {
        let (_, t, _, head_dim) = q.dims4()?;
        let op_dtype = op_query_dtype(q, kv_dtype);
        let op_takes = crate::op::validate::SUPPORTED_HEAD_DIMS.contains(&head_dim)
            && crate::op::takes_query_tokens(t, q.device(), op_dtype);
        Ok(if self.backend == AttentionBackend::SplitKv && op_takes {
            Route::Op
        } else {
            Route::Reference
        })
    }

    /// A step after the cache's host-counted lengths.
    fn forward_host(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        cache: &mut KvCache,
        want_lse: bool,
        as_decode_steps: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let (batch, t, _, _) = self.check_inputs(q, k, v, cache)?;
        // The cache stores k and v in its own dtype (e.g. f16 under f32, or scaled fp8).
        let scales = KvScales::of(cache);
        let uniform = cache.is_uniform();
        if self.route(q, cache.dtype())? == Route::Op {
            let past = cache.len();
            let (k_all, v_all) = cache.append(k, v)?;
            if !uniform {
                // Sequences of different lengths: one call, each masked to its own length.
                let op = self.op(scales).with_seqlens(cache.seq_lens_tensor()?);
                return run_op(&op, q, &k_all, &v_all, want_lse);
            }
            if as_decode_steps && t > 1 && q.device().is_cpu() {
                return self.split_kv_as_steps(q, &k_all, &v_all, past, scales, want_lse);
            }
            return run_op(&self.op(scales), q, &k_all, &v_all, want_lse);
        }
        if uniform {
            let past = cache.len();
            let (k_all, v_all) = cache.append(k, v)?;
            return Ok((self.reference(q, &k_all, &v_all, past, scales)?, None));
        }
        // Sequence by sequence, each over its own cached prefix.
        let outs = (0..batch)
            .map(|seq| {
                let past = cache.seq_lens()[seq];
                let (k_all, v_all) =
                    cache.append_to(seq, &k.narrow(0, seq, 1)?, &v.narrow(0, seq, 1)?)?;
                self.reference(&q.narrow(0, seq, 1)?, &k_all, &v_all, past, scales)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((Tensor::cat(&outs, 0)?, None))
    }

    /// A step at lengths held in device memory (see [`AttentionStep::at`]).
    fn forward_device(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        cache: &mut KvCache,
        lengths: &DeviceLengths,
        want_lse: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        self.check_inputs(q, k, v, cache)?;
        self.check_device_route(q, cache)?;
        let (k_all, v_all) = cache.append_at(k, v, &lengths.before)?;
        let op = self
            .op(KvScales::of(cache))
            .with_seqlens(lengths.after.clone());
        run_op(&op, q, &k_all, &v_all, want_lse)
    }

    /// Attends `q` `(batch, t, q_heads, head_dim)` over `cache`, whose keys and values for the
    /// step are already stored at `lengths.before` (by a kernel that computed and appended
    /// them, see [`KvCache::append_in_place`]); `k_all` and `v_all` are its views over the
    /// capacity. What [`AttentionStep::at`] runs after its append.
    #[cfg(all(feature = "cuda", feature = "models"))]
    pub(crate) fn forward_appended(
        &self,
        q: &Tensor,
        (k_all, v_all): (&Tensor, &Tensor),
        cache: &KvCache,
        lengths: &DeviceLengths,
    ) -> Result<Tensor> {
        self.check_settings()?;
        self.check_device_route(q, cache)?;
        let op = self
            .op(KvScales::of(cache))
            .with_seqlens(lengths.after.clone());
        Ok(run_op(&op, q, k_all, v_all, false)?.0)
    }

    /// Refuses a step at device lengths that the op would not run.
    fn check_device_route(&self, q: &Tensor, cache: &KvCache) -> Result<()> {
        if self.route(q, cache.dtype())? == Route::Op {
            return Ok(());
        }
        let (_, t, _, head_dim) = q.dims4()?;
        bail!(
            "cached attention: a step at device lengths needs the split-KV backend, a head dim \
             in {:?} and a token count the op takes; got {:?}, head dim {head_dim}, {t} tokens",
            crate::SUPPORTED_HEAD_DIMS,
            self.backend
        )
    }

    /// Checks q, k and v against each other and the cache; returns q's dims.
    fn check_inputs(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        cache: &KvCache,
    ) -> Result<(usize, usize, usize, usize)> {
        let (batch, t, q_heads, head_dim) = q.dims4().map_err(|_| {
            candle_core::Error::Msg(format!(
                "cached attention: q must be (batch, t, q_heads, head_dim), got {:?}",
                q.dims()
            ))
        })?;
        if t == 0 {
            bail!("cached attention: q has no tokens (shape {:?})", q.dims())
        }
        if k.dims4()? != (batch, t, cache.kv_heads(), head_dim) || k.dims() != v.dims() {
            bail!(
                "cached attention: k and v must be (batch, t, kv_heads, head_dim) = ({batch}, {t}, {}, \
                 {head_dim}) to match q {:?} and the cache, got k {:?} and v {:?}",
                cache.kv_heads(),
                q.dims(),
                k.dims(),
                v.dims()
            )
        }
        if q_heads % cache.kv_heads() != 0 {
            bail!(
                "cached attention: q_heads ({q_heads}) must be a multiple of kv_heads ({})",
                cache.kv_heads()
            )
        }
        if batch != cache.batch() {
            bail!(
                "cached attention: q has batch {batch}, the cache holds {} sequences",
                cache.batch()
            )
        }
        self.check_settings()?;
        Ok((batch, t, q_heads, head_dim))
    }

    /// Checks the settings every path applies.
    fn check_settings(&self) -> Result<()> {
        if self.prefill_block == 0 {
            bail!("cached attention: prefill_block must be at least 1")
        }
        if self.window_left == Some(0) {
            bail!(
                "cached attention: window_left must be at least 1 (a model's sliding window \
                 holds the token and the ones before it); use None for no window"
            )
        }
        crate::op::validate::check_softcap(self.softcap)
    }

    /// The split-KV op over q's t tokens `(b, t, h_q, d)` after `past` cached positions, in
    /// groups of tokens that one-token steps would split the cache for alike.
    fn split_kv_as_steps(
        &self,
        q: &Tensor,
        k_all: &Tensor,
        v_all: &Tensor,
        past: usize,
        scales: KvScales,
        want_lse: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let t = q.dim(1)?;
        let q_cache = op_query(q, k_all.dtype())?;
        let op = self.op(scales);
        // The cut a step for token i would make: none (one split), or chunks of this length.
        let cuts = (0..t)
            .map(|i| {
                let plan = op.split_plan(
                    &q_cache.narrow(1, i, 1)?,
                    &k_all.narrow(1, 0, past + i + 1)?,
                )?;
                Ok((plan.num_splits > 1).then_some(plan.chunk_size))
            })
            .collect::<Result<Vec<_>>>()?;
        let (mut outs, mut lses) = (Vec::with_capacity(2), Vec::with_capacity(2));
        let mut start = 0;
        while start < t {
            let end = (start..t).find(|&i| cuts[i] != cuts[start]).unwrap_or(t);
            let len = past + end;
            let q_group = q.narrow(1, start, end - start)?.contiguous()?;
            let (out, lse) = run_op(
                &op,
                &q_group,
                &k_all.narrow(1, 0, len)?,
                &v_all.narrow(1, 0, len)?,
                want_lse,
            )?;
            outs.push(out);
            lses.extend(lse);
            start = end;
        }
        let lse = if want_lse {
            Some(Tensor::cat(&lses, 2)?)
        } else {
            None
        };
        Ok((Tensor::cat(&outs, 1)?, lse))
    }

    /// The split-KV op over K/V stored with `scales`.
    fn op(&self, scales: KvScales) -> SplitKvAttention {
        SplitKvAttention::new(self.softmax_scale)
            .with_kv_scales(scales.k, scales.v)
            .with_window_left(self.window_left)
            .with_softcap(self.softcap)
    }

    /// What the reference paths mask and cap besides causality.
    fn score_mods(&self) -> ScoreMods {
        ScoreMods {
            window_left: self.window_left,
            softcap: self.softcap,
        }
    }

    /// The reference path of the backend: q `(b, t, h_q, d)` over all of `k_all`/`v_all`
    /// `(b, past + t, h_kv, d)`, stored with `scales`, causally.
    fn reference(
        &self,
        q: &Tensor,
        k_all: &Tensor,
        v_all: &Tensor,
        past: usize,
        scales: KvScales,
    ) -> Result<Tensor> {
        let scale = (self.softmax_scale, scales);
        match self.backend {
            AttentionBackend::SplitKv => blocked_causal(
                q,
                k_all,
                v_all,
                past,
                scale,
                self.score_mods(),
                self.prefill_block,
            ),
            AttentionBackend::Naive => naive(q, k_all, v_all, past, scale, self.score_mods()),
        }
    }
}

/// Runs `op` over q (cast for K/V's dtype), k and v; returns the output in q's dtype and, when
/// wanted, the LSE. The op accumulates in f32 whatever the dtype.
fn run_op(
    op: &SplitKvAttention,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    want_lse: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let q_op = op_query(q, k.dtype())?;
    let (out, lse) = if want_lse {
        let (out, lse) = op.forward_with_lse(&q_op, k, v)?;
        (out, Some(lse))
    } else {
        (op.forward(&q_op, k, v)?, None)
    };
    Ok((out.to_dtype(q.dtype())?, lse))
}

/// A sliding window and soft-capping, as the prompt paths apply them to their score matrices.
#[derive(Debug, Clone, Copy, PartialEq)]
struct ScoreMods {
    window_left: Option<usize>,
    softcap: Option<f32>,
}

impl ScoreMods {
    /// The first key position the query at `position` sees.
    fn first_seen(&self, position: usize) -> usize {
        self.window_left
            .map_or(0, |window| position.saturating_sub(window))
    }

    /// Scores soft-capped as c·tanh(s/c), or as they are.
    fn cap(&self, scores: Tensor) -> Result<Tensor> {
        match self.softcap {
            Some(c) => (scores / f64::from(c))?.tanh()? * f64::from(c),
            None => Ok(scores),
        }
    }

    /// A u8 `(rows, cols)` mask, nonzero where the query at position `first_row + i` does not
    /// see the key at `first_col + j`: the key comes after it, or before its window. Built on
    /// the device from one value per row.
    fn hidden(
        &self,
        (first_row, rows): (usize, usize),
        (first_col, cols): (usize, usize),
        device: &candle_core::Device,
    ) -> Result<Tensor> {
        let col = Tensor::arange(first_col as u32, (first_col + cols) as u32, device)?
            .reshape((1, cols))?;
        let first_after = Tensor::arange(
            (first_row + 1) as u32,
            (first_row + rows + 1) as u32,
            device,
        )?
        .reshape((rows, 1))?;
        let after = col.broadcast_ge(&first_after)?;
        if self.window_left.is_none() {
            return Ok(after);
        }
        let first_seen: Vec<u32> = (first_row..first_row + rows)
            .map(|row| self.first_seen(row) as u32)
            .collect();
        let first_seen = Tensor::from_vec(first_seen, (rows, 1), device)?;
        after.add(&col.broadcast_lt(&first_seen)?)
    }
}

/// The per-tensor scales of a cache's stored K/V: real = stored × scale.
#[derive(Debug, Clone, Copy, PartialEq)]
struct KvScales {
    k: f32,
    v: f32,
}

impl KvScales {
    fn of(cache: &KvCache) -> Self {
        Self {
            k: cache.k_scale(),
            v: cache.v_scale(),
        }
    }
}

/// q as the op takes it over K/V stored in `kv_dtype`: in that dtype, except over fp8 K/V,
/// which the op reads under q as it is (f32, f16 or bf16), or under an f16 q on CUDA, whose
/// fp8 kernels multiply in f16 whatever q is.
/// The dtype [`op_query`] gives q.
fn op_query_dtype(q: &Tensor, kv_dtype: DType) -> DType {
    match kv_dtype {
        DType::F8E4M3 if q.dtype() == DType::F32 && q.device().is_cuda() => DType::F16,
        DType::F8E4M3 => q.dtype(),
        kv => kv,
    }
}

fn op_query(q: &Tensor, kv_dtype: DType) -> Result<Tensor> {
    match kv_dtype {
        DType::F8E4M3 if q.dtype() == DType::F32 && q.device().is_cuda() => q.to_dtype(DType::F16),
        DType::F8E4M3 => Ok(q.clone()),
        _ => q.to_dtype(kv_dtype),
    }
}

/// Stored keys or values as f32, unscaled: fp8 through the crate's conversion, which, unlike
/// candle's cast, also runs on CUDA.
fn stored_f32(x: &Tensor) -> Result<Tensor> {
    if x.dtype() == DType::F8E4M3 {
        crate::fp8::dequantize_e4m3(x, 1.0, DType::F32)
    } else {
        x.to_dtype(DType::F32)
    }
}

/// `x · scale` (f32), skipped when the scale is 1.
fn scaled(x: Tensor, scale: f32) -> Result<Tensor> {
    if scale == 1.0 {
        Ok(x)
    } else {
        x.affine(f64::from(scale), 0.0)
    }
}

/// Causal attention in blocks of query rows. Block `[s, s + n)` scores only the keys it can see,
/// `[0, past + s + n)` (from its first row's window on, with a window), so the masked upper
/// triangle beyond the diagonal block is never computed.
/// The query heads of a GQA group are stacked as rows of one matmul against their shared K/V,
/// so K/V are never repeated per head. Computes in f32.
///
/// The stored K/V are cast to f32; their scales fold into q (scores are linear in k) and into
/// the output (a weighted sum of v), which costs less than scaling every cached row.
fn blocked_causal(
    q: &Tensor,
    k_all: &Tensor,
    v_all: &Tensor,
    past: usize,
    (scale, kv_scales): (f32, KvScales),
    mods: ScoreMods,
    block: usize,
) -> Result<Tensor> {
    let (b, t, q_heads, d) = q.dims4()?;
    let out_dtype = q.dtype();
    let kv_heads = k_all.dim(2)?;
    let group = q_heads / kv_heads;
    // (b, kv_heads, t, group, d): rows of a block are (position, group member).
    let q = (q.to_dtype(DType::F32)? * (f64::from(scale) * f64::from(kv_scales.k)))?
        .reshape((b, t, kv_heads, group, d))?
        .transpose(1, 2)?
        .contiguous()?;
    // Head-major views of the cache; `to_dtype` copies only when the cache is not f32.
    let k = stored_f32(&k_all.transpose(1, 2)?)?;
    let v = stored_f32(&v_all.transpose(1, 2)?)?;
    let device = q.device();
    let neg_inf = Tensor::new(f32::NEG_INFINITY, device)?;

    let mut outs = Vec::with_capacity(t.div_ceil(block));
    for start in (0..t).step_by(block) {
        let n = block.min(t - start);
        let first_row = past + start;
        // Keys before the window of the block's first row are seen by none of its rows.
        let first_col = mods.first_seen(first_row);
        let cols = first_row + n - first_col;
        let q_block = q
            .narrow(2, start, n)?
            .reshape((b, kv_heads, n * group, d))?;
        let k_block = k.narrow(2, first_col, cols)?;
        let v_block = v.narrow(2, first_col, cols)?;
        let scores = mods
            .cap(q_block.matmul(&k_block.t()?)?)?
            .reshape((b, kv_heads, n, group, cols))?;
        let hidden = mods
            .hidden((first_row, n), (first_col, cols), device)?
            .reshape((n, 1, cols))?;
        let scores = hidden
            .broadcast_as(scores.shape())?
            .where_cond(&neg_inf.broadcast_as(scores.shape())?, &scores)?;
        let probs = candle_nn::ops::softmax_last_dim(&scores)?;
        let out = probs
            .reshape((b, kv_heads, n * group, cols))?
            .matmul(&v_block)?
            .reshape((b, kv_heads, n, group, d))?;
        outs.push(out);
    }
    let out = Tensor::cat(&outs, 2)?
        .transpose(1, 2)?
        .reshape((b, t, q_heads, d))?;
    scaled(out, kv_scales.v)?.to_dtype(out_dtype)
}

/// `(b, kv_heads, L, d)` with each head repeated `group` times in place: `(b, kv_heads · group, L, d)`.
fn repeat_kv(x: &Tensor, group: usize) -> Result<Tensor> {
    if group == 1 {
        return Ok(x.clone());
    }
    let (b, kv_heads, len, d) = x.dims4()?;
    x.unsqueeze(2)?
        .broadcast_as((b, kv_heads, group, len, d))?
        .reshape((b, kv_heads * group, len, d))
}

/// Candle's naive attention: K/V repeated per query head, full `(t, past + t)` scores, causal mask
/// when `t > 1` (and the window's, with one), softmax, in f32. The K/V scales fold into the scores
/// and the output, as in [`blocked_causal`].
fn naive(
    q: &Tensor,
    k_all: &Tensor,
    v_all: &Tensor,
    past: usize,
    (scale, kv_scales): (f32, KvScales),
    mods: ScoreMods,
) -> Result<Tensor> {
    let (b, t, q_heads, d) = q.dims4()?;
    let out_dtype = q.dtype();
    let kv_len = k_all.dim(1)?;
    let group = q_heads / k_all.dim(2)?;
    let q = q.transpose(1, 2)?.to_dtype(DType::F32)?.contiguous()?;
    let k = repeat_kv(&stored_f32(&k_all.transpose(1, 2)?)?, group)?;
    let v = repeat_kv(&stored_f32(&v_all.transpose(1, 2)?)?, group)?.contiguous()?;
    let scores = mods.cap((q.matmul(&k.t()?)? * (f64::from(scale) * f64::from(kv_scales.k)))?)?;
    let scores = if t > 1 || mods.window_left.is_some() {
        let hidden = mods
            .hidden((past, t), (0, kv_len), q.device())?
            .broadcast_as(scores.shape())?;
        let neg_inf = Tensor::new(f32::NEG_INFINITY, q.device())?.broadcast_as(scores.shape())?;
        hidden.where_cond(&neg_inf, &scores)?
    } else {
        scores
    };
    let probs = candle_nn::ops::softmax_last_dim(&scores)?;
    let out = probs
        .matmul(&v)?
        .transpose(1, 2)?
        .reshape((b, t, q_heads, d))?;
    scaled(out, kv_scales.v)?.to_dtype(out_dtype)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::cache::KvCacheConfig;
    use candle_core::Device;

    fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
        (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
    }

    fn cache(batch: usize, kv_heads: usize, d: usize) -> Result<KvCache> {
        KvCache::new(&KvCacheConfig {
            batch,
            kv_heads,
            head_dim: d,
            initial_capacity: 8,
            max_capacity: 1024,
            dtype: DType::F32,
            device: Device::Cpu,
            k_scale: 1.0,
            v_scale: 1.0,
        })
    }

    /// Plain per-query-head causal attention, computed one query row at a time.
    fn reference(q: &Tensor, k: &Tensor, v: &Tensor, scale: f32) -> Result<Tensor> {
        let (b, t, h_q, d) = q.dims4()?;
        let h_kv = k.dim(2)?;
        let past = k.dim(1)? - t;
        let mut rows = Vec::new();
        for bi in 0..b {
            for i in 0..t {
                for h in 0..h_q {
                    let g = h / (h_q / h_kv);
                    let qv = q.get(bi)?.get(i)?.get(h)?; // (d,)
                    let keys = k
                        .get(bi)?
                        .narrow(0, 0, past + i + 1)?
                        .narrow(1, g, 1)?
                        .squeeze(1)?;
                    let vals = v
                        .get(bi)?
                        .narrow(0, 0, past + i + 1)?
                        .narrow(1, g, 1)?
                        .squeeze(1)?;
                    let s = (keys.matmul(&qv.unsqueeze(1)?)?.squeeze(1)? * f64::from(scale))?;
                    let p = candle_nn::ops::softmax_last_dim(&s.unsqueeze(0)?)?;
                    rows.push(p.matmul(&vals)?.squeeze(0)?);
                }
            }
        }
        Tensor::stack(&rows, 0)?.reshape((b, t, h_q, d))
    }

    fn run(backend: AttentionBackend, block: usize) -> Result<()> {
        let dev = Device::Cpu;
        let (b, h_q, h_kv, d) = (2, 6, 2, 64);
        let scale = 1.0 / 8.0;
        let mut cache = cache(b, h_kv, d)?;
        let attn = CachedAttention {
            prefill_block: block,
            ..CachedAttention::new(scale).with_backend(backend)
        };
        let mut all_k = Vec::new();
        let mut all_v = Vec::new();
        // A prompt, a second prompt chunk on top of it, then two decode steps.
        for t in [13, 7, 1, 1] {
            let q = Tensor::randn(0f32, 1.0, (b, t, h_q, d), &dev)?;
            let k = Tensor::randn(0f32, 1.0, (b, t, h_kv, d), &dev)?;
            let v = Tensor::randn(0f32, 1.0, (b, t, h_kv, d), &dev)?;
            all_k.push(k.clone());
            all_v.push(v.clone());
            let out = attn.forward(&q, &k, &v, AttentionStep::new(&mut cache))?;
            let expected = reference(
                &q,
                &Tensor::cat(&all_k, 1)?,
                &Tensor::cat(&all_v, 1)?,
                scale,
            )?;
            assert_eq!(out.dims(), [b, t, h_q, d]);
            let diff = max_abs_diff(&out, &expected)?;
            assert!(diff < 1e-5, "{backend:?} block {block} t {t}: diff {diff}");
        }
        Ok(())
    }

    /// Steps fed from lengths in device memory (here the CPU's) append where the cache ends and
    /// attend over the capacity masked to the new lengths: the reference's result.
    #[test]
    fn forward_at_matches_reference() -> Result<()> {
        let dev = Device::Cpu;
        let (b, h_q, h_kv, d) = (2, 6, 2, 64);
        let scale = 1.0 / 8.0;
        let mut cache = cache(b, h_kv, d)?;
        let attn = CachedAttention::new(scale);
        let (mut all_k, mut all_v) = (Vec::new(), Vec::new());
        for t in [9, 1, 1, 2, 1] {
            let q = Tensor::randn(0f32, 1.0, (b, t, h_q, d), &dev)?;
            let k = Tensor::randn(0f32, 1.0, (b, t, h_kv, d), &dev)?;
            let v = Tensor::randn(0f32, 1.0, (b, t, h_kv, d), &dev)?;
            all_k.push(k.clone());
            all_v.push(v.clone());
            let len = cache.len() as u32;
            let lengths = DeviceLengths {
                before: Tensor::new(&[len, len], &dev)?,
                after: Tensor::new(&[len + t as u32, len + t as u32], &dev)?,
            };
            let out = attn.forward(&q, &k, &v, AttentionStep::at(&mut cache, &lengths))?;
            let expected = reference(
                &q,
                &Tensor::cat(&all_k, 1)?,
                &Tensor::cat(&all_v, 1)?,
                scale,
            )?;
            let diff = max_abs_diff(&out, &expected)?;
            assert!(diff < 1e-5, "t {t}: diff {diff}");
        }
        // Lengths that are not the cache's are refused where they can be read.
        let x = Tensor::zeros((b, 1, h_kv, d), DType::F32, &dev)?;
        let q = Tensor::zeros((b, 1, h_q, d), DType::F32, &dev)?;
        let wrong = DeviceLengths {
            before: Tensor::new(&[0u32, 0], &dev)?,
            after: Tensor::new(&[1u32, 1], &dev)?,
        };
        let err = attn
            .forward(&q, &x, &x, AttentionStep::at(&mut cache, &wrong))
            .unwrap_err();
        assert!(
            err.to_string().contains("differ from the cached lengths"),
            "{err}"
        );
        let naive = attn.with_backend(AttentionBackend::Naive);
        let err = naive
            .forward(&q, &x, &x, AttentionStep::at(&mut cache, &wrong))
            .unwrap_err();
        assert!(err.to_string().contains("split-KV backend"), "{err}");
        Ok(())
    }

    #[test]
    fn split_kv_backend_matches_reference_across_block_sizes() -> Result<()> {
        for block in [1, 4, 13, 256] {
            run(AttentionBackend::SplitKv, block)?;
        }
        Ok(())
    }

    #[test]
    fn naive_backend_matches_reference() -> Result<()> {
        run(AttentionBackend::Naive, DEFAULT_PREFILL_BLOCK)
    }

    /// An fp8 cache with the given scales, otherwise like [`cache`].
    fn fp8_cache(batch: usize, kv_heads: usize, d: usize, scales: (f32, f32)) -> Result<KvCache> {
        KvCache::new(
            &KvCacheConfig {
                dtype: DType::F8E4M3,
                ..cache(batch, kv_heads, d)?.config()
            }
            .with_kv_scales(scales.0, scales.1),
        )
    }

    /// Over an fp8 cache with scales other than 1, every path (blocked causal prefill on top of
    /// cached positions, the op for a few tokens and a step, naive, as steps) attends to the real
    /// values: the stored ones times the scales.
    fn run_fp8(backend: AttentionBackend, as_steps: bool) -> Result<()> {
        let dev = Device::Cpu;
        let (b, h_q, h_kv, d) = (2, 6, 2, 64);
        let scale = 0.125;
        let (k_scale, v_scale) = (0.05, 0.02);
        let mut cache = fp8_cache(b, h_kv, d, (k_scale, v_scale))?;
        let attn = CachedAttention {
            prefill_block: 8,
            ..CachedAttention::new(scale).with_backend(backend)
        };
        // Past the op's 16 query tokens, a second such chunk, a few tokens, one step.
        for t in [21, 18, 3, 1] {
            let q = Tensor::randn(0f32, 1.0, (b, t, h_q, d), &dev)?;
            let k = Tensor::randn(0f32, 4.0, (b, t, h_kv, d), &dev)?;
            let v = Tensor::randn(0f32, 2.0, (b, t, h_kv, d), &dev)?;
            let out = if as_steps {
                attn.forward(&q, &k, &v, AttentionStep::new(&mut cache).as_decode_steps())?
            } else {
                attn.forward(&q, &k, &v, AttentionStep::new(&mut cache))?
            };
            let (k_all, v_all) = cache.views()?;
            assert_eq!(k_all.dtype(), DType::F8E4M3);
            let real = |x: &Tensor, s: f32| x.to_dtype(DType::F32)? * f64::from(s);
            let expected = reference(&q, &real(&k_all, k_scale)?, &real(&v_all, v_scale)?, scale)?;
            // f32 rounding of outputs a few units large; a misapplied scale moves them by ~1.
            let diff = max_abs_diff(&out, &expected)?;
            assert!(
                diff < 5e-5,
                "{backend:?} as steps {as_steps} t {t}: diff {diff}"
            );
        }
        Ok(())
    }

    #[test]
    fn fp8_cache_is_read_as_the_real_values_on_every_path() -> Result<()> {
        run_fp8(AttentionBackend::SplitKv, false)?;
        run_fp8(AttentionBackend::SplitKv, true)?;
        run_fp8(AttentionBackend::Naive, false)
    }

    #[test]
    fn ragged_batch_attends_each_sequence_over_its_own_length() -> Result<()> {
        ragged_batch(&|batch| cache(batch, 2, 64))?;
        ragged_batch(&|batch| fp8_cache(batch, 2, 64, (0.05, 0.02)))
    }

    /// Ragged decode (one op call, each sequence masked to its length) against each sequence
    /// alone, over caches from `new_cache(batch)`.
    fn ragged_batch(new_cache: &dyn Fn(usize) -> Result<KvCache>) -> Result<()> {
        let dev = Device::Cpu;
        let (h_q, h_kv, d) = (4, 2, 64);
        let scale = 0.125;
        for backend in [AttentionBackend::SplitKv, AttentionBackend::Naive] {
            let attn = CachedAttention::new(scale).with_backend(backend);
            let mut batched = new_cache(2)?;
            let mut singles = [new_cache(1)?, new_cache(1)?];
            // Prompts of 5 and 9 tokens, one sequence at a time.
            for (seq, len) in [(0, 5), (1, 9)] {
                let k = Tensor::randn(0f32, 1.0, (1, len, h_kv, d), &dev)?;
                let v = Tensor::randn(0f32, 1.0, (1, len, h_kv, d), &dev)?;
                batched.append_to(seq, &k, &v)?;
                singles[seq].append(&k, &v)?;
            }
            for t in [1, 3] {
                let q = Tensor::randn(0f32, 1.0, (2, t, h_q, d), &dev)?;
                let k = Tensor::randn(0f32, 1.0, (2, t, h_kv, d), &dev)?;
                let v = Tensor::randn(0f32, 1.0, (2, t, h_kv, d), &dev)?;
                let out = attn.forward(&q, &k, &v, AttentionStep::new(&mut batched))?;
                for (seq, single) in singles.iter_mut().enumerate() {
                    let one = |x: &Tensor| x.narrow(0, seq, 1);
                    let expected =
                        attn.forward(&one(&q)?, &one(&k)?, &one(&v)?, AttentionStep::new(single))?;
                    let diff = max_abs_diff(&one(&out)?, &expected)?;
                    assert!(diff < 1e-6, "{backend:?} t {t} seq {seq}: diff {diff}");
                }
            }
            assert_eq!(batched.seq_lens(), [9, 13]);
        }
        Ok(())
    }

    #[test]
    fn an_f16_cache_under_f32_activations_stays_close() -> Result<()> {
        let dev = Device::Cpu;
        let mut narrow = KvCache::new(&KvCacheConfig {
            dtype: DType::F16,
            ..cache(1, 2, 64)?.config()
        })?;
        let mut wide = cache(1, 2, 64)?;
        let attn = CachedAttention::new(0.125);
        for t in [9, 1, 1] {
            let q = Tensor::randn(0f32, 1.0, (1, t, 4, 64), &dev)?;
            let k = Tensor::randn(0f32, 1.0, (1, t, 2, 64), &dev)?;
            let v = Tensor::randn(0f32, 1.0, (1, t, 2, 64), &dev)?;
            let out = attn.forward(&q, &k, &v, AttentionStep::new(&mut narrow))?;
            assert_eq!(out.dtype(), DType::F32);
            let expected = attn.forward(&q, &k, &v, AttentionStep::new(&mut wide))?;
            let diff = max_abs_diff(&out, &expected)?;
            assert!(diff < 5e-3, "t {t}: diff {diff}");
        }
        Ok(())
    }

    #[test]
    fn rejects_mismatched_shapes() -> Result<()> {
        let dev = Device::Cpu;
        let mut cache = cache(1, 2, 64)?;
        let q = Tensor::zeros((1, 3, 4, 64), DType::F32, &dev)?;
        let k = Tensor::zeros((1, 2, 2, 64), DType::F32, &dev)?;
        let err = CachedAttention::new(0.1)
            .forward(&q, &k, &k, AttentionStep::new(&mut cache))
            .unwrap_err();
        assert!(
            err.to_string().contains("(batch, t, kv_heads, head_dim)"),
            "{err}"
        );
        let q = Tensor::zeros((1, 2, 3, 64), DType::F32, &dev)?;
        assert!(CachedAttention::new(0.1)
            .forward(&q, &k, &k, AttentionStep::new(&mut cache))
            .is_err());
        assert!(cache.is_empty());
        Ok(())
    }
}
