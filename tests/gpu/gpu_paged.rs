//! The op over paged K/V on a CUDA device (skipped without one): both kernel families, every
//! dtype and fp8 K/V, head dims, group sizes (wide groups too), page sizes 1 to 256, lengths at
//! and around page boundaries and 100,003, shared pages, several query tokens, a window and
//! soft-capping, against the f64 reference and the contiguous op, with NaN in every position no
//! sequence owns and in the output and split scratch.

use candle_core::{DType, Result};
use candle_splitkv::CudaKernel;

use crate::common::paged::{check_paged, Layout, PagedCase};
use crate::common::{gpu, gpu_for_fp8};

const SPLITS: [Option<usize>; 3] = [None, Some(1), Some(7)];
const KERNELS: [CudaKernel; 2] = [CudaKernel::TensorCore, CudaKernel::CudaCore];

fn case(lens: &[u32], page_size: usize, dtype: DType) -> PagedCase {
    PagedCase {
        t: 1,
        h_q: 32,
        h_kv: 8,
        d: 128,
        lens: lens.to_vec(),
        dtype,
        kv_dtype: dtype,
        layout: Layout {
            page_size,
            spare_pages: 5,
            spare_entries: 3,
            shared_pages: 0,
            seed: page_size as u64 * 31 + lens.len() as u64,
        },
        window: None,
        softcap: None,
    }
}

fn kernels_for(dtype: DType) -> &'static [CudaKernel] {
    if dtype == DType::F32 {
        &KERNELS[1..]
    } else {
        &KERNELS
    }
}

#[test]
fn page_sizes_and_lengths_around_page_boundaries() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    for page_size in [1, 7, 16, 32, 64, 256] {
        let p = page_size as u32;
        let lens = [0, 1, p - 1, p, p + 1, 37 * p + 3];
        let case = case(&lens, page_size, DType::BF16);
        check_paged(&dev, &case, &KERNELS, &SPLITS)?;
    }
    Ok(())
}

#[test]
fn every_dtype_head_dim_and_group() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for d in candle_splitkv::SUPPORTED_HEAD_DIMS {
            for (h_q, h_kv) in [(8, 8), (32, 8), (12, 1), (64, 2)] {
                let case = PagedCase {
                    h_q,
                    h_kv,
                    d,
                    ..case(&[1000, 2049, 17], 16, dtype)
                };
                check_paged(&dev, &case, kernels_for(dtype), &[None, Some(3)])?;
            }
        }
    }
    Ok(())
}

#[test]
fn fp8_pages() -> Result<()> {
    let Some(dev) = gpu_for_fp8("fp8_pages")? else {
        return Ok(());
    };
    for (d, page_size) in [(128, 16), (64, 16), (128, 256), (64, 7)] {
        for dtype in [DType::BF16, DType::F16] {
            let case = PagedCase {
                d,
                kv_dtype: DType::F8E4M3,
                ..case(&[3000, 511, 1], page_size, dtype)
            };
            check_paged(&dev, &case, &KERNELS[..1], &SPLITS)?;
        }
    }
    Ok(())
}

#[test]
fn shared_pages_query_tokens_window_and_softcap() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    for (t, window, softcap) in [
        (1, None, None),
        (4, None, None),
        (1, Some(1000), None),
        (3, Some(100), Some(5.0)),
        (1, None, Some(50.0)),
    ] {
        let case = PagedCase {
            t,
            window,
            softcap,
            layout: Layout {
                shared_pages: 20,
                ..case(&[], 16, DType::BF16).layout
            },
            ..case(&[4000, 700, 2500], 16, DType::BF16)
        };
        check_paged(&dev, &case, &KERNELS, &SPLITS)?;
    }
    Ok(())
}

#[test]
fn a_long_sequence_and_many_waves() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    check_paged(
        &dev,
        &case(&[100_003, 9], 256, DType::BF16),
        &KERNELS,
        &[None],
    )?;
    let many: Vec<u32> = (0..24).map(|i| 3000 + 97 * i).collect();
    check_paged(&dev, &case(&many, 16, DType::BF16), &KERNELS, &[None])
}
