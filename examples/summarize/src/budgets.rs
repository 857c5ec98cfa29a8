//! How many tokens each generation of a summary may read and write.

use super::SummarizeError;

/// Room left in the context for the prompt's fixed text and for tokenization differences between
/// a chunk alone and the same span inside the whole document.
const PROMPT_SLACK: usize = 32;

/// The fewest tokens an intermediate summary may have, however small the final one.
const MIN_PART_SUMMARY: usize = 16;

/// The token budgets of one summary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Budgets {
    /// The most document tokens summarized at once: a chunk, or the final summary's limit where
    /// that is more, as a document no longer than its summary gains nothing from being cut.
    pub(crate) whole: usize,
    /// The most document tokens in one chunk.
    pub(crate) chunk: usize,
    /// The most tokens of summaries merged by one generation. It may exceed the chunk budget so
    /// that every merge takes at least two summaries, and every round shrinks the text.
    pub(crate) merge: usize,
    /// The limit of the intermediate summaries: never more than a chunk, whose summary it is.
    pub(crate) part_summary: usize,
    /// The limit of the final summary.
    pub(crate) final_summary: usize,
}

impl Budgets {
    /// Budgets for a model with `context_length` tokens, prompts that take up to
    /// `prompt_overhead` tokens besides their text, chunks of up to `chunk_tokens` and a final
    /// summary of up to `max_new_tokens`.
    pub(crate) fn new(
        context_length: usize,
        prompt_overhead: usize,
        chunk_tokens: usize,
        max_new_tokens: usize,
    ) -> Result<Self, SummarizeError> {
        let room = context_length.saturating_sub(
            prompt_overhead
                .saturating_add(PROMPT_SLACK)
                .saturating_add(max_new_tokens),
        );
        let chunk = chunk_tokens.min(room);
        // Half the final limit: intermediate summaries are only read by the model, and shorter
        // ones keep small models from rambling and decoding from dominating. A summary longer
        // than its chunk would be rambling too.
        let part_summary = (max_new_tokens / 2).min(chunk).max(MIN_PART_SUMMARY);
        let min_merge = part_summary.saturating_mul(2).saturating_add(PROMPT_SLACK);
        if room < min_merge {
            let largest =
                context_length.saturating_sub(prompt_overhead.saturating_add(2 * PROMPT_SLACK)) / 2;
            return Err(SummarizeError::SummaryLimitTooLarge {
                max_new_tokens,
                context_length,
                largest,
            });
        }
        Ok(Self {
            whole: chunk.max(max_new_tokens.min(room)),
            chunk,
            merge: chunk_tokens.max(min_merge).min(room),
            part_summary,
            final_summary: max_new_tokens,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_large_context_takes_the_chunk_size_asked_for() {
        let budgets = Budgets::new(8192, 60, 1024, 200).unwrap();
        assert_eq!(
            budgets,
            Budgets {
                whole: 1024,
                chunk: 1024,
                merge: 1024,
                part_summary: 100,
                final_summary: 200,
            }
        );
    }

    #[test]
    fn merges_take_at_least_two_summaries() {
        let budgets = Budgets::new(8192, 60, 100, 400).unwrap();
        assert_eq!(
            (budgets.chunk, budgets.merge),
            (100, 2 * 100 + PROMPT_SLACK)
        );
    }

    #[test]
    fn small_chunks_leave_short_documents_whole() {
        let budgets = Budgets::new(8192, 60, 64, 200).unwrap();
        // Intermediate summaries are no longer than a chunk.
        assert_eq!(budgets.part_summary, 64);
        assert_eq!(budgets.final_summary, 200);
        assert_eq!((budgets.chunk, budgets.whole), (64, 200));
        // Unless the context has no room for that.
        let budgets = Budgets::new(512, 60, 64, 220).unwrap();
        assert_eq!(budgets.whole, 512 - 60 - PROMPT_SLACK - 220);
    }

    #[test]
    fn intermediate_summaries_have_a_floor() {
        let budgets = Budgets::new(8192, 60, 1024, 10).unwrap();
        assert_eq!(budgets.part_summary, MIN_PART_SUMMARY);
        assert_eq!(budgets.final_summary, 10);
    }

    #[test]
    fn a_small_context_caps_both_budgets() {
        // 512 - 60 - 32 - 100 tokens are left for the text.
        let budgets = Budgets::new(512, 60, 1024, 100).unwrap();
        assert_eq!((budgets.chunk, budgets.merge), (320, 320));
    }

    #[test]
    fn rejects_a_final_limit_that_leaves_no_room_to_merge() {
        let error = Budgets::new(512, 60, 1024, 300).unwrap_err();
        let largest = (512 - 60 - 2 * PROMPT_SLACK) / 2;
        assert_eq!(
            error,
            SummarizeError::SummaryLimitTooLarge {
                max_new_tokens: 300,
                context_length: 512,
                largest,
            }
        );
        // The limit the error suggests works.
        assert!(Budgets::new(512, 60, 1024, largest).is_ok());
        assert!(error
            .to_string()
            .contains(&format!("use at most {largest}")));
    }

    #[test]
    fn huge_limits_are_rejected_without_overflow() {
        assert!(Budgets::new(512, 60, usize::MAX, usize::MAX).is_err());
        assert!(Budgets::new(0, usize::MAX, 1024, 200).is_err());
        let budgets = Budgets::new(usize::MAX, 60, usize::MAX, 200).unwrap();
        assert_eq!(budgets.chunk, budgets.merge);
    }
}
