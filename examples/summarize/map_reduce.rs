//! Summarizing a document of any length: summarize chunks that fit, then summarize the summaries.

use anyhow::{bail, Result};

use crate::bad_input::bad_input;
use crate::chat_template::ChatFormat;
use crate::chunking::{drop_unfinished_sentence, split_into_chunks, token_starts};
use crate::generation::{GenerationObserver, Generator, Timing};
use crate::progress::{Progress, StreamToStdout};

/// Without a system message SmolLM2 ends its answer before writing anything.
const SYSTEM: &str = "You are a helpful assistant who writes concise, accurate summaries.";

/// Room left in the context for the prompt's fixed text and for tokenization differences between
/// a chunk alone and the same span inside the whole document.
const PROMPT_SLACK: usize = 32;

/// What a generation is asked to do. The instruction follows the text: small models lose an
/// instruction placed before a long text, and then continue or repeat the text instead.
#[derive(Debug, Clone, Copy)]
enum Task<'t> {
    /// The whole document fits at once.
    Document(&'t str),
    /// One chunk of a longer document.
    Part(&'t str),
    /// Summaries of consecutive parts, to be merged into one.
    Summaries(&'t str),
}

impl Task<'_> {
    fn user_message(self) -> String {
        match self {
            // Joined summaries read like a short document; asked to "combine summaries", small
            // models tend to describe the list instead of summarizing it.
            Task::Document(text) | Task::Summaries(text) => {
                format!("{text}\n\nSummarize the text above in a short paragraph.")
            }
            Task::Part(text) => {
                format!("{text}\n\nSummarize the text above in two or three sentences.")
            }
        }
    }
}

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
    format: ChatFormat,
    chunk_tokens: usize,
    /// Limit of the final summary.
    max_new_tokens: usize,
    generations: usize,
    timing: Timing,
}

impl<'g, 'm> Summarizer<'g, 'm> {
    pub fn new(
        generator: &'g mut Generator<'m>,
        format: ChatFormat,
        chunk_tokens: usize,
        max_new_tokens: usize,
    ) -> Self {
        Self {
            generator,
            format,
            chunk_tokens,
            max_new_tokens,
            generations: 0,
            timing: Timing::default(),
        }
    }

    /// Limit of the intermediate summaries: half the final one. They are only read by the
    /// model, and shorter ones keep small models from rambling and decoding from dominating.
    fn part_tokens(&self) -> usize {
        (self.max_new_tokens / 2).max(16)
    }

    /// Summarizes `document`. The final summary streams to stdout when `stream` is set.
    pub fn summarize(
        mut self,
        document: &str,
        progress: &mut Progress,
        stream: bool,
    ) -> Result<Summary> {
        let (map_budget, reduce_budget) = self.budgets()?;
        let starts = token_starts(self.generator.tokenizer(), document)?;
        let document_tokens = starts.len();
        let chunks = split_into_chunks(document, &starts, map_budget);
        let count = chunks.len();

        let mut extra_rounds = 0;
        let text = if count <= 1 {
            self.final_summary(Task::Document(document.trim()), progress, stream)?
        } else {
            let tasks: Vec<Task> = chunks.iter().map(|&text| Task::Part(text)).collect();
            let mut summaries = self.summarize_all(&tasks, "part", progress)?;
            loop {
                let joined = summaries.join("\n\n");
                let starts = token_starts(self.generator.tokenizer(), &joined)?;
                let groups = split_into_chunks(&joined, &starts, reduce_budget);
                if groups.len() <= 1 {
                    break self.final_summary(Task::Summaries(&joined), progress, stream)?;
                }
                if groups.len() >= summaries.len() {
                    bail!(
                        "the summaries of the parts do not get shorter when summarized again; \
                         try a larger --chunk-tokens or a smaller --max-new-tokens"
                    );
                }
                extra_rounds += 1;
                let tasks: Vec<Task> = groups.into_iter().map(Task::Summaries).collect();
                summaries = self.summarize_all(
                    &tasks,
                    &format!("merging, round {extra_rounds},"),
                    progress,
                )?;
            }
        };
        if text.is_empty() {
            bail!("the model wrote an empty summary");
        }
        Ok(Summary {
            text,
            document_tokens,
            chunks: count.max(1),
            extra_rounds,
            generations: self.generations,
            timing: self.timing,
        })
    }

    /// The most tokens of document text per chunk, and of summaries per merge. Merges may use
    /// more than --chunk-tokens when needed to take at least two summaries at a time, so that
    /// every round shrinks the text.
    fn budgets(&self) -> Result<(usize, usize)> {
        let context = self.generator.context_length();
        let max_new = self.max_new_tokens;
        let mut overhead = 0;
        for task in [Task::Document(""), Task::Part(""), Task::Summaries("")] {
            overhead = overhead.max(self.prompt(task)?.len());
        }
        let room = context.saturating_sub(overhead + PROMPT_SLACK + max_new);
        let min_merge = 2 * self.part_tokens() + PROMPT_SLACK;
        if room < min_merge {
            bad_input!(
                "--max-new-tokens {max_new} is too large for the model's context of {context} \
                 tokens: summaries could not be merged; use at most {}",
                context.saturating_sub(overhead + 2 * PROMPT_SLACK) / 2
            );
        }
        Ok((
            self.chunk_tokens.min(room),
            self.chunk_tokens.max(min_merge).min(room),
        ))
    }

    fn prompt(&self, task: Task) -> Result<Vec<u32>> {
        self.generator
            .encode_prompt(&self.format.render(SYSTEM, &task.user_message()))
    }

    /// Summarizes each task, dropping empty answers.
    fn summarize_all(
        &mut self,
        tasks: &[Task],
        label: &str,
        progress: &mut Progress,
    ) -> Result<Vec<String>> {
        let prompts = tasks
            .iter()
            .map(|&t| self.prompt(t))
            .collect::<Result<Vec<_>>>()?;
        progress.add_work(prompts.iter().map(Vec::len).sum());
        let mut summaries = Vec::with_capacity(tasks.len());
        for (i, prompt) in prompts.iter().enumerate() {
            progress.set_step(format!("{label} {}/{}", i + 1, tasks.len()));
            let summary = self.run(prompt, self.part_tokens(), progress)?;
            let summary = drop_unfinished_sentence(&summary);
            if !summary.is_empty() {
                summaries.push(summary.to_string());
            }
        }
        if summaries.is_empty() {
            bail!("the model wrote an empty summary for every part of the document");
        }
        Ok(summaries)
    }

    fn final_summary(
        &mut self,
        task: Task,
        progress: &mut Progress,
        stream: bool,
    ) -> Result<String> {
        let prompt = self.prompt(task)?;
        progress.add_work(prompt.len());
        progress.set_step("summary");
        let text = if stream {
            let mut out = StreamToStdout::new(progress);
            let text = self.run(&prompt, self.max_new_tokens, &mut out)?;
            out.finish()?;
            text
        } else {
            self.run(&prompt, self.max_new_tokens, progress)?
        };
        // The streamed text stops at the same place.
        Ok(drop_unfinished_sentence(&text).to_string())
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
