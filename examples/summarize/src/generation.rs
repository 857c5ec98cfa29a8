//! One generation: prefill a prompt into an empty cache, then sample tokens until the answer ends;
//! or many at once ([`Generator::generate_batch`]).
//!
//! These loops belong to the summarizer, not to `candle_splitkv::models`: what they add to the
//! library's steps (`Llama::forward`, `Llama::forward_mixed` over a `PagedKvCache`,
//! `SpeculativeDecoder::step` with its logits hook) is the summarizer's own: its sampling
//! options and repeat penalty, the observers behind its progress bars and streamed output, and
//! the timing it reports.

mod batch;

use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use candle_core::{Device, Tensor};
use candle_splitkv::models::llama::Llama;
use candle_splitkv::models::speculative::{PromptLookup, Sampling, SpeculativeDecoder};
use candle_transformers::generation::{LogitsProcessor, Sampling as GenerationSampling};
use tokenizers::Tokenizer;

pub use batch::{BatchObserver, Request};

/// Prefill goes through the model in slices of this many tokens, so progress can be shown while
/// a long prompt is read. Large enough to keep the matrix products efficient.
const PREFILL_SLICE: usize = 512;

/// How tokens are picked.
#[derive(Debug, Clone, Copy)]
pub struct SamplingSettings {
    /// 0 means greedy.
    pub temperature: f64,
    pub seed: u64,
    /// 1 means no penalty.
    pub repeat_penalty: f32,
    /// The repeat penalty looks at this many of the latest generated tokens.
    pub repeat_last_n: usize,
    /// With a temperature: sample among the k most likely tokens only.
    pub top_k: Option<usize>,
    /// With a temperature: sample among the most likely tokens whose probabilities add up to p.
    pub top_p: Option<f64>,
    /// Tokens drafted per verification pass by prompt lookup; 0 decodes one token a pass.
    pub speculate: usize,
}

/// Receives what happens during a generation, to draw progress or stream the text.
pub trait GenerationObserver {
    /// `tokens` more prompt tokens went through the model, at `tokens_per_s` so far.
    fn prefilled(&mut self, tokens: usize, tokens_per_s: f64);
    /// The answer grew by `text` (possibly empty while a multi-byte character is incomplete);
    /// `generated` tokens so far, at `tokens_per_s`.
    fn generated(&mut self, text: &str, generated: usize, tokens_per_s: f64) -> Result<()>;
}

/// The outcome of a generation.
#[derive(Debug, Clone)]
pub struct Generation {
    /// The answer, special tokens removed, trimmed.
    pub text: String,
    pub timing: Timing,
}

/// Token counts and time spent, for the statistics.
#[derive(Debug, Clone, Copy, Default)]
pub struct Timing {
    pub prefill_tokens: usize,
    pub prefill_secs: f64,
    /// Tokens decoded after the first (which comes from the prefill's logits), a stop token
    /// included: without speculation, forward passes of one token each.
    pub decode_tokens: usize,
    pub decode_secs: f64,
    /// With speculation: the target's verification passes, the tokens drafted for them and
    /// those of the drafts kept.
    pub verify_passes: usize,
    pub drafted: usize,
    pub accepted: usize,
}

impl Timing {
    pub fn add(&mut self, other: Timing) {
        self.prefill_tokens += other.prefill_tokens;
        self.prefill_secs += other.prefill_secs;
        self.decode_tokens += other.decode_tokens;
        self.decode_secs += other.decode_secs;
        self.verify_passes += other.verify_passes;
        self.drafted += other.drafted;
        self.accepted += other.accepted;
    }
}

/// The sampler of one answer, seeded from the settings.
fn sampler(settings: &SamplingSettings) -> LogitsProcessor {
    let SamplingSettings {
        temperature,
        seed,
        top_k,
        top_p,
        ..
    } = *settings;
    let sampling = match (top_k, top_p) {
        _ if temperature <= 0.0 => GenerationSampling::ArgMax,
        (None, None) => GenerationSampling::All { temperature },
        (Some(k), None) => GenerationSampling::TopK { k, temperature },
        (None, Some(p)) => GenerationSampling::TopP { p, temperature },
        (Some(k), Some(p)) => GenerationSampling::TopKThenTopP { k, p, temperature },
    };
    LogitsProcessor::from_sampling(seed, sampling)
}

/// Runs generations on one model.
pub struct Generator<'m> {
    model: &'m mut Llama,
    tokenizer: &'m Tokenizer,
    stop_tokens: Vec<u32>,
    settings: SamplingSettings,
}

impl<'m> Generator<'m> {
    pub fn new(
        model: &'m mut Llama,
        tokenizer: &'m Tokenizer,
        stop_tokens: Vec<u32>,
        settings: SamplingSettings,
    ) -> Self {
        Self {
            model,
            tokenizer,
            stop_tokens,
            settings,
        }
    }

    pub fn tokenizer(&self) -> &'m Tokenizer {
        self.tokenizer
    }

    pub fn context_length(&self) -> usize {
        self.model.context_length()
    }

    /// Per token of `text`, the attention `instruction` after it pays it (see
    /// [`attention_mass`](crate::attention_salience::attention_mass)), read from an empty
    /// cache, which is left empty.
    pub fn attention_to(&mut self, text: &[u32], instruction: &[u32]) -> Result<Vec<f32>> {
        self.model.reset();
        let read = self
            .model
            .forward(text)
            .and_then(|_| self.model.forward_with_attention(instruction));
        self.model.reset();
        let (_, weights) = read.context("reading the document for attention")?;
        let mut mass = crate::attention_salience::attention_mass(&weights, instruction.len())?;
        mass.truncate(text.len());
        Ok(mass)
    }

    /// Whether single generations draft tokens by prompt lookup.
    pub fn speculates(&self) -> bool {
        self.settings.speculate > 0
    }

    /// Whether answers can be written in batches: a paged cache holds f32, f16 or bf16, not fp8.
    pub fn can_batch(&self) -> bool {
        self.model.cache_dtype() != candle_core::DType::F8E4M3
    }

    /// Generates the answer to `prompt`, at most `max_new_tokens` of it, from an empty cache.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        max_new_tokens: usize,
        observer: &mut dyn GenerationObserver,
    ) -> Result<Generation> {
        let context = self.model.context_length();
        if prompt.is_empty() || prompt.len() >= context {
            bail!(
                "a prompt of {} tokens does not fit the model's context of {context}",
                prompt.len()
            );
        }
        // Each generation is independent: the previous chunk's cache must not leak into this one.
        self.model.reset();

        let start = Instant::now();
        let mut logits = None;
        for slice in prompt.chunks(PREFILL_SLICE) {
            logits = Some(self.model.forward(slice).context("prefill failed")?);
            let done = self.model.cache_len();
            observer.prefilled(slice.len(), done as f64 / start.elapsed().as_secs_f64());
        }
        let logits = logits.context("empty prompt")?;
        let prefill_secs = start.elapsed().as_secs_f64();
        let prefill = Timing {
            prefill_tokens: prompt.len(),
            prefill_secs,
            ..Timing::default()
        };
        if self.settings.speculate > 0 {
            return self.decode_speculative(prompt, logits, max_new_tokens, observer, prefill);
        }

        let mut logits = logits;
        let mut sampler = sampler(&self.settings);
        let mut stream = self.tokenizer.decode_stream(true);
        let mut generated: Vec<u32> = Vec::new();
        let mut decode_tokens = 0;
        let start = Instant::now();
        loop {
            logits = self.penalized(logits, &generated)?;
            let token = sampler.sample(&logits)?;
            if self.stop_tokens.contains(&token) {
                break;
            }
            generated.push(token);
            let piece = stream
                .step(token)
                .map_err(|e| anyhow!("cannot decode token {token}: {e}"))?;
            let elapsed = start.elapsed().as_secs_f64();
            let rate = if elapsed > 0.0 {
                decode_tokens as f64 / elapsed
            } else {
                0.0
            };
            observer.generated(piece.as_deref().unwrap_or(""), generated.len(), rate)?;
            if generated.len() >= max_new_tokens || self.model.cache_len() + 1 >= context {
                break;
            }
            logits = self.model.forward(&[token]).context("decoding failed")?;
            decode_tokens += 1;
        }
        let timing = Timing {
            decode_tokens,
            decode_secs: start.elapsed().as_secs_f64(),
            ..prefill
        };
        self.answer(&generated, timing)
    }

    /// The generation of the answer `generated`: its text, trimmed, with its timing.
    fn answer(&self, generated: &[u32], timing: Timing) -> Result<Generation> {
        let text = self
            .tokenizer
            .decode(generated, true)
            .map_err(|e| anyhow!("cannot decode the answer: {e}"))?;
        Ok(Generation {
            text: text.trim().to_string(),
            timing,
        })
    }

    /// `logits` with the repeat penalty over the latest of the `generated` tokens.
    fn penalized(&self, logits: Tensor, generated: &[u32]) -> Result<Tensor> {
        let SamplingSettings {
            repeat_penalty,
            repeat_last_n,
            ..
        } = self.settings;
        if repeat_penalty == 1.0 || generated.is_empty() {
            return Ok(logits);
        }
        let window = &generated[generated.len().saturating_sub(repeat_last_n)..];
        Ok(candle_transformers::utils::apply_repeat_penalty(
            &logits,
            repeat_penalty,
            window,
        )?)
    }

    /// The decode loop with speculation: the first token comes from the prefill's logits as in
    /// the plain loop, then each verification pass checks the tokens that prompt lookup drafts.
    /// Every row of logits gets the plain loop's repeat penalty before verification, so greedy
    /// decoding emits the plain loop's tokens; the stopping rules are the plain loop's too.
    fn decode_speculative(
        &mut self,
        prompt: &[u32],
        logits: Tensor,
        max_new_tokens: usize,
        observer: &mut dyn GenerationObserver,
        prefill: Timing,
    ) -> Result<Generation> {
        let SamplingSettings {
            temperature,
            seed,
            repeat_penalty,
            repeat_last_n,
            top_k,
            top_p,
            speculate,
        } = self.settings;
        // Plain decoding ends once the sequence fills the context.
        let limit = max_new_tokens.min(self.model.context_length() - prompt.len());
        let sampling = match (top_k, top_p) {
            _ if temperature <= 0.0 => Sampling::Greedy,
            (None, None) => Sampling::Temperature(temperature),
            _ => Sampling::Truncated {
                temperature,
                top_k,
                top_p,
            },
        };
        // A stream of its own: the first token's sampler already draws from `seed`.
        let verify_seed = seed ^ 0x9e37_79b9_7f4a_7c15;
        let mut decoder =
            SpeculativeDecoder::new(PromptLookup::default(), speculate, sampling, verify_seed);
        // Candle's own penalty on each row, so that the arithmetic is the plain loop's.
        let mut penalize = |tokens: &[u32], row: &mut [f32]| -> candle_core::Result<()> {
            let generated = &tokens[prompt.len().min(tokens.len())..];
            if repeat_penalty == 1.0 || generated.is_empty() {
                return Ok(());
            }
            let window = &generated[generated.len().saturating_sub(repeat_last_n)..];
            let logits = Tensor::from_slice(row, row.len(), &Device::Cpu)?;
            let penalized =
                candle_transformers::utils::apply_repeat_penalty(&logits, repeat_penalty, window)?;
            row.copy_from_slice(&penalized.to_vec1::<f32>()?);
            Ok(())
        };

        let start = Instant::now();
        let mut stream = self.tokenizer.decode_stream(true);
        // The prompt and the tokens generated so far.
        let mut context = prompt.to_vec();
        // Appends a token to the answer and streams it; returns the answer's length in tokens.
        let mut emit = |token: u32, context: &mut Vec<u32>| -> Result<usize> {
            context.push(token);
            let generated = context.len() - prompt.len();
            let piece = stream
                .step(token)
                .map_err(|e| anyhow!("cannot decode token {token}: {e}"))?;
            let elapsed = start.elapsed().as_secs_f64();
            // The plain loop's rate: the tokens decoded after the first.
            let rate = if elapsed > 0.0 {
                (generated - 1) as f64 / elapsed
            } else {
                0.0
            };
            observer.generated(piece.as_deref().unwrap_or(""), generated, rate)?;
            Ok(generated)
        };
        let mut timing = prefill;
        // The first token, sampled from the prefill's logits exactly as the plain loop does.
        let first = LogitsProcessor::new(seed, Some(temperature), None).sample(&logits)?;
        let mut done = self.stop_tokens.contains(&first) || emit(first, &mut context)? >= limit;
        while !done {
            let step = decoder
                .step(
                    self.model,
                    &context,
                    limit - (context.len() - prompt.len()),
                    &mut penalize,
                )
                .context("decoding failed")?;
            timing.verify_passes += 1;
            timing.drafted += step.drafted;
            timing.accepted += step.accepted;
            for token in step.tokens {
                timing.decode_tokens += 1;
                done = self.stop_tokens.contains(&token) || emit(token, &mut context)? >= limit;
                if done {
                    break;
                }
            }
        }
        timing.decode_secs = start.elapsed().as_secs_f64();
        self.answer(&context[prompt.len()..], timing)
    }
}
