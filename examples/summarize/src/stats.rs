//! The statistics of a run: one line for people, one JSON object for programs.

use serde_json::{json, Value};

use crate::planted_facts::FactScore;
use crate::summarizer::Summary;

/// Where and how the summary was made, next to what [`Summary`] counted.
pub struct RunInfo {
    pub model: String,
    pub device: String,
    pub attention: &'static str,
    /// How the KV cache stores keys and values (`float32`, `bfloat16`, `float16`, `float8_e4m3fn`).
    pub kv_dtype: &'static str,
    /// Tokens drafted per verification pass (0: no speculation).
    pub speculate: usize,
    pub elapsed_secs: f64,
    /// The summary's score on the facts planted in the document, when a list was given.
    pub facts: Option<FactScore>,
}

fn per_second(tokens: usize, secs: f64) -> f64 {
    if secs > 0.0 {
        tokens as f64 / secs
    } else {
        0.0
    }
}

/// The share of drafted tokens the model kept (0 when nothing was drafted).
fn acceptance_rate(summary: &Summary) -> f64 {
    let t = &summary.timing;
    if t.drafted > 0 {
        t.accepted as f64 / t.drafted as f64
    } else {
        0.0
    }
}

/// The one-line summary of the run, for stderr.
pub fn stats_line(summary: &Summary, info: &RunInfo) -> String {
    let t = &summary.timing;
    let speculation = if info.speculate > 0 {
        format!(
            " | speculate {}, acceptance {:.0}%",
            info.speculate,
            100.0 * acceptance_rate(summary)
        )
    } else {
        String::new()
    };
    let facts = info.facts.as_ref().map_or(String::new(), |score| {
        format!(
            " | facts {}/{} recalled, {} invented",
            score.recalled.len(),
            score.planted,
            score.invented.len()
        )
    });
    let selected = summary
        .selected_tokens
        .map_or(String::new(), |tokens| format!(" | {tokens} selected"));
    let extractive = summary.extractive.map_or(String::new(), |why| {
        format!(
            " | extractive: whole sentences of the document ({})",
            why.reason()
        )
    });
    let salience = summary.salience_secs.map_or(String::new(), |secs| {
        format!(" | attention salience {secs:.1} s")
    });
    // A summary of whole sentences generates nothing: no chunks or rates to report.
    let generation = if summary.generations == 0 {
        String::new()
    } else {
        format!(
            " | {} chunk{} | prefill {:.1} tok/s | decode {:.1} tok/s{speculation}",
            summary.chunks,
            if summary.chunks == 1 { "" } else { "s" },
            per_second(t.prefill_tokens, t.prefill_secs),
            per_second(t.decode_tokens, t.decode_secs),
        )
    };
    format!(
        "document {} tokens{selected}{extractive}{salience}{generation} | attention {} | kv {} | \
         device {}{facts} | {:.1} s",
        summary.document_tokens, info.attention, info.kv_dtype, info.device, info.elapsed_secs,
    )
}

/// The summary and the statistics as one JSON object, with the score on the planted facts when
/// a list was given.
pub fn json_report(summary: &Summary, info: &RunInfo) -> Value {
    let t = &summary.timing;
    let mut report = json!({
        "summary": summary.text,
        "stats": {
            "document_tokens": summary.document_tokens,
            "selected_tokens": summary.selected_tokens,
            "chunks": summary.chunks,
            "extra_merge_rounds": summary.extra_rounds,
            "dropped_sentences": summary.dropped_sentences,
            "replaced_sentences": summary.replaced_sentences,
            "extractive": summary.extractive.map(|why| why.reason()),
            "attention_salience_seconds": summary.salience_secs,
            "generations": summary.generations,
            "prefill_tokens": t.prefill_tokens,
            "prefill_seconds": t.prefill_secs,
            "prefill_tokens_per_second": per_second(t.prefill_tokens, t.prefill_secs),
            "decode_tokens": t.decode_tokens,
            "decode_seconds": t.decode_secs,
            "decode_tokens_per_second": per_second(t.decode_tokens, t.decode_secs),
            "speculate": info.speculate,
            "drafted_tokens": t.drafted,
            "accepted_tokens": t.accepted,
            "acceptance_rate": acceptance_rate(summary),
            "verify_passes": t.verify_passes,
            "attention": info.attention,
            "kv_dtype": info.kv_dtype,
            "device": info.device,
            "model": info.model,
            "elapsed_seconds": info.elapsed_secs,
        },
    });
    if let Some(score) = &info.facts {
        report["facts"] = json!({
            "planted": score.planted,
            "recalled": score.recalled,
            "missed": score.missed,
            "invented": score.invented,
        });
    }
    report
}

/// What a run over several documents did as a whole: the rates of the batch, over its wall
/// time, where each document's own rates count only its share.
pub struct Aggregate {
    documents: usize,
    prefill_tokens: usize,
    decode_tokens: usize,
    generations: usize,
    secs: f64,
}

impl Aggregate {
    pub fn of(summaries: &[Summary], secs: f64) -> Self {
        Self {
            documents: summaries.len(),
            prefill_tokens: summaries.iter().map(|s| s.timing.prefill_tokens).sum(),
            decode_tokens: summaries.iter().map(|s| s.timing.decode_tokens).sum(),
            generations: summaries.iter().map(|s| s.generations).sum(),
            secs,
        }
    }

    /// Tokens written: one from each prompt's logits, the rest decoded.
    fn written(&self) -> usize {
        self.decode_tokens + self.generations
    }

    pub fn line(&self, batch: usize) -> String {
        format!(
            "{} documents, {} answers, up to {batch} at once: {} prompt tokens read and {} tokens \
             written in {:.1} s | {:.1} tok/s written, {:.1} tok/s read and written",
            self.documents,
            self.generations,
            self.prefill_tokens,
            self.written(),
            self.secs,
            per_second(self.written(), self.secs),
            per_second(self.prefill_tokens + self.written(), self.secs),
        )
    }

    pub fn json(&self) -> Value {
        json!({
            "documents": self.documents,
            "generations": self.generations,
            "prompt_tokens": self.prefill_tokens,
            "written_tokens": self.written(),
            "seconds": self.secs,
            "written_tokens_per_second": per_second(self.written(), self.secs),
        })
    }
}
