//! candle-flash-attn's API on the split-KV op: the same functions, arguments, shapes and masks,
//! on CUDA and the CPU, so that a model written for `candle_flash_attn` switches with one line:
//!
//! ```
//! use candle_splitkv::flash_attn as candle_flash_attn;
//! # use candle_core::{Device, Tensor};
//! # fn main() -> candle_core::Result<()> {
//! # let dev = Device::Cpu;
//! # let q = Tensor::randn(0f32, 1.0, (1, 7, 8, 64), &dev)?;
//! # let k = Tensor::randn(0f32, 1.0, (1, 7, 2, 64), &dev)?;
//! # let v = k.clone();
//! let y = candle_flash_attn::flash_attn(&q, &k, &v, 0.125, true)?;
//! # assert_eq!(y.dims(), &[1, 7, 8, 64]);
//! # Ok(()) }
//! ```
//!
//! - q `(batch, seq_len_q, num_heads_q, head_dim)`, k and v `(batch, seq_len_kv, num_heads_kv,
//!   head_dim)`, `num_heads_q` a multiple of `num_heads_kv`; the output has q's shape and dtype.
//! - **Masks as FlashAttention-2 (2.1 and later) aligns them**: query i of `seq_len_q` sits at
//!   position `seq_len_kv − seq_len_q + i` (bottom right), and with a window sees keys
//!   `pos − window_size_left ..= pos + window_size_right`. `None`, or a size past `seq_len_kv`,
//!   leaves that side open: `(None, Some(0))` is the causal mask, `(None, None)` none. A query
//!   that sees no key (causal with more queries than keys) gets zeros.
//! - **Beyond candle-flash-attn**: f32 as well as f16/bf16, the CPU as well as CUDA (the same
//!   kernels as the rest of the crate: split-KV decode, the prefill forms), any compute
//!   capability from 8.0. **Narrower**: head dims 64, 80, 96, 128 and 256
//!   ([`SUPPORTED_HEAD_DIMS`](crate::SUPPORTED_HEAD_DIMS)); ALiBi slopes and the paged form's
//!   `mm_prefix_ranges` are refused with an error that says so. Every failure is a
//!   `candle_core::Error`.
//!
//! The varlen forms ([`flash_attn_varlen`] and its siblings) are in `varlen.rs`.

mod varlen;

use candle_core::{bail, Result, Tensor};

use crate::op::SplitKvAttention;

pub use varlen::{
    flash_attn_varlen, flash_attn_varlen_alibi, flash_attn_varlen_alibi_windowed,
    flash_attn_varlen_alibi_windowed_softcap, flash_attn_varlen_paged_windowed,
    flash_attn_varlen_windowed,
};

/// Scaled dot-product attention, `softmax(q·kᵀ · softmax_scale) · v`, causal or not.
///
/// q: `(batch, seq_len_q, num_heads_q, head_dim)`; k, v: `(batch, seq_len_kv, num_heads_kv,
/// head_dim)`, `num_heads_q` a multiple of `num_heads_kv`. With `causal`, query i sees the keys
/// up to position `seq_len_kv − seq_len_q + i`. Returns q's shape and dtype.
pub fn flash_attn(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    flash_attn_windowed(q, k, v, softmax_scale, None, causal_window_right(causal))
}

/// [`flash_attn`] with a local window: query i, at position `p = seq_len_kv − seq_len_q + i`,
/// sees the keys `p − window_size_left ..= p + window_size_right`. `None` (or a size past
/// `seq_len_kv`) leaves that side open, so `(None, Some(0))` is the causal mask.
pub fn flash_attn_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    let kv_len = k.dims().get(1).copied().unwrap_or(0);
    attention_op(
        softmax_scale,
        window_size_left,
        window_size_right,
        kv_len,
        None,
    )?
    .forward(q, k, v)
}

/// candle-flash-attn's ALiBi form. ALiBi is not supported: always an error that says so.
pub fn flash_attn_alibi(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: &Tensor,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    flash_attn_alibi_windowed(
        q,
        k,
        v,
        alibi_slopes,
        softmax_scale,
        None,
        causal_window_right(causal),
    )
}

/// candle-flash-attn's windowed ALiBi form. ALiBi is not supported: always an error that says so.
pub fn flash_attn_alibi_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: &Tensor,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    flash_attn_alibi_windowed_softcap(
        q,
        k,
        v,
        Some(alibi_slopes),
        softmax_scale,
        window_size_left,
        window_size_right,
        0.0,
    )
}

/// [`flash_attn_windowed`] with Gemma-2's logit soft-capping: scores (after the softmax scale)
/// become `softcap · tanh(s / softcap)`; a `softcap` of 0 caps nothing, as in candle-flash-attn.
/// `alibi_slopes` must be `None`: ALiBi is not supported.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_alibi_windowed_softcap(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: Option<&Tensor>,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
    softcap: f32,
) -> Result<Tensor> {
    refuse_alibi(alibi_slopes)?;
    let kv_len = k.dims().get(1).copied().unwrap_or(0);
    attention_op(
        softmax_scale,
        window_size_left,
        window_size_right,
        kv_len,
        Some(softcap),
    )?
    .forward(q, k, v)
}

/// The split-KV op for FlashAttention-2's window sizes over keys of (at most) `kv_len`
/// positions: a size past `kv_len` is no bound, as candle-flash-attn reads it; a soft cap of 0
/// is none.
fn attention_op(
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
    kv_len: usize,
    softcap: Option<f32>,
) -> Result<SplitKvAttention> {
    let within = |w: usize| w <= kv_len;
    let softcap = match softcap {
        Some(0.0) => None,
        Some(c) if !(c.is_finite() && c > 0.0) => {
            bail!("flash_attn: softcap must be finite and positive, or 0 for none, got {c}")
        }
        other => other,
    };
    Ok(SplitKvAttention::new(softmax_scale)
        .with_window_left(window_size_left.filter(|&w| within(w)))
        .with_window_right(window_size_right.filter(|&w| within(w)))
        .with_softcap(softcap))
}

/// candle-flash-attn's `causal` as a right window: 0 past the query's own position, or no bound.
fn causal_window_right(causal: bool) -> Option<usize> {
    causal.then_some(0)
}

fn refuse_alibi(alibi_slopes: Option<&Tensor>) -> Result<()> {
    if alibi_slopes.is_some() {
        bail!(
            "flash_attn: ALiBi slopes are not supported by candle-splitkv; call the form without \
             `alibi` (or pass None), or keep candle-flash-attn for ALiBi models"
        )
    }
    Ok(())
}
