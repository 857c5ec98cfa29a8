//! The decode op on CUDA: checks what the kernels need of the inputs, allocates exactly the
//! buffers this call needs, and launches the partial pass and, where the splits merge through
//! memory, the combine pass.

use candle_core::backend::BackendStorage;
use candle_core::cuda::CudaDType;
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result, Storage, Tensor};
use cudarc::driver::{DeviceRepr, LaunchConfig};
use float8::F8E4M3;
use half::{bf16, f16};

use super::kernels::{CombineParams, DecodeParams, KernelForm, SplitMerge};
use super::launch::{device_ptr, launch_dependent, tensor_ptr};
use super::lockstep::LOCKSTEP_TILES;
use super::planner::{self, prepare};
use super::wide_groups::query_blocks;
use crate::op::call::DecodeCall;
use crate::op::page_divisor::PageDivisor;
use crate::op::plan::{SplitPlan, CHUNK_ALIGN, MAX_SPLITS};
use crate::op::validate::RowStrides;

/// The split plan the CUDA path would use for this call, for `dtype` queries and K/V stored as
/// `kv_dtype`.
pub(crate) fn split_plan(
    call: &DecodeCall,
    dev: &CudaDevice,
    dtypes: (DType, DType),
) -> Result<SplitPlan> {
    Ok(prepare(call, dev, dtypes, &query_blocks(call.dims))?.1)
}

/// Runs a validated call: the output, and the natural-log LSE `(b, h_q, t)` where the call asked
/// for it.
pub(crate) fn forward(
    call: &DecodeCall,
    q: (&CudaStorage, &Layout),
    k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
) -> Result<(CudaStorage, Option<Tensor>)> {
    match (q.0.dtype(), k.0.dtype()) {
        (DType::F16, DType::F16) => launch::<f16, f16>(call, q, k, v),
        (DType::BF16, DType::BF16) => launch::<bf16, bf16>(call, q, k, v),
        (DType::F32, DType::F32) => launch::<f32, f32>(call, q, k, v),
        (DType::F16, DType::F8E4M3) => launch::<f16, F8E4M3>(call, q, k, v),
        (DType::BF16, DType::F8E4M3) => launch::<bf16, F8E4M3>(call, q, k, v),
        (q_dtype, k_dtype) => bail!(
            "split-kv attention: q {q_dtype:?} with K/V {k_dtype:?} is not supported on CUDA; \
             use f32, f16 or bf16 throughout, or f16/bf16 q with f8e4m3 K/V"
        ),
    }
}

/// The cp.async loads move 16 bytes at a time, so every K/V row must start on a 16-byte boundary.
pub(crate) fn check_alignment(
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

/// The device address of the call's u32 tensor `name` (`seqlens_k`, `block_table`), or 0 where
/// the call has none.
pub(crate) fn u32_ptr(name: &str, t: Option<&Tensor>, dev: &CudaDevice) -> Result<u64> {
    let Some(t) = t else {
        return Ok(0);
    };
    if !t.is_contiguous() {
        bail!("split-kv attention: {name} must be contiguous")
    }
    // The op holds the tensor until the call returns.
    match tensor_ptr::<u32>(t, dev)? {
        Some(ptr) => Ok(ptr),
        None => bail!("split-kv attention: {name} must be on q's CUDA device"),
    }
}

/// T: the query and output type; KV: how K and V are stored (T, or fp8).
fn launch<T: CudaDType + DeviceRepr, KV: CudaDType + DeviceRepr>(
    call: &DecodeCall,
    (q, q_layout): (&CudaStorage, &Layout),
    (k, k_layout): (&CudaStorage, &Layout),
    (v, v_layout): (&CudaStorage, &Layout),
) -> Result<(CudaStorage, Option<Tensor>)> {
    let dev = q.device().clone();
    let (elem_bytes, kv_bytes) = (std::mem::size_of::<T>(), std::mem::size_of::<KV>());
    let (q_strides, k_strides, v_strides) = (
        RowStrides::of(q_layout),
        RowStrides::of(k_layout),
        RowStrides::of(v_layout),
    );
    check_alignment("q", &q_strides, q_layout.dims(), elem_bytes)?;
    check_alignment("k", &k_strides, k_layout.dims(), kv_bytes)?;
    check_alignment("v", &v_strides, v_layout.dims(), kv_bytes)?;
    if call.dims.kv_len > i32::MAX as usize {
        bail!(
            "split-kv attention: kv_len {} exceeds {}",
            call.dims.kv_len,
            i32::MAX
        )
    }
    // From here on a "kv head" is a block of query rows (heads × tokens), and wide groups are
    // padded (see `wide_groups`); the output and the LSE keep the caller's shapes.
    let real_rows = call.dims.batch * call.dims.q_heads * call.dims.q_len;
    let blocks = query_blocks(call.dims);
    let dims = blocks.dims;

    let (kernel, plan) = prepare(call, &dev, (q.dtype(), k.dtype()), &blocks)?;
    #[cfg(feature = "test-hooks")]
    crate::test_hooks::record_decode_kernel(kernel.spec.symbol);
    debug_assert!(plan.num_splits <= MAX_SPLITS);
    let launch = planner::launch(&dev, &kernel, &blocks, plan)?;
    let merges_through_memory = plan.num_splits > 1 && launch.merge != SplitMerge::InCluster;

    let padded_rows = dims.batch * dims.q_heads;
    // Every allocation is a node in a captured graph, so allocate only what this call needs: the
    // LSE when the caller asked for it, and one scratch buffer (partial outputs, then their LSEs)
    // when the splits merge through memory (the combine pass or the last CTA).
    // SAFETY (all three): every element is written by the partial kernel (one split, or a
    // cluster or last-CTA merge) or the combine kernel before anything reads it; the tests
    // poison them to prove it.
    let out = unsafe { dev.alloc::<T>(real_rows * dims.head_dim)? };
    let lse = if call.want_lse {
        Some(unsafe { dev.alloc::<f32>(real_rows)? })
    } else {
        None
    };
    let scratch = if merges_through_memory {
        Some(unsafe { dev.alloc::<f32>(padded_rows * plan.num_splits * (dims.head_dim + 1))? })
    } else {
        None
    };
    #[cfg(feature = "test-hooks")]
    {
        use crate::test_hooks::poison;
        poison(&dev, &out)?;
        if let Some(lse) = &lse {
            poison(&dev, lse)?;
        }
        if let Some(scratch) = &scratch {
            poison(&dev, scratch)?;
        }
    }
    let pages = call.dims.pages;
    let divisor = PageDivisor::new(pages.map_or(1, |p| p.page_size) as u32);
    let lse_ptr = lse.as_ref().map_or(0, |l| device_ptr(l, &dev, 0));
    let partial_out_ptr = scratch.as_ref().map_or(0, |s| device_ptr(s, &dev, 0));
    let partial_lse_ptr = scratch.as_ref().map_or(0, |s| {
        device_ptr(s, &dev, padded_rows * plan.num_splits * dims.head_dim)
    });

    let params = DecodeParams {
        q: device_ptr(q.as_cuda_slice::<T>()?, &dev, q_strides.offset),
        k: device_ptr(k.as_cuda_slice::<KV>()?, &dev, k_strides.offset),
        v: device_ptr(v.as_cuda_slice::<KV>()?, &dev, v_strides.offset),
        out: device_ptr(&out, &dev, 0),
        lse_out: lse_ptr,
        partial_out: partial_out_ptr,
        partial_lse: partial_lse_ptr,
        seqlens: u32_ptr("seqlens_k", call.seqlens_k, &dev)?,
        split_counters: launch.counters.unwrap_or(0),
        q_batch_stride: q_strides.batch as i64,
        q_seq_stride: q_strides.seq as i64,
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
        scale_log2: call.softmax_scale * call.k_scale * std::f32::consts::LOG2_E,
        v_scale: call.v_scale,
        merge: launch.merge as i32,
        blocks_per_kv_head: blocks.blocks_per_kv_head as i32,
        padded_group: blocks.padded_group as i32,
        real_group: blocks.real_group as i32,
        lockstep_tiles: LOCKSTEP_TILES,
        query_tokens: call.dims.q_len as i32,
        out_heads: call.dims.q_heads as i32,
        chunk_align: CHUNK_ALIGN as i32,
        window_left: call
            .window_left
            .map_or(-1, |w| w.min(i32::MAX as usize) as i32),
        window_right: call.window_right.min(i32::MAX as usize) as i32,
        softcap_log2: call.softcap.map_or(0.0, |c| c * std::f32::consts::LOG2_E),
        softcap_exp2: call.softcap.map_or(0.0, |c| 2.0 / c),
        block_table: u32_ptr("block_table", call.block_table, &dev)?,
        max_pages: pages.map_or(0, |p| p.max_pages) as i32,
        page_size: pages.map_or(0, |p| p.page_size) as i32,
        page_magic: divisor.magic,
        page_shift: divisor.shift as i32,
    };
    // SAFETY: the kernel reads q/k/v within the validated shapes and strides (paged: within the
    // pages the caller's block table names, which the docs make the caller's duty on CUDA),
    // reads seqlens for `batch` entries, and writes only the buffers allocated above, sized for this launch, and
    // (last-CTA merge) the first `units` split counters, which it leaves at zero; it touches
    // global memory only after its launch dependency resolves.
    unsafe { launch_dependent(&launch.func, &dev, launch.cfg, launch.cluster, &params)? };

    if merges_through_memory && launch.merge == SplitMerge::ByCombinePass {
        let Some(spec) = KernelForm::Combine.find(q.dtype(), q.dtype(), 0, 0) else {
            bail!("split-kv attention: no combine kernel for {:?}", q.dtype())
        };
        let combine = spec.load(&dev)?;
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
            query_tokens: call.dims.q_len as i32,
            out_heads: call.dims.q_heads as i32,
        };
        let cfg = LaunchConfig {
            grid_dim: (real_rows as u32, 1, 1),
            block_dim: (spec.threads, 1, 1),
            shared_mem_bytes: spec.smem_bytes as u32,
        };
        // SAFETY: the combine kernel takes one `CombineParams`; it reads the partial buffers
        // written above and writes `real_rows` outputs.
        unsafe { launch_dependent(&combine, &dev, cfg, None, &params)? };
    }
    drop(scratch);

    let lse = lse.map(|lse| {
        let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(lse, dev.clone()));
        Tensor::from_storage(
            storage,
            (call.dims.batch, call.dims.q_heads, call.dims.q_len),
            candle_core::op::BackpropOp::none(),
            false,
        )
    });
    Ok((CudaStorage::wrap_cuda_slice(out, dev), lse))
}
