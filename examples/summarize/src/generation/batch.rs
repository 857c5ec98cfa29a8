//! Many generations at once: continuous batching with chunked prefill over a paged cache. Up to
//! `max_batch` answers are written together, one forward pass per step for all of them: a prompt
//! that just joined brings its next chunk to the step beside the other answers' next tokens, so
//! reading it does not stall them. A finished answer frees its pages and the next prompt takes
//! its place.

use std::collections::VecDeque;
use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::Tensor;
use candle_splitkv::SequenceId;
use candle_transformers::generation::LogitsProcessor;

use super::{sampler, Generation, Generator, Timing, PREFILL_SLICE};

/// Positions per page of the batch's cache.
const PAGE_SIZE: usize = 16;

/// One answer to write: its prompt and its length limit.
#[derive(Debug, Clone)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub max_new_tokens: usize,
}

/// Receives what happens while a batch is written.
pub trait BatchObserver {
    /// Request `index` joined the batch: its prompt was read.
    fn joined(&mut self, index: usize, prompt_tokens: usize);
    /// A step wrote one token for each of `live` answers; `tokens_per_s` answers' tokens were
    /// written per second over the batch so far.
    fn stepped(&mut self, live: usize, tokens_per_s: f64);
    /// Request `index` is answered.
    fn finished(&mut self, index: usize, generation: &Generation) -> Result<()>;
}

/// An answer being written.
struct Live {
    index: usize,
    id: SequenceId,
    sampler: LogitsProcessor,
    generated: Vec<u32>,
    limit: usize,
    /// Prompt tokens in the cache so far.
    prompt_read: usize,
    /// What it brings to the next step once its prompt is read: the token it wrote last.
    next: Option<u32>,
    /// The logits its next token is sampled from, after its prompt's last chunk or its last
    /// token went through the model.
    logits: Option<Tensor>,
    /// Its prefill and decode times are its share of each step it is in, by the tokens it
    /// brought, so that the shares add up to the batch's time.
    timing: Timing,
}

impl Generator<'_> {
    /// Writes the answers to `requests`, at most `max_batch` at a time, each as
    /// [`Generator::generate`] would (the same sampling, penalty and stopping rules; greedy
    /// answers match it up to rounding). Returns them in the requests' order. A prompt is read
    /// a chunk per step, in the same passes as the other answers' tokens. Prompt lookup
    /// speculation does not apply here.
    pub fn generate_batch(
        &mut self,
        requests: &[Request],
        max_batch: usize,
        observer: &mut dyn BatchObserver,
    ) -> Result<Vec<Generation>> {
        let context = self.model.context_length();
        if let Some(bad) = requests
            .iter()
            .find(|r| r.prompt.is_empty() || r.prompt.len() >= context)
        {
            anyhow::bail!(
                "a prompt of {} tokens does not fit the model's context of {context}",
                bad.prompt.len()
            );
        }
        let max_batch = max_batch.max(1);
        // Room for the longest answers that may be written at once.
        let mut lengths: Vec<usize> = requests
            .iter()
            .map(|r| {
                (r.prompt.len() + r.max_new_tokens)
                    .min(context)
                    .div_ceil(PAGE_SIZE)
            })
            .collect();
        lengths.sort_unstable_by(|a, b| b.cmp(a));
        let pages: usize = lengths.iter().take(max_batch).sum();
        let mut cache = self.model.paged_cache(pages.max(1), PAGE_SIZE)?;

        // Prompt tokens an answer brings to one step.
        let chunk = self.model.prefill_chunk().min(PREFILL_SLICE);

        let mut waiting: VecDeque<usize> = (0..requests.len()).collect();
        let mut live: Vec<Live> = Vec::new();
        let mut done: Vec<Option<Generation>> = vec![None; requests.len()];
        let batch_start = Instant::now();
        let mut written = 0usize;
        while !waiting.is_empty() || !live.is_empty() {
            while live.len() < max_batch {
                let Some(index) = waiting.pop_front() else {
                    break;
                };
                live.push(Live {
                    index,
                    id: cache.add_sequence(),
                    sampler: sampler(&self.settings),
                    generated: Vec::new(),
                    limit: requests[index].max_new_tokens,
                    prompt_read: 0,
                    next: None,
                    logits: None,
                    timing: Timing {
                        prefill_tokens: requests[index].prompt.len(),
                        ..Timing::default()
                    },
                });
            }
            // Sample the next token of each answer that has its logits; finished answers leave.
            let mut still = Vec::with_capacity(live.len());
            for mut answer in live.drain(..) {
                let Some(logits) = answer.logits.take() else {
                    still.push(answer);
                    continue;
                };
                let logits = self.penalized(logits, &answer.generated)?;
                let token = answer.sampler.sample(&logits)?;
                let stop = self.stop_tokens.contains(&token);
                if !stop {
                    answer.generated.push(token);
                }
                let length = requests[answer.index].prompt.len() + answer.generated.len();
                if stop || answer.generated.len() >= answer.limit || length >= context {
                    cache.free_sequence(answer.id)?;
                    let generation = self.answer(&answer.generated, answer.timing)?;
                    observer.finished(answer.index, &generation)?;
                    done[answer.index] = Some(generation);
                } else {
                    answer.next = Some(token);
                    still.push(answer);
                }
            }
            live = still;
            if live.is_empty() {
                continue;
            }
            // One pass: each answer brings its prompt's next chunk, or its last token.
            let inputs: Vec<(SequenceId, &[u32])> = live
                .iter()
                .map(|answer| {
                    let tokens = match &answer.next {
                        Some(token) => std::slice::from_ref(token),
                        None => {
                            let prompt = &requests[answer.index].prompt;
                            let end = prompt.len().min(answer.prompt_read + chunk);
                            &prompt[answer.prompt_read..end]
                        }
                    };
                    (answer.id, tokens)
                })
                .collect();
            let counts: Vec<usize> = inputs.iter().map(|(_, tokens)| tokens.len()).collect();
            let step_start = Instant::now();
            let logits = self
                .model
                .forward_mixed(&mut cache, &inputs)
                .context("a batched step failed")?;
            let secs_per_token =
                step_start.elapsed().as_secs_f64() / counts.iter().sum::<usize>() as f64;
            let mut decoded = 0;
            for (row, (answer, count)) in live.iter_mut().zip(counts).enumerate() {
                let share = secs_per_token * count as f64;
                if answer.next.take().is_some() {
                    answer.timing.decode_tokens += 1;
                    answer.timing.decode_secs += share;
                    decoded += 1;
                } else {
                    answer.timing.prefill_secs += share;
                    answer.prompt_read += count;
                    let prompt_tokens = requests[answer.index].prompt.len();
                    if answer.prompt_read < prompt_tokens {
                        continue;
                    }
                    observer.joined(answer.index, prompt_tokens);
                }
                answer.logits = Some(logits.get(row)?);
            }
            if decoded > 0 {
                written += decoded;
                let elapsed = batch_start.elapsed().as_secs_f64();
                observer.stepped(decoded, written as f64 / elapsed.max(1e-9));
            }
        }
        done.into_iter()
            .map(|g| g.context("a request was never answered"))
            .collect()
    }
}
