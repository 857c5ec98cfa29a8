//! Extractive selection: the sentences of a text that state the most names, numbers and dates,
//! kept in their order. Before the model, it boils a long document down to what a small model
//! can read quickly and copy faithfully; after it, it keeps the facts of the summaries of the
//! parts instead of summarizing them away.

use std::collections::HashSet;
use std::ops::Range;

use super::mentions::{mentions, Mention};
use super::pronoun_subjects::standalone_sentences;
use super::sentences::{is_definition, opens_with_capital};
use super::topic_words::words_of;

/// Fragments shorter than this many words (list markers, captions) state no fact worth selecting,
/// even when they carry a number.
const MIN_SENTENCE_WORDS: usize = 6;

/// How a statement ends; headings and titles, whose capitalized words would pass for names,
/// end otherwise.
const STATEMENT_ENDS: [char; 5] = ['.', '!', '?', '"', ')'];

/// Integers below this are mostly ordinals and small counts ("section 5", "two options"), rarely
/// the figures a reader needs.
const MIN_SALIENT_INTEGER: u64 = 20;

/// One fact a sentence states, by the words that identify it: a number, or a name of one or
/// more capitalized words in a row ("Marguerite Ashdown", "Tarrow Estuary Authority"). A name
/// of several words is one fact, as much as a one-word name is.
type Fact = Vec<String>;

/// The facts a sentence states, as selection counts them: numbers other than small integers, and
/// names inside the sentence (any word opening it is capitalized).
fn facts_of(sentence: &str) -> Vec<Fact> {
    let mut facts = Vec::new();
    let mut name: Fact = Vec::new();
    for (position, word) in sentence.split_whitespace().enumerate() {
        let mut capitalized = false;
        for mention in mentions(word) {
            match mention {
                Mention::Number(number) => {
                    let small = number
                        .parse::<u64>()
                        .is_ok_and(|integer| integer < MIN_SALIENT_INTEGER);
                    if !small {
                        facts.push(vec![number]);
                    }
                }
                Mention::Name { word, .. } => {
                    capitalized = true;
                    if position > 0 {
                        name.push(word);
                    }
                }
            }
        }
        // Lowercase words and punctuation (a comma between two names) end a name.
        let ends_name =
            !capitalized || word.ends_with(|c: char| c.is_ascii_punctuation() && c != '\'');
        if ends_name && !name.is_empty() {
            facts.push(std::mem::take(&mut name));
        }
    }
    if !name.is_empty() {
        facts.push(name);
    }
    facts
}

/// Picks sentences of `text` whose tokens add up to at most `budget`, and returns them trimmed,
/// in the order of the text, each made to stand alone: its quotation marks paired, and a pronoun
/// subject replaced by the name it stands for (a sentence whose pronoun cannot be resolved is
/// not picked; see [`standalone_sentences`]). `token_starts` holds the byte offset where each token of `text`
/// starts (see [`token_starts`](super::chunking::token_starts)); `topic` holds the topic words
/// of the document `text` is or summarizes (see [`topic_words`](super::topic_words)).
///
/// Each pick is the sentence that adds the most facts not stated by the sentences picked before
/// it, per token, so that the selection covers as many distinct names, numbers and dates as the
/// budget holds, each as briefly as the text states it, without repeating them. Once no sentence
/// adds a fact, the rest of the budget goes the same way to the sentences that add the most
/// topic words: what a document with few facts is about.
pub(crate) fn select_salient_sentences(
    text: &str,
    token_starts: &[usize],
    budget: usize,
    topic: &HashSet<String>,
) -> Vec<String> {
    let tokens_in = |span: &Range<usize>| {
        token_starts.partition_point(|&start| start < span.end)
            - token_starts.partition_point(|&start| start < span.start)
    };
    let mut candidates: Vec<Candidate> = standalone_sentences(text)
        .into_iter()
        .enumerate()
        .filter_map(|(position, (span, sentence))| {
            let sentence = sentence?;
            Some(Candidate {
                position,
                // Counted as the text has it: a name in place of a pronoun adds a token or two.
                tokens: tokens_in(&span).max(1),
                facts: facts_of(&sentence),
                topic_words: words_of(&sentence)
                    .filter(|word| topic.contains(word))
                    .collect(),
                text: sentence,
            })
        })
        .filter(|candidate| {
            candidate.text.ends_with(STATEMENT_ENDS)
                && opens_with_capital(&candidate.text)
                && !is_definition(&candidate.text)
                && candidate.text.split_whitespace().count() >= MIN_SENTENCE_WORDS
        })
        .collect();

    let mut selection = Selection {
        budget,
        used: 0,
        picked: Vec::new(),
    };
    // Facts first. A fact is new while any of its words is not covered yet.
    selection.pick_greedily(
        &mut candidates,
        HashSet::new(),
        |candidate, covered| {
            let new = |fact: &&Fact| fact.iter().any(|word| !covered.contains(word));
            candidate.facts.iter().filter(new).count()
        },
        |candidate| candidate.facts.iter().flatten().cloned().collect(),
    );
    // Then topic words, those of the sentences with facts already covered.
    let said = selection
        .picked
        .iter()
        .flat_map(|(_, sentence)| words_of(sentence))
        .filter(|word| topic.contains(word))
        .collect();
    selection.pick_greedily(
        &mut candidates,
        said,
        |candidate, covered| candidate.topic_words.difference(covered).count(),
        |candidate| candidate.topic_words.iter().cloned().collect(),
    );
    let mut picked = selection.picked;
    picked.sort_unstable_by_key(|&(position, _)| position);
    picked.into_iter().map(|(_, sentence)| sentence).collect()
}

/// A sentence that may be selected.
struct Candidate {
    position: usize,
    text: String,
    tokens: usize,
    facts: Vec<Fact>,
    topic_words: HashSet<String>,
}

/// The sentences picked so far, by their position in the text.
struct Selection {
    budget: usize,
    used: usize,
    picked: Vec<(usize, String)>,
}

impl Selection {
    /// Picks, while the budget allows, the candidate that adds the most new items to `covered`
    /// per token: `new_items` counts those a candidate would add, `items` lists all of its own.
    fn pick_greedily(
        &mut self,
        candidates: &mut Vec<Candidate>,
        mut covered: HashSet<String>,
        new_items: impl Fn(&Candidate, &HashSet<String>) -> usize,
        items: impl Fn(&Candidate) -> Vec<String>,
    ) {
        loop {
            let best = candidates
                .iter()
                .enumerate()
                .filter(|(_, candidate)| self.used + candidate.tokens <= self.budget)
                .map(|(at, candidate)| {
                    let gain = new_items(candidate, &covered) as f64 / candidate.tokens as f64;
                    (at, gain, candidate.position)
                })
                .filter(|&(_, gain, _)| gain > 0.0)
                // On a tie, the earlier sentence.
                .max_by(|a, b| a.1.total_cmp(&b.1).then(b.2.cmp(&a.2)));
            let Some((at, _, _)) = best else {
                return;
            };
            let candidate = candidates.swap_remove(at);
            covered.extend(items(&candidate));
            self.used += candidate.tokens;
            self.picked.push((candidate.position, candidate.text));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_tokenizer::word_starts;
    use crate::topic_words::topic_words;

    fn select(text: &str, budget: usize) -> Vec<String> {
        select_salient_sentences(text, &word_starts(text), budget, &topic_words(text))
    }

    #[test]
    fn picks_the_sentences_with_the_most_new_facts_in_text_order() {
        let text = "The weather was mild and nothing much happened all week. \
            The barrier cost 412 million and opened in 2019 at Port Ellery. \
            It was opened in 2019 by the mayor of the town. \
            Marguerite Ashdown led the design team from the first drawing.";
        // Room for the two sentences with new facts; the third only repeats 2019.
        assert_eq!(
            select(text, 30),
            [
                "The barrier cost 412 million and opened in 2019 at Port Ellery.",
                "Marguerite Ashdown led the design team from the first drawing."
            ]
        );
    }

    #[test]
    fn stops_at_the_budget() {
        // Two new facts in eight words against one.
        let text = "Alpha met Beta in the big hall today. Delta came on the 23rd of May too.";
        assert_eq!(select(text, 9), ["Delta came on the 23rd of May too."]);
        assert!(select(text, 5).is_empty());
    }

    #[test]
    fn headings_small_integers_and_fact_free_text_are_not_picked() {
        let text = "## 5. Design\n\nSection 5 has the gates that rise when tides are high.\n\n\
            The Tarrow Estuary Tidal Barrier: Report of the Review Panel";
        assert!(select(text, 100).is_empty());
    }

    #[test]
    fn picked_sentences_stand_alone() {
        let text = "Mr Fairweather gave evidence to the panel at some length. He said the \
            group met 1,340 households in 1988. The contract was awarded to Brackwater Civil \
            Engineering, a firm from Tarrow. Its bid was the lowest of 3 by £12 million. The \
            mayor said: \"The barrier will cost £286 million. It will hold.\"";
        assert_eq!(
            select(text, 100),
            [
                "Mr Fairweather said the group met 1,340 households in 1988.",
                "The contract was awarded to Brackwater Civil Engineering, a firm from Tarrow.",
                "The mayor said: \"The barrier will cost £286 million.\""
            ]
        );
    }
}
