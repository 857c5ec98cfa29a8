//! candle-flash-attn's varlen forms: sequences of different lengths packed one after another,
//! found through cumulative lengths (`seqlens_q`, `seqlens_k`: u32, `batch + 1` values, `0,
//! len_0, len_0 + len_1, …`).
//!
//! The op takes q as `(batch, t, heads, head_dim)`, so the packed queries are gathered into `t =
//! max_seqlen_q` rows per sequence, each sequence's at the end (its tokens keep their positions
//! relative to its keys), and the output is gathered back; where every sequence has
//! `max_seqlen_q` queries the packed q is that shape already and nothing moves. Packed K/V of
//! unequal lengths are read in place as a pool of one-position pages. Every index is worked out
//! on q's device from the cumulative lengths, so nothing waits for the device; on the CPU the
//! lengths are also checked (monotone, within the packed tensors and within the maxima).

use candle_core::{bail, DType, Device, Result, Tensor, D};

use super::{attention_op, causal_window_right, refuse_alibi};

/// Attention over packed sequences of different lengths, causal or not.
///
/// q: `(total_q, num_heads_q, head_dim)`; k, v: `(total_kv, num_heads_kv, head_dim)`;
/// `seqlens_q`, `seqlens_k`: u32 `(batch + 1,)` cumulative lengths on q's device;
/// `max_seqlen_q`, `max_seqlen_k`: the longest sequence of each (at least). With `causal`, query
/// i of a sequence with `len_q` queries and `len_k` keys sees the keys up to `len_k − len_q + i`.
/// Returns `(total_q, num_heads_q, head_dim)` in q's dtype.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    flash_attn_varlen_windowed(
        q,
        k,
        v,
        seqlens_q,
        seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale,
        None,
        causal_window_right(causal),
    )
}

/// [`flash_attn_varlen`] with a local window (see
/// [`flash_attn_windowed`](super::flash_attn_windowed)); a size past `max_seqlen_k` is no bound.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    flash_attn_varlen_alibi_windowed_softcap(
        q,
        k,
        v,
        None,
        seqlens_q,
        seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale,
        window_size_left,
        window_size_right,
        0.0,
    )
}

/// candle-flash-attn's varlen ALiBi form. ALiBi is not supported: always an error that says so.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_alibi(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    flash_attn_varlen_alibi_windowed(
        q,
        k,
        v,
        alibi_slopes,
        seqlens_q,
        seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale,
        None,
        causal_window_right(causal),
    )
}

/// candle-flash-attn's windowed varlen ALiBi form. ALiBi is not supported: always an error that
/// says so.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_alibi_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    flash_attn_varlen_alibi_windowed_softcap(
        q,
        k,
        v,
        Some(alibi_slopes),
        seqlens_q,
        seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale,
        window_size_left,
        window_size_right,
        0.0,
    )
}

/// [`flash_attn_varlen_windowed`] with soft-capping (`softcap · tanh(s / softcap)`, 0 for none).
/// `alibi_slopes` must be `None`: ALiBi is not supported.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_alibi_windowed_softcap(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: Option<&Tensor>,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
    softcap: f32,
) -> Result<Tensor> {
    refuse_alibi(alibi_slopes)?;
    let (total_k, kv_heads, head_dim) = packed_dims(k, "k")?;
    if v.dims() != k.dims() {
        bail!(
            "flash_attn_varlen: v must have k's shape {:?}, got {:?}",
            k.dims(),
            v.dims()
        )
    }
    let queries = PackedQueries::new(q, seqlens_q, max_seqlen_q)?;
    let keys = Cumulative::new(
        seqlens_k,
        "seqlens_k",
        Some(total_k),
        max_seqlen_k,
        q.device(),
    )?;
    if keys.batch != queries.lengths.batch {
        bail!(
            "flash_attn_varlen: seqlens_q and seqlens_k must have the same number of elements, \
             got {} and {}",
            queries.lengths.batch + 1,
            keys.batch + 1
        )
    }
    let op = attention_op(
        softmax_scale,
        window_size_left,
        window_size_right,
        max_seqlen_k,
        Some(softcap),
    )?;
    let out = if keys.batch * max_seqlen_k == total_k {
        // Every sequence has max_seqlen_k keys: the packed K/V are (batch, max_seqlen_k, ..).
        let shape = (keys.batch, max_seqlen_k, kv_heads, head_dim);
        op.forward(&queries.padded, &k.reshape(shape)?, &v.reshape(shape)?)?
    } else {
        // Pages of one position: sequence b's position p is packed row seqlens_k[b] + p.
        let positions = Tensor::arange(0u32, max_seqlen_k as u32, q.device())?;
        let last_row = scalar_u32(total_k - 1, q.device())?;
        let block_table = keys
            .starts
            .unsqueeze(1)?
            .broadcast_add(&positions.unsqueeze(0)?)?
            .broadcast_minimum(&last_row)?;
        op.with_block_table(block_table)
            .with_seqlens(keys.clamped_lengths(max_seqlen_k)?)
            .forward(&queries.padded, &k.unsqueeze(1)?, &v.unsqueeze(1)?)?
    };
    queries.unpad(&out)
}

/// Varlen attention over paged K/V: k and v are pools `(num_blocks, page_block_size,
/// num_heads_kv, head_dim)`, and position p of sequence b is row `p % page_block_size` of page
/// `block_table[b][p / page_block_size]` (u32 or i32 `(batch, max_blocks)`). `seqlens_k` holds
/// the cumulative key lengths, as in [`flash_attn_varlen`]. Any page size from 1 up (candle-flash-attn
/// needs a multiple of 32). `mm_prefix_ranges` must be `None`: bidirectional prefix ranges are not
/// supported. `softcap`: as in [`flash_attn_varlen_alibi_windowed_softcap`].
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_paged_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    block_table: &Tensor,
    mm_prefix_ranges: Option<&Tensor>,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
    page_block_size: usize,
    softcap: Option<f32>,
) -> Result<Tensor> {
    if mm_prefix_ranges.is_some() {
        bail!(
            "flash_attn_varlen_paged_windowed: mm_prefix_ranges (bidirectional prefix ranges) \
             are not supported by candle-splitkv; pass None"
        )
    }
    let &[_, pool_page_size, _, _] = k.dims() else {
        bail!(
            "flash_attn_varlen_paged_windowed: k and v are page pools (num_blocks, \
             page_block_size, num_heads_kv, head_dim), got k {:?}",
            k.dims()
        )
    };
    if pool_page_size != page_block_size {
        bail!(
            "flash_attn_varlen_paged_windowed: page_block_size {page_block_size} does not match \
             k's pages of {pool_page_size} positions"
        )
    }
    let block_table = match block_table.dtype() {
        DType::U32 => block_table.clone(),
        // Candle casts i32 on the CPU only.
        DType::I32 if block_table.device().is_cpu() => block_table.to_dtype(DType::U32)?,
        other => bail!(
            "flash_attn_varlen_paged_windowed: block_table must be u32 (or i32 on the CPU), got \
             {other:?} on {:?}",
            block_table.device().location()
        ),
    };
    let (_, max_blocks) = block_table.dims2()?;
    let queries = PackedQueries::new(q, seqlens_q, max_seqlen_q)?;
    let capacity = max_blocks * page_block_size;
    let keys = Cumulative::new(seqlens_k, "seqlens_k", None, max_seqlen_k, q.device())?;
    if keys.batch != queries.lengths.batch {
        bail!(
            "flash_attn_varlen_paged_windowed: seqlens_q and seqlens_k must have the same number \
             of elements, got {} and {}",
            queries.lengths.batch + 1,
            keys.batch + 1
        )
    }
    let op = attention_op(
        softmax_scale,
        window_size_left,
        window_size_right,
        max_seqlen_k,
        softcap,
    )?;
    let out = op
        .with_block_table(block_table)
        .with_seqlens(keys.clamped_lengths(capacity.min(u32::MAX as usize))?)
        .forward(&queries.padded, k, v)?;
    queries.unpad(&out)
}

/// `(total, heads, head_dim)` of a packed tensor.
fn packed_dims(t: &Tensor, name: &str) -> Result<(usize, usize, usize)> {
    match t.dims() {
        &[total, heads, head_dim] => Ok((total, heads, head_dim)),
        dims => bail!(
            "flash_attn_varlen: {name} must be packed (total, num_heads, head_dim), got {dims:?}"
        ),
    }
}

fn scalar_u32(value: usize, device: &Device) -> Result<Tensor> {
    let Ok(value) = u32::try_from(value) else {
        bail!("flash_attn_varlen: {value} rows are more than u32 indices address")
    };
    Tensor::new(value, device)
}

/// Cumulative lengths as device tensors: where each sequence starts and ends, and its length.
struct Cumulative {
    batch: usize,
    starts: Tensor,
    ends: Tensor,
    lengths: Tensor,
}

impl Cumulative {
    /// Checks shape, dtype and device; on the CPU also the values: non-decreasing from 0, ending
    /// at `total` where the rows are packed, and each length at most `max_len`.
    fn new(
        cumulative: &Tensor,
        name: &str,
        total: Option<usize>,
        max_len: usize,
        device: &Device,
    ) -> Result<Self> {
        if cumulative.dtype() != DType::U32 {
            bail!(
                "flash_attn_varlen: {name} must be u32, got {:?}",
                cumulative.dtype()
            )
        }
        if !cumulative.device().same_device(device) {
            bail!("flash_attn_varlen: {name} must be on q's device")
        }
        let n = match cumulative.dims() {
            &[n] if n >= 2 => n,
            dims => bail!(
                "flash_attn_varlen: {name} must be (batch + 1,) cumulative lengths, at least 2 \
                 values, got shape {dims:?}"
            ),
        };
        if device.is_cpu() {
            check_cumulative(&cumulative.to_vec1::<u32>()?, name, total, max_len)?;
        }
        let batch = n - 1;
        let starts = cumulative.narrow(0, 0, batch)?;
        let ends = cumulative.narrow(0, 1, batch)?;
        let lengths = ends.sub(&starts)?;
        Ok(Self {
            batch,
            starts,
            ends,
            lengths,
        })
    }

    /// The lengths, each at most `bound` (on CUDA, where they are not checked, so that a wrong
    /// one never reads past what the call addresses).
    fn clamped_lengths(&self, bound: usize) -> Result<Tensor> {
        self.lengths
            .broadcast_minimum(&scalar_u32(bound, self.lengths.device())?)
    }
}

fn check_cumulative(
    values: &[u32],
    name: &str,
    total: Option<usize>,
    max_len: usize,
) -> Result<()> {
    if values[0] != 0 {
        bail!(
            "flash_attn_varlen: {name} must start at 0, got {}",
            values[0]
        )
    }
    for (b, pair) in values.windows(2).enumerate() {
        if pair[1] < pair[0] {
            bail!(
                "flash_attn_varlen: {name} must not decrease, got {} then {} at sequence {b}",
                pair[0],
                pair[1]
            )
        }
        let len = (pair[1] - pair[0]) as usize;
        if len > max_len {
            bail!(
                "flash_attn_varlen: sequence {b} has {len} positions in {name}, more than the \
                 maximum given, {max_len}"
            )
        }
    }
    let last = values[values.len() - 1] as usize;
    match total {
        Some(total) if last != total => bail!(
            "flash_attn_varlen: {name} ends at {last}, but the packed tensor has {total} rows"
        ),
        _ => Ok(()),
    }
}

/// The packed queries as the op takes them, `(batch, max_seqlen_q, heads, head_dim)`, and the way
/// back.
struct PackedQueries {
    padded: Tensor,
    lengths: Cumulative,
    max_len: usize,
    total: usize,
    /// Whether every sequence has max_len queries (the packed q is the padded one, reshaped).
    uniform: bool,
}

impl PackedQueries {
    fn new(q: &Tensor, seqlens_q: &Tensor, max_len: usize) -> Result<Self> {
        let (total, heads, head_dim) = packed_dims(q, "q")?;
        if max_len == 0 {
            bail!("flash_attn_varlen: max_seqlen_q must be at least 1")
        }
        let lengths = Cumulative::new(seqlens_q, "seqlens_q", Some(total), max_len, q.device())?;
        let batch = lengths.batch;
        let uniform = batch * max_len == total;
        let padded = if uniform {
            q.reshape((batch, max_len, heads, head_dim))?
        } else {
            // Row j of sequence b is packed row ends[b] − max_len + j: its queries at the end,
            // the rows before them (clamped into the tensor) computed and dropped.
            let offsets = Tensor::arange(0u32, max_len as u32, q.device())?;
            let floor = scalar_u32(max_len, q.device())?;
            let rows = lengths
                .ends
                .unsqueeze(1)?
                .broadcast_add(&offsets.unsqueeze(0)?)?
                .broadcast_maximum(&floor)?
                .broadcast_sub(&floor)?
                .broadcast_minimum(&scalar_u32(total.saturating_sub(1), q.device())?)?
                .flatten_all()?;
            q.index_select(&rows, 0)?
                .reshape((batch, max_len, heads, head_dim))?
        };
        Ok(Self {
            padded,
            lengths,
            max_len,
            total,
            uniform,
        })
    }

    /// The packed rows of the op's output `(batch, max_len, heads, head_dim)`.
    fn unpad(&self, out: &Tensor) -> Result<Tensor> {
        let (batch, _, heads, head_dim) = out.dims4()?;
        let flat = out.reshape((batch * self.max_len, heads, head_dim))?;
        if self.uniform {
            return Ok(flat);
        }
        let device = out.device();
        // Packed row r belongs to the sequence whose end is the first above r: the count of ends
        // at or below it (the last end, the total, is above every row).
        let rows = Tensor::arange(0u32, self.total as u32, device)?;
        let sequence = if batch > 1 {
            rows.unsqueeze(1)?
                .broadcast_ge(&self.lengths.ends.narrow(0, 0, batch - 1)?.unsqueeze(0)?)?
                .to_dtype(DType::U32)?
                .sum(D::Minus1)?
        } else {
            rows.zeros_like()?
        };
        // Its place in the padded rows: sequence · max_len + (r − (end − max_len)).
        let ends = self.lengths.ends.index_select(&sequence, 0)?;
        let max_len = scalar_u32(self.max_len, device)?;
        let within = rows
            .broadcast_add(&max_len)?
            .maximum(&ends)?
            .sub(&ends)?
            .broadcast_minimum(&scalar_u32(self.max_len - 1, device)?)?;
        let source = sequence.broadcast_mul(&max_len)?.add(&within)?;
        flat.index_select(&source, 0)
    }
}
