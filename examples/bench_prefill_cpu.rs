//! Times prefill attention on the CPU: t new tokens after `past` cached ones, causal, through the
//! split-KV op, through the attention layer's naive backend (the A/B reference: K/V repeated per
//! query head, the whole score matrix, mask and softmax), and through candle-nn's CPU flash
//! attention. One JSON line per point.
//!
//! ```text
//! cargo run --release --example bench_prefill_cpu
//! cargo run --release --example bench_prefill_cpu -- --heads 32:8:128 --t 512,2048 --past 0,4096
//! ```
//!
//! Each repetition runs every backend once, in turn, so that the ratios come from one run on a
//! noisy machine; the median of `--reps` repetitions is reported. The op and the naive backend
//! read the same head-major cache (the op through its strided views); candle-nn's kernel reads a
//! contiguous copy made outside the timing. TFLOP/s count the causal part only:
//! 4 · d · h_q · (the keys each query sees, summed).

use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::attention::AttnMask;
use candle_splitkv::{
    AttentionBackend, AttentionStep, CachedAttention, KvCache, KvCacheConfig, SplitKvAttention,
};
use clap::Parser;
use serde_json::json;

#[path = "common/timing.rs"]
mod timing;
use timing::median;

#[derive(Parser, Debug)]
#[command(about = "Benchmark prefill attention on the CPU")]
struct Args {
    /// Head configs as q_heads:kv_heads:head_dim (default 9:3:64, the default model's).
    #[arg(long, value_delimiter = ',', default_value = "9:3:64")]
    heads: Vec<String>,
    /// New tokens per sequence.
    #[arg(long, value_delimiter = ',', default_value = "512,2048,4096")]
    t: Vec<usize>,
    /// Cached tokens before them.
    #[arg(long, value_delimiter = ',', default_value = "0,2048")]
    past: Vec<usize>,
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Timed repetitions per point; the median is reported.
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Skip candle-nn's CPU flash attention (slow at long prompts).
    #[arg(long)]
    no_cpu_flash: bool,
    /// Print JSON lines only.
    #[arg(long)]
    json: bool,
}

fn parse_heads(spec: &str) -> Result<(usize, usize, usize)> {
    let parts = spec
        .split(':')
        .map(str::parse)
        .collect::<Result<Vec<usize>, _>>()
        .with_context(|| format!("bad --heads entry {spec:?}: want q_heads:kv_heads:head_dim"))?;
    match parts[..] {
        [hq, hk, d] if hk > 0 && hq % hk == 0 => Ok((hq, hk, d)),
        _ => bail!("bad --heads entry {spec:?}: want q_heads:kv_heads:head_dim, q_heads a multiple of kv_heads"),
    }
}

/// One point's inputs: the new tokens' q, k, v and a cache holding `past` random positions.
struct Point {
    b: usize,
    t: usize,
    past: usize,
    hq: usize,
    hk: usize,
    d: usize,
    q: Tensor,
    k_new: Tensor,
    v_new: Tensor,
    cache: KvCache,
    /// The whole sequence's K/V, contiguous `(b, past + t, hk, d)`, for candle-nn's kernel.
    k_seq: Tensor,
    v_seq: Tensor,
}

impl Point {
    fn new(b: usize, (hq, hk, d): (usize, usize, usize), t: usize, past: usize) -> Result<Self> {
        let dev = Device::Cpu;
        let random = |shape: (usize, usize, usize, usize)| Tensor::randn(0f32, 1.0, shape, &dev);
        let (k_past, v_past) = (random((b, past, hk, d))?, random((b, past, hk, d))?);
        let (k_new, v_new) = (random((b, t, hk, d))?, random((b, t, hk, d))?);
        let mut cache = KvCache::new(&KvCacheConfig {
            batch: b,
            kv_heads: hk,
            head_dim: d,
            initial_capacity: past + t,
            max_capacity: past + t,
            dtype: DType::F32,
            device: dev.clone(),
            k_scale: 1.0,
            v_scale: 1.0,
        })?;
        if past > 0 {
            cache.append(&k_past, &v_past)?;
        }
        let k_seq = Tensor::cat(&[&k_past, &k_new], 1)?;
        let v_seq = Tensor::cat(&[&v_past, &v_new], 1)?;
        Ok(Self {
            b,
            t,
            past,
            hq,
            hk,
            d,
            q: random((b, t, hq, d))?,
            k_new,
            v_new,
            cache,
            k_seq,
            v_seq,
        })
    }

    fn scale(&self) -> f32 {
        1.0 / (self.d as f32).sqrt()
    }

    /// 4 · d · h_q · (keys seen, summed over the batch's queries).
    fn causal_flops(&self) -> f64 {
        let (t, past) = (self.t as f64, self.past as f64);
        let seen = t * past + t * (t + 1.0) / 2.0;
        4.0 * (self.d * self.hq * self.b) as f64 * seen
    }

    /// The op over the cache's views after appending the new tokens.
    fn splitkv(&mut self) -> Result<Tensor> {
        self.cache.truncate(self.past);
        let (k, v) = self.cache.append(&self.k_new, &self.v_new)?;
        Ok(SplitKvAttention::new(self.scale()).forward(&self.q, &k, &v)?)
    }

    /// The attention layer's naive backend over the same cache.
    fn naive(&mut self) -> Result<Tensor> {
        self.cache.truncate(self.past);
        let attention = CachedAttention::new(self.scale()).with_backend(AttentionBackend::Naive);
        Ok(attention.forward(
            &self.q,
            &self.k_new,
            &self.v_new,
            AttentionStep::new(&mut self.cache),
        )?)
    }

    /// candle-nn's CPU flash attention over the contiguous sequence.
    fn cpu_flash(&self) -> Result<Tensor> {
        Ok(candle_nn::attention::flash_attn::<f32>(
            &self.q,
            &self.k_seq,
            &self.v_seq,
            self.scale(),
            AttnMask::causal_with_offset(self.past),
            None,
            None,
        )?)
    }
}

/// Seconds `f` takes.
fn seconds(f: impl FnOnce() -> Result<Tensor>) -> Result<f64> {
    let start = Instant::now();
    std::hint::black_box(f()?);
    Ok(start.elapsed().as_secs_f64())
}

fn report(args: &Args, p: &Point, backend: &str, secs: f64, extra: serde_json::Value) {
    let tflops = p.causal_flops() / secs / 1e12;
    let mut line = json!({
        "kind": "ours", "backend": backend, "device": "cpu", "dtype": "float32",
        "b": p.b, "t": p.t, "past": p.past, "L": p.past + p.t, "hq": p.hq, "hk": p.hk, "d": p.d,
        "ms": (secs * 1e5).round() / 100.0, "TFLOPs": (tflops * 1e4).round() / 1e4,
        "threads": rayon::current_num_threads(),
    });
    if let (Some(obj), Some(more)) = (line.as_object_mut(), extra.as_object()) {
        obj.extend(more.clone());
    }
    if args.json {
        println!("{line}");
    } else {
        println!(
            "{backend:>17} t={:<5} past={:<5} h={}/{} d={:<3} {:>10.2} ms {:>6.1} GFLOP/s  {extra}",
            p.t,
            p.past,
            p.hq,
            p.hk,
            p.d,
            secs * 1e3,
            tflops * 1e3
        );
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.reps == 0 {
        bail!("--reps must be at least 1");
    }
    for spec in &args.heads {
        let heads = parse_heads(spec)?;
        for &t in &args.t {
            for &past in &args.past {
                let mut p = Point::new(args.batch, heads, t, past)?;
                // Warm-up: page in the buffers and the thread pool.
                p.splitkv()?;
                p.naive()?;
                let (mut ours, mut naive, mut flash) = (Vec::new(), Vec::new(), Vec::new());
                for _ in 0..args.reps {
                    ours.push(seconds(|| p.splitkv())?);
                    naive.push(seconds(|| p.naive())?);
                    if !args.no_cpu_flash {
                        flash.push(seconds(|| p.cpu_flash())?);
                    }
                }
                let ours = median(ours);
                let naive = median(naive);
                let mut extra = json!({
                    "speedup_vs_naive": (naive / ours * 100.0).round() / 100.0,
                });
                if !flash.is_empty() {
                    let flash = median(flash.clone());
                    extra["speedup_vs_cpu_flash"] = json!((flash / ours * 100.0).round() / 100.0);
                }
                report(&args, &p, "splitkv_cpu", ours, extra);
                report(&args, &p, "naive", naive, json!({}));
                if !flash.is_empty() {
                    report(&args, &p, "candle_cpu_flash", median(flash), json!({}));
                }
            }
        }
    }
    Ok(())
}
