//! Llama (RMSNorm, SwiGLU, grouped-query attention, RoPE with Llama 3 scaling) decoding through
//! the split-KV op, and the families of the same shape: Mistral, Phi-3 (joined q/k/v and gate/up
//! weights, split at load), Qwen2 (q/k/v biases), Qwen3 (per-head q/k norms) and Gemma-2 (norms
//! after attention and the MLP as well, GELU, scaled embeddings, soft-capped scores and logits),
//! with the sliding windows each applies (see [`LlamaConfig::window_left`]).
//!
//! Each layer applies RoPE as its own op, then hands q, k and v to [`CachedAttention`], which
//! appends k and v to a [`KvCache`] in place and attends over it with the split-KV op. A prompt
//! goes in chunks of [`LoadOptions::prefill_chunk`] tokens, each a block of queries over the
//! cache before it, so that a long prompt holds one chunk's activations at a time. Weights load from an HF directory (config.json,
//! tokenizer.json, *.safetensors) or from a GGUF file (tokenizer and chat template from its
//! metadata); see [`Llama::load`].

mod attention_probe;
mod config;
#[cfg(feature = "cuda")]
mod device_step;
mod gguf;
mod hf;
mod joined;
mod mixed;
mod paged;
mod rope;

use std::cell::RefCell;
use std::path::Path;
use std::sync::Arc;

use candle_core::{bail, DType, Device, Module, Result, Tensor};
use candle_nn::{Embedding, RmsNorm, VarBuilder};

use super::gguf_rows::{GgufRows, PackedBlocks};
use super::linear::{Linear, RowSplit};
use super::residual;
use crate::nn::attention::{AttentionStep, CachedAttention, DeviceLengths};
use crate::nn::cache::{KvCache, KvCacheConfig};
use crate::nn::paged_cache::{MixedStep, PagedKvCache, PagedStep};

pub use super::weight_form::{WeightChoice, WeightForm, WeightFormPolicy};
/// The crate root's [`AttentionBackend`](crate::AttentionBackend), under the path the
/// summarizer imports it by; hidden from the docs, and to go once it imports the root's.
#[doc(hidden)]
pub use crate::nn::AttentionBackend;
use attention_probe::{attention_weights, QueryRecord};
pub use config::{Gemma2Extras, LlamaConfig, RopeScaling, SlidingWindow, WindowedLayers};
use joined::{JoinedHead, JoinedLayer, LayerTensors};
pub use rope::{RopeAngles, RopeLayout, RotaryEmbedding};

/// Positions each layer's cache holds before its first growth (capped at the context length).
const DEFAULT_INITIAL_CACHE_CAPACITY: usize = 1024;

/// Prompt tokens per chunk of a prefill (see [`LoadOptions::prefill_chunk`]).
pub const DEFAULT_PREFILL_CHUNK: usize = 2048;

/// Options of [`Llama::load_with`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoadOptions {
    pub backend: AttentionBackend,
    /// Activation, cache and dense-weight dtype. `None`: f32 on the CPU; on other devices the
    /// checkpoint's `torch_dtype` (bf16 when absent). GGUF models run in f32, except small llama
    /// ones on CUDA, which run dense in bf16 (f16 or bf16 may be asked for there).
    pub dtype: Option<DType>,
    /// How GGUF weight forms are chosen.
    pub weight_forms: WeightFormPolicy,
    /// KV cache dtype: f32, f16, bf16 or f8e4m3. `None`: the activation dtype. A narrower one
    /// (f16 under f32) halves the bytes a decode step reads; on the CPU, where the op is
    /// compute-bound at these sizes, f32 measured faster (docs/perf-log.md, "CPU cache dtype").
    /// fp8 (`F8E4M3`, e4m3) stores half the bytes of bf16 per position, with 3 mantissa bits:
    /// keys and values are stored divided by [`LoadOptions::cache_k_scale`] and
    /// [`LoadOptions::cache_v_scale`] and saturate at ±448 × the scale.
    pub cache_dtype: Option<DType>,
    /// Keys are cached divided by this and read back times it (1.0 by default): with an fp8
    /// cache, a scale above the largest key magnitude / 448 keeps keys from saturating, a
    /// smaller one keeps more precision for small keys. Finite and positive.
    pub cache_k_scale: f32,
    /// Values are cached divided by this and read back times it (1.0 by default), as keys are
    /// by [`LoadOptions::cache_k_scale`].
    pub cache_v_scale: f32,
    /// Positions allocated per layer cache up front; the cache doubles from there.
    pub initial_cache_capacity: usize,
    /// Join each layer's dense projections (q/k/v, gate/up) for the fused decode kernels.
    /// `None`: where those kernels run, i.e. f16/bf16 on CUDA. Dense (HF) checkpoints without
    /// attention biases or q/k norms only (the fused kernels have neither): Qwen2 and Qwen3
    /// layers stay separate.
    pub joined_layers: Option<bool>,
    /// Prompt tokens written to the cache and attended per chunk ([`DEFAULT_PREFILL_CHUNK`] by
    /// default, at least 1). Each chunk is a block of queries over the whole cache before it,
    /// so a prompt of any length holds one chunk's activations at a time (q/k/v, the MLP's
    /// intermediates, attention scores), while a chunk of 2048 rows keeps the projections'
    /// matmuls as efficient as the whole prompt's would be. Results agree with one pass over
    /// the whole prompt to rounding.
    pub prefill_chunk: usize,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            backend: AttentionBackend::SplitKv,
            dtype: None,
            weight_forms: WeightFormPolicy::Measure,
            cache_dtype: None,
            cache_k_scale: 1.0,
            cache_v_scale: 1.0,
            initial_cache_capacity: DEFAULT_INITIAL_CACHE_CAPACITY,
            joined_layers: None,
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
        }
    }
}

/// A loaded model with what is needed to talk to it.
pub struct LoadedModel {
    pub model: Llama,
    pub tokenizer: tokenizers::Tokenizer,
    /// The Jinja chat template, when the checkpoint has one.
    pub chat_template: Option<String>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

/// The weight form a pass multiplies its rows in (see [`Linear`]).
#[derive(Debug, Clone, Copy)]
enum Rows<'a> {
    /// The single-row form for one row, the many-row form for more (a prompt).
    BySize,
    /// Every row in the single-row form, and attention as one-token steps: a few tokens being
    /// verified, computed as decoding computes them.
    AsDecode,
    /// Some rows as a decode step multiplies them, the others as a prompt's: a step of decode
    /// rows beside prompt chunks.
    Split(&'a RowSplit),
}

impl Rows<'_> {
    /// Whether `n` rows are all multiplied in the single-row form.
    fn single_row_form(self, n: usize) -> bool {
        match self {
            Rows::BySize => n == 1,
            Rows::AsDecode => true,
            Rows::Split(_) => false,
        }
    }

    /// Whether `n` rows are all multiplied in the many-row form.
    fn many_row_form(self, n: usize) -> bool {
        matches!(self, Rows::BySize) && n > 1
    }

    fn project(self, linear: &Linear, x: &Tensor) -> Result<Tensor> {
        match self {
            Rows::BySize => linear.forward(x),
            Rows::AsDecode => linear.forward_single_row_form(x),
            Rows::Split(split) => linear.forward_split(x, split),
        }
    }
}

/// The LSE `(1, h_q, t)` of each layer's split-KV attention, in layer order.
type LseRecord = RefCell<Vec<Tensor>>;

/// Where a pass's keys and values go in the caches: after the lengths the host counts (with the
/// attention's LSE recorded, or not), or at lengths held in device memory (a step that a CUDA
/// graph can replay).
#[derive(Debug, Clone, Copy)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
enum Positions<'a> {
    Host(Rows<'a>),
    Recorded(&'a LseRecord),
    /// After the lengths the host counts, each layer's queries recorded.
    Probed(&'a QueryRecord),
    Device(&'a DeviceLengths),
}

impl<'a> Positions<'a> {
    fn rows(self) -> Rows<'a> {
        match self {
            Positions::Host(rows) => rows,
            Positions::Recorded(_) | Positions::Probed(_) | Positions::Device(_) => Rows::BySize,
        }
    }
}

/// Where one layer's keys and values go: the model's own cache of the layer, at `Positions`, or
/// layer `layer` of a paged cache, at the step's positions (multiplied in the form `rows`).
enum LayerKv<'a> {
    Own(&'a mut KvCache, Positions<'a>),
    Paged {
        cache: &'a PagedKvCache,
        layer: usize,
        step: &'a PagedStep,
        rows: Rows<'a>,
    },
    /// Layer `layer` of a paged cache, at the positions a mixed step made room for; the pass's
    /// tokens are the step's, end to end as one sequence.
    Mixed {
        cache: &'a PagedKvCache,
        layer: usize,
        step: &'a MixedStep,
        rows: Rows<'a>,
    },
}

impl<'a> LayerKv<'a> {
    fn rows(&self) -> Rows<'a> {
        match self {
            LayerKv::Own(_, positions) => positions.rows(),
            LayerKv::Paged { rows, .. } | LayerKv::Mixed { rows, .. } => *rows,
        }
    }

    /// Appends k and v to the layer's cache and attends q over it.
    fn attend(
        self,
        attention: &CachedAttention,
        (q, k, v): (&Tensor, &Tensor, &Tensor),
    ) -> Result<Tensor> {
        let step = match self {
            LayerKv::Own(cache, Positions::Host(Rows::BySize | Rows::Split(_))) => {
                AttentionStep::new(cache)
            }
            LayerKv::Own(cache, Positions::Host(Rows::AsDecode)) => {
                AttentionStep::new(cache).as_decode_steps()
            }
            LayerKv::Own(cache, Positions::Recorded(record)) => {
                let mut lse = None;
                let out =
                    attention.forward(q, k, v, AttentionStep::new(cache).with_lse(&mut lse))?;
                record.borrow_mut().extend(lse);
                return Ok(out);
            }
            LayerKv::Own(cache, Positions::Probed(record)) => {
                record.borrow_mut().push(q.clone());
                AttentionStep::new(cache)
            }
            LayerKv::Own(cache, Positions::Device(lengths)) => AttentionStep::at(cache, lengths),
            LayerKv::Paged {
                cache, layer, step, ..
            } => AttentionStep::paged(cache, layer, step),
            LayerKv::Mixed {
                cache, layer, step, ..
            } => AttentionStep::mixed(cache, layer, step),
        };
        attention.forward(q, k, v, step)
    }
}

#[derive(Debug, Clone)]
struct SelfAttention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    /// Per-head RMSNorm of q and k before RoPE (Qwen3).
    qk_norms: Option<(RmsNorm, RmsNorm)>,
    /// q, k and v's rows joined in their single-row form (GGUF blocks as stored, no biases):
    /// one product for the three in a decode step, each output what its own projection gives.
    decode_qkv: Option<Arc<GgufRows>>,
    /// q, k and v's rows joined in their many-row form (GGUF blocks repacked, no biases): one
    /// product for the three in a prompt, the input quantized once.
    prompt_qkv: Option<Arc<PackedBlocks>>,
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl SelfAttention {
    /// `x (b, t, hidden)` → `(b, t, hidden)`; appends this step's keys and values where `kv`
    /// says.
    fn forward(
        &self,
        x: &Tensor,
        angles: &RopeAngles,
        attention: &CachedAttention,
        kv: LayerKv,
    ) -> Result<Tensor> {
        let rows = kv.rows();
        let (b, t, _) = x.dims3()?;
        let joined = match (&self.decode_qkv, &self.prompt_qkv) {
            (Some(qkv), _) if rows.single_row_form(b * t) => Some(qkv.forward(x)?),
            (_, Some(qkv)) if rows.many_row_form(b * t) => Some(qkv.forward(x)?),
            _ => None,
        };
        let (q, k, v) = match joined {
            Some(qkv) => {
                let (q_size, kv_size) =
                    (self.q_heads * self.head_dim, self.kv_heads * self.head_dim);
                (
                    qkv.narrow(2, 0, q_size)?,
                    qkv.narrow(2, q_size, kv_size)?,
                    qkv.narrow(2, q_size + kv_size, kv_size)?,
                )
            }
            _ => (
                rows.project(&self.q_proj, x)?,
                rows.project(&self.k_proj, x)?,
                rows.project(&self.v_proj, x)?,
            ),
        };
        let q = q.reshape((b, t, self.q_heads, self.head_dim))?;
        let k = k.reshape((b, t, self.kv_heads, self.head_dim))?;
        let v = v.reshape((b, t, self.kv_heads, self.head_dim))?;
        let (q, k) = match &self.qk_norms {
            Some((q_norm, k_norm)) => (q_norm.forward(&q)?, k_norm.forward(&k)?),
            None => (q, k),
        };
        let q = angles.apply(&q)?;
        let k = angles.apply(&k)?;
        let y = kv.attend(attention, (&q, &k, &v))?;
        rows.project(
            &self.o_proj,
            &y.reshape((b, t, self.q_heads * self.head_dim))?,
        )
    }
}

#[derive(Debug, Clone)]
struct Mlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
    /// SiLU, or Gemma-2's GELU (tanh approximation).
    activation: candle_nn::Activation,
    /// Gate and up's rows joined in their single-row form with SiLU(gate) × up applied to the
    /// product (SiLU layers, GGUF blocks as stored): one product in a decode step.
    decode_gate_up: Option<Arc<GgufRows>>,
    /// The same in their many-row form (GGUF blocks repacked): one product in a prompt.
    prompt_gate_up: Option<Arc<PackedBlocks>>,
}

impl Mlp {
    fn forward(&self, x: &Tensor, rows: Rows<'_>) -> Result<Tensor> {
        rows.project(&self.down_proj, &self.activated(x, rows)?)
    }

    /// The down projection's input: `activation(gate) × up`.
    fn activated(&self, x: &Tensor, rows: Rows<'_>) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        if let Some(gate_up) = &self.decode_gate_up {
            if rows.single_row_form(b * t) {
                return gate_up.forward(x);
            }
        }
        if let Some(gate_up) = &self.prompt_gate_up {
            if rows.many_row_form(b * t) {
                return gate_up.forward(x);
            }
            // Prompt rows beside decode rows go through the same joined product as a prompt
            // alone: its SiLU rounds unlike candle's, and 8-bit inputs would carry the
            // difference into later layers.
            if let Rows::Split(split) = rows {
                let single = self.activated(&x.index_select(&split.single, 1)?, Rows::AsDecode)?;
                let many = gate_up.forward(&x.index_select(&split.many, 1)?)?;
                return Tensor::cat(&[single, many], 1)?.index_select(&split.order, 1);
            }
        }
        let gate = rows.project(&self.gate_proj, x)?.apply(&self.activation)?;
        gate.mul(&rows.project(&self.up_proj, x)?)
    }
}

/// Gemma-2's norms of the attention's and the MLP's outputs, before each joins the residual.
#[derive(Debug, Clone)]
struct OutputNorms {
    attention: RmsNorm,
    mlp: RmsNorm,
}

#[derive(Debug, Clone)]
struct DecoderLayer {
    input_norm: RmsNorm,
    attention: SelfAttention,
    /// The norm before the MLP (HF's `post_attention_layernorm`, Gemma-2's
    /// `pre_feedforward_layernorm`).
    post_attention_norm: RmsNorm,
    mlp: Mlp,
    output_norms: Option<OutputNorms>,
}

impl DecoderLayer {
    fn forward(
        &self,
        x: &Tensor,
        angles: &RopeAngles,
        attention: &CachedAttention,
        kv: LayerKv,
    ) -> Result<Tensor> {
        let rows = kv.rows();
        let h = self.input_norm.forward(x)?;
        let mut h = self.attention.forward(&h, angles, attention, kv)?;
        if let Some(norms) = &self.output_norms {
            h = norms.attention.forward(&h)?;
        }
        let x = residual::add(x, &h)?;
        let mut h = self
            .mlp
            .forward(&self.post_attention_norm.forward(&x)?, rows)?;
        if let Some(norms) = &self.output_norms {
            h = norms.mlp.forward(&h)?;
        }
        residual::add(&x, &h)
    }
}

/// A layer as loaded: separate projections in any weight form, or dense and joined for the
/// fused decode kernels (f16/bf16 on CUDA).
#[derive(Debug, Clone)]
enum Layer {
    Separate(Box<DecoderLayer>),
    Joined(JoinedLayer),
}

impl Layer {
    /// `x (b, t, hidden)` → `(b, t, hidden)`, its keys and values going where `kv` says.
    fn forward(
        &self,
        x: &Tensor,
        angles: &RopeAngles,
        attention: &CachedAttention,
        fused_decode: bool,
        kv: LayerKv,
    ) -> Result<Tensor> {
        match self {
            Layer::Separate(layer) => layer.forward(x, angles, attention, kv),
            Layer::Joined(layer) => layer.forward(x, angles, attention, fused_decode, kv),
        }
    }
}

/// The attention of layer `index`: the model's, with the layer's window.
fn layer_attention(
    attention: &CachedAttention,
    config: &LlamaConfig,
    index: usize,
) -> CachedAttention {
    attention.with_window_left(config.window_left(index))
}

/// Runs `pass` on a thread of rayon's pool when the model is on the CPU. A CPU pass runs a few
/// hundred parallel products (each layer's projections, its attention): called from outside the
/// pool, each would hand its tasks to the pool and put the calling thread to sleep until they
/// are done, a wake-up and a sleep per product (a sixth of a decode step's CPU time on 2 cores
/// went to them). From a thread of the pool, that thread takes part in each product and the
/// others steal from it.
#[cfg(not(feature = "cuda"))]
fn on_cpu_pool<R: Send>(cpu: bool, pass: impl FnOnce() -> R + Send) -> R {
    if cpu && rayon::current_thread_index().is_none() {
        rayon::scope(|_| pass())
    } else {
        pass()
    }
}

/// With the `cuda` feature a model holds CUDA graph handles, which may not be shared between
/// threads, so a pass runs on the calling thread.
#[cfg(feature = "cuda")]
fn on_cpu_pool<R>(_cpu: bool, pass: impl FnOnce() -> R) -> R {
    pass()
}

/// Checks a prefill chunk size.
fn check_prefill_chunk(tokens: usize) -> Result<()> {
    if tokens == 0 {
        bail!("model: prefill_chunk must be at least 1 token")
    }
    Ok(())
}

/// The logits of a prompt's last chunk, from the per-chunk results of [`Llama::in_chunks`].
fn logits_of_last(chunks: Vec<Option<Tensor>>) -> Result<Tensor> {
    match chunks.into_iter().last().flatten() {
        Some(logits) => Ok(logits),
        None => bail!("model forward: the prompt's last chunk gave no logits"),
    }
}

/// The weights of a model, however they were loaded.
#[derive(Debug, Clone)]
struct Weights {
    embed_tokens: Embedding,
    layers: Vec<Layer>,
    head: Head,
}

#[derive(Debug, Clone)]
enum Head {
    Separate { norm: RmsNorm, lm_head: Linear },
    Joined(JoinedHead),
}

/// A Llama model with one KV cache per layer for one sequence at a time; batches of sequences
/// decode over a [`PagedKvCache`] (see [`Llama::forward_paged`], and [`Llama::forward_mixed`]
/// for prompt chunks beside decode rows).
#[derive(Debug, Clone)]
pub struct Llama {
    config: LlamaConfig,
    weights: Weights,
    rope: RotaryEmbedding,
    attention: CachedAttention,
    caches: Vec<KvCache>,
    dtype: DType,
    device: Device,
    weight_choices: Vec<WeightChoice>,
    fused_decode: bool,
    /// Capture one-token CUDA steps as graphs (see [`Llama::set_cuda_graph`]).
    cuda_graph: bool,
    /// Prompt tokens per chunk (see [`LoadOptions::prefill_chunk`]).
    prefill_chunk: usize,
    /// The inputs of one-token CUDA steps and their graph, from the first such step on.
    #[cfg(feature = "cuda")]
    device_steps: Option<DeviceSteps>,
}

/// What one-token steps on CUDA keep between calls.
#[cfg(feature = "cuda")]
#[derive(Debug, Clone)]
struct DeviceSteps {
    inputs: device_step::StepInputs,
    graph: device_step::StepGraph,
}

impl Llama {
    /// Loads a GGUF file or an HF directory (config.json, tokenizer.json, *.safetensors) with
    /// default options and the given attention backend.
    pub fn load(path: &Path, device: &Device, backend: AttentionBackend) -> Result<LoadedModel> {
        Self::load_with(
            path,
            device,
            LoadOptions {
                backend,
                ..LoadOptions::default()
            },
        )
    }

    /// [`Llama::load`] with all options.
    pub fn load_with(path: &Path, device: &Device, options: LoadOptions) -> Result<LoadedModel> {
        if path.is_dir() {
            hf::load(path, device, options)
        } else if path.is_file() {
            gguf::load(path, device, options)
        } else {
            bail!(
                "model: {} is neither a GGUF file nor an HF model directory",
                path.display()
            )
        }
    }

    /// Builds the model from HF-named tensors (`model.embed_tokens.weight`,
    /// `model.layers.{i}.self_attn.q_proj.weight`, …); `vb` must yield `dtype` tensors.
    pub fn from_var_builder(
        vb: VarBuilder,
        config: LlamaConfig,
        dtype: DType,
        options: LoadOptions,
    ) -> Result<Self> {
        config.validate()?;
        let c = &config;
        // On CUDA, dense 16-bit weights decode through the fused kernels (see `fused_linear`),
        // which take no biases.
        let join = c.joins_for_fused_kernels()
            && options.joined_layers.unwrap_or_else(|| {
                vb.device().is_cuda() && matches!(dtype, DType::F16 | DType::BF16)
            });
        let eps = c.rms_norm_eps as f32;
        let matrix = |vb: &VarBuilder, out: usize, inp: usize| vb.get((out, inp), "weight");
        let minus_one = c.gemma2.is_some_and(|g| g.norm_weights_minus_one);
        let norm_weight = |vb: VarBuilder| -> Result<Tensor> {
            let weight = vb.get(c.hidden_size, "weight")?;
            if minus_one {
                weight.affine(1.0, 1.0)
            } else {
                Ok(weight)
            }
        };
        let norm = |weight: &Tensor| RmsNorm::new(weight.clone(), c.rms_norm_eps);
        let embed = vb.get((c.vocab_size, c.hidden_size), "model.embed_tokens.weight")?;
        let lm_head = if c.tie_word_embeddings || !vb.contains_tensor("lm_head.weight") {
            embed.clone()
        } else {
            matrix(&vb.pp("lm_head"), c.vocab_size, c.hidden_size)?
        };
        let (q_size, kv_size, ffn) = (
            c.num_attention_heads * c.head_dim,
            c.num_key_value_heads * c.head_dim,
            c.intermediate_size,
        );
        let layers = (0..c.num_hidden_layers)
            .map(|i| {
                let vb = vb.pp(format!("model.layers.{i}"));
                let attn = vb.pp("self_attn");
                let mlp = vb.pp("mlp");
                // Phi-3 stores q/k/v as one matrix and gate/up as another: split them.
                let (q, k, v) = if attn.contains_tensor("qkv_proj.weight") {
                    let qkv = matrix(&attn.pp("qkv_proj"), q_size + 2 * kv_size, c.hidden_size)?;
                    (
                        qkv.narrow(0, 0, q_size)?,
                        qkv.narrow(0, q_size, kv_size)?,
                        qkv.narrow(0, q_size + kv_size, kv_size)?,
                    )
                } else {
                    (
                        matrix(&attn.pp("q_proj"), q_size, c.hidden_size)?,
                        matrix(&attn.pp("k_proj"), kv_size, c.hidden_size)?,
                        matrix(&attn.pp("v_proj"), kv_size, c.hidden_size)?,
                    )
                };
                let (gate, up) = if mlp.contains_tensor("gate_up_proj.weight") {
                    let gate_up = matrix(&mlp.pp("gate_up_proj"), 2 * ffn, c.hidden_size)?;
                    (gate_up.narrow(0, 0, ffn)?, gate_up.narrow(0, ffn, ffn)?)
                } else {
                    (
                        matrix(&mlp.pp("gate_proj"), ffn, c.hidden_size)?,
                        matrix(&mlp.pp("up_proj"), ffn, c.hidden_size)?,
                    )
                };
                let t = LayerTensors {
                    q,
                    k,
                    v,
                    o: matrix(&attn.pp("o_proj"), c.hidden_size, q_size)?,
                    gate,
                    up,
                    down: matrix(&mlp.pp("down_proj"), c.hidden_size, ffn)?,
                    input_norm: norm_weight(vb.pp("input_layernorm"))?,
                    post_attention_norm: match c.gemma2 {
                        Some(_) => norm_weight(vb.pp("pre_feedforward_layernorm"))?,
                        None => norm_weight(vb.pp("post_attention_layernorm"))?,
                    },
                };
                let output_norms = match c.gemma2 {
                    Some(_) => Some(OutputNorms {
                        attention: norm(&norm_weight(vb.pp("post_attention_layernorm"))?),
                        mlp: norm(&norm_weight(vb.pp("post_feedforward_layernorm"))?),
                    }),
                    None => None,
                };
                if join {
                    return Ok(Layer::Joined(JoinedLayer::new(
                        t,
                        eps,
                        c.num_attention_heads,
                        c.num_key_value_heads,
                        c.head_dim,
                    )?));
                }
                let projection = |weight: Tensor, name: &str, size: usize| -> Result<Linear> {
                    let linear = Linear::dense(weight);
                    if !c.attention_bias {
                        return Ok(linear);
                    }
                    Ok(linear.with_bias(attn.pp(name).get(size, "bias")?))
                };
                let qk_norms = if c.qk_norm {
                    let head_norm = |name: &str| -> Result<RmsNorm> {
                        Ok(norm(&attn.pp(name).get(c.head_dim, "weight")?))
                    };
                    Some((head_norm("q_norm")?, head_norm("k_norm")?))
                } else {
                    None
                };
                Ok(Layer::Separate(Box::new(DecoderLayer {
                    input_norm: norm(&t.input_norm),
                    attention: SelfAttention {
                        q_proj: projection(t.q, "q_proj", q_size)?,
                        k_proj: projection(t.k, "k_proj", kv_size)?,
                        v_proj: projection(t.v, "v_proj", kv_size)?,
                        o_proj: Linear::dense(t.o),
                        qk_norms,
                        decode_qkv: None,
                        prompt_qkv: None,
                        q_heads: c.num_attention_heads,
                        kv_heads: c.num_key_value_heads,
                        head_dim: c.head_dim,
                    },
                    post_attention_norm: norm(&t.post_attention_norm),
                    mlp: Mlp {
                        gate_proj: Linear::dense(t.gate),
                        up_proj: Linear::dense(t.up),
                        down_proj: Linear::dense(t.down),
                        activation: c.mlp_activation(),
                        decode_gate_up: None,
                        prompt_gate_up: None,
                    },
                    output_norms,
                })))
            })
            .collect::<Result<Vec<_>>>()?;
        let final_norm = norm_weight(vb.pp("model.norm"))?;
        let head = if join {
            Head::Joined(JoinedHead {
                norm: final_norm,
                lm_head,
                eps,
            })
        } else {
            Head::Separate {
                norm: norm(&final_norm),
                lm_head: Linear::dense(lm_head),
            }
        };
        let weights = Weights {
            embed_tokens: Embedding::new(embed, c.hidden_size),
            layers,
            head,
        };
        let device = vb.device().clone();
        Self::from_parts(
            config,
            weights,
            RopeLayout::Halves,
            None,
            dtype,
            &device,
            options,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn from_parts(
        config: LlamaConfig,
        weights: Weights,
        rope_layout: RopeLayout,
        rope_freq_factors: Option<&[f32]>,
        dtype: DType,
        device: &Device,
        options: LoadOptions,
    ) -> Result<Self> {
        check_prefill_chunk(options.prefill_chunk)?;
        let rope = RotaryEmbedding::new(&config, rope_freq_factors, rope_layout, dtype, device)?;
        // The cache checks the dtype and the scales.
        let cache_dtype = options.cache_dtype.unwrap_or(dtype);
        let cache_config = KvCacheConfig {
            batch: 1,
            kv_heads: config.num_key_value_heads,
            head_dim: config.head_dim,
            initial_capacity: options.initial_cache_capacity,
            max_capacity: config.max_position_embeddings,
            dtype: cache_dtype,
            device: device.clone(),
            k_scale: options.cache_k_scale,
            v_scale: options.cache_v_scale,
        };
        let caches = (0..config.num_hidden_layers)
            .map(|_| KvCache::new(&cache_config))
            .collect::<Result<Vec<_>>>()?;
        let softcap = config.gemma2.and_then(|g| g.attn_logit_softcapping);
        Ok(Self {
            attention: CachedAttention::new(config.softmax_scale())
                .with_backend(options.backend)
                .with_softcap(softcap),
            config,
            weights,
            rope,
            caches,
            dtype,
            device: device.clone(),
            weight_choices: Vec::new(),
            fused_decode: true,
            cuda_graph: false,
            prefill_chunk: options.prefill_chunk,
            #[cfg(feature = "cuda")]
            device_steps: None,
        })
    }

    /// Runs `tokens` (one sequence) after what the cache already holds, appends them to the
    /// cache, and returns the f32 logits `(vocab,)` of the last token.
    ///
    /// On CUDA with the split-KV backend, a single token runs as a step fed from device memory:
    /// its token and position are written to a small device buffer, and attention masks each
    /// cache to its length over the whole capacity, so that every step launches the same
    /// kernels. With [`Llama::set_cuda_graph`] those launches are captured once per cache
    /// allocation and replayed.
    pub fn forward(&mut self, tokens: &[u32]) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let [token] = tokens {
            if self.takes_device_steps() {
                return self.device_step(*token);
            }
        }
        on_cpu_pool(self.device.is_cpu(), || self.forward_here(tokens))
    }

    /// [`Llama::forward`] on the calling thread (the host-fed path).
    fn forward_here(&mut self, tokens: &[u32]) -> Result<Tensor> {
        let logits = self.in_chunks(tokens, |model, chunk, last| {
            let x = model.hidden_states(chunk, Positions::Host(Rows::BySize))?;
            last.then(|| model.last_logits(&x)).transpose()
        })?;
        logits_of_last(logits)
    }

    /// Runs `tokens` (checked whole first) through `run` in chunks of at most
    /// [`Llama::prefill_chunk`] tokens, each after the ones before it in the cache; `run` is told
    /// which chunk is the last. On an error the cache is rolled back to where it stood.
    fn in_chunks<T>(
        &mut self,
        tokens: &[u32],
        mut run: impl FnMut(&mut Self, &[u32], bool) -> Result<T>,
    ) -> Result<Vec<T>> {
        self.check_tokens(tokens)?;
        let start = self.cache_len();
        let chunks = tokens.len().div_ceil(self.prefill_chunk);
        let results = tokens
            .chunks(self.prefill_chunk)
            .enumerate()
            .map(|(i, chunk)| run(self, chunk, i + 1 == chunks))
            .collect::<Result<Vec<_>>>();
        if results.is_err() {
            self.truncate(start);
        }
        results
    }

    /// Like [`Llama::forward`], also returning the natural-log LSE of every layer's split-KV
    /// attention, in layer order: one f32 `(1, q_heads, t)` tensor per layer, for debugging (a
    /// map of them over the steps shows heads that spread or lock their attention, and splits
    /// lost in a merge). A prompt longer than [`Llama::prefill_chunk`] has each layer's LSE of
    /// its chunks joined along t. Passes where the op did not run for every chunk (chunks of
    /// more tokens than the op takes, the naive backend) return no LSE. The pass runs fed from
    /// the host, uncaptured; on the CPU its logits are those of [`Llama::forward`].
    pub fn forward_with_lse(&mut self, tokens: &[u32]) -> Result<(Tensor, Vec<Tensor>)> {
        let layers = self.weights.layers.len();
        let chunks = self.in_chunks(tokens, |model, chunk, last| {
            let record = LseRecord::default();
            let x = model.hidden_states(chunk, Positions::Recorded(&record))?;
            let logits = last.then(|| model.last_logits(&x)).transpose()?;
            Ok((logits, record.into_inner()))
        })?;
        let every_chunk_recorded = chunks.iter().all(|(_, lses)| lses.len() == layers);
        let mut per_layer = vec![Vec::with_capacity(chunks.len()); layers];
        let mut logits = Vec::with_capacity(1);
        for (chunk_logits, lses) in chunks {
            logits.push(chunk_logits);
            for (layer, lse) in per_layer.iter_mut().zip(lses) {
                layer.push(lse);
            }
        }
        let lses = if every_chunk_recorded {
            per_layer
                .iter()
                .map(|chunks| Tensor::cat(chunks, 2))
                .collect::<Result<Vec<_>>>()?
        } else {
            Vec::new()
        };
        Ok((logits_of_last(logits)?, lses))
    }

    /// Like [`Llama::forward`], also returning where `tokens` look: for each layer, in layer
    /// order, the f32 attention weights `(q_heads, t, len)` of their queries over every position
    /// of the cache after the pass (`len` positions, `tokens` the last `t` of them), with the
    /// layer's scale, soft-capping, causal mask and window. Summed over a span of positions they
    /// say how much each token attends to it: which sentences of a document an instruction after
    /// it looks at. The pass runs as [`Llama::forward`] runs it (same logits and cache); the
    /// weights are recomputed in f32 from each layer's queries and the cached keys, and take
    /// `layers · q_heads · t · len` floats, so keep `tokens` short after a long cache.
    pub fn forward_with_attention(&mut self, tokens: &[u32]) -> Result<(Tensor, Vec<Tensor>)> {
        let layers = self.weights.layers.len();
        let chunks = self.in_chunks(tokens, |model, chunk, last| {
            let record = QueryRecord::default();
            let x = model.hidden_states(chunk, Positions::Probed(&record))?;
            let logits = last.then(|| model.last_logits(&x)).transpose()?;
            Ok((logits, record.into_inner()))
        })?;
        let mut per_layer = vec![Vec::with_capacity(chunks.len()); layers];
        let mut logits = Vec::with_capacity(1);
        for (chunk_logits, queries) in chunks {
            logits.push(chunk_logits);
            if queries.len() != layers {
                bail!(
                    "model: {} of {layers} layers recorded their queries",
                    queries.len()
                );
            }
            for (layer, q) in per_layer.iter_mut().zip(queries) {
                layer.push(q);
            }
        }
        let weights = per_layer
            .iter()
            .zip(&self.caches)
            .enumerate()
            .map(|(index, (queries, cache))| {
                attention_weights(&Tensor::cat(queries, 1)?, cache, &self.config, index)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((logits_of_last(logits)?, weights))
    }

    /// The f32 logits `(vocab,)` of the last of hidden states `(1, t, hidden)`.
    fn last_logits(&self, x: &Tensor) -> Result<Tensor> {
        let last = x.narrow(1, x.dim(1)? - 1, 1)?;
        self.logits(&last, Rows::BySize)?.flatten_all()
    }

    /// Like [`Llama::forward`], returning the f32 logits `(t, vocab)` of every token: what
    /// verifying drafted tokens needs. Up to [`crate::MAX_QUERY_TOKENS`] tokens after a filled
    /// cache run through the split-KV op in one pass over the cache (see
    /// [`crate::SplitKvAttention`]). Those tokens are computed as one-token steps compute them:
    /// the weights in the form a decode step uses (a quantized model on the CPU keeps a second
    /// form for prompts), and on the CPU the attention split as each step would split it; so
    /// there each row's logits are exactly those of [`Llama::forward`] one token at a time.
    pub fn forward_all(&mut self, tokens: &[u32]) -> Result<Tensor> {
        on_cpu_pool(self.device.is_cpu(), || self.forward_all_here(tokens))
    }

    /// [`Llama::forward_all`] on the calling thread.
    fn forward_all_here(&mut self, tokens: &[u32]) -> Result<Tensor> {
        let rows = if tokens.len() <= crate::MAX_QUERY_TOKENS {
            Rows::AsDecode
        } else {
            Rows::BySize
        };
        let logits = self.in_chunks(tokens, |model, chunk, _| {
            let x = model.hidden_states(chunk, Positions::Host(rows))?;
            model.logits(&x, rows)?.squeeze(0)
        })?;
        Tensor::cat(&logits, 0)
    }

    /// Forgets the cached positions from `len` on, e.g. rejected drafted tokens: a length
    /// change, no copy. A cache at most `len` long is unchanged.
    pub fn truncate(&mut self, len: usize) {
        self.caches.iter_mut().for_each(|c| c.truncate(len));
    }

    /// The last layer's output `(1, t, hidden)` for `tokens`, appended to the cache after the
    /// lengths the host counts.
    fn hidden_states(&mut self, tokens: &[u32], positions: Positions) -> Result<Tensor> {
        let t = tokens.len();
        let input = Tensor::new(tokens, &self.device)?.unsqueeze(0)?;
        let x = self.embed(&input)?;
        let angles = self.rope.angles(&[self.cache_len()], t)?;
        self.layers(x, &angles, positions)
    }

    /// Whether one-token steps run fed from device memory: on CUDA, with the split-KV backend
    /// over a head dim it takes.
    #[cfg(feature = "cuda")]
    fn takes_device_steps(&self) -> bool {
        self.device.is_cuda()
            && self.attention.backend() == AttentionBackend::SplitKv
            && crate::SUPPORTED_HEAD_DIMS.contains(&self.config.head_dim)
    }

    /// One token through a step fed from device memory (see [`Llama::forward`]): replayed from
    /// its graph, captured, or run eagerly. The f32 logits `(vocab,)`.
    #[cfg(feature = "cuda")]
    fn device_step(&mut self, token: u32) -> Result<Tensor> {
        self.check_tokens(&[token])?;
        let position = self.cache_len();
        // Growth reallocates the caches: never inside a step that is being captured.
        for cache in &mut self.caches {
            cache.reserve(position + 1)?;
        }
        let mut steps = match self.device_steps.take() {
            Some(steps) => steps,
            None => DeviceSteps {
                inputs: device_step::StepInputs::new(&self.device)?,
                graph: device_step::StepGraph::default(),
            },
        };
        let logits = steps.inputs.set(token, position).and_then(|()| {
            if !self.cuda_graph {
                return self.fed_logits(&steps.inputs);
            }
            let shape = device_step::StepShape::of(&self.caches, self.fused_decode);
            let device = self.device.clone();
            let vocab = self.config.vocab_size;
            let inputs = steps.inputs.clone();
            let model = std::cell::RefCell::new(&mut *self);
            steps.graph.run(
                &device,
                (shape, vocab),
                || model.borrow_mut().fed_logits(&inputs),
                || {
                    model
                        .borrow_mut()
                        .caches
                        .iter_mut()
                        .for_each(|c| c.count_appended(1))
                },
            )
        });
        self.device_steps = Some(steps);
        if logits.is_err() {
            // A step that failed part-way may have counted the position in some caches.
            self.truncate(position);
        }
        logits
    }

    /// The f32 logits `(vocab,)` of the step whose inputs `inputs` holds.
    #[cfg(feature = "cuda")]
    fn fed_logits(&mut self, inputs: &device_step::StepInputs) -> Result<Tensor> {
        let x = self.embed(&inputs.token)?;
        let angles = self.rope.angles_at(&inputs.lengths.before)?;
        let x = self.layers(x, &angles, Positions::Device(&inputs.lengths))?;
        self.logits(&x, Rows::BySize)?.flatten_all()
    }

    /// Checks that `tokens` is not empty, is in the vocabulary and fits in the context.
    fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        if tokens.is_empty() {
            bail!("model forward: no tokens given")
        }
        if let Some(&bad) = tokens
            .iter()
            .find(|&&t| t as usize >= self.config.vocab_size)
        {
            bail!(
                "model forward: token id {bad} is out of the vocabulary (size {})",
                self.config.vocab_size
            )
        }
        let needed = self.cache_len() + tokens.len();
        if needed > self.context_length() {
            bail!(
                "model forward: {} cached + {} new tokens exceed the context length {}",
                self.cache_len(),
                tokens.len(),
                self.context_length()
            )
        }
        Ok(())
    }

    /// The embeddings of `tokens`, scaled by √hidden_size for Gemma-2 (the scale rounded to the
    /// model's dtype first, as the reference implementation does).
    fn embed(&self, tokens: &Tensor) -> Result<Tensor> {
        let x = self.weights.embed_tokens.forward(tokens)?;
        if self.config.gemma2.is_none() {
            return Ok(x);
        }
        let scale = (self.config.hidden_size as f64).sqrt();
        let scale = match x.dtype() {
            DType::BF16 => half::bf16::from_f64(scale).to_f64(),
            DType::F16 => half::f16::from_f64(scale).to_f64(),
            _ => scale,
        };
        x.affine(scale, 0.0)
    }

    /// Runs every layer over `x`, appending to the caches at `positions`.
    fn layers(
        &mut self,
        mut x: Tensor,
        angles: &RopeAngles,
        positions: Positions,
    ) -> Result<Tensor> {
        let mut caches = self.caches.iter_mut();
        for (index, layer) in self.weights.layers.iter().enumerate() {
            let Some(cache) = caches.next() else {
                bail!("model: layer {index} has no cache")
            };
            let attention = layer_attention(&self.attention, &self.config, index);
            let kv = LayerKv::Own(cache, positions);
            x = layer.forward(&x, angles, &attention, self.fused_decode, kv)?;
        }
        Ok(x)
    }

    /// f32 logits `(1, t, vocab)` of hidden states `(1, t, hidden)`.
    fn logits(&self, x: &Tensor, rows: Rows<'_>) -> Result<Tensor> {
        let logits = match &self.weights.head {
            Head::Separate { norm, lm_head } => rows.project(lm_head, &norm.forward(x)?)?,
            Head::Joined(head) => head.forward(x, self.fused_decode)?,
        };
        let logits = logits.to_dtype(DType::F32)?;
        match self.config.gemma2.and_then(|g| g.final_logit_softcapping) {
            Some(c) => (logits / f64::from(c))?.tanh()? * f64::from(c),
            None => Ok(logits),
        }
    }

    /// Forgets the cached sequence.
    pub fn reset(&mut self) {
        self.caches.iter_mut().for_each(KvCache::reset);
    }

    /// The longest sequence the model handles (`max_position_embeddings`, GGUF `context_length`).
    pub fn context_length(&self) -> usize {
        self.config.max_position_embeddings
    }

    /// Tokens in the cache.
    pub fn cache_len(&self) -> usize {
        self.caches.first().map_or(0, KvCache::len)
    }

    /// The attention that runs over the caches.
    pub fn backend(&self) -> AttentionBackend {
        self.attention.backend()
    }

    /// Switches the attention backend; the cache stays valid.
    pub fn set_backend(&mut self, backend: AttentionBackend) {
        self.attention = self.attention.with_backend(backend);
    }

    /// Whether decode steps run the fused projection kernels (dense f16/bf16 weights on CUDA).
    pub fn has_fused_decode(&self) -> bool {
        self.fused_decode && matches!(self.weights.head, Head::Joined(_))
    }

    /// Turns the fused projection kernels on or off (on by default), e.g. for A/B runs: off,
    /// the joined weights go through candle's separate ops. Without joined weights (CPU, f32,
    /// GGUF) this changes nothing.
    pub fn set_fused_decode(&mut self, on: bool) {
        self.fused_decode = on;
    }

    /// Captures one-token CUDA steps as CUDA graphs (off by default): each step is then one
    /// graph launch instead of a few hundred kernel launches, with logits identical to the
    /// uncaptured step. A graph is captured on the second step after the caches are
    /// (re)allocated and replayed until they grow again. Needs a CUDA device; steps with
    /// another backend than split-KV run uncaptured.
    pub fn set_cuda_graph(&mut self, on: bool) -> Result<()> {
        if on && !self.device.is_cuda() {
            bail!(
                "model: CUDA graphs need a CUDA device, this model is on {:?}",
                self.device.location()
            )
        }
        self.cuda_graph = on;
        Ok(())
    }

    /// Prompt tokens written and attended per chunk (see [`LoadOptions::prefill_chunk`]).
    pub fn prefill_chunk(&self) -> usize {
        self.prefill_chunk
    }

    /// Sets the prompt tokens per chunk (see [`LoadOptions::prefill_chunk`]); at least 1.
    pub fn set_prefill_chunk(&mut self, tokens: usize) -> Result<()> {
        check_prefill_chunk(tokens)?;
        self.prefill_chunk = tokens;
        Ok(())
    }

    /// Whether one-token CUDA steps are captured as graphs (see [`Llama::set_cuda_graph`]).
    pub fn cuda_graph(&self) -> bool {
        self.cuda_graph
    }

    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The dtype the KV cache stores keys and values in.
    pub fn cache_dtype(&self) -> DType {
        self.caches.first().map_or(self.dtype, KvCache::dtype)
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The per-layer caches, e.g. to fill them directly in benchmarks.
    pub fn caches_mut(&mut self) -> &mut [KvCache] {
        &mut self.caches
    }

    /// How the GGUF weight forms were chosen, with the timings; empty for dense checkpoints.
    pub fn weight_choices(&self) -> &[WeightChoice] {
        &self.weight_choices
    }
}
