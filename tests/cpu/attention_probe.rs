//! `Llama::forward_with_attention` on the tiny random model: the pass is `Llama::forward`'s
//! (same logits, same cache after it), and the weights it returns are, per layer, a causal
//! distribution of each new token over the cache, whatever chunks the prompt went in.

use anyhow::Result;
use candle_core::{Device, Tensor};
use candle_splitkv::models::llama::{Llama, LoadOptions};
use rand::{rngs::StdRng, Rng, SeedableRng};

use crate::common::tiny_llama::{write_tiny_model, HEADS, LAYERS, VOCAB};

fn tiny(prefill_chunk: usize) -> Result<(tempfile::TempDir, Llama)> {
    let dir = tempfile::tempdir()?;
    write_tiny_model(dir.path())?;
    let options = LoadOptions {
        prefill_chunk,
        ..LoadOptions::default()
    };
    let model = Llama::load_with(dir.path(), &Device::Cpu, options)?.model;
    Ok((dir, model))
}

fn prompt(len: usize) -> Vec<u32> {
    let mut rng = StdRng::seed_from_u64(23);
    (0..len)
        .map(|_| rng.random_range(3..VOCAB as u32))
        .collect()
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    Ok((a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
}

#[test]
fn the_pass_is_forwards_and_the_weights_are_causal_distributions() -> Result<()> {
    let (_dir, mut probed) = tiny(512)?;
    let mut plain = probed.clone();
    let tokens = prompt(45);
    probed.forward(&tokens[..40])?;
    plain.forward(&tokens[..40])?;
    let (logits, weights) = probed.forward_with_attention(&tokens[40..])?;
    assert_eq!(max_abs_diff(&logits, &plain.forward(&tokens[40..])?)?, 0.0);
    assert_eq!(probed.cache_len(), 45);
    // The cache holds what forward would have put there: the next step agrees.
    assert_eq!(
        max_abs_diff(&probed.forward(&[7])?, &plain.forward(&[7])?)?,
        0.0
    );
    assert_eq!(weights.len(), LAYERS);
    for layer in &weights {
        assert_eq!(layer.dims(), [HEADS, 5, 45]);
        let rows = layer.to_vec3::<f32>()?;
        for head in &rows {
            for (i, row) in head.iter().enumerate() {
                let position = 40 + i;
                let sum: f32 = row.iter().sum();
                assert!((sum - 1.0).abs() < 1e-5, "a row sums to {sum}");
                assert!(row[position] > 0.0, "a token does not see itself");
                assert!(
                    row[position + 1..].iter().all(|&w| w == 0.0),
                    "a token sees a later one"
                );
                assert!(row[..=position].iter().all(|&w| w > 0.0));
            }
        }
    }
    Ok(())
}

#[test]
fn the_weights_do_not_depend_on_the_chunks_the_prompt_went_in() -> Result<()> {
    let tokens = prompt(45);
    let (_dir, mut whole) = tiny(512)?;
    let (_weights_dir, mut chunked) = tiny(16)?;
    whole.forward(&tokens[..40])?;
    let (_, after) = whole.forward_with_attention(&tokens[40..])?;
    // 45 tokens in chunks of 16: the last five rows are the same queries over the same cache.
    let (_, at_once) = chunked.forward_with_attention(&tokens)?;
    for (a, b) in after.iter().zip(&at_once) {
        assert_eq!(b.dims(), [HEADS, 45, 45]);
        let diff = max_abs_diff(a, &b.narrow(1, 40, 5)?)?;
        assert!(diff < 1e-5, "weights differ by {diff}");
    }
    Ok(())
}
