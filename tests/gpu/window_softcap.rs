//! The op's sliding window and logit soft-capping against the f64 reference, on the CPU and, where
//! one exists, on a CUDA device (both kernel families, and fp8 K/V): one and several query tokens,
//! every dtype, forced split counts, varlen with lengths inside and outside the window, wide
//! groups and grids of many waves, with the output and split scratch filled with NaN first. Then
//! the errors for a window of 0 and a cap ≤ 0.

use candle_core::{DType, Device, Result, Tensor};
use candle_splitkv::{CudaKernel, SplitKvAttention};

use crate::common::{
    assert_close, assert_lse_close, fp8_kv_built, gpu, poisoned, reference_masked,
};

fn random(shape: (usize, usize, usize, usize), dtype: DType, device: &Device) -> Result<Tensor> {
    Tensor::randn(0f32, 1.0, shape, device)?.to_dtype(dtype)
}

/// Every case on `device` with the kernel families in `kernels`.
fn check_device(device: &Device, dtypes: &[DType], kernels: &[CudaKernel]) -> Result<()> {
    for &dtype in dtypes {
        // (t, h_q, h_kv, d, L, window, softcap); softcap 50 as Gemma-2, 5 to bend most scores.
        for (t, h_q, h_kv, d, l, window, softcap) in [
            (1, 32, 8, 128, 3000, Some(1000), None),
            (1, 8, 2, 64, 700, Some(1), None),
            (1, 9, 3, 64, 500, None, Some(5.0)),
            (1, 16, 4, 128, 4100, Some(4096), Some(50.0)),
            (4, 8, 2, 128, 900, Some(100), Some(5.0)),
            (3, 14, 2, 80, 300, Some(2), None),
            (2, 4, 4, 256, 40, Some(500), Some(5.0)),
        ] {
            let b = 2;
            let q = random((b, t, h_q, d), dtype, device)?;
            let k = random((b, l, h_kv, d), dtype, device)?;
            let v = random((b, l, h_kv, d), dtype, device)?;
            let scale = 2.0 / (d as f32).sqrt();
            let want = reference_masked(&q, &k, &v, scale, None, window, softcap)?;
            for &kernel in kernels {
                if kernel == CudaKernel::TensorCore && dtype == DType::F32 {
                    continue;
                }
                for splits in [None, Some(1), Some(7)] {
                    let op = poisoned(scale)
                        .with_window_left(window)
                        .with_softcap(softcap)
                        .with_num_splits(splits)
                        .with_cuda_kernel(kernel);
                    let (out, lse) = op.forward_with_lse(&q, &k, &v)?;
                    let what = format!(
                        "{device:?} {kernel:?} {dtype:?} t={t} {h_q}/{h_kv} d={d} L={l} \
                         window={window:?} softcap={softcap:?} splits={splits:?}"
                    );
                    assert_close(&what, &out, &want.out, dtype)?;
                    assert_lse_close(&what, &lse, &want.lse, dtype)?;
                }
            }
            // Varlen: one sequence shorter than the window, one longer.
            let lens = [(window.unwrap_or(8) / 2).clamp(t, l) as u32, l as u32];
            let want = reference_masked(&q, &k, &v, scale, Some(&lens), window, softcap)?;
            for &kernel in kernels {
                if kernel == CudaKernel::TensorCore && dtype == DType::F32 {
                    continue;
                }
                let op = poisoned(scale)
                    .with_window_left(window)
                    .with_softcap(softcap)
                    .with_cuda_kernel(kernel)
                    .with_seqlens(Tensor::new(&lens, device)?);
                let out = op.forward(&q, &k, &v)?;
                let what =
                    format!("{device:?} {kernel:?} {dtype:?} varlen {lens:?} window={window:?}");
                assert_close(&what, &out, &want.out, dtype)?;
            }
        }
    }
    Ok(())
}

#[test]
fn window_and_softcap_match_the_reference_on_the_cpu() -> Result<()> {
    check_device(
        &Device::Cpu,
        &[DType::F32, DType::BF16],
        &[CudaKernel::Auto],
    )
}

#[test]
fn gpu_window_and_softcap_match_the_reference() -> Result<()> {
    let Some(gpu) = gpu() else { return Ok(()) };
    check_device(
        &gpu,
        &[DType::F32, DType::F16, DType::BF16],
        &[CudaKernel::TensorCore, CudaKernel::CudaCore],
    )
}

/// Shapes the planner runs differently: wide groups (blocks of query heads per kv head), grids
/// of more work items than the GPU holds (the windowed form has no persistent twin), and fp8 K/V
/// with scales, whose reference is taken on the dequantized values.
#[test]
fn gpu_window_and_softcap_wide_groups_many_items_and_fp8() -> Result<()> {
    let Some(gpu) = gpu() else { return Ok(()) };
    // (b, t, h_q, h_kv, d, L, window, softcap)
    for (b, t, h_q, h_kv, d, l, window, softcap) in [
        (1, 1, 64, 2, 128, 5000, Some(2048), Some(30.0)),
        (1, 1, 32, 8, 128, 8192, Some(4095), None),
        (2, 4, 48, 1, 64, 900, Some(300), None),
        (16, 1, 32, 8, 128, 6000, Some(4096), Some(50.0)),
        (3, 2, 16, 8, 256, 2500, Some(1000), Some(50.0)),
    ] {
        let dtype = DType::BF16;
        let q = random((b, t, h_q, d), dtype, &gpu)?;
        // On the host: candle's CUDA backend has no casts to fp8.
        let k = random((b, l, h_kv, d), DType::F32, &Device::Cpu)?;
        let v = random((b, l, h_kv, d), DType::F32, &Device::Cpu)?;
        let scale = 1.0 / (d as f32).sqrt();
        let what =
            format!("{b}×{t} {h_q}/{h_kv} d={d} L={l} window={window:?} softcap={softcap:?}");
        let (k16, v16) = (
            k.to_dtype(dtype)?.to_device(&gpu)?,
            v.to_dtype(dtype)?.to_device(&gpu)?,
        );
        let want = reference_masked(&q, &k16, &v16, scale, None, window, softcap)?;
        for splits in [None, Some(3)] {
            let op = poisoned(scale)
                .with_window_left(window)
                .with_softcap(softcap)
                .with_num_splits(splits);
            let out = op.forward(&q, &k16, &v16)?;
            assert_close(
                &format!("bf16 {what} splits={splits:?}"),
                &out,
                &want.out,
                dtype,
            )?;
        }
        if !fp8_kv_built() {
            continue;
        }
        // fp8: K and V stored divided by scales that map ±4 to ±448.
        let (k_scale, v_scale) = (4.0 / 448.0, 4.0 / 448.0);
        let k8 = (k / f64::from(k_scale))?.to_dtype(DType::F8E4M3)?;
        let v8 = (v / f64::from(v_scale))?.to_dtype(DType::F8E4M3)?;
        let k_real = (k8.to_dtype(DType::F32)? * f64::from(k_scale))?;
        let v_real = (v8.to_dtype(DType::F32)? * f64::from(v_scale))?;
        let want = reference_masked(&q, &k_real, &v_real, scale, None, window, softcap)?;
        let op = poisoned(scale)
            .with_window_left(window)
            .with_softcap(softcap)
            .with_kv_scales(k_scale, v_scale);
        let (out, lse) = op.forward_with_lse(&q, &k8.to_device(&gpu)?, &v8.to_device(&gpu)?)?;
        assert_close(&format!("fp8 {what}"), &out, &want.out, dtype)?;
        assert_lse_close(&format!("fp8 {what}"), &lse, &want.lse, dtype)?;
    }
    Ok(())
}

#[test]
fn bad_caps_are_errors_and_a_zero_window_sees_the_query_alone() -> Result<()> {
    let dev = Device::Cpu;
    let q = random((1, 1, 4, 64), DType::F32, &dev)?;
    let k = random((1, 10, 2, 64), DType::F32, &dev)?;
    let v = random((1, 10, 2, 64), DType::F32, &dev)?;
    let op = SplitKvAttention::new(0.125);
    // A window of 0 leaves each query its own position: the output is that position's value.
    let alone = op.clone().with_window_left(Some(0)).forward(&q, &k, &v)?;
    let own = v
        .narrow(1, 9, 1)?
        .unsqueeze(3)?
        .repeat((1, 1, 1, 2, 1))?
        .reshape((1, 1, 4, 64))?;
    let diff = (alone - own)?.abs()?.max_all()?.to_scalar::<f32>()?;
    assert!(diff < 1e-6, "window 0: {diff}");
    for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        let err = op
            .clone()
            .with_softcap(Some(bad))
            .forward(&q, &k, &k)
            .unwrap_err();
        assert!(
            err.to_string()
                .contains("softcap must be finite and positive"),
            "{err}"
        );
    }
    Ok(())
}
