//! One-token decode steps on CUDA: fed from device memory, and captured as CUDA graphs.
//!
//! - The cache write at device positions against the CPU cache's append: identical bytes, in
//!   bf16, f32 and fp8 with a scale, from strided rows.
//! - Graph against eager: the tiny Llama decodes 32 steps with graphs on and off, through a cache
//!   growth (a new graph), a rollback and a verification pass between steps; every logit must be
//!   identical, in bf16 and with an fp8 cache, fused and unfused.
//! - Steps fed from device memory against the host-fed path (`forward_all` of one token): the
//!   same greedy tokens, logits within bf16 rounding.
//!
//! Skips with a notice where no CUDA device exists. The graph test runs in a process of its own:
//! a capture fails when another thread of the process synchronises the device meanwhile.

use anyhow::Result;
use candle_core::{DType, Device, Tensor, D};
use candle_splitkv::models::llama::{Llama, LoadOptions};
use candle_splitkv::{KvCache, KvCacheConfig};
use rand::{rngs::StdRng, Rng, SeedableRng};

use crate::common::own_process::in_own_process;
use crate::common::tiny_llama::{write_decisive_tiny_model, VOCAB};
use crate::common::{fp8_kv_built, gpu, greedy};

fn cache_config(dtype: DType, device: &Device, scales: (f32, f32)) -> KvCacheConfig {
    KvCacheConfig {
        batch: 2,
        kv_heads: 3,
        head_dim: 64,
        initial_capacity: 8,
        max_capacity: 64,
        dtype,
        device: device.clone(),
        k_scale: scales.0,
        v_scale: scales.1,
    }
}

/// The stored bytes of a cache, as f32 on the host.
fn stored(cache: &KvCache) -> Result<Vec<f32>> {
    let (k, v) = cache.capacity_views()?;
    let host = |x: Tensor| -> Result<Vec<f32>> {
        Ok(x.to_device(&Device::Cpu)?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?)
    };
    let mut all = host(k)?;
    all.extend(host(v)?);
    Ok(all)
}

#[test]
fn gpu_appends_write_what_append_does_on_the_cpu() -> Result<()> {
    let Some(gpu) = gpu() else { return Ok(()) };
    let mut rng = StdRng::seed_from_u64(5);
    for (cache_dtype, rows_dtype, scales) in [
        (DType::BF16, DType::BF16, (1.0, 1.0)),
        (DType::F32, DType::F32, (1.0, 1.0)),
        (DType::F8E4M3, DType::BF16, (0.02, 0.5)),
        (DType::F8E4M3, DType::F32, (1.0, 3.0)),
    ]
    .into_iter()
    .filter(|case| case.0 != DType::F8E4M3 || fp8_kv_built())
    {
        let mut on_cpu = KvCache::new(&cache_config(cache_dtype, &Device::Cpu, scales))?;
        let mut on_gpu = KvCache::new(&cache_config(cache_dtype, &gpu, scales))?;
        // The same appends at the host's positions (the write kernel with a host start).
        let mut on_gpu_host = KvCache::new(&cache_config(cache_dtype, &gpu, scales))?;
        // Steps of 1 to 3 tokens, through two growths; v is a strided view (every other head
        // of a wider tensor), as a joined projection hands it over.
        for step in 0..12 {
            let t = 1 + step % 3;
            let k = Tensor::randn(0f32, 4.0, (2, t, 3, 64), &Device::Cpu)?.to_dtype(rows_dtype)?;
            let wide =
                Tensor::randn(0f32, 4.0, (2, t, 6, 64), &Device::Cpu)?.to_dtype(rows_dtype)?;
            let v = wide.narrow(2, rng.random_range(0..3), 3)?;
            let lengths = Tensor::new(
                on_gpu
                    .seq_lens()
                    .iter()
                    .map(|&l| l as u32)
                    .collect::<Vec<_>>(),
                &gpu,
            )?;
            on_cpu.append(&k, &v)?;
            let (k_all, _) =
                on_gpu.append_at(&k.to_device(&gpu)?, &v.to_device(&gpu)?, &lengths)?;
            assert_eq!(k_all.dims(), [2, on_gpu.capacity(), 3, 64]);
            assert_eq!(on_gpu.seq_lens(), on_cpu.seq_lens());
            on_gpu_host.append(&k.to_device(&gpu)?, &v.to_device(&gpu)?)?;
        }
        let want = stored(&on_cpu)?;
        for (how, cache) in [
            ("device lengths", &on_gpu),
            ("host positions", &on_gpu_host),
        ] {
            assert_eq!(cache.capacity(), on_cpu.capacity());
            let got = stored(cache)?;
            let differing = got
                .iter()
                .zip(&want)
                .filter(|(g, w)| g.to_bits() != w.to_bits())
                .count();
            assert_eq!(
                differing, 0,
                "{cache_dtype:?} cache from {rows_dtype:?} rows at {how}: {differing} stored \
                 values differ"
            );
        }
    }
    Ok(())
}

/// Decodes `steps` greedy tokens after `prompt`; after step 10 it rolls back two positions and
/// feeds them again, and after step 20 it verifies three tokens in one pass and rolls them
/// back. Returns every step's logits.
fn decode(model: &mut Llama, prompt: &[u32], steps: usize) -> Result<Vec<Vec<f32>>> {
    let host = |x: Tensor| -> Result<Vec<f32>> {
        Ok(x.to_device(&Device::Cpu)?
            .to_dtype(DType::F32)?
            .to_vec1::<f32>()?)
    };
    let mut logits = host(model.forward(prompt)?)?;
    let mut tokens: Vec<u32> = prompt.to_vec();
    let mut all = Vec::new();
    for step in 0..steps {
        let next = greedy(&logits);
        tokens.push(next);
        logits = host(model.forward(&[next])?)?;
        all.push(logits.clone());
        if step == 10 {
            let len = model.cache_len();
            model.truncate(len - 2);
            for &t in &tokens[tokens.len() - 2..] {
                logits = host(model.forward(&[t])?)?;
            }
            all.push(logits.clone());
        }
        if step == 20 {
            let len = model.cache_len();
            let drafts = [next, (next + 1) % VOCAB as u32, (next + 2) % VOCAB as u32];
            all.push(host(model.forward_all(&drafts)?.flatten_all()?)?);
            model.truncate(len);
        }
    }
    Ok(all)
}

fn load(dir: &std::path::Path, gpu: &Device, cache_dtype: DType) -> Result<Llama> {
    let options = LoadOptions {
        dtype: Some(DType::BF16),
        cache_dtype: Some(cache_dtype),
        // The prompt fills 300 of 320 positions: the caches grow during the steps.
        initial_cache_capacity: 320,
        ..Default::default()
    };
    Ok(Llama::load_with(dir, gpu, options)?.model)
}

fn prompt(len: usize) -> Vec<u32> {
    let mut rng = StdRng::seed_from_u64(41);
    (0..len)
        .map(|_| rng.random_range(3..VOCAB as u32))
        .collect()
}

#[test]
fn gpu_graph_steps_give_the_logits_of_uncaptured_steps() -> Result<()> {
    if !in_own_process(
        module_path!(),
        "gpu_graph_steps_give_the_logits_of_uncaptured_steps",
    ) {
        return Ok(());
    }
    let Some(gpu) = gpu() else { return Ok(()) };
    let dir = tempfile::tempdir()?;
    write_decisive_tiny_model(dir.path())?;
    let prompt = prompt(300);
    for cache_dtype in [DType::BF16, DType::F8E4M3] {
        if cache_dtype == DType::F8E4M3 && !fp8_kv_built() {
            println!("fp8 cache skipped: this build has no fp8 kernels");
            continue;
        }
        for fused in [true, false] {
            let mut eager = load(dir.path(), &gpu, cache_dtype)?;
            let mut graphed = load(dir.path(), &gpu, cache_dtype)?;
            eager.set_fused_decode(fused);
            graphed.set_fused_decode(fused);
            graphed.set_cuda_graph(true)?;
            let want = decode(&mut eager, &prompt, 32)?;
            let got = decode(&mut graphed, &prompt, 32)?;
            assert!(graphed.caches_mut()[0].capacity() > 320, "no growth");
            assert_eq!(got.len(), want.len());
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let differing = g
                    .iter()
                    .zip(w)
                    .filter(|(a, b)| a.to_bits() != b.to_bits())
                    .count();
                assert_eq!(
                    differing, 0,
                    "{cache_dtype:?} cache, fused {fused}: row {i} has {differing} logits that \
                     differ from the uncaptured step"
                );
            }
            println!(
                "{cache_dtype:?} cache, fused {fused}: {} rows of logits identical with and \
                 without graphs",
                got.len()
            );
        }
    }
    Ok(())
}

#[test]
fn gpu_device_fed_steps_stay_close_to_host_fed_steps() -> Result<()> {
    let Some(gpu) = gpu() else { return Ok(()) };
    let dir = tempfile::tempdir()?;
    write_decisive_tiny_model(dir.path())?;
    let prompt = prompt(300);
    let mut fed = load(dir.path(), &gpu, DType::BF16)?;
    let mut host = load(dir.path(), &gpu, DType::BF16)?;
    let as_f32 = |x: Tensor| -> Result<Tensor> {
        Ok(x.to_device(&Device::Cpu)?
            .to_dtype(DType::F32)?
            .flatten_all()?)
    };
    let mut fed_logits = as_f32(fed.forward(&prompt)?)?;
    let mut host_logits = as_f32(host.forward(&prompt)?)?;
    let mut worst = 0f32;
    for _ in 0..32 {
        let diff = (&fed_logits - &host_logits)?
            .abs()?
            .max(D::Minus1)?
            .to_scalar::<f32>()?;
        worst = worst.max(diff);
        let next = greedy(&fed_logits.to_vec1::<f32>()?);
        assert_eq!(next, greedy(&host_logits.to_vec1::<f32>()?));
        fed_logits = as_f32(fed.forward(&[next])?)?;
        // One token through `forward_all` takes the path fed from the host.
        host_logits = as_f32(host.forward_all(&[next])?)?;
    }
    println!("device-fed against host-fed steps: max |logit diff| {worst:.3e}");
    assert!(worst <= 0.25, "device-fed steps differ by {worst}");
    Ok(())
}

#[test]
fn cuda_graphs_are_refused_on_the_cpu() -> Result<()> {
    let dir = tempfile::tempdir()?;
    write_decisive_tiny_model(dir.path())?;
    let mut model = Llama::load_with(dir.path(), &Device::Cpu, LoadOptions::default())?.model;
    let err = model.set_cuda_graph(true).unwrap_err();
    assert!(err.to_string().contains("need a CUDA device"), "{err}");
    assert!(!model.cuda_graph());
    model.set_cuda_graph(false)?;
    Ok(())
}
