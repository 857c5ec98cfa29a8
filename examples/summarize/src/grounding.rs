//! Checking a summary against its source: a number or a name the source does not contain was
//! invented by the model, and so is the sentence that states it. A sentence whose names and
//! numbers are all in the source may still pin them to the wrong things, or lean on a sentence
//! that is not there; such a sentence gives way to the source's own sentence about them.

use std::collections::HashSet;

use super::contract::RewriteContract;
use super::mentions::{mentions, Mention};
use super::pronoun_subjects::opens_with_pronoun;
use super::sentences::{is_definition, opens_with_capital, sentences};
use super::stray_quotes::without_stray_quotes;

/// How a statement ends; a source's headings and fragments stand in for no sentence.
const STATEMENT_ENDS: [char; 6] = ['.', '!', '?', '"', '\u{201d}', ')'];

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
/// A grounded sentence must also keep the rewrite contract (see [`RewriteContract`]): be a
/// sentence of the source or a compression of exactly one, so that it says of its names and
/// numbers what the source says. A sentence whose subject is a pronoun must follow the sentence
/// it leans on.
#[derive(Debug, Clone, Default)]
pub struct Grounding {
    numbers: HashSet<String>,
    words: HashSet<String>,
    lowercase_words: HashSet<String>,
    contract: RewriteContract,
    /// The source's statements that stand alone (their quotation marks paired, their subject no
    /// pronoun), to stand in for a sentence that breaks the contract.
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
            contract: RewriteContract::new(source),
            sentences: sentences(source)
                .into_iter()
                .map(|sentence| without_stray_quotes(sentence.trim()))
                .filter(|sentence| {
                    sentence.ends_with(STATEMENT_ENDS) && !opens_with_pronoun(sentence)
                })
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
    /// dropped. A grounded sentence that the source does not support (see [`Grounding`]), that
    /// opens with no capital letter (a fragment), or whose subject is a pronoun where the
    /// sentence before it was not kept as written, is
    /// replaced by the source's sentence that shares the most names and numbers with it, unless
    /// that one is already in the text; it is dropped when none shares any. Each kept sentence
    /// keeps the whitespace after it (a replacement: one space). [`Grounding::stream`] checks a
    /// text shown a few sentences at a time the same way.
    pub fn keep_grounded(&self, text: &str) -> GroundedText {
        self.stream().push(text)
    }

    /// A check of a text that comes a few whole sentences at a time, such as an answer shown as
    /// it is written: the pieces checked in turn give what [`keep_grounded`](Self::keep_grounded)
    /// gives for the whole text.
    pub fn stream(&self) -> GroundedStream<'_> {
        GroundedStream {
            grounding: self,
            quoted: HashSet::new(),
            previous_kept: false,
        }
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

/// [`Grounding::keep_grounded`] over a text that comes a few whole sentences at a time.
#[derive(Debug)]
pub struct GroundedStream<'g> {
    grounding: &'g Grounding,
    /// The source sentences put in so far, each at most once.
    quoted: HashSet<usize>,
    /// Whether the last sentence was kept as written: a pronoun opening the next one then still
    /// follows what it stands for.
    previous_kept: bool,
}

impl GroundedStream<'_> {
    /// Checks the next whole sentences of the text.
    pub fn push(&mut self, text: &str) -> GroundedText {
        let grounding = self.grounding;
        let mut checked = GroundedText::default();
        for sentence in sentences(text) {
            if sentence.trim().is_empty() {
                checked.text.push_str(sentence);
                continue;
            }
            let found = mentions(sentence);
            let kept = if !found.iter().all(|mention| grounding.grounds(mention)) {
                checked.dropped += 1;
                false
            } else if grounding.contract.holds(sentence)
                && opens_with_capital(sentence)
                && !is_definition(sentence)
                && (self.previous_kept || !opens_with_pronoun(sentence))
            {
                checked.text.push_str(sentence);
                true
            } else {
                match grounding.source_sentence_about(&found) {
                    Some(i) if self.quoted.insert(i) => {
                        checked.text.push_str(&grounding.sentences[i]);
                        checked.text.push(' ');
                        checked.replaced += 1;
                    }
                    _ => checked.dropped += 1,
                }
                false
            };
            self.previous_kept = kept;
        }
        checked
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
        let summary = "The barrier cost £412 million, against a budget of £286m. It protects \
            18,600 homes in Port Ellery. It was built by Brackwater in 2019.\nThe Council paid.";
        assert_eq!(
            grounding.keep_grounded(summary),
            GroundedText {
                text: "The barrier cost £412 million, against a budget of £286m. It protects \
                    18,600 homes in Port Ellery. "
                    .to_string(),
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
    fn a_sentence_that_breaks_the_contract_gives_way_to_the_source() {
        let grounding = Grounding::new(
            "The barrier cost £412 million, against a budget of £286m. The barrier protects \
             18,600 homes in Port Ellery; the town council paid a share.",
        );
        // 286 is the budget, in pounds: a grounded number, wrongly placed; and a clause cut.
        let summary = "The barrier protects 286 homes. The barrier cost £412 million.";
        assert_eq!(
            grounding.keep_grounded(summary),
            GroundedText {
                text: "The barrier cost £412 million, against a budget of £286m. ".to_string(),
                dropped: 1,
                replaced: 1,
            }
        );
        // A clause dropped whole keeps it.
        assert_eq!(
            grounding
                .keep_grounded("The barrier protects 18,600 homes in Port Ellery.")
                .text,
            "The barrier protects 18,600 homes in Port Ellery."
        );
    }

    #[test]
    fn a_pronoun_subject_must_follow_what_it_stands_for() {
        let grounding = Grounding::new(
            "Mr Fairweather gave evidence to the panel in 2021. He described the frustration of \
             the residents of Port Ellery. The barrier opened in 2019 and it has held since.",
        );
        // After the sentence it leans on, as written.
        let paragraph = "Mr Fairweather gave evidence to the panel in 2021. He described the \
            frustration of the residents of Port Ellery.";
        assert_eq!(grounding.keep_grounded(paragraph).text, paragraph);
        // Alone it goes: the source's own sentence leans on the one before it too.
        assert_eq!(
            grounding
                .keep_grounded("He described the frustration of the residents of Port Ellery."),
            GroundedText {
                text: String::new(),
                dropped: 1,
                replaced: 0,
            }
        );
        assert_eq!(
            grounding.keep_grounded("It opened in 2019.").text,
            "The barrier opened in 2019 and it has held since. "
        );
    }

    #[test]
    fn a_splice_of_two_sentences_gives_way_to_one_of_them() {
        let grounding = Grounding::new(
            "Tidewell refunded 0.6 million euros of lease fees to the town in 2021. The town's \
             own share of the works was 1.7 million euros.",
        );
        assert_eq!(
            grounding.keep_grounded(
                "Tidewell refunded 0.6 million euros of lease fees to the town of 1.7 million \
                 euros."
            ),
            GroundedText {
                text: "Tidewell refunded 0.6 million euros of lease fees to the town in 2021. "
                    .to_string(),
                dropped: 0,
                replaced: 1,
            }
        );
    }

    #[test]
    fn a_text_checked_in_pieces_reads_as_checked_at_once() {
        let grounding = Grounding::new(SOURCE);
        let pieces = [
            "The barrier cost £412 million, against a budget of £286m. ",
            "It protects 18,600 homes in Port Ellery. It protects 286 homes. ",
            "It protects Port Ellery. The Council paid.",
        ];
        let mut stream = grounding.stream();
        let streamed: String = pieces.iter().map(|piece| stream.push(piece).text).collect();
        assert_eq!(streamed, grounding.keep_grounded(&pieces.concat()).text);
        // A pronoun opening a piece still follows the sentence kept before it.
        assert!(streamed.starts_with(
            "The barrier cost £412 million, against a budget of £286m. It protects 18,600 homes"
        ));
    }

    #[test]
    fn a_fragment_gives_way_to_the_sentence_it_was_cut_from() {
        let grounding = Grounding::new(
            "The weights are about 0.087 and 0.032. The output is about 0.87 plus 4.74 plus 19.32 \
             plus 1.28, which is roughly 26.2.",
        );
        assert_eq!(
            grounding
                .keep_grounded("19.32 plus 1.28, which is roughly 26.2.")
                .text,
            "The output is about 0.87 plus 4.74 plus 19.32 plus 1.28, which is roughly 26.2. "
        );
    }
}
