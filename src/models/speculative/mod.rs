//! Speculative decoding: a drafter proposes a few tokens, the target model checks them all in
//! one pass over its KV cache ([`Llama::forward_all`]), and keeps the ones its own decoding would
//! have produced. At long context each pass costs about one read of the cache and the weights,
//! so every kept draft is a token for free.
//!
//! - [`Sampling::Greedy`] is lossless: the tokens are exactly those of plain greedy decoding.
//! - [`Sampling::Temperature`] uses the speculative-sampling acceptance rule, so the tokens are
//!   distributed as sampling from the target alone.
//! - Drafters: [`PromptLookup`] (n-gram matches in the prompt and the text so far, no second
//!   model) and [`DraftModel`] (any smaller model that shares the tokenizer).
//! - A rejected draft costs the target nothing but a truncation of its cache.
//!
//! ```no_run
//! # use candle_splitkv::models::llama::Llama;
//! use candle_splitkv::models::speculative::{PromptLookup, Sampling, SpeculativeDecoder};
//! # fn run(target: &mut Llama, prompt: &[u32]) -> candle_core::Result<()> {
//! let mut decoder = SpeculativeDecoder::new(PromptLookup::default(), 4, Sampling::Greedy, 0);
//! let out = decoder.generate(target, prompt, 256, &[2], |token| {
//!     print!("{token} ");
//!     Ok(())
//! })?;
//! eprintln!("{} tokens in {} passes", out.tokens.len(), out.target_passes);
//! # Ok(()) }
//! ```

mod acceptance;
mod draft_model;
mod prompt_lookup;

use candle_core::{bail, Result};
use rand::{rngs::StdRng, SeedableRng};

pub use acceptance::{verify, Sampling, Verdict};
pub use draft_model::DraftModel;
pub use prompt_lookup::PromptLookup;

use crate::models::llama::Llama;

/// Proposed tokens, and for a drafter that samples, the distribution each was drawn from.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Draft {
    pub tokens: Vec<u32>,
    /// `probs[i]`: the drafter's distribution over the vocabulary when it drew `tokens[i]`;
    /// `None` for a deterministic drafter.
    pub probs: Option<Vec<Vec<f64>>>,
}

/// Proposes tokens for the target model to verify.
pub trait Drafter {
    /// Up to `n` tokens to follow `context`: the prompt and every token emitted so far.
    fn draft(&mut self, context: &[u32], n: usize) -> Result<Draft>;
}

/// What [`SpeculativeDecoder::generate`] produced, and how.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Generated {
    pub tokens: Vec<u32>,
    /// Verification passes of the target model (each emits at least one token).
    pub target_passes: usize,
    /// Tokens drafted, and of those, kept.
    pub drafted: usize,
    pub accepted: usize,
}

/// Generates with a target model and a drafter.
pub struct SpeculativeDecoder<D: Drafter> {
    drafter: D,
    draft_len: usize,
    sampling: Sampling,
    rng: StdRng,
}

impl<D: Drafter> SpeculativeDecoder<D> {
    /// Drafts up to `draft_len` tokens a pass (0: plain decoding, one token a pass), capped so
    /// that a pass holds at most [`crate::MAX_QUERY_TOKENS`] tokens. `seed` seeds the sampler.
    pub fn new(drafter: D, draft_len: usize, sampling: Sampling, seed: u64) -> Self {
        Self {
            drafter,
            draft_len,
            sampling,
            rng: StdRng::seed_from_u64(seed),
        }
    }

    pub fn drafter(&self) -> &D {
        &self.drafter
    }

    /// Starts `target` from an empty cache, runs `prompt`, and generates up to `max_new`
    /// tokens, stopping after any token of `stop`. Each token goes to `on_token` as soon as it
    /// is decided.
    pub fn generate(
        &mut self,
        target: &mut Llama,
        prompt: &[u32],
        max_new: usize,
        stop: &[u32],
        mut on_token: impl FnMut(u32) -> Result<()>,
    ) -> Result<Generated> {
        let Some((&last, head)) = prompt.split_last() else {
            bail!("speculative decoding: the prompt is empty")
        };
        if let Sampling::Temperature(t) = self.sampling {
            if !(t > 0.0 && t.is_finite()) {
                bail!("speculative decoding: the temperature must be positive, got {t}")
            }
        }
        target.reset();
        if !head.is_empty() {
            target.forward(head)?;
        }
        // The cache holds the context but its last token, which the next pass runs first.
        let mut context = prompt.to_vec();
        let mut pending = last;
        let mut out = Generated::default();
        let max_drafts = self.draft_len.min(crate::MAX_QUERY_TOKENS - 1);
        while out.tokens.len() < max_new {
            let cached = target.cache_len();
            // Past the context length the target's pass reports the error.
            let room = target.context_length().saturating_sub(cached + 1);
            let n = max_drafts.min(max_new - out.tokens.len() - 1).min(room);
            let mut draft = if n > 0 {
                self.drafter.draft(&context, n)?
            } else {
                Draft::default()
            };
            draft.tokens.truncate(n);
            if let Some(probs) = &mut draft.probs {
                probs.truncate(draft.tokens.len());
            }
            let mut run = Vec::with_capacity(draft.tokens.len() + 1);
            run.push(pending);
            run.extend_from_slice(&draft.tokens);
            let rows = target.forward_all(&run)?.to_vec2::<f32>()?;
            let verdict = verify(
                &draft.tokens,
                draft.probs.as_deref(),
                &rows,
                self.sampling,
                &mut self.rng,
            )?;
            out.target_passes += 1;
            out.drafted += draft.tokens.len();
            out.accepted += verdict.accepted;
            // Keep the pending token and the accepted drafts; the new token runs next pass.
            target.truncate(cached + 1 + verdict.accepted);
            let emitted = draft.tokens[..verdict.accepted]
                .iter()
                .copied()
                .chain(std::iter::once(verdict.next));
            for token in emitted {
                context.push(token);
                out.tokens.push(token);
                on_token(token)?;
                if stop.contains(&token) || out.tokens.len() == max_new {
                    return Ok(out);
                }
            }
            pending = verdict.next;
        }
        Ok(out)
    }
}
