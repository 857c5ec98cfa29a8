//! End-to-end decode benchmark: a Llama with random weights, its cache filled to context C with
//! random keys and values (timing decode is the point, not prefill), then ≥ 32 timed decode steps
//! after 4 warm-up steps, for:
//! - `splitkv`: our model, decode attention through the split-KV op (on CUDA with 16-bit
//!   weights, the projections run fused with their norms, activation and residual adds; on CUDA
//!   each step is one replayed CUDA graph);
//! - `splitkv_uncaptured`: the same with every step's kernels launched one by one (A/B);
//! - `splitkv_unfused`: the same as `splitkv` with candle's separate ops around the projections;
//! - `splitkv_qkv_chain`: the same as `splitkv` with the q/k/v projection, RoPE and the cache
//!   append as three launches instead of one kernel (A/B);
//! - `naive`: our model with candle's naive attention over the same cache;
//! - `candle_stock`: candle-transformers' Llama on the same weights, its cache filled by a
//!   chunked prefill (it has no other way in), up to `--stock-max-context`.
//!
//! With `--speculate K`, it also times a verification step: K drafted tokens and the one
//! before them through the model in one pass (`Llama::forward_all`), the cache rolled back after
//! each. At a synthetic acceptance rate A (each draft accepted independently with probability A,
//! as far as the first rejection), a step yields (1 − A^(K+1)) / (1 − A) tokens on average; the
//! `splitkv_speculative` line reports the tokens/s that gives, drafting taken as free (prompt
//! lookup costs no model pass), next to plain decoding.
//!
//! With `--batch B`, it also times batched decode steps (`Llama::forward_paged`): B sequences,
//! each filled to C with random keys and values in a paged cache of `--page-size` positions per
//! page, one token each per step, the weights read once for all of them; the `splitkv_paged`
//! line gives the step time and the aggregate tokens/s (B per step).
//!
//! With `--prefill T1,T2,…`, it times time to first token instead: a T-token prompt of token ids
//! spread over the vocabulary through the model's own prefill (`Llama::forward`, in chunks of
//! `--prefill-chunk` tokens, each attending over the chunks before it), after one warm-up
//! prefill. The `splitkv_prefill` line gives `ttft_ms`, and `attention_ms`: the same chunks'
//! attention alone (cache writes and attention calls of every layer, on random q/k/v of the
//! chunks' shapes), `rest_ms` the difference (projections, MLP, norms, RoPE, the head).
//!
//! Prints one JSON line per (context, backend):
//! `{"kind":"e2e","model":...,"kv_dtype":...,"context":C,"backend":...,"ms_per_token":...,...}`
//! with the attention share of the step time (our backends) and the bytes a step must read
//! (weights + KV), from which the bandwidth floor follows. `--kv-dtype` picks how our model's
//! cache stores K/V (fp8 halves bf16's bytes); the stock model's cache is always in `--dtype`.
//!
//! ```text
//! cargo run --release --features cuda --example bench_llama                 # Llama-3-8B shape, bf16
//! cargo run --release --example bench_llama -- --config small --cpu         # small model on the CPU
//! cargo run --release --features cuda --example bench_llama -- --contexts 8192 --batch 16
//! cargo run --release --features cuda --example bench_llama -- --prefill 8192,32768,131072
//! ```

use std::collections::HashMap;
use std::time::Instant;

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_splitkv::models::llama::{
    Llama, LlamaConfig, LoadOptions, RopeScaling, DEFAULT_PREFILL_CHUNK,
};
use candle_splitkv::{
    AttentionBackend, AttentionStep, CachedAttention, KvCache, PagedKvCache, SequenceId,
};
use candle_transformers::models::llama as stock;
use clap::{Parser, ValueEnum};

#[path = "common/kv_dtype.rs"]
mod kv_dtype;
use kv_dtype::{kv_dtype_name, KvDtypeArg};

const WARMUP_STEPS: usize = 4;
/// Positions past the largest context: room for the warm-up and timed steps.
const CONTEXT_MARGIN: usize = 256;
/// Keys/values written per append while filling the cache.
const FILL_CHUNK: usize = 4096;
/// Prompt tokens per stock forward call while filling its cache.
const STOCK_PREFILL_CHUNK: usize = 512;

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Preset {
    /// 32 layers, hidden 4096, 32/8 heads of 128, FFN 14336, vocab 128256.
    Llama3_8b,
    /// 8 layers, hidden 1024, 16/4 heads of 64, FFN 2816, vocab 32000: for the CPU.
    Small,
    /// SmolLM2-135M's shape (the summarizer's default model): 30 layers, hidden 576, 9/3 heads
    /// of 64, FFN 1536, vocab 49152. Its steps are bound by launches, not bytes.
    #[value(name = "smollm2-135m")]
    Smollm2_135m,
}

#[derive(Clone, Copy, Debug, PartialEq, ValueEnum)]
enum Backend {
    Splitkv,
    SplitkvUncaptured,
    SplitkvUnfused,
    SplitkvQkvChain,
    Naive,
    CandleStock,
}

#[derive(Parser)]
struct Args {
    #[arg(long, value_enum, default_value_t = Preset::Llama3_8b)]
    config: Preset,
    /// Keep only this many layers.
    #[arg(long)]
    layers: Option<usize>,
    /// Contexts to fill the cache to (default: 4096,32768,131072 for llama3-8b, 1024,4096 for small).
    #[arg(long, value_delimiter = ',')]
    contexts: Vec<usize>,
    /// Timed decode steps.
    #[arg(long, default_value_t = 32)]
    steps: usize,
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [Backend::Splitkv, Backend::Naive, Backend::CandleStock])]
    backends: Vec<Backend>,
    /// Largest context the stock model is run at (its cache concatenates on every step, and its
    /// prefill materialises chunk × context scores).
    #[arg(long, default_value_t = 32768)]
    stock_max_context: usize,
    /// Run on the CPU even when CUDA is available.
    #[arg(long)]
    cpu: bool,
    /// bf16, f16 or f32 (default: bf16 on CUDA, f32 on the CPU).
    #[arg(long)]
    dtype: Option<String>,
    /// How our model's KV cache stores keys and values (written as `kv_dtype` in each line):
    /// fp8 (e4m3, scale 1), bf16, f16 or f32. Default: `--dtype`.
    #[arg(long, value_enum, value_name = "DTYPE")]
    kv_dtype: Option<KvDtypeArg>,
    /// Drafted tokens per verification step to time (0: none). At most 15.
    #[arg(long, default_value_t = 0)]
    speculate: usize,
    /// The synthetic acceptance rate of each draft, in [0, 1], for `--speculate`.
    #[arg(long, default_value_t = 0.7)]
    acceptance: f64,
    /// Also time batched steps of this many sequences over a paged cache (comma-separated).
    #[arg(long, value_delimiter = ',')]
    batch: Vec<usize>,
    /// Positions per page of the batched steps' paged cache.
    #[arg(long, default_value_t = 16)]
    page_size: usize,
    /// Keep cudarc's per-buffer event tracking (two CUDA events per allocation, recorded at every
    /// launch). Everything here runs on candle's one stream, so by default it is turned off.
    #[arg(long)]
    event_tracking: bool,
    /// Prompt tokens per prefill chunk of our model (default: `DEFAULT_PREFILL_CHUNK`).
    #[arg(long)]
    prefill_chunk: Option<usize>,
    /// Time to first token instead of decode steps: a prompt of each of these lengths
    /// (comma-separated) through our model's own prefill, in chunks of `--prefill-chunk`.
    #[arg(long, value_delimiter = ',')]
    prefill: Vec<usize>,
    /// Timed prefills per prompt length, after one warm-up prefill.
    #[arg(long, default_value_t = 2)]
    prefill_runs: usize,
}

fn model_config(preset: Preset, layers: Option<usize>, max_context: usize) -> LlamaConfig {
    let (hidden, ffn, vocab, num_layers, heads, kv_heads, head_dim) = match preset {
        Preset::Llama3_8b => (4096, 14336, 128256, 32, 32, 8, 128),
        Preset::Small => (1024, 2816, 32000, 8, 16, 4, 64),
        Preset::Smollm2_135m => (576, 1536, 49152, 30, 9, 3, 64),
    };
    LlamaConfig {
        hidden_size: hidden,
        intermediate_size: ffn,
        vocab_size: vocab,
        num_hidden_layers: layers.unwrap_or(num_layers),
        num_attention_heads: heads,
        num_key_value_heads: kv_heads,
        head_dim,
        rms_norm_eps: 1e-5,
        rope_theta: 500_000.0,
        rope_scaling: Some(RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        }),
        max_position_embeddings: max_context + CONTEXT_MARGIN,
        ..LlamaConfig::default()
    }
}

fn stock_config(c: &LlamaConfig) -> stock::Config {
    stock::Config {
        hidden_size: c.hidden_size,
        intermediate_size: c.intermediate_size,
        vocab_size: c.vocab_size,
        num_hidden_layers: c.num_hidden_layers,
        num_attention_heads: c.num_attention_heads,
        num_key_value_heads: c.num_key_value_heads,
        use_flash_attn: false,
        rms_norm_eps: c.rms_norm_eps,
        rope_theta: c.rope_theta,
        bos_token_id: None,
        eos_token_id: None,
        rope_scaling: Some(stock::Llama3RopeConfig {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
            rope_type: stock::Llama3RopeType::Llama3,
        }),
        max_position_embeddings: c.max_position_embeddings,
        tie_word_embeddings: false,
    }
}

/// HF-named random weights, shared (not copied) by every model built from them.
fn random_weights(c: &LlamaConfig, dtype: DType, dev: &Device) -> Result<HashMap<String, Tensor>> {
    let mut w = HashMap::new();
    let mut add = |name: String, shape: (usize, usize)| -> Result<()> {
        let t = Tensor::randn(0f32, 0.02, shape, dev)?.to_dtype(dtype)?;
        w.insert(name, t);
        Ok(())
    };
    let (q, kv) = (
        c.num_attention_heads * c.head_dim,
        c.num_key_value_heads * c.head_dim,
    );
    let (h, f) = (c.hidden_size, c.intermediate_size);
    add("model.embed_tokens.weight".into(), (c.vocab_size, h))?;
    add("lm_head.weight".into(), (c.vocab_size, h))?;
    for l in 0..c.num_hidden_layers {
        let p = format!("model.layers.{l}");
        add(format!("{p}.self_attn.q_proj.weight"), (q, h))?;
        add(format!("{p}.self_attn.k_proj.weight"), (kv, h))?;
        add(format!("{p}.self_attn.v_proj.weight"), (kv, h))?;
        add(format!("{p}.self_attn.o_proj.weight"), (h, q))?;
        add(format!("{p}.mlp.gate_proj.weight"), (f, h))?;
        add(format!("{p}.mlp.up_proj.weight"), (f, h))?;
        add(format!("{p}.mlp.down_proj.weight"), (h, f))?;
    }
    let mut norms = vec!["model.norm.weight".to_string()];
    for l in 0..c.num_hidden_layers {
        norms.push(format!("model.layers.{l}.input_layernorm.weight"));
        norms.push(format!("model.layers.{l}.post_attention_layernorm.weight"));
    }
    for name in norms {
        w.insert(name, Tensor::ones(h, dtype, dev)?);
    }
    Ok(w)
}

/// Bytes one decode step of one sequence reads: every weight but the embedding table (one row
/// of it), plus K and V of every layer over the context, stored in `kv_dtype`.
fn bytes_per_step(
    c: &LlamaConfig,
    weights: &HashMap<String, Tensor>,
    context: usize,
    kv_dtype: DType,
) -> usize {
    batch_bytes_per_step(c, weights, context, kv_dtype, 1)
}

/// Bytes one decode step of `batch` sequences at `context` reads: the weights once, K and V of
/// each sequence.
fn batch_bytes_per_step(
    c: &LlamaConfig,
    weights: &HashMap<String, Tensor>,
    context: usize,
    kv_dtype: DType,
    batch: usize,
) -> usize {
    let weight_bytes: usize = weights
        .iter()
        .filter(|(name, _)| name.as_str() != "model.embed_tokens.weight")
        .map(|(_, t)| t.elem_count() * t.dtype().size_in_bytes())
        .sum();
    let kv_bytes = c.num_hidden_layers
        * 2
        * context
        * c.num_key_value_heads
        * c.head_dim
        * kv_dtype.size_in_bytes();
    weight_bytes + batch * kv_bytes
}

struct Report<'a> {
    model: &'a str,
    dtype: DType,
    /// How the K/V cache of the timed model stores keys and values.
    kv_dtype: DType,
    device: &'a str,
    context: usize,
    steps: usize,
    bytes: usize,
}

impl Report<'_> {
    /// The fields every line opens with, up to the backend's name.
    fn head(&self, backend: &str) -> String {
        format!(
            "\"kind\":\"e2e\",\"model\":\"{}\",\"dtype\":\"{:?}\",\"kv_dtype\":\"{}\",\
             \"device\":\"{}\",\"context\":{},\"backend\":\"{backend}\"",
            self.model,
            self.dtype,
            kv_dtype_name(self.kv_dtype),
            self.device,
            self.context
        )
    }

    fn line(&self, backend: &str, ms_per_token: f64, attention_ms: Option<f64>) {
        let attention = match attention_ms {
            Some(a) => format!(
                ",\"attention_ms_per_token\":{a:.3},\"attention_share\":{:.3}",
                a / ms_per_token
            ),
            None => String::new(),
        };
        println!(
            "{{{},\"steps\":{},\"ms_per_token\":{ms_per_token:.3},\"tokens_per_s\":{:.2},\
             \"bytes_per_token\":{}{attention}}}",
            self.head(backend),
            self.steps,
            1e3 / ms_per_token,
            self.bytes
        );
    }

    /// A verification step of `drafts + 1` tokens taking `verify_ms`, at `acceptance`, against
    /// a plain step of `plain_ms`.
    fn speculative_line(&self, drafts: usize, acceptance: f64, verify_ms: f64, plain_ms: f64) {
        let tokens = expected_tokens(drafts, acceptance);
        let ms_per_token = verify_ms / tokens;
        println!(
            "{{{},\"steps\":{},\"drafts\":{drafts},\"acceptance\":{acceptance},\
             \"tokens_per_step\":{tokens:.3},\"ms_per_step\":{verify_ms:.3},\
             \"step_vs_plain\":{:.3},\"ms_per_token\":{ms_per_token:.3},\"tokens_per_s\":{:.2},\
             \"speedup_vs_plain\":{:.3}}}",
            self.head("splitkv_speculative"),
            self.steps,
            verify_ms / plain_ms,
            1e3 / ms_per_token,
            plain_ms / ms_per_token
        );
    }

    /// Batched steps of `batch` sequences, reading `bytes` per step.
    fn batch_line(
        &self,
        label: &str,
        batch: usize,
        page_size: usize,
        t: &BatchTiming,
        bytes: usize,
    ) {
        println!(
            "{{{},\"batch\":{batch},\"page_size\":{page_size},\"steps\":{},\
             \"ms_per_step\":{:.3},\"tokens_per_s\":{:.2},\"bytes_per_step\":{bytes},\
             \"attention_ms_per_step\":{:.3},\"host_ms_per_step\":{:.3}}}",
            self.head(label),
            self.steps,
            t.step_ms,
            batch as f64 * 1e3 / t.step_ms,
            t.attention_ms,
            t.host_ms
        );
    }

    fn error(&self, backend: &str, error: &str) {
        let error = error
            .replace('\\', "\\\\")
            .replace('"', "'")
            .replace('\n', " ");
        println!("{{{},\"error\":\"{error}\"}}", self.head(backend));
    }
}

/// Tokens a verification step of `drafts` drafts yields on average when each draft is accepted
/// independently with probability `acceptance` up to the first rejection: the accepted drafts
/// plus the model's own next token, 1 + A + A² + … + A^drafts.
fn expected_tokens(drafts: usize, acceptance: f64) -> f64 {
    (0..=drafts).map(|i| acceptance.powi(i as i32)).sum()
}

/// Milliseconds per verification step of `drafts + 1` tokens at `context`, the cache rolled
/// back after each.
fn run_verify(model: &mut Llama, context: usize, drafts: usize, steps: usize) -> Result<f64> {
    let device = model.device().clone();
    let vocab = model.config().vocab_size as u32;
    model.set_backend(AttentionBackend::SplitKv);
    model.truncate(context);
    let ms = time_steps(&device, steps, |i| {
        let tokens: Vec<u32> = (0..=drafts)
            .map(|j| ((i + j) as u32 * 7919) % vocab)
            .collect();
        model.forward_all(&tokens)?;
        model.truncate(context);
        Ok(())
    })?;
    Ok(ms)
}

/// Fills every layer cache of `model` to `context` positions with random keys and values.
fn fill_cache(model: &mut Llama, context: usize) -> Result<()> {
    let (kv_heads, head_dim, dtype) = {
        let c = model.config();
        (c.num_key_value_heads, c.head_dim, model.dtype())
    };
    let device = model.device().clone();
    model.reset();
    for cache in model.caches_mut() {
        for start in (0..context).step_by(FILL_CHUNK) {
            let n = FILL_CHUNK.min(context - start);
            let k =
                Tensor::randn(0f32, 1.0, (1, n, kv_heads, head_dim), &device)?.to_dtype(dtype)?;
            let v =
                Tensor::randn(0f32, 1.0, (1, n, kv_heads, head_dim), &device)?.to_dtype(dtype)?;
            cache.append(&k, &v)?;
        }
    }
    Ok(())
}

/// What a batched step costs.
struct BatchTiming {
    step_ms: f64,
    /// The attention alone: every layer's writes and op call for the batch.
    attention_ms: f64,
    /// The host's time to enqueue one step, the device idle at its start: a step this long is
    /// bound by its launches.
    host_ms: f64,
}

/// Batched steps of `batch` sequences, each filled to `context` positions with random keys and
/// values in a paged cache of `page_size` positions per page.
fn run_batch(
    model: &Llama,
    context: usize,
    batch: usize,
    page_size: usize,
    steps: usize,
) -> Result<BatchTiming> {
    let c = model.config().clone();
    let device = model.device().clone();
    let positions = context + WARMUP_STEPS + steps;
    let mut cache: PagedKvCache =
        model.paged_cache(batch * positions.div_ceil(page_size), page_size)?;
    let kv_dtype = cache.config().dtype;
    let ids: Vec<SequenceId> = (0..batch).map(|_| cache.add_sequence()).collect();
    for &id in &ids {
        for start in (0..context).step_by(FILL_CHUNK) {
            let n = FILL_CHUNK.min(context - start);
            let shape = (1, n, c.num_key_value_heads, c.head_dim);
            let k = Tensor::randn(0f32, 1.0, shape, &device)?.to_dtype(kv_dtype)?;
            let v = Tensor::randn(0f32, 1.0, shape, &device)?.to_dtype(kv_dtype)?;
            let step = cache.begin_step(&[id], n)?;
            for layer in 0..c.num_hidden_layers {
                cache.write(layer, &step, &k, &v)?;
            }
        }
    }
    let vocab = c.vocab_size as u32;
    let tokens = |i: usize| -> Vec<u32> {
        (0..batch)
            .map(|s| ((i * batch + s) as u32 * 7919) % vocab)
            .collect()
    };
    let step_ms = time_steps(&device, steps, |i| {
        model.forward_paged(&mut cache, &ids, &tokens(i))?;
        Ok(())
    })?;
    for &id in &ids {
        cache.truncate(id, context)?;
    }
    let mut host_secs = 0.0;
    for i in 0..steps {
        device.synchronize()?;
        let start = Instant::now();
        model.forward_paged(&mut cache, &ids, &tokens(i))?;
        host_secs += start.elapsed().as_secs_f64();
    }
    for &id in &ids {
        cache.truncate(id, context)?;
    }
    let attention = CachedAttention::new(1.0 / (c.head_dim as f32).sqrt());
    let q = Tensor::randn(
        0f32,
        1.0,
        (batch, 1, c.num_attention_heads, c.head_dim),
        &device,
    )?
    .to_dtype(model.dtype())?;
    let kv = Tensor::randn(
        0f32,
        1.0,
        (batch, 1, c.num_key_value_heads, c.head_dim),
        &device,
    )?
    .to_dtype(kv_dtype)?;
    let step = cache.begin_step(&ids, 1)?;
    let attention_ms = time_steps(&device, steps, |_| {
        for layer in 0..c.num_hidden_layers {
            attention.forward(&q, &kv, &kv, AttentionStep::paged(&cache, layer, &step))?;
        }
        Ok(())
    })?;
    Ok(BatchTiming {
        step_ms,
        attention_ms,
        host_ms: host_secs * 1e3 / steps as f64,
    })
}

/// What a prefill of a prompt costs.
struct PrefillTiming {
    /// The whole prefill, to the last token's logits: time to first token.
    total_ms: f64,
    /// The attention alone: every layer's cache writes and attention calls over every chunk.
    attention_ms: f64,
}

/// A prompt of `len` token ids spread over the vocabulary (a fixed stride through it, so that
/// neighbouring tokens differ as text's do).
fn prompt(len: usize, vocab: usize) -> Vec<u32> {
    (0..len).map(|i| ((i * 7919 + 17) % vocab) as u32).collect()
}

/// Time to first token of a `len`-token prompt through `model.forward` (its chunked prefill),
/// then the attention of that prefill alone: the same chunks' q/k/v shapes through
/// `CachedAttention` for every layer, over a cache that grows chunk by chunk. Projections, norms
/// and the rest take the difference.
fn run_prefill(model: &mut Llama, len: usize, runs: usize) -> Result<PrefillTiming> {
    let device = model.device().clone();
    let c = model.config().clone();
    let tokens = prompt(len, c.vocab_size);
    model.set_backend(AttentionBackend::SplitKv);
    model.reset();
    model.forward(&tokens)?;
    let mut total = 0.0;
    for _ in 0..runs {
        model.reset();
        device.synchronize()?;
        let start = Instant::now();
        model.forward(&tokens)?;
        device.synchronize()?;
        total += start.elapsed().as_secs_f64();
    }
    model.reset();

    let chunk = model.prefill_chunk();
    let mut cache = KvCache::new(&model.caches_mut()[0].config())?;
    let attention = CachedAttention::new(1.0 / (c.head_dim as f32).sqrt());
    let random = |n: usize, heads: usize| {
        Tensor::randn(0f32, 1.0, (1, n, heads, c.head_dim), &device)?.to_dtype(model.dtype())
    };
    let mut attention_secs = 0.0;
    for start in (0..len).step_by(chunk) {
        let n = chunk.min(len - start);
        let (q, kv) = (
            random(n, c.num_attention_heads)?,
            random(n, c.num_key_value_heads)?,
        );
        device.synchronize()?;
        let timer = Instant::now();
        for _ in 0..runs {
            for _ in 0..c.num_hidden_layers {
                cache.truncate(start);
                attention.forward(&q, &kv, &kv, AttentionStep::new(&mut cache))?;
            }
        }
        device.synchronize()?;
        attention_secs += timer.elapsed().as_secs_f64();
    }
    Ok(PrefillTiming {
        total_ms: total * 1e3 / runs as f64,
        attention_ms: attention_secs * 1e3 / runs as f64,
    })
}

/// Mean milliseconds per call of `step(i)` over `steps` calls after the warm-up.
fn time_steps(
    device: &Device,
    steps: usize,
    mut step: impl FnMut(usize) -> Result<()>,
) -> Result<f64> {
    for i in 0..WARMUP_STEPS {
        step(i)?;
    }
    device.synchronize()?;
    let start = Instant::now();
    for i in 0..steps {
        step(WARMUP_STEPS + i)?;
    }
    device.synchronize()?;
    Ok(start.elapsed().as_secs_f64() * 1e3 / steps as f64)
}

/// Our model: decode steps, then the attention alone (append + attention per layer) over the
/// same cache, for the share.
fn run_ours(
    model: &mut Llama,
    backend: AttentionBackend,
    context: usize,
    steps: usize,
) -> Result<(f64, f64)> {
    let device = model.device().clone();
    let vocab = model.config().vocab_size as u32;
    model.set_backend(backend);
    model
        .caches_mut()
        .iter_mut()
        .for_each(|c| c.truncate(context));
    let step_ms = time_steps(&device, steps, |i| {
        model.forward(&[(i as u32 * 7919) % vocab])?;
        Ok(())
    })?;
    model
        .caches_mut()
        .iter_mut()
        .for_each(|c| c.truncate(context));

    let c = model.config().clone();
    let attention = CachedAttention::new(1.0 / (c.head_dim as f32).sqrt()).with_backend(backend);
    let dtype = model.dtype();
    let q = Tensor::randn(
        0f32,
        1.0,
        (1, 1, c.num_attention_heads, c.head_dim),
        &device,
    )?
    .to_dtype(dtype)?;
    let kv = Tensor::randn(
        0f32,
        1.0,
        (1, 1, c.num_key_value_heads, c.head_dim),
        &device,
    )?
    .to_dtype(dtype)?;
    let attention_ms = time_steps(&device, steps, |_| {
        for cache in model.caches_mut() {
            attention.forward(&q, &kv, &kv, AttentionStep::new(cache))?;
            cache.truncate(context);
        }
        Ok(())
    })?;
    Ok((step_ms, attention_ms))
}

fn run_stock(
    weights: &HashMap<String, Tensor>,
    config: &LlamaConfig,
    dtype: DType,
    device: &Device,
    context: usize,
    steps: usize,
) -> Result<f64> {
    let config = stock_config(config);
    let vb = VarBuilder::from_tensors(weights.clone(), dtype, device);
    let model = stock::Llama::load(vb, &config)?;
    let mut cache = stock::Cache::new(true, dtype, &config, device)?;
    let vocab = config.vocab_size as u32;
    for start in (0..context).step_by(STOCK_PREFILL_CHUNK) {
        let n = STOCK_PREFILL_CHUNK.min(context - start);
        let tokens: Vec<u32> = (start..start + n)
            .map(|i| (i as u32 * 7919) % vocab)
            .collect();
        let input = Tensor::new(tokens.as_slice(), device)?.unsqueeze(0)?;
        model.forward(&input, start, &mut cache)?;
    }
    time_steps(device, steps, |i| {
        let input = Tensor::new(&[(i as u32 * 7919) % vocab], device)?.unsqueeze(0)?;
        model.forward(&input, context + i, &mut cache)?;
        Ok(())
    })
}

fn main() -> Result<()> {
    let args = Args::parse();
    let device = if args.cpu {
        Device::Cpu
    } else {
        Device::cuda_if_available(0)?
    };
    #[cfg(feature = "cuda")]
    if let (Device::Cuda(cuda), false) = (&device, args.event_tracking) {
        // SAFETY: every tensor of this program lives and is used on candle's single stream.
        unsafe { cuda.disable_event_tracking() };
    }
    let dtype = match args.dtype.as_deref() {
        None if device.is_cpu() => DType::F32,
        None | Some("bf16") => DType::BF16,
        Some("f16") => DType::F16,
        Some("f32") => DType::F32,
        Some(other) => bail!("unknown dtype {other}; use bf16, f16 or f32"),
    };
    let kv_dtype = args.kv_dtype.map_or(dtype, KvDtypeArg::dtype);
    let contexts = if args.contexts.is_empty() {
        match args.config {
            Preset::Llama3_8b => vec![4096, 32768, 131072],
            Preset::Small | Preset::Smollm2_135m => vec![1024, 4096],
        }
    } else {
        args.contexts.clone()
    };
    if args.steps == 0 {
        bail!("--steps must be at least 1")
    }
    if args.speculate >= candle_splitkv::MAX_QUERY_TOKENS {
        bail!(
            "--speculate {}: a verification step holds at most {} tokens, so at most {} drafts",
            args.speculate,
            candle_splitkv::MAX_QUERY_TOKENS,
            candle_splitkv::MAX_QUERY_TOKENS - 1
        )
    }
    if args.batch.contains(&0) || args.page_size == 0 {
        bail!("--batch sizes and --page-size must be at least 1")
    }
    if !(0.0..=1.0).contains(&args.acceptance) {
        bail!("--acceptance {} must lie in [0, 1]", args.acceptance)
    }
    let max_context = contexts
        .iter()
        .chain(&args.prefill)
        .copied()
        .max()
        .unwrap_or(0);
    let config = model_config(args.config, args.layers, max_context);
    let model_name = format!(
        "{}-shape-{}-layers",
        match args.config {
            Preset::Llama3_8b => "llama3-8b",
            Preset::Small => "small",
            Preset::Smollm2_135m => "smollm2-135m-shape",
        },
        config.num_hidden_layers
    );
    let device_name = if device.is_cpu() { "cpu" } else { "cuda" };
    eprintln!(
        "building random {model_name} weights ({dtype:?}, K/V {}, {device_name})",
        kv_dtype_name(kv_dtype)
    );
    let weights = random_weights(&config, dtype, &device)?;
    let prefill_chunk = args.prefill_chunk.unwrap_or(DEFAULT_PREFILL_CHUNK);

    if !args.prefill.is_empty() {
        if args.prefill.contains(&0) || args.prefill_runs == 0 {
            bail!("--prefill lengths and --prefill-runs must be at least 1")
        }
        let vb = VarBuilder::from_tensors(weights.clone(), dtype, &device);
        let options = LoadOptions {
            initial_cache_capacity: max_context + CONTEXT_MARGIN,
            cache_dtype: Some(kv_dtype),
            prefill_chunk,
            ..LoadOptions::default()
        };
        let mut model = Llama::from_var_builder(vb, config.clone(), dtype, options)?;
        for &len in &args.prefill {
            let report = Report {
                model: &model_name,
                dtype,
                kv_dtype,
                device: device_name,
                context: len,
                steps: args.prefill_runs,
                bytes: 0,
            };
            match run_prefill(&mut model, len, args.prefill_runs) {
                Ok(t) => println!(
                    "{{{},\"prefill_chunk\":{prefill_chunk},\"runs\":{},\"ttft_ms\":{:.3},\
                     \"tokens_per_s\":{:.1},\"attention_ms\":{:.3},\"rest_ms\":{:.3}}}",
                    report.head("splitkv_prefill"),
                    args.prefill_runs,
                    t.total_ms,
                    len as f64 * 1e3 / t.total_ms,
                    t.attention_ms,
                    t.total_ms - t.attention_ms
                ),
                Err(e) => report.error("splitkv_prefill", &e.to_string()),
            }
        }
        return Ok(());
    }

    for &context in &contexts {
        let report = Report {
            model: &model_name,
            dtype,
            kv_dtype,
            device: device_name,
            context,
            steps: args.steps,
            bytes: bytes_per_step(&config, &weights, context, kv_dtype),
        };
        // The stock model caches K/V in the activation dtype.
        let stock_report = Report {
            kv_dtype: dtype,
            bytes: bytes_per_step(&config, &weights, context, dtype),
            ..report
        };
        let ours_wanted = args.backends.iter().any(|b| *b != Backend::CandleStock);
        if ours_wanted {
            let vb = VarBuilder::from_tensors(weights.clone(), dtype, &device);
            let options = LoadOptions {
                initial_cache_capacity: context + CONTEXT_MARGIN,
                cache_dtype: Some(kv_dtype),
                prefill_chunk,
                ..LoadOptions::default()
            };
            let mut model = Llama::from_var_builder(vb, config.clone(), dtype, options)?;
            fill_cache(&mut model, context)?;
            for &backend in &args.backends {
                let (ours, fused, label) = match backend {
                    Backend::Splitkv => (AttentionBackend::SplitKv, true, "splitkv"),
                    Backend::SplitkvUncaptured => {
                        (AttentionBackend::SplitKv, true, "splitkv_uncaptured")
                    }
                    Backend::SplitkvUnfused => {
                        (AttentionBackend::SplitKv, false, "splitkv_unfused")
                    }
                    Backend::SplitkvQkvChain => {
                        (AttentionBackend::SplitKv, true, "splitkv_qkv_chain")
                    }
                    Backend::Naive => (AttentionBackend::Naive, true, "naive"),
                    Backend::CandleStock => continue,
                };
                candle_splitkv::test_hooks::unfuse_qkv_append(backend == Backend::SplitkvQkvChain);
                model.set_fused_decode(fused);
                model.set_cuda_graph(device.is_cuda() && backend != Backend::SplitkvUncaptured)?;
                let plain_ms = match run_ours(&mut model, ours, context, args.steps) {
                    Ok((ms, attention_ms)) => {
                        report.line(label, ms, Some(attention_ms));
                        ms
                    }
                    Err(e) => {
                        report.error(label, &e.to_string());
                        continue;
                    }
                };
                if backend == Backend::Splitkv && args.speculate > 0 {
                    match run_verify(&mut model, context, args.speculate, args.steps) {
                        Ok(verify_ms) => report.speculative_line(
                            args.speculate,
                            args.acceptance,
                            verify_ms,
                            plain_ms,
                        ),
                        Err(e) => report.error("splitkv_speculative", &e.to_string()),
                    }
                }
            }
            candle_splitkv::test_hooks::unfuse_qkv_append(false);
            model.set_backend(AttentionBackend::SplitKv);
            // The fused projections, and candle's ops where `splitkv-unfused` asks for an A/B.
            let unfused_too = args.backends.contains(&Backend::SplitkvUnfused);
            for (fused, label) in [(true, "splitkv_paged"), (false, "splitkv_paged_unfused")] {
                if !fused && !unfused_too {
                    continue;
                }
                model.set_fused_decode(fused);
                for &batch in &args.batch {
                    let bytes = batch_bytes_per_step(&config, &weights, context, kv_dtype, batch);
                    match run_batch(&model, context, batch, args.page_size, args.steps) {
                        Ok(timing) => {
                            report.batch_line(label, batch, args.page_size, &timing, bytes)
                        }
                        Err(e) => report.error(label, &e.to_string()),
                    }
                }
            }
            model.set_fused_decode(true);
        }
        if args.backends.contains(&Backend::CandleStock) {
            if context > args.stock_max_context {
                stock_report.error(
                    "candle_stock",
                    &format!(
                        "skipped: context above --stock-max-context {}",
                        args.stock_max_context
                    ),
                );
            } else {
                match run_stock(&weights, &config, dtype, &device, context, args.steps) {
                    Ok(ms) => stock_report.line("candle_stock", ms, None),
                    Err(e) => stock_report.error("candle_stock", &e.to_string()),
                }
            }
        }
    }
    Ok(())
}
