//! `SplitKvAttention`: the decode op as a candle `CustomOp3` (q, k, v → out).
//!
//! The op validates its inputs, describes the call to a backend ([`call::DecodeCall`]) and hands
//! the LSE back to a caller that asked for it. The CPU backend lives here; the CUDA one in
//! `crate::cuda`.

pub(crate) mod call;
pub(crate) mod cpu;
mod merge;
pub(crate) mod page_divisor;
pub(crate) mod plan;
pub(crate) mod validate;

use std::sync::{Arc, Mutex};

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp3, DType, Device, Layout, Result, Shape, Tensor};

pub use call::CudaKernel;
use call::DecodeCall;
use plan::SplitPlan;

/// Where a call that asked for the LSE finds it once the op has run.
type LseSlot = Arc<Mutex<Option<Tensor>>>;

/// Split-KV attention of the last t positions of each sequence over their K/V: a decode step
/// (t = 1), a verification pass of drafted tokens, or a prefill chunk.
///
/// - q: `(batch, t, q_heads, head_dim)`, t ≥ 1: the last t positions of each sequence, query
///   token i seeing the keys up to position `len − t + i` (causal, aligned to the end of the
///   cache; [`SplitKvAttention::with_window_right`] moves or lifts that bound); a token that
///   sees no key gets zeros and an LSE of −inf. On the CPU, past a few
///   tokens a tiled prefill pass runs. On CUDA, calls of up to
///   [`MAX_QUERY_TOKENS`](crate::MAX_QUERY_TOKENS) tokens run the decode kernels, where the t
///   tokens of a sequence share one pass over its K/V; longer calls (a prefill, a chunk of one)
///   and calls with many query rows per kv head run the causal prefill kernels, which take
///   f16/bf16 q.
/// - k, v: `(batch, kv_len, kv_heads, head_dim)`; only the last dim must be contiguous. Both in
///   q's dtype, or both fp8 (`F8E4M3`) with [`SplitKvAttention::with_kv_scales`] giving the
///   real values; on CUDA fp8 takes an f16 or bf16 q and a build for compute capability 89 or
///   later.
/// - output: the shape and dtype of q.
///
/// `q_heads` must be a multiple of `kv_heads` (grouped-query attention with any group size).
///
/// Built with [`SplitKvAttention::new`] and the `with_*` methods, run with
/// [`SplitKvAttention::forward`] or [`SplitKvAttention::forward_with_lse`].
#[derive(Debug, Clone)]
pub struct SplitKvAttention {
    softmax_scale: f32,
    num_splits: Option<usize>,
    seqlens_k: Option<Tensor>,
    cuda_kernel: CudaKernel,
    k_scale: f32,
    v_scale: f32,
    window_left: Option<usize>,
    window_right: Option<usize>,
    softcap: Option<f32>,
    block_table: Option<Tensor>,
    lse_slot: Option<LseSlot>,
}

impl SplitKvAttention {
    /// The op with `softmax_scale` (the multiplier of q·k before the softmax, usually
    /// `1 / sqrt(head_dim)`), the heuristic split count, no per-sequence lengths, K/V as stored
    /// (scales of 1), the causal mask, no window and no soft-capping.
    pub fn new(softmax_scale: f32) -> Self {
        Self {
            softmax_scale,
            num_splits: None,
            seqlens_k: None,
            cuda_kernel: CudaKernel::Auto,
            k_scale: 1.0,
            v_scale: 1.0,
            window_left: None,
            window_right: Some(0),
            softcap: None,
            block_table: None,
            lse_slot: None,
        }
    }

    /// `Some(n)`: forces n splits (clamped to one position per split at least). `None`: the
    /// split heuristic decides from the batch, head count, length and hardware. Results agree
    /// across n within fp32 rounding.
    pub fn with_num_splits(mut self, num_splits: Option<usize>) -> Self {
        self.num_splits = num_splits;
        self
    }

    /// Picks the CUDA kernel family (see [`CudaKernel`]); results agree across families within
    /// the dtype's rounding.
    pub fn with_cuda_kernel(mut self, kernel: CudaKernel) -> Self {
        self.cuda_kernel = kernel;
        self
    }

    /// The per-tensor scales of K and V (1 by default): the real values are the stored ones
    /// times these, as for fp8 (e4m3) K/V stored divided by a scale (see
    /// [`quantize_e4m3`](crate::quantize_e4m3)). Finite and positive.
    pub fn with_kv_scales(mut self, k_scale: f32, v_scale: f32) -> Self {
        self.k_scale = k_scale;
        self.v_scale = v_scale;
        self
    }

    /// Sliding window: a query at position p sees keys p − `window_left` ..= p only (Mistral,
    /// Gemma-2's local layers); keys before the window are not read. `None`: every key before
    /// it; `Some(0)`: none before it.
    pub fn with_window_left(mut self, window_left: Option<usize>) -> Self {
        self.window_left = window_left;
        self
    }

    /// How far past its own position a query sees: keys up to p + `window_right`. `Some(0)`
    /// (the default) is the causal mask; `None` lets every query see every key after it too
    /// (no causal mask, as an encoder attends). With [`SplitKvAttention::with_window_left`] this
    /// is FlashAttention's local window `(window_size_left, window_size_right)`.
    pub fn with_window_right(mut self, window_right: Option<usize>) -> Self {
        self.window_right = window_right;
        self
    }

    /// Logit soft-capping: scores (after the softmax scale) become `c·tanh(s/c)` before the
    /// softmax (Gemma-2: c = 50). `None`: plain scores. Finite and positive.
    pub fn with_softcap(mut self, softcap: Option<f32>) -> Self {
        self.softcap = softcap;
        self
    }

    /// Restricts each batch entry to its first `seqlens_k[b]` positions: u32 `(batch,)` on q's
    /// device, positions at or past the length ignored. On CUDA each sequence is then cut into
    /// the plan's splits by its own length, so that a call planned for a longer view (a step
    /// over a whole cache) keeps every split busy.
    pub fn with_seqlens(mut self, seqlens_k: Tensor) -> Self {
        self.seqlens_k = Some(seqlens_k);
        self
    }

    /// Reads K/V from a pool of pages: `block_table` is u32 `(batch, max_pages_per_seq)` on q's
    /// device, k and v are then a pool `(num_pages, page_size, kv_heads, head_dim)` (only the
    /// last dim contiguous, so a head-major pool goes in as a transposed view), and position p
    /// of sequence b is row `p % page_size` of page `block_table[b][p / page_size]`. Needs
    /// [`SplitKvAttention::with_seqlens`]; entries past a sequence's last page are never read.
    /// On the CPU a page index outside the pool, or a row too short for its sequence's length,
    /// is an error; on CUDA, where checking would need a host synchronisation, the table is
    /// trusted: a bad entry reads outside the pool.
    pub fn with_block_table(mut self, block_table: Tensor) -> Self {
        self.block_table = Some(block_table);
        self
    }

    /// Validates the inputs and runs the op.
    pub fn forward(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        let dims = validate::check_tensors(q, k, v, self.block_table.as_ref())?;
        validate::check_num_splits(self.num_splits)?;
        validate::check_softcap(self.softcap)?;
        if let Some(seqlens) = &self.seqlens_k {
            validate::check_seqlens(seqlens, q, &dims)?;
        } else if dims.pages.is_some() {
            bail!(
                "split-kv attention: a paged call needs seqlens_k, the length of each sequence \
                 (with_seqlens)"
            )
        }
        // Without per-sequence lengths, the keys a window leaves out are cut off here, so that
        // the split plan covers only the ones that are read.
        if let (Some(window), None) = (self.window_left, &self.seqlens_k) {
            let seen = window.saturating_add(dims.q_len).min(dims.kv_len);
            if seen < dims.kv_len {
                let skip = dims.kv_len - seen;
                return q.apply_op3(
                    &k.narrow(1, skip, seen)?,
                    &v.narrow(1, skip, seen)?,
                    self.clone(),
                );
            }
        }
        q.apply_op3(k, v, self.clone())
    }

    /// Runs the op and also returns the log-sum-exp of the scaled scores, f32
    /// `(batch, q_heads, t)` in natural log (−inf where a token sees no key).
    pub fn forward_with_lse(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let slot: LseSlot = Arc::default();
        let op = Self {
            lse_slot: Some(slot.clone()),
            ..self.clone()
        };
        let out = op.forward(q, k, v)?;
        let lse = slot
            .lock()
            .map_err(|_| candle_core::Error::Msg("split-kv attention: LSE slot poisoned".into()))?
            .take();
        match lse {
            Some(lse) => Ok((out, lse)),
            None => bail!("split-kv attention: the backend did not produce an LSE"),
        }
    }

    /// The split plan this op uses for `q` and `k` on their device: the heuristic's choice (on
    /// sm_90, at short contexts, possibly fewer splits so that they merge inside clusters), or
    /// the forced count clamped to the sequence.
    pub(crate) fn split_plan(&self, q: &Tensor, k: &Tensor) -> Result<SplitPlan> {
        let dims = validate::check_tensors(q, k, k, self.block_table.as_ref())?;
        let call = self.call(dims)?;
        match q.device() {
            Device::Cpu => Ok(cpu::split_plan(&call)),
            #[cfg(feature = "cuda")]
            Device::Cuda(dev) => crate::cuda::split_plan(&call, dev, (q.dtype(), k.dtype())),
            other => bail!(
                "split-kv attention: no split plan for device {:?}",
                other.location()
            ),
        }
    }

    /// The call the backends see, for validated sizes.
    fn call(&self, dims: validate::DecodeDims) -> Result<DecodeCall<'_>> {
        validate::check_num_splits(self.num_splits)?;
        validate::check_kv_scales(self.k_scale, self.v_scale)?;
        Ok(DecodeCall {
            dims,
            softmax_scale: self.softmax_scale,
            k_scale: self.k_scale,
            v_scale: self.v_scale,
            window_left: self.window_left,
            // Past q_len − 1 every query already sees every key.
            window_right: self
                .window_right
                .map_or(dims.q_len - 1, |w| w.min(dims.q_len - 1)),
            softcap: self.softcap,
            num_splits: self.num_splits,
            seqlens_k: self.seqlens_k.as_ref(),
            block_table: self.block_table.as_ref(),
            cuda_kernel: self.cuda_kernel,
            want_lse: self.lse_slot.is_some(),
        })
    }

    /// Hands the LSE to a waiting `forward_with_lse`, if any.
    fn deliver_lse(&self, lse: Option<Tensor>) -> Result<()> {
        let Some(slot) = &self.lse_slot else {
            return Ok(());
        };
        let Some(lse) = lse else {
            bail!("split-kv attention: LSE requested but the backend produced none")
        };
        let mut slot = slot
            .lock()
            .map_err(|_| candle_core::Error::Msg("split-kv attention: LSE slot poisoned".into()))?;
        *slot = Some(lse);
        Ok(())
    }
}

/// Decode attention of the last t query tokens of each sequence (t = 1 for plain decoding) over
/// the whole of k and v; see [`SplitKvAttention`] for the shapes.
pub fn flash_decode(q: &Tensor, k: &Tensor, v: &Tensor, softmax_scale: f32) -> Result<Tensor> {
    SplitKvAttention::new(softmax_scale).forward(q, k, v)
}

/// Like [`flash_decode`], also returning the log-sum-exp of the scaled scores: f32
/// `(batch, q_heads, t)`, natural log.
pub fn flash_decode_with_lse(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
) -> Result<(Tensor, Tensor)> {
    SplitKvAttention::new(softmax_scale).forward_with_lse(q, k, v)
}

/// Decode attention where batch entry `b` attends to its first `seqlens_k[b]` positions only.
///
/// `seqlens_k` is u32 `(batch,)` on q's device, each value at most `kv_len`. A length of 0 gives a
/// zero output. Values above `kv_len` are an error on the CPU; on CUDA, where checking would need
/// a host synchronisation, they are clamped to `kv_len`.
pub fn flash_decode_varlen(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_k: &Tensor,
    softmax_scale: f32,
) -> Result<Tensor> {
    SplitKvAttention::new(softmax_scale)
        .with_seqlens(seqlens_k.clone())
        .forward(q, k, v)
}

/// Decode attention over K/V kept in pages: sequence b's position p is row `p % page_size` of
/// page `block_table[b][p / page_size]` of `k_pages` and `v_pages`, and it attends to its first
/// `seqlens_k[b]` positions.
///
/// - `k_pages`, `v_pages`: `(num_pages, page_size, kv_heads, head_dim)`, only the last dim
///   contiguous (a head-major pool `(num_pages, kv_heads, page_size, head_dim)` goes in
///   transposed); any page size from 1 up.
/// - `block_table`: u32 `(batch, max_pages_per_seq)`; `seqlens_k`: u32 `(batch,)`, each at most
///   `max_pages_per_seq · page_size`. Both on q's device.
///
/// Everything else is as for [`flash_decode`]. A page index outside the pool, or a table row too
/// short for its sequence, is an error on the CPU; on CUDA the table is not checked (that would
/// need a host synchronisation), and such an entry reads outside the pool.
pub fn flash_decode_paged(
    q: &Tensor,
    k_pages: &Tensor,
    v_pages: &Tensor,
    block_table: &Tensor,
    seqlens_k: &Tensor,
    softmax_scale: f32,
) -> Result<Tensor> {
    SplitKvAttention::new(softmax_scale)
        .with_block_table(block_table.clone())
        .with_seqlens(seqlens_k.clone())
        .forward(q, k_pages, v_pages)
}

/// Whether the op takes `t` query tokens per sequence of a `dtype` q on `device`: any number
/// on the CPU, and on CUDA in f16/bf16 (the prefill kernels); f32 on CUDA runs the decode
/// kernels alone, which take up to [`MAX_QUERY_TOKENS`](crate::MAX_QUERY_TOKENS).
pub(crate) fn takes_query_tokens(t: usize, device: &Device, dtype: DType) -> bool {
    t >= 1
        && (!device.is_cuda()
            || t <= validate::MAX_QUERY_TOKENS
            || matches!(dtype, DType::F16 | DType::BF16))
}

impl CustomOp3 for SplitKvAttention {
    fn name(&self) -> &'static str {
        "split-kv-decode"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        q_layout: &Layout,
        k: &CpuStorage,
        k_layout: &Layout,
        v: &CpuStorage,
        v_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let dims = validate::check_layouts(
            (q.dtype(), q_layout),
            (k.dtype(), k_layout),
            (v.dtype(), v_layout),
            self.block_table.as_ref().map(Tensor::dims),
        )?;
        let call = self.call(dims)?;
        let (out, lse) = cpu::forward(&call, (q, q_layout), (k, k_layout), (v, v_layout))?;
        if self.lse_slot.is_some() {
            let lse = Tensor::from_vec(lse, (dims.batch, dims.q_heads, dims.q_len), &Device::Cpu)?;
            self.deliver_lse(Some(lse))?;
        }
        Ok((out, q_layout.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        q: &candle_core::CudaStorage,
        q_layout: &Layout,
        k: &candle_core::CudaStorage,
        k_layout: &Layout,
        v: &candle_core::CudaStorage,
        v_layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let dims = validate::check_layouts(
            (q.dtype(), q_layout),
            (k.dtype(), k_layout),
            (v.dtype(), v_layout),
            self.block_table.as_ref().map(Tensor::dims),
        )?;
        let call = self.call(dims)?;
        let (out, lse) = crate::cuda::forward(&call, (q, q_layout), (k, k_layout), (v, v_layout))?;
        self.deliver_lse(lse)?;
        Ok((out, q_layout.shape().clone()))
    }

    fn bwd(
        &self,
        _q: &Tensor,
        _k: &Tensor,
        _v: &Tensor,
        _out: &Tensor,
        _grad_out: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        bail!("split-kv attention: backward is not supported: inference only")
    }
}
