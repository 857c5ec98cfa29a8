//! `GgufRows`: a weight kept in its GGUF blocks as stored (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K),
//! multiplied row by row with rayon, for decode inputs on the CPU.
//!
//! A decode step is bound by the bytes of the weights it reads. The default model ships Q4_1
//! (0.625 bytes a weight); converted to 8-bit rows at load it read 1.125. Here the stored blocks
//! are read as they are, and each input row is quantized once per product to 8-bit blocks (see
//! [`act`]), so that a block's dot is integer arithmetic: AVX-512 VNNI where the CPU has it,
//! AVX2 otherwise, portable code elsewhere, picked once at run time ([`Kernel::detect`]).
//!
//! Threads: as in [`super::q8_rows`], rayon tasks of a few weight rows each, so that when a
//! worker is descheduled (other processes share the cores) the ones that run take over its rows,
//! where a spinning barrier (candle's quantized matmul) would wait for it.
//!
//! Each input row's product is computed alone, in the same order whatever the number of rows,
//! so a row's product does not depend on the rows beside it (verification passes multiply a few
//! rows at once and must see the logits decode steps see).

use std::cell::RefCell;
use std::sync::{Arc, OnceLock};

use candle_core::quantized::QTensor;
use candle_core::{bail, CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

mod act;
mod formats;
mod packed;
// AVX-512 intrinsics and target features are stable from Rust 1.89, the crate's rust-version.
#[cfg(target_arch = "x86_64")]
mod packed_vnni;
#[cfg(target_arch = "x86_64")]
mod x86;

use act::{ActRow, QuantizedRows, BLOCK};
pub use formats::Format;
pub use packed::PackedBlocks;

/// Weight rows per rayon task: enough work to amortise scheduling (16 rows of 576 Q4_1 values
/// are 5.6 KiB), small enough that a descheduled worker's share is soon taken over.
const ROWS_PER_TASK: usize = 16;
/// Below this many block products (weight blocks × input rows) one thread finishes sooner
/// than waking the others.
const PARALLEL_MIN_BLOCK_PRODUCTS: usize = 1 << 12;

/// Rows of at most this many 32-value blocks are multiplied four at a time under VNNI.
const SHORT_ROW_BLOCKS: usize = 32;

/// The dot-product code, picked once per process from the CPU's features.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    /// AVX-512 F/BW/VL and VNNI (with AVX2, F16C, FMA).
    Vnni,
    /// AVX2, F16C and FMA.
    Avx2,
    /// No SIMD of our own (what the compiler makes of plain loops).
    Portable,
}

impl Kernel {
    /// The best kernel this CPU runs.
    pub fn detect() -> Self {
        static DETECTED: OnceLock<Kernel> = OnceLock::new();
        *DETECTED.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                use std::arch::is_x86_feature_detected as has;
                let avx2 = has!("avx2") && has!("f16c") && has!("fma");
                if avx2
                    && has!("avx512f")
                    && has!("avx512bw")
                    && has!("avx512vl")
                    && has!("avx512vnni")
                {
                    return Kernel::Vnni;
                }
                if avx2 {
                    return Kernel::Avx2;
                }
            }
            Kernel::Portable
        })
    }

    /// Whether this CPU runs `self`.
    pub fn runs_here(self) -> bool {
        matches!(
            (self, Self::detect()),
            (Kernel::Portable, _)
                | (Kernel::Avx2, Kernel::Vnni | Kernel::Avx2)
                | (Kernel::Vnni, Kernel::Vnni)
        )
    }

    /// `ys[i]` = stored row `i` of `rows` (rows of `row_bytes`) · `x`, several rows at a time
    /// where the kernel reads the input once for them: each the product [`Kernel::dot`] gives.
    fn dots(self, format: Format, rows: &[u8], row_bytes: usize, x: ActRow, ys: &mut [f32]) {
        const R: usize = 4;
        let mut done = 0;
        #[cfg(target_arch = "x86_64")]
        // Four Q4 rows at a time (VNNI) measured 8% faster per block than one at a time on
        // rows of 576 values, and a third slower on rows of 4,608 (four streams of long rows
        // apart in memory): short rows only. For Q8_0 the AVX2 form, one row at a time,
        // measured faster still.
        if self == Kernel::Vnni
            && matches!(format, Format::Q4_0 | Format::Q4_1)
            && x.blocks() <= SHORT_ROW_BLOCKS
        {
            while done + R <= ys.len() {
                let row = |i: usize| &rows[(done + i) * row_bytes..(done + i + 1) * row_bytes];
                let group = [row(0), row(1), row(2), row(3)];
                // SAFETY: as in `dot`: `self` runs here, and the function checks its slices.
                let out = unsafe {
                    match format {
                        Format::Q4_1 => x86::q4_vnni_rows::<true, R>(group, x),
                        _ => x86::q4_vnni_rows::<false, R>(group, x),
                    }
                };
                ys[done..done + R].copy_from_slice(&out);
                done += R;
            }
        }
        for (i, y) in ys.iter_mut().enumerate().skip(done) {
            *y = self.dot(format, &rows[i * row_bytes..(i + 1) * row_bytes], x);
        }
    }

    /// Stored row `row` · `x` (the row holds whole blocks covering `x`'s values). `self` must
    /// run here ([`Kernel::runs_here`]); forms without SIMD code of their own run portably.
    fn dot(self, format: Format, row: &[u8], x: ActRow) -> f32 {
        debug_assert!(self.runs_here());
        #[cfg(target_arch = "x86_64")]
        {
            // SAFETY (each call): `self` runs here, i.e. its features were detected at run time
            // by `Kernel::detect` (tests only pass kernels for which `runs_here` holds). The
            // functions check their slices' lengths before loading.
            match (self, format) {
                (Kernel::Vnni, Format::Q4_1) => return unsafe { x86::q4_vnni::<true>(row, x) },
                (Kernel::Vnni, Format::Q4_0) => return unsafe { x86::q4_vnni::<false>(row, x) },
                (Kernel::Vnni, Format::Q8_0) => return unsafe { x86::q8_0_avx2(row, x) },
                (Kernel::Avx2, Format::Q4_1) => return unsafe { x86::q4_avx2::<true>(row, x) },
                (Kernel::Avx2, Format::Q4_0) => return unsafe { x86::q4_avx2::<false>(row, x) },
                (Kernel::Avx2, Format::Q8_0) => return unsafe { x86::q8_0_avx2(row, x) },
                _ => {}
            }
        }
        formats::dot_scalar(format, row, x)
    }
}

/// An `(out, in)` weight in its stored GGUF blocks, row-major (each row whole blocks): rows
/// `first_row..first_row + out_features` of a block store that views may share (a layer's
/// q, k and v are views of their joined rows).
#[derive(Debug, Clone)]
pub struct GgufRows {
    format: Format,
    data: Arc<Vec<u8>>,
    row_bytes: usize,
    first_row: usize,
    out_features: usize,
    in_features: usize,
    /// Output `silu(y[..h]) × y[h..]` (h = out / 2) instead of `y`: a joined gate/up product
    /// that hands the down projection its input.
    silu_mul: bool,
}

thread_local! {
    /// The calling thread's quantized inputs, reused from product to product.
    static INPUTS: RefCell<QuantizedRows> = RefCell::new(QuantizedRows::default());
}

impl GgufRows {
    /// Whether a stored type can be kept this way.
    pub fn takes(weight: &QTensor) -> bool {
        Format::of(weight.dtype()).is_some()
            && weight
                .shape()
                .dims2()
                .is_ok_and(|(_, k)| k > 0 && k.is_multiple_of(weight.dtype().block_size()))
    }

    /// The blocks of a quantized `(out, in)` weight, copied as stored.
    pub fn new(weight: &QTensor) -> Result<Self> {
        Self::joined(&[weight])
    }

    /// The rows of `weights` one after another, as stored: one product for several matrices
    /// that take the same input (q, k and v; gate and up). They must share a type and `in`.
    pub fn joined(weights: &[&QTensor]) -> Result<Self> {
        let Some(first) = weights.first() else {
            bail!("stored rows: no weights given")
        };
        let dtype = first.dtype();
        let Some(format) = Format::of(dtype) else {
            bail!("stored rows: GGUF type {dtype:?} is not one of Q4_0, Q4_1, Q8_0, Q4_K, Q6_K")
        };
        let (_, in_features) = first.shape().dims2()?;
        if in_features == 0 || !in_features.is_multiple_of(format.block_values()) {
            bail!(
                "stored rows: in_features ({in_features}) must be a positive multiple of {:?}'s \
                 block ({})",
                dtype,
                format.block_values()
            )
        }
        let row_bytes = in_features / format.block_values() * format.block_bytes();
        let mut data = Vec::new();
        let mut out_features = 0;
        for weight in weights {
            let (out, k) = weight.shape().dims2()?;
            if weight.dtype() != dtype || k != in_features {
                bail!(
                    "stored rows: joined weights must share type and in_features: {:?} x {k} \
                     after {dtype:?} x {in_features}",
                    weight.dtype()
                )
            }
            let bytes = weight.data()?;
            if bytes.len() != out * row_bytes {
                bail!(
                    "stored rows: a {out}x{k} {dtype:?} weight holds {} bytes, expected {}",
                    bytes.len(),
                    out * row_bytes
                )
            }
            data.extend_from_slice(&bytes);
            out_features += out;
        }
        Ok(Self {
            format,
            data: Arc::new(data),
            row_bytes,
            first_row: 0,
            out_features,
            in_features,
            silu_mul: false,
        })
    }

    /// Rows `start..start + count` of this weight, sharing its blocks.
    pub fn rows(&self, start: usize, count: usize) -> Result<Self> {
        if self.silu_mul || start + count > self.out_features || count == 0 {
            bail!(
                "stored rows: no rows {start}..{} of {} to view",
                start + count,
                self.out_features
            )
        }
        Ok(Self {
            first_row: self.first_row + start,
            out_features: count,
            data: Arc::clone(&self.data),
            ..*self
        })
    }

    /// The same rows with outputs `silu(y[..h]) × y[h..]`, h = out / 2: for the rows of a gate
    /// projection followed by those of an up projection.
    pub fn with_silu_mul(mut self) -> Result<Self> {
        if !self.out_features.is_multiple_of(2) {
            bail!(
                "stored rows: SiLU(gate) × up needs an even number of rows, got {}",
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

    /// `out[r * out_features + o] = weight row o · input row r` for the rows of `x` (a multiple
    /// of `in_features` long), with `kernel` (which must run here).
    pub fn products(&self, kernel: Kernel, x: &[f32], out: &mut [f32]) -> Result<()> {
        if !x.len().is_multiple_of(self.in_features) {
            bail!(
                "stored rows: input of {} values is not rows of {}",
                x.len(),
                self.in_features
            )
        }
        let rows = x.len() / self.in_features;
        if out.len() != rows * self.out_features {
            bail!(
                "stored rows: output of {} values for {rows} rows of {}",
                out.len(),
                self.out_features
            )
        }
        if !kernel.runs_here() {
            bail!("stored rows: the {kernel:?} kernel does not run on this CPU")
        }
        if rows == 0 {
            return Ok(());
        }
        INPUTS.with(|held| {
            // A thread of the pool waiting on its tasks may run another product's (two models
            // on one pool): that one quantizes into a buffer of its own.
            let mut own = QuantizedRows::default();
            let mut held = held.try_borrow_mut();
            let inputs = match held.as_deref_mut() {
                Ok(held) => held,
                Err(_) => &mut own,
            };
            inputs.quantize(x, self.in_features);
            let inputs = &*inputs;
            let data = &self.data[self.first_row * self.row_bytes..];
            let blocks = self.in_features / BLOCK * self.out_features;
            for (r, out_row) in out.chunks_exact_mut(self.out_features).enumerate() {
                let x_row = inputs.row(r);
                let dots = |first: usize, ys: &mut [f32]| {
                    let rows = &data[first * self.row_bytes..];
                    kernel.dots(self.format, rows, self.row_bytes, x_row, ys);
                };
                if blocks < PARALLEL_MIN_BLOCK_PRODUCTS {
                    dots(0, out_row);
                } else {
                    out_row
                        .par_chunks_mut(ROWS_PER_TASK)
                        .enumerate()
                        .for_each(|(task, ys)| dots(task * ROWS_PER_TASK, ys));
                }
            }
        });
        Ok(())
    }
}

/// `out[r][o] = silu(gate_up[r][o]) × gate_up[r][h + o]` over rows of `h` outputs: candle's SiLU
/// (x / (1 + e^−x)), then the product, as the unjoined layers compute it.
fn silu_mul_rows(gate_up: &[f32], out: &mut [f32], h: usize) {
    for (y, out) in gate_up.chunks_exact(2 * h).zip(out.chunks_exact_mut(h)) {
        let (gate, up) = y.split_at(h);
        for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
            *o = g / (1.0 + (-g).exp()) * u;
        }
    }
}

impl CustomOp1 for GgufRows {
    fn name(&self) -> &'static str {
        "gguf-rows-matmul"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let x =
            super::q8_rows::contiguous_f32_rows("stored rows", storage, layout, self.in_features)?;
        let dims = layout.dims();
        let rows = x.len() / self.in_features;
        let mut out = vec![0f32; rows * self.out_features];
        self.products(Kernel::detect(), x, &mut out)?;
        if self.silu_mul {
            let half = self.out_features / 2;
            let mut activated = vec![0f32; rows * half];
            silu_mul_rows(&out, &mut activated, half);
            out = activated;
        }
        let mut shape = dims.to_vec();
        if let Some(last) = shape.last_mut() {
            *last = self.outputs();
        }
        Ok((CpuStorage::F32(out), Shape::from(shape)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::GgmlDType;
    use candle_core::{DType, Device};

    const KERNELS: [Kernel; 3] = [Kernel::Vnni, Kernel::Avx2, Kernel::Portable];

    /// Deterministic values in ±`scale`, with edge blocks: all zero, one large value among
    /// small ones, all equal, alternating extremes.
    fn values(seed: u64, len: usize, scale: f32) -> Vec<f32> {
        let mut state = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        let mut v: Vec<f32> = (0..len)
            .map(|_| {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
            })
            .collect();
        let blocks = len / BLOCK;
        if blocks >= 4 {
            v[..BLOCK].fill(0.0);
            v[BLOCK..2 * BLOCK].iter_mut().for_each(|x| *x *= 1e-3);
            v[BLOCK + 5] = scale;
            v[2 * BLOCK..3 * BLOCK].fill(-scale);
            for (i, x) in v[3 * BLOCK..4 * BLOCK].iter_mut().enumerate() {
                *x = if i % 2 == 0 { scale } else { -scale };
            }
        }
        v
    }

    /// The f64 product of the dequantized weight with the dequantized 8-bit input row `r`.
    fn reference(weight: &QTensor, inputs: &QuantizedRows, r: usize) -> Result<Vec<(f64, f64)>> {
        let (n, k) = weight.shape().dims2()?;
        let w = weight.dequantize(&Device::Cpu)?.to_vec2::<f32>()?;
        let x = inputs.row(r);
        let xs: Vec<f64> = (0..k)
            .map(|i| f64::from(x.scales[i / BLOCK]) * f64::from(x.quants[i]))
            .collect();
        Ok((0..n)
            .map(|o| {
                let exact = (0..k).map(|i| f64::from(w[o][i]) * xs[i]).sum();
                let magnitude = (0..k).map(|i| (f64::from(w[o][i]) * xs[i]).abs()).sum();
                (exact, magnitude)
            })
            .collect())
    }

    /// Every form, every kernel this CPU runs, against the f64 reference on random blocks with
    /// edge values (and an odd number of 32-blocks for the 32-value forms, through the tails).
    #[test]
    fn every_form_and_kernel_matches_the_f64_reference() -> Result<()> {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512vnni")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("f16c")
            && std::arch::is_x86_feature_detected!("fma")
        {
            assert_eq!(Kernel::detect(), Kernel::Vnni);
        }
        let dev = Device::Cpu;
        for (dtype, k) in [
            (GgmlDType::Q4_1, 96),
            (GgmlDType::Q4_1, 576),
            (GgmlDType::Q4_1, 1568),
            (GgmlDType::Q4_0, 96),
            (GgmlDType::Q4_0, 576),
            (GgmlDType::Q8_0, 96),
            (GgmlDType::Q8_0, 576),
            (GgmlDType::Q4K, 512),
            (GgmlDType::Q6K, 512),
        ] {
            let n = 37;
            let w = Tensor::from_vec(values(k as u64, n * k, 2.0), (n, k), &dev)?;
            let weight = QTensor::quantize(&w, dtype)?;
            let rows = GgufRows::new(&weight)?;
            let x = values(7, 2 * k, 3.0);
            let mut inputs = QuantizedRows::default();
            inputs.quantize(&x, k);
            for r in 0..2 {
                let want = reference(&weight, &inputs, r)?;
                for kernel in KERNELS.into_iter().filter(|k| k.runs_here()) {
                    let mut got = vec![f32::NAN; 2 * n];
                    rows.products(kernel, &x, &mut got)?;
                    for (o, &(exact, magnitude)) in want.iter().enumerate() {
                        let y = f64::from(got[r * n + o]);
                        assert!(
                            (y - exact).abs() <= 1e-5 * magnitude + 1e-12,
                            "{dtype:?} k {k} {kernel:?} row {r} out {o}: {y} vs {exact}"
                        );
                    }
                }
            }
        }
        Ok(())
    }

    /// Q8_0 quants of -128 (which ggml's quantizer does not write, but a file may hold) and
    /// all-15 / all-0 nibbles.
    #[test]
    fn extreme_stored_quants() -> Result<()> {
        let k = 96;
        let x = values(3, k, 1.0);
        let mut inputs = QuantizedRows::default();
        inputs.quantize(&x, k);
        for (dtype, fill) in [
            (GgmlDType::Q8_0, 0x80u8),
            (GgmlDType::Q8_0, 0x7F),
            (GgmlDType::Q4_1, 0xFF),
            (GgmlDType::Q4_0, 0x00),
        ] {
            let format = Format::of(dtype).unwrap();
            let mut bytes = vec![fill; k / BLOCK * format.block_bytes()];
            for block in bytes.chunks_exact_mut(format.block_bytes()) {
                block[..2].copy_from_slice(&half::f16::from_f32(0.5).to_bits().to_le_bytes());
                if dtype == GgmlDType::Q4_1 {
                    block[2..4].copy_from_slice(&half::f16::from_f32(-1.5).to_bits().to_le_bytes());
                }
            }
            let storage = candle_core::quantized::QStorage::from_data(
                std::borrow::Cow::Owned(bytes),
                &Device::Cpu,
                dtype,
            )?;
            let weight = QTensor::new(storage, (1, k))?;
            let rows = GgufRows::new(&weight)?;
            let (exact, magnitude) = reference(&weight, &inputs, 0)?[0];
            for kernel in KERNELS.into_iter().filter(|k| k.runs_here()) {
                let mut got = [f32::NAN];
                rows.products(kernel, &x, &mut got)?;
                let y = f64::from(got[0]);
                assert!(
                    (y - exact).abs() <= 1e-5 * magnitude,
                    "{dtype:?} fill {fill:#x} {kernel:?}: {y} vs {exact}"
                );
            }
        }
        Ok(())
    }

    /// Joined weights give each part's products; several rows give each row's product alone,
    /// bit for bit; through the op, shapes follow the input.
    #[test]
    fn joined_and_batched_rows_equal_the_parts() -> Result<()> {
        let dev = Device::Cpu;
        let k = 576;
        let a = QTensor::quantize(
            &Tensor::from_vec(values(1, 300 * k, 1.0), (300, k), &dev)?,
            GgmlDType::Q4_1,
        )?;
        let b = QTensor::quantize(
            &Tensor::from_vec(values(2, 200 * k, 1.0), (200, k), &dev)?,
            GgmlDType::Q4_1,
        )?;
        let joined = GgufRows::joined(&[&a, &b])?;
        let x = Tensor::from_vec(values(5, 3 * k, 1.0), (1, 3, k), &dev)?;
        let all = joined.forward(&x)?;
        assert_eq!(all.dims(), [1, 3, 500]);
        let parts = Tensor::cat(
            &[
                GgufRows::new(&a)?.forward(&x)?,
                GgufRows::new(&b)?.forward(&x)?,
            ],
            2,
        )?;
        assert_eq!(all.to_vec3::<f32>()?, parts.to_vec3::<f32>()?);
        for r in 0..3 {
            let alone = joined.forward(&x.narrow(1, r, 1)?)?;
            assert_eq!(
                alone.flatten_all()?.to_vec1::<f32>()?,
                all.narrow(1, r, 1)?.flatten_all()?.to_vec1::<f32>()?
            );
        }
        assert!(GgufRows::joined(&[
            &a,
            &QTensor::quantize(&Tensor::zeros((4, 64), DType::F32, &dev)?, GgmlDType::Q4_1)?
        ])
        .is_err());
        Ok(())
    }
}

#[cfg(test)]
mod timing {
    use super::*;
    use candle_core::quantized::GgmlDType;
    use candle_core::Device;
    use std::time::Instant;

    /// `cargo test --release --lib gguf_rows::timing -- --ignored --nocapture`: single-thread
    /// kernel rates on a weight larger than the L2 cache.
    #[test]
    #[ignore]
    fn kernel_rates() -> Result<()> {
        let dev = Device::Cpu;
        // RATE_ROWS=131072 for weights larger than the last-level cache.
        let n: usize = std::env::var("RATE_ROWS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(4096);
        for (dtype, k) in [
            (GgmlDType::Q4_1, 576),
            (GgmlDType::Q4_1, 4608),
            (GgmlDType::Q8_0, 576),
            (GgmlDType::Q8_0, 4608),
            (GgmlDType::Q4_0, 576),
            (GgmlDType::Q4K, 512),
            (GgmlDType::Q6K, 512),
        ] {
            let w = Tensor::randn(0f32, 1.0, (n, k), &dev)?;
            let x: Vec<f32> = Tensor::randn(0f32, 1.0, k, &dev)?.to_vec1()?;
            let rows = GgufRows::new(&QTensor::quantize(&w, dtype)?)?;
            let mut inputs = QuantizedRows::default();
            inputs.quantize(&x, k);
            for kernel in [Kernel::Vnni, Kernel::Avx2, Kernel::Portable] {
                if !kernel.runs_here() {
                    continue;
                }
                // The fastest of many passes: the machine is shared, and a pass that was not
                // interrupted is what the kernel costs.
                let mut s = f64::INFINITY;
                let mut sink = 0f32;
                for _ in 0..(200 * 4096 / n).max(5) {
                    let start = Instant::now();
                    let mut ys = vec![0f32; n];
                    kernel.dots(
                        rows.format,
                        &rows.data,
                        rows.row_bytes,
                        inputs.row(0),
                        &mut ys,
                    );
                    sink += ys[n / 3];
                    s = s.min(start.elapsed().as_secs_f64());
                }
                println!(
                    "{dtype:?} {kernel:?}: {:.1} us per {n}x{k}, {:.2} GB/s, {:.2} ns/block ({sink})",
                    s * 1e6,
                    rows.data.len() as f64 / s / 1e9,
                    s * 1e9 / (n * k / 32) as f64
                );
            }
        }
        Ok(())
    }
}
