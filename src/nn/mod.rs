//! The building blocks a candle model uses the op through: a preallocated KV cache, the attention
//! layer that appends to it and attends, and projections fused with the work around them.

pub mod attention;
pub mod cache;
pub mod fused_linear;
mod stored_kv;
