//! Batched decoding over a paged cache on the GPU (bf16: the paged op, the cache's writes on
//! CUDA, batched projections) against decoding each sequence alone on the same GPU, with
//! continuous batching and a fork, at page sizes 1, 16 and 256. The batched rows run through
//! other kernels than a single row (candle's matmul, not the fused single-row kernels), which
//! round differently in bf16, so the model is the decisive tiny Llama (every greedy step leads
//! by several units) and the logits must agree within 2, as in the GPU Llama suite.
//!
//! The same requests in steps that mix prompt chunks with decode rows (`Llama::forward_mixed`):
//! chunks of 16 tokens take the op's decode kernels, of 40 its prefill kernels.
//!
//! Skips with a notice where no CUDA device exists.

use anyhow::Result;
use candle_core::DType;
use candle_splitkv::models::llama::{Llama, LoadOptions};

use crate::common::batched::{check_mixed_model, check_model, tiny_requests};
use crate::common::gpu;
use crate::common::tiny_llama::write_decisive_tiny_model;

const TOLERANCE: f32 = 2.0;

#[test]
fn gpu_batched_greedy_decoding_equals_decoding_alone() -> Result<()> {
    let Some(gpu) = gpu() else { return Ok(()) };
    let dir = tempfile::tempdir()?;
    write_decisive_tiny_model(dir.path())?;
    for dtype in [DType::BF16, DType::F32] {
        let options = LoadOptions {
            dtype: Some(dtype),
            ..LoadOptions::default()
        };
        let mut model = Llama::load_with(dir.path(), &gpu, options)?.model;
        for page_size in [1, 16, 256] {
            check_model(
                &mut model,
                &tiny_requests(),
                page_size,
                TOLERANCE,
                &format!("{dtype:?} on the GPU"),
            )?;
        }
    }
    Ok(())
}

#[test]
fn gpu_mixed_steps_equal_decoding_alone() -> Result<()> {
    let Some(gpu) = gpu() else { return Ok(()) };
    let dir = tempfile::tempdir()?;
    write_decisive_tiny_model(dir.path())?;
    for dtype in [DType::BF16, DType::F32] {
        let options = LoadOptions {
            dtype: Some(dtype),
            ..LoadOptions::default()
        };
        let mut model = Llama::load_with(dir.path(), &gpu, options)?.model;
        for (chunk, page_size) in [(16, 1), (40, 16)] {
            model.set_prefill_chunk(chunk)?;
            check_mixed_model(
                &mut model,
                &tiny_requests(),
                page_size,
                TOLERANCE,
                &format!("{dtype:?} on the GPU, chunk {chunk}"),
            )?;
        }
    }
    Ok(())
}
