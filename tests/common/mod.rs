//! Shared by the CPU and GPU test suites: random inputs and an f64 reference.
#![allow(dead_code)]

pub mod batched;
pub mod flash_attn_cases;
pub mod own_process;
pub mod paged;
pub mod seeded;
pub mod tiny_families;
pub mod tiny_llama;

/// The path of example `name`'s binary: `cargo test` builds the examples next to the test
/// binaries, in `<target>/<profile>/examples/`.
pub fn example_binary(name: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("the test knows its own path");
    // <target>/<profile>/deps/<test>-<hash> -> <target>/<profile>/examples/<name>
    let profile_dir = exe
        .parent()
        .and_then(std::path::Path::parent)
        .expect("the test binary lives in <target>/<profile>/deps");
    let binary = profile_dir
        .join("examples")
        .join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    assert!(
        binary.is_file(),
        "{} is missing; `cargo test` builds it (examples are built with the tests)",
        binary.display()
    );
    binary
}

use candle_core::{DType, Device, Result, Tensor};
use candle_splitkv::SplitKvAttention;
use rayon::prelude::*;

/// The first CUDA device, or `None` with a notice, so that GPU tests skip where there is none.
pub fn gpu() -> Option<Device> {
    match Device::new_cuda(0) {
        Ok(dev) => Some(dev),
        Err(e) => {
            println!("skipping GPU test: no CUDA device ({e})");
            None
        }
    }
}

/// The greedy token: the first of the largest logits.
pub fn greedy(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Whether this build runs fp8 (e4m3) K/V on CUDA: its kernels need compute capability 89 or
/// later, so a build for 80 or 86 has none.
pub fn fp8_kv_built() -> bool {
    candle_splitkv::test_hooks::compiled_compute_cap().is_some_and(|cap| cap >= 89)
}

/// The first CUDA device for a test of fp8 K/V, or `None` with a notice. In a build without fp8
/// kernels an fp8 call must fail with the error that says so, which is checked instead.
pub fn gpu_for_fp8(test: &str) -> Result<Option<Device>> {
    let Some(dev) = gpu() else { return Ok(None) };
    if fp8_kv_built() {
        return Ok(Some(dev));
    }
    let q = Tensor::zeros((1, 1, 8, 64), DType::BF16, &dev)?;
    let kv = Tensor::zeros((1, 16, 8, 64), DType::F8E4M3, &Device::Cpu)?.to_device(&dev)?;
    match SplitKvAttention::new(0.125).forward(&q, &kv, &kv) {
        Ok(_) => panic!("{test}: an fp8 call ran in a build without fp8 kernels"),
        Err(e) => assert!(
            e.to_string().contains("compute capability 89"),
            "{test}: unexpected error {e}"
        ),
    }
    println!("{test}: fp8 K/V skipped, this build has none (refused with an error, as it should)");
    Ok(None)
}

/// The op, with this thread's kernel outputs and split scratch filled with NaN before the
/// kernels run from here on, so that an element they fail to write fails the comparison.
pub fn poisoned(scale: f32) -> SplitKvAttention {
    candle_splitkv::test_hooks::poison_outputs(true);
    SplitKvAttention::new(scale)
}

/// One decode problem's sizes.
#[derive(Debug, Clone, Copy)]
pub struct Case {
    pub b: usize,
    pub h_q: usize,
    pub h_kv: usize,
    pub d: usize,
    pub l: usize,
    pub dtype: DType,
}

impl Case {
    pub fn scale(&self) -> f32 {
        1.0 / (self.d as f32).sqrt()
    }
}

/// Fresh random q, k, v of the case's dtype on `device`; k and v are contiguous `(b, L, h_kv, d)`.
pub fn random_qkv(case: &Case, device: &Device) -> Result<(Tensor, Tensor, Tensor)> {
    let q =
        Tensor::randn(0f32, 1.0, (case.b, 1, case.h_q, case.d), device)?.to_dtype(case.dtype)?;
    let k = Tensor::randn(0f32, 1.0, (case.b, case.l, case.h_kv, case.d), device)?
        .to_dtype(case.dtype)?;
    let v = Tensor::randn(0f32, 1.0, (case.b, case.l, case.h_kv, case.d), device)?
        .to_dtype(case.dtype)?;
    Ok((q, k, v))
}

/// Random k or v laid out head-major `(b, h_kv, capacity, d)`, returned as the narrowed and
/// transposed `(b, len, h_kv, d)` view a KV cache hands to the op, plus its contiguous copy.
pub fn head_major_view(
    b: usize,
    h_kv: usize,
    capacity: usize,
    len: usize,
    d: usize,
    dtype: DType,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    let buffer = Tensor::randn(0f32, 1.0, (b, h_kv, capacity, d), device)?.to_dtype(dtype)?;
    let view = buffer.narrow(2, 0, len)?.transpose(1, 2)?;
    let dense = view.contiguous()?;
    Ok((view, dense))
}

/// softmax(q·kᵀ·scale)·v and the natural-log LSE, in f64, per `(b, t, h_q)`: query token i of
/// t is the sequence's position len − t + i and sees the keys up to it (all of them for t = 1).
/// `seqlens` restricts batch entry `b` to its first `seqlens[b]` positions.
pub struct Reference {
    /// `(b, t, h_q, d)` flattened.
    pub out: Vec<f64>,
    /// `(b, h_q, t)` flattened.
    pub lse: Vec<f64>,
}

pub fn reference(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f32,
    seqlens: Option<&[u32]>,
) -> Result<Reference> {
    reference_masked(q, k, v, scale, seqlens, None, None)
}

/// [`reference`] with a sliding window (a query at position p sees keys p − window ..= p) and
/// soft-capping of the scaled scores (s → c·tanh(s/c)).
#[allow(dead_code)]
pub fn reference_masked(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f32,
    seqlens: Option<&[u32]>,
    window: Option<usize>,
    softcap: Option<f32>,
) -> Result<Reference> {
    let (b, t_len, h_q, d) = q.dims4()?;
    let (_, l, h_kv, _) = k.dims4()?;
    let group = h_q / h_kv;
    // f32 holds f16/bf16 values exactly and halves the memory of an f64 copy.
    let to_host = |t: &Tensor| -> Result<Vec<f32>> {
        t.to_device(&Device::Cpu)?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()
    };
    let (q, k, v) = (
        to_host(q)?,
        to_host(&k.contiguous()?)?,
        to_host(&v.contiguous()?)?,
    );
    // One row per (batch, token, q head), computed in parallel: GPU tests check long sequences.
    // Token i of t is position len − t + i and sees the keys up to it.
    let rows: Vec<(Vec<f64>, f64)> = (0..b * t_len * h_q)
        .into_par_iter()
        .map(|row| {
            let (bi, token, h) = (row / (t_len * h_q), (row / h_q) % t_len, row % h_q);
            let len = seqlens.map_or(l, |s| s[bi] as usize);
            let visible = (len + token + 1).saturating_sub(t_len);
            let g = h / group;
            let qrow = &q[row * d..(row + 1) * d];
            let mut o = vec![0f64; d];
            if visible == 0 {
                return (o, f64::NEG_INFINITY);
            }
            let first = window.map_or(0, |w| (visible - 1).saturating_sub(w));
            let scores: Vec<f64> = (first..visible)
                .map(|t| {
                    let krow = &k[((bi * l + t) * h_kv + g) * d..][..d];
                    let s = qrow
                        .iter()
                        .zip(krow)
                        .map(|(&a, &b)| a as f64 * b as f64)
                        .sum::<f64>()
                        * scale as f64;
                    softcap.map_or(s, |c| c as f64 * (s / c as f64).tanh())
                })
                .collect();
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let mut sum = 0f64;
            for (i, score) in scores.iter().enumerate() {
                let t = first + i;
                let p = (score - max).exp();
                sum += p;
                let vrow = &v[((bi * l + t) * h_kv + g) * d..][..d];
                for (acc, x) in o.iter_mut().zip(vrow) {
                    *acc += p * *x as f64;
                }
            }
            o.iter_mut().for_each(|x| *x /= sum);
            (o, max + sum.ln())
        })
        .collect();
    // The LSE in (batch, q head, token) order, as the op returns it.
    let mut lse = vec![0f64; rows.len()];
    for (row, (_, x)) in rows.iter().enumerate() {
        let (bi, token, h) = (row / (t_len * h_q), (row / h_q) % t_len, row % h_q);
        lse[(bi * h_q + h) * t_len + token] = *x;
    }
    let out = rows.into_iter().flat_map(|(o, _)| o).collect();
    Ok(Reference { out, lse })
}

/// Absolute + relative tolerance on the output for inputs and output of `dtype`.
pub fn tolerance(dtype: DType) -> (f64, f64) {
    match dtype {
        DType::F32 => (2e-5, 1e-4),
        DType::F16 => (2e-3, 4e-3),
        DType::BF16 => (1.5e-2, 1.6e-2),
        other => panic!("no tolerance for {other:?}"),
    }
}

/// The largest elementwise difference between two equally long results.
pub fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

pub fn host_f64(t: &Tensor) -> Result<Vec<f64>> {
    t.to_device(&Device::Cpu)?
        .to_dtype(DType::F64)?
        .flatten_all()?
        .to_vec1::<f64>()
}

/// Worst violation of `|got - want| <= atol + rtol·|want|` over all elements, as a ratio of the
/// allowed error (≤ 1 passes). NaN counts as an infinite violation.
pub fn worst_violation(got: &[f64], want: &[f64], (atol, rtol): (f64, f64)) -> f64 {
    assert_eq!(got.len(), want.len(), "length mismatch");
    got.iter()
        .zip(want)
        .map(|(g, w)| {
            if g.is_nan() || w.is_nan() {
                return f64::INFINITY;
            }
            if g == w {
                return 0.0;
            }
            (g - w).abs() / (atol + rtol * w.abs())
        })
        .fold(0.0, f64::max)
}

/// Checks an output against the reference, with a message naming the case.
pub fn assert_close(what: &str, got: &Tensor, want: &[f64], dtype: DType) -> Result<()> {
    assert_close_scaled(what, got, want, dtype, 1.0)
}

/// Like [`assert_close`] with the dtype's tolerance multiplied by `factor`: large logits
/// amplify the fp32 rounding of q·k by their scale.
pub fn assert_close_scaled(
    what: &str,
    got: &Tensor,
    want: &[f64],
    dtype: DType,
    factor: f64,
) -> Result<()> {
    let got = host_f64(got)?;
    assert!(
        got.iter().all(|x| x.is_finite()),
        "{what}: non-finite output"
    );
    let (atol, rtol) = tolerance(dtype);
    let worst = worst_violation(&got, want, (factor * atol, factor * rtol));
    assert!(
        worst <= 1.0,
        "{what}: output differs from the f64 reference ({worst:.2}× {factor}× the {dtype:?} tolerance)"
    );
    Ok(())
}

/// Checks natural-log LSEs against the reference: -inf must match exactly, finite values within
/// a tolerance relative to the score scale.
pub fn assert_lse_close(what: &str, got: &Tensor, want: &[f64], dtype: DType) -> Result<()> {
    let got = host_f64(got)?;
    assert_eq!(got.len(), want.len(), "{what}: LSE length");
    let tol = match dtype {
        DType::F32 => 1e-4,
        _ => 2e-3,
    };
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        if w.is_infinite() {
            assert!(
                g.is_infinite() && *g < 0.0,
                "{what}: lse[{i}] = {g}, want -inf"
            );
        } else {
            assert!(
                (g - w).abs() <= tol * (1.0 + w.abs()),
                "{what}: lse[{i}] = {g}, want {w}"
            );
        }
    }
    Ok(())
}
