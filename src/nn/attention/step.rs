//! [`AttentionStep`]: what one call of [`CachedAttention::forward`](super::CachedAttention::forward)
//! covers: the cache the step's keys and values go to and where its positions live, whether the
//! LSE is wanted, and whether a few tokens are computed as one-token steps would compute them.

use candle_core::Tensor;

use crate::nn::cache::KvCache;
use crate::nn::paged_cache::{MixedStep, PagedKvCache, PagedStep};

/// A step's cache lengths in device memory, u32 `(batch,)` tensors on the cache's device (see
/// [`AttentionStep::at`]).
#[derive(Debug, Clone)]
pub struct DeviceLengths {
    /// Each sequence's cached length before the step: where its new tokens go.
    pub before: Tensor,
    /// Each sequence's length after the step: `before` plus the step's tokens.
    pub after: Tensor,
}

/// Where a step's keys and values go, and where the lengths it attends over are counted.
#[derive(Debug)]
pub(super) enum StepKv<'a> {
    /// After the cache's own lengths, which the host counts.
    Host(&'a mut KvCache),
    /// At lengths held in device memory.
    Device(&'a mut KvCache, &'a DeviceLengths),
    /// Layer `layer` of a paged cache, at the positions `step` made room for.
    Paged {
        cache: &'a PagedKvCache,
        layer: usize,
        step: &'a PagedStep,
    },
    /// Layer `layer` of a paged cache, at the positions a mixed `step` made room for.
    Mixed {
        cache: &'a PagedKvCache,
        layer: usize,
        step: &'a MixedStep,
    },
}

/// One call of [`CachedAttention::forward`](super::CachedAttention::forward): a prompt (or a
/// chunk of one), a decode step, a verification pass or a paged batch.
///
/// A step of t tokens per sequence writes their keys and values after what the cache holds and
/// attends them over everything up to and including their own positions: token `i` of a
/// sequence of length `len` after the step sits at `len − t + i`. So a long prompt can go in
/// chunks, each a block of queries over all the chunks before it, with the same result as one
/// call over the whole prompt (to rounding) and only one chunk's scores at a time.
///
/// ```
/// # use candle_core::{DType, Device, Tensor};
/// # use candle_splitkv::{AttentionStep, CachedAttention, KvCache, KvCacheConfig};
/// # fn main() -> candle_core::Result<()> {
/// # let device = Device::Cpu;
/// # let mut cache = KvCache::new(&KvCacheConfig {
/// #     batch: 1, kv_heads: 2, head_dim: 64, initial_capacity: 16, max_capacity: 64,
/// #     dtype: DType::F32, device: device.clone(), k_scale: 1.0, v_scale: 1.0,
/// # })?;
/// # let q = Tensor::randn(0f32, 1.0, (1, 1, 8, 64), &device)?;
/// # let k = Tensor::randn(0f32, 1.0, (1, 1, 2, 64), &device)?;
/// # let v = k.clone();
/// let attention = CachedAttention::new(0.125);
/// let mut lse = None;
/// let y = attention.forward(&q, &k, &v, AttentionStep::new(&mut cache).with_lse(&mut lse))?;
/// assert_eq!(lse.map(|lse| lse.dims().to_vec()), Some(vec![1, 8, 1]));
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct AttentionStep<'a> {
    pub(super) kv: StepKv<'a>,
    pub(super) lse: Option<&'a mut Option<Tensor>>,
    pub(super) as_decode_steps: bool,
}

impl<'a> AttentionStep<'a> {
    /// A step appended to `cache` after the lengths it counts on the host.
    pub fn new(cache: &'a mut KvCache) -> Self {
        Self::of(StepKv::Host(cache))
    }

    /// A step whose positions live in device memory (see [`KvCache::append_at`]):
    /// `lengths.before` holds the cache's lengths, where the new keys and values go, and
    /// `lengths.after` those lengths plus t, which attention masks each sequence to. The op runs
    /// over the whole capacity, cut by each sequence's own length, so that the launches do not
    /// change from one step to the next and a CUDA graph can replay them. Needs the split-KV
    /// backend and a head dim in [`SUPPORTED_HEAD_DIMS`](crate::SUPPORTED_HEAD_DIMS).
    pub fn at(cache: &'a mut KvCache, lengths: &'a DeviceLengths) -> Self {
        Self::of(StepKv::Device(cache, lengths))
    }

    /// A step of the sequences of `step` (made by [`PagedKvCache::begin_step`]) in layer
    /// `layer` of `cache`: q, k and v hold `step.batch()` sequences of `step.t()` tokens.
    pub fn paged(cache: &'a PagedKvCache, layer: usize, step: &'a PagedStep) -> Self {
        Self::of(StepKv::Paged { cache, layer, step })
    }

    /// A step of the sequences of a mixed `step` (made by [`PagedKvCache::begin_mixed_step`]),
    /// each with its own number of new tokens, in layer `layer` of `cache`: q, k and v are
    /// `(1, step.tokens(), heads, head_dim)`, the step's tokens end to end (see [`MixedStep`]).
    /// Each group of sequences with the same count is one call of the op, whose output goes
    /// back in the step's token order. The LSE is not implemented for it.
    pub fn mixed(cache: &'a PagedKvCache, layer: usize, step: &'a MixedStep) -> Self {
        Self::of(StepKv::Mixed { cache, layer, step })
    }

    /// Also writes into `lse` the natural-log LSE `(batch, q_heads, t)` of the split-KV op where
    /// it ran (see [`SplitKvAttention::forward_with_lse`](crate::SplitKvAttention)), and `None`
    /// where it did not (the naive backend, a head dim the op does not take).
    pub fn with_lse(mut self, lse: &'a mut Option<Tensor>) -> Self {
        self.lse = Some(lse);
        self
    }

    /// Computes a few tokens being verified as one-token steps at their positions would compute
    /// them (on the CPU, bit for bit), so that verification sees the logits decoding would.
    ///
    /// The op cuts the cache into splits by its length; one call over all the tokens could cut
    /// it elsewhere than a step for an earlier token does, and round differently. So the tokens
    /// whose own lengths get the same cut share a call over the keys up to the last of them
    /// (masked keys weigh exactly nothing): one call, or two where a cut moves. On CUDA, and
    /// for one token, this changes nothing.
    pub fn as_decode_steps(mut self) -> Self {
        self.as_decode_steps = true;
        self
    }

    fn of(kv: StepKv<'a>) -> Self {
        Self {
            kv,
            lse: None,
            as_decode_steps: false,
        }
    }
}
