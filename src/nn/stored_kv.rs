//! How a [`KvCache`](super::cache::KvCache) stores real keys or values: in its dtype, divided by
//! a per-tensor scale, and for fp8 (e4m3) saturated to the finite range.
//!
//! The real value is the stored one times the scale. e4m3 has no infinities, so fp8 writes go
//! through [`crate::quantize_e4m3`], which saturates at ±[`crate::E4M3_MAX`] on every device.

use candle_core::{bail, DType, Result, Tensor};

/// The dtypes a KV cache may store keys and values in.
pub const CACHE_DTYPES: [DType; 4] = [DType::F32, DType::F16, DType::BF16, DType::F8E4M3];

/// The dtypes new keys and values may come in: the real values, before scaling.
const INPUT_DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

pub(crate) fn check_cache_dtype(dtype: DType) -> Result<()> {
    if !CACHE_DTYPES.contains(&dtype) {
        bail!(
            "kv cache: dtype {dtype:?} is not supported; use one of {}",
            dtype_list(&CACHE_DTYPES)
        )
    }
    Ok(())
}

/// Checks the dtype of new keys or values (`name`) given to the cache's `op`.
pub(crate) fn check_input_dtype(op: &str, name: &str, dtype: DType) -> Result<()> {
    if !INPUT_DTYPES.contains(&dtype) {
        bail!(
            "kv cache {op}: {name} has dtype {dtype:?}; new keys and values are the real values, \
             in one of {} (the cache converts them to its own dtype)",
            dtype_list(&INPUT_DTYPES)
        )
    }
    Ok(())
}

pub(crate) fn check_scale(name: &str, scale: f32) -> Result<()> {
    if !(scale.is_finite() && scale > 0.0) {
        bail!("kv cache: {name} must be finite and positive, got {scale}")
    }
    Ok(())
}

fn dtype_list(dtypes: &[DType]) -> String {
    dtypes
        .iter()
        .map(|d| d.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The conversion of real values into one stored tensor (keys or values) of a cache.
#[derive(Debug, Clone)]
pub(crate) struct StoredForm {
    dtype: DType,
    scale: f32,
}

impl StoredForm {
    /// Checks `dtype` and `scale` (named `scale_name` in errors).
    pub fn new(dtype: DType, scale: f32, scale_name: &str) -> Result<Self> {
        check_cache_dtype(dtype)?;
        check_scale(scale_name, scale)?;
        Ok(Self { dtype, scale })
    }

    pub fn scale(&self) -> f32 {
        self.scale
    }

    /// Writes the real rows `x` `(b, t, h, d)` into `buffer` `(b, h, capacity, d)` (contiguous)
    /// at positions `at..at + t`: for fp8 straight into the slot in one pass, otherwise stored
    /// and copied in.
    pub fn write(&self, buffer: &Tensor, at: usize, x: &Tensor) -> Result<()> {
        let rows = x.transpose(1, 2)?;
        if self.dtype == DType::F8E4M3 {
            let slot = buffer.narrow(2, at, rows.dim(2)?)?;
            return crate::fp8::quantize_e4m3_into(&slot, &rows, self.scale);
        }
        buffer.slice_set(&self.store(&rows)?.contiguous()?, 2, at)
    }

    /// Rows `x` as the cache-write kernel takes them: as they are for fp8, which the kernel
    /// quantizes with the scale; otherwise already stored (scaled and cast), to be copied.
    #[cfg(feature = "cuda")]
    pub fn kernel_rows(&self, x: &Tensor) -> Result<Tensor> {
        if self.dtype == DType::F8E4M3 {
            return Ok(x.clone());
        }
        self.store(x)
    }

    /// `x / scale` in the stored dtype, saturated for fp8. With scale 1 this is the plain cast
    /// (nothing at all when `x` is in the stored dtype).
    pub fn store(&self, x: &Tensor) -> Result<Tensor> {
        if self.dtype == DType::F8E4M3 {
            return crate::fp8::quantize_e4m3(x, self.scale);
        }
        if self.scale == 1.0 {
            return x.to_dtype(self.dtype);
        }
        // In f32: scaling a 16-bit input in its own dtype would round the scale to 8 or 11 bits.
        x.to_dtype(DType::F32)?
            .affine(1.0 / f64::from(self.scale), 0.0)?
            .to_dtype(self.dtype)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn stored_f32(form: &StoredForm, values: &[f32]) -> Result<Vec<f32>> {
        let x = Tensor::new(values, &Device::Cpu)?;
        form.store(&x)?.to_dtype(DType::F32)?.to_vec1::<f32>()
    }

    #[test]
    fn fp8_saturates_and_infinities_become_the_bound() -> Result<()> {
        let form = StoredForm::new(DType::F8E4M3, 1.0, "k_scale")?;
        let got = stored_f32(
            &form,
            &[1e6, -1e6, f32::INFINITY, f32::NEG_INFINITY, 449.0, 1.0],
        )?;
        assert_eq!(got, [448.0, -448.0, 448.0, -448.0, 448.0, 1.0]);
        Ok(())
    }

    #[test]
    fn unit_scale_in_the_stored_dtype_is_untouched() -> Result<()> {
        let form = StoredForm::new(DType::F32, 1.0, "k_scale")?;
        let x = Tensor::new(&[1.5f32, -2.25], &Device::Cpu)?;
        let stored = form.store(&x)?;
        // The same tensor: no copy, no op.
        assert_eq!(stored.id(), x.id());
        Ok(())
    }

    #[test]
    fn rejects_bad_dtypes_and_scales() {
        let err = StoredForm::new(DType::U8, 1.0, "k_scale").unwrap_err();
        assert!(err.to_string().contains("f32, f16, bf16, f8e4m3"), "{err}");
        for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
            let err = StoredForm::new(DType::F8E4M3, bad, "v_scale").unwrap_err();
            assert!(err.to_string().contains("v_scale must be finite"), "{err}");
        }
    }
}
