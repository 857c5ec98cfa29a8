//! Hooks for the test suites and benchmarks (feature `test-hooks`, which the crate's
//! dev-dependency on itself turns on for its tests, examples and benches): NaN poisoning of
//! kernel outputs, the fused projections' launch count and ring form, and the split plan the op
//! picks. Not part of the crate's API otherwise.
//!
//! The switches are per thread, so that tests running in parallel keep apart: a kernel launched
//! from a thread sees that thread's settings.

use std::cell::Cell;

use candle_core::{Result, Tensor};

pub use crate::op::plan::SplitPlan;
use crate::op::SplitKvAttention;

thread_local! {
    static POISON_OUTPUTS: Cell<bool> = const { Cell::new(false) };
    static RING_FORM_FOR_ALL: Cell<bool> = const { Cell::new(false) };
    static FUSED_LAUNCHES: Cell<u64> = const { Cell::new(0) };
}

/// Fills the outputs and scratch buffers of every CUDA kernel launched from this thread (the
/// op's output, LSE and split scratch, the fused projections, the q/k/v split, SwiGLU) with NaN
/// before it runs, so that an element a kernel fails to write cannot pass for a result.
pub fn poison_outputs(on: bool) {
    POISON_OUTPUTS.set(on);
}

/// Runs every fused projection from this thread through the shared-memory ring form wherever
/// the device can take it, not only the long weight streams the form is chosen for, so that
/// small shapes test it too.
pub fn ring_form_for_all(on: bool) {
    RING_FORM_FOR_ALL.set(on);
}

/// How many times this thread has launched the fused projection kernel.
pub fn fused_launch_count() -> u64 {
    FUSED_LAUNCHES.get()
}

/// The split plan `op` uses for `q` and `k` on their device: the heuristic's choice, or the
/// forced count clamped to the sequence.
pub fn split_plan(op: &SplitKvAttention, q: &Tensor, k: &Tensor) -> Result<SplitPlan> {
    op.split_plan(q, k)
}

/// Whether this thread's fused projections take the ring form for every shape.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn ring_form_forced() -> bool {
    RING_FORM_FOR_ALL.get()
}

/// Counts one launch of the fused projection kernel from this thread.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn count_fused_launch() {
    FUSED_LAUNCHES.set(FUSED_LAUNCHES.get() + 1);
}

/// Fills `buf` with NaN bytes on its stream when this thread poisons kernel outputs (see
/// [`poison_outputs`]).
#[cfg(feature = "cuda")]
pub(crate) fn poison<T>(
    dev: &candle_core::CudaDevice,
    buf: &cudarc::driver::CudaSlice<T>,
) -> Result<()> {
    use candle_core::cuda::WrapErr;
    use cudarc::driver::DevicePtr;

    if !POISON_OUTPUTS.get() {
        return Ok(());
    }
    let stream = dev.cuda_stream();
    let (ptr, _sync) = buf.device_ptr(&stream);
    let bytes = buf.len() * std::mem::size_of::<T>();
    // SAFETY: writes exactly the bytes of `buf`, on the stream that uses it.
    unsafe { cudarc::driver::result::memset_d8_async(ptr, 0xff, bytes, stream.cu_stream()) }.w()
}
