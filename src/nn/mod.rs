//! The building blocks a candle model uses the op through: a preallocated KV cache, a paged one
//! for many sequences at once, the attention layer that appends to it and attends, and
//! projections fused with the work around them.

pub mod attention;
pub mod cache;
pub mod fused_linear;
mod page_allocator;
pub mod paged_cache;
mod stored_kv;
