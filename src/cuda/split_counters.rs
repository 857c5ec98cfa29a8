//! Arrival counters for the in-grid merge of the splits (`kMergeByLastCta` in
//! kernels/last_split_merge.cuh): one per (batch, kv head), counting the split CTAs that have
//! written their partials so that the last one can merge them.
//!
//! The kernel resets every counter it uses before its grid completes, so the buffer stays zero
//! between launches and is allocated and zeroed once per device, then kept (16 KiB, and with it a
//! reference to the device's stream) for the life of the process: a captured graph may hold its
//! address.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use candle_core::cuda::WrapErr;
use candle_core::cuda_backend::DeviceId;
use candle_core::{CudaDevice, Result};
use cudarc::driver::{sys, CudaSlice};

use super::launch::device_ptr;

/// Counters per device: enough for every split plan the heuristic makes (it splits only while
/// `batch * kv_heads` is below the SM count); larger forced plans use the combine pass.
pub(crate) const SPLIT_COUNTERS: usize = 4096;

static COUNTERS: OnceLock<Mutex<HashMap<DeviceId, CudaSlice<u32>>>> = OnceLock::new();

/// The device address of `dev`'s zeroed counters, allocating them on first use. `None` when they
/// do not exist yet and the stream is being captured: allocating inside a capture would make the
/// buffer part of the graph, so that call falls back to the combine pass.
pub(crate) fn split_counters(dev: &CudaDevice) -> Result<Option<u64>> {
    let cache = COUNTERS.get_or_init(Default::default);
    let mut cache = cache
        .lock()
        .map_err(|_| candle_core::Error::Msg("split-kv: the counter cache is poisoned".into()))?;
    if let Some(counters) = cache.get(&dev.id()) {
        return Ok(Some(device_ptr(counters, dev, 0)));
    }
    let stream = dev.cuda_stream();
    let capturing =
        stream.capture_status().w()? != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    if capturing {
        return Ok(None);
    }
    let counters = dev.alloc_zeros::<u32>(SPLIT_COUNTERS)?;
    let ptr = device_ptr(&counters, dev, 0);
    cache.insert(dev.id(), counters);
    Ok(Some(ptr))
}
