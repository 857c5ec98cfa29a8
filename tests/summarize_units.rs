//! Unit tests of the summarizer example's self-contained parts: chunking, the chat template and
//! the document checks.
//!
//! `cargo test` builds examples as plain binaries (tests/summarize_cli.rs runs the result) and
//! does not run their `#[cfg(test)]` modules, so this target compiles those files again as a test.

// Only the tests use these modules here; the rest of their API serves the binary.
#![allow(dead_code)]

#[path = "../examples/summarize/bad_input.rs"]
mod bad_input;
#[path = "../examples/summarize/chat_template.rs"]
mod chat_template;
#[path = "../examples/summarize/chunking.rs"]
mod chunking;
#[path = "../examples/summarize/document.rs"]
mod document;
