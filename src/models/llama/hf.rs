//! Loading a Llama from an HF directory: config.json, tokenizer.json, *.safetensors, and
//! optionally generation_config.json and tokenizer_config.json (chat template).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{bail, DType, Device, Result};
use candle_nn::VarBuilder;

use super::{Llama, LlamaConfig, LoadOptions, LoadedModel};

pub(super) fn load(dir: &Path, device: &Device, options: LoadOptions) -> Result<LoadedModel> {
    let config_json = read_text(&dir.join("config.json"))?;
    let mut config = LlamaConfig::from_hf_json(&config_json)?;
    let generation_config = dir.join("generation_config.json");
    if generation_config.is_file() {
        config.merge_generation_config(&read_text(&generation_config)?)?;
    }
    let tokenizer_path = dir.join("tokenizer.json");
    if !tokenizer_path.is_file() {
        bail!("model: {} is missing", tokenizer_path.display())
    }
    let tokenizer = tokenizers::Tokenizer::from_file(&tokenizer_path).map_err(|e| {
        candle_core::Error::Msg(format!(
            "model: cannot read {}: {e}",
            tokenizer_path.display()
        ))
    })?;
    let chat_template = chat_template(dir)?;

    let dtype = match options.dtype {
        Some(dtype) => dtype,
        None if device.is_cpu() => DType::F32,
        None => checkpoint_dtype(&config_json)?.unwrap_or(DType::BF16),
    };
    if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
        bail!("model: dtype {dtype:?} is not supported; use f32, f16 or bf16")
    }
    let mut tensors = HashMap::new();
    for file in safetensors_files(dir)? {
        tensors.extend(candle_core::safetensors::load(&file, device)?);
    }
    let vb = VarBuilder::from_tensors(tensors, dtype, device);
    let bos_token_id = config.bos_token_id;
    let eos_token_ids = config.eos_token_ids.clone();
    let model = Llama::from_var_builder(vb, config, dtype, options)?;
    Ok(LoadedModel {
        model,
        tokenizer,
        chat_template,
        bos_token_id,
        eos_token_ids,
    })
}

fn read_text(path: &Path) -> Result<String> {
    std::fs::read_to_string(path)
        .map_err(|e| candle_core::Error::Msg(format!("model: cannot read {}: {e}", path.display())))
}

fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let entries = std::fs::read_dir(dir).map_err(|e| {
        candle_core::Error::Msg(format!("model: cannot list {}: {e}", dir.display()))
    })?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|ext| ext == "safetensors"))
        .collect();
    if files.is_empty() {
        bail!("model: no *.safetensors file in {}", dir.display())
    }
    files.sort();
    Ok(files)
}

/// The checkpoint's `torch_dtype`, if it names one we run.
fn checkpoint_dtype(config_json: &str) -> Result<Option<DType>> {
    let value: serde_json::Value = serde_json::from_str(config_json)
        .map_err(|e| candle_core::Error::Msg(format!("config.json: {e}")))?;
    Ok(match value.get("torch_dtype").and_then(|v| v.as_str()) {
        Some("bfloat16") => Some(DType::BF16),
        Some("float16") => Some(DType::F16),
        Some("float32") => Some(DType::F32),
        _ => None,
    })
}

/// `chat_template` of tokenizer_config.json: a string, or a list of named templates of which
/// the one named "default" is taken.
fn chat_template(dir: &Path) -> Result<Option<String>> {
    let path = dir.join("tokenizer_config.json");
    if !path.is_file() {
        return Ok(None);
    }
    let value: serde_json::Value = serde_json::from_str(&read_text(&path)?)
        .map_err(|e| candle_core::Error::Msg(format!("model {}: {e}", path.display())))?;
    Ok(match value.get("chat_template") {
        Some(serde_json::Value::String(template)) => Some(template.clone()),
        Some(serde_json::Value::Array(named)) => named
            .iter()
            .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
            .and_then(|t| t.get("template"))
            .and_then(|t| t.as_str())
            .map(str::to_string),
        _ => None,
    })
}
