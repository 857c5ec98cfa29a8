//! Summarizing a document of any length on the model: the library plans the chunks and merges,
//! this runs the generations, shows their progress and streams the final summary.

use std::io::Write;

use anyhow::{anyhow, Context, Result};
use candle_splitkv::summarize::{
    ChatTemplate, Grounding, MapReduce, Reduce, Round, SummarizeError,
};

use crate::bad_input::BadInput;
use crate::generation::{GenerationObserver, Generator, Timing};
use crate::progress::{Progress, StreamToStdout};

/// The result of summarizing a document.
#[derive(Debug, Clone)]
pub struct Summary {
    pub text: String,
    pub document_tokens: usize,
    /// How many tokens the sentences selected for their facts have, when the document was
    /// summarized from them.
    pub selected_tokens: Option<usize>,
    /// How many chunks the document was cut into (1 when it fit at once).
    pub chunks: usize,
    /// Rounds of summarizing summaries before the final one (0 for most documents).
    pub extra_rounds: usize,
    /// Sentences of the answers dropped for stating a number or a name the document does not
    /// contain.
    pub dropped_sentences: usize,
    /// Sentences of the answers replaced by the document's own sentence about their names and
    /// numbers, for attributing them to the wrong things.
    pub replaced_sentences: usize,
    pub generations: usize,
    pub timing: Timing,
}

/// How a document is boiled down: the planner's settings.
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    pub chunk_tokens: usize,
    /// Limit of the final summary.
    pub max_new_tokens: usize,
    /// Summarize a longer document from its sentences with the most facts, up to this many
    /// tokens of them.
    pub select_tokens: Option<usize>,
    pub reduce: Reduce,
    /// Drop sentences that state a number or a name the document does not contain.
    pub ground: bool,
}

/// Summarizes documents, cutting them to fit the model's context.
pub struct Summarizer<'g, 'm> {
    generator: &'g mut Generator<'m>,
    chat: ChatTemplate,
    plan: Plan,
    generations: usize,
    timing: Timing,
}

impl<'g, 'm> Summarizer<'g, 'm> {
    pub fn new(generator: &'g mut Generator<'m>, chat: ChatTemplate, plan: Plan) -> Self {
        Self {
            generator,
            chat,
            plan,
            generations: 0,
            timing: Timing::default(),
        }
    }

    /// Summarizes `document`. The final summary streams to stdout when `stream` is set.
    pub fn summarize(
        mut self,
        document: &str,
        progress: &mut Progress,
        stream: bool,
    ) -> Result<Summary> {
        let mut plan = MapReduce::new(
            self.generator.tokenizer(),
            self.chat.clone(),
            self.generator.context_length(),
            self.plan.chunk_tokens,
            self.plan.max_new_tokens,
        )
        .map_err(in_option_terms)?
        .with_selection(self.plan.select_tokens)
        .with_reduce(self.plan.reduce)
        .with_grounding(self.plan.ground);
        let mut round = plan.start(document)?;
        let text = loop {
            let next = match round {
                Round::Parts {
                    prompts,
                    max_new_tokens,
                } => {
                    let answers = self.summarize_all(&prompts, "part", max_new_tokens, progress)?;
                    plan.next_round(&answers)
                }
                Round::Merge {
                    round,
                    prompts,
                    max_new_tokens,
                } => {
                    let label = format!("merging, round {round},");
                    let answers = self.summarize_all(&prompts, &label, max_new_tokens, progress)?;
                    plan.next_round(&answers)
                }
                Round::Final {
                    prompt,
                    max_new_tokens,
                } => {
                    let answer = self.final_summary(
                        &prompt,
                        max_new_tokens,
                        plan.grounding(),
                        progress,
                        stream,
                    )?;
                    break plan.finish(&answer).map_err(in_option_terms)?;
                }
                Round::Done { summary } => {
                    progress.clear();
                    if stream {
                        print_summary(&summary)?;
                    }
                    break summary;
                }
            };
            round = next.map_err(in_option_terms)?;
        };
        Ok(Summary {
            text,
            document_tokens: plan.document_tokens(),
            selected_tokens: plan.selected_tokens(),
            chunks: plan.chunks(),
            extra_rounds: plan.merge_rounds(),
            dropped_sentences: plan.dropped_sentences(),
            replaced_sentences: plan.replaced_sentences(),
            generations: self.generations,
            timing: self.timing,
        })
    }

    /// Answers each prompt of a round of intermediate summaries.
    fn summarize_all(
        &mut self,
        prompts: &[Vec<u32>],
        label: &str,
        max_new_tokens: usize,
        progress: &mut Progress,
    ) -> Result<Vec<String>> {
        progress.add_work(prompts.iter().map(Vec::len).sum());
        let mut answers = Vec::with_capacity(prompts.len());
        for (i, prompt) in prompts.iter().enumerate() {
            progress.set_step(format!("{label} {}/{}", i + 1, prompts.len()));
            answers.push(self.run(prompt, max_new_tokens, progress)?);
        }
        Ok(answers)
    }

    fn final_summary(
        &mut self,
        prompt: &[u32],
        max_new_tokens: usize,
        grounding: Option<&Grounding>,
        progress: &mut Progress,
        stream: bool,
    ) -> Result<String> {
        progress.add_work(prompt.len());
        progress.set_step("summary");
        if stream {
            let mut out = StreamToStdout::new(progress, grounding);
            let text = self.run(prompt, max_new_tokens, &mut out)?;
            out.finish()?;
            Ok(text)
        } else {
            self.run(prompt, max_new_tokens, progress)
        }
    }

    fn run(
        &mut self,
        prompt: &[u32],
        max_new_tokens: usize,
        observer: &mut dyn GenerationObserver,
    ) -> Result<String> {
        let generation = self.generator.generate(prompt, max_new_tokens, observer)?;
        self.generations += 1;
        self.timing.add(generation.timing);
        Ok(generation.text)
    }
}

/// Prints a summary put together without a final generation, with its closing line break.
fn print_summary(summary: &str) -> Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{summary}")
        .and_then(|()| out.flush())
        .context("writing to stdout")
}

/// The planner's error, naming the options that set its limits.
fn in_option_terms(error: SummarizeError) -> anyhow::Error {
    match error {
        SummarizeError::SummaryLimitTooLarge {
            max_new_tokens,
            context_length,
            largest,
        } => BadInput(format!(
            "--max-new-tokens {max_new_tokens} is too large for the model's context of \
             {context_length} tokens: summaries could not be merged; use at most {largest}"
        ))
        .into(),
        SummarizeError::SummariesDoNotShrink => anyhow!(
            "the summaries of the parts do not get shorter when summarized again; \
             try a larger --chunk-tokens or a smaller --max-new-tokens"
        ),
        SummarizeError::NothingGrounded => anyhow!(
            "every sentence of the model's summary stated a number or a name the document does \
             not contain; --keep-ungrounded keeps them"
        ),
        error => error.into(),
    }
}
