//! Timing helpers shared by the benchmarks.

#![allow(dead_code)]

/// The median of non-empty samples.
pub fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(|a, b| a.total_cmp(b));
    xs[xs.len() / 2]
}

/// Median GPU µs per call of `call(i)` over the rotated sets: graph-captured where the
/// driver allows it, otherwise back-to-back launches.
#[cfg(feature = "cuda")]
pub fn gpu_time(
    dev: &candle_core::CudaDevice,
    sets: usize,
    reps: usize,
    call: &dyn Fn(usize) -> anyhow::Result<()>,
) -> anyhow::Result<(f64, &'static str)> {
    use cudarc::driver::sys;
    let stream = dev.cuda_stream();
    for i in 0..sets {
        call(i)?;
    }
    stream.synchronize()?;
    let graph = (|| -> anyhow::Result<Option<cudarc::driver::CudaGraph>> {
        stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)?;
        let captured: anyhow::Result<()> = (0..sets).try_for_each(call);
        let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0))?;
        captured?;
        Ok(graph)
    })()
    .ok()
    .flatten();
    let ctx = stream.context();
    let timing = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
    let mut samples = Vec::with_capacity(reps);
    // Back-to-back runs repeat the sweep so that each sample spans enough work.
    let eager_sweeps = 4;
    for _ in 0..reps + 1 {
        let start = ctx.new_event(timing)?;
        let end = ctx.new_event(timing)?;
        start.record(&stream)?;
        let calls = match &graph {
            Some(g) => {
                g.launch()?;
                sets
            }
            None => {
                for _ in 0..eager_sweeps {
                    (0..sets).try_for_each(call)?;
                }
                sets * eager_sweeps
            }
        };
        end.record(&stream)?;
        end.synchronize()?;
        samples.push(start.elapsed_ms(&end)? as f64 * 1e3 / calls as f64);
    }
    samples.remove(0); // the first replay uploads the graph
    Ok((
        median(samples),
        if graph.is_some() { "graph" } else { "eager" },
    ))
}
