//! Wide groups on the tensor-core kernels: how many CTAs their plans fill, and the lockstep
//! clusters that let the blocks of one kv head share its K/V through L2.

use candle_core::{CudaDevice, Result};
use cudarc::driver::LaunchConfig;

use super::decode_kernel::DecodeKernel;
use super::kernels::KernelForm;
use super::launch::{compiled_compute_cap, resident_clusters, ClusterDims};
use super::wide_groups::QueryBlocks;
use crate::op::plan::{aligned, SplitPlan};

/// K+V bytes times blocks per kv head from which a wide group's blocks fill every resident slot
/// (two CTAs per SM) rather than one per SM. Each block streams its kv head's K/V, so a group of
/// n blocks does n passes of tensor-core work per byte, and one CTA per SM leaves the pass bound
/// by that work; below it the extra splits cost more than they gain (docs/perf-log.md, v3ae–v3ag).
const WIDE_FILL_WORK_BYTES: usize = 64 << 20;

/// Whether this call's plan fills every resident slot: a wide group on the tensor-core kernels
/// with at least [`WIDE_FILL_WORK_BYTES`] of K/V passes.
pub(super) fn fills_every_slot(kernel: &DecodeKernel, blocks: &QueryBlocks) -> bool {
    let dims = &blocks.dims;
    // `dims.kv_heads` counts blocks, so this is the K/V bytes times the blocks that read them.
    let work_bytes = 2
        * dims.batch
        * dims.kv_heads
        * dims.kv_len
        * dims.head_dim
        * kernel.spec.kv_dtype.size_in_bytes();
    kernel.is_tensor_core() && blocks.blocks_per_kv_head > 1 && work_bytes >= WIDE_FILL_WORK_BYTES
}

/// Blocks of query heads per K/V head that run as one cluster in lock step at most: the portable
/// cluster size (groups of up to 128 query heads).
const MAX_LOCKSTEP_BLOCKS: usize = 8;

/// Tiles each warp streams between two cluster barriers of the lockstep forms (4, 8 and 16
/// measured the same).
pub(super) const LOCKSTEP_TILES: i32 = 4;

/// How many clusters of one kv head's blocks the lockstep form of `kernel` (merging in the last
/// CTA or not) holds at once with two CTAs per SM, and their shape; `None` where there is no
/// lockstep form: groups of one block or more than [`MAX_LOCKSTEP_BLOCKS`], the persistent and
/// CUDA-core kernels, builds before sm_90.
fn lockstep_residency(
    dev: &CudaDevice,
    kernel: &DecodeKernel,
    blocks: &QueryBlocks,
    last_cta: bool,
) -> Result<Option<(usize, ClusterDims)>> {
    let per_head = blocks.blocks_per_kv_head;
    if kernel.spec.form != KernelForm::TensorCore
        || compiled_compute_cap() < 90
        || !(2..=MAX_LOCKSTEP_BLOCKS).contains(&per_head)
    {
        return Ok(None);
    }
    let form = if last_cta {
        KernelForm::TensorCoreLastCtaLockstep
    } else {
        KernelForm::TensorCoreLockstep
    };
    let (spec, func) = kernel.form(dev, form)?;
    let shape = ClusterDims {
        x: 1,
        y: per_head as u32,
    };
    // The occupancy query wants a grid of whole clusters.
    let cfg = LaunchConfig {
        grid_dim: (1, shape.y, 1),
        block_dim: (spec.threads, 1, 1),
        shared_mem_bytes: spec.smem_bytes as u32,
    };
    let resident = resident_clusters(dev, spec.symbol, &func, &cfg, shape)?;
    Ok(Some((resident, shape)))
}

/// Where a filling plan's lockstep clusters would not all be resident, the plan with as many
/// splits as they allow, if that keeps more than four fifths of them: a cluster left for a second
/// wave doubles the call, and beyond that fewer splits cost more than lock step gains.
pub(super) fn lockstep_plan(
    dev: &CudaDevice,
    kernel: &DecodeKernel,
    blocks: &QueryBlocks,
    plan: SplitPlan,
) -> Result<Option<SplitPlan>> {
    let Some((resident, _)) = lockstep_residency(dev, kernel, blocks, false)? else {
        return Ok(None);
    };
    let dims = &blocks.dims;
    let clusters_per_split = dims.batch * dims.kv_heads / blocks.blocks_per_kv_head;
    let fitting = resident / clusters_per_split.max(1);
    if fitting >= plan.num_splits || fitting * 5 <= plan.num_splits * 4 {
        return Ok(None);
    }
    Ok(Some(aligned(dims.kv_len, fitting)))
}

/// The cluster shape that runs each kv head's blocks in lock step (`LOCKSTEP` in
/// kernels/split_kv_decode_mma.cuh), so that the first block to stream a tile leaves it in L2 for
/// the others: for plans that fill every slot, where every cluster of the grid is resident at
/// once. `None` runs the plain form.
pub(super) fn lockstep_cluster(
    dev: &CudaDevice,
    kernel: &DecodeKernel,
    blocks: &QueryBlocks,
    last_cta: bool,
    num_splits: usize,
) -> Result<Option<ClusterDims>> {
    if !fills_every_slot(kernel, blocks) {
        return Ok(None);
    }
    let Some((resident, shape)) = lockstep_residency(dev, kernel, blocks, last_cta)? else {
        return Ok(None);
    };
    let dims = &blocks.dims;
    let clusters = num_splits * dims.batch * dims.kv_heads / blocks.blocks_per_kv_head;
    Ok((clusters <= resident).then_some(shape))
}
