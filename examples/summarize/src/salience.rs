//! Extractive selection: the sentences that say what a document is about. Each sentence is
//! weighed by how central it is (LexRank), by the names, numbers and dates it states that no
//! sentence picked before it states, and by the document's distinctive terms it is the first to
//! state; sentences of the document's own overview count more, so that its author's summary is
//! heard and an anecdotal opening is not mistaken for the point. The facts and terms count once
//! per summary, so the objective has diminishing returns and is filled greedily by gain per
//! token under the budget. Before the model, it boils a long document down to what a small
//! model can read quickly; it also makes the summary itself where the model does not read the
//! document's language.

use std::collections::{HashMap, HashSet};
use std::ops::Range;

use super::centrality::{cosine, lexrank, terms, tfidf_vectors};
use super::mentions::{mentions, Mention};
use super::model_salience::ModelSalience;
use super::pronoun_subjects::opens_with_pronoun;
use super::sentences::{opens_with_capital, sentence_spans, words_in};
use super::stray_quotes::without_stray_quotes;

/// Fragments shorter than this many words (list markers, captions) are not selected.
const MIN_SENTENCE_WORDS: usize = 6;

/// How a statement ends; headings and titles, whose capitalized words would pass for names,
/// end otherwise.
const STATEMENT_ENDS: [char; 9] = [
    '.', '!', '?', '"', ')', '\u{201d}', '\u{3002}', '\u{ff01}', '\u{ff1f}',
];

/// Integers below this are mostly ordinals and small counts ("section 5", "two options"), rarely
/// the figures a reader needs.
const MIN_SALIENT_INTEGER: u64 = 20;

/// How much a sentence's centrality (1 on average) weighs against one new fact.
const CENTRALITY_WEIGHT: f64 = 0.3;

/// How much more a sentence of the document's own overview (abstract, summary, key findings)
/// weighs.
const OVERVIEW_WEIGHT: f64 = 2.5;

/// How much the distinctive terms a sentence is the first to state (their inverse sentence
/// frequencies summed, 1 for the mean sentence's whole set) weigh against one new fact.
const COVERAGE_WEIGHT: f64 = 0.5;

/// How much a sentence's model salience (1 on average over the scored sentences) weighs against
/// one new fact.
const MODEL_WEIGHT: f64 = 0.3;

/// How much likeness to a sentence already picked takes off (maximal marginal relevance).
const REDUNDANCY_WEIGHT: f64 = 0.7;

/// Headings of a document's own overview, lowercase, in the languages of the evaluation set. A
/// conclusion is not one: it comes after the body and states less of it.
const OVERVIEW_HEADINGS: &[&str] = &[
    "abstract",
    "summary",
    "overview",
    "key findings",
    "executive",
    "resumen",
    "r\u{e9}sum\u{e9}",
    "zusammenfassung",
    "\u{6458}\u{8981}",
    "\u{6982}\u{8981}",
    "\u{603b}\u{7ed3}",
];

/// One fact a sentence states, by the words that identify it: a number, or a name of one or
/// more capitalized words in a row ("Marguerite Ashdown", "Tarrow Estuary Authority"). A name
/// of several words is one fact, as much as a one-word name is.
type Fact = Vec<String>;

/// The facts a sentence states, as selection counts them: numbers other than small integers that
/// are no percentage, and names inside the sentence (any word opening it is capitalized).
fn facts_of(sentence: &str) -> Vec<Fact> {
    let mut facts = Vec::new();
    let mut name: Fact = Vec::new();
    let words: Vec<&str> = sentence.split_whitespace().collect();
    for (position, &word) in words.iter().enumerate() {
        let mut capitalized = false;
        if let Some(number) = decimal_comma(word) {
            facts.push(vec![number]);
            continue;
        }
        for mention in mentions(word) {
            match mention {
                Mention::Number(number) => {
                    let small = number
                        .parse::<u64>()
                        .is_ok_and(|integer| integer < MIN_SALIENT_INTEGER);
                    if !small || is_percentage(word, &words[position + 1..]) {
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

/// Whether the number `word` writes is a percentage, by its sign or the words `following` it
/// (`12%`, `12 per cent`, `12 percent`, `12 por ciento`): a figure, however small.
fn is_percentage(word: &str, following: &[&str]) -> bool {
    let next = |i: usize| following.get(i).map_or(String::new(), |w| w.to_lowercase());
    word.contains('%')
        || next(0).starts_with("percent")
        || (["per", "por"].contains(&next(0).as_str())
            && (next(1).starts_with("cent") || next(1).starts_with("ciento")))
}

/// The number a word writes with a decimal comma (`3,2` and `48,7` in most European languages),
/// with a decimal point; `None` for any other word. At most two digits follow the comma, since
/// three are a group of thousands (`4,200`).
fn decimal_comma(word: &str) -> Option<String> {
    let word = word.trim_end_matches(|c: char| c.is_ascii_punctuation() || c == '%');
    let (whole, fraction) = word.split_once(',')?;
    let digits = |part: &str| !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit());
    (digits(whole) && digits(fraction) && fraction.len() <= 2)
        .then(|| format!("{whole}.{fraction}"))
}

/// A sentence that may be picked, with what it is weighed by.
struct Candidate {
    position: usize,
    text: String,
    tokens: usize,
    overview: bool,
    facts: Vec<Fact>,
    centrality: f64,
    /// The model's salience of the sentence over its mean, 0 without one.
    model: f64,
}

/// A picked sentence.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Picked {
    /// Its place among the sentences of the text.
    pub position: usize,
    /// The sentence, trimmed, its quotation marks paired.
    pub text: String,
    /// Its tokens in the text.
    pub tokens: usize,
}

/// The sentences of `text` that may stand in a summary, with whether the section each is in is
/// the document's overview; with a model's salience, only the sentences
/// it scores.
fn candidates(text: &str, token_starts: &[usize], model: Option<&ModelSalience>) -> Vec<Candidate> {
    let tokens_in = |span: &Range<usize>| {
        token_starts.partition_point(|&start| start < span.end)
            - token_starts.partition_point(|&start| start < span.start)
    };
    let mut overview = false;
    let mut found = Vec::new();
    for (position, span) in sentence_spans(text).into_iter().enumerate() {
        let raw = text[span.clone()].trim();
        if let Some(heading) = raw.strip_prefix('#') {
            let heading = heading.trim_start_matches('#').trim().to_lowercase();
            overview = OVERVIEW_HEADINGS.iter().any(|h| heading.contains(h));
            continue;
        }
        // A sentence wrapped over several lines reads as one line.
        let sentence = without_stray_quotes(&raw.split_whitespace().collect::<Vec<_>>().join(" "));
        let statement = sentence.ends_with(STATEMENT_ENDS)
            && opens_with_capital(&sentence)
            // A sentence whose subject is a pronoun leans on the one before it.
            && !opens_with_pronoun(&sentence)
            && words_in(&sentence) >= MIN_SENTENCE_WORDS;
        if statement {
            found.push(Candidate {
                position,
                tokens: tokens_in(&span).max(1),
                overview,
                facts: facts_of(&sentence),
                centrality: 0.0,
                model: 0.0,
                text: sentence,
            });
        }
    }
    let terms: Vec<Vec<String>> = found.iter().map(|c| terms(&c.text)).collect();
    let scores = lexrank(&terms, None);
    let mean = 1.0 / scores.len().max(1) as f64;
    for (candidate, score) in found.iter_mut().zip(scores) {
        candidate.centrality = score / mean;
    }
    // Centrality is the whole document's; the model's salience narrows the candidates after it.
    if let Some(model) = model.filter(|m| !m.is_empty()) {
        found.retain(|c| model.score(c.position).is_some());
        let scores: Vec<f64> = found
            .iter()
            .filter_map(|c| model.score(c.position))
            .collect();
        let mean = scores.iter().sum::<f64>() / scores.len().max(1) as f64;
        for (candidate, score) in found.iter_mut().zip(scores) {
            candidate.model = score / mean;
        }
    }
    found
}

/// Picks sentences of `text` whose tokens add up to at most `budget`, most salient first.
/// `token_starts` holds the byte offset where each token of `text` starts (see
/// [`token_starts`](super::chunking::token_starts)).
///
/// Each pick is the sentence with the most weight per token: its centrality and its `model`
/// salience (where given, among the sentences it scores only), plus the names and numbers and
/// the distinctive terms it states that no picked sentence states, times the overview's weight
/// where it stands in the document's overview, less its likeness to the sentences picked.
pub(crate) fn rank_salient_sentences(
    text: &str,
    token_starts: &[usize],
    budget: usize,
    model: Option<&ModelSalience>,
) -> Vec<Picked> {
    let mut candidates = candidates(text, token_starts, model);
    let sentence_terms: Vec<Vec<String>> = candidates.iter().map(|c| terms(&c.text)).collect();
    let vectors = tfidf_vectors(&sentence_terms);
    let distinct_terms: Vec<Vec<&str>> = sentence_terms
        .iter()
        .map(|terms| {
            let mut distinct: Vec<&str> = terms.iter().map(String::as_str).collect();
            distinct.sort_unstable();
            distinct.dedup();
            distinct
        })
        .collect();
    let term_weights = distinctive_term_weights(&distinct_terms);
    let mut covered: HashSet<&Fact> = HashSet::new();
    let mut covered_terms: HashSet<&str> = HashSet::new();
    let mut likeness = vec![0.0f64; candidates.len()];
    let mut taken = vec![false; candidates.len()];
    let mut used = 0;
    let mut order = Vec::new();
    loop {
        let best = (0..candidates.len())
            .filter(|&i| !taken[i] && used + candidates[i].tokens <= budget)
            .map(|i| {
                let c = &candidates[i];
                let new_facts = c
                    .facts
                    .iter()
                    .filter(|fact| !covered.contains(fact))
                    .count() as f64;
                let new_terms: f64 = distinct_terms[i]
                    .iter()
                    .filter(|term| !covered_terms.contains(*term))
                    .map(|term| term_weights.get(term).copied().unwrap_or(0.0))
                    .sum();
                // The document's own overview is its author's summary.
                let overview = if c.overview { OVERVIEW_WEIGHT } else { 1.0 };
                let weight = (CENTRALITY_WEIGHT * c.centrality
                    + MODEL_WEIGHT * c.model
                    + new_facts
                    + COVERAGE_WEIGHT * new_terms)
                    * overview
                    * (1.0 - REDUNDANCY_WEIGHT * likeness[i]).max(0.0);
                (i, weight / c.tokens as f64)
            })
            .filter(|&(_, gain)| gain > 0.0)
            // On a tie, the earlier sentence.
            .max_by(|a, b| a.1.total_cmp(&b.1).then(b.0.cmp(&a.0)));
        let Some((i, _)) = best else {
            break;
        };
        taken[i] = true;
        used += candidates[i].tokens;
        covered.extend(candidates[i].facts.iter());
        covered_terms.extend(distinct_terms[i].iter().copied());
        for (j, like) in likeness.iter_mut().enumerate() {
            *like = like.max(cosine(&vectors[i], &vectors[j]));
        }
        order.push(i);
    }
    let picked: Vec<Picked> = order
        .into_iter()
        .map(|i| Picked {
            position: candidates[i].position,
            text: std::mem::take(&mut candidates[i].text),
            tokens: candidates[i].tokens,
        })
        .collect();
    picked
}

/// The weight of each term of `sentences` (each a list of distinct terms): its inverse sentence
/// frequency, `ln(n / df)`, so that a term few sentences state (a specific) counts more than one
/// most of them state; scaled so that the mean sentence's terms add up to 1.
fn distinctive_term_weights<'a>(sentences: &[Vec<&'a str>]) -> HashMap<&'a str, f64> {
    let mut frequency: HashMap<&str, f64> = HashMap::new();
    for terms in sentences {
        for &term in terms {
            *frequency.entry(term).or_insert(0.0) += 1.0;
        }
    }
    let n = sentences.len().max(1) as f64;
    let mut weights: HashMap<&str, f64> = frequency
        .into_iter()
        .map(|(term, df)| (term, (n / df).ln()))
        .collect();
    let mean_sentence = sentences
        .iter()
        .map(|terms| {
            terms
                .iter()
                .filter_map(|term| weights.get(term))
                .sum::<f64>()
        })
        .sum::<f64>()
        / n;
    if mean_sentence > 0.0 {
        weights.values_mut().for_each(|w| *w /= mean_sentence);
    }
    weights
}

/// The sentences [`rank_salient_sentences`] picks, in the order of the text.
pub(crate) fn select_salient_sentences(
    text: &str,
    token_starts: &[usize],
    budget: usize,
    model: Option<&ModelSalience>,
) -> Vec<String> {
    let mut picked = rank_salient_sentences(text, token_starts, budget, model);
    picked.sort_unstable_by_key(|p| p.position);
    picked.into_iter().map(|p| p.text).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_tokenizer::word_starts;

    fn select(text: &str, budget: usize) -> Vec<String> {
        select_salient_sentences(text, &word_starts(text), budget, None)
    }

    #[test]
    fn picks_the_sentences_with_the_most_new_facts_in_text_order() {
        let text = "The weather was mild and nothing much happened all week. \
            The barrier cost 412 million and opened in 2019 at Port Ellery. \
            The barrier was opened in 2019 by the mayor of the town. \
            Marguerite Ashdown led the design team from the first drawing.";
        // Room for the two sentences with new facts; the third only repeats 2019.
        assert_eq!(
            select(text, 24),
            [
                "The barrier cost 412 million and opened in 2019 at Port Ellery.",
                "Marguerite Ashdown led the design team from the first drawing."
            ]
        );
    }

    #[test]
    fn a_decimal_comma_writes_one_number() {
        assert_eq!(decimal_comma("3,2"), Some("3.2".to_string()));
        assert_eq!(decimal_comma("48,75%,"), Some("48.75".to_string()));
        // Three digits after a comma are a group of thousands.
        assert_eq!(decimal_comma("4,200"), None);
        assert_eq!(decimal_comma("a,b"), None);
        assert_eq!(decimal_comma(",5"), None);
        // A small percentage is a figure; a small count or ordinal is not.
        assert_eq!(
            facts_of("In section 5, 12 per cent and 7% of the 3 sites fell."),
            [vec!["12".to_string()], vec!["7".to_string()]]
        );
        assert_eq!(
            facts_of("Two of the 3 sites fell by 4 percentage points."),
            [vec!["4".to_string()]]
        );
        // A small decimal is a fact; the integers each side of the comma alone would not be.
        assert_eq!(
            facts_of("La tasa de agua sube un 3,2 por ciento."),
            [vec!["3.2".to_string()]]
        );
    }

    #[test]
    fn rarer_terms_weigh_more_and_the_mean_sentence_weighs_one() {
        let sentences = vec![
            vec!["barrier", "gates"],
            vec!["barrier", "cost"],
            vec!["barrier", "gates", "ashdown"],
            vec!["barrier"],
        ];
        let weights = distinctive_term_weights(&sentences);
        // A term every sentence states tells none apart.
        assert_eq!(weights["barrier"], 0.0);
        assert!(weights["ashdown"] > weights["gates"]);
        assert_eq!(weights["ashdown"], weights["cost"]);
        let mean: f64 = sentences
            .iter()
            .map(|terms| terms.iter().map(|t| weights[t]).sum::<f64>())
            .sum::<f64>()
            / sentences.len() as f64;
        assert!((mean - 1.0).abs() < 1e-12, "{mean}");
        assert!(distinctive_term_weights(&[]).is_empty());
    }

    #[test]
    fn a_sentence_of_new_terms_comes_before_one_of_terms_already_stated() {
        // No names or numbers: the second pick is the sentence that adds what the first did
        // not say, not the one that says it again in other order.
        let text = "The estuary barrier closes against storm surges at high tide. \
            The barrier closes at high tide against storm surges on the estuary. \
            Engineers inspect the hinges and seals every spring after the floods.";
        let picked = rank_salient_sentences(text, &word_starts(text), 24, None);
        let positions: Vec<usize> = picked.iter().map(|p| p.position).collect();
        assert_eq!(positions.len(), 2);
        assert!(positions.contains(&2), "{positions:?}");
    }

    #[test]
    fn stops_at_the_budget() {
        let text = "Alpha met Beta in the big hall today. Delta came on the 23rd of May too.";
        assert_eq!(select(text, 9), ["Delta came on the 23rd of May too."]);
        assert!(select(text, 5).is_empty());
    }

    #[test]
    fn headings_fragments_and_leaning_sentences_are_not_picked() {
        let text = "## 5. Design\n\nSection 5 has gates.\n\n\
            The Tarrow Estuary Tidal Barrier: Report of the Review Panel\n\n\
            He said the group met 1,340 households in 1988.";
        assert!(select(text, 100).is_empty());
    }

    #[test]
    fn the_overview_and_central_sentences_come_before_an_anecdote() {
        let text = "A woman remembers the morning the water came up her street in a rush. \
            Her neighbour carried a cat across the road in a laundry basket.\n\n\
            ## Summary\n\nThe barrier protects the estuary towns from storm surges.\n\n\
            ## Design\n\nThe barrier closes against storm surges at high tide on the estuary. \
            Storm surges on the estuary have grown since the towns were built.";
        let picked = rank_salient_sentences(text, &word_starts(text), 200, None);
        assert_eq!(
            picked[0].text,
            "The barrier protects the estuary towns from storm surges."
        );
        assert_eq!(picked.len(), 4);
    }

    #[test]
    fn a_model_salience_narrows_the_candidates_and_weighs_in() {
        let text = "The estuary barrier was built between the two river towns. \
            The estuary barrier closes when the river towns expect a surge. \
            The estuary barrier is inspected by the river towns every spring.";
        let starts = word_starts(text);
        let alone = rank_salient_sentences(text, &starts, 200, None);
        assert_eq!(alone.len(), 3);
        // The model scores the second and third only, the third far above the second.
        let model = ModelSalience::new([(1, 1.0), (2, 30.0)]);
        let picked = rank_salient_sentences(text, &starts, 200, Some(&model));
        let positions: Vec<usize> = picked.iter().map(|p| p.position).collect();
        assert_eq!(positions, [2, 1]);
        // Scores of nothing leave selection to the text.
        let empty = ModelSalience::new([]);
        assert_eq!(
            rank_salient_sentences(text, &starts, 200, Some(&empty)),
            alone
        );
    }
}
