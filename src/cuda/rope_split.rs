//! A joined q/k/v projection's output split into contiguous q, k and v, with q and k rotated, in
//! one launch (see `kernels/rope_split.cuh`).

use candle_core::cuda::CudaDType;
use candle_core::op::BackpropOp;
use candle_core::{bail, CudaDevice, CudaStorage, DType, Device, Result, Storage, Tensor};
use cudarc::driver::DeviceRepr;
use half::{bf16, f16};

use super::kernels::{KernelForm, RopeSplitParams};
use super::launch::{device_ptr, launch_grid_stride, tensor_ptr};

/// Head counts of the three parts of a joined q/k/v output, in order.
#[derive(Debug, Clone, Copy)]
pub(crate) struct QkvHeads {
    pub q: usize,
    pub k: usize,
    pub v: usize,
}

/// Splits `qkv` `(b, t, q + k + v heads, d)` (any strides, last dim contiguous) into contiguous
/// q, k and v, rotating q and k by `cos`/`sin` (one contiguous row of d/2 angles per token, in
/// `(b, t)` order). `interleaved` rotates pairs `(2i, 2i + 1)` instead of `(i, i + d/2)`.
pub(crate) fn rope_split(
    qkv: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    heads: QkvHeads,
    interleaved: bool,
) -> Result<(Tensor, Tensor, Tensor)> {
    let Device::Cuda(dev) = qkv.device() else {
        bail!("rope: qkv is not on a CUDA device")
    };
    let (b, t, h, d) = qkv.dims4()?;
    let stride = qkv.stride();
    if d % 2 != 0
        || stride[3] != 1
        || h != heads.q + heads.k + heads.v
        || heads.q * heads.k * heads.v == 0
    {
        bail!(
            "rope: qkv must be (b, t, {} + {} + {} heads, even head dim) with contiguous \
             elements, got shape {:?} and strides {stride:?}",
            heads.q,
            heads.k,
            heads.v,
            qkv.dims()
        )
    }
    for (name, angles) in [("cos", cos), ("sin", sin)] {
        if angles.elem_count() != b * t * d / 2
            || angles.dims().last() != Some(&(d / 2))
            || !angles.is_contiguous()
            || angles.dtype() != qkv.dtype()
            || !angles.device().same_device(qkv.device())
        {
            bail!(
                "rope: {name} must hold one contiguous row of {} angles per token ({} tokens) in \
                 qkv's dtype {:?} on its device, got {:?} {:?}",
                d / 2,
                b * t,
                qkv.dtype(),
                angles.dtype(),
                angles.dims()
            )
        }
    }
    let run = match qkv.dtype() {
        DType::F32 => launch::<f32>,
        DType::F16 => launch::<f16>,
        DType::BF16 => launch::<bf16>,
        other => bail!("rope: dtype {other:?} is not supported (f32, f16 or bf16)"),
    };
    let [q, k, v] = run(dev, qkv, cos, sin, heads, interleaved)?;
    let wrap = |storage: CudaStorage, heads: usize| {
        Tensor::from_storage(
            Storage::Cuda(storage),
            (b, t, heads, d),
            BackpropOp::none(),
            false,
        )
    };
    Ok((wrap(q, heads.q), wrap(k, heads.k), wrap(v, heads.v)))
}

fn address<T: CudaDType>(t: &Tensor, dev: &CudaDevice) -> Result<u64> {
    tensor_ptr::<T>(t, dev)?
        .ok_or_else(|| candle_core::Error::Msg("rope: every tensor must be on CUDA".into()))
}

fn launch<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    qkv: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    heads: QkvHeads,
    interleaved: bool,
) -> Result<[CudaStorage; 3]> {
    let (b, t, h, d) = qkv.dims4()?;
    let Some(spec) = KernelForm::RopeSplit.find(qkv.dtype(), qkv.dtype(), 0, 0) else {
        bail!("rope: no kernel for {:?} in this build", qkv.dtype())
    };
    let func = spec.load(dev)?;
    let rows = b * t * d;
    // SAFETY: the kernel writes every element of the three outputs.
    let alloc = |heads: usize| unsafe { dev.alloc::<T>(rows * heads) };
    let (q, k, v) = (alloc(heads.q)?, alloc(heads.k)?, alloc(heads.v)?);
    #[cfg(feature = "test-hooks")]
    for part in [&q, &k, &v] {
        crate::test_hooks::poison(dev, part)?;
    }
    let stride = qkv.stride();
    let params = RopeSplitParams {
        x: address::<T>(qkv, dev)?,
        cos: address::<T>(cos, dev)?,
        sin: address::<T>(sin, dev)?,
        y_front: device_ptr(&q, dev, 0),
        y_back: device_ptr(&k, dev, 0),
        y_rest: device_ptr(&v, dev, 0),
        batch: b as i32,
        tokens: t as i32,
        heads: h as i32,
        head_dim: d as i32,
        split: heads.q as i32,
        rotated: (heads.q + heads.k) as i32,
        interleaved: i32::from(interleaved),
        x_batch_stride: stride[0] as i64,
        x_seq_stride: stride[1] as i64,
        x_head_stride: stride[2] as i64,
    };
    // SAFETY: the kernel takes one `RopeSplitParams`; it reads qkv within its checked shape and
    // strides and b·t rows of angles, and writes the outputs allocated above.
    unsafe { launch_grid_stride(dev, &func, spec.threads, b * t * h * d / 2, 4096, &params)? };
    let wrap = |slice| CudaStorage::wrap_cuda_slice(slice, dev.clone());
    Ok([wrap(q), wrap(k), wrap(v)])
}
