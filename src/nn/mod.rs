//! The building blocks a candle model uses the op through: a preallocated KV cache, a paged one
//! for many sequences at once, the attention layer that appends to it and attends, and
//! projections fused with the work around them.

pub(crate) mod attention;
pub(crate) mod cache;
pub(crate) mod fused_linear;
mod page_allocator;
pub(crate) mod paged_cache;
mod stored_kv;

pub use attention::{AttentionBackend, AttentionStep, CachedAttention, DeviceLengths};
pub use cache::{KvCache, KvCacheConfig};
pub use fused_linear::{fused_linear, linear_unfused, LinearInput, LinearOutput};
pub use paged_cache::{
    MixedStep, PagedKvCache, PagedKvCacheConfig, PagedStep, SequenceId, StepGroup,
};
pub use stored_kv::CACHE_DTYPES;
