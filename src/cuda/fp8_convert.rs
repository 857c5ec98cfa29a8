//! fp8 (e4m3) conversions on CUDA for [`crate::fp8`]: one grid-stride kernel each way, between
//! strided views of one shape of up to four dims.

use candle_core::backend::BackendStorage;
use candle_core::cuda::CudaDType;
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result, WithDType};
use cudarc::driver::{CudaSlice, DeviceRepr};
use float8::F8E4M3;
use half::{bf16, f16};

use super::kernels::{Fp8ConvertParams, KernelForm};
use super::launch::{device_ptr, launch_grid_stride};

/// A view as the kernel reads or writes it: up to four dims, padded at the front.
struct View {
    start: usize,
    sizes: [usize; 4],
    strides: [usize; 4],
}

impl View {
    fn of(layout: &Layout) -> Result<Self> {
        let (dims, strides) = (layout.dims(), layout.stride());
        if dims.len() > 4 {
            bail!("fp8 conversion on CUDA: at most 4 dims, got shape {dims:?}; reshape first")
        }
        let pad = 4 - dims.len();
        let mut view = Self {
            start: layout.start_offset(),
            sizes: [1; 4],
            strides: [0; 4],
        };
        view.sizes[pad..].copy_from_slice(dims);
        view.strides[pad..].copy_from_slice(strides);
        Ok(view)
    }

    /// A contiguous buffer of this view's shape.
    fn contiguous_like(&self) -> Self {
        let mut strides = [1; 4];
        for d in (0..3).rev() {
            strides[d] = strides[d + 1] * self.sizes[d + 1];
        }
        Self {
            start: 0,
            sizes: self.sizes,
            strides,
        }
    }

    fn count(&self) -> usize {
        self.sizes.iter().product()
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
    let src = View::of(layout)?;
    let dst = src.contiguous_like();
    let count = src.count();
    macro_rules! run_into {
        ($form:expr, $src_ty:ty, $dst_ty:ty, $kernel_dtype:expr) => {{
            // SAFETY: the kernel writes all `count` elements.
            let out = unsafe { dev.alloc::<$dst_ty>(count)? };
            let src_ptr = device_ptr(storage.as_cuda_slice::<$src_ty>()?, &dev, src.start);
            run(
                &dev,
                $form,
                $kernel_dtype,
                (src_ptr, &src),
                (&out, &dst),
                scale,
            )?;
            Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
        }};
    }
    use KernelForm::{DequantizeE4m3 as Dequantize, QuantizeE4m3 as Quantize};
    match (storage.dtype(), to) {
        (DType::F32, DType::F8E4M3) => run_into!(Quantize, f32, F8E4M3, DType::F32),
        (DType::F16, DType::F8E4M3) => run_into!(Quantize, f16, F8E4M3, DType::F16),
        (DType::BF16, DType::F8E4M3) => run_into!(Quantize, bf16, F8E4M3, DType::BF16),
        (DType::F8E4M3, DType::F32) => run_into!(Dequantize, F8E4M3, f32, DType::F32),
        (DType::F8E4M3, DType::F16) => run_into!(Dequantize, F8E4M3, f16, DType::F16),
        (DType::F8E4M3, DType::BF16) => run_into!(Dequantize, F8E4M3, bf16, DType::BF16),
        (from, to) => bail!("fp8 conversion: {from:?} to {to:?} is not supported"),
    }
}

/// Writes `src` (f32, f16 or bf16, seen through `src_layout`) divided by `scale` into the fp8
/// view `dst_layout` of `dst`, which has the same shape.
pub(crate) fn quantize_into(
    dst: &mut CudaStorage,
    dst_layout: &Layout,
    src: &CudaStorage,
    src_layout: &Layout,
    scale: f32,
) -> Result<()> {
    let dev = src.device().clone();
    let (src_view, dst_view) = (View::of(src_layout)?, View::of(dst_layout)?);
    let out = dst.as_cuda_slice_mut::<F8E4M3>()?;
    let src_ptr = match src.dtype() {
        DType::F32 => device_ptr(src.as_cuda_slice::<f32>()?, &dev, src_view.start),
        DType::F16 => device_ptr(src.as_cuda_slice::<f16>()?, &dev, src_view.start),
        DType::BF16 => device_ptr(src.as_cuda_slice::<bf16>()?, &dev, src_view.start),
        other => bail!("fp8 conversion: {other:?} to F8E4M3 is not supported"),
    };
    run(
        &dev,
        KernelForm::QuantizeE4m3,
        src.dtype(),
        (src_ptr, &src_view),
        (&*out, &dst_view),
        scale,
    )
}

/// Launches `form` for the non-fp8 side's `dtype`, from `src` into `dst`: views of one shape.
fn run<D: WithDType + CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    form: KernelForm,
    dtype: DType,
    (src, src_view): (u64, &View),
    (dst, dst_view): (&CudaSlice<D>, &View),
    scale: f32,
) -> Result<()> {
    let count = src_view.count();
    if count == 0 {
        return Ok(());
    }
    let Some(spec) = form.find(dtype, dtype, 0, 0) else {
        bail!("fp8 conversion: no {form:?} kernel for {dtype:?} in this build")
    };
    let func = spec.load(dev)?;
    let (s, d) = (&src_view.strides, &dst_view.strides);
    let params = Fp8ConvertParams {
        src,
        dst: device_ptr(dst, dev, dst_view.start),
        count: count as i64,
        size1: src_view.sizes[1] as i64,
        size2: src_view.sizes[2] as i64,
        size3: src_view.sizes[3] as i64,
        src_stride0: s[0] as i64,
        src_stride1: s[1] as i64,
        src_stride2: s[2] as i64,
        src_stride3: s[3] as i64,
        dst_stride0: d[0] as i64,
        dst_stride1: d[1] as i64,
        dst_stride2: d[2] as i64,
        dst_stride3: d[3] as i64,
        scale,
    };
    // SAFETY: the kernel takes one `Fp8ConvertParams` and reads and writes the `count` elements
    // of the two views, whose layouts the caller's storages hold.
    unsafe { launch_grid_stride(dev, &func, spec.threads, count, 8192, &params) }
}
