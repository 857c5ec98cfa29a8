//! What a GPU that gives a CTA 99 KiB of shared memory (sm_86, sm_89) runs. A build for a target
//! before sm_90 sizes every form for 99 KiB but one, the tensor-core decode of 16-bit K/V at head
//! dim 256, whose calls run on CUDA cores there. Run on an H100 with the op told the GPU has
//! 99 KiB, such a build takes those paths, so the H100 tests them. A build for sm_90 sizes its
//! forms past 99 KiB and skips these tests.

use candle_core::{DType, Device, Result};
use candle_splitkv::test_hooks::{compiled_compute_cap, last_decode_kernel, limit_smem_per_cta};

use crate::common::flash_attn_cases::{api_cases, check_api_case};
use crate::common::{self, assert_close, assert_lse_close, gpu, poisoned, reference, Case};

/// The opt-in shared memory of sm_86 and sm_89 per CTA.
const SMEM_99_KIB: usize = 99 * 1024;

/// Runs `body` on a GPU as one with 99 KiB per CTA, where the build allows it.
fn with_99_kib(name: &str, body: impl FnOnce(&Device) -> Result<()>) -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    if compiled_compute_cap().is_none_or(|cap| cap >= 90) {
        println!("{name}: skipped, a build for sm_90 sizes its forms past 99 KiB");
        return Ok(());
    }
    limit_smem_per_cta(Some(SMEM_99_KIB));
    let result = body(&dev);
    limit_smem_per_cta(None);
    result
}

#[test]
fn gpu_99_kib_decode_forms() -> Result<()> {
    with_99_kib("gpu_99_kib_decode_forms", |dev| {
        let mut count = 0;
        for d in [64, 80, 96, 128, 256] {
            for dtype in [DType::BF16, DType::F16] {
                for (h_q, h_kv) in [(8, 8), (16, 8), (32, 8), (28, 2)] {
                    for (b, l) in [(1, 1), (3, 257), (1, 4097), (2, 50000)] {
                        let case = Case {
                            b,
                            h_q,
                            h_kv,
                            d,
                            l,
                            dtype,
                        };
                        let (q, k, v) = common::random_qkv(&case, dev)?;
                        let (out, lse) = poisoned(case.scale()).forward_with_lse(&q, &k, &v)?;
                        let kernel = last_decode_kernel().unwrap_or("none");
                        let what = format!("{case:?} at 99 KiB ({kernel})");
                        let want = reference(&q, &k, &v, case.scale(), None)?;
                        assert_close(&what, &out, &want.out, dtype)?;
                        assert_lse_close(&what, &lse, &want.lse, dtype)?;
                        // Head dim 256 alone leaves the tensor cores for CUDA cores.
                        let expected = if d == 256 {
                            "cuda_core_"
                        } else {
                            "tensor_core"
                        };
                        assert!(kernel.starts_with(expected), "{what}: expected {expected}*");
                        count += 1;
                    }
                }
            }
        }
        println!("gpu_99_kib_decode_forms: {count} cases passed");
        Ok(())
    })
}

#[test]
fn gpu_99_kib_flash_attn_api() -> Result<()> {
    with_99_kib("gpu_99_kib_flash_attn_api", |dev| {
        let cases = api_cases(true);
        for case in &cases {
            for dtype in [DType::BF16, DType::F16] {
                check_api_case(case, dtype, dev)?;
            }
        }
        println!("gpu_99_kib_flash_attn_api: {} cases passed", cases.len());
        Ok(())
    })
}
