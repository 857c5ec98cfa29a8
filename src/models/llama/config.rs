//! Llama hyper-parameters, read from an HF `config.json` or from GGUF metadata.

use std::collections::HashMap;

use candle_core::quantized::gguf_file;
use candle_core::{bail, Result};
use serde::Deserialize;

/// How RoPE frequencies are rescaled for long context.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Every frequency divided by `factor` (position interpolation).
    Linear { factor: f32 },
    /// Llama 3.1's scheme: low frequencies divided by `factor`, high ones kept, a smooth ramp
    /// in between.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position_embeddings: usize,
    },
}

/// The hyper-parameters of a Llama model.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f32,
    pub rope_scaling: Option<RopeScaling>,
    /// The context length: positions covered by the RoPE tables and the KV cache.
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Biases on the q, k and v projections (Qwen2).
    pub attention_bias: bool,
    /// Per-head RMSNorm of q and k before RoPE (Qwen3).
    pub qk_norm: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

/// The `general.architecture`s of a GGUF file this decoder runs.
pub const SUPPORTED_GGUF_ARCHITECTURES: [&str; 3] = ["llama", "qwen2", "qwen3"];

/// A GGUF file's `general.architecture`, checked to be one this decoder runs.
pub(crate) fn gguf_architecture(content: &gguf_file::Content) -> Result<&str> {
    let arch = content
        .metadata
        .get("general.architecture")
        .and_then(|v| v.to_string().ok())
        .map(String::as_str)
        .unwrap_or("(missing)");
    if !SUPPORTED_GGUF_ARCHITECTURES.contains(&arch) {
        bail!(
            "gguf: general.architecture is `{arch}`; supported: {}",
            SUPPORTED_GGUF_ARCHITECTURES.join(", ")
        )
    }
    Ok(arch)
}

/// The `model_type`s of an HF config.json this decoder runs.
pub const SUPPORTED_MODEL_TYPES: [&str; 5] = ["llama", "mistral", "phi3", "qwen2", "qwen3"];

#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(u32),
    Many(Vec<u32>),
}

impl OneOrMany {
    fn into_vec(self) -> Vec<u32> {
        match self {
            Self::One(id) => vec![id],
            Self::Many(ids) => ids,
        }
    }
}

#[derive(Deserialize)]
struct HfRopeScaling {
    #[serde(alias = "type")]
    rope_type: Option<String>,
    factor: Option<f32>,
    low_freq_factor: Option<f32>,
    high_freq_factor: Option<f32>,
    original_max_position_embeddings: Option<usize>,
}

#[derive(Deserialize)]
struct HfConfig {
    hidden_size: usize,
    intermediate_size: usize,
    vocab_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: f64,
    rope_theta: Option<f32>,
    rope_scaling: Option<HfRopeScaling>,
    max_position_embeddings: usize,
    tie_word_embeddings: Option<bool>,
    bos_token_id: Option<u32>,
    eos_token_id: Option<OneOrMany>,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default)]
    mlp_bias: bool,
    model_type: Option<String>,
    use_sliding_window: Option<bool>,
    sliding_window: Option<usize>,
    partial_rotary_factor: Option<f64>,
}

/// `generation_config.json` often lists more end-of-turn tokens than `config.json`.
#[derive(Deserialize)]
struct HfGenerationConfig {
    eos_token_id: Option<OneOrMany>,
}

impl LlamaConfig {
    /// Parses an HF `config.json`.
    pub fn from_hf_json(json: &str) -> Result<Self> {
        let hf: HfConfig = serde_json::from_str(json)
            .map_err(|e| candle_core::Error::Msg(format!("llama config.json: {e}")))?;
        let model_type = hf.model_type.as_deref().unwrap_or("llama");
        let (attention_bias, qk_norm) = match model_type {
            "llama" => (hf.attention_bias, false),
            "mistral" => (false, false),
            // Phi-3's sliding_window is not applied, as in candle-transformers' Phi-3.
            "phi3" => (false, false),
            // Qwen2 always has q/k/v biases; its config does not say so.
            "qwen2" => (true, false),
            "qwen3" => (hf.attention_bias, true),
            other => bail!(
                "config.json: model_type `{other}` is not supported; supported: {}",
                SUPPORTED_MODEL_TYPES.join(", ")
            ),
        };
        if hf.partial_rotary_factor.is_some_and(|f| f != 1.0) {
            bail!(
                "config.json: partial_rotary_factor is not supported (RoPE over whole heads only)"
            )
        }
        if hf.mlp_bias {
            bail!("config.json: mlp_bias is not supported (MLP projections without biases only)")
        }
        let mistral_window = match (model_type, hf.sliding_window) {
            ("mistral", Some(w)) => w < hf.max_position_embeddings,
            _ => false,
        };
        if hf.use_sliding_window == Some(true) || mistral_window {
            bail!(
                "config.json: sliding-window attention (use_sliding_window, or a Mistral \
                 sliding_window below the context length) is not supported yet; full attention \
                 only (Mistral from v0.2 on)"
            )
        }
        let rope_scaling = match hf.rope_scaling {
            None => None,
            Some(s) => hf_rope_scaling(s)?,
        };
        let head_dim = hf
            .head_dim
            .unwrap_or(hf.hidden_size / hf.num_attention_heads.max(1));
        let config = Self {
            hidden_size: hf.hidden_size,
            intermediate_size: hf.intermediate_size,
            vocab_size: hf.vocab_size,
            num_hidden_layers: hf.num_hidden_layers,
            num_attention_heads: hf.num_attention_heads,
            num_key_value_heads: hf.num_key_value_heads.unwrap_or(hf.num_attention_heads),
            head_dim,
            rms_norm_eps: hf.rms_norm_eps,
            rope_theta: hf.rope_theta.unwrap_or(10_000.0),
            rope_scaling,
            max_position_embeddings: hf.max_position_embeddings,
            tie_word_embeddings: hf.tie_word_embeddings.unwrap_or(false),
            attention_bias,
            qk_norm,
            bos_token_id: hf.bos_token_id,
            eos_token_ids: hf.eos_token_id.map(OneOrMany::into_vec).unwrap_or_default(),
        };
        config.validate()?;
        Ok(config)
    }

    /// Adds the end-of-sequence ids of an HF `generation_config.json`.
    pub(crate) fn merge_generation_config(&mut self, json: &str) -> Result<()> {
        let gen: HfGenerationConfig = serde_json::from_str(json)
            .map_err(|e| candle_core::Error::Msg(format!("llama generation_config.json: {e}")))?;
        for id in gen
            .eos_token_id
            .map(OneOrMany::into_vec)
            .unwrap_or_default()
        {
            if !self.eos_token_ids.contains(&id) {
                self.eos_token_ids.push(id);
            }
        }
        Ok(())
    }

    /// Reads the `{arch}.*` and `tokenizer.ggml.*` metadata of a GGUF file, `arch` being its
    /// `general.architecture`, one of [`SUPPORTED_GGUF_ARCHITECTURES`].
    pub(crate) fn from_gguf(content: &gguf_file::Content) -> Result<Self> {
        let md = &content.metadata;
        let arch = gguf_architecture(content)?;
        let key = |name: &str| format!("{arch}.{name}");
        let usize_of =
            |name: &str| -> Result<usize> { Ok(required(md, &key(name))?.to_u32()? as usize) };
        let hidden_size = usize_of("embedding_length")?;
        let num_attention_heads = usize_of("attention.head_count")?;
        let num_key_value_heads = match md.get(&key("attention.head_count_kv")) {
            Some(v) => v.to_u32()? as usize,
            None => num_attention_heads,
        };
        let head_dim = match md.get(&key("attention.key_length")) {
            Some(v) => v.to_u32()? as usize,
            None => hidden_size / num_attention_heads.max(1),
        };
        let vocab_size = match md.get(&key("vocab_size")) {
            Some(v) => v.to_u32()? as usize,
            None => match md.get("tokenizer.ggml.tokens") {
                Some(tokens) => tokens.to_vec()?.len(),
                None => {
                    bail!("gguf: neither {arch}.vocab_size nor tokenizer.ggml.tokens is present")
                }
            },
        };
        let rope_scaling = match md
            .get(&key("rope.scaling.type"))
            .map(|v| v.to_string().map(String::as_str))
            .transpose()?
        {
            None | Some("none") => None,
            Some("linear") => Some(RopeScaling::Linear {
                factor: required(md, &key("rope.scaling.factor"))?.to_f32()?,
            }),
            Some(other) => bail!(
                "gguf: {arch}.rope.scaling.type `{other}` is not supported; supported: none, \
                 linear (Llama 3 scaling comes as the rope_freqs tensor)"
            ),
        };
        let config = Self {
            hidden_size,
            intermediate_size: usize_of("feed_forward_length")?,
            vocab_size,
            num_hidden_layers: usize_of("block_count")?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps: required(md, &key("attention.layer_norm_rms_epsilon"))?.to_f32()? as f64,
            rope_theta: match md.get(&key("rope.freq_base")) {
                Some(v) => v.to_f32()?,
                None => 10_000.0,
            },
            rope_scaling,
            max_position_embeddings: usize_of("context_length")?,
            tie_word_embeddings: !content.tensor_infos.contains_key("output.weight"),
            attention_bias: arch == "qwen2",
            qk_norm: arch == "qwen3",
            bos_token_id: md
                .get("tokenizer.ggml.bos_token_id")
                .map(|v| v.to_u32())
                .transpose()?,
            eos_token_ids: md
                .get("tokenizer.ggml.eos_token_id")
                .map(|v| v.to_u32())
                .transpose()?
                .into_iter()
                .collect(),
        };
        config.validate()?;
        Ok(config)
    }

    /// Checks that the sizes fit together.
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("vocab_size", self.vocab_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, v)| *v == 0) {
            bail!("llama config: {name} must be at least 1")
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            bail!(
                "llama config: num_attention_heads ({}) must be a multiple of num_key_value_heads ({})",
                self.num_attention_heads,
                self.num_key_value_heads
            )
        }
        if !self.head_dim.is_multiple_of(2) {
            bail!(
                "llama config: head_dim ({}) must be even for RoPE",
                self.head_dim
            )
        }
        Ok(())
    }
}

fn required<'a>(
    md: &'a HashMap<String, gguf_file::Value>,
    key: &str,
) -> Result<&'a gguf_file::Value> {
    match md.get(key) {
        Some(v) => Ok(v),
        None => bail!("gguf: metadata key `{key}` is missing"),
    }
}

fn hf_rope_scaling(s: HfRopeScaling) -> Result<Option<RopeScaling>> {
    let missing = |field: &str| {
        candle_core::Error::Msg(format!("llama config.json: rope_scaling needs `{field}`"))
    };
    match s.rope_type.as_deref().unwrap_or("default") {
        "default" => Ok(None),
        "linear" => Ok(Some(RopeScaling::Linear {
            factor: s.factor.ok_or_else(|| missing("factor"))?,
        })),
        "llama3" => {
            let scaling = RopeScaling::Llama3 {
                factor: s.factor.ok_or_else(|| missing("factor"))?,
                low_freq_factor: s
                    .low_freq_factor
                    .ok_or_else(|| missing("low_freq_factor"))?,
                high_freq_factor: s
                    .high_freq_factor
                    .ok_or_else(|| missing("high_freq_factor"))?,
                original_max_position_embeddings: s
                    .original_max_position_embeddings
                    .ok_or_else(|| missing("original_max_position_embeddings"))?,
            };
            if let RopeScaling::Llama3 {
                low_freq_factor,
                high_freq_factor,
                ..
            } = scaling
            {
                if high_freq_factor <= low_freq_factor {
                    bail!(
                        "llama config.json: rope_scaling high_freq_factor ({high_freq_factor}) must \
                         exceed low_freq_factor ({low_freq_factor})"
                    )
                }
            }
            Ok(Some(scaling))
        }
        other => bail!(
            "llama config.json: rope_scaling type `{other}` is not supported; supported: default, \
             linear, llama3"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LLAMA31_8B: &str = r#"{
        "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
        "vocab_size": 128256, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
        "max_position_embeddings": 131072, "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009], "torch_dtype": "bfloat16",
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"}
    }"#;

    #[test]
    fn parses_a_llama31_config() -> Result<()> {
        let c = LlamaConfig::from_hf_json(LLAMA31_8B)?;
        assert_eq!(c.head_dim, 128);
        assert_eq!(c.num_key_value_heads, 8);
        assert_eq!(c.eos_token_ids, [128001, 128008, 128009]);
        assert!(!c.tie_word_embeddings);
        assert_eq!(
            c.rope_scaling,
            Some(RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192
            })
        );
        Ok(())
    }

    #[test]
    fn rejects_unsupported_configs() {
        let yarn = LLAMA31_8B.replace("\"llama3\"", "\"yarn\"");
        let err = LlamaConfig::from_hf_json(&yarn).unwrap_err().to_string();
        assert!(err.contains("`yarn` is not supported"), "{err}");
        let bad_gqa =
            LLAMA31_8B.replace("\"num_key_value_heads\": 8", "\"num_key_value_heads\": 5");
        let err = LlamaConfig::from_hf_json(&bad_gqa).unwrap_err().to_string();
        assert!(err.contains("multiple of num_key_value_heads"), "{err}");
    }
}
