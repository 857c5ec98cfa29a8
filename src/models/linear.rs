//! A bias-free linear layer that may keep its weight in two forms: one for single-row inputs
//! (decode, bound by reading the weight) and one for many rows (prefill, bound by arithmetic).

use std::sync::Arc;

use candle_core::quantized::QMatMul;
use candle_core::{Module, Result, Tensor};

use super::gguf_rows::{GgufRows, PackedBlocks};
use super::q8_rows::Q8Rows;

/// One form of a weight, with the kernel that multiplies it.
#[derive(Debug, Clone)]
pub enum LinearWeight {
    /// Dense or quantized, through candle's `QMatMul`.
    QMatMul(QMatMul),
    /// Q8_0 rows through the crate's rayon kernel (CPU only).
    Q8Rows(Arc<Q8Rows>),
    /// GGUF blocks as stored, through the crate's rayon kernel (CPU only).
    GgufRows(Arc<GgufRows>),
    /// GGUF blocks repacked for many-row products (CPU only).
    PackedBlocks(Arc<PackedBlocks>),
}

impl Module for LinearWeight {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Self::QMatMul(w) => crate::nn::fused_linear::matmul_rows(w, x),
            Self::Q8Rows(w) => w.forward(x),
            Self::GgufRows(w) => w.forward(x),
            Self::PackedBlocks(w) => w.forward(x),
        }
    }
}

/// The rows of a `(1, n, in)` input split by the form they are multiplied in: decode rows in the
/// single-row form, prompt rows in the many-row form (see [`Linear::forward_split`]).
#[derive(Debug, Clone)]
pub struct RowSplit {
    /// u32: the rows multiplied in the single-row form.
    pub single: Tensor,
    /// u32: the rows multiplied in the many-row form.
    pub many: Tensor,
    /// u32 `(n,)`: where each row sits among the `single` rows followed by the `many` rows.
    pub order: Tensor,
}

#[derive(Debug, Clone)]
pub struct Linear {
    single_row: LinearWeight,
    many_rows: Option<LinearWeight>,
    /// `(out,)`, added to every row.
    bias: Option<Tensor>,
}

impl Linear {
    /// One form for every input.
    pub fn new(weight: LinearWeight) -> Self {
        Self {
            single_row: weight,
            many_rows: None,
            bias: None,
        }
    }

    /// The same layer with `bias` `(out,)` added to every output row.
    pub fn with_bias(mut self, bias: Tensor) -> Self {
        self.bias = Some(bias);
        self
    }

    fn add_bias(&self, y: Tensor) -> Result<Tensor> {
        match &self.bias {
            Some(bias) => y.broadcast_add(bias),
            None => Ok(y),
        }
    }

    /// A dense `(out, in)` weight.
    pub fn dense(weight: Tensor) -> Self {
        Self::new(LinearWeight::QMatMul(QMatMul::Tensor(weight)))
    }

    /// `single_row` for inputs of one row, `many_rows` for the others.
    pub fn with_forms(single_row: LinearWeight, many_rows: LinearWeight) -> Self {
        Self {
            single_row,
            many_rows: Some(many_rows),
            bias: None,
        }
    }
}

impl Linear {
    /// Every row in the single-row form, as a decode step multiplies it: for the few tokens of
    /// a verification pass, whose logits should be those decoding would see.
    pub fn forward_single_row_form(&self, x: &Tensor) -> Result<Tensor> {
        self.add_bias(self.single_row.forward(x)?)
    }
}

impl Linear {
    /// `x (1, n, in)` → `(1, n, out)`, the rows of `split.single` in the single-row form and
    /// those of `split.many` in the many-row form, one product each, so that each row rounds
    /// as it would in a decode step or in a prompt. With one form, one product over every row.
    pub fn forward_split(&self, x: &Tensor, split: &RowSplit) -> Result<Tensor> {
        let Some(many_rows) = &self.many_rows else {
            return self.forward(x);
        };
        let single = self
            .single_row
            .forward(&x.index_select(&split.single, 1)?)?;
        let many = many_rows.forward(&x.index_select(&split.many, 1)?)?;
        self.add_bias(Tensor::cat(&[single, many], 1)?.index_select(&split.order, 1)?)
    }
}

impl Module for Linear {
    /// `x (…, in)` → `(…, out)`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let rows = x.dims()[..x.rank().saturating_sub(1)]
            .iter()
            .product::<usize>();
        let y = match &self.many_rows {
            Some(many_rows) if rows > 1 => many_rows.forward(x)?,
            _ => self.single_row.forward(x)?,
        };
        self.add_bias(y)
    }
}
