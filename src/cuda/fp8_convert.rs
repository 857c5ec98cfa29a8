//! fp8 (e4m3) conversions on CUDA for [`crate::fp8`]: one grid-stride kernel each way.

use candle_core::backend::BackendStorage;
use candle_core::cuda::{CudaDType, WrapErr};
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result, WithDType};
use cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};
use float8::F8E4M3;
use half::{bf16, f16};

use super::kernels::{Fp8ConvertParams, KernelForm};
use super::launch::device_ptr;

/// `storage` (contiguous per `layout`) converted to fp8 with `1 / scale`, or from fp8 to `to`
/// with `scale`.
pub(crate) fn convert(
    storage: &CudaStorage,
    layout: &Layout,
    scale: f32,
    to: DType,
) -> Result<CudaStorage> {
    let Some((start, end)) = layout.contiguous_offsets() else {
        bail!("fp8 conversion: the input must be contiguous")
    };
    let dev = storage.device().clone();
    let count = end - start;
    match (storage.dtype(), to) {
        (DType::F32, DType::F8E4M3) => quantize::<f32>(&dev, storage, start, count, scale),
        (DType::F16, DType::F8E4M3) => quantize::<f16>(&dev, storage, start, count, scale),
        (DType::BF16, DType::F8E4M3) => quantize::<bf16>(&dev, storage, start, count, scale),
        (DType::F8E4M3, DType::F32) => dequantize::<f32>(&dev, storage, start, count, scale),
        (DType::F8E4M3, DType::F16) => dequantize::<f16>(&dev, storage, start, count, scale),
        (DType::F8E4M3, DType::BF16) => dequantize::<bf16>(&dev, storage, start, count, scale),
        (from, to) => bail!("fp8 conversion: {from:?} to {to:?} is not supported"),
    }
}

fn quantize<T: CudaDType + DeviceRepr + WithDType>(
    dev: &CudaDevice,
    src: &CudaStorage,
    start: usize,
    count: usize,
    scale: f32,
) -> Result<CudaStorage> {
    // SAFETY: the kernel writes all `count` elements.
    let out = unsafe { dev.alloc::<F8E4M3>(count)? };
    let src = device_ptr(src.as_cuda_slice::<T>()?, dev, start);
    run(
        dev,
        KernelForm::QuantizeE4m3,
        T::DTYPE,
        src,
        &out,
        count,
        scale,
    )?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

fn dequantize<T: CudaDType + DeviceRepr + WithDType>(
    dev: &CudaDevice,
    src: &CudaStorage,
    start: usize,
    count: usize,
    scale: f32,
) -> Result<CudaStorage> {
    // SAFETY: the kernel writes all `count` elements.
    let out = unsafe { dev.alloc::<T>(count)? };
    let src = device_ptr(src.as_cuda_slice::<F8E4M3>()?, dev, start);
    run(
        dev,
        KernelForm::DequantizeE4m3,
        T::DTYPE,
        src,
        &out,
        count,
        scale,
    )?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

/// Launches `form` for the non-fp8 side's `dtype`, from `src` into `dst`.
fn run<D>(
    dev: &CudaDevice,
    form: KernelForm,
    dtype: DType,
    src: u64,
    dst: &CudaSlice<D>,
    count: usize,
    scale: f32,
) -> Result<()> {
    if count == 0 {
        return Ok(());
    }
    let Some(spec) = form.find(dtype, dtype, 0, 0) else {
        bail!("fp8 conversion: no {form:?} kernel for {dtype:?} in this build")
    };
    let func = spec.load(dev)?;
    let params = Fp8ConvertParams {
        src,
        dst: device_ptr(dst, dev, 0),
        count: count as i64,
        scale,
    };
    // Enough CTAs to fill the GPU a few times over; each thread strides on from there.
    let ctas = count.div_ceil(2 * spec.threads as usize).clamp(1, 8192) as u32;
    let cfg = LaunchConfig {
        grid_dim: (ctas, 1, 1),
        block_dim: (spec.threads, 1, 1),
        shared_mem_bytes: 0,
    };
    // A plain launch: the kernel reads its input at once, so it must not overlap the kernel that
    // wrote it.
    let stream = dev.cuda_stream();
    let mut builder = stream.launch_builder(&func);
    builder.arg(&params);
    // SAFETY: the kernel takes one `Fp8ConvertParams`, reads `count` source elements and writes
    // `count` destination elements, both buffers sized for that.
    unsafe { builder.launch(cfg) }.map(|_| ()).w()
}
