//! Split-KV FlashAttention for the decode step in [Candle](https://github.com/huggingface/candle).
//!
//! At decode time each sequence contributes one query token, so attention is a long, thin read of
//! the KV cache. The op cuts the cache into chunks ("splits") that run in parallel, each producing
//! a partial output and its log-sum-exp, then merges them. On CUDA it runs the crate's own kernels;
//! on the CPU a multi-threaded implementation of the same algorithm.
//!
//! Tensors follow candle's flash-attention convention:
//! - q: `(batch, t, q_heads, head_dim)`: t = 1 for plain decoding, up to [`MAX_QUERY_TOKENS`]
//!   to verify drafted tokens in one pass (the last t positions, causal)
//! - k, v: `(batch, kv_len, kv_heads, head_dim)`, only the last dim contiguous, so a narrowed,
//!   transposed view of a head-major `(batch, kv_heads, capacity, head_dim)` cache goes in
//!   without a copy. In q's dtype, or fp8 (e4m3) with per-tensor scales (see
//!   [`SplitKvAttention::k_scale`] and [`quantize_e4m3`]).
//! - output: the shape and dtype of q; LSE: f32 `(batch, q_heads, t)`, natural log.
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
pub mod fp8;
#[cfg(feature = "models")]
pub mod models;
pub mod nn;
mod op;

pub use device_memory::retain_freed_device_memory;
pub use fp8::{dequantize_e4m3, quantize_e4m3, quantize_e4m3_into, E4M3_MAX};
pub use nn::attention::{self, cached_attention, AttentionBackend, CachedAttention};
pub use nn::cache::{self, KvCache, KvCacheConfig};
pub use nn::fused_linear::{self, fused_linear, linear_unfused, LinearInput, LinearOutput};
pub use nn::paged_cache::{self, PagedKvCache, PagedKvCacheConfig, PagedStep, SequenceId};
pub use op::plan;
pub use op::validate::{MAX_QUERY_TOKENS, SUPPORTED_HEAD_DIMS};
pub use op::{
    flash_decode, flash_decode_paged, flash_decode_varlen, flash_decode_with_lse, CudaKernel,
    SplitKvAttention,
};
