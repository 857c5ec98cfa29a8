//! `candle_splitkv::flash_attn` on the CPU: candle-flash-attn's functions against an f64
//! reference written from FlashAttention-2's mask rules, and the errors it gives where it differs.

use candle_core::{DType, Device, Result, Tensor};
use candle_splitkv::flash_attn;

use crate::common::flash_attn_cases::{api_cases, check_api_case, check_varlen_case, varlen_cases};

#[test]
fn fixed_length_forms_match_flash_attention_2() -> Result<()> {
    candle_splitkv::test_hooks::poison_outputs(true);
    for case in api_cases(true) {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            check_api_case(&case, dtype, &Device::Cpu)?;
        }
    }
    Ok(())
}

#[test]
fn varlen_forms_match_flash_attention_2() -> Result<()> {
    candle_splitkv::test_hooks::poison_outputs(true);
    for case in varlen_cases(true) {
        for dtype in [DType::F32, DType::BF16] {
            check_varlen_case(&case, dtype, &Device::Cpu)?;
        }
    }
    Ok(())
}

fn qkv(dev: &Device) -> Result<(Tensor, Tensor, Tensor)> {
    let q = Tensor::randn(0f32, 1.0, (1, 4, 8, 64), dev)?;
    let k = Tensor::randn(0f32, 1.0, (1, 9, 2, 64), dev)?;
    Ok((q, k.clone(), k))
}

fn expect_err(result: Result<Tensor>, needle: &str) {
    match result {
        Ok(_) => panic!("expected an error mentioning {needle:?}"),
        Err(e) => assert!(
            e.to_string().contains(needle),
            "error {e} does not mention {needle:?}"
        ),
    }
}

#[test]
fn alibi_and_prefix_ranges_are_refused_with_a_reason() -> Result<()> {
    let dev = Device::Cpu;
    let (q, k, v) = qkv(&dev)?;
    let slopes = Tensor::ones(8, DType::F32, &dev)?;
    expect_err(
        flash_attn::flash_attn_alibi(&q, &k, &v, &slopes, 0.1, true),
        "ALiBi",
    );
    expect_err(
        flash_attn::flash_attn_alibi_windowed(&q, &k, &v, &slopes, 0.1, Some(3), Some(0)),
        "ALiBi",
    );
    let (q, k, v) = (q.squeeze(0)?, k.squeeze(0)?, v.squeeze(0)?);
    let sq = Tensor::new(&[0u32, 4], &dev)?;
    let sk = Tensor::new(&[0u32, 9], &dev)?;
    expect_err(
        flash_attn::flash_attn_varlen_alibi(&q, &k, &v, &slopes, &sq, &sk, 4, 9, 0.1, false),
        "ALiBi",
    );
    let pool = k.reshape((9, 1, 2, 64))?;
    let table = Tensor::arange(0u32, 9, &dev)?.reshape((1, 9))?;
    let ranges = Tensor::zeros((1, 1, 2), DType::I32, &dev)?;
    expect_err(
        flash_attn::flash_attn_varlen_paged_windowed(
            &q,
            &pool,
            &pool,
            &sq,
            &sk,
            &table,
            Some(&ranges),
            4,
            9,
            0.1,
            None,
            Some(0),
            1,
            None,
        ),
        "mm_prefix_ranges",
    );
    Ok(())
}

#[test]
fn bad_cumulative_lengths_are_errors() -> Result<()> {
    let dev = Device::Cpu;
    let q = Tensor::randn(0f32, 1.0, (6, 4, 64), &dev)?;
    let k = Tensor::randn(0f32, 1.0, (10, 2, 64), &dev)?;
    let good_k = Tensor::new(&[0u32, 4, 10], &dev)?;
    let run = |sq: &[u32], sk: &Tensor, max_q: usize, max_k: usize| {
        let sq = Tensor::new(sq, &dev)?;
        flash_attn::flash_attn_varlen(&q, &k, &k, &sq, sk, max_q, max_k, 0.1, true)
    };
    expect_err(run(&[0, 4, 3], &good_k, 6, 6), "must not decrease");
    expect_err(
        run(&[0, 2, 5], &good_k, 6, 6),
        "the packed tensor has 6 rows",
    );
    expect_err(run(&[0, 1, 6], &good_k, 3, 6), "more than the maximum");
    expect_err(run(&[0, 3, 6], &good_k, 6, 5), "more than the maximum");
    expect_err(run(&[6], &good_k, 6, 6), "at least 2 values");
    expect_err(
        run(&[0, 6], &good_k, 6, 10),
        "seqlens_q and seqlens_k must have the same number of elements",
    );
    let f32_lens = Tensor::new(&[0f32, 4., 10.], &dev)?;
    expect_err(run(&[0, 3, 6], &f32_lens, 6, 6), "must be u32");
    Ok(())
}

#[test]
fn a_block_table_of_i32_reads_as_u32() -> Result<()> {
    let dev = Device::Cpu;
    let q = Tensor::randn(0f32, 1.0, (3, 4, 64), &dev)?;
    let pool = Tensor::randn(0f32, 1.0, (4, 16, 2, 64), &dev)?;
    let sq = Tensor::new(&[0u32, 3], &dev)?;
    let sk = Tensor::new(&[0u32, 40], &dev)?;
    let run = |table: &Tensor| {
        flash_attn::flash_attn_varlen_paged_windowed(
            &q,
            &pool,
            &pool,
            &sq,
            &sk,
            table,
            None,
            3,
            40,
            0.1,
            None,
            Some(0),
            16,
            None,
        )
    };
    let unsigned = run(&Tensor::new(&[[3u32, 0, 2]], &dev)?)?;
    let signed = run(&Tensor::new(&[[3i32, 0, 2]], &dev)?)?;
    assert_eq!(
        unsigned.flatten_all()?.to_vec1::<f32>()?,
        signed.flatten_all()?.to_vec1::<f32>()?
    );
    expect_err(
        flash_attn::flash_attn_varlen_paged_windowed(
            &q,
            &pool,
            &pool,
            &sq,
            &sk,
            &Tensor::new(&[[3u32, 0, 2]], &dev)?,
            None,
            3,
            40,
            0.1,
            None,
            Some(0),
            32,
            None,
        ),
        "page_block_size 32 does not match",
    );
    Ok(())
}

#[test]
fn the_switch_example_runs_candle_transformers_shapes() {
    let out = std::process::Command::new(crate::common::example_binary("flash_attn_switch"))
        .args(["--prompt", "40", "--steps", "2"])
        .output()
        .expect("the example runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for model in ["llama-2-7b", "mistral-7b-v0.1"] {
        assert_eq!(
            stdout.matches(model).count(),
            3,
            "{model}: a prompt and two decode steps\n{stdout}"
        );
    }
}
