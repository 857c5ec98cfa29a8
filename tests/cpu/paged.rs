//! The op over paged K/V on the CPU: against the f64 reference and the contiguous op on the same
//! data, over shuffled block tables, pages shared between sequences, NaN in every position no
//! sequence owns, every dtype, head dim and group size, page sizes 1 to 256, lengths at and around
//! page boundaries, several query tokens, a window and soft-capping; then its errors.

use candle_core::{DType, Device, Result, Tensor};
use candle_splitkv::{flash_decode_paged, CudaKernel, SplitKvAttention};

use crate::common::paged::{check_paged, Layout, PagedCase};

fn layout(page_size: usize, seed: u64) -> Layout {
    Layout {
        page_size,
        spare_pages: 3,
        spare_entries: 2,
        shared_pages: 0,
        seed,
    }
}

fn case(lens: &[u32], page_size: usize, dtype: DType) -> PagedCase {
    PagedCase {
        t: 1,
        h_q: 8,
        h_kv: 2,
        d: 64,
        lens: lens.to_vec(),
        dtype,
        kv_dtype: dtype,
        layout: layout(page_size, lens.len() as u64 + page_size as u64),
        window: None,
        softcap: None,
    }
}

const SPLITS: [Option<usize>; 3] = [None, Some(1), Some(5)];

#[test]
fn page_sizes_and_lengths_around_page_boundaries() -> Result<()> {
    for page_size in [1, 7, 16, 256] {
        let p = page_size as u32;
        let lens = [0, 1, p - 1, p, p + 1, 3 * p + 2];
        check_paged(
            &Device::Cpu,
            &case(&lens, page_size, DType::F32),
            &[CudaKernel::Auto],
            &SPLITS,
        )?;
    }
    Ok(())
}

#[test]
fn every_dtype_head_dim_and_group() -> Result<()> {
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for d in candle_splitkv::SUPPORTED_HEAD_DIMS {
            for (h_q, h_kv) in [(4, 4), (8, 2), (12, 1)] {
                let case = PagedCase {
                    h_q,
                    h_kv,
                    d,
                    ..case(&[33, 100, 64], 16, dtype)
                };
                check_paged(&Device::Cpu, &case, &[CudaKernel::Auto], &[None])?;
            }
        }
    }
    Ok(())
}

#[test]
fn fp8_pages() -> Result<()> {
    let case = PagedCase {
        kv_dtype: DType::F8E4M3,
        ..case(&[300, 17], 16, DType::BF16)
    };
    check_paged(&Device::Cpu, &case, &[CudaKernel::Auto], &SPLITS)
}

#[test]
fn sequences_sharing_pages() -> Result<()> {
    let case = PagedCase {
        layout: Layout {
            shared_pages: 3,
            ..layout(16, 11)
        },
        ..case(&[50, 70, 10], 16, DType::F32)
    };
    check_paged(&Device::Cpu, &case, &[CudaKernel::Auto], &SPLITS)
}

#[test]
fn query_tokens_window_and_softcap() -> Result<()> {
    for (t, window, softcap) in [
        (4, None, None),
        (1, Some(20), None),
        (3, Some(40), Some(5.0)),
        (1, None, Some(50.0)),
    ] {
        let case = PagedCase {
            t,
            window,
            softcap,
            ..case(&[90, 130, 4], 16, DType::F32)
        };
        check_paged(&Device::Cpu, &case, &[CudaKernel::Auto], &SPLITS)?;
    }
    Ok(())
}

#[test]
fn a_long_sequence() -> Result<()> {
    let case = PagedCase {
        h_q: 2,
        h_kv: 1,
        ..case(&[100_003, 5], 256, DType::F32)
    };
    check_paged(&Device::Cpu, &case, &[CudaKernel::Auto], &[None])
}

#[test]
fn a_head_major_pool_goes_in_transposed() -> Result<()> {
    let dev = Device::Cpu;
    let (pages, page_size, h_kv, d) = (6, 8, 2, 64);
    // (num_pages, h_kv, page_size, d) in memory, seen as (num_pages, page_size, h_kv, d).
    let k = Tensor::randn(0f32, 1.0, (pages, h_kv, page_size, d), &dev)?;
    let v = Tensor::randn(0f32, 1.0, (pages, h_kv, page_size, d), &dev)?;
    let (k_view, v_view) = (k.transpose(1, 2)?, v.transpose(1, 2)?);
    let q = Tensor::randn(0f32, 1.0, (1, 1, 4, d), &dev)?;
    let table = Tensor::new(&[[4u32, 1, 5]], &dev)?;
    let lens = Tensor::new(&[20u32], &dev)?;
    let got = flash_decode_paged(&q, &k_view, &v_view, &table, &lens, 0.125)?;
    // The same positions gathered contiguously: pages 4, 1 and the first 4 rows of 5.
    let gather = |x: &Tensor| -> Result<Tensor> {
        let rows: Vec<Tensor> = [4usize, 1, 5]
            .iter()
            .map(|&p| x.narrow(0, p, 1))
            .collect::<Result<_>>()?;
        Tensor::cat(&rows, 1)?.narrow(1, 0, 20)
    };
    let want = candle_splitkv::flash_decode(&q, &gather(&k_view)?, &gather(&v_view)?, 0.125)?;
    let diff = (got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
    assert!(diff < 1e-6, "head-major pool: {diff}");
    Ok(())
}

fn error_of(result: Result<Tensor>) -> String {
    match result {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_tables_are_clear_errors() -> Result<()> {
    let dev = Device::Cpu;
    let q = Tensor::zeros((2, 1, 4, 64), DType::F32, &dev)?;
    let pool = Tensor::zeros((5, 16, 2, 64), DType::F32, &dev)?;
    let table = Tensor::new(&[[0u32, 1], [2, 3]], &dev)?;
    let lens = Tensor::new(&[20u32, 32], &dev)?;
    let run =
        |table: &Tensor, lens: &Tensor| flash_decode_paged(&q, &pool, &pool, table, lens, 0.125);
    run(&table, &lens)?;

    let outside = Tensor::new(&[[0u32, 1], [2, 5]], &dev)?;
    let e = error_of(run(&outside, &lens));
    assert!(
        e.contains("block_table[1][1] = 5") && e.contains("5 pages"),
        "{e}"
    );
    // Entries past a sequence's last page are not read.
    let past = Tensor::new(&[[0u32, 1], [2, 3]], &dev)?;
    run(&past, &Tensor::new(&[20u32, 17], &dev)?)?;
    let unused = Tensor::new(&[[0u32, 99], [2, 3]], &dev)?;
    run(&unused, &Tensor::new(&[16u32, 32], &dev)?)?;

    let e = error_of(run(&table, &Tensor::new(&[20u32, 33], &dev)?));
    assert!(e.contains("too short for sequence 1"), "{e}");
    let e = error_of(run(&table.to_dtype(DType::I64)?, &lens));
    assert!(e.contains("block_table must be u32"), "{e}");
    let e = error_of(run(&Tensor::new(&[[0u32, 1]], &dev)?, &lens));
    assert!(e.contains("block_table has 1 rows"), "{e}");
    let e = error_of(run(&Tensor::new(&[0u32, 1], &dev)?, &lens));
    assert!(e.contains("shape (batch, max_pages_per_seq)"), "{e}");
    let e = error_of(
        SplitKvAttention::new(0.125)
            .with_block_table(table.clone())
            .forward(&q, &pool, &pool),
    );
    assert!(e.contains("needs seqlens_k"), "{e}");
    let e = error_of(flash_decode_paged(
        &q,
        &Tensor::zeros((5, 16, 2, 32), DType::F32, &dev)?,
        &pool,
        &table,
        &lens,
        0.125,
    ));
    assert!(e.contains("same shape"), "{e}");
    Ok(())
}
