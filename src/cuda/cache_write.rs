//! New K/V rows written into a cache at positions held in device memory, K and V in one launch
//! (see `kernels/cache_write.cuh`): what a decode step captured in a CUDA graph appends with.

use candle_core::{bail, DType, Device, Result, Tensor};
use float8::F8E4M3;
use half::{bf16, f16};

use super::kernels::{CacheWriteParams, KernelForm};
use super::launch::{launch_grid_stride, tensor_ptr};

/// A 4-D tensor's strides in elements, checked to have a contiguous last dim.
fn strides(name: &str, t: &Tensor) -> Result<[i64; 3]> {
    let s = t.stride();
    if s.len() != 4 || (s[3] != 1 && t.dims()[3] > 1) {
        bail!(
            "cache write: {name} must be 4-D with a contiguous last dim, got shape {:?} and \
             strides {s:?}",
            t.dims()
        )
    }
    Ok([s[0] as i64, s[1] as i64, s[2] as i64])
}

/// The device address of `t`, of element type `dtype`.
fn address(name: &str, t: &Tensor, dtype: DType) -> Result<u64> {
    let Device::Cuda(dev) = t.device() else {
        bail!("cache write: {name} is not on a CUDA device")
    };
    let ptr = match dtype {
        DType::F32 => tensor_ptr::<f32>(t, dev)?,
        DType::F16 => tensor_ptr::<f16>(t, dev)?,
        DType::BF16 => tensor_ptr::<bf16>(t, dev)?,
        DType::F8E4M3 => tensor_ptr::<F8E4M3>(t, dev)?,
        DType::U32 => tensor_ptr::<u32>(t, dev)?,
        other => bail!("cache write: {name} has dtype {other:?}"),
    };
    ptr.ok_or_else(|| candle_core::Error::Msg(format!("cache write: {name} is not on CUDA")))
}

/// Where each sequence's new rows start in the caches.
#[derive(Debug, Clone, Copy)]
pub(crate) enum RowStarts<'a> {
    /// Read from a contiguous u32 `(b,)` tensor when the kernel runs (a captured step).
    Device(&'a Tensor),
    /// One position for every sequence, known on the host.
    Host(usize),
}

/// Writes `k_new`/`v_new` `(b, t, h, d)` into the caches `(b, h, capacity, d)`, sequence `s` at
/// positions `start_s..start_s + t` (see [`RowStarts`]), none at or past the capacity. The rows
/// are in the caches' dtype, or the caches are fp8 and store `row / scale` (scales `(k, v)`). The
/// caches are written through shared handles: the caller owns them and orders every reader after
/// this on the stream.
pub(crate) fn write_rows(
    (k_cache, v_cache): (&Tensor, &Tensor),
    (k_new, v_new): (&Tensor, &Tensor),
    starts: RowStarts,
    (k_scale, v_scale): (f32, f32),
) -> Result<()> {
    let Device::Cuda(dev) = k_cache.device() else {
        bail!("cache write: the caches are not on a CUDA device")
    };
    let (batch, heads, capacity, head_dim) = k_cache.dims4()?;
    let (b, t, h, d) = k_new.dims4()?;
    if (b, h, d) != (batch, heads, head_dim)
        || v_new.dims() != k_new.dims()
        || v_cache.dims() != k_cache.dims()
    {
        bail!(
            "cache write: rows {:?}/{:?} do not fit caches {:?}/{:?}",
            k_new.dims(),
            v_new.dims(),
            k_cache.dims(),
            v_cache.dims()
        )
    }
    let (starts, start_offset) = match starts {
        RowStarts::Device(starts) => {
            if starts.dtype() != DType::U32 || starts.dims() != [batch] || !starts.is_contiguous() {
                bail!(
                    "cache write: starts must be a contiguous u32 ({batch},), got {:?} {:?}",
                    starts.dtype(),
                    starts.dims()
                )
            }
            (address("starts", starts, DType::U32)?, 0)
        }
        RowStarts::Host(at) => {
            if at > i32::MAX as usize {
                bail!("cache write: position {at} is past the kernel's range")
            }
            (0, at as i32)
        }
    };
    let (dtype, kv_dtype) = (k_new.dtype(), k_cache.dtype());
    if v_new.dtype() != dtype || v_cache.dtype() != kv_dtype {
        bail!("cache write: k and v must share their dtypes")
    }
    if kv_dtype != dtype && kv_dtype != DType::F8E4M3 {
        bail!("cache write: rows {dtype:?} into a {kv_dtype:?} cache; convert them first")
    }
    if t == 0 {
        return Ok(());
    }
    let Some(spec) = KernelForm::CacheWrite.find(dtype, kv_dtype, 0, 0) else {
        bail!("cache write: no kernel for {dtype:?} rows into a {kv_dtype:?} cache in this build")
    };
    let func = spec.load(dev)?;
    let ([ksb, kss, ksh], [vsb, vss, vsh]) = (strides("k", k_new)?, strides("v", v_new)?);
    let ([kdb, kdh, kds], [vdb, vdh, vds]) =
        (strides("k cache", k_cache)?, strides("v cache", v_cache)?);
    let params = CacheWriteParams {
        k_src: address("k", k_new, dtype)?,
        v_src: address("v", v_new, dtype)?,
        k_dst: address("k cache", k_cache, kv_dtype)?,
        v_dst: address("v cache", v_cache, kv_dtype)?,
        starts,
        start_offset,
        batch: b as i32,
        tokens: t as i32,
        heads: h as i32,
        head_dim: d as i32,
        capacity: capacity.min(i32::MAX as usize) as i32,
        k_src_batch_stride: ksb,
        k_src_seq_stride: kss,
        k_src_head_stride: ksh,
        v_src_batch_stride: vsb,
        v_src_seq_stride: vss,
        v_src_head_stride: vsh,
        k_dst_batch_stride: kdb,
        k_dst_head_stride: kdh,
        k_dst_seq_stride: kds,
        v_dst_batch_stride: vdb,
        v_dst_head_stride: vdh,
        v_dst_seq_stride: vds,
        k_scale,
        v_scale,
    };
    let elements = 2 * b * t * h * d;
    // SAFETY: the kernel takes one `CacheWriteParams`; it reads the rows within their checked
    // shapes and strides, `batch` starts, and writes cache positions below the capacity only.
    unsafe { launch_grid_stride(dev, &func, spec.threads, elements, 4096, &params) }
}
