//! The summarizer at its default settings, on the CPU, keeps the facts of a long document: on
//! `examples/data/tidal-barrier-review.md` (a fictional report of about 14,700 tokens) it recalls
//! at least half of the facts planted in it (`tidal-barrier-review.facts.json`: names, figures,
//! dates), states no number or name the report does not contain, and finishes within 3 minutes.
//!
//! The test runs the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) from
//! `$CANDLE_SPLITKV_CACHE`, else `~/.cache/candle-splitkv`, and is skipped with a notice when it
//! is not there (`scripts/fetch-model.sh` fetches it).

use std::process::Command;

use serde_json::Value;

use crate::common;

/// The time the summary may take, model loading included.
const TIME_LIMIT_SECS: f64 = 180.0;

fn data(name: &str) -> String {
    common::data(name)
        .to_str()
        .expect("the repository path is UTF-8")
        .to_string()
}

fn strings(value: &Value) -> Vec<&str> {
    value
        .as_array()
        .map(|items| items.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

#[test]
fn default_summary_keeps_the_planted_facts_and_invents_none() {
    let Some(model) = common::cached_default_model() else {
        return;
    };
    // Alone, so that the time taken is the summary's own.
    let _one_at_a_time = common::one_model_run_at_a_time();
    let cache = model.parent().expect("the model is a file in its cache");
    let output = Command::new(common::binary())
        .arg(data("tidal-barrier-review.md"))
        .args(["--facts", &data("tidal-barrier-review.facts.json")])
        .args(["--device", "cpu", "--json", "--quiet"])
        .env("CANDLE_SPLITKV_CACHE", cache)
        .output()
        .expect("the summarize binary starts");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "exit {:?}: {stderr}",
        output.status.code()
    );
    let report: Value = serde_json::from_slice(&output.stdout).unwrap_or_else(|e| {
        panic!(
            "not one JSON object ({e}): {}",
            String::from_utf8_lossy(&output.stdout)
        )
    });
    let summary = report["summary"].as_str().unwrap_or_default();
    let facts = &report["facts"];
    let planted = facts["planted"].as_u64().unwrap_or(0) as usize;
    let recalled = strings(&facts["recalled"]);
    let invented = strings(&facts["invented"]);
    let elapsed = report["stats"]["elapsed_seconds"]
        .as_f64()
        .unwrap_or(f64::NAN);
    eprintln!(
        "{} of {planted} facts recalled, {} invented, {elapsed:.1} s\nsummary: {summary}",
        recalled.len(),
        invented.len()
    );

    assert_eq!(planted, 15, "{report}");
    assert!(
        2 * recalled.len() >= planted,
        "recalled {} of {planted} planted facts: {recalled:?}\nsummary: {summary}",
        recalled.len()
    );
    assert!(
        invented.is_empty(),
        "the summary states numbers or names the document does not: {invented:?}\nsummary: \
         {summary}"
    );
    assert!(
        elapsed <= TIME_LIMIT_SECS,
        "the summary took {elapsed:.1} s, more than {TIME_LIMIT_SECS} s"
    );
}
