//! Continuous batching over a paged cache against decoding each sequence alone, for the CPU and
//! GPU batched-decoding suites.

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};
use candle_splitkv::models::llama::Llama;
use candle_splitkv::{PagedKvCache, SequenceId};
use rand::{rngs::StdRng, Rng, SeedableRng};

use super::tiny_llama::VOCAB;

/// A request of the batch: its prompt, the step it joins at, and how many tokens it decodes.
pub struct Request {
    pub prompt: Vec<u32>,
    pub joins_at: usize,
    pub new_tokens: usize,
}

/// Greedy decoding of one prompt alone: the tokens and the logits each was picked from.
pub fn decode_alone(
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
    let f32_on_cpu = |x: &Tensor| x.to_device(&Device::Cpu)?.to_dtype(DType::F32);
    Ok((f32_on_cpu(a)? - f32_on_cpu(b)?)?
        .abs()?
        .max(0)?
        .to_scalar::<f32>()?)
}

/// Runs `requests` through one paged cache with continuous batching: each joins at its step
/// (its prompt run alone), every live sequence decodes one token per step in one batched pass,
/// and a sequence leaves (its pages freed) once it has its tokens. With `fork_first`, the first
/// request is forked after its prompt and the fork decodes beside it. Returns, per request (the
/// fork last), the greedy tokens and their logits.
pub fn decode_batched(
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

/// Runs `requests` through one paged cache with chunked prefill and continuous batching: a
/// request joins at its step, and every step is one [`Llama::forward_mixed`] pass in which each
/// live sequence brings either its prompt's next chunk of at most `prefill_chunk` tokens or the
/// one token it decodes. A sequence leaves (its pages freed) once it has its tokens. Returns,
/// per request, the greedy tokens and their logits.
pub fn decode_mixed(
    model: &Llama,
    cache: &mut PagedKvCache,
    requests: &[Request],
) -> Result<Vec<Vec<(u32, Tensor)>>> {
    struct Live {
        slot: usize,
        id: SequenceId,
        /// Prompt tokens fed so far.
        fed: usize,
        /// The token it decodes next, once its prompt is in.
        next: Option<u32>,
    }
    let chunk = model.prefill_chunk();
    let mut out: Vec<Vec<(u32, Tensor)>> = vec![Vec::new(); requests.len()];
    let mut live: Vec<Live> = Vec::new();
    let mut finished = 0;
    let mut step = 0;
    while finished < requests.len() {
        for (slot, request) in requests.iter().enumerate() {
            if request.joins_at == step {
                let id = cache.add_sequence();
                live.push(Live {
                    slot,
                    id,
                    fed: 0,
                    next: None,
                });
            }
        }
        if !live.is_empty() {
            let inputs: Vec<(SequenceId, &[u32])> = live
                .iter()
                .map(|l| {
                    let prompt = &requests[l.slot].prompt;
                    let tokens = match l.next.as_ref() {
                        Some(next) => std::slice::from_ref(next),
                        None => &prompt[l.fed..prompt.len().min(l.fed + chunk)],
                    };
                    (l.id, tokens)
                })
                .collect();
            let logits = model.forward_mixed(cache, &inputs)?;
            let counts: Vec<usize> = inputs.iter().map(|(_, t)| t.len()).collect();
            let mut still = Vec::new();
            for (row, (mut l, count)) in live.drain(..).zip(counts).enumerate() {
                if l.next.is_none() {
                    l.fed += count;
                    if l.fed < requests[l.slot].prompt.len() {
                        still.push(l);
                        continue;
                    }
                }
                let logits = logits.get(row)?;
                let token = logits.argmax(0)?.to_scalar::<u32>()?;
                out[l.slot].push((token, logits));
                if out[l.slot].len() == requests[l.slot].new_tokens {
                    cache.free_sequence(l.id)?;
                    finished += 1;
                } else {
                    l.next = Some(token);
                    still.push(l);
                }
            }
            live = still;
        }
        step += 1;
        ensure!(step < 10_000, "the batch never finished");
    }
    Ok(out)
}

/// Same greedy tokens, and logits within `tolerance`.
pub fn check_same(
    alone: &[(u32, Tensor)],
    batched: &[(u32, Tensor)],
    tolerance: f32,
    what: &str,
) -> Result<()> {
    ensure!(alone.len() == batched.len(), "{what}: token counts differ");
    for (i, ((ta, la), (tb, lb))) in alone.iter().zip(batched).enumerate() {
        let diff = max_abs_diff(la, lb)?;
        ensure!(
            diff <= tolerance,
            "{what}: logits of token {i} differ by {diff} (tolerance {tolerance})"
        );
        ensure!(ta == tb, "{what}: token {i} is {tb} batched, {ta} alone");
    }
    Ok(())
}
pub fn random_prompt(rng: &mut StdRng, len: usize, vocab: u32) -> Vec<u32> {
    (0..len).map(|_| rng.random_range(3..vocab)).collect()
}

/// The requests of the tiny model: prompts on both sides of the op's several-token limit,
/// joining at different steps, decoding different counts.
pub fn tiny_requests() -> Vec<Request> {
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

/// Decodes `requests` alone, then batched with a fork of the first (see [`decode_batched`]), in
/// a pool of 256 pages of `page_size`, and checks that they agree to `tolerance` and that every
/// page is free at the end.
pub fn check_model(
    model: &mut Llama,
    requests: &[Request],
    page_size: usize,
    tolerance: f32,
    what: &str,
) -> Result<()> {
    let (alone, batched) = alone_and_together(model, requests, page_size, what, |model, cache| {
        decode_batched(model, cache, requests, true)
    })?;
    check_all_same(&alone, &batched, tolerance, page_size, what)?;
    check_same(
        &alone[0],
        &batched[requests.len()],
        tolerance,
        &format!("{what}, page {page_size}, the fork of request 0"),
    )
}

/// Decodes `requests` alone, then all together with chunked prefill in steps that mix prompt
/// chunks with decode rows (see [`decode_mixed`]), in a pool of 256 pages of `page_size`, and
/// checks that they agree to `tolerance` and that every page is free at the end.
pub fn check_mixed_model(
    model: &mut Llama,
    requests: &[Request],
    page_size: usize,
    tolerance: f32,
    what: &str,
) -> Result<()> {
    let (alone, mixed) = alone_and_together(model, requests, page_size, what, |model, cache| {
        decode_mixed(model, cache, requests)
    })?;
    check_all_same(&alone, &mixed, tolerance, page_size, what)
}

type Decoded = Vec<Vec<(u32, Tensor)>>;

/// Each request decoded alone, and all of them through `together` over a pool of 256 pages of
/// `page_size`, which must be free again afterwards.
fn alone_and_together(
    model: &mut Llama,
    requests: &[Request],
    page_size: usize,
    what: &str,
    together: impl FnOnce(&Llama, &mut PagedKvCache) -> Result<Decoded>,
) -> Result<(Decoded, Decoded)> {
    let alone = requests
        .iter()
        .map(|r| decode_alone(model, &r.prompt, r.new_tokens))
        .collect::<Result<Vec<_>>>()?;
    let mut cache = model.paged_cache(256, page_size)?;
    let together = together(model, &mut cache)?;
    ensure!(
        cache.free_pages() == 256,
        "{what}: every sequence left, yet {} of 256 pages are free",
        cache.free_pages()
    );
    Ok((alone, together))
}

/// Request i decoded alone against request i decoded together, for every request.
fn check_all_same(
    alone: &Decoded,
    together: &Decoded,
    tolerance: f32,
    page_size: usize,
    what: &str,
) -> Result<()> {
    for (i, (a, b)) in alone.iter().zip(together).enumerate() {
        check_same(
            a,
            b,
            tolerance,
            &format!("{what}, page {page_size}, request {i}"),
        )?;
    }
    Ok(())
}
