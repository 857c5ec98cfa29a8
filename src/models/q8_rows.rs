//! `Q8Rows`: a weight in 8-bit blocks (Q8_0's format: 32 quants and a scale per block, the
//! scale kept in f32) multiplied row by row with rayon, for decode inputs on the CPU.
//!
//! Several input rows (a batch of sequences, a few tokens being verified) are multiplied in one
//! pass over the weight, each product exactly as a single row gets it (see the `dot` module).
//!
//! Why not candle's `QMatMul`: its CPU path synchronises its worker threads with spinning
//! barriers, so each matmul waits for the slowest thread. When other processes share the cores
//! (a laptop, a CI runner) a descheduled worker stalls every matmul for a scheduler slice;
//! decode steps measured several times slower that way (docs/perf-log.md, "CPU q8 rows").
//! Rayon's work stealing lets the threads that do run take over the rest.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

mod dot;
use dot::{dot_rows, quantize, BlockRows, BLOCK};

/// Output rows computed per rayon task: enough work to amortise scheduling, small enough to
/// balance across threads.
const ROWS_PER_TASK: usize = 16;
/// Below this many block products (weight blocks × input rows; 1M weights for one row) one
/// thread finishes sooner than waking others.
const PARALLEL_MIN_BLOCK_PRODUCTS: usize = 1 << 15;

/// An `(out, in)` weight in 8-bit blocks, row-major.
#[derive(Debug, Clone)]
pub struct Q8Rows {
    quants: Vec<i8>,
    /// One per block of `BLOCK` quants.
    scales: Vec<f32>,
    out_features: usize,
    in_features: usize,
}

impl Q8Rows {
    /// Quantizes a dense `(out, in)` weight; `in` must be a multiple of 32 (the block).
    pub fn quantize(weight: &Tensor) -> Result<Self> {
        let (out_features, in_features) = weight.dims2()?;
        if in_features % BLOCK != 0 {
            bail!("q8 rows: in_features ({in_features}) must be a multiple of {BLOCK}")
        }
        let dense = weight
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let mut quants = vec![0i8; dense.len()];
        let mut scales = vec![0f32; dense.len() / BLOCK];
        quantize(&dense, &mut quants, &mut scales);
        Ok(Self {
            quants,
            scales,
            out_features,
            in_features,
        })
    }

    /// `x (…, in)` → `(…, out)`, f32 on the CPU.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.apply_op1_no_bwd(self)
    }
}

/// The input of a CPU row product: contiguous f32 rows of `in_features` values; `what` names the
/// product in the errors.
pub(crate) fn contiguous_f32_rows<'a>(
    what: &str,
    storage: &'a CpuStorage,
    layout: &Layout,
    in_features: usize,
) -> Result<&'a [f32]> {
    let CpuStorage::F32(data) = storage else {
        bail!("{what}: input must be f32, got {:?}", storage.dtype())
    };
    let Some((start, end)) = layout.contiguous_offsets() else {
        bail!("{what}: input must be contiguous")
    };
    let dims = layout.dims();
    if dims.last() != Some(&in_features) {
        bail!("{what}: input {dims:?} must end in in_features = {in_features}")
    }
    Ok(&data[start..end])
}

impl CustomOp1 for Q8Rows {
    fn name(&self) -> &'static str {
        "q8-rows-matmul"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = contiguous_f32_rows("q8 rows", storage, layout, self.in_features)?;
        let dims = layout.dims();
        let blocks_per_row = self.in_features / BLOCK;
        let rows = x.len() / self.in_features;
        let mut x_quants = vec![0i8; x.len()];
        let mut x_scales = vec![0f32; x.len() / BLOCK];
        quantize(x, &mut x_quants, &mut x_scales);
        let inputs = BlockRows {
            quants: &x_quants,
            scales: &x_scales,
        };
        // Each weight row is read once for all input rows (a few tokens being verified, or a
        // batch of sequences, cost about one read of the weights), and each product is the dot
        // a single row gets.
        let weight_row_dots = |w_row: usize, ys: &mut [f32]| {
            let at = w_row * blocks_per_row..(w_row + 1) * blocks_per_row;
            let weight = BlockRows {
                quants: &self.quants[at.start * BLOCK..at.end * BLOCK],
                scales: &self.scales[at],
            };
            dot_rows(weight, inputs, ys);
        };
        // `(out, rows)`: one weight row's products are contiguous.
        let mut by_weight_row = vec![0f32; rows * self.out_features];
        if rows > 0 {
            if self.scales.len() * rows < PARALLEL_MIN_BLOCK_PRODUCTS {
                by_weight_row
                    .chunks_exact_mut(rows)
                    .enumerate()
                    .for_each(|(w_row, ys)| weight_row_dots(w_row, ys));
            } else {
                by_weight_row
                    .par_chunks_mut(ROWS_PER_TASK * rows)
                    .enumerate()
                    .for_each(|(task, ys)| {
                        let first = task * ROWS_PER_TASK;
                        ys.chunks_exact_mut(rows)
                            .enumerate()
                            .for_each(|(i, ys)| weight_row_dots(first + i, ys));
                    });
            }
        }
        let out = if rows == 1 {
            by_weight_row
        } else {
            let mut out = vec![0f32; rows * self.out_features];
            for (w_row, ys) in by_weight_row.chunks_exact(rows.max(1)).enumerate() {
                for (row, &y) in ys.iter().enumerate() {
                    out[row * self.out_features + w_row] = y;
                }
            }
            out
        };
        let mut shape = dims.to_vec();
        if let Some(last) = shape.last_mut() {
            *last = self.out_features;
        }
        Ok((CpuStorage::F32(out), Shape::from(shape)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn matches_the_dense_product_within_quantization_error() -> Result<()> {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 1.0, (100, 96), &dev)?;
        let x = Tensor::randn(0f32, 1.0, (2, 1, 96), &dev)?;
        let y = Q8Rows::quantize(&w)?.forward(&x)?;
        assert_eq!(y.dims(), [2, 1, 100]);
        let exact = x.broadcast_matmul(&w.t()?)?;
        let err = (&y - &exact)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?;
        let scale = exact.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
        assert!(err / scale < 2e-2, "relative error {}", err / scale);
        assert!(Q8Rows::quantize(&Tensor::zeros((4, 40), DType::F32, &dev)?).is_err());
        Ok(())
    }

    #[test]
    fn rows_together_equal_rows_one_at_a_time() -> Result<()> {
        let dev = Device::Cpu;
        // Large enough for the parallel path, with a last task of fewer rows.
        for (out, rows) in [(100, 5), ((1 << 15) / 3 + 7, 3)] {
            let w = Q8Rows::quantize(&Tensor::randn(0f32, 1.0, (out, 96), &dev)?)?;
            let x = Tensor::randn(0f32, 1.0, (1, rows, 96), &dev)?;
            let together = w.forward(&x)?.squeeze(0)?.to_vec2::<f32>()?;
            for (row, got) in together.iter().enumerate() {
                let alone = w.forward(&x.narrow(1, row, 1)?)?.flatten_all()?;
                assert_eq!(got, &alone.to_vec1::<f32>()?, "row {row} of {out}x96");
            }
        }
        Ok(())
    }
}
