//! A bias-free linear layer that may keep its weight in two forms: one for single-row inputs
//! (decode, bound by reading the weight) and one for many rows (prefill, bound by arithmetic).

use candle_core::quantized::QMatMul;
use candle_core::{Module, Result, Tensor};

#[derive(Debug, Clone)]
pub struct Linear {
    single_row: QMatMul,
    many_rows: Option<QMatMul>,
}

impl Linear {
    /// One form for every input.
    pub fn new(weight: QMatMul) -> Self {
        Self {
            single_row: weight,
            many_rows: None,
        }
    }

    /// A dense `(out, in)` weight.
    pub fn dense(weight: Tensor) -> Self {
        Self::new(QMatMul::Tensor(weight))
    }

    /// `single_row` for inputs of one row, `many_rows` for the others.
    pub fn with_forms(single_row: QMatMul, many_rows: QMatMul) -> Self {
        Self {
            single_row,
            many_rows: Some(many_rows),
        }
    }
}

impl Module for Linear {
    /// `x (…, in)` → `(…, out)`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let rows = x.dims()[..x.rank().saturating_sub(1)]
            .iter()
            .product::<usize>();
        match &self.many_rows {
            Some(many_rows) if rows > 1 => many_rows.forward(x),
            _ => self.single_row.forward(x),
        }
    }
}
