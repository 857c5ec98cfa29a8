//! The families beside Llama through our decoder against candle-transformers' own models on the
//! same random weights, on the CPU, in f32: Mistral (full attention, and a sliding window),
//! Phi-3 (q/k/v and gate/up stored joined), Qwen2 (q/k/v biases, tied embeddings), Qwen3
//! (per-head q/k norms, a head dim that is not hidden / heads) and Gemma-2 (norms around
//! attention and the MLP, GELU, scaled embeddings, soft-capped scores and logits). The logits of a
//! prompt and of 32 decode steps (fed random tokens) agree to 1e-4 of their scale, and so do the
//! greedy choices. Gemma-2's alternating windows, which candle-transformers does not apply, are
//! checked by decoding against prefilling. Then the configs the decoder refuses.

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_splitkv::models::llama::{Llama, LlamaConfig, LoadOptions};
use candle_transformers::models::{gemma2, mistral, phi3, qwen2, qwen3};
use rand::{rngs::StdRng, Rng, SeedableRng};

use crate::common::tiny_families::{
    weights, Family, GEMMA2, GEMMA2_JSON, MISTRAL, MISTRAL_JSON, PHI3, PHI3_JSON, QWEN2,
    QWEN2_JSON, QWEN3, QWEN3_JSON, VOCAB,
};

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
fn gemma2_matches_candle_transformers() -> Result<()> {
    let config: gemma2::Config = serde_json::from_str(GEMMA2_JSON)?;
    let vb = VarBuilder::from_tensors(weights(GEMMA2)?, DType::F32, &Device::Cpu);
    let mut model = gemma2::Model::new(false, &config, vb)?;
    let step: Step = Box::new(move |tokens, offset| {
        Ok(model.forward(&input(tokens)?, offset)?.flatten_all()?)
    });
    check("gemma2", GEMMA2_JSON, GEMMA2, step)
}

/// A window of this many positions, well inside the 40-token prompt and the 32 steps after it.
const WINDOW: usize = 24;

/// Mistral with a sliding window against candle-transformers' Mistral recomputing the whole
/// sequence at every step: its prompt mask applies the window (a token there sees `window` + 1
/// positions, its own included, where HF's and ours see `window`), its cached steps do not.
#[test]
fn windowed_mistral_matches_candle_transformers() -> Result<()> {
    let json = MISTRAL_JSON.replace(
        "\"sliding_window\": null",
        &format!("\"sliding_window\": {WINDOW}"),
    );
    let mut config: mistral::Config = serde_json::from_str(&json)?;
    config.sliding_window = Some(WINDOW - 1);
    let vb = VarBuilder::from_tensors(weights(MISTRAL)?, DType::F32, &Device::Cpu);
    let mut model = mistral::Model::new(&config, vb)?;
    let mut seen = Vec::new();
    let step: Step = Box::new(move |tokens, _| {
        seen.extend_from_slice(tokens);
        model.clear_kv_cache();
        let logits = model.forward(&input(&seen)?, 0)?;
        Ok(logits.flatten_all()?)
    });
    check("mistral, windowed", &json, MISTRAL, step)
}

/// Gemma-2 with windows in its even layers: 32 decode steps after a prompt against prefills of
/// the same tokens (the prompt path and the op apply the window each their own way), and
/// different from the same model without windows.
#[test]
fn gemma2_windows_decode_as_they_prefill() -> Result<()> {
    let dev = Device::Cpu;
    let load = |window: usize| -> Result<Llama> {
        let json = GEMMA2_JSON.replace(
            "\"sliding_window\": 4096",
            &format!("\"sliding_window\": {window}"),
        );
        let config = LlamaConfig::from_hf_json(&json)?;
        let vb = VarBuilder::from_tensors(weights(GEMMA2)?, DType::F32, &dev);
        Ok(Llama::from_var_builder(
            vb,
            config,
            DType::F32,
            LoadOptions::default(),
        )?)
    };
    let (mut decoding, mut prefilling, mut unwindowed) =
        (load(WINDOW)?, load(WINDOW)?, load(4096)?);
    assert_eq!(decoding.config().window_left(0), Some(WINDOW - 1));
    assert_eq!(decoding.config().window_left(1), None);
    let mut rng = StdRng::seed_from_u64(9);
    let mut tokens: Vec<u32> = (0..40).map(|_| rng.random_range(3..VOCAB as u32)).collect();
    let mut logits = decoding.forward(&tokens)?;
    let mut apart = 0f32;
    for step in 0..=32 {
        prefilling.reset();
        let want = prefilling.forward(&tokens)?;
        let scale = want.abs()?.max(0)?.to_scalar::<f32>()?.max(1.0);
        let diff = max_abs_diff(&logits, &want)?;
        assert!(diff <= 1e-4 * scale, "step {step}: logits differ by {diff}");
        unwindowed.reset();
        apart = apart.max(max_abs_diff(&unwindowed.forward(&tokens)?, &want)? / scale);
        if step == 32 {
            break;
        }
        let next = rng.random_range(3..VOCAB as u32);
        tokens.push(next);
        logits = decoding.forward(&[next])?;
    }
    assert!(apart > 1e-3, "the window changed nothing ({apart:.1e})");
    Ok(())
}

#[test]
fn sliding_windows_land_on_the_layers_of_each_family() -> Result<()> {
    let mistral = LlamaConfig::from_hf_json(
        &MISTRAL_JSON.replace("\"sliding_window\": null", "\"sliding_window\": 512"),
    )?;
    assert_eq!(
        (mistral.window_left(0), mistral.window_left(1)),
        (Some(511), Some(511))
    );
    // A window as long as the context is no window.
    assert_eq!(
        LlamaConfig::from_hf_json(PHI3_JSON)?.window_left(0),
        Some(1022)
    );
    let phi3 = PHI3_JSON.replace("\"sliding_window\": 1023", "\"sliding_window\": 1024");
    assert_eq!(LlamaConfig::from_hf_json(&phi3)?.window_left(0), None);
    let qwen2 = QWEN2_JSON
        .replace(
            "\"use_sliding_window\": false",
            "\"use_sliding_window\": true",
        )
        .replace("\"sliding_window\": 1024", "\"sliding_window\": 256")
        .replace("\"max_window_layers\": 2", "\"max_window_layers\": 1");
    let qwen2 = LlamaConfig::from_hf_json(&qwen2)?;
    assert_eq!(
        (qwen2.window_left(0), qwen2.window_left(1)),
        (None, Some(255))
    );
    assert_eq!(LlamaConfig::from_hf_json(QWEN2_JSON)?.window_left(1), None);
    let gemma2 = GEMMA2_JSON.replace("\"sliding_window\": 4096", "\"sliding_window\": 512");
    let gemma2 = LlamaConfig::from_hf_json(&gemma2)?;
    assert_eq!(
        (gemma2.window_left(0), gemma2.window_left(1)),
        (Some(511), None)
    );
    Ok(())
}

#[test]
fn unsupported_configs_are_refused_with_the_supported_ones_named() {
    let other = QWEN2_JSON.replace("\"qwen2\"", "\"gpt_neox\"");
    let err = LlamaConfig::from_hf_json(&other).unwrap_err();
    assert!(
        err.to_string()
            .contains("supported: llama, mistral, phi3, qwen2, qwen3, gemma2"),
        "{err}"
    );
    let tiny_window = MISTRAL_JSON.replace("\"sliding_window\": null", "\"sliding_window\": 1");
    let err = LlamaConfig::from_hf_json(&tiny_window).unwrap_err();
    assert!(err.to_string().contains("must be at least 2"), "{err}");
    let gelu = MISTRAL_JSON.replace("\"silu\"", "\"gelu\"");
    let err = LlamaConfig::from_hf_json(&gelu).unwrap_err();
    assert!(err.to_string().contains("activation `gelu`"), "{err}");
}
