//! The compiled kernels: the table that build.rs generates from `kernels/kernels.toml` (one entry
//! per instance, with the threads and shared memory the kernels' headers define), looked up by
//! form, dtypes, head dim and group, and loaded on first use ([`super::modules`]).

use candle_core::{CudaDevice, DType, Result};
use cudarc::driver::CudaFunction;

include!(concat!(env!("OUT_DIR"), "/kernel_table.rs"));

/// One compiled kernel: a form at one dtype, K/V storage type, head dim and group bound.
#[derive(Debug)]
pub(crate) struct KernelSpec {
    pub form: KernelForm,
    pub dtype: DType,
    /// How K and V are stored: `dtype`, or fp8 for the forms that widen it in registers.
    pub kv_dtype: DType,
    /// 0 for forms that take any head dim.
    pub head_dim: usize,
    /// Query heads a CTA holds at most; 0 for forms without a group.
    pub group: usize,
    pub symbol: &'static str,
    /// The module holding the kernel, and its fatbin.
    pub module: &'static str,
    pub image: &'static [u8],
    pub threads: u32,
    /// Dynamic shared memory the kernel needs (it traps on less).
    pub smem_bytes: usize,
    /// With the splits merging inside a thread-block cluster: `smem_bytes` and the receive area.
    pub cluster_smem_bytes: usize,
    /// Query rows and K/V positions of one CTA's tile, for the prefill forms; 0 for the others.
    pub tile_rows: usize,
    pub tile_keys: usize,
}

impl KernelForm {
    /// The instance of this form for `dtype`, K/V stored as `kv_dtype`, and `head_dim`, whose
    /// group bound is the smallest that holds `group` query heads (0 for forms without either);
    /// `None` where none is compiled, as for the tensor-core forms in a build for a target
    /// before sm_80.
    pub fn find(
        self,
        dtype: DType,
        kv_dtype: DType,
        head_dim: usize,
        group: usize,
    ) -> Option<&'static KernelSpec> {
        KERNELS
            .iter()
            .filter(|k| k.form == self && k.dtype == dtype && k.kv_dtype == kv_dtype)
            .filter(|k| k.head_dim == head_dim && k.group >= group)
            .min_by_key(|k| k.group)
    }

    /// Whether this build has the form for `dtype` with K/V stored as `kv_dtype`.
    pub fn compiled_for(self, dtype: DType, kv_dtype: DType) -> bool {
        KERNELS
            .iter()
            .any(|k| k.form == self && k.dtype == dtype && k.kv_dtype == kv_dtype)
    }

    /// The partial-pass form on CUDA cores, with or without a window or pages.
    pub fn on_cuda_cores(self) -> bool {
        matches!(
            self,
            KernelForm::CudaCore | KernelForm::CudaCoreWindowed | KernelForm::CudaCorePaged
        )
    }

    /// The form of the same family that applies a sliding window and soft-capping, for the two
    /// families the planner starts from; `None` for the others.
    pub fn windowed(self) -> Option<KernelForm> {
        match self {
            KernelForm::CudaCore => Some(KernelForm::CudaCoreWindowed),
            KernelForm::TensorCore => Some(KernelForm::TensorCoreWindowed),
            _ => None,
        }
    }

    /// The form of the same family that reads K/V from a pool of pages, with a window and
    /// soft-capping where `windowed`, for the two families the planner starts from; `None` for
    /// the others.
    pub fn paged(self, windowed: bool) -> Option<KernelForm> {
        match (self, windowed) {
            (KernelForm::CudaCore, _) => Some(KernelForm::CudaCorePaged),
            (KernelForm::TensorCore, false) => Some(KernelForm::TensorCorePaged),
            (KernelForm::TensorCore, true) => Some(KernelForm::TensorCoreWindowedPaged),
            _ => None,
        }
    }

    /// The widest group bound compiled for this form.
    pub fn max_group(self) -> usize {
        KERNELS
            .iter()
            .filter(|k| k.form == self)
            .map(|k| k.group)
            .max()
            .unwrap_or(0)
    }
}

impl KernelSpec {
    /// The kernel in `dev`'s context, its module loaded there on first use.
    pub fn load(&self, dev: &CudaDevice) -> Result<CudaFunction> {
        super::modules::function(dev, self.module, self.image, self.symbol)
    }

    /// The same instance in another form: same dtypes, head dim and group bound.
    pub fn sibling(&self, form: KernelForm) -> Option<&'static KernelSpec> {
        KERNELS.iter().find(|k| {
            k.form == form
                && k.dtype == self.dtype
                && k.kv_dtype == self.kv_dtype
                && k.head_dim == self.head_dim
                && k.group == self.group
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_decode_form_covers_every_head_dim() {
        for &d in &crate::SUPPORTED_HEAD_DIMS {
            // f16/bf16 keep two bounds on CUDA cores (kernels.toml), the smaller one 4.
            for (dtype, bound) in [(DType::F32, 1), (DType::F16, 4), (DType::BF16, 4)] {
                let spec = KernelForm::CudaCore.find(dtype, dtype, d, 1);
                assert!(spec.is_some_and(|s| s.group == bound && s.smem_bytes > 0));
            }
        }
    }

    #[test]
    fn groups_take_the_smallest_bound_that_holds_them() {
        let bound = |dtype, g| {
            KernelForm::CudaCore
                .find(dtype, dtype, 128, g)
                .map(|s| s.group)
        };
        assert_eq!(bound(DType::F32, 3), Some(4));
        assert_eq!(bound(DType::F32, 5), Some(8));
        assert_eq!(bound(DType::F16, 1), Some(4));
        assert_eq!(bound(DType::F16, 5), Some(16));
        assert_eq!(bound(DType::F16, 16), Some(16));
        assert_eq!(bound(DType::F16, 17), None);
        assert_eq!(KernelForm::CudaCore.max_group(), 16);
    }

    #[test]
    fn every_form_fits_the_targets_shared_memory() {
        // Checked against the GPU at run time instead, each with a form to fall back on: the
        // persistent forms (their merge area beside the ring), and below sm_90 the tensor-core
        // decode of 16-bit K/V at head dim 256 (192 KiB), for which the CUDA-core form runs.
        let runtime_checked = |k: &KernelSpec| {
            let persistent = matches!(
                k.form,
                KernelForm::TensorCorePersistent | KernelForm::TensorCorePersistentPaged
            );
            let wide_ring = k.module.starts_with("split_kv_decode_mma")
                && k.head_dim == 256
                && k.kv_dtype != DType::F8E4M3;
            persistent || wide_ring
        };
        for k in KERNELS.iter().filter(|k| !runtime_checked(k)) {
            assert!(
                k.smem_bytes <= MAX_SMEM_PER_CTA,
                "{}: {} bytes of shared memory, the target allows {MAX_SMEM_PER_CTA}",
                k.symbol,
                k.smem_bytes
            );
        }
    }

    #[test]
    fn symbols_are_unique() {
        let mut symbols: Vec<_> = KERNELS.iter().map(|k| k.symbol).collect();
        symbols.sort();
        symbols.dedup();
        assert_eq!(symbols.len(), KERNELS.len());
    }
}
