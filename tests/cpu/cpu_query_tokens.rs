//! Several query tokens per sequence on the CPU: the last t positions of each sequence, each
//! attending causally to the keys up to its own position, checked against the f64 reference.

use candle_core::{DType, Device, Result, Tensor};
use candle_splitkv::{SplitKvAttention, MAX_QUERY_TOKENS};

use crate::common::{assert_close, assert_lse_close, host_f64, max_abs_diff, reference};

fn random(shape: (usize, usize, usize, usize), dtype: DType) -> Result<Tensor> {
    Tensor::randn(0f32, 1.0, shape, &Device::Cpu)?.to_dtype(dtype)
}

#[test]
fn query_tokens_attend_causally_to_the_end_of_the_cache() -> Result<()> {
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for (t, h_q, h_kv, d, l) in [
            (2, 8, 2, 64, 700),
            (4, 9, 3, 128, 1500),
            (MAX_QUERY_TOKENS, 14, 2, 80, 300),
            (3, 4, 4, 256, 40),
        ] {
            let b = 2;
            let q = random((b, t, h_q, d), dtype)?;
            let k = random((b, l, h_kv, d), dtype)?;
            let v = random((b, l, h_kv, d), dtype)?;
            let scale = 1.0 / (d as f32).sqrt();
            let want = reference(&q, &k, &v, scale, None)?;
            for splits in [None, Some(1), Some(3), Some(16)] {
                let op = SplitKvAttention::new(scale).with_num_splits(splits);
                let (out, lse) = op.forward_with_lse(&q, &k, &v)?;
                assert_eq!(out.dims(), &[b, t, h_q, d]);
                assert_eq!(lse.dims(), &[b, h_q, t]);
                let what = format!("{dtype:?} t={t} {h_q}/{h_kv} d={d} L={l} splits={splits:?}");
                assert_close(&what, &out, &want.out, dtype)?;
                assert_lse_close(&what, &lse, &want.lse, dtype)?;
            }
        }
    }
    Ok(())
}

#[test]
fn query_tokens_with_per_sequence_lengths() -> Result<()> {
    // Lengths shorter than t leave the first tokens of that sequence nothing to see: zeros and
    // an LSE of −inf. Length 0 leaves every token so.
    let (b, t, h_q, h_kv, d, l) = (5, 6, 6, 2, 64, 900);
    let lens = [900u32, 517, 4, 1, 0];
    let q = random((b, t, h_q, d), DType::F32)?;
    let k = random((b, l, h_kv, d), DType::F32)?;
    let v = random((b, l, h_kv, d), DType::F32)?;
    let seqlens = Tensor::new(&lens, &Device::Cpu)?;
    let scale = 0.125;
    let want = reference(&q, &k, &v, scale, Some(&lens))?;
    for splits in [None, Some(2), Some(9)] {
        let op = SplitKvAttention::new(scale)
            .with_num_splits(splits)
            .with_seqlens(seqlens.clone());
        let (out, lse) = op.forward_with_lse(&q, &k, &v)?;
        assert_close("varlen tokens", &out, &want.out, DType::F32)?;
        assert_lse_close("varlen tokens", &lse, &want.lse, DType::F32)?;
    }
    let lse = host_f64(
        &SplitKvAttention::new(scale)
            .with_seqlens(seqlens)
            .forward_with_lse(&q, &k, &v)?
            .1,
    )?;
    // Sequence 2 has 4 positions: its tokens 0 and 1 (positions −2 and −1) see nothing.
    let at = |bi: usize, h: usize, token: usize| lse[(bi * h_q + h) * t + token];
    assert_eq!(at(2, 0, 0), f64::NEG_INFINITY);
    assert_eq!(at(2, 0, 1), f64::NEG_INFINITY);
    assert!(at(2, 0, 2).is_finite());
    assert!((0..t).all(|token| at(4, 3, token) == f64::NEG_INFINITY));
    Ok(())
}

#[test]
fn one_token_is_the_last_row_of_many() -> Result<()> {
    // The last of t tokens sees the whole cache, exactly as a one-token call does.
    let (b, t, h_q, h_kv, d, l) = (2, 5, 8, 2, 128, 1200);
    let q = random((b, t, h_q, d), DType::F32)?;
    let k = random((b, l, h_kv, d), DType::F32)?;
    let v = random((b, l, h_kv, d), DType::F32)?;
    let many = candle_splitkv::flash_decode(&q, &k, &v, 0.1)?;
    let last = q.narrow(1, t - 1, 1)?.contiguous()?;
    let one = candle_splitkv::flash_decode(&last, &k, &v, 0.1)?;
    let many_last = host_f64(&many.narrow(1, t - 1, 1)?)?;
    let one = host_f64(&one)?;
    let worst = max_abs_diff(&many_last, &one);
    assert!(
        worst < 1e-5,
        "last token differs from the one-token call by {worst}"
    );
    Ok(())
}
