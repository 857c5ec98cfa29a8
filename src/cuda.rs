//! The CUDA path: loads the PTX that build.rs compiled from `kernels/` and launches the partial
//! and combine kernels on candle's stream, with no host synchronisation.

use candle_core::backend::BackendStorage;
use candle_core::cuda::CudaDType;
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result, Shape, Storage, Tensor};
use cudarc::driver::{CudaFunction, DeviceRepr, LaunchConfig};
use half::{bf16, f16};

use crate::cuda_launch::{
    compiled_compute_cap, device_ptr, launch_dependent, max_smem_per_cta, one_cta_per_sm_smem,
    poison, resident_clusters, resident_ctas, ClusterDims,
};
use crate::op::{CudaKernel, SplitKvAttention};
use crate::plan::MAX_SPLITS;
use crate::split_counters::{split_counters, SPLIT_COUNTERS};
use crate::validate::{self, DecodeDims, RowStrides};
use crate::wide_groups::{query_blocks, QueryBlocks, MAX_GROUP};

mod lockstep;
use lockstep::{fills_every_slot, lockstep_cluster, lockstep_plan, LOCKSTEP_TILES};

const DECODE_F16_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/split_kv_decode_f16.ptx"));
const DECODE_BF16_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/split_kv_decode_bf16.ptx"));
const DECODE_F32_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/split_kv_decode_f32.ptx"));
const DECODE_MMA_F16_PTX: &str =
    include_str!(concat!(env!("OUT_DIR"), "/split_kv_decode_mma_f16.ptx"));
const DECODE_MMA_BF16_PTX: &str =
    include_str!(concat!(env!("OUT_DIR"), "/split_kv_decode_mma_bf16.ptx"));
const COMBINE_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/combine.ptx"));

/// Shortest chunk the CUDA plan cuts. Below 2048 positions, 256-position chunks leave fewer than
/// eight splits and each warp streams its tiles one latency after another, so 128 is allowed
/// there; at 4096 and beyond, 128-position chunks measured slower (more splits to combine).
fn gpu_min_chunk(kv_len: usize) -> usize {
    if kv_len < 8 * crate::plan::MIN_CHUNK {
        128
    } else {
        crate::plan::MIN_CHUNK
    }
}

/// Threads per CTA of the partial kernel (`kThreads` in kernels/split_kv_decode.cuh).
const DECODE_THREADS: u32 = 128;
const COMBINE_THREADS: u32 = 128;

/// Most splits merged inside one thread-block cluster (`kMaxCluster` in
/// kernels/cluster_merge.cuh); more go through the combine kernel.
const MAX_CLUSTER: usize = 16;

/// Launch parameters of the partial kernel; must match `DecodeParams` in kernels/common.cuh.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct DecodeParams {
    q: u64,
    k: u64,
    v: u64,
    out: u64,
    lse_out: u64,
    partial_out: u64,
    partial_lse: u64,
    seqlens: u64,
    split_counters: u64,
    q_batch_stride: i64,
    q_head_stride: i64,
    k_batch_stride: i64,
    k_seq_stride: i64,
    k_head_stride: i64,
    v_batch_stride: i64,
    v_seq_stride: i64,
    v_head_stride: i64,
    batch: i32,
    q_heads: i32,
    kv_heads: i32,
    kv_len: i32,
    num_splits: i32,
    chunk_size: i32,
    scale_log2: f32,
    merge: SplitMerge,
    blocks_per_kv_head: i32,
    padded_group: i32,
    real_group: i32,
    lockstep_tiles: i32,
}

/// How the splits of each (batch, kv head) are merged; must match `SplitMerge` in
/// kernels/common.cuh. Irrelevant with one split, where the partial pass writes the output.
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SplitMerge {
    /// A second grid, the combine kernel.
    CombinePass = 0,
    /// The splits are one thread-block cluster and merge through distributed shared memory.
    InCluster = 1,
    /// The last CTA of the group to finish merges, counted on the split counters.
    ByLastCta = 2,
}

// SAFETY: plain-old-data with the C layout the kernels expect.
unsafe impl DeviceRepr for DecodeParams {}

/// Most bytes of partial outputs and LSEs that the last CTA of a (batch, kv head) reads back to
/// merge its splits; more go through the combine pass, which spreads the reads over a CTA per
/// query head (H200, bf16, b = 1, 32/8, d 128, 16 splits: 33 KB, 4K 9.0 → 8.3 µs; 64/8 at 66 KB
/// was no faster than the combine pass).
const LAST_CTA_MERGE_BYTES: usize = 64 * 1024;

/// Launch parameters of the combine kernel; must match `CombineParams` in kernels/common.cuh.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct CombineParams {
    partial_out: u64,
    partial_lse: u64,
    out: u64,
    lse_out: u64,
    rows: i32,
    num_splits: i32,
    head_dim: i32,
    padded_group: i32,
    real_group: i32,
    reserved: i32,
}

// SAFETY: as above.
unsafe impl DeviceRepr for CombineParams {}

/// The CUDA-core kernel's group-size bucket: the smallest compiled `GMAX` holding the group.
fn group_bucket(group: usize) -> Result<usize> {
    match [1, 2, 4, 8, MAX_GROUP].into_iter().find(|&g| g >= group) {
        Some(g) => Ok(g),
        None => bail!(
            "split-kv attention: a CUDA kernel holds up to {MAX_GROUP} query heads per kv head, \
             got {group}"
        ),
    }
}

/// Dynamic shared memory of one CUDA-core CTA: `Tiling::kTotalSmem` in
/// kernels/split_kv_decode.cuh (the kernel traps if it is given less).
fn cuda_core_smem_bytes(head_dim: usize, elem_bytes: usize, gmax: usize) -> usize {
    const RING_BYTES_PER_WARP: usize = 24 * 1024;
    let chunks = head_dim / 8;
    let lanes_per_row = match chunks {
        0..=8 => 8,
        9..=16 => 16,
        _ => 32,
    };
    let steps = match gmax {
        0..=4 => 8,
        8 => 4,
        _ => 2,
    };
    let rows = (32 / lanes_per_row) * steps;
    let stage_bytes = 2 * rows * head_dim * elem_bytes;
    let stages = (RING_BYTES_PER_WARP / stage_bytes).clamp(2, 8);
    let ring = WARPS * stages * stage_bytes;
    let q_in_smem = if gmax <= 8 { 0 } else { gmax * head_dim * 4 };
    ring.max(merge_smem_bytes(head_dim, gmax)) + q_in_smem
}

/// Dynamic shared memory of one tensor-core CTA: `MmaTiling::kSmemBytes`, or
/// `kPersistentSmemBytes` for the persistent form, in kernels/split_kv_decode_mma.cuh.
fn tensor_core_smem_bytes(head_dim: usize, gmax: usize, persistent: bool) -> usize {
    const RING_BYTES_PER_WARP: usize = 26 * 1024;
    // 32-row tiles where a row is at most 128 bytes, else 16.
    let rows = if head_dim * 2 <= 128 { 32 } else { 16 };
    // Dense rows, their pieces permuted rather than padded.
    let row_bytes = head_dim * 2;
    let stage_bytes = 2 * rows * row_bytes;
    let stages = (RING_BYTES_PER_WARP / stage_bytes).clamp(3, 8);
    let ring = WARPS * stages * stage_bytes;
    if persistent {
        return ring + merge_smem_bytes(head_dim, gmax);
    }
    ring.max(merge_smem_bytes(head_dim, gmax))
}

/// `merge_smem_bytes` in kernels/warp_merge.cuh: per warp and head, the output row, max and sum,
/// padded to `merge_slot_floats` (head_dim + 8).
fn merge_smem_bytes(head_dim: usize, gmax: usize) -> usize {
    WARPS * gmax * (head_dim + 8) * 4
}

/// `cluster_receive_bytes` in kernels/cluster_merge.cuh: what the other CTAs of a cluster push
/// to this one (slices of four columns, or one column per thread), then their LSEs.
fn cluster_receive_bytes(head_dim: usize, gmax: usize) -> usize {
    let slices = (gmax * head_dim / 4 + MAX_CLUSTER) * 16;
    let columns = MAX_CLUSTER * DECODE_THREADS as usize * 4;
    slices.max(columns) + MAX_CLUSTER * gmax * 4
}

/// Warps per CTA of both partial kernels (`kWarps` in kernels/common.cuh).
const WARPS: usize = 4;

/// The kernel family that runs for `choice` and `dtype`.
fn resolve_family(choice: CudaKernel, dtype: DType) -> Result<CudaKernel> {
    let tensor_cores = dtype != DType::F32 && compiled_compute_cap() >= 80;
    Ok(match choice {
        CudaKernel::Auto if tensor_cores => CudaKernel::TensorCore,
        CudaKernel::Auto | CudaKernel::CudaCore => CudaKernel::CudaCore,
        CudaKernel::TensorCore if dtype == DType::F32 => {
            bail!("split-kv attention: the tensor-core kernels take f16 or bf16, got f32")
        }
        CudaKernel::TensorCore if !tensor_cores => bail!(
            "split-kv attention: the tensor-core kernels need a build for compute capability 80 \
             or later, this one targets {}",
            compiled_compute_cap()
        ),
        CudaKernel::TensorCore => CudaKernel::TensorCore,
    })
}

fn dtype_tag(dtype: DType) -> Result<&'static str> {
    Ok(match dtype {
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        DType::F32 => "f32",
        other => {
            bail!("split-kv attention: dtype {other:?} is not supported; use f32, f16 or bf16")
        }
    })
}

/// The PTX module holding the partial kernels of one family and dtype.
fn decode_module(family: CudaKernel, dtype: DType) -> Result<(&'static str, &'static str)> {
    Ok(match (family, dtype) {
        (CudaKernel::TensorCore, DType::F16) => ("split_kv_decode_mma_f16", DECODE_MMA_F16_PTX),
        (CudaKernel::TensorCore, DType::BF16) => ("split_kv_decode_mma_bf16", DECODE_MMA_BF16_PTX),
        (_, DType::F16) => ("split_kv_decode_f16", DECODE_F16_PTX),
        (_, DType::BF16) => ("split_kv_decode_bf16", DECODE_BF16_PTX),
        (_, DType::F32) => ("split_kv_decode_f32", DECODE_F32_PTX),
        (_, other) => {
            bail!("split-kv attention: dtype {other:?} is not supported; use f32, f16 or bf16")
        }
    })
}

/// The cp.async loads move 16 bytes at a time, so every K/V row must start on a 16-byte boundary.
fn check_alignment(
    name: &str,
    strides: &RowStrides,
    dims: &[usize],
    elem_bytes: usize,
) -> Result<()> {
    let per_16 = 16 / elem_bytes;
    let moving = [
        (strides.batch, dims[0]),
        (strides.seq, dims[1]),
        (strides.head, dims[2]),
    ];
    let misaligned = !strides.offset.is_multiple_of(per_16)
        || moving
            .iter()
            .any(|&(stride, size)| size > 1 && !stride.is_multiple_of(per_16));
    if misaligned {
        bail!(
            "split-kv attention: on CUDA every row of {name} must start on a 16-byte boundary \
             (offset and batch/seq/head strides multiples of {per_16} elements), got offset {} and \
             strides {:?}; call .contiguous() on {name} first",
            strides.offset,
            [strides.batch, strides.seq, strides.head]
        )
    }
    Ok(())
}

/// The partial kernel for one (family, dtype, head dim, group bucket), ready to launch.
struct DecodeKernel {
    family: CudaKernel,
    /// One wave of CTAs that walk the work items (tensor-core kernels only), instead of one
    /// CTA per item.
    persistent: bool,
    name: String,
    func: CudaFunction,
    /// The PTX module holding `func` and its other forms.
    module: (&'static str, &'static str),
    smem_bytes: usize,
    /// Shared memory when the splits merge in a cluster: `smem_bytes` and the receive area
    /// (`MmaTiling::kClusterSmemBytes`).
    cluster_smem_bytes: usize,
    /// CTAs the split plan aims for.
    parallel_slots: usize,
    /// CTAs the GPU holds at once.
    resident: usize,
}

impl DecodeKernel {
    fn load(
        dev: &CudaDevice,
        family: CudaKernel,
        dtype: DType,
        dims: &DecodeDims,
        persistent: bool,
    ) -> Result<Self> {
        let (module, ptx) = decode_module(family, dtype)?;
        let gmax = group_bucket(dims.group_size())?;
        let (gmax, smem_bytes) = match family {
            CudaKernel::TensorCore => {
                let gmax = gmax.max(8);
                (
                    gmax,
                    tensor_core_smem_bytes(dims.head_dim, gmax, persistent),
                )
            }
            _ => (
                gmax,
                cuda_core_smem_bytes(dims.head_dim, dtype.size_in_bytes(), gmax),
            ),
        };
        let cluster_smem_bytes = smem_bytes + cluster_receive_bytes(dims.head_dim, gmax);
        let suffix = if persistent { "_persistent" } else { "" };
        let name = format!("{module}_d{}_g{gmax}{suffix}", dims.head_dim);
        let func = (*dev.get_or_load_custom_func(&name, module, ptx)?).clone();
        let residency = resident_ctas(dev, &name, &func, DECODE_THREADS, smem_bytes)?;
        // Tensor-core CTAs each stream enough bytes to keep an SM's share of HBM busy: one per
        // SM measured faster than filling every resident slot (e.g. b = 16, 64/8, L = 1K: one
        // split 20.9 µs, two 24.0), whose extra splits only add per-split fixed cost.
        let parallel_slots = match family {
            CudaKernel::TensorCore => residency.sms,
            _ => residency.total(),
        };
        Ok(Self {
            family,
            persistent,
            name,
            func,
            module: (module, ptx),
            smem_bytes,
            cluster_smem_bytes,
            parallel_slots,
            resident: residency.total(),
        })
    }

    /// Another form of this one-item tensor-core kernel, with the same shared memory: suffix
    /// `_last_cta` (the last CTA per (batch, kv head) merges the splits), `_lockstep` (the blocks
    /// of a wide group run as clusters in lock step) or both, in kernels/split_kv_decode_mma.cuh.
    fn form(&self, dev: &CudaDevice, suffix: &str) -> Result<CudaFunction> {
        let name = format!("{}{suffix}", self.name);
        let (module, ptx) = self.module;
        let func = (*dev.get_or_load_custom_func(&name, module, ptx)?).clone();
        // Raises the form's shared-memory limit on first use; cached afterwards.
        resident_ctas(dev, &name, &func, DECODE_THREADS, self.smem_bytes)?;
        Ok(func)
    }
}

/// The partial kernel and split plan for these inputs.
fn prepare(
    op: &SplitKvAttention,
    dev: &CudaDevice,
    dtype: DType,
    blocks: &QueryBlocks,
) -> Result<(DecodeKernel, crate::plan::SplitPlan)> {
    let dims = &blocks.dims;
    let family = resolve_family(op.cuda_kernel, dtype)?;
    let kernel = DecodeKernel::load(dev, family, dtype, dims, false)?;
    let fill = fills_every_slot(&kernel, blocks);
    let slots = if fill {
        kernel.resident
    } else {
        kernel.parallel_slots
    };
    let plan = op.plan(dims, slots, gpu_min_chunk(dims.kv_len));
    let items = plan.num_splits * dims.batch * dims.kv_heads;
    // More items than resident CTAs: each CTA would ramp up and drain on its own, so one wave
    // of persistent CTAs walks them instead (b = 64, 32/8, L = 1K: 512 items), where the device
    // has the shared memory for the persistent form's separate merge area.
    let gmax = group_bucket(dims.group_size())?.max(8);
    let persistent_fits =
        tensor_core_smem_bytes(dims.head_dim, gmax, true) <= max_smem_per_cta(dev)?;
    if family == CudaKernel::TensorCore && items > kernel.resident && persistent_fits {
        let persistent = DecodeKernel::load(dev, family, dtype, dims, true)?;
        return Ok((persistent, plan));
    }
    if op.num_splits.is_none() {
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
/// SMs beats streaming on every SM followed by the combine pass (H200, bf16: b = 4, 32/8, d 64,
/// 1K, 3 splits of 96 KiB in clusters 6.9 µs against 4 with the combine 7.7; b = 1, 32/8, d 128,
/// 4K, 8 splits of 256 KiB in clusters 9.3 µs against 16 with the combine 9.2).
const CLUSTER_CHUNK_BYTES: usize = 192 * 1024;

/// Where the heuristic's plan needs the combine pass because its clusters would not all be
/// resident, a plan of at least half as many splits whose clusters are, provided its chunks stay
/// within [`CLUSTER_CHUNK_BYTES`]: at short contexts the combine pass (a second grid and an L2
/// round trip) costs more than the SMs given up.
fn cluster_plan(
    dev: &CudaDevice,
    kernel: &DecodeKernel,
    dims: &DecodeDims,
    plan: crate::plan::SplitPlan,
) -> Result<Option<crate::plan::SplitPlan>> {
    let units = dims.batch * dims.kv_heads;
    let config = |splits: usize| LaunchConfig {
        grid_dim: (splits as u32, dims.kv_heads as u32, dims.batch as u32),
        block_dim: (DECODE_THREADS, 1, 1),
        shared_mem_bytes: kernel.smem_bytes as u32,
    };
    let splits = plan.num_splits;
    if kernel.family != CudaKernel::TensorCore
        || splits < 2
        || merge_cluster(dev, kernel, units, splits, &config(splits))?.is_some()
    {
        return Ok(None);
    }
    for fewer in (splits.div_ceil(2)..splits).rev() {
        let candidate = crate::plan::aligned(dims.kv_len, fewer);
        // K and V rows of 16-bit elements, the tensor-core kernels' inputs.
        let chunk_bytes = 2 * candidate.chunk_size * dims.head_dim * 2;
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
/// (batch, kv head), or `None` for the combine kernel. Only for the tensor-core kernels on sm_90,
/// 2 to 16 splits, and where every cluster is resident at once with one CTA per SM: left to
/// itself the scheduler packs a cluster two CTAs to an SM, and half the SMs then stream a long
/// context (b = 1, 32/8, 128K: 129 → 150 µs).
fn merge_cluster(
    dev: &CudaDevice,
    kernel: &DecodeKernel,
    units: usize,
    splits: usize,
    cfg: &LaunchConfig,
) -> Result<Option<(ClusterDims, LaunchConfig)>> {
    if kernel.family != CudaKernel::TensorCore
        || kernel.persistent
        || !(2..=MAX_CLUSTER).contains(&splits)
    {
        return Ok(None);
    }
    let Some(smem) = one_cta_per_sm_smem(dev)? else {
        return Ok(None);
    };
    if kernel.cluster_smem_bytes > max_smem_per_cta(dev)? {
        return Ok(None);
    }
    let cfg = LaunchConfig {
        shared_mem_bytes: smem.max(kernel.cluster_smem_bytes) as u32,
        ..*cfg
    };
    let shape = ClusterDims {
        x: splits as u32,
        y: 1,
    };
    let resident = resident_clusters(dev, &kernel.name, &kernel.func, &cfg, shape)?;
    Ok((resident >= units).then_some((shape, cfg)))
}

/// The split plan the CUDA path would use for these inputs.
pub fn split_plan(
    op: &SplitKvAttention,
    dev: &CudaDevice,
    dtype: DType,
    dims: &DecodeDims,
) -> Result<crate::plan::SplitPlan> {
    Ok(prepare(op, dev, dtype, &query_blocks(*dims))?.1)
}

/// Entry point from `SplitKvAttention::cuda_fwd`.
pub fn forward(
    op: &SplitKvAttention,
    (q, q_layout): (&CudaStorage, &Layout),
    (k, k_layout): (&CudaStorage, &Layout),
    (v, v_layout): (&CudaStorage, &Layout),
) -> Result<(CudaStorage, Shape)> {
    let dims = validate::check_layouts(
        (q.dtype(), q_layout),
        (k.dtype(), k_layout),
        (v.dtype(), v_layout),
    )?;
    validate::check_num_splits(op.num_splits)?;
    match q.dtype() {
        DType::F16 => launch::<f16>(op, dims, (q, q_layout), (k, k_layout), (v, v_layout)),
        DType::BF16 => launch::<bf16>(op, dims, (q, q_layout), (k, k_layout), (v, v_layout)),
        DType::F32 => launch::<f32>(op, dims, (q, q_layout), (k, k_layout), (v, v_layout)),
        other => {
            bail!("split-kv attention: dtype {other:?} is not supported; use f32, f16 or bf16")
        }
    }
}

fn launch<T: CudaDType + DeviceRepr>(
    op: &SplitKvAttention,
    dims: DecodeDims,
    (q, q_layout): (&CudaStorage, &Layout),
    (k, k_layout): (&CudaStorage, &Layout),
    (v, v_layout): (&CudaStorage, &Layout),
) -> Result<(CudaStorage, Shape)> {
    let dev = q.device().clone();
    let elem_bytes = std::mem::size_of::<T>();
    let (q_strides, k_strides, v_strides) = (
        RowStrides::of(q_layout),
        RowStrides::of(k_layout),
        RowStrides::of(v_layout),
    );
    check_alignment("q", &q_strides, q_layout.dims(), elem_bytes)?;
    check_alignment("k", &k_strides, k_layout.dims(), elem_bytes)?;
    check_alignment("v", &v_strides, v_layout.dims(), elem_bytes)?;
    // From here on a "kv head" is a block of query heads, and wide groups are padded (see
    // `wide_groups`); the output and the LSE keep the caller's heads.
    let real_rows = dims.batch * dims.q_heads;
    let blocks = query_blocks(dims);
    let dims = blocks.dims;
    if dims.kv_len > i32::MAX as usize {
        bail!(
            "split-kv attention: kv_len {} exceeds {}",
            dims.kv_len,
            i32::MAX
        )
    }

    let (kernel, plan) = prepare(op, &dev, q.dtype(), &blocks)?;
    let smem = kernel.smem_bytes;
    debug_assert!(plan.num_splits <= MAX_SPLITS);

    let items = plan.num_splits * dims.batch * dims.kv_heads;
    let grid_dim = if kernel.persistent {
        let ctas = crate::plan::persistent_ctas(items, kernel.resident);
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
        block_dim: (DECODE_THREADS, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let units = dims.batch * dims.kv_heads;
    let (cluster, cfg) = match merge_cluster(&dev, &kernel, units, plan.num_splits, &cfg)? {
        Some((size, cluster_cfg)) => (Some(size), cluster_cfg),
        None => (None, cfg),
    };
    // The last CTA of each group merges where the group's partials are few enough for one SM to
    // read quickly; the persistent and CUDA-core kernels, and plans beyond the counters, merge in
    // the combine pass.
    let group_partial_bytes = dims.group_size() * plan.num_splits * (dims.head_dim + 1) * 4;
    let counters = if plan.num_splits > 1
        && cluster.is_none()
        && kernel.family == CudaKernel::TensorCore
        && !kernel.persistent
        && units <= SPLIT_COUNTERS
        && group_partial_bytes <= LAST_CTA_MERGE_BYTES
    {
        split_counters(&dev)?
    } else {
        None
    };
    let merge = match (cluster, counters) {
        (Some(_), _) => SplitMerge::InCluster,
        (None, Some(_)) => SplitMerge::ByLastCta,
        (None, None) => SplitMerge::CombinePass,
    };
    let combine_pass = plan.num_splits > 1 && merge == SplitMerge::CombinePass;
    let merge_suffix = if merge == SplitMerge::ByLastCta {
        "_last_cta"
    } else {
        ""
    };
    let lockstep = match cluster {
        None => lockstep_cluster(&dev, &kernel, &blocks, merge_suffix, plan.num_splits)?,
        Some(_) => None,
    };
    let decode = match (&lockstep, merge_suffix) {
        (Some((_, func)), _) => func.clone(),
        (None, "") => kernel.func.clone(),
        (None, suffix) => kernel.form(&dev, suffix)?,
    };
    let cluster = cluster.or(lockstep.map(|(shape, _)| shape));

    let padded_rows = dims.batch * dims.q_heads;
    // Every allocation is a node in a captured graph, so allocate only what this call needs: the
    // LSE when the caller asked for it, and one scratch buffer (partial outputs, then their LSEs)
    // when the splits merge through memory (the combine pass or the last CTA).
    // SAFETY (all three): every element is written by the partial kernel (one split, or a
    // cluster or last-CTA merge) or the combine kernel before anything reads it; the tests
    // poison them to prove it.
    let out = unsafe { dev.alloc::<T>(real_rows * dims.head_dim)? };
    let lse = if op.wants_lse() {
        Some(unsafe { dev.alloc::<f32>(real_rows)? })
    } else {
        None
    };
    let scratch = if plan.num_splits > 1 && merge != SplitMerge::InCluster {
        Some(unsafe { dev.alloc::<f32>(padded_rows * plan.num_splits * (dims.head_dim + 1))? })
    } else {
        None
    };
    if op.poison_scratch {
        poison(&dev, &out)?;
        if let Some(lse) = &lse {
            poison(&dev, lse)?;
        }
        if let Some(scratch) = &scratch {
            poison(&dev, scratch)?;
        }
    }
    let lse_ptr = lse.as_ref().map_or(0, |l| device_ptr(l, &dev, 0));
    let partial_out_ptr = scratch.as_ref().map_or(0, |s| device_ptr(s, &dev, 0));
    let partial_lse_ptr = scratch.as_ref().map_or(0, |s| {
        device_ptr(s, &dev, padded_rows * plan.num_splits * dims.head_dim)
    });

    let seqlens_guard;
    let seqlens_ptr = match &op.seqlens_k {
        None => 0,
        Some(t) => {
            let (storage, layout) = t.storage_and_layout();
            seqlens_guard = storage;
            let Storage::Cuda(s) = &*seqlens_guard else {
                bail!("split-kv attention: seqlens_k must be on q's CUDA device")
            };
            device_ptr(s.as_cuda_slice::<u32>()?, &dev, layout.start_offset())
        }
    };
    if op.seqlens_k.as_ref().is_some_and(|t| !t.is_contiguous()) {
        bail!("split-kv attention: seqlens_k must be contiguous")
    }

    let params = DecodeParams {
        q: device_ptr(q.as_cuda_slice::<T>()?, &dev, q_strides.offset),
        k: device_ptr(k.as_cuda_slice::<T>()?, &dev, k_strides.offset),
        v: device_ptr(v.as_cuda_slice::<T>()?, &dev, v_strides.offset),
        out: device_ptr(&out, &dev, 0),
        lse_out: lse_ptr,
        partial_out: partial_out_ptr,
        partial_lse: partial_lse_ptr,
        seqlens: seqlens_ptr,
        split_counters: counters.unwrap_or(0),
        q_batch_stride: q_strides.batch as i64,
        q_head_stride: q_strides.head as i64,
        k_batch_stride: k_strides.batch as i64,
        k_seq_stride: k_strides.seq as i64,
        k_head_stride: k_strides.head as i64,
        v_batch_stride: v_strides.batch as i64,
        v_seq_stride: v_strides.seq as i64,
        v_head_stride: v_strides.head as i64,
        batch: dims.batch as i32,
        q_heads: dims.q_heads as i32,
        kv_heads: dims.kv_heads as i32,
        kv_len: dims.kv_len as i32,
        num_splits: plan.num_splits as i32,
        chunk_size: plan.chunk_size.min(i32::MAX as usize) as i32,
        scale_log2: op.softmax_scale * std::f32::consts::LOG2_E,
        merge,
        blocks_per_kv_head: blocks.blocks_per_kv_head as i32,
        padded_group: blocks.padded_group as i32,
        real_group: blocks.real_group as i32,
        lockstep_tiles: LOCKSTEP_TILES,
    };
    // SAFETY: the kernel reads q/k/v within the validated shapes and strides, reads seqlens for
    // `batch` entries, and writes only the buffers allocated above, sized for this launch, and
    // (last-CTA merge) the first `units` split counters, which it leaves at zero; it touches
    // global memory only after its launch dependency resolves.
    unsafe { launch_dependent(&decode, &dev, cfg, cluster, &params)? };

    if combine_pass {
        let combine = dev.get_or_load_custom_func(
            &format!("split_kv_combine_{}", dtype_tag(q.dtype())?),
            "split_kv_combine",
            COMBINE_PTX,
        )?;
        let params = CombineParams {
            partial_out: partial_out_ptr,
            partial_lse: partial_lse_ptr,
            out: device_ptr(&out, &dev, 0),
            lse_out: lse_ptr,
            rows: real_rows as i32,
            num_splits: plan.num_splits as i32,
            head_dim: dims.head_dim as i32,
            padded_group: blocks.padded_group as i32,
            real_group: blocks.real_group as i32,
            reserved: 0,
        };
        let cfg = LaunchConfig {
            grid_dim: (real_rows as u32, 1, 1),
            block_dim: (COMBINE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `split_kv_combine_*` takes one `CombineParams`; it reads the partial buffers
        // written above and writes `real_rows` outputs.
        unsafe { launch_dependent(&combine, &dev, cfg, None, &params)? };
    }
    drop(scratch);

    op.deliver_lse(|| {
        let Some(lse) = lse else {
            bail!("split-kv attention: LSE requested but not allocated")
        };
        let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(lse, dev.clone()));
        Ok(Tensor::from_storage(
            storage,
            (dims.batch, real_rows / dims.batch, 1),
            candle_core::op::BackpropOp::none(),
            false,
        ))
    })?;
    Ok((
        CudaStorage::wrap_cuda_slice(out, dev),
        q_layout.shape().clone(),
    ))
}
