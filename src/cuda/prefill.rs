//! Calls with many query tokens on CUDA: the causal prefill kernels (kernels/prefill.cuh on
//! mma.sync, kernels/prefill_sm90.cuh on Hopper's warpgroup products). One CTA runs a tile of a
//! kv head's query rows (query tokens × the heads of its group) against that kv head's K/V, so
//! the K/V stream once per tile rather than once per 16 rows as in the decode forms; the host
//! picks the form, cuts each tile's keys into splits where the tiles alone leave the GPU idle,
//! and merges the splits in the combine pass.

use candle_core::backend::BackendStorage;
use candle_core::cuda::{CudaDType, WrapErr};
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result, Storage, Tensor};
use cudarc::driver::{sys, CudaFunction, DeviceRepr, LaunchConfig, PushKernelArg};

use super::decode::{check_alignment, u32_ptr};
use super::kernels::{CombineParams, KernelForm, KernelSpec, PrefillParams};
use super::launch::{device_ptr, resident_ctas, Residency};
use super::tensor_map::{TensorMap, Tiled4d};
use crate::op::call::{CudaKernel, DecodeCall};
use crate::op::page_divisor::PageDivisor;
use crate::op::plan::{SplitPlan, MAX_SPLITS};
use crate::op::validate::{RowStrides, MAX_QUERY_TOKENS};

/// Rows of one decode block (the tensor-core decode forms' M dimension): the decode forms stream
/// a kv head's K/V once per block of its query rows.
const DECODE_BLOCK_ROWS: usize = 16;

/// Decode blocks per kv head up to which the decode forms stay ahead at few query tokens: beyond
/// it they re-stream the same K/V once per block, where one prefill tile streams it once.
const DECODE_BLOCKS_PER_KV_HEAD: usize = 2;

/// Most splits a prefill tile's keys are cut into.
const MAX_PREFILL_SPLITS: usize = 64;

/// Fewest K/V tiles a split keeps: fewer would spend more on the split's setup and merge than
/// it saves.
const MIN_TILES_PER_SPLIT: usize = 4;

/// The prefill kernel families.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PrefillFamily {
    /// kernels/prefill.cuh: every sm_80+ target, fp8 K/V, windows and soft-capping, every head dim.
    MmaSync,
    /// kernels/prefill_sm90.cuh: sm_90a builds on a compute capability 9.0 device; K/V in q's
    /// dtype or fp8, head dims 64, 128 and 256, no window or soft-capping.
    Wgmma,
}

/// The prefill kernel for a call, or `None` where the decode forms run it: the decode forms
/// for a few query tokens unless their blocks would re-stream the K/V too often, else the sm_90a
/// form where it runs and covers the call, else the mma.sync form. `forced` (tests) names the
/// prefill family for every call instead.
pub(crate) fn route(
    call: &DecodeCall,
    dev: &CudaDevice,
    (dtype, kv_dtype): (DType, DType),
    forced: Option<PrefillFamily>,
) -> Result<Option<&'static KernelSpec>> {
    let t = call.dims.q_len;
    let family = match forced {
        None => {
            // The decode forms take a few query tokens in every dtype, and stay the choice
            // where the caller picked their CUDA-core family.
            let decode_takes = t <= MAX_QUERY_TOKENS
                && (call.cuda_kernel == CudaKernel::CudaCore
                    || !decode_falls_behind(call, dev)?
                    || !KernelForm::PrefillMma.compiled_for(dtype, kv_dtype));
            if decode_takes {
                return Ok(None);
            }
            if wgmma_covers(call, dev, dtype, kv_dtype)? {
                PrefillFamily::Wgmma
            } else {
                PrefillFamily::MmaSync
            }
        }
        Some(PrefillFamily::MmaSync) => PrefillFamily::MmaSync,
        Some(PrefillFamily::Wgmma) => {
            if !wgmma_covers(call, dev, dtype, kv_dtype)? {
                bail!(
                    "split-kv attention: the sm_90a prefill form does not take this call: it needs \
                     a build for compute capability 90 on a 9.0 device, f16/bf16 q with K/V of \
                     the same dtype or f8e4m3, head dim 64, 128 or 256, and no window or \
                     soft-capping"
                )
            }
            PrefillFamily::Wgmma
        }
    };
    if !matches!(dtype, DType::F16 | DType::BF16) {
        bail!(
            "split-kv attention: on CUDA, more than {MAX_QUERY_TOKENS} query tokens per sequence \
             take f16 or bf16 q (the prefill kernels run on tensor cores), got {dtype:?}"
        )
    }
    if kv_dtype != dtype && kv_dtype != DType::F8E4M3 {
        bail!(
            "split-kv attention: the prefill kernels take K/V in q's dtype or f8e4m3, got q \
             {dtype:?} with K/V {kv_dtype:?}"
        )
    }
    let windowed = call.windowed();
    let paged = call.dims.pages.is_some();
    let form = match (family, windowed, paged) {
        (PrefillFamily::Wgmma, _, false) => KernelForm::PrefillSm90,
        (PrefillFamily::Wgmma, _, true) => KernelForm::PrefillSm90Paged,
        (PrefillFamily::MmaSync, false, false) => KernelForm::PrefillMma,
        (PrefillFamily::MmaSync, true, false) => KernelForm::PrefillMmaWindowed,
        (PrefillFamily::MmaSync, false, true) => KernelForm::PrefillMmaPaged,
        (PrefillFamily::MmaSync, true, true) => KernelForm::PrefillMmaWindowedPaged,
    };
    match form.find(dtype, kv_dtype, call.dims.head_dim, 0) {
        Some(spec) => Ok(Some(spec)),
        None if kv_dtype == DType::F8E4M3 => bail!(
            "split-kv attention: fp8 (f8e4m3) K/V need a build for compute capability 89 or \
             later, this one targets {}",
            super::launch::compiled_compute_cap()
        ),
        None => bail!(
            "split-kv attention: no {form:?} kernel for {dtype:?} q, {kv_dtype:?} K/V and head \
             dim {} in this build",
            call.dims.head_dim
        ),
    }
}

/// Whether the decode forms, at t ≤ [`MAX_QUERY_TOKENS`], would stream each kv head's K/V more
/// than [`DECODE_BLOCKS_PER_KV_HEAD`] times and have more blocks than the GPU has SMs, so that
/// they cannot make up for it with splits: then one prefill tile per kv head does the same work
/// in one pass over the K/V.
fn decode_falls_behind(call: &DecodeCall, dev: &CudaDevice) -> Result<bool> {
    let dims = &call.dims;
    let rows = dims.q_len * dims.group_size();
    let blocks_per_kv_head = rows.div_ceil(DECODE_BLOCK_ROWS);
    if blocks_per_kv_head <= DECODE_BLOCKS_PER_KV_HEAD {
        return Ok(false);
    }
    Ok(dims.batch * dims.kv_heads * blocks_per_kv_head >= multiprocessors(dev)?)
}

fn multiprocessors(dev: &CudaDevice) -> Result<usize> {
    let sms = dev
        .cuda_stream()
        .context()
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .w()?;
    Ok(sms.max(1) as usize)
}

/// Whether the sm_90a form is compiled for the call and runs on `dev`: its code targets the
/// architecture-specific sm_90a, which only a compute capability 9.0 device loads.
fn wgmma_covers(
    call: &DecodeCall,
    dev: &CudaDevice,
    dtype: DType,
    kv_dtype: DType,
) -> Result<bool> {
    let kv_takes = kv_dtype == dtype || kv_dtype == DType::F8E4M3;
    if !kv_takes || call.windowed() {
        return Ok(false);
    }
    if KernelForm::PrefillSm90
        .find(dtype, kv_dtype, call.dims.head_dim, 0)
        .is_none()
    {
        return Ok(false);
    }
    let context = dev.cuda_stream().context().clone();
    let major = context
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
        .w()?;
    let minor = context
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
        .w()?;
    Ok((major, minor) == (9, 0))
}

/// A prefill kernel loaded on a device, with how many of its CTAs the GPU holds at once.
struct PrefillKernel {
    spec: &'static KernelSpec,
    func: CudaFunction,
    residency: Residency,
}

impl PrefillKernel {
    fn load(dev: &CudaDevice, spec: &'static KernelSpec) -> Result<Self> {
        let func = spec.load(dev)?;
        // Also raises the kernel's dynamic shared-memory limit to what it needs.
        let residency = resident_ctas(dev, spec.symbol, &func, spec.threads, spec.smem_bytes)?;
        Ok(Self {
            spec,
            func,
            residency,
        })
    }

    /// CTAs of a launch with `items` work items: the sm_90a forms are persistent, each CTA
    /// taking items round after round (kernels/prefill_sm90.cuh), so that one item's copies
    /// overlap the end of the one before; as many as fit on the GPU at once. The mma.sync form
    /// runs one CTA per item.
    fn ctas(&self, items: usize) -> usize {
        if !matches!(
            self.spec.form,
            KernelForm::PrefillSm90 | KernelForm::PrefillSm90Paged
        ) {
            return items;
        }
        let resident = self.residency.total().max(1);
        #[cfg(feature = "test-hooks")]
        let resident = crate::test_hooks::forced_persistent_ctas().unwrap_or(resident);
        items.min(resident).max(1)
    }

    /// Query tiles of one (batch, kv head).
    fn query_tiles(&self, call: &DecodeCall) -> usize {
        (call.dims.q_len * call.dims.group_size()).div_ceil(self.spec.tile_rows.max(1))
    }

    /// The split count: the forced one (clamped to the K/V tiles and [`MAX_SPLITS`]), or the
    /// rule below. Causal work with a short past is uneven, and the grid's longest-first order
    /// balances it: no split once the work items fill the GPU. Otherwise the items are about
    /// equal and the time goes as waves per unit of work, ⌈items·s / slots⌉ / s, with a small
    /// charge per split for the merge; each split keeps at least [`MIN_TILES_PER_SPLIT`] tiles.
    fn splits(&self, call: &DecodeCall) -> usize {
        let dims = &call.dims;
        let keys = self.spec.tile_keys.max(1);
        let key_tiles = dims.kv_len.div_ceil(keys).max(1);
        if let Some(n) = call.num_splits {
            return n.clamp(1, key_tiles.min(MAX_SPLITS));
        }
        let items = self.query_tiles(call) * dims.kv_heads * dims.batch;
        let slots = self.residency.total().max(1);
        let past = dims.kv_len.saturating_sub(dims.q_len);
        if items >= slots && past < dims.q_len {
            return 1;
        }
        let cost = |s: usize| {
            (items * s).div_ceil(slots) as f64 / s as f64 * (1.0 + 0.02 * (s - 1) as f64)
        };
        let mut best = 1;
        for s in 2..=MAX_PREFILL_SPLITS.min(MAX_SPLITS) {
            if key_tiles / s < MIN_TILES_PER_SPLIT {
                break;
            }
            if cost(s) < cost(best) - 1e-9 {
                best = s;
            }
        }
        best
    }
}

/// The split plan a prefill call runs with: its split count, and the K/V positions of a split
/// of the longest sequence.
pub(crate) fn split_plan(
    call: &DecodeCall,
    dev: &CudaDevice,
    spec: &'static KernelSpec,
) -> Result<SplitPlan> {
    let kernel = PrefillKernel::load(dev, spec)?;
    let num_splits = kernel.splits(call);
    Ok(SplitPlan {
        num_splits,
        chunk_size: call.dims.kv_len.div_ceil(num_splits).max(1),
    })
}

/// Runs a validated call on the prefill kernel `spec`: the output, and the natural-log LSE
/// `(b, h_q, t)` where the call asked for it.
pub(crate) fn forward(
    call: &DecodeCall,
    spec: &'static KernelSpec,
    q: (&CudaStorage, &Layout),
    k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
) -> Result<(CudaStorage, Option<Tensor>)> {
    match (q.0.dtype(), k.0.dtype()) {
        (DType::F16, DType::F16) => launch::<half::f16, half::f16>(call, spec, q, k, v),
        (DType::BF16, DType::BF16) => launch::<half::bf16, half::bf16>(call, spec, q, k, v),
        (DType::F16, DType::F8E4M3) => launch::<half::f16, float8::F8E4M3>(call, spec, q, k, v),
        (DType::BF16, DType::F8E4M3) => launch::<half::bf16, float8::F8E4M3>(call, spec, q, k, v),
        (q_dtype, k_dtype) => bail!(
            "split-kv attention: the prefill kernels take f16 or bf16 q with K/V of the same \
             dtype or f8e4m3, got q {q_dtype:?} with K/V {k_dtype:?}"
        ),
    }
}

/// What the kernels assume of the call (the guarantees at the top of kernels/prefill.cuh), as
/// errors: every row 16-byte aligned, and a K/V tile's rows within 2³¹ bytes of its first.
fn check_guarantees(
    call: &DecodeCall,
    spec: &KernelSpec,
    layouts: [(&str, &Layout, usize); 3],
) -> Result<()> {
    let scale = call.softmax_scale * call.k_scale;
    if !(scale.is_finite() && scale > 0.0) {
        bail!(
            "split-kv attention: with more than {MAX_QUERY_TOKENS} query tokens the softmax scale \
             (times the K scale) must be finite and positive, got {scale}"
        )
    }
    for (name, layout, elem_bytes) in layouts {
        let strides = RowStrides::of(layout);
        check_alignment(name, &strides, layout.dims(), elem_bytes)?;
        if name != "q" {
            let span = strides.seq as u128 * elem_bytes as u128 * spec.tile_keys as u128;
            if span >= 1 << 31 {
                bail!(
                    "split-kv attention: the prefill kernels address a tile of {} {name} rows \
                     within 2^31 bytes, but {name}'s row stride is {} elements; call \
                     .contiguous() on {name} first",
                    spec.tile_keys,
                    strides.seq
                )
            }
        }
    }
    if call.dims.kv_len > i32::MAX as usize {
        bail!(
            "split-kv attention: kv_len {} exceeds {}",
            call.dims.kv_len,
            i32::MAX
        )
    }
    Ok(())
}

/// T: the query and output type; KV: how K and V are stored (T, or fp8).
fn launch<T: CudaDType + DeviceRepr, KV: CudaDType + DeviceRepr>(
    call: &DecodeCall,
    spec: &'static KernelSpec,
    (q, q_layout): (&CudaStorage, &Layout),
    (k, k_layout): (&CudaStorage, &Layout),
    (v, v_layout): (&CudaStorage, &Layout),
) -> Result<(CudaStorage, Option<Tensor>)> {
    let dev = q.device().clone();
    let (elem_bytes, kv_bytes) = (std::mem::size_of::<T>(), std::mem::size_of::<KV>());
    check_guarantees(
        call,
        spec,
        [
            ("q", q_layout, elem_bytes),
            ("k", k_layout, kv_bytes),
            ("v", v_layout, kv_bytes),
        ],
    )?;
    let dims = call.dims;
    let kernel = PrefillKernel::load(&dev, spec)?;
    let num_splits = kernel.splits(call);
    let query_tiles = kernel.query_tiles(call);
    let items = query_tiles * dims.kv_heads * dims.batch * num_splits;
    if items > i32::MAX as usize {
        bail!(
            "split-kv attention: {items} prefill work items exceed the grid's limit of {}; split \
             the call into smaller batches",
            i32::MAX
        )
    }
    let grid = kernel.ctas(items);
    let rows = dims.batch * dims.q_heads * dims.q_len;
    let d = dims.head_dim;
    // SAFETY (all three): the prefill kernel writes every output and LSE element (one split) or
    // every partial (several), and the combine pass every output and LSE element from them,
    // before anything reads them; the tests poison them to prove it.
    let out = unsafe { dev.alloc::<T>(rows * d)? };
    let lse = if call.want_lse {
        Some(unsafe { dev.alloc::<f32>(rows)? })
    } else {
        None
    };
    let scratch = if num_splits > 1 {
        Some(unsafe { dev.alloc::<f32>(rows * num_splits * (d + 1))? })
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
    let (q_strides, k_strides, v_strides) = (
        RowStrides::of(q_layout),
        RowStrides::of(k_layout),
        RowStrides::of(v_layout),
    );
    let pages = dims.pages;
    let divisor = PageDivisor::new(pages.map_or(1, |p| p.page_size) as u32);
    let lse_ptr = lse.as_ref().map_or(0, |l| device_ptr(l, &dev, 0));
    let partial_out = scratch.as_ref().map_or(0, |s| device_ptr(s, &dev, 0));
    let partial_lse = scratch
        .as_ref()
        .map_or(0, |s| device_ptr(s, &dev, rows * num_splits * d));
    // The sm_90a form copies whole tiles of contiguous or strided 16-bit K/V by TMA: K and V as
    // (d, position, kv head, batch), a box one 64-dim column block of a tile.
    let k_ptr = device_ptr(k.as_cuda_slice::<KV>()?, &dev, k_strides.offset);
    let v_ptr = device_ptr(v.as_cuda_slice::<KV>()?, &dev, v_strides.offset);
    let tma_map = |base: u64, strides: &RowStrides| {
        if spec.form != KernelForm::PrefillSm90 || spec.kv_dtype != spec.dtype {
            return None;
        }
        Tiled4d {
            dtype: spec.dtype,
            base,
            dims: [
                d as u64,
                dims.kv_len as u64,
                dims.kv_heads as u64,
                dims.batch as u64,
            ],
            strides: [strides.seq, strides.head, strides.batch].map(|s| (s * kv_bytes) as u64),
            box_dims: [64, spec.tile_keys as u32, 1, 1],
        }
        .encode()
    };
    let (k_map, v_map) = (tma_map(k_ptr, &k_strides), tma_map(v_ptr, &v_strides));
    let params = PrefillParams {
        q: device_ptr(q.as_cuda_slice::<T>()?, &dev, q_strides.offset),
        k: k_ptr,
        v: v_ptr,
        out: device_ptr(&out, &dev, 0),
        lse_out: lse_ptr,
        partial_out,
        partial_lse,
        seqlens: u32_ptr("seqlens_k", call.seqlens_k, &dev)?,
        block_table: u32_ptr("block_table", call.block_table, &dev)?,
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
        query_tokens: dims.q_len as i32,
        num_splits: num_splits as i32,
        scale_log2: call.softmax_scale * call.k_scale * std::f32::consts::LOG2_E,
        v_scale: call.v_scale,
        window_left: call
            .window_left
            .map_or(-1, |w| w.min(i32::MAX as usize) as i32),
        window_right: call.window_right.min(i32::MAX as usize) as i32,
        softcap_log2: call.softcap.map_or(0.0, |c| c * std::f32::consts::LOG2_E),
        softcap_exp2: call.softcap.map_or(0.0, |c| 2.0 / c),
        max_pages: pages.map_or(0, |p| p.max_pages) as i32,
        page_size: pages.map_or(0, |p| p.page_size) as i32,
        page_magic: divisor.magic,
        page_shift: divisor.shift as i32,
        tma: i32::from(k_map.is_some() && v_map.is_some()),
        k_map: k_map.unwrap_or(TensorMap::NONE),
        v_map: v_map.unwrap_or(TensorMap::NONE),
    };
    let cfg = LaunchConfig {
        grid_dim: (grid as u32, 1, 1),
        block_dim: (spec.threads, 1, 1),
        shared_mem_bytes: spec.smem_bytes as u32,
    };
    let stream = dev.cuda_stream();
    let mut builder = stream.launch_builder(&kernel.func);
    builder.arg(&params);
    // SAFETY: the kernel takes one `PrefillParams`; it reads q/k/v within the validated shapes
    // and strides (paged: within the pages the caller's block table names, the caller's duty
    // on CUDA), seqlens for `batch` entries, and writes only the buffers allocated above.
    unsafe { builder.launch(cfg) }.w()?;

    if num_splits > 1 {
        let Some(combine) = KernelForm::Combine.find(q.dtype(), q.dtype(), 0, 0) else {
            bail!("split-kv attention: no combine kernel for {:?}", q.dtype())
        };
        let func = combine.load(&dev)?;
        let group = dims.group_size() as i32;
        let params = CombineParams {
            partial_out,
            partial_lse,
            out: device_ptr(&out, &dev, 0),
            lse_out: lse_ptr,
            rows: rows as i32,
            num_splits: num_splits as i32,
            head_dim: d as i32,
            padded_group: group,
            real_group: group,
            query_tokens: dims.q_len as i32,
            out_heads: dims.q_heads as i32,
        };
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (combine.threads, 1, 1),
            shared_mem_bytes: combine.smem_bytes as u32,
        };
        let mut builder = stream.launch_builder(&func);
        builder.arg(&params);
        // SAFETY: the combine kernel takes one `CombineParams`; it reads the partials written
        // above and writes `rows` outputs and LSEs.
        unsafe { builder.launch(cfg) }.w()?;
    }
    drop(scratch);

    let lse = lse.map(|lse| {
        let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(lse, dev.clone()));
        Tensor::from_storage(
            storage,
            (dims.batch, dims.q_heads, dims.q_len),
            candle_core::op::BackpropOp::none(),
            false,
        )
    });
    Ok((CudaStorage::wrap_cuda_slice(out, dev), lse))
}
