//! Loading a Llama from a GGUF file: hyper-parameters, tokenizer and chat template from the
//! metadata, weights in the forms chosen by [`crate::models::weight_form`].

use std::borrow::Cow;
use std::collections::HashMap;
use std::fs::File;
use std::io::BufReader;
use std::path::Path;
use std::sync::Arc;

use candle_core::quantized::gguf_file::Content;
use candle_core::quantized::tokenizer::TokenizerFromGguf;
use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::{bail, DType, Device, Result, Tensor};
use candle_nn::{Embedding, RmsNorm};

use super::config::gguf_architecture;
use super::joined::{JoinedHead, JoinedLayer, LayerTensors};
use super::{
    DecoderLayer, Head, Layer, Llama, LlamaConfig, LoadOptions, LoadedModel, Mlp, OutputNorms,
    RopeLayout, SelfAttention, Weights,
};
use crate::models::linear::Linear;
use crate::models::weight_form::{
    self, JoinedLinears, WeightChoice, WeightForm, WeightFormPolicy, WeightPlan,
};

/// The per-layer matrices, by their GGUF names.
const LAYER_MATRICES: [&str; 7] = [
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
];

/// Phi-3's per-layer matrices: q/k/v joined in `attn_qkv`, gate and up in `ffn_up`.
const PHI3_LAYER_MATRICES: [&str; 4] = ["attn_qkv", "attn_output", "ffn_up", "ffn_down"];

/// The GGUF names of the layer matrices of architecture `arch`.
fn stored_layer_matrices(arch: &str) -> &'static [&'static str] {
    match arch {
        "phi3" => &PHI3_LAYER_MATRICES,
        _ => &LAYER_MATRICES,
    }
}

/// One layer's matrices as stored, q/k/v and gate/up apart.
struct LayerMatrices {
    q: QTensor,
    k: QTensor,
    v: QTensor,
    o: QTensor,
    gate: QTensor,
    up: QTensor,
    down: QTensor,
}

impl LayerMatrices {
    /// Reads layer `layer`'s matrices, splitting Phi-3's joined ones by rows.
    fn read(
        read: &mut dyn FnMut(&str) -> Result<QTensor>,
        arch: &str,
        config: &LlamaConfig,
        layer: usize,
    ) -> Result<Self> {
        let mut at = |name: &str| read(&format!("blk.{layer}.{name}.weight"));
        if arch != "phi3" {
            return Ok(Self {
                q: at("attn_q")?,
                k: at("attn_k")?,
                v: at("attn_v")?,
                o: at("attn_output")?,
                gate: at("ffn_gate")?,
                up: at("ffn_up")?,
                down: at("ffn_down")?,
            });
        }
        let (q_rows, kv_rows, ffn) = (
            config.num_attention_heads * config.head_dim,
            config.num_key_value_heads * config.head_dim,
            config.intermediate_size,
        );
        let qkv = at("attn_qkv")?;
        let gate_up = at("ffn_up")?;
        Ok(Self {
            q: row_slice(&qkv, 0, q_rows)?,
            k: row_slice(&qkv, q_rows, kv_rows)?,
            v: row_slice(&qkv, q_rows + kv_rows, kv_rows)?,
            o: at("attn_output")?,
            gate: row_slice(&gate_up, 0, ffn)?,
            up: row_slice(&gate_up, ffn, ffn)?,
            down: at("ffn_down")?,
        })
    }
}

/// Rows `start..start + count` of a quantized matrix. Each row is stored as whole blocks, one row
/// after another, so the slice is exact in every stored type.
fn row_slice(t: &QTensor, start: usize, count: usize) -> Result<QTensor> {
    let (rows, cols) = t.shape().dims2()?;
    if start + count > rows {
        bail!(
            "model: GGUF matrix of {rows} rows has no rows {start}..{}",
            start + count
        )
    }
    let dtype = t.dtype();
    let row_bytes = cols / dtype.block_size() * dtype.type_size();
    let data = t.data()?;
    let rows_data = &data[start * row_bytes..(start + count) * row_bytes];
    let storage = QStorage::from_data(Cow::Borrowed(rows_data), &t.device(), dtype)?;
    QTensor::new(storage, (count, cols))
}

/// On CUDA, GGUF models whose layer matrices take at most this many bytes in bf16 run dense in
/// bf16, through the fused decode kernels: a step of such a model is bound by its launches, not
/// its bytes, and the fused layers launch a third as many kernels as the quantized matmuls
/// (docs/perf-log.md, "GGUF dense on CUDA"). Larger models keep their quantized weights, which
/// read fewer bytes.
const CUDA_DENSE_MAX_BYTES: usize = 1 << 30;

/// The dtype a GGUF model runs in: f32 with its weights in the chosen forms, or on CUDA f16/bf16
/// with dense, joined layers.
fn run_dtype(
    content: &Content,
    config: &LlamaConfig,
    device: &Device,
    options: &LoadOptions,
) -> Result<DType> {
    match options.dtype {
        None | Some(DType::F32) if !device.is_cuda() => Ok(DType::F32),
        Some(DType::F32) => Ok(DType::F32),
        Some(dtype @ (DType::F16 | DType::BF16)) if device.is_cuda() => Ok(dtype),
        Some(dtype) => bail!(
            "model: GGUF models run in f32, or on CUDA in f16 or bf16 (dense); got {dtype:?} on \
             {:?}",
            device.location()
        ),
        None => {
            let elements: usize = content
                .tensor_infos
                .iter()
                .filter(|(name, _)| name.starts_with("blk."))
                .map(|(_, info)| info.shape.elem_count())
                .sum();
            let dense = options.weight_forms == WeightFormPolicy::Measure
                && 2 * elements <= CUDA_DENSE_MAX_BYTES
                && config.joins_for_fused_kernels();
            Ok(if dense { DType::BF16 } else { DType::F32 })
        }
    }
}

pub(super) fn load(path: &Path, device: &Device, options: LoadOptions) -> Result<LoadedModel> {
    let file = File::open(path).map_err(|e| {
        candle_core::Error::Msg(format!("model: cannot open {}: {e}", path.display()))
    })?;
    let mut reader = BufReader::new(file);
    let content = Content::read(&mut reader).map_err(|e| {
        e.context(format!(
            "model: {} is not a readable GGUF file",
            path.display()
        ))
    })?;
    let config = LlamaConfig::from_gguf(&content)?;
    let tokenizer = tokenizers::Tokenizer::from_gguf(&content)?;
    let chat_template = content
        .metadata
        .get("tokenizer.chat_template")
        .and_then(|v| v.to_string().ok())
        .cloned();
    let dtype = run_dtype(&content, &config, device, &options)?;
    let arch = gguf_architecture(&content)?;
    if dtype != DType::F32 && !config.joins_for_fused_kernels() {
        bail!(
            "model: {arch} GGUF models run in f32 (the fused bf16 kernels take no q/k/v biases, \
             q/k norms or Gemma-2 layers), got dtype {dtype:?}"
        )
    }
    // llama GGUFs permute q/k rows for interleaved pairs; the others keep HF's halves.
    let rope_layout = match arch {
        "llama" => RopeLayout::Interleaved,
        _ => RopeLayout::Halves,
    };
    let mut read = |name: &str| content.tensor(&mut reader, name, device);
    // Llama 3.1 GGUFs carry their long-context scaling as per-frequency divisors.
    let rope_freq_factors = if content.tensor_infos.contains_key("rope_freqs.weight") {
        Some(dequantized_vec(&read("rope_freqs.weight")?)?)
    } else {
        None
    };
    let (weights, choices) = if dtype == DType::F32 {
        weights_in_chosen_forms(&content, &config, &mut read, device, &options)?
    } else {
        (
            dense_joined_weights(&content, &config, &mut read, device, dtype)?,
            Vec::new(),
        )
    };
    let bos_token_id = config.bos_token_id;
    let eos_token_ids = config.eos_token_ids.clone();
    let mut model = Llama::from_parts(
        config,
        weights,
        rope_layout,
        rope_freq_factors.as_deref(),
        dtype,
        device,
        options,
    )?;
    model.weight_choices = choices;
    Ok(LoadedModel {
        model,
        tokenizer,
        chat_template,
        bos_token_id,
        eos_token_ids,
    })
}

/// Every layer matrix dequantized to `dtype` and joined for the fused decode kernels.
fn dense_joined_weights(
    content: &Content,
    config: &LlamaConfig,
    read: &mut dyn FnMut(&str) -> Result<QTensor>,
    device: &Device,
    dtype: DType,
) -> Result<Weights> {
    let arch = gguf_architecture(content)?;
    let dense = |t: QTensor| -> Result<Tensor> { t.dequantize(device)?.to_dtype(dtype) };
    let eps = config.rms_norm_eps as f32;
    let embeddings = dense(read("token_embd.weight")?)?;
    let lm_head = match content.tensor_infos.contains_key("output.weight") {
        true => dense(read("output.weight")?)?,
        false => embeddings.clone(),
    };
    let layers = (0..config.num_hidden_layers)
        .map(|layer| {
            let m = LayerMatrices::read(read, arch, config, layer)?;
            let tensors = LayerTensors {
                q: dense(m.q)?,
                k: dense(m.k)?,
                v: dense(m.v)?,
                o: dense(m.o)?,
                gate: dense(m.gate)?,
                up: dense(m.up)?,
                down: dense(m.down)?,
                input_norm: dense(read(&format!("blk.{layer}.attn_norm.weight"))?)?,
                post_attention_norm: dense(read(&format!("blk.{layer}.ffn_norm.weight"))?)?,
            };
            Ok(Layer::Joined(JoinedLayer::new(
                tensors,
                eps,
                config.num_attention_heads,
                config.num_key_value_heads,
                config.head_dim,
            )?))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Weights {
        embed_tokens: Embedding::new(embeddings, config.hidden_size),
        layers,
        head: Head::Joined(JoinedHead {
            norm: dense(read("output_norm.weight")?)?,
            lm_head,
            eps,
        }),
    })
}

/// The f32 model: each layer matrix in the form chosen for its stored type (see
/// [`weight_form::choose`]), with the choices made.
fn weights_in_chosen_forms(
    content: &Content,
    config: &LlamaConfig,
    read: &mut dyn FnMut(&str) -> Result<QTensor>,
    device: &Device,
    options: &LoadOptions,
) -> Result<(Weights, Vec<WeightChoice>)> {
    let norm = |read: &mut dyn FnMut(&str) -> Result<QTensor>, name: &str| -> Result<RmsNorm> {
        Ok(RmsNorm::new(
            read(name)?.dequantize(device)?,
            config.rms_norm_eps,
        ))
    };

    // One measurement per stored type of the layer matrices, on the largest of that type.
    let arch = gguf_architecture(content)?;
    let mut samples: HashMap<GgmlDType, (String, usize)> = HashMap::new();
    for layer in 0..config.num_hidden_layers {
        for matrix in stored_layer_matrices(arch) {
            let name = format!("blk.{layer}.{matrix}.weight");
            let Some(info) = content.tensor_infos.get(&name) else {
                bail!("model: GGUF tensor {name} is missing")
            };
            let size = info.shape.elem_count();
            let entry = samples
                .entry(info.ggml_dtype)
                .or_insert_with(|| (name.clone(), size));
            if size > entry.1 {
                *entry = (name, size);
            }
        }
    }
    let mut choices: Vec<WeightChoice> = Vec::new();
    let mut plans = HashMap::new();
    for (dtype, (name, _)) in &samples {
        let choice = weight_form::choose(&read(name)?, options.weight_forms, device, false)?;
        plans.insert(*dtype, choice.plan);
        choices.push(choice);
    }
    choices.sort_by_key(|c| format!("{:?}", c.stored));

    let token_embd = read("token_embd.weight")?;
    let embeddings = token_embd.dequantize(device)?;
    // The head only ever sees the last token, so only its single-row speed matters.
    let (head_weight, tied) = match content.tensor_infos.contains_key("output.weight") {
        true => (read("output.weight")?, false),
        false => (token_embd, true),
    };
    let head_choice = weight_form::choose(&head_weight, options.weight_forms, device, true)?;
    let lm_head = if tied && head_choice.plan.decode == WeightForm::DenseF32 {
        Linear::dense(embeddings.clone()) // shares the embedding table
    } else {
        weight_form::linear(head_weight, head_choice.plan)?
    };
    choices.push(head_choice);

    let mut layers = Vec::with_capacity(config.num_hidden_layers);
    for layer in 0..config.num_hidden_layers {
        let input_norm = norm(read, &format!("blk.{layer}.attn_norm.weight"))?;
        let post_attention_norm = norm(read, &format!("blk.{layer}.ffn_norm.weight"))?;
        let output_norms = match config.gemma2 {
            Some(_) => Some(OutputNorms {
                attention: norm(read, &format!("blk.{layer}.post_attention_norm.weight"))?,
                mlp: norm(read, &format!("blk.{layer}.post_ffw_norm.weight"))?,
            }),
            None => None,
        };
        let qk_norms = if config.qk_norm {
            Some((
                norm(read, &format!("blk.{layer}.attn_q_norm.weight"))?,
                norm(read, &format!("blk.{layer}.attn_k_norm.weight"))?,
            ))
        } else {
            None
        };
        let biases = if config.attention_bias {
            let mut bias = |name: &str| -> Result<Tensor> {
                read(&format!("blk.{layer}.{name}.bias"))?.dequantize(device)
            };
            Some([bias("attn_q")?, bias("attn_k")?, bias("attn_v")?])
        } else {
            None
        };
        let m = LayerMatrices::read(read, arch, config, layer)?;
        let matrix = |tensor: QTensor| -> Result<Linear> {
            match plans.get(&tensor.dtype()) {
                Some(plan) => weight_form::linear(tensor, *plan),
                None => bail!("model: no weight plan for {:?}", tensor.dtype()),
            }
        };
        let plan_of = |tensor: &QTensor| -> Result<WeightPlan> {
            match plans.get(&tensor.dtype()) {
                Some(plan) => Ok(*plan),
                None => bail!("model: no weight plan for {:?}", tensor.dtype()),
            }
        };
        // Matrices that take the same input, joined for decode steps where they share a form.
        let (qkv_plan, gate_up_plan) = (plan_of(&m.q)?, plan_of(&m.gate)?);
        let qkv = if biases.is_none() && [&m.k, &m.v].iter().all(|t| t.dtype() == m.q.dtype()) {
            weight_form::joined_linears(vec![m.q, m.k, m.v], qkv_plan)?
        } else {
            JoinedLinears {
                linears: vec![matrix(m.q)?, matrix(m.k)?, matrix(m.v)?],
                decode: None,
                prompt: None,
            }
        };
        let activation = config.mlp_activation();
        let gate_up = if m.up.dtype() == m.gate.dtype() {
            weight_form::joined_linears(vec![m.gate, m.up], gate_up_plan)?
        } else {
            JoinedLinears {
                linears: vec![matrix(m.gate)?, matrix(m.up)?],
                decode: None,
                prompt: None,
            }
        };
        let silu = activation == candle_nn::Activation::Silu;
        let (decode_gate_up, prompt_gate_up) = match (gate_up.decode, gate_up.prompt) {
            (decode, prompt) if silu => (
                decode
                    .map(|rows| Arc::unwrap_or_clone(rows).with_silu_mul().map(Arc::new))
                    .transpose()?,
                prompt
                    .map(|rows| Arc::unwrap_or_clone(rows).with_silu_mul().map(Arc::new))
                    .transpose()?,
            ),
            _ => (None, None),
        };
        let (decode_qkv, prompt_qkv) = (qkv.decode, qkv.prompt);
        let (qkv, gate_up) = (qkv.linears, gate_up.linears);
        let [q_proj, k_proj, v_proj]: [Linear; 3] = qkv
            .try_into()
            .map_err(|_| candle_core::Error::Msg("model: q/k/v not three".into()))?;
        let [gate_proj, up_proj]: [Linear; 2] = gate_up
            .try_into()
            .map_err(|_| candle_core::Error::Msg("model: gate/up not two".into()))?;
        let (mut q_proj, mut k_proj, mut v_proj) = (q_proj, k_proj, v_proj);
        if let Some([q, k, v]) = biases {
            (q_proj, k_proj, v_proj) = (
                q_proj.with_bias(q),
                k_proj.with_bias(k),
                v_proj.with_bias(v),
            );
        }
        layers.push(Layer::Separate(Box::new(DecoderLayer {
            input_norm,
            attention: SelfAttention {
                qk_norms,
                q_proj,
                k_proj,
                v_proj,
                o_proj: matrix(m.o)?,
                decode_qkv,
                prompt_qkv,
                q_heads: config.num_attention_heads,
                kv_heads: config.num_key_value_heads,
                head_dim: config.head_dim,
            },
            post_attention_norm,
            mlp: Mlp {
                gate_proj,
                up_proj,
                down_proj: matrix(m.down)?,
                activation,
                decode_gate_up,
                prompt_gate_up,
            },
            output_norms,
        })));
    }
    let final_norm = norm(read, "output_norm.weight")?;
    let weights = Weights {
        embed_tokens: Embedding::new(embeddings, config.hidden_size),
        layers,
        head: Head::Separate {
            norm: final_norm,
            lm_head,
        },
    };
    Ok((weights, choices))
}

fn dequantized_vec(t: &QTensor) -> Result<Vec<f32>> {
    t.dequantize(&Device::Cpu)?
        .flatten_all()?
        .to_dtype(DType::F32)?
        .to_vec1::<f32>()
}
