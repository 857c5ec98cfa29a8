//! A candle-transformers model's attention, switched from candle-flash-attn to this crate by one
//! `use`: the shapes come from candle-transformers' own configs (Llama 2 7B, Mistral 7B), the
//! calls are the ones its model files make (`(batch, heads, seq, head_dim)` tensors transposed to
//! `(batch, seq, heads, head_dim)`, `causal = seq_len > 1`), over a prompt and then decode steps
//! on a growing cache. Each call is checked against the models' own path without flash attention
//! (f32 scores, the causal mask, softmax, the product with V).
//!
//! ```sh
//! cargo run --release --example flash_attn_switch                      # CPU
//! cargo run --release --features cuda --example flash_attn_switch -- --cuda
//! ```

use std::time::Instant;

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor, D};
use clap::Parser;
// The one line a model changes: it called `candle_flash_attn::flash_attn` before.
use candle_splitkv::flash_attn as candle_flash_attn;
use candle_transformers::models::{llama, mistral};

#[derive(Parser)]
struct Args {
    /// Run on the first CUDA device (needs `--features cuda`).
    #[arg(long)]
    cuda: bool,
    /// Prompt tokens.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..))]
    prompt: u32,
    /// Decode steps after the prompt.
    #[arg(long, default_value_t = 4)]
    steps: usize,
}

/// One model's attention shape, as its candle-transformers config gives it.
struct Shape {
    name: &'static str,
    q_heads: usize,
    /// Heads of the k and v the model hands to flash attention: Llama repeats K/V to the query
    /// heads first, Mistral passes its grouped K/V.
    kv_heads: usize,
    head_dim: usize,
}

fn shapes() -> Vec<Shape> {
    let llama = llama::Config::config_7b_v2(true);
    let mistral = mistral::Config::config_7b_v0_1(true);
    let mistral_head_dim = mistral
        .head_dim
        .unwrap_or(mistral.hidden_size / mistral.num_attention_heads);
    vec![
        Shape {
            name: "llama-2-7b",
            q_heads: llama.num_attention_heads,
            kv_heads: llama.num_attention_heads,
            head_dim: llama.hidden_size / llama.num_attention_heads,
        },
        Shape {
            name: "mistral-7b-v0.1",
            q_heads: mistral.num_attention_heads,
            kv_heads: mistral.num_key_value_heads,
            head_dim: mistral_head_dim,
        },
    ]
}

/// The models' attention without flash attention, in f32: q `(b, h_q, t, d)`, k and v
/// `(b, h_kv, L, d)` with K/V repeated to the query heads, the last t positions causal.
fn reference(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
    let (b, h_q, t, d) = q.dims4()?;
    let (_, h_kv, l, _) = k.dims4()?;
    let repeat = |x: &Tensor| -> Result<Tensor> {
        Ok(x.unsqueeze(2)?
            .repeat((1, 1, h_q / h_kv, 1, 1))?
            .reshape((b, h_q, l, d))?)
    };
    let (q, k, v) = (
        q.to_dtype(DType::F32)?,
        repeat(&k.to_dtype(DType::F32)?)?,
        repeat(&v.to_dtype(DType::F32)?)?,
    );
    let scores = (q.matmul(&k.t()?)? * scale)?;
    // Query i sits at position l − t + i and sees the keys up to it.
    let mask: Vec<f32> = (0..t)
        .flat_map(|i| {
            (0..l).map(move |j| {
                if j > l - t + i {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
        })
        .collect();
    let mask = Tensor::from_vec(mask, (t, l), q.device())?;
    let probs = candle_nn::ops::softmax_last_dim(&scores.broadcast_add(&mask)?)?;
    Ok(probs.matmul(&v)?)
}

fn main() -> Result<()> {
    let args = Args::parse();
    let prompt = args.prompt as usize;
    let device = if args.cuda {
        Device::new_cuda(0)?
    } else {
        Device::Cpu
    };
    let dtype = if args.cuda { DType::BF16 } else { DType::F32 };
    let tolerance = if args.cuda { 2e-2 } else { 1e-4 };
    for shape in shapes() {
        let scale = 1.0 / (shape.head_dim as f64).sqrt();
        let random = |heads: usize, t: usize| -> Result<Tensor> {
            Ok(
                Tensor::randn(0f32, 1.0, (1, heads, t, shape.head_dim), &device)?
                    .to_dtype(dtype)?,
            )
        };
        // The prompt's K/V, then one position more each step, as the models' caches grow.
        let mut k = random(shape.kv_heads, prompt)?;
        let mut v = random(shape.kv_heads, prompt)?;
        for step in 0..=args.steps {
            let seq_len = if step == 0 { prompt } else { 1 };
            if step > 0 {
                k = Tensor::cat(&[&k, &random(shape.kv_heads, 1)?], 2)?;
                v = Tensor::cat(&[&v, &random(shape.kv_heads, 1)?], 2)?;
            }
            let q = random(shape.q_heads, seq_len)?;
            device.synchronize()?;
            let start = Instant::now();
            // As the model files call it: (b, seq, heads, head_dim) views, causal past one token.
            let y = candle_flash_attn::flash_attn(
                &q.transpose(1, 2)?,
                &k.transpose(1, 2)?,
                &v.transpose(1, 2)?,
                scale as f32,
                seq_len > 1,
            )?
            .transpose(1, 2)?;
            device.synchronize()?;
            let took = start.elapsed();
            let want = reference(&q, &k, &v, scale)?;
            let diff = (y.to_dtype(DType::F32)? - want)?
                .abs()?
                .flatten_all()?
                .max(D::Minus1)?
                .to_scalar::<f32>()?;
            println!(
                "{:<16} {} t = {seq_len:>4} over {:>4} keys: {:>8.3} ms, max |diff| vs the models' \
                 own attention {diff:.2e}",
                shape.name,
                if step == 0 { "prompt" } else { "decode" },
                k.dim(2)?,
                took.as_secs_f64() * 1e3,
            );
            ensure!(
                diff < tolerance,
                "{}: differs from the models' own attention by {diff}",
                shape.name
            );
        }
    }
    Ok(())
}
