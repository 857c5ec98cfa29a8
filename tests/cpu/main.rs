//! The CPU suites, as one test binary: one link instead of one per suite. The suites run on
//! parallel threads of one process; the test hooks they set are per thread.
//!
//! One suite: `cargo test --release --test cpu cpu_prefill::`.

#[path = "../common/mod.rs"]
mod common;

mod attention_probe;
mod batched_llama;
mod chunked_prefill;
mod cpu_api;
mod cpu_errors;
mod cpu_fp8;
mod cpu_matrix;
mod cpu_prefill;
mod cpu_query_tokens;
mod families_equivalence;
mod flash_attn_api;
mod gguf_families;
mod kv_cache_fp8;
mod llama_equivalence;
mod llama_fp8_cache;
// Runs the `lse_heatmap` example, which needs the model stack.
#[cfg(feature = "models")]
mod lse_heatmap;
mod paged;
mod paged_cache;
mod speculative;
