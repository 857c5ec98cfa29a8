//! fp8 (e4m3) K/V on the CPU: against the f64 reference on the dequantized K/V, and against the
//! unquantized K/V within the error that e4m3 rounding can cause.

use candle_core::{DType, Device, Result, Tensor};
use candle_splitkv::{SplitKvAttention, E4M3_MAX, SUPPORTED_HEAD_DIMS};

use crate::common::{assert_close, assert_lse_close, host_f64, reference};

/// e4m3's unit roundoff (3 mantissa bits), and half the spacing of its subnormals: the most a
/// value within range moves when rounded to it, relatively and absolutely.
const E4M3_UNIT_ROUNDOFF: f64 = 1.0 / 16.0;
const E4M3_HALF_SUBNORMAL: f64 = 1.0 / 1024.0;

fn random(shape: (usize, usize, usize, usize), dtype: DType) -> Result<Tensor> {
    Tensor::randn(0f32, 1.0, shape, &Device::Cpu)?.to_dtype(dtype)
}

/// `x` stored in e4m3 with a per-tensor scale that maps its largest magnitude to the top of the
/// range: the stored tensor, the scale, and the real values the stored ones stand for.
fn quantize(x: &Tensor) -> Result<(Tensor, f32, Tensor)> {
    let max = x
        .abs()?
        .max_all()?
        .to_dtype(DType::F64)?
        .to_scalar::<f64>()?;
    let scale = (max / f64::from(E4M3_MAX)) as f32;
    let stored = (x / f64::from(scale))?.to_dtype(DType::F8E4M3)?;
    let real = (stored.to_dtype(DType::F32)? * f64::from(scale))?;
    Ok((stored, scale, real))
}

#[test]
fn fp8_kv_matches_the_reference_on_the_dequantized_cache() -> Result<()> {
    let mut count = 0;
    for q_dtype in [DType::F32, DType::F16, DType::BF16] {
        for d in SUPPORTED_HEAD_DIMS {
            for (h_q, h_kv) in [(8, 8), (9, 3), (16, 1), (32, 8)] {
                for (t, l) in [(1, 700), (4, 1500)] {
                    let b = 2;
                    let q = random((b, t, h_q, d), q_dtype)?;
                    let (k8, k_scale, k_real) = quantize(&random((b, l, h_kv, d), DType::F32)?)?;
                    let (v8, v_scale, v_real) = quantize(&random((b, l, h_kv, d), DType::F32)?)?;
                    let scale = 1.0 / (d as f32).sqrt();
                    let want = reference(&q, &k_real, &v_real, scale, None)?;
                    for splits in [None, Some(3)] {
                        let op = SplitKvAttention::new(scale)
                            .with_num_splits(splits)
                            .with_kv_scales(k_scale, v_scale);
                        let (out, lse) = op.forward_with_lse(&q, &k8, &v8)?;
                        assert_eq!(out.dtype(), q_dtype);
                        let what = format!("{q_dtype:?} d {d} {h_q}/{h_kv} t {t} {splits:?}");
                        assert_close(&what, &out, &want.out, q_dtype)?;
                        assert_lse_close(&what, &lse, &want.lse, q_dtype)?;
                        count += 1;
                    }
                }
            }
        }
    }
    println!("fp8_kv_matches_the_reference_on_the_dequantized_cache: {count} cases");
    Ok(())
}

/// Rounding K moves each score by at most δ = scale · Σ_j |q_j| · (u·|k_j| + a) (u the unit
/// roundoff, a half the subnormal spacing, in real units), so every softmax weight moves by a
/// factor within e^±2Δ, Δ the largest δ of the row; rounding V moves each value by at most
/// u·|v| + a. The output, a convex combination of the values, then moves by at most
/// max|v| · (e^2Δ − 1) + u · max|v| + a per column (to first order in the value error).
#[test]
fn fp8_kv_stays_within_the_e4m3_error_bound() -> Result<()> {
    let (b, t, h_q, h_kv, d, l) = (1, 3, 8, 2, 128, 2000);
    let group = h_q / h_kv;
    let q = random((b, t, h_q, d), DType::F32)?;
    let k = random((b, l, h_kv, d), DType::F32)?;
    let v = random((b, l, h_kv, d), DType::F32)?;
    let (k8, k_scale, _) = quantize(&k)?;
    let (v8, v_scale, _) = quantize(&v)?;
    let scale = 1.0 / (d as f32).sqrt();
    let exact = reference(&q, &k, &v, scale, None)?;
    let got = host_f64(
        &SplitKvAttention::new(scale)
            .with_kv_scales(k_scale, v_scale)
            .forward(&q, &k8, &v8)?,
    )?;
    let (qh, kh, vh) = (host_f64(&q)?, host_f64(&k)?, host_f64(&v)?);
    let (ka, va) = (
        E4M3_HALF_SUBNORMAL * f64::from(k_scale),
        E4M3_HALF_SUBNORMAL * f64::from(v_scale),
    );
    let mut worst_share = 0f64;
    for token in 0..t {
        for h in 0..h_q {
            let g = h / group;
            let qrow = &qh[((token * h_q) + h) * d..][..d];
            let visible = l - t + token + 1;
            let delta = (0..visible)
                .map(|pos| {
                    let krow = &kh[(pos * h_kv + g) * d..][..d];
                    f64::from(scale)
                        * qrow
                            .iter()
                            .zip(krow)
                            .map(|(q, k)| q.abs() * (E4M3_UNIT_ROUNDOFF * k.abs() + ka))
                            .sum::<f64>()
                })
                .fold(0f64, f64::max);
            for c in 0..d {
                let vmax = (0..visible)
                    .map(|pos| vh[(pos * h_kv + g) * d + c].abs())
                    .fold(0f64, f64::max);
                let bound = vmax * ((2.0 * delta).exp() - 1.0) + E4M3_UNIT_ROUNDOFF * vmax + va;
                let at = ((token * h_q) + h) * d + c;
                let err = (got[at] - exact.out[at]).abs();
                assert!(
                    err <= bound + 1e-5,
                    "token {token} head {h} column {c}: error {err} past the bound {bound}"
                );
                worst_share = worst_share.max(err / bound);
            }
        }
    }
    println!("fp8 error at most {worst_share:.3} of the bound");
    Ok(())
}

#[test]
fn scales_apply_to_the_real_values() -> Result<()> {
    // The same stored K/V with scales 1 and s·k, s·v: the scores scale by s_k (as if the softmax
    // scale did), the outputs by s_v.
    let (b, t, h_q, h_kv, d, l) = (2, 2, 4, 2, 64, 300);
    let q = random((b, t, h_q, d), DType::F32)?;
    let k8 = (random((b, l, h_kv, d), DType::F32)? * 4.0)?.to_dtype(DType::F8E4M3)?;
    let v8 = (random((b, l, h_kv, d), DType::F32)? * 4.0)?.to_dtype(DType::F8E4M3)?;
    let (s_k, s_v) = (0.25f32, 3.0f32);
    let scaled = SplitKvAttention::new(0.125)
        .with_kv_scales(s_k, s_v)
        .forward(&q, &k8, &v8)?;
    let plain = SplitKvAttention::new(0.125 * s_k).forward(&q, &k8, &v8)?;
    let want: Vec<f64> = host_f64(&plain)?
        .iter()
        .map(|x| x * f64::from(s_v))
        .collect();
    assert_close("scales", &scaled, &want, DType::F32)
}

#[test]
fn fp8_inputs_are_checked() -> Result<()> {
    let q = random((1, 1, 4, 64), DType::BF16)?;
    let k8 = random((1, 16, 2, 64), DType::F32)?.to_dtype(DType::F8E4M3)?;
    let v16 = random((1, 16, 2, 64), DType::BF16)?;
    let message = |r: Result<Tensor>| r.err().map(|e| e.to_string()).unwrap_or_default();
    let op = SplitKvAttention::new(0.1);
    assert!(message(op.forward(&q, &k8, &v16)).contains("k and v must share one dtype"));
    let q8 = q.to_dtype(DType::F32)?.to_dtype(DType::F8E4M3)?;
    assert!(message(op.forward(&q8, &k8, &k8)).contains("is not supported"));
    for (k_scale, v_scale) in [
        (0.0, 1.0),
        (1.0, f32::NAN),
        (-2.0, 1.0),
        (1.0, f32::INFINITY),
    ] {
        let op = SplitKvAttention::new(0.1).with_kv_scales(k_scale, v_scale);
        assert!(
            message(op.forward(&q, &k8, &k8)).contains("must be finite and positive"),
            "scales {k_scale}, {v_scale}"
        );
    }
    Ok(())
}
