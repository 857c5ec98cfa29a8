//! Our Llama against candle-transformers' Llama on the same random weights, on the CPU, in f32:
//! the logits of a prompt and of 32 greedy decode steps agree to 1e-4, and so do the tokens.
//! And `Llama::forward_with_lse` against `Llama::forward`.

use std::path::Path;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_splitkv::models::llama::{Llama, LoadOptions};
use candle_splitkv::AttentionBackend;
use candle_transformers::models::llama as stock;
use rand::{rngs::StdRng, Rng, SeedableRng};

use crate::common::tiny_llama::{write_tiny_model, CONFIG_JSON, CONTEXT, HEADS, LAYERS, VOCAB};

const TOLERANCE: f32 = 1e-4;

fn stock_model(dir: &Path) -> Result<(stock::Llama, stock::Cache)> {
    let config: stock::LlamaConfig = serde_json::from_str(CONFIG_JSON)?;
    let config = config.into_config(false);
    let tensors = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu)?;
    let vb = candle_nn::VarBuilder::from_tensors(tensors, DType::F32, &Device::Cpu);
    let model = stock::Llama::load(vb, &config)?;
    let cache = stock::Cache::new(true, DType::F32, &config, &Device::Cpu)?;
    Ok((model, cache))
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    Ok((a - b)?.abs()?.max(0)?.to_scalar::<f32>()?)
}

fn argmax(logits: &Tensor) -> Result<u32> {
    Ok(logits.argmax(0)?.to_scalar::<u32>()?)
}

/// Prefill in `chunks`, then 32 greedy steps, against the stock model (prompt in one call).
/// `joined`: the layout of the fused decode kernels (q/k/v joined, gate/up interleaved), which
/// on the CPU runs through candle's ops.
fn check_against_stock(backend: AttentionBackend, chunks: &[usize], joined: bool) -> Result<()> {
    let dir = tempfile::tempdir()?;
    write_tiny_model(dir.path())?;
    let options = LoadOptions {
        backend,
        joined_layers: Some(joined),
        ..LoadOptions::default()
    };
    let loaded = Llama::load_with(dir.path(), &Device::Cpu, options)?;
    let mut ours = loaded.model;
    assert_eq!(ours.backend(), backend);
    assert_eq!(ours.context_length(), CONTEXT);
    assert_eq!(loaded.bos_token_id, Some(1));
    assert_eq!(loaded.eos_token_ids, [2]);
    let (theirs, mut stock_cache) = stock_model(dir.path())?;

    let mut rng = StdRng::seed_from_u64(17);
    let prompt_len: usize = chunks.iter().sum();
    let prompt: Vec<u32> = (0..prompt_len)
        .map(|_| rng.random_range(3..VOCAB as u32))
        .collect();
    // The tokenizer written next to the weights maps "t{i}" to i.
    let text: Vec<String> = prompt.iter().map(|t| format!("t{t}")).collect();
    let encoded = loaded
        .tokenizer
        .encode(text.join(" "), false)
        .map_err(anyhow::Error::msg)?;
    assert_eq!(encoded.get_ids(), prompt.as_slice());

    let mut ours_logits = None;
    let mut at = 0;
    for &n in chunks {
        ours_logits = Some(ours.forward(&prompt[at..at + n])?);
        at += n;
    }
    let mut ours_logits = ours_logits.expect("at least one chunk");
    assert_eq!(ours.cache_len(), prompt_len);
    let input = Tensor::new(prompt.as_slice(), &Device::Cpu)?.unsqueeze(0)?;
    let mut stock_logits = theirs.forward(&input, 0, &mut stock_cache)?.squeeze(0)?;
    assert_eq!(ours_logits.dims(), [VOCAB]);
    let prompt_diff = max_abs_diff(&ours_logits, &stock_logits)?;
    let scale = stock_logits.abs()?.max(0)?.to_scalar::<f32>()?;

    let mut worst_decode = 0f32;
    let (mut ours_tokens, mut stock_tokens) = (Vec::new(), Vec::new());
    for step in 0..32 {
        let (ours_next, stock_next) = (argmax(&ours_logits)?, argmax(&stock_logits)?);
        ours_tokens.push(ours_next);
        stock_tokens.push(stock_next);
        ours_logits = ours.forward(&[ours_next])?;
        let input = Tensor::new(&[stock_next], &Device::Cpu)?.unsqueeze(0)?;
        stock_logits = theirs
            .forward(&input, prompt_len + step, &mut stock_cache)?
            .squeeze(0)?;
        worst_decode = worst_decode.max(max_abs_diff(&ours_logits, &stock_logits)?);
    }
    eprintln!(
        "{backend:?}, joined {joined}, prompt {chunks:?}: logits max |diff| prompt {prompt_diff:.2e}, decode \
         {worst_decode:.2e} (logit scale {scale:.1}); greedy tokens {:?}",
        ours_tokens
    );
    assert!(
        prompt_diff <= TOLERANCE,
        "prompt logits differ by {prompt_diff}"
    );
    assert!(
        worst_decode <= TOLERANCE,
        "decode logits differ by {worst_decode}"
    );
    assert_eq!(ours_tokens, stock_tokens);
    // A model that always predicts the same token would make the comparison weak.
    let mut distinct = ours_tokens.clone();
    distinct.sort();
    distinct.dedup();
    assert!(
        distinct.len() > 4,
        "greedy tokens barely vary: {ours_tokens:?}"
    );
    assert_eq!(ours.cache_len(), prompt_len + 32);

    ours.reset();
    assert_eq!(ours.cache_len(), 0);
    let again = ours.forward(&prompt)?;
    let input = Tensor::new(prompt.as_slice(), &Device::Cpu)?.unsqueeze(0)?;
    let mut fresh_cache = stock_model(dir.path())?.1;
    let stock_again = theirs.forward(&input, 0, &mut fresh_cache)?.squeeze(0)?;
    assert!(max_abs_diff(&again, &stock_again)? <= TOLERANCE);
    Ok(())
}

#[test]
fn split_kv_matches_stock_llama_with_a_two_block_prompt() -> Result<()> {
    // 300 prompt tokens span two prefill blocks.
    check_against_stock(AttentionBackend::SplitKv, &[300], false)
}

#[test]
fn split_kv_matches_stock_llama_with_a_chunked_prompt() -> Result<()> {
    check_against_stock(AttentionBackend::SplitKv, &[37, 1, 90], false)
}

#[test]
fn joined_layers_match_stock_llama() -> Result<()> {
    check_against_stock(AttentionBackend::SplitKv, &[37, 1, 90], true)
}

#[test]
fn naive_backend_matches_stock_llama() -> Result<()> {
    check_against_stock(AttentionBackend::Naive, &[45], false)
}

#[test]
fn forward_rejects_bad_input() -> Result<()> {
    let dir = tempfile::tempdir()?;
    write_tiny_model(dir.path())?;
    let mut model = Llama::load(dir.path(), &Device::Cpu, AttentionBackend::SplitKv)?.model;
    assert!(model.forward(&[]).is_err());
    let err = model.forward(&[VOCAB as u32]).unwrap_err().to_string();
    assert!(err.contains("out of the vocabulary"), "{err}");
    let too_long = vec![5u32; CONTEXT + 1];
    let err = model.forward(&too_long).unwrap_err().to_string();
    assert!(err.contains("context length 512"), "{err}");
    assert_eq!(model.cache_len(), 0);
    let missing = Llama::load(
        &dir.path().join("nope"),
        &Device::Cpu,
        AttentionBackend::SplitKv,
    );
    assert!(missing.is_err());
    Ok(())
}

/// `forward_with_lse` gives the logits of `forward` bit for bit, with one finite LSE
/// `(1, heads, t)` per layer, for a prompt (which the CPU op takes whole) and for decode steps.
#[test]
fn forward_with_lse_gives_the_logits_of_forward_and_an_lse_per_layer() -> Result<()> {
    let dir = tempfile::tempdir()?;
    write_tiny_model(dir.path())?;
    let load = || Llama::load_with(dir.path(), &Device::Cpu, LoadOptions::default());
    let (mut plain, mut recording) = (load()?.model, load()?.model);
    let prompt: Vec<u32> = (3..40).collect();
    assert!(prompt.len() > candle_splitkv::MAX_QUERY_TOKENS);
    let check_lse = |lse: &[Tensor], t: usize| -> Result<()> {
        assert_eq!(lse.len(), LAYERS);
        for layer in lse {
            assert_eq!(layer.dims(), [1, HEADS, t]);
            let values = layer.flatten_all()?.to_vec1::<f32>()?;
            assert!(values.iter().all(|x| x.is_finite()), "{values:?}");
        }
        Ok(())
    };
    let (logits, lse) = recording.forward_with_lse(&prompt)?;
    assert_eq!(max_abs_diff(&logits, &plain.forward(&prompt)?)?, 0.0);
    check_lse(&lse, prompt.len())?;
    for token in [5, 9, 200] {
        let want = plain.forward(&[token])?;
        let (got, lse) = recording.forward_with_lse(&[token])?;
        assert_eq!(max_abs_diff(&got, &want)?, 0.0);
        check_lse(&lse, 1)?;
    }
    assert_eq!(recording.cache_len(), plain.cache_len());
    Ok(())
}
