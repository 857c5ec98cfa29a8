//! `PackedBlocks`: a weight's 32-value GGUF blocks (Q4_0, Q4_1, Q8_0, Q4_K) repacked for
//! products of many input rows on the CPU (a prompt), with 8-bit inputs and integer dot
//! products.
//!
//! Each of these forms is, per block of 32 values of one output, an unsigned quant times a
//! scale plus an offset: Q4_1 nibble × d + m, Q4_0 nibble × d − 8d, Q8_0 (quant + 128) × d −
//! 128d, Q4_K nibble × (d × scale) − dmin × min. The quants are kept as bytes, 16 outputs side
//! by side in runs of four consecutive values (the operand layout of `vpdpbusd`), each block's
//! scale and offset as f32. A tile of input rows × 32 outputs then costs 8 instructions per
//! row and block, each reading four of the row's quants broadcast, where a row-by-row dot
//! reshuffles the weight's nibbles for every input row. The weight takes 1.25 bytes a value,
//! against 4 for the dense f32 form prompts used before; decode keeps its own forms.
//!
//! Input blocks are quantized as for [`super::GgufRows`]; each output is the same sum of block
//! terms in the same order whatever the rows beside it, so a row's product does not depend on
//! how the rows were split over threads.

use std::cell::RefCell;
use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{bail, CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::act::{quantize_block, BLOCK};
use super::formats::{f16_at, unpack_q4k, Format, SUPER};
use super::Kernel;

/// Outputs side by side in the packed quants (one 512-bit register of i32 sums).
pub const GROUP: usize = 16;
/// Bytes of one block of one group: `BLOCK` quants of `GROUP` outputs.
pub const GROUP_BLOCK_BYTES: usize = BLOCK * GROUP;
/// Input rows per tile of the VNNI kernel: 4 rows × 2 groups keep 16 accumulators in registers.
const TILE_ROWS: usize = 4;
/// Below this many multiply-adds a product runs on the calling thread alone.
const PARALLEL_MIN_MACS: usize = 1 << 20;

/// The packed blocks of a quantized `(out, in)` weight: outputs `first_group × GROUP..` of a
/// store that views may share (a layer's q, k and v are views of their joined rows).
#[derive(Debug, Clone)]
pub struct PackedBlocks {
    store: Arc<Store>,
    first_group: usize,
    out_features: usize,
    in_features: usize,
    /// Output `silu(y[..h]) × y[h..]` (h = out / 2) instead of `y`: a joined gate/up product
    /// that hands the down projection its input.
    silu_mul: bool,
}

/// The packed values of one or more weights' rows.
#[derive(Debug)]
struct Store {
    /// Per group of `GROUP` outputs (the last one padded with zeros), per block: for each run
    /// of four values, the four quants of each output in turn.
    quants: Vec<u8>,
    /// Per group, per block: each output's scale.
    scales: Vec<f32>,
    /// Per group, per block: each output's offset (added once per unit of input).
    offsets: Vec<f32>,
}

/// Input rows quantized to 8-bit blocks.
#[derive(Debug, Default)]
struct Inputs {
    quants: Vec<i8>,
    scales: Vec<f32>,
    /// Per block: the scale × Σ quants, what a block's offset multiplies.
    sums: Vec<f32>,
}

/// One weight group onwards and one input row onwards, as a tile reads them.
#[derive(Debug, Clone, Copy)]
pub struct TileInputs<'a> {
    /// Blocks per row.
    pub blocks: usize,
    /// From the first group of the tile on (see [`Store`]).
    pub quants: &'a [u8],
    pub scales: &'a [f32],
    pub offsets: &'a [f32],
    /// From the first input row of the tile on, rows of `blocks × BLOCK`.
    pub x_quants: &'a [i8],
    /// Per block, from the first input row of the tile on.
    pub x_scales: &'a [f32],
    pub x_sums: &'a [f32],
}

thread_local! {
    /// A worker's products of a joined gate/up chunk, before SiLU(gate) × up.
    static GATE_UP: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

impl PackedBlocks {
    /// Whether a weight can be packed: one of the 32-value forms or Q4_K, rows of whole blocks.
    pub fn takes(weight: &QTensor) -> bool {
        matches!(
            weight.dtype(),
            GgmlDType::Q4_0 | GgmlDType::Q4_1 | GgmlDType::Q8_0 | GgmlDType::Q4K
        ) && weight
            .shape()
            .dims2()
            .is_ok_and(|(n, k)| n > 0 && k > 0 && k.is_multiple_of(weight.dtype().block_size()))
    }

    /// Repacks the blocks of `weight` (no rounding: every value is the stored one).
    pub fn new(weight: &QTensor) -> Result<Self> {
        Self::joined(&[weight])
    }

    /// The rows of `weights` one after another, repacked: one product for several matrices
    /// that take the same input (q, k and v; gate and up). They must share a type and `in`.
    pub fn joined(weights: &[&QTensor]) -> Result<Self> {
        let Some(first) = weights.first() else {
            bail!("packed blocks: no weights given")
        };
        let dtype = first.dtype();
        let format = match Format::of(dtype) {
            Some(f @ (Format::Q4_0 | Format::Q4_1 | Format::Q8_0 | Format::Q4K)) => f,
            _ => bail!("packed blocks: GGUF type {dtype:?} is not one of Q4_0, Q4_1, Q8_0, Q4_K"),
        };
        let (_, k) = first.shape().dims2()?;
        if k == 0 || !k.is_multiple_of(format.block_values()) {
            bail!(
                "packed blocks: in_features ({k}) must be a positive multiple of {dtype:?}'s \
                 block ({})",
                format.block_values()
            )
        }
        let row_bytes = k / format.block_values() * format.block_bytes();
        let mut rows = Vec::with_capacity(weights.len());
        for weight in weights {
            let (n, in_features) = weight.shape().dims2()?;
            if weight.dtype() != dtype || in_features != k || n == 0 {
                bail!(
                    "packed blocks: joined weights must share type and in_features: {:?} \
                     {n}x{in_features} after {dtype:?} x {k}",
                    weight.dtype()
                )
            }
            let bytes = weight.data()?;
            if bytes.len() != n * row_bytes {
                bail!(
                    "packed blocks: a {n}x{k} {dtype:?} weight holds {} bytes, expected {}",
                    bytes.len(),
                    n * row_bytes
                )
            }
            rows.push(bytes);
        }
        let n: usize = rows.iter().map(|bytes| bytes.len() / row_bytes).sum();
        let blocks = k / BLOCK;
        let groups = n.div_ceil(GROUP);
        let mut store = Store {
            quants: vec![0; groups * blocks * GROUP_BLOCK_BYTES],
            scales: vec![0.0; groups * blocks * GROUP],
            offsets: vec![0.0; groups * blocks * GROUP],
        };
        let all_rows = rows.iter().flat_map(|bytes| bytes.chunks_exact(row_bytes));
        for (o, row) in all_rows.enumerate() {
            let (group, lane) = (o / GROUP, o % GROUP);
            unsigned_blocks(format, row, |b, quants, scale, offset| {
                let at = group * blocks + b;
                let base = at * GROUP_BLOCK_BYTES + lane * 4;
                for (run, four) in quants.chunks_exact(4).enumerate() {
                    let to = base + run * GROUP * 4;
                    store.quants[to..to + 4].copy_from_slice(four);
                }
                store.scales[at * GROUP + lane] = scale;
                store.offsets[at * GROUP + lane] = offset;
            });
        }
        Ok(Self {
            store: Arc::new(store),
            first_group: 0,
            out_features: n,
            in_features: k,
            silu_mul: false,
        })
    }

    /// Rows `start..start + count` of this weight, sharing its blocks: `start` must begin a
    /// group of `GROUP` rows.
    pub fn rows(&self, start: usize, count: usize) -> Result<Self> {
        if self.silu_mul
            || start + count > self.out_features
            || count == 0
            || !start.is_multiple_of(GROUP)
        {
            bail!(
                "packed blocks: no view of rows {start}..{} of {} (views start at multiples of \
                 {GROUP})",
                start + count,
                self.out_features
            )
        }
        Ok(Self {
            store: Arc::clone(&self.store),
            first_group: self.first_group + start / GROUP,
            out_features: count,
            ..*self
        })
    }

    /// The same rows with outputs `silu(y[..h]) × y[h..]`, h = out / 2: for the rows of a gate
    /// projection followed by those of an up projection.
    pub fn with_silu_mul(mut self) -> Result<Self> {
        if !self.out_features.is_multiple_of(2) {
            bail!(
                "packed blocks: SiLU(gate) × up needs an even number of rows, got {}",
                self.out_features
            )
        }
        self.silu_mul = true;
        Ok(self)
    }

    /// Output values per input row.
    fn outputs(&self) -> usize {
        if self.silu_mul {
            self.out_features / 2
        } else {
            self.out_features
        }
    }

    /// `x (…, in)` → `(…, out)`, f32 on the CPU.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.apply_op1_no_bwd(self)
    }

    /// `out[r * outputs + o]` = weight row o · input row r for the rows of `x` (a multiple of
    /// `in_features` long), or SiLU(gate) × up of them, with `kernel` (which must run here).
    pub fn products(&self, kernel: Kernel, x: &[f32], out: &mut [f32]) -> Result<()> {
        let (n, k) = (self.outputs(), self.in_features);
        if !x.len().is_multiple_of(k) {
            bail!(
                "packed blocks: input of {} values is not rows of {k}",
                x.len()
            )
        }
        let rows = x.len() / k;
        if out.len() != rows * n {
            bail!(
                "packed blocks: output of {} values for {rows} rows of {n}",
                out.len()
            )
        }
        if !kernel.runs_here() {
            bail!("packed blocks: the {kernel:?} kernel does not run on this CPU")
        }
        if rows == 0 {
            return Ok(());
        }
        let parallel = rows * self.out_features * k >= PARALLEL_MIN_MACS;
        let inputs = quantize(x, k, parallel);
        // Enough chunks of rows that a descheduled worker's share is soon taken over, each a
        // whole number of tiles.
        let threads = if parallel {
            rayon::current_num_threads()
        } else {
            1
        };
        let chunk = rows
            .div_ceil(4 * threads)
            .next_multiple_of(TILE_ROWS)
            .clamp(TILE_ROWS, 32);
        let run = |(c, out): (usize, &mut [f32])| {
            if self.silu_mul {
                GATE_UP.with(|held| {
                    let mut own = Vec::new();
                    let mut held = held.try_borrow_mut();
                    let gate_up = match held.as_deref_mut() {
                        Ok(held) => held,
                        Err(_) => &mut own,
                    };
                    gate_up.resize(out.len() * 2, 0.0);
                    self.chunk(kernel, &inputs, c * chunk, gate_up);
                    silu_mul(gate_up, out, n);
                })
            } else {
                self.chunk(kernel, &inputs, c * chunk, out)
            }
        };
        if parallel {
            out.par_chunks_mut(chunk * n).enumerate().for_each(run);
        } else {
            out.chunks_mut(chunk * n).enumerate().for_each(run);
        }
        Ok(())
    }

    /// The products of input rows `first..` into `out` (whole rows of `out_features`).
    fn chunk(&self, kernel: Kernel, inputs: &Inputs, first: usize, out: &mut [f32]) {
        let (n, blocks) = (self.out_features, self.in_features / BLOCK);
        let rows = out.len() / n;
        let groups = n.div_ceil(GROUP);
        let store = &*self.store;
        for g in (0..groups).step_by(2) {
            let cols = (n - g * GROUP).min(2 * GROUP);
            let group = self.first_group + g;
            let mut r = 0;
            while r < rows {
                let row = first + r;
                let tile_inputs = TileInputs {
                    blocks,
                    quants: &store.quants[group * blocks * GROUP_BLOCK_BYTES..],
                    scales: &store.scales[group * blocks * GROUP..],
                    offsets: &store.offsets[group * blocks * GROUP..],
                    x_quants: &inputs.quants[row * blocks * BLOCK..],
                    x_scales: &inputs.scales[row * blocks..],
                    x_sums: &inputs.sums[row * blocks..],
                };
                let out = &mut out[r * n + g * GROUP..];
                let tiled = rows - r >= TILE_ROWS;
                r += if tiled { TILE_ROWS } else { 1 };
                #[cfg(target_arch = "x86_64")]
                if kernel == Kernel::Vnni {
                    use super::packed_vnni::tile;
                    // SAFETY: `kernel` runs here (checked by `products`), so the VNNI features
                    // were detected; the function checks its slices before loading.
                    unsafe {
                        match (tiled, cols > GROUP) {
                            (true, true) => tile::<TILE_ROWS, 2>(tile_inputs, out, n, cols),
                            (true, false) => tile::<TILE_ROWS, 1>(tile_inputs, out, n, cols),
                            (false, true) => tile::<1, 2>(tile_inputs, out, n, cols),
                            (false, false) => tile::<1, 1>(tile_inputs, out, n, cols),
                        }
                    }
                    continue;
                }
                tile_portable(tile_inputs, if tiled { TILE_ROWS } else { 1 }, out, n, cols);
            }
        }
    }
}

/// `out[r][o] = silu(gate_up[r][o]) × gate_up[r][h + o]`, rows of `h` outputs: candle's SiLU
/// (x / (1 + e^−x)) then the product, as the unjoined layers compute it, with AVX-512 where the
/// CPU has it.
fn silu_mul(gate_up: &[f32], out: &mut [f32], h: usize) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512 F was detected just above.
        unsafe { super::packed_vnni::silu_mul(gate_up, out, h) };
        return;
    }
    super::silu_mul_rows(gate_up, out, h);
}

/// The blocks of one stored row of `format` as `(block, 32 unsigned quants, scale, offset)`:
/// value = scale × quant + offset.
fn unsigned_blocks(format: Format, row: &[u8], mut f: impl FnMut(usize, &[u8; BLOCK], f32, f32)) {
    let mut quants = [0u8; BLOCK];
    match format {
        Format::Q4_0 | Format::Q4_1 => {
            let qs_at = if format == Format::Q4_1 { 4 } else { 2 };
            for (b, block) in row.chunks_exact(format.block_bytes()).enumerate() {
                for (l, &byte) in block[qs_at..qs_at + BLOCK / 2].iter().enumerate() {
                    quants[l] = byte & 0x0F;
                    quants[l + BLOCK / 2] = byte >> 4;
                }
                let d = f16_at(block, 0);
                let offset = if format == Format::Q4_1 {
                    f16_at(block, 2)
                } else {
                    -8.0 * d
                };
                f(b, &quants, d, offset);
            }
        }
        Format::Q8_0 => {
            for (b, block) in row.chunks_exact(format.block_bytes()).enumerate() {
                for (q, &byte) in quants.iter_mut().zip(&block[2..2 + BLOCK]) {
                    *q = (byte as i8 as i16 + 128) as u8;
                }
                let d = f16_at(block, 0);
                f(b, &quants, d, -128.0 * d);
            }
        }
        Format::Q4K => {
            for (s, block) in row.chunks_exact(format.block_bytes()).enumerate() {
                let (values, scales, mins) = unpack_q4k(block);
                for j in 0..SUPER / BLOCK {
                    quants.copy_from_slice(&values[j * BLOCK..(j + 1) * BLOCK]);
                    f(s * SUPER / BLOCK + j, &quants, scales[j], -mins[j]);
                }
            }
        }
        Format::Q6K => unreachable!("packed blocks: Q6_K is refused by PackedBlocks::new"),
    }
}

/// Rows of `k` values quantized to 8-bit blocks, rows split over rayon's threads if `parallel`.
fn quantize(x: &[f32], k: usize, parallel: bool) -> Inputs {
    let blocks = x.len() / BLOCK;
    let mut inputs = Inputs {
        quants: vec![0; blocks * BLOCK],
        scales: vec![0.0; blocks],
        sums: vec![0.0; blocks],
    };
    let task = (64 * 1024 / k).max(1) * k;
    if parallel {
        (
            x.par_chunks(task),
            inputs.quants.par_chunks_mut(task),
            inputs.scales.par_chunks_mut(task / BLOCK),
            inputs.sums.par_chunks_mut(task / BLOCK),
        )
            .into_par_iter()
            .for_each(|(x, q, scales, sums)| quantize_rows(x, q, scales, sums));
    } else {
        quantize_rows(x, &mut inputs.quants, &mut inputs.scales, &mut inputs.sums);
    }
    inputs
}

/// [`quantize_block`] over whole blocks, with each block's scale × Σ quants.
fn quantize_rows(x: &[f32], quants: &mut [i8], scales: &mut [f32], sums: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
    {
        // SAFETY: the features were detected just above; the function checks its slices.
        unsafe { super::packed_vnni::quantize_rows(x, quants, scales, sums) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 was detected; the function is the portable code compiled with it.
        unsafe { quantize_rows_avx2(x, quants, scales, sums) };
        return;
    }
    quantize_rows_portable(x, quants, scales, sums);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn quantize_rows_avx2(x: &[f32], quants: &mut [i8], scales: &mut [f32], sums: &mut [f32]) {
    quantize_rows_portable(x, quants, scales, sums);
}

#[inline(always)]
fn quantize_rows_portable(x: &[f32], quants: &mut [i8], scales: &mut [f32], sums: &mut [f32]) {
    for (((block, q), scale), sum) in x
        .chunks_exact(BLOCK)
        .zip(quants.chunks_exact_mut(BLOCK))
        .zip(scales.iter_mut())
        .zip(sums.iter_mut())
    {
        *scale = quantize_block(block, q);
        *sum = *scale * q.iter().map(|&q| i32::from(q)).sum::<i32>() as f32;
    }
}

/// The portable form of the VNNI tile: the same block terms in the same order (a fused
/// multiply-add each), so both give the same outputs.
fn tile_portable(t: TileInputs, rows: usize, out: &mut [f32], stride: usize, cols: usize) {
    let row_len = t.blocks * BLOCK;
    for r in 0..rows {
        for c in 0..cols {
            let (group, lane) = (c / GROUP, c % GROUP);
            let mut acc = 0f32;
            for b in 0..t.blocks {
                let at = group * t.blocks + b;
                let w = &t.quants[at * GROUP_BLOCK_BYTES..(at + 1) * GROUP_BLOCK_BYTES];
                let x = &t.x_quants[r * row_len + b * BLOCK..r * row_len + (b + 1) * BLOCK];
                let dot: i32 = (0..BLOCK)
                    .map(|v| i32::from(w[(v / 4) * GROUP * 4 + lane * 4 + v % 4]) * i32::from(x[v]))
                    .sum();
                let scale = t.scales[at * GROUP + lane] * t.x_scales[r * t.blocks + b];
                acc = (dot as f32).mul_add(scale, acc);
                acc = t.offsets[at * GROUP + lane].mul_add(t.x_sums[r * t.blocks + b], acc);
            }
            out[r * stride + c] = acc;
        }
    }
}

impl CustomOp1 for PackedBlocks {
    fn name(&self) -> &'static str {
        "packed-blocks-matmul"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = crate::models::q8_rows::contiguous_f32_rows(
            "packed blocks",
            storage,
            layout,
            self.in_features,
        )?;
        let rows = x.len() / self.in_features;
        let mut out = vec![0f32; rows * self.outputs()];
        self.products(Kernel::detect(), x, &mut out)?;
        let mut shape = layout.dims().to_vec();
        if let Some(last) = shape.last_mut() {
            *last = self.outputs();
        }
        Ok((CpuStorage::F32(out), Shape::from(shape)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn values(seed: u64, len: usize, scale: f32) -> Vec<f32> {
        let mut state = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        (0..len)
            .map(|_| {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
            })
            .collect()
    }

    /// Every form, on the kernels this CPU runs, against the f64 product of the dequantized
    /// weight with the dequantized 8-bit inputs; the kernels agree bit for bit; row counts and
    /// output counts off the tile sizes go through the remainders.
    #[test]
    fn every_form_matches_the_f64_reference() -> Result<()> {
        let dev = Device::Cpu;
        for (dtype, n, k) in [
            (GgmlDType::Q4_1, 37, 96),
            (GgmlDType::Q4_1, 64, 576),
            (GgmlDType::Q4_0, 21, 96),
            (GgmlDType::Q8_0, 50, 160),
            (GgmlDType::Q4K, 17, 512),
        ] {
            let w = Tensor::from_vec(values(k as u64, n * k, 2.0), (n, k), &dev)?;
            let weight = QTensor::quantize(&w, dtype)?;
            let dense = weight.dequantize(&dev)?.to_vec2::<f32>()?;
            let packed = PackedBlocks::new(&weight)?;
            let rows = 7;
            let x = values(9, rows * k, 3.0);
            let inputs = quantize(&x, k, false);
            let mut outs = Vec::new();
            for kernel in [Kernel::Vnni, Kernel::Portable] {
                if !kernel.runs_here() {
                    continue;
                }
                let mut got = vec![f32::NAN; rows * n];
                packed.products(kernel, &x, &mut got)?;
                for r in 0..rows {
                    for o in 0..n {
                        let (mut exact, mut magnitude) = (0f64, 0f64);
                        for (i, &w) in dense[o].iter().enumerate() {
                            let xi = f64::from(inputs.scales[r * k / BLOCK + i / BLOCK])
                                * f64::from(inputs.quants[r * k + i]);
                            exact += f64::from(w) * xi;
                            magnitude += (f64::from(w) * xi).abs();
                        }
                        let y = f64::from(got[r * n + o]);
                        assert!(
                            (y - exact).abs() <= 1e-5 * magnitude + 1e-9,
                            "{dtype:?} {kernel:?} row {r} out {o}: {y} vs {exact}"
                        );
                    }
                }
                outs.push(got);
            }
            for other in &outs[1..] {
                assert_eq!(&outs[0], other, "{dtype:?}: kernels disagree");
            }
        }
        Ok(())
    }

    /// Through the op: shapes follow the input, rows split over threads give each row's
    /// product alone, and refused types and shapes are errors.
    #[test]
    fn the_op_and_its_refusals() -> Result<()> {
        let dev = Device::Cpu;
        let (n, k) = (200, 576);
        let weight = QTensor::quantize(
            &Tensor::from_vec(values(1, n * k, 1.0), (n, k), &dev)?,
            GgmlDType::Q4_1,
        )?;
        let packed = PackedBlocks::new(&weight)?;
        let x = Tensor::from_vec(values(5, 70 * k, 1.0), (1, 70, k), &dev)?;
        let all = packed.forward(&x)?;
        assert_eq!(all.dims(), [1, 70, n]);
        for r in [0, 3, 69] {
            let alone = packed.forward(&x.narrow(1, r, 1)?)?;
            assert_eq!(
                alone.flatten_all()?.to_vec1::<f32>()?,
                all.narrow(1, r, 1)?.flatten_all()?.to_vec1::<f32>()?
            );
        }
        assert!(packed
            .forward(&Tensor::zeros((2, 100), candle_core::DType::F32, &dev)?)
            .is_err());
        let q6 = QTensor::quantize(
            &Tensor::zeros((4, 256), candle_core::DType::F32, &dev)?,
            GgmlDType::Q6K,
        )?;
        assert!(!PackedBlocks::takes(&q6) && PackedBlocks::new(&q6).is_err());
        assert!(packed.rows(8, 16).is_err() && packed.rows(192, 16).is_err());
        Ok(())
    }

    /// Joined weights and their views give each part's products; SiLU(gate) × up of a joined
    /// gate/up is that of the parts' products.
    #[test]
    fn joined_views_and_silu_mul_equal_the_parts() -> Result<()> {
        let dev = Device::Cpu;
        let k = 192;
        let part = |seed, n| -> Result<QTensor> {
            QTensor::quantize(
                &Tensor::from_vec(values(seed, n * k, 1.0), (n, k), &dev)?,
                GgmlDType::Q4_1,
            )
        };
        let (a, b) = (part(1, 48)?, part(2, 48)?);
        let joined = PackedBlocks::joined(&[&a, &b])?;
        let x = Tensor::from_vec(values(5, 9 * k, 2.0), (9, k), &dev)?;
        let all = joined.forward(&x)?;
        let (ya, yb) = (
            PackedBlocks::new(&a)?.forward(&x)?,
            PackedBlocks::new(&b)?.forward(&x)?,
        );
        assert_eq!(
            all.to_vec2::<f32>()?,
            Tensor::cat(&[&ya, &yb], 1)?.to_vec2::<f32>()?
        );
        assert_eq!(
            joined.rows(48, 48)?.forward(&x)?.to_vec2::<f32>()?,
            yb.to_vec2::<f32>()?
        );
        let activated = joined.with_silu_mul()?.forward(&x)?;
        let want = (candle_nn::ops::silu(&ya)? * &yb)?;
        let diff = (activated - &want)?.abs()?.flatten_all()?.max(0)?;
        let scale = want.abs()?.flatten_all()?.max(0)?;
        assert!(diff.to_scalar::<f32>()? <= 1e-6 * scale.to_scalar::<f32>()?);
        Ok(())
    }
}
