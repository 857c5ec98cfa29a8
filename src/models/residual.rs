//! Residual sums of a layer on the CPU, on rayon's pool.
//!
//! Candle's CPU elementwise ops split tensors of 64K values or more over a pool of spinning
//! threads of their own. A prompt's residual adds are that large, and the pass runs on a
//! thread of rayon's pool (see `llama::on_cpu_pool`): on 2 cores the two pools' threads took
//! turns, each add waiting for threads the scheduler had put behind the others. Here the sum
//! is split over rayon's tasks instead.

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

/// Values per rayon task: large enough to amortise a task, small enough to share the work.
const VALUES_PER_TASK: usize = 32 * 1024;

/// `a + b` for tensors of one shape: on rayon's pool for contiguous f32 tensors on the CPU,
/// candle's add otherwise.
pub fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let ours = a.device().is_cpu()
        && a.dtype() == DType::F32
        && b.dtype() == DType::F32
        && a.dims() == b.dims()
        && a.is_contiguous()
        && b.is_contiguous();
    if ours {
        a.apply_op2_no_bwd(b, &ResidualAdd)
    } else {
        a + b
    }
}

struct ResidualAdd;

impl CustomOp2 for ResidualAdd {
    fn name(&self) -> &'static str {
        "residual-add"
    }

    fn cpu_fwd(
        &self,
        a: &CpuStorage,
        a_layout: &Layout,
        b: &CpuStorage,
        b_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (CpuStorage::F32(a), CpuStorage::F32(b)) = (a, b) else {
            candle_core::bail!("residual add: f32 inputs only")
        };
        let (Some((a0, a1)), Some((b0, b1))) =
            (a_layout.contiguous_offsets(), b_layout.contiguous_offsets())
        else {
            candle_core::bail!("residual add: contiguous inputs only")
        };
        if a_layout.dims() != b_layout.dims() {
            candle_core::bail!(
                "residual add: shapes {:?} and {:?} differ",
                a_layout.dims(),
                b_layout.dims()
            )
        }
        let (a, b) = (&a[a0..a1], &b[b0..b1]);
        let mut out = vec![0f32; a.len()];
        out.par_chunks_mut(VALUES_PER_TASK)
            .zip(
                a.par_chunks(VALUES_PER_TASK)
                    .zip(b.par_chunks(VALUES_PER_TASK)),
            )
            .for_each(|(out, (a, b))| {
                for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
                    *o = x + y;
                }
            });
        Ok((CpuStorage::F32(out), a_layout.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn sums_equal_candles() -> Result<()> {
        let dev = Device::Cpu;
        let a = Tensor::randn(0f32, 1.0, (1, 300, 576), &dev)?;
        let b = Tensor::randn(0f32, 1.0, (1, 300, 576), &dev)?;
        assert_eq!(
            add(&a, &b)?.flatten_all()?.to_vec1::<f32>()?,
            (&a + &b)?.flatten_all()?.to_vec1::<f32>()?
        );
        // Strided or mismatched inputs go to candle's add.
        let t = a.transpose(1, 2)?;
        assert_eq!(add(&t, &t)?.dims(), [1, 576, 300]);
        assert!(add(&a, &b.narrow(1, 0, 10)?).is_err());
        Ok(())
    }
}
