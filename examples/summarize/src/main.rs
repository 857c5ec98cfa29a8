//! Summarizes a text document with a local LLM: the default model is fetched on first use, and
//! documents longer than the model's context are summarized chunk by chunk (map-reduce).
//!
//! ```text
//! cargo run --release -p summarize -- examples/data/split-kv-decoding.md
//! ```
//!
//! Exit codes: 0 on success, 2 for bad input (document, model or options), 1 for other failures.

// These three are shared with the attention crate's examples (`lse_heatmap` reads the same
// default model).
mod attention_salience;
#[path = "../../common/bad_input.rs"]
mod bad_input;
mod cli;
#[path = "../../common/default_model.rs"]
mod default_model;
mod eval;
mod generation;
mod hub;
mod input;
#[path = "../../common/kv_dtype.rs"]
mod kv_dtype;
mod planted_facts;
mod progress;
mod stats;
mod summarizer;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::Result;
use candle_core::Device;
use candle_splitkv::models::llama::{AttentionBackend, Llama, LoadOptions};
use clap::Parser;
use summarize::ChatTemplate;

use bad_input::{bad_input, BadInput};
use cli::{Args, AttentionArg, Command, DeviceArg};
use generation::{Generator, SamplingSettings};
use planted_facts::PlantedFacts;
use progress::{DocumentBars, Progress};
use stats::RunInfo;
use summarizer::{Plan, Summarizer};

fn main() -> ExitCode {
    // candle attaches a backtrace to its errors when RUST_BACKTRACE is set; a user facing a bad
    // model file wants the one-line reason, not a stack. Panics still get their backtrace.
    if std::env::var_os("RUST_LIB_BACKTRACE").is_none() {
        std::env::set_var("RUST_LIB_BACKTRACE", "0");
    }
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            let bad_input = error.chain().any(|cause| cause.is::<BadInput>());
            eprintln!("error: {}", one_line(&error));
            ExitCode::from(if bad_input { 2 } else { 1 })
        }
    }
}

/// The error and its causes on one line, as messages from deep inside may span several.
fn one_line(error: &anyhow::Error) -> String {
    let text = format!("{error:#}");
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn run(args: &Args) -> Result<()> {
    let started = Instant::now();
    check_options(args)?;
    // The documents are checked first: a typo in a name should not wait for a model download.
    let paths = input::document_paths(&args.files)?;
    let documents = paths
        .iter()
        .map(|path| input::read_document(path))
        .collect::<Result<Vec<_>>>()?;
    if documents.len() > 1 {
        if args.facts.is_some() {
            bad_input!(
                "--facts scores one document; {} were given",
                documents.len()
            );
        }
        if args.speculate > 0 {
            bad_input!("--speculate applies to one document at a time; several are batched");
        }
    }
    let planted_facts = args.facts.as_deref().map(PlantedFacts::read).transpose()?;
    let device = select_device(args.device)?;
    let model_path = match (&args.model, &args.model_id) {
        (Some(path), _) if !path.exists() => bad_input!("model not found: {}", path.display()),
        (Some(path), _) => path.clone(),
        (None, Some(id)) => hub::fetch(
            id,
            args.revision.as_deref(),
            args.gguf_file.as_deref(),
            args.quiet,
        )?,
        (None, None) => default_model::default_model_path(args.quiet)?,
    };

    let mut progress = Progress::new(args.quiet);
    progress.set_step(format!("loading {}", file_name(&model_path)));
    let backend = match args.attention {
        AttentionArg::Splitkv => AttentionBackend::SplitKv,
        AttentionArg::Naive => AttentionBackend::Naive,
    };
    let options = LoadOptions {
        backend,
        dtype: args.dtype.map(|d| d.dtype()),
        cache_dtype: args.kv_dtype.map(|kv| kv.dtype()),
        weight_forms: args.weight_form.policy(),
        ..LoadOptions::default()
    };
    let loaded = match Llama::load_with(&model_path, &device, options) {
        Ok(loaded) => loaded,
        Err(e) => bad_input!("cannot load the model {}: {e}", model_path.display()),
    };
    let mut model = loaded.model;
    if device.is_cuda() {
        model.set_cuda_graph(args.cuda_graph)?;
    }
    let kv_dtype = kv_dtype::kv_dtype_name(model.cache_dtype());
    let token_text = |id: Option<u32>| {
        id.and_then(|id| loaded.tokenizer.id_to_token(id))
            .unwrap_or_default()
    };
    let chat = match ChatTemplate::new(
        loaded.chat_template.as_deref(),
        &token_text(loaded.bos_token_id),
        &token_text(loaded.eos_token_ids.first().copied()),
    ) {
        Ok(chat) => chat,
        Err(e) => bad_input!("cannot use the model {}: {e}", model_path.display()),
    };
    let mut stop_tokens = loaded.eos_token_ids.clone();
    stop_tokens.extend(loaded.tokenizer.token_to_id(chat.end_of_turn()));

    let settings = SamplingSettings {
        temperature: args.temperature,
        seed: args.seed,
        repeat_penalty: args.repeat_penalty,
        repeat_last_n: args.repeat_last_n,
        top_k: args.top_k,
        top_p: args.top_p,
        speculate: args.speculate,
    };
    let mut generator = Generator::new(&mut model, &loaded.tokenizer, stop_tokens, settings);
    let plan = Plan {
        chunk_tokens: args.chunk_tokens,
        max_new_tokens: args.max_new_tokens,
        select_tokens: (args.select_tokens > 0).then_some(args.select_tokens),
        reduce: args.reduce.reduce(),
        extractive: !args.rewrite,
        attention_salience: args.salience == cli::SalienceArg::Attention,
        english_only: args.model.is_none() && args.model_id.is_none(),
        batch: args.batch,
    };
    if documents.len() > 1 && !generator.can_batch() {
        bad_input!(
            "--kv-dtype fp8 works on one document at a time: several documents decode in \
             batches over a paged cache, which holds f32, f16 or bf16"
        );
    }
    if let Some(Command::Eval {
        paths,
        raw,
        text_only,
    }) = &args.command
    {
        progress.clear();
        return eval::run(
            &mut generator,
            &chat,
            plan,
            paths,
            eval::Options {
                raw: raw.as_deref(),
                text_only: *text_only,
                quiet: args.quiet,
            },
        );
    }
    let summarizer = Summarizer::new(&mut generator, chat, plan);
    let document = match documents.as_slice() {
        [document] => document,
        _ => {
            progress.clear();
            let names: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
            let many = Many {
                names: &names,
                documents: &documents,
                model: model_path.display().to_string(),
                device: device_name(&device),
                kv_dtype,
            };
            return many.summarize(summarizer, args, started);
        }
    };
    let summary = summarizer.summarize(document, &mut progress, !args.json)?;
    progress.clear();

    let info = RunInfo {
        model: model_path.display().to_string(),
        device: device_name(&device),
        attention: match backend {
            AttentionBackend::SplitKv => "splitkv",
            AttentionBackend::Naive => "naive",
        },
        kv_dtype,
        speculate: args.speculate,
        elapsed_secs: started.elapsed().as_secs_f64(),
        facts: planted_facts.map(|facts| facts.score(&summary.text, document)),
    };
    if args.json {
        println!("{}", stats::json_report(&summary, &info));
    }
    if !args.quiet {
        eprintln!("{}", stats::stats_line(&summary, &info));
    }
    Ok(())
}

/// A run over several documents.
struct Many<'a> {
    names: &'a [String],
    documents: &'a [String],
    model: String,
    device: String,
    kv_dtype: &'static str,
}

impl Many<'_> {
    /// Summarizes the documents together, printing each summary under its name as it is done,
    /// then the statistics: per document, and the aggregate rate of the batch.
    fn summarize(&self, summarizer: Summarizer, args: &Args, started: Instant) -> Result<()> {
        let bars = DocumentBars::new(args.quiet, self.names);
        let batch_start = Instant::now();
        let summaries = summarizer.summarize_many(self.documents, &bars, |i, summary| {
            if args.json {
                return Ok(());
            }
            bars.suspend(|| print_titled(&self.names[i], &summary.text))
        })?;
        let batch_secs = batch_start.elapsed().as_secs_f64();
        bars.clear();
        let info = RunInfo {
            model: self.model.clone(),
            device: self.device.clone(),
            attention: match args.attention {
                AttentionArg::Splitkv => "splitkv",
                AttentionArg::Naive => "naive",
            },
            kv_dtype: self.kv_dtype,
            speculate: 0,
            elapsed_secs: started.elapsed().as_secs_f64(),
            facts: None,
        };
        let aggregate = stats::Aggregate::of(&summaries, batch_secs);
        if args.json {
            let reports: Vec<_> = summaries
                .iter()
                .zip(self.names)
                .map(|(summary, name)| {
                    let mut report = stats::json_report(summary, &info);
                    report["document"] = name.as_str().into();
                    report
                })
                .collect();
            let all = serde_json::json!({ "documents": reports, "aggregate": aggregate.json() });
            println!("{all}");
        }
        if !args.quiet {
            for (summary, name) in summaries.iter().zip(self.names) {
                eprintln!("{name}: {}", stats::stats_line(summary, &info));
            }
            eprintln!("{}", aggregate.line(args.batch));
        }
        Ok(())
    }
}

/// Prints a document's summary under its name.
fn print_titled(name: &str, summary: &str) -> Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    writeln!(out, "## {name}\n\n{summary}\n")
        .and_then(|()| out.flush())
        .map_err(|e| anyhow::anyhow!("writing to stdout: {e}"))
}

/// Rejects option values that clap's types let through.
fn check_options(args: &Args) -> Result<()> {
    if !(args.temperature.is_finite() && args.temperature >= 0.0) {
        bad_input!("--temperature must be 0 or more, got {}", args.temperature);
    }
    if !(args.repeat_penalty.is_finite() && args.repeat_penalty > 0.0) {
        bad_input!(
            "--repeat-penalty must be above 0, got {}",
            args.repeat_penalty
        );
    }
    if args.max_new_tokens == 0 {
        bad_input!("--max-new-tokens must be at least 1");
    }
    if args.top_k == Some(0) {
        bad_input!("--top-k must be at least 1");
    }
    if let Some(p) = args.top_p {
        if !(p > 0.0 && p <= 1.0) {
            bad_input!("--top-p must be in (0, 1], got {p}");
        }
    }
    let truncated = args.top_k.is_some() || args.top_p.is_some();
    if truncated && args.temperature == 0.0 {
        bad_input!("--top-k and --top-p choose among sampled tokens; give a --temperature above 0");
    }
    // A verification pass holds the last token and the drafts.
    let most_drafts = candle_splitkv::MAX_QUERY_TOKENS - 1;
    if args.speculate > most_drafts {
        bad_input!(
            "--speculate must be at most {most_drafts} (0 turns it off), got {}",
            args.speculate
        );
    }
    if args.batch == 0 {
        bad_input!("--batch must be at least 1");
    }
    if args.chunk_tokens < 64 {
        bad_input!(
            "--chunk-tokens must be at least 64, got {}",
            args.chunk_tokens
        );
    }
    Ok(())
}

/// The requested device; by default the first GPU when the binary has CUDA and one is present.
fn select_device(requested: Option<DeviceArg>) -> Result<Device> {
    let device = pick_device(requested)?;
    #[cfg(feature = "cuda")]
    if let Device::Cuda(cuda) = &device {
        // SAFETY: the summarizer runs every op on candle's single stream, so cudarc's per-buffer
        // events (two per allocation, recorded at every launch) only cost host time.
        unsafe { cuda.disable_event_tracking() };
    }
    Ok(device)
}

fn pick_device(requested: Option<DeviceArg>) -> Result<Device> {
    match requested {
        Some(DeviceArg::Cpu) => Ok(Device::Cpu),
        Some(DeviceArg::Cuda) if !candle_core::utils::cuda_is_available() => bad_input!(
            "--device cuda: this binary was built without CUDA; rebuild with `--features cuda`"
        ),
        Some(DeviceArg::Cuda) => match Device::new_cuda(0) {
            Ok(device) => Ok(device),
            Err(e) => bad_input!("--device cuda: no usable GPU: {e}"),
        },
        None if candle_core::utils::cuda_is_available() => {
            Ok(Device::new_cuda(0).unwrap_or(Device::Cpu))
        }
        None => Ok(Device::Cpu),
    }
}

fn device_name(device: &Device) -> String {
    if device.is_cuda() {
        "cuda:0".to_string()
    } else if device.is_metal() {
        "metal".to_string()
    } else {
        "cpu".to_string()
    }
}

fn file_name(path: &std::path::Path) -> String {
    path.file_name()
        .map(PathBuf::from)
        .unwrap_or_else(|| path.to_path_buf())
        .display()
        .to_string()
}
