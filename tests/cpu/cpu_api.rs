//! Strided views, varlen, forced split counts, LSE and large logits on the CPU.

use candle_core::{DType, Device, IndexOp, Result, Tensor};
use candle_splitkv::{flash_decode, flash_decode_varlen, flash_decode_with_lse, SplitKvAttention};

use crate::common;
use crate::common::{assert_close, assert_lse_close, host_f64, reference, Case};

#[test]
fn head_major_cache_view_needs_no_copy() -> Result<()> {
    let dev = Device::Cpu;
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let (b, h_q, h_kv, d, cap, len) = (2, 14, 2, 128, 3000, 2049);
        let q = Tensor::randn(0f32, 1.0, (b, 1, h_q, d), &dev)?.to_dtype(dtype)?;
        let (k_view, k_dense) = common::head_major_view(b, h_kv, cap, len, d, dtype, &dev)?;
        let (v_view, v_dense) = common::head_major_view(b, h_kv, cap, len, d, dtype, &dev)?;
        assert!(!k_view.is_contiguous());
        let scale = 1.0 / (d as f32).sqrt();
        let strided = flash_decode(&q, &k_view, &v_view, scale)?;
        let dense = flash_decode(&q, &k_dense, &v_dense, scale)?;
        assert_eq!(host_f64(&strided)?, host_f64(&dense)?, "{dtype:?}");
        let want = reference(&q, &k_dense, &v_dense, scale, None)?;
        assert_close(&format!("strided {dtype:?}"), &strided, &want.out, dtype)?;
    }
    Ok(())
}

#[test]
fn odd_batch_and_head_strides() -> Result<()> {
    let dev = Device::Cpu;
    // k and v are every other head and every other batch entry of larger buffers.
    let (b, h_q, h_kv, d, l) = (3, 8, 4, 64, 700);
    let q = Tensor::randn(0f32, 1.0, (b, 1, h_q, d), &dev)?;
    let k_big = Tensor::randn(0f32, 1.0, (2 * b, l, 2 * h_kv, d), &dev)?;
    let v_big = Tensor::randn(0f32, 1.0, (2 * b, l, 2 * h_kv, d), &dev)?;
    let pick = |t: &Tensor| -> Result<Tensor> {
        let t = t.reshape((b, 2, l, h_kv, 2, d))?;
        t.i((.., 1, .., .., 0, ..))
    };
    let (k, v) = (pick(&k_big)?, pick(&v_big)?);
    assert!(!k.is_contiguous());
    let scale = 0.125;
    let out = flash_decode(&q, &k, &v, scale)?;
    let want = reference(&q, &k, &v, scale, None)?;
    assert_close("odd strides", &out, &want.out, DType::F32)
}

#[test]
fn varlen_ignores_positions_past_each_length() -> Result<()> {
    let dev = Device::Cpu;
    for dtype in [DType::F32, DType::BF16] {
        let case = Case {
            b: 4,
            h_q: 9,
            h_kv: 3,
            d: 64,
            l: 1500,
            dtype,
        };
        let (q, k, v) = common::random_qkv(&case, &dev)?;
        let lens = [1500u32, 0, 1, 777];
        let seqlens = Tensor::new(&lens, &dev)?;
        let out = flash_decode_varlen(&q, &k, &v, &seqlens, case.scale())?;
        let want = reference(&q, &k, &v, case.scale(), Some(&lens))?;
        assert_close(&format!("varlen {dtype:?}"), &out, &want.out, dtype)?;
        // The empty sequence gives exact zeros and an LSE of -inf.
        let op = SplitKvAttention::new(case.scale()).with_seqlens(seqlens);
        let (out, lse) = op.forward_with_lse(&q, &k, &v)?;
        let empty = host_f64(&out.i(1)?)?;
        assert!(
            empty.iter().all(|&x| x == 0.0),
            "zero-length output is not zero"
        );
        assert_lse_close("varlen lse", &lse, &want.lse, dtype)?;
    }
    Ok(())
}

#[test]
fn forced_split_counts_agree() -> Result<()> {
    let dev = Device::Cpu;
    for dtype in [DType::F32, DType::F16] {
        let case = Case {
            b: 2,
            h_q: 32,
            h_kv: 8,
            d: 128,
            l: 4097,
            dtype,
        };
        let (q, k, v) = common::random_qkv(&case, &dev)?;
        let want = reference(&q, &k, &v, case.scale(), None)?;
        let one = SplitKvAttention::new(case.scale())
            .with_num_splits(Some(1))
            .forward(&q, &k, &v)?
            .to_dtype(DType::F32)?;
        for n in 1..=64 {
            let op = SplitKvAttention::new(case.scale()).with_num_splits(Some(n));
            let (out, lse) = op.forward_with_lse(&q, &k, &v)?;
            assert_close(&format!("{n} splits {dtype:?}"), &out, &want.out, dtype)?;
            assert_lse_close(&format!("{n} splits {dtype:?}"), &lse, &want.lse, dtype)?;
            // Across split counts the only difference is fp32 rounding (plus one output ulp).
            let diff = (out.to_dtype(DType::F32)? - &one)?
                .abs()?
                .max_all()?
                .to_scalar::<f32>()?;
            let ulp = if dtype == DType::F32 { 2e-6 } else { 2e-3 };
            assert!(diff <= ulp, "{n} splits differ from 1 split by {diff}");
        }
    }
    Ok(())
}

#[test]
fn lse_matches_reference() -> Result<()> {
    let dev = Device::Cpu;
    let case = Case {
        b: 3,
        h_q: 14,
        h_kv: 2,
        d: 96,
        l: 5000,
        dtype: DType::F32,
    };
    let (q, k, v) = common::random_qkv(&case, &dev)?;
    let (_, lse) = flash_decode_with_lse(&q, &k, &v, case.scale())?;
    let want = reference(&q, &k, &v, case.scale(), None)?;
    assert_lse_close("lse", &lse, &want.lse, DType::F32)
}

#[test]
fn large_logits_stay_finite() -> Result<()> {
    let dev = Device::Cpu;
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let case = Case {
            b: 1,
            h_q: 32,
            h_kv: 8,
            d: 128,
            l: 3000,
            dtype,
        };
        let (q, k, v) = common::random_qkv(&case, &dev)?;
        let q = (q.to_dtype(DType::F32)? * 100.0)?.to_dtype(dtype)?;
        for splits in [None, Some(1), Some(7)] {
            let op = SplitKvAttention::new(case.scale()).with_num_splits(splits);
            let (out, lse) = op.forward_with_lse(&q, &k, &v)?;
            let want = reference(&q, &k, &v, case.scale(), None)?;
            // ×100 logits amplify the fp32 rounding of q·k a hundredfold; allow 10× more.
            let what = format!("logits x100 {dtype:?}");
            common::assert_close_scaled(&what, &out, &want.out, dtype, 10.0)?;
            assert_lse_close(&format!("logits x100 {dtype:?}"), &lse, &want.lse, dtype)?;
        }
    }
    Ok(())
}
