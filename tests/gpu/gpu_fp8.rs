//! fp8 (e4m3) K/V on CUDA against the f64 reference computed on the dequantized K/V (stored
//! value × scale), with q's tolerance; outputs and split scratch are poisoned with NaN first.
//! The error that e4m3 rounding itself adds is bounded in tests/cpu/cpu_fp8.rs; here the GPU also
//! agrees with the CPU op on the same stored bytes.
//!
//! Skips with a notice where no CUDA device exists.

use candle_core::{DType, Device, Result, Tensor};
use candle_splitkv::{
    dequantize_e4m3, quantize_e4m3, quantize_e4m3_into, CudaKernel, SplitKvAttention, E4M3_MAX,
    MAX_QUERY_TOKENS, SUPPORTED_HEAD_DIMS,
};

use crate::common::{
    assert_close, assert_lse_close, gpu, gpu_for_fp8, host_f64, max_abs_diff, poisoned, reference,
};

/// Random `shape` in e4m3 with a per-tensor scale that maps its largest magnitude to ±448, the
/// top of the range: the stored tensor on `dev`, the scale, and the real values (f32, on `dev`).
fn quantized(shape: (usize, usize, usize, usize), dev: &Device) -> Result<(Tensor, f32, Tensor)> {
    // Quantized on the CPU, so that the stored bytes do not depend on a device's cast.
    let x = Tensor::randn(0f32, 1.0, shape, &Device::Cpu)?;
    let max = x.abs()?.max_all()?.to_scalar::<f32>()?;
    let scale = max / E4M3_MAX;
    let stored = (x / f64::from(scale))?.to_dtype(DType::F8E4M3)?;
    let real = (stored.to_dtype(DType::F32)? * f64::from(scale))?;
    Ok((stored.to_device(dev)?, scale, real.to_device(dev)?))
}

/// One call's sizes, with q in `dtype` (f16 or bf16) and K/V in e4m3.
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

/// q, the stored K and V with their scales, and the real K and V.
struct Inputs {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_scale: f32,
    v_scale: f32,
    k_real: Tensor,
    v_real: Tensor,
}

impl Shape {
    fn scale(&self) -> f32 {
        1.0 / (self.d as f32).sqrt()
    }

    fn inputs(&self, dev: &Device) -> Result<Inputs> {
        let q = Tensor::randn(0f32, 1.0, (self.b, self.t, self.h_q, self.d), dev)?
            .to_dtype(self.dtype)?;
        let (k, k_scale, k_real) = quantized((self.b, self.l, self.h_kv, self.d), dev)?;
        let (v, v_scale, v_real) = quantized((self.b, self.l, self.h_kv, self.d), dev)?;
        Ok(Inputs {
            q,
            k,
            v,
            k_scale,
            v_scale,
            k_real,
            v_real,
        })
    }
}

impl Inputs {
    fn op(&self, scale: f32) -> SplitKvAttention {
        poisoned(scale).with_kv_scales(self.k_scale, self.v_scale)
    }
}

/// Runs `shape` with each split count and compares output and LSE with the reference.
fn check(dev: &Device, shape: Shape, splits: &[Option<usize>], lens: Option<&[u32]>) -> Result<()> {
    let x = shape.inputs(dev)?;
    let want = reference(&x.q, &x.k_real, &x.v_real, shape.scale(), lens)?;
    let seqlens = lens.map(|l| Tensor::new(l, dev)).transpose()?;
    for &n in splits {
        let mut op = x.op(shape.scale()).with_num_splits(n);
        if let Some(s) = &seqlens {
            op = op.with_seqlens(s.clone());
        }
        let (out, lse) = op.forward_with_lse(&x.q, &x.k, &x.v)?;
        assert_eq!(out.dtype(), shape.dtype);
        assert_eq!(out.dims(), x.q.dims());
        let what = format!("fp8 {shape:?} splits {n:?} lens {lens:?}");
        assert_close(&what, &out, &want.out, shape.dtype)?;
        assert_lse_close(&what, &lse, &want.lse, shape.dtype)?;
    }
    Ok(())
}

#[test]
fn gpu_fp8_every_head_dim_group_and_length() -> Result<()> {
    let Some(dev) = gpu_for_fp8("gpu_fp8_every_head_dim_group_and_length")? else {
        return Ok(());
    };
    let mut count = 0;
    for dtype in [DType::BF16, DType::F16] {
        for d in SUPPORTED_HEAD_DIMS {
            for (h_q, h_kv) in [(8, 8), (8, 2), (9, 3), (16, 2), (32, 8), (16, 1), (40, 2)] {
                // 257 and 4097 end mid-tile; 1 is a single position.
                for l in [1, 257, 4097] {
                    let shape = Shape {
                        b: 2,
                        t: 1,
                        h_q,
                        h_kv,
                        d,
                        l,
                        dtype,
                    };
                    check(&dev, shape, &[None, Some(3)], None)?;
                    count += 1;
                }
            }
        }
    }
    println!("gpu_fp8_every_head_dim_group_and_length: {count} shapes passed");
    Ok(())
}

/// Several query tokens: t × group rows, one tile up to 16 rows and blocks of rows past it.
#[test]
fn gpu_fp8_query_tokens() -> Result<()> {
    let Some(dev) = gpu_for_fp8("gpu_fp8_query_tokens")? else {
        return Ok(());
    };
    for t in [2, 3, 5, 8, MAX_QUERY_TOKENS] {
        for (h_q, h_kv, d) in [(32, 8, 128), (8, 2, 64), (12, 1, 96), (4, 4, 80)] {
            for l in [t - 1, t + 1, 3000] {
                let shape = Shape {
                    b: 2,
                    t,
                    h_q,
                    h_kv,
                    d,
                    l: l.max(1),
                    dtype: DType::BF16,
                };
                check(&dev, shape, &[None, Some(4)], None)?;
            }
        }
    }
    Ok(())
}

/// Split counts from one to many agree within fp32 rounding, whichever merge the plan picks.
#[test]
fn gpu_fp8_split_counts_agree() -> Result<()> {
    let Some(dev) = gpu_for_fp8("gpu_fp8_split_counts_agree")? else {
        return Ok(());
    };
    for (t, l) in [(1, 40000), (4, 20000), (1, 900)] {
        let shape = Shape {
            b: 1,
            t,
            h_q: 32,
            h_kv: 8,
            d: 128,
            l,
            dtype: DType::BF16,
        };
        let x = shape.inputs(&dev)?;
        let want = reference(&x.q, &x.k_real, &x.v_real, shape.scale(), None)?;
        let one = host_f64(
            &x.op(shape.scale())
                .with_num_splits(Some(1))
                .forward(&x.q, &x.k, &x.v)?,
        )?;
        for n in [None, Some(2), Some(7), Some(16), Some(33), Some(100)] {
            let (out, lse) = x
                .op(shape.scale())
                .with_num_splits(n)
                .forward_with_lse(&x.q, &x.k, &x.v)?;
            let what = format!("fp8 {shape:?} splits {n:?}");
            assert_close(&what, &out, &want.out, shape.dtype)?;
            assert_lse_close(&what, &lse, &want.lse, shape.dtype)?;
            let diff = max_abs_diff(&host_f64(&out)?, &one);
            assert!(diff <= 8e-3, "{what}: differs from one split by {diff}");
        }
    }
    Ok(())
}

/// Per-sequence lengths, some below t, and grids large enough for the persistent form.
#[test]
fn gpu_fp8_varlen_and_persistent() -> Result<()> {
    let Some(dev) = gpu_for_fp8("gpu_fp8_varlen_and_persistent")? else {
        return Ok(());
    };
    let lens = [4097u32, 1000, 5, 1, 0, 16];
    for (t, h_q, h_kv, d) in [(1, 32, 8, 128), (6, 8, 2, 64), (3, 12, 1, 256)] {
        let shape = Shape {
            b: lens.len(),
            t,
            h_q,
            h_kv,
            d,
            l: 4097,
            dtype: DType::BF16,
        };
        check(&dev, shape, &[None, Some(1), Some(4)], Some(&lens))?;
    }
    for (b, t, h_q, h_kv, l) in [
        (16, 1, 32, 8, 9000),
        (64, 2, 32, 32, 1500),
        (1, 8, 64, 8, 30000),
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
        check(&dev, shape, &[None], None)?;
    }
    Ok(())
}

/// The cache seen through a head-major buffer's transposed view, and q narrowed out of a wider
/// token dimension.
#[test]
fn gpu_fp8_strided_views() -> Result<()> {
    let Some(dev) = gpu_for_fp8("gpu_fp8_strided_views")? else {
        return Ok(());
    };
    let (b, t, h_q, h_kv, d, cap, len) = (2, 3, 12, 3, 128, 3000, 2049);
    let wide = Tensor::randn(0f32, 1.0, (b, t + 2, h_q, d), &dev)?.to_dtype(DType::BF16)?;
    let q = wide.narrow(1, 1, t)?;
    let (k_buf, k_scale, k_real) = quantized((b, h_kv, cap, d), &dev)?;
    let (v_buf, v_scale, v_real) = quantized((b, h_kv, cap, d), &dev)?;
    let view = |x: &Tensor| x.narrow(2, 0, len)?.transpose(1, 2);
    let (k, v) = (view(&k_buf)?, view(&v_buf)?);
    assert!(!k.is_contiguous() && !q.is_contiguous());
    let want = reference(&q, &view(&k_real)?, &view(&v_real)?, 0.1, None)?;
    let (out, lse) = poisoned(0.1)
        .with_kv_scales(k_scale, v_scale)
        .forward_with_lse(&q, &k, &v)?;
    assert_close("fp8 strided", &out, &want.out, DType::BF16)?;
    assert_lse_close("fp8 strided", &lse, &want.lse, DType::BF16)
}

/// The GPU and the CPU op agree on the same stored bytes and scales.
#[test]
fn gpu_fp8_matches_cpu() -> Result<()> {
    let Some(dev) = gpu_for_fp8("gpu_fp8_matches_cpu")? else {
        return Ok(());
    };
    let shape = Shape {
        b: 2,
        t: 4,
        h_q: 32,
        h_kv: 8,
        d: 128,
        l: 5000,
        dtype: DType::F16,
    };
    let x = shape.inputs(&dev)?;
    let gpu_out = x.op(shape.scale()).forward(&x.q, &x.k, &x.v)?;
    let cpu = Device::Cpu;
    let cpu_out = SplitKvAttention::new(shape.scale())
        .with_kv_scales(x.k_scale, x.v_scale)
        .forward(
            &x.q.to_device(&cpu)?,
            &x.k.to_device(&cpu)?,
            &x.v.to_device(&cpu)?,
        )?;
    let diff = max_abs_diff(&host_f64(&gpu_out)?, &host_f64(&cpu_out)?);
    assert!(diff < 4e-3, "GPU and CPU differ by {diff}");
    Ok(())
}

/// What CUDA does not run with fp8 K/V is a clear error.
#[test]
fn gpu_fp8_rejects_what_it_does_not_run() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let (k, _, _) = quantized((1, 64, 2, 64), &dev)?;
    let message = |r: Result<Tensor>| r.err().map(|e| e.to_string()).unwrap_or_default();
    let q32 = Tensor::randn(0f32, 1.0, (1, 1, 4, 64), &dev)?;
    assert!(message(SplitKvAttention::new(0.1).forward(&q32, &k, &k)).contains("f16 or bf16"));
    let q = q32.to_dtype(DType::BF16)?;
    let cuda_cores = SplitKvAttention::new(0.1).with_cuda_kernel(CudaKernel::CudaCore);
    assert!(message(cuda_cores.forward(&q, &k, &k)).contains("tensor-core"));
    // Rows must start on 16-byte boundaries: 16 fp8 elements.
    let (wide, _, _) = quantized((1, 64, 2, 72), &dev)?;
    let odd = wide.narrow(3, 8, 64)?;
    assert!(message(SplitKvAttention::new(0.1).forward(&q, &odd, &odd)).contains("16-byte"));
    Ok(())
}

/// The conversions write the same bytes as on the CPU: rounding to nearest even, saturation at
/// ±448 (never NaN from a finite value), NaN kept; and read them back alike.
#[test]
fn gpu_fp8_conversions_match_cpu() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let cpu = Device::Cpu;
    let mut values = (Tensor::randn(0f32, 1.0, 100_001, &cpu)? * 300.0)?.to_vec1::<f32>()?;
    values.extend([1e6, -1e6, 448.0, 464.0, -480.0, 1e-7, -0.0, f32::NAN]);
    let x = Tensor::new(values.as_slice(), &cpu)?;
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let x = x.to_dtype(dtype)?;
        for scale in [1.0f32, 0.37, 3.0] {
            let bits = |t: Tensor| -> Result<Vec<u8>> {
                let stored = t
                    .to_device(&cpu)?
                    .flatten_all()?
                    .to_vec1::<float8::F8E4M3>()?;
                Ok(stored.iter().map(|v| v.to_bits()).collect())
            };
            let on_gpu = quantize_e4m3(&x.to_device(&dev)?, scale)?;
            let on_cpu = quantize_e4m3(&x, scale)?;
            assert_eq!(
                bits(on_gpu.clone())?,
                bits(on_cpu.clone())?,
                "{dtype:?} scale {scale}"
            );
            let back_gpu = host_f64(&dequantize_e4m3(&on_gpu, scale, dtype)?)?;
            let back_cpu = host_f64(&dequantize_e4m3(&on_cpu, scale, dtype)?)?;
            let n = back_cpu.len();
            // Saturated, never NaN, for every finite input (up to the rounding of the result
            // dtype); NaN for the NaN.
            let top = 448.0 * f64::from(scale) * 1.01;
            assert!(back_gpu[..n - 1].iter().all(|v| v.abs() <= top));
            assert!(back_gpu[n - 1].is_nan());
            let same = back_gpu[..n - 1] == back_cpu[..n - 1];
            assert!(same, "{dtype:?} scale {scale}: dequantized values differ");
        }
    }
    Ok(())
}

/// Strided views convert as their contiguous copies do: a cache's transposed K/V, read back by
/// the prefill paths, and a narrowed input.
#[test]
fn gpu_fp8_conversions_take_strided_views() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let x = Tensor::randn(0f32, 1.0, (2, 3, 50, 16), &dev)?.to_dtype(DType::BF16)?;
    let stored = quantize_e4m3(&x, 0.5)?;
    let view = stored.narrow(2, 5, 40)?.transpose(1, 2)?;
    assert!(!view.is_contiguous());
    let got = host_f64(&dequantize_e4m3(&view, 0.5, DType::F32)?)?;
    let cpu_view = stored
        .to_device(&Device::Cpu)?
        .narrow(2, 5, 40)?
        .transpose(1, 2)?;
    let want = host_f64(&dequantize_e4m3(&cpu_view, 0.5, DType::F32)?)?;
    assert_eq!(got, want);
    let wide = x.narrow(3, 4, 8)?;
    let got = quantize_e4m3(&wide, 0.5)?.to_device(&Device::Cpu)?;
    let want = quantize_e4m3(&wide.to_device(&Device::Cpu)?, 0.5)?;
    assert_eq!(
        host_f64(&dequantize_e4m3(&got, 1.0, DType::F32)?)?,
        host_f64(&dequantize_e4m3(&want, 1.0, DType::F32)?)?
    );
    Ok(())
}

/// New rows written straight into a cache slot (a strided fp8 view) hold the CPU's bytes, and
/// nothing outside the slot changes.
#[test]
fn gpu_fp8_quantize_into_a_cache_slot() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let cpu = Device::Cpu;
    let start = (Tensor::randn(0f32, 1.0, (2, 3, 40, 64), &cpu)? * 10.0)?;
    let rows = (Tensor::randn(0f32, 1.0, (2, 5, 3, 64), &cpu)? * 100.0)?.to_dtype(DType::BF16)?;
    let on_cpu = quantize_e4m3(&start, 0.25)?;
    let on_gpu = quantize_e4m3(&start.to_device(&dev)?, 0.25)?;
    quantize_e4m3_into(&on_cpu.narrow(2, 17, 5)?, &rows.transpose(1, 2)?, 0.25)?;
    let gpu_rows = rows.to_device(&dev)?;
    quantize_e4m3_into(&on_gpu.narrow(2, 17, 5)?, &gpu_rows.transpose(1, 2)?, 0.25)?;
    let back = |t: &Tensor| host_f64(&dequantize_e4m3(t, 1.0, DType::F32)?);
    assert_eq!(back(&on_gpu)?, back(&on_cpu)?);
    Ok(())
}
