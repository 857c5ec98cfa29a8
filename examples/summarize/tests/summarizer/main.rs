//! The summarizer's test suites, as one test binary (one link instead of one per suite). They run
//! on parallel threads of one process; the runs of the model take turns
//! (`common::one_model_run_at_a_time`).
//!
//! One suite: `cargo test --release -p summarize --test summarizer summarize_cli::`.

#[path = "../common/mod.rs"]
mod common;

mod contract_property;
mod default_model_template;
mod summarize_cli;
mod summary_facts;
