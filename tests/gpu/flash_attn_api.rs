//! `candle_splitkv::flash_attn` on CUDA: candle-flash-attn's functions against an f64 reference
//! written from FlashAttention-2's mask rules, through the decode and prefill kernels.

use candle_core::{DType, Result};

use crate::common;
use crate::common::flash_attn_cases::{api_cases, check_api_case, check_varlen_case, varlen_cases};

#[test]
fn fixed_length_forms_match_flash_attention_2() -> Result<()> {
    let Some(dev) = common::gpu() else {
        return Ok(());
    };
    candle_splitkv::test_hooks::poison_outputs(true);
    for case in api_cases(true) {
        for dtype in [DType::F16, DType::BF16] {
            check_api_case(&case, dtype, &dev)?;
        }
        // f32 runs the decode kernels alone, up to MAX_QUERY_TOKENS queries.
        if case.sq <= candle_splitkv::MAX_QUERY_TOKENS {
            check_api_case(&case, DType::F32, &dev)?;
        }
    }
    Ok(())
}

#[test]
fn varlen_forms_match_flash_attention_2() -> Result<()> {
    let Some(dev) = common::gpu() else {
        return Ok(());
    };
    candle_splitkv::test_hooks::poison_outputs(true);
    for case in varlen_cases(true) {
        for dtype in [DType::F16, DType::BF16] {
            check_varlen_case(&case, dtype, &dev)?;
        }
    }
    Ok(())
}
