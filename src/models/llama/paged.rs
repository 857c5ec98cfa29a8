//! Batched decoding over a [`PagedKvCache`]: several sequences of different lengths in one pass,
//! the weights read once for all of them. Sequences join (their prompt run on its own) and leave
//! between passes, which is continuous batching; the caller decides who runs when.
//! [`Llama::forward_mixed`] reads prompts in the same passes as the other sequences' tokens.

use candle_core::{bail, Result, Tensor};

use super::{layer_attention, LayerKv, Llama, Rows};
use crate::nn::paged_cache::{PagedKvCache, PagedKvCacheConfig, SequenceId};

impl Llama {
    /// A paged cache for this model: `num_pages` pages of `page_size` positions per layer, in
    /// the model's cache dtype (f32, f16 or bf16) on its device.
    pub fn paged_cache(&self, num_pages: usize, page_size: usize) -> Result<PagedKvCache> {
        PagedKvCache::new(&PagedKvCacheConfig {
            layers: self.config.num_hidden_layers,
            num_pages,
            page_size,
            kv_heads: self.config.num_key_value_heads,
            head_dim: self.config.head_dim,
            dtype: self.cache_dtype(),
            device: self.device.clone(),
        })
    }

    /// Runs `t` new tokens of each sequence `ids[s]` after what `cache` holds of it, in one
    /// pass, and returns the f32 logits `(batch, vocab)` of each sequence's last token.
    ///
    /// `tokens` is `(batch, t)` row-major: `tokens[s·t .. (s+1)·t]` belong to `ids[s]`. One
    /// token per sequence is a decode step: every sequence's row is computed as
    /// [`Llama::forward`] computes a one-token step (on the CPU its logits match decoding the
    /// sequence alone to rounding), and attention is one call of the op over all of them.
    /// Longer runs of tokens (prompts) go in chunks of [`Llama::prefill_chunk`] tokens per
    /// sequence, each attending over the chunks before it.
    ///
    /// The model's own cache is neither read nor changed. On an error the sequences keep their
    /// lengths from before the call.
    pub fn forward_paged(
        &self,
        cache: &mut PagedKvCache,
        ids: &[SequenceId],
        tokens: &[u32],
    ) -> Result<Tensor> {
        super::on_cpu_pool(self.device.is_cpu(), || {
            self.forward_paged_here(cache, ids, tokens)
        })
    }

    /// [`Llama::forward_paged`] on the calling thread.
    fn forward_paged_here(
        &self,
        cache: &mut PagedKvCache,
        ids: &[SequenceId],
        tokens: &[u32],
    ) -> Result<Tensor> {
        self.check_paged_cache(cache)?;
        if ids.is_empty() || tokens.is_empty() || !tokens.len().is_multiple_of(ids.len()) {
            bail!(
                "model forward_paged: {} tokens do not split evenly over {} sequences (at least \
                 one each)",
                tokens.len(),
                ids.len()
            )
        }
        let (batch, t) = (ids.len(), tokens.len() / ids.len());
        let vocab = self.config.vocab_size;
        if let Some(&bad) = tokens.iter().find(|&&token| token as usize >= vocab) {
            bail!("model forward_paged: token id {bad} is out of the vocabulary (size {vocab})")
        }
        let starts = ids
            .iter()
            .map(|&id| cache.len(id))
            .collect::<Result<Vec<_>>>()?;
        if let Some((id, start)) = ids
            .iter()
            .zip(&starts)
            .find(|(_, &start)| start + t > self.context_length())
        {
            bail!(
                "model forward_paged: sequence {id:?} holds {start} tokens; {t} more exceed the \
                 context length {}",
                self.context_length()
            )
        }
        // A prompt goes in chunks of at most `prefill_chunk` tokens per sequence, each over the
        // chunks before it.
        let mut done = 0;
        let logits = loop {
            let n = self.prefill_chunk.min(t - done);
            let chunk: Vec<u32> = (0..batch)
                .flat_map(|s| &tokens[s * t + done..][..n])
                .copied()
                .collect();
            let chunk_starts: Vec<usize> = starts.iter().map(|s| s + done).collect();
            let logits = self.paged_pass(cache, ids, &chunk, (&chunk_starts, n));
            done += n;
            if logits.is_err() || done == t {
                break logits;
            }
        };
        if logits.is_err() {
            for (&id, &start) in ids.iter().zip(&starts) {
                cache.truncate(id, start)?;
            }
        }
        logits
    }

    /// One pass of `t` tokens per sequence, `tokens` `(batch, t)` row-major, sequence `s`
    /// starting at `starts[s]`: the f32 logits `(batch, vocab)` of each sequence's last token.
    fn paged_pass(
        &self,
        cache: &mut PagedKvCache,
        ids: &[SequenceId],
        tokens: &[u32],
        (starts, t): (&[usize], usize),
    ) -> Result<Tensor> {
        let batch = ids.len();
        let step = cache.begin_step(ids, t)?;
        let rows = if t == 1 { Rows::AsDecode } else { Rows::BySize };
        let input = Tensor::from_slice(tokens, (batch, t), &self.device)?;
        let mut x = self.embed(&input)?;
        let angles = self.rope.angles(starts, t)?;
        for (index, layer) in self.weights.layers.iter().enumerate() {
            let attention = layer_attention(&self.attention, &self.config, index);
            let kv = LayerKv::Paged {
                cache,
                layer: index,
                step: &step,
                rows,
            };
            x = layer.forward(&x, &angles, &attention, self.fused_decode, kv)?;
        }
        let last = x.narrow(1, t - 1, 1)?;
        self.logits(&last, rows)?
            .reshape((batch, self.config.vocab_size))
    }

    /// Checks that `cache` was made for this model.
    pub(super) fn check_paged_cache(&self, cache: &PagedKvCache) -> Result<()> {
        let c = cache.config();
        let want = (
            self.config.num_hidden_layers,
            self.config.num_key_value_heads,
            self.config.head_dim,
        );
        if (c.layers, c.kv_heads, c.head_dim) != want || !c.device.same_device(&self.device) {
            bail!(
                "model forward_paged: the cache has {} layers of {} kv heads of {} on {:?}; the \
                 model needs {} layers of {} kv heads of {} on {:?} (see Llama::paged_cache)",
                c.layers,
                c.kv_heads,
                c.head_dim,
                c.device.location(),
                want.0,
                want.1,
                want.2,
                self.device.location()
            )
        }
        Ok(())
    }
}
