//! Models patched to decode through the split-KV op.

pub mod linear;
pub mod llama;
pub mod q8_rows;
pub mod speculative;
pub mod weight_form;
