//! Whether a sentence says of its names and numbers what its source says of them: a rewrite by
//! a small model keeps every name and figure of its source, yet may pin a figure to the wrong
//! noun ("a budget of £44 million" from "£126 million, or 44 percent of the budget"), a name
//! to the wrong role, or splice two sentences into one that says neither ("refunded 0.6 million
//! euros to the town of 1.7 million euros").

use std::collections::{HashMap, HashSet};

use super::mentions::number_at;

/// Words next to a name or number in a sentence must stand at most this many words from it in
/// a sentence of the source.
const SOURCE_REACH: usize = 10;

/// The words of a sentence checked around each name or number: this many on either side.
const SENTENCE_REACH: usize = 3;

/// A sentence may use a few content words the source sentence it rewrites lacks (a rewrite says
/// `built` where the source says `constructed`), but not more than this share of them: a sentence
/// made of its own words, or of another sentence's, says something its source did not.
const MAX_NEW_WORD_SHARE: f64 = 0.2;

/// Words are compared by their first letters, so that `flooded` matches `floods`.
const STEM_CHARS: usize = 5;

/// Words that say nothing of what a name or number is.
const FUNCTION_WORDS: &[&str] = &[
    "a", "about", "after", "all", "also", "an", "and", "any", "are", "as", "at", "be", "been",
    "before", "between", "both", "but", "by", "can", "could", "did", "do", "during", "each", "for",
    "from", "had", "has", "have", "he", "her", "his", "how", "in", "into", "is", "it", "its",
    "more", "most", "no", "not", "of", "on", "one", "only", "or", "other", "our", "over", "she",
    "so", "some", "such", "than", "that", "the", "their", "them", "then", "there", "these", "they",
    "this", "those", "to", "under", "up", "was", "we", "were", "what", "when", "where", "which",
    "while", "who", "whom", "whose", "will", "with", "would",
];

/// Currency signs that make a number an amount of money.
const CURRENCIES: &[char] = &['£', '$', '€', '¥'];

/// A word of a text, for checking attributions.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Word {
    /// A name or a number, as [`super::Mention`] finds them (a capitalized word opening its
    /// sentence is not one), as written.
    anchor: Option<String>,
    /// The word's first letters, lowercase, unless it is a function word.
    stem: Option<String>,
    /// Which sentence of the text it is in.
    sentence: usize,
}

/// A number with what makes it a quantity: `£44 million` is not `44 percent`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Quantity {
    currency: Option<char>,
    /// The word after it that scales or qualifies it (`million`, `percent`), normalized.
    unit: Option<&'static str>,
}

/// The unit a word after a number gives it, normalized: `m` and `million` are one unit.
fn unit_of(word: &str) -> Option<&'static str> {
    match word.to_lowercase().as_str() {
        "m" | "million" | "millions" | "mn" => Some("million"),
        "bn" | "billion" | "billions" => Some("billion"),
        "k" | "thousand" | "thousands" => Some("thousand"),
        "percent" | "per" | "%" | "pc" => Some("percent"),
        _ => None,
    }
}

/// The words of a text in order, and each number's quantity.
#[derive(Debug, Clone, Default)]
struct Words {
    words: Vec<Word>,
    quantities: Vec<(String, Quantity)>,
}

impl Words {
    fn of(text: &str) -> Self {
        let mut words = Vec::new();
        let mut quantities = Vec::new();
        for (index, sentence) in super::sentences::sentences(text).into_iter().enumerate() {
            let mut first_word = true;
            let mut rest = sentence;
            let mut previous = None;
            while let Some(start) = rest.find(|c: char| c.is_alphanumeric() || c == '%') {
                let before = rest[..start].chars().last().or(previous);
                rest = &rest[start..];
                let Some(first) = rest.chars().next() else {
                    break;
                };
                if first.is_ascii_digit() {
                    let (number, len) = number_at(rest);
                    rest = &rest[len..];
                    // The unit follows at once (`£4.2m`, `44%`) or as the next word.
                    let after = rest.trim_start();
                    let unit_len = after
                        .find(|c: char| !(c.is_alphabetic() || c == '%'))
                        .unwrap_or(after.len());
                    let unit = unit_of(&after[..unit_len]);
                    let currency = before.filter(|c| CURRENCIES.contains(c));
                    quantities.push((number.clone(), Quantity { currency, unit }));
                    words.push(Word {
                        stem: Some(number.clone()),
                        anchor: Some(number),
                        sentence: index,
                    });
                } else if first.is_alphabetic() || first == '%' {
                    let len = rest
                        .find(|c: char| !c.is_alphabetic())
                        .unwrap_or(rest.len())
                        .max(first.len_utf8());
                    let word = &rest[..len];
                    let lower = word.to_lowercase();
                    let anchor = first.is_uppercase() && !first_word && len > 1;
                    // A single letter is a unit (`m`), a symbol or what is left of `'s`.
                    let function =
                        FUNCTION_WORDS.contains(&lower.as_str()) || word.chars().nth(1).is_none();
                    words.push(Word {
                        anchor: anchor.then(|| word.to_string()),
                        stem: (anchor || !function)
                            .then(|| lower.chars().take(STEM_CHARS).collect()),
                        sentence: index,
                    });
                    first_word = false;
                    rest = &rest[len..];
                } else {
                    rest = &rest[first.len_utf8()..];
                }
                previous = None;
            }
        }
        Self { words, quantities }
    }
}

/// A source text indexed to check the attributions of sentences about it.
#[derive(Debug, Clone, Default)]
pub(crate) struct Attributions {
    words: Vec<Word>,
    /// Where each name and number stands in `words`.
    anchors: HashMap<String, Vec<usize>>,
    /// The quantities each number appears as.
    quantities: HashMap<String, Vec<Quantity>>,
    /// The stems of the words of each of its sentences.
    sentence_stems: Vec<HashSet<String>>,
}

impl Attributions {
    pub(crate) fn new(source: &str) -> Self {
        let Words { words, quantities } = Words::of(source);
        let mut anchors: HashMap<String, Vec<usize>> = HashMap::new();
        for (i, word) in words.iter().enumerate() {
            if let Some(anchor) = &word.anchor {
                anchors.entry(anchor.clone()).or_default().push(i);
            }
        }
        let mut by_number: HashMap<String, Vec<Quantity>> = HashMap::new();
        for (number, quantity) in quantities {
            by_number.entry(number).or_default().push(quantity);
        }
        let mut sentence_stems: Vec<HashSet<String>> = Vec::new();
        for word in &words {
            if sentence_stems.len() <= word.sentence {
                sentence_stems.resize_with(word.sentence + 1, HashSet::new);
            }
            if let Some(stem) = &word.stem {
                sentence_stems[word.sentence].insert(stem.clone());
            }
        }
        Self {
            words,
            anchors,
            quantities: by_number,
            sentence_stems,
        }
    }

    /// Whether `sentence` says what the source says:
    /// - one sentence of the source holds its names and numbers and most of its content words;
    /// - a number with a currency or a unit appears in the source with the same ones;
    /// - each content word within a few words of a name or number in the sentence stands within
    ///   a few words of that name or number somewhere in the source.
    ///
    /// A name or number the source lacks is [`super::Grounding`]'s concern; it fails here only
    /// when content words stand near it.
    pub(crate) fn supports(&self, sentence: &str) -> bool {
        let Words { words, quantities } = Words::of(sentence);
        let quantities_hold = quantities.iter().all(|(number, quantity)| {
            let (currency, unit) = (quantity.currency, quantity.unit);
            if currency.is_none() && unit.is_none() {
                return true;
            }
            self.quantities.get(number).is_some_and(|known| {
                known.iter().any(|k| {
                    currency.is_none_or(|c| k.currency == Some(c))
                        && unit.is_none_or(|u| k.unit == Some(u))
                })
            })
        });
        quantities_hold
            && self.one_sentence_holds(&words)
            && words.iter().enumerate().all(|(i, word)| {
                let Some(anchor) = &word.anchor else {
                    return true;
                };
                let near =
                    i.saturating_sub(SENTENCE_REACH)..(i + SENTENCE_REACH + 1).min(words.len());
                // Other names and numbers are checked in their own turn.
                words[near].iter().all(|neighbour| match neighbour {
                    Word {
                        anchor: None,
                        stem: Some(stem),
                        ..
                    } => self.near_in_source(anchor, stem),
                    _ => true,
                })
            })
    }

    /// Whether one sentence of the source holds all the names and numbers of `words` that the
    /// source has, and all but a few of their content words: a sentence that takes them from two
    /// says something neither of them says.
    fn one_sentence_holds(&self, words: &[Word]) -> bool {
        // The sentences that hold every known name and number.
        let mut holding: Option<HashSet<usize>> = None;
        for anchor in words.iter().filter_map(|word| word.anchor.as_ref()) {
            let Some(positions) = self.anchors.get(anchor) else {
                continue;
            };
            let with_it: HashSet<usize> = positions
                .iter()
                .map(|&at| self.words[at].sentence)
                .collect();
            holding = Some(match holding {
                None => with_it,
                Some(holding) => holding.intersection(&with_it).copied().collect(),
            });
        }
        let stems: Vec<&String> = words.iter().filter_map(|word| word.stem.as_ref()).collect();
        if stems.is_empty() {
            return holding.is_none_or(|holding| !holding.is_empty());
        }
        let most_new = MAX_NEW_WORD_SHARE * stems.len() as f64;
        let holds = |sentence: usize| {
            let own = &self.sentence_stems[sentence];
            let new = stems.iter().filter(|stem| !own.contains(**stem)).count();
            new as f64 <= most_new
        };
        match holding {
            Some(holding) => holding.into_iter().any(holds),
            None => (0..self.sentence_stems.len()).any(holds),
        }
    }

    /// Whether a word with `stem` stands near `anchor` anywhere in the source.
    fn near_in_source(&self, anchor: &str, stem: &str) -> bool {
        let Some(positions) = self.anchors.get(anchor) else {
            return false;
        };
        positions.iter().any(|&at| {
            let near =
                at.saturating_sub(SOURCE_REACH)..(at + SOURCE_REACH + 1).min(self.words.len());
            let sentence = self.words[at].sentence;
            self.words[near]
                .iter()
                .any(|word| word.sentence == sentence && word.stem.as_deref() == Some(stem))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SOURCE: &str = "The barrier cost £412 million, against a budget of £286m. \
        The overrun was £126 million, or 44 percent of the approved budget. \
        The loudest voice was Hollis Fairweather, a boatbuilder whose workshop was destroyed \
        in 1987 and whose mother was among the six people who died that night.";

    #[test]
    fn faithful_rewrites_are_supported() {
        let source = Attributions::new(SOURCE);
        for sentence in [
            "The barrier cost £412m against a budget of £286 million.",
            "The overrun was 44% of the budget.",
            "Hollis Fairweather was a boatbuilder whose workshop was destroyed in 1987.",
            "It cost 412 million.",
            // One new word in five.
            "Overall, the barrier cost £412 million.",
        ] {
            assert!(source.supports(sentence), "{sentence}");
        }
    }

    #[test]
    fn a_sentence_of_new_words_is_not() {
        let source = Attributions::new(SOURCE);
        assert!(!source.supports("This sentence contains a grammatical error."));
        assert!(!source.supports("The barrier was cheap and quickly finished."));
    }

    #[test]
    fn a_figure_with_the_wrong_unit_is_not() {
        let source = Attributions::new(SOURCE);
        assert!(!source.supports("The approved budget was £44 million."));
        assert!(!source.supports("The overrun was 126 percent."));
        assert!(!source.supports("It cost $412 million."));
    }

    #[test]
    fn a_name_given_a_role_from_elsewhere_is_not() {
        let source = Attributions::new(SOURCE);
        assert!(!source
            .supports("The mother of the six people killed that night was Hollis Fairweather."));
        assert!(!source.supports("The budget was set by Hollis Fairweather."));
        // Unknown to the source at all.
        assert!(!source.supports("It was built by Ashdown."));
    }

    #[test]
    fn two_sentences_spliced_into_one_are_not() {
        let source = Attributions::new(
            "Tidewell refunded 0.6 million euros of lease fees to the town in 2021. The town's \
             own share of the works was 1.7 million euros.",
        );
        assert!(!source.supports(
            "Tidewell refunded 0.6 million euros of lease fees to the town of 1.7 million euros."
        ));
        // A splice whose second half has no name or number.
        assert!(!source.supports(
            "Tidewell refunded 0.6 million euros of lease fees and the town paid its own share."
        ));
        // Each sentence rewritten alone is.
        assert!(source.supports("Tidewell refunded 0.6 million euros of lease fees in 2021."));
        assert!(source.supports("The town's own share was 1.7 million euros."));
    }
}
