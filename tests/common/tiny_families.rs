//! Tiny random Mistral, Phi-3, Qwen2, Qwen3 and Gemma-2 models: their HF config.json, and HF-named
//! weights from one generator, for the family tests (HF directories and GGUF files alike).

use std::collections::HashMap;

use anyhow::Result;
use candle_core::{Device, Tensor};
use rand::{rngs::StdRng, Rng, SeedableRng};

pub const HIDDEN: usize = 128;
pub const FFN: usize = 352;
pub const VOCAB: usize = 300;
pub const LAYERS: usize = 2;
pub const HEADS: usize = 4;
pub const KV_HEADS: usize = 2;

pub const QWEN2_JSON: &str = r#"{
  "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
  "hidden_size": 128, "intermediate_size": 352, "vocab_size": 300,
  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
  "max_position_embeddings": 1024, "sliding_window": 1024, "max_window_layers": 2,
  "use_sliding_window": false, "tie_word_embeddings": true, "rope_theta": 1000000.0,
  "rms_norm_eps": 1e-6, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2
}"#;

pub const QWEN3_JSON: &str = r#"{
  "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
  "hidden_size": 128, "intermediate_size": 352, "vocab_size": 300, "head_dim": 64,
  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
  "attention_bias": false, "max_position_embeddings": 1024, "sliding_window": null,
  "max_window_layers": 2, "use_sliding_window": false, "tie_word_embeddings": false,
  "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "hidden_act": "silu", "bos_token_id": 1,
  "eos_token_id": 2
}"#;

pub const MISTRAL_JSON: &str = r#"{
  "architectures": ["MistralForCausalLM"], "model_type": "mistral",
  "hidden_size": 128, "intermediate_size": 352, "vocab_size": 300,
  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
  "max_position_embeddings": 1024, "sliding_window": null, "tie_word_embeddings": false,
  "rope_theta": 1000000.0, "rms_norm_eps": 1e-5, "hidden_act": "silu", "bos_token_id": 1,
  "eos_token_id": 2
}"#;

pub const PHI3_JSON: &str = r#"{
  "architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
  "hidden_size": 128, "intermediate_size": 352, "vocab_size": 300,
  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
  "max_position_embeddings": 1024, "original_max_position_embeddings": 1024,
  "sliding_window": 1023, "rope_scaling": null, "tie_word_embeddings": false,
  "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "hidden_act": "silu", "bos_token_id": 1,
  "eos_token_id": 2
}"#;

/// Soft caps far below Gemma-2's own (50 and 30), so that the tiny model's scores and logits bend.
pub const GEMMA2_JSON: &str = r#"{
  "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
  "hidden_size": 128, "intermediate_size": 352, "vocab_size": 300, "head_dim": 64,
  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
  "max_position_embeddings": 1024, "sliding_window": 4096, "query_pre_attn_scalar": 64,
  "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0, "attention_bias": false,
  "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
  "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "bos_token_id": 2, "eos_token_id": 1
}"#;

/// What sets a family's tiny model apart.
#[derive(Clone, Copy)]
pub struct Family {
    pub head_dim: usize,
    pub qkv_bias: bool,
    pub qk_norm: bool,
    pub tied: bool,
    /// q/k/v in one `qkv_proj` and gate/up in one `gate_up_proj` (Phi-3).
    pub joined_weights: bool,
    /// Norms before and after attention and the MLP, stored as the scale minus one (Gemma-2).
    pub gemma2: bool,
}

pub const MISTRAL: Family = Family {
    head_dim: HIDDEN / HEADS,
    qkv_bias: false,
    qk_norm: false,
    tied: false,
    joined_weights: false,
    gemma2: false,
};

pub const PHI3: Family = Family {
    head_dim: HIDDEN / HEADS,
    qkv_bias: false,
    qk_norm: false,
    tied: false,
    joined_weights: true,
    gemma2: false,
};

pub const QWEN2: Family = Family {
    head_dim: HIDDEN / HEADS,
    qkv_bias: true,
    qk_norm: false,
    tied: true,
    joined_weights: false,
    gemma2: false,
};

pub const QWEN3: Family = Family {
    head_dim: 64,
    qkv_bias: false,
    qk_norm: true,
    tied: false,
    joined_weights: false,
    gemma2: false,
};

pub const GEMMA2: Family = Family {
    head_dim: 64,
    qkv_bias: false,
    qk_norm: false,
    tied: true,
    joined_weights: false,
    gemma2: true,
};

fn random(rng: &mut StdRng, shape: &[usize], std: f32) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let bound = std * 3f32.sqrt();
    let data: Vec<f32> = (0..n).map(|_| rng.random_range(-bound..bound)).collect();
    Ok(Tensor::from_vec(data, shape, &Device::Cpu)?)
}

/// HF-named weights of a tiny model of `family`.
pub fn weights(family: Family) -> Result<HashMap<String, Tensor>> {
    let mut rng = StdRng::seed_from_u64(23);
    let mut w = HashMap::new();
    w.insert(
        "model.embed_tokens.weight".to_string(),
        random(&mut rng, &[VOCAB, HIDDEN], 0.5)?,
    );
    if !family.tied {
        w.insert(
            "lm_head.weight".to_string(),
            random(&mut rng, &[VOCAB, HIDDEN], 0.1)?,
        );
    }
    let d = family.head_dim;
    let (q, kv) = (HEADS * d, KV_HEADS * d);
    // Gemma-2 stores the scale minus one.
    let offset = if family.gemma2 { 0.0 } else { 1.0 };
    let norm = |rng: &mut StdRng, size: usize| -> Result<Tensor> {
        Ok((random(rng, &[size], 0.1)? + offset)?)
    };
    for i in 0..LAYERS {
        let p = format!("model.layers.{i}");
        for (name, shape, std) in [
            ("self_attn.q_proj.weight", vec![q, HIDDEN], 0.08),
            ("self_attn.k_proj.weight", vec![kv, HIDDEN], 0.08),
            ("self_attn.v_proj.weight", vec![kv, HIDDEN], 0.08),
            ("self_attn.o_proj.weight", vec![HIDDEN, q], 0.08),
            ("mlp.gate_proj.weight", vec![FFN, HIDDEN], 0.08),
            ("mlp.up_proj.weight", vec![FFN, HIDDEN], 0.08),
            ("mlp.down_proj.weight", vec![HIDDEN, FFN], 0.05),
        ] {
            w.insert(format!("{p}.{name}"), random(&mut rng, &shape, std)?);
        }
        if family.joined_weights {
            let take = |w: &mut HashMap<String, Tensor>, name: &str| {
                w.remove(&format!("{p}.{name}.weight"))
                    .expect("generated above")
            };
            let (q, k, v) = (
                take(&mut w, "self_attn.q_proj"),
                take(&mut w, "self_attn.k_proj"),
                take(&mut w, "self_attn.v_proj"),
            );
            let qkv = Tensor::cat(&[q, k, v], 0)?;
            w.insert(format!("{p}.self_attn.qkv_proj.weight"), qkv);
            let (gate, up) = (take(&mut w, "mlp.gate_proj"), take(&mut w, "mlp.up_proj"));
            w.insert(
                format!("{p}.mlp.gate_up_proj.weight"),
                Tensor::cat(&[gate, up], 0)?,
            );
        }
        if family.qkv_bias {
            for (name, size) in [("q_proj", q), ("k_proj", kv), ("v_proj", kv)] {
                let bias = random(&mut rng, &[size], 0.5)?;
                w.insert(format!("{p}.self_attn.{name}.bias"), bias);
            }
        }
        if family.qk_norm {
            for name in ["q_norm", "k_norm"] {
                w.insert(format!("{p}.self_attn.{name}.weight"), norm(&mut rng, d)?);
            }
        }
        for name in ["input_layernorm", "post_attention_layernorm"] {
            w.insert(format!("{p}.{name}.weight"), norm(&mut rng, HIDDEN)?);
        }
        if family.gemma2 {
            for name in ["pre_feedforward_layernorm", "post_feedforward_layernorm"] {
                w.insert(format!("{p}.{name}.weight"), norm(&mut rng, HIDDEN)?);
            }
        }
    }
    w.insert("model.norm.weight".to_string(), norm(&mut rng, HIDDEN)?);
    Ok(w)
}
