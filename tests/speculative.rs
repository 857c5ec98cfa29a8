//! Speculative decoding on the tiny Llama (CPU): greedy verification emits exactly the tokens
//! of plain greedy decoding, whatever the drafter proposes, and kept drafts save target passes.

mod common;

use std::path::Path;

use anyhow::Result;
use candle_core::Device;
use candle_splitkv::models::llama::{Llama, LoadOptions};
use candle_splitkv::models::speculative::{
    DraftModel, Drafter, PromptLookup, Sampling, SpeculativeDecoder,
};
use common::tiny_llama::{decisive_next, write_decisive_tiny_model, write_tiny_model, VOCAB};

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
