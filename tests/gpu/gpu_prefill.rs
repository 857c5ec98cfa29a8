//! Many query tokens per sequence on CUDA (the prefill kernels) against the f64 reference: every
//! head dim, f16 and bf16, group sizes 1 to 16, empty and long pasts, fewer keys than tokens,
//! per-sequence lengths (0 and shorter than t among them), paged K/V with shuffled tables and NaN
//! in unused pages, fp8 K/V with scales, sliding windows and soft-capping, the LSE, forced split
//! counts, and both prefill forms (mma.sync, and sm_90a where the build and device have it).
//! Outputs and split scratch are poisoned with NaN first.
//!
//! Skips with a notice where no CUDA device exists.

use candle_core::{DType, Device, Result, Tensor};
use candle_splitkv::test_hooks::{
    force_persistent_ctas, force_prefill_route, last_attention_form, PrefillRoute,
};
use candle_splitkv::{dequantize_e4m3, quantize_e4m3, SplitKvAttention, MAX_QUERY_TOKENS};

use crate::common;
use crate::common::paged::{check_paged, Layout, PagedCase};
use crate::common::seeded::SeededDraws;
use crate::common::{
    assert_close, assert_lse_close, fp8_kv_built, gpu, gpu_for_fp8, host_f64, poisoned,
    reference_masked,
};

const HEAD_DIMS: [usize; 5] = [64, 80, 96, 128, 256];
const DTYPES: [DType; 2] = [DType::F16, DType::BF16];

/// One call's sizes and options.
#[derive(Debug, Clone)]
struct Shape {
    b: usize,
    t: usize,
    h_q: usize,
    h_kv: usize,
    d: usize,
    /// Positions in K/V; each sequence's past is `l − t` (or its length's).
    l: usize,
    dtype: DType,
    lens: Option<Vec<u32>>,
    window: Option<usize>,
    softcap: Option<f32>,
}

impl Shape {
    fn new(b: usize, t: usize, (h_q, h_kv, d): (usize, usize, usize), l: usize) -> Self {
        Self {
            b,
            t,
            h_q,
            h_kv,
            d,
            l,
            dtype: DType::BF16,
            lens: None,
            window: None,
            softcap: None,
        }
    }

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

    fn op(&self, scale: f32, dev: &Device) -> Result<SplitKvAttention> {
        let op = poisoned(scale)
            .with_window_left(self.window)
            .with_softcap(self.softcap);
        Ok(match &self.lens {
            Some(lens) => op.with_seqlens(Tensor::new(lens.as_slice(), dev)?),
            None => op,
        })
    }
}

/// The prefill forms this build and device run: mma.sync always, sm_90a where a bf16 call at
/// head dim 128 takes it.
fn routes(dev: &Device) -> Result<Vec<PrefillRoute>> {
    force_prefill_route(PrefillRoute::Wgmma);
    let probe = Shape::new(1, 32, (2, 1, 128), 64);
    let (q, k, v) = probe.qkv(dev)?;
    let wgmma = SplitKvAttention::new(probe.scale()).forward(&q, &k, &v);
    force_prefill_route(PrefillRoute::Auto);
    Ok(match wgmma {
        Ok(_) => vec![PrefillRoute::MmaSync, PrefillRoute::Wgmma],
        Err(e) => {
            println!("sm_90a prefill form not run here: {e}");
            vec![PrefillRoute::MmaSync]
        }
    })
}

/// Whether `route` takes the shape: the sm_90a form runs head dims 64/128/256 without a window
/// or soft-capping.
fn takes(route: PrefillRoute, shape: &Shape) -> bool {
    route != PrefillRoute::Wgmma
        || ([64, 128, 256].contains(&shape.d) && shape.window.is_none() && shape.softcap.is_none())
}

/// A split count's output against one split's: within `8e-3` plus one ulp of the output dtype at
/// the element's magnitude, since each split rounds its probabilities to 16 bits against its
/// own running max and the merged result is rounded to the output dtype once more.
fn assert_splits_agree(what: &str, out: &[f64], one: &[f64], dtype: DType) {
    let ulp = match dtype {
        DType::BF16 => 2f64.powi(-7),
        DType::F16 => 2f64.powi(-10),
        _ => 2f64.powi(-23),
    };
    for (i, (a, b)) in out.iter().zip(one).enumerate() {
        let allowed = 8e-3 + ulp * a.abs().max(b.abs());
        let diff = (a - b).abs();
        assert!(
            diff <= allowed,
            "{what}: element {i} differs from one split's by {diff} (allowed {allowed})"
        );
    }
}

/// Runs `shape` on each route and split count against the reference (output and LSE); every
/// split count's output agreeing with one split's (see [`assert_splits_agree`]).
fn check(
    dev: &Device,
    shape: &Shape,
    routes: &[PrefillRoute],
    splits: &[Option<usize>],
) -> Result<()> {
    let (q, k, v) = shape.qkv(dev)?;
    let scale = shape.scale();
    let want = reference_masked(
        &q,
        &k,
        &v,
        scale,
        shape.lens.as_deref(),
        shape.window,
        shape.softcap,
    )?;
    for &route in routes.iter().filter(|&&r| takes(r, shape)) {
        force_prefill_route(route);
        let one = host_f64(
            &shape
                .op(scale, dev)?
                .with_num_splits(Some(1))
                .forward(&q, &k, &v)?,
        )?;
        for &n in splits {
            let (out, lse) = shape
                .op(scale, dev)?
                .with_num_splits(n)
                .forward_with_lse(&q, &k, &v)?;
            let form = last_attention_form().unwrap_or("none");
            let what = format!("{shape:?} {route:?} ({form}) splits {n:?}");
            assert!(form.starts_with("prefill"), "{what}: ran {form}");
            assert_eq!(out.dims(), q.dims());
            assert_eq!(lse.dims(), &[shape.b, shape.h_q, shape.t]);
            assert_close(&what, &out, &want.out, shape.dtype)?;
            assert_lse_close(&what, &lse, &want.lse, shape.dtype)?;
            assert_splits_agree(&what, &host_f64(&out)?, &one, shape.dtype);
        }
    }
    force_prefill_route(PrefillRoute::Auto);
    Ok(())
}

#[test]
fn gpu_prefill_every_head_dim_dtype_and_past() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let routes = routes(&dev)?;
    let mut count = 0;
    // (t, K/V length): empty past, fewer keys than tokens, a past, a long past.
    for (t, l) in [(17, 17), (100, 60), (130, 1000), (64, 5000)] {
        for d in HEAD_DIMS {
            for dtype in DTYPES {
                let shape = Shape {
                    dtype,
                    ..Shape::new(2, t, (8, 2, d), l)
                };
                check(&dev, &shape, &routes, &[None, Some(3)])?;
                count += 1;
            }
        }
    }
    println!("gpu_prefill_every_head_dim_dtype_and_past: {count} shapes passed");
    Ok(())
}

#[test]
fn gpu_prefill_long_chunks() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let routes = routes(&dev)?;
    for (t, l, d) in [(4096, 4096, 64), (1000, 9000, 128), (700, 700, 256)] {
        let shape = Shape::new(1, t, (2, 1, d), l);
        check(&dev, &shape, &routes, &[None, Some(4)])?;
    }
    Ok(())
}

/// Groups 1, 4, 8 and 16 and multi-query heads: the query tiles hold token × group rows.
#[test]
fn gpu_prefill_group_sizes() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let routes = routes(&dev)?;
    for (h_q, h_kv) in [(4, 4), (8, 2), (16, 2), (32, 2), (12, 1)] {
        for dtype in DTYPES {
            let shape = Shape {
                dtype,
                ..Shape::new(2, 77, (h_q, h_kv, 128), 600)
            };
            check(&dev, &shape, &routes, &[None, Some(2)])?;
        }
    }
    Ok(())
}

/// Split counts from one to many agree within the rounding of the 16-bit probabilities.
#[test]
fn gpu_prefill_split_counts_agree() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let routes = routes(&dev)?;
    let shape = Shape::new(1, 256, (8, 2, 128), 12000);
    let splits = [None, Some(2), Some(7), Some(16), Some(33), Some(64)];
    check(&dev, &shape, &routes, &splits)
}

/// Per-sequence lengths: longer than t, shorter than t, 0, and t itself.
#[test]
fn gpu_prefill_varlen() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let routes = routes(&dev)?;
    for d in [64, 96, 128] {
        for dtype in DTYPES {
            let shape = Shape {
                dtype,
                lens: Some(vec![1500, 10, 0, 50, 1]),
                ..Shape::new(5, 50, (8, 2, d), 1500)
            };
            check(&dev, &shape, &routes, &[None, Some(5)])?;
        }
    }
    Ok(())
}

/// Sliding windows from one position to past the sequence, with and without soft-capping.
#[test]
fn gpu_prefill_window_and_softcap() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let routes = routes(&dev)?;
    let l = 900;
    for window in [Some(1), Some(31), Some(200), Some(l + 100), None] {
        for softcap in [None, Some(30.0)] {
            if window.is_none() && softcap.is_none() {
                continue;
            }
            for (d, dtype) in [(64, DType::BF16), (80, DType::F16), (128, DType::BF16)] {
                let shape = Shape {
                    dtype,
                    window,
                    softcap,
                    lens: Some(vec![l as u32, 300]),
                    ..Shape::new(2, 120, (8, 2, d), l)
                };
                check(&dev, &shape, &routes, &[None, Some(3)])?;
            }
        }
    }
    Ok(())
}

/// Strided K/V: a head-major cache narrowed and transposed, as a KV cache hands it over.
#[test]
fn gpu_prefill_strided_kv() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let routes = routes(&dev)?;
    let (b, t, h_q, h_kv, d, l, capacity) = (2, 90, 8, 2, 128, 700, 1024);
    let (k, k_dense) = common::head_major_view(b, h_kv, capacity, l, d, DType::BF16, &dev)?;
    let (v, v_dense) = common::head_major_view(b, h_kv, capacity, l, d, DType::BF16, &dev)?;
    let q = Tensor::randn(0f32, 1.0, (b, t, h_q, d), &dev)?.to_dtype(DType::BF16)?;
    let scale = 1.0 / (d as f32).sqrt();
    let want = reference_masked(&q, &k_dense, &v_dense, scale, None, None, None)?;
    for &route in &routes {
        force_prefill_route(route);
        for n in [None, Some(3)] {
            let (out, lse) = poisoned(scale)
                .with_num_splits(n)
                .forward_with_lse(&q, &k, &v)?;
            let what = format!("strided {route:?} splits {n:?}");
            assert_close(&what, &out, &want.out, DType::BF16)?;
            assert_lse_close(&what, &lse, &want.lse, DType::BF16)?;
        }
    }
    force_prefill_route(PrefillRoute::Auto);
    Ok(())
}

/// Runs `shape` with fp8 K/V (K drawn `k_gain` times wider than V, quantized with `k_scale` and
/// `v_scale`) on each route that takes it and each split count, against the reference on the
/// dequantized K/V (output and LSE).
fn check_fp8(
    dev: &Device,
    shape: &Shape,
    routes: &[PrefillRoute],
    splits: &[Option<usize>],
    k_gain: f64,
    (k_scale, v_scale): (f32, f32),
) -> Result<()> {
    let (q, k, v) = shape.qkv(dev)?;
    let k8 = quantize_e4m3(&(k.to_dtype(DType::F32)? * k_gain)?, k_scale)?;
    let v8 = quantize_e4m3(&v.to_dtype(DType::F32)?, v_scale)?;
    let k_real = dequantize_e4m3(&k8, k_scale, DType::F32)?;
    let v_real = dequantize_e4m3(&v8, v_scale, DType::F32)?;
    let want = reference_masked(
        &q,
        &k_real,
        &v_real,
        shape.scale(),
        shape.lens.as_deref(),
        shape.window,
        shape.softcap,
    )?;
    for &route in routes.iter().filter(|&&r| takes(r, shape)) {
        force_prefill_route(route);
        for &n in splits {
            let (out, lse) = shape
                .op(shape.scale(), dev)?
                .with_kv_scales(k_scale, v_scale)
                .with_num_splits(n)
                .forward_with_lse(&q, &k8, &v8)?;
            let form = last_attention_form().unwrap_or("none");
            let what = format!("fp8 {shape:?} ({form}, {route:?}) splits {n:?}");
            assert!(
                form.starts_with("prefill_") && form.contains("kv_f8e4m3"),
                "{what}"
            );
            assert_close(&what, &out, &want.out, shape.dtype)?;
            assert_lse_close(&what, &lse, &want.lse, shape.dtype)?;
        }
    }
    force_prefill_route(PrefillRoute::Auto);
    Ok(())
}

/// fp8 K/V with scales against the reference on the dequantized K/V, on both prefill forms.
#[test]
fn gpu_prefill_fp8() -> Result<()> {
    let Some(dev) = gpu_for_fp8("gpu_prefill_fp8")? else {
        return Ok(());
    };
    let routes = routes(&dev)?;
    for d in HEAD_DIMS {
        for dtype in DTYPES {
            let shape = Shape {
                dtype,
                ..Shape::new(2, 70, (8, 2, d), 800)
            };
            check_fp8(
                &dev,
                &shape,
                &routes,
                &[None, Some(1), Some(4)],
                3.0,
                (0.02, 0.5),
            )?;
        }
    }
    Ok(())
}

/// The value of the e4m3 bit pattern `bits` (not NaN).
fn e4m3_value(bits: u8) -> f32 {
    let sign = if bits & 0x80 != 0 { -1.0 } else { 1.0 };
    let (exponent, mantissa) = (((bits >> 3) & 0xF) as i32, (bits & 7) as f32);
    match exponent {
        0 => sign * mantissa / 8.0 * 2f32.powi(-6),
        e => sign * (1.0 + mantissa / 8.0) * 2f32.powi(e - 7),
    }
}

/// Every finite e4m3 value, subnormals included, widens exactly: with one key, the row that
/// sees it gets its value row, bit for bit, on both prefill forms.
#[test]
fn gpu_prefill_fp8_widens_exactly() -> Result<()> {
    let Some(dev) = gpu_for_fp8("gpu_prefill_fp8_widens_exactly")? else {
        return Ok(());
    };
    let mut values: Vec<f32> = (0..=255u8)
        .filter(|bits| bits & 0x7F != 0x7F)
        .map(e4m3_value)
        .collect();
    values.resize(256, 0.0);
    let (t, h, d) = (32, 2, 128);
    for route in routes(&dev)? {
        force_prefill_route(route);
        for dtype in DTYPES {
            let v_real = Tensor::from_vec(values.clone(), (1, 1, h, d), &dev)?;
            let v8 = quantize_e4m3(&v_real, 1.0)?;
            let k8 = quantize_e4m3(&Tensor::ones((1, 1, h, d), DType::F32, &dev)?, 1.0)?;
            let q = Tensor::randn(0f32, 1.0, (1, t, h, d), &dev)?.to_dtype(dtype)?;
            let out = poisoned(0.1).forward(&q, &k8, &v8)?;
            let form = last_attention_form().unwrap_or("none");
            let last = host_f64(&out.narrow(1, t - 1, 1)?.flatten_all()?)?;
            let want = host_f64(&v_real.to_dtype(dtype)?.flatten_all()?)?;
            for (i, (got, want)) in last.iter().zip(&want).enumerate() {
                assert!(
                    got == want,
                    "{dtype:?} ({form}, {route:?}): value {i} widened to {got}, want {want}"
                );
            }
        }
    }
    force_prefill_route(PrefillRoute::Auto);
    Ok(())
}

/// The persistent sm_90a grid with a few CTAs, each taking many items in rounds that alternate
/// direction (items of no keys among them, splits, fp8 and paged K/V), and with one item per CTA.
#[test]
fn gpu_prefill_persistent_rounds() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let routes = routes(&dev)?;
    if !routes.contains(&PrefillRoute::Wgmma) {
        println!("gpu_prefill_persistent_rounds: no sm_90a prefill form here");
        return Ok(());
    }
    let wgmma = [PrefillRoute::Wgmma];
    let varlen = Shape {
        lens: Some(vec![900, 0, 37, 600]),
        ..Shape::new(4, 150, (8, 2, 128), 900)
    };
    let wide = Shape {
        dtype: DType::F16,
        ..Shape::new(1, 300, (4, 4, 256), 700)
    };
    let narrow = Shape::new(2, 200, (16, 2, 64), 1200);
    for ctas in [1, 3, 7, 100_000] {
        force_persistent_ctas(Some(ctas));
        for shape in [&varlen, &wide, &narrow] {
            check(&dev, shape, &wgmma, &[None, Some(3)])?;
        }
        if fp8_kv_built() {
            check_fp8(&dev, &varlen, &wgmma, &[None, Some(2)], 4.0, (0.05, 0.02))?;
        }
        force_prefill_route(PrefillRoute::Wgmma);
        let case = PagedCase {
            t: 60,
            h_q: 8,
            h_kv: 2,
            d: 128,
            lens: vec![1000, 40, 0, 333],
            dtype: DType::BF16,
            kv_dtype: DType::BF16,
            layout: Layout {
                page_size: 16,
                spare_pages: 5,
                spare_entries: 3,
                shared_pages: 0,
                seed: 12,
            },
            window: None,
            softcap: None,
        };
        check_paged(
            &dev,
            &case,
            &[candle_splitkv::CudaKernel::Auto],
            &[None, Some(4)],
        )?;
        force_prefill_route(PrefillRoute::Auto);
    }
    force_persistent_ctas(None);
    Ok(())
}

/// Paged K/V: shuffled tables, NaN in every position no sequence owns, spare table entries
/// pointing outside the pool; against the reference and the contiguous op.
#[test]
fn gpu_prefill_paged() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    for route in routes(&dev)? {
        force_prefill_route(route);
        for (d, dtype, kv_dtype, page_size, window) in [
            (128, DType::BF16, DType::BF16, 16, None),
            (64, DType::F16, DType::F16, 1, None),
            (256, DType::BF16, DType::BF16, 64, None),
            (96, DType::F16, DType::F16, 7, Some(50)),
            (128, DType::BF16, DType::F8E4M3, 32, None),
            (128, DType::BF16, DType::F8E4M3, 32, Some(100)),
            (256, DType::F16, DType::F8E4M3, 16, None),
            (64, DType::BF16, DType::F8E4M3, 8, None),
        ]
        .into_iter()
        .filter(|case| case.2 != DType::F8E4M3 || fp8_kv_built())
        {
            let case = PagedCase {
                t: 60,
                h_q: 8,
                h_kv: 2,
                d,
                lens: vec![1000, 40, 0, 333],
                dtype,
                kv_dtype,
                layout: Layout {
                    page_size,
                    spare_pages: 5,
                    spare_entries: 3,
                    shared_pages: 0,
                    seed: 11,
                },
                window,
                softcap: window.map(|_| 20.0),
            };
            let sm90_takes = window.is_none() && d != 96;
            if route == PrefillRoute::Wgmma && !sm90_takes {
                continue;
            }
            check_paged(
                &dev,
                &case,
                &[candle_splitkv::CudaKernel::Auto],
                &[None, Some(1), Some(5)],
            )?;
        }
    }
    force_prefill_route(PrefillRoute::Auto);
    Ok(())
}

/// The mma.sync prefill form also takes a few query tokens (it runs them where the decode forms
/// would re-stream the K/V too often).
#[test]
fn gpu_prefill_few_tokens() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    for t in [1, 5, MAX_QUERY_TOKENS] {
        let shape = Shape::new(3, t, (16, 2, 128), 2000);
        check(&dev, &shape, &[PrefillRoute::MmaSync], &[None, Some(4)])?;
    }
    Ok(())
}

/// The op's rule: a few query tokens with few rows per kv head stay on the decode forms; many
/// rows per kv head over a batch that fills the GPU, or more tokens than the decode forms take,
/// go to the prefill forms.
#[test]
fn gpu_prefill_route_rule() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    force_prefill_route(PrefillRoute::Auto);
    let form = |shape: Shape| -> Result<&'static str> {
        let (q, k, v) = shape.qkv(&dev)?;
        SplitKvAttention::new(shape.scale()).forward(&q, &k, &v)?;
        Ok(last_attention_form().unwrap_or("none"))
    };
    // Verification of 8 drafts with 4 query heads per kv head: 32 rows, two decode blocks.
    assert_eq!(form(Shape::new(1, 8, (32, 8, 128), 20000))?, "decode");
    assert_eq!(form(Shape::new(1, 4, (32, 8, 128), 20000))?, "decode");
    // 8 tokens × 8 heads = 64 rows per kv head, 512 decode blocks.
    assert!(form(Shape::new(16, 8, (64, 8, 128), 4096))?.starts_with("prefill"));
    assert!(form(Shape::new(1, MAX_QUERY_TOKENS + 1, (4, 4, 64), 100))?.starts_with("prefill"));
    // f32 has no prefill form: a few tokens stay on the decode forms, more are an error.
    let f32_shape = |t| Shape {
        dtype: DType::F32,
        ..Shape::new(16, t, (64, 8, 64), 256)
    };
    assert_eq!(form(f32_shape(8))?, "decode");
    let err = form(f32_shape(MAX_QUERY_TOKENS + 1))
        .unwrap_err()
        .to_string();
    assert!(err.contains("f16 or bf16"), "{err}");
    Ok(())
}

/// Cases in [`gpu_prefill_seeded_random_shapes`].
const FUZZ_CASES: usize = 120;

/// Shapes drawn from a seed (batch, tokens, 1 to 1,500 keys, heads, head dim, dtype, per-sequence
/// lengths, window, softcap, fp8 K/V), none of them chosen by hand, on every prefill form that
/// takes each. `SPLITKV_TEST_SEED` draws another set.
#[test]
fn gpu_prefill_seeded_random_shapes() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let routes = routes(&dev)?;
    let (mut draws, seed) = SeededDraws::from_env_or(0x5eed_cafe_f00d_d00d);
    let mut draw = |n: usize| draws.below(n);
    for _ in 0..FUZZ_CASES {
        let b = 1 + draw(3);
        let t = MAX_QUERY_TOKENS + 1 + draw(300);
        let l = 1 + draw(1500);
        let h_kv = 1 + draw(3);
        let group = [1, 2, 4, 5, 8, 16][draw(6)];
        let d = HEAD_DIMS[draw(HEAD_DIMS.len())];
        let dtype = DTYPES[draw(2)];
        let lens = (draw(2) == 0).then(|| (0..b).map(|_| draw(l + 1) as u32).collect::<Vec<_>>());
        let window = (draw(4) == 0).then(|| 1 + draw(l + 1));
        let softcap = (draw(4) == 0).then(|| 5.0 + draw(40) as f32);
        // Drawn whether or not the build has fp8 kernels, so that the shapes stay the same.
        let fp8 = draw(4) == 0 && fp8_kv_built();
        let shape = Shape {
            dtype,
            lens,
            window,
            softcap,
            ..Shape::new(b, t, (h_kv * group, h_kv, d), l)
        };
        let splits = [None, Some(1), Some(1 + draw(8))];
        if fp8 {
            check_fp8(&dev, &shape, &routes, &splits, 1.0, (0.05, 0.25))?;
        } else {
            check(&dev, &shape, &routes, &splits)?;
        }
    }
    println!("gpu_prefill_seeded_random_shapes: {FUZZ_CASES} cases from seed {seed:#x} passed");
    Ok(())
}
