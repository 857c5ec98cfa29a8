//! A tokenizer for the tests: one token per run of non-whitespace, every word unknown.

use tokenizers::models::wordlevel::WordLevel;
use tokenizers::pre_tokenizers::whitespace::WhitespaceSplit;
use tokenizers::Tokenizer;

pub(crate) fn word_tokenizer() -> Tokenizer {
    let model = WordLevel::builder()
        .vocab([("<unk>".to_string(), 0)].into_iter().collect())
        .unk_token("<unk>".to_string())
        .build()
        .expect("a one-word vocabulary is valid");
    let mut tokenizer = Tokenizer::new(model);
    tokenizer.with_pre_tokenizer(Some(WhitespaceSplit));
    tokenizer
}

/// Where [`word_tokenizer`]'s tokens start: one per run of non-whitespace.
pub(crate) fn word_starts(text: &str) -> Vec<usize> {
    let mut starts = Vec::new();
    let mut in_word = false;
    for (i, c) in text.char_indices() {
        if !c.is_whitespace() && !in_word {
            starts.push(i);
        }
        in_word = !c.is_whitespace();
    }
    starts
}
