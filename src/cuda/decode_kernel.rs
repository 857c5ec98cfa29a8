//! A partial-pass kernel as the planner sees it: its table entry, the loaded function, and how
//! many of its CTAs the device runs at once.

use candle_core::{bail, CudaDevice, DType, Result};
use cudarc::driver::CudaFunction;

use super::kernels::{KernelForm, KernelSpec};
use super::launch::{compiled_compute_cap, resident_ctas};
use crate::op::validate::DecodeDims;

/// A partial-pass kernel, loaded, with what the split plan needs to know of it.
pub(crate) struct DecodeKernel {
    pub spec: &'static KernelSpec,
    pub func: CudaFunction,
    /// CTAs the split plan aims for.
    pub parallel_slots: usize,
    /// CTAs the GPU holds at once.
    pub resident: usize,
}

impl DecodeKernel {
    pub fn load(
        dev: &CudaDevice,
        form: KernelForm,
        dtype: DType,
        kv_dtype: DType,
        dims: &DecodeDims,
    ) -> Result<Self> {
        let group = dims.group_size();
        let Some(spec) = form.find(dtype, kv_dtype, dims.head_dim, group) else {
            bail!(
                "split-kv attention: no {form:?} kernel for {dtype:?} queries, {kv_dtype:?} K/V, \
                 head dim {} and {group} query heads per block in this build (compute \
                 capability {})",
                dims.head_dim,
                compiled_compute_cap()
            )
        };
        let func = spec.load(dev)?;
        let residency = resident_ctas(dev, spec.symbol, &func, spec.threads, spec.smem_bytes)?;
        // Tensor-core CTAs each stream enough bytes to keep an SM's share of HBM busy: one per
        // SM measured faster than filling every resident slot, whose extra splits only add
        // per-split fixed cost.
        let parallel_slots = if spec.form.on_cuda_cores() {
            residency.total()
        } else {
            residency.sms
        };
        Ok(Self {
            spec,
            func,
            parallel_slots,
            resident: residency.total(),
        })
    }

    pub fn is_tensor_core(&self) -> bool {
        !self.spec.form.on_cuda_cores()
    }

    pub fn is_persistent(&self) -> bool {
        matches!(
            self.spec.form,
            KernelForm::TensorCorePersistent | KernelForm::TensorCorePersistentPaged
        )
    }

    /// This instance in another form, loaded, with its shared-memory limit raised on first use.
    pub fn form(
        &self,
        dev: &CudaDevice,
        form: KernelForm,
    ) -> Result<(&'static KernelSpec, CudaFunction)> {
        let Some(spec) = self.spec.sibling(form) else {
            bail!(
                "split-kv attention: no {form:?} form of {} in this build",
                self.spec.symbol
            )
        };
        let func = spec.load(dev)?;
        resident_ctas(dev, spec.symbol, &func, spec.threads, spec.smem_bytes)?;
        Ok((spec, func))
    }
}
