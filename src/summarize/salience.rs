//! Extractive selection: the sentences of a text that state the most names, numbers and dates,
//! kept in their order. Before the model, it boils a long document down to what a small model
//! can read quickly and copy faithfully; after it, it keeps the facts of the summaries of the
//! parts instead of summarizing them away.

use std::collections::HashSet;

use super::mentions::{mentions, Mention};
use super::sentences::sentence_spans;

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
/// in the order of the text. `token_starts` holds the byte offset where each token of `text`
/// starts (see [`token_starts`](super::chunking::token_starts)).
///
/// Each pick is the sentence that adds the most facts not stated by the sentences picked before
/// it, per token; sentences that add none are never picked. The selection thus covers as many
/// distinct names, numbers and dates as the budget holds, each as briefly as the text states
/// it, without repeating them.
pub(crate) fn select_salient_sentences<'t>(
    text: &'t str,
    token_starts: &[usize],
    budget: usize,
) -> Vec<&'t str> {
    struct Candidate<'t> {
        position: usize,
        text: &'t str,
        tokens: usize,
        facts: Vec<Fact>,
    }
    let tokens_in = |span: &std::ops::Range<usize>| {
        token_starts.partition_point(|&start| start < span.end)
            - token_starts.partition_point(|&start| start < span.start)
    };
    let mut candidates: Vec<Candidate> = sentence_spans(text)
        .into_iter()
        .enumerate()
        .map(|(position, span)| Candidate {
            position,
            text: text[span.clone()].trim(),
            tokens: tokens_in(&span).max(1),
            facts: facts_of(&text[span]),
        })
        .filter(|candidate| {
            candidate.text.ends_with(STATEMENT_ENDS)
                && candidate.text.split_whitespace().count() >= MIN_SENTENCE_WORDS
                && !candidate.facts.is_empty()
        })
        .collect();

    // The words of the facts stated so far; a fact is new while any of its words is not.
    let mut covered: HashSet<String> = HashSet::new();
    let mut picked: Vec<(usize, &str)> = Vec::new();
    let mut used = 0;
    loop {
        let gain = |candidate: &Candidate| {
            let new_facts = candidate
                .facts
                .iter()
                .filter(|fact| fact.iter().any(|word| !covered.contains(word)))
                .count();
            new_facts as f64 / candidate.tokens as f64
        };
        let best = candidates
            .iter()
            .enumerate()
            .filter(|(_, candidate)| used + candidate.tokens <= budget)
            .map(|(at, candidate)| (at, gain(candidate), candidate.position))
            .filter(|&(_, gain, _)| gain > 0.0)
            // On a tie, the earlier sentence.
            .max_by(|a, b| a.1.total_cmp(&b.1).then(b.2.cmp(&a.2)));
        let Some((at, _, _)) = best else {
            break;
        };
        let candidate = candidates.swap_remove(at);
        used += candidate.tokens;
        covered.extend(candidate.facts.into_iter().flatten());
        picked.push((candidate.position, candidate.text));
    }
    picked.sort_unstable_by_key(|&(position, _)| position);
    picked.into_iter().map(|(_, sentence)| sentence).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One token per run of non-whitespace.
    fn word_starts(text: &str) -> Vec<usize> {
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

    fn select(text: &str, budget: usize) -> Vec<&str> {
        select_salient_sentences(text, &word_starts(text), budget)
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
}
