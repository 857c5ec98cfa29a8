//! Rotary position embeddings, applied as their own op before attention.

use candle_core::{bail, DType, Device, Result, Tensor};

use super::config::{LlamaConfig, RopeScaling};

/// How the two halves of each rotated pair are laid out in a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeLayout {
    /// Pairs `(i, i + d/2)`: HF safetensors weights (`candle_nn::rotary_emb::rope`).
    Halves,
    /// Pairs `(2i, 2i + 1)`: GGUF llama weights, whose q/k rows are permuted for it
    /// (`candle_nn::rotary_emb::rope_i`).
    Interleaved,
}

/// cos/sin tables over the model's whole context.
#[derive(Debug, Clone)]
pub struct RotaryEmbedding {
    cos: Tensor,
    sin: Tensor,
    layout: RopeLayout,
}

/// The inverse frequency of each rotated pair, with the config's long-context scaling and
/// optional per-pair divisors (GGUF's `rope_freqs` tensor).
pub fn inverse_frequencies(config: &LlamaConfig, freq_factors: Option<&[f32]>) -> Result<Vec<f64>> {
    let d = config.head_dim;
    let base = f64::from(config.rope_theta);
    let mut inv_freq: Vec<f64> = (0..d / 2)
        .map(|i| 1.0 / base.powf(2.0 * i as f64 / d as f64))
        .collect();
    match &config.rope_scaling {
        None => {}
        Some(RopeScaling::Linear { factor }) => {
            inv_freq.iter_mut().for_each(|f| *f /= f64::from(*factor));
        }
        Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        }) => {
            let (factor, low, high) = (
                f64::from(*factor),
                f64::from(*low_freq_factor),
                f64::from(*high_freq_factor),
            );
            let original = *original_max_position_embeddings as f64;
            let (low_freq_wavelen, high_freq_wavelen) = (original / low, original / high);
            for f in inv_freq.iter_mut() {
                let wavelen = 2.0 * std::f64::consts::PI / *f;
                *f = if wavelen < high_freq_wavelen {
                    *f
                } else if wavelen > low_freq_wavelen {
                    *f / factor
                } else {
                    let smooth = (original / wavelen - low) / (high - low);
                    (1.0 - smooth) * *f / factor + smooth * *f
                };
            }
        }
    }
    if let Some(factors) = freq_factors {
        if factors.len() != inv_freq.len() {
            bail!(
                "rope: {} frequency factors given, head_dim {} needs {}",
                factors.len(),
                d,
                inv_freq.len()
            )
        }
        for (f, &k) in inv_freq.iter_mut().zip(factors) {
            *f /= f64::from(k);
        }
    }
    Ok(inv_freq)
}

impl RotaryEmbedding {
    /// Tables for positions `0..config.max_position_embeddings`, stored in `dtype`. Angles are
    /// `position × inverse frequency` in f32, as in the HF and candle reference implementations
    /// the checkpoints were trained and tested with.
    pub fn new(
        config: &LlamaConfig,
        freq_factors: Option<&[f32]>,
        layout: RopeLayout,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let inv_freq: Vec<f32> = inverse_frequencies(config, freq_factors)?
            .into_iter()
            .map(|f| f as f32)
            .collect();
        let positions = config.max_position_embeddings;
        let half = inv_freq.len();
        let mut cos = Vec::with_capacity(positions * half);
        let mut sin = Vec::with_capacity(positions * half);
        for p in 0..positions {
            for f in &inv_freq {
                let angle = p as f32 * f;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        let table = |v: Vec<f32>| Tensor::from_vec(v, (positions, half), device)?.to_dtype(dtype);
        Ok(Self {
            cos: table(cos)?,
            sin: table(sin)?,
            layout,
        })
    }

    /// Positions the tables cover.
    pub fn max_positions(&self) -> usize {
        self.cos.dims()[0]
    }

    /// Rotates `x` `(batch, t, heads, head_dim)`; token `i` of sequence `s` is at position
    /// `starts[s] + i`. Returns a contiguous tensor of the same shape.
    pub fn apply(&self, x: &Tensor, starts: &[usize]) -> Result<Tensor> {
        let (_, t, _, _) = x.dims4()?;
        self.angles(starts, t)?.apply(x)
    }

    /// The cos/sin rows for `t` new tokens of each sequence, token `i` of sequence `s` at
    /// position `starts[s] + i`: looked up once per forward pass and shared by every layer.
    pub fn angles(&self, starts: &[usize], t: usize) -> Result<RopeAngles> {
        let end = starts.iter().map(|s| s + t).max().unwrap_or(0);
        if end > self.max_positions() {
            bail!(
                "rope: position {} is past the model's context length {}",
                end - 1,
                self.max_positions()
            )
        }
        // Each token becomes its own "batch entry" of one position, with its own cos/sin row, so
        // x needs no transpose and sequences may sit at different positions.
        let (cos, sin) = match starts {
            // One sequence: its rows are a contiguous range of the tables, a view.
            [start] => (
                self.cos.narrow(0, *start, t)?,
                self.sin.narrow(0, *start, t)?,
            ),
            _ => {
                let positions: Vec<u32> = starts
                    .iter()
                    .flat_map(|&s| (s..s + t).map(|p| p as u32))
                    .collect();
                let positions = Tensor::from_vec(positions, starts.len() * t, self.cos.device())?;
                (
                    self.cos.index_select(&positions, 0)?,
                    self.sin.index_select(&positions, 0)?,
                )
            }
        };
        Ok(RopeAngles {
            cos: cos.unsqueeze(1)?,
            sin: sin.unsqueeze(1)?,
            batch: starts.len(),
            t,
            layout: self.layout,
        })
    }
}

impl RotaryEmbedding {
    /// The cos/sin rows of tokens laid end to end as one sequence of `positions.len()` tokens,
    /// token `i` at `positions[i]`: a mixed step's tokens, each at its own sequence's position.
    pub fn angles_at_positions(&self, positions: &[usize]) -> Result<RopeAngles> {
        if let Some(&past) = positions.iter().find(|&&p| p >= self.max_positions()) {
            bail!(
                "rope: position {past} is past the model's context length {}",
                self.max_positions()
            )
        }
        let t = positions.len();
        let index: Vec<u32> = positions.iter().map(|&p| p as u32).collect();
        let index = Tensor::from_vec(index, t, self.cos.device())?;
        Ok(RopeAngles {
            cos: self.cos.index_select(&index, 0)?.unsqueeze(1)?,
            sin: self.sin.index_select(&index, 0)?.unsqueeze(1)?,
            batch: 1,
            t,
            layout: self.layout,
        })
    }

    /// Like [`RotaryEmbedding::angles`] for one token per sequence, at the positions a u32
    /// `(batch,)` tensor holds on the tables' device: looked up when the gather runs, so that a
    /// captured decode step rotates by the position of each replay. Positions past the tables
    /// are the caller's to rule out.
    pub fn angles_at(&self, positions: &Tensor) -> Result<RopeAngles> {
        let batch = positions.dims1()?;
        Ok(RopeAngles {
            cos: self.cos.index_select(positions, 0)?.unsqueeze(1)?,
            sin: self.sin.index_select(positions, 0)?.unsqueeze(1)?,
            batch,
            t: 1,
            layout: self.layout,
        })
    }
}

/// cos/sin rows for the tokens of one forward pass (see [`RotaryEmbedding::angles`]).
#[derive(Debug, Clone)]
pub struct RopeAngles {
    /// `(batch·t, 1, head_dim/2)`.
    cos: Tensor,
    sin: Tensor,
    batch: usize,
    t: usize,
    layout: RopeLayout,
}

impl RopeAngles {
    /// Rotates `x` `(batch, t, heads, head_dim)`, with `batch` and `t` those the angles were
    /// looked up for. Returns a contiguous tensor of the same shape.
    pub fn apply(&self, x: &Tensor) -> Result<Tensor> {
        let (b, t, heads, d) = x.dims4()?;
        if (b, t) != (self.batch, self.t) {
            bail!(
                "rope: angles for {} sequences of {} tokens, x has shape {:?}",
                self.batch,
                self.t,
                x.dims()
            )
        }
        let x = x.contiguous()?.reshape((b * t, heads, 1, d))?;
        let rotated = match self.layout {
            RopeLayout::Halves => candle_nn::rotary_emb::rope(&x, &self.cos, &self.sin)?,
            RopeLayout::Interleaved => candle_nn::rotary_emb::rope_i(&x, &self.cos, &self.sin)?,
        };
        rotated.reshape((b, t, heads, d))
    }

    /// The cos and sin rows `(batch·t, 1, head_dim/2)`, and whether rotation pairs are
    /// interleaved: for a kernel that rotates in its epilogue.
    #[cfg(feature = "cuda")]
    pub(crate) fn rows(&self) -> (&Tensor, &Tensor, bool) {
        (&self.cos, &self.sin, self.layout == RopeLayout::Interleaved)
    }

    /// Splits a joined projection's output `(batch, t, q + k + v heads, head_dim)` into
    /// contiguous q, k and v, with q and k rotated. On CUDA this is one launch that reads the
    /// output in place; elsewhere the rotation and the copies run as separate ops.
    pub fn split_qkv(
        &self,
        qkv: &Tensor,
        (q_heads, kv_heads): (usize, usize),
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (b, t, heads, _) = qkv.dims4()?;
        if (b, t) != (self.batch, self.t) || heads != q_heads + 2 * kv_heads {
            bail!(
                "rope: angles for {} sequences of {} tokens and {q_heads} + 2·{kv_heads} heads, \
                 qkv has shape {:?}",
                self.batch,
                self.t,
                qkv.dims()
            )
        }
        #[cfg(feature = "cuda")]
        if qkv.device().is_cuda() {
            let heads = crate::cuda::rope_split::QkvHeads {
                q: q_heads,
                k: kv_heads,
                v: kv_heads,
            };
            let interleaved = self.layout == RopeLayout::Interleaved;
            return crate::cuda::rope_split::rope_split(
                qkv,
                &self.cos,
                &self.sin,
                heads,
                interleaved,
            );
        }
        let qk = self.apply(&qkv.narrow(2, 0, q_heads + kv_heads)?)?;
        Ok((
            qk.narrow(2, 0, q_heads)?.contiguous()?,
            qk.narrow(2, q_heads, kv_heads)?.contiguous()?,
            qkv.narrow(2, q_heads + kv_heads, kv_heads)?.contiguous()?,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(scaling: Option<RopeScaling>) -> LlamaConfig {
        LlamaConfig {
            head_dim: 64,
            rope_theta: 500_000.0,
            rope_scaling: scaling,
            max_position_embeddings: 64,
            ..LlamaConfig::default()
        }
    }

    #[test]
    fn llama3_scaling_keeps_high_and_divides_low_frequencies() -> Result<()> {
        let plain = inverse_frequencies(&config(None), None)?;
        let scaled = inverse_frequencies(
            &config(Some(RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192,
            })),
            None,
        )?;
        assert_eq!(scaled[0], plain[0]);
        let last = plain.len() - 1;
        assert!((scaled[last] - plain[last] / 8.0).abs() < 1e-15);
        // In between, the ramp stays between the two.
        for (s, p) in scaled.iter().zip(&plain) {
            assert!(*s <= *p && *s >= p / 8.0 - 1e-18);
        }
        Ok(())
    }

    #[test]
    fn angles_at_device_positions_equal_host_positions() -> Result<()> {
        let dev = Device::Cpu;
        let rope = RotaryEmbedding::new(&config(None), None, RopeLayout::Halves, DType::F32, &dev)?;
        let x = Tensor::randn(0f32, 1.0, (2, 1, 3, 64), &dev)?;
        let at = rope
            .angles_at(&Tensor::new(&[5u32, 40], &dev)?)?
            .apply(&x)?;
        let host = rope.apply(&x, &[5, 40])?;
        let diff = (at - host)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?;
        assert_eq!(diff, 0.0);
        Ok(())
    }

    /// Batched application at different start positions equals one-by-one `rope` over the
    /// usual `(b, h, t, d)` layout.
    #[test]
    fn matches_candle_rope_at_offsets() -> Result<()> {
        let dev = Device::Cpu;
        let cfg = config(None);
        for (layout, reference) in [
            (
                RopeLayout::Halves,
                candle_nn::rotary_emb::rope as fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>,
            ),
            (RopeLayout::Interleaved, candle_nn::rotary_emb::rope_i),
        ] {
            let rope = RotaryEmbedding::new(&cfg, None, layout, DType::F32, &dev)?;
            let x = Tensor::randn(0f32, 1.0, (2, 5, 3, 64), &dev)?;
            let starts = [0, 7];
            let out = rope.apply(&x, &starts)?;
            for (s, &start) in starts.iter().enumerate() {
                let xs = x.narrow(0, s, 1)?.transpose(1, 2)?.contiguous()?;
                let cos = rope.cos.narrow(0, start, 5)?;
                let sin = rope.sin.narrow(0, start, 5)?;
                let expected = reference(&xs, &cos, &sin)?.transpose(1, 2)?;
                let diff = (out.narrow(0, s, 1)? - expected)?
                    .abs()?
                    .flatten_all()?
                    .max(0)?
                    .to_scalar::<f32>()?;
                assert!(diff < 1e-6, "{layout:?}: {diff}");
            }
            assert!(rope.apply(&x, &[0, 60]).is_err());
        }
        Ok(())
    }
}
