//! One-token decode steps fed from device memory, and their CUDA graphs.
//!
//! A step's token, its position and the cache lengths after it live in a small device buffer
//! that the host rewrites before each step. Everything the step launches reads them from there:
//! the embedding gathers the token, RoPE gathers its angles, the caches append at the position
//! and attention masks each cache to its new length over the whole capacity. So the launches
//! are the same from one step to the next, and one captured graph replays every step until the
//! caches are reallocated.

use candle_core::{DType, Device, Result, Tensor, TensorId};

use crate::cuda::graph::{self, CapturedGraph};
use crate::cuda::memory::set_u32s;
use crate::nn::attention::DeviceLengths;
use crate::nn::cache::KvCache;

/// The device buffer a step reads its inputs from, and views of its parts.
#[derive(Debug, Clone)]
pub(super) struct StepInputs {
    /// u32 `(3,)`: the token, its position, the length after the step.
    buffer: Tensor,
    /// `(1, 1)`: the token, as the embedding takes ids.
    pub token: Tensor,
    pub lengths: DeviceLengths,
}

impl StepInputs {
    pub fn new(device: &Device) -> Result<Self> {
        let buffer = Tensor::zeros(3, DType::U32, device)?;
        Ok(Self {
            token: buffer.narrow(0, 0, 1)?.reshape((1, 1))?,
            lengths: DeviceLengths {
                before: buffer.narrow(0, 1, 1)?,
                after: buffer.narrow(0, 2, 1)?,
            },
            buffer,
        })
    }

    /// Sets the inputs of the next step: `token` at `position`, stream-ordered after the work
    /// already queued, with no wait for it.
    pub fn set(&self, token: u32, position: usize) -> Result<()> {
        let position = u32::try_from(position).map_err(candle_core::Error::wrap)?;
        set_u32s(&self.buffer, &[token, position, position + 1])
    }
}

/// What a captured step depends on beyond its inputs: the caches' storage (a reallocated cache
/// lives elsewhere) and whether the projections run fused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct StepShape {
    storage: Vec<(TensorId, TensorId)>,
    fused: bool,
    /// The test hook that runs the q/k/v kernel as its unfused chain changes the launches too.
    qkv_chain: bool,
}

impl StepShape {
    pub fn of(caches: &[KvCache], fused: bool) -> Self {
        #[cfg(feature = "test-hooks")]
        let qkv_chain = crate::test_hooks::qkv_append_unfused();
        #[cfg(not(feature = "test-hooks"))]
        let qkv_chain = false;
        Self {
            storage: caches.iter().map(KvCache::storage_ids).collect(),
            fused,
            qkv_chain,
        }
    }
}

/// Where the graph of a step shape stands.
#[derive(Default)]
pub(super) enum StepGraph {
    /// Nothing run yet for the current shape.
    #[default]
    Cold,
    /// Run once eagerly with candle's upload cache on: ready to capture.
    Warm(StepShape),
    /// Captured; `logits` is where each replay leaves its f32 logits `(vocab,)`.
    Captured {
        shape: StepShape,
        graph: CapturedGraph,
        logits: Tensor,
    },
}

impl std::fmt::Debug for StepGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Cold => "Cold",
            Self::Warm(_) => "Warm",
            Self::Captured { .. } => "Captured",
        })
    }
}

/// A clone starts cold: a graph replays its own model's buffers only.
impl Clone for StepGraph {
    fn clone(&self) -> Self {
        Self::Cold
    }
}

impl StepGraph {
    /// The logits of a step of `shape` whose inputs are set: by replaying the captured graph,
    /// by capturing one (second step of a shape), or by running `step` eagerly (first step).
    /// `step` runs the step and returns the f32 logits `(vocab,)`; `advance` does on the host
    /// what a replay does not: counting the appended position in the caches.
    pub fn run(
        &mut self,
        device: &Device,
        (shape, vocab): (StepShape, usize),
        mut step: impl FnMut() -> Result<Tensor>,
        advance: impl FnOnce(),
    ) -> Result<Tensor> {
        let Device::Cuda(dev) = device else {
            return step();
        };
        match std::mem::take(self) {
            Self::Captured {
                shape: captured,
                graph,
                logits,
            } if captured == shape => {
                graph.replay()?;
                advance();
                let out = logits.copy()?;
                *self = Self::Captured {
                    shape,
                    graph,
                    logits,
                };
                Ok(out)
            }
            Self::Warm(warm) if warm == shape => {
                let logits = Tensor::zeros(vocab, DType::F32, device)?;
                // The capture runs the host side of the step (the caches count the position)
                // without the device side, which the first replay then does.
                let graph = graph::capture(dev, || {
                    let out = step()?;
                    logits.slice_set(&out, 0, 0)
                })?;
                graph.replay()?;
                let out = logits.copy()?;
                *self = Self::Captured {
                    shape,
                    graph,
                    logits,
                };
                Ok(out)
            }
            _ => {
                let out = graph::warm_up(dev, &mut step)?;
                *self = Self::Warm(shape);
                Ok(out)
            }
        }
    }
}
