//! Device memory: the pool policy for long-running processes, and small stream-ordered writes.

use candle_core::{CudaDevice, Result};
use cudarc::driver::{result, sys};

/// Makes the pool `dev` allocates from keep freed memory for reuse (see
/// [`crate::retain_freed_device_memory`]).
pub(crate) fn retain_freed_memory(dev: &CudaDevice) -> Result<()> {
    let context = dev.cuda_stream().context().clone();
    if !context.has_async_alloc() {
        // No pool: allocations go straight to the driver and nothing is churned.
        return Ok(());
    }
    context.bind_to_thread().map_err(candle_core::Error::wrap)?;
    let mut keep_all = u64::MAX;
    // SAFETY: the device handle comes from a live context, the pool is that device's current
    // one, and the release-threshold attribute takes a u64.
    unsafe {
        let pool =
            result::device::get_mem_pool(context.cu_device()).map_err(candle_core::Error::wrap)?;
        result::mem_pool::set_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut keep_all as *mut u64).cast(),
        )
        .map_err(candle_core::Error::wrap)?;
    }
    Ok(())
}

/// Writes `values` into the first elements of the u32 tensor `t` on its stream, one async
/// memset per value: stream-ordered like a kernel, with no host buffer to stage (a copy from
/// pageable host memory would first wait for the stream).
#[cfg(feature = "models")]
pub(crate) fn set_u32s(t: &candle_core::Tensor, values: &[u32]) -> Result<()> {
    use candle_core::cuda::WrapErr;
    let candle_core::Device::Cuda(dev) = t.device() else {
        candle_core::bail!("set_u32s: the tensor is not on a CUDA device")
    };
    if t.dtype() != candle_core::DType::U32 || !t.is_contiguous() || t.elem_count() < values.len() {
        candle_core::bail!(
            "set_u32s: needs a contiguous u32 tensor of at least {} elements, got {:?} {:?}",
            values.len(),
            t.dtype(),
            t.dims()
        )
    }
    let Some(base) = super::launch::tensor_ptr::<u32>(t, dev)? else {
        candle_core::bail!("set_u32s: the tensor is not on a CUDA device")
    };
    let stream = dev.cuda_stream();
    for (i, &value) in values.iter().enumerate() {
        // SAFETY: element i lies inside the tensor's storage (checked above), which it holds.
        unsafe {
            sys::cuMemsetD32Async(base + 4 * i as u64, value, 1, stream.cu_stream()).result()
        }
        .w()?;
    }
    Ok(())
}
