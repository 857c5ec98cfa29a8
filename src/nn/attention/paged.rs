//! [`CachedAttention`] over one layer of a [`PagedKvCache`] (see [`AttentionStep::paged`]): the
//! step's keys and values are written into their pages, then the op attends every sequence of
//! the batch through the step's block table in one call. The reference paths gather each
//! sequence's pages in order. A mixed step ([`AttentionStep::mixed`]) runs one such call per
//! group of sequences that bring the same number of tokens.
//!
//! [`AttentionStep::paged`]: super::AttentionStep::paged
//! [`AttentionStep::mixed`]: super::AttentionStep::mixed

use candle_core::{bail, Result, Tensor};

use super::{run_op, CachedAttention, KvScales, Route};
use crate::nn::paged_cache::{MixedStep, PagedKvCache, PagedStep};

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

impl CachedAttention {
    /// Attends the tokens of a mixed `step`, laid end to end in q, k and v `(1, tokens, heads,
    /// head_dim)`: each group of sequences with the same count in one call of
    /// [`CachedAttention::forward_paged`], then the outputs back in the step's token order.
    pub(super) fn forward_mixed(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        (cache, layer, step): (&PagedKvCache, usize, &MixedStep),
    ) -> Result<Tensor> {
        let tokens = step.tokens();
        for (name, x) in [("q", q), ("k", k), ("v", v)] {
            match x.dims() {
                [1, t, _, _] if *t == tokens => {}
                dims => bail!(
                    "paged attention: {name} must be (1, {tokens}, heads, head_dim), the mixed \
                     step's tokens end to end, got {dims:?}"
                ),
            }
        }
        let (_, _, q_heads, head_dim) = q.dims4()?;
        let groups = step.groups();
        let mut outs = Vec::with_capacity(groups.len());
        for group in groups {
            let (batch, t) = (group.step.batch(), group.step.t());
            let take = |x: &Tensor| -> Result<Tensor> {
                let (_, _, heads, d) = x.dims4()?;
                let x = if groups.len() == 1 {
                    x.clone()
                } else {
                    x.index_select(&group.tokens, 1)?
                };
                x.reshape((batch, t, heads, d))
            };
            let (out, _) = self.forward_paged(
                &take(q)?,
                &take(k)?,
                &take(v)?,
                (cache, layer, &group.step),
                false,
            )?;
            outs.push(out.reshape((1, batch * t, q_heads, head_dim))?);
        }
        let out = Tensor::cat(&outs, 1)?;
        match step.order() {
            Some(order) => out.index_select(order, 1),
            None => Ok(out),
        }
    }
}
