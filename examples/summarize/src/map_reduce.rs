//! Summarizing a document of any length: summarize chunks that fit, then reduce the summaries.
//!
//! [`MapReduce`] plans the generations and reduces their answers; the caller runs the model. It
//! hands out [`Round`]s of prompts and takes back the answers, until the final summary.

use std::fmt;

use tokenizers::Tokenizer;

use super::budgets::Budgets;
use super::chunking::{split_into_chunks, token_starts};
use super::contract::RewriteContract;
use super::model_salience::ModelSalience;
use super::prompts::{encode_prompt, prompt_overhead, Task};
use super::quotation_frames::unframe_quotations;
use super::salience::{rank_salient_sentences, select_salient_sentences, Picked};
use super::whole_sentences::whole_sentences;
use super::{ChatTemplate, GroundedText, Grounding, SummarizeError};

/// How the summaries of the parts become the final summary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Reduce {
    /// The model summarizes the summaries, in as many rounds as they need to fit one prompt.
    #[default]
    Summarize,
    /// The most salient selected sentences, each in its rewritten form where the model
    /// compressed it within the rewrite contract, up to the final summary's limit, in document
    /// order ([`Round::Done`]): no further generation, so no fact is summarized away. Where the
    /// document was not selected from, the most salient sentences of the summaries; where none
    /// qualifies, the model summarizes them.
    CarryFacts,
}

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
    /// The final summary, put together from the summaries of the parts without another
    /// generation ([`Reduce::CarryFacts`]).
    Done {
        /// The summary.
        summary: String,
    },
}

/// Plans the summary of a document of any length. One that fits a chunk, or is no longer than
/// the final summary may be, is summarized at once; a longer one is cut into chunks on paragraph
/// and sentence boundaries, each chunk is summarized, then the summaries are reduced to one: by
/// default summarized, in as many rounds as they need to fit one prompt.
///
/// Intermediate summaries get half the final summary's limit (at least 16 tokens), and every
/// answer is cut back to its last whole sentence.
///
/// Three steps keep the facts of a long document, each off unless asked for:
/// [`with_selection`](Self::with_selection) summarizes only the sentences that state the most
/// names, numbers and dates; [`with_reduce`](Self::with_reduce) can carry the facts of the
/// parts' summaries into the final one instead of summarizing them again; and
/// [`with_grounding`](Self::with_grounding) drops every sentence of an answer that states a
/// number or a name the document does not contain.
pub struct MapReduce<'t> {
    tokenizer: &'t Tokenizer,
    chat: ChatTemplate,
    budgets: Budgets,
    selection_budget: Option<usize>,
    reduce: Reduce,
    ground: bool,
    grounding: Option<Grounding>,
    /// The grounding of each chunk, while their summaries are awaited.
    chunk_groundings: Vec<Grounding>,
    document_tokens: usize,
    selected_tokens: Option<usize>,
    chunks: usize,
    merge_rounds: usize,
    dropped_sentences: usize,
    replaced_sentences: usize,
    /// The selected sentences, most salient first, while their rewrites are awaited.
    selected: Vec<Picked>,
    /// The selected sentence each chunk holds, by index into `selected`.
    chunk_sentences: Vec<Vec<usize>>,
    /// Whether the summary is made of whole sentences of the document, with no generation.
    extractive: bool,
    /// The most salient sentences of the document, up to the final summary's limit: the summary
    /// where checking leaves nothing of the model's.
    fallback: String,
    /// A salience of the document's sentences from outside its text, weighed in selection.
    model_salience: Option<ModelSalience>,
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
            selection_budget: None,
            reduce: Reduce::default(),
            ground: false,
            grounding: None,
            chunk_groundings: Vec::new(),
            document_tokens: 0,
            selected_tokens: None,
            chunks: 0,
            merge_rounds: 0,
            dropped_sentences: 0,
            replaced_sentences: 0,
            selected: Vec::new(),
            chunk_sentences: Vec::new(),
            extractive: false,
            fallback: String::new(),
            model_salience: None,
        })
    }

    /// Summarizes a document of more than `tokens` tokens from its most salient sentences (see
    /// `rank_salient_sentences`), up to `tokens` of its tokens, in document order, one
    /// paragraph each, instead of from all of it. A document without such sentences is
    /// summarized whole. `None` (the default) summarizes every document whole.
    pub fn with_selection(mut self, tokens: Option<usize>) -> Self {
        self.selection_budget = tokens;
        self
    }

    /// How the summaries of the parts become the final summary ([`Reduce::Summarize`] by
    /// default).
    pub fn with_reduce(mut self, reduce: Reduce) -> Self {
        self.reduce = reduce;
        self
    }

    /// Whether the summary is the document's most salient whole sentences, up to the final
    /// summary's limit, with no generation ([`Round::Done`] from [`start`](Self::start)): for a
    /// document in a language the model does not read. Off by default.
    pub fn with_extractive(mut self, extractive: bool) -> Self {
        self.extractive = extractive;
        self
    }

    /// Weighs `salience` (a model's, of the document given to [`start`](Self::start)) in
    /// selecting its sentences, which are then picked among those it scores; `None` (the
    /// default) selects by the text alone.
    pub fn with_model_salience(mut self, salience: Option<ModelSalience>) -> Self {
        self.model_salience = salience;
        self
    }

    /// Whether to check each sentence of an answer against the document (see [`Grounding`]):
    /// one that states a number or a name the document does not contain is dropped, one that
    /// breaks the rewrite contract gives way to the document's sentence; off by default.
    pub fn with_grounding(mut self, ground: bool) -> Self {
        self.ground = ground;
        self
    }

    /// Cuts `document` (or its selected sentences) into chunks and returns the first round: the
    /// final summary when the document fits a chunk or is no longer than the final summary may
    /// be, the summaries of its parts otherwise.
    pub fn start(&mut self, document: &str) -> Result<Round, SummarizeError> {
        let starts = token_starts(self.tokenizer, document)?;
        self.document_tokens = starts.len();
        self.selected_tokens = None;
        self.chunks = 1;
        self.merge_rounds = 0;
        self.dropped_sentences = 0;
        self.replaced_sentences = 0;
        self.grounding = self.ground.then(|| Grounding::new(document));
        self.selected.clear();
        self.chunk_sentences.clear();
        self.fallback = select_salient_sentences(
            document,
            &starts,
            self.budgets.final_summary,
            self.model_salience.as_ref(),
        )
        .join(" ");
        if self.extractive {
            if self.fallback.is_empty() {
                return Err(SummarizeError::NothingToSelect);
            }
            return Ok(Round::Done {
                summary: self.fallback.clone(),
            });
        }
        if starts.len() <= self.budgets.whole {
            return self.final_round(Task::Document(document.trim()));
        }
        let selection: String;
        let (text, starts) = match self.selection_budget {
            Some(budget) if starts.len() > budget => {
                self.selected =
                    rank_salient_sentences(document, &starts, budget, self.model_salience.as_ref());
                if self.selected.is_empty() {
                    (document, starts)
                } else {
                    let mut in_order: Vec<&Picked> = self.selected.iter().collect();
                    in_order.sort_unstable_by_key(|picked| picked.position);
                    // One paragraph each, so that chunks end between sentences.
                    selection = in_order
                        .iter()
                        .map(|picked| picked.text.as_str())
                        .collect::<Vec<_>>()
                        .join("\n\n");
                    let selection_starts = token_starts(self.tokenizer, &selection)?;
                    self.selected_tokens = Some(selection_starts.len());
                    (selection.as_str(), selection_starts)
                }
            }
            _ => (document, starts),
        };
        let chunks = split_into_chunks(text, &starts, self.budgets.chunk);
        self.chunks = chunks.len().max(1);
        if chunks.len() <= 1 {
            return self.final_round(Task::Document(text.trim()));
        }
        self.chunk_groundings = match &self.grounding {
            Some(grounding) => chunks.iter().map(|c| grounding.narrowed_to(c)).collect(),
            None => Vec::new(),
        };
        // Which selected sentences each chunk holds: their rewrites are looked for in its answer.
        self.chunk_sentences = chunks
            .iter()
            .map(|chunk| {
                (0..self.selected.len())
                    .filter(|&i| chunk.contains(self.selected[i].text.as_str()))
                    .collect()
            })
            .collect();
        let prompts = self.prompts(chunks.into_iter().map(Task::Part))?;
        Ok(Round::Parts {
            prompts,
            max_new_tokens: self.budgets.part_summary,
        })
    }

    /// Takes the answers of a [`Round::Parts`] or [`Round::Merge`] and returns the next round:
    /// with [`Reduce::CarryFacts`], the summary itself; else the final summary when the
    /// summaries fit one prompt, another merge otherwise.
    ///
    /// Empty answers are skipped (so are answers left empty by grounding). Fails when all of
    /// them are empty, or when merging would not leave fewer summaries than there are.
    pub fn next_round(&mut self, answers: &[String]) -> Result<Round, SummarizeError> {
        // The summaries of the chunks are checked against their chunks, merged summaries against
        // the document.
        let chunk_groundings = std::mem::take(&mut self.chunk_groundings);
        let chunk_sentences = std::mem::take(&mut self.chunk_sentences);
        let mut summaries = Vec::with_capacity(answers.len());
        let mut rewrites: Vec<Option<String>> = vec![None; self.selected.len()];
        for (i, answer) in answers.iter().enumerate() {
            let grounding = match chunk_groundings.get(i) {
                Some(chunk) if chunk_groundings.len() == answers.len() => Some(chunk),
                _ => self.grounding.as_ref(),
            };
            let answer = unframe_quotations(answer);
            let checked = grounded(&whole_sentences(&answer), grounding);
            self.dropped_sentences += checked.dropped;
            self.replaced_sentences += checked.replaced;
            let summary = checked.text;
            if let Some(held) = chunk_sentences.get(i) {
                self.find_rewrites(held, &summary, &mut rewrites)?;
            }
            if !summary.is_empty() {
                summaries.push(summary);
            }
        }
        if self.reduce == Reduce::CarryFacts && !self.selected.is_empty() {
            return Ok(Round::Done {
                summary: self.carried(&rewrites)?,
            });
        }
        if summaries.is_empty() {
            return Err(SummarizeError::AllSummariesEmpty);
        }
        let joined = summaries.join("\n\n");
        let starts = token_starts(self.tokenizer, &joined)?;
        if self.reduce == Reduce::CarryFacts {
            let picked =
                select_salient_sentences(&joined, &starts, self.budgets.final_summary, None);
            if !picked.is_empty() {
                return Ok(Round::Done {
                    summary: picked.join(" "),
                });
            }
        }
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

    /// Records, for each selected sentence of `held` (indices into `selected`), the shortest
    /// sentence of `answer` that is a compression of it under the rewrite contract and has
    /// fewer tokens.
    fn find_rewrites(
        &self,
        held: &[usize],
        answer: &str,
        rewrites: &mut [Option<String>],
    ) -> Result<(), SummarizeError> {
        for &i in held {
            let contract = RewriteContract::new(&self.selected[i].text);
            let mut best = self.selected[i].tokens;
            for sentence in crate::sentences::sentences(answer) {
                let sentence = sentence.trim();
                if sentence.is_empty() || !contract.holds(sentence) {
                    continue;
                }
                let tokens = token_starts(self.tokenizer, sentence)?.len();
                if tokens < best {
                    best = tokens;
                    rewrites[i] = Some(sentence.to_string());
                }
            }
        }
        Ok(())
    }

    /// The summary carried from the selection: the selected sentences, most salient first, each
    /// as rewritten where it was, while they fit the final summary's limit; in document order.
    fn carried(&self, rewrites: &[Option<String>]) -> Result<String, SummarizeError> {
        let mut used = 0;
        let mut kept: Vec<(usize, &str)> = Vec::new();
        for (picked, rewrite) in self.selected.iter().zip(rewrites) {
            let (text, tokens) = match rewrite {
                Some(rewrite) => (
                    rewrite.as_str(),
                    token_starts(self.tokenizer, rewrite)?.len(),
                ),
                None => (picked.text.as_str(), picked.tokens),
            };
            if used + tokens <= self.budgets.final_summary {
                used += tokens;
                kept.push((picked.position, text));
            }
        }
        kept.sort_unstable_by_key(|&(position, _)| position);
        let summary = kept
            .into_iter()
            .map(|(_, text)| text)
            .collect::<Vec<_>>()
            .join(" ");
        // Every sentence is checked against the whole document once more.
        let checked = grounded(&summary, self.grounding.as_ref());
        Ok(checked.text)
    }

    /// Takes the answer of the [`Round::Final`] and returns the summary: the answer up to its
    /// last whole sentence, its quotation marks paired, checked by grounding when it is on.
    /// Fails when that is empty.
    pub fn finish(&mut self, answer: &str) -> Result<String, SummarizeError> {
        let whole = whole_sentences(answer);
        if whole.is_empty() {
            return Err(SummarizeError::EmptySummary);
        }
        let checked = grounded(&whole, self.grounding.as_ref());
        self.dropped_sentences += checked.dropped;
        self.replaced_sentences += checked.replaced;
        let summary = checked.text;
        if summary.is_empty() {
            if self.fallback.is_empty() {
                return Err(SummarizeError::NothingGrounded);
            }
            return Ok(self.fallback.clone());
        }
        Ok(summary)
    }

    /// The grounding of the document being summarized, when grounding is on: what
    /// [`finish`](Self::finish) checks the final answer against, for a caller that shows the
    /// answer as it is written.
    pub fn grounding(&self) -> Option<&Grounding> {
        self.grounding.as_ref()
    }

    /// How many tokens the document has.
    pub fn document_tokens(&self) -> usize {
        self.document_tokens
    }

    /// How many tokens the selected sentences have, paragraph breaks between them included, when
    /// the document was summarized from them.
    pub fn selected_tokens(&self) -> Option<usize> {
        self.selected_tokens
    }

    /// How many chunks the document (or its selected sentences) was cut into (1 when it fits at
    /// once).
    pub fn chunks(&self) -> usize {
        self.chunks
    }

    /// How many sentences of the answers grounding dropped.
    pub fn dropped_sentences(&self) -> usize {
        self.dropped_sentences
    }

    /// How many sentences of the answers grounding replaced by a sentence of the text they
    /// misattributed.
    pub fn replaced_sentences(&self) -> usize {
        self.replaced_sentences
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

/// `text` checked by `grounding` (see [`Grounding::keep_grounded`]), trimmed.
fn grounded(text: &str, grounding: Option<&Grounding>) -> GroundedText {
    let mut checked = match grounding {
        Some(grounding) => grounding.keep_grounded(text),
        None => GroundedText {
            text: text.to_string(),
            ..GroundedText::default()
        },
    };
    checked.text = checked.text.trim().to_string();
    checked
}

// By hand, to leave out the tokenizer's vocabulary.
impl fmt::Debug for MapReduce<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MapReduce")
            .field("chat", &self.chat)
            .field("budgets", &self.budgets)
            .field("selection_budget", &self.selection_budget)
            .field("reduce", &self.reduce)
            .field("ground", &self.ground)
            .field("document_tokens", &self.document_tokens)
            .field("selected_tokens", &self.selected_tokens)
            .field("chunks", &self.chunks)
            .field("merge_rounds", &self.merge_rounds)
            .field("dropped_sentences", &self.dropped_sentences)
            .field("replaced_sentences", &self.replaced_sentences)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_tokenizer::word_tokenizer;

    /// One paragraph of `words` one-token words, one sentence.
    fn paragraph(words: usize) -> String {
        format!("W{}.", " w".repeat(words - 1))
    }

    fn paragraphs(count: usize, words: usize) -> Vec<String> {
        (0..count).map(|_| paragraph(words)).collect()
    }

    /// The final round of `task` in the ChatML template, as the plan should return it.
    fn final_round(tokenizer: &Tokenizer, task: Task, max_new_tokens: usize) -> Round {
        Round::Final {
            prompt: encode_prompt(tokenizer, &ChatTemplate::chatml(), task).unwrap(),
            max_new_tokens,
        }
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
            final_round(
                &tokenizer,
                Task::Document("Short text. Two sentences."),
                200
            )
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
        // Half the final limit, but no more than a chunk.
        assert_eq!(max_new_tokens, 64);
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
            final_round(&tokenizer, Task::Summaries(&merged), 200)
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
        // A merge reads up to two 64-token summaries (160 tokens), more than a chunk: five
        // summaries of 70 tokens go in three groups.
        let Round::Merge {
            round,
            prompts,
            max_new_tokens,
        } = plan.next_round(&paragraphs(5, 70)).unwrap()
        else {
            panic!("expected a merge round");
        };
        let two_summaries = paragraphs(2, 70).join("\n\n");
        let merge_prompt = prompt_tokens(&tokenizer, Task::Summaries(&two_summaries));
        let lengths: Vec<usize> = prompts.iter().map(Vec::len).collect();
        assert_eq!(lengths, [merge_prompt, merge_prompt, merge_prompt - 70]);
        assert_eq!((round, max_new_tokens), (1, 64));
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

    /// A sentence of `words` words in all, stating `fact` (a number or a name) at its end.
    fn fact_sentence(words: usize, fact: &str) -> String {
        format!("W{} {fact}.", " w".repeat(words - 2))
    }

    #[test]
    fn a_long_document_is_summarized_from_its_sentences_with_facts() {
        let tokenizer = word_tokenizer();
        let mut plan = MapReduce::new(&tokenizer, ChatTemplate::chatml(), 8192, 64, 50)
            .unwrap()
            .with_selection(Some(30));
        // 20 sentences of 9 tokens without facts, and 3 of 10 tokens that state one.
        let mut paragraphs = paragraphs(20, 9);
        paragraphs.insert(3, fact_sentence(10, "1987"));
        paragraphs.insert(12, fact_sentence(10, "Ashdown"));
        paragraphs.insert(20, fact_sentence(10, "£412"));
        let round = plan.start(&paragraphs.join("\n\n")).unwrap();
        assert_eq!(plan.document_tokens(), 210);
        assert_eq!(plan.selected_tokens(), Some(30));
        // The three sentences with facts, in document order, fit one chunk.
        let selected = [
            fact_sentence(10, "1987"),
            fact_sentence(10, "Ashdown"),
            fact_sentence(10, "£412"),
        ]
        .join("\n\n");
        assert_eq!(
            round,
            final_round(&tokenizer, Task::Document(&selected), 50)
        );
        assert_eq!(plan.chunks(), 1);
    }

    #[test]
    fn carrying_facts_keeps_the_summaries_sentences_with_the_most_facts() {
        let tokenizer = word_tokenizer();
        let mut plan = MapReduce::new(&tokenizer, ChatTemplate::chatml(), 8192, 64, 20)
            .unwrap()
            .with_reduce(Reduce::CarryFacts);
        plan.start(&paragraphs(10, 30).join("\n\n")).unwrap();
        let answers = [
            format!("{} {}", fact_sentence(8, "Ashdown"), paragraph(8)),
            fact_sentence(12, "1987"),
            format!(
                "{} {}",
                fact_sentence(8, "2019"),
                fact_sentence(8, "Ashdown")
            ),
        ];
        // Room for two of the three 8-token sentences with a new fact, kept in order.
        assert_eq!(
            plan.next_round(&answers).unwrap(),
            Round::Done {
                summary: format!(
                    "{} {}",
                    fact_sentence(8, "Ashdown"),
                    fact_sentence(8, "2019")
                ),
            }
        );
        // Summaries without a statement to carry are summarized by the model.
        plan.start(&paragraphs(10, 30).join("\n\n")).unwrap();
        assert!(matches!(
            plan.next_round(&paragraphs(2, 3)).unwrap(),
            Round::Final { .. }
        ));
    }

    #[test]
    fn grounding_drops_what_the_text_read_does_not_state() {
        let tokenizer = word_tokenizer();
        let mut plan = MapReduce::new(&tokenizer, ChatTemplate::chatml(), 8192, 40, 50)
            .unwrap()
            .with_grounding(true);
        // Three chunks: one states 1987, one 2019, one neither. The filler word is "w".
        let document = [
            fact_sentence(30, "1987"),
            fact_sentence(30, "2019"),
            paragraph(30),
        ]
        .join("\n\n");
        let Round::Parts { prompts, .. } = plan.start(&document).unwrap() else {
            panic!("expected the summaries of the parts");
        };
        assert_eq!(prompts.len(), 3);
        // 2019 is in the document, but not in the first chunk, whose summary the first answer
        // is. An answer that keeps its facts but cuts a clause short gives way to the sentence
        // of the chunk.
        let answers = [
            "W in 1987. W in 2019.".to_string(),
            "W in 2019.".to_string(),
            "W in 1999.".to_string(),
        ];
        let Round::Final { prompt, .. } = plan.next_round(&answers).unwrap() else {
            panic!("expected the final summary");
        };
        let kept = format!(
            "{}\n\n{}",
            fact_sentence(30, "1987"),
            fact_sentence(30, "2019")
        );
        assert_eq!(
            prompt,
            encode_prompt(&tokenizer, &ChatTemplate::chatml(), Task::Summaries(&kept)).unwrap()
        );
        assert_eq!(
            (plan.dropped_sentences(), plan.replaced_sentences()),
            (2, 2)
        );
        // The final summary is checked against the whole document.
        assert_eq!(
            plan.finish(&format!("{} W in 2024.", fact_sentence(30, "1987")))
                .unwrap(),
            fact_sentence(30, "1987")
        );
        assert_eq!(plan.dropped_sentences(), 3);
        // A name the document lacks: nothing of the answer is left, and the summary is the
        // document's most salient sentences, within the limit.
        let fallback = plan.finish("Only Zed.").unwrap();
        assert!(!fallback.contains("Zed"));
        assert!(document.contains(&fallback), "{fallback}");
        assert!(plan.grounding().is_some());
    }
}
