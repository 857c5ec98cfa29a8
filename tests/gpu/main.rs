//! The suites that test the CUDA path, as one test binary: one link instead of one per suite, and
//! one file to carry to a GPU machine. Their GPU tests skip with a notice where no CUDA device
//! exists; the CPU checks of the mixed suites (`fused_linear`, `window_softcap`, `llama_gguf`)
//! run everywhere. The suites run on parallel threads of one process, so a test that captures a
//! CUDA graph reruns the binary on itself alone (`common::own_process`).
//!
//! One suite: `cargo test --release --features cuda --test gpu gpu_prefill::`.

#[path = "../common/mod.rs"]
mod common;

mod flash_attn_api;
mod fused_linear;
mod gpu_batched;
mod gpu_families;
mod gpu_fp8;
mod gpu_graph;
mod gpu_graph_capture;
mod gpu_kernels;
mod gpu_llama;
mod gpu_paged;
mod gpu_prefill;
// Calls a kernel the crate has only on CUDA.
#[cfg(feature = "cuda")]
mod gpu_qkv_rope_append;
mod gpu_query_tokens;
mod gpu_rope_split;
mod llama_gguf;
mod smem_99_kib;
mod window_softcap;
