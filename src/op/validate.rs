//! Input checks shared by every backend. Each failure is a `candle_core::Error` whose message says
//! what was wrong and what is allowed.

use candle_core::{bail, DType, Layout, Result, Tensor};

include!(concat!(env!("OUT_DIR"), "/limits.rs"));

/// Sizes of one decode call, after validation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeDims {
    pub batch: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Number of cached positions L (the k/v sequence dimension); with pages, the most a
    /// sequence's row of the block table holds (`max_pages · page_size`).
    pub kv_len: usize,
    /// Query tokens per sequence: the last `q_len` positions of each sequence.
    pub q_len: usize,
    /// K/V in a pool of pages instead of one row of positions per sequence.
    pub pages: Option<PageDims>,
}

/// The sizes of a paged K/V pool: k and v are `(num_pages, page_size, kv_heads, head_dim)`, and
/// position p of sequence b is row `p % page_size` of page `block_table[b][p / page_size]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageDims {
    pub num_pages: usize,
    pub page_size: usize,
    /// Entries in each sequence's row of the block table.
    pub max_pages: usize,
}

impl DecodeDims {
    /// Query heads per KV head.
    pub fn group_size(&self) -> usize {
        self.q_heads / self.kv_heads
    }
}

/// Element strides and offset of a `(b, seq, heads, d)` view whose last dim is contiguous.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowStrides {
    pub offset: usize,
    pub batch: usize,
    pub seq: usize,
    pub head: usize,
}

impl RowStrides {
    pub fn of(layout: &Layout) -> Self {
        let s = layout.stride();
        Self {
            offset: layout.start_offset(),
            batch: s[0],
            seq: s[1],
            head: s[2],
        }
    }

    /// Offset of the first element of row `(b, pos, head)`.
    #[inline]
    pub fn row(&self, b: usize, pos: usize, head: usize) -> usize {
        self.offset + b * self.batch + pos * self.seq + head * self.head
    }
}

fn check_rank4(name: &str, dims: &[usize], expected: &str) -> Result<()> {
    if dims.len() != 4 {
        bail!(
            "split-kv attention: {name} must have rank 4 {expected}, got shape {dims:?} (rank {})",
            dims.len()
        )
    }
    Ok(())
}

fn check_last_dim_contiguous(name: &str, layout: &Layout) -> Result<()> {
    let dims = layout.dims();
    let stride = layout.stride();
    if dims[3] > 1 && stride[3] != 1 {
        bail!(
            "split-kv attention: the last (head_dim) dimension of {name} must be contiguous (stride 1), \
             got strides {stride:?}; call .contiguous() on it first"
        )
    }
    Ok(())
}

/// Checks the shapes, strides and dtypes of q, k and v as the op sees them. With
/// `block_table_dims`, the shape of a block table, k and v are a pool of pages.
pub fn check_layouts(
    q: (DType, &Layout),
    k: (DType, &Layout),
    v: (DType, &Layout),
    block_table_dims: Option<&[usize]>,
) -> Result<DecodeDims> {
    let (q_dtype, q_layout) = q;
    let (k_dtype, k_layout) = k;
    let (v_dtype, v_layout) = v;
    let kv_shape = match block_table_dims {
        None => "(batch, kv_len, kv_heads, head_dim)",
        Some(_) => "(num_pages, page_size, kv_heads, head_dim)",
    };
    check_rank4("q", q_layout.dims(), "(batch, q_len, q_heads, head_dim)")?;
    check_rank4("k", k_layout.dims(), kv_shape)?;
    check_rank4("v", v_layout.dims(), kv_shape)?;
    if k_dtype != v_dtype || (k_dtype != q_dtype && k_dtype != DType::F8E4M3) {
        bail!(
            "split-kv attention: k and v must share one dtype, q's or f8e4m3, got q {q_dtype:?}, \
             k {k_dtype:?}, v {v_dtype:?}"
        )
    }
    if !matches!(q_dtype, DType::F32 | DType::F16 | DType::BF16) {
        bail!("split-kv attention: dtype {q_dtype:?} is not supported; use f32, f16 or bf16")
    }
    let (b, q_len, h_q, d) = q_layout.shape().dims4()?;
    let (kb, kv_len, h_kv, kd) = k_layout.shape().dims4()?;
    if q_len == 0 {
        bail!(
            "split-kv attention: q has q_len = 0 (shape {:?}); the op takes at least one query \
             token per sequence",
            q_layout.dims()
        )
    }
    if k_layout.dims() != v_layout.dims() {
        bail!(
            "split-kv attention: k and v must have the same shape, got k {:?} and v {:?}",
            k_layout.dims(),
            v_layout.dims()
        )
    }
    let (kv_len, pages) = match block_table_dims {
        None if kb != b => {
            bail!("split-kv attention: batch mismatch, q has {b} and k/v have {kb}")
        }
        None => (kv_len, None),
        Some(table) => {
            let pages = check_page_dims(table, b, kb, kv_len)?;
            (pages.max_pages * pages.page_size, Some(pages))
        }
    };
    if kd != d {
        bail!("split-kv attention: head_dim mismatch, q has {d} and k/v have {kd}")
    }
    if !SUPPORTED_HEAD_DIMS.contains(&d) {
        bail!(
            "split-kv attention: head_dim {d} is not supported; supported: {SUPPORTED_HEAD_DIMS:?}"
        )
    }
    if h_kv == 0 || h_q == 0 || h_q % h_kv != 0 {
        bail!(
            "split-kv attention: q_heads ({h_q}) must be a positive multiple of kv_heads ({h_kv})"
        )
    }
    check_last_dim_contiguous("q", q_layout)?;
    check_last_dim_contiguous("k", k_layout)?;
    check_last_dim_contiguous("v", v_layout)?;
    Ok(DecodeDims {
        batch: b,
        q_heads: h_q,
        kv_heads: h_kv,
        head_dim: d,
        kv_len,
        q_len,
        pages,
    })
}

/// The page sizes of a pool of `num_pages` pages of `page_size` positions, read through a block
/// table of shape `table` by `batch` sequences.
fn check_page_dims(
    table: &[usize],
    batch: usize,
    num_pages: usize,
    page_size: usize,
) -> Result<PageDims> {
    let &[rows, max_pages] = table else {
        bail!(
            "split-kv attention: block_table must have shape (batch, max_pages_per_seq), got \
             {table:?}"
        )
    };
    if rows != batch {
        bail!(
            "split-kv attention: block_table has {rows} rows, q has {batch} sequences; the table \
             needs one row per sequence"
        )
    }
    if num_pages == 0 || page_size == 0 || max_pages == 0 {
        bail!(
            "split-kv attention: a paged call needs at least one page of at least one position \
             and a table of at least one entry per sequence, got {num_pages} pages of \
             {page_size} positions and {max_pages} entries per sequence"
        )
    }
    let longest = max_pages
        .checked_mul(page_size)
        .filter(|&l| l <= MAX_KV_LEN);
    let Some(_) = longest else {
        bail!(
            "split-kv attention: {max_pages} pages of {page_size} positions per sequence exceed \
             the longest sequence the op takes, {MAX_KV_LEN} positions"
        )
    };
    Ok(PageDims {
        num_pages,
        page_size,
        max_pages,
    })
}

/// The longest sequence a paged call may describe: positions are 32-bit signed on CUDA.
const MAX_KV_LEN: usize = i32::MAX as usize;

/// Checks tensors before they reach the op: everything [`check_layouts`] checks, plus devices,
/// the query tokens the device takes, and with a block table its dtype and device.
pub fn check_tensors(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    block_table: Option<&Tensor>,
) -> Result<DecodeDims> {
    if !q.device().same_device(k.device()) || !q.device().same_device(v.device()) {
        bail!(
            "split-kv attention: q, k and v must be on the same device, got q on {:?}, k on {:?}, \
             v on {:?}",
            q.device().location(),
            k.device().location(),
            v.device().location()
        )
    }
    if let Some(table) = block_table {
        if table.dtype() != DType::U32 {
            bail!(
                "split-kv attention: block_table must be u32, got {:?}",
                table.dtype()
            )
        }
        if !table.device().same_device(q.device()) {
            bail!(
                "split-kv attention: block_table must be on q's device ({:?}), got {:?}",
                q.device().location(),
                table.device().location()
            )
        }
    }
    let dims = check_layouts(
        (q.dtype(), q.layout()),
        (k.dtype(), k.layout()),
        (v.dtype(), v.layout()),
        block_table.map(Tensor::dims),
    )?;
    Ok(dims)
}

/// Checks the per-sequence lengths of a varlen call: u32 of shape `(batch,)`, on q's device.
/// The values themselves are checked by the backend that reads them.
pub fn check_seqlens(seqlens: &Tensor, q: &Tensor, dims: &DecodeDims) -> Result<()> {
    if seqlens.dtype() != DType::U32 {
        bail!(
            "split-kv attention: seqlens_k must be u32, got {:?}",
            seqlens.dtype()
        )
    }
    if seqlens.dims() != [dims.batch] {
        bail!(
            "split-kv attention: seqlens_k must have shape ({},) (one length per batch entry), got {:?}",
            dims.batch,
            seqlens.dims()
        )
    }
    if !seqlens.device().same_device(q.device()) {
        bail!(
            "split-kv attention: seqlens_k must be on q's device ({:?}), got {:?}",
            q.device().location(),
            seqlens.device().location()
        )
    }
    Ok(())
}

/// Checks host-side length values against L.
pub fn check_seqlen_values(seqlens: &[u32], kv_len: usize) -> Result<()> {
    if let Some((i, &len)) = seqlens
        .iter()
        .enumerate()
        .find(|(_, &len)| len as usize > kv_len)
    {
        bail!("split-kv attention: seqlens_k[{i}] = {len} exceeds the k/v length {kv_len}")
    }
    Ok(())
}

/// Checks host-side block table values: every page a sequence's length reaches is in the pool.
/// Entries past a sequence's last page are not read and may hold anything.
pub fn check_block_table_values(table: &[u32], seqlens: &[u32], pages: PageDims) -> Result<()> {
    for (b, &len) in seqlens.iter().enumerate() {
        let len = len as usize;
        if len > pages.max_pages * pages.page_size {
            bail!(
                "split-kv attention: block_table is too short for sequence {b}: its length {len} \
                 needs {} pages of {} positions, the table has {} per sequence",
                len.div_ceil(pages.page_size),
                pages.page_size,
                pages.max_pages
            )
        }
        let row = &table[b * pages.max_pages..][..len.div_ceil(pages.page_size)];
        if let Some((i, &page)) = row
            .iter()
            .enumerate()
            .find(|(_, &page)| page as usize >= pages.num_pages)
        {
            bail!(
                "split-kv attention: block_table[{b}][{i}] = {page} is not a page of the pool, \
                 which has {} pages",
                pages.num_pages
            )
        }
    }
    Ok(())
}

/// A finite positive soft cap.
pub fn check_softcap(softcap: Option<f32>) -> Result<()> {
    if let Some(c) = softcap {
        if !(c.is_finite() && c > 0.0) {
            bail!("split-kv attention: softcap must be finite and positive, got {c}; use None for no capping")
        }
    }
    Ok(())
}

pub fn check_num_splits(num_splits: Option<usize>) -> Result<()> {
    if num_splits == Some(0) {
        bail!(
            "split-kv attention: num_splits must be at least 1 (or None for the heuristic), got 0"
        )
    }
    Ok(())
}

/// The K and V scales must be finite and positive: the stored values times their scale are the
/// real ones.
pub fn check_kv_scales(k_scale: f32, v_scale: f32) -> Result<()> {
    for (name, scale) in [("k_scale", k_scale), ("v_scale", v_scale)] {
        if !(scale.is_finite() && scale > 0.0) {
            bail!("split-kv attention: {name} must be finite and positive, got {scale}")
        }
    }
    Ok(())
}
