//! The CUDA kernels against the f64 reference. Every run poisons the output and the split scratch
//! with NaN first, so an element the kernels fail to write fails the comparison.
//!
//! Skips with a notice where no CUDA device exists.

use candle_core::{DType, Device, IndexOp, Result, Tensor};
use candle_splitkv::test_hooks::split_plan;
use candle_splitkv::{CudaKernel, SplitKvAttention};

use crate::common;
use crate::common::{
    assert_close, assert_lse_close, gpu, host_f64, max_abs_diff, poisoned, reference, Case,
};

const HEADS: [(usize, usize); 4] = [(8, 8), (9, 3), (14, 2), (32, 8)];
const HEAD_DIMS: [usize; 5] = [64, 80, 96, 128, 256];
const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

fn check_case(dev: &Device, case: Case, splits: Option<usize>) -> Result<()> {
    check_case_with(dev, case, splits, CudaKernel::Auto)
}

fn check_case_with(
    dev: &Device,
    case: Case,
    splits: Option<usize>,
    kernel: CudaKernel,
) -> Result<()> {
    let (q, k, v) = common::random_qkv(&case, dev)?;
    let op = poisoned(case.scale())
        .with_num_splits(splits)
        .with_cuda_kernel(kernel);
    let (out, lse) = op.forward_with_lse(&q, &k, &v)?;
    assert_eq!(out.dims(), q.dims());
    assert_eq!(out.dtype(), case.dtype);
    assert_eq!(lse.dims(), &[case.b, case.h_q, 1]);
    let want = reference(&q, &k, &v, case.scale(), None)?;
    let what = format!("{case:?} splits {splits:?} kernel {kernel:?}");
    assert_close(&what, &out, &want.out, case.dtype)?;
    assert_lse_close(&what, &lse, &want.lse, case.dtype)
}

#[test]
fn gpu_full_matrix() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut count = 0;
    for l in [1, 2, 255, 256, 257, 4097, 50000] {
        for b in [1, 3] {
            for (h_q, h_kv) in HEADS {
                for d in HEAD_DIMS {
                    for dtype in DTYPES {
                        check_case(
                            &dev,
                            Case {
                                b,
                                h_q,
                                h_kv,
                                d,
                                l,
                                dtype,
                            },
                            None,
                        )?;
                        count += 1;
                    }
                }
            }
        }
    }
    println!("gpu_full_matrix: {count} cases passed");
    Ok(())
}

#[test]
fn gpu_every_group_size() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut count = 0;
    for group in 1..=16 {
        for dtype in [DType::BF16, DType::F16] {
            for kernel in [CudaKernel::TensorCore, CudaKernel::CudaCore] {
                let case = Case {
                    b: 2,
                    h_q: 2 * group,
                    h_kv: 2,
                    d: 128,
                    l: 3000,
                    dtype,
                };
                check_case_with(&dev, case, None, kernel)?;
                count += 1;
            }
        }
    }
    println!("gpu_every_group_size: {count} cases passed");
    Ok(())
}

/// The full matrix runs the default (tensor-core) kernels for f16/bf16; this covers the
/// CUDA-core kernels on the same head layouts and dims for those dtypes.
#[test]
fn gpu_cuda_core_kernels_16bit() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut count = 0;
    for l in [1, 257, 4097] {
        for (h_q, h_kv) in HEADS {
            for d in HEAD_DIMS {
                for dtype in [DType::F16, DType::BF16] {
                    let case = Case {
                        b: 3,
                        h_q,
                        h_kv,
                        d,
                        l,
                        dtype,
                    };
                    check_case_with(&dev, case, None, CudaKernel::CudaCore)?;
                    count += 1;
                }
            }
        }
    }
    println!("gpu_cuda_core_kernels_16bit: {count} cases passed");
    Ok(())
}

/// Short contexts where the plan may trade splits for a cluster merge (on sm_90: 4 splits with
/// the combine pass become 3 in clusters, 16 become 8), against the reference, with ragged
/// lengths so that the shorter chunks end mid-tile.
#[test]
fn gpu_short_context_cluster_plans() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let shapes = [
        (1, 32, 32, 128, 1024),
        (4, 32, 8, 64, 1000),
        (4, 64, 8, 128, 1111),
        (1, 32, 8, 64, 4096),
        (2, 128, 8, 128, 777),
    ];
    for (b, h_q, h_kv, d, l) in shapes {
        for dtype in [DType::BF16, DType::F16] {
            let case = Case {
                b,
                h_q,
                h_kv,
                d,
                l,
                dtype,
            };
            let (q, k, _) = common::random_qkv(&case, &dev)?;
            let plan = split_plan(&poisoned(case.scale()), &q, &k)?;
            assert!(
                plan.num_splits * plan.chunk_size >= l,
                "{plan:?} misses rows of {l}"
            );
            println!("gpu_short_context_cluster_plans {case:?}: {plan:?}");
            check_case(&dev, case, None)?;
        }
    }
    Ok(())
}

#[test]
fn gpu_forced_splits_agree() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    for dtype in [DType::BF16, DType::F32] {
        let case = Case {
            b: 1,
            h_q: 32,
            h_kv: 8,
            d: 128,
            l: 65536,
            dtype,
        };
        let (q, k, v) = common::random_qkv(&case, &dev)?;
        let want = reference(&q, &k, &v, case.scale(), None)?;
        let one = poisoned(case.scale())
            .with_num_splits(Some(1))
            .forward(&q, &k, &v)?;
        let one = host_f64(&one)?;
        let mut count = 0;
        for n in (1..=64).chain([100, 128, 200, 256]) {
            let op = poisoned(case.scale()).with_num_splits(Some(n));
            let (out, lse) = op.forward_with_lse(&q, &k, &v)?;
            assert_close(&format!("{n} splits {dtype:?}"), &out, &want.out, dtype)?;
            assert_lse_close(&format!("{n} splits {dtype:?}"), &lse, &want.lse, dtype)?;
            let got = host_f64(&out)?;
            let ulp = if dtype == DType::F32 { 2e-6 } else { 8e-3 };
            let diff = max_abs_diff(&got, &one);
            assert!(
                diff <= ulp,
                "{n} splits differ from 1 split by {diff} ({dtype:?})"
            );
            count += 1;
        }
        println!("gpu_forced_splits_agree {dtype:?}: {count} split counts agree");
    }
    Ok(())
}

/// The combine pass lays its threads out by head dim (split lanes × 4-column groups) and takes the
/// splits in batches, so split counts on both sides of a batch boundary run for every head dim.
#[test]
fn gpu_combine_every_head_dim() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut count = 0;
    for d in HEAD_DIMS {
        for dtype in [DType::BF16, DType::F32] {
            let case = Case {
                b: 2,
                h_q: 8,
                h_kv: 2,
                d,
                l: 6000,
                dtype,
            };
            let (q, k, v) = common::random_qkv(&case, &dev)?;
            let want = reference(&q, &k, &v, case.scale(), None)?;
            for n in [2, 9, 16, 17, 33, 65, 129] {
                let what = format!("d {d} {n} splits {dtype:?}");
                let (out, lse) = poisoned(case.scale())
                    .with_num_splits(Some(n))
                    .forward_with_lse(&q, &k, &v)?;
                assert_close(&what, &out, &want.out, dtype)?;
                assert_lse_close(&what, &lse, &want.lse, dtype)?;
                count += 1;
            }
        }
    }
    println!("gpu_combine_every_head_dim: {count} cases passed");
    Ok(())
}

#[test]
fn gpu_large_logits() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    for dtype in DTYPES {
        let case = Case {
            b: 2,
            h_q: 32,
            h_kv: 8,
            d: 128,
            l: 20000,
            dtype,
        };
        let (q, k, v) = common::random_qkv(&case, &dev)?;
        let q = (q.to_dtype(DType::F32)? * 100.0)?.to_dtype(dtype)?;
        let want = reference(&q, &k, &v, case.scale(), None)?;
        for splits in [None, Some(1), Some(13)] {
            let (out, lse) = poisoned(case.scale())
                .with_num_splits(splits)
                .forward_with_lse(&q, &k, &v)?;
            let got = host_f64(&out)?;
            assert!(got.iter().all(|x| x.is_finite()), "non-finite output");
            // ×100 logits amplify the fp32 rounding of q·k a hundredfold, so allow 10× more.
            let (atol, rtol) = common::tolerance(dtype);
            let worst = common::worst_violation(&got, &want.out, (10.0 * atol, 10.0 * rtol));
            assert!(
                worst <= 1.0,
                "x100 {dtype:?} {splits:?}: {worst:.2}× the tolerance"
            );
            assert_lse_close(
                &format!("x100 {dtype:?} {splits:?}"),
                &lse,
                &want.lse,
                dtype,
            )?;
        }
    }
    Ok(())
}

#[test]
fn gpu_very_long_context() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let case = Case {
        b: 1,
        h_q: 32,
        h_kv: 8,
        d: 128,
        l: 262144,
        dtype: DType::BF16,
    };
    check_case(&dev, case, None)?;
    check_case(&dev, case, Some(1))?;
    println!("gpu_very_long_context: L = 262144 passed");
    Ok(())
}

#[test]
fn gpu_head_major_cache_view() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    for dtype in DTYPES {
        let (b, h_q, h_kv, d, cap, len) = (2, 9, 3, 64, 5000, 4097);
        let q = Tensor::randn(0f32, 1.0, (b, 1, h_q, d), &dev)?.to_dtype(dtype)?;
        let (k_view, k_dense) = common::head_major_view(b, h_kv, cap, len, d, dtype, &dev)?;
        let (v_view, v_dense) = common::head_major_view(b, h_kv, cap, len, d, dtype, &dev)?;
        assert!(!k_view.is_contiguous());
        let scale = 0.125;
        let out = poisoned(scale).forward(&q, &k_view, &v_view)?;
        let want = reference(&q, &k_dense, &v_dense, scale, None)?;
        assert_close(&format!("head-major {dtype:?}"), &out, &want.out, dtype)?;
    }
    Ok(())
}

#[test]
fn gpu_varlen() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    for dtype in DTYPES {
        let case = Case {
            b: 4,
            h_q: 14,
            h_kv: 2,
            d: 96,
            l: 9000,
            dtype,
        };
        let (q, k, v) = common::random_qkv(&case, &dev)?;
        let lens = [9000u32, 0, 1, 4097];
        let seqlens = Tensor::new(&lens, &dev)?;
        for splits in [None, Some(1), Some(5)] {
            let op = poisoned(case.scale())
                .with_seqlens(seqlens.clone())
                .with_num_splits(splits);
            let (out, lse) = op.forward_with_lse(&q, &k, &v)?;
            let want = reference(&q, &k, &v, case.scale(), Some(&lens))?;
            let what = format!("varlen {dtype:?} {splits:?}");
            assert_close(&what, &out, &want.out, dtype)?;
            assert_lse_close(&what, &lse, &want.lse, dtype)?;
            assert!(
                host_f64(&out.i(1)?)?.iter().all(|&x| x == 0.0),
                "{what}: empty row not zero"
            );
        }
    }
    Ok(())
}

/// More work items than resident CTAs: the tensor-core kernels then run one wave of persistent
/// CTAs whose warps stream on across item boundaries. Ragged lengths (empty, one position,
/// partial tiles) make warps skip items and leave tiles half full.
#[test]
fn gpu_persistent_grid() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut count = 0;
    // (batch, h_q, h_kv, d): each has more (batch, kv head) pairs than the GPU holds CTAs.
    for (b, h_q, h_kv, d) in [
        (40, 32, 8, 128),
        (40, 8, 8, 64),
        (40, 12, 4, 256),
        (70, 48, 4, 96),
        (40, 32, 8, 96),
        (40, 16, 4, 80),
    ] {
        for dtype in [DType::BF16, DType::F16] {
            let case = Case {
                b,
                h_q,
                h_kv,
                d,
                l: 600,
                dtype,
            };
            let (q, k, v) = common::random_qkv(&case, &dev)?;
            let pattern = [600u32, 0, 1, 17, 333, 599];
            let lens: Vec<u32> = (0..b).map(|i| pattern[i % pattern.len()]).collect();
            let seqlens = Tensor::new(lens.as_slice(), &dev)?;
            let want = reference(&q, &k, &v, case.scale(), Some(&lens))?;
            for splits in [None, Some(3)] {
                let op = poisoned(case.scale())
                    .with_seqlens(seqlens.clone())
                    .with_num_splits(splits);
                let (out, lse) = op.forward_with_lse(&q, &k, &v)?;
                let what = format!("persistent {case:?} splits {splits:?}");
                assert_close(&what, &out, &want.out, dtype)?;
                assert_lse_close(&what, &lse, &want.lse, dtype)?;
                count += 1;
            }
        }
    }
    println!("gpu_persistent_grid: {count} cases passed");
    Ok(())
}

#[test]
fn gpu_matches_cpu_op() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    for dtype in DTYPES {
        let case = Case {
            b: 3,
            h_q: 32,
            h_kv: 8,
            d: 128,
            l: 12345,
            dtype,
        };
        let (q, k, v) = common::random_qkv(&case, &Device::Cpu)?;
        let cpu = SplitKvAttention::new(case.scale()).forward(&q, &k, &v)?;
        let gpu_out = poisoned(case.scale()).forward(
            &q.to_device(&dev)?,
            &k.to_device(&dev)?,
            &v.to_device(&dev)?,
        )?;
        let (a, b) = (host_f64(&cpu)?, host_f64(&gpu_out)?);
        let worst = common::worst_violation(&b, &a, common::tolerance(dtype));
        assert!(
            worst <= 1.0,
            "GPU and CPU differ ({worst:.2}× the {dtype:?} tolerance)"
        );
    }
    Ok(())
}

/// The last CTA of each (batch, kv head) resets its arrival counter, so calls of other shapes and
/// split counts that reuse the counters right after must merge correctly, every time.
#[test]
fn gpu_last_cta_merge_back_to_back() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let shapes = [
        (1, 32, 8, 20),
        (3, 10, 5, 17),
        (1, 32, 8, 33),
        (2, 8, 2, 129),
        (3, 10, 5, 40),
    ];
    let mut count = 0;
    for round in 0..2 {
        for (b, h_q, h_kv, splits) in shapes {
            let case = Case {
                b,
                h_q,
                h_kv,
                d: 64,
                l: 9000,
                dtype: DType::F16,
            };
            let (q, k, v) = common::random_qkv(&case, &dev)?;
            let want = reference(&q, &k, &v, case.scale(), None)?;
            let (out, lse) = poisoned(case.scale())
                .with_num_splits(Some(splits))
                .forward_with_lse(&q, &k, &v)?;
            let what = format!("round {round}, {case:?}, {splits} splits");
            assert_close(&what, &out, &want.out, case.dtype)?;
            assert_lse_close(&what, &lse, &want.lse, case.dtype)?;
            count += 1;
        }
    }
    println!("gpu_last_cta_merge_back_to_back: {count} calls merged correctly");
    Ok(())
}

#[test]
fn gpu_rejects_bad_inputs() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let q = Tensor::zeros((1, 1, 8, 64), DType::F32, &dev)?;
    let k_cpu = Tensor::zeros((1, 16, 8, 64), DType::F32, &Device::Cpu)?;
    let v = Tensor::zeros((1, 16, 8, 64), DType::F32, &dev)?;
    let err = candle_splitkv::flash_decode(&q, &k_cpu, &v, 1.0).unwrap_err();
    assert!(err.to_string().contains("same device"), "{err}");
    let k = Tensor::zeros((1, 16, 8, 64), DType::F32, &dev)?;
    // More query tokens than the decode kernels take run the prefill kernels: 16-bit only.
    let q17 = Tensor::zeros((1, 17, 8, 64), DType::F32, &dev)?;
    let err = candle_splitkv::flash_decode(&q17, &k, &v, 1.0).unwrap_err();
    assert!(err.to_string().contains("f16 or bf16"), "{err}");
    let seqlens_cpu = Tensor::new(&[3u32], &Device::Cpu)?;
    let err = candle_splitkv::flash_decode_varlen(&q, &k, &v, &seqlens_cpu, 1.0).unwrap_err();
    assert!(
        err.to_string().contains("seqlens_k must be on q's device"),
        "{err}"
    );
    // A view starting mid-row is not 16-byte aligned.
    let wide = Tensor::zeros((1, 16, 8, 65), DType::F32, &dev)?;
    let k_odd = wide.narrow(3, 1, 64)?;
    let err = candle_splitkv::flash_decode(&q, &k_odd, &v, 1.0).unwrap_err();
    assert!(err.to_string().contains("16-byte boundary"), "{err}");
    let err = SplitKvAttention::new(1.0)
        .with_cuda_kernel(CudaKernel::TensorCore)
        .forward(&q, &k, &v)
        .unwrap_err();
    assert!(err.to_string().contains("f16 or bf16"), "{err}");
    Ok(())
}

/// Checks every combination of shape `(b, h_q, h_kv, d, l)`, dtype and split count against the
/// reference; returns how many ran.
fn check_shapes(
    dev: &Device,
    shapes: &[(usize, usize, usize, usize, usize)],
    dtypes: &[DType],
    splits: &[Option<usize>],
) -> Result<usize> {
    let mut count = 0;
    for &(b, h_q, h_kv, d, l) in shapes {
        for &dtype in dtypes {
            let case = Case {
                b,
                h_q,
                h_kv,
                d,
                l,
                dtype,
            };
            for &n in splits {
                check_case(dev, case, n)?;
                count += 1;
            }
        }
    }
    Ok(count)
}

/// Groups wider than a CUDA block holds run as several blocks of query heads per kv head, all
/// reading its K and V in one launch: 48 (3 × 16), 20 (2 × 10), 2 × 32 (2 × 2 × 16), 2 × 48.
/// Groups the blocks do not divide are padded inside the kernels: 71 (5 × 15), 17 (2 × 9),
/// 2 × 17 (2 × 2 × 9), also at a batch that takes the persistent grid.
#[test]
fn gpu_wide_groups() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let shapes = [
        (2, 48, 1, 128, 3000),
        (3, 20, 1, 128, 700),
        (1, 71, 1, 64, 5000),
        (1, 17, 1, 64, 300),
        (2, 34, 2, 128, 900),
        (1, 64, 2, 64, 2000),
        (2, 96, 2, 128, 1500),
        (64, 34, 2, 128, 600),
    ];
    let count = check_shapes(&dev, &shapes, &DTYPES, &[None, Some(5)])?;
    println!("gpu_wide_groups: {count} cases passed");
    Ok(())
}

/// Wide groups with long chunks (several of the lockstep forms' barrier intervals), merged in
/// every way: no split, by the last CTA, and by the combine pass (12 splits of 16-head blocks
/// exceed what the last CTA reads back).
#[test]
fn gpu_wide_groups_long_chunks() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let shapes = [
        (3, 48, 1, 128, 9000),
        (2, 71, 1, 64, 12000),
        (1, 40, 2, 96, 7000),
    ];
    let count = check_shapes(&dev, &shapes, &DTYPES, &[None, Some(1), Some(3), Some(12)])?;
    println!("gpu_wide_groups_long_chunks: {count} cases passed");
    Ok(())
}

/// Wide groups with enough K/V that their plans fill two CTAs per SM, with the blocks in lock step
/// on sm_90 where the clusters fit (all of them, or after trimming the splits), or not where they
/// do not.
#[test]
fn gpu_wide_groups_filling() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let shapes = [
        (8, 48, 1, 128, 8192),
        (4, 71, 1, 64, 16384),
        (16, 71, 1, 64, 4096),
        (4, 64, 2, 128, 8192),
    ];
    let count = check_shapes(&dev, &shapes, &[DType::F16, DType::BF16], &[None, Some(3)])?;
    println!("gpu_wide_groups_filling: {count} cases passed");
    Ok(())
}

#[cfg(feature = "cuda")]
#[test]
fn gpu_retain_freed_device_memory() -> Result<()> {
    use cudarc::driver::{result, sys};
    let Some(dev) = gpu() else { return Ok(()) };
    let Device::Cuda(cuda) = &dev else {
        unreachable!("gpu() returns a CUDA device")
    };
    let context = cuda.cuda_stream().context().clone();
    if !context.has_async_alloc() {
        eprintln!("device has no memory pool: nothing to check");
        return Ok(());
    }
    let threshold = || -> Result<u64> {
        let mut value = 0u64;
        unsafe {
            let pool = result::device::get_mem_pool(context.cu_device())
                .map_err(candle_core::Error::wrap)?;
            result::mem_pool::get_attribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut value as *mut u64).cast(),
            )
            .map_err(candle_core::Error::wrap)?;
        }
        Ok(value)
    };
    candle_splitkv::retain_freed_device_memory(&dev)?;
    assert_eq!(
        threshold()?,
        u64::MAX,
        "the pool still releases freed memory"
    );
    Ok(())
}

/// Each split owns a fixed chunk and each warp fixed tiles, so the same inputs give bitwise the
/// same output on every run, whichever path merges the splits.
#[test]
fn gpu_output_is_repeatable() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    for (l, dtype) in [(70000, DType::BF16), (3000, DType::F16), (9000, DType::F32)] {
        let case = Case {
            b: 2,
            h_q: 32,
            h_kv: 8,
            d: 128,
            l,
            dtype,
        };
        let (q, k, v) = common::random_qkv(&case, &dev)?;
        let op = poisoned(case.scale());
        let (out, lse) = op.forward_with_lse(&q, &k, &v)?;
        let (first, first_lse) = (host_f64(&out)?, host_f64(&lse)?);
        for run in 1..4 {
            let (out, lse) = op.forward_with_lse(&q, &k, &v)?;
            let same =
                |a: &[f64], b: &[f64]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(
                same(&host_f64(&out)?, &first) && same(&host_f64(&lse)?, &first_lse),
                "run {run} differs from the first ({dtype:?}, L = {l})"
            );
        }
    }
    Ok(())
}
