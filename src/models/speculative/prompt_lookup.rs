//! Drafts with no second model: the tokens that followed the last earlier occurrence of the
//! context's final n-gram, in the prompt or the text so far. Summaries and answers quote their
//! source, so such continuations are often right.

use candle_core::Result;

use super::{Draft, Drafter};

/// The prompt-lookup drafter: tries n-grams from `max_ngram` tokens down to `min_ngram`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptLookup {
    pub max_ngram: usize,
    pub min_ngram: usize,
}

impl Default for PromptLookup {
    fn default() -> Self {
        Self {
            max_ngram: 3,
            min_ngram: 1,
        }
    }
}

impl Drafter for PromptLookup {
    fn draft(&mut self, context: &[u32], n: usize) -> Result<Draft> {
        let min = self.min_ngram.max(1);
        for size in (min..=self.max_ngram).rev() {
            if n == 0 || context.len() <= size {
                continue;
            }
            let suffix = &context[context.len() - size..];
            // The most recent earlier occurrence, not the suffix itself.
            let found = (0..context.len() - size)
                .rev()
                .find(|&at| &context[at..at + size] == suffix);
            if let Some(at) = found {
                let from = at + size;
                let tokens = context[from..(from + n).min(context.len())].to_vec();
                return Ok(Draft {
                    tokens,
                    probs: None,
                });
            }
        }
        Ok(Draft::default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn continues_the_last_match_of_the_longest_ngram() -> Result<()> {
        let mut lookup = PromptLookup::default();
        // "5 6 7" occurs earlier followed by "8 9 1"; the context ends in "5 6 7" again.
        let context = [1, 5, 6, 7, 8, 9, 1, 2, 5, 6, 7];
        assert_eq!(lookup.draft(&context, 3)?.tokens, [8, 9, 1]);
        assert_eq!(lookup.draft(&context, 10)?.tokens, [8, 9, 1, 2, 5, 6, 7]);
        // Only a one-token match: the latest earlier 4 is followed by 3.
        assert_eq!(lookup.draft(&[4, 2, 4, 3, 9, 4], 2)?.tokens, [3, 9]);
        assert!(lookup.draft(&[1, 2, 3], 4)?.tokens.is_empty());
        assert!(lookup.draft(&context, 0)?.tokens.is_empty());
        assert!(lookup.draft(&[], 4)?.tokens.is_empty());
        Ok(())
    }
}
