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

/// Which layers attend through a sliding window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WindowedLayers {
    /// Every layer (Mistral v0.1, Phi-3).
    All,
    /// Layers 0, 2, 4, …; the others attend to everything (Gemma-2).
    Even,
    /// Layers from this index on (Qwen2 and Qwen3 with `use_sliding_window`).
    From(usize),
}

/// Sliding-window attention: in the layers it applies to, a token sees the last `size` positions,
/// its own included.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlidingWindow {
    pub size: usize,
    pub layers: WindowedLayers,
}

/// What Gemma-2 adds to the Llama layer: norms after attention and after the MLP as well as
/// before them, a GELU (tanh) MLP, embeddings scaled by √hidden_size, and soft-capped scores and
/// logits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gemma2Extras {
    /// Attention scores (after the softmax scale) become c·tanh(s/c).
    pub attn_logit_softcapping: Option<f32>,
    /// Final logits become c·tanh(x/c).
    pub final_logit_softcapping: Option<f32>,
    /// Scores are scaled by 1/√query_pre_attn_scalar rather than 1/√head_dim.
    pub query_pre_attn_scalar: f32,
    /// The norm weights are stored as the scale minus one (HF checkpoints; GGUF files store the
    /// scale itself).
    pub norm_weights_minus_one: bool,
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
    /// Sliding-window attention in some or all layers.
    pub sliding_window: Option<SlidingWindow>,
    /// Gemma-2's additions to the layer; `None` for the other families.
    pub gemma2: Option<Gemma2Extras>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

/// The shape HF transformers' `LlamaConfig` defaults to (Llama 2 7B: 32 layers of 32 heads of
/// 128, hidden size 4096, a 32000-token vocabulary, a 2048-token context), as plain Llama: no
/// RoPE scaling, biases, q/k norms, window or Gemma-2 additions, and no special tokens. Name
/// what differs: `LlamaConfig { num_hidden_layers: 2, ..Default::default() }`.
impl Default for LlamaConfig {
    fn default() -> Self {
        Self {
            hidden_size: 4096,
            intermediate_size: 11008,
            vocab_size: 32000,
            num_hidden_layers: 32,
            num_attention_heads: 32,
            num_key_value_heads: 32,
            head_dim: 128,
            rms_norm_eps: 1e-6,
            rope_theta: 10_000.0,
            rope_scaling: None,
            max_position_embeddings: 2048,
            tie_word_embeddings: false,
            attention_bias: false,
            qk_norm: false,
            sliding_window: None,
            gemma2: None,
            bos_token_id: None,
            eos_token_ids: Vec::new(),
        }
    }
}

/// The `general.architecture`s of a GGUF file this decoder runs.
pub const SUPPORTED_GGUF_ARCHITECTURES: [&str; 5] = ["llama", "qwen2", "qwen3", "phi3", "gemma2"];

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
pub const SUPPORTED_MODEL_TYPES: [&str; 6] =
    ["llama", "mistral", "phi3", "qwen2", "qwen3", "gemma2"];

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
    max_window_layers: Option<usize>,
    partial_rotary_factor: Option<f64>,
    hidden_act: Option<String>,
    hidden_activation: Option<String>,
    attn_logit_softcapping: Option<f32>,
    final_logit_softcapping: Option<f32>,
    query_pre_attn_scalar: Option<f32>,
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
            .map_err(|e| candle_core::Error::Msg(format!("config.json: {e}")))?;
        let model_type = hf.model_type.as_deref().unwrap_or("llama");
        let (attention_bias, qk_norm) = match model_type {
            "llama" | "gemma2" => (hf.attention_bias, false),
            "mistral" | "phi3" => (false, false),
            // Qwen2 always has q/k/v biases; its config does not say so.
            "qwen2" => (true, false),
            "qwen3" => (hf.attention_bias, true),
            other => bail!(
                "config.json: model_type `{other}` is not supported; supported: {}",
                SUPPORTED_MODEL_TYPES.join(", ")
            ),
        };
        let head_dim = hf
            .head_dim
            .unwrap_or(hf.hidden_size / hf.num_attention_heads.max(1));
        let activation = hf.hidden_activation.as_deref().or(hf.hidden_act.as_deref());
        let expected = if model_type == "gemma2" {
            "gelu_pytorch_tanh"
        } else {
            "silu"
        };
        if activation.is_some_and(|a| a != expected) {
            bail!(
                "config.json: a {model_type} MLP with activation `{}` is not supported; supported: \
                 {expected}",
                activation.unwrap_or_default()
            )
        }
        let windowed_layers = match model_type {
            // Applied as the reference implementations apply them; older Mistrals and Phi-3 use
            // windows in every layer.
            "mistral" | "phi3" => Some(WindowedLayers::All),
            "gemma2" => Some(WindowedLayers::Even),
            "qwen2" | "qwen3" if hf.use_sliding_window == Some(true) => {
                Some(WindowedLayers::From(hf.max_window_layers.unwrap_or(0)))
            }
            _ => None,
        };
        // A window that covers the whole context changes nothing.
        let sliding_window = match (windowed_layers, hf.sliding_window) {
            (Some(layers), Some(size)) if size < hf.max_position_embeddings => {
                Some(SlidingWindow { size, layers })
            }
            _ => None,
        };
        let gemma2 = (model_type == "gemma2").then(|| Gemma2Extras {
            attn_logit_softcapping: hf.attn_logit_softcapping,
            final_logit_softcapping: hf.final_logit_softcapping,
            query_pre_attn_scalar: hf.query_pre_attn_scalar.unwrap_or(head_dim as f32),
            norm_weights_minus_one: true,
        });
        if hf.partial_rotary_factor.is_some_and(|f| f != 1.0) {
            bail!(
                "config.json: partial_rotary_factor is not supported (RoPE over whole heads only)"
            )
        }
        if hf.mlp_bias {
            bail!("config.json: mlp_bias is not supported (MLP projections without biases only)")
        }
        let rope_scaling = match hf.rope_scaling {
            None => None,
            Some(s) => hf_rope_scaling(s)?,
        };
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
            // Gemma-2 ties them unless told otherwise.
            tie_word_embeddings: hf.tie_word_embeddings.unwrap_or(model_type == "gemma2"),
            attention_bias,
            qk_norm,
            sliding_window,
            gemma2,
            bos_token_id: hf.bos_token_id,
            eos_token_ids: hf.eos_token_id.map(OneOrMany::into_vec).unwrap_or_default(),
        };
        config.validate()?;
        Ok(config)
    }

    /// Adds the end-of-sequence ids of an HF `generation_config.json`.
    pub(crate) fn merge_generation_config(&mut self, json: &str) -> Result<()> {
        let gen: HfGenerationConfig = serde_json::from_str(json)
            .map_err(|e| candle_core::Error::Msg(format!("generation_config.json: {e}")))?;
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
        if let Some(rotary) = md.get(&key("rope.dimension_count")) {
            if rotary.to_u32()? as usize != head_dim {
                bail!(
                    "gguf: {arch}.rope.dimension_count ({}) differs from the head dim ({head_dim}); \
                     RoPE over whole heads only",
                    rotary.to_u32()?
                )
            }
        }
        if content
            .tensor_infos
            .contains_key("rope_factors_long.weight")
        {
            bail!("gguf: long-context RoPE factors (Phi-3 longrope) are not supported")
        }
        let f32_of = |name: &str| md.get(&key(name)).map(|v| v.to_f32()).transpose();
        let context_length = usize_of("context_length")?;
        let sliding_window = match md.get(&key("attention.sliding_window")) {
            // A window that covers the whole context changes nothing.
            Some(size) if (size.to_u32()? as usize) < context_length => {
                let layers = match arch {
                    "gemma2" => WindowedLayers::Even,
                    _ => WindowedLayers::All,
                };
                Some(SlidingWindow {
                    size: size.to_u32()? as usize,
                    layers,
                })
            }
            _ => None,
        };
        let num_hidden_layers = usize_of("block_count")?;
        let gemma2 = match arch {
            "gemma2" => Some(Gemma2Extras {
                attn_logit_softcapping: f32_of("attn_logit_softcapping")?,
                final_logit_softcapping: f32_of("final_logit_softcapping")?,
                // GGUF does not store it. Of the released Gemma-2s only the 27B (46 layers)
                // scales by something other than the head dim: hidden_size / heads.
                query_pre_attn_scalar: if num_hidden_layers == 46 {
                    (hidden_size / num_attention_heads.max(1)) as f32
                } else {
                    head_dim as f32
                },
                // The converters store the scale itself.
                norm_weights_minus_one: false,
            }),
            _ => None,
        };
        let config = Self {
            hidden_size,
            intermediate_size: usize_of("feed_forward_length")?,
            vocab_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps: required(md, &key("attention.layer_norm_rms_epsilon"))?.to_f32()? as f64,
            rope_theta: match md.get(&key("rope.freq_base")) {
                Some(v) => v.to_f32()?,
                None => 10_000.0,
            },
            rope_scaling,
            max_position_embeddings: context_length,
            tie_word_embeddings: !content.tensor_infos.contains_key("output.weight"),
            attention_bias: arch == "qwen2",
            qk_norm: arch == "qwen3",
            sliding_window,
            gemma2,
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

    /// The sliding window of layer `layer` as the op takes it: how many positions before its own
    /// a token sees, or `None` for full attention.
    pub fn window_left(&self, layer: usize) -> Option<usize> {
        let window = self.sliding_window?;
        let windowed = match window.layers {
            WindowedLayers::All => true,
            WindowedLayers::Even => layer.is_multiple_of(2),
            WindowedLayers::From(first) => layer >= first,
        };
        windowed.then(|| window.size - 1)
    }

    /// Whether the layers can be joined for the fused decode kernels, which add no biases, norm
    /// no heads and know only the Llama layer with SwiGLU.
    pub(crate) fn joins_for_fused_kernels(&self) -> bool {
        !self.attention_bias && !self.qk_norm && self.gemma2.is_none()
    }

    /// The MLP's activation: SiLU (SwiGLU), or GELU with the tanh approximation (Gemma-2).
    pub(crate) fn mlp_activation(&self) -> candle_nn::Activation {
        match self.gemma2 {
            Some(_) => candle_nn::Activation::GeluPytorchTanh,
            None => candle_nn::Activation::Silu,
        }
    }

    /// The softmax scale of the attention scores.
    pub fn softmax_scale(&self) -> f32 {
        let scalar = self
            .gemma2
            .map_or(self.head_dim as f32, |g| g.query_pre_attn_scalar);
        1.0 / scalar.sqrt()
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
            bail!("model config: {name} must be at least 1")
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            bail!(
                "model config: num_attention_heads ({}) must be a multiple of num_key_value_heads ({})",
                self.num_attention_heads,
                self.num_key_value_heads
            )
        }
        if let Some(window) = &self.sliding_window {
            if window.size < 2 {
                bail!(
                    "model config: sliding_window ({}) must be at least 2 (a token and the one \
                     before it)",
                    window.size
                )
            }
        }
        if let Some(g) = &self.gemma2 {
            let scalar_ok = g.query_pre_attn_scalar.is_finite() && g.query_pre_attn_scalar > 0.0;
            let caps_ok = [g.attn_logit_softcapping, g.final_logit_softcapping]
                .iter()
                .flatten()
                .all(|c| c.is_finite() && *c > 0.0);
            if !scalar_ok || !caps_ok {
                bail!(
                    "model config: query_pre_attn_scalar and the soft caps must be finite and \
                     positive, got {g:?}"
                )
            }
        }
        if !self.head_dim.is_multiple_of(2) {
            bail!(
                "model config: head_dim ({}) must be even for RoPE",
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
    let missing =
        |field: &str| candle_core::Error::Msg(format!("config.json: rope_scaling needs `{field}`"));
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
                        "config.json: rope_scaling high_freq_factor ({high_freq_factor}) must \
                         exceed low_freq_factor ({low_freq_factor})"
                    )
                }
            }
            Ok(Some(scaling))
        }
        other => bail!(
            "config.json: rope_scaling type `{other}` is not supported; supported: default, \
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
    fn the_default_is_a_valid_llama2_7b_shape() -> Result<()> {
        let c = LlamaConfig::default();
        c.validate()?;
        assert_eq!(c.num_attention_heads * c.head_dim, c.hidden_size);
        assert_eq!(c.window_left(0), None);
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
