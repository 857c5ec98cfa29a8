//! Qwen2 (q/k/v biases, tied embeddings) through our decoder against candle-transformers' Qwen2 on
//! the same random weights, on the CPU, in f32: the logits of a prompt and of 32 decode steps (fed
//! random tokens) agree to 1e-4 of their scale, and so do the greedy choices. Then the configs it
//! refuses.

use std::collections::HashMap;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_splitkv::models::llama::{Llama, LlamaConfig, LoadOptions};
use candle_transformers::models::qwen2 as stock;
use rand::{rngs::StdRng, Rng, SeedableRng};

const HIDDEN: usize = 128;
const FFN: usize = 352;
const VOCAB: usize = 300;
const LAYERS: usize = 2;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = HIDDEN / HEADS;

const CONFIG_JSON: &str = r#"{
  "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
  "hidden_size": 128, "intermediate_size": 352, "vocab_size": 300,
  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
  "max_position_embeddings": 1024, "sliding_window": 1024, "max_window_layers": 2,
  "use_sliding_window": false, "tie_word_embeddings": true, "rope_theta": 1000000.0,
  "rms_norm_eps": 1e-6, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2
}"#;

fn random(rng: &mut StdRng, shape: &[usize], std: f32) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let bound = std * 3f32.sqrt();
    let data: Vec<f32> = (0..n).map(|_| rng.random_range(-bound..bound)).collect();
    Ok(Tensor::from_vec(data, shape, &Device::Cpu)?)
}

/// HF-named weights of a tiny Qwen2, biases included, the output head tied to the embeddings.
fn weights() -> Result<HashMap<String, Tensor>> {
    let mut rng = StdRng::seed_from_u64(23);
    let mut w = HashMap::new();
    w.insert(
        "model.embed_tokens.weight".to_string(),
        random(&mut rng, &[VOCAB, HIDDEN], 0.5)?,
    );
    let (q, kv) = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM);
    for i in 0..LAYERS {
        let p = format!("model.layers.{i}");
        for (name, shape, std) in [
            ("self_attn.q_proj.weight", vec![q, HIDDEN], 0.08),
            ("self_attn.k_proj.weight", vec![kv, HIDDEN], 0.08),
            ("self_attn.v_proj.weight", vec![kv, HIDDEN], 0.08),
            ("self_attn.q_proj.bias", vec![q], 0.5),
            ("self_attn.k_proj.bias", vec![kv], 0.5),
            ("self_attn.v_proj.bias", vec![kv], 0.5),
            ("self_attn.o_proj.weight", vec![HIDDEN, q], 0.08),
            ("mlp.gate_proj.weight", vec![FFN, HIDDEN], 0.08),
            ("mlp.up_proj.weight", vec![FFN, HIDDEN], 0.08),
            ("mlp.down_proj.weight", vec![HIDDEN, FFN], 0.05),
        ] {
            w.insert(format!("{p}.{name}"), random(&mut rng, &shape, std)?);
        }
        for norm in ["input_layernorm", "post_attention_layernorm"] {
            let ones = (random(&mut rng, &[HIDDEN], 0.1)? + 1.0)?;
            w.insert(format!("{p}.{norm}.weight"), ones);
        }
    }
    w.insert(
        "model.norm.weight".to_string(),
        (random(&mut rng, &[HIDDEN], 0.1)? + 1.0)?,
    );
    Ok(w)
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    Ok((a - b)?.abs()?.max(0)?.to_scalar::<f32>()?)
}

#[test]
fn qwen2_matches_candle_transformers() -> Result<()> {
    let tensors = weights()?;
    let dev = Device::Cpu;
    let config = LlamaConfig::from_hf_json(CONFIG_JSON)?;
    assert!(config.attention_bias);
    let vb = VarBuilder::from_tensors(tensors.clone(), DType::F32, &dev);
    let mut ours = Llama::from_var_builder(vb, config, DType::F32, LoadOptions::default())?;
    let stock_config: stock::Config = serde_json::from_str(CONFIG_JSON)?;
    let vb = VarBuilder::from_tensors(tensors, DType::F32, &dev);
    let mut theirs = stock::ModelForCausalLM::new(&stock_config, vb)?;

    let mut rng = StdRng::seed_from_u64(5);
    let prompt: Vec<u32> = (0..40).map(|_| rng.random_range(3..VOCAB as u32)).collect();
    let mut ours_logits = ours.forward(&prompt)?;
    let input = Tensor::new(prompt.as_slice(), &dev)?.unsqueeze(0)?;
    let mut stock_logits = theirs.forward(&input, 0)?.flatten_all()?;
    let (mut worst, mut tokens) = (0f32, Vec::new());
    for step in 0..=32 {
        let scale = stock_logits.abs()?.max(0)?.to_scalar::<f32>()?.max(1.0);
        let diff = max_abs_diff(&ours_logits, &stock_logits)?;
        worst = worst.max(diff / scale);
        assert!(
            diff <= 1e-4 * scale,
            "step {step}: logits differ by {diff} (scale {scale})"
        );
        let greedy = stock_logits.argmax(0)?.to_scalar::<u32>()?;
        assert_eq!(
            ours_logits.argmax(0)?.to_scalar::<u32>()?,
            greedy,
            "step {step}"
        );
        tokens.push(greedy);
        if step == 32 {
            break;
        }
        // Random weights make greedy decoding repeat one token: feed random ones instead, so
        // that every step attends over a cache of different keys.
        let next = rng.random_range(3..VOCAB as u32);
        ours_logits = ours.forward(&[next])?;
        let input = Tensor::new(&[next], &dev)?.unsqueeze(0)?;
        stock_logits = theirs.forward(&input, prompt.len() + step)?.flatten_all()?;
    }
    println!("qwen2: worst logit difference {worst:.2e} of the scale; tokens {tokens:?}");
    Ok(())
}

#[test]
fn unsupported_configs_are_refused_with_the_supported_ones_named() {
    let other = CONFIG_JSON.replace("\"qwen2\"", "\"gpt_neox\"");
    let err = LlamaConfig::from_hf_json(&other).unwrap_err();
    assert!(err.to_string().contains("supported: llama, qwen2"), "{err}");
    let windowed = CONFIG_JSON.replace(
        "\"use_sliding_window\": false",
        "\"use_sliding_window\": true",
    );
    let err = LlamaConfig::from_hf_json(&windowed).unwrap_err();
    assert!(err.to_string().contains("use_sliding_window"), "{err}");
}
