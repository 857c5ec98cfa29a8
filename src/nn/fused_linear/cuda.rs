//! Launches the fused matrix-vector kernel (`kernels/matvec.cuh`) for one f16/bf16 row on
//! candle's stream, or hands a few rows to [`rows`].

use candle_core::cuda::CudaDType;
use candle_core::{CudaDevice, CudaStorage, DType, Device, Result, Storage, Tensor};
use cudarc::driver::{CudaFunction, DeviceRepr, LaunchConfig};
use half::{bf16, f16};

use super::{rows, LinearInput, LinearOutput};
use crate::cuda::kernels::{KernelForm, KernelSpec, MatVecEpilogue, MatVecParams, MatVecPrologue};
use crate::cuda::launch::{
    device_ptr, launch_dependent, max_dynamic_smem, resident_ctas, tensor_ptr,
};

/// The staged input lives in shared memory; past this the kernel would need an opt-in limit
/// that not every GPU has, and such wide layers are rare, so they take the unfused path.
pub(super) const MAX_STAGED_BYTES: usize = 48 * 1024;

/// Weights from this size up stream through the ring form: measured faster there (the
/// Llama-3-8B gate/up and lm_head projections), while shorter streams (q/k/v, o, down) ran as
/// fast or faster in the register forms, which start streaming with less setup.
const RING_MIN_WEIGHT_BYTES: usize = 128 << 20;

/// The operands of one fused call, as the caller passed them.
#[derive(Clone, Copy)]
pub(super) struct Operands<'a> {
    pub x: &'a Tensor,
    pub w: &'a Tensor,
    pub input: LinearInput<'a>,
    pub output: LinearOutput<'a>,
}

/// Runs a fused kernel when one applies (CUDA, f16/bf16, one row, or up to
/// [`rows::MAX_ROWS`] rows on tensor cores, 16-byte aligned rows, the input small enough to
/// stage); `None` means the caller should run the unfused ops. Shapes were checked by the caller.
pub(super) fn try_fused(
    x: &Tensor,
    w: &Tensor,
    input: LinearInput,
    output: LinearOutput,
    out_dims: &[usize],
) -> Result<Option<Tensor>> {
    let Device::Cuda(dev) = x.device() else {
        return Ok(None);
    };
    let rows: usize = x.dims()[..x.rank() - 1].iter().product();
    let (n, k) = w.dims2()?;
    let elem = x.dtype().size_in_bytes();
    let vec_aligned = |t: &Tensor| t.is_contiguous() && t.layout().start_offset().is_multiple_of(8);
    let eligible = matches!(x.dtype(), DType::F16 | DType::BF16)
        && (1..=rows::MAX_ROWS).contains(&rows)
        && k.is_multiple_of(8)
        && n <= i32::MAX as usize
        && k <= i32::MAX as usize
        && vec_aligned(x)
        && vec_aligned(w)
        && match output {
            LinearOutput::AddResidual(r) => r.is_contiguous(),
            _ => true,
        }
        && match input {
            LinearInput::RmsNorm { weight, .. } => vec_aligned(weight),
            LinearInput::Plain => true,
        };
    if !eligible {
        return Ok(None);
    }
    let ops = Operands {
        x,
        w,
        input,
        output,
    };
    let y = if rows == 1 {
        if staged_bytes(input, k, elem) > MAX_STAGED_BYTES {
            return Ok(None);
        }
        match x.dtype() {
            DType::F16 => launch::<f16>(dev, &ops, n, k)?,
            DType::BF16 => launch::<bf16>(dev, &ops, n, k)?,
            _ => return Ok(None),
        }
    } else {
        let y = match x.dtype() {
            DType::F16 => rows::launch::<f16>(dev, &ops, rows, (n, k))?,
            DType::BF16 => rows::launch::<bf16>(dev, &ops, rows, (n, k))?,
            _ => None,
        };
        let Some(y) = y else { return Ok(None) };
        y
    };
    let storage = Storage::Cuda(y);
    Ok(Some(Tensor::from_storage(
        storage,
        out_dims,
        candle_core::op::BackpropOp::none(),
        false,
    )))
}

/// A fused launch: the kernel, its grid and the dynamic shared memory it takes.
pub(super) struct Launch {
    spec: &'static KernelSpec,
    func: CudaFunction,
    grid: u32,
    smem_bytes: usize,
}

impl Launch {
    /// Launches the kernel with `params` on candle's stream, as a programmatic dependent of the
    /// kernel before (see [`launch_dependent`]).
    ///
    /// # Safety
    ///
    /// `params` must be the kernel's parameter block, and every address in it valid for what the
    /// kernel reads and writes.
    pub unsafe fn run<P: DeviceRepr>(&self, dev: &CudaDevice, params: &P) -> Result<()> {
        let cfg = LaunchConfig {
            grid_dim: (self.grid, 1, 1),
            block_dim: (self.spec.threads, 1, 1),
            shared_mem_bytes: self.smem_bytes as u32,
        };
        // SAFETY: the caller's contract.
        unsafe { launch_dependent(&self.func, dev, cfg, None, params) }
    }
}

/// The forms of one kernel built on matvec.cuh's stream: the ring form (where it has one) and the
/// two register forms.
#[derive(Debug, Clone, Copy)]
pub(super) struct MatVecForms {
    pub ring: Option<KernelForm>,
    pub deep: KernelForm,
    pub shallow: KernelForm,
}

/// The fused projection's forms.
const PRODUCT_FORMS: MatVecForms = MatVecForms {
    ring: Some(KernelForm::MatVecRing),
    deep: KernelForm::MatVecDeep,
    shallow: KernelForm::MatVecShallow,
};

/// The kernel form and grid for an `n × k` weight of `elem`-byte elements whose staged input
/// takes `staged` bytes.
///
/// Long weight streams take the ring form (one CTA per SM, the bytes in flight in shared
/// memory) where the device lets a CTA take its rings and the staged input. Elsewhere, the
/// register forms: the deep one (four loads per lane and row per tile, two CTAs per SM) streams
/// best; the shallow one (two loads, three CTAs per SM) has more warps, and wins when its one
/// round of row pairs would take the deep one two.
pub(super) fn pick_kernel(
    dev: &CudaDevice,
    forms: MatVecForms,
    (dtype, kv_dtype): (DType, DType),
    (n, k): (usize, usize),
    staged: usize,
) -> Result<Launch> {
    let pairs = n.div_ceil(2);
    let warps_per_cta = |spec: &KernelSpec| spec.threads as usize / 32;
    let grid_for = |spec: &KernelSpec, ctas: usize| {
        pairs.div_ceil(warps_per_cta(spec)).min(ctas).max(1) as u32
    };
    #[cfg(feature = "test-hooks")]
    let ring_wanted = crate::test_hooks::ring_form_forced();
    #[cfg(not(feature = "test-hooks"))]
    let ring_wanted = false;
    let ring_wanted = ring_wanted || n * k * dtype.size_in_bytes() >= RING_MIN_WEIGHT_BYTES;
    if let Some(spec) = forms
        .ring
        .and_then(|ring| ring.find(dtype, kv_dtype, 0, 0))
        .filter(|_| ring_wanted)
    {
        let func = spec.load(dev)?;
        let most = max_dynamic_smem(dev, &func)?;
        if spec.smem_bytes + staged <= most {
            let ctas = resident_ctas(dev, spec.symbol, &func, spec.threads, most)?.total();
            return Ok(Launch {
                spec,
                func,
                grid: grid_for(spec, ctas),
                smem_bytes: spec.smem_bytes + staged,
            });
        }
    }
    let load = |form: KernelForm| -> Result<(&'static KernelSpec, CudaFunction, usize)> {
        let Some(spec) = form.find(dtype, kv_dtype, 0, 0) else {
            candle_core::bail!(
                "fused linear: no {form:?} kernel for {dtype:?} (K/V {kv_dtype:?}) in this build"
            )
        };
        let func = spec.load(dev)?;
        let ctas = resident_ctas(dev, spec.symbol, &func, spec.threads, MAX_STAGED_BYTES)?.total();
        Ok((spec, func, ctas))
    };
    let deep = load(forms.deep)?;
    let (spec, func, ctas) = if pairs > deep.2 * warps_per_cta(deep.0) {
        let shallow = load(forms.shallow)?;
        if pairs <= shallow.2 * warps_per_cta(shallow.0) {
            shallow
        } else {
            deep
        }
    } else {
        deep
    };
    Ok(Launch {
        spec,
        func,
        grid: grid_for(spec, ctas),
        smem_bytes: staged,
    })
}

/// Shared memory for the staged input (and the norm weight beside it).
pub(super) fn staged_bytes(input: LinearInput, k: usize, elem: usize) -> usize {
    match input {
        LinearInput::Plain => k * elem,
        LinearInput::RmsNorm { .. } => 2 * k * elem,
    }
}

/// The device address of `t`'s first element, keeping its storage borrowed for the launch.
pub(super) fn address<T: CudaDType>(t: &Tensor, dev: &CudaDevice) -> Result<u64> {
    match tensor_ptr::<T>(t, dev)? {
        Some(ptr) => Ok(ptr),
        None => candle_core::bail!("fused linear: every tensor must be on the CUDA device"),
    }
}

fn launch<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    ops: &Operands,
    n: usize,
    k: usize,
) -> Result<CudaStorage> {
    let Operands {
        x,
        w,
        input,
        output,
    } = *ops;
    let staged = staged_bytes(input, k, std::mem::size_of::<T>());
    let kernel = pick_kernel(dev, PRODUCT_FORMS, (x.dtype(), x.dtype()), (n, k), staged)?;
    let (epilogue, residual, outputs) = match output {
        LinearOutput::Plain => (MatVecEpilogue::Plain, 0, n),
        LinearOutput::AddResidual(r) => (MatVecEpilogue::Residual, address::<T>(r, dev)?, n),
        LinearOutput::SwiGlu => (MatVecEpilogue::SwiGlu, 0, n / 2),
    };

    // SAFETY: every output is written by the kernel; tests poison it to check.
    let y = unsafe { dev.alloc::<T>(outputs)? };
    #[cfg(feature = "test-hooks")]
    crate::test_hooks::poison(dev, &y)?;
    let (prologue, norm_weight, eps) = match input {
        LinearInput::Plain => (MatVecPrologue::Plain, 0, 0.0),
        LinearInput::RmsNorm { weight, eps } => {
            (MatVecPrologue::RmsNorm, address::<T>(weight, dev)?, eps)
        }
    };
    let params = MatVecParams {
        x: address::<T>(x, dev)?,
        w: address::<T>(w, dev)?,
        norm_weight,
        residual,
        y: device_ptr(&y, dev, 0),
        n: n as i32,
        k: k as i32,
        prologue: prologue as i32,
        epilogue: epilogue as i32,
        eps,
    };
    // SAFETY: the matvec kernels take one `MatVecParams`; it reads k inputs, n·k weights, k norm weights
    // and n residuals, and writes the outputs allocated above.
    unsafe { kernel.run(dev, &params)? };
    #[cfg(feature = "test-hooks")]
    crate::test_hooks::count_fused_launch();
    Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
}
