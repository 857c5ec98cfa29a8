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
    /// Number of cached positions L (the k/v sequence dimension).
    pub kv_len: usize,
    /// Query tokens per sequence: the last `q_len` positions of each sequence.
    pub q_len: usize,
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

/// Checks the shapes, strides and dtypes of q, k and v as the op sees them.
pub fn check_layouts(
    q: (DType, &Layout),
    k: (DType, &Layout),
    v: (DType, &Layout),
) -> Result<DecodeDims> {
    let (q_dtype, q_layout) = q;
    let (k_dtype, k_layout) = k;
    let (v_dtype, v_layout) = v;
    check_rank4("q", q_layout.dims(), "(batch, q_len, q_heads, head_dim)")?;
    check_rank4("k", k_layout.dims(), "(batch, kv_len, kv_heads, head_dim)")?;
    check_rank4("v", v_layout.dims(), "(batch, kv_len, kv_heads, head_dim)")?;
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
    if q_len == 0 || q_len > MAX_QUERY_TOKENS {
        bail!(
            "split-kv attention: q has q_len = {q_len} (shape {:?}); the op takes 1 to \
             {MAX_QUERY_TOKENS} query tokens per sequence; use causal attention for a longer prefill",
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
    if kb != b {
        bail!("split-kv attention: batch mismatch, q has {b} and k/v have {kb}")
    }
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
    })
}

/// Checks tensors before they reach the op: everything [`check_layouts`] checks, plus devices.
pub fn check_tensors(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<DecodeDims> {
    if !q.device().same_device(k.device()) || !q.device().same_device(v.device()) {
        bail!(
            "split-kv attention: q, k and v must be on the same device, got q on {:?}, k on {:?}, \
             v on {:?}",
            q.device().location(),
            k.device().location(),
            v.device().location()
        )
    }
    check_layouts(
        (q.dtype(), q.layout()),
        (k.dtype(), k.layout()),
        (v.dtype(), v.layout()),
    )
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

/// A window of at least one position, a finite positive soft cap.
pub fn check_window_and_softcap(window_left: Option<usize>, softcap: Option<f32>) -> Result<()> {
    if window_left == Some(0) {
        bail!(
            "split-kv attention: window_left must be at least 1 (a query then sees itself and the \
             one before); use None for no window"
        )
    }
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
