//! The form quantized GGUF weights are multiplied in, chosen at load time by measurement.
//!
//! Candle's CPU matmul speed depends on the storage type: some quantized types have SIMD dot
//! products, others (Q4_1 in candle 0.11) run scalar code, and dense f32 goes through an
//! optimised gemm that wins once there are many rows. So on the CPU, for each stored type, one
//! weight of that type is timed in each candidate form, at one row (decode) and at many rows
//! (prefill), and the fastest form per regime is kept (candle's quantized matmul is handicapped
//! for its behaviour on shared cores, see `SPIN_BARRIER_PENALTY`). Elsewhere (CUDA, Metal) weights stay as
//! stored: the device kernels handle every type.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{bail, DType, Device, Module, Result, Tensor};

use super::gguf_rows::{GgufRows, Kernel, PackedBlocks};
use super::linear::{Linear, LinearWeight};
use super::q8_rows::Q8Rows;

/// A form a weight can be multiplied in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightForm {
    /// The GGUF storage type, through `QMatMul`.
    AsStored,
    /// Requantized to Q8_0 (SIMD dot products on x86 and ARM), through `QMatMul`.
    Q8_0,
    /// Requantized to Q8_0, through the crate's rayon kernel (`Q8Rows`). CPU, single rows
    /// only: it is timed for decode and never picked for prefill.
    Q8_0Rows,
    /// Dequantized to dense f32, through gemm.
    DenseF32,
    /// The GGUF blocks as stored (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K), through the crate's rayon
    /// kernel with 8-bit inputs and integer dot products (`GgufRows`). CPU, single rows only,
    /// like `Q8_0Rows`.
    StoredRows,
    /// The GGUF 32-value blocks (Q4_0, Q4_1, Q8_0, Q4_K) repacked for the crate's many-row
    /// kernel with 8-bit inputs (`PackedBlocks`). CPU; timed for prompts only, and only where
    /// the CPU has AVX-512 VNNI (the portable form is for correctness elsewhere).
    PackedBlocks,
}

impl WeightForm {
    /// Whether this form runs the crate's single-row kernels (CPU, decode only).
    fn is_rows_kernel(self) -> bool {
        matches!(self, Self::Q8_0Rows | Self::StoredRows)
    }

    /// Whether this form is timed for prompts only.
    fn is_many_rows_kernel(self) -> bool {
        self == Self::PackedBlocks
    }
}

impl fmt::Display for WeightForm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::AsStored => "as stored",
            Self::Q8_0 => "Q8_0",
            Self::Q8_0Rows => "Q8_0 rows",
            Self::DenseF32 => "dense f32",
            Self::StoredRows => "stored rows",
            Self::PackedBlocks => "packed blocks",
        })
    }
}

/// How to pick weight forms at load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightFormPolicy {
    /// Time the candidates on the CPU; keep weights as stored on other devices.
    #[default]
    Measure,
    /// Use this form for every quantized weight (no measurement).
    Fixed(WeightForm),
    /// Use this form for single rows (decode) wherever it takes the weight, and choose the
    /// many-row form by measurement as `Measure` does: for A/B runs of decode forms.
    FixedDecode(WeightForm),
}

/// The forms chosen for one stored type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WeightPlan {
    /// For single-row inputs.
    pub decode: WeightForm,
    /// For many-row inputs.
    pub prefill: WeightForm,
}

/// One candidate's measured time per matmul.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct FormTiming {
    pub form: WeightForm,
    /// `None` when only many rows were timed.
    pub decode: Option<Duration>,
    /// `None` when only single rows were timed.
    pub prefill: Option<Duration>,
}

/// The forms chosen for the weights of one stored type, with the measurements behind them,
/// shown as one line by `Display` (see [`Llama::weight_choices`](super::llama::Llama)).
#[derive(Debug, Clone, PartialEq)]
pub struct WeightChoice {
    pub(crate) stored: GgmlDType,
    /// `(out, in)` of the weight that was timed.
    pub(crate) sample_shape: (usize, usize),
    pub(crate) plan: WeightPlan,
    /// Empty when nothing was measured.
    pub(crate) timings: Vec<FormTiming>,
}

impl fmt::Display for WeightChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let single_rows_only =
            !self.timings.is_empty() && self.timings.iter().all(|t| t.prefill.is_none());
        if single_rows_only {
            write!(
                f,
                "{:?} weights (single rows only): {}",
                self.stored, self.plan.decode
            )?;
        } else {
            write!(
                f,
                "{:?} weights: decode {}, prefill {}",
                self.stored, self.plan.decode, self.plan.prefill
            )?;
        }
        if !self.timings.is_empty() {
            let (n, k) = self.sample_shape;
            write!(f, " (timed on {n}x{k}:")?;
            for t in &self.timings {
                write!(f, " {}", t.form)?;
                if let Some(decode) = t.decode {
                    write!(f, " {:.2} ms", decode.as_secs_f64() * 1e3)?;
                }
                if let Some(prefill) = t.prefill {
                    write!(f, " / {:.1} ms", prefill.as_secs_f64() * 1e3)?;
                }
                f.write_str(";")?;
            }
            write!(f, " per matmul of 1 / {PREFILL_ROWS} rows)")?;
        }
        Ok(())
    }
}

/// Rows of the many-row timing: a typical prefill chunk is far larger; gemm efficiency has
/// mostly levelled off by here.
const PREFILL_ROWS: usize = 128;
/// Decode products per form: single products of one sample weight are short (0.1 ms), so one
/// descheduled round moves a mean of ten by several times the difference between forms.
const DECODE_ROUNDS: usize = 30;
/// Twice the last-level cache of common desktop and server CPUs.
const EVICTION_BYTES: usize = 64 << 20;
/// Candle's quantized CPU matmul (forms `AsStored` and `Q8_0`) synchronises its threads with
/// spinning barriers. When other processes share the cores, each matmul waits for descheduled
/// threads: on a 2-core machine with other work running, decode steps took 3-10x longer than
/// with the rayon kernel, although a quiet-moment timing put candle's matmul ahead by 1.5-2.5x.
/// Its measured times are multiplied by this factor before comparing.
const SPIN_BARRIER_PENALTY: f64 = 3.0;
const PREFILL_ROUNDS: usize = 3;
/// Stored rows' measured decode time is divided by this before comparing: a step joins their
/// products (q/k/v in one, gate/up in one with the SiLU, see `joined_linears`), which one sample
/// weight timed alone does not show, and reads the fewest bytes when every weight streams from
/// memory. On 2 quiet cores (2026-12-06) the default model's sample timed stored rows at
/// 0.09-0.10 ms against 8-bit rows' 0.07-0.09, while whole decode steps took 6.8-7.0 ms against
/// 11.5-12.3 at 512 positions.
const STORED_ROWS_JOIN_CREDIT: f64 = 1.5;
/// Share of each form's rounds its time is the mean of (the fastest; see [`trimmed_mean`]).
const KEPT_ROUNDS_PERCENT: usize = 80;

/// Picks the forms for weights stored like `sample`. With `single_rows_only` (a weight that never
/// sees more than one row, like an output head used on the last token) only decode is timed.
pub(crate) fn choose(
    sample: &QTensor,
    policy: WeightFormPolicy,
    device: &Device,
    single_rows_only: bool,
) -> Result<WeightChoice> {
    let stored = sample.dtype();
    let (n, k) = sample.shape().dims2()?;
    let fixed = |form| WeightChoice {
        stored,
        sample_shape: (n, k),
        plan: WeightPlan {
            decode: form,
            prefill: form,
        },
        timings: Vec::new(),
    };
    if is_float(stored) {
        return Ok(fixed(WeightForm::DenseF32));
    }
    let decode_form = match policy {
        WeightFormPolicy::Fixed(form) => return Ok(fixed(form)),
        WeightFormPolicy::Measure | WeightFormPolicy::FixedDecode(_) if !device.is_cpu() => {
            return Ok(fixed(WeightForm::AsStored))
        }
        WeightFormPolicy::Measure => None,
        WeightFormPolicy::FixedDecode(form) => Some(form),
    };
    let mut candidates = vec![WeightForm::AsStored, WeightForm::DenseF32];
    if k % GgmlDType::Q8_0.block_size() == 0 {
        if stored != GgmlDType::Q8_0 {
            candidates.push(WeightForm::Q8_0);
        }
        candidates.push(WeightForm::Q8_0Rows);
    }
    if GgufRows::takes(sample) {
        candidates.push(WeightForm::StoredRows);
    }
    if !single_rows_only && PackedBlocks::takes(sample) && Kernel::detect() == Kernel::Vnni {
        candidates.push(WeightForm::PackedBlocks);
    }
    let decode_x = Tensor::randn(0f32, 1.0, (1, k), device)?;
    let prefill_x = Tensor::randn(0f32, 1.0, (PREFILL_ROWS, k), device)?;
    let weights = candidates
        .iter()
        .map(|&form| convert(sample, form))
        .collect::<Result<Vec<_>>>()?;
    // Decode reads every weight from memory once per token: time it with cold caches.
    let mut eviction = vec![0u64; EVICTION_BYTES / 8];
    // Timed on a thread of rayon's pool, as a decode step runs its products (see
    // `llama::on_cpu_pool`): from outside it each product would also pay the calling thread's
    // sleep and wake-up, which a step does not.
    let decode_forms: Vec<bool> = candidates
        .iter()
        .map(|form| !form.is_many_rows_kernel())
        .collect();
    let decode_weights = timed_weights(&weights, &decode_forms);
    let mut decode = rayon::scope(|_| {
        mean_times(
            &decode_weights,
            &decode_x,
            DECODE_ROUNDS,
            Some(&mut eviction),
        )
    })?
    .into_iter();
    // The rows kernels are single-row kernels: never a prefill form.
    let prefill_forms: Vec<bool> = candidates
        .iter()
        .map(|&form| !single_rows_only && !form.is_rows_kernel())
        .collect();
    let prefill_weights = timed_weights(&weights, &prefill_forms);
    let mut prefill = mean_times(&prefill_weights, &prefill_x, PREFILL_ROUNDS, None)?.into_iter();
    let timings: Vec<FormTiming> = candidates
        .iter()
        .zip(&decode_forms)
        .zip(&prefill_forms)
        .map(|((&form, &decode_timed), &prefill_timed)| FormTiming {
            form,
            decode: if decode_timed { decode.next() } else { None },
            prefill: if prefill_timed { prefill.next() } else { None },
        })
        .collect();
    let fastest = |time: fn(&FormTiming) -> Duration| {
        timings
            .iter()
            .min_by(|a, b| effective_ms(a.form, time(a)).total_cmp(&effective_ms(b.form, time(b))))
            .map_or(WeightForm::AsStored, |t| t.form)
    };
    let decode = match decode_form {
        Some(form) if timings.iter().any(|t| t.form == form) => form,
        _ => fastest(|t| t.decode.unwrap_or(Duration::MAX)),
    };
    let plan = WeightPlan {
        decode,
        prefill: if single_rows_only {
            decode
        } else {
            fastest(|t| t.prefill.unwrap_or(Duration::MAX))
        },
    };
    Ok(WeightChoice {
        stored,
        sample_shape: (n, k),
        plan,
        timings,
    })
}

/// The weights whose entry in `timed` is true.
fn timed_weights(weights: &[LinearWeight], timed: &[bool]) -> Vec<LinearWeight> {
    weights
        .iter()
        .zip(timed)
        .filter(|(_, &timed)| timed)
        .map(|(w, _)| w.clone())
        .collect()
}

/// `weight` in `form`, ready to multiply.
pub(crate) fn convert(weight: &QTensor, form: WeightForm) -> Result<LinearWeight> {
    let device = weight.device();
    Ok(match form {
        _ if is_float(weight.dtype()) => LinearWeight::QMatMul(QMatMul::Tensor(
            weight.dequantize(&device)?.to_dtype(DType::F32)?,
        )),
        WeightForm::AsStored => qmatmul(requantize_identity(weight)?),
        WeightForm::Q8_0 if weight.dtype() == GgmlDType::Q8_0 => {
            qmatmul(requantize_identity(weight)?)
        }
        WeightForm::Q8_0 => qmatmul(QTensor::quantize(
            &weight.dequantize(&device)?,
            GgmlDType::Q8_0,
        )?),
        WeightForm::Q8_0Rows => {
            LinearWeight::Q8Rows(Arc::new(Q8Rows::quantize(&weight.dequantize(&device)?)?))
        }
        WeightForm::DenseF32 => LinearWeight::QMatMul(QMatMul::Tensor(
            weight.dequantize(&device)?.to_dtype(DType::F32)?,
        )),
        WeightForm::StoredRows if device.is_cpu() && GgufRows::takes(weight) => {
            LinearWeight::GgufRows(Arc::new(GgufRows::new(weight)?))
        }
        WeightForm::PackedBlocks if device.is_cpu() && PackedBlocks::takes(weight) => {
            LinearWeight::PackedBlocks(Arc::new(PackedBlocks::new(weight)?))
        }
        WeightForm::PackedBlocks => bail!(
            "weight form: packed blocks take Q4_0, Q4_1, Q8_0 or Q4_K weights on the CPU whose \
             rows are whole blocks, got {:?} {:?} on {:?}",
            weight.dtype(),
            weight.shape().dims(),
            device.location()
        ),
        WeightForm::StoredRows => bail!(
            "weight form: stored rows take Q4_0, Q4_1, Q8_0, Q4_K or Q6_K weights on the CPU \
             whose rows are whole blocks, got {:?} {:?} on {:?}",
            weight.dtype(),
            weight.shape().dims(),
            device.location()
        ),
    })
}

fn qmatmul(weight: QTensor) -> LinearWeight {
    LinearWeight::QMatMul(QMatMul::QTensor(Arc::new(weight)))
}

/// A linear layer for `weight` following `plan`; the second form is built only when it differs.
pub(crate) fn linear(weight: QTensor, plan: WeightPlan) -> Result<Linear> {
    if plan.decode == plan.prefill || is_float(weight.dtype()) {
        return Ok(Linear::new(into_form(weight, plan.decode)?));
    }
    // Convert first, then move the stored tensor into the form that keeps it (if any).
    if keeps_storage(&weight, plan.decode) {
        let prefill = convert(&weight, plan.prefill)?;
        Ok(Linear::with_forms(into_form(weight, plan.decode)?, prefill))
    } else {
        let decode = convert(&weight, plan.decode)?;
        Ok(Linear::with_forms(decode, into_form(weight, plan.prefill)?))
    }
}

/// Linear layers of matrices that take the same input, with their joined forms.
pub(crate) struct JoinedLinears {
    pub linears: Vec<Linear>,
    /// Their single-row forms as one [`GgufRows`], when that form is `StoredRows`.
    pub decode: Option<Arc<GgufRows>>,
    /// Their many-row forms as one [`PackedBlocks`], when that form is `PackedBlocks`.
    pub prompt: Option<Arc<PackedBlocks>>,
}

/// Linear layers for `weights` (one stored type, one `in`) following `plan`. When their
/// single-row form is `StoredRows`, those forms are views of one [`GgufRows`] joining their
/// rows, which is returned too: a decode step can multiply them all in one product (q, k and v;
/// gate and up), each view's outputs what its own product gives. Likewise for a many-row form
/// `PackedBlocks`: one product for a prompt, its inputs quantized once.
pub(crate) fn joined_linears(weights: Vec<QTensor>, plan: WeightPlan) -> Result<JoinedLinears> {
    let same_input = weights.iter().all(|w| {
        w.device().is_cpu()
            && w.dtype() == weights[0].dtype()
            && w.shape().dims2().ok().map(|d| d.1) == weights[0].shape().dims2().ok().map(|d| d.1)
    });
    let decode = if same_input
        && plan.decode == WeightForm::StoredRows
        && weights.iter().all(GgufRows::takes)
    {
        Some(GgufRows::joined(&weights.iter().collect::<Vec<_>>())?)
    } else {
        None
    };
    let prompt = if same_input
        && plan.prefill == WeightForm::PackedBlocks
        && plan.prefill != plan.decode
        && weights.iter().all(PackedBlocks::takes)
    {
        Some(PackedBlocks::joined(&weights.iter().collect::<Vec<_>>())?)
    } else {
        None
    };
    let mut start = 0;
    let mut linears = Vec::with_capacity(weights.len());
    for weight in weights {
        let rows = weight.shape().dims2()?.0;
        let first = start;
        start += rows;
        if decode.is_none() && prompt.is_none() {
            linears.push(linear(weight, plan)?);
            continue;
        }
        let single = match &decode {
            Some(joined) => LinearWeight::GgufRows(Arc::new(joined.rows(first, rows)?)),
            None => convert(&weight, plan.decode)?,
        };
        if plan.prefill == plan.decode {
            linears.push(Linear::new(single));
            continue;
        }
        // A view of the joined prompt form where the rows start one of its groups.
        let many = match prompt.as_ref().map(|joined| joined.rows(first, rows)) {
            Some(Ok(view)) => LinearWeight::PackedBlocks(Arc::new(view)),
            _ => into_form(weight, plan.prefill)?,
        };
        linears.push(Linear::with_forms(single, many));
    }
    Ok(JoinedLinears {
        linears,
        decode: decode.map(Arc::new),
        prompt: prompt.map(Arc::new),
    })
}

/// Whether `form` uses `weight`'s blocks unchanged.
fn keeps_storage(weight: &QTensor, form: WeightForm) -> bool {
    !is_float(weight.dtype())
        && (form == WeightForm::AsStored
            || (form == WeightForm::Q8_0 && weight.dtype() == GgmlDType::Q8_0))
}

/// Like [`convert`], moving the tensor in when its blocks are kept.
fn into_form(weight: QTensor, form: WeightForm) -> Result<LinearWeight> {
    if keeps_storage(&weight, form) {
        Ok(qmatmul(weight))
    } else {
        convert(&weight, form)
    }
}

/// A copy of a quantized tensor in its own type (QTensor is not `Clone`): its raw blocks
/// re-wrapped, no rounding.
fn requantize_identity(weight: &QTensor) -> Result<QTensor> {
    let bytes = weight.data()?;
    let storage = candle_core::quantized::QStorage::from_data(
        std::borrow::Cow::Owned(bytes.into_owned()),
        &weight.device(),
        weight.dtype(),
    )?;
    QTensor::new(storage, weight.shape().clone())
}

fn is_float(dtype: GgmlDType) -> bool {
    matches!(dtype, GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16)
}

/// The time a form is ranked by: measured, with [`SPIN_BARRIER_PENALTY`] for candle's quantized
/// CPU matmul and [`STORED_ROWS_JOIN_CREDIT`] for stored rows.
fn effective_ms(form: WeightForm, measured: Duration) -> f64 {
    let ms = measured.as_secs_f64() * 1e3;
    match form {
        WeightForm::AsStored | WeightForm::Q8_0 => ms * SPIN_BARRIER_PENALTY,
        WeightForm::StoredRows => ms / STORED_ROWS_JOIN_CREDIT,
        WeightForm::Q8_0Rows | WeightForm::DenseF32 | WeightForm::PackedBlocks => ms,
    }
}

/// Mean time of one product per weight. The weights take turns, round after round, so that
/// load from other processes falls on all of them alike; a mean (of the fastest rounds, not the
/// median) keeps the stalls a kernel suffers when it shares the cores. With `eviction`, that buffer is read before
/// each product so the weight comes from memory, as it does in a decode step.
fn mean_times(
    weights: &[LinearWeight],
    x: &Tensor,
    rounds: usize,
    mut eviction: Option<&mut [u64]>,
) -> Result<Vec<Duration>> {
    for weight in weights {
        weight.forward(x)?; // warm-up: first-touch allocations, packed caches
    }
    let mut times = vec![Vec::with_capacity(rounds); weights.len()];
    for round in 0..rounds {
        for (weight, times) in weights.iter().zip(times.iter_mut()) {
            if let Some(buffer) = eviction.as_deref_mut() {
                evict_caches(buffer, round);
            }
            let start = Instant::now();
            weight.forward(x)?;
            times.push(start.elapsed());
        }
    }
    Ok(times.into_iter().map(trimmed_mean).collect())
}

/// The mean of the fastest [`KEPT_ROUNDS_PERCENT`] of `times`: the stalls a form suffers
/// round after round stay in it, a rare descheduling of one round does not (one 1 ms stall in
/// thirty 0.1 ms products made a form look twice as slow as it runs in a step).
fn trimmed_mean(mut times: Vec<Duration>) -> Duration {
    times.sort();
    let kept = (times.len() * KEPT_ROUNDS_PERCENT).div_ceil(100).max(1);
    let kept = &times[..kept.min(times.len())];
    kept.iter().sum::<Duration>() / kept.len().max(1) as u32
}

/// Writes one word per cache line of `buffer`, pushing other data out of the caches.
fn evict_caches(buffer: &mut [u64], round: usize) {
    for word in buffer.iter_mut().step_by(8) {
        *word = word.wrapping_add(round as u64);
    }
    std::hint::black_box(&buffer);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
        (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
    }

    #[test]
    fn every_form_computes_the_same_product() -> Result<()> {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 1.0, (64, 256), &dev)?;
        let q = QTensor::quantize(&w, GgmlDType::Q4_1)?;
        let x = Tensor::randn(0f32, 1.0, (3, 256), &dev)?;
        let exact = x.matmul(&q.dequantize(&dev)?.t()?)?;
        let scale = exact.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
        for (form, tolerance) in [
            (WeightForm::DenseF32, 1e-5),
            (WeightForm::AsStored, 2e-2),
            (WeightForm::Q8_0, 3e-2),
            (WeightForm::Q8_0Rows, 3e-2),
            (WeightForm::StoredRows, 2e-2),
            (WeightForm::PackedBlocks, 2e-2),
        ] {
            let y = convert(&q, form)?.forward(&x)?;
            let rel = max_abs_diff(&y, &exact)? / scale;
            assert!(rel < tolerance, "{form}: relative error {rel}");
        }
        Ok(())
    }

    #[test]
    fn measuring_picks_a_timed_candidate_per_regime() -> Result<()> {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 1.0, (128, 256), &dev)?;
        let q = QTensor::quantize(&w, GgmlDType::Q4_1)?;
        let choice = choose(&q, WeightFormPolicy::Measure, &dev, false)?;
        let packed = usize::from(Kernel::detect() == Kernel::Vnni);
        assert_eq!(choice.timings.len(), 5 + packed);
        assert!(!choice.plan.prefill.is_rows_kernel());
        let forms: Vec<_> = choice.timings.iter().map(|t| t.form).collect();
        assert!(forms.contains(&choice.plan.decode) && forms.contains(&choice.plan.prefill));
        let fixed = choose(&q, WeightFormPolicy::Fixed(WeightForm::Q8_0), &dev, false)?;
        assert!(fixed.timings.is_empty());
        assert_eq!(fixed.plan.prefill, WeightForm::Q8_0);
        // Two forms: single rows and many rows go through different weights, same product.
        let layer = linear(
            q,
            WeightPlan {
                decode: WeightForm::AsStored,
                prefill: WeightForm::DenseF32,
            },
        )?;
        let x = Tensor::randn(0f32, 1.0, (1, 2, 256), &dev)?;
        let many = layer.forward(&x)?;
        let one = layer.forward(&x.narrow(1, 0, 1)?)?;
        let rel = max_abs_diff(&many.narrow(1, 0, 1)?, &one)?
            / many.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
        assert!(rel < 2e-2, "{rel}");
        Ok(())
    }
}
