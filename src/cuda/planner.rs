//! How a decode call runs on the device at hand: the kernel form, the split plan, and how the
//! splits merge (in a thread-block cluster, in the last CTA of each group, or in the combine
//! pass). Every choice here was measured; docs/perf-log.md holds the numbers.

use candle_core::{bail, CudaDevice, DType, Result};
use cudarc::driver::{CudaFunction, LaunchConfig};

use super::decode_kernel::DecodeKernel;
use super::kernels::{KernelForm, SplitMerge, MAX_CLUSTER};
use super::launch::{
    compiled_compute_cap, max_smem_per_cta, one_cta_per_sm_smem, resident_clusters, ClusterDims,
};
use super::lockstep::{fills_every_slot, lockstep_cluster, lockstep_plan};
use super::split_counters::{split_counters, SPLIT_COUNTERS};
use super::wide_groups::QueryBlocks;
use crate::op::call::{CudaKernel, DecodeCall};
use crate::op::plan::{self, SplitPlan, MIN_CHUNK};
use crate::op::validate::DecodeDims;

/// Shortest chunk the CUDA plan cuts: below 2048 positions, 256-position chunks leave fewer than
/// eight splits and each warp streams its tiles one latency after another, so 128 is allowed
/// there; from 4096 on, 128-position chunks measured slower (more splits to merge).
fn gpu_min_chunk(kv_len: usize) -> usize {
    if kv_len < 8 * MIN_CHUNK {
        128
    } else {
        MIN_CHUNK
    }
}

/// Whether the tensor-core forms' ring for `dims` fits the shared memory `dev` gives a CTA. A
/// build for a target before sm_90 sizes every form for 99 KiB but one: 16-bit K/V at head dim
/// 256, whose ring needs the 192 KiB of an sm_90 GPU running that build; elsewhere those calls
/// run on CUDA cores.
fn tensor_cores_fit(dev: &CudaDevice, dtype: DType, dims: &DecodeDims) -> Result<bool> {
    match KernelForm::TensorCore.find(dtype, dtype, dims.head_dim, dims.group_size()) {
        Some(spec) => Ok(spec.smem_bytes <= max_smem_per_cta(dev)?),
        None => Ok(true),
    }
}

/// The kernel family that runs for `choice`, `dtype` queries and K/V stored as `kv_dtype`.
fn resolve_family(choice: CudaKernel, dtype: DType, kv_dtype: DType) -> Result<KernelForm> {
    if kv_dtype == DType::F8E4M3 {
        // Only the tensor-core kernels widen fp8 rows, and only in hardware from sm_89 on.
        if !matches!(dtype, DType::F16 | DType::BF16) {
            bail!(
                "split-kv attention: with fp8 (f8e4m3) K/V on CUDA, q must be f16 or bf16, got \
                 {dtype:?}"
            )
        }
        if choice == CudaKernel::CudaCore {
            bail!(
                "split-kv attention: fp8 (f8e4m3) K/V run on the tensor-core kernels; use \
                 CudaKernel::Auto or CudaKernel::TensorCore"
            )
        }
        if !KernelForm::TensorCore.compiled_for(dtype, kv_dtype) {
            bail!(
                "split-kv attention: fp8 (f8e4m3) K/V need a build for compute capability 89 or \
                 later, this one targets {}",
                compiled_compute_cap()
            )
        }
        return Ok(KernelForm::TensorCore);
    }
    let tensor_cores = dtype != DType::F32 && KernelForm::TensorCore.compiled_for(dtype, dtype);
    Ok(match choice {
        CudaKernel::Auto if tensor_cores => KernelForm::TensorCore,
        CudaKernel::Auto | CudaKernel::CudaCore => KernelForm::CudaCore,
        CudaKernel::TensorCore if dtype == DType::F32 => {
            bail!("split-kv attention: the tensor-core kernels take f16 or bf16, got f32")
        }
        CudaKernel::TensorCore if !tensor_cores => bail!(
            "split-kv attention: the tensor-core kernels need a build for compute capability 80 \
             or later, this one targets {}",
            compiled_compute_cap()
        ),
        CudaKernel::TensorCore => KernelForm::TensorCore,
    })
}

/// The partial kernel and split plan for `dtype` queries and K/V stored as `kv_dtype`.
pub(crate) fn prepare(
    call: &DecodeCall,
    dev: &CudaDevice,
    (dtype, kv_dtype): (DType, DType),
    blocks: &QueryBlocks,
) -> Result<(DecodeKernel, SplitPlan)> {
    let dims = &blocks.dims;
    let mut family = resolve_family(call.cuda_kernel, dtype, kv_dtype)?;
    if call.cuda_kernel == CudaKernel::Auto
        && family == KernelForm::TensorCore
        && kv_dtype == dtype
        && !tensor_cores_fit(dev, dtype, dims)?
    {
        family = KernelForm::CudaCore;
    }
    let windowed = call.windowed();
    if dims.pages.is_some() {
        family = match family.paged(windowed) {
            Some(paged) => paged,
            None => bail!("split-kv attention: no paged form of the {family:?} kernels"),
        };
    } else if windowed {
        family = family.windowed().unwrap_or(family);
    }
    let kernel = DecodeKernel::load(dev, family, dtype, kv_dtype, dims)?;
    let fill = fills_every_slot(&kernel, blocks);
    let slots = if fill {
        kernel.resident
    } else {
        kernel.parallel_slots
    };
    let plan = DecodeCall {
        dims: *dims,
        ..*call
    }
    .split_plan(slots, gpu_min_chunk(dims.kv_len));
    let items = plan.num_splits * dims.batch * dims.kv_heads;
    // More items than resident CTAs: each CTA would ramp up and drain on its own, so one wave
    // of persistent CTAs walks them instead, where the device has the shared memory for the
    // persistent form's separate merge area (the windowed forms have none: their items run in
    // waves).
    let persistent_twin = match kernel.spec.form {
        KernelForm::TensorCore => Some(KernelForm::TensorCorePersistent),
        KernelForm::TensorCorePaged => Some(KernelForm::TensorCorePersistentPaged),
        _ => None,
    };
    if let (Some(twin), true) = (persistent_twin, items > kernel.resident) {
        if let Some(spec) = kernel.spec.sibling(twin) {
            if spec.smem_bytes <= max_smem_per_cta(dev)? {
                let persistent = DecodeKernel::load(dev, spec.form, dtype, kv_dtype, dims)?;
                return Ok((persistent, plan));
            }
        }
    }
    if call.num_splits.is_none() {
        if let Some(shorter) = cluster_plan(dev, &kernel, dims, plan)? {
            return Ok((kernel, shorter));
        }
        if fill {
            if let Some(fitted) = lockstep_plan(dev, &kernel, blocks, plan)? {
                return Ok((kernel, fitted));
            }
        }
    }
    Ok((kernel, plan))
}

/// Chunks of at most this many K+V bytes are short enough that merging inside clusters on fewer
/// SMs beats streaming on every SM followed by the combine pass.
const CLUSTER_CHUNK_BYTES: usize = 192 * 1024;

/// Where the heuristic's plan needs the combine pass because its clusters would not all be
/// resident, a plan of at least half as many splits whose clusters are, provided its chunks stay
/// within [`CLUSTER_CHUNK_BYTES`]: at short contexts the combine pass (a second grid and an L2
/// round trip) costs more than the SMs given up.
fn cluster_plan(
    dev: &CudaDevice,
    kernel: &DecodeKernel,
    dims: &DecodeDims,
    plan: SplitPlan,
) -> Result<Option<SplitPlan>> {
    let units = dims.batch * dims.kv_heads;
    let config = |splits: usize| LaunchConfig {
        grid_dim: (splits as u32, dims.kv_heads as u32, dims.batch as u32),
        block_dim: (kernel.spec.threads, 1, 1),
        shared_mem_bytes: kernel.spec.smem_bytes as u32,
    };
    let splits = plan.num_splits;
    if !kernel.is_tensor_core()
        || splits < 2
        || merge_cluster(dev, kernel, units, splits, &config(splits))?.is_some()
    {
        return Ok(None);
    }
    for fewer in (splits.div_ceil(2)..splits).rev() {
        let candidate = plan::aligned(dims.kv_len, fewer);
        let chunk_bytes =
            2 * candidate.chunk_size * dims.head_dim * kernel.spec.kv_dtype.size_in_bytes();
        if chunk_bytes > CLUSTER_CHUNK_BYTES {
            break; // fewer splits only lengthen the chunks
        }
        let splits = candidate.num_splits;
        if splits >= 2 && merge_cluster(dev, kernel, units, splits, &config(splits))?.is_some() {
            return Ok(Some(candidate));
        }
    }
    Ok(None)
}

/// The launch that merges the splits inside the partial pass, clusters of all the splits of one
/// (batch, kv head), or `None` for another merge. Only for the one-item tensor-core kernels (plain,
/// windowed or paged) on sm_90, 2 to [`MAX_CLUSTER`] splits, and where every cluster is resident
/// at once with one CTA per SM: left to itself the scheduler packs a cluster two CTAs to an SM,
/// and half the SMs then stream a long context.
fn merge_cluster(
    dev: &CudaDevice,
    kernel: &DecodeKernel,
    units: usize,
    splits: usize,
    cfg: &LaunchConfig,
) -> Result<Option<(ClusterDims, LaunchConfig)>> {
    let one_item = matches!(
        kernel.spec.form,
        KernelForm::TensorCore
            | KernelForm::TensorCoreWindowed
            | KernelForm::TensorCorePaged
            | KernelForm::TensorCoreWindowedPaged
    );
    if !one_item || !(2..=MAX_CLUSTER).contains(&splits) {
        return Ok(None);
    }
    let Some(smem) = one_cta_per_sm_smem(dev)? else {
        return Ok(None);
    };
    if kernel.spec.cluster_smem_bytes > max_smem_per_cta(dev)? {
        return Ok(None);
    }
    let cfg = LaunchConfig {
        shared_mem_bytes: smem.max(kernel.spec.cluster_smem_bytes) as u32,
        ..*cfg
    };
    let shape = ClusterDims {
        x: splits as u32,
        y: 1,
    };
    let resident = resident_clusters(dev, kernel.spec.symbol, &kernel.func, &cfg, shape)?;
    Ok((resident >= units).then_some((shape, cfg)))
}

/// Most bytes of partial outputs and LSEs that the last CTA of a (batch, kv head) reads back to
/// merge its splits; more go through the combine pass, which spreads the reads over a CTA per
/// query head.
const LAST_CTA_MERGE_BYTES: usize = 64 * 1024;

/// Everything a launch of the partial pass needs beyond its buffers.
pub(crate) struct Launch {
    pub func: CudaFunction,
    pub cfg: LaunchConfig,
    pub cluster: Option<ClusterDims>,
    pub merge: SplitMerge,
    /// The device's split counters, for [`SplitMerge::ByLastCta`].
    pub counters: Option<u64>,
}

/// How the partial pass of `kernel` over `plan` launches and merges its splits.
pub(crate) fn launch(
    dev: &CudaDevice,
    kernel: &DecodeKernel,
    blocks: &QueryBlocks,
    plan: SplitPlan,
) -> Result<Launch> {
    let dims = &blocks.dims;
    let items = plan.num_splits * dims.batch * dims.kv_heads;
    let grid_dim = if kernel.is_persistent() {
        let ctas = plan::persistent_ctas(items, kernel.resident);
        (ctas as u32, 1, 1)
    } else {
        (
            plan.num_splits as u32,
            dims.kv_heads as u32,
            dims.batch as u32,
        )
    };
    let cfg = LaunchConfig {
        grid_dim,
        block_dim: (kernel.spec.threads, 1, 1),
        shared_mem_bytes: kernel.spec.smem_bytes as u32,
    };
    let units = dims.batch * dims.kv_heads;
    let (in_cluster, cfg) = match merge_cluster(dev, kernel, units, plan.num_splits, &cfg)? {
        Some((shape, cluster_cfg)) => (Some(shape), cluster_cfg),
        None => (None, cfg),
    };
    // The last CTA of each group merges where the group's partials are few enough for one SM to
    // read quickly; the persistent and CUDA-core kernels, and plans beyond the counters, merge in
    // the combine pass.
    let group_partial_bytes = dims.group_size() * plan.num_splits * (dims.head_dim + 1) * 4;
    let counters = if plan.num_splits > 1
        && in_cluster.is_none()
        && matches!(
            kernel.spec.form,
            KernelForm::TensorCore | KernelForm::TensorCorePaged
        )
        && units <= SPLIT_COUNTERS
        && group_partial_bytes <= LAST_CTA_MERGE_BYTES
    {
        split_counters(dev)?
    } else {
        None
    };
    let merge = match (in_cluster, counters) {
        (Some(_), _) => SplitMerge::InCluster,
        (None, Some(_)) => SplitMerge::ByLastCta,
        (None, None) => SplitMerge::ByCombinePass,
    };
    let last_cta = merge == SplitMerge::ByLastCta;
    let lockstep = match in_cluster {
        None => lockstep_cluster(dev, kernel, blocks, last_cta, plan.num_splits)?,
        Some(_) => None,
    };
    // The one place a form is chosen.
    let form = match (kernel.spec.form, last_cta, lockstep.is_some()) {
        (KernelForm::TensorCore, true, true) => KernelForm::TensorCoreLastCtaLockstep,
        (KernelForm::TensorCore, true, false) => KernelForm::TensorCoreLastCta,
        (KernelForm::TensorCore, false, true) => KernelForm::TensorCoreLockstep,
        (KernelForm::TensorCorePaged, true, _) => KernelForm::TensorCoreLastCtaPaged,
        (form, _, _) => form,
    };
    let func = if form == kernel.spec.form {
        kernel.func.clone()
    } else {
        kernel.form(dev, form)?.1
    };
    Ok(Launch {
        func,
        cfg,
        cluster: in_cluster.or(lockstep),
        merge,
        counters,
    })
}
