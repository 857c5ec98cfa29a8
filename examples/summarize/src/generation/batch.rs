//! Many generations at once: continuous batching over a paged cache. Up to `max_batch` answers
//! are written together, one batched forward pass per step for all of them; a finished answer
//! frees its pages and the next prompt takes its place.

use std::collections::VecDeque;
use std::time::Instant;

use anyhow::{Context, Result};
use candle_splitkv::{PagedKvCache, SequenceId};
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
    /// Its decode time is its share of each step it is in: the step's time over the answers in
    /// it, so that the shares add up to the batch's time.
    timing: Timing,
}

impl Generator<'_> {
    /// Writes the answers to `requests`, at most `max_batch` at a time, each as
    /// [`Generator::generate`] would (the same sampling, penalty and stopping rules; greedy
    /// answers match it up to rounding). Returns them in the requests' order. Prompt lookup
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

        let mut waiting: VecDeque<usize> = (0..requests.len()).collect();
        let mut live: Vec<Live> = Vec::new();
        let mut done: Vec<Option<Generation>> = vec![None; requests.len()];
        let mut pending_logits: Vec<candle_core::Tensor> = Vec::new();
        let batch_start = Instant::now();
        let mut written = 0usize;
        while !waiting.is_empty() || !live.is_empty() {
            while live.len() < max_batch {
                let Some(index) = waiting.pop_front() else {
                    break;
                };
                let (joined, logits) = self.join(&mut cache, index, &requests[index])?;
                observer.joined(index, requests[index].prompt.len());
                live.push(joined);
                pending_logits.push(logits);
            }
            // Sample each answer's next token from its logits; finished answers leave.
            let mut next = Vec::with_capacity(live.len());
            let mut still = Vec::with_capacity(live.len());
            for (mut answer, logits) in live.drain(..).zip(pending_logits.drain(..)) {
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
                    next.push(token);
                    still.push(answer);
                }
            }
            live = still;
            if live.is_empty() {
                continue;
            }
            let ids: Vec<SequenceId> = live.iter().map(|a| a.id).collect();
            let step_start = Instant::now();
            let logits = self
                .model
                .forward_paged(&mut cache, &ids, &next)
                .context("decoding failed")?;
            for row in 0..live.len() {
                pending_logits.push(logits.get(row)?);
            }
            let share = step_start.elapsed().as_secs_f64() / live.len() as f64;
            for answer in &mut live {
                answer.timing.decode_tokens += 1;
                answer.timing.decode_secs += share;
            }
            written += live.len();
            let elapsed = batch_start.elapsed().as_secs_f64();
            observer.stepped(live.len(), written as f64 / elapsed.max(1e-9));
        }
        done.into_iter()
            .map(|g| g.context("a request was never answered"))
            .collect()
    }

    /// Starts request `index`: reads its prompt into a new sequence of `cache`; returns the
    /// answer and the logits of its first token.
    fn join(
        &mut self,
        cache: &mut PagedKvCache,
        index: usize,
        request: &Request,
    ) -> Result<(Live, candle_core::Tensor)> {
        let start = Instant::now();
        let id = cache.add_sequence();
        let mut logits = None;
        for slice in request.prompt.chunks(PREFILL_SLICE) {
            logits = Some(
                self.model
                    .forward_paged(cache, &[id], slice)
                    .context("prefill failed")?
                    .squeeze(0)?,
            );
        }
        let logits = logits.context("empty prompt")?;
        let answer = Live {
            index,
            id,
            sampler: sampler(&self.settings),
            generated: Vec::new(),
            limit: request.max_new_tokens,
            timing: Timing {
                prefill_tokens: request.prompt.len(),
                prefill_secs: start.elapsed().as_secs_f64(),
                ..Timing::default()
            },
        };
        Ok((answer, logits))
    }
}
