//! Summarizing a document of any length on the model: the library plans the chunks and merges,
//! this runs the generations, shows their progress and streams the final summary.

use anyhow::{anyhow, Result};
use candle_splitkv::summarize::{ChatTemplate, MapReduce, Round, SummarizeError};

use crate::bad_input::BadInput;
use crate::generation::{GenerationObserver, Generator, Timing};
use crate::progress::{Progress, StreamToStdout};

/// The result of summarizing a document.
#[derive(Debug, Clone)]
pub struct Summary {
    pub text: String,
    pub document_tokens: usize,
    /// How many chunks the document was cut into (1 when it fit at once).
    pub chunks: usize,
    /// Rounds of summarizing summaries before the final one (0 for most documents).
    pub extra_rounds: usize,
    pub generations: usize,
    pub timing: Timing,
}

/// Summarizes documents, cutting them to fit the model's context.
pub struct Summarizer<'g, 'm> {
    generator: &'g mut Generator<'m>,
    chat: ChatTemplate,
    chunk_tokens: usize,
    /// Limit of the final summary.
    max_new_tokens: usize,
    generations: usize,
    timing: Timing,
}

impl<'g, 'm> Summarizer<'g, 'm> {
    pub fn new(
        generator: &'g mut Generator<'m>,
        chat: ChatTemplate,
        chunk_tokens: usize,
        max_new_tokens: usize,
    ) -> Self {
        Self {
            generator,
            chat,
            chunk_tokens,
            max_new_tokens,
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
            self.chunk_tokens,
            self.max_new_tokens,
        )
        .map_err(in_option_terms)?;
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
                    let answer = self.final_summary(&prompt, max_new_tokens, progress, stream)?;
                    break plan.finish(&answer)?;
                }
            };
            round = next.map_err(in_option_terms)?;
        };
        Ok(Summary {
            text,
            document_tokens: plan.document_tokens(),
            chunks: plan.chunks(),
            extra_rounds: plan.merge_rounds(),
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
        progress: &mut Progress,
        stream: bool,
    ) -> Result<String> {
        progress.add_work(prompt.len());
        progress.set_step("summary");
        if stream {
            let mut out = StreamToStdout::new(progress);
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
        error => error.into(),
    }
}
