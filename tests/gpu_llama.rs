//! The patched Llama on the GPU against the same model on the CPU: a tiny random model in bf16, a
//! prompt long enough that decode runs split kernels, then 32 greedy steps. The greedy tokens must
//! be identical.
//!
//! bf16 logits over a 512-token vocabulary often tie exactly, and at a tie either device may pick
//! either token; the prompt's seed is chosen so that every step's greedy lead is at least two bf16
//! steps, and the test checks that this still holds, so that a mismatch means a real difference.
//!
//! Skips with a notice where no CUDA device exists.

mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor, D};
use candle_splitkv::models::llama::{Llama, LoadOptions};
use common::tiny_llama::{write_tiny_model, VOCAB};
use rand::{rngs::StdRng, Rng, SeedableRng};

/// The greedy token and its lead over the runner-up.
fn greedy(logits: &Tensor) -> Result<(u32, f32)> {
    let logits = logits.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    Ok((order[0] as u32, logits[order[0]] - logits[order[1]]))
}

#[test]
fn gpu_and_cpu_greedy_tokens_agree() -> Result<()> {
    let gpu = match Device::new_cuda(0) {
        Ok(dev) => dev,
        Err(e) => {
            println!("skipping GPU test: no CUDA device ({e})");
            return Ok(());
        }
    };
    let dir = tempfile::tempdir()?;
    write_tiny_model(dir.path())?;
    let options = LoadOptions {
        dtype: Some(DType::BF16),
        ..Default::default()
    };
    let mut on_cpu = Llama::load_with(dir.path(), &Device::Cpu, options)?.model;
    let mut on_gpu = Llama::load_with(dir.path(), &gpu, options)?.model;

    let mut rng = StdRng::seed_from_u64(39);
    let prompt: Vec<u32> = (0..300)
        .map(|_| rng.random_range(3..VOCAB as u32))
        .collect();
    let mut cpu_logits = on_cpu.forward(&prompt)?;
    let mut gpu_logits = on_gpu.forward(&prompt)?;
    let (mut cpu_tokens, mut gpu_tokens) = (Vec::new(), Vec::new());
    let (mut worst_diff, mut least_lead) = (0f32, f32::INFINITY);
    for _ in 0..32 {
        let diff = (cpu_logits.to_dtype(DType::F32)?
            - gpu_logits.to_device(&Device::Cpu)?.to_dtype(DType::F32)?)?
        .abs()?
        .max(D::Minus1)?
        .to_scalar::<f32>()?;
        worst_diff = worst_diff.max(diff);
        let (cpu_next, lead) = greedy(&cpu_logits)?;
        let (gpu_next, _) = greedy(&gpu_logits)?;
        least_lead = least_lead.min(lead);
        cpu_tokens.push(cpu_next);
        gpu_tokens.push(gpu_next);
        cpu_logits = on_cpu.forward(&[cpu_next])?;
        gpu_logits = on_gpu.forward(&[gpu_next])?;
    }
    println!(
        "bf16 tiny Llama, prompt {}: logits max |GPU - CPU| {worst_diff:.3}, smallest greedy lead \
         {least_lead:.3}; tokens {gpu_tokens:?}",
        prompt.len()
    );
    assert!(
        least_lead >= 0.125,
        "the prompt no longer has a decisive greedy path (lead {least_lead})"
    );
    assert_eq!(gpu_tokens, cpu_tokens, "GPU and CPU greedy tokens differ");
    let mut distinct = cpu_tokens.clone();
    distinct.sort();
    distinct.dedup();
    assert!(
        distinct.len() > 4,
        "greedy tokens barely vary: {cpu_tokens:?}"
    );
    Ok(())
}
