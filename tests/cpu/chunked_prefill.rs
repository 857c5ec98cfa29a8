//! Chunked prefill on the tiny Llama, on the CPU: a prompt written and attended in chunks, each a
//! block of queries over the chunks before it, gives the logits of one pass over the whole
//! prompt (to f32 rounding), through the model's own cache and through a paged one, for every
//! backend; and the greedy tokens after it are the same.

use anyhow::Result;
use candle_core::{Device, Tensor};
use candle_splitkv::models::llama::{Llama, LoadOptions, DEFAULT_PREFILL_CHUNK};
use candle_splitkv::AttentionBackend;
use rand::{rngs::StdRng, Rng, SeedableRng};

use crate::common::tiny_llama::{write_tiny_model, VOCAB};

const TOLERANCE: f32 = 1e-4;
const PROMPT: usize = 150;

fn tiny_model(backend: AttentionBackend) -> Result<Llama> {
    let dir = tempfile::tempdir()?;
    write_tiny_model(dir.path())?;
    let options = LoadOptions {
        backend,
        ..LoadOptions::default()
    };
    Ok(Llama::load_with(dir.path(), &Device::Cpu, options)?.model)
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    Ok((a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
}

fn prompt(len: usize) -> Vec<u32> {
    let mut rng = StdRng::seed_from_u64(5);
    (0..len)
        .map(|_| rng.random_range(3..VOCAB as u32))
        .collect()
}

/// The prompt's last logits and 8 greedy tokens after it, with the model's chunk size as set.
fn prefill_and_decode(model: &mut Llama, prompt: &[u32]) -> Result<(Tensor, Vec<u32>)> {
    model.reset();
    let prompt_logits = model.forward(prompt)?;
    let mut logits = prompt_logits.clone();
    let mut tokens = Vec::new();
    for _ in 0..8 {
        let token = logits.argmax(0)?.to_scalar::<u32>()?;
        tokens.push(token);
        logits = model.forward(&[token])?;
    }
    Ok((prompt_logits, tokens))
}

#[test]
fn chunked_prefill_equals_one_pass() -> Result<()> {
    let prompt = prompt(PROMPT);
    for backend in [AttentionBackend::SplitKv, AttentionBackend::Naive] {
        let mut model = tiny_model(backend)?;
        assert_eq!(model.prefill_chunk(), DEFAULT_PREFILL_CHUNK);
        let (whole, whole_tokens) = prefill_and_decode(&mut model, &prompt)?;
        // Chunks the op takes (up to its query-token limit) and longer ones, a ragged last
        // chunk, and one token at a time.
        for chunk in [1, 7, 16, 17, 64] {
            model.set_prefill_chunk(chunk)?;
            let (chunked, tokens) = prefill_and_decode(&mut model, &prompt)?;
            assert_eq!(model.cache_len(), PROMPT + 8);
            let diff = max_abs_diff(&chunked, &whole)?;
            assert!(diff < TOLERANCE, "{backend:?} chunk {chunk}: diff {diff}");
            assert_eq!(tokens, whole_tokens, "{backend:?} chunk {chunk}");
        }
        model.set_prefill_chunk(DEFAULT_PREFILL_CHUNK)?;
    }
    Ok(())
}

/// `forward_all` in chunks gives every row one pass gives, and `forward_with_lse` joins the
/// chunks' LSE of each layer along t.
#[test]
fn chunked_forward_all_and_lse_equal_one_pass() -> Result<()> {
    let prompt = prompt(40);
    let mut model = tiny_model(AttentionBackend::SplitKv)?;
    let whole = model.forward_all(&prompt)?;
    model.reset();
    model.set_prefill_chunk(12)?;
    let chunked = model.forward_all(&prompt)?;
    assert_eq!(chunked.dims(), whole.dims());
    let diff = max_abs_diff(&chunked, &whole)?;
    assert!(diff < TOLERANCE, "forward_all: diff {diff}");

    model.reset();
    let (logits, lses) = model.forward_with_lse(&prompt)?;
    let diff = max_abs_diff(&logits, &whole.get(prompt.len() - 1)?)?;
    assert!(diff < TOLERANCE, "forward_with_lse: diff {diff}");
    assert_eq!(lses.len(), model.config().num_hidden_layers);
    for lse in &lses {
        assert_eq!(lse.dims(), [1, model.config().num_attention_heads, 40]);
    }
    Ok(())
}

/// A paged prompt in chunks equals the model's own one-pass prefill, for two sequences at once.
#[test]
fn chunked_paged_prefill_equals_one_pass() -> Result<()> {
    let mut model = tiny_model(AttentionBackend::SplitKv)?;
    let prompts = [prompt(PROMPT), prompt(PROMPT + 9)[9..].to_vec()];
    let whole: Vec<Tensor> = prompts
        .iter()
        .map(|p| {
            model.reset();
            model.forward(p)
        })
        .collect::<candle_core::Result<_>>()?;
    model.set_prefill_chunk(23)?;
    let mut cache = model.paged_cache(64, 8)?;
    let ids = [cache.add_sequence(), cache.add_sequence()];
    let tokens: Vec<u32> = prompts.concat();
    let logits = model.forward_paged(&mut cache, &ids, &tokens)?;
    for (s, expected) in whole.iter().enumerate() {
        assert_eq!(cache.len(ids[s])?, PROMPT);
        let diff = max_abs_diff(&logits.get(s)?, expected)?;
        assert!(diff < TOLERANCE, "sequence {s}: diff {diff}");
    }
    Ok(())
}

#[test]
fn prefill_chunk_must_be_positive() -> Result<()> {
    let mut model = tiny_model(AttentionBackend::SplitKv)?;
    let err = model.set_prefill_chunk(0).unwrap_err();
    assert!(err.to_string().contains("prefill_chunk"), "{err}");
    let dir = tempfile::tempdir()?;
    write_tiny_model(dir.path())?;
    let options = LoadOptions {
        prefill_chunk: 0,
        ..LoadOptions::default()
    };
    assert!(Llama::load_with(dir.path(), &Device::Cpu, options).is_err());
    Ok(())
}
