//! Runs the `summarize` binary as a user would: bad inputs must fail cleanly with exit code 2, and
//! real documents must be summarized by the default model (fetched on first use).

use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::Value;

use crate::common;

const SHORT_DOCUMENT: &str = "\
The town library will stay open until ten in the evening on weekdays from next month. The \
change follows a survey in which students said they had nowhere quiet to study after school. \
To pay for the extra hours, the library will close its small branch near the station, whose \
visitor numbers have fallen for five years in a row. Staff from that branch will move to the \
main building, and no jobs will be lost.";

fn binary() -> PathBuf {
    common::binary()
}

fn sample_document() -> PathBuf {
    common::data("split-kv-decoding.md")
}

fn summarize(args: &[&str]) -> Output {
    Command::new(binary())
        .args(args)
        .output()
        .expect("the summarize binary starts")
}

/// [`summarize_ok_as`] with the model rewriting, as the tests of generation need.
fn summarize_ok(args: &[&str]) -> (String, String) {
    summarize_ok_as(&[args, &["--rewrite"]].concat())
}

/// Runs the summarizer with one weight form, asserts that it succeeded, and returns its stdout
/// and stderr. The form is fixed because the measured choice depends on the machine's load, and
/// the forms round differently enough to change a greedy summary (and what of it is grounded).
fn summarize_ok_as(args: &[&str]) -> (String, String) {
    let output = summarize(&[args, &["--weight-form", "q8-0"]].concat());
    let (stdout, stderr) = (text(&output.stdout), text(&output.stderr));
    assert!(
        output.status.success(),
        "exit {:?}: {stderr}",
        output.status.code()
    );
    (stdout, stderr)
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A scratch directory for input files, unique to this test.
fn scratch_dir(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("summarize-cli-{}-{test}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Asserts exit code 2 and a single-line error naming the problem, with no panic or backtrace.
fn assert_rejected(args: &[&str], expected: &str) {
    let output = summarize(args);
    let stderr = text(&output.stderr);
    assert_eq!(
        output.status.code(),
        Some(2),
        "{args:?}: stderr was {stderr:?}"
    );
    assert!(
        output.stdout.is_empty(),
        "{args:?}: printed {:?}",
        text(&output.stdout)
    );
    assert_eq!(
        stderr.lines().count(),
        1,
        "{args:?}: expected one line, got {stderr:?}"
    );
    assert!(stderr.starts_with("error: "), "{args:?}: {stderr:?}");
    assert!(
        stderr.contains(expected),
        "{args:?}: {stderr:?} lacks {expected:?}"
    );
    assert!(!stderr.contains("panicked"), "{args:?}: {stderr:?}");
}

#[test]
fn bad_documents_exit_2_with_a_one_line_reason() {
    let dir = scratch_dir("documents");
    let write = |name: &str, bytes: &[u8]| {
        let path = dir.join(name);
        std::fs::write(&path, bytes).unwrap();
        path.to_str().unwrap().to_string()
    };
    let missing = dir.join("missing.txt").to_str().unwrap().to_string();
    let empty = write("empty.txt", b"");
    let blank = write("blank.txt", b"  \n\t\r\n   \n");
    let with_nul = write("nul.txt", b"looks like text\0but is not");
    let not_utf8: Vec<u8> = (0..2000u32).map(|i| 0x80 + (i * 7 % 0x7f) as u8).collect();
    let not_utf8 = write("latin.bin", &not_utf8);
    let no_documents = dir.join("no-documents");
    std::fs::create_dir_all(&no_documents).unwrap();
    let no_documents = no_documents.to_str().unwrap().to_string();

    // A model is never needed to reject these, so they fail fast even on a machine without one.
    assert_rejected(&[&missing], "no such file");
    assert_rejected(&[&no_documents], "holds no .md or .txt document");
    assert_rejected(&["-", &empty], "can only be the one document");
    // Each document is checked before any model is loaded.
    assert_rejected(&[&missing, &empty], "no such file");
    assert_rejected(&[&empty], "is empty");
    assert_rejected(&[&blank], "is empty");
    assert_rejected(&[&with_nul], "NUL bytes");
    assert_rejected(&[&not_utf8], "not valid UTF-8");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_models_and_options_exit_2_with_a_one_line_reason() {
    let dir = scratch_dir("models");
    let document = dir.join("doc.txt");
    std::fs::write(&document, SHORT_DOCUMENT).unwrap();
    let garbage = dir.join("garbage.gguf");
    std::fs::write(
        &garbage,
        b"this is not a GGUF file, just some text pretending",
    )
    .unwrap();
    let document = document.to_str().unwrap();

    let missing_model = dir.join("nowhere.gguf");
    assert_rejected(
        &[document, "--model", missing_model.to_str().unwrap()],
        "model not found",
    );
    assert_rejected(
        &[
            document,
            "--model",
            garbage.to_str().unwrap(),
            "--device",
            "cpu",
        ],
        "cannot load the model",
    );
    assert_rejected(&[document, "--temperature", "-1"], "--temperature");
    assert_rejected(&[document, "--chunk-tokens", "10"], "--chunk-tokens");
    assert_rejected(&[document, "--max-new-tokens", "0"], "--max-new-tokens");
    assert_rejected(&[document, "--speculate", "16"], "--speculate");
    assert_rejected(
        &[document, "--temperature", "0.7", "--top-k", "0"],
        "--top-k",
    );
    assert_rejected(
        &[document, "--temperature", "0.7", "--top-p", "1.5"],
        "--top-p",
    );
    assert_rejected(&[document, "--top-k", "40"], "give a --temperature above 0");

    // Fact lists are read before the model loads.
    let facts = dir.join("facts.json");
    let missing_facts = dir.join("no-facts.json");
    assert_rejected(
        &[document, "--facts", missing_facts.to_str().unwrap()],
        "cannot read the fact list",
    );
    for (json, expected) in [
        ("[1, 2]", "has no \"facts\" array"),
        ("{\"facts\": []}", "lists no facts"),
        (
            "{\"facts\": [{\"fact\": \"x\", \"forms\": []}]}",
            "fact 1 needs",
        ),
        ("{\"facts\": [{\"fact\": \"x\"", "is not JSON"),
    ] {
        std::fs::write(&facts, json).unwrap();
        assert_rejected(&[document, "--facts", facts.to_str().unwrap()], expected);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn short_document_streams_a_summary_and_a_stats_line() {
    let _one_at_a_time = common::one_model_run_at_a_time();
    let dir = scratch_dir("short");
    let document = dir.join("library.txt");
    std::fs::write(&document, SHORT_DOCUMENT).unwrap();

    let (stdout, stderr) = summarize_ok(&[document.to_str().unwrap()]);
    assert!(
        stdout.split_whitespace().count() >= 5,
        "expected a summary of a few words, got {stdout:?}"
    );
    let stats = stderr.lines().last().unwrap_or_default();
    assert!(stats.contains(" 1 chunk |"), "{stats:?}");
    assert!(
        stats.contains("decode ") && stats.contains("tok/s"),
        "{stats:?}"
    );
    assert!(stats.contains("attention splitkv"), "{stats:?}");
    // The GGUF model runs in f32 and its cache follows unless --kv-dtype says otherwise.
    assert!(stats.contains("| kv float32 |"), "{stats:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn several_documents_are_summarized_together() {
    let _one_at_a_time = common::one_model_run_at_a_time();
    let dir = scratch_dir("several");
    std::fs::write(dir.join("a-library.txt"), SHORT_DOCUMENT).unwrap();
    let second = "The harbour ferry will run every twenty minutes in the summer, twice as often \
        as now. The council bought two more boats after queues at the pier grew to an hour on \
        sunny weekends. Tickets will cost the same, and the first crossing will leave at six.";
    std::fs::write(dir.join("b-ferry.md"), second).unwrap();
    std::fs::write(dir.join("notes.json"), "{}").unwrap();
    let folder = dir.to_str().unwrap();

    let facts = sample_document().with_extension("facts.json");
    assert_rejected(
        &[folder, "--facts", facts.to_str().unwrap()],
        "--facts scores one document",
    );
    assert_rejected(&[folder, "--speculate", "2"], "one document at a time");
    assert_rejected(&[folder, "--batch", "0"], "--batch must be at least 1");
    assert_rejected(&[folder, "--kv-dtype", "fp8"], "one document at a time");

    let (stdout, stderr) = summarize_ok(&[folder]);
    // Both documents of the folder (not the JSON file), each under its name with a summary.
    for name in ["a-library.txt", "b-ferry.md"] {
        let title = stdout
            .lines()
            .position(|line| line.starts_with("## ") && line.ends_with(name))
            .unwrap_or_else(|| panic!("no title for {name} in {stdout:?}"));
        let summary = stdout.lines().nth(title + 2).unwrap_or_default();
        assert!(
            summary.split_whitespace().count() >= 5,
            "{name}: expected a summary, got {summary:?}"
        );
    }
    assert!(!stdout.contains("notes.json"), "{stdout:?}");
    let aggregate = stderr.lines().last().unwrap_or_default();
    assert!(
        aggregate.starts_with("2 documents, 2 answers, up to 8 at once")
            && aggregate.contains("tok/s written"),
        "{aggregate:?}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn fp8_kv_cache_summarizes_and_reports_its_dtype() {
    let _one_at_a_time = common::one_model_run_at_a_time();
    let dir = scratch_dir("fp8");
    let document = dir.join("library.txt");
    std::fs::write(&document, SHORT_DOCUMENT).unwrap();
    // Where the rewrite contract leaves nothing of the model's answer, the summary is the
    // text's own sentences: there is always one.
    let output = summarize(&[
        document.to_str().unwrap(),
        "--json",
        "--kv-dtype",
        "fp8",
        "--rewrite",
    ]);
    let stderr = text(&output.stderr);
    assert!(
        output.status.success(),
        "exit {:?}: {stderr}",
        output.status.code()
    );
    let report: Value = serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", text(&output.stdout)));
    assert_eq!(report["stats"]["kv_dtype"], "float8_e4m3fn", "{report}");
    assert!(
        report["summary"]
            .as_str()
            .is_some_and(|s| s.split_whitespace().count() >= 5),
        "{report}"
    );
    let stats_line = stderr.lines().last().unwrap_or_default();
    assert!(
        stats_line.contains("| kv float8_e4m3fn |"),
        "{stats_line:?}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn speculation_keeps_the_greedy_summary() {
    let _one_at_a_time = common::one_model_run_at_a_time();
    let dir = scratch_dir("speculate");
    let document = dir.join("library.txt");
    std::fs::write(&document, SHORT_DOCUMENT).unwrap();
    // One weight form for both runs: the measured choice can differ between two processes on a
    // busy machine, and the forms round differently.
    let run = |speculate: &str| {
        let output = summarize(&[
            document.to_str().unwrap(),
            "--json",
            "--weight-form",
            "q8-0",
            "--speculate",
            speculate,
            "--rewrite",
        ]);
        let stderr = text(&output.stderr);
        assert!(
            output.status.success(),
            "--speculate {speculate}: exit {:?}: {stderr}",
            output.status.code()
        );
        let report: Value = serde_json::from_slice(&output.stdout)
            .unwrap_or_else(|e| panic!("--speculate {speculate}: not JSON ({e})"));
        let stats_line = stderr.lines().last().unwrap_or_default().to_string();
        (report, stats_line)
    };
    let (plain, plain_line) = run("0");
    let (speculated, speculated_line) = run("4");
    // Greedy by default: drafting changes how many passes, not what is said.
    assert_eq!(plain["summary"], speculated["summary"]);
    assert!(plain["summary"].as_str().is_some_and(|s| !s.is_empty()));

    let (plain, speculated) = (&plain["stats"], &speculated["stats"]);
    assert_eq!(plain["speculate"], 0, "{plain}");
    assert_eq!(plain["verify_passes"], 0, "{plain}");
    assert!(!plain_line.contains("speculate"), "{plain_line:?}");
    assert_eq!(speculated["speculate"], 4, "{speculated}");
    let drafted = speculated["drafted_tokens"].as_u64().unwrap();
    let accepted = speculated["accepted_tokens"].as_u64().unwrap();
    assert!(accepted <= drafted, "{speculated}");
    assert!(
        speculated["verify_passes"].as_u64().unwrap() > 0,
        "{speculated}"
    );
    let rate = speculated["acceptance_rate"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&rate), "{speculated}");
    assert!(
        speculated_line.contains("| speculate 4, acceptance "),
        "{speculated_line:?}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn by_default_a_long_document_is_summarized_by_its_own_sentences() {
    let _one_at_a_time = common::one_model_run_at_a_time();
    let document = sample_document();
    let output = summarize(&[document.to_str().unwrap(), "--json", "--quiet"]);
    let stderr = text(&output.stderr);
    assert!(
        output.status.success(),
        "exit {:?}: {stderr}",
        output.status.code()
    );
    let report: Value = serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", text(&output.stdout)));
    let stats = &report["stats"];
    assert_eq!(stats["generations"], 0, "{stats}");
    let line = summarize(&[document.to_str().unwrap(), "--weight-form", "q8-0"]);
    let line = text(&line.stderr);
    let line = line.lines().last().unwrap_or_default();
    assert!(line.contains("extractive: whole sentences"), "{line:?}");
    assert!(!line.contains("tok/s"), "no generation, no rates: {line:?}");
    assert!(
        stats["extractive"]
            .as_str()
            .is_some_and(|why| why.contains("--rewrite")),
        "{stats}"
    );
    // Whole sentences of the document, each as it stands there (its lines joined).
    let source = std::fs::read_to_string(&document).unwrap();
    let source = source.split_whitespace().collect::<Vec<_>>().join(" ");
    let summary = report["summary"].as_str().expect("a summary string");
    let sentences: Vec<&str> = summary.split(". ").collect();
    assert!(sentences.len() >= 3, "summary: {summary:?}");
    for sentence in sentences {
        assert!(
            source.contains(sentence.trim_end_matches('.')),
            "not in the document: {sentence:?}"
        );
    }
}

#[test]
fn attention_salience_reads_the_document_and_picks_its_sentences() {
    let _one_at_a_time = common::one_model_run_at_a_time();
    let dir = scratch_dir("attention");
    let document = dir.join("library.txt");
    std::fs::write(&document, SHORT_DOCUMENT).unwrap();
    let (stdout, _) = summarize_ok_as(&[
        document.to_str().unwrap(),
        "--json",
        "--salience",
        "attention",
    ]);
    let report: Value =
        serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}"));
    let stats = &report["stats"];
    assert!(
        stats["attention_salience_seconds"]
            .as_f64()
            .is_some_and(|s| s > 0.0),
        "{stats}"
    );
    assert_eq!(stats["generations"], 0, "{stats}");
    let summary = report["summary"].as_str().expect("a summary string");
    assert!(summary.split_whitespace().count() >= 5, "{summary:?}");
    for sentence in summary.split(". ") {
        assert!(
            SHORT_DOCUMENT.contains(sentence.trim_end_matches('.')),
            "not in the document: {sentence:?}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn long_document_is_summarized_in_several_chunks() {
    let _one_at_a_time = common::one_model_run_at_a_time();
    let output = summarize(&[
        sample_document().to_str().unwrap(),
        "--json",
        "--quiet",
        "--rewrite",
    ]);
    let stderr = text(&output.stderr);
    assert!(
        output.status.success(),
        "exit {:?}: {stderr}",
        output.status.code()
    );
    assert!(stderr.is_empty(), "--quiet printed {stderr:?}");

    let report: Value = serde_json::from_slice(&output.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is not one JSON object ({e}): {}",
            text(&output.stdout)
        )
    });
    let summary = report["summary"].as_str().expect("a summary string");
    assert!(
        summary.split_whitespace().count() >= 5,
        "summary: {summary:?}"
    );
    let stats = &report["stats"];
    // The sample is longer than SmolLM2's 8192-token window; its most salient sentences are
    // summarized, up to 1024 of its tokens (a paragraph break between two sentences may add
    // one).
    assert!(stats["document_tokens"].as_u64().unwrap() > 8192, "{stats}");
    let selected = stats["selected_tokens"].as_u64().unwrap();
    assert!((512..=1024 + 128).contains(&selected), "{stats}");
    assert!(stats["chunks"].as_u64().unwrap() >= 2, "{stats}");
    // One generation per chunk; the summary is the most salient sentences, as rewritten.
    assert!(
        stats["generations"].as_u64().unwrap() >= stats["chunks"].as_u64().unwrap(),
        "{stats}"
    );
    assert!(stats["dropped_sentences"].is_u64(), "{stats}");
    assert!(
        stats["decode_tokens_per_second"].as_f64().unwrap() > 0.0,
        "{stats}"
    );
}

/// A default model in the cache whose digest is not the pinned one is removed, never loaded: the
/// summarizer exits 2 with a one-line reason.
#[test]
fn a_corrupted_default_model_is_removed_and_refused() {
    let dir = scratch_dir("corrupted");
    let document = dir.join("doc.txt");
    std::fs::write(&document, SHORT_DOCUMENT).unwrap();
    let cache = dir.join("cache");
    std::fs::create_dir_all(&cache).unwrap();
    let model = cache.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    std::fs::write(&model, b"GGUF, but cut short").unwrap();
    let output = Command::new(binary())
        .args([document.to_str().unwrap(), "--device", "cpu"])
        .env("CANDLE_SPLITKV_CACHE", &cache)
        .output()
        .expect("the summarize binary starts");
    let stderr = text(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "stderr was {stderr:?}");
    assert_eq!(stderr.lines().count(), 1, "stderr was {stderr:?}");
    assert!(stderr.contains("corrupted or truncated"), "{stderr}");
    assert!(!model.exists(), "the corrupted model was left in the cache");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--model-id` fetches through the Hugging Face hub client; where the hub cannot be reached (here
/// an endpoint that refuses connections) the run fails with one line that says so.
#[test]
fn an_unreachable_hub_is_one_clear_line() {
    let dir = scratch_dir("hub");
    let document = dir.join("doc.txt");
    std::fs::write(&document, SHORT_DOCUMENT).unwrap();
    let output = Command::new(binary())
        .args([document.to_str().unwrap(), "--device", "cpu"])
        .args(["--model-id", "Qwen/Qwen2.5-0.5B-Instruct", "--quiet"])
        .env("HF_HOME", dir.join("hf"))
        .env("HF_ENDPOINT", "http://127.0.0.1:9")
        .output()
        .expect("the summarize binary starts");
    let stderr = text(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "stderr was {stderr:?}");
    assert_eq!(stderr.lines().count(), 1, "stderr was {stderr:?}");
    assert!(stderr.contains("Hugging Face hub"), "{stderr}");
    assert!(stderr.contains("no network access"), "{stderr}");
    // --revision and --gguf-file belong to --model-id.
    let output = summarize(&[document.to_str().unwrap(), "--revision", "main"]);
    assert_eq!(output.status.code(), Some(2));
    std::fs::remove_dir_all(&dir).unwrap();
}
