//! fp8 (e4m3) conversions on CUDA for [`crate::fp8`]: one grid-stride kernel each way, reading a
//! strided view of up to four dims and writing a contiguous result.

use candle_core::backend::BackendStorage;
use candle_core::cuda::{CudaDType, WrapErr};
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result, WithDType};
use cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};
use float8::F8E4M3;
use half::{bf16, f16};

use super::kernels::{Fp8ConvertParams, KernelForm};
use super::launch::device_ptr;

/// The source as the kernel reads it: up to four dims, padded at the front.
struct SourceView {
    start: usize,
    count: usize,
    sizes: [usize; 4],
    strides: [usize; 4],
}

impl SourceView {
    fn of(layout: &Layout) -> Result<Self> {
        let (dims, strides) = (layout.dims(), layout.stride());
        if dims.len() > 4 {
            bail!("fp8 conversion on CUDA: at most 4 dims, got shape {dims:?}; reshape first")
        }
        let pad = 4 - dims.len();
        let mut view = Self {
            start: layout.start_offset(),
            count: layout.shape().elem_count(),
            sizes: [1; 4],
            strides: [0; 4],
        };
        view.sizes[pad..].copy_from_slice(dims);
        view.strides[pad..].copy_from_slice(strides);
        Ok(view)
    }
}

/// `storage` seen through `layout`, converted to fp8 with `1 / scale`, or from fp8 to `to` with
/// `scale`, into a contiguous result.
pub(crate) fn convert(
    storage: &CudaStorage,
    layout: &Layout,
    scale: f32,
    to: DType,
) -> Result<CudaStorage> {
    let dev = storage.device().clone();
    let view = SourceView::of(layout)?;
    let s = storage;
    match (storage.dtype(), to) {
        (DType::F32, DType::F8E4M3) => quantize::<f32>(&dev, s, &view, scale),
        (DType::F16, DType::F8E4M3) => quantize::<f16>(&dev, s, &view, scale),
        (DType::BF16, DType::F8E4M3) => quantize::<bf16>(&dev, s, &view, scale),
        (DType::F8E4M3, DType::F32) => dequantize::<f32>(&dev, s, &view, scale),
        (DType::F8E4M3, DType::F16) => dequantize::<f16>(&dev, s, &view, scale),
        (DType::F8E4M3, DType::BF16) => dequantize::<bf16>(&dev, s, &view, scale),
        (from, to) => bail!("fp8 conversion: {from:?} to {to:?} is not supported"),
    }
}

fn quantize<T: CudaDType + DeviceRepr + WithDType>(
    dev: &CudaDevice,
    src: &CudaStorage,
    view: &SourceView,
    scale: f32,
) -> Result<CudaStorage> {
    // SAFETY: the kernel writes all `count` elements.
    let out = unsafe { dev.alloc::<F8E4M3>(view.count)? };
    let src = device_ptr(src.as_cuda_slice::<T>()?, dev, view.start);
    run(
        dev,
        KernelForm::QuantizeE4m3,
        T::DTYPE,
        src,
        view,
        &out,
        scale,
    )?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

fn dequantize<T: CudaDType + DeviceRepr + WithDType>(
    dev: &CudaDevice,
    src: &CudaStorage,
    view: &SourceView,
    scale: f32,
) -> Result<CudaStorage> {
    // SAFETY: the kernel writes all `count` elements.
    let out = unsafe { dev.alloc::<T>(view.count)? };
    let src = device_ptr(src.as_cuda_slice::<F8E4M3>()?, dev, view.start);
    run(
        dev,
        KernelForm::DequantizeE4m3,
        T::DTYPE,
        src,
        view,
        &out,
        scale,
    )?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

/// Launches `form` for the non-fp8 side's `dtype`, from `src` seen as `view` into `dst`.
fn run<D>(
    dev: &CudaDevice,
    form: KernelForm,
    dtype: DType,
    src: u64,
    view: &SourceView,
    dst: &CudaSlice<D>,
    scale: f32,
) -> Result<()> {
    if view.count == 0 {
        return Ok(());
    }
    let Some(spec) = form.find(dtype, dtype, 0, 0) else {
        bail!("fp8 conversion: no {form:?} kernel for {dtype:?} in this build")
    };
    let func = spec.load(dev)?;
    let params = Fp8ConvertParams {
        src,
        dst: device_ptr(dst, dev, 0),
        count: view.count as i64,
        size1: view.sizes[1] as i64,
        size2: view.sizes[2] as i64,
        size3: view.sizes[3] as i64,
        stride0: view.strides[0] as i64,
        stride1: view.strides[1] as i64,
        stride2: view.strides[2] as i64,
        stride3: view.strides[3] as i64,
        scale,
    };
    // Enough CTAs to fill the GPU a few times over; each thread strides on from there.
    let ctas = view.count.div_ceil(spec.threads as usize).clamp(1, 8192) as u32;
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
    // SAFETY: the kernel takes one `Fp8ConvertParams`, reads the `count` source elements of the
    // layout's view and writes `count` destination elements into a buffer of that size.
    unsafe { builder.launch(cfg) }.map(|_| ()).w()
}
