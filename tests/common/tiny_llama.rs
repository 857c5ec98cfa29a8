//! A tiny random Llama written as an HF directory (config.json, model.safetensors and a word-level
//! tokenizer), for the model tests: 2 layers, hidden 256, 4 query / 2 KV heads of head dim 64,
//! vocab 512.

use std::collections::HashMap;
use std::path::Path;

use anyhow::Result;
use candle_core::{Device, Tensor};
use rand::{rngs::StdRng, Rng, SeedableRng};

pub const HIDDEN: usize = 256;
pub const INTERMEDIATE: usize = 512;
pub const VOCAB: usize = 512;
pub const LAYERS: usize = 2;
pub const HEADS: usize = 4;
pub const KV_HEADS: usize = 2;
pub const HEAD_DIM: usize = 64;
pub const CONTEXT: usize = 512;

/// Llama 3 rope scaling with a short original context, so that the high-frequency, ramp and
/// low-frequency regimes all occur at head dim 64.
pub const CONFIG_JSON: &str = r#"{
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
pub fn write_tiny_model(dir: &Path) -> Result<()> {
    write_model(dir, false)
}

/// The same model with a head that makes greedy decoding decisive: the output row of token
/// `next(t)` also carries token `t`'s embedding, so each step's top logit leads the rest by
/// several units, well above the differences bf16 rounding makes between two devices, while
/// attention and the MLP still move every logit. Greedy tokens then walk `next`'s long cycle.
#[allow(dead_code)]
pub fn write_decisive_tiny_model(dir: &Path) -> Result<()> {
    write_model(dir, true)
}

/// The token a decisive model favours after `t`: an affine permutation of the vocabulary.
#[allow(dead_code)]
pub fn decisive_next(t: usize) -> usize {
    (97 * t + 5) % VOCAB
}

fn write_model(dir: &Path, decisive: bool) -> Result<()> {
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
    let mut lm_head = random(&mut rng, (VOCAB, HIDDEN), 4.0 * fan_in(HIDDEN))?;
    if decisive {
        let embed = &tensors["model.embed_tokens.weight"];
        let order: Vec<u32> = (0..VOCAB)
            .map(|row| {
                (0..VOCAB)
                    .find(|&t| decisive_next(t) == row)
                    .map_or(0, |t| t as u32)
            })
            .collect();
        let order = Tensor::new(order, &Device::Cpu)?;
        lm_head = (lm_head + (embed.index_select(&order, 0)? * f64::from(3.0 * fan_in(HIDDEN)))?)?;
    }
    tensors.insert("lm_head.weight".to_string(), lm_head);
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
