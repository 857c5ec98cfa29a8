//! [`CachedAttention`] over one layer of a [`PagedKvCache`] (see [`AttentionStep::paged`]): the
//! step's keys and values are written into their pages, then the op attends every sequence of
//! the batch through the step's block table in one call. The reference paths gather each
//! sequence's pages in order.
//!
//! [`AttentionStep::paged`]: super::AttentionStep::paged

use candle_core::{bail, Result, Tensor};

use super::{run_op, CachedAttention, KvScales, Route};
use crate::nn::paged_cache::{PagedKvCache, PagedStep};

impl CachedAttention {
    /// Writes k and v of `step`'s new positions into layer `layer` of `cache`, then attends q
    /// over each sequence as it stands after the step. q, k and v hold the step's sequences of
    /// its t tokens each.
    pub(super) fn forward_paged(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        (cache, layer, step): (&PagedKvCache, usize, &PagedStep),
        want_lse: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
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
        self.check_settings()?;
        cache.write(layer, step, &k.to_dtype(c.dtype)?, &v.to_dtype(c.dtype)?)?;
        // Pages hold keys and values as they are: no scales.
        let scales = KvScales { k: 1.0, v: 1.0 };
        if self.route(q, c.dtype)? == Route::Op {
            let (k_pages, v_pages) = cache.layer(layer)?;
            let op = self
                .op(scales)
                .with_block_table(step.block_table.clone())
                .with_seqlens(step.seqlens.clone());
            return run_op(&op, q, &k_pages, &v_pages, want_lse);
        }
        let outs = step
            .ids()
            .iter()
            .enumerate()
            .map(|(s, &id)| {
                let (k_all, v_all) = cache.sequence_kv(layer, id)?;
                let past = k_all.dim(1)? - t;
                self.reference(&q.narrow(0, s, 1)?, &k_all, &v_all, past, scales)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((Tensor::cat(&outs, 0)?, None))
    }
}
