//! fp8 (e4m3) storage for K/V: [`quantize_e4m3`] writes real values as stored ones (divided by a
//! per-tensor scale, rounded to nearest, saturated at ±[`E4M3_MAX`]), [`dequantize_e4m3`] reads
//! them back (times the scale). The same rounding on every device, so a cache filled on the GPU
//! holds the bytes the CPU would write.
//!
//! Candle 0.11's CUDA casts to and from `F8E4M3` look up kernels under names its kernel library
//! does not define, so they fail; these ops run on both devices, with one rounding rule.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, DType, InplaceOp2, Layout, Result, Shape, Tensor};
use float8::F8E4M3;
use half::{bf16, f16};

/// The largest finite e4m3 value: stored values saturate here.
pub const E4M3_MAX: f32 = 448.0;

/// `x / scale` in fp8 (e4m3), rounded to nearest even and saturated at ±448, so that no finite
/// value turns into NaN (NaN stays NaN). `x` is f32, f16 or bf16, any view (on CUDA of up to
/// four dims); `scale` finite and positive. The result is contiguous.
pub fn quantize_e4m3(x: &Tensor, scale: f32) -> Result<Tensor> {
    check_scale(scale)?;
    if !matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16) {
        bail!(
            "quantize_e4m3: x must be f32, f16 or bf16, got {:?}",
            x.dtype()
        )
    }
    on_device(x)?.apply_op1_no_bwd(&Convert {
        scale,
        to: DType::F8E4M3,
    })
}

/// The real values of fp8 (e4m3) `x` (any view; on CUDA of up to four dims): stored × `scale`,
/// as `dtype` (f32, f16 or bf16), contiguous.
pub fn dequantize_e4m3(x: &Tensor, scale: f32, dtype: DType) -> Result<Tensor> {
    check_scale(scale)?;
    if x.dtype() != DType::F8E4M3 {
        bail!("dequantize_e4m3: x must be f8e4m3, got {:?}", x.dtype())
    }
    if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
        bail!("dequantize_e4m3: the result must be f32, f16 or bf16, got {dtype:?}")
    }
    on_device(x)?.apply_op1_no_bwd(&Convert { scale, to: dtype })
}

/// Writes `x / scale` in fp8 (e4m3), rounded and saturated as [`quantize_e4m3`] does, into `dst`
/// in place: an fp8 view of `x`'s shape (say a cache's slot for new rows), whose storage it
/// shares. One pass, where quantizing and then copying into the slot would take two.
pub fn quantize_e4m3_into(dst: &Tensor, x: &Tensor, scale: f32) -> Result<()> {
    check_scale(scale)?;
    if dst.dtype() != DType::F8E4M3 {
        bail!(
            "quantize_e4m3_into: dst must be f8e4m3, got {:?}",
            dst.dtype()
        )
    }
    if !matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16) {
        bail!(
            "quantize_e4m3_into: x must be f32, f16 or bf16, got {:?}",
            x.dtype()
        )
    }
    if dst.dims() != x.dims() {
        bail!(
            "quantize_e4m3_into: dst {:?} and x {:?} must have one shape",
            dst.dims(),
            x.dims()
        )
    }
    if !dst.device().same_device(x.device()) {
        bail!("quantize_e4m3_into: dst and x must be on one device")
    }
    dst.inplace_op2(x, &QuantizeInto { scale })
}

fn check_scale(scale: f32) -> Result<()> {
    if !(scale.is_finite() && scale > 0.0) {
        bail!("fp8 scale must be finite and positive, got {scale}")
    }
    Ok(())
}

/// The storage offsets of `layout`'s elements, in row-major order.
fn offsets(layout: &Layout) -> Vec<usize> {
    let (dims, strides) = (layout.dims(), layout.stride());
    let count = layout.shape().elem_count();
    let mut out = Vec::with_capacity(count);
    let mut index = vec![0; dims.len()];
    let mut at = layout.start_offset();
    for _ in 0..count {
        out.push(at);
        for d in (0..dims.len()).rev() {
            index[d] += 1;
            at += strides[d];
            if index[d] < dims[d] {
                break;
            }
            at -= strides[d] * dims[d];
            index[d] = 0;
        }
    }
    out
}

/// [`quantize_e4m3_into`]'s in-place write.
struct QuantizeInto {
    scale: f32,
}

fn quantize_at<T: Copy>(
    dst: &mut [F8E4M3],
    dst_layout: &Layout,
    src: &[T],
    src_layout: &Layout,
    scale: f32,
    to_f32: fn(T) -> f32,
) {
    for (d, s) in offsets(dst_layout).into_iter().zip(offsets(src_layout)) {
        dst[d] = F8E4M3::from_f32(to_f32(src[s]) / scale);
    }
}

impl InplaceOp2 for QuantizeInto {
    fn name(&self) -> &'static str {
        "fp8-e4m3-quantize-into"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<()> {
        let CpuStorage::F8E4M3(dst) = s1 else {
            bail!("quantize_e4m3_into: dst must be f8e4m3")
        };
        let s = self.scale;
        match s2 {
            CpuStorage::F32(x) => quantize_at(dst, l1, x, l2, s, |x| x),
            CpuStorage::F16(x) => quantize_at(dst, l1, x, l2, s, f16::to_f32),
            CpuStorage::BF16(x) => quantize_at(dst, l1, x, l2, s, bf16::to_f32),
            other => bail!(
                "quantize_e4m3_into: x must be f32, f16 or bf16, got {:?}",
                other.dtype()
            ),
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &mut candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<()> {
        crate::cuda::fp8_convert::quantize_into(s1, l1, s2, l2, self.scale)
    }
}

/// One conversion: to fp8 from the input's dtype, or from fp8 to `to`.
struct Convert {
    scale: f32,
    to: DType,
}

/// The elements of `src` seen through `layout`, which [`on_device`] made contiguous on the CPU.
fn elements<'a, T>(src: &'a [T], layout: &Layout) -> Result<&'a [T]> {
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(&src[start..end]),
        None => bail!("fp8 conversion: the CPU input must be contiguous"),
    }
}

fn quantize<T: Copy>(
    src: &[T],
    layout: &Layout,
    scale: f32,
    to_f32: fn(T) -> f32,
) -> Result<Vec<F8E4M3>> {
    // F8E4M3::from_f32 rounds to nearest even and saturates finite values at ±448.
    Ok(elements(src, layout)?
        .iter()
        .map(|&x| F8E4M3::from_f32(to_f32(x) / scale))
        .collect())
}

fn dequantize<T>(
    src: &[F8E4M3],
    layout: &Layout,
    scale: f32,
    from_f32: fn(f32) -> T,
) -> Result<Vec<T>> {
    Ok(elements(src, layout)?
        .iter()
        .map(|x| from_f32(x.to_f32() * scale))
        .collect())
}

/// `x` as the conversion reads it: any view on CUDA, whose kernels take strides; contiguous on
/// the CPU, where candle's copy handles every dtype.
fn on_device(x: &Tensor) -> Result<Tensor> {
    if x.device().is_cpu() {
        x.contiguous()
    } else {
        Ok(x.clone())
    }
}

impl CustomOp1 for Convert {
    fn name(&self) -> &'static str {
        "fp8-e4m3-convert"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let (s, l) = (self.scale, layout);
        let out = match (storage, self.to) {
            (CpuStorage::F32(x), DType::F8E4M3) => CpuStorage::F8E4M3(quantize(x, l, s, |x| x)?),
            (CpuStorage::F16(x), DType::F8E4M3) => {
                CpuStorage::F8E4M3(quantize(x, l, s, f16::to_f32)?)
            }
            (CpuStorage::BF16(x), DType::F8E4M3) => {
                CpuStorage::F8E4M3(quantize(x, l, s, bf16::to_f32)?)
            }
            (CpuStorage::F8E4M3(x), DType::F32) => CpuStorage::F32(dequantize(x, l, s, |x| x)?),
            (CpuStorage::F8E4M3(x), DType::F16) => {
                CpuStorage::F16(dequantize(x, l, s, f16::from_f32)?)
            }
            (CpuStorage::F8E4M3(x), DType::BF16) => {
                CpuStorage::BF16(dequantize(x, l, s, bf16::from_f32)?)
            }
            (x, to) => bail!("fp8 conversion: {:?} to {to:?} is not supported", x.dtype()),
        };
        Ok((out, layout.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &candle_core::CudaStorage,
        layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = crate::cuda::fp8_convert::convert(storage, layout, self.scale, self.to)?;
        Ok((out, layout.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn saturates_and_keeps_nan() -> Result<()> {
        let x = Tensor::new(
            &[1000f32, -1000.0, 448.0, 0.5, f32::NAN, 1e-9],
            &Device::Cpu,
        )?;
        let back = dequantize_e4m3(&quantize_e4m3(&x, 2.0)?, 2.0, DType::F32)?.to_vec1::<f32>()?;
        assert_eq!(&back[..4], &[896.0, -896.0, 448.0, 0.5]);
        assert!(back[4].is_nan());
        assert_eq!(back[5], 0.0);
        Ok(())
    }

    #[test]
    fn round_trips_within_half_a_step() -> Result<()> {
        let x = (Tensor::randn(0f32, 1.0, 4096, &Device::Cpu)? * 3.0)?;
        let scale = 0.05;
        let back = dequantize_e4m3(&quantize_e4m3(&x, scale)?, scale, DType::F32)?;
        for (a, b) in x.to_vec1::<f32>()?.iter().zip(back.to_vec1::<f32>()?) {
            // 3 mantissa bits: within 2^-4 relative for normals, half a subnormal step below.
            let bound = (a.abs() / 16.0).max(scale / 1024.0) * 1.0001;
            assert!((a - b).abs() <= bound, "{a} came back as {b}");
        }
        Ok(())
    }

    #[test]
    fn bad_inputs_are_errors() -> Result<()> {
        let x = Tensor::zeros(4, DType::F32, &Device::Cpu)?;
        assert!(quantize_e4m3(&x, 0.0).is_err());
        assert!(quantize_e4m3(&x, f32::NAN).is_err());
        assert!(quantize_e4m3(&x.to_dtype(DType::U32)?, 1.0).is_err());
        assert!(dequantize_e4m3(&x, 1.0, DType::F32).is_err());
        let q = quantize_e4m3(&x, 1.0)?;
        assert!(dequantize_e4m3(&q, 1.0, DType::U8).is_err());
        Ok(())
    }

    #[test]
    fn quantize_into_writes_only_its_view() -> Result<()> {
        let cache = quantize_e4m3(
            &Tensor::zeros((2, 3, 10, 4), DType::F32, &Device::Cpu)?,
            1.0,
        )?;
        let rows = Tensor::randn(0f32, 1.0, (2, 2, 3, 4), &Device::Cpu)?;
        quantize_e4m3_into(&cache.narrow(2, 5, 2)?, &rows.transpose(1, 2)?, 0.5)?;
        let back = dequantize_e4m3(&cache, 0.5, DType::F32)?;
        let want = dequantize_e4m3(
            &quantize_e4m3(&rows.transpose(1, 2)?, 0.5)?,
            0.5,
            DType::F32,
        )?;
        let diff = (back.narrow(2, 5, 2)? - want)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?;
        assert_eq!(diff, 0.0);
        let rest = (back.narrow(2, 0, 5)?.abs()?.sum_all()?.to_scalar::<f32>()?)
            + back.narrow(2, 7, 3)?.abs()?.sum_all()?.to_scalar::<f32>()?;
        assert_eq!(rest, 0.0);
        assert!(quantize_e4m3_into(&cache.narrow(2, 0, 3)?, &rows, 1.0).is_err());
        Ok(())
    }
}
