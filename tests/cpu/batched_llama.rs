//! Batched decoding over a paged cache (`Llama::forward_paged`) against decoding each sequence
//! alone (`Llama::forward` over the model's own cache), on the CPU: sequences of different
//! lengths join and leave between steps (continuous batching), a forked sequence shares its
//! parent's prompt pages, and the greedy tokens are the same while the logits agree to rounding.
//! Then the errors: uneven tokens, a pool too small, a cache made for another model.
//!
//! Chunked prefill with continuous batching (`Llama::forward_mixed`): steps that mix prompt
//! chunks of joining sequences with decode rows of the others give each sequence what it gets
//! alone, a step of decode rows only gives what `forward_paged` gives, and bad steps are errors
//! that leave the lengths as they were.
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

use crate::common::batched::{check_mixed_model, check_model, tiny_requests, Request};
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

#[test]
fn mixed_steps_of_prompt_chunks_and_decode_rows_equal_decoding_alone_on_the_tiny_llama(
) -> Result<()> {
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
        // Chunks the op takes as decode-sized queries and longer ones; the 100-token prompt
        // goes over several steps beside the others' decode rows.
        for (chunk, page_size) in [(16, 7), (23, 16), (7, 1)] {
            model.set_prefill_chunk(chunk)?;
            check_mixed_model(
                &mut model,
                &requests,
                page_size,
                TOLERANCE,
                &format!("{backend:?}, joined {joined}, chunk {chunk}"),
            )?;
        }
    }
    Ok(())
}

#[test]
fn a_mixed_step_of_decode_rows_only_equals_forward_paged() -> Result<()> {
    let model = tiny_model(LoadOptions::default())?;
    let prompts: [&[u32]; 3] = [&[5, 9, 11], &[7; 20], &[4]];
    let mut logits = Vec::new();
    for mixed in [false, true] {
        let mut cache = model.paged_cache(16, 8)?;
        let ids: Vec<_> = prompts.iter().map(|_| cache.add_sequence()).collect();
        for (&id, prompt) in ids.iter().zip(prompts) {
            model.forward_paged(&mut cache, &[id], prompt)?;
        }
        let next = [3u32, 8, 12];
        logits.push(if mixed {
            let inputs: Vec<_> = ids
                .iter()
                .zip(&next)
                .map(|(&id, token)| (id, std::slice::from_ref(token)))
                .collect();
            model.forward_mixed(&mut cache, &inputs)?
        } else {
            model.forward_paged(&mut cache, &ids, &next)?
        });
    }
    let diff = (&logits[0] - &logits[1])?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f32>()?;
    ensure!(
        diff == 0.0,
        "decode rows differ by {diff} between the passes"
    );
    Ok(())
}

#[test]
fn mixed_steps_reject_bad_calls_and_keep_lengths() -> Result<()> {
    let mut model = tiny_model(LoadOptions::default())?;
    model.set_prefill_chunk(32)?;
    let mut cache = model.paged_cache(4, 16)?;
    let a = cache.add_sequence();
    let b = cache.add_sequence();
    let gone = cache.add_sequence();
    cache.free_sequence(gone)?;
    model.forward_mixed(&mut cache, &[(a, &[5, 6, 7]), (b, &[5])])?;
    let long = vec![7u32; 33];
    let chunk = vec![7u32; 32];
    let bad: [(&str, Vec<StepInput>); 7] = [
        ("an empty step", vec![]),
        ("an unknown sequence", vec![(a, &[5]), (gone, &[5])]),
        ("a sequence with no tokens", vec![(a, &[5]), (b, &[])]),
        ("a sequence twice", vec![(a, &[5]), (a, &[6])]),
        ("more than a chunk", vec![(a, &long), (b, &[5])]),
        ("a token out of the vocabulary", vec![(a, &[VOCAB as u32])]),
        // 2 pages held, 2 free: 32 more positions for a and for b need 4.
        ("a step past the pool", vec![(a, &chunk), (b, &chunk)]),
    ];
    for (what, inputs) in &bad {
        ensure!(
            model.forward_mixed(&mut cache, inputs).is_err(),
            "{what} was accepted"
        );
        ensure!(
            (cache.len(a)?, cache.len(b)?) == (3, 1),
            "{what} changed the lengths"
        );
    }
    ensure!(cache.begin_mixed_step(&[]).is_err(), "an empty cache step");
    ensure!(
        cache.begin_mixed_step(&[(a, 1), (b, 0)]).is_err(),
        "a cache step with a count of 0"
    );
    ensure!(
        cache.begin_mixed_step(&[(a, 1), (b, 70)]).is_err(),
        "a cache step past the pool"
    );
    ensure!(
        (cache.len(a)?, cache.len(b)?, cache.free_pages()) == (3, 1, 2),
        "a failed cache step changed the cache"
    );
    Ok(())
}

/// A sequence of a mixed step and the tokens it brings.
type StepInput<'a> = (candle_splitkv::SequenceId, &'a [u32]);

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
    check_model(&mut model, &requests, 16, TOLERANCE, "default model")?;
    // The longest prompt goes in several chunks beside the other sequences' decode rows, which
    // keep the quantized weights' single-row form while the chunks take the many-row form.
    model.set_prefill_chunk(8)?;
    check_mixed_model(
        &mut model,
        &requests,
        16,
        TOLERANCE,
        "default model, mixed steps",
    )
}
