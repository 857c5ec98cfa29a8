//! `SplitKvAttention`: the decode op as a candle `CustomOp3` (q, k, v → out).

use std::sync::{Arc, Mutex};

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp3, Device, Layout, Result, Shape, Tensor};

use crate::cpu::{self, DecodeInputs, Element};
use crate::plan::{self, SplitPlan};
use crate::validate::{self, DecodeDims, RowStrides};

/// Where a call that asked for the LSE finds it once the op has run.
type LseSlot = Arc<Mutex<Option<Tensor>>>;

/// Which family of CUDA kernels runs the partial pass. The CPU path ignores it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CudaKernel {
    /// Tensor cores for f16/bf16 on sm_80 and later, CUDA cores otherwise.
    #[default]
    Auto,
    /// `mma.sync` tensor-core kernels: f16/bf16 only, built for sm_80 or later.
    TensorCore,
    /// Kernels doing the dot products on CUDA cores: every dtype and target.
    CudaCore,
}

/// Split-KV attention for one decode step.
///
/// - q: `(batch, 1, q_heads, head_dim)`
/// - k, v: `(batch, kv_len, kv_heads, head_dim)`; only the last dim must be contiguous.
/// - output: the shape and dtype of q.
///
/// `q_heads` must be a multiple of `kv_heads` (grouped-query attention with any group size).
#[derive(Debug, Clone)]
pub struct SplitKvAttention {
    /// Multiplier applied to q·k before the softmax, usually `1 / sqrt(head_dim)`.
    pub softmax_scale: f32,
    /// `None`: the split heuristic decides. `Some(n)`: force n splits (clamped to one position per
    /// split at least). Results agree across n within fp32 rounding.
    pub num_splits: Option<usize>,
    /// Optional u32 `(batch,)` lengths: positions at or past `seqlens_k[b]` are ignored.
    pub seqlens_k: Option<Tensor>,
    /// The CUDA kernel family; results agree across families within the dtype's rounding.
    pub cuda_kernel: CudaKernel,
    lse_slot: Option<LseSlot>,
    /// Test hook: fill the output and scratch with NaN before the kernels run, so that any
    /// element they fail to write shows up.
    #[doc(hidden)]
    pub poison_scratch: bool,
}

impl SplitKvAttention {
    /// The op with the heuristic split count and no per-sequence lengths.
    pub fn new(softmax_scale: f32) -> Self {
        Self {
            softmax_scale,
            num_splits: None,
            seqlens_k: None,
            cuda_kernel: CudaKernel::Auto,
            lse_slot: None,
            poison_scratch: false,
        }
    }

    /// Forces `num_splits` splits (`None` restores the heuristic).
    pub fn with_num_splits(mut self, num_splits: Option<usize>) -> Self {
        self.num_splits = num_splits;
        self
    }

    /// Picks the CUDA kernel family (see [`CudaKernel`]).
    pub fn with_cuda_kernel(mut self, kernel: CudaKernel) -> Self {
        self.cuda_kernel = kernel;
        self
    }

    /// Restricts each batch entry to its first `seqlens_k[b]` positions.
    pub fn with_seqlens(mut self, seqlens_k: Tensor) -> Self {
        self.seqlens_k = Some(seqlens_k);
        self
    }

    /// Validates the inputs and runs the op.
    pub fn forward(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        let dims = validate::check_tensors(q, k, v)?;
        validate::check_num_splits(self.num_splits)?;
        if let Some(seqlens) = &self.seqlens_k {
            validate::check_seqlens(seqlens, q, &dims)?;
        }
        q.apply_op3(k, v, self.clone())
    }

    /// Runs the op and also returns the log-sum-exp of the scaled scores, f32 `(batch, q_heads, 1)`
    /// in natural log (−inf for an empty sequence).
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
    pub fn split_plan(&self, q: &Tensor, k: &Tensor) -> Result<SplitPlan> {
        let dims = validate::check_tensors(q, k, k)?;
        match q.device() {
            Device::Cpu => Ok(self.plan(&dims, cpu_parallel_slots(), plan::MIN_CHUNK)),
            #[cfg(feature = "cuda")]
            Device::Cuda(dev) => crate::cuda::split_plan(self, dev, q.dtype(), &dims),
            other => bail!(
                "split-kv attention: no split plan for device {:?}",
                other.location()
            ),
        }
    }

    /// The split plan for these sizes on hardware running `parallel_slots` units at once.
    pub(crate) fn plan(
        &self,
        dims: &DecodeDims,
        parallel_slots: usize,
        min_chunk: usize,
    ) -> SplitPlan {
        match self.num_splits {
            Some(n) => plan::forced(dims.kv_len, n),
            None => plan::plan_with_min_chunk(
                dims.batch,
                dims.kv_heads,
                dims.kv_len,
                parallel_slots,
                min_chunk,
            ),
        }
    }

    /// Whether a `forward_with_lse` call waits for the LSE.
    #[cfg(feature = "cuda")]
    pub(crate) fn wants_lse(&self) -> bool {
        self.lse_slot.is_some()
    }

    /// Hands the LSE to a waiting `forward_with_lse`, if any.
    pub(crate) fn deliver_lse(&self, make: impl FnOnce() -> Result<Tensor>) -> Result<()> {
        if let Some(slot) = &self.lse_slot {
            let lse = make()?;
            let mut slot = slot.lock().map_err(|_| {
                candle_core::Error::Msg("split-kv attention: LSE slot poisoned".into())
            })?;
            *slot = Some(lse);
        }
        Ok(())
    }

    fn cpu_seqlens(&self, dims: &DecodeDims) -> Result<Option<Vec<u32>>> {
        let Some(seqlens) = &self.seqlens_k else {
            return Ok(None);
        };
        let lens = seqlens.to_device(&Device::Cpu)?.to_vec1::<u32>()?;
        if lens.len() != dims.batch {
            bail!(
                "split-kv attention: seqlens_k must have shape ({},), got {:?}",
                dims.batch,
                seqlens.dims()
            )
        }
        validate::check_seqlen_values(&lens, dims.kv_len)?;
        Ok(Some(lens))
    }

    fn cpu_typed<T: Element>(
        &self,
        dims: DecodeDims,
        (q, q_layout): (&[T], &Layout),
        (k, k_layout): (&[T], &Layout),
        (v, v_layout): (&[T], &Layout),
    ) -> Result<Vec<T>> {
        let seqlens = self.cpu_seqlens(&dims)?;
        let slots = cpu_parallel_slots();
        let inputs = DecodeInputs {
            q,
            q_strides: RowStrides::of(q_layout),
            k,
            k_strides: RowStrides::of(k_layout),
            v,
            v_strides: RowStrides::of(v_layout),
            seqlens: seqlens.as_deref(),
            dims,
            softmax_scale: self.softmax_scale,
        };
        let (out, lse) = cpu::decode(&inputs, self.plan(&dims, slots, plan::MIN_CHUNK));
        self.deliver_lse(|| Tensor::from_vec(lse, (dims.batch, dims.q_heads, 1), &Device::Cpu))?;
        Ok(out)
    }
}

/// Tasks the CPU path aims for: a few per thread so that uneven chunks still balance.
fn cpu_parallel_slots() -> usize {
    4 * rayon::current_num_threads()
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
        )?;
        validate::check_num_splits(self.num_splits)?;
        let storage = match (q, k, v) {
            (CpuStorage::F32(q), CpuStorage::F32(k), CpuStorage::F32(v)) => CpuStorage::F32(
                self.cpu_typed(dims, (q, q_layout), (k, k_layout), (v, v_layout))?,
            ),
            (CpuStorage::F16(q), CpuStorage::F16(k), CpuStorage::F16(v)) => CpuStorage::F16(
                self.cpu_typed(dims, (q, q_layout), (k, k_layout), (v, v_layout))?,
            ),
            (CpuStorage::BF16(q), CpuStorage::BF16(k), CpuStorage::BF16(v)) => CpuStorage::BF16(
                self.cpu_typed(dims, (q, q_layout), (k, k_layout), (v, v_layout))?,
            ),
            _ => bail!(
                "split-kv attention: unsupported dtype {:?}; use f32, f16 or bf16",
                q.dtype()
            ),
        };
        Ok((storage, q_layout.shape().clone()))
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
        crate::cuda::forward(self, (q, q_layout), (k, k_layout), (v, v_layout))
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
