//! The tiny random Llama with an fp8 (e4m3) KV cache against the same model with an f32 cache
//! (the reference) and a bf16 one, on the CPU: a chunked prompt (blocked causal prefill on top
//! of cached positions, and a one-token chunk through the op), then greedy decode steps.

use std::path::Path;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_splitkv::models::llama::{Llama, LoadOptions};
use rand::{rngs::StdRng, Rng, SeedableRng};

use crate::common::tiny_llama::{write_tiny_model, VOCAB};

/// Prompt chunks: a prefill, a one-token chunk, a prefill on top of both.
const CHUNKS: [usize; 3] = [29, 1, 20];
const STEPS: usize = 8;
/// e4m3's unit roundoff (3 mantissa bits): the largest relative error of a stored normal value.
const E4M3_UNIT_ROUNDOFF: f32 = 1.0 / 16.0;

fn load(dir: &Path, cache_dtype: DType, scales: (f32, f32)) -> Result<Llama> {
    let options = LoadOptions {
        cache_dtype: Some(cache_dtype),
        cache_k_scale: scales.0,
        cache_v_scale: scales.1,
        ..LoadOptions::default()
    };
    Ok(Llama::load_with(dir, &Device::Cpu, options)?.model)
}

fn argmax(logits: &Tensor) -> Result<u32> {
    Ok(logits.argmax(0)?.to_scalar::<u32>()?)
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    Ok((a - b)?.abs()?.max(0)?.to_scalar::<f32>()?)
}

fn max_abs(x: &Tensor) -> Result<f32> {
    Ok(x.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
}

fn prompt() -> Vec<u32> {
    let mut rng = StdRng::seed_from_u64(23);
    (0..CHUNKS.iter().sum())
        .map(|_| rng.random_range(3..VOCAB as u32))
        .collect()
}

/// The logits after the prompt (run in [`CHUNKS`]) and after each of `tokens`.
fn logits_along(model: &mut Llama, prompt: &[u32], tokens: &[u32]) -> Result<Vec<Tensor>> {
    model.reset();
    let mut at = 0;
    let mut last = None;
    for n in CHUNKS {
        last = Some(model.forward(&prompt[at..at + n])?);
        at += n;
    }
    let mut all = vec![last.expect("at least one chunk")];
    for &token in tokens {
        all.push(model.forward(&[token])?);
    }
    Ok(all)
}

/// The largest logit difference over the prompt and the steps.
fn worst_diff(a: &[Tensor], b: &[Tensor]) -> Result<f32> {
    a.iter()
        .zip(b)
        .try_fold(0f32, |worst, (a, b)| Ok(worst.max(max_abs_diff(a, b)?)))
}

/// The largest |key| and |value| any layer cached.
fn cached_magnitudes(model: &mut Llama) -> Result<(f32, f32)> {
    let mut most = (0f32, 0f32);
    for cache in model.caches_mut() {
        let (k, v) = cache.views()?;
        most = (most.0.max(max_abs(&k)?), most.1.max(max_abs(&v)?));
    }
    Ok(most)
}

/// fp8 K/V move the logits by a bounded amount, and greedy decoding runs.
///
/// The bound: each stored key and value moves by at most u = 2^-4 of itself (e4m3 rounding,
/// normal values). An attention output then moves by at most about 2u of its size: u through
/// the values, and about u through the softmax weights, whose scores move by u of q·k. To first
/// order the logits move by the same share of their size, so the test allows 2u (1/8) of the
/// largest logit. A misapplied scale moves them by several times that (the calibrated scales
/// here are about 1/50 and 1/100), as would values saturating where they should not.
#[test]
fn fp8_cache_stays_close_to_f32_and_bf16() -> Result<()> {
    let dir = tempfile::tempdir()?;
    write_tiny_model(dir.path())?;
    let prompt = prompt();

    let mut reference = load(dir.path(), DType::F32, (1.0, 1.0))?;
    reference.reset();
    let mut logits = Vec::new();
    let mut tokens = Vec::new();
    let mut at = 0;
    for n in CHUNKS {
        logits = vec![reference.forward(&prompt[at..at + n])?];
        at += n;
    }
    for _ in 0..STEPS {
        let next = argmax(logits.last().expect("logits"))?;
        tokens.push(next);
        logits.push(reference.forward(&[next])?);
    }
    let logit_scale = logits
        .iter()
        .try_fold(0f32, |m, l| Ok::<_, anyhow::Error>(m.max(max_abs(l)?)))?;
    // Per-tensor scales the usual way: the largest magnitude maps to the top of e4m3's range.
    let (k_max, v_max) = cached_magnitudes(&mut reference)?;
    let calibrated = (k_max / 448.0, v_max / 448.0);

    let mut bf16 = load(dir.path(), DType::BF16, (1.0, 1.0))?;
    let bf16_diff = worst_diff(&logits_along(&mut bf16, &prompt, &tokens)?, &logits)?;
    eprintln!(
        "logit scale {logit_scale:.2}; cached |k| up to {k_max:.2}, |v| up to {v_max:.2}; \
         bf16 cache (q and the attention output in bf16 too): max |logit diff| {bf16_diff:.3e}"
    );
    assert!(bf16_diff.is_finite());

    let bound = 2.0 * E4M3_UNIT_ROUNDOFF * logit_scale;
    for scales in [(1.0, 1.0), calibrated] {
        let mut fp8 = load(dir.path(), DType::F8E4M3, scales)?;
        assert_eq!(fp8.cache_dtype(), DType::F8E4M3);
        let fp8_logits = logits_along(&mut fp8, &prompt, &tokens)?;
        let diff = worst_diff(&fp8_logits, &logits)?;
        let steps_kept = fp8_logits
            .iter()
            .zip(&logits)
            .map(|(a, b)| Ok(argmax(a)? == argmax(b)?))
            .collect::<Result<Vec<bool>>>()?;

        // Greedy decoding on its own tokens.
        fp8.reset();
        let mut next = argmax(&fp8.forward(&prompt)?)?;
        let mut greedy = Vec::new();
        for _ in 0..STEPS {
            greedy.push(next);
            next = argmax(&fp8.forward(&[next])?)?;
        }
        eprintln!(
            "fp8 cache, scales {scales:?}: max |logit diff| {diff:.3e} (bound {bound:.3e}); same \
             argmax at {}/{} positions; greedy {greedy:?} vs f32 {tokens:?}",
            steps_kept.iter().filter(|&&same| same).count(),
            steps_kept.len()
        );
        assert!(diff.is_finite(), "fp8 logits are not finite");
        // Zero would mean the keys and values were not rounded to e4m3 at all.
        assert!(diff > 0.0, "fp8 logits equal the f32 cache's");
        assert!(diff <= bound, "fp8 logits differ by {diff}, past {bound}");
        assert_eq!(greedy.len(), STEPS);
        assert!(greedy.iter().all(|&t| (t as usize) < VOCAB));
    }
    Ok(())
}
