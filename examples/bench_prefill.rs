//! Times the op at many query tokens per sequence (causal prefill over a past, and the few-token
//! calls around the decode forms' range) on a CUDA device: one JSON line per point,
//!
//! `{"kind":"ours","backend":"splitkv","dtype":"bfloat16","kv_dtype":"bfloat16","b":1,"hq":32,
//!   "hk":8,"d":128,"t":4096,"past":0,"ms":..,"tflops":..,"form":".."}`
//!
//! with causal FLOPs = 4 · d · h_q · Σ (keys each query sees), timed with CUDA events after a
//! warm-up, the median of `--reps` repetitions; `form` is the kernel the op picked ("decode", or
//! the prefill instance). `--peer-shapes` prints the grid as the `b,hq,hk,t,past,d;...` list
//! that peer-library scripts take, and exits.
//!
//!     cargo run --release --features cuda --example bench_prefill
//!     cargo run --release --features cuda --example bench_prefill -- --shapes "1,32,8,4096,0,128"

#[path = "common/timing.rs"]
mod timing;

use anyhow::{bail, Context, Result};
use candle_core::DType;
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "Times split-kv attention at many query tokens on a CUDA device")]
struct Args {
    /// Points as `b,hq,hk,t,past,d` separated by `;` (default: the built-in grid).
    #[arg(long)]
    shapes: Option<String>,
    /// Query dtypes: any of bf16, f16.
    #[arg(long, value_delimiter = ',', default_values_t = ["bf16".to_string(), "f16".to_string()])]
    dtypes: Vec<String>,
    /// Also time every point with fp8 (e4m3) K/V (the grid's own fp8 points run regardless).
    #[arg(long)]
    fp8: bool,
    /// Timed repetitions (the median is reported); at least 5.
    #[arg(long, default_value_t = 7)]
    reps: usize,
    /// CTAs of the persistent (sm_90a) prefill grid (default: as many as fit on the GPU at once);
    /// a number at least the call's work items runs one item per CTA.
    #[arg(long)]
    persistent_ctas: Option<usize>,
    /// Which kernels run the calls: `auto` (the op's rule), `mma-sync` (the sm_80 form, on any
    /// GPU it builds for) or `wgmma` (the sm_90a form).
    #[arg(long, value_enum, default_value_t = Route::Auto)]
    route: Route,
    /// Print the grid's shapes as `b,hq,hk,t,past,d;...` and exit.
    #[arg(long)]
    peer_shapes: bool,
}

/// The prefill kernels a run is forced onto (the test hook's routes).
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    Auto,
    MmaSync,
    Wgmma,
}

/// One point of the grid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Point {
    b: usize,
    hq: usize,
    hk: usize,
    t: usize,
    past: usize,
    d: usize,
    /// K/V stored as fp8 (e4m3).
    fp8: bool,
}

impl Point {
    const fn new(b: usize, (hq, hk, d): (usize, usize, usize), t: usize, past: usize) -> Self {
        Self {
            b,
            hq,
            hk,
            t,
            past,
            d,
            fp8: false,
        }
    }

    const fn fp8(self) -> Self {
        Self { fp8: true, ..self }
    }

    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    /// 4 · d · h_q · Σ keys seen: query i of t sees the past and itself and the i before it.
    fn flops(&self) -> f64 {
        let (t, past) = (self.t as f64, self.past as f64);
        let keys = t * past + t * (t + 1.0) / 2.0;
        4.0 * self.d as f64 * self.hq as f64 * keys * self.b as f64
    }
}

/// The default grid: long prefills, a chunk after a long past, a batch, other head dims and
/// groups, fp8 K/V, the few-token calls where the decode forms meet many query rows per kv head,
/// and the verification points the decode forms keep.
fn default_grid() -> Vec<Point> {
    let llama = (32, 8, 128);
    vec![
        Point::new(1, llama, 4096, 0),
        Point::new(1, llama, 16384, 0),
        Point::new(1, llama, 32768, 0),
        Point::new(1, llama, 2048, 30720),
        Point::new(8, llama, 4096, 0),
        Point::new(1, (32, 8, 64), 16384, 0),
        Point::new(1, (32, 8, 256), 16384, 0),
        Point::new(1, (64, 8, 128), 16384, 0),
        Point::new(1, llama, 16384, 0).fp8(),
        Point::new(16, (64, 8, 128), 4, 4096),
        Point::new(16, (64, 8, 128), 8, 4096),
        Point::new(1, llama, 4, 131072),
        Point::new(1, llama, 8, 131072),
    ]
}

fn parse_shapes(spec: &str) -> Result<Vec<Point>> {
    spec.split(';')
        .filter(|s| !s.trim().is_empty())
        .map(|s| {
            let v: Vec<usize> = s
                .split(',')
                .map(|x| x.trim().parse::<usize>())
                .collect::<Result<_, _>>()
                .with_context(|| format!("shape {s:?}: expected b,hq,hk,t,past,d"))?;
            match v.as_slice() {
                &[b, hq, hk, t, past, d] => Ok(Point::new(b, (hq, hk, d), t, past)),
                _ => bail!("shape {s:?}: expected six numbers b,hq,hk,t,past,d"),
            }
        })
        .collect()
}

fn peer_shapes(points: &[Point]) -> String {
    let mut shapes: Vec<String> = Vec::new();
    for p in points {
        let s = format!("{},{},{},{},{},{}", p.b, p.hq, p.hk, p.t, p.past, p.d);
        if !shapes.contains(&s) {
            shapes.push(s);
        }
    }
    shapes.join(";")
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn parse_dtype(name: &str) -> Result<DType> {
    Ok(match name {
        "bf16" | "bfloat16" => DType::BF16,
        "f16" | "float16" => DType::F16,
        other => bail!("unknown dtype {other:?}; use bf16 or f16"),
    })
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        DType::F8E4M3 => "float8_e4m3fn",
        _ => "other",
    }
}

#[cfg(feature = "cuda")]
fn bench(args: &Args, points: &[Point]) -> Result<()> {
    use candle_core::{Device, Tensor};
    use candle_splitkv::test_hooks::{
        compiled_compute_cap, force_persistent_ctas, force_prefill_route, last_attention_form,
        PrefillRoute,
    };
    use candle_splitkv::{quantize_e4m3, SplitKvAttention};
    use serde_json::json;

    let device = Device::new_cuda(0).context("bench_prefill needs a CUDA device")?;
    let Device::Cuda(cuda) = &device else {
        bail!("bench_prefill needs a CUDA device")
    };
    // fp8 K/V need a build for compute capability 89 or later; below it their points are left out.
    let fp8_built = compiled_compute_cap().is_some_and(|cap| cap >= 89);
    if args.persistent_ctas == Some(0) {
        bail!("--persistent-ctas must be at least 1");
    }
    force_persistent_ctas(args.persistent_ctas);
    force_prefill_route(match args.route {
        Route::Auto => PrefillRoute::Auto,
        Route::MmaSync => PrefillRoute::MmaSync,
        Route::Wgmma => PrefillRoute::Wgmma,
    });
    if !fp8_built {
        eprintln!("bench_prefill: this build has no fp8 K/V kernels; fp8 points left out");
    }
    for name in &args.dtypes {
        let dtype = parse_dtype(name)?;
        for p in points {
            let mut kinds = vec![p.fp8];
            if args.fp8 && !p.fp8 {
                kinds.push(true);
            }
            kinds.retain(|&fp8| fp8_built || !fp8);
            for fp8 in kinds {
                let p = Point { fp8, ..*p };
                let l = p.past + p.t;
                let random = |shape: (usize, usize, usize, usize)| {
                    Tensor::randn(0f32, 1.0, shape, &device)?.to_dtype(dtype)
                };
                let q = random((p.b, p.t, p.hq, p.d))?;
                let (mut k, mut v) = (random((p.b, l, p.hk, p.d))?, random((p.b, l, p.hk, p.d))?);
                let mut op = SplitKvAttention::new(1.0 / (p.d as f32).sqrt());
                if fp8 {
                    k = quantize_e4m3(&k.to_dtype(DType::F32)?, 0.05)?;
                    v = quantize_e4m3(&v.to_dtype(DType::F32)?, 0.05)?;
                    op = op.with_kv_scales(0.05, 0.05);
                }
                let (us, _) = timing::gpu_time(cuda, 1, args.reps, &|_| {
                    op.forward(&q, &k, &v)?;
                    Ok(())
                })?;
                let form = last_attention_form().unwrap_or("unknown");
                let ms = us / 1e3;
                let line = json!({
                    "kind": "ours",
                    "backend": "splitkv",
                    "dtype": dtype_name(dtype),
                    "kv_dtype": dtype_name(if fp8 { DType::F8E4M3 } else { dtype }),
                    "b": p.b, "hq": p.hq, "hk": p.hk, "d": p.d, "t": p.t, "past": p.past,
                    "ms": ms,
                    "tflops": p.flops() / (ms * 1e-3) / 1e12,
                    "form": form,
                    "persistent_ctas": args.persistent_ctas,
                });
                println!("{line}");
            }
        }
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn bench(_args: &Args, _points: &[Point]) -> Result<()> {
    bail!("bench_prefill times the CUDA kernels: build with --features cuda")
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.reps < 5 {
        bail!("--reps must be at least 5, got {}", args.reps);
    }
    let points = match &args.shapes {
        Some(spec) => parse_shapes(spec)?,
        None => default_grid(),
    };
    if args.peer_shapes {
        println!("{}", peer_shapes(&points));
        return Ok(());
    }
    bench(&args, &points)
}
