//! Several query tokens per sequence on CUDA against the f64 reference: the last t positions of
//! each sequence, token i seeing the keys up to position `len − t + i`. Outputs and split scratch
//! are poisoned with NaN first.
//!
//! Skips with a notice where no CUDA device exists.

use candle_core::{DType, Device, Result, Tensor};
use candle_splitkv::{CudaKernel, MAX_QUERY_TOKENS};

use crate::common;
use crate::common::{
    assert_close, assert_lse_close, gpu, host_f64, max_abs_diff, poisoned, reference,
};

const TOKENS: [usize; 7] = [1, 2, 3, 4, 5, 8, 16];
const HEAD_DIMS: [usize; 5] = [64, 80, 96, 128, 256];
const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// One call's sizes.
#[derive(Debug, Clone, Copy)]
struct Shape {
    b: usize,
    t: usize,
    h_q: usize,
    h_kv: usize,
    d: usize,
    l: usize,
    dtype: DType,
}

impl Shape {
    fn scale(&self) -> f32 {
        1.0 / (self.d as f32).sqrt()
    }

    fn qkv(&self, dev: &Device) -> Result<(Tensor, Tensor, Tensor)> {
        let random = |shape: (usize, usize, usize, usize)| {
            Tensor::randn(0f32, 1.0, shape, dev)?.to_dtype(self.dtype)
        };
        Ok((
            random((self.b, self.t, self.h_q, self.d))?,
            random((self.b, self.l, self.h_kv, self.d))?,
            random((self.b, self.l, self.h_kv, self.d))?,
        ))
    }
}

/// Runs `shape` with each split count and kernel family and compares output and LSE with the
/// reference.
fn check(
    dev: &Device,
    shape: Shape,
    splits: &[Option<usize>],
    kernels: &[CudaKernel],
) -> Result<()> {
    let (q, k, v) = shape.qkv(dev)?;
    let want = reference(&q, &k, &v, shape.scale(), None)?;
    for &kernel in kernels {
        for &n in splits {
            let (out, lse) = poisoned(shape.scale())
                .with_num_splits(n)
                .with_cuda_kernel(kernel)
                .forward_with_lse(&q, &k, &v)?;
            assert_eq!(out.dims(), q.dims());
            assert_eq!(lse.dims(), &[shape.b, shape.h_q, shape.t]);
            let what = format!("{shape:?} splits {n:?} {kernel:?}");
            assert_close(&what, &out, &want.out, shape.dtype)?;
            assert_lse_close(&what, &lse, &want.lse, shape.dtype)?;
        }
    }
    Ok(())
}

/// The kernel families a dtype runs on: both for 16-bit inputs, the CUDA cores for f32.
fn kernels_for(dtype: DType) -> &'static [CudaKernel] {
    if dtype == DType::F32 {
        &[CudaKernel::CudaCore]
    } else {
        &[CudaKernel::TensorCore, CudaKernel::CudaCore]
    }
}

#[test]
fn gpu_query_tokens_every_head_dim_dtype_and_length() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut count = 0;
    for t in TOKENS {
        // Lengths below t leave the first tokens nothing to see; t ± 1 puts the masked
        // positions at a chunk's start; 257 and 4097 end mid-tile.
        let mut lengths = vec![1, t.saturating_sub(1).max(1), t, t + 1, 257, 4097];
        lengths.dedup();
        for l in lengths {
            for d in HEAD_DIMS {
                for dtype in DTYPES {
                    let shape = Shape {
                        b: 2,
                        t,
                        h_q: 8,
                        h_kv: 2,
                        d,
                        l,
                        dtype,
                    };
                    check(&dev, shape, &[None, Some(3)], kernels_for(dtype))?;
                    count += 1;
                }
            }
        }
    }
    println!("gpu_query_tokens_every_head_dim_dtype_and_length: {count} shapes passed");
    Ok(())
}

/// Every group size with every token count: t × group query rows fill one tensor-core tile up to
/// 16 and run as several blocks of rows past it (up to 256 rows).
#[test]
fn gpu_query_tokens_every_group_size() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut count = 0;
    for group in 1..=16 {
        for t in TOKENS {
            for dtype in [DType::BF16, DType::F16] {
                let shape = Shape {
                    b: 2,
                    t,
                    h_q: 2 * group,
                    h_kv: 2,
                    d: 128,
                    l: 3000,
                    dtype,
                };
                check(&dev, shape, &[None], kernels_for(dtype))?;
                count += 1;
            }
        }
    }
    println!("gpu_query_tokens_every_group_size: {count} shapes passed");
    Ok(())
}

/// Split counts from one to many agree with each other within fp32 rounding, whichever merge
/// the plan picks (cluster, last CTA, combine pass).
#[test]
fn gpu_query_tokens_split_counts_agree() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    for (t, dtype) in [(4, DType::BF16), (8, DType::BF16), (5, DType::F32)] {
        let shape = Shape {
            b: 1,
            t,
            h_q: 32,
            h_kv: 8,
            d: 128,
            l: 40000,
            dtype,
        };
        let (q, k, v) = shape.qkv(&dev)?;
        let want = reference(&q, &k, &v, shape.scale(), None)?;
        let one = host_f64(
            &poisoned(shape.scale())
                .with_num_splits(Some(1))
                .forward(&q, &k, &v)?,
        )?;
        for n in [None, Some(2), Some(7), Some(16), Some(33), Some(100)] {
            let (out, lse) = poisoned(shape.scale())
                .with_num_splits(n)
                .forward_with_lse(&q, &k, &v)?;
            let what = format!("{shape:?} splits {n:?}");
            assert_close(&what, &out, &want.out, dtype)?;
            assert_lse_close(&what, &lse, &want.lse, dtype)?;
            let ulp = if dtype == DType::F32 { 2e-6 } else { 8e-3 };
            let diff = max_abs_diff(&host_f64(&out)?, &one);
            assert!(diff <= ulp, "{what}: differs from one split by {diff}");
        }
    }
    Ok(())
}

/// Per-sequence lengths, some below t: the tokens before a sequence's first position get zeros
/// and an LSE of −inf.
#[test]
fn gpu_query_tokens_varlen() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let lens = [4097u32, 1000, 5, 1, 0, 16];
    let l = 4097;
    for dtype in DTYPES {
        for (t, h_q, h_kv, d) in [
            (6, 8, 2, 64),
            (MAX_QUERY_TOKENS, 32, 8, 128),
            (3, 12, 1, 96),
        ] {
            let shape = Shape {
                b: lens.len(),
                t,
                h_q,
                h_kv,
                d,
                l,
                dtype,
            };
            let (q, k, v) = shape.qkv(&dev)?;
            let seqlens = Tensor::new(&lens, &dev)?;
            let want = reference(&q, &k, &v, shape.scale(), Some(&lens))?;
            for &kernel in kernels_for(dtype) {
                for n in [None, Some(1), Some(4)] {
                    let (out, lse) = poisoned(shape.scale())
                        .with_seqlens(seqlens.clone())
                        .with_num_splits(n)
                        .with_cuda_kernel(kernel)
                        .forward_with_lse(&q, &k, &v)?;
                    let what = format!("varlen {shape:?} splits {n:?} {kernel:?}");
                    assert_close(&what, &out, &want.out, dtype)?;
                    assert_lse_close(&what, &lse, &want.lse, dtype)?;
                }
            }
        }
    }
    Ok(())
}

/// q and the cache as strided views: q narrowed out of a wider token dimension, K/V a head-major
/// buffer seen through a transposed view.
#[test]
fn gpu_query_tokens_strided_views() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    for dtype in DTYPES {
        let (b, t, h_q, h_kv, d, cap, len) = (2, 5, 12, 3, 128, 3000, 2049);
        let wide = Tensor::randn(0f32, 1.0, (b, t + 3, h_q, d), &dev)?.to_dtype(dtype)?;
        let q = wide.narrow(1, 2, t)?;
        assert!(!q.is_contiguous());
        let (k, _) = common::head_major_view(b, h_kv, cap, len, d, dtype, &dev)?;
        let (v, _) = common::head_major_view(b, h_kv, cap, len, d, dtype, &dev)?;
        let scale = 0.1;
        let want = reference(&q, &k, &v, scale, None)?;
        for &kernel in kernels_for(dtype) {
            let (out, lse) = poisoned(scale)
                .with_cuda_kernel(kernel)
                .forward_with_lse(&q, &k, &v)?;
            let what = format!("strided {dtype:?} {kernel:?}");
            assert_close(&what, &out, &want.out, dtype)?;
            assert_lse_close(&what, &lse, &want.lse, dtype)?;
        }
    }
    Ok(())
}

/// Wide calls: many rows per kv head with long chunks, and a batch large enough for the
/// persistent grid.
#[test]
fn gpu_query_tokens_wide_and_persistent() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    for (b, t, h_q, h_kv, l) in [
        (1, 8, 64, 8, 70000),
        (1, 16, 32, 8, 20000),
        (16, 4, 32, 8, 9000),
        (64, 2, 32, 32, 1500),
    ] {
        let shape = Shape {
            b,
            t,
            h_q,
            h_kv,
            d: 128,
            l,
            dtype: DType::BF16,
        };
        check(&dev, shape, &[None], &[CudaKernel::Auto])?;
    }
    Ok(())
}

/// The last of t tokens sees the whole cache, as a one-token call does, and the GPU agrees with
/// the CPU op.
#[test]
fn gpu_query_tokens_match_cpu_and_one_token() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let shape = Shape {
        b: 2,
        t: 7,
        h_q: 32,
        h_kv: 8,
        d: 128,
        l: 5000,
        dtype: DType::F32,
    };
    let (q, k, v) = shape.qkv(&dev)?;
    let scale = shape.scale();
    let many = poisoned(scale).forward(&q, &k, &v)?;
    let last = q.narrow(1, shape.t - 1, 1)?.contiguous()?;
    let one = poisoned(scale).forward(&last, &k, &v)?;
    let diff = max_abs_diff(
        &host_f64(&many.narrow(1, shape.t - 1, 1)?)?,
        &host_f64(&one)?,
    );
    assert!(diff < 1e-5, "last token differs from one token by {diff}");
    let cpu = poisoned(scale).forward(
        &q.to_device(&Device::Cpu)?,
        &k.to_device(&Device::Cpu)?,
        &v.to_device(&Device::Cpu)?,
    )?;
    let diff = max_abs_diff(&host_f64(&many)?, &host_f64(&cpu)?);
    assert!(diff < 1e-5, "GPU and CPU differ by {diff}");
    Ok(())
}

/// Past [`MAX_QUERY_TOKENS`] the CUDA path refuses the call with a message that names both
/// limits, where the CPU runs it.
#[test]
fn gpu_more_f32_query_tokens_than_the_decode_kernels_take_is_an_error() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let shape = Shape {
        b: 1,
        t: MAX_QUERY_TOKENS + 1,
        h_q: 4,
        h_kv: 2,
        d: 64,
        l: 100,
        dtype: DType::F32,
    };
    let (q, k, v) = shape.qkv(&dev)?;
    let err = candle_splitkv::flash_decode(&q, &k, &v, shape.scale())
        .expect_err("f32 on CUDA takes at most MAX_QUERY_TOKENS query tokens")
        .to_string();
    assert!(
        err.contains(&format!("more than {MAX_QUERY_TOKENS} query tokens"))
            && err.contains("take f16 or bf16 q"),
        "unexpected error: {err}"
    );
    let on_cpu = candle_splitkv::flash_decode(
        &q.to_device(&Device::Cpu)?,
        &k.to_device(&Device::Cpu)?,
        &v.to_device(&Device::Cpu)?,
        shape.scale(),
    )?;
    assert_eq!(on_cpu.dims(), q.dims());
    Ok(())
}
