//! An fp8 (e4m3) KV cache: writes store the real values divided by the scale, rounded to the
//! nearest e4m3 value and saturated at ±448 (never NaN); reads times the scale come back within
//! e4m3's rounding error; bad scales and dtypes are clear errors.

use candle_core::{DType, Device, Result, Tensor};
use candle_splitkv::{KvCache, KvCacheConfig};
use candle_splitkv::{CACHE_DTYPES, E4M3_MAX};
use float8::F8E4M3;

const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 8;
/// e4m3's unit roundoff (3 mantissa bits, round to nearest): the largest relative error of a
/// normal value.
const E4M3_UNIT_ROUNDOFF: f64 = 1.0 / 16.0;
/// The smallest normal e4m3 magnitude; below it the spacing is fixed (2^-9) instead.
const E4M3_MIN_NORMAL: f64 = 1.0 / 64.0;

fn fp8_config(batch: usize, k_scale: f32, v_scale: f32) -> KvCacheConfig {
    KvCacheConfig {
        batch,
        kv_heads: KV_HEADS,
        head_dim: HEAD_DIM,
        initial_capacity: 2,
        max_capacity: 64,
        dtype: DType::F8E4M3,
        device: Device::Cpu,
        k_scale: 1.0,
        v_scale: 1.0,
    }
    .with_kv_scales(k_scale, v_scale)
}

/// The elements as f64, through f32: candle's direct cast of f8e4m3 to f64 on the CPU did not
/// finish here, while f8e4m3 → f32 is exact.
fn values(x: &Tensor) -> Result<Vec<f64>> {
    x.to_dtype(DType::F32)?
        .to_dtype(DType::F64)?
        .flatten_all()?
        .to_vec1::<f64>()
}

/// Every finite e4m3 value, decoded independently of candle's cast.
fn e4m3_values() -> Vec<f64> {
    (0..=255u8)
        .map(|bits| f64::from(F8E4M3::from_bits(bits).to_f32()))
        .filter(|x| x.is_finite())
        .collect()
}

/// Whether `stored` is an e4m3 value nearest to `x` (either one on a tie).
fn is_nearest(stored: f64, x: f64, grid: &[f64]) -> bool {
    let best = grid
        .iter()
        .map(|g| (g - x).abs())
        .fold(f64::INFINITY, f64::min);
    grid.contains(&stored) && (stored - x).abs() <= best
}

#[test]
fn fp8_append_stores_the_nearest_e4m3_value_of_x_over_the_scale_saturated() -> Result<()> {
    let grid = e4m3_values();
    // Powers of two, so that x / scale is exact in f32 and "nearest" is unambiguous.
    let (k_scale, v_scale) = (0.5f32, 4.0f32);
    let mut cache = KvCache::new(&fp8_config(1, k_scale, v_scale))?;
    let shape = (1, 5, KV_HEADS, HEAD_DIM);
    // Normal values at a spread of magnitudes, and some far past ±448 × scale.
    let mut k = (Tensor::randn(0f32, 1.0, shape, &Device::Cpu)? * 60.0)?;
    let mut v = (Tensor::randn(0f32, 1.0, shape, &Device::Cpu)? * 500.0)?;
    let huge = Tensor::new(
        &[1e5f32, -1e5, 1e30, -1e30, 225.0, -224.5, 2000.0, -1793.0],
        &Device::Cpu,
    )?
    .reshape((1, 1, KV_HEADS, HEAD_DIM / 2))?;
    let huge = Tensor::cat(&[&huge, &huge], 3)?;
    k = Tensor::cat(&[&k, &huge], 1)?;
    v = Tensor::cat(&[&v, &huge], 1)?;
    // Several positions at once, then one more step (and a growth of the storage).
    cache.append(&k.narrow(1, 0, 4)?, &v.narrow(1, 0, 4)?)?;
    let (k_stored, v_stored) = cache.append(&k.narrow(1, 4, 2)?, &v.narrow(1, 4, 2)?)?;
    assert_eq!(cache.capacity(), 8);
    assert_eq!(k_stored.dtype(), DType::F8E4M3);
    let mut saturated = 0;
    for (name, x, stored, scale) in [("k", &k, &k_stored, k_scale), ("v", &v, &v_stored, v_scale)] {
        let scale = f64::from(scale);
        let bound = f64::from(E4M3_MAX) * scale;
        for (x, s) in values(x)?.into_iter().zip(values(stored)?) {
            assert!(s.is_finite(), "{name}: {x} stored as {s}");
            let real = s * scale;
            if x.abs() >= bound {
                assert_eq!(real, bound.copysign(x), "{name}: {x} must saturate");
                saturated += 1;
            } else {
                assert!(
                    is_nearest(s, x / scale, &grid),
                    "{name}: {x} / {scale} stored as {s}"
                );
            }
        }
    }
    // The huge row on both, and the widest of the random values.
    assert!(saturated >= 24, "only {saturated} values saturated");
    Ok(())
}

#[test]
fn every_write_path_saturates_instead_of_giving_nan() -> Result<()> {
    let mut cache = KvCache::new(&fp8_config(2, 0.25, 0.25))?;
    let big = |b: usize, t: usize| -> Result<Tensor> {
        Tensor::randn(0f32, 1.0, (b, t, KV_HEADS, HEAD_DIM), &Device::Cpu)? * 1e4
    };
    // One sequence alone, then a ragged step over both, then a uniform one, in each input dtype.
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        cache.reset();
        let x = big(1, 3)?.to_dtype(dtype)?;
        cache.append_to(0, &x, &x)?;
        let x = big(2, 2)?.to_dtype(dtype)?;
        cache.append(&x, &x)?;
        let x = big(1, 3)?.to_dtype(dtype)?;
        cache.append_to(1, &x, &x)?;
        let x = big(2, 2)?.to_dtype(dtype)?;
        cache.append(&x, &x)?;
        assert_eq!(cache.seq_lens(), [7, 7]);
        let (k, v) = cache.views()?;
        for stored in [values(&k)?, values(&v)?] {
            assert!(stored.iter().all(|s| s.abs() <= f64::from(E4M3_MAX)));
            let at_bound = stored
                .iter()
                .filter(|s| s.abs() == f64::from(E4M3_MAX))
                .count();
            assert!(
                at_bound > stored.len() / 2,
                "{dtype:?}: {at_bound} saturated"
            );
        }
    }
    Ok(())
}

#[test]
fn scaled_fp8_round_trips_within_the_e4m3_error_bound() -> Result<()> {
    // Scales that are not powers of two, so the division rounds in f32 before the cast.
    let (k_scale, v_scale) = (0.037f32, 3.3f32);
    let mut cache = KvCache::new(&fp8_config(1, k_scale, v_scale))?;
    let shape = (1, 40, KV_HEADS, HEAD_DIM);
    // |x| / scale from about 0.002 to 400: normal values, and some subnormal ones.
    let magnitudes = |scale: f32| -> Result<Tensor> {
        let exponent = Tensor::rand(-9f32, 8.6, shape, &Device::Cpu)?;
        let sign = Tensor::randn(0f32, 1.0, shape, &Device::Cpu)?.sign()?;
        (exponent.affine(std::f64::consts::LN_2, 0.0)?.exp()? * sign)? * f64::from(scale)
    };
    let (k, v) = (magnitudes(k_scale)?, magnitudes(v_scale)?);
    let (k_stored, v_stored) = cache.append(&k, &v)?;
    assert_eq!((cache.k_scale(), cache.v_scale()), (k_scale, v_scale));
    let mut worst = 0f64;
    for (x, stored, scale) in [(&k, &k_stored, k_scale), (&v, &v_stored, v_scale)] {
        let scale = f64::from(scale);
        for (x, s) in values(x)?.into_iter().zip(values(stored)?) {
            let real = s * scale;
            let err = (real - x).abs();
            // The f32 division adds at most a few f32 ulps before e4m3 rounds.
            let slack = 1e-6 * x.abs();
            if x.abs() / scale >= E4M3_MIN_NORMAL {
                assert!(
                    err <= E4M3_UNIT_ROUNDOFF * x.abs() + slack,
                    "{x} came back as {real} (scale {scale})"
                );
                worst = worst.max(err / x.abs());
            } else {
                // Subnormals: half their spacing, 2^-10, in real units.
                assert!(
                    err <= scale / 1024.0 + slack,
                    "{x} came back as {real} (scale {scale})"
                );
            }
        }
    }
    println!("largest relative error of a normal value: {worst:.4} (bound 0.0625)");
    Ok(())
}

#[test]
fn bad_scales_and_dtypes_are_clear_errors() -> Result<()> {
    for (k_scale, v_scale, name) in [
        (0.0, 1.0, "k_scale"),
        (-2.0, 1.0, "k_scale"),
        (f32::NAN, 1.0, "k_scale"),
        (1.0, f32::INFINITY, "v_scale"),
        (1.0, 0.0, "v_scale"),
    ] {
        let err = KvCache::new(&fp8_config(1, k_scale, v_scale)).unwrap_err();
        assert!(
            err.to_string()
                .contains(&format!("{name} must be finite and positive")),
            "{err}"
        );
    }
    for dtype in [DType::U8, DType::F64, DType::U32] {
        let err = KvCache::new(&KvCacheConfig {
            dtype,
            ..fp8_config(1, 1.0, 1.0)
        })
        .unwrap_err();
        assert!(err.to_string().contains("f32, f16, bf16, f8e4m3"), "{err}");
    }
    assert_eq!(CACHE_DTYPES.len(), 4);

    // New keys and values are the real values; already-stored fp8 ones are refused.
    let mut cache = KvCache::new(&fp8_config(1, 1.0, 1.0))?;
    let x = Tensor::ones((1, 1, KV_HEADS, HEAD_DIM), DType::F32, &Device::Cpu)?;
    let err = cache
        .append(&x.to_dtype(DType::F8E4M3)?, &x.to_dtype(DType::F8E4M3)?)
        .unwrap_err();
    assert!(err.to_string().contains("real values"), "{err}");
    let err = cache.append(&x, &x.to_dtype(DType::F16)?).unwrap_err();
    assert!(err.to_string().contains("same dtype"), "{err}");
    assert!(cache.is_empty());
    Ok(())
}

#[test]
fn the_config_keeps_the_scales() -> Result<()> {
    let cache = KvCache::new(&fp8_config(1, 0.5, 2.0))?;
    let config = cache.config();
    assert_eq!((config.k_scale, config.v_scale), (0.5, 2.0));
    assert_eq!(config.dtype, DType::F8E4M3);
    // Half the bytes of bf16 per position.
    assert_eq!(
        DType::F8E4M3.size_in_bytes() * 2,
        DType::BF16.size_in_bytes()
    );
    Ok(())
}
