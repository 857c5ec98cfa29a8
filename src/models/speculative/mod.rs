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
//! - [`SpeculativeDecoder::step`] is one pass, for a program with its own prefill, stopping
//!   rules and logits adjustment (a repeat penalty); [`SpeculativeDecoder::generate`] is the
//!   whole loop.
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

pub use acceptance::Sampling;
use acceptance::{verify, Verdict};
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

/// Changes one row of the target's logits before verification, given the tokens that row's
/// prediction follows (see [`SpeculativeDecoder::step`]).
pub type AdjustLogits<'a> = dyn FnMut(&[u32], &mut [f32]) -> Result<()> + 'a;

/// What one [`SpeculativeDecoder::step`] emitted: one verification pass of the target.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Step {
    /// The accepted drafts, then the target's own next token: at least one token.
    pub tokens: Vec<u32>,
    /// Tokens drafted in this pass, and of those, kept.
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
        let Some((_, head)) = prompt.split_last() else {
            bail!("speculative decoding: the prompt is empty")
        };
        self.check_sampling()?;
        target.reset();
        if !head.is_empty() {
            target.forward(head)?;
        }
        let mut context = prompt.to_vec();
        let mut out = Generated::default();
        let mut keep_logits = |_: &[u32], _: &mut [f32]| Ok(());
        while out.tokens.len() < max_new {
            let step = self.step(
                target,
                &context,
                max_new - out.tokens.len(),
                &mut keep_logits,
            )?;
            out.target_passes += 1;
            out.drafted += step.drafted;
            out.accepted += step.accepted;
            for token in step.tokens {
                context.push(token);
                out.tokens.push(token);
                on_token(token)?;
                if stop.contains(&token) || out.tokens.len() == max_new {
                    return Ok(out);
                }
            }
        }
        Ok(out)
    }

    /// One verification pass, for a caller that runs its own prefill and its own loop.
    ///
    /// `context` is the prompt and every token emitted so far. The target's cache must hold all
    /// of it but its last token, which this pass runs first (after a prefill of the prompt but
    /// its last token, or after the previous step). Drafts up to `draft_len` tokens (fewer near
    /// `max_tokens`, the most this step may emit, and near the target's context length), runs
    /// the last token and the drafts through the target in one pass, and returns the drafts it
    /// kept followed by the target's own next token: between 1 and `max_tokens` tokens. The
    /// cache then holds `context` and the kept drafts; the returned last token runs next step.
    /// On an error the cache is left as it was.
    ///
    /// `adjust(tokens, logits)` may change each row of the target's logits before verification
    /// (a repeat penalty, a ban on some tokens): `tokens` are those the row's prediction follows,
    /// `context` and then the drafts before that row. Greedy verification with an adjustment
    /// emits exactly the tokens of plain greedy decoding with the same adjustment applied at
    /// every step, given the same logits (on the CPU, [`Llama::forward_all`] computes them bit
    /// for bit as one-token steps do); with [`Sampling::Temperature`] the tokens are distributed
    /// as sampling from the adjusted logits.
    pub fn step(
        &mut self,
        target: &mut Llama,
        context: &[u32],
        max_tokens: usize,
        adjust: &mut AdjustLogits<'_>,
    ) -> Result<Step> {
        let Some(&last) = context.last() else {
            bail!("speculative decoding: the context is empty; it must end in a token to run")
        };
        let cached = target.cache_len();
        if cached + 1 != context.len() {
            bail!(
                "speculative decoding: the target's cache holds {cached} tokens, but a context of \
                 {} tokens needs {} (all of it but its last token)",
                context.len(),
                context.len() - 1
            )
        }
        if max_tokens == 0 {
            bail!("speculative decoding: a step emits at least one token, max_tokens is 0")
        }
        self.check_sampling()?;
        // Past the context length the target's pass reports the error.
        let room = target.context_length().saturating_sub(context.len());
        let n = self
            .draft_len
            .min(crate::MAX_QUERY_TOKENS - 1)
            .min(max_tokens - 1)
            .min(room);
        let mut draft = if n > 0 {
            self.drafter.draft(context, n)?
        } else {
            Draft::default()
        };
        draft.tokens.truncate(n);
        if let Some(probs) = &mut draft.probs {
            probs.truncate(draft.tokens.len());
        }
        let mut run = Vec::with_capacity(draft.tokens.len() + 1);
        run.push(last);
        run.extend_from_slice(&draft.tokens);
        let mut pass = || -> Result<Verdict> {
            let mut rows = target.forward_all(&run)?.to_vec2::<f32>()?;
            let mut seen = Vec::with_capacity(context.len() + draft.tokens.len());
            seen.extend_from_slice(context);
            for (i, row) in rows.iter_mut().enumerate() {
                // Row i predicts what follows the context and the first i drafts.
                if let Some(&draft) = i.checked_sub(1).and_then(|j| draft.tokens.get(j)) {
                    seen.push(draft);
                }
                adjust(&seen, row)?;
            }
            verify(
                &draft.tokens,
                draft.probs.as_deref(),
                &rows,
                self.sampling,
                &mut self.rng,
            )
        };
        let verdict = match pass() {
            Ok(verdict) => verdict,
            Err(error) => {
                // Leave the cache as the caller gave it, so that the step can be run again.
                target.truncate(cached);
                return Err(error);
            }
        };
        // Keep the last token and the accepted drafts; the new token runs next step.
        target.truncate(cached + 1 + verdict.accepted);
        let mut tokens = draft.tokens[..verdict.accepted].to_vec();
        tokens.push(verdict.next);
        Ok(Step {
            tokens,
            drafted: draft.tokens.len(),
            accepted: verdict.accepted,
        })
    }

    fn check_sampling(&self) -> Result<()> {
        self.sampling.check()
    }
}
