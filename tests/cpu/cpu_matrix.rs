//! The op on the CPU against the f64 reference over the full case matrix.

use candle_core::{DType, Device, Result};

use crate::common;
use crate::common::{assert_close, assert_lse_close, reference, Case};

const HEADS: [(usize, usize); 4] = [(8, 8), (9, 3), (14, 2), (32, 8)];
const HEAD_DIMS: [usize; 5] = [64, 80, 96, 128, 256];
const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

fn check(case: Case) -> Result<()> {
    let dev = Device::Cpu;
    let (q, k, v) = common::random_qkv(&case, &dev)?;
    let (out, lse) = candle_splitkv::flash_decode_with_lse(&q, &k, &v, case.scale())?;
    assert_eq!(out.dims(), q.dims(), "{case:?}: output shape");
    assert_eq!(out.dtype(), case.dtype, "{case:?}: output dtype");
    assert_eq!(lse.dims(), &[case.b, case.h_q, 1], "{case:?}: lse shape");
    let want = reference(&q, &k, &v, case.scale(), None)?;
    assert_close(&format!("{case:?}"), &out, &want.out, case.dtype)?;
    assert_lse_close(&format!("{case:?}"), &lse, &want.lse, case.dtype)
}

/// Every combination of batch, head layout, head dim and dtype at short and tile-boundary lengths.
#[test]
fn full_matrix_short_lengths() -> Result<()> {
    let mut count = 0;
    for l in [1, 2, 255, 256, 257, 4097] {
        for b in [1, 3] {
            for (h_q, h_kv) in HEADS {
                for d in HEAD_DIMS {
                    for dtype in DTYPES {
                        check(Case {
                            b,
                            h_q,
                            h_kv,
                            d,
                            l,
                            dtype,
                        })?;
                        count += 1;
                    }
                }
            }
        }
    }
    assert_eq!(count, 6 * 2 * 4 * 5 * 3);
    println!("{count} cases passed");
    Ok(())
}

/// L = 50000 for every head layout, head dim and dtype; batch 3 where the KV stays small enough
/// for the f64 reference to be quick, batch 1 elsewhere.
#[test]
fn full_matrix_long_length() -> Result<()> {
    let mut count = 0;
    for (h_q, h_kv) in HEADS {
        for d in HEAD_DIMS {
            for dtype in DTYPES {
                let b = if h_kv * d <= 256 { 3 } else { 1 };
                check(Case {
                    b,
                    h_q,
                    h_kv,
                    d,
                    l: 50000,
                    dtype,
                })?;
                count += 1;
            }
        }
    }
    println!("{count} cases passed");
    Ok(())
}
