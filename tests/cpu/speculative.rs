//! Speculative decoding on the tiny Llama (CPU): greedy verification emits exactly the tokens
//! of plain greedy decoding, whatever the drafter proposes, and kept drafts save target passes.

use std::path::{Path, PathBuf};

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_splitkv::models::llama::{Llama, LoadOptions, WeightForm, WeightFormPolicy};
use candle_splitkv::models::speculative::{
    DraftModel, Drafter, PromptLookup, Sampling, SpeculativeDecoder,
};
use candle_splitkv::test_hooks::split_plan;
use candle_splitkv::{AttentionStep, CachedAttention, KvCache, KvCacheConfig, SplitKvAttention};

use crate::common::tiny_llama::{
    decisive_next, write_decisive_tiny_model, write_tiny_model, VOCAB,
};

fn load(dir: &Path) -> Result<Llama> {
    Ok(Llama::load_with(dir, &Device::Cpu, LoadOptions::default())?.model)
}

fn plain_greedy(model: &mut Llama, prompt: &[u32], steps: usize) -> Result<Vec<u32>> {
    model.reset();
    let mut logits = model.forward(prompt)?;
    let mut out = Vec::new();
    for _ in 0..steps {
        let token = logits.argmax(0)?.to_scalar::<u32>()?;
        out.push(token);
        logits = model.forward(&[token])?;
    }
    Ok(out)
}

/// A prompt that walks the decisive model's own chain, then restarts it: prompt lookup finds
/// the continuation the model is about to produce.
fn chain_prompt() -> Vec<u32> {
    let mut chain = vec![7u32];
    for _ in 0..24 {
        let last = *chain.last().unwrap_or(&7) as usize;
        chain.push(decisive_next(last) as u32);
    }
    chain.extend_from_slice(&[3, 7]);
    chain
}

fn speculate<D: Drafter>(
    target: &mut Llama,
    drafter: D,
    draft_len: usize,
    prompt: &[u32],
    steps: usize,
) -> Result<candle_splitkv::models::speculative::Generated> {
    let mut decoder = SpeculativeDecoder::new(drafter, draft_len, Sampling::Greedy, 0);
    let mut streamed = Vec::new();
    let out = decoder.generate(target, prompt, steps, &[], |t| {
        streamed.push(t);
        Ok(())
    })?;
    assert_eq!(
        streamed, out.tokens,
        "streamed tokens differ from the result"
    );
    Ok(out)
}

#[test]
fn greedy_speculation_is_plain_greedy_decoding() -> Result<()> {
    let target_dir = tempfile::tempdir()?;
    write_decisive_tiny_model(target_dir.path())?;
    let draft_dir = tempfile::tempdir()?;
    write_tiny_model(draft_dir.path())?;
    let mut target = load(target_dir.path())?;
    let steps = 40;
    for prompt in [chain_prompt(), vec![1, 40, 41, 40, 41, 40, 99, 5]] {
        let want = plain_greedy(&mut target, &prompt, steps)?;
        for draft_len in [1, 4, 15] {
            let lookup = speculate(
                &mut target,
                PromptLookup::default(),
                draft_len,
                &prompt,
                steps,
            )?;
            assert_eq!(lookup.tokens, want, "prompt lookup, {draft_len} drafts");
            // A different model: most drafts are rejected, the output must not change.
            let other = DraftModel::new(load(draft_dir.path())?, Sampling::Greedy, 1);
            let drafted = speculate(&mut target, other, draft_len, &prompt, steps)?;
            assert_eq!(
                drafted.tokens, want,
                "other draft model, {draft_len} drafts"
            );
            // The target itself as the drafter: every draft is kept.
            let same = DraftModel::new(load(target_dir.path())?, Sampling::Greedy, 1);
            let kept = speculate(&mut target, same, draft_len, &prompt, steps)?;
            assert_eq!(kept.tokens, want, "self-drafting, {draft_len} drafts");
            assert_eq!(
                kept.accepted, kept.drafted,
                "self-drafting rejected a draft"
            );
            assert!(kept.target_passes <= steps.div_ceil(draft_len + 1));
        }
    }
    // On the chain prompt, lookup drafts are the model's own continuation for the 24 tokens the
    // prompt's chain covers: four drafts kept a pass, five tokens a pass.
    let prompt = chain_prompt();
    let lookup = speculate(&mut target, PromptLookup::default(), 4, &prompt, 24)?;
    assert!(
        lookup.accepted >= 18 && lookup.target_passes <= 6,
        "lookup kept {} of {} drafts in {} passes",
        lookup.accepted,
        lookup.drafted,
        lookup.target_passes
    );
    Ok(())
}

#[test]
fn sampling_and_stop_tokens() -> Result<()> {
    let dir = tempfile::tempdir()?;
    write_tiny_model(dir.path())?;
    let mut target = load(dir.path())?;
    let prompt = [1u32, 9, 10, 11, 9, 10];
    let want = plain_greedy(&mut target, &prompt, 12)?;
    // Stop at the fifth greedy token: the output ends there, stop token included.
    let stop = want[4];
    let first = want.iter().position(|&t| t == stop).unwrap_or(4);
    let mut decoder = SpeculativeDecoder::new(PromptLookup::default(), 4, Sampling::Greedy, 0);
    let out = decoder.generate(&mut target, &prompt, 12, &[stop], |_| Ok(()))?;
    assert_eq!(out.tokens, want[..=first]);

    let drafter = DraftModel::new(load(dir.path())?, Sampling::Temperature(0.9), 3);
    let mut decoder = SpeculativeDecoder::new(drafter, 3, Sampling::Temperature(0.9), 4);
    let out = decoder.generate(&mut target, &prompt, 30, &[], |_| Ok(()))?;
    assert_eq!(out.tokens.len(), 30);
    assert!(out.tokens.iter().all(|&t| (t as usize) < VOCAB));
    // Draft and target are the same model at the same temperature: p = q, every draft kept.
    assert_eq!(out.accepted, out.drafted);

    let mut decoder = SpeculativeDecoder::new(PromptLookup::default(), 4, Sampling::Greedy, 0);
    assert!(decoder
        .generate(&mut target, &[], 4, &[], |_| Ok(()))
        .is_err());
    let mut decoder =
        SpeculativeDecoder::new(PromptLookup::default(), 4, Sampling::Temperature(-1.0), 0);
    assert!(decoder
        .generate(&mut target, &prompt, 4, &[], |_| Ok(()))
        .is_err());
    Ok(())
}

/// A repeat penalty: logits of tokens already in `seen` move towards zero (positive ones divided
/// by 1.3, negative ones multiplied).
fn penalize(seen: &[u32], logits: &mut [f32]) {
    let mut done = std::collections::HashSet::new();
    for &token in seen {
        if let (true, Some(x)) = (done.insert(token), logits.get_mut(token as usize)) {
            *x = if *x >= 0.0 { *x / 1.3 } else { *x * 1.3 };
        }
    }
}

/// The first index of the largest value.
fn first_argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Plain greedy decoding with `penalize` applied before every pick.
fn plain_greedy_penalized(model: &mut Llama, prompt: &[u32], steps: usize) -> Result<Vec<u32>> {
    model.reset();
    let mut logits = model.forward(prompt)?.to_vec1::<f32>()?;
    let mut seen = prompt.to_vec();
    for _ in 0..steps {
        penalize(&seen, &mut logits);
        let token = first_argmax(&logits);
        seen.push(token);
        logits = model.forward(&[token])?.to_vec1::<f32>()?;
    }
    Ok(seen[prompt.len()..].to_vec())
}

#[test]
fn steps_with_an_adjustment_are_plain_greedy_with_it() -> Result<()> {
    let dir = tempfile::tempdir()?;
    write_tiny_model(dir.path())?;
    let mut target = load(dir.path())?;
    let prompt = [1u32, 9, 10, 11, 9, 10, 12, 9, 10];
    let steps = 40;
    let want = plain_greedy_penalized(&mut target, &prompt, steps)?;
    // The penalty must matter here, or this would only repeat the test above.
    assert_ne!(want, plain_greedy(&mut target, &prompt, steps)?);
    for draft_len in [1, 4, 8] {
        let mut decoder =
            SpeculativeDecoder::new(PromptLookup::default(), draft_len, Sampling::Greedy, 0);
        // The caller's own prefill: all of the prompt but its last token.
        target.reset();
        target.forward(&prompt[..prompt.len() - 1])?;
        let mut context = prompt.to_vec();
        let (mut drafted, mut accepted) = (0, 0);
        let mut adjust = |seen: &[u32], logits: &mut [f32]| {
            penalize(seen, logits);
            Ok(())
        };
        while context.len() - prompt.len() < steps {
            let left = steps - (context.len() - prompt.len());
            let step = decoder.step(&mut target, &context, left, &mut adjust)?;
            assert!(
                !step.tokens.is_empty() && step.tokens.len() <= left,
                "{} tokens with {left} left",
                step.tokens.len()
            );
            assert_eq!(step.tokens.len(), step.accepted + 1);
            assert!(step.accepted <= step.drafted && step.drafted <= draft_len);
            drafted += step.drafted;
            accepted += step.accepted;
            context.extend_from_slice(&step.tokens);
            assert_eq!(target.cache_len(), context.len() - 1);
        }
        assert_eq!(
            &context[prompt.len()..],
            want,
            "{draft_len} drafts: {accepted} of {drafted} kept"
        );
        assert!(
            drafted > 0,
            "{draft_len} drafts: prompt lookup drafted nothing"
        );
    }
    Ok(())
}

#[test]
fn a_step_needs_the_context_the_cache_holds() -> Result<()> {
    let dir = tempfile::tempdir()?;
    write_tiny_model(dir.path())?;
    let mut target = load(dir.path())?;
    let prompt = [1u32, 9, 10, 11];
    let mut decoder = SpeculativeDecoder::new(PromptLookup::default(), 4, Sampling::Greedy, 0);
    let mut keep = |_: &[u32], _: &mut [f32]| Ok(());
    // The whole prompt is cached: its last token would run twice.
    target.reset();
    target.forward(&prompt)?;
    let error = decoder
        .step(&mut target, &prompt, 4, &mut keep)
        .expect_err("a context no longer than the cache");
    assert!(
        error.to_string().contains("cache holds 4 tokens"),
        "{error}"
    );
    // Two tokens missing from the cache.
    assert!(decoder
        .step(&mut target, &[&prompt[..], &[5, 6]].concat(), 4, &mut keep)
        .is_err());
    assert!(decoder.step(&mut target, &[], 4, &mut keep).is_err());
    // No token allowed, or an adjustment that fails: errors that leave the cache as it was.
    target.truncate(prompt.len() - 1);
    assert!(decoder.step(&mut target, &prompt, 0, &mut keep).is_err());
    let mut fail = |_: &[u32], _: &mut [f32]| Err(candle_core::Error::Msg("no".into()));
    assert!(decoder.step(&mut target, &prompt, 4, &mut fail).is_err());
    assert_eq!(target.cache_len(), prompt.len() - 1);
    let step = decoder.step(&mut target, &prompt, 4, &mut keep)?;
    assert_eq!(target.cache_len(), prompt.len() + step.accepted);
    Ok(())
}

/// The default model (SmolLM2-135M Q4_1), if present where the fetch script puts it.
fn default_model() -> Option<PathBuf> {
    let dir = match std::env::var_os("CANDLE_SPLITKV_CACHE") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(std::env::var_os("HOME")?).join(".cache/candle-splitkv"),
    };
    let path = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    if !path.is_file() {
        eprintln!("skipping: the default model is not at {}", path.display());
        return None;
    }
    Some(path)
}

/// The first cache length at which the op, already splitting the cache, cuts it elsewhere
/// (with this machine's threads).
fn moved_cut(q_heads: usize, kv_heads: usize, head_dim: usize) -> Result<usize> {
    let op = SplitKvAttention::new(1.0);
    let q = Tensor::zeros((1, 1, q_heads, head_dim), DType::F32, &Device::Cpu)?;
    let chunk = |len: usize| -> Result<Option<usize>> {
        let k = Tensor::zeros((1, len, kv_heads, head_dim), DType::F32, &Device::Cpu)?;
        let plan = split_plan(&op, &q, &k)?;
        Ok((plan.num_splits > 1).then_some(plan.chunk_size))
    };
    for len in 9..4096 {
        let (before, at) = (chunk(len - 1)?, chunk(len)?);
        if before.is_some() && at.is_some() && before != at {
            return Ok(len);
        }
    }
    anyhow::bail!("the split of the cache does not move below 4096 positions")
}

/// Attention of a few tokens "as steps" is bit for bit that of one-token steps, across a length
/// where the op's split of the cache moves (one call over all of them rounds differently there).
#[test]
fn attention_as_steps_is_one_token_steps() -> Result<()> {
    as_steps_against_steps(DType::F32, (1.0, 1.0))
}

/// The same over an fp8 cache with scales: verification reads it exactly as decoding does.
#[test]
fn attention_as_steps_over_an_fp8_cache_is_one_token_steps() -> Result<()> {
    as_steps_against_steps(DType::F8E4M3, (0.05, 0.02))
}

fn as_steps_against_steps(cache_dtype: DType, (k_scale, v_scale): (f32, f32)) -> Result<()> {
    let (q_heads, kv_heads, head_dim, t) = (9, 3, 64, 16);
    let cut = moved_cut(q_heads, kv_heads, head_dim)?;
    let past = cut - t / 2;
    let device = Device::Cpu;
    let mut cache = KvCache::new(&KvCacheConfig {
        batch: 1,
        kv_heads,
        head_dim,
        initial_capacity: 64,
        max_capacity: past + t,
        dtype: cache_dtype,
        device: device.clone(),
        k_scale,
        v_scale,
    })?;
    let kv = |len: usize| Tensor::randn(0f32, 1.0, (1, len, kv_heads, head_dim), &device);
    cache.append(&kv(past)?, &kv(past)?)?;
    let q = Tensor::randn(0f32, 1.0, (1, t, q_heads, head_dim), &device)?;
    let (k, v) = (kv(t)?, kv(t)?);
    let attention = CachedAttention::new(0.125);

    let mut steps = Vec::new();
    for i in 0..t {
        let narrow = |x: &Tensor| x.narrow(1, i, 1);
        let out = attention.forward(
            &narrow(&q)?,
            &narrow(&k)?,
            &narrow(&v)?,
            AttentionStep::new(&mut cache),
        )?;
        steps.push(out.flatten_all()?.to_vec1::<f32>()?);
    }
    let rows = |out: Tensor| -> Result<Vec<Vec<f32>>> {
        Ok(out.squeeze(0)?.flatten_from(1)?.to_vec2::<f32>()?)
    };
    cache.truncate(past);
    let as_steps =
        rows(attention.forward(&q, &k, &v, AttentionStep::new(&mut cache).as_decode_steps())?)?;
    assert_eq!(as_steps, steps);
    cache.truncate(past);
    let one_call = rows(attention.forward(&q, &k, &v, AttentionStep::new(&mut cache))?)?;
    assert_ne!(
        one_call,
        steps,
        "one call over the cache of length {} should round differently",
        past + t
    );
    Ok(())
}

/// On the CPU, a verification pass computes each token exactly as a one-token step does: the
/// weights in the decode form, the attention split as each step splits it.
#[test]
fn forward_all_rows_are_one_token_steps_on_the_cpu() -> Result<()> {
    let Some(path) = default_model() else {
        return Ok(());
    };
    // One fixed weight form: a form measured at load on a busy machine can be dense f32, whose
    // gemm need not round a row of sixteen as it rounds a row alone. The claim under test is the
    // attention's split and the rows' single-row form, not the measurement.
    let options = LoadOptions {
        weight_forms: WeightFormPolicy::Fixed(WeightForm::Q8_0),
        ..LoadOptions::default()
    };
    let mut model = Llama::load_with(&path, &Device::Cpu, options)?.model;
    let config = model.config().clone();
    let (kv_heads, q_heads, head_dim) = (
        config.num_key_value_heads,
        config.num_attention_heads,
        config.head_dim,
    );
    let cut = moved_cut(q_heads, kv_heads, head_dim)?;
    let tokens: Vec<u32> = (0..cut + 8).map(|i| (i * 37 % 5000) as u32 + 10).collect();
    let (past, run) = tokens.split_at(cut - 8);
    model.reset();
    model.forward(past)?;
    let mut steps = Vec::new();
    for &token in run {
        steps.push(model.forward(&[token])?.to_vec1::<f32>()?);
    }
    model.truncate(past.len());
    let rows = model.forward_all(run)?.to_vec2::<f32>()?;
    for (i, (row, step)) in rows.iter().zip(&steps).enumerate() {
        assert!(
            row == step,
            "token {i} of the pass (cache length {})",
            past.len() + i + 1
        );
    }
    Ok(())
}
