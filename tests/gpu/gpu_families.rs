//! Every family on the GPU against the same model on the CPU, on tiny random models with
//! sliding windows far shorter than the prompt, so that decode steps run the windowed kernels.
//!
//! - f32 on both: greedy tokens identical over 32 steps and logits within 1e-3 of their scale,
//!   with plain steps and with steps captured as CUDA graphs (both fed from device memory, where
//!   the kernels find each window from the sequence's length).
//! - bf16 on the GPU (the tensor-core kernels), teacher-forced on the CPU's tokens: logits within
//!   a tenth of their scale, reported.
//!
//! Skips with a notice where no CUDA device exists.

use anyhow::Result;
use candle_core::{DType, Device, Tensor, D};
use candle_nn::VarBuilder;
use candle_splitkv::models::llama::{Llama, LlamaConfig, LoadOptions};
use rand::{rngs::StdRng, Rng, SeedableRng};

use crate::common::gpu;
use crate::common::own_process::in_own_process;
use crate::common::tiny_families::{
    weights, Family, GEMMA2, GEMMA2_JSON, MISTRAL, MISTRAL_JSON, PHI3, PHI3_JSON, QWEN2,
    QWEN2_JSON, QWEN3, QWEN3_JSON, VOCAB,
};

/// Sliding windows of this many positions, against a prompt of [`PROMPT`] tokens.
const WINDOW: usize = 64;
const PROMPT: usize = 300;

/// Each family's config with a window of [`WINDOW`] positions where the family has windows.
fn families() -> Vec<(&'static str, String, Family)> {
    let window = format!("\"sliding_window\": {WINDOW}");
    vec![
        (
            "mistral",
            MISTRAL_JSON.replace("\"sliding_window\": null", &window),
            MISTRAL,
        ),
        (
            "phi3",
            PHI3_JSON.replace("\"sliding_window\": 1023", &window),
            PHI3,
        ),
        (
            "qwen2",
            QWEN2_JSON
                .replace(
                    "\"use_sliding_window\": false",
                    "\"use_sliding_window\": true",
                )
                .replace("\"max_window_layers\": 2", "\"max_window_layers\": 1")
                .replace("\"sliding_window\": 1024", &window),
            QWEN2,
        ),
        ("qwen3", QWEN3_JSON.to_string(), QWEN3),
        (
            "gemma2",
            GEMMA2_JSON.replace("\"sliding_window\": 4096", &window),
            GEMMA2,
        ),
    ]
}

fn load(json: &str, family: Family, device: &Device, dtype: DType) -> Result<Llama> {
    let config = LlamaConfig::from_hf_json(json)?;
    let vb = VarBuilder::from_tensors(weights(family)?, dtype, device);
    Ok(Llama::from_var_builder(
        vb,
        config,
        dtype,
        LoadOptions::default(),
    )?)
}

fn on_cpu_f32(t: &Tensor) -> Result<Tensor> {
    Ok(t.to_device(&Device::Cpu)?.to_dtype(DType::F32)?)
}

fn max_abs(t: &Tensor) -> Result<f32> {
    Ok(t.abs()?.max(D::Minus1)?.to_scalar::<f32>()?)
}

#[test]
fn gpu_families_decode_as_on_the_cpu() -> Result<()> {
    // The graph runs capture: alone in the process.
    if !in_own_process(module_path!(), "gpu_families_decode_as_on_the_cpu") {
        return Ok(());
    }
    let Some(gpu) = gpu() else { return Ok(()) };
    for (name, json, family) in families() {
        for graph in [false, true] {
            let mut cpu = load(&json, family, &Device::Cpu, DType::F32)?;
            let mut on_gpu = load(&json, family, &gpu, DType::F32)?;
            on_gpu.set_cuda_graph(graph)?;
            let mut rng = StdRng::seed_from_u64(17);
            let prompt: Vec<u32> = (0..PROMPT)
                .map(|_| rng.random_range(3..VOCAB as u32))
                .collect();
            let mut want = cpu.forward(&prompt)?;
            let mut got = on_cpu_f32(&on_gpu.forward(&prompt)?)?;
            let mut worst = 0f32;
            for step in 0..32 {
                let scale = max_abs(&want)?.max(1.0);
                let diff = max_abs(&(&want - &got)?)?;
                worst = worst.max(diff / scale);
                assert!(
                    diff <= 1e-3 * scale,
                    "{name} (graph {graph}) step {step}: logits differ by {diff} (scale {scale})"
                );
                let next = want.argmax(0)?.to_scalar::<u32>()?;
                assert_eq!(
                    got.argmax(0)?.to_scalar::<u32>()?,
                    next,
                    "{name} (graph {graph}) step {step}: greedy tokens differ"
                );
                // Random weights repeat one greedy token: feed random ones every other step, so
                // that the cache holds different keys.
                let next = if step % 2 == 0 {
                    next
                } else {
                    rng.random_range(3..VOCAB as u32)
                };
                want = cpu.forward(&[next])?;
                got = on_cpu_f32(&on_gpu.forward(&[next])?)?;
            }
            println!("{name}, f32, graph {graph}: worst logit difference {worst:.2e} of the scale");
        }
    }
    Ok(())
}

#[test]
fn gpu_families_in_bf16_stay_close_to_the_cpu() -> Result<()> {
    let Some(gpu) = gpu() else { return Ok(()) };
    for (name, json, family) in families() {
        let mut cpu = load(&json, family, &Device::Cpu, DType::F32)?;
        let mut on_gpu = load(&json, family, &gpu, DType::BF16)?;
        let mut rng = StdRng::seed_from_u64(19);
        let prompt: Vec<u32> = (0..PROMPT)
            .map(|_| rng.random_range(3..VOCAB as u32))
            .collect();
        let mut want = cpu.forward(&prompt)?;
        let mut got = on_cpu_f32(&on_gpu.forward(&prompt)?)?;
        let (mut worst, mut same) = (0f32, 0);
        for _ in 0..32 {
            let scale = max_abs(&want)?.max(1.0);
            worst = worst.max(max_abs(&(&want - &got)?)? / scale);
            let next = want.argmax(0)?.to_scalar::<u32>()?;
            same += usize::from(got.argmax(0)?.to_scalar::<u32>()? == next);
            let next = rng.random_range(3..VOCAB as u32);
            want = cpu.forward(&[next])?;
            got = on_cpu_f32(&on_gpu.forward(&[next])?)?;
        }
        println!(
            "{name}, bf16 on the GPU: worst logit difference {worst:.2e} of the scale; {same} of \
             32 greedy tokens as the CPU's"
        );
        assert!(
            worst.is_finite() && worst <= 0.1,
            "{name}: bf16 logits moved by {worst} of their scale"
        );
    }
    Ok(())
}
