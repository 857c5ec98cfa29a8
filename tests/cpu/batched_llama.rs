//! Batched decoding over a paged cache (`Llama::forward_paged`) against decoding each sequence
//! alone (`Llama::forward` over the model's own cache), on the CPU: sequences of different
//! lengths join and leave between steps (continuous batching), a forked sequence shares its
//! parent's prompt pages, and the greedy tokens are the same while the logits agree to rounding.
//! Then the errors: uneven tokens, a pool too small, a cache made for another model.
//!
//! The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) runs the same check when it is in
//! `$CANDLE_SPLITKV_CACHE`, else `~/.cache/candle-splitkv`; the test says so and skips that
//! part when it is not.

use std::path::PathBuf;

use anyhow::{ensure, Result};
use candle_core::Device;
use candle_splitkv::models::llama::{Llama, LoadOptions};
use candle_splitkv::AttentionBackend;
use candle_splitkv::PagedKvCache;

use crate::common::batched::{check_model, tiny_requests, Request};
use crate::common::tiny_llama::{write_tiny_model, VOCAB};

const TOLERANCE: f32 = 1e-4;
const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

fn tiny_model(options: LoadOptions) -> Result<Llama> {
    let dir = tempfile::tempdir()?;
    write_tiny_model(dir.path())?;
    Ok(Llama::load_with(dir.path(), &Device::Cpu, options)?.model)
}

#[test]
fn batched_greedy_decoding_equals_decoding_alone_on_the_tiny_llama() -> Result<()> {
    let requests = tiny_requests();
    for (joined, backend) in [
        (false, AttentionBackend::SplitKv),
        (true, AttentionBackend::SplitKv),
        (false, AttentionBackend::Naive),
    ] {
        let mut model = tiny_model(LoadOptions {
            backend,
            joined_layers: Some(joined),
            ..LoadOptions::default()
        })?;
        for page_size in [1, 7, 16] {
            check_model(
                &mut model,
                &requests,
                page_size,
                TOLERANCE,
                &format!("{backend:?}, joined {joined}"),
            )?;
        }
    }
    Ok(())
}

#[test]
fn batched_decoding_rejects_bad_calls_and_keeps_lengths() -> Result<()> {
    let model = tiny_model(LoadOptions::default())?;
    let mut cache = model.paged_cache(4, 16)?;
    let a = cache.add_sequence();
    let b = cache.add_sequence();
    model.forward_paged(&mut cache, &[a, b], &[5, 6])?;
    let uneven = model.forward_paged(&mut cache, &[a, b], &[5, 6, 7]);
    ensure!(uneven.is_err(), "3 tokens over 2 sequences were accepted");
    let out_of_vocab = model.forward_paged(&mut cache, &[a], &[VOCAB as u32]);
    ensure!(
        out_of_vocab.is_err(),
        "a token out of the vocabulary was accepted"
    );
    // 2 pages held, 2 free: 40 more positions for each of a and b need 4.
    let too_many = vec![7u32; 80];
    let err = model
        .forward_paged(&mut cache, &[a, b], &too_many)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    ensure!(
        err.contains("free pages"),
        "a step past the pool gave: {err:?}"
    );
    ensure!(
        (cache.len(a)?, cache.len(b)?) == (1, 1),
        "a failed step changed the lengths"
    );
    let other = tiny_model(LoadOptions::default())?;
    let mut small = PagedKvCache::new(&candle_splitkv::PagedKvCacheConfig {
        layers: 1,
        ..cache.config().clone()
    })?;
    let c = small.add_sequence();
    ensure!(
        other.forward_paged(&mut small, &[c], &[5]).is_err(),
        "a cache of 1 layer was accepted by a model of 2"
    );
    Ok(())
}

/// The directory holding the default model, when it is there.
fn default_model() -> Option<PathBuf> {
    let cache = match std::env::var_os("CANDLE_SPLITKV_CACHE") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(std::env::var_os("HOME")?).join(".cache/candle-splitkv"),
    };
    let path = cache.join(DEFAULT_MODEL_FILE);
    if path.is_file() {
        Some(path)
    } else {
        eprintln!(
            "skipping the default model: {DEFAULT_MODEL_FILE} is not in {} \
             (scripts/fetch-model.sh fetches it)",
            cache.display()
        );
        None
    }
}

#[test]
fn batched_greedy_decoding_equals_decoding_alone_on_the_default_model() -> Result<()> {
    let Some(path) = default_model() else {
        return Ok(());
    };
    let loaded = Llama::load(&path, &Device::Cpu, AttentionBackend::SplitKv)?;
    let mut model = loaded.model;
    let tokenizer = loaded.tokenizer;
    let texts = [
        "The tidal barrier was finished in",
        "Paris is the capital of France, and its river is called the",
        "Rust is a programming language that",
        "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    ];
    let requests = texts
        .iter()
        .zip([0, 0, 3, 6])
        .map(|(text, joins_at)| {
            let encoding = tokenizer
                .encode(*text, false)
                .map_err(|e| anyhow::anyhow!("tokenizing: {e}"))?;
            Ok(Request {
                prompt: encoding.get_ids().to_vec(),
                joins_at,
                new_tokens: 16,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    check_model(&mut model, &requests, 16, TOLERANCE, "default model")
}
