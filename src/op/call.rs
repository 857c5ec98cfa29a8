//! One call of the op as the backends see it: the validated sizes and the settings that shape the
//! launch, with nothing of the op itself, so that a backend never reaches back into it.

use candle_core::Tensor;

use super::plan::{self, SplitPlan};
use super::validate::DecodeDims;

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

/// A validated call of the op.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DecodeCall<'a> {
    pub dims: DecodeDims,
    pub softmax_scale: f32,
    /// The real K and V are the stored values times these (fp8 caches; 1 otherwise).
    pub k_scale: f32,
    pub v_scale: f32,
    /// A query sees at most this many positions before its own.
    pub window_left: Option<usize>,
    /// A query sees this many positions after its own (0: causal), at most `q_len − 1`, which
    /// lets every query see every key.
    pub window_right: usize,
    /// Scores become `c·tanh(s/c)` (after the softmax scale) with this c.
    pub softcap: Option<f32>,
    /// `None`: the heuristic decides; `Some(n)`: n splits, clamped to the sequence.
    pub num_splits: Option<usize>,
    /// u32 `(batch,)` lengths, checked for shape, dtype and device.
    pub seqlens_k: Option<&'a Tensor>,
    /// u32 `(batch, max_pages)` page indices when K/V are paged (`dims.pages`), checked for
    /// shape, dtype and device.
    pub block_table: Option<&'a Tensor>,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub cuda_kernel: CudaKernel,
    /// Whether the caller waits for the log-sum-exp.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub want_lse: bool,
}

impl DecodeCall<'_> {
    /// Whether the call masks or caps beyond the plain causal mask, which the CUDA kernels run
    /// in forms of their own.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub fn windowed(&self) -> bool {
        self.window_left.is_some() || self.window_right > 0 || self.softcap.is_some()
    }

    /// The split plan for hardware running `parallel_slots` units at once, with chunks of at
    /// least `min_chunk` positions: the forced count clamped to the sequence, or the heuristic's.
    pub fn split_plan(&self, parallel_slots: usize, min_chunk: usize) -> SplitPlan {
        let dims = &self.dims;
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
}
