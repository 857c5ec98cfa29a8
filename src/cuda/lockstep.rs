//! Wide groups on the tensor-core kernels: how many CTAs their plans fill, and the lockstep
//! clusters that let the blocks of one kv head share its K/V through L2.

use candle_core::{CudaDevice, Result};
use cudarc::driver::{CudaFunction, LaunchConfig};

use super::{DecodeKernel, DECODE_THREADS};
use crate::cuda_launch::{compiled_compute_cap, resident_clusters, ClusterDims};
use crate::op::CudaKernel;
use crate::plan::{aligned, SplitPlan};
use crate::wide_groups::QueryBlocks;

/// K+V bytes times blocks per kv head from which a wide group's blocks fill every resident slot
/// (two CTAs per SM) rather than one per SM. Each block streams its kv head's K/V, so a group of
/// n blocks does n passes of tensor-core work per byte, and one CTA per SM leaves the pass bound
/// by that work (H200, bf16, b = 16, 48/1, d 128, 64K: 96 CTAs 286 µs, 240 CTAs 179 µs; 71/1,
/// d 64, 4K, 16 MiB × 5 blocks: 19.7 → 14.3 µs); below it the extra splits cost more than they
/// gain (b = 1, 64/2, d 128, 16K, 16 MiB × 2 blocks: 12.3 → 14.7 µs).
const WIDE_FILL_WORK_BYTES: usize = 64 << 20;

/// Whether this call's plan fills every resident slot: a wide group on the tensor-core kernels
/// with at least [`WIDE_FILL_WORK_BYTES`] of K/V passes.
pub(super) fn fills_every_slot(kernel: &DecodeKernel, blocks: &QueryBlocks) -> bool {
    let dims = &blocks.dims;
    // `dims.kv_heads` counts blocks, so this is the K/V bytes times the blocks that read them.
    let work_bytes = 2 * dims.batch * dims.kv_heads * dims.kv_len * dims.head_dim * 2;
    kernel.family == CudaKernel::TensorCore
        && blocks.blocks_per_kv_head > 1
        && work_bytes >= WIDE_FILL_WORK_BYTES
}

/// Blocks of query heads per K/V head that run as one cluster in lock step at most: the portable
/// cluster size (groups of up to 128 query heads).
const MAX_LOCKSTEP_BLOCKS: usize = 8;

/// Tiles each warp streams between two cluster barriers of the lockstep forms (4, 8 and 16
/// measured the same).
pub(super) const LOCKSTEP_TILES: i32 = 4;

/// How many clusters of one kv head's blocks the lockstep form of `kernel` (suffix
/// `merge_suffix` + `_lockstep`) holds at once with two CTAs per SM, and the form; `None` where
/// there is no lockstep form: groups of one block or more than [`MAX_LOCKSTEP_BLOCKS`], the
/// persistent and CUDA-core kernels, builds before sm_90.
fn lockstep_residency(
    dev: &CudaDevice,
    kernel: &DecodeKernel,
    blocks: &QueryBlocks,
    merge_suffix: &str,
) -> Result<Option<(usize, ClusterDims, CudaFunction)>> {
    let per_head = blocks.blocks_per_kv_head;
    if kernel.family != CudaKernel::TensorCore
        || kernel.persistent
        || compiled_compute_cap() < 90
        || !(2..=MAX_LOCKSTEP_BLOCKS).contains(&per_head)
    {
        return Ok(None);
    }
    let suffix = format!("{merge_suffix}_lockstep");
    let func = kernel.form(dev, &suffix)?;
    let shape = ClusterDims {
        x: 1,
        y: per_head as u32,
    };
    // The occupancy query wants a grid of whole clusters.
    let cfg = LaunchConfig {
        grid_dim: (1, shape.y, 1),
        block_dim: (DECODE_THREADS, 1, 1),
        shared_mem_bytes: kernel.smem_bytes as u32,
    };
    let name = format!("{}{suffix}", kernel.name);
    let resident = resident_clusters(dev, &name, &func, &cfg, shape)?;
    Ok(Some((resident, shape, func)))
}

/// Where a filling plan's lockstep clusters would not all be resident, the plan with as many
/// splits as they allow, if that keeps more than four fifths of them: a cluster left for a second
/// wave doubles the call, and beyond that fewer splits cost more than lock step gains (H200,
/// bf16, 48/1, d 128, L = 64K: b = 4, 19 splits in lock step 52.3 µs against 22 splits without
/// it 66.8; b = 16, 4 splits in lock step 208 µs against 5 without it 179).
pub(super) fn lockstep_plan(
    dev: &CudaDevice,
    kernel: &DecodeKernel,
    blocks: &QueryBlocks,
    plan: SplitPlan,
) -> Result<Option<SplitPlan>> {
    let Some((resident, _, _)) = lockstep_residency(dev, kernel, blocks, "")? else {
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

/// The cluster shape and kernel form that run each kv head's blocks in lock step (`LOCKSTEP` in
/// kernels/split_kv_decode_mma.cuh), so that the first block to stream a tile leaves it in L2 for
/// the others: for plans that fill every slot, where every cluster of the grid is resident at
/// once. `None` runs the plain form.
pub(super) fn lockstep_cluster(
    dev: &CudaDevice,
    kernel: &DecodeKernel,
    blocks: &QueryBlocks,
    merge_suffix: &str,
    num_splits: usize,
) -> Result<Option<(ClusterDims, CudaFunction)>> {
    if !fills_every_slot(kernel, blocks) {
        return Ok(None);
    }
    let Some((resident, shape, func)) = lockstep_residency(dev, kernel, blocks, merge_suffix)?
    else {
        return Ok(None);
    };
    let dims = &blocks.dims;
    let clusters = num_splits * dims.batch * dims.kv_heads / blocks.blocks_per_kv_head;
    Ok((clusters <= resident).then_some((shape, func)))
}
