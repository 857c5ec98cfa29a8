//! A bias-free linear layer fused with the elementwise work around it in a transformer layer:
//! `y = f(x)·Wᵀ`, where `f` is the identity or RMSNorm, followed by a residual add or SwiGLU.
//!
//! At decode time (one row) a linear layer reads its whole weight to produce one output row, so
//! it is bound by memory bandwidth, and the norm, activation and residual add around it are
//! separate launches that each cost more time than their arithmetic. On CUDA, for f16/bf16,
//! [`fused_linear`] runs all of it as one kernel that streams the weight with 16-byte loads: on
//! CUDA cores for one row, on tensor cores for 2 to 16 rows (a batch of decode steps, or a
//! verification step's drafts), still reading the weight once. Everywhere else (the CPU, f32, more
//! rows) it runs [`linear_unfused`], the same computation with candle's ops, so a model can call
//! it unconditionally.

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(all(feature = "cuda", feature = "models"))]
pub(crate) mod qkv_rope_append;
#[cfg(feature = "cuda")]
mod rows;

use candle_core::quantized::QMatMul;
use candle_core::{bail, Module, Result, Tensor, D};

/// What the weight multiplies: the input as given, or its RMSNorm.
#[derive(Debug, Clone, Copy)]
pub enum LinearInput<'a> {
    /// `x` as given.
    Plain,
    /// `RMSNorm(x) · weight`, with `weight` of shape `(k,)`.
    RmsNorm { weight: &'a Tensor, eps: f32 },
}

/// What becomes of the product `p = f(x)·Wᵀ`.
#[derive(Debug, Clone, Copy)]
pub enum LinearOutput<'a> {
    /// `p`, `(…, n)`.
    Plain,
    /// `p + residual`, with the residual of the output's shape `(…, n)`.
    AddResidual(&'a Tensor),
    /// SwiGLU over interleaved rows: W is `(2f, k)` with rows `[gate_0, up_0, gate_1, up_1, …]`
    /// and the output `(…, f)` is `silu(p[2i])·p[2i+1]`. Interleaving keeps each (gate, up) pair
    /// in one warp of the fused kernel, so the activation needs no second pass.
    SwiGlu,
}

/// `f(x)·Wᵀ`, then the output transform.
///
/// - `x`: `(…, k)`; `w`: `(n, k)`, as in candle's `Linear`;
/// - output: `(…, n)`, or `(…, n/2)` for [`LinearOutput::SwiGlu`], in x's dtype. All tensors
///   share x's dtype and device.
///
/// Up to 16 rows of f16/bf16 on CUDA run a fused kernel (more than one row needs an sm_80 or
/// later build, and an sm_90 one where a row's input is too wide for one CTA); the rest runs
/// [`linear_unfused`] (on CUDA with SwiGLU in one launch of its own). The kernel rounds where the unfused ops round, except
/// that a product and its residual are rounded once, not twice.
pub fn fused_linear(
    x: &Tensor,
    w: &Tensor,
    input: LinearInput,
    output: LinearOutput,
) -> Result<Tensor> {
    let out_dims = check(x, w, input, output)?;
    #[cfg(feature = "cuda")]
    if let Some(y) = cuda::try_fused(x, w, input, output, &out_dims)? {
        return Ok(y);
    }
    let _ = out_dims;
    // Several rows on CUDA: the product through candle, the activation in one launch.
    #[cfg(feature = "cuda")]
    if matches!(output, LinearOutput::SwiGlu) && x.device().is_cuda() {
        let y = unfused(x, w, input, LinearOutput::Plain)?;
        return crate::cuda::swiglu::swiglu_pairs(&y);
    }
    unfused(x, w, input, output)
}

/// The computation of [`fused_linear`] with candle's ops, one launch per step (for A/B runs).
pub fn linear_unfused(
    x: &Tensor,
    w: &Tensor,
    input: LinearInput,
    output: LinearOutput,
) -> Result<Tensor> {
    check(x, w, input, output)?;
    unfused(x, w, input, output)
}

/// Validates the operands; returns the output's dims.
fn check(x: &Tensor, w: &Tensor, input: LinearInput, output: LinearOutput) -> Result<Vec<usize>> {
    let (n, k) = w.dims2().map_err(|_| {
        candle_core::Error::Msg(format!(
            "fused linear: the weight must be (out, in), got {:?}",
            w.dims()
        ))
    })?;
    if x.rank() < 1 || x.dims()[x.rank() - 1] != k {
        bail!(
            "fused linear: x must end in {k} columns for a ({n}, {k}) weight, got {:?}",
            x.dims()
        )
    }
    let same = |name: &str, t: &Tensor| -> Result<()> {
        if t.dtype() != x.dtype() || !t.device().same_device(x.device()) {
            bail!(
                "fused linear: {name} must have x's dtype {:?} and device, got {:?} on {:?}",
                x.dtype(),
                t.dtype(),
                t.device().location()
            )
        }
        Ok(())
    };
    same("the weight", w)?;
    if let LinearInput::RmsNorm { weight, .. } = input {
        same("the norm weight", weight)?;
        if weight.dims() != [k] {
            bail!(
                "fused linear: the norm weight must be ({k},), got {:?}",
                weight.dims()
            )
        }
    }
    let mut out_dims = x.dims().to_vec();
    let last = out_dims.len() - 1;
    out_dims[last] = n;
    match output {
        LinearOutput::Plain => {}
        LinearOutput::AddResidual(r) => {
            same("the residual", r)?;
            if r.dims() != out_dims.as_slice() {
                bail!(
                    "fused linear: the residual must have the output's shape {out_dims:?}, got {:?}",
                    r.dims()
                )
            }
        }
        LinearOutput::SwiGlu => {
            if n % 2 != 0 {
                bail!("fused linear: SwiGLU needs interleaved (gate, up) row pairs, the weight has {n} rows")
            }
            out_dims[last] = n / 2;
        }
    }
    Ok(out_dims)
}

fn unfused(x: &Tensor, w: &Tensor, input: LinearInput, output: LinearOutput) -> Result<Tensor> {
    let h = match input {
        LinearInput::Plain => x.clone(),
        LinearInput::RmsNorm { weight, eps } => candle_nn::ops::rms_norm(x, weight, eps)?,
    };
    let y = matmul_rows(&QMatMul::Tensor(w.clone()), &h)?;
    match output {
        LinearOutput::Plain => Ok(y),
        LinearOutput::AddResidual(r) => y + r,
        LinearOutput::SwiGlu => {
            let mut pairs = y.dims().to_vec();
            let last = pairs.len() - 1;
            pairs[last] /= 2;
            pairs.push(2);
            let y = y.reshape(pairs)?;
            let gate = y.narrow(D::Minus1, 0, 1)?.squeeze(D::Minus1)?;
            let up = y.narrow(D::Minus1, 1, 1)?.squeeze(D::Minus1)?;
            candle_nn::ops::silu(&gate)? * up
        }
    }
}

/// `x (…, k) · Wᵀ` with every leading dim taken as rows of one matrix product. Candle's
/// `QMatMul` on a dense weight multiplies a `(b, t, k)` input as b products of t rows, each
/// reading the whole weight: b decode rows of a batch would read it b times.
pub(crate) fn matmul_rows(w: &QMatMul, x: &Tensor) -> Result<Tensor> {
    if x.rank() <= 2 {
        return w.forward(x);
    }
    let dims = x.dims();
    let k = dims[dims.len() - 1];
    let rows = x.elem_count() / k.max(1);
    let y = w.forward(&x.reshape((rows, k))?)?;
    let mut out = dims[..dims.len() - 1].to_vec();
    out.push(y.dim(1)?);
    y.reshape(out)
}
