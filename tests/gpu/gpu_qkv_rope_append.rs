//! The fused q/k/v kernel of a decode step (RMSNorm, the joined projection, RoPE and the cache
//! append in one launch) against the chain it replaces (the fused projection, the q/k/v split
//! and the cache write at device positions): q and both caches bit for bit, and q and the
//! stored keys and values against an f64 reference. Halves and interleaved rotations, head dims
//! 64 and 128, grouped and plain heads, f16 and bf16, caches in the rows' dtype and in fp8, with
//! q poisoned with NaN first. Then the tiny Llama's steps with the kernel and with the chain give
//! identical logits.
//!
//! Skips with a notice where no CUDA device exists.

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_splitkv::models::llama::{
    Llama, LlamaConfig, LoadOptions, RopeAngles, RopeLayout, RotaryEmbedding,
};
use candle_splitkv::test_hooks::{
    poison_outputs, qkv_append_launch_count, qkv_rope_append, unfuse_qkv_append,
};
use candle_splitkv::{fused_linear, KvCache, KvCacheConfig, LinearInput, LinearOutput};
use rand::{rngs::StdRng, Rng, SeedableRng};

use crate::common::tiny_llama::{write_decisive_tiny_model, VOCAB};
use crate::common::{fp8_kv_built, gpu, greedy};

const HIDDEN: usize = 256;
const EPS: f32 = 1e-5;
/// Where the step's token goes: the cache holds this many positions before it.
const POSITION: usize = 37;

/// Through f32: candle's CPU cast of strided fp8 straight to f64 does not finish.
fn values(t: &Tensor) -> Result<Vec<f64>> {
    Ok(t.to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .to_dtype(DType::F64)?
        .flatten_all()?
        .to_vec1::<f64>()?)
}

fn unit_roundoff(dtype: DType) -> f64 {
    match dtype {
        DType::BF16 => 2f64.powi(-8),
        _ => 2f64.powi(-11),
    }
}

/// A cache of one sequence holding the positions `past` `(1, POSITION, kv_heads, d)` (values
/// half the keys).
fn filled_cache(
    (kv_heads, head_dim): (usize, usize),
    dtype: DType,
    past: &Tensor,
    dev: &Device,
) -> Result<KvCache> {
    let fp8 = dtype == DType::F8E4M3;
    let mut cache = KvCache::new(&KvCacheConfig {
        batch: 1,
        kv_heads,
        head_dim,
        initial_capacity: 64,
        max_capacity: 128,
        dtype,
        device: dev.clone(),
        k_scale: if fp8 { 0.03 } else { 1.0 },
        v_scale: if fp8 { 0.5 } else { 1.0 },
    })?;
    cache.append(past, &(past * 0.5)?)?;
    Ok(cache)
}

/// The cos and sin of the step's angles in f64 (as the dtype holds them): rotating pair j's unit
/// vector gives them exactly.
fn angle_values(
    angles: &RopeAngles,
    layout: RopeLayout,
    d: usize,
    dev: &Device,
    dtype: DType,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let half = d / 2;
    let first = |j: usize| {
        if layout == RopeLayout::Halves {
            j
        } else {
            2 * j
        }
    };
    let second = |j: usize| {
        if layout == RopeLayout::Halves {
            j + half
        } else {
            2 * j + 1
        }
    };
    let mut unit = vec![0f32; half * d];
    for j in 0..half {
        unit[j * d + first(j)] = 1.0;
    }
    let unit = Tensor::from_vec(unit, (1, 1, half, d), dev)?.to_dtype(dtype)?;
    let rotated = values(&angles.apply(&unit)?)?;
    Ok((
        (0..half).map(|j| rotated[j * d + first(j)]).collect(),
        (0..half).map(|j| rotated[j * d + second(j)]).collect(),
    ))
}

/// The f64 rows of the projection (RMSNorm rounded to the dtype, as both paths round it) and
/// each row's Σ|w·x| (its rounding scale).
fn projected(x: &Tensor, w: &Tensor, norm: &Tensor, dtype: DType) -> Result<(Vec<f64>, Vec<f64>)> {
    let (xs, ws, gs) = (values(x)?, values(w)?, values(norm)?);
    let mean_sq = xs.iter().map(|v| v * v).sum::<f64>() / HIDDEN as f64;
    let inv = 1.0 / (mean_sq + EPS as f64).sqrt();
    let normed: Vec<f64> = xs.iter().zip(&gs).map(|(v, g)| v * inv * g).collect();
    let normed = values(&Tensor::new(normed.as_slice(), &Device::Cpu)?.to_dtype(dtype)?)?;
    let rows = ws.len() / HIDDEN;
    let (mut out, mut size) = (vec![0.0; rows], vec![0.0; rows]);
    for r in 0..rows {
        for (wv, xv) in ws[r * HIDDEN..(r + 1) * HIDDEN].iter().zip(&normed) {
            out[r] += wv * xv;
            size[r] += (wv * xv).abs();
        }
    }
    Ok((out, size))
}

#[test]
fn gpu_qkv_rope_append_is_the_unfused_chain_bit_for_bit() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut rng = StdRng::seed_from_u64(77);
    let starts = Tensor::new(&[POSITION as u32], &dev)?;
    let mut cases = 0;
    for dtype in [DType::BF16, DType::F16] {
        for layout in [RopeLayout::Halves, RopeLayout::Interleaved] {
            for (q_heads, kv_heads, d) in [(4, 2, 64), (8, 2, 128), (3, 3, 64)] {
                for cache_dtype in [dtype, DType::F8E4M3] {
                    if cache_dtype == DType::F8E4M3 && !fp8_kv_built() {
                        continue;
                    }
                    let what = format!(
                        "{dtype:?} {layout:?} {q_heads}/{kv_heads} d {d}, {cache_dtype:?} cache"
                    );
                    eprintln!("fused q/k/v step: {what}");
                    let heads = q_heads + 2 * kv_heads;
                    let config = LlamaConfig {
                        head_dim: d,
                        max_position_embeddings: 128,
                        ..LlamaConfig::default()
                    };
                    let rope = RotaryEmbedding::new(&config, None, layout, dtype, &dev)?;
                    let angles = rope.angles_at(&starts)?;
                    let x = Tensor::randn(0f32, 1.0, (1, 1, HIDDEN), &dev)?.to_dtype(dtype)?;
                    let w = (Tensor::randn(0f32, 1.0, (heads * d, HIDDEN), &dev)?
                        / (HIDDEN as f64).sqrt())?
                    .to_dtype(dtype)?;
                    let gain: Vec<f32> = (0..HIDDEN).map(|_| rng.random_range(0.5..1.5)).collect();
                    let norm = Tensor::new(gain.as_slice(), &dev)?.to_dtype(dtype)?;

                    // Two caches holding the same past; the chain appends to one, the kernel
                    // to the other.
                    let past = Tensor::randn(0f32, 1.0, (1, POSITION, kv_heads, d), &dev)?
                        .to_dtype(dtype)?;
                    let mut chain_cache = filled_cache((kv_heads, d), cache_dtype, &past, &dev)?;
                    let mut fused_cache = filled_cache((kv_heads, d), cache_dtype, &past, &dev)?;
                    // The chain: projection, split with rotation, cache write at the device position.
                    let qkv = fused_linear(
                        &x,
                        &w,
                        LinearInput::RmsNorm {
                            weight: &norm,
                            eps: EPS,
                        },
                        LinearOutput::Plain,
                    )?;
                    let (q_chain, k_new, v_new) =
                        angles.split_qkv(&qkv.reshape((1, 1, heads, d))?, (q_heads, kv_heads))?;
                    chain_cache.append_at(&k_new, &v_new, &starts)?;

                    poison_outputs(true);
                    let q = qkv_rope_append(
                        &x,
                        &w,
                        (&norm, EPS),
                        &angles,
                        (q_heads, kv_heads, d),
                        &mut fused_cache,
                        &starts,
                    )?;
                    poison_outputs(false);
                    let Some(q) = q else {
                        panic!("{what}: the fused kernel did not take the step")
                    };
                    assert_eq!(q.dims(), [1, 1, q_heads, d], "{what}");
                    assert_eq!(
                        fused_cache.len(),
                        POSITION + 1,
                        "{what}: the cache did not count the step"
                    );

                    let bits = |t: &Tensor| -> Result<Vec<u32>> {
                        Ok(values(t)?.iter().map(|v| (*v as f32).to_bits()).collect())
                    };
                    assert_eq!(
                        bits(&q)?,
                        bits(&q_chain)?,
                        "{what}: q differs from the chain's"
                    );
                    let (fk, fv) = fused_cache.capacity_views()?;
                    let (ck, cv) = chain_cache.capacity_views()?;
                    assert_eq!(
                        bits(&fk)?,
                        bits(&ck)?,
                        "{what}: the K cache differs from the chain's"
                    );
                    assert_eq!(
                        bits(&fv)?,
                        bits(&cv)?,
                        "{what}: the V cache differs from the chain's"
                    );

                    // Against f64: q, and the new key and value as the cache stores them.
                    let (rows, size) = projected(&x, &w, &norm, dtype)?;
                    let (cos, sin) = angle_values(&angles, layout, d, &dev, dtype)?;
                    let u = unit_roundoff(dtype);
                    let half = d / 2;
                    let pair = |i: usize| {
                        if layout == RopeLayout::Halves {
                            (i % half, i < half)
                        } else {
                            (i / 2, i.is_multiple_of(2))
                        }
                    };
                    let partner = |i: usize| match layout {
                        RopeLayout::Halves => {
                            if i < half {
                                i + half
                            } else {
                                i - half
                            }
                        }
                        RopeLayout::Interleaved => i ^ 1,
                    };
                    let expect = |h: usize, i: usize| -> (f64, f64) {
                        let (r, o) = (h * d + i, h * d + partner(i));
                        if h >= q_heads + kv_heads {
                            return (rows[r], size[r]);
                        }
                        let (j, first) = pair(i);
                        let (a, b) = if first {
                            (rows[r], rows[o])
                        } else {
                            (rows[o], rows[r])
                        };
                        let want = if first {
                            a * cos[j] - b * sin[j]
                        } else {
                            a * sin[j] + b * cos[j]
                        };
                        (want, size[r] + size[o])
                    };
                    let qv = values(&q)?;
                    for h in 0..q_heads {
                        for i in 0..d {
                            let (want, scale) = expect(h, i);
                            let got = qv[h * d + i];
                            assert!(
                                (got - want).abs() <= 4.0 * u * scale + 1e-6,
                                "{what}: q[{h}][{i}] = {got}, f64 gives {want}"
                            );
                        }
                    }
                    let (k_rows, v_rows) = fused_cache.views()?;
                    let stored = |t: &Tensor, scale: f64| -> Result<Vec<f64>> {
                        Ok(values(&t.narrow(1, POSITION, 1)?)?
                            .iter()
                            .map(|v| v * scale)
                            .collect())
                    };
                    let (ks, vs) = (fused_cache.k_scale() as f64, fused_cache.v_scale() as f64);
                    // fp8 keeps 3 mantissa bits (half a unit: 2^-4 relative), and subnormals
                    // down to 2^-9 of the scale.
                    let (rel, abs) = if cache_dtype == DType::F8E4M3 {
                        (2f64.powi(-4), 2f64.powi(-10))
                    } else {
                        (0.0, 0.0)
                    };
                    for (name, got, scale, first_head) in [
                        ("k", stored(&k_rows, ks)?, ks, q_heads),
                        ("v", stored(&v_rows, vs)?, vs, q_heads + kv_heads),
                    ] {
                        for h in 0..kv_heads {
                            for i in 0..d {
                                let (want, size_h) = expect(first_head + h, i);
                                let g = got[h * d + i];
                                let bound =
                                    4.0 * u * size_h + rel * want.abs() + abs * scale + 1e-6;
                                assert!(
                                    (g - want).abs() <= bound,
                                    "{what}: {name}[{h}][{i}] = {g}, f64 gives {want}"
                                );
                            }
                        }
                    }
                    cases += 1;
                }
            }
        }
    }
    println!("fused q/k/v step: {cases} cases bit for bit with the unfused chain and within rounding of f64");
    Ok(())
}

/// The tiny Llama's decode steps (fed from device memory) with the fused q/k/v kernel and with
/// the unfused chain give identical logits, with bf16 and fp8 caches.
#[test]
fn gpu_llama_steps_with_the_fused_qkv_kernel_equal_the_chain() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let dir = tempfile::tempdir()?;
    write_decisive_tiny_model(dir.path())?;
    let mut rng = StdRng::seed_from_u64(3);
    let prompt: Vec<u32> = (0..100)
        .map(|_| rng.random_range(3..VOCAB as u32))
        .collect();
    for cache_dtype in [DType::BF16, DType::F8E4M3] {
        if cache_dtype == DType::F8E4M3 && !fp8_kv_built() {
            continue;
        }
        let load = || -> Result<Llama> {
            let options = LoadOptions {
                dtype: Some(DType::BF16),
                cache_dtype: Some(cache_dtype),
                ..Default::default()
            };
            Ok(Llama::load_with(dir.path(), &dev, options)?.model)
        };
        let (mut fused, mut chain) = (load()?, load()?);
        let host = |t: Tensor| -> Result<Vec<f32>> {
            Ok(t.to_device(&Device::Cpu)?
                .to_dtype(DType::F32)?
                .flatten_all()?
                .to_vec1::<f32>()?)
        };
        let mut fused_logits = host(fused.forward(&prompt)?)?;
        let launches = qkv_append_launch_count();
        chain.forward(&prompt)?;
        let steps = 24;
        for step in 0..steps {
            let next = greedy(&fused_logits);
            fused_logits = host(fused.forward(&[next])?)?;
            unfuse_qkv_append(true);
            let stepped = chain.forward(&[next]);
            unfuse_qkv_append(false);
            let chain_logits = host(stepped?)?;
            let differing = fused_logits
                .iter()
                .zip(&chain_logits)
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count();
            assert_eq!(
                differing, 0,
                "{cache_dtype:?} cache, step {step}: {differing} logits differ"
            );
        }
        let ran = qkv_append_launch_count() - launches;
        assert_eq!(
            ran,
            (steps * fused.config().num_hidden_layers) as u64,
            "{cache_dtype:?} cache: the fused kernel ran {ran} times"
        );
        println!("{cache_dtype:?} cache: {steps} steps with the fused q/k/v kernel, logits identical to the chain's");
    }
    Ok(())
}
