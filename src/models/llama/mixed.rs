//! Chunked prefill with continuous batching over a [`PagedKvCache`]: one pass over a step that
//! mixes prompt chunks of some sequences with decode rows of others. The token-wise work (the
//! embeddings, the projections, RoPE, the MLP, the norms) runs once over all the step's tokens;
//! attention runs per shape (see [`MixedStep`]).

use candle_core::{bail, Result, Tensor};

use super::{layer_attention, LayerKv, Llama, RowSplit, Rows};
use crate::nn::paged_cache::{MixedStep, PagedKvCache, SequenceId};

impl Llama {
    /// Runs one step in which each sequence `inputs[s].0` brings its own new tokens
    /// `inputs[s].1`, after what `cache` holds of it: a decode row of 1 token, or a chunk of a
    /// prompt of at most [`Llama::prefill_chunk`] tokens. Returns the f32 logits `(batch,
    /// vocab)` of each sequence's last token, in the order of `inputs`: what samples a decode
    /// row's next token, or the first answer token after a prompt's last chunk (the logits after
    /// an earlier chunk are of no use).
    ///
    /// All the step's tokens go through the projections, the MLP and the norms as one run of
    /// rows, so prompt chunks and decode rows share each weight read (a weight kept in a
    /// single-row and a many-row form, as quantized ones are, multiplies the decode rows in the
    /// first and the chunks in the second, one product each, so that every row rounds as it
    /// would alone). Attention runs once per
    /// number of new tokens: all the decode rows in one call of the op, each other count in
    /// its own; no row is padded. A prompt longer than a chunk goes over several steps: the
    /// caller feeds its next `prefill_chunk` tokens each step, beside the other sequences'
    /// decode rows (continuous batching), and samples from the logits of its last chunk.
    /// A step of decode rows only is computed as [`Llama::forward_paged`] computes it.
    ///
    /// The model's own cache is neither read nor changed. On an error the sequences keep their
    /// lengths from before the call.
    pub fn forward_mixed(
        &self,
        cache: &mut PagedKvCache,
        inputs: &[(SequenceId, &[u32])],
    ) -> Result<Tensor> {
        super::on_cpu_pool(self.device.is_cpu(), || {
            self.forward_mixed_here(cache, inputs)
        })
    }

    /// [`Llama::forward_mixed`] on the calling thread.
    fn forward_mixed_here(
        &self,
        cache: &mut PagedKvCache,
        inputs: &[(SequenceId, &[u32])],
    ) -> Result<Tensor> {
        self.check_paged_cache(cache)?;
        if inputs.is_empty() {
            bail!("model forward_mixed: the step has no sequences")
        }
        let chunk = self.prefill_chunk;
        let vocab = self.config.vocab_size;
        for (id, tokens) in inputs {
            if tokens.is_empty() || tokens.len() > chunk {
                bail!(
                    "model forward_mixed: sequence {id:?} brings {} tokens; a step takes 1 to \
                     prefill_chunk ({chunk}) per sequence, so feed a longer prompt over several \
                     steps",
                    tokens.len()
                )
            }
            if let Some(&bad) = tokens.iter().find(|&&token| token as usize >= vocab) {
                bail!(
                    "model forward_mixed: token id {bad} of sequence {id:?} is out of the \
                     vocabulary (size {vocab})"
                )
            }
            let start = cache.len(*id)?;
            if start + tokens.len() > self.context_length() {
                bail!(
                    "model forward_mixed: sequence {id:?} holds {start} tokens; {} more exceed \
                     the context length {}",
                    tokens.len(),
                    self.context_length()
                )
            }
        }
        let counts: Vec<(SequenceId, usize)> = inputs
            .iter()
            .map(|(id, tokens)| (*id, tokens.len()))
            .collect();
        let step = cache.begin_mixed_step(&counts)?;
        let logits = self.mixed_pass(cache, inputs, &step);
        if logits.is_err() {
            for (id, count) in counts {
                let grown = cache.len(id)?;
                cache.truncate(id, grown - count)?;
            }
        }
        logits
    }

    /// One pass over the tokens of `step`, end to end as one sequence of rows.
    fn mixed_pass(
        &self,
        cache: &PagedKvCache,
        inputs: &[(SequenceId, &[u32])],
        step: &MixedStep,
    ) -> Result<Tensor> {
        // Decode rows are multiplied as a decode step multiplies them, prompt chunks as a
        // prompt's rows: where a weight has two forms, each form is one product over its rows.
        let split = self.row_split(step)?;
        let rows = match &split {
            Some(split) => Rows::Split(split),
            None if step.counts().iter().all(|&count| count == 1) => Rows::AsDecode,
            None => Rows::BySize,
        };
        let tokens: Vec<u32> = inputs
            .iter()
            .flat_map(|(_, tokens)| tokens.iter().copied())
            .collect();
        let n = tokens.len();
        let input = Tensor::from_vec(tokens, (1, n), &self.device)?;
        let mut x = self.embed(&input)?;
        let angles = self.rope.angles_at_positions(&step.positions())?;
        for (index, layer) in self.weights.layers.iter().enumerate() {
            let attention = layer_attention(&self.attention, &self.config, index);
            let kv = LayerKv::Mixed {
                cache,
                layer: index,
                step,
                rows,
            };
            x = layer.forward(&x, &angles, &attention, self.fused_decode, kv)?;
        }
        let batch = step.batch();
        let last: Vec<u32> = step.last_tokens().iter().map(|&i| i as u32).collect();
        let last = Tensor::from_vec(last, batch, &self.device)?;
        let hidden = self.config.hidden_size;
        let x = x.index_select(&last, 1)?.reshape((batch, 1, hidden))?;
        // Each last token's logits as a decode step or a prompt's last token alone gets them.
        self.logits(&x, Rows::AsDecode)?
            .reshape((batch, self.config.vocab_size))
    }

    /// The rows of `step` split into decode rows and prompt-chunk rows, when it has both.
    fn row_split(&self, step: &MixedStep) -> Result<Option<RowSplit>> {
        let (mut single, mut many) = (Vec::new(), Vec::new());
        let mut token = 0u32;
        for &count in step.counts() {
            let rows = if count == 1 { &mut single } else { &mut many };
            rows.extend(token..token + count as u32);
            token += count as u32;
        }
        if single.is_empty() || many.is_empty() {
            return Ok(None);
        }
        let mut order = vec![0u32; token as usize];
        for (position, &row) in single.iter().chain(&many).enumerate() {
            order[row as usize] = position as u32;
        }
        let tensor = |rows: Vec<u32>| {
            let n = rows.len();
            Tensor::from_vec(rows, n, &self.device)
        };
        Ok(Some(RowSplit {
            single: tensor(single)?,
            many: tensor(many)?,
            order: tensor(order)?,
        }))
    }
}
