//! What can go wrong while planning a summary or reducing its answers.

use std::fmt;

/// An error of [`MapReduce`](super::MapReduce).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SummarizeError {
    /// The tokenizer failed on `what` ("the text" or "the prompt").
    Tokenize {
        /// What was being tokenized.
        what: &'static str,
        /// The tokenizer's message.
        reason: String,
    },
    /// The limit of the final summary leaves no room in the context to merge two intermediate
    /// summaries.
    SummaryLimitTooLarge {
        /// The limit asked for.
        max_new_tokens: usize,
        /// The model's context length.
        context_length: usize,
        /// A limit that leaves enough room.
        largest: usize,
    },
    /// Summarizing the summaries again would not make them fewer, so merging would never end.
    SummariesDoNotShrink,
    /// Every answer of a round of intermediate summaries was empty.
    AllSummariesEmpty,
    /// The final answer was empty.
    EmptySummary,
    /// Every sentence of the final answer stated a number or a name the document does not
    /// contain, and grounding dropped them all.
    NothingGrounded,
    /// A summary of whole sentences was asked for, and the document has no sentence that could
    /// stand in one (a statement of six words or more).
    NothingToSelect,
    /// The model's chat template does not parse or render.
    ChatTemplate {
        /// The template engine's message.
        reason: String,
    },
}

impl fmt::Display for SummarizeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SummarizeError::Tokenize { what, reason } => {
                write!(f, "cannot tokenize {what}: {reason}")
            }
            SummarizeError::SummaryLimitTooLarge {
                max_new_tokens,
                context_length,
                largest,
            } => write!(
                f,
                "a summary limit of {max_new_tokens} tokens is too large for the model's context \
                 of {context_length} tokens: summaries could not be merged; use at most {largest}"
            ),
            SummarizeError::SummariesDoNotShrink => f.write_str(
                "the summaries of the parts do not get shorter when summarized again; use larger \
                 chunks or a smaller summary limit",
            ),
            SummarizeError::AllSummariesEmpty => {
                f.write_str("the model wrote an empty summary for every part of the document")
            }
            SummarizeError::EmptySummary => f.write_str("the model wrote an empty summary"),
            SummarizeError::NothingGrounded => f.write_str(
                "every sentence of the model's summary stated a number or a name the document \
                 does not contain",
            ),
            SummarizeError::NothingToSelect => f.write_str(
                "the document has no sentence to summarize it by: a summary of its own sentences \
                 needs statements of six words or more that end with a full stop",
            ),
            SummarizeError::ChatTemplate { reason } => {
                write!(f, "the model's chat template cannot be rendered: {reason}")
            }
        }
    }
}

impl std::error::Error for SummarizeError {}

impl SummarizeError {
    /// Wraps a tokenizer's error while it tokenized `what`.
    pub(crate) fn tokenizing(what: &'static str) -> impl FnOnce(tokenizers::Error) -> Self {
        move |e| SummarizeError::Tokenize {
            what,
            reason: e.to_string(),
        }
    }
}
