//! The building blocks of a long-document summarizer: checking that the input is text, selecting
//! its most salient sentences (LexRank centrality, new names and numbers, sections, overview),
//! cutting them into chunks that fit the model's context, prompting in the model's chat format,
//! reducing the answers to one summary (map-reduce), and checking every sentence written against
//! the document under the rewrite contract ([`RewriteContract`]); also the extractive baselines
//! a summary is measured against ([`Baseline`]).
//!
//! [`MapReduce`] plans the generations and the caller runs them, on any model:
//!
//! ```no_run
//! use summarize::{decode_text, ChatTemplate, MapReduce, Reduce, Round};
//! # fn generate(prompt: &[u32], max_new_tokens: usize) -> String { unimplemented!() }
//! # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! # let (tokenizer, bytes) = (tokenizers::Tokenizer::from_file("tokenizer.json")?, vec![]);
//! let document = decode_text("notes.txt", bytes)?;
//! // The summarizer's defaults: chunks of 64 tokens from the 1,024 tokens of the most salient
//! // sentences, a summary of up to 400 tokens carried from them as the model compressed them.
//! let mut plan = MapReduce::new(&tokenizer, ChatTemplate::chatml(), 8192, 64, 400)?
//!     .with_selection(Some(1024))
//!     .with_reduce(Reduce::CarryFacts)
//!     .with_grounding(true);
//! let mut round = plan.start(&document)?;
//! let summary = loop {
//!     round = match round {
//!         Round::Parts { prompts, max_new_tokens } | Round::Merge { prompts, max_new_tokens, .. } => {
//!             let answers: Vec<String> =
//!                 prompts.iter().map(|p| generate(p, max_new_tokens)).collect();
//!             plan.next_round(&answers)?
//!         }
//!         Round::Final { prompt, max_new_tokens } => {
//!             break plan.finish(&generate(&prompt, max_new_tokens))?;
//!         }
//!         Round::Done { summary } => break summary,
//!     };
//! };
//! # Ok(()) }
//! ```
//!
//! The package's `summarize` binary is a complete command-line summarizer built on them, running
//! the models of `candle-splitkv`.

mod baselines;
mod budgets;
mod centrality;
mod chat_template;
mod chunking;
mod contract;
mod document;
mod error;
mod grounding;
mod language;
mod map_reduce;
mod mentions;
mod model_salience;
mod prompts;
mod pronoun_subjects;
mod quotation_frames;
mod salience;
mod sentence_pool;
mod sentences;
mod stray_quotes;
#[cfg(test)]
mod test_tokenizer;
mod whole_sentences;

pub use baselines::{candidate_sentences, Baseline, LEXRANK_THRESHOLD};
pub use centrality::{cosine, lexrank, terms, textrank, tfidf_vectors};
pub use chat_template::ChatTemplate;
pub use contract::{is_cjk, Breach, RewriteContract};
pub use document::{decode_text, NotADocument};
pub use error::SummarizeError;
pub use grounding::{GroundedStream, GroundedText, Grounding};
pub use language::reads_as_english;
pub use map_reduce::{MapReduce, Reduce, Round};
pub use mentions::Mention;
pub use model_salience::ModelSalience;
pub use sentence_pool::{sentence_pool, PoolSentence};
pub use sentences::{sentences, words_in};
pub use whole_sentences::WholeSentences;
