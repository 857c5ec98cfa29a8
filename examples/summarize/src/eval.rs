//! `summarize eval`: the summarizer scored on documents with planted facts, by default and with
//! each use of the model added (its attention as salience, its rewrites), beside four extractive
//! baselines held to the default summary's word count, in one table.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use serde_json::json;
use summarize::{reads_as_english, sentences, words_in, Baseline, ChatTemplate, RewriteContract};

use crate::bad_input::bad_input;
use crate::generation::Generator;
use crate::input::read_document;
use crate::planted_facts::PlantedFacts;
use crate::progress::Progress;
use crate::summarizer::{Plan, Summarizer, Summary};

/// A document with its planted facts, and the folder it is grouped by.
struct Case {
    name: String,
    group: String,
    document: String,
    facts: PlantedFacts,
}

/// One document's row of the table.
struct Row {
    name: String,
    group: String,
    tokens: usize,
    planted: usize,
    /// The default: selection by the text alone, whole sentences.
    ours: usize,
    /// With the model's attention salience in selection (not run with `text_only`).
    attention: Option<usize>,
    /// With the model's rewrites of the selected sentences (not run with `text_only`).
    rewritten: Option<usize>,
    baselines: Vec<usize>,
    words: usize,
    violations: usize,
    /// Seconds taken by ours, with attention salience, with rewrites.
    secs: [Option<f64>; 3],
    /// Whether the model does not read the document (it is then neither rewritten nor read).
    not_read: bool,
    raw: serde_json::Value,
}

/// The documents `paths` name (files, folders, and folders one level down) with their facts.
fn cases(paths: &[PathBuf]) -> Result<Vec<Case>> {
    let mut files = Vec::new();
    for path in paths {
        collect(path, 1, &mut files)?;
    }
    if files.is_empty() {
        bad_input!("no .md or .txt document with its .facts.json in the paths given");
    }
    files
        .into_iter()
        .map(|(path, facts_path)| {
            let group = path
                .parent()
                .and_then(Path::file_name)
                .map_or(String::new(), |g| g.to_string_lossy().into_owned());
            let name = path
                .file_stem()
                .map_or(String::new(), |n| n.to_string_lossy().into_owned());
            Ok(Case {
                name,
                group,
                document: read_document(&path)?,
                facts: PlantedFacts::read(&facts_path)?,
            })
        })
        .collect()
}

/// Adds the documents at `path` that have a facts file, looking `depth` folders down.
fn collect(path: &Path, depth: usize, found: &mut Vec<(PathBuf, PathBuf)>) -> Result<()> {
    if path.is_dir() {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(path)
            .with_context(|| format!("cannot list {}", path.display()))?
            .filter_map(|entry| entry.ok().map(|e| e.path()))
            .collect();
        entries.sort();
        for entry in entries {
            if entry.is_file() || depth > 0 {
                collect(&entry, depth.saturating_sub(1), found)?;
            }
        }
        return Ok(());
    }
    let is_document = path.extension().is_some_and(|e| e == "md" || e == "txt");
    let facts = path.with_extension("facts.json");
    if is_document && facts.is_file() {
        found.push((path.to_path_buf(), facts));
    } else if is_document && path.exists() && path.file_name().is_some_and(|n| n != "README.md") {
        bad_input!("{} has no facts file {}", path.display(), facts.display());
    } else if !path.exists() {
        bad_input!("{}: no such file or folder", path.display());
    }
    Ok(())
}

/// Sentences of `summary` that break the rewrite contract against `document`.
fn violations(summary: &str, document: &str) -> usize {
    let contract = RewriteContract::new(document);
    sentences(summary)
        .into_iter()
        .filter(|s| !s.trim().is_empty() && !contract.holds(s.trim()))
        .count()
}

/// How `summarize eval` runs.
pub struct Options<'a> {
    /// Where to write every summary and score as JSON, if anywhere.
    pub raw: Option<&'a Path>,
    /// Leave out the runs that use the model.
    pub text_only: bool,
    pub quiet: bool,
}

/// Runs the evaluation and prints its table.
pub fn run(
    generator: &mut Generator,
    chat: &ChatTemplate,
    plan: Plan,
    paths: &[PathBuf],
    options: Options,
) -> Result<()> {
    let Options {
        raw,
        text_only,
        quiet,
    } = options;
    let cases = cases(paths)?;
    let mut rows = Vec::with_capacity(cases.len());
    for (i, case) in cases.iter().enumerate() {
        if !quiet {
            eprintln!("[{}/{}] {}/{}", i + 1, cases.len(), case.group, case.name);
        }
        // The default, then each use of the model added to it.
        let mut variant = |extractive, attention_salience| -> Result<(Summary, f64)> {
            let started = Instant::now();
            let summary = Summarizer::new(
                generator,
                chat.clone(),
                Plan {
                    extractive,
                    attention_salience,
                    ..plan
                },
            )
            .summarize(&case.document, &mut Progress::new(true), false)?;
            Ok((summary, started.elapsed().as_secs_f64()))
        };
        let (ours, secs) = variant(true, false)?;
        let with_model = if text_only {
            None
        } else {
            Some((variant(true, true)?, variant(false, false)?))
        };
        let (attention, rewritten) = match &with_model {
            Some(((attention, _), (rewritten, _))) => (Some(attention), Some(rewritten)),
            None => (None, None),
        };
        let words = words_in(&ours.text);
        let score = |text: &str| case.facts.score(text, &case.document).recalled.len();
        let baseline_texts: Vec<String> = Baseline::ALL
            .iter()
            .map(|b| b.summarize(&case.document, words))
            .collect();
        let row = Row {
            name: case.name.clone(),
            group: case.group.clone(),
            tokens: ours.document_tokens,
            planted: case.facts.len(),
            ours: score(&ours.text),
            attention: attention.map(|s| score(&s.text)),
            rewritten: rewritten.map(|s| score(&s.text)),
            baselines: baseline_texts.iter().map(|t| score(t)).collect(),
            words,
            violations: [Some(&ours), attention, rewritten]
                .into_iter()
                .flatten()
                .map(|s| violations(&s.text, &case.document))
                .sum(),
            secs: [
                Some(secs),
                with_model.as_ref().map(|((_, secs), _)| *secs),
                with_model.as_ref().map(|(_, (_, secs))| *secs),
            ],
            // The model reads the document unless the language check says otherwise.
            not_read: !reads_as_english(&case.document) && plan.english_only,
            raw: json!({
                "document": case.name,
                "group": case.group,
                "ours": ours.text,
                "ours_missed": case.facts.score(&ours.text, &case.document).missed,
                "attention_salience": attention.map(|s| s.text.clone()),
                "rewritten": rewritten.map(|s| s.text.clone()),
                "baselines": Baseline::ALL.iter().zip(&baseline_texts)
                    .map(|(b, t)| json!({"name": b.name(), "summary": t, "words": words_in(t)}))
                    .collect::<Vec<_>>(),
            }),
        };
        if !quiet {
            eprintln!("{}", table_row(&row));
        }
        rows.push(row);
    }
    println!("{}", table(&rows));
    if let Some(raw) = raw {
        let all: Vec<_> = rows.iter().map(|row| row.raw.clone()).collect();
        std::fs::write(raw, serde_json::to_string_pretty(&all)?)
            .with_context(|| format!("cannot write {}", raw.display()))?;
    }
    Ok(())
}

/// A count, or a dash for a run left out.
fn count(value: Option<usize>) -> String {
    value.map_or("–".to_string(), |v| v.to_string())
}

fn table_row(row: &Row) -> String {
    let baselines: Vec<String> = row.baselines.iter().map(usize::to_string).collect();
    let secs: Vec<String> = row
        .secs
        .iter()
        .map(|s| s.map_or("–".to_string(), |s| format!("{s:.1}")))
        .collect();
    format!(
        "| {}{} | {} | {}/{} | {} | {} | {} | {} | {} | {} s |",
        row.name,
        if row.not_read {
            " (not read by the model)"
        } else {
            ""
        },
        row.tokens,
        row.ours,
        row.planted,
        count(row.attention),
        count(row.rewritten),
        baselines.join(" | "),
        row.words,
        row.violations,
        secs.join(" / ")
    )
}

/// The table: a row per document, then each group's mean recall, ours against the best
/// baseline's.
fn table(rows: &[Row]) -> String {
    let names: Vec<&str> = Baseline::ALL.iter().map(|b| b.name()).collect();
    let mut out = String::new();
    let mut groups: Vec<&str> = rows.iter().map(|r| r.group.as_str()).collect();
    groups.dedup();
    for group in groups {
        let rows: Vec<&Row> = rows.iter().filter(|r| r.group == group).collect();
        let _ = writeln!(out, "\n{group}\n");
        let _ = writeln!(
            out,
            "| document | tokens | ours | + attention salience | + model rewrites | {} | words | violations | time (ours / + attention / + rewrites) |",
            names.join(" | ")
        );
        let _ = writeln!(
            out,
            "|---|---|---|---|---|{}---|---|---|",
            "---|".repeat(names.len())
        );
        for row in &rows {
            let _ = writeln!(out, "{}", table_row(row));
        }
        let mean = |recalled: &dyn Fn(&Row) -> usize| {
            rows.iter()
                .map(|r| recalled(r) as f64 / r.planted.max(1) as f64)
                .sum::<f64>()
                / rows.len() as f64
        };
        // A run left out of any row has no mean.
        let model_mean = |recalled: &dyn Fn(&Row) -> Option<usize>| {
            if rows.iter().all(|r| recalled(r).is_some()) {
                format!("{:.2}", mean(&|r: &Row| recalled(r).unwrap_or(0)))
            } else {
                "–".to_string()
            }
        };
        let baseline_means: Vec<f64> = (0..names.len())
            .map(|b| mean(&|r: &Row| r.baselines[b]))
            .collect();
        let best = baseline_means.iter().copied().fold(0.0, f64::max);
        let ours = mean(&|r: &Row| r.ours);
        let _ = writeln!(
            out,
            "| mean recall | | {:.2} | {} | {} | {} | | {} | |",
            ours,
            model_mean(&|r: &Row| r.attention),
            model_mean(&|r: &Row| r.rewritten),
            baseline_means
                .iter()
                .map(|m| format!("{m:.2}"))
                .collect::<Vec<_>>()
                .join(" | "),
            rows.iter().map(|r| r.violations).sum::<usize>()
        );
        let _ = writeln!(
            out,
            "\n{group}: ours / best baseline mean recall = {:.2}; ours >= best baseline on {} of {} documents",
            if best > 0.0 { ours / best } else { f64::INFINITY },
            rows.iter()
                .filter(|r| r.baselines.iter().all(|&b| r.ours >= b))
                .count(),
            rows.len()
        );
    }
    out
}
