//! The sentences a model is shown to score: those the text's own salience picks first, up to a
//! number of tokens, so that reading them costs the same whatever the document's length.

use tokenizers::Tokenizer;

use super::chunking::token_starts;
use super::error::SummarizeError;
use super::salience::rank_salient_sentences;

/// A sentence of the pool: its place among the document's [`sentences`](crate::sentences) and
/// its text as selection reads it (trimmed, its lines joined, its quotation marks paired).
#[derive(Debug, Clone, PartialEq)]
pub struct PoolSentence {
    pub position: usize,
    pub text: String,
}

/// The sentences of `document` that selection picks first, up to `tokens` of its tokens, in
/// document order: the candidates a [`ModelSalience`](crate::ModelSalience) scores.
pub fn sentence_pool(
    tokenizer: &Tokenizer,
    document: &str,
    tokens: usize,
) -> Result<Vec<PoolSentence>, SummarizeError> {
    let starts = token_starts(tokenizer, document)?;
    let mut pool: Vec<PoolSentence> = rank_salient_sentences(document, &starts, tokens, None)
        .into_iter()
        .map(|picked| PoolSentence {
            position: picked.position,
            text: picked.text,
        })
        .collect();
    pool.sort_unstable_by_key(|s| s.position);
    Ok(pool)
}
