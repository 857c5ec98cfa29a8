//! Models patched to decode through the split-KV op.

pub mod llama;
