//! Prefill and decode throughput of a GGUF or HF model of any family the decoder loads (Llama,
//! Mistral, Phi-3, Qwen2, Qwen3, Gemma-2), ours (split-KV and naive attention) and optionally
//! candle-transformers' `quantized_llama` (llama GGUFs), in one run.
//!
//! For each context C: prefill a C-token prompt (timed), then 4 warm-up and `--steps` timed
//! decode steps. Prints one JSON line per (backend, context).
//!
//! With `--batch B`, also B sequences at context C in a paged cache (`Llama::forward_paged`):
//! each prompt prefilled alone (they differ, so no page is shared), then batched greedy steps of
//! one token per sequence; the `splitkv_paged` line gives the aggregate tokens/s.
//!
//! ```text
//! cargo run --release --example model_throughput -- --model model.gguf --contexts 2500,4096 --stock
//! cargo run --release --example model_throughput -- --model model.gguf --contexts 512 --batch 4
//! ```

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Result};
use candle_core::quantized::gguf_file;
use candle_core::{DType, Device, Tensor};
use candle_splitkv::models::llama::{
    Llama, LoadOptions, WeightForm, WeightFormPolicy, DEFAULT_PREFILL_CHUNK,
};
use candle_splitkv::AttentionBackend;
use candle_splitkv::SequenceId;
use candle_transformers::models::quantized_llama::{ModelWeights, MAX_SEQ_LEN};
use clap::Parser;

const WARMUP_STEPS: usize = 4;

#[derive(Parser)]
struct Args {
    /// A GGUF file or an HF model directory.
    #[arg(long)]
    model: PathBuf,
    /// Prompt lengths to prefill, then decode after.
    #[arg(long, value_delimiter = ',', default_values_t = [2500usize, 4096])]
    contexts: Vec<usize>,
    /// Timed decode steps per context.
    #[arg(long, default_value_t = 32)]
    steps: usize,
    /// Also time the naive attention backend.
    #[arg(long)]
    naive: bool,
    /// Also time candle-transformers' quantized_llama (GGUF only, contexts up to 4096).
    #[arg(long)]
    stock: bool,
    /// KV cache dtype: f32, f16, bf16 or fp8 (e4m3, scale 1) (default: the model's choice).
    #[arg(long)]
    cache_dtype: Option<String>,
    /// Also decode this many sequences at once over a paged cache (sizes, comma-separated).
    #[arg(long, value_delimiter = ',')]
    batch: Vec<usize>,
    /// Positions per page of the paged cache.
    #[arg(long, default_value_t = 16)]
    page_size: usize,
    /// Prompt tokens per prefill chunk (default: the model's, `DEFAULT_PREFILL_CHUNK`).
    #[arg(long)]
    prefill_chunk: Option<usize>,
    /// GGUF weight forms: `measure` (the default, timed at load), or the decode form fixed
    /// (`stored-rows`, `q8-rows`, `as-stored`, `q8`, `dense`) with the prompt's form measured.
    #[arg(long, default_value = "measure")]
    weight_form: String,
    /// Instead of timing: the mean log-likelihood of the first `--loglik-tokens` tokens of this
    /// text file, each token's logits from a one-token decode step (the decode weight form).
    #[arg(long)]
    loglik: Option<PathBuf>,
    #[arg(long, default_value_t = 2048)]
    loglik_tokens: usize,
    /// Instead of timing: 16 greedy tokens after each of the default-model test prompts
    /// (`tests/cpu/batched_llama.rs`), with the gap between the two largest logits at each pick
    /// and the runner-up token.
    #[arg(long)]
    greedy: bool,
}

/// Mean natural-log likelihood of `tokens[1..]`, each predicted by a one-token step.
fn mean_log_likelihood(model: &mut Llama, tokens: &[u32]) -> Result<f64> {
    model.reset();
    let mut total = 0.0;
    let mut logits = model.forward(&tokens[..1])?;
    for &next in &tokens[1..] {
        let row = logits.to_vec1::<f32>()?;
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
        let sum: f64 = row.iter().map(|&v| (v as f64 - max).exp()).sum();
        total += row[next as usize] as f64 - max - sum.ln();
        logits = model.forward(&[next])?;
    }
    Ok(total / (tokens.len() - 1) as f64)
}

/// `steps` greedy tokens after `prompt`, each with the gap between its logit and the next
/// largest and the token that had it.
fn greedy_with_gaps(
    model: &mut Llama,
    prompt: &[u32],
    steps: usize,
) -> Result<Vec<(u32, f32, u32)>> {
    model.reset();
    let mut logits = model.forward(prompt)?;
    let mut out = Vec::with_capacity(steps);
    for _ in 0..steps {
        let row = logits.to_vec1::<f32>()?;
        let mut order: Vec<usize> = (0..row.len()).collect();
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
        let next = order[0] as u32;
        out.push((next, row[order[0]] - row[order[1]], order[1] as u32));
        logits = model.forward(&[next])?;
    }
    Ok(out)
}

/// A deterministic prompt of `len` tokens: an English passage, repeated, starting `offset`
/// tokens into it (so that prompts of a batch differ).
fn prompt_tokens(tokenizer: &tokenizers::Tokenizer, len: usize, offset: usize) -> Result<Vec<u32>> {
    let passage = "The river rose slowly through the spring, and the people of the valley moved \
        their animals to the high meadows, where the grass was thin but the ground was dry. \
        Each evening the elders met to measure the water against the old stone marks. ";
    let ids = tokenizer
        .encode(passage, false)
        .map_err(anyhow::Error::msg)?
        .get_ids()
        .to_vec();
    if ids.is_empty() {
        bail!("the tokenizer produced no tokens")
    }
    Ok(ids.iter().copied().cycle().skip(offset).take(len).collect())
}

fn argmax(logits: &Tensor) -> Result<u32> {
    Ok(logits.flatten_all()?.argmax(0)?.to_scalar::<u32>()?)
}

struct Timing {
    prefill_s: f64,
    decode_ms_per_token: f64,
}

/// Prefills `prompt`, then greedy-decodes, timing both; `forward(tokens, position)` returns the
/// logits of the last token.
fn time_run(
    prompt: &[u32],
    steps: usize,
    mut forward: impl FnMut(&[u32], usize) -> Result<Tensor>,
) -> Result<Timing> {
    let start = Instant::now();
    let mut logits = forward(prompt, 0)?;
    let prefill_s = start.elapsed().as_secs_f64();
    let mut timed = 0.0;
    for i in 0..WARMUP_STEPS + steps {
        let position = prompt.len() + i;
        let next = argmax(&logits)?;
        let start = Instant::now();
        logits = forward(&[next], position)?;
        if i >= WARMUP_STEPS {
            timed += start.elapsed().as_secs_f64();
        }
    }
    Ok(Timing {
        prefill_s,
        decode_ms_per_token: timed * 1e3 / steps as f64,
    })
}

/// `batch` sequences at `context`: each prompt prefilled alone into a paged cache (timed
/// together), then greedy steps of one token per sequence in one pass each.
fn time_batch(
    model: &Llama,
    tokenizer: &tokenizers::Tokenizer,
    context: usize,
    batch: usize,
    page_size: usize,
    steps: usize,
) -> Result<Timing> {
    let positions = context + WARMUP_STEPS + steps;
    let mut cache = model.paged_cache(batch * positions.div_ceil(page_size), page_size)?;
    let start = Instant::now();
    let mut ids: Vec<SequenceId> = Vec::with_capacity(batch);
    let mut next: Vec<u32> = Vec::with_capacity(batch);
    for s in 0..batch {
        let id = cache.add_sequence();
        let logits =
            model.forward_paged(&mut cache, &[id], &prompt_tokens(tokenizer, context, s)?)?;
        ids.push(id);
        next.push(argmax(&logits)?);
    }
    let prefill_s = start.elapsed().as_secs_f64();
    let mut timed = 0.0;
    for i in 0..WARMUP_STEPS + steps {
        let start = Instant::now();
        let logits = model.forward_paged(&mut cache, &ids, &next)?;
        if i >= WARMUP_STEPS {
            timed += start.elapsed().as_secs_f64();
        }
        next = logits.argmax(1)?.to_vec1::<u32>()?;
    }
    Ok(Timing {
        prefill_s,
        decode_ms_per_token: timed * 1e3 / (steps * batch) as f64,
    })
}

fn report(model: &str, backend: &str, context: usize, t: &Timing) {
    println!(
        "{{\"kind\":\"cpu_throughput\",\"model\":\"{model}\",\"backend\":\"{backend}\",\
         \"context\":{context},\"prefill_s\":{:.2},\"prefill_tokens_per_s\":{:.1},\
         \"ms_per_token\":{:.2},\"decode_tokens_per_s\":{:.1}}}",
        t.prefill_s,
        context as f64 / t.prefill_s,
        t.decode_ms_per_token,
        1e3 / t.decode_ms_per_token
    );
}

fn main() -> Result<()> {
    let args = Args::parse();
    let device = Device::Cpu;
    let name = args
        .model
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let start = Instant::now();
    let cache_dtype = match args.cache_dtype.as_deref() {
        None => None,
        Some("f32") => Some(DType::F32),
        Some("f16") => Some(DType::F16),
        Some("bf16") => Some(DType::BF16),
        Some("fp8") => Some(DType::F8E4M3),
        Some(other) => bail!("unknown cache dtype {other}; use f32, f16, bf16 or fp8"),
    };
    let weight_forms = match args.weight_form.as_str() {
        "measure" => WeightFormPolicy::Measure,
        "stored-rows" => WeightFormPolicy::FixedDecode(WeightForm::StoredRows),
        "q8-rows" => WeightFormPolicy::FixedDecode(WeightForm::Q8_0Rows),
        "as-stored" => WeightFormPolicy::FixedDecode(WeightForm::AsStored),
        "q8" => WeightFormPolicy::FixedDecode(WeightForm::Q8_0),
        "dense" => WeightFormPolicy::FixedDecode(WeightForm::DenseF32),
        other => bail!(
            "unknown weight form {other}; use measure, stored-rows, q8-rows, as-stored, q8 or \
             dense"
        ),
    };
    let options = LoadOptions {
        weight_forms,
        cache_dtype,
        prefill_chunk: args.prefill_chunk.unwrap_or(DEFAULT_PREFILL_CHUNK),
        ..LoadOptions::default()
    };
    let loaded = Llama::load_with(&args.model, &device, options)?;
    eprintln!("loaded in {:.1} s", start.elapsed().as_secs_f64());
    for choice in loaded.model.weight_choices() {
        eprintln!("  {choice}");
    }
    let mut model = loaded.model;
    if let Some(path) = &args.loglik {
        let text = std::fs::read_to_string(path)?;
        let ids = loaded
            .tokenizer
            .encode(text, false)
            .map_err(anyhow::Error::msg)?
            .get_ids()
            .to_vec();
        let tokens = &ids[..ids.len().min(args.loglik_tokens)];
        if tokens.len() < 2 {
            bail!("{} has fewer than 2 tokens", path.display())
        }
        let mean = mean_log_likelihood(&mut model, tokens)?;
        println!(
            "{{\"kind\":\"loglik\",\"weight_form\":\"{}\",\"tokens\":{},\"mean_log_likelihood\":{mean:.6}}}",
            args.weight_form,
            tokens.len()
        );
        return Ok(());
    }
    if args.greedy {
        for text in [
            "The tidal barrier was finished in",
            "Paris is the capital of France, and its river is called the",
            "Rust is a programming language that",
            "Once upon a time, in a small village by the sea, there lived an old fisherman who",
        ] {
            let prompt = loaded
                .tokenizer
                .encode(text, false)
                .map_err(anyhow::Error::msg)?
                .get_ids()
                .to_vec();
            let picks = greedy_with_gaps(&mut model, &prompt, 16)?;
            let tokens: Vec<u32> = picks.iter().map(|p| p.0).collect();
            let gaps: Vec<String> = picks.iter().map(|p| format!("{:.3}", p.1)).collect();
            let runners_up: Vec<u32> = picks.iter().map(|p| p.2).collect();
            let decoded = loaded
                .tokenizer
                .decode(&tokens, true)
                .map_err(anyhow::Error::msg)?;
            println!(
                "{{\"kind\":\"greedy\",\"weight_form\":\"{}\",\"prompt\":{:?},\"tokens\":{tokens:?},\"gaps\":[{}],\"runners_up\":{runners_up:?},\"text\":{:?}}}",
                args.weight_form,
                text,
                gaps.join(","),
                decoded
            );
        }
        return Ok(());
    }
    if args.batch.contains(&0) || args.page_size == 0 {
        bail!("--batch sizes and --page-size must be at least 1")
    }
    let mut backends = vec![AttentionBackend::SplitKv];
    if args.naive {
        backends.push(AttentionBackend::Naive);
    }
    for &context in &args.contexts {
        if context + WARMUP_STEPS + args.steps > model.context_length() {
            bail!(
                "context {context} plus {} decode steps exceeds the model's {}",
                WARMUP_STEPS + args.steps,
                model.context_length()
            )
        }
        let prompt = prompt_tokens(&loaded.tokenizer, context, 0)?;
        for &backend in &backends {
            model.set_backend(backend);
            model.reset();
            let timing = time_run(&prompt, args.steps, |tokens, _| Ok(model.forward(tokens)?))?;
            let label = match backend {
                AttentionBackend::SplitKv => "splitkv",
                AttentionBackend::Naive => "naive",
            };
            report(&name, label, context, &timing);
        }
        model.set_backend(AttentionBackend::SplitKv);
        for &batch in &args.batch {
            let timing = time_batch(
                &model,
                &loaded.tokenizer,
                context,
                batch,
                args.page_size,
                args.steps,
            )?;
            // Prefill rate and ms per token are over all the batch's tokens.
            let timing = Timing {
                prefill_s: timing.prefill_s / batch as f64,
                ..timing
            };
            report(&name, &format!("splitkv_paged_b{batch}"), context, &timing);
        }
        if args.stock {
            if context + WARMUP_STEPS + args.steps > MAX_SEQ_LEN {
                eprintln!(
                    "stock quantized_llama: context {context} is past its {MAX_SEQ_LEN} limit"
                );
                continue;
            }
            let mut file = std::fs::File::open(&args.model)?;
            let content = gguf_file::Content::read(&mut file)?;
            let mut stock = ModelWeights::from_gguf(content, &mut file, &device)?;
            let timing = time_run(&prompt, args.steps, |tokens, position| {
                let input = Tensor::new(tokens, &device)?.unsqueeze(0)?;
                Ok(stock.forward(&input, position)?)
            })?;
            report(&name, "candle_stock", context, &timing);
        }
    }
    Ok(())
}
