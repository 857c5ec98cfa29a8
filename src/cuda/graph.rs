//! Work on candle's stream captured once as a CUDA graph and replayed: one launch for what
//! would otherwise be hundreds.
//!
//! Candle uploads small parameter blocks (shapes and strides of strided ops) from the host,
//! which a capture cannot do. Its host-to-device cache keeps the blocks of a run that had the
//! cache on, so the same work is run once under [`warm_up`] before it is captured.

use candle_core::cuda::WrapErr;
use candle_core::{CudaDevice, Result};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaGraph;

/// A captured, instantiated graph of work on candle's stream.
pub(crate) struct CapturedGraph {
    graph: CudaGraph,
}

// SAFETY: a graph may be launched from any thread, one at a time; the wrapper is not `Sync`,
// and `replay` takes it by reference from its single owner.
unsafe impl Send for CapturedGraph {}

impl CapturedGraph {
    /// Launches the graph on the stream it was captured on.
    pub fn replay(&self) -> Result<()> {
        self.graph.launch().w()
    }
}

/// Runs `work` with candle's host-to-device parameter cache on, so that a capture of the same
/// work afterwards finds every parameter block on the device.
pub(crate) fn warm_up<R>(dev: &CudaDevice, work: impl FnOnce() -> Result<R>) -> Result<R> {
    let _cache = dev.enable_cuda_graph_htod_cache();
    work()
}

/// Captures what `work` launches on `dev`'s stream, without running it, and instantiates the
/// graph. Every device allocation `work` makes must be freed before it returns, so that each
/// replay allocates and frees its own; what is to outlive a replay goes into buffers allocated
/// before the capture. Fails, leaving the stream as it was, where `work` fails or launches
/// something that cannot be captured (a host synchronisation, an uncached upload).
pub(crate) fn capture(
    dev: &CudaDevice,
    work: impl FnOnce() -> Result<()>,
) -> Result<CapturedGraph> {
    let _cache = dev.enable_cuda_graph_htod_cache();
    let stream = dev.cuda_stream();
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .w()?;
    let worked = work();
    // The capture ends whatever happened, or the stream would stay in capture mode.
    let ended = stream.end_capture(CUgraphInstantiate_flags(0));
    worked?;
    let Some(graph) = ended.w()? else {
        candle_core::bail!("cuda graph: the capture recorded nothing")
    };
    graph.upload().w()?;
    Ok(CapturedGraph { graph })
}
