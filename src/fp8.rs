//! fp8 (e4m3) storage for K/V: [`quantize_e4m3`] writes real values as stored ones (divided by a
//! per-tensor scale, rounded to nearest, saturated at ±[`E4M3_MAX`]), [`dequantize_e4m3`] reads
//! them back (times the scale). The same rounding on every device, so a cache filled on the GPU
//! holds the bytes the CPU would write.
//!
//! Candle 0.11's CUDA casts to and from `F8E4M3` look up kernels under names its kernel library
//! does not define, so they fail; these ops run on both devices, with one rounding rule.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};
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

fn check_scale(scale: f32) -> Result<()> {
    if !(scale.is_finite() && scale > 0.0) {
        bail!("fp8 scale must be finite and positive, got {scale}")
    }
    Ok(())
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
}
