//! Batched decoding over a paged cache (`Llama::forward_paged`) against decoding each sequence
//! alone (`Llama::forward` over the model's own cache), on the CPU: sequences of different
//! lengths join and leave between steps (continuous batching), a forked sequence shares its
//! parent's prompt pages, and the greedy tokens are the same while the logits agree to rounding.
//! Then the errors: uneven tokens, a pool too small, a cache made for another model.
//!
//! The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) runs the same check when it is in
//! `$CANDLE_SPLITKV_CACHE`, else `~/.cache/candle-splitkv`; the test says so and skips that
//! part when it is not.

mod common;

use std::path::PathBuf;

use anyhow::{ensure, Result};
use candle_core::{Device, Tensor};
use candle_splitkv::models::llama::{AttentionBackend, Llama, LoadOptions};
use candle_splitkv::{PagedKvCache, SequenceId};
use common::tiny_llama::{write_tiny_model, VOCAB};
use rand::{rngs::StdRng, Rng, SeedableRng};

const TOLERANCE: f32 = 1e-4;
const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// A request of the batch: its prompt, the step it joins at, and how many tokens it decodes.
struct Request {
    prompt: Vec<u32>,
    joins_at: usize,
    new_tokens: usize,
}

/// Greedy decoding of one prompt alone: the tokens and the logits each was picked from.
fn decode_alone(
    model: &mut Llama,
    prompt: &[u32],
    new_tokens: usize,
) -> Result<Vec<(u32, Tensor)>> {
    model.reset();
    let mut logits = model.forward(prompt)?;
    let mut out = Vec::with_capacity(new_tokens);
    for _ in 0..new_tokens {
        let token = logits.argmax(0)?.to_scalar::<u32>()?;
        out.push((token, logits.clone()));
        logits = model.forward(&[token])?;
    }
    Ok(out)
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    Ok((a - b)?.abs()?.max(0)?.to_scalar::<f32>()?)
}

/// Runs `requests` through one paged cache with continuous batching: each joins at its step
/// (its prompt run alone), every live sequence decodes one token per step in one batched pass,
/// and a sequence leaves (its pages freed) once it has its tokens. With `fork_first`, the first
/// request is forked after its prompt and the fork decodes beside it. Returns, per request (the
/// fork last), the greedy tokens and their logits.
fn decode_batched(
    model: &Llama,
    cache: &mut PagedKvCache,
    requests: &[Request],
    fork_first: bool,
) -> Result<Vec<Vec<(u32, Tensor)>>> {
    let slots = requests.len() + usize::from(fork_first);
    let mut out: Vec<Vec<(u32, Tensor)>> = vec![Vec::new(); slots];
    let mut wanted: Vec<usize> = requests.iter().map(|r| r.new_tokens).collect();
    if fork_first {
        wanted.push(requests[0].new_tokens);
    }
    // (slot, sequence, logits of its next token)
    let mut live: Vec<(usize, SequenceId, Tensor)> = Vec::new();
    let mut step = 0;
    while live.len() + out.iter().filter(|o| !o.is_empty()).count() < slots || !live.is_empty() {
        for (slot, request) in requests.iter().enumerate() {
            if request.joins_at != step {
                continue;
            }
            let id = cache.add_sequence();
            let logits = model
                .forward_paged(cache, &[id], &request.prompt)?
                .squeeze(0)?;
            if slot == 0 && fork_first {
                let fork = cache.fork(id)?;
                live.push((requests.len(), fork, logits.clone()));
            }
            live.push((slot, id, logits));
        }
        // Pick each live sequence's token; those done leave.
        let mut tokens = Vec::new();
        let mut still = Vec::new();
        for (slot, id, logits) in live.drain(..) {
            let token = logits.argmax(0)?.to_scalar::<u32>()?;
            out[slot].push((token, logits));
            if out[slot].len() == wanted[slot] {
                let before = cache.free_pages();
                cache.free_sequence(id)?;
                ensure!(cache.free_pages() >= before, "freeing gave no pages back");
            } else {
                tokens.push(token);
                still.push((slot, id));
            }
        }
        if !still.is_empty() {
            let ids: Vec<SequenceId> = still.iter().map(|&(_, id)| id).collect();
            let logits = model.forward_paged(cache, &ids, &tokens)?;
            for (row, (slot, id)) in still.into_iter().enumerate() {
                live.push((slot, id, logits.get(row)?));
            }
        }
        step += 1;
        ensure!(step < 10_000, "the batch never finished");
    }
    Ok(out)
}

fn check_same(alone: &[(u32, Tensor)], batched: &[(u32, Tensor)], what: &str) -> Result<()> {
    ensure!(alone.len() == batched.len(), "{what}: token counts differ");
    for (i, ((ta, la), (tb, lb))) in alone.iter().zip(batched).enumerate() {
        let diff = max_abs_diff(la, lb)?;
        ensure!(
            diff <= TOLERANCE,
            "{what}: logits of token {i} differ by {diff} (tolerance {TOLERANCE})"
        );
        ensure!(ta == tb, "{what}: token {i} is {tb} batched, {ta} alone");
    }
    Ok(())
}

fn random_prompt(rng: &mut StdRng, len: usize, vocab: u32) -> Vec<u32> {
    (0..len).map(|_| rng.random_range(3..vocab)).collect()
}

/// The requests of the tiny model: prompts on both sides of the op's several-token limit,
/// joining at different steps, decoding different counts.
fn tiny_requests() -> Vec<Request> {
    let mut rng = StdRng::seed_from_u64(41);
    let spec = [
        (5, 0, 24),
        (64, 0, 12),
        (17, 5, 20),
        (100, 9, 16),
        (1, 9, 8),
    ];
    spec.iter()
        .map(|&(len, joins_at, new_tokens)| Request {
            prompt: random_prompt(&mut rng, len, VOCAB as u32),
            joins_at,
            new_tokens,
        })
        .collect()
}

fn check_model(
    model: &mut Llama,
    requests: &[Request],
    page_size: usize,
    what: &str,
) -> Result<()> {
    let alone = requests
        .iter()
        .map(|r| decode_alone(model, &r.prompt, r.new_tokens))
        .collect::<Result<Vec<_>>>()?;
    let mut cache = model.paged_cache(256, page_size)?;
    let batched = decode_batched(model, &mut cache, requests, true)?;
    for (i, (a, b)) in alone.iter().zip(&batched).enumerate() {
        check_same(a, b, &format!("{what}, page {page_size}, request {i}"))?;
    }
    check_same(
        &alone[0],
        &batched[requests.len()],
        &format!("{what}, page {page_size}, the fork of request 0"),
    )?;
    ensure!(
        cache.free_pages() == 256,
        "{what}: every sequence left, yet {} of 256 pages are free",
        cache.free_pages()
    );
    Ok(())
}

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
    check_model(&mut model, &requests, 16, "default model")
}
