//! Prefill through the op on the CPU: more query tokens per sequence than a verification pass
//! has (17 to 4,096), the last t positions of each sequence, token i seeing the keys up to
//! position `len − t + i`. Checked against the f64 reference with the output and split scratch
//! poisoned with NaN first, over empty and long pasts, more tokens than keys, every dtype, head
//! dim and group size, per-sequence lengths, paged and strided K/V, fp8 K/V, windows,
//! soft-capping and the LSE, and across split counts.

use candle_core::{DType, Device, Result, Tensor};
use candle_splitkv::{quantize_e4m3, SplitKvAttention, MAX_QUERY_TOKENS, SUPPORTED_HEAD_DIMS};

use crate::common::paged::{check_paged, Layout, PagedCase};
use crate::common::seeded::SeededDraws;
use crate::common::{
    assert_close, assert_lse_close, head_major_view, host_f64, max_abs_diff, poisoned,
    reference_masked,
};

fn random(shape: (usize, usize, usize, usize), dtype: DType) -> Result<Tensor> {
    Tensor::randn(0f32, 1.0, shape, &Device::Cpu)?.to_dtype(dtype)
}

/// One prefill call: `t` query tokens per sequence over `kv_len` keys (the last `t` of which
/// are the tokens' own positions when `t ≤ kv_len`).
#[derive(Debug, Clone)]
struct Case {
    b: usize,
    t: usize,
    kv_len: usize,
    h_q: usize,
    h_kv: usize,
    d: usize,
    dtype: DType,
    /// Per-sequence lengths (`seqlens_k`), each at most `kv_len`.
    lens: Option<Vec<u32>>,
    window: Option<usize>,
    softcap: Option<f32>,
}

impl Case {
    fn new(t: usize, kv_len: usize, (h_q, h_kv, d): (usize, usize, usize)) -> Self {
        Self {
            b: 1,
            t,
            kv_len,
            h_q,
            h_kv,
            d,
            dtype: DType::F32,
            lens: None,
            window: None,
            softcap: None,
        }
    }

    fn scale(&self) -> f32 {
        1.0 / (self.d as f32).sqrt()
    }

    /// The op for this case with `splits`, poisoned.
    fn op(&self, splits: Option<usize>) -> Result<SplitKvAttention> {
        let op = poisoned(self.scale())
            .with_num_splits(splits)
            .with_window_left(self.window)
            .with_softcap(self.softcap);
        Ok(match &self.lens {
            Some(lens) => op.with_seqlens(Tensor::new(lens.as_slice(), &Device::Cpu)?),
            None => op,
        })
    }
}

/// Runs `case` on fresh random inputs with each of `splits` and checks output and LSE against
/// the f64 reference; with f32, the split counts must agree within fp32 rounding.
fn check(case: &Case, splits: &[Option<usize>]) -> Result<()> {
    let q = random((case.b, case.t, case.h_q, case.d), case.dtype)?;
    let k = random((case.b, case.kv_len, case.h_kv, case.d), case.dtype)?;
    let v = random((case.b, case.kv_len, case.h_kv, case.d), case.dtype)?;
    check_inputs(case, (&q, &k, &v), splits)
}

/// [`check`] on given q, k, v (any layout whose last dim is contiguous).
fn check_inputs(
    case: &Case,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    splits: &[Option<usize>],
) -> Result<()> {
    let want = reference_masked(
        q,
        k,
        v,
        case.scale(),
        case.lens.as_deref(),
        case.window,
        case.softcap,
    )?;
    let mut first: Option<(Vec<f64>, Vec<f64>)> = None;
    for &n in splits {
        let (out, lse) = case.op(n)?.forward_with_lse(q, k, v)?;
        assert_eq!(out.dims(), q.dims());
        assert_eq!(lse.dims(), &[case.b, case.h_q, case.t]);
        let what = format!("splits {n:?} {case:?}");
        assert_close(&what, &out, &want.out, case.dtype)?;
        assert_lse_close(&what, &lse, &want.lse, case.dtype)?;
        let (out, lse) = (host_f64(&out)?, host_f64(&lse)?);
        match &first {
            None => first = Some((out, lse)),
            Some((out_0, lse_0)) if case.dtype == DType::F32 => {
                let worst = max_abs_diff(out_0, &out);
                assert!(
                    worst < 1e-5,
                    "{what}: differs from {:?} by {worst}",
                    splits[0]
                );
                for (a, b) in lse_0.iter().zip(&lse) {
                    assert!(
                        a == b || (a - b).abs() <= 1e-5 * (1.0 + a.abs()),
                        "{what}: LSE {b} against {a} with {:?}",
                        splits[0]
                    );
                }
            }
            Some(_) => {}
        }
    }
    Ok(())
}

const SPLITS: [Option<usize>; 3] = [None, Some(1), Some(4)];

#[test]
fn prefill_lengths_with_and_without_a_past() -> Result<()> {
    // (t, past, (h_q, h_kv, d)): the first query token past a verification pass, block edges,
    // a long empty-past prompt and a chunk after a long past.
    for (t, past, heads) in [
        (MAX_QUERY_TOKENS + 1, 0, (8, 2, 64)),
        (MAX_QUERY_TOKENS + 1, 1500, (9, 3, 64)),
        (33, 31, (3, 3, 64)),
        (97, 0, (4, 1, 128)),
        (300, 700, (16, 1, 64)),
        (1000, 0, (2, 2, 64)),
        (2048, 1200, (2, 1, 64)),
        (4096, 0, (1, 1, 64)),
    ] {
        let splits: &[Option<usize>] = if t >= 2048 { &[None] } else { &SPLITS };
        check(&Case::new(t, past + t, heads), splits)?;
    }
    // A batch of two.
    check(
        &Case {
            b: 2,
            ..Case::new(130, 400, (6, 2, 64))
        },
        &SPLITS,
    )
}

#[test]
fn more_query_tokens_than_keys() -> Result<()> {
    // The first t − kv_len tokens lie before the sequence's start: zeros and an LSE of −inf.
    for (t, kv_len) in [(64, 40), (200, 1), (50, 49)] {
        check(&Case::new(t, kv_len, (4, 2, 64)), &SPLITS)?;
    }
    Ok(())
}

#[test]
fn prefill_every_dtype_and_head_dim() -> Result<()> {
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for (i, d) in SUPPORTED_HEAD_DIMS.into_iter().enumerate() {
            let heads = if i % 2 == 0 { (9, 3, d) } else { (14, 2, d) };
            let case = Case {
                b: 2,
                dtype,
                ..Case::new(40, 70, heads)
            };
            check(&case, &[None, Some(3)])?;
        }
    }
    Ok(())
}

#[test]
fn prefill_every_group_size() -> Result<()> {
    // Groups 1, 4, 8, 16, MQA and odd ones; with 16 a block holds few tokens, so many blocks.
    for (h_q, h_kv) in [(4, 4), (8, 2), (16, 2), (16, 1), (12, 1), (9, 3), (14, 2)] {
        check(&Case::new(70, 250, (h_q, h_kv, 64)), &SPLITS)?;
    }
    Ok(())
}

#[test]
fn prefill_with_per_sequence_lengths() -> Result<()> {
    // Lengths shorter than t leave a sequence's first tokens nothing to see; 0 leaves all so.
    let case = Case {
        b: 5,
        lens: Some(vec![300, 120, 30, 1, 0]),
        ..Case::new(50, 300, (6, 2, 64))
    };
    check(&case, &[None, Some(2), Some(7)])?;
    let long = Case {
        b: 2,
        lens: Some(vec![1500, 700]),
        ..Case::new(600, 1500, (4, 1, 64))
    };
    check(&long, &[None, Some(3)])
}

#[test]
fn prefill_windows_and_softcaps() -> Result<()> {
    // Windows from one position to past the length; the narrowing of K/V the op does without
    // per-sequence lengths, and the masking it does with them.
    for window in [1, 7, 64, 200, 10_000] {
        for softcap in [None, Some(5.0)] {
            let case = Case {
                window: Some(window),
                softcap,
                ..Case::new(150, 250, (6, 2, 64))
            };
            check(&case, &SPLITS)?;
            let varlen = Case {
                b: 2,
                lens: Some(vec![250, 90]),
                ..case
            };
            check(&varlen, &[None, Some(3)])?;
        }
    }
    Ok(())
}

#[test]
fn prefill_over_strided_views() -> Result<()> {
    // K/V as the transposed views of a head-major cache with spare capacity, q as a transposed
    // view of head-major queries.
    let (b, t, h_q, h_kv, d, len) = (2, 90, 8, 2, 128, 400);
    for dtype in [DType::F32, DType::BF16] {
        let (k, _) = head_major_view(b, h_kv, len + 77, len, d, dtype, &Device::Cpu)?;
        let (v, _) = head_major_view(b, h_kv, len + 77, len, d, dtype, &Device::Cpu)?;
        let q = random((b, h_q, t, d), dtype)?.transpose(1, 2)?;
        let case = Case {
            b,
            dtype,
            ..Case::new(t, len, (h_q, h_kv, d))
        };
        check_inputs(&case, (&q, &k, &v), &SPLITS)?;
    }
    Ok(())
}

#[test]
fn prefill_over_fp8_kv_with_scales() -> Result<()> {
    // The reference reads the real values, stored × scale.
    for (q_dtype, d) in [(DType::F32, 64), (DType::BF16, 128), (DType::F16, 80)] {
        let (b, t, h_q, h_kv, len) = (2, 100, 8, 2, 300);
        let q = random((b, t, h_q, d), q_dtype)?;
        let quantized = |scale: f32| -> Result<(Tensor, Tensor)> {
            let real = (random((b, len, h_kv, d), DType::F32)? * f64::from(scale))?;
            let stored = quantize_e4m3(&real, scale)?;
            let real = (stored.to_dtype(DType::F32)? * f64::from(scale))?;
            Ok((stored, real))
        };
        let (k_scale, v_scale) = (0.02, 0.5);
        let (k8, k_real) = quantized(k_scale)?;
        let (v8, v_real) = quantized(v_scale)?;
        let scale = 1.0 / (d as f32).sqrt();
        let want = reference_masked(&q, &k_real, &v_real, scale, None, None, None)?;
        for splits in [None, Some(3)] {
            let (out, lse) = poisoned(scale)
                .with_kv_scales(k_scale, v_scale)
                .with_num_splits(splits)
                .forward_with_lse(&q, &k8, &v8)?;
            let what = format!("fp8 {q_dtype:?} d {d} splits {splits:?}");
            assert_eq!(out.dtype(), q_dtype);
            assert_close(&what, &out, &want.out, q_dtype)?;
            assert_lse_close(&what, &lse, &want.lse, q_dtype)?;
        }
    }
    Ok(())
}

#[test]
fn prefill_over_paged_kv() -> Result<()> {
    // Shuffled tables, NaN in every position no sequence owns, pages shared between sequences,
    // fp8 pages, a window and a soft cap.
    let layout = |page_size: usize, seed: u64| Layout {
        page_size,
        spare_pages: 3,
        spare_entries: 2,
        shared_pages: 2,
        seed,
    };
    let base = PagedCase {
        t: 60,
        h_q: 8,
        h_kv: 2,
        d: 64,
        lens: vec![400, 133, 20, 0],
        dtype: DType::F32,
        kv_dtype: DType::F32,
        layout: layout(16, 3),
        window: None,
        softcap: None,
    };
    let kernels = [candle_splitkv::CudaKernel::Auto];
    for page_size in [1, 16, 64] {
        let case = PagedCase {
            layout: layout(page_size, page_size as u64),
            ..base.clone()
        };
        check_paged(&Device::Cpu, &case, &kernels, &SPLITS)?;
    }
    let variants = [
        PagedCase {
            dtype: DType::BF16,
            kv_dtype: DType::F8E4M3,
            ..base.clone()
        },
        PagedCase {
            dtype: DType::F16,
            d: 96,
            h_q: 9,
            h_kv: 3,
            ..base.clone()
        },
        PagedCase {
            window: Some(33),
            softcap: Some(8.0),
            ..base.clone()
        },
    ];
    for case in &variants {
        check_paged(&Device::Cpu, case, &kernels, &[None, Some(3)])?;
    }
    Ok(())
}

#[test]
fn a_short_chunk_after_a_long_past_splits_its_keys() -> Result<()> {
    // A few blocks of query rows cannot fill the threads alone: the heuristic splits the keys,
    // and the result is the one-split result within fp32 rounding.
    let case = Case::new(40, 20_000, (4, 1, 64));
    let q = random((1, case.t, case.h_q, case.d), DType::F32)?;
    let k = random((1, case.kv_len, case.h_kv, case.d), DType::F32)?;
    let v = random((1, case.kv_len, case.h_kv, case.d), DType::F32)?;
    let plan =
        candle_splitkv::test_hooks::split_plan(&SplitKvAttention::new(case.scale()), &q, &k)?;
    assert!(plan.num_splits > 1, "{plan:?} does not split");
    check_inputs(&case, (&q, &k, &v), &[None, Some(1)])
}

#[test]
fn the_last_prefill_row_is_a_decode_step() -> Result<()> {
    // The last of t tokens sees the whole cache, as a one-token call does.
    let (t, h_q, h_kv, d, len) = (200, 8, 2, 128, 1200);
    let q = random((1, t, h_q, d), DType::F32)?;
    let k = random((1, len, h_kv, d), DType::F32)?;
    let v = random((1, len, h_kv, d), DType::F32)?;
    let many = candle_splitkv::flash_decode(&q, &k, &v, 0.1)?;
    let last = q.narrow(1, t - 1, 1)?.contiguous()?;
    let one = candle_splitkv::flash_decode(&last, &k, &v, 0.1)?;
    let worst = max_abs_diff(&host_f64(&many.narrow(1, t - 1, 1)?)?, &host_f64(&one)?);
    assert!(
        worst < 1e-5,
        "last row differs from the one-token call by {worst}"
    );
    Ok(())
}

/// Cases in [`prefill_seeded_random_shapes`].
const FUZZ_CASES: usize = 200;

/// Shapes drawn from a fixed seed (batch, tokens, past, heads, head dim, dtype, per-sequence
/// lengths, window, softcap), none of them chosen by hand: the corners the cases above do not
/// name.
#[test]
fn prefill_seeded_random_shapes() -> Result<()> {
    let mut draws = SeededDraws::new(0x9e37_79b9_7f4a_7c15);
    let mut draw = |n: usize| draws.below(n);
    for _ in 0..FUZZ_CASES {
        let b = 1 + draw(3);
        let t = 1 + draw(160);
        let kv_len = draw(400);
        let h_kv = 1 + draw(3);
        let group = [1, 2, 3, 4, 5, 8][draw(6)];
        let d = SUPPORTED_HEAD_DIMS[draw(SUPPORTED_HEAD_DIMS.len())];
        let dtype = [DType::F32, DType::F16, DType::BF16][draw(3)];
        let lens = (draw(2) == 0).then(|| (0..b).map(|_| draw(kv_len + 1) as u32).collect());
        let window = (draw(3) == 0).then(|| 1 + draw(kv_len + 1));
        let softcap = (draw(3) == 0).then(|| 5.0 + draw(40) as f32);
        let case = Case {
            b,
            dtype,
            lens,
            window,
            softcap,
            ..Case::new(t, kv_len, (h_kv * group, h_kv, d))
        };
        check(&case, &[None, Some(1), Some(1 + draw(6))])?;
    }
    Ok(())
}
