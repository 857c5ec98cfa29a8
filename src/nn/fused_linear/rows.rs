//! Launches the fused projection for a few rows (`kernels/matvec_rows.cuh`): the rows of a
//! batched decode step or of a verification step's drafts, on tensor cores, the weight read once.

use candle_core::cuda::CudaDType;
use candle_core::{CudaDevice, CudaStorage, Result};
use cudarc::driver::{DeviceRepr, LaunchConfig};

use super::cuda::{address, Operands};
use super::{LinearInput, LinearOutput};
use crate::cuda::kernels::{
    KernelForm, MatVecEpilogue, MatVecParams, MatVecPrologue, MatVecRowsParams, MATVEC_ROWS_BLOCK,
    MATVEC_ROWS_MAX_CLUSTER, MATVEC_ROWS_PAD_BYTES, MATVEC_ROWS_PER_PRODUCT,
    MATVEC_ROWS_TILE_COLUMNS,
};
use crate::cuda::launch::{
    compiled_compute_cap, device_ptr, launch_dependent, max_dynamic_smem, resident_clusters,
    resident_ctas, ClusterDims,
};

pub(super) use crate::cuda::kernels::MATVEC_MAX_ROWS as MAX_ROWS;

/// The most CTAs along k the plan takes (sm_90 clusters). Clusters of 8 measured slower than 4
/// wherever 4 fit (one more round of pushes, and grids past one wave of resident CTAs), and
/// where a CTA of 4 cannot stage its slice candle's ops were faster than 8; tests and
/// benchmarks can still force up to [`MATVEC_ROWS_MAX_CLUSTER`].
const PLANNED_MAX_SPLITS: usize = 4;

/// How a launch divides the work: clusters of `splits` CTAs along k, each CTA staging `slice`
/// columns of the rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Plan {
    splits: usize,
    slice: usize,
    smem_bytes: usize,
}

/// Sizes of one call, as the plans see them.
#[derive(Debug, Clone, Copy)]
struct Shape {
    n: usize,
    k: usize,
    rows: usize,
    /// Bytes per element.
    elem: usize,
}

/// Columns of k per CTA with `splits` CTAs along k: whole tiles.
fn slice_columns(k: usize, splits: usize) -> usize {
    k.div_ceil(splits).div_ceil(MATVEC_ROWS_TILE_COLUMNS) * MATVEC_ROWS_TILE_COLUMNS
}

/// Whether every one of `splits` CTAs along k gets columns (more splits leave more without).
fn every_split_has_columns(k: usize, splits: usize) -> bool {
    splits >= 1 && (splits - 1) * slice_columns(k, splits) < k
}

/// The plan with `splits` CTAs along k, or `None` where a CTA could not stage its slice in
/// `smem_limit` bytes or a split would be left without columns.
fn plan_with(splits: usize, s: Shape, fixed_smem: usize, smem_limit: usize) -> Option<Plan> {
    if !every_split_has_columns(s.k, splits) {
        return None;
    }
    let slice = slice_columns(s.k, splits);
    let staged_rows = s.rows.div_ceil(MATVEC_ROWS_PER_PRODUCT) * MATVEC_ROWS_PER_PRODUCT;
    let smem_bytes = fixed_smem + staged_rows * (slice * s.elem + MATVEC_ROWS_PAD_BYTES);
    (smem_bytes <= smem_limit).then_some(Plan {
        splits,
        slice,
        smem_bytes,
    })
}

/// The plan for a call, or `None` where no CTA could stage its slice.
///
/// More splits give small n more CTAs and smaller slices; each split past one costs a push of
/// partial sums through distributed shared memory (clusters: sm_90 builds only). The fewest
/// splits whose grid reaches two CTAs per SM win; where none does, the most that still give every
/// CTA columns of its own.
fn plan(
    s: Shape,
    fixed_smem: usize,
    smem_limit: usize,
    sms: usize,
    most_splits: usize,
) -> Option<Plan> {
    let blocks = s.n.div_ceil(MATVEC_ROWS_BLOCK);
    let mut best = None;
    let mut splits = 1;
    while splits <= most_splits {
        if !every_split_has_columns(s.k, splits) {
            break;
        }
        if let Some(p) = plan_with(splits, s, fixed_smem, smem_limit) {
            best = Some(p);
            if blocks * splits >= 2 * sms {
                break;
            }
        }
        splits *= 2;
    }
    best
}

/// Runs the kernel for `rows` rows (2 to [`MAX_ROWS`]) where the GPU can take a plan; `None`
/// means the caller runs the unfused ops.
pub(super) fn launch<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    ops: &Operands,
    rows: usize,
    (n, k): (usize, usize),
) -> Result<Option<CudaStorage>> {
    let dtype = ops.x.dtype();
    let Some(spec) = KernelForm::MatVecRows.find(dtype, dtype, 0, 0) else {
        return Ok(None);
    };
    let func = spec.load(dev)?;
    // Two CTAs an SM at least, so one CTA's epilogue overlaps another's stream.
    let smem_limit = max_dynamic_smem(dev, &func)? / 2;
    let sms = resident_ctas(dev, spec.symbol, &func, spec.threads, spec.smem_bytes)?.sms;
    let most_splits = if compiled_compute_cap() >= 90 {
        MATVEC_ROWS_MAX_CLUSTER
    } else {
        1
    };
    let planned_most_splits = most_splits.min(PLANNED_MAX_SPLITS);
    let shape = Shape {
        n,
        k,
        rows,
        elem: std::mem::size_of::<T>(),
    };
    #[cfg(feature = "test-hooks")]
    let forced = crate::test_hooks::forced_rows_splits();
    #[cfg(not(feature = "test-hooks"))]
    let forced: Option<usize> = None;
    let plan = match forced {
        Some(splits) if splits > most_splits => None,
        Some(splits) => plan_with(splits, shape, spec.smem_bytes, smem_limit),
        None => plan(shape, spec.smem_bytes, smem_limit, sms, planned_most_splits),
    };
    let Some(plan) = plan else {
        return Ok(None);
    };
    let cfg = LaunchConfig {
        grid_dim: ((n.div_ceil(MATVEC_ROWS_BLOCK) * plan.splits) as u32, 1, 1),
        block_dim: (spec.threads, 1, 1),
        shared_mem_bytes: plan.smem_bytes as u32,
    };
    let cluster = (plan.splits > 1).then_some(ClusterDims {
        x: plan.splits as u32,
        y: 1,
    });
    if let Some(shape) = cluster {
        if resident_clusters(dev, spec.symbol, &func, &cfg, shape)? == 0 {
            return Ok(None);
        }
    }
    run::<T>(dev, &func, cfg, cluster, ops, rows, (n, k), plan.slice).map(Some)
}

#[allow(clippy::too_many_arguments)]
fn run<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    func: &cudarc::driver::CudaFunction,
    cfg: LaunchConfig,
    cluster: Option<ClusterDims>,
    ops: &Operands,
    rows: usize,
    (n, k): (usize, usize),
    slice: usize,
) -> Result<CudaStorage> {
    let (epilogue, residual, outputs) = match ops.output {
        LinearOutput::Plain => (MatVecEpilogue::Plain, 0, n),
        LinearOutput::AddResidual(r) => (MatVecEpilogue::Residual, address::<T>(r, dev)?, n),
        LinearOutput::SwiGlu => (MatVecEpilogue::SwiGlu, 0, n / 2),
    };
    let (prologue, norm_weight, eps) = match ops.input {
        LinearInput::Plain => (MatVecPrologue::Plain, 0, 0.0),
        LinearInput::RmsNorm { weight, eps } => {
            (MatVecPrologue::RmsNorm, address::<T>(weight, dev)?, eps)
        }
    };
    // SAFETY: every output is written by the kernel; tests poison it to check.
    let y = unsafe { dev.alloc::<T>(rows * outputs)? };
    #[cfg(feature = "test-hooks")]
    crate::test_hooks::poison(dev, &y)?;
    let params = MatVecRowsParams {
        product: MatVecParams {
            x: address::<T>(ops.x, dev)?,
            w: address::<T>(ops.w, dev)?,
            norm_weight,
            residual,
            y: device_ptr(&y, dev, 0),
            n: n as i32,
            k: k as i32,
            prologue: prologue as i32,
            epilogue: epilogue as i32,
            eps,
        },
        rows: rows as i32,
        slice_columns: slice as i32,
    };
    // SAFETY: the kernel takes one `MatVecRowsParams`; it reads rows·k inputs, n·k weights, k norm
    // weights and rows·n residuals, and writes the rows·outputs elements allocated above.
    unsafe { launch_dependent(func, dev, cfg, cluster, &params)? };
    #[cfg(feature = "test-hooks")]
    crate::test_hooks::count_fused_launch();
    Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const FIXED: usize = 8768;
    const LIMIT: usize = 113 * 1024;

    fn shape(n: usize, k: usize, rows: usize) -> Shape {
        Shape {
            n,
            k,
            rows,
            elem: 2,
        }
    }

    #[test]
    fn small_n_takes_splits_until_the_grid_fills_the_gpu() {
        // 32 row blocks: 8 splits give 256 CTAs on 132 SMs.
        let p = plan(shape(4096, 4096, 16), FIXED, LIMIT, 132, 8).unwrap();
        assert_eq!((p.splits, p.slice), (8, 512));
        // Without clusters, one CTA stages all of k: 8 rows fit, 16 do not.
        let p = plan(shape(4096, 4096, 8), FIXED, LIMIT, 132, 1).unwrap();
        assert_eq!((p.splits, p.slice), (1, 4096));
        assert!(plan(shape(4096, 4096, 16), FIXED, LIMIT, 132, 1).is_none());
    }

    #[test]
    fn large_n_needs_no_split_beyond_the_shared_memory_bound() {
        // 224 row blocks; k = 4096 at 16 rows needs 2 splits to stage its slice.
        let p = plan(shape(28672, 4096, 16), FIXED, LIMIT, 132, 8).unwrap();
        assert_eq!((p.splits, p.slice), (2, 2048));
        // Eight rows would fit unsplit, but 224 CTAs are fewer than two an SM.
        let p = plan(shape(28672, 4096, 8), FIXED, LIMIT, 132, 8).unwrap();
        assert_eq!((p.splits, p.slice), (2, 2048));
        let p = plan(shape(28672, 4096, 8), FIXED, LIMIT, 100, 8).unwrap();
        assert_eq!((p.splits, p.slice), (1, 4096));
        // k = 14336 does not fit one CTA without clusters.
        assert!(plan(shape(4096, 14336, 16), FIXED, LIMIT, 132, 1).is_none());
        let p = plan(shape(4096, 14336, 16), FIXED, LIMIT, 132, 8).unwrap();
        assert_eq!((p.splits, p.slice), (8, 1792));
    }

    #[test]
    fn no_split_is_left_without_columns() {
        // k = 576 (SmolLM2): 2 splits take 384 columns each; 4 would leave the last none.
        let p = plan(shape(576, 576, 4), FIXED, LIMIT, 132, 8).unwrap();
        assert_eq!((p.splits, p.slice), (2, 384));
    }

    #[test]
    fn a_forced_split_count_is_taken_where_it_fits() {
        let p = plan_with(4, shape(4096, 4096, 16), FIXED, LIMIT).unwrap();
        assert_eq!((p.splits, p.slice), (4, 1024));
        // One CTA cannot stage 16 rows of 4096 columns in the limit.
        assert!(plan_with(1, shape(4096, 4096, 16), FIXED, LIMIT).is_none());
        // 8 splits of k = 576 would leave the last ones without columns.
        assert!(plan_with(8, shape(576, 576, 4), FIXED, LIMIT).is_none());
    }
}
