//! The q/k/v projection of a one-token decode step with RoPE and the cache append in its
//! epilogue, as one kernel (`kernels/qkv_rope_append.cuh`): RMSNorm(x) times the joined
//! `[q | k | v]` weight, q and k rotated by the step's angles, q returned and k and v written
//! into the cache at the cached length read from device memory, so that a captured step appends
//! where the cache ends when it is replayed. The results are those of the unfused chain
//! (projection, rope split, cache write) bit for bit.

use candle_core::cuda::CudaDType;
use candle_core::{CudaDevice, DType, Device, Result, Storage, Tensor};
use cudarc::driver::DeviceRepr;
use float8::F8E4M3;
use half::{bf16, f16};

use super::cuda::{address, pick_kernel, staged_bytes, MatVecForms, MAX_STAGED_BYTES};
use crate::cuda::kernels::{
    KernelForm, MatVecEpilogue, MatVecParams, MatVecPrologue, QkvRopeAppendParams,
};
use crate::cuda::launch::device_ptr;
use crate::nn::cache::KvCache;

const FORMS: MatVecForms = MatVecForms {
    ring: None,
    deep: KernelForm::QkvRopeAppendDeep,
    shallow: KernelForm::QkvRopeAppendShallow,
};

/// One decode token's q/k/v projection and what follows it before attention.
#[derive(Debug, Clone, Copy)]
pub(crate) struct QkvRopeAppend<'a> {
    /// The layer's input, one token: `(1, 1, hidden)`.
    pub x: &'a Tensor,
    /// `((q_heads + 2·kv_heads)·head_dim, hidden)`: rows `[q | k | v]`.
    pub w: &'a Tensor,
    /// The input norm's weight `(hidden,)` and epsilon.
    pub norm: (&'a Tensor, f32),
    /// The step's cos and sin rows, `head_dim / 2` values each (any shape of that size).
    pub angles: (&'a Tensor, &'a Tensor),
    /// Rotation pairs `(2i, 2i + 1)` instead of `(i, i + d/2)`.
    pub interleaved: bool,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl QkvRopeAppend<'_> {
    /// Whether the kernel takes this step into `cache`: CUDA, f16/bf16, one token, a cache in
    /// x's dtype unscaled or fp8, shapes that fit the kernel. Otherwise the caller runs the
    /// unfused chain.
    pub fn applies(&self, cache: &KvCache) -> bool {
        #[cfg(feature = "test-hooks")]
        if crate::test_hooks::qkv_append_unfused() {
            return false;
        }
        let dtype = self.x.dtype();
        let hidden = self.x.dims().last().copied().unwrap_or(0);
        let heads = self.q_heads + 2 * self.kv_heads;
        let aligned = |t: &Tensor| t.is_contiguous() && t.layout().start_offset().is_multiple_of(8);
        let angles_fit = |t: &Tensor| {
            t.dtype() == dtype && t.is_contiguous() && t.elem_count() == self.head_dim / 2
        };
        self.x.device().is_cuda()
            && matches!(dtype, DType::F16 | DType::BF16)
            && self.x.elem_count() == hidden
            && hidden.is_multiple_of(8)
            && staged_bytes(self.rms_input(), hidden, dtype.size_in_bytes()) <= MAX_STAGED_BYTES
            && self.head_dim.is_multiple_of(2)
            && self.w.dims() == [heads * self.head_dim, hidden]
            && self.w.dtype() == dtype
            && aligned(self.x)
            && aligned(self.w)
            && aligned(self.norm.0)
            && self.norm.0.dtype() == dtype
            && angles_fit(self.angles.0)
            && angles_fit(self.angles.1)
            && cache.batch() == 1
            && cache.kv_heads() == self.kv_heads
            && cache.head_dim() == self.head_dim
            && cache.stores_rows_of(dtype)
            && heads * self.head_dim <= i32::MAX as usize
    }

    fn rms_input(&self) -> super::LinearInput<'_> {
        super::LinearInput::RmsNorm {
            weight: self.norm.0,
            eps: self.norm.1,
        }
    }

    /// Runs the kernel: appends the token's k and v to `cache` at `starts` (a u32 `(1,)` tensor
    /// holding the cache's length on its device) and returns q `(1, 1, q_heads, head_dim)`,
    /// rotated, and the cache's views over its capacity (as [`KvCache::append_at`] does).
    /// [`QkvRopeAppend::applies`] must hold.
    pub fn run(&self, cache: &mut KvCache, starts: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let Device::Cuda(dev) = self.x.device() else {
            candle_core::bail!("qkv rope append: x is not on a CUDA device")
        };
        if starts.dtype() != DType::U32 || starts.dims() != [1] || !starts.is_contiguous() {
            candle_core::bail!(
                "qkv rope append: starts must be a contiguous u32 (1,), got {:?} {:?}",
                starts.dtype(),
                starts.dims()
            )
        }
        let mut q = None;
        let (k_all, v_all) = cache.append_in_place(1, |k_cache, v_cache, scales| {
            q = Some(match self.x.dtype() {
                DType::F16 => self.launch::<f16>(dev, (k_cache, v_cache), scales, starts)?,
                DType::BF16 => self.launch::<bf16>(dev, (k_cache, v_cache), scales, starts)?,
                other => candle_core::bail!("qkv rope append: x has dtype {other:?}"),
            });
            Ok(())
        })?;
        let Some(q) = q else {
            candle_core::bail!("qkv rope append: the cache did not run the write")
        };
        Ok((q, k_all, v_all))
    }

    fn launch<T: CudaDType + DeviceRepr>(
        &self,
        dev: &CudaDevice,
        (k_cache, v_cache): (&Tensor, &Tensor),
        (k_scale, v_scale): (f32, f32),
        starts: &Tensor,
    ) -> Result<Tensor> {
        let (n, hidden) = self.w.dims2()?;
        let dtype = self.x.dtype();
        let kv_dtype = k_cache.dtype();
        let input = self.rms_input();
        let kernel = pick_kernel(
            dev,
            FORMS,
            (dtype, kv_dtype),
            (n, hidden),
            staged_bytes(input, hidden, dtype.size_in_bytes()),
        )?;
        let q_elems = self.q_heads * self.head_dim;
        // SAFETY: every element is written by the kernel; tests poison it to check.
        let q = unsafe { dev.alloc::<T>(q_elems)? };
        #[cfg(feature = "test-hooks")]
        crate::test_hooks::poison(dev, &q)?;
        let cache_address = |t: &Tensor| -> Result<u64> {
            let ptr = match kv_dtype {
                DType::F8E4M3 => crate::cuda::launch::tensor_ptr::<F8E4M3>(t, dev)?,
                _ => crate::cuda::launch::tensor_ptr::<T>(t, dev)?,
            };
            ptr.ok_or_else(|| {
                candle_core::Error::Msg("qkv rope append: the cache is not on CUDA".into())
            })
        };
        let strides = |t: &Tensor| {
            let s = t.stride();
            (s[1] as i64, s[2] as i64)
        };
        let ((k_head, k_seq), (v_head, v_seq)) = (strides(k_cache), strides(v_cache));
        let params = QkvRopeAppendParams {
            product: MatVecParams {
                x: address::<T>(self.x, dev)?,
                w: address::<T>(self.w, dev)?,
                norm_weight: address::<T>(self.norm.0, dev)?,
                residual: 0,
                y: 0,
                n: n as i32,
                k: hidden as i32,
                prologue: MatVecPrologue::RmsNorm as i32,
                epilogue: MatVecEpilogue::Plain as i32,
                eps: self.norm.1,
            },
            cos: address::<T>(self.angles.0, dev)?,
            sin: address::<T>(self.angles.1, dev)?,
            starts: crate::cuda::launch::tensor_ptr::<u32>(starts, dev)?.unwrap_or(0),
            q: device_ptr(&q, dev, 0),
            k_cache: cache_address(k_cache)?,
            v_cache: cache_address(v_cache)?,
            k_head_stride: k_head,
            k_seq_stride: k_seq,
            v_head_stride: v_head,
            v_seq_stride: v_seq,
            q_heads: self.q_heads as i32,
            kv_heads: self.kv_heads as i32,
            head_dim: self.head_dim as i32,
            capacity: k_cache.dims()[2].min(i32::MAX as usize) as i32,
            interleaved: i32::from(self.interleaved),
            k_scale,
            v_scale,
        };
        // SAFETY: the kernel takes one `QkvRopeAppendParams`; it reads `hidden` inputs and norm
        // weights, the n·hidden weights, head_dim/2 angles and one start, and writes q (allocated
        // above) and one position below the capacity of each cache head, whose strides these are.
        unsafe { kernel.run(dev, &params)? };
        #[cfg(feature = "test-hooks")]
        crate::test_hooks::count_qkv_append_launch();
        let q = candle_core::CudaStorage::wrap_cuda_slice(q, dev.clone());
        Ok(Tensor::from_storage(
            Storage::Cuda(q),
            (1, 1, self.q_heads, self.head_dim),
            candle_core::op::BackpropOp::none(),
            false,
        ))
    }
}
