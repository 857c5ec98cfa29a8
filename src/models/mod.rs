//! Models patched to decode through the split-KV op.

mod gguf_rows;
mod linear;
pub mod llama;
mod q8_rows;
mod residual;
pub mod speculative;
mod weight_form;
