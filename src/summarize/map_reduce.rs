//! Summarizing a document of any length: summarize chunks that fit, then summarize the summaries.
//!
//! [`MapReduce`] plans the generations and reduces their answers; the caller runs the model. It
//! hands out [`Round`]s of prompts and takes back the answers, until the final summary.

use std::fmt;

use tokenizers::Tokenizer;

use super::budgets::Budgets;
use super::chunking::{split_into_chunks, token_starts};
use super::prompts::{encode_prompt, prompt_overhead, Task};
use super::whole_sentences::drop_unfinished_sentence;
use super::{ChatTemplate, SummarizeError};

/// The generations to run next: each prompt is answered by a generation of at most
/// `max_new_tokens` tokens that starts from an empty cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Round {
    /// Summarize each chunk of the document, then pass the answers to
    /// [`MapReduce::next_round`].
    Parts {
        /// One prompt per chunk, in document order.
        prompts: Vec<Vec<u32>>,
        /// The limit of each answer.
        max_new_tokens: usize,
    },
    /// Merge each group of consecutive summaries into one, then pass the answers to
    /// [`MapReduce::next_round`]. Only needed when the summaries of the parts are too long to
    /// merge at once.
    Merge {
        /// Which merge round this is, from 1.
        round: usize,
        /// One prompt per group, in document order.
        prompts: Vec<Vec<u32>>,
        /// The limit of each answer.
        max_new_tokens: usize,
    },
    /// Write the final summary, then pass the answer to [`MapReduce::finish`].
    Final {
        /// The prompt.
        prompt: Vec<u32>,
        /// The limit of the answer.
        max_new_tokens: usize,
    },
}

/// Plans the summary of a document of any length. One that fits the model's context is
/// summarized at once; a longer one is cut into chunks on paragraph and sentence boundaries, each
/// chunk is summarized, then the summaries are summarized, in as many rounds as they need to fit
/// one prompt.
///
/// Intermediate summaries get half the final summary's limit (at least 16 tokens), and every
/// answer is cut back to its last whole sentence.
pub struct MapReduce<'t> {
    tokenizer: &'t Tokenizer,
    chat: ChatTemplate,
    budgets: Budgets,
    document_tokens: usize,
    chunks: usize,
    merge_rounds: usize,
}

impl<'t> MapReduce<'t> {
    /// Plans summaries of at most `max_new_tokens` tokens by a model with a context of
    /// `context_length` tokens, reading at most `chunk_tokens` tokens of the document at a time
    /// (fewer where the context requires it).
    ///
    /// Fails when `max_new_tokens` leaves no room in the context to merge two summaries of half
    /// its size; the error says the largest limit that does.
    pub fn new(
        tokenizer: &'t Tokenizer,
        chat: ChatTemplate,
        context_length: usize,
        chunk_tokens: usize,
        max_new_tokens: usize,
    ) -> Result<Self, SummarizeError> {
        let overhead = prompt_overhead(tokenizer, &chat)?;
        let budgets = Budgets::new(context_length, overhead, chunk_tokens, max_new_tokens)?;
        Ok(Self {
            tokenizer,
            chat,
            budgets,
            document_tokens: 0,
            chunks: 0,
            merge_rounds: 0,
        })
    }

    /// Cuts `document` into chunks and returns the first round: the final summary when the
    /// document fits at once, the summaries of its parts otherwise.
    pub fn start(&mut self, document: &str) -> Result<Round, SummarizeError> {
        let starts = token_starts(self.tokenizer, document)?;
        let chunks = split_into_chunks(document, &starts, self.budgets.chunk);
        self.document_tokens = starts.len();
        self.chunks = chunks.len().max(1);
        self.merge_rounds = 0;
        if chunks.len() <= 1 {
            return self.final_round(Task::Document(document.trim()));
        }
        let prompts = self.prompts(chunks.into_iter().map(Task::Part))?;
        Ok(Round::Parts {
            prompts,
            max_new_tokens: self.budgets.part_summary,
        })
    }

    /// Takes the answers of a [`Round::Parts`] or [`Round::Merge`] and returns the next round:
    /// the final summary when the summaries fit one prompt, another merge otherwise.
    ///
    /// Empty answers are skipped. Fails when all of them are empty, or when merging would not
    /// leave fewer summaries than there are.
    pub fn next_round(&mut self, answers: &[String]) -> Result<Round, SummarizeError> {
        let summaries: Vec<&str> = answers
            .iter()
            .map(|answer| drop_unfinished_sentence(answer))
            .filter(|summary| !summary.is_empty())
            .collect();
        if summaries.is_empty() {
            return Err(SummarizeError::AllSummariesEmpty);
        }
        let joined = summaries.join("\n\n");
        let starts = token_starts(self.tokenizer, &joined)?;
        let groups = split_into_chunks(&joined, &starts, self.budgets.merge);
        if groups.len() <= 1 {
            return self.final_round(Task::Summaries(&joined));
        }
        if groups.len() >= summaries.len() {
            return Err(SummarizeError::SummariesDoNotShrink);
        }
        self.merge_rounds += 1;
        let prompts = self.prompts(groups.into_iter().map(Task::Summaries))?;
        Ok(Round::Merge {
            round: self.merge_rounds,
            prompts,
            max_new_tokens: self.budgets.part_summary,
        })
    }

    /// Takes the answer of the [`Round::Final`] and returns the summary: the answer up to its
    /// last whole sentence. Fails when that is empty.
    pub fn finish(&self, answer: &str) -> Result<String, SummarizeError> {
        let summary = drop_unfinished_sentence(answer);
        if summary.is_empty() {
            return Err(SummarizeError::EmptySummary);
        }
        Ok(summary.to_string())
    }

    /// How many tokens the document has.
    pub fn document_tokens(&self) -> usize {
        self.document_tokens
    }

    /// How many chunks the document was cut into (1 when it fits at once).
    pub fn chunks(&self) -> usize {
        self.chunks
    }

    /// How many rounds of merging summaries came before the final one (0 for most documents).
    pub fn merge_rounds(&self) -> usize {
        self.merge_rounds
    }

    fn final_round(&self, task: Task) -> Result<Round, SummarizeError> {
        Ok(Round::Final {
            prompt: encode_prompt(self.tokenizer, &self.chat, task)?,
            max_new_tokens: self.budgets.final_summary,
        })
    }

    fn prompts<'a>(
        &self,
        tasks: impl Iterator<Item = Task<'a>>,
    ) -> Result<Vec<Vec<u32>>, SummarizeError> {
        tasks
            .map(|task| encode_prompt(self.tokenizer, &self.chat, task))
            .collect()
    }
}

// By hand, to leave out the tokenizer's vocabulary.
impl fmt::Debug for MapReduce<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MapReduce")
            .field("chat", &self.chat)
            .field("budgets", &self.budgets)
            .field("document_tokens", &self.document_tokens)
            .field("chunks", &self.chunks)
            .field("merge_rounds", &self.merge_rounds)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::summarize::test_tokenizer::word_tokenizer;

    /// One paragraph of `words` one-token words, ending a sentence.
    fn paragraph(words: usize) -> String {
        format!("{}.", vec!["w"; words].join(" "))
    }

    fn paragraphs(count: usize, words: usize) -> Vec<String> {
        (0..count).map(|_| paragraph(words)).collect()
    }

    fn prompt_tokens(tokenizer: &Tokenizer, task: Task) -> usize {
        encode_prompt(tokenizer, &ChatTemplate::chatml(), task)
            .unwrap()
            .len()
    }

    #[test]
    fn a_short_document_is_summarized_at_once() {
        let tokenizer = word_tokenizer();
        let mut plan = MapReduce::new(&tokenizer, ChatTemplate::chatml(), 8192, 1024, 200).unwrap();
        let round = plan.start("\n  Short text. Two sentences.  \n").unwrap();
        assert_eq!(
            round,
            Round::Final {
                prompt: encode_prompt(
                    &tokenizer,
                    &ChatTemplate::chatml(),
                    Task::Document("Short text. Two sentences.")
                )
                .unwrap(),
                max_new_tokens: 200,
            }
        );
        assert_eq!(
            (plan.document_tokens(), plan.chunks(), plan.merge_rounds()),
            (4, 1, 0)
        );
        assert_eq!(plan.finish(" A summary. Cut").unwrap(), "A summary.");
        assert_eq!(
            plan.finish(" \n").unwrap_err(),
            SummarizeError::EmptySummary
        );
    }

    #[test]
    fn a_long_document_is_summarized_in_parts_then_merged() {
        let tokenizer = word_tokenizer();
        let mut plan = MapReduce::new(&tokenizer, ChatTemplate::chatml(), 8192, 64, 200).unwrap();
        // Two paragraphs of 30 tokens fit a chunk of 64, three do not.
        let document = paragraphs(10, 30).join("\n\n");
        let Round::Parts {
            prompts,
            max_new_tokens,
        } = plan.start(&document).unwrap()
        else {
            panic!("expected the summaries of the parts");
        };
        let two_paragraphs = paragraphs(2, 30).join("\n\n");
        let part_prompt = prompt_tokens(&tokenizer, Task::Part(&two_paragraphs));
        assert_eq!(prompts.len(), 5);
        assert!(prompts.iter().all(|prompt| prompt.len() == part_prompt));
        assert_eq!(max_new_tokens, 100);
        assert_eq!((plan.document_tokens(), plan.chunks()), (300, 5));

        // Unfinished sentences and empty answers do not reach the merge.
        let answers: Vec<String> = (1..=5)
            .map(|i| format!("Part {i} summary. Then a cut"))
            .chain([String::new()])
            .collect();
        let merged = (1..=5)
            .map(|i| format!("Part {i} summary."))
            .collect::<Vec<_>>()
            .join("\n\n");
        assert_eq!(
            plan.next_round(&answers).unwrap(),
            Round::Final {
                prompt: encode_prompt(
                    &tokenizer,
                    &ChatTemplate::chatml(),
                    Task::Summaries(&merged)
                )
                .unwrap(),
                max_new_tokens: 200,
            }
        );
        assert_eq!(plan.merge_rounds(), 0);
    }

    #[test]
    fn summaries_too_long_to_merge_at_once_take_more_rounds() {
        let tokenizer = word_tokenizer();
        let mut plan = MapReduce::new(&tokenizer, ChatTemplate::chatml(), 8192, 64, 200).unwrap();
        let Round::Parts { prompts, .. } = plan.start(&paragraphs(10, 30).join("\n\n")).unwrap()
        else {
            panic!("expected the summaries of the parts");
        };
        assert_eq!(prompts.len(), 5);
        // A merge reads up to two 100-token summaries (232 tokens), more than a chunk: five
        // summaries go in three groups.
        let Round::Merge {
            round,
            prompts,
            max_new_tokens,
        } = plan.next_round(&paragraphs(5, 100)).unwrap()
        else {
            panic!("expected a merge round");
        };
        let two_summaries = paragraphs(2, 100).join("\n\n");
        let merge_prompt = prompt_tokens(&tokenizer, Task::Summaries(&two_summaries));
        let lengths: Vec<usize> = prompts.iter().map(Vec::len).collect();
        assert_eq!(lengths, [merge_prompt, merge_prompt, merge_prompt - 100]);
        assert_eq!((round, max_new_tokens), (1, 100));
        assert_eq!(plan.merge_rounds(), 1);

        let answers = ["One.", "Two.", "Three."].map(String::from);
        assert!(matches!(
            plan.next_round(&answers).unwrap(),
            Round::Final {
                max_new_tokens: 200,
                ..
            }
        ));
        assert_eq!(plan.merge_rounds(), 1);
    }

    #[test]
    fn summaries_that_do_not_shrink_are_an_error() {
        let tokenizer = word_tokenizer();
        let mut plan = MapReduce::new(&tokenizer, ChatTemplate::chatml(), 8192, 64, 200).unwrap();
        // Each summary alone exceeds what one merge reads.
        assert_eq!(
            plan.next_round(&paragraphs(2, 300)).unwrap_err(),
            SummarizeError::SummariesDoNotShrink
        );
    }

    #[test]
    fn all_empty_answers_are_an_error() {
        let tokenizer = word_tokenizer();
        let mut plan = MapReduce::new(&tokenizer, ChatTemplate::chatml(), 8192, 64, 200).unwrap();
        let answers = ["", " \n "].map(String::from);
        assert_eq!(
            plan.next_round(&answers).unwrap_err(),
            SummarizeError::AllSummariesEmpty
        );
    }

    #[test]
    fn a_summary_limit_too_large_for_the_context_is_rejected() {
        let tokenizer = word_tokenizer();
        let overhead = prompt_overhead(&tokenizer, &ChatTemplate::chatml()).unwrap();
        let error = MapReduce::new(&tokenizer, ChatTemplate::chatml(), 512, 1024, 400)
            .err()
            .unwrap();
        assert_eq!(
            error,
            SummarizeError::SummaryLimitTooLarge {
                max_new_tokens: 400,
                context_length: 512,
                largest: (512 - overhead - 64) / 2,
            }
        );
    }
}
