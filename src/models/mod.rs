//! Models patched to decode through the split-KV op.

pub mod linear;
pub mod llama;
pub mod weight_form;
