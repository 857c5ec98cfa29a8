//! Checking a summary against its source: a number or a name the source does not contain was
//! invented by the model, and so is the sentence that states it. A sentence whose names and
//! numbers are all in the source may still pin them to the wrong things; such a sentence gives
//! way to the source's own sentence about them.

use std::collections::HashSet;

use super::attribution::Attributions;
use super::mentions::{mentions, Mention};
use super::sentences::sentences;

/// A text checked by [`Grounding::keep_grounded`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GroundedText {
    /// The text: its sentences that the source grounds and supports, and the source's sentences
    /// in place of those it grounds but does not support.
    pub text: String,
    /// How many sentences were dropped.
    pub dropped: usize,
    /// How many sentences were replaced by a sentence of the source.
    pub replaced: usize,
}

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
///
/// A grounded sentence is also checked for what it says of its names and numbers: a figure must
/// keep its currency and unit (`£44 million` is not `44 percent`), and the words around a name
/// or number must stand near it in the source.
#[derive(Debug, Clone, Default)]
pub struct Grounding {
    numbers: HashSet<String>,
    words: HashSet<String>,
    lowercase_words: HashSet<String>,
    attributions: Attributions,
    /// The source's sentences, trimmed, to stand in for a sentence that misattributes.
    sentences: Vec<String>,
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
            attributions: Attributions::new(source),
            sentences: sentences(source)
                .into_iter()
                .map(|sentence| sentence.trim().to_string())
                .filter(|sentence| !sentence.is_empty())
                .collect(),
        }
    }

    /// The grounding of `part`, a part of this source: the numbers and names of an answer about
    /// the part must be in the part, where a model that read only the part found them. A word
    /// opening a sentence is still looked up in the whole source: it is no fact, and a part of
    /// a few sentences lacks too many common words.
    pub fn narrowed_to(&self, part: &str) -> Self {
        Self {
            lowercase_words: self.lowercase_words.clone(),
            ..Grounding::new(part)
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

    /// `text` checked sentence by sentence. A sentence that states an ungrounded mention is
    /// dropped. A grounded sentence that the source does not support (see [`Grounding`]) is
    /// replaced by the source's sentence that shares the most names and numbers with it, unless
    /// that one is already in the text; it is dropped when none shares any. Each kept sentence
    /// keeps the whitespace after it (a replacement: one space), so that a text shown a few
    /// sentences at a time reads the same as the whole text checked at once.
    pub fn keep_grounded(&self, text: &str) -> GroundedText {
        let mut checked = GroundedText::default();
        let mut quoted = HashSet::new();
        for sentence in sentences(text) {
            let found = mentions(sentence);
            if !found.iter().all(|mention| self.grounds(mention)) {
                checked.dropped += 1;
            } else if self.attributions.supports(sentence) {
                checked.text.push_str(sentence);
            } else {
                match self.source_sentence_about(&found) {
                    Some(i) if quoted.insert(i) => {
                        checked.text.push_str(&self.sentences[i]);
                        checked.text.push(' ');
                        checked.replaced += 1;
                    }
                    _ => checked.dropped += 1,
                }
            }
        }
        checked
    }

    /// The index of the source sentence that shares the most names and numbers with `found`
    /// (the first of equals), if any shares one.
    fn source_sentence_about(&self, found: &[Mention]) -> Option<usize> {
        let facts: HashSet<&Mention> = found
            .iter()
            .filter(|mention| {
                !matches!(
                    mention,
                    Mention::Name {
                        sentence_start: true,
                        ..
                    }
                )
            })
            .collect();
        self.sentences
            .iter()
            .enumerate()
            .map(|(i, sentence)| {
                let own: HashSet<Mention> = mentions(sentence).into_iter().collect();
                let shared = facts.iter().filter(|fact| own.contains(**fact)).count();
                (shared, std::cmp::Reverse(i))
            })
            .max()
            .filter(|&(shared, _)| shared > 0)
            .map(|(_, std::cmp::Reverse(i))| i)
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
            GroundedText {
                text: "The barrier cost £412 million. It protects 18,600 homes.\n".to_string(),
                dropped: 2,
                replaced: 0,
            }
        );
        assert_eq!(
            grounding.keep_grounded("Nothing in 1066.").text,
            String::new()
        );
    }

    #[test]
    fn a_sentence_that_misattributes_gives_way_to_the_source() {
        let grounding = Grounding::new(SOURCE);
        // 286 is the budget, in pounds: a grounded number, wrongly placed.
        let summary = "It protects 286 homes. The barrier cost £412 million. The Council paid.";
        assert_eq!(
            grounding.keep_grounded(summary),
            GroundedText {
                text: "The barrier cost £412 million, against a budget of £286m. \
                    The barrier cost £412 million. "
                    .to_string(),
                dropped: 1,
                replaced: 1,
            }
        );
    }
}
