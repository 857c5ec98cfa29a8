//! Summarizing a document of any length on the model: the library plans the chunks and merges,
//! this runs the generations, shows their progress and streams the final summary.

use std::io::Write;
use std::time::Instant;

use anyhow::{anyhow, Context, Result};
use summarize::{
    reads_as_english, ChatTemplate, Grounding, MapReduce, ModelSalience, Reduce, Round,
    SummarizeError,
};

use crate::attention_salience::attention_salience;
use crate::bad_input::BadInput;
use crate::generation::{
    BatchObserver, Generation, GenerationObserver, Generator, Request, Timing,
};
use crate::progress::{DocumentBars, Progress, StreamToStdout};

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
    /// Why the summary is made of whole sentences of the document with no generation, if it is.
    pub extractive: Option<Extractive>,
    /// Seconds the model took to read the document for its attention salience, if it did.
    pub salience_secs: Option<f64>,
    pub generations: usize,
    pub timing: Timing,
}

/// Why a summary is extractive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Extractive {
    /// The default: the model rewrites only with `--rewrite`.
    Default,
    /// The model reads English and the document is in another language.
    LanguageNotRead,
}

impl Extractive {
    pub fn reason(self) -> &'static str {
        match self {
            Extractive::Default => "the default; --rewrite has the model compress them",
            Extractive::LanguageNotRead => "the model does not read the document's language",
        }
    }
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
    /// Summarize every document from its own sentences, with no generation.
    pub extractive: bool,
    /// Weigh the attention the model pays each sentence in selecting them (see
    /// [`attention_salience`]), where the model reads the document.
    pub attention_salience: bool,
    /// Whether the model reads English only (the default model): a document in another language
    /// is then summarized from its own sentences.
    pub english_only: bool,
    /// Answers written at once (continuous batching); 1 writes them one at a time.
    pub batch: usize,
}

/// Summarizes documents, cutting them to fit the model's context.
pub struct Summarizer<'g, 'm> {
    generator: &'g mut Generator<'m>,
    chat: ChatTemplate,
    plan: Plan,
    generations: usize,
    timing: Timing,
}

/// Tokens of the sentences the text ranks first that the model reads for its salience: about
/// twice what selection keeps, few enough to read in seconds on a CPU.
const ATTENTION_POOL_TOKENS: usize = 2048;

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

    /// Why `document` is summarized from its own sentences, if it is.
    fn extractive(&self, document: &str) -> Option<Extractive> {
        if self.plan.english_only && !reads_as_english(document) {
            Some(Extractive::LanguageNotRead)
        } else if self.plan.extractive {
            Some(Extractive::Default)
        } else {
            None
        }
    }

    /// The model's salience of `document`'s sentences and the seconds it took, where the plan
    /// asks for it and the model reads the document.
    fn model_salience(
        &mut self,
        document: &str,
        extractive: Option<Extractive>,
    ) -> Result<(Option<ModelSalience>, Option<f64>)> {
        if !self.plan.attention_salience || extractive == Some(Extractive::LanguageNotRead) {
            return Ok((None, None));
        }
        let started = Instant::now();
        let salience = attention_salience(self.generator, document, ATTENTION_POOL_TOKENS)?;
        Ok((Some(salience), Some(started.elapsed().as_secs_f64())))
    }

    /// The planner of one document. Every answer is checked against the document: the rewrite
    /// contract, and the names and numbers it states.
    fn planner(&self, extractive: bool, salience: Option<ModelSalience>) -> Result<MapReduce<'m>> {
        Ok(MapReduce::new(
            self.generator.tokenizer(),
            self.chat.clone(),
            self.generator.context_length(),
            self.plan.chunk_tokens,
            self.plan.max_new_tokens,
        )
        .map_err(in_option_terms)?
        .with_selection(self.plan.select_tokens)
        .with_reduce(self.plan.reduce)
        .with_extractive(extractive)
        .with_model_salience(salience)
        .with_grounding(true))
    }

    /// Summarizes `document`. The final summary streams to stdout when `stream` is set.
    pub fn summarize(
        mut self,
        document: &str,
        progress: &mut Progress,
        stream: bool,
    ) -> Result<Summary> {
        let extractive = self.extractive(document);
        let (salience, salience_secs) = self.model_salience(document, extractive)?;
        let mut plan = self.planner(extractive.is_some(), salience)?;
        let mut round = plan.start(document).map_err(in_option_terms)?;
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
            extractive,
            salience_secs,
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
        if self.plan.batch > 1 && !self.generator.speculates() && self.generator.can_batch() {
            let requests: Vec<Request> = prompts
                .iter()
                .map(|prompt| Request {
                    prompt: prompt.clone(),
                    max_new_tokens,
                })
                .collect();
            progress.set_step(format!("{label}s, {} at once", self.plan.batch));
            let generations = self.generator.generate_batch(
                &requests,
                self.plan.batch,
                &mut PartsProgress {
                    progress,
                    answered: 0,
                    total: prompts.len(),
                    label,
                },
            )?;
            return Ok(generations
                .into_iter()
                .map(|generation| self.count(generation))
                .collect());
        }
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
        Ok(self.count(generation))
    }

    /// Counts a generation in the statistics; its text.
    fn count(&mut self, generation: Generation) -> String {
        self.generations += 1;
        self.timing.add(generation.timing);
        generation.text
    }

    /// Summarizes several documents at once: the answers of every document's current round are
    /// written together (continuous batching, `Plan::batch` at a time), and each document moves
    /// on to its next round when the wave is done. `done(i, summary)` is called as document `i`
    /// is finished; the summaries come back in the documents' order.
    pub fn summarize_many(
        mut self,
        documents: &[String],
        bars: &DocumentBars,
        mut done: impl FnMut(usize, &Summary) -> Result<()>,
    ) -> Result<Vec<Summary>> {
        let mut runs = Vec::with_capacity(documents.len());
        for document in documents {
            let extractive = self.extractive(document);
            let (salience, salience_secs) = self.model_salience(document, extractive)?;
            let mut plan = self.planner(extractive.is_some(), salience)?;
            let round = plan.start(document).map_err(in_option_terms)?;
            runs.push(DocumentRun {
                plan,
                extractive,
                salience_secs,
                round: Some(round),
                generations: 0,
                timing: Timing::default(),
                summary: None,
            });
        }
        loop {
            // Documents whose planner finished without a generation.
            for (i, run) in runs.iter_mut().enumerate() {
                match run.round.take() {
                    Some(Round::Done { summary }) => {
                        let summary = run.finish(summary);
                        bars.finished(i, &summary);
                        done(i, &summary)?;
                        run.summary = Some(summary);
                    }
                    Some(round) => {
                        bars.set_round(i, round_label(&round), round_prompts(&round).len());
                        run.round = Some(round);
                    }
                    None => {}
                }
            }
            let mut requests = Vec::new();
            let mut owners = Vec::new();
            for (i, run) in runs.iter().enumerate() {
                let Some(round) = &run.round else { continue };
                let max_new_tokens = round_max_new_tokens(round);
                for prompt in round_prompts(round) {
                    requests.push(Request {
                        prompt: prompt.clone(),
                        max_new_tokens,
                    });
                    owners.push(i);
                }
            }
            if requests.is_empty() {
                break;
            }
            let generations = self.generator.generate_batch(
                &requests,
                self.plan.batch,
                &mut WaveProgress {
                    bars,
                    owners: &owners,
                },
            )?;
            let mut answers: Vec<Vec<String>> = vec![Vec::new(); runs.len()];
            for (generation, &i) in generations.into_iter().zip(&owners) {
                runs[i].generations += 1;
                runs[i].timing.add(generation.timing);
                self.generations += 1;
                answers[i].push(generation.text);
            }
            for (i, run) in runs.iter_mut().enumerate() {
                let Some(round) = run.round.take() else {
                    continue;
                };
                run.round = Some(match round {
                    Round::Final { .. } => {
                        let text = run.plan.finish(&answers[i][0]).map_err(in_option_terms)?;
                        Round::Done { summary: text }
                    }
                    _ => run.plan.next_round(&answers[i]).map_err(in_option_terms)?,
                });
            }
        }
        runs.into_iter()
            .map(|run| run.summary.context("a document was never summarized"))
            .collect()
    }
}

/// One document of [`Summarizer::summarize_many`].
struct DocumentRun<'t> {
    plan: MapReduce<'t>,
    extractive: Option<Extractive>,
    salience_secs: Option<f64>,
    /// The round whose answers are being written; `None` once summarized.
    round: Option<Round>,
    generations: usize,
    timing: Timing,
    summary: Option<Summary>,
}

impl DocumentRun<'_> {
    fn finish(&self, text: String) -> Summary {
        Summary {
            text,
            document_tokens: self.plan.document_tokens(),
            selected_tokens: self.plan.selected_tokens(),
            chunks: self.plan.chunks(),
            extra_rounds: self.plan.merge_rounds(),
            dropped_sentences: self.plan.dropped_sentences(),
            replaced_sentences: self.plan.replaced_sentences(),
            extractive: self.extractive,
            salience_secs: self.salience_secs,
            generations: self.generations,
            timing: self.timing,
        }
    }
}

fn round_prompts(round: &Round) -> &[Vec<u32>] {
    match round {
        Round::Parts { prompts, .. } | Round::Merge { prompts, .. } => prompts,
        Round::Final { prompt, .. } => std::slice::from_ref(prompt),
        Round::Done { .. } => &[],
    }
}

fn round_max_new_tokens(round: &Round) -> usize {
    match round {
        Round::Parts { max_new_tokens, .. }
        | Round::Merge { max_new_tokens, .. }
        | Round::Final { max_new_tokens, .. } => *max_new_tokens,
        Round::Done { .. } => 0,
    }
}

fn round_label(round: &Round) -> String {
    match round {
        Round::Parts { .. } => "parts".to_string(),
        Round::Merge { round, .. } => format!("merging, round {round}"),
        Round::Final { .. } => "summary".to_string(),
        Round::Done { .. } => "done".to_string(),
    }
}

/// Progress of one round's answers written as a batch, on the run's bar.
struct PartsProgress<'p> {
    progress: &'p mut Progress,
    answered: usize,
    total: usize,
    label: &'p str,
}

impl BatchObserver for PartsProgress<'_> {
    fn joined(&mut self, _index: usize, prompt_tokens: usize) {
        self.progress.inc(prompt_tokens);
    }

    fn stepped(&mut self, live: usize, tokens_per_s: f64) {
        self.progress.set_step(format!(
            "{}s: {}/{} answered, writing {live} at {tokens_per_s:.1} tok/s",
            self.label, self.answered, self.total
        ));
    }

    fn finished(&mut self, _index: usize, _generation: &Generation) -> Result<()> {
        self.answered += 1;
        Ok(())
    }
}

/// Progress of a wave of several documents' answers, on each document's bar.
struct WaveProgress<'b> {
    bars: &'b DocumentBars,
    /// The document of each request.
    owners: &'b [usize],
}

impl BatchObserver for WaveProgress<'_> {
    fn joined(&mut self, _index: usize, _prompt_tokens: usize) {}

    fn stepped(&mut self, live: usize, tokens_per_s: f64) {
        self.bars.set_rate(live, tokens_per_s);
    }

    fn finished(&mut self, index: usize, _generation: &Generation) -> Result<()> {
        self.bars.answered(self.owners[index]);
        Ok(())
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
        SummarizeError::NothingToSelect => BadInput(format!(
            "{}; a summary of whole sentences (the default, and any document the model does \
             not read) needs such sentences",
            SummarizeError::NothingToSelect
        ))
        .into(),
        error => error.into(),
    }
}
