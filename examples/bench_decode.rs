//! Times the split-KV decode op against candle's own attention (the naive path and, on the CPU,
//! candle-nn's flash attention), one JSON line per point.
//!
//! ```text
//! cargo run --release --example bench_decode -- --device cpu
//! cargo run --release --features cuda --example bench_decode -- --device cuda --json
//! cargo run --release --features cuda --example bench_decode -- --device cuda \
//!     --kernels tensor-core,cuda-core --batch 16 --heads 64:8:128 --len 131072
//! ```
//!
//! On CUDA, inputs rotate over enough buffer sets that one sweep reads at least 512 MiB of K/V
//! (so L2 never holds them); calls are captured into a CUDA graph where possible and timed with
//! CUDA events; the median of the repetitions is reported. On the CPU, each backend's median of
//! `--reps` runs is reported, with a plain multi-threaded read of the same bytes as the ceiling.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::attention::AttnMask;
use candle_splitkv::test_hooks::split_plan;
use candle_splitkv::SplitKvAttention;
use clap::{Parser, ValueEnum};
use rayon::prelude::*;
use serde_json::json;

#[path = "common/timing.rs"]
mod timing;
use timing::median;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Backend {
    /// This crate's op.
    Splitkv,
    /// candle-transformers' way: repeat_kv, matmul, softmax, matmul.
    CandleNaive,
    /// candle-nn's CPU flash attention (`candle_nn::attention::flash_attn`), on contiguous
    /// `(b, L, h_kv, d)` K/V; the CPU only.
    CandleCpuFlash,
    /// Every one the device runs.
    All,
}

impl Backend {
    fn includes(self, one: Backend) -> bool {
        self == Backend::All || self == one
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Dtype {
    Bf16,
    F16,
    F32,
}

impl Dtype {
    fn dtype(self) -> DType {
        match self {
            Dtype::Bf16 => DType::BF16,
            Dtype::F16 => DType::F16,
            Dtype::F32 => DType::F32,
        }
    }
}

/// How K/V are stored, when not in q's dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum KvDtype {
    /// e4m3 (`F8E4M3`), scale 1.
    Fp8,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum PageLayout {
    HeadMajor,
    SeqMajor,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum KernelArg {
    Auto,
    TensorCore,
    CudaCore,
}

#[derive(Parser, Debug, Clone)]
#[command(about = "Benchmark split-KV decode attention")]
struct Args {
    /// cpu or cuda.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Print JSON lines only.
    #[arg(long)]
    json: bool,
    #[arg(long, value_enum, default_value = "all")]
    backend: Backend,
    /// Element types to run, in order.
    #[arg(long, value_enum, value_delimiter = ',')]
    dtype: Option<Vec<Dtype>>,
    /// K/V stored in another dtype than q's (written as `kv_dtype` in each line); on CUDA fp8
    /// takes f16/bf16 q and a build for compute capability 89 or later.
    #[arg(long, value_enum)]
    kv_dtype: Option<KvDtype>,
    /// Batch sizes (default: the benchmark grid on CUDA, 1 on CPU).
    #[arg(long, value_delimiter = ',')]
    batch: Option<Vec<usize>>,
    /// Head configs as q_heads:kv_heads:head_dim, comma separated.
    #[arg(long, value_delimiter = ',')]
    heads: Option<Vec<String>>,
    /// Context lengths.
    #[arg(long = "len", value_delimiter = ',')]
    lens: Option<Vec<usize>>,
    /// Query tokens per sequence (the last positions, causal), e.g. 1,2,4,8: a verification pass
    /// of drafted tokens. The naive path is timed for one token only.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    qlen: Vec<usize>,
    /// Timed repetitions per point; the median is reported.
    #[arg(long, default_value_t = 7)]
    reps: usize,
    /// A sliding window: each query sees the last W positions before its own (written as
    /// `window` in each line). Bandwidth then counts the positions read, not L.
    #[arg(long, value_name = "W")]
    window: Option<usize>,

    /// Soft-caps the scores at C (written as `softcap` in each line).
    #[arg(long, value_name = "C")]
    softcap: Option<f32>,

    /// K/V in a pool of pages of this many positions, each sequence's pages in a shuffled order
    /// (written as `page_size` in each line); the split-KV op only.
    #[arg(long, value_name = "PAGE_SIZE")]
    paged: Option<usize>,

    /// How a page pool is laid out: `head-major` `(pages, kv_heads, page_size, d)`, as the
    /// contiguous cache is, or `seq-major` `(pages, page_size, kv_heads, d)` (written as
    /// `page_layout` in each line).
    #[arg(long, value_enum, default_value = "head-major")]
    page_layout: PageLayout,

    /// Force this many splits instead of the heuristic.
    #[arg(long)]
    splits: Option<usize>,
    /// CUDA kernel families to time, each reported as its own backend: auto → `splitkv`,
    /// tensor-core → `splitkv_tc`, cuda-core → `splitkv_cc`.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "auto")]
    kernels: Vec<KernelArg>,
    /// Skip points whose K+V exceeds this many GiB.
    #[arg(long, default_value_t = 8.0)]
    max_kv_gib: f64,
    /// Run the whole list of points this many times in one process, each line tagged with its
    /// `pass`: shows how much a point moves with the process's allocation history.
    #[arg(long, default_value_t = 1)]
    passes: usize,
    /// The pass being run (set by `main`, not on the command line).
    #[arg(skip)]
    pass: usize,
}

impl Args {
    /// The page size and pool layout with `--paged`.
    fn paging(&self) -> Option<(usize, PageLayout)> {
        self.paged.map(|page| (page, self.page_layout))
    }
}

#[derive(Clone, Copy, Debug)]
struct Point {
    b: usize,
    t: usize,
    hq: usize,
    hk: usize,
    d: usize,
    l: usize,
    dtype: DType,
    kv_dtype: DType,
    /// Positions a sliding window lets the op read (`l` without one).
    read_len: usize,
}

impl Point {
    /// K+V bytes the op reads.
    fn kv_bytes(&self) -> usize {
        2 * self.b * self.hk * self.read_len * self.d * self.kv_dtype.size_in_bytes()
    }
    /// K+V bytes of the whole cache, window or not.
    fn cache_bytes(&self) -> usize {
        2 * self.b * self.hk * self.l * self.d * self.kv_dtype.size_in_bytes()
    }
    /// Bytes the op must move: K and V once, q in and out once.
    fn bytes(&self) -> usize {
        self.kv_bytes() + 2 * self.b * self.t * self.hq * self.d * self.dtype.size_in_bytes()
    }
}

fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::BF16 => "bfloat16",
        DType::F8E4M3 => "float8_e4m3fn",
        DType::F16 => "float16",
        _ => "float32",
    }
}

fn parse_heads(spec: &str) -> Result<(usize, usize, usize)> {
    let parts: Vec<usize> = spec
        .split(':')
        .map(|p| p.trim().parse::<usize>())
        .collect::<Result<_, _>>()
        .with_context(|| format!("bad --heads entry {spec:?}: want q_heads:kv_heads:head_dim"))?;
    match parts[..] {
        [hq, hk, d] => Ok((hq, hk, d)),
        _ => bail!("bad --heads entry {spec:?}: want q_heads:kv_heads:head_dim"),
    }
}

fn points(args: &Args, on_gpu: bool) -> Result<Vec<Point>> {
    let heads: Vec<(usize, usize, usize)> = match &args.heads {
        Some(specs) => specs
            .iter()
            .map(|s| parse_heads(s))
            .collect::<Result<_>>()?,
        None if on_gpu => vec![(32, 8, 128), (32, 32, 128), (64, 8, 128), (32, 8, 64)],
        None => vec![(32, 8, 128), (9, 3, 64)],
    };
    let batches = args
        .batch
        .clone()
        .unwrap_or(if on_gpu { vec![1, 4, 16, 64] } else { vec![1] });
    let lens = args.lens.clone().unwrap_or(if on_gpu {
        vec![1024, 4096, 16384, 65536, 131072]
    } else {
        vec![8192, 32768, 65536]
    });
    let dtypes = args.dtype.clone().unwrap_or(if on_gpu {
        vec![Dtype::Bf16, Dtype::F16]
    } else {
        vec![Dtype::F32]
    });
    let mut out = Vec::new();
    for dtype in dtypes {
        for &(hq, hk, d) in &heads {
            for &b in &batches {
                for (&l, &t) in lens
                    .iter()
                    .flat_map(|l| args.qlen.iter().map(move |t| (l, t)))
                {
                    let p = Point {
                        b,
                        t,
                        hq,
                        hk,
                        d,
                        l,
                        dtype: dtype.dtype(),
                        read_len: args.window.map_or(l, |w| l.min(w + t)),
                        kv_dtype: match args.kv_dtype {
                            Some(KvDtype::Fp8) => DType::F8E4M3,
                            None => dtype.dtype(),
                        },
                    };
                    if p.cache_bytes() as f64 <= args.max_kv_gib * (1u64 << 30) as f64 {
                        out.push(p);
                    }
                }
            }
        }
    }
    Ok(out)
}

/// One buffer set: q `(b,t,hq,d)` and k, v head-major `(b,hk,L,d)` as a cache holds them, or
/// with `--paged` pools of `b·⌈L/page⌉` pages.
struct Inputs {
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    /// `--paged`: the block table, the lengths and the pool's layout.
    pages: Option<(Tensor, Tensor, PageLayout)>,
}

/// Sequence b's pages, in a shuffled order over the pool so that no two neighbours in a sequence
/// are neighbours in memory (xorshift, fixed seed): u32 `(b, pages_per_seq)`.
fn shuffled_block_table(b: usize, pages_per_seq: usize, dev: &Device) -> Result<Tensor> {
    let n = b * pages_per_seq;
    let mut order: Vec<u32> = (0..n as u32).collect();
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    for i in (1..n).rev() {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        order.swap(i, (state % (i as u64 + 1)) as usize);
    }
    Ok(Tensor::from_vec(order, (b, pages_per_seq), dev)?)
}

impl Inputs {
    fn random(p: &Point, dev: &Device, paged: Option<(usize, PageLayout)>) -> Result<Self> {
        let rand = |shape: (usize, usize, usize, usize), dtype: DType| -> Result<Tensor> {
            let x = Tensor::randn(0f32, 1.0, shape, dev)?;
            Ok(match dtype {
                DType::F8E4M3 => candle_splitkv::quantize_e4m3(&x, 1.0)?,
                _ => x.to_dtype(dtype)?,
            })
        };
        let q = rand((p.b, p.t, p.hq, p.d), p.dtype)?;
        let Some((page, layout)) = paged else {
            return Ok(Self {
                q,
                k_cache: rand((p.b, p.hk, p.l, p.d), p.kv_dtype)?,
                v_cache: rand((p.b, p.hk, p.l, p.d), p.kv_dtype)?,
                pages: None,
            });
        };
        let per_seq = p.l.div_ceil(page);
        let shape = match layout {
            PageLayout::HeadMajor => (p.b * per_seq, p.hk, page, p.d),
            PageLayout::SeqMajor => (p.b * per_seq, page, p.hk, p.d),
        };
        Ok(Self {
            q,
            k_cache: rand(shape, p.kv_dtype)?,
            v_cache: rand(shape, p.kv_dtype)?,
            pages: Some((
                shuffled_block_table(p.b, per_seq, dev)?,
                Tensor::from_vec(vec![p.l as u32; p.b], p.b, dev)?,
                layout,
            )),
        })
    }

    /// `(b, L, hk, d)` views of the cache, or `(pages, page_size, hk, d)` views of the pool: no
    /// copy.
    fn kv_views(&self) -> Result<(Tensor, Tensor)> {
        match self.pages {
            Some((_, _, PageLayout::SeqMajor)) => Ok((self.k_cache.clone(), self.v_cache.clone())),
            _ => Ok((self.k_cache.transpose(1, 2)?, self.v_cache.transpose(1, 2)?)),
        }
    }

    /// `op` reading this set's pages, if paged.
    fn paged_op(&self, op: SplitKvAttention) -> SplitKvAttention {
        match &self.pages {
            Some((table, lens, _)) => op
                .with_block_table(table.clone())
                .with_seqlens(lens.clone()),
            None => op,
        }
    }
}

fn run_splitkv(op: &SplitKvAttention, x: &Inputs) -> Result<Tensor> {
    let (k, v) = x.kv_views()?;
    Ok(op.forward(&x.q, &k, &v)?)
}

/// candle-nn's CPU flash attention over contiguous K/V `(b, L, h_kv, d)`: the last `t` positions
/// attend causally, as in the op.
fn run_cpu_flash(x: &Inputs, k_seq: &Tensor, v_seq: &Tensor, scale: f64) -> Result<Tensor> {
    let (_, t, _, _) = x.q.dims4()?;
    let l = k_seq.dim(1)?;
    let mask = if t == 1 {
        AttnMask::None
    } else {
        AttnMask::causal_with_offset(l.saturating_sub(t))
    };
    Ok(candle_nn::attention::flash_attn::<f32>(
        &x.q,
        k_seq,
        v_seq,
        scale as f32,
        mask,
        None,
        None,
    )?)
}

/// Attention the way candle-transformers' llama does it at decode time.
fn run_naive(x: &Inputs, hq: usize, scale: f64) -> Result<Tensor> {
    let (b, hk, l, d) = x.k_cache.dims4()?;
    let group = hq / hk;
    let repeat = |t: &Tensor| -> Result<Tensor> {
        Ok(candle_transformers::utils::repeat_kv(t.clone(), group)?.reshape((b, hq, l, d))?)
    };
    let q = x.q.transpose(1, 2)?; // (b, hq, 1, d)
    let k = repeat(&x.k_cache)?;
    let v = repeat(&x.v_cache)?;
    let att = (q.matmul(&k.t()?)? * scale)?;
    let att = candle_nn::ops::softmax_last_dim(&att.to_dtype(DType::F32)?)?.to_dtype(v.dtype())?;
    Ok(att.matmul(&v)?.transpose(1, 2)?)
}

fn report(args: &Args, p: &Point, device: &str, backend: &str, us: f64, extra: serde_json::Value) {
    let gbps = p.bytes() as f64 / us / 1e3;
    let mut line = json!({
        "kind": "ours", "backend": backend, "device": device, "dtype": dtype_name(p.dtype),
        "kv_dtype": dtype_name(p.kv_dtype),
        "b": p.b, "t": p.t, "hq": p.hq, "hk": p.hk, "L": p.l, "d": p.d,
        "us": (us * 100.0).round() / 100.0, "GBps": gbps.round(),
    });
    if let (Some(obj), Some(more)) = (line.as_object_mut(), extra.as_object()) {
        obj.extend(more.clone());
        if args.passes > 1 {
            obj.insert("pass".into(), json!(args.pass));
        }
        if let Some(w) = args.window {
            obj.insert("window".into(), json!(w));
        }
        if let Some(c) = args.softcap {
            obj.insert("softcap".into(), json!(c));
        }
        if let Some(page) = args.paged {
            obj.insert("page_size".into(), json!(page));
            let layout = match args.page_layout {
                PageLayout::HeadMajor => "head_major",
                PageLayout::SeqMajor => "seq_major",
            };
            obj.insert("page_layout".into(), json!(layout));
        }
    }
    if args.json {
        println!("{line}");
    } else {
        println!(
            "{backend:>13} {:>8} b={:<3} t={:<2} h={}/{} d={:<3} L={:<7} {:>10.1} us {:>7.0} GB/s  {extra}",
            dtype_name(p.dtype),
            p.b,
            p.t,
            p.hq,
            p.hk,
            p.d,
            p.l,
            us,
            gbps
        );
    }
}

/// Reads every byte of K and V on all threads, straight from the tensors' storage: the CPU's
/// bandwidth ceiling for this point.
fn cpu_read_loop(x: &Inputs) -> Result<f64> {
    fn sum_storage(t: &Tensor) -> Result<f32> {
        let (storage, layout) = t.storage_and_layout();
        let candle_core::Storage::Cpu(cpu) = &*storage else {
            bail!("read loop needs a CPU tensor");
        };
        if let Ok(bytes) = cpu.as_slice::<float8::F8E4M3>() {
            let bytes = &bytes[layout.start_offset()..];
            let sum = bytes
                .par_chunks(1 << 16)
                .map(|c| c.iter().map(|x| u32::from(x.to_bits())).sum::<u32>())
                .reduce(|| 0, u32::wrapping_add);
            return Ok(sum as f32);
        }
        let data = cpu.as_slice::<f32>()?;
        let data = &data[layout.start_offset()..];
        Ok(data.par_chunks(1 << 14).map(sum_wide).sum::<f32>())
    }
    let start = Instant::now();
    let sum = sum_storage(&x.k_cache)? + sum_storage(&x.v_cache)?;
    let us = start.elapsed().as_secs_f64() * 1e6;
    std::hint::black_box(sum);
    Ok(us)
}

/// Sum with eight independent accumulators, so the loop is bound by loads, not by add latency.
fn sum_wide(xs: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let mut chunks = xs.chunks_exact(8);
    for c in &mut chunks {
        for (a, x) in acc.iter_mut().zip(c) {
            *a += x;
        }
    }
    acc.iter().sum::<f32>() + chunks.remainder().iter().sum::<f32>()
}

fn bench_cpu(args: &Args) -> Result<()> {
    let dev = Device::Cpu;
    if args.kernels != [KernelArg::Auto] {
        bail!("--kernels picks CUDA kernel families; the CPU has one implementation");
    }
    for p in points(args, false)? {
        if p.dtype != DType::F32 {
            bail!("the CPU benchmark runs f32 (its read-loop ceiling reads f32); pass --dtype f32");
        }
        let x = Inputs::random(&p, &dev, args.paging())?;
        let scale = 1.0 / (p.d as f64).sqrt();
        let op = x.paged_op(
            SplitKvAttention::new(scale as f32)
                .with_num_splits(args.splits)
                .with_window_left(args.window)
                .with_softcap(args.softcap),
        );
        let (k, _) = x.kv_views()?;
        let splits = split_plan(&op, &x.q, &k)?.num_splits;
        // The layout candle-nn's kernel reads, copied once outside the timing.
        let flash_kv = if args.backend.includes(Backend::CandleCpuFlash) && p.kv_dtype == p.dtype {
            let (k, v) = x.kv_views()?;
            Some((k.contiguous()?, v.contiguous()?))
        } else {
            None
        };
        let mut ours = Vec::new();
        let mut naive = Vec::new();
        let mut flash = Vec::new();
        let mut ceiling = Vec::new();
        for _ in 0..args.reps {
            if args.backend.includes(Backend::Splitkv) {
                let t = Instant::now();
                std::hint::black_box(run_splitkv(&op, &x)?);
                ours.push(t.elapsed().as_secs_f64() * 1e6);
            }
            if args.backend.includes(Backend::CandleNaive) && p.t == 1 && p.kv_dtype == p.dtype {
                let t = Instant::now();
                std::hint::black_box(run_naive(&x, p.hq, scale)?);
                naive.push(t.elapsed().as_secs_f64() * 1e6);
            }
            if let Some((k, v)) = &flash_kv {
                let t = Instant::now();
                std::hint::black_box(run_cpu_flash(&x, k, v, scale)?);
                flash.push(t.elapsed().as_secs_f64() * 1e6);
            }
            ceiling.push(cpu_read_loop(&x)?);
        }
        let read_us = median(ceiling);
        report(
            args,
            &p,
            "cpu",
            "read_loop",
            read_us,
            json!({"kind": "ceiling"}),
        );
        if !ours.is_empty() {
            let us = median(ours);
            let mut extra =
                json!({"splits": splits, "of_ceiling": (read_us / us * 1000.0).round() / 1000.0});
            if !naive.is_empty() {
                extra["speedup_vs_naive"] =
                    json!((median(naive.clone()) / us * 100.0).round() / 100.0);
            }
            if !flash.is_empty() {
                extra["speedup_vs_cpu_flash"] =
                    json!((median(flash.clone()) / us * 100.0).round() / 100.0);
            }
            report(args, &p, "cpu", "splitkv_cpu", us, extra);
        }
        if !naive.is_empty() {
            report(args, &p, "cpu", "candle_naive", median(naive), json!({}));
        }
        if !flash.is_empty() {
            report(
                args,
                &p,
                "cpu",
                "candle_cpu_flash",
                median(flash),
                json!({}),
            );
        }
    }
    Ok(())
}

#[cfg(feature = "cuda")]
mod gpu {
    //! CUDA timing: rotated buffer sets, graph capture, CUDA events.
    use super::*;
    use candle_splitkv::CudaKernel;

    /// Buffer sets so that one sweep reads at least 512 MiB of K/V, at most 32, and at most
    /// 16 GiB of caches (a short window over long caches reads little of each).
    pub fn rotation(p: &Point) -> usize {
        let fitting = ((16usize << 30) / p.cache_bytes()).max(1);
        (512usize << 20)
            .div_ceil(p.kv_bytes())
            .clamp(1, 32)
            .min(fitting)
    }

    impl KernelArg {
        fn choice(self) -> CudaKernel {
            match self {
                KernelArg::Auto => CudaKernel::Auto,
                KernelArg::TensorCore => CudaKernel::TensorCore,
                KernelArg::CudaCore => CudaKernel::CudaCore,
            }
        }

        fn backend(self) -> &'static str {
            match self {
                KernelArg::Auto => "splitkv",
                KernelArg::TensorCore => "splitkv_tc",
                KernelArg::CudaCore => "splitkv_cc",
            }
        }
    }

    pub fn bench(args: &Args) -> Result<()> {
        let device = Device::new_cuda(0)?;
        let Device::Cuda(cuda) = &device else {
            bail!("no CUDA device");
        };
        // One stream only: per-tensor events would also be recorded inside graph capture.
        unsafe { cuda.disable_event_tracking() };
        // As the KV cache does: inputs allocated and freed point after point would otherwise land
        // in freshly remapped pool memory, which streams slower from process to process.
        candle_splitkv::retain_freed_device_memory(&device)?;
        for p in points(args, true)? {
            let sets = rotation(&p);
            // One block table for all sets: each set's pool holds its pages at the same places.
            let inputs: Vec<Inputs> = (0..sets)
                .map(|_| Inputs::random(&p, &device, args.paging()))
                .collect::<Result<_>>()?;
            let scale = 1.0 / (p.d as f64).sqrt();
            for kernel in args
                .kernels
                .iter()
                .filter(|_| args.backend.includes(Backend::Splitkv))
            {
                let op = inputs[0].paged_op(
                    SplitKvAttention::new(scale as f32)
                        .with_num_splits(args.splits)
                        .with_window_left(args.window)
                        .with_softcap(args.softcap)
                        .with_cuda_kernel(kernel.choice()),
                );
                let (k, _) = inputs[0].kv_views()?;
                let splits = split_plan(&op, &inputs[0].q, &k)?.num_splits;
                let (us, how) = timing::gpu_time(cuda, sets, args.reps, &|i| {
                    run_splitkv(&op, &inputs[i]).map(drop)
                })?;
                report(
                    args,
                    &p,
                    "cuda",
                    kernel.backend(),
                    us,
                    json!({"splits": splits, "timing": how, "sets": sets}),
                );
            }
            if args.backend.includes(Backend::CandleNaive) && p.t == 1 {
                let (us, how) = timing::gpu_time(cuda, sets, args.reps, &|i| {
                    run_naive(&inputs[i], p.hq, scale).map(drop)
                })?;
                report(
                    args,
                    &p,
                    "cuda",
                    "candle_naive",
                    us,
                    json!({"timing": how, "sets": sets}),
                );
            }
        }
        Ok(())
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.reps == 0 {
        bail!("--reps must be at least 1");
    }
    if args.passes == 0 {
        bail!("--passes must be at least 1");
    }
    if (args.window.is_some() || args.softcap.is_some() || args.paged.is_some())
        && args.backend != Backend::Splitkv
    {
        bail!("--window, --softcap and --paged time the split-KV op only; pass --backend splitkv");
    }
    if args.paged == Some(0) {
        bail!("--paged 0: a page holds at least one position");
    }
    if let Some(&t) = args
        .qlen
        .iter()
        .find(|&&t| !(1..=candle_splitkv::MAX_QUERY_TOKENS).contains(&t))
    {
        bail!(
            "--qlen {t}: the op takes 1 to {} query tokens per sequence",
            candle_splitkv::MAX_QUERY_TOKENS
        );
    }
    if args.backend == Backend::CandleCpuFlash && args.device != "cpu" {
        bail!("--backend candle-cpu-flash is candle-nn's CPU kernel; pass --device cpu");
    }
    if args.backend == Backend::CandleNaive && args.qlen.iter().any(|&t| t > 1) {
        bail!("--backend candle-naive times one query token; drop --qlen or pass --qlen 1");
    }
    for pass in 0..args.passes {
        let args = Args {
            pass,
            ..args.clone()
        };
        match args.device.as_str() {
            "cpu" => bench_cpu(&args)?,
            #[cfg(feature = "cuda")]
            "cuda" => gpu::bench(&args)?,
            #[cfg(not(feature = "cuda"))]
            "cuda" => bail!("this build has no CUDA support: rebuild with `--features cuda`"),
            other => bail!("unknown --device {other:?}: use cpu or cuda"),
        }
    }
    Ok(())
}
