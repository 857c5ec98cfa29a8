//! The attention LSE of a model reading a document, as a PNG heatmap, for debugging attention.
//!
//! The document is read as one prompt, then the model decodes greedily; at every decode step
//! each layer's split-KV attention returns, per query head, the natural-log sum of its
//! exponentiated scores (LSE). The map has one column per step and one row per (layer, head),
//! layers separated by a line; colour runs from dark (low LSE) to bright yellow (high), over the
//! range of the whole map. NaN and ±inf cells are green. docs/models.md ("Debugging attention:
//! the LSE heatmap") shows what a healthy map looks like.
//!
//! ```text
//! cargo run --release --example lse_heatmap -- examples/data/split-kv-decoding.md --out lse.png
//! ```

#[path = "common/bad_input.rs"]
mod bad_input;
#[path = "common/default_model.rs"]
mod default_model;

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_splitkv::models::llama::Llama;
use candle_splitkv::AttentionBackend;
use clap::Parser;
use image::{Rgb, RgbImage};

#[derive(Parser)]
struct Args {
    /// The text file to read.
    document: PathBuf,
    /// A GGUF file or HF model directory (default: the summarizer's default model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Decode steps, one column each.
    #[arg(long, default_value_t = 64)]
    steps: usize,
    /// Prompt tokens at most (the document is cut there).
    #[arg(long, default_value_t = 4096)]
    max_prompt_tokens: usize,
    /// The PNG to write.
    #[arg(long, default_value = "lse.png")]
    out: PathBuf,
    /// Run on the CPU even when CUDA is available.
    #[arg(long)]
    cpu: bool,
}

/// Pixels per cell.
const CELL_WIDTH: u32 = 6;
const CELL_HEIGHT: u32 = 2;
const LAYER_SEPARATOR: Rgb<u8> = Rgb([255, 255, 255]);
const NOT_FINITE: Rgb<u8> = Rgb([0, 220, 0]);

/// Dark purple through red and orange to light yellow, at `x` in [0, 1].
fn colour(x: f32) -> Rgb<u8> {
    const STOPS: [[f32; 3]; 5] = [
        [0.0, 0.0, 0.02],
        [0.34, 0.06, 0.43],
        [0.73, 0.21, 0.33],
        [0.98, 0.55, 0.04],
        [0.99, 1.0, 0.64],
    ];
    let x = x.clamp(0.0, 1.0) * (STOPS.len() - 1) as f32;
    let i = (x as usize).min(STOPS.len() - 2);
    let t = x - i as f32;
    let mix = |c: usize| ((STOPS[i][c] * (1.0 - t) + STOPS[i + 1][c] * t) * 255.0).round() as u8;
    Rgb([mix(0), mix(1), mix(2)])
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.steps == 0 {
        bail!("--steps must be at least 1");
    }
    let text = std::fs::read_to_string(&args.document)
        .with_context(|| format!("cannot read {}", args.document.display()))?;
    let device = if args.cpu || !candle_core::utils::cuda_is_available() {
        Device::Cpu
    } else {
        Device::new_cuda(0)?
    };
    let model_path = match &args.model {
        Some(path) => path.clone(),
        None => default_model::default_model_path(false)?,
    };
    let loaded = Llama::load(&model_path, &device, AttentionBackend::SplitKv)
        .with_context(|| format!("cannot load {}", model_path.display()))?;
    let mut model = loaded.model;
    let mut prompt = loaded
        .tokenizer
        .encode(text.as_str(), false)
        .map_err(|e| anyhow::anyhow!("cannot tokenize the document: {e}"))?
        .get_ids()
        .to_vec();
    let room = model.context_length().saturating_sub(args.steps + 1);
    prompt.truncate(args.max_prompt_tokens.min(room));
    if prompt.is_empty() {
        bail!("the document has no tokens, or the context has no room for them");
    }
    eprintln!(
        "{}: {} prompt tokens, then {} decode steps on {:?}",
        model_path.display(),
        prompt.len(),
        args.steps,
        device.location()
    );

    let mut logits = model.forward(&prompt)?;
    // columns[step][layer][head]
    let mut columns: Vec<Vec<Vec<f32>>> = Vec::with_capacity(args.steps);
    for _ in 0..args.steps {
        let next = logits.argmax(0)?.to_scalar::<u32>()?;
        let (step_logits, lse) = model.forward_with_lse(&[next])?;
        logits = step_logits;
        let layers = lse
            .iter()
            .map(|lse: &Tensor| lse.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>())
            .collect::<candle_core::Result<Vec<_>>>()?;
        if layers.is_empty() {
            bail!("the model returned no LSE: its attention does not run through the split-KV op");
        }
        columns.push(layers);
    }

    let (layers, heads) = (columns[0].len(), columns[0][0].len());
    let finite = || {
        columns
            .iter()
            .flatten()
            .flatten()
            .copied()
            .filter(|x| x.is_finite())
    };
    let (low, high) = finite().fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), x| {
        (lo.min(x), hi.max(x))
    });
    let span = (high - low).max(1e-6);
    let height = layers as u32 * (heads as u32 * CELL_HEIGHT + 1);
    let mut image = RgbImage::from_pixel(args.steps as u32 * CELL_WIDTH, height, LAYER_SEPARATOR);
    for (step, column) in columns.iter().enumerate() {
        for (layer, row) in column.iter().enumerate() {
            for (head, &lse) in row.iter().enumerate() {
                let pixel = if lse.is_finite() {
                    colour((lse - low) / span)
                } else {
                    NOT_FINITE
                };
                let top =
                    layer as u32 * (heads as u32 * CELL_HEIGHT + 1) + head as u32 * CELL_HEIGHT;
                for y in top..top + CELL_HEIGHT {
                    for x in step as u32 * CELL_WIDTH..(step as u32 + 1) * CELL_WIDTH {
                        image.put_pixel(x, y, pixel);
                    }
                }
            }
        }
    }
    image
        .save(&args.out)
        .with_context(|| format!("cannot write {}", args.out.display()))?;
    let not_finite = columns
        .iter()
        .flatten()
        .flatten()
        .filter(|x| !x.is_finite())
        .count();
    // How far each layer's mean LSE moved from the first step to the last.
    let mean = |step: usize, layer: usize| columns[step][layer].iter().sum::<f32>() / heads as f32;
    let drift = (0..layers)
        .map(|l| mean(args.steps - 1, l) - mean(0, l))
        .fold(
            0f32,
            |worst, d| if d.abs() > worst.abs() { d } else { worst },
        );
    eprintln!(
        "wrote {} ({} steps × {layers} layers × {heads} heads): LSE from {low:.2} to {high:.2}, \
         {not_finite} not finite, largest drift of a layer's mean over the steps {drift:+.2}",
        args.out.display(),
        args.steps
    );
    Ok(())
}
