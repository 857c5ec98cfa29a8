//! [`CachedAttention`] over one layer of a [`PagedKvCache`]: the step's keys and values are
//! written into their pages, then a decode step (or a few tokens being verified) runs the op
//! through the step's block table, every sequence of the batch in one call; a longer prompt
//! runs the blocked causal attention over its sequence's pages gathered in order.

use candle_core::{bail, Result, Tensor};

use super::{op_query, CachedAttention, KvScales};
use crate::nn::paged_cache::{PagedKvCache, PagedStep};

impl CachedAttention {
    /// Writes k and v of `step`'s new positions into layer `layer` of `cache`, then attends q
    /// over each sequence as it stands after the step.
    ///
    /// - q: `(batch, t, q_heads, head_dim)`, k and v: `(batch, t, kv_heads, head_dim)`, after
    ///   RoPE, with `batch` and `t` those of `step`; k and v are stored in the cache's dtype.
    /// - output: `(batch, t, q_heads, head_dim)` in q's dtype.
    ///
    /// Token `i` of sequence `s` sits at position `len_s − t + i`, `len_s` its length after
    /// the step, and attends causally as [`CachedAttention::forward`] does.
    pub fn forward_paged(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        cache: &PagedKvCache,
        layer: usize,
        step: &PagedStep,
    ) -> Result<Tensor> {
        let (batch, t, q_heads, head_dim) = q.dims4().map_err(|_| {
            candle_core::Error::Msg(format!(
                "paged attention: q must be (batch, t, q_heads, head_dim), got {:?}",
                q.dims()
            ))
        })?;
        let c = cache.config();
        if (batch, t) != (step.batch(), step.t()) {
            bail!(
                "paged attention: q {:?} must hold the step's {} sequences of {} tokens",
                q.dims(),
                step.batch(),
                step.t()
            )
        }
        if head_dim != c.head_dim || q_heads % c.kv_heads != 0 {
            bail!(
                "paged attention: q {:?} must have head_dim {} and a multiple of the cache's {} \
                 kv heads",
                q.dims(),
                c.head_dim,
                c.kv_heads
            )
        }
        if self.prefill_block == 0 {
            bail!("paged attention: prefill_block must be at least 1")
        }
        crate::op::validate::check_window_and_softcap(self.window_left, self.softcap)?;
        cache.write(layer, step, &k.to_dtype(c.dtype)?, &v.to_dtype(c.dtype)?)?;
        // Pages hold keys and values as they are: no scales.
        let scales = KvScales { k: 1.0, v: 1.0 };
        if self.uses_split_kv(head_dim) && crate::op::takes_query_tokens(t) {
            let (k_pages, v_pages) = cache.layer(layer)?;
            return self
                .op(scales)
                .with_block_table(step.block_table.clone())
                .with_seqlens(step.seqlens.clone())
                .forward(&op_query(q, c.dtype)?, &k_pages, &v_pages)?
                .to_dtype(q.dtype());
        }
        // A prompt: sequence by sequence, over its pages gathered in order.
        let outs = step
            .ids()
            .iter()
            .enumerate()
            .map(|(s, &id)| {
                let (k_all, v_all) = cache.sequence_kv(layer, id)?;
                let past = k_all.dim(1)? - t;
                self.attend(&q.narrow(0, s, 1)?, &k_all, &v_all, past, scales)
            })
            .collect::<Result<Vec<_>>>()?;
        Tensor::cat(&outs, 0)
    }
}
