//! Split-KV FlashAttention for [Candle](https://github.com/huggingface/candle), with the KV
//! caches and the attention layer a candle model needs to use it.
//!
//! At decode time each sequence contributes one query token, so attention is a long, thin read of
//! the KV cache. The op cuts the cache into chunks ("splits") that run in parallel, each producing
//! a partial output and its log-sum-exp, then merges them. The same op takes a few query tokens
//! (drafts to verify) or a whole prompt (a causal prefill, with kernels of its own on CUDA). On
//! CUDA it runs the crate's own kernels; on the CPU a multi-threaded implementation of the same
//! algorithm.
//!
//! # The op
//!
//! Tensors follow candle's flash-attention convention:
//! - q: `(batch, t, q_heads, head_dim)`: t = 1 for plain decoding, a few to verify drafted
//!   tokens in one pass (up to [`MAX_QUERY_TOKENS`] run the decode kernels), any number for a
//!   prefill (the last t positions, causal); `head_dim` one of [`SUPPORTED_HEAD_DIMS`].
//! - k, v: `(batch, kv_len, kv_heads, head_dim)`, only the last dim contiguous, so a narrowed,
//!   transposed view of a head-major `(batch, kv_heads, capacity, head_dim)` cache goes in
//!   without a copy. In q's dtype, or fp8 (e4m3) with per-tensor scales
//!   ([`SplitKvAttention::with_kv_scales`], [`quantize_e4m3`]).
//! - output: the shape and dtype of q; LSE: f32 `(batch, q_heads, t)`, natural log.
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use candle_splitkv::{flash_decode, SplitKvAttention};
//! # fn main() -> candle_core::Result<()> {
//! let dev = Device::Cpu;
//! let q = Tensor::randn(0f32, 1.0, (1, 1, 8, 64), &dev)?;
//! let k = Tensor::randn(0f32, 1.0, (1, 1000, 2, 64), &dev)?;
//! let v = Tensor::randn(0f32, 1.0, (1, 1000, 2, 64), &dev)?;
//! let out = flash_decode(&q, &k, &v, 1.0 / 8.0)?;
//! assert_eq!(out.dims(), &[1, 1, 8, 64]);
//!
//! // The op itself, for everything else: forced splits, a sliding window, soft-capping,
//! // per-sequence lengths, paged K/V, the LSE.
//! let op = SplitKvAttention::new(1.0 / 8.0)
//!     .with_num_splits(Some(4))
//!     .with_window_left(Some(256));
//! let (out, lse) = op.forward_with_lse(&q, &k, &v)?;
//! assert_eq!(lse.dims(), &[1, 8, 1]);
//! # Ok(()) }
//! ```
//!
//! [`flash_decode_varlen`] masks each sequence to its own length, [`flash_decode_paged`] reads
//! K/V from a pool of pages through a block table, and [`flash_decode_with_lse`] also returns
//! the LSE. [`CudaKernel`] picks the CUDA kernel family.
//!
//! # A KV cache and attention for your model
//!
//! [`KvCache`] is a preallocated, head-major cache written in place (it copies only when its
//! capacity doubles), in f32, f16, bf16 or fp8 ([`CACHE_DTYPES`]). [`CachedAttention`] appends a
//! step's keys and values to it and attends with the split-KV op, whatever the step: a prompt or
//! a chunk of one, a decode step, a few tokens being verified ([`AttentionStep`] says which
//! cache and where its positions live). Replace the concatenating cache and the attention of a
//! layer with:
//!
//! ```
//! use candle_core::{DType, Device, Tensor};
//! use candle_splitkv::{AttentionStep, CachedAttention, KvCache, KvCacheConfig};
//! # fn main() -> candle_core::Result<()> {
//! let (q_heads, kv_heads, head_dim) = (8, 2, 64);
//! let device = Device::Cpu;
//! // Once per layer.
//! let mut cache = KvCache::new(&KvCacheConfig {
//!     batch: 1,
//!     kv_heads,
//!     head_dim,
//!     initial_capacity: 1024,
//!     max_capacity: 8192, // the model's context length
//!     dtype: DType::F32,
//!     device: device.clone(),
//!     k_scale: 1.0,
//!     v_scale: 1.0,
//! })?;
//! let attention = CachedAttention::new(1.0 / (head_dim as f32).sqrt());
//!
//! // In the layer's forward, after RoPE: a prompt of 5 tokens, then one decode step.
//! for t in [5, 1] {
//!     let q = Tensor::randn(0f32, 1.0, (1, t, q_heads, head_dim), &device)?;
//!     let k = Tensor::randn(0f32, 1.0, (1, t, kv_heads, head_dim), &device)?;
//!     let v = Tensor::randn(0f32, 1.0, (1, t, kv_heads, head_dim), &device)?;
//!     let y = attention.forward(&q, &k, &v, AttentionStep::new(&mut cache))?;
//!     assert_eq!(y.dims(), &[1, t, q_heads, head_dim]);
//! }
//! assert_eq!(cache.len(), 6);
//! # Ok(()) }
//! ```
//!
//! K/V are shared across each grouped-query group, so `q_heads` may be any multiple of
//! `kv_heads`. For batches of sequences that come and go, [`PagedKvCache`] keeps every layer's
//! keys and values in pools of pages: [`PagedKvCache::begin_step`] makes room for a step and
//! returns its [`PagedStep`], and [`CachedAttention::forward`] attends each layer through it
//! ([`AttentionStep::paged`]); [`PagedKvCache::begin_mixed_step`] makes a step of prompt chunks
//! beside decode rows, attended by shape ([`AttentionStep::mixed`]). [`fused_linear`] runs a decode step's projections with the
//! RMSNorm before them and the residual add or SwiGLU after them in one CUDA kernel
//! ([`LinearInput`], [`LinearOutput`]).
//!
//! # Models
//!
//! With the `models` feature, [`models::llama::Llama`] is a complete model built this way:
//! Llama, Mistral, Phi-3, Qwen2, Qwen3 and Gemma-2 from an HF directory or a GGUF file, with
//! batched decoding over a paged cache and CUDA graphs; [`models::speculative`] adds speculative
//! decoding on top.
//!
//! # Features
//!
//! - `models` (default): the model stack above. Without it the crate is the op, the caches,
//!   the attention layer and the fused projections.
//! - `cuda`: the CUDA kernels, compiled by `nvcc` for the compute capability in
//!   `CUDA_COMPUTE_CAP` (80 or later, e.g. `90`), or else that of the GPU `nvidia-smi` finds at
//!   build time: machine code for that target, and PTX that the driver compiles for newer GPUs
//!   (`CANDLE_SPLITKV_PTX_ONLY=1` builds the PTX alone, faster, at the cost of that compile on
//!   the first load).
//! - `test-hooks`: switches the crate's own tests and benchmarks use (NaN poisoning of kernel
//!   outputs, launch counts, the split plan); not part of the API.

#[cfg(feature = "cuda")]
mod cuda;
mod device_memory;
pub mod flash_attn;
mod fp8;
#[cfg(feature = "models")]
pub mod models;
mod nn;
mod op;
#[cfg(feature = "test-hooks")]
pub mod test_hooks;

pub use device_memory::retain_freed_device_memory;
pub use fp8::{dequantize_e4m3, quantize_e4m3, quantize_e4m3_into, E4M3_MAX};
pub use nn::{
    fused_linear, linear_unfused, AttentionBackend, AttentionStep, CachedAttention, DeviceLengths,
    KvCache, KvCacheConfig, LinearInput, LinearOutput, MixedStep, PagedKvCache, PagedKvCacheConfig,
    PagedStep, SequenceId, StepGroup, CACHE_DTYPES,
};
pub use op::validate::{MAX_QUERY_TOKENS, SUPPORTED_HEAD_DIMS};
pub use op::{
    flash_decode, flash_decode_paged, flash_decode_varlen, flash_decode_with_lse, CudaKernel,
    SplitKvAttention,
};
