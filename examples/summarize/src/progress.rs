//! The progress bar on stderr, and the observer that streams the final summary to stdout.

use std::io::Write;
use std::time::Duration;

use anyhow::{Context, Result};
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use summarize::{GroundedStream, Grounding, WholeSentences};

use crate::generation::GenerationObserver;
use crate::summarizer::Summary;

/// One bar for the whole run. Its length is the number of prompt tokens to read, so it moves
/// with prefill, the bulk of the work; the message says which step runs and how fast.
pub struct Progress {
    bar: ProgressBar,
    step: String,
    /// Whether the bar shows token counts yet (it is a plain spinner while the model loads).
    counting: bool,
}

impl Progress {
    /// A bar on stderr, or a hidden one when `quiet`. indicatif draws nothing when stderr is not
    /// a terminal, so logs and pipes stay clean.
    pub fn new(quiet: bool) -> Self {
        let target = if quiet {
            ProgressDrawTarget::hidden()
        } else {
            ProgressDrawTarget::stderr()
        };
        let bar = ProgressBar::with_draw_target(Some(0), target);
        bar.set_style(style("{spinner} [{elapsed_precise}] {msg}"));
        bar.enable_steady_tick(Duration::from_millis(200));
        Self {
            bar,
            step: String::new(),
            counting: false,
        }
    }

    /// Shows what runs now, e.g. "part 2/5".
    pub fn set_step(&mut self, step: impl Into<String>) {
        self.step = step.into();
        self.bar.set_message(self.step.clone());
    }

    /// Adds prompt tokens that will be read.
    pub fn add_work(&mut self, tokens: usize) {
        if !self.counting {
            self.bar.set_style(
                style("{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} prompt tokens  {msg}")
                    .progress_chars("=> "),
            );
            self.counting = true;
        }
        self.bar.inc_length(tokens as u64);
    }

    /// Counts `tokens` more prompt tokens read.
    pub fn inc(&self, tokens: usize) {
        self.bar.inc(tokens as u64);
    }

    /// Removes the bar from the terminal.
    pub fn clear(&self) {
        self.bar.finish_and_clear();
    }
}

/// One bar per document of a run over several, under a line with the batch's writing rate.
pub struct DocumentBars {
    multi: MultiProgress,
    rate: ProgressBar,
    bars: Vec<ProgressBar>,
}

impl DocumentBars {
    /// Bars named after `names` on stderr, or hidden ones when `quiet`.
    pub fn new(quiet: bool, names: &[String]) -> Self {
        let target = if quiet {
            ProgressDrawTarget::hidden()
        } else {
            ProgressDrawTarget::stderr()
        };
        let multi = MultiProgress::with_draw_target(target);
        let rate = multi.add(ProgressBar::new_spinner());
        rate.set_style(style("{spinner} [{elapsed_precise}] {msg}"));
        rate.set_message(format!("{} documents: reading", names.len()));
        rate.enable_steady_tick(Duration::from_millis(200));
        let width = names.iter().map(String::len).max().unwrap_or(0).min(40);
        let bars = names
            .iter()
            .map(|name| {
                let bar = multi.add(ProgressBar::new(0));
                bar.set_style(
                    style(&format!(
                        "  {{prefix:{width}}} {{bar:20}} {{pos}}/{{len}} {{msg}}"
                    ))
                    .progress_chars("=> "),
                );
                bar.set_prefix(name.clone());
                bar
            })
            .collect();
        Self { multi, rate, bars }
    }

    /// Document `doc` is in the round `label` of `answers` answers.
    pub fn set_round(&self, doc: usize, label: String, answers: usize) {
        let bar = &self.bars[doc];
        bar.set_length(answers as u64);
        bar.set_position(0);
        bar.set_message(label);
    }

    /// One more answer of document `doc`'s round is written.
    pub fn answered(&self, doc: usize) {
        self.bars[doc].inc(1);
    }

    /// The batch writes `live` answers at `tokens_per_s` in all.
    pub fn set_rate(&self, live: usize, tokens_per_s: f64) {
        self.rate.set_message(format!(
            "{} documents: writing {live} answers at once, {tokens_per_s:.1} tok/s",
            self.bars.len()
        ));
    }

    /// Document `doc` is summarized.
    pub fn finished(&self, doc: usize, summary: &Summary) {
        self.bars[doc].finish_with_message(format!(
            "done: {} generations, {} words",
            summary.generations,
            summary.text.split_whitespace().count()
        ));
    }

    /// Runs `f` (which prints) with the bars hidden, so that they do not draw over its text.
    pub fn suspend<R>(&self, f: impl FnOnce() -> R) -> R {
        self.multi.suspend(f)
    }

    /// Removes the bars from the terminal.
    pub fn clear(&self) {
        self.rate.finish_and_clear();
        self.multi.clear().ok();
    }
}

fn style(template: &str) -> ProgressStyle {
    ProgressStyle::with_template(template).expect("the progress templates are valid")
}

impl GenerationObserver for Progress {
    fn prefilled(&mut self, tokens: usize, tokens_per_s: f64) {
        self.bar.inc(tokens as u64);
        self.bar
            .set_message(format!("{}: reading at {tokens_per_s:.0} tok/s", self.step));
    }

    fn generated(&mut self, _text: &str, generated: usize, tokens_per_s: f64) -> Result<()> {
        self.bar.set_message(format!(
            "{}: writing, {generated} tokens at {tokens_per_s:.1} tok/s",
            self.step
        ));
        Ok(())
    }
}

/// Shows prefill progress, then clears the bar and prints the answer as it grows, a sentence at a
/// time: an answer cut by the token limit then ends on its last whole sentence, as the returned
/// summary does. With a grounding, sentences it does not ground are left out, as the returned
/// summary leaves them out.
pub struct StreamToStdout<'p> {
    progress: &'p mut Progress,
    grounding: Option<GroundedStream<'p>>,
    started: bool,
    sentences: WholeSentences,
    printed: bool,
}

impl<'p> StreamToStdout<'p> {
    pub fn new(progress: &'p mut Progress, grounding: Option<&'p Grounding>) -> Self {
        Self {
            progress,
            grounding: grounding.map(Grounding::stream),
            started: false,
            sentences: WholeSentences::new(),
            printed: false,
        }
    }

    /// Prints the held-back tail unless it is an unfinished sentence after whole ones, then ends
    /// the streamed text with a newline, if anything was printed.
    pub fn finish(&mut self) -> Result<()> {
        let tail = self.sentences.finish();
        self.print(&tail)?;
        if self.printed {
            let mut out = std::io::stdout().lock();
            writeln!(out)
                .and_then(|()| out.flush())
                .context("writing to stdout")?;
        }
        Ok(())
    }
}

impl StreamToStdout<'_> {
    /// Prints the grounded sentences of `text`, without the whitespace that would open the
    /// summary.
    fn print(&mut self, text: &str) -> Result<()> {
        let grounded = match &mut self.grounding {
            Some(grounding) => grounding.push(text).text,
            None => text.to_string(),
        };
        let shown = if self.printed {
            grounded.as_str()
        } else {
            grounded.trim_start()
        };
        self.printed |= !shown.is_empty();
        print_now(shown)
    }
}

/// Writes `text` to stdout and flushes it, so that the answer shows as the model writes it.
fn print_now(text: &str) -> Result<()> {
    if text.is_empty() {
        return Ok(());
    }
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .context("writing to stdout")
}

impl GenerationObserver for StreamToStdout<'_> {
    fn prefilled(&mut self, tokens: usize, tokens_per_s: f64) {
        self.progress.prefilled(tokens, tokens_per_s);
    }

    fn generated(&mut self, text: &str, _generated: usize, _tokens_per_s: f64) -> Result<()> {
        if !self.started {
            // The bar would redraw over the text on a shared terminal.
            self.progress.clear();
            self.started = true;
        }
        let released = self.sentences.push(text);
        self.print(&released)
    }
}
