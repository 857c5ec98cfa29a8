//! Checking a summary against its source: a number or a name the source does not contain was
//! invented by the model, and so is the sentence that states it.

use std::collections::HashSet;

use super::mentions::{mentions, Mention};
use super::sentences::sentences;

/// The numbers and words of a source text, to tell which mentions of a summary it grounds.
///
/// A mention is *ungrounded* (invented) when:
/// - it is a number (see [`Mention::Number`]) that the source does not contain as a number, after
///   group commas are removed: `4,200` matches `4200`, but not `4.2 thousand` or `four thousand
///   two hundred`;
/// - it is a capitalized word inside a sentence that the source does not contain with the same
///   spelling and case: `Halvorsen`, or `Council` where the source only has `council`;
/// - it is a capitalized word opening a sentence that the source does not contain in any case:
///   `The` is grounded by any `the`, an unknown `Meanwhile` is counted.
///
/// The check is conservative: it counts more than invented facts (a capitalized common word the
/// source never uses, a figure the summary computed or rounded), and it misses a fact invented
/// from grounded parts (a real name next to a real figure it does not belong to).
#[derive(Debug, Clone, Default)]
pub struct Grounding {
    numbers: HashSet<String>,
    words: HashSet<String>,
    lowercase_words: HashSet<String>,
}

impl Grounding {
    /// Indexes the numbers and words of `source`.
    pub fn new(source: &str) -> Self {
        let numbers = mentions(source)
            .into_iter()
            .filter_map(|mention| match mention {
                Mention::Number(number) => Some(number),
                Mention::Name { .. } => None,
            })
            .collect();
        let words: HashSet<String> = source
            .split(|c: char| !c.is_alphabetic())
            .filter(|word| !word.is_empty())
            .map(str::to_string)
            .collect();
        let lowercase_words = words.iter().map(|word| word.to_lowercase()).collect();
        Self {
            numbers,
            words,
            lowercase_words,
        }
    }

    /// The grounding of `part`, a part of this source: the numbers and names of an answer about
    /// the part must be in the part, where a model that read only the part found them. A word
    /// opening a sentence is still looked up in the whole source: it is no fact, and a part of
    /// a few sentences lacks too many common words.
    pub fn narrowed_to(&self, part: &str) -> Self {
        let Grounding { numbers, words, .. } = Grounding::new(part);
        Self {
            numbers,
            words,
            lowercase_words: self.lowercase_words.clone(),
        }
    }

    /// Whether the source grounds `mention`.
    pub fn grounds(&self, mention: &Mention) -> bool {
        match mention {
            Mention::Number(number) => self.numbers.contains(number),
            Mention::Name {
                word,
                sentence_start: false,
            } => self.words.contains(word),
            Mention::Name {
                word,
                sentence_start: true,
            } => self.lowercase_words.contains(&word.to_lowercase()),
        }
    }

    /// The mentions of `text` the source does not ground, in order, each once.
    pub fn ungrounded(&self, text: &str) -> Vec<Mention> {
        let mut seen = HashSet::new();
        mentions(text)
            .into_iter()
            .filter(|mention| !self.grounds(mention) && seen.insert(mention.clone()))
            .collect()
    }

    /// `text` without its sentences that state an ungrounded mention, and how many sentences
    /// were dropped. Each kept sentence keeps the whitespace after it, so that a text shown a
    /// few sentences at a time reads the same as the whole text filtered at once.
    pub fn keep_grounded(&self, text: &str) -> (String, usize) {
        let mut kept = String::with_capacity(text.len());
        let mut dropped = 0;
        for sentence in sentences(text) {
            if mentions(sentence)
                .iter()
                .all(|mention| self.grounds(mention))
            {
                kept.push_str(sentence);
            } else {
                dropped += 1;
            }
        }
        (kept, dropped)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SOURCE: &str = "The barrier cost £412 million, against a budget of £286m. \
        It protects 18,600 homes in Port Ellery; the town council paid a share.";

    fn names(mentions: &[Mention]) -> Vec<String> {
        mentions
            .iter()
            .map(|mention| match mention {
                Mention::Number(number) => number.clone(),
                Mention::Name { word, .. } => word.clone(),
            })
            .collect()
    }

    #[test]
    fn numbers_match_in_any_grouping() {
        let grounding = Grounding::new(SOURCE);
        assert!(grounding
            .ungrounded("It cost 412 million and protects 18600 homes.")
            .is_empty());
        assert_eq!(
            names(&grounding.ungrounded("It cost 412,000,000, or 44% over 286.")),
            ["412000000", "44"]
        );
    }

    #[test]
    fn names_inside_a_sentence_must_match_in_case() {
        let grounding = Grounding::new(SOURCE);
        assert!(grounding
            .ungrounded("The barrier protects Port Ellery.")
            .is_empty());
        assert_eq!(
            names(&grounding.ungrounded("Mayor Halvorsen told the Council, twice. Town hall.")),
            ["Mayor", "Halvorsen", "Council"]
        );
    }

    #[test]
    fn a_word_opening_a_sentence_matches_in_any_case() {
        let grounding = Grounding::new(SOURCE);
        assert!(grounding
            .ungrounded("Town council. Homes. It protects.")
            .is_empty());
        // The source never uses the word at all.
        assert_eq!(
            names(&grounding.ungrounded("Meanwhile, it held.")),
            ["Meanwhile"]
        );
    }

    #[test]
    fn a_part_grounds_its_own_facts_and_the_source_its_common_words() {
        let part = Grounding::new(SOURCE).narrowed_to("It protects 18,600 homes in Port Ellery.");
        assert!(part.ungrounded("Port Ellery has 18,600 homes.").is_empty());
        // In the source, but not in the part.
        assert_eq!(names(&part.ungrounded("It cost 412 million.")), ["412"]);
        assert_eq!(
            names(&part.ungrounded("The town council agreed.")),
            Vec::<String>::new()
        );
        assert_eq!(
            names(&part.ungrounded("A Town Council.")),
            ["Town", "Council"]
        );
    }

    #[test]
    fn each_ungrounded_mention_is_listed_once() {
        let grounding = Grounding::new(SOURCE);
        assert_eq!(
            names(&grounding.ungrounded("In 1999 and 1999, Zed met Zed.")),
            ["1999", "Zed"]
        );
    }

    #[test]
    fn keeps_only_grounded_sentences() {
        let grounding = Grounding::new(SOURCE);
        let summary = "The barrier cost £412 million. It was built by Brackwater in 2019. \
            It protects 18,600 homes.\nThe Council paid.";
        assert_eq!(
            grounding.keep_grounded(summary),
            (
                "The barrier cost £412 million. It protects 18,600 homes.\n".to_string(),
                2
            )
        );
        assert_eq!(
            grounding.keep_grounded("Nothing in 1066."),
            (String::new(), 1)
        );
    }
}
