//! Launch helpers shared by the crate's CUDA ops: device pointers, per-kernel residency (cached),
//! thread-block clusters, and launches that overlap the previous kernel.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use candle_core::cuda::CudaDType;
use candle_core::cuda::WrapErr;
use candle_core::cuda_backend::DeviceId;
use candle_core::{CudaDevice, Result, Storage, Tensor};
use cudarc::driver::{
    sys, CudaFunction, CudaSlice, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
};

/// The target architecture build.rs compiled the kernels for.
pub(crate) fn compiled_compute_cap() -> u32 {
    env!("CANDLE_SPLITKV_COMPUTE_CAP").parse().unwrap_or(0)
}

/// The device address of element `offset_elems` of `slice`.
pub(crate) fn device_ptr<T>(slice: &CudaSlice<T>, dev: &CudaDevice, offset_elems: usize) -> u64 {
    let stream = dev.cuda_stream();
    let (ptr, _sync) = slice.device_ptr(&stream);
    ptr + (offset_elems * std::mem::size_of::<T>()) as u64
}

/// The device address of `t`'s first element, or `None` where `t` is not on a CUDA device. The
/// tensor must outlive the launch that uses the address (kernels are ordered on the stream before
/// any later write to it).
pub(crate) fn tensor_ptr<T: CudaDType>(t: &Tensor, dev: &CudaDevice) -> Result<Option<u64>> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(s) = &*storage else {
        return Ok(None);
    };
    Ok(Some(device_ptr(
        s.as_cuda_slice::<T>()?,
        dev,
        layout.start_offset(),
    )))
}

/// Launches `func`, a grid-stride kernel of `threads` threads per CTA taking one parameter block,
/// over `elements` elements: enough CTAs to fill the GPU a few times over (at most `max_ctas`),
/// each thread striding on from there. A plain launch: such kernels read their input at once,
/// so they must not overlap the kernel that wrote it.
///
/// # Safety
/// `params` must be the block `func` takes, and every address in it valid for the elements the
/// kernel reads and writes.
pub(crate) unsafe fn launch_grid_stride<P: DeviceRepr>(
    dev: &CudaDevice,
    func: &CudaFunction,
    threads: u32,
    elements: usize,
    max_ctas: usize,
    params: &P,
) -> Result<()> {
    let cfg = LaunchConfig {
        grid_dim: (
            elements.div_ceil(threads as usize).clamp(1, max_ctas) as u32,
            1,
            1,
        ),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    };
    let stream = dev.cuda_stream();
    let mut builder = stream.launch_builder(func);
    builder.arg(params);
    // SAFETY: the caller's contract.
    unsafe { builder.launch(cfg) }.map(|_| ()).w()
}

/// How many CTAs of one kernel the GPU holds at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Residency {
    pub sms: usize,
    pub per_sm: usize,
}

impl Residency {
    pub fn total(&self) -> usize {
        self.sms * self.per_sm
    }
}

/// Residency per (device, kernel name).
static RESIDENT_CTAS: OnceLock<Mutex<HashMap<(DeviceId, String), Residency>>> = OnceLock::new();

/// How many CTAs of `func` (named `name`, `threads` per CTA, `smem_bytes` of dynamic shared
/// memory) fit on the GPU at once. The first call per device and kernel also raises the kernel's
/// dynamic shared-memory limit; later calls skip those driver calls.
pub(crate) fn resident_ctas(
    dev: &CudaDevice,
    name: &str,
    func: &CudaFunction,
    threads: u32,
    smem_bytes: usize,
) -> Result<Residency> {
    let key = (dev.id(), name.to_string());
    let cache = RESIDENT_CTAS.get_or_init(Default::default);
    if let Some(slots) = cache.lock().ok().and_then(|c| c.get(&key).copied()) {
        return Ok(slots);
    }
    allow_dynamic_smem(dev, func, smem_bytes)?;
    let sms = dev
        .cuda_stream()
        .context()
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .w()? as usize;
    let per_sm = func
        .occupancy_max_active_blocks_per_multiprocessor(threads, smem_bytes, None)
        .w()?
        .max(1) as usize;
    let residency = Residency { sms, per_sm };
    if let Ok(mut c) = cache.lock() {
        c.insert(key, residency);
    }
    Ok(residency)
}

/// The shape of a thread-block cluster: CTAs along x and y of the grid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct ClusterDims {
    pub x: u32,
    pub y: u32,
}

impl ClusterDims {
    pub fn size(&self) -> u32 {
        self.x * self.y
    }
}

/// Launch attributes beyond the grid: a programmatic dependency on the previous kernel, and
/// optionally clusters.
struct Attributes {
    list: [sys::CUlaunchAttribute; 2],
    len: u32,
}

impl Attributes {
    fn new(cluster: Option<ClusterDims>) -> Self {
        // SAFETY: plain-old-data unions; each field set below is the one its attribute id selects.
        let mut dependent: sys::CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
        dependent.programmaticStreamSerializationAllowed = 1;
        let mut dims: sys::CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
        let shape = cluster.unwrap_or(ClusterDims { x: 1, y: 1 });
        dims.clusterDim.x = shape.x;
        dims.clusterDim.y = shape.y;
        dims.clusterDim.z = 1;
        Self {
            list: [
                sys::CUlaunchAttribute {
                    id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
                    pad: [0; 4],
                    value: dependent,
                },
                sys::CUlaunchAttribute {
                    id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
                    pad: [0; 4],
                    value: dims,
                },
            ],
            len: if cluster.is_some() { 2 } else { 1 },
        }
    }

    fn config(&mut self, cfg: &LaunchConfig, stream: sys::CUstream) -> sys::CUlaunchConfig {
        sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: stream,
            attrs: self.list.as_mut_ptr(),
            numAttrs: self.len,
        }
    }
}

/// Launches `func` with a single by-value parameter block on candle's stream. On sm_90 builds it
/// is a programmatic dependent of the previous kernel: its CTAs may be scheduled while that kernel
/// runs, so the kernel must wait in-kernel (`griddepcontrol.wait`) before it reads or writes any
/// global memory another kernel may touch; the attribute only hides the launch gap. Earlier
/// architectures get a plain launch, where the wait is a no-op. `cluster` groups the grid's CTAs
/// into thread-block clusters of that shape (sm_90 only; see [`resident_clusters`]).
///
/// # Safety
///
/// `P` must be the exact parameter type of `func`, and the kernel must stay within the buffers
/// `params` points to.
pub(crate) unsafe fn launch_dependent<P: DeviceRepr>(
    func: &CudaFunction,
    dev: &CudaDevice,
    cfg: LaunchConfig,
    cluster: Option<ClusterDims>,
    params: &P,
) -> Result<()> {
    let stream = dev.cuda_stream();
    if compiled_compute_cap() < 90 {
        if cluster.is_some() {
            candle_core::bail!("split-kv: thread-block clusters need a build for sm_90 or later")
        }
        let mut builder = stream.launch_builder(func);
        builder.arg(params);
        // SAFETY: the caller vouches for the parameter type and the buffers.
        return unsafe { builder.launch(cfg) }.map(|_| ()).w();
    }
    let mut attributes = Attributes::new(cluster);
    let config = attributes.config(&cfg, stream.cu_stream());
    let mut args = [params as *const P as *mut std::ffi::c_void];
    // SAFETY: `args` points to `params` and `config` to `attributes` for the duration of the
    // call; the caller vouches for the parameter type and the buffers.
    unsafe {
        sys::cuLaunchKernelEx(
            &config,
            func.cu_function(),
            args.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()
    .w()
}

/// How many clusters of shape `cluster` of `func` (named `name`), launched as `cfg`, the GPU runs
/// at once (0 where it cannot schedule them). The first call per device, kernel, shape and
/// shared-memory size also raises the kernel's shared-memory limit to `cfg`'s and allows sizes
/// past the portable 8 (H100 and H200 schedule 16); later calls skip the driver.
pub(crate) fn resident_clusters(
    dev: &CudaDevice,
    name: &str,
    func: &CudaFunction,
    cfg: &LaunchConfig,
    cluster: ClusterDims,
) -> Result<usize> {
    type Key = (DeviceId, String, ClusterDims, u32);
    static CLUSTERS: OnceLock<Mutex<HashMap<Key, usize>>> = OnceLock::new();
    if compiled_compute_cap() < 90 {
        return Ok(0);
    }
    let key = (dev.id(), name.to_string(), cluster, cfg.shared_mem_bytes);
    let cache = CLUSTERS.get_or_init(Default::default);
    if let Some(n) = cache.lock().ok().and_then(|c| c.get(&key).copied()) {
        return Ok(n);
    }
    allow_dynamic_smem(dev, func, cfg.shared_mem_bytes as usize)?;
    if cluster.size() > 8 {
        func.set_attribute(
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
            1,
        )
        .w()?;
    }
    let mut attributes = Attributes::new(Some(cluster));
    let config = attributes.config(cfg, std::ptr::null_mut());
    let mut clusters: std::ffi::c_int = 0;
    // SAFETY: `config` points to `attributes`, alive for the call; the driver only reads it.
    let status =
        unsafe { sys::cuOccupancyMaxActiveClusters(&mut clusters, func.cu_function(), &config) };
    // A size the device cannot schedule at all is an error here, not a reason to fail the op.
    let n = if status == sys::CUresult::CUDA_SUCCESS {
        clusters.max(0) as usize
    } else {
        0
    };
    if let Ok(mut c) = cache.lock() {
        c.insert(key, n);
    }
    Ok(n)
}

/// Raises `func`'s dynamic shared-memory limit to the most the device allows it, checking that
/// `bytes` fits. A module is loaded once per context, so every device handle and thread of the
/// process shares the function: the limit is always set to the same value, never to one call's
/// need, so that no call can lower it under another's launch.
pub(crate) fn allow_dynamic_smem(
    dev: &CudaDevice,
    func: &CudaFunction,
    bytes: usize,
) -> Result<()> {
    let most = max_dynamic_smem(dev, func)?;
    if bytes > most {
        candle_core::bail!(
            "split-kv attention: a kernel needs {bytes} bytes of dynamic shared memory, this GPU \
             allows it {most}; this build (compute capability {}) sizes its kernels for {} bytes, \
             so build with CUDA_COMPUTE_CAP set to this GPU's",
            compiled_compute_cap(),
            super::kernels::MAX_SMEM_PER_CTA
        )
    }
    func.set_attribute(
        sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        most as i32,
    )
    .w()
}

/// The most dynamic shared memory one CTA may opt into on `dev`.
pub(crate) fn max_smem_per_cta(dev: &CudaDevice) -> Result<usize> {
    let stream = dev.cuda_stream();
    let bytes = stream
        .context()
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        .w()?;
    let bytes = bytes.max(0) as usize;
    #[cfg(feature = "test-hooks")]
    if let Some(limit) = crate::test_hooks::smem_per_cta_limit() {
        return Ok(bytes.min(limit));
    }
    Ok(bytes)
}

/// The most dynamic shared memory one CTA of `func` may take: the device's opt-in limit less
/// the function's static shared memory, which the driver counts against the same limit.
pub(crate) fn max_dynamic_smem(dev: &CudaDevice, func: &CudaFunction) -> Result<usize> {
    let static_bytes = func.shared_size_bytes().w()?.max(0) as usize;
    Ok(max_smem_per_cta(dev)?.saturating_sub(static_bytes))
}

/// Dynamic shared memory that leaves room for one CTA per SM only, if one CTA may ask for it.
pub(crate) fn one_cta_per_sm_smem(dev: &CudaDevice) -> Result<Option<usize>> {
    let stream = dev.cuda_stream();
    let per_sm = stream
        .context()
        .attribute(
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
        )
        .w()? as usize;
    let more_than_half = per_sm / 2 + 1;
    Ok((more_than_half <= max_smem_per_cta(dev)?).then_some(more_than_half))
}
