//! Contiguous K/V copied into a pool of pages, for checking the paged op against the contiguous
//! one on the same data.

use candle_core::{DType, Device, Result, Tensor};

/// A paged copy of `(b, L, h_kv, d)` K/V.
pub struct PagedKv {
    /// `(num_pages, page_size, h_kv, d)`.
    pub k_pages: Tensor,
    pub v_pages: Tensor,
    /// u32 `(b, max_pages)`.
    pub block_table: Tensor,
    /// u32 `(b,)`.
    pub seqlens: Tensor,
}

/// How the pool is laid out.
#[derive(Debug, Clone, Copy)]
pub struct Layout {
    pub page_size: usize,
    /// Pages in the pool that no sequence uses, filled with NaN.
    pub spare_pages: usize,
    /// Table entries per sequence beyond what the longest needs, holding indices outside the
    /// pool: they must never be read.
    pub spare_entries: usize,
    /// Sequence 1 uses sequence 0's pages for the first `shared_pages` pages (their contents
    /// must be equal; see [`share_prefix`]).
    pub shared_pages: usize,
    /// Seed of the page order.
    pub seed: u64,
}

/// Copies `len` positions of sequence 0 of `x` `(b, L, h, d)` over sequence 1's, so that they
/// may share pages.
pub fn share_prefix(x: &Tensor, len: usize) -> Result<Tensor> {
    if len == 0 {
        return Ok(x.clone());
    }
    let first = x.narrow(0, 0, 1)?.narrow(1, 0, len)?;
    x.slice_assign(&[1..2, 0..len, 0..x.dim(2)?, 0..x.dim(3)?], &first)
}

/// A pseudo-random permutation of `0..n`.
fn shuffled(n: usize, seed: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407)
        | 1;
    for i in (1..n).rev() {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        order.swap(i, (state % (i as u64 + 1)) as usize);
    }
    order
}

/// Pages `k` and `v` `(b, L, h_kv, d)`, sequence `i` holding its first `lens[i]` positions; every
/// position of a page past its sequence's length is NaN, and so are the spare pages. The pool
/// has k's dtype and device.
pub fn page_kv(k: &Tensor, v: &Tensor, lens: &[u32], layout: Layout) -> Result<PagedKv> {
    let (b, _, h, d) = k.dims4()?;
    let page = layout.page_size;
    let pages_of = |len: u32| (len as usize).div_ceil(page);
    let longest = lens.iter().map(|&l| pages_of(l)).max().unwrap_or(0);
    let max_pages = longest + layout.spare_entries;
    // (sequence, page of it) for every page the pool holds, shared ones once.
    let mut owners = Vec::new();
    for (seq, &len) in lens.iter().enumerate() {
        for p in 0..pages_of(len) {
            if !(seq == 1 && p < layout.shared_pages) {
                owners.push(Some((seq, p)));
            }
        }
    }
    owners.extend(std::iter::repeat_n(None, layout.spare_pages));
    let order = shuffled(owners.len(), layout.seed);
    let pool: Vec<Option<(usize, usize)>> = order.iter().map(|&i| owners[i]).collect();
    let where_is = |seq: usize, p: usize| pool.iter().position(|o| *o == Some((seq, p)));

    let num_pages = pool.len().max(1);
    let mut table = vec![u32::MAX - 7; b * max_pages.max(1)];
    for (seq, &len) in lens.iter().enumerate() {
        for p in 0..pages_of(len) {
            let owner = if seq == 1 && p < layout.shared_pages {
                0
            } else {
                seq
            };
            table[seq * max_pages.max(1) + p] =
                where_is(owner, p).expect("every used page is in the pool") as u32;
        }
    }
    let fill = |x: &Tensor| -> Result<Tensor> {
        let host = x
            .to_device(&Device::Cpu)?
            .to_dtype(DType::F32)?
            .contiguous()?;
        let l = host.dim(1)?;
        let data = host.flatten_all()?.to_vec1::<f32>()?;
        let row = h * d;
        let mut out = vec![f32::NAN; num_pages * page * row];
        for (slot, owner) in pool.iter().enumerate() {
            let Some((seq, p)) = *owner else { continue };
            let len = lens[seq] as usize;
            for r in 0..page {
                let pos = p * page + r;
                if pos < len {
                    let src = &data[(seq * l + pos) * row..][..row];
                    out[(slot * page + r) * row..][..row].copy_from_slice(src);
                }
            }
        }
        // Converted on the CPU: candle's CUDA casts do not all reach fp8.
        Tensor::from_vec(out, (num_pages, page, h, d), &Device::Cpu)?
            .to_dtype(x.dtype())?
            .to_device(x.device())
    };
    Ok(PagedKv {
        k_pages: fill(k)?,
        v_pages: fill(v)?,
        block_table: Tensor::from_vec(table, (b, max_pages.max(1)), k.device())?,
        seqlens: Tensor::from_vec(lens.to_vec(), b, k.device())?,
    })
}

/// One paged call to check.
#[derive(Debug, Clone)]
pub struct PagedCase {
    pub t: usize,
    pub h_q: usize,
    pub h_kv: usize,
    pub d: usize,
    /// Each sequence's length; K/V hold the longest.
    pub lens: Vec<u32>,
    pub dtype: DType,
    /// K/V stored as this (the dtype, or fp8).
    pub kv_dtype: DType,
    pub layout: Layout,
    pub window: Option<usize>,
    pub softcap: Option<f32>,
}

/// Runs `case` on `device` with each kernel family and split count, output and scratch poisoned
/// with NaN: the paged op against the f64 reference, and against the contiguous op on the same
/// data.
pub fn check_paged(
    device: &Device,
    case: &PagedCase,
    kernels: &[candle_splitkv::CudaKernel],
    splits: &[Option<usize>],
) -> Result<()> {
    use super::{assert_close, assert_lse_close, poisoned, reference_masked};
    let b = case.lens.len();
    let l = case.lens.iter().copied().max().unwrap_or(0).max(1) as usize;
    let random = |shape: (usize, usize, usize, usize)| -> Result<Tensor> {
        Tensor::randn(0f32, 1.0, shape, device)?.to_dtype(case.dtype)
    };
    let q = random((b, case.t, case.h_q, case.d))?;
    let shared = case.layout.shared_pages * case.layout.page_size;
    let kv = |x: Tensor| -> Result<Tensor> {
        let x = if case.kv_dtype == DType::F8E4M3 {
            candle_splitkv::quantize_e4m3(&x.to_dtype(DType::F32)?, 1.0)?
        } else {
            x
        };
        share_prefix(&x, shared)
    };
    let k = kv(random((b, l, case.h_kv, case.d))?)?;
    let v = kv(random((b, l, case.h_kv, case.d))?)?;
    let paged = page_kv(&k, &v, &case.lens, case.layout)?;
    let scale = 1.0 / (case.d as f32).sqrt();
    let want = reference_masked(
        &q,
        &k,
        &v,
        scale,
        Some(&case.lens),
        case.window,
        case.softcap,
    )?;
    for &kernel in kernels {
        for &num_splits in splits {
            let op = |block_table: Option<&Tensor>| {
                let op = poisoned(scale)
                    .with_seqlens(paged.seqlens.clone())
                    .with_window_left(case.window)
                    .with_softcap(case.softcap)
                    .with_num_splits(num_splits)
                    .with_cuda_kernel(kernel);
                match block_table {
                    Some(table) => op.with_block_table(table.clone()),
                    None => op,
                }
            };
            let what = format!("{device:?} {kernel:?} splits {num_splits:?} {case:?}");
            let (out, lse) = op(Some(&paged.block_table)).forward_with_lse(
                &q,
                &paged.k_pages,
                &paged.v_pages,
            )?;
            assert_close(&what, &out, &want.out, case.dtype)?;
            assert_lse_close(&what, &lse, &want.lse, case.dtype)?;
            let contiguous = op(None).forward(&q, &k, &v)?;
            assert_close(
                &format!("{what}: against the contiguous op"),
                &out,
                &super::host_f64(&contiguous)?,
                case.dtype,
            )?;
        }
    }
    Ok(())
}
