//! Decode-step projections of a Llama-3-8B layer: `fused_linear` (one kernel: norm or SwiGLU
//! activation, product, residual add) against candle's separate ops computing the same thing
//! (cuBLAS for the product). f16/bf16 on CUDA, one row or a few (`--rows`: the rows of a batched
//! decode step, which the fused form multiplies on tensor cores).
//!
//! Enough distinct weights rotate through each timed sweep that L2 never holds them; sweeps are
//! captured into a CUDA graph and timed with CUDA events. One JSON line per (shape, backend) with
//! the weight bytes read per call and the resulting bandwidth.
//!
//! ```text
//! cargo run --release --features cuda --example bench_linear
//! ```

#[path = "common/timing.rs"]
mod timing;

#[cfg(feature = "cuda")]
fn main() -> anyhow::Result<()> {
    use candle_core::{DType, Device, Tensor};
    use candle_splitkv::{fused_linear, linear_unfused, LinearInput, LinearOutput};
    use clap::Parser;
    use serde_json::json;

    #[derive(Parser)]
    struct Args {
        /// bf16 or f16.
        #[arg(long, default_value = "bf16")]
        dtype: String,
        /// Timed repetitions; the median is reported.
        #[arg(long, default_value_t = 20)]
        reps: usize,
        /// Input rows per call (comma-separated), 1 to 16 for the fused kernels.
        #[arg(long, value_delimiter = ',', default_values_t = [1usize])]
        rows: Vec<usize>,
        /// For several rows, also time the fused kernel with these k-split counts (CTAs of a
        /// cluster along k) instead of its own plan; each is reported where it fits.
        #[arg(long, value_delimiter = ',')]
        rows_splits: Vec<usize>,
    }
    let args = Args::parse();
    let dtype = match args.dtype.as_str() {
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        other => anyhow::bail!("unknown dtype {other}; use bf16 or f16"),
    };
    let device = Device::new_cuda(0)?;
    let Device::Cuda(cuda) = &device else {
        unreachable!("new_cuda returns a CUDA device")
    };
    // SAFETY: everything here runs on candle's single stream.
    unsafe { cuda.disable_event_tracking() };

    // (name, out, in, RMSNorm prologue, epilogue)
    let shapes = [
        ("qkv+norm", 6144, 4096, true, "plain"),
        ("o+residual", 4096, 4096, false, "residual"),
        ("gate_up+norm+swiglu", 28672, 4096, true, "swiglu"),
        ("down+residual", 4096, 14336, false, "residual"),
        ("lm_head+norm", 128256, 4096, true, "plain"),
    ];
    for (name, n, k, norm, epilogue) in shapes {
        let weight_bytes = n * k * dtype.size_in_bytes();
        let sets = (1usize << 30).div_ceil(weight_bytes).clamp(2, 64);
        let w = (0..sets)
            .map(|_| Tensor::randn(0f32, 0.02, (n, k), &device)?.to_dtype(dtype))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let gain = Tensor::ones(k, dtype, &device)?;
        for &rows in &args.rows {
            let x = Tensor::randn(0f32, 1.0, (rows, 1, k), &device)?.to_dtype(dtype)?;
            let residual = Tensor::randn(0f32, 1.0, (rows, 1, n), &device)?.to_dtype(dtype)?;
            let input = if norm {
                LinearInput::RmsNorm {
                    weight: &gain,
                    eps: 1e-5,
                }
            } else {
                LinearInput::Plain
            };
            let output = match epilogue {
                "residual" => LinearOutput::AddResidual(&residual),
                "swiglu" => LinearOutput::SwiGlu,
                _ => LinearOutput::Plain,
            };
            let fused = |i: usize| -> anyhow::Result<()> {
                fused_linear(&x, &w[i], input, output)?;
                Ok(())
            };
            let unfused = |i: usize| -> anyhow::Result<()> {
                linear_unfused(&x, &w[i], input, output)?;
                Ok(())
            };
            // (label, call, forced k-splits): the plain runs, then the fused kernel at each
            // count asked.
            type Call<'a> = &'a dyn Fn(usize) -> anyhow::Result<()>;
            let mut runs: Vec<(String, Call, Option<usize>)> = vec![
                ("fused".to_string(), &fused, None),
                ("candle_unfused".to_string(), &unfused, None),
            ];
            if rows > 1 {
                runs.extend(
                    args.rows_splits
                        .iter()
                        .map(|&s| (format!("fused_splits_{s}"), &fused as Call, Some(s))),
                );
            }
            for (backend, call, splits) in runs {
                candle_splitkv::test_hooks::force_rows_splits(splits);
                if splits.is_some() {
                    // A count the kernel cannot take runs candle's ops: leave it out.
                    let before = candle_splitkv::test_hooks::fused_launch_count();
                    call(0)?;
                    if candle_splitkv::test_hooks::fused_launch_count() == before {
                        continue;
                    }
                }
                let (us, how) = timing::gpu_time(cuda, sets, args.reps, call)?;
                println!(
                    "{}",
                    json!({
                        "kind": "linear", "shape": name, "out": n, "in": k, "rows": rows,
                        "dtype": args.dtype, "backend": backend, "us": (us * 1000.0).round() / 1000.0,
                        "weight_bytes": weight_bytes,
                        "tb_per_s": (weight_bytes as f64 / us / 1e6 * 1000.0).round() / 1000.0,
                        "timing": how,
                    })
                );
            }
            candle_splitkv::test_hooks::force_rows_splits(None);
        }
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn main() -> anyhow::Result<()> {
    anyhow::bail!("bench_linear times CUDA kernels; build it with --features cuda")
}
