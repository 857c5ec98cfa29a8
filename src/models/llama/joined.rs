//! A decoder layer with its dense projections joined for [`fused_linear`]: q/k/v in one weight,
//! gate/up interleaved in another. On CUDA with 16-bit weights a decode step is then four
//! kernels and attention (norm + qkv + RoPE + the cache append, o + residual, norm + gate/up +
//! SwiGLU, down + residual); a prompt runs the same math through candle's ops.

use candle_core::{Result, Tensor};

use super::rope::RopeAngles;
use super::LayerKv;
#[cfg(feature = "cuda")]
use super::Positions;
use crate::nn::attention::CachedAttention;
use crate::nn::fused_linear::{fused_linear, linear_unfused, LinearInput, LinearOutput};

/// The dense weights of one layer, in the layout the fused kernels read.
#[derive(Debug, Clone)]
pub(super) struct JoinedLayer {
    /// `(q + 2·kv, hidden)`: `[q | k | v]` rows.
    qkv: Tensor,
    o: Tensor,
    /// `(2·ffn, hidden)`: rows `[gate_0, up_0, gate_1, up_1, …]`.
    gate_up: Tensor,
    down: Tensor,
    input_norm: Tensor,
    post_attention_norm: Tensor,
    eps: f32,
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

/// The separate `(out, in)` weights of one layer, as checkpoints store them.
pub(super) struct LayerTensors {
    pub q: Tensor,
    pub k: Tensor,
    pub v: Tensor,
    pub o: Tensor,
    pub gate: Tensor,
    pub up: Tensor,
    pub down: Tensor,
    pub input_norm: Tensor,
    pub post_attention_norm: Tensor,
}

/// Runs one projection fused (the kernel where it applies) or as candle's separate ops.
fn project(
    fused: bool,
    x: &Tensor,
    w: &Tensor,
    input: LinearInput,
    output: LinearOutput,
) -> Result<Tensor> {
    if fused {
        fused_linear(x, w, input, output)
    } else {
        linear_unfused(x, w, input, output)
    }
}

impl JoinedLayer {
    /// Joins a layer's weights (one copy at load; the separate tensors can be dropped after).
    pub fn new(
        t: LayerTensors,
        eps: f32,
        q_heads: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<Self> {
        let (ffn, hidden) = t.gate.dims2()?;
        Ok(Self {
            qkv: Tensor::cat(&[&t.q, &t.k, &t.v], 0)?,
            o: t.o,
            gate_up: Tensor::stack(&[&t.gate, &t.up], 1)?.reshape((2 * ffn, hidden))?,
            down: t.down,
            input_norm: t.input_norm,
            post_attention_norm: t.post_attention_norm,
            eps,
            q_heads,
            kv_heads,
            head_dim,
        })
    }

    /// `x (b, t, hidden)` → `(b, t, hidden)`, residual adds included. `fused` false runs every
    /// projection through candle's ops (for A/B runs); prompts take that path anyway. The keys
    /// and values go where `kv` says.
    pub fn forward(
        &self,
        x: &Tensor,
        angles: &RopeAngles,
        attention: &CachedAttention,
        fused: bool,
        kv: LayerKv,
    ) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let q_size = self.q_heads * self.head_dim;
        let norm = |weight| LinearInput::RmsNorm {
            weight,
            eps: self.eps,
        };
        let y = match kv {
            // A decode step at device positions: projection, RoPE and the append in one kernel.
            #[cfg(feature = "cuda")]
            LayerKv::Own(cache, Positions::Device(lengths))
                if fused && self.qkv_rope_append(x, angles).applies(cache) =>
            {
                let (q, k_all, v_all) = self
                    .qkv_rope_append(x, angles)
                    .run(cache, &lengths.before)?;
                attention.forward_appended(&q, (&k_all, &v_all), cache, lengths)?
            }
            kv => {
                let qkv = project(
                    fused,
                    x,
                    &self.qkv,
                    norm(&self.input_norm),
                    LinearOutput::Plain,
                )?;
                let heads = self.q_heads + 2 * self.kv_heads;
                let (q, k, v) = angles.split_qkv(
                    &qkv.reshape((b, t, heads, self.head_dim))?,
                    (self.q_heads, self.kv_heads),
                )?;
                kv.attend(attention, (&q, &k, &v))?
            }
        }
        .reshape((b, t, q_size))?;
        let x = project(
            fused,
            &y,
            &self.o,
            LinearInput::Plain,
            LinearOutput::AddResidual(x),
        )?;
        let h = project(
            fused,
            &x,
            &self.gate_up,
            norm(&self.post_attention_norm),
            LinearOutput::SwiGlu,
        )?;
        project(
            fused,
            &h,
            &self.down,
            LinearInput::Plain,
            LinearOutput::AddResidual(&x),
        )
    }
}

#[cfg(feature = "cuda")]
impl JoinedLayer {
    /// The fused q/k/v kernel's view of this layer's step over `x`.
    fn qkv_rope_append<'a>(
        &'a self,
        x: &'a Tensor,
        angles: &'a RopeAngles,
    ) -> crate::nn::fused_linear::qkv_rope_append::QkvRopeAppend<'a> {
        let (cos, sin, interleaved) = angles.rows();
        crate::nn::fused_linear::qkv_rope_append::QkvRopeAppend {
            x,
            w: &self.qkv,
            norm: (&self.input_norm, self.eps),
            angles: (cos, sin),
            interleaved,
            q_heads: self.q_heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
        }
    }
}

/// The final norm and the output head, dense.
#[derive(Debug, Clone)]
pub(super) struct JoinedHead {
    pub norm: Tensor,
    pub lm_head: Tensor,
    pub eps: f32,
}

impl JoinedHead {
    /// Logits of one position, `(b, 1, hidden)` → `(b, 1, vocab)`.
    pub fn forward(&self, x: &Tensor, fused: bool) -> Result<Tensor> {
        let input = LinearInput::RmsNorm {
            weight: &self.norm,
            eps: self.eps,
        };
        project(fused, x, &self.lm_head, input, LinearOutput::Plain)
    }
}
