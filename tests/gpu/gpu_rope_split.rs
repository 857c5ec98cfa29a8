//! The CUDA split of a joined q/k/v projection's output (`RopeAngles::split_qkv`: q and k
//! rotated, v copied, one launch reading the output through its strides) against an f64
//! reference and against the CPU path (candle's rope and copies), with its outputs poisoned with
//! NaN first. Skips with a notice where no CUDA device exists.

use candle_core::{DType, Device, Result, Tensor};
use candle_splitkv::models::llama::{LlamaConfig, RopeLayout, RotaryEmbedding};
use candle_splitkv::test_hooks::poison_outputs;

use crate::common::gpu;

/// The RoPE tables read only the head dim, the context length and the frequencies.
fn config(head_dim: usize) -> LlamaConfig {
    LlamaConfig {
        head_dim,
        max_position_embeddings: 256,
        ..LlamaConfig::default()
    }
}

/// Unit roundoff of a dtype.
fn unit_roundoff(dtype: DType) -> f64 {
    match dtype {
        DType::BF16 => 2f64.powi(-8),
        DType::F16 => 2f64.powi(-11),
        _ => 2f64.powi(-24),
    }
}

/// q, k and v as the layers split them before this kernel: candle's rope over the narrowed q and
/// k heads, and contiguous copies.
fn split_with_candle(
    rope: &RotaryEmbedding,
    qkv: &Tensor,
    starts: &[usize],
    t: usize,
    (q_heads, kv_heads): (usize, usize),
) -> Result<(Tensor, Tensor, Tensor)> {
    let qk = rope
        .angles(starts, t)?
        .apply(&qkv.narrow(2, 0, q_heads + kv_heads)?)?;
    Ok((
        qk.narrow(2, 0, q_heads)?.contiguous()?,
        qk.narrow(2, q_heads, kv_heads)?.contiguous()?,
        qkv.narrow(2, q_heads + kv_heads, kv_heads)?.contiguous()?,
    ))
}

fn values(t: &Tensor) -> Result<Vec<f64>> {
    t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()
}

/// The rotation of `x` `(b, t, heads, d)` in f64, token `i` of sequence `s` at `starts[s] + i`,
/// with the angle tables as rounded to the dtype; returns the rotated values and, per element,
/// the size of the terms that made it (for the rounding tolerance).
fn reference(
    x: &Tensor,
    cos: &[f64],
    sin: &[f64],
    starts: &[usize],
    layout: RopeLayout,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let (_, t, heads, d) = x.dims4()?;
    let x = values(&x.contiguous()?)?;
    let half = d / 2;
    let (mut out, mut size) = (vec![0.0; x.len()], vec![0.0; x.len()]);
    for (s, &start) in starts.iter().enumerate() {
        for i in 0..t {
            let position = start + i;
            for h in 0..heads {
                let base = ((s * t + i) * heads + h) * d;
                for j in 0..half {
                    let (i1, i2) = match layout {
                        RopeLayout::Halves => (j, j + half),
                        RopeLayout::Interleaved => (2 * j, 2 * j + 1),
                    };
                    let (c, sn) = (cos[position * half + j], sin[position * half + j]);
                    let (a, b2) = (x[base + i1], x[base + i2]);
                    out[base + i1] = a * c - b2 * sn;
                    out[base + i2] = a * sn + b2 * c;
                    let terms = a.abs() + b2.abs();
                    size[base + i1] = terms;
                    size[base + i2] = terms;
                }
            }
        }
    }
    Ok((out, size))
}

#[test]
fn split_qkv_matches_f64_reference_and_the_cpu_path() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let (q_heads, kv_heads) = (4, 2);
    let heads = q_heads + 2 * kv_heads;
    poison_outputs(true);
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let tolerance = match dtype {
            DType::BF16 => 1.0 / 64.0,
            DType::F16 => 1.0 / 512.0,
            _ => 1e-6,
        };
        for layout in [RopeLayout::Halves, RopeLayout::Interleaved] {
            for head_dim in [64, 128] {
                let cpu_rope =
                    RotaryEmbedding::new(&config(head_dim), None, layout, dtype, &Device::Cpu)?;
                let gpu_rope = RotaryEmbedding::new(&config(head_dim), None, layout, dtype, &dev)?;
                let (cos, sin) = tables(&cpu_rope, head_dim, layout, dtype)?;
                for (starts, t) in [(vec![0usize], 1usize), (vec![7], 5), (vec![3, 200, 41], 2)] {
                    // A strided view: one spare head before and after each token's heads.
                    let padded = Tensor::randn(
                        0f32,
                        1.0,
                        (starts.len(), t, heads + 2, head_dim),
                        &Device::Cpu,
                    )?
                    .to_dtype(dtype)?;
                    let qkv_cpu = padded.narrow(2, 1, heads)?;
                    let qkv_gpu = padded.to_device(&dev)?.narrow(2, 1, heads)?;
                    let (expected, size) = reference(&qkv_cpu, &cos, &sin, &starts, layout)?;
                    let (q, k, v) = gpu_rope
                        .angles(&starts, t)?
                        .split_qkv(&qkv_gpu, (q_heads, kv_heads))?;
                    // Against candle's rope and copies on the same device (the path this
                    // replaces) and on the CPU.
                    let (gq, gk, gv) =
                        split_with_candle(&gpu_rope, &qkv_gpu, &starts, t, (q_heads, kv_heads))?;
                    let (cq, ck, cv) = cpu_rope
                        .angles(&starts, t)?
                        .split_qkv(&qkv_cpu, (q_heads, kv_heads))?;
                    let what = format!("{dtype:?} {layout:?} d {head_dim} starts {starts:?} t {t}");
                    let u = unit_roundoff(dtype);
                    let rows = starts.len() * t;
                    for (name, part, candle_gpu, cpu, first_head) in [
                        ("q", &q, &gq, &cq, 0),
                        ("k", &k, &gk, &ck, q_heads),
                        ("v", &v, &gv, &cv, q_heads + kv_heads),
                    ] {
                        assert!(part.is_contiguous(), "{what}: {name} is not contiguous");
                        assert_eq!(part.dims(), cpu.dims(), "{what}: {name}");
                        let part_heads = part.dims()[2];
                        let got = values(part)?;
                        // Where the element sits in the joined heads, for its terms' size.
                        let joined = |i: usize| {
                            let (row, rest) =
                                (i / (part_heads * head_dim), i % (part_heads * head_dim));
                            (row * heads + first_head) * head_dim + rest
                        };
                        assert_eq!(got.len(), rows * part_heads * head_dim);
                        for (other, reference) in
                            [("candle on the GPU", candle_gpu), ("the CPU", cpu)]
                        {
                            for (i, (g, w)) in got.iter().zip(&values(reference)?).enumerate() {
                                // Two valid orders of the roundings (a fused multiply-add or
                                // not) differ by at most a rounding of each term and of the sum.
                                let bound = 2.0 * u * (size[joined(i)] + w.abs());
                                assert!(
                                    (g - w).abs() <= bound,
                                    "{what}: {name}[{i}] = {g}, {other} gives {w}"
                                );
                            }
                        }
                    }
                    // Against f64: q and k rotated, v as it was.
                    let rotated = Tensor::cat(&[&q, &k, &v], 2)?;
                    let got = values(&rotated)?;
                    let x = values(&qkv_cpu.contiguous()?)?;
                    let d = head_dim;
                    for (i, g) in got.iter().enumerate() {
                        let h = (i / d) % heads;
                        let (want, scale) = if h < q_heads + kv_heads {
                            (expected[i], size[i])
                        } else {
                            (x[i], 0.0)
                        };
                        assert!(
                            (g - want).abs() <= tolerance * scale + 1e-12,
                            "{what}: element {i} = {g}, f64 gives {want}"
                        );
                    }
                }
            }
        }
    }
    poison_outputs(false);

    // Shapes that do not split are errors, not panics.
    let rope = RotaryEmbedding::new(&config(64), None, RopeLayout::Halves, DType::F32, &dev)?;
    let qkv = Tensor::zeros((1, 2, heads, 64), DType::F32, &dev)?;
    assert!(rope
        .angles(&[0], 2)?
        .split_qkv(&qkv, (q_heads, kv_heads + 1))
        .is_err());
    assert!(rope
        .angles(&[0], 3)?
        .split_qkv(&qkv, (q_heads, kv_heads))
        .is_err());
    Ok(())
}

/// The angle tables of `rope`, as its dtype holds them, in f64: `(positions, d/2)` flattened.
/// Rotating the unit vector of each pair's first element gives (cos, sin) exactly, in any dtype.
fn tables(
    rope: &RotaryEmbedding,
    head_dim: usize,
    layout: RopeLayout,
    dtype: DType,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let positions = rope.max_positions();
    let half = head_dim / 2;
    let first = |j: usize| match layout {
        RopeLayout::Halves => j,
        RopeLayout::Interleaved => 2 * j,
    };
    let second = |j: usize| match layout {
        RopeLayout::Halves => j + half,
        RopeLayout::Interleaved => 2 * j + 1,
    };
    // Head j of token p holds the unit vector of pair j.
    let mut unit = vec![0f32; positions * half * head_dim];
    for p in 0..positions {
        for j in 0..half {
            unit[(p * half + j) * head_dim + first(j)] = 1.0;
        }
    }
    let unit =
        Tensor::from_vec(unit, (1, positions, half, head_dim), &Device::Cpu)?.to_dtype(dtype)?;
    let rotated = values(&rope.apply(&unit, &[0])?)?;
    let (mut cos, mut sin) = (
        Vec::with_capacity(positions * half),
        Vec::with_capacity(positions * half),
    );
    for p in 0..positions {
        for j in 0..half {
            let base = (p * half + j) * head_dim;
            cos.push(rotated[base + first(j)]);
            sin.push(rotated[base + second(j)]);
        }
    }
    Ok((cos, sin))
}
