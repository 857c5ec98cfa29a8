//! The families beside Llama through our decoder against candle-transformers' own models on the
//! same random weights, on the CPU, in f32: Mistral (full attention), Phi-3 (q/k/v and gate/up
//! stored joined), Qwen2 (q/k/v biases, tied embeddings) and Qwen3
//! (per-head q/k norms, a head dim that is not hidden / heads). The logits of a prompt and of 32
//! decode steps (fed random tokens) agree to 1e-4 of their scale, and so do the greedy choices.
//! Then the configs the decoder refuses.

mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_splitkv::models::llama::{Llama, LlamaConfig, LoadOptions};
use candle_transformers::models::{mistral, phi3, qwen2, qwen3};
use common::tiny_families::{
    weights, Family, MISTRAL, MISTRAL_JSON, PHI3, PHI3_JSON, QWEN2, QWEN2_JSON, QWEN3, QWEN3_JSON,
    VOCAB,
};
use rand::{rngs::StdRng, Rng, SeedableRng};

fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    Ok((a - b)?.abs()?.max(0)?.to_scalar::<f32>()?)
}

/// One model's logits `(vocab,)` for `tokens` after `offset` cached positions.
type Step<'a> = Box<dyn FnMut(&[u32], usize) -> Result<Tensor> + 'a>;

/// Our decoder against `theirs` over a prompt and 32 decode steps.
fn check(name: &str, json: &str, family: Family, mut theirs: Step) -> Result<()> {
    let dev = Device::Cpu;
    let config = LlamaConfig::from_hf_json(json)?;
    assert_eq!(
        (config.attention_bias, config.qk_norm, config.head_dim),
        (family.qkv_bias, family.qk_norm, family.head_dim)
    );
    let vb = VarBuilder::from_tensors(weights(family)?, DType::F32, &dev);
    let mut ours = Llama::from_var_builder(vb, config, DType::F32, LoadOptions::default())?;

    let mut rng = StdRng::seed_from_u64(5);
    let prompt: Vec<u32> = (0..40).map(|_| rng.random_range(3..VOCAB as u32)).collect();
    let mut ours_logits = ours.forward(&prompt)?;
    let mut stock_logits = theirs(&prompt, 0)?;
    let (mut worst, mut tokens) = (0f32, Vec::new());
    for step in 0..=32 {
        let scale = stock_logits.abs()?.max(0)?.to_scalar::<f32>()?.max(1.0);
        let diff = max_abs_diff(&ours_logits, &stock_logits)?;
        worst = worst.max(diff / scale);
        assert!(
            diff <= 1e-4 * scale,
            "{name} step {step}: logits differ by {diff} (scale {scale})"
        );
        let greedy = stock_logits.argmax(0)?.to_scalar::<u32>()?;
        assert_eq!(
            ours_logits.argmax(0)?.to_scalar::<u32>()?,
            greedy,
            "{name} step {step}"
        );
        tokens.push(greedy);
        if step == 32 {
            break;
        }
        // Random weights make greedy decoding repeat one token: feed random ones instead, so
        // that every step attends over a cache of different keys.
        let next = rng.random_range(3..VOCAB as u32);
        ours_logits = ours.forward(&[next])?;
        stock_logits = theirs(&[next], prompt.len() + step)?;
    }
    println!("{name}: worst logit difference {worst:.2e} of the scale; greedy {tokens:?}");
    Ok(())
}

fn input(tokens: &[u32]) -> Result<Tensor> {
    Ok(Tensor::new(tokens, &Device::Cpu)?.unsqueeze(0)?)
}

#[test]
fn mistral_matches_candle_transformers() -> Result<()> {
    let config: mistral::Config = serde_json::from_str(MISTRAL_JSON)?;
    let vb = VarBuilder::from_tensors(weights(MISTRAL)?, DType::F32, &Device::Cpu);
    let mut model = mistral::Model::new(&config, vb)?;
    let step: Step = Box::new(move |tokens, offset| {
        Ok(model.forward(&input(tokens)?, offset)?.flatten_all()?)
    });
    check("mistral", MISTRAL_JSON, MISTRAL, step)
}

#[test]
fn phi3_matches_candle_transformers() -> Result<()> {
    let config: phi3::Config = serde_json::from_str(PHI3_JSON)?;
    let vb = VarBuilder::from_tensors(weights(PHI3)?, DType::F32, &Device::Cpu);
    let mut model = phi3::Model::new(&config, vb)?;
    let step: Step = Box::new(move |tokens, offset| {
        Ok(model.forward(&input(tokens)?, offset)?.flatten_all()?)
    });
    check("phi3", PHI3_JSON, PHI3, step)
}

#[test]
fn qwen2_matches_candle_transformers() -> Result<()> {
    let config: qwen2::Config = serde_json::from_str(QWEN2_JSON)?;
    let vb = VarBuilder::from_tensors(weights(QWEN2)?, DType::F32, &Device::Cpu);
    let mut model = qwen2::ModelForCausalLM::new(&config, vb)?;
    let step: Step = Box::new(move |tokens, offset| {
        Ok(model.forward(&input(tokens)?, offset)?.flatten_all()?)
    });
    check("qwen2", QWEN2_JSON, QWEN2, step)
}

#[test]
fn qwen3_matches_candle_transformers() -> Result<()> {
    let config: qwen3::Config = serde_json::from_str(QWEN3_JSON)?;
    let vb = VarBuilder::from_tensors(weights(QWEN3)?, DType::F32, &Device::Cpu);
    let mut model = qwen3::ModelForCausalLM::new(&config, vb)?;
    let step: Step = Box::new(move |tokens, offset| {
        Ok(model.forward(&input(tokens)?, offset)?.flatten_all()?)
    });
    check("qwen3", QWEN3_JSON, QWEN3, step)
}

#[test]
fn unsupported_configs_are_refused_with_the_supported_ones_named() {
    let other = QWEN2_JSON.replace("\"qwen2\"", "\"gpt_neox\"");
    let err = LlamaConfig::from_hf_json(&other).unwrap_err();
    assert!(
        err.to_string()
            .contains("supported: llama, mistral, phi3, qwen2, qwen3"),
        "{err}"
    );
    let windowed = MISTRAL_JSON.replace("\"sliding_window\": null", "\"sliding_window\": 512");
    let err = LlamaConfig::from_hf_json(&windowed).unwrap_err();
    assert!(
        err.to_string().contains("sliding-window attention"),
        "{err}"
    );
    let windowed = QWEN2_JSON.replace(
        "\"use_sliding_window\": false",
        "\"use_sliding_window\": true",
    );
    let err = LlamaConfig::from_hf_json(&windowed).unwrap_err();
    assert!(err.to_string().contains("use_sliding_window"), "{err}");
}
