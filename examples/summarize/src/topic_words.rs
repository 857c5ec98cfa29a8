//! The words a document is about: those that recur in a few of its sentences, but not in most,
//! as common words do. They choose the sentences of a document with few names, numbers and dates.

use std::collections::{HashMap, HashSet};

use super::sentences::sentences;

/// A word is a topic word of a text when it recurs in at least this many of its sentences...
const MIN_TOPIC_SENTENCES: usize = 2;

/// ...but in no more than this share of them, which common words exceed.
const MAX_TOPIC_SHARE: f64 = 0.25;

/// Words shorter than this are rarely what a text is about.
const MIN_TOPIC_WORD_LEN: usize = 4;

/// The words of `text` that may be topic words, lowercase.
pub(crate) fn words_of(text: &str) -> impl Iterator<Item = String> + '_ {
    text.split(|c: char| !c.is_alphabetic())
        .filter(|word| word.chars().count() >= MIN_TOPIC_WORD_LEN)
        .map(str::to_lowercase)
}

/// The topic words of a document: words that recur in a few of its sentences, but not in most,
/// as common words do. Lowercase.
pub(crate) fn topic_words(document: &str) -> HashSet<String> {
    let mut sentence_counts: HashMap<String, usize> = HashMap::new();
    let mut total = 0;
    for sentence in sentences(document) {
        total += 1;
        let words: HashSet<String> = words_of(sentence).collect();
        for word in words {
            *sentence_counts.entry(word).or_insert(0) += 1;
        }
    }
    let most = (MAX_TOPIC_SHARE * total as f64).max(MIN_TOPIC_SENTENCES as f64);
    sentence_counts
        .into_iter()
        .filter(|&(_, count)| count >= MIN_TOPIC_SENTENCES && count as f64 <= most)
        .map(|(word, _)| word)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topic_words_recur_but_not_everywhere() {
        let document = "The barrier holds the tide. The barrier cost money. \
            The tide rose high. The town was dry. The gates are steel.";
        let topic = topic_words(document);
        // "barrier" and "tide" recur in 2 of 5 sentences; "the" is in all, and short.
        let mut words: Vec<&str> = topic.iter().map(String::as_str).collect();
        words.sort_unstable();
        assert_eq!(words, ["barrier", "tide"]);
    }

    #[test]
    fn words_are_lowercase_letters_of_four_or_more() {
        let words: Vec<String> = words_of("Ashdown's 412 gates, by the Tide").collect();
        assert_eq!(words, ["ashdown", "gates", "tide"]);
    }
}
