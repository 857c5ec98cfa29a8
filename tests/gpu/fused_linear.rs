//! `fused_linear` against an f64 reference on fresh random inputs: the unfused path on the CPU,
//! and the fused kernel on CUDA (skipped with a notice where no device exists), with outputs
//! poisoned with NaN first.

use candle_core::{DType, Device, Result, Tensor, D};
use candle_splitkv::test_hooks::{
    compiled_compute_cap, force_rows_splits, fused_launch_count, poison_outputs, ring_form_for_all,
};
use candle_splitkv::{fused_linear, LinearInput, LinearOutput};

use crate::common::gpu;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Prologue {
    Plain,
    RmsNorm,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Epilogue {
    Plain,
    Residual,
    SwiGlu,
}

const EPS: f32 = 1e-5;
const PROLOGUES: [Prologue; 2] = [Prologue::Plain, Prologue::RmsNorm];
const EPILOGUES: [Epilogue; 3] = [Epilogue::Plain, Epilogue::Residual, Epilogue::SwiGlu];

fn host(t: &Tensor) -> Result<Vec<f64>> {
    t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()
}

/// Unit roundoff of a dtype.
fn unit_roundoff(dtype: DType) -> f64 {
    match dtype {
        DType::BF16 => 2f64.powi(-8),
        DType::F16 => 2f64.powi(-11),
        _ => 2f64.powi(-24),
    }
}

struct Inputs {
    x: Tensor,
    w: Tensor,
    gain: Tensor,
    residual: Tensor,
}

fn inputs(dev: &Device, dtype: DType, rows: usize, n: usize, k: usize) -> Result<Inputs> {
    let r = |shape: &[usize], std: f32| -> Result<Tensor> {
        Tensor::randn(0f32, std, shape, dev)?.to_dtype(dtype)
    };
    Ok(Inputs {
        x: r(&[1, rows, k], 1.0)?,
        w: r(&[n, k], 0.05)?,
        gain: (r(&[k], 0.2)? + 1.0)?.to_dtype(dtype)?,
        residual: r(&[1, rows, n], 1.0)?,
    })
}

fn run(case: &Inputs, p: Prologue, e: Epilogue) -> Result<Tensor> {
    let input = match p {
        Prologue::Plain => LinearInput::Plain,
        Prologue::RmsNorm => LinearInput::RmsNorm {
            weight: &case.gain,
            eps: EPS,
        },
    };
    let output = match e {
        Epilogue::Plain => LinearOutput::Plain,
        Epilogue::Residual => LinearOutput::AddResidual(&case.residual),
        Epilogue::SwiGlu => LinearOutput::SwiGlu,
    };
    fused_linear(&case.x, &case.w, input, output)
}

/// Checks every output against f64 math on the same (already rounded) inputs. The bound allows
/// the roundings a correct kernel makes: the normalised input rounded to the dtype, random in
/// sign so they grow like the root of the sum of squares, and the roundings of the result (three
/// for SwiGLU: gate and up, silu, product).
fn check(what: &str, got: &Tensor, case: &Inputs, p: Prologue, e: Epilogue) -> Result<()> {
    let dtype = case.x.dtype();
    let (n, k) = case.w.dims2()?;
    let x = host(&case.x)?;
    let w = host(&case.w)?;
    let gain = host(&case.gain)?;
    let res = host(&case.residual)?;
    let got = host(got)?;
    let rows = x.len() / k;
    let outs = if e == Epilogue::SwiGlu { n / 2 } else { n };
    assert_eq!(got.len(), rows * outs, "{what}: output size");
    let u = unit_roundoff(dtype);
    for row in 0..rows {
        let xr = &x[row * k..(row + 1) * k];
        let f: Vec<f64> = match p {
            Prologue::Plain => xr.to_vec(),
            Prologue::RmsNorm => {
                let ms = xr.iter().map(|v| v * v).sum::<f64>() / k as f64;
                let inv = 1.0 / (ms + EPS as f64).sqrt();
                xr.iter().zip(&gain).map(|(v, g)| v * inv * g).collect()
            }
        };
        // The product of weight row `o`, and the error bound of its rounded inputs.
        let product = |o: usize| -> (f64, f64) {
            let terms = || w[o * k..(o + 1) * k].iter().zip(&f).map(|(a, b)| a * b);
            let spread = terms().map(|t| t * t).sum::<f64>().sqrt();
            (terms().sum::<f64>(), 4.0 * u * spread)
        };
        for o in 0..outs {
            let (want, tol) = match e {
                Epilogue::Plain => {
                    let (p, t) = product(o);
                    (p, t + 2.0 * u * p.abs())
                }
                Epilogue::Residual => {
                    // The product may be rounded before the residual is added, and the sum may
                    // cancel: that rounding is relative to the product, not to the sum.
                    let (p, t) = product(o);
                    let want = p + res[row * n + o];
                    (want, t + u * p.abs() + 2.0 * u * want.abs())
                }
                Epilogue::SwiGlu => {
                    let ((g, tg), (up, tu)) = (product(2 * o), product(2 * o + 1));
                    let sig = 1.0 / (1.0 + (-g).exp());
                    let silu = g * sig;
                    // d silu / d g is at most 1.1 in magnitude.
                    let silu_err = 1.1 * (tg + u * g.abs()) + u * silu.abs();
                    let want = silu * up;
                    let tol = silu_err * (up.abs() + tu)
                        + silu.abs() * (tu + u * up.abs())
                        + 2.0 * u * want.abs();
                    (want, tol)
                }
            };
            let tol = tol + 1e-6;
            let err = (got[row * outs + o] - want).abs();
            assert!(
                err <= tol,
                "{what}: row {row} output {o}: got {}, want {want} (tolerance {tol})",
                got[row * outs + o]
            );
        }
    }
    Ok(())
}

#[test]
fn cpu_matches_reference() -> Result<()> {
    let dev = Device::Cpu;
    for dtype in [DType::F32, DType::BF16] {
        for (rows, n, k) in [(1, 38, 64), (3, 16, 40), (1, 6, 12)] {
            for p in PROLOGUES {
                for e in EPILOGUES {
                    let case = inputs(&dev, dtype, rows, n, k)?;
                    let y = run(&case, p, e)?;
                    let what = format!("cpu {dtype:?} rows {rows} n {n} k {k} {p:?} {e:?}");
                    check(&what, &y, &case, p, e)?;
                }
            }
        }
    }
    Ok(())
}

#[test]
fn rejects_bad_shapes() -> Result<()> {
    let dev = Device::Cpu;
    let x = Tensor::zeros((1, 1, 64), DType::F32, &dev)?;
    let w = Tensor::zeros((32, 64), DType::F32, &dev)?;
    let plain = LinearOutput::Plain;
    let message = |r: Result<Tensor>| r.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(message(fused_linear(&x, &w.t()?, LinearInput::Plain, plain)).contains("columns"));
    let odd = Tensor::zeros((31, 64), DType::F32, &dev)?;
    assert!(message(fused_linear(
        &x,
        &odd,
        LinearInput::Plain,
        LinearOutput::SwiGlu
    ))
    .contains("row pairs"));
    let gain = Tensor::zeros(63, DType::F32, &dev)?;
    let norm = LinearInput::RmsNorm {
        weight: &gain,
        eps: EPS,
    };
    assert!(message(fused_linear(&x, &w, norm, plain)).contains("norm weight"));
    let residual = Tensor::zeros((1, 1, 31), DType::F32, &dev)?;
    let add = LinearOutput::AddResidual(&residual);
    assert!(message(fused_linear(&x, &w, LinearInput::Plain, add)).contains("residual"));
    let w16 = w.to_dtype(DType::BF16)?;
    assert!(message(fused_linear(&x, &w16, LinearInput::Plain, plain)).contains("dtype"));
    let w3 = w.unsqueeze(0)?;
    assert!(message(fused_linear(&x, &w3, LinearInput::Plain, plain)).contains("(out, in)"));
    Ok(())
}

/// Every prologue and epilogue on each `(n, k)` for one row, fused where the staged input fits.
fn check_gpu_shapes(dev: &Device, shapes: &[(usize, usize)]) -> Result<()> {
    // The staged input (and norm weight) must fit in 48 KiB of shared memory.
    check_gpu_rows(dev, shapes, &[1], |p, _, k| {
        Some((if p == Prologue::RmsNorm { 4 * k } else { 2 * k }) <= 48 * 1024)
    })
}

/// Every prologue and epilogue on each `(n, k)` and row count; `fused(p, rows, k)` says whether
/// a fused kernel must run (`None`: either may).
fn check_gpu_rows(
    dev: &Device,
    shapes: &[(usize, usize)],
    row_counts: &[usize],
    fused: impl Fn(Prologue, usize, usize) -> Option<bool>,
) -> Result<()> {
    poison_outputs(true);
    for dtype in [DType::BF16, DType::F16] {
        for &(n, k) in shapes {
            for &rows in row_counts {
                for p in PROLOGUES {
                    for e in EPILOGUES {
                        if e == Epilogue::SwiGlu && n % 2 != 0 {
                            continue;
                        }
                        let case = inputs(dev, dtype, rows, n, k)?;
                        let before = fused_launch_count();
                        let y = run(&case, p, e)?;
                        if let Some(fused) = fused(p, rows, k) {
                            assert_eq!(
                                fused_launch_count(),
                                before + u64::from(fused),
                                "{dtype:?} {rows} × ({n}, {k}) {p:?} {e:?}: a fused kernel ran \
                                 where it should not, or not where it should"
                            );
                        }
                        let what = format!("cuda {dtype:?} rows {rows} n {n} k {k} {p:?} {e:?}");
                        check(&what, &y, &case, p, e)?;
                    }
                }
            }
        }
    }
    Ok(())
}

/// The rows kernel (2 to 16 rows on tensor cores): row counts below, at and past one product's
/// 8; shapes that take 1, 2 and 4 CTAs a cluster (8 when forced), ragged row blocks and slices,
/// widths that do not fill a tile. An sm_90 build splits k over clusters of up to 4 CTAs, so it
/// takes every shape but a 14,336-column one past 8 rows, whose quarter slices do not fit two
/// CTAs an SM (the plan leaves it to candle's ops); others take what one CTA can stage (the
/// outputs are checked either way).
#[test]
fn gpu_rows_kernel_matches_reference() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let clusters = compiled_compute_cap().is_some_and(|cap| cap >= 90);
    check_gpu_rows(
        &dev,
        &[
            (2, 8),
            (34, 64),
            (300, 1000),
            (1000, 1032),
            (5000, 576),
            (520, 14336),
        ],
        &[2, 5, 8, 9, 16],
        |_, rows, k| clusters.then_some(rows <= 8 || k < 14336),
    )?;
    if clusters {
        // Clusters of 8 CTAs, which the plan no longer picks, on shapes that give each CTA columns.
        force_rows_splits(Some(8));
        let forced = check_gpu_rows(&dev, &[(300, 1000), (520, 14336)], &[9, 16], |_, _, _| {
            Some(true)
        });
        force_rows_splits(None);
        forced?;
    }
    poison_outputs(false);
    Ok(())
}

/// The rows kernel on Llama-3-8B's projections at a batch of 16, each with the prologue and
/// epilogue the model's step gives it (large: not for the memory checkers). The plan leaves the
/// down projection to candle's ops, which measured faster than the clusters of 8 CTAs it would
/// need; it runs here with 8 forced.
#[test]
fn gpu_rows_kernel_llama_shapes() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    if compiled_compute_cap().is_none_or(|cap| cap < 90) {
        return Ok(());
    }
    poison_outputs(true);
    let down = (4096, 14336);
    let case = inputs(&dev, DType::BF16, 16, down.0, down.1)?;
    let before = fused_launch_count();
    let y = run(&case, Prologue::Plain, Epilogue::Residual)?;
    assert_eq!(
        fused_launch_count(),
        before,
        "16 × {down:?} ran fused by plan"
    );
    check(
        "cuda 16 × down by plan",
        &y,
        &case,
        Prologue::Plain,
        Epilogue::Residual,
    )?;
    for ((n, k), p, e, splits) in [
        ((6144, 4096), Prologue::RmsNorm, Epilogue::Plain, None),
        ((4096, 4096), Prologue::Plain, Epilogue::Residual, None),
        ((28672, 4096), Prologue::RmsNorm, Epilogue::SwiGlu, None),
        (down, Prologue::Plain, Epilogue::Residual, Some(8)),
    ] {
        let case = inputs(&dev, DType::BF16, 16, n, k)?;
        let before = fused_launch_count();
        force_rows_splits(splits);
        let y = run(&case, p, e);
        force_rows_splits(None);
        let y = y?;
        assert_eq!(
            fused_launch_count(),
            before + 1,
            "16 × ({n}, {k}) did not run fused"
        );
        check(
            &format!("cuda 16 × ({n}, {k}) {p:?} {e:?}"),
            &y,
            &case,
            p,
            e,
        )?;
    }
    poison_outputs(false);
    Ok(())
}

/// Llama-3-8B's projection shapes (large: not for the memory checkers); gate/up takes the ring
/// form, the others the register forms.
#[test]
fn gpu_fused_kernel_llama_shapes() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    check_gpu_shapes(
        &dev,
        &[(4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336)],
    )
}

/// `(n, k)`: row counts odd and even, below and above one round of the grid (5000 rows take the
/// shallow variant on an H200); widths that do and do not fill a warp's tile; a width too wide
/// to stage with the norm weight.
const SMALL_AND_RAGGED_SHAPES: &[(usize, usize)] = &[
    (2, 8),
    (17, 40),
    (1000, 1032),
    (302, 14336),
    (5000, 64),
    (9000, 256),
];

/// The ring form on the small and ragged shapes (small enough for the memory checkers).
#[test]
fn gpu_ring_form_matches_reference() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    ring_form_for_all(true);
    let checked = check_gpu_shapes(&dev, SMALL_AND_RAGGED_SHAPES);
    ring_form_for_all(false);
    checked
}

#[test]
fn gpu_fused_kernel_matches_reference() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    check_gpu_shapes(&dev, SMALL_AND_RAGGED_SHAPES)?;

    // A view into a joined projection output, as the Llama decode step passes it.
    let joined = Tensor::randn(0f32, 1.0, (1, 1, 3 * 512), &dev)?.to_dtype(DType::BF16)?;
    let w = Tensor::randn(0f32, 0.05, (64, 512), &dev)?.to_dtype(DType::BF16)?;
    let x = joined.narrow(D::Minus1, 512, 512)?;
    let before = fused_launch_count();
    let y = fused_linear(&x, &w, LinearInput::Plain, LinearOutput::Plain)?;
    assert_eq!(fused_launch_count(), before + 1);
    let case = Inputs {
        x: x.contiguous()?,
        w,
        gain: Tensor::ones(512, DType::BF16, &dev)?,
        residual: Tensor::zeros((1, 1, 64), DType::BF16, &dev)?,
    };
    check(
        "cuda narrowed input",
        &y,
        &case,
        Prologue::Plain,
        Epilogue::Plain,
    )?;

    // Shapes the kernels do not take run candle's ops (SwiGLU in a launch of its own) and
    // still agree: more rows than 16, a width that is not whole 16-byte vectors, f32.
    for (rows, n, k, dtype) in [
        (17, 34, 64, DType::BF16),
        (3, 10, 12, DType::F16),
        (1, 10, 12, DType::F16),
        (1, 10, 64, DType::F32),
        (4, 10, 64, DType::F32),
    ] {
        let case = inputs(&dev, dtype, rows, n, k)?;
        for e in EPILOGUES {
            let before = fused_launch_count();
            let y = run(&case, Prologue::RmsNorm, e)?;
            assert_eq!(
                fused_launch_count(),
                before,
                "({rows}, {n}, {k}) should not run fused"
            );
            check("cuda fallback", &y, &case, Prologue::RmsNorm, e)?;
        }
    }
    poison_outputs(false);
    Ok(())
}
