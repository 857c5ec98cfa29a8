//! Where a pass's queries look: the attention weights of its tokens over the cache, recomputed in
//! f32 from the queries each layer handed to attention and the keys the cache holds. The split-KV
//! op never forms these weights (it keeps a running softmax), so a caller that wants to read them
//! (which part of a document an instruction after it attends to) gets them here, apart from the
//! pass.

use std::cell::RefCell;

use candle_core::{DType, Result, Tensor};

use super::config::LlamaConfig;
use crate::nn::cache::KvCache;

/// The queries `(1, t, q_heads, head_dim)` each layer attended with, after RoPE, in layer order;
/// a pass in several chunks records one per layer and chunk.
pub(super) type QueryRecord = RefCell<Vec<Tensor>>;

/// The f32 attention weights `(q_heads, t, len)` of the last `t` positions of layer `layer`'s
/// cache (`len` long) over all of it, from their queries `q (1, t, q_heads, head_dim)`: the
/// layer's softmax scale, soft-capping, causal mask and sliding window, as the op applies them.
pub(super) fn attention_weights(
    q: &Tensor,
    cache: &KvCache,
    config: &LlamaConfig,
    layer: usize,
) -> Result<Tensor> {
    let (_, t, q_heads, head_dim) = q.dims4()?;
    let kv_heads = cache.kv_heads();
    let len = cache.len();
    let group = q_heads / kv_heads;
    // (q_heads, t, d) → (kv_heads, group·t, d): the query heads that share a key head, together.
    let q = q
        .squeeze(0)?
        .transpose(0, 1)?
        .to_dtype(DType::F32)?
        .contiguous()?
        .reshape((kv_heads, group * t, head_dim))?;
    let (k, _) = cache.views()?;
    let mut k = k.squeeze(0)?.transpose(0, 1)?.to_dtype(DType::F32)?;
    if cache.k_scale() != 1.0 {
        k = k.affine(f64::from(cache.k_scale()), 0.0)?;
    }
    let mut scores = q
        .matmul(&k.t()?.contiguous()?)?
        .affine(f64::from(config.softmax_scale()), 0.0)?;
    if let Some(cap) = config.gemma2.and_then(|g| g.attn_logit_softcapping) {
        scores = ((scores / f64::from(cap))?.tanh()? * f64::from(cap))?;
    }
    let scores = scores.reshape((q_heads, t, len))?;
    let window = config.window_left(layer);
    let mask: Vec<f32> = (0..t)
        .flat_map(|i| {
            let position = len - t + i;
            (0..len).map(move |key| {
                let seen = key <= position && window.is_none_or(|w| position - key <= w);
                if seen {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
        })
        .collect();
    let mask = Tensor::from_vec(mask, (1, t, len), q.device())?;
    candle_nn::ops::softmax_last_dim(&scores.broadcast_add(&mask)?)
}
