//! Models from the Hugging Face hub (`--model-id`), through the `hf-hub` crate into its usual
//! cache (`$HF_HOME/hub`, or `~/.cache/huggingface/hub`).

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use hf_hub::api::sync::{ApiBuilder, ApiError, ApiRepo};
use hf_hub::{Repo, RepoType};

/// The files of an HF model directory besides its weights; the optional ones may be absent.
const REQUIRED: [&str; 2] = ["config.json", "tokenizer.json"];
const OPTIONAL: [&str; 2] = ["tokenizer_config.json", "generation_config.json"];
/// The list of shards of a checkpoint split over several safetensors files.
const SHARD_INDEX: &str = "model.safetensors.index.json";

/// Downloads `model_id` at `revision` (the default branch when `None`): the one GGUF file
/// `gguf_file`, or else the HF directory's config, tokenizer and safetensors. Returns the
/// local path to load: the GGUF file, or the snapshot directory.
pub fn fetch(
    model_id: &str,
    revision: Option<&str>,
    gguf_file: Option<&str>,
    quiet: bool,
) -> Result<PathBuf> {
    let api = ApiBuilder::from_env()
        .with_progress(!quiet)
        .build()
        .context("cannot set up the Hugging Face hub client")?;
    let repo = api.repo(match revision {
        Some(revision) => Repo::with_revision(model_id.into(), RepoType::Model, revision.into()),
        None => Repo::new(model_id.into(), RepoType::Model),
    });
    let get = |file: &str| -> Result<PathBuf> {
        repo.get(file).map_err(|e| hub_error(model_id, file, e))
    };
    if let Some(file) = gguf_file {
        return get(file);
    }
    let config = get(REQUIRED[0])?;
    get(REQUIRED[1])?;
    for file in OPTIONAL {
        // Absent files are fine; unreachable hubs were already reported above.
        let _ = repo.get(file);
    }
    for shard in safetensors_files(&repo, model_id)? {
        get(&shard)?;
    }
    match config.parent() {
        Some(dir) => Ok(dir.to_path_buf()),
        None => bail!("the hub cache path {} has no directory", config.display()),
    }
}

/// The safetensors files of the checkpoint: the shards its index lists, or `model.safetensors`.
fn safetensors_files(repo: &ApiRepo, model_id: &str) -> Result<Vec<String>> {
    let Ok(index) = repo.get(SHARD_INDEX) else {
        return Ok(vec!["model.safetensors".to_string()]);
    };
    let text = std::fs::read_to_string(&index)
        .with_context(|| format!("cannot read {}", index.display()))?;
    let json: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{model_id}: {SHARD_INDEX} is not JSON"))?;
    let Some(map) = json.get("weight_map").and_then(|m| m.as_object()) else {
        bail!("{model_id}: {SHARD_INDEX} has no weight_map");
    };
    let mut files: Vec<String> = map
        .values()
        .filter_map(|v| v.as_str())
        .map(String::from)
        .collect();
    files.sort();
    files.dedup();
    Ok(files)
}

/// One line that says what could not be fetched, and why, in words a user can act on.
fn hub_error(model_id: &str, file: &str, error: ApiError) -> anyhow::Error {
    let reason = error.to_string().replace('\n', " ");
    let hint = match error {
        ApiError::RequestError(_) => {
            " (no network access to the Hugging Face hub? pass a local model with --model PATH)"
        }
        _ => "",
    };
    anyhow::anyhow!("cannot fetch {file} of {model_id} from the Hugging Face hub: {reason}{hint}")
}
