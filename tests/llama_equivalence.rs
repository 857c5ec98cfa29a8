//! Our Llama against candle-transformers' Llama on the same random weights, on the CPU, in f32:
//! the logits of a prompt and of 32 greedy decode steps agree to 1e-4, and so do the tokens.

use std::collections::HashMap;
use std::path::Path;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_splitkv::models::llama::{AttentionBackend, Llama};
use candle_transformers::models::llama as stock;
use rand::{rngs::StdRng, Rng, SeedableRng};

const HIDDEN: usize = 256;
const INTERMEDIATE: usize = 512;
const VOCAB: usize = 512;
const LAYERS: usize = 2;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 64;
const CONTEXT: usize = 512;
const TOLERANCE: f32 = 1e-4;

/// Llama 3 rope scaling with a short original context, so that the high-frequency, ramp and
/// low-frequency regimes all occur at head dim 64.
const CONFIG_JSON: &str = r#"{
  "architectures": ["LlamaForCausalLM"],
  "hidden_size": 256, "intermediate_size": 512, "vocab_size": 512,
  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
  "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 512,
  "tie_word_embeddings": false, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
  "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
}"#;

fn random(rng: &mut StdRng, shape: (usize, usize), std: f32) -> Result<Tensor> {
    let n = shape.0 * shape.1;
    // Uniform with the given standard deviation.
    let bound = std * 3f32.sqrt();
    let data: Vec<f32> = (0..n).map(|_| rng.random_range(-bound..bound)).collect();
    Ok(Tensor::from_vec(data, shape, &Device::Cpu)?)
}

fn random_norm(rng: &mut StdRng) -> Result<Tensor> {
    let data: Vec<f32> = (0..HIDDEN).map(|_| rng.random_range(0.8..1.2)).collect();
    Ok(Tensor::from_vec(data, HIDDEN, &Device::Cpu)?)
}

/// Writes config.json, model.safetensors and a word-level tokenizer.json into `dir`.
fn write_tiny_model(dir: &Path) -> Result<()> {
    let mut rng = StdRng::seed_from_u64(5);
    let mut tensors = HashMap::new();
    let (q_size, kv_size) = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM);
    let fan_in = |n: usize| 1.0 / (n as f32).sqrt();
    tensors.insert(
        "model.embed_tokens.weight".to_string(),
        random(&mut rng, (VOCAB, HIDDEN), 1.0)?,
    );
    for layer in 0..LAYERS {
        let p = format!("model.layers.{layer}");
        let mut add = |name: &str, t: Tensor| tensors.insert(format!("{p}.{name}.weight"), t);
        add("input_layernorm", random_norm(&mut rng)?);
        add("post_attention_layernorm", random_norm(&mut rng)?);
        // q and k a little larger than unit scale so attention is not uniform.
        add(
            "self_attn.q_proj",
            random(&mut rng, (q_size, HIDDEN), 2.0 * fan_in(HIDDEN))?,
        );
        add(
            "self_attn.k_proj",
            random(&mut rng, (kv_size, HIDDEN), 2.0 * fan_in(HIDDEN))?,
        );
        add(
            "self_attn.v_proj",
            random(&mut rng, (kv_size, HIDDEN), fan_in(HIDDEN))?,
        );
        add(
            "self_attn.o_proj",
            random(&mut rng, (HIDDEN, q_size), fan_in(q_size))?,
        );
        add(
            "mlp.gate_proj",
            random(&mut rng, (INTERMEDIATE, HIDDEN), fan_in(HIDDEN))?,
        );
        add(
            "mlp.up_proj",
            random(&mut rng, (INTERMEDIATE, HIDDEN), fan_in(HIDDEN))?,
        );
        add(
            "mlp.down_proj",
            random(&mut rng, (HIDDEN, INTERMEDIATE), fan_in(INTERMEDIATE))?,
        );
    }
    tensors.insert("model.norm.weight".to_string(), random_norm(&mut rng)?);
    tensors.insert(
        "lm_head.weight".to_string(),
        random(&mut rng, (VOCAB, HIDDEN), 4.0 * fan_in(HIDDEN))?,
    );
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors"))?;
    std::fs::write(dir.join("config.json"), CONFIG_JSON)?;

    let vocab = (0..VOCAB).map(|i| (format!("t{i}"), i as u32)).collect();
    let model = tokenizers::models::wordlevel::WordLevel::builder()
        .vocab(vocab)
        .unk_token("t0".to_string())
        .build()
        .map_err(anyhow::Error::msg)?;
    let mut tokenizer = tokenizers::Tokenizer::new(model);
    tokenizer.with_pre_tokenizer(Some(tokenizers::pre_tokenizers::whitespace::Whitespace {}));
    tokenizer
        .save(dir.join("tokenizer.json"), false)
        .map_err(anyhow::Error::msg)?;
    Ok(())
}

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
fn check_against_stock(backend: AttentionBackend, chunks: &[usize]) -> Result<()> {
    let dir = tempfile::tempdir()?;
    write_tiny_model(dir.path())?;
    let loaded = Llama::load(dir.path(), &Device::Cpu, backend)?;
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
        "{backend:?}, prompt {chunks:?}: logits max |diff| prompt {prompt_diff:.2e}, decode \
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
    check_against_stock(AttentionBackend::SplitKv, &[300])
}

#[test]
fn split_kv_matches_stock_llama_with_a_chunked_prompt() -> Result<()> {
    check_against_stock(AttentionBackend::SplitKv, &[37, 1, 90])
}

#[test]
fn naive_backend_matches_stock_llama() -> Result<()> {
    check_against_stock(AttentionBackend::Naive, &[45])
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
