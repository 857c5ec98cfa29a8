//! Four published extractive summarizers, to measure a summary against at the same length: lead
//! (the first sentences), the TF-IDF centroid (the sentences nearest the document's mean
//! vector), TextRank and LexRank (the most central sentences of a graph of them; see
//! [`textrank`] and [`lexrank`]). Each takes sentences in its order of preference until they
//! reach the word count asked for, and returns them in document order.

use std::collections::HashMap;

use super::centrality::{lexrank, terms, textrank};
use super::contract::is_cjk;
use super::sentences::{sentences, words_in};

/// Sentences of this many words or fewer (headings, list markers) are not candidates.
const MAX_FRAGMENT_WORDS: usize = 5;

/// The threshold of LexRank's graph: the cosine at which two sentences are joined, as the
/// published method and its Python package use it.
pub const LEXRANK_THRESHOLD: f64 = 0.1;

/// An extractive baseline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Baseline {
    Lead,
    Centroid,
    TextRank,
    LexRank,
}

impl Baseline {
    pub const ALL: [Baseline; 4] = [
        Baseline::Lead,
        Baseline::Centroid,
        Baseline::TextRank,
        Baseline::LexRank,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Baseline::Lead => "lead",
            Baseline::Centroid => "TF-IDF centroid",
            Baseline::TextRank => "TextRank",
            Baseline::LexRank => "LexRank",
        }
    }

    /// The summary of `document` this baseline writes, of at least `words` words (see
    /// [`words_in`]) where the document has them: whole sentences, in document order.
    pub fn summarize(self, document: &str, words: usize) -> String {
        let candidates = candidate_sentences(document);
        let plain: Vec<Vec<String>> = candidates.iter().map(|s| plain_words(s)).collect();
        let scores: Vec<f64> = match self {
            // Earlier first.
            Baseline::Lead => (0..candidates.len()).map(|i| -(i as f64)).collect(),
            Baseline::Centroid => centroid_scores(&plain),
            Baseline::TextRank => {
                textrank(&candidates.iter().map(|s| terms(s)).collect::<Vec<_>>())
            }
            Baseline::LexRank => lexrank(&plain, Some(LEXRANK_THRESHOLD)),
        };
        let mut order: Vec<usize> = (0..candidates.len()).collect();
        // Stable: equal scores keep document order.
        order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]));
        let mut picked = Vec::new();
        let mut count = 0;
        for i in order {
            if count >= words {
                break;
            }
            picked.push(i);
            count += words_in(&candidates[i]);
        }
        picked.sort_unstable();
        picked
            .into_iter()
            .map(|i| candidates[i].as_str())
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// The sentences of `document` a baseline may take: those of its prose lines (not headings,
/// list items or table rows) with more than `MAX_FRAGMENT_WORDS` words, trimmed.
pub fn candidate_sentences(document: &str) -> Vec<String> {
    let prose: Vec<&str> = document
        .lines()
        .filter(|line| {
            let line = line.trim_start();
            !line.is_empty() && !line.starts_with(['#', '*', '|'])
        })
        .collect();
    sentences(&prose.join(" "))
        .into_iter()
        .map(str::trim)
        .filter(|s| words_in(s) > MAX_FRAGMENT_WORDS)
        .map(str::to_string)
        .collect()
}

/// Words as the reference implementations of the centroid and LexRank baselines count them:
/// lowercase, not stemmed, function words left out; a character of a script written without
/// spaces is a word of its own.
fn plain_words(sentence: &str) -> Vec<String> {
    sentence
        .split(|c: char| !c.is_alphanumeric() || is_cjk(c))
        .chain(sentence.matches(is_cjk))
        .map(str::to_lowercase)
        .filter(|w| !w.is_empty() && !crate::contract::is_function_word(w))
        .collect()
}

/// The cosine of each sentence's TF-IDF vector (raw term counts times the log of the inverse
/// sentence frequency) with the sum of all of them.
fn centroid_scores(sentences: &[Vec<String>]) -> Vec<f64> {
    let n = sentences.len() as f64;
    let mut frequency: HashMap<&str, f64> = HashMap::new();
    for sentence in sentences {
        let mut seen: Vec<&str> = sentence.iter().map(String::as_str).collect();
        seen.sort_unstable();
        seen.dedup();
        for word in seen {
            *frequency.entry(word).or_insert(0.0) += 1.0;
        }
    }
    let vectors: Vec<HashMap<&str, f64>> = sentences
        .iter()
        .map(|sentence| {
            let mut vector: HashMap<&str, f64> = HashMap::new();
            for word in sentence {
                *vector.entry(word).or_insert(0.0) += (n / frequency[word.as_str()]).ln();
            }
            vector
        })
        .collect();
    let mut centroid: HashMap<&str, f64> = HashMap::new();
    for (word, weight) in vectors.iter().flatten() {
        *centroid.entry(word).or_insert(0.0) += weight;
    }
    let norm = |v: &HashMap<&str, f64>| v.values().map(|w| w * w).sum::<f64>().sqrt() + 1e-9;
    let centroid_norm = norm(&centroid);
    vectors
        .iter()
        .map(|v| {
            let dot: f64 = v
                .iter()
                .map(|(w, x)| x * centroid.get(w).unwrap_or(&0.0))
                .sum();
            dot / (norm(v) * centroid_norm)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const DOCUMENT: &str = "# Title\n\nA short anecdote about a dog on a beach one morning. \
        The tidal barrier protects the town from storm surges every winter. \
        The barrier closed against storm surges twice this winter on the estuary. \
        Storm surges flooded the town before the tidal barrier was built.\n\n- a list item here\n";

    #[test]
    fn every_baseline_takes_whole_sentences_up_to_the_word_count() {
        assert_eq!(candidate_sentences(DOCUMENT).len(), 4);
        for baseline in Baseline::ALL {
            let summary = baseline.summarize(DOCUMENT, 10);
            let sentences = candidate_sentences(DOCUMENT);
            assert!(words_in(&summary) >= 10, "{}", baseline.name());
            for sentence in crate::sentences::sentences(&summary) {
                assert!(sentences.contains(&sentence.trim().to_string()));
            }
        }
        assert_eq!(
            Baseline::Lead.summarize(DOCUMENT, 10),
            "A short anecdote about a dog on a beach one morning."
        );
        // TextRank passes the anecdote over.
        assert!(!Baseline::TextRank.summarize(DOCUMENT, 10).contains("dog"));
    }
}
