//! Qwen2, Qwen3 and Phi-3 from GGUF files through our decoder against candle-transformers'
//! `quantized_qwen2`, `quantized_qwen3` and `quantized_phi3` on the same file, on the CPU: tiny
//! random models written with candle's GGUF writer (f32 tensors, so both sides multiply the same
//! numbers). The logits of a prompt and of 32 decode steps (fed random tokens) agree to 1e-4 of
//! their scale, and so do the greedy choices. Gemma-2, which candle-transformers has no quantized
//! model of, against our decoder loading the same weights from an HF directory. Then an
//! unsupported architecture is named in the error.

use std::collections::HashMap;
use std::path::Path;

use anyhow::Result;
use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::DType;
use candle_core::{Device, Tensor};
use candle_nn::VarBuilder;
use candle_splitkv::models::llama::LlamaConfig;
use candle_splitkv::models::llama::{Llama, LoadOptions, WeightForm, WeightFormPolicy};
use candle_transformers::models::{quantized_phi3, quantized_qwen2, quantized_qwen3};
use rand::{rngs::StdRng, Rng, SeedableRng};

use crate::common::tiny_families::{
    weights, Family, FFN, GEMMA2, GEMMA2_JSON, HEADS, HIDDEN, KV_HEADS, LAYERS, PHI3, QWEN2, QWEN3,
    VOCAB,
};

/// The GGUF name of an HF-named weight of `family`.
fn gguf_name(hf: &str, family: Family) -> String {
    let renamed = [
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("lm_head.weight", "output.weight"),
        ("model.norm.weight", "output_norm.weight"),
    ];
    if let Some((_, to)) = renamed.iter().find(|(from, _)| *from == hf) {
        return to.to_string();
    }
    let rest = hf.strip_prefix("model.layers.").expect("a layer weight");
    let (layer, name) = rest.split_once('.').expect("layer.name");
    // Gemma-2's norms: one before and one after attention and the MLP.
    let gemma2_norms = [
        ("input_layernorm", "attn_norm"),
        ("post_attention_layernorm", "post_attention_norm"),
        ("pre_feedforward_layernorm", "ffn_norm"),
        ("post_feedforward_layernorm", "post_ffw_norm"),
    ];
    if let Some((_, to)) = gemma2_norms
        .iter()
        .find(|(from, _)| family.gemma2 && name.starts_with(from))
    {
        return format!("blk.{layer}.{to}.weight");
    }
    let name = [
        ("self_attn.qkv_proj", "attn_qkv"),
        ("mlp.gate_up_proj", "ffn_up"),
        ("self_attn.q_proj", "attn_q"),
        ("self_attn.k_proj", "attn_k"),
        ("self_attn.v_proj", "attn_v"),
        ("self_attn.o_proj", "attn_output"),
        ("self_attn.q_norm", "attn_q_norm"),
        ("self_attn.k_norm", "attn_k_norm"),
        ("mlp.gate_proj", "ffn_gate"),
        ("mlp.up_proj", "ffn_up"),
        ("mlp.down_proj", "ffn_down"),
        ("input_layernorm", "attn_norm"),
        ("post_attention_layernorm", "ffn_norm"),
    ]
    .iter()
    .fold(name.to_string(), |n, (from, to)| n.replace(from, to));
    format!("blk.{layer}.{name}")
}

/// Writes the tiny model of `family` as a GGUF file of architecture `arch`, with a word-level
/// gpt2-style vocabulary of `t0`, `t1`, …, RoPE base `rope_base` and `extra` metadata.
fn write_gguf(
    path: &Path,
    arch: &str,
    family: Family,
    rope_base: f32,
    extra: &[(&str, Value)],
) -> Result<()> {
    let tensors: HashMap<String, Tensor> = weights(family)?;
    let mut named: Vec<(String, QTensor)> = tensors
        .iter()
        .map(|(name, t)| {
            // GGUF files store Gemma-2's norm scales themselves, not minus one.
            let t = if family.gemma2 && name.contains("norm") {
                (t + 1.0)?
            } else {
                t.clone()
            };
            Ok((
                gguf_name(name, family),
                QTensor::quantize(&t, GgmlDType::F32)?,
            ))
        })
        .collect::<Result<_>>()?;
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let key = |name: &str| format!("{arch}.{name}");
    let mut metadata: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        // quantized_qwen3 keeps its RoPE tables in this dtype (0: f32; f16 when absent).
        ("general.dtype".into(), Value::U32(0)),
        (key("embedding_length"), Value::U32(HIDDEN as u32)),
        (key("block_count"), Value::U32(LAYERS as u32)),
        (key("feed_forward_length"), Value::U32(FFN as u32)),
        (key("attention.head_count"), Value::U32(HEADS as u32)),
        (key("attention.head_count_kv"), Value::U32(KV_HEADS as u32)),
        (
            key("attention.key_length"),
            Value::U32(family.head_dim as u32),
        ),
        (key("context_length"), Value::U32(1024)),
        (key("attention.layer_norm_rms_epsilon"), Value::F32(1e-6)),
        (key("rope.freq_base"), Value::F32(rope_base)),
        (
            key("rope.dimension_count"),
            Value::U32(family.head_dim as u32),
        ),
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        (
            "tokenizer.ggml.tokens".into(),
            Value::Array((0..VOCAB).map(|i| Value::String(format!("t{i}"))).collect()),
        ),
        ("tokenizer.ggml.merges".into(), Value::Array(vec![])),
        ("tokenizer.ggml.bos_token_id".into(), Value::U32(1)),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(2)),
    ];
    metadata.extend(extra.iter().map(|(k, v)| (key(k), v.clone())));
    let metadata: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensors: Vec<(&str, &QTensor)> = named.iter().map(|(k, t)| (k.as_str(), t)).collect();
    let mut file = std::fs::File::create(path)?;
    gguf_file::write(&mut file, &metadata, &tensors)?;
    Ok(())
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    Ok((a - b)?.abs()?.max(0)?.to_scalar::<f32>()?)
}

/// candle-transformers' quantized model of an architecture: logits `(vocab,)` of the last of
/// `tokens` after `offset` positions.
trait StockStep {
    fn step(&mut self, tokens: &[u32], offset: usize) -> Result<Tensor>;
}

fn input(tokens: &[u32]) -> Result<Tensor> {
    Ok(Tensor::new(tokens, &Device::Cpu)?.unsqueeze(0)?)
}

impl StockStep for quantized_qwen2::ModelWeights {
    fn step(&mut self, tokens: &[u32], offset: usize) -> Result<Tensor> {
        Ok(self.forward(&input(tokens)?, offset)?.flatten_all()?)
    }
}

impl StockStep for quantized_phi3::ModelWeights {
    fn step(&mut self, tokens: &[u32], offset: usize) -> Result<Tensor> {
        Ok(self.forward(&input(tokens)?, offset)?.flatten_all()?)
    }
}

/// Our decoder loading the same weights from an HF directory's tensors.
struct HfDecoder(Llama);

impl StockStep for HfDecoder {
    fn step(&mut self, tokens: &[u32], _offset: usize) -> Result<Tensor> {
        Ok(self.0.forward(tokens)?)
    }
}

impl StockStep for quantized_qwen3::ModelWeights {
    fn step(&mut self, tokens: &[u32], offset: usize) -> Result<Tensor> {
        Ok(self.forward(&input(tokens)?, offset)?.flatten_all()?)
    }
}

fn check(path: &Path, theirs: &mut dyn StockStep) -> Result<()> {
    let options = LoadOptions {
        weight_forms: WeightFormPolicy::Fixed(WeightForm::AsStored),
        ..LoadOptions::default()
    };
    let mut ours = Llama::load_with(path, &Device::Cpu, options)?.model;
    let mut rng = StdRng::seed_from_u64(5);
    let prompt: Vec<u32> = (0..40).map(|_| rng.random_range(3..VOCAB as u32)).collect();
    let mut ours_logits = ours.forward(&prompt)?;
    let mut stock_logits = theirs.step(&prompt, 0)?;
    let mut worst = 0f32;
    for step in 0..=32 {
        let scale = stock_logits.abs()?.max(0)?.to_scalar::<f32>()?.max(1.0);
        let diff = max_abs_diff(&ours_logits, &stock_logits)?;
        worst = worst.max(diff / scale);
        assert!(diff <= 1e-4 * scale, "step {step}: logits differ by {diff}");
        assert_eq!(
            ours_logits.argmax(0)?.to_scalar::<u32>()?,
            stock_logits.argmax(0)?.to_scalar::<u32>()?,
            "step {step}"
        );
        if step == 32 {
            break;
        }
        let next = rng.random_range(3..VOCAB as u32);
        ours_logits = ours.forward(&[next])?;
        stock_logits = theirs.step(&[next], prompt.len() + step)?;
    }
    println!(
        "{}: worst logit difference {worst:.2e} of the scale",
        path.display()
    );
    Ok(())
}

fn stock_content(path: &Path) -> Result<(gguf_file::Content, std::fs::File)> {
    let mut file = std::fs::File::open(path)?;
    let content = gguf_file::Content::read(&mut file)?;
    Ok((content, file))
}

#[test]
fn qwen2_gguf_matches_quantized_qwen2() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("qwen2.gguf");
    write_gguf(&path, "qwen2", QWEN2, 1e6, &[])?;
    let (content, mut file) = stock_content(&path)?;
    let mut theirs = quantized_qwen2::ModelWeights::from_gguf(content, &mut file, &Device::Cpu)?;
    check(&path, &mut theirs)
}

#[test]
fn qwen3_gguf_matches_quantized_qwen3() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("qwen3.gguf");
    write_gguf(&path, "qwen3", QWEN3, 1e6, &[])?;
    let (content, mut file) = stock_content(&path)?;
    let mut theirs = quantized_qwen3::ModelWeights::from_gguf(content, &mut file, &Device::Cpu)?;
    check(&path, &mut theirs)
}

#[test]
fn phi3_gguf_matches_quantized_phi3() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("phi3.gguf");
    // quantized_phi3 takes RoPE base 10,000 whatever the file says.
    write_gguf(&path, "phi3", PHI3, 10_000.0, &[])?;
    let (content, mut file) = stock_content(&path)?;
    let mut theirs =
        quantized_phi3::ModelWeights::from_gguf(false, content, &mut file, &Device::Cpu)?;
    check(&path, &mut theirs)
}

#[test]
fn gemma2_gguf_matches_the_hf_checkpoint() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("gemma2.gguf");
    let extra = [
        ("attn_logit_softcapping", Value::F32(2.0)),
        ("final_logit_softcapping", Value::F32(3.0)),
        ("attention.sliding_window", Value::U32(24)),
    ];
    write_gguf(&path, "gemma2", GEMMA2, 10_000.0, &extra)?;
    let json = GEMMA2_JSON.replace("\"sliding_window\": 4096", "\"sliding_window\": 24");
    let config = LlamaConfig::from_hf_json(&json)?;
    let vb = VarBuilder::from_tensors(weights(GEMMA2)?, DType::F32, &Device::Cpu);
    let hf = Llama::from_var_builder(vb, config.clone(), DType::F32, LoadOptions::default())?;
    let ours = Llama::load(&path, &Device::Cpu, Default::default())?.model;
    let from_gguf = ours.config();
    assert_eq!(
        (
            from_gguf.sliding_window,
            from_gguf.softmax_scale(),
            from_gguf.tie_word_embeddings
        ),
        (config.sliding_window, config.softmax_scale(), true)
    );
    check(&path, &mut HfDecoder(hf))
}

#[test]
fn unsupported_gguf_architectures_are_named() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("other.gguf");
    write_gguf(&path, "starcoder2", QWEN2, 1e6, &[])?;
    let Err(err) = Llama::load_with(&path, &Device::Cpu, LoadOptions::default()) else {
        panic!("a starcoder2 GGUF loaded")
    };
    assert!(
        err.to_string()
            .contains("supported: llama, qwen2, qwen3, phi3, gemma2"),
        "{err}"
    );
    Ok(())
}
