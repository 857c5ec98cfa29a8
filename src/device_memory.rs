//! How freed CUDA memory is handled by the pool that candle allocates from.
//!
//! Candle allocates device memory stream-ordered, from the device's current memory pool. With the
//! pool's default release threshold of zero, every synchronisation unmaps whatever the process has
//! freed, and the next allocations map fresh pages. Large buffers placed by that churn (a
//! benchmark allocating and freeing inputs point after point) measured up to 15% slower to
//! stream, varying from process to process (docs/perf-log.md, v3j). A model that allocates its KV
//! cache once was not affected.

use candle_core::{Device, Result};

/// Makes the memory pool that `device` allocates from keep the memory tensors free, for reuse by
/// later allocations of the process, instead of returning it to the driver at each
/// synchronisation. A no-op on devices other than CUDA, or without a pool; calling it again
/// changes nothing.
///
/// Worth calling once at start-up in a process that allocates and frees large buffers while it
/// decodes (the crate's benchmark does). The cost is that memory freed by the process stays
/// reserved for it, as with PyTorch's caching allocator, until the process exits.
pub fn retain_freed_device_memory(device: &Device) -> Result<()> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(dev) => crate::cuda::memory::retain_freed_memory(dev),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_device_is_left_alone() {
        assert!(retain_freed_device_memory(&Device::Cpu).is_ok());
    }
}
