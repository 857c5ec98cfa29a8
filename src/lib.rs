//! Split-KV FlashAttention for the decode step in [Candle](https://github.com/huggingface/candle).
//!
//! At decode time each sequence contributes one query token, so attention is a long, thin read of
//! the KV cache. The op cuts the cache into chunks ("splits") that run in parallel, each producing
//! a partial output and its log-sum-exp, then merges them. On CUDA it runs the crate's own kernels;
//! on the CPU a multi-threaded implementation of the same algorithm.
//!
//! Tensors follow candle's flash-attention convention:
//! - q: `(batch, 1, q_heads, head_dim)`
//! - k, v: `(batch, kv_len, kv_heads, head_dim)`, only the last dim contiguous, so a narrowed,
//!   transposed view of a head-major `(batch, kv_heads, capacity, head_dim)` cache goes in
//!   without a copy.
//! - output: the shape and dtype of q; LSE: f32 `(batch, q_heads, 1)`, natural log.
//!
//! ```
//! use candle_core::{Device, Tensor, DType};
//! # fn main() -> candle_core::Result<()> {
//! let dev = Device::Cpu;
//! let q = Tensor::randn(0f32, 1.0, (1, 1, 8, 64), &dev)?;
//! let k = Tensor::randn(0f32, 1.0, (1, 1000, 2, 64), &dev)?;
//! let v = Tensor::randn(0f32, 1.0, (1, 1000, 2, 64), &dev)?;
//! let out = candle_splitkv::flash_decode(&q, &k, &v, 1.0 / 8.0)?;
//! assert_eq!(out.dims(), &[1, 1, 8, 64]);
//! # Ok(()) }
//! ```

#[cfg(feature = "cuda")]
mod cuda;
mod device_memory;
#[cfg(feature = "models")]
pub mod models;
pub mod nn;
mod op;
#[cfg(feature = "models")]
pub mod summarize;

use candle_core::{Result, Tensor};

pub use device_memory::retain_freed_device_memory;
pub use nn::attention::{self, cached_attention, AttentionBackend, CachedAttention};
pub use nn::cache::{self, KvCache, KvCacheConfig};
pub use nn::fused_linear::{self, fused_linear, linear_unfused, LinearInput, LinearOutput};
pub use op::plan;
pub use op::validate::SUPPORTED_HEAD_DIMS;
pub use op::{CudaKernel, SplitKvAttention};

/// Decode attention of one query token per sequence over the whole of k and v.
pub fn flash_decode(q: &Tensor, k: &Tensor, v: &Tensor, softmax_scale: f32) -> Result<Tensor> {
    SplitKvAttention::new(softmax_scale).forward(q, k, v)
}

/// Like [`flash_decode`], also returning the log-sum-exp of the scaled scores: f32
/// `(batch, q_heads, 1)`, natural log.
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
