//! The op captured into a CUDA graph. A capture fails when another thread of the process does
//! something that synchronises the context implicitly (a device's setup or teardown frees memory
//! that way), and the test needs a device no one has used yet, so it runs in a process of its own.
//!
//! Built with the `cuda` feature; skips with a notice where no CUDA device exists.

#[cfg(feature = "cuda")]
use candle_core::{DType, Device, Result};

#[cfg(feature = "cuda")]
use crate::common::own_process::in_own_process;
#[cfg(feature = "cuda")]
use crate::common::{self, assert_close, gpu, poisoned, reference, Case};

/// The op captured into a CUDA graph as the first calls on a fresh device (kernel setup, scratch
/// allocation and the merge launches all inside the capture): a cluster merge (7 splits), and 20
/// splits, which merge in the combine pass because the split counters cannot be allocated inside
/// a capture. After an eager call has allocated them, a second capture merges by the last CTA.
/// Every replayed graph must give the right answer.
#[cfg(feature = "cuda")]
#[test]
fn gpu_first_call_in_graph_capture() -> Result<()> {
    use candle_core::cuda::WrapErr;
    use cudarc::driver::sys;
    if !in_own_process(module_path!(), "gpu_first_call_in_graph_capture") {
        return Ok(());
    }
    let Some(dev) = gpu() else { return Ok(()) };
    let Device::Cuda(cuda) = &dev else {
        unreachable!("gpu() returns a CUDA device")
    };
    // SAFETY: this device is used by this test only, on one stream.
    unsafe { cuda.disable_event_tracking() };
    let case = Case {
        b: 2,
        h_q: 8,
        h_kv: 2,
        d: 128,
        l: 5000,
        dtype: DType::BF16,
    };
    let (q, k, v) = common::random_qkv(&case, &dev)?;
    let want = reference(&q, &k, &v, case.scale(), None)?;
    let stream = cuda.cuda_stream();
    let run = |splits: usize| {
        poisoned(case.scale())
            .with_num_splits(Some(splits))
            .forward(&q, &k, &v)
    };
    let captured = |splits: usize, what: &str| -> Result<()> {
        stream.synchronize().w()?;
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .w()?;
        let out = run(splits);
        let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0)).w()?;
        let out = out?;
        let Some(graph) = graph else {
            panic!("the capture recorded no work ({what})")
        };
        // The graph owns the output's allocation, so it launches once.
        graph.launch().w()?;
        stream.synchronize().w()?;
        assert_close(what, &out, &want.out, case.dtype)
    };
    captured(7, "first call in capture, cluster merge")?;
    captured(20, "first call in capture, 20 splits")?;
    assert_close("eager, 20 splits", &run(20)?, &want.out, case.dtype)?;
    captured(20, "capture after an eager call, 20 splits")
}
