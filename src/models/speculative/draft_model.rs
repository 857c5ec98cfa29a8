//! Drafts from a smaller model that shares the target's tokenizer.

use candle_core::{bail, Result};
use rand::{rngs::StdRng, SeedableRng};

use super::acceptance::{argmax, Sampling};
use super::{Draft, Drafter};
use crate::models::llama::Llama;

/// A draft model with its own cache, kept in step with the context between calls: only the
/// tokens past what it has cached are run, and a rejected draft is a truncation.
pub struct DraftModel {
    model: Llama,
    /// The tokens in the draft model's cache.
    cached: Vec<u32>,
    sampling: Sampling,
    rng: StdRng,
}

impl DraftModel {
    /// Drafts greedily with `Sampling::Greedy`, else samples at the temperature given (which
    /// the acceptance rule then corrects for).
    pub fn new(mut model: Llama, sampling: Sampling, seed: u64) -> Self {
        model.reset();
        Self {
            model,
            cached: Vec::new(),
            sampling,
            rng: StdRng::seed_from_u64(seed),
        }
    }

    /// The draft model, e.g. to compare its vocabulary with the target's.
    pub fn model(&self) -> &Llama {
        &self.model
    }
}

impl Drafter for DraftModel {
    fn draft(&mut self, context: &[u32], n: usize) -> Result<Draft> {
        if context.is_empty() {
            bail!("draft model: the context is empty")
        }
        let n = n.min(self.model.context_length().saturating_sub(context.len()));
        if n == 0 {
            return Ok(Draft::default());
        }
        // Keep what the cache shares with the context, leaving at least one token to run.
        let common = self
            .cached
            .iter()
            .zip(context)
            .take_while(|(a, b)| a == b)
            .count()
            .min(context.len() - 1);
        self.model.truncate(common);
        self.cached.truncate(common);
        let mut logits = self.model.forward(&context[common..])?;
        self.cached.extend_from_slice(&context[common..]);

        let mut draft = Draft::default();
        let mut probs = Vec::new();
        for i in 0..n {
            let row = logits.to_vec1::<f32>()?;
            let token = match self.sampling.distribution(&row)? {
                None => argmax(&row),
                Some(p) => {
                    let token = super::acceptance::draw_from(&p, &mut self.rng)?;
                    probs.push(p);
                    token
                }
            };
            draft.tokens.push(token);
            if i + 1 < n {
                logits = self.model.forward(&[token])?;
                self.cached.push(token);
            }
        }
        if self.sampling != Sampling::Greedy {
            draft.probs = Some(probs);
        }
        Ok(draft)
    }
}
