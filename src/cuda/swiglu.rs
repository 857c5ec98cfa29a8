//! SwiGLU over the interleaved (gate, up) columns of several rows in one launch (see
//! `kernels/swiglu.cuh`), where candle's ops would take two over strided views.

use candle_core::cuda::CudaDType;
use candle_core::op::BackpropOp;
use candle_core::{bail, CudaDevice, CudaStorage, DType, Device, Result, Storage, Tensor};
use cudarc::driver::DeviceRepr;
use half::{bf16, f16};

use super::kernels::{KernelForm, SwiGluParams};
use super::launch::{device_ptr, launch_grid_stride, tensor_ptr};

/// `x (…, 2n)` with columns `[gate_0, up_0, gate_1, up_1, …]` → `(…, n)`, `silu(gate_i)·up_i`.
pub(crate) fn swiglu_pairs(x: &Tensor) -> Result<Tensor> {
    let Device::Cuda(dev) = x.device() else {
        bail!("swiglu: x is not on a CUDA device")
    };
    let mut dims = x.dims().to_vec();
    let Some(last) = dims.last_mut() else {
        bail!("swiglu: x must have at least one dim")
    };
    if *last % 2 != 0 || !x.is_contiguous() {
        bail!(
            "swiglu: x must be contiguous with (gate, up) column pairs, got shape {:?}",
            x.dims()
        )
    }
    *last /= 2;
    let count = x.elem_count() / 2;
    let storage = match x.dtype() {
        DType::F32 => launch::<f32>(dev, x, count)?,
        DType::F16 => launch::<f16>(dev, x, count)?,
        DType::BF16 => launch::<bf16>(dev, x, count)?,
        other => bail!("swiglu: dtype {other:?} is not supported (f32, f16 or bf16)"),
    };
    Ok(Tensor::from_storage(
        Storage::Cuda(storage),
        dims,
        BackpropOp::none(),
        false,
    ))
}

fn launch<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    x: &Tensor,
    count: usize,
) -> Result<CudaStorage> {
    let Some(spec) = KernelForm::SwiGlu.find(x.dtype(), x.dtype(), 0, 0) else {
        bail!("swiglu: no kernel for {:?} in this build", x.dtype())
    };
    let func = spec.load(dev)?;
    // SAFETY: the kernel writes every element.
    let y = unsafe { dev.alloc::<T>(count.max(1))? };
    #[cfg(feature = "test-hooks")]
    crate::test_hooks::poison(dev, &y)?;
    let Some(x_ptr) = tensor_ptr::<T>(x, dev)? else {
        bail!("swiglu: x is not on CUDA")
    };
    let params = SwiGluParams {
        x: x_ptr,
        y: device_ptr(&y, dev, 0),
        count: count as i64,
    };
    // SAFETY: the kernel takes one `SwiGluParams`; it reads 2·count elements of x and writes
    // count elements of y.
    unsafe { launch_grid_stride(dev, &func, spec.threads, count, 4096, &params)? };
    Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
}
