//! Hooks for the test suites and benchmarks (feature `test-hooks`, which the crate's
//! dev-dependency on itself turns on for its tests, examples and benches): NaN poisoning of
//! kernel outputs, the fused projections' launch count, ring form and k-split count (several
//! rows), the fused q/k/v append, the split plan the op picks, the persistent prefill grid's
//! size, and on CUDA the attention kernel a call runs (decode or prefill forms). Not part of
//! the crate's API otherwise.
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
    static PREFILL_ROUTE: Cell<PrefillRoute> = const { Cell::new(PrefillRoute::Auto) };
    static ATTENTION_FORM: Cell<Option<&'static str>> = const { Cell::new(None) };
    static DECODE_KERNEL: Cell<Option<&'static str>> = const { Cell::new(None) };
    static SMEM_PER_CTA_LIMIT: Cell<Option<usize>> = const { Cell::new(None) };
    static PERSISTENT_CTAS: Cell<Option<usize>> = const { Cell::new(None) };
    static ROWS_SPLITS: Cell<Option<usize>> = const { Cell::new(None) };
    static QKV_APPEND_UNFUSED: Cell<bool> = const { Cell::new(false) };
    static QKV_APPEND_LAUNCHES: Cell<u64> = const { Cell::new(0) };
}

/// Which kernels run this thread's attention calls on CUDA.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PrefillRoute {
    /// The op's rule: the decode kernels for a few query tokens unless many query rows per kv
    /// head would make them re-stream the K/V, the best prefill form otherwise.
    #[default]
    Auto,
    /// The mma.sync prefill form (kernels/prefill.cuh) for every call, at any t.
    MmaSync,
    /// The sm_90a prefill form (kernels/prefill_sm90.cuh) for every call; an error where the
    /// build or device lacks it or it does not cover the call.
    Wgmma,
}

/// Sends this thread's attention calls on CUDA down `route` instead of the rule's choice, so
/// that each prefill form is tested at every shape it takes.
pub fn force_prefill_route(route: PrefillRoute) {
    PREFILL_ROUTE.set(route);
}

/// The prefill family this thread's calls are forced onto, if any.
#[cfg(feature = "cuda")]
pub(crate) fn forced_prefill_family() -> Option<crate::cuda::prefill::PrefillFamily> {
    use crate::cuda::prefill::PrefillFamily;
    match PREFILL_ROUTE.get() {
        PrefillRoute::Auto => None,
        PrefillRoute::MmaSync => Some(PrefillFamily::MmaSync),
        PrefillRoute::Wgmma => Some(PrefillFamily::Wgmma),
    }
}

/// The kernel this thread's last attention call on CUDA ran: "decode" for the decode forms, the
/// instance's symbol (such as `prefill_sm90_bf16_d128`) for the prefill forms.
pub fn last_attention_form() -> Option<&'static str> {
    ATTENTION_FORM.get()
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn record_attention_form(form: &'static str) {
    ATTENTION_FORM.set(Some(form));
}

/// The partial-pass instance this thread's last decode call on CUDA ran, such as
/// `tensor_core_bf16_d128_g8` or `cuda_core_bf16_d256_g4`.
pub fn last_decode_kernel() -> Option<&'static str> {
    DECODE_KERNEL.get()
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn record_decode_kernel(symbol: &'static str) {
    DECODE_KERNEL.set(Some(symbol));
}

/// Plans and launches this thread's CUDA calls as if the GPU gave a CTA at most `bytes` of shared
/// memory (`None`: what it gives), so that a build for a target before sm_90, run on an H100,
/// takes the paths of a GPU with 99 KiB (sm_86, sm_89).
pub fn limit_smem_per_cta(bytes: Option<usize>) {
    SMEM_PER_CTA_LIMIT.set(bytes);
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn smem_per_cta_limit() -> Option<usize> {
    SMEM_PER_CTA_LIMIT.get()
}

/// Launches this thread's calls on the persistent (sm_90a) prefill forms with `ctas` CTAs,
/// clamped to the call's work items (`None`: as many as fit on the GPU at once), so that the
/// rounds in which a CTA takes item after item are tested at any count, and a count of at least
/// the items (one item per CTA) can be compared with the persistent grid.
pub fn force_persistent_ctas(ctas: Option<usize>) {
    PERSISTENT_CTAS.set(ctas);
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn forced_persistent_ctas() -> Option<usize> {
    PERSISTENT_CTAS.get()
}

/// Runs this thread's fused projections of 2 to 16 rows with `splits` CTAs along k (a cluster
/// of that many on sm_90 builds; 1 elsewhere) where a CTA can stage its slice, candle's ops where
/// it cannot (`None`: the kernel's own plan), so that benchmarks can compare the plans.
pub fn force_rows_splits(splits: Option<usize>) {
    ROWS_SPLITS.set(splits);
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn forced_rows_splits() -> Option<usize> {
    ROWS_SPLITS.get()
}

/// Runs this thread's decode steps' q/k/v projection, RoPE and cache append as three launches
/// (projection, split, write) instead of one kernel, so that tests can compare the two.
pub fn unfuse_qkv_append(on: bool) {
    QKV_APPEND_UNFUSED.set(on);
}

#[cfg_attr(not(all(feature = "cuda", feature = "models")), allow(dead_code))]
pub(crate) fn qkv_append_unfused() -> bool {
    QKV_APPEND_UNFUSED.get()
}

/// How many times this thread has launched the fused q/k/v kernel (projection, RoPE and the
/// cache append).
pub fn qkv_append_launch_count() -> u64 {
    QKV_APPEND_LAUNCHES.get()
}

#[cfg_attr(not(all(feature = "cuda", feature = "models")), allow(dead_code))]
pub(crate) fn count_qkv_append_launch() {
    QKV_APPEND_LAUNCHES.set(QKV_APPEND_LAUNCHES.get() + 1);
}

/// Runs the fused q/k/v kernel of a decode step as a model's layer does: RMSNorm(`x`) with
/// `norm = (weight, eps)` times `w` (rows `[q | k | v]`), q and k rotated by `angles` (one
/// token's), k and v appended to `cache` at `starts` (u32 `(1,)` on the device). Returns q
/// `(1, 1, q_heads, head_dim)`, or `None` where the kernel does not take the step (the model
/// then runs the unfused chain).
#[cfg(all(feature = "cuda", feature = "models"))]
pub fn qkv_rope_append(
    x: &Tensor,
    w: &Tensor,
    norm: (&Tensor, f32),
    angles: &crate::models::llama::RopeAngles,
    (q_heads, kv_heads, head_dim): (usize, usize, usize),
    cache: &mut crate::KvCache,
    starts: &Tensor,
) -> Result<Option<Tensor>> {
    let (cos, sin, interleaved) = angles.rows();
    let step = crate::nn::fused_linear::qkv_rope_append::QkvRopeAppend {
        x,
        w,
        norm,
        angles: (cos, sin),
        interleaved,
        q_heads,
        kv_heads,
        head_dim,
    };
    if !step.applies(cache) {
        return Ok(None);
    }
    Ok(Some(step.run(cache, starts)?.0))
}

/// The compute capability this build's kernels target (`CUDA_COMPUTE_CAP` at build time); `None`
/// in a build without the `cuda` feature.
#[cfg(feature = "cuda")]
pub fn compiled_compute_cap() -> Option<u32> {
    Some(crate::cuda::launch::compiled_compute_cap())
}

/// The compute capability this build's kernels target: `None`, a build without the `cuda`
/// feature.
#[cfg(not(feature = "cuda"))]
pub fn compiled_compute_cap() -> Option<u32> {
    None
}

/// Fills the outputs and scratch buffers of every CUDA kernel launched from this thread (the
/// op's output, LSE and split scratch, the fused projections, the q/k/v split, SwiGLU) with NaN
/// before it runs, so that an element a kernel fails to write cannot pass for a result.
pub fn poison_outputs(on: bool) {
    POISON_OUTPUTS.set(on);
}

/// Whether this thread poisons kernel outputs and scratch (see [`poison_outputs`]); the CPU
/// path fills its split scratch with NaN instead of zeros then.
pub(crate) fn poisoning() -> bool {
    POISON_OUTPUTS.get()
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
