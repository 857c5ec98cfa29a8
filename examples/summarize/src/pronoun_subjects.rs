//! A sentence whose subject is a pronoun ("He described...", "Its bid was the lowest") leans on
//! the sentence before it for what the pronoun stands for. Taken out of its text it says less
//! than it seems to, or something else, so a summary keeps it only right after that sentence.

use std::ops::Range;

/// Words that may open a sentence before its subject: `But it...`, `However, it...`.
const CONNECTIVES: &[&str] = &[
    "also",
    "and",
    "but",
    "finally",
    "however",
    "instead",
    "later",
    "meanwhile",
    "moreover",
    "nevertheless",
    "now",
    "so",
    "still",
    "then",
    "thus",
    "today",
    "yet",
];

/// Words that open a phrase before the subject, which a comma closes: `In 2019, it...`.
const OPENING_PHRASE_WORDS: &[&str] = &[
    "after", "against", "although", "as", "at", "because", "before", "by", "despite", "during",
    "for", "from", "if", "in", "on", "once", "over", "since", "though", "through", "under",
    "unlike", "until", "when", "while", "with", "within", "without",
];

/// The longest opening phrase looked past, in words (`In a tidal estuary with a complicated and
/// poorly surveyed bed, such claims...`).
const MAX_OPENING_PHRASE_WORDS: usize = 12;

/// Words after which a demonstrative stands alone as the subject (`This is`, `Those who`),
/// rather than before its noun (`This figure`).
const AFTER_DEMONSTRATIVE_PRONOUNS: &[&str] = &[
    "are", "can", "could", "did", "does", "had", "has", "have", "is", "may", "means", "meant",
    "might", "must", "of", "should", "was", "we", "were", "which", "who", "will", "would",
];

/// Words that stand for a noun of the sentence before after `the`, when a verb follows them (`The
/// first was...`, `The latter is...`).
const ELLIPTIC_AFTER_THE: &[&str] = &[
    "fifth", "first", "former", "fourth", "last", "latter", "other", "same", "second", "sixth",
    "third",
];

/// Whether the subject of `sentence` is a pronoun, also after a connective or an opening phrase
/// (`But it...`, `In 2019, it...`), or a word that points back the same way (`Such claims...`,
/// `The fourth is...`). `It` before `is` or `seems` may stand for nothing and counts too: whether
/// it does cannot be told.
pub(crate) fn opens_with_pronoun(sentence: &str) -> bool {
    let words = words(sentence);
    let lower = |i: usize| words.get(i).map(|(_, word)| word.to_lowercase());
    let Some(first) = lower(0) else {
        return false;
    };
    let subject = if CONNECTIVES.contains(&first.as_str()) {
        1
    } else if OPENING_PHRASE_WORDS.contains(&first.as_str()) {
        // The word after the comma that closes the opening phrase.
        let Some(comma) = sentence.find(',') else {
            return false;
        };
        match words.iter().position(|(at, _)| at.start > comma) {
            Some(after) if after <= MAX_OPENING_PHRASE_WORDS => after,
            _ => return false,
        }
    } else {
        0
    };
    let (Some(word), next) = (lower(subject), lower(subject + 1).unwrap_or_default()) else {
        return false;
    };
    match word.as_str() {
        "he" | "his" | "she" | "her" | "it" | "its" | "they" | "their" | "such" => true,
        "this" | "that" | "these" | "those" => {
            AFTER_DEMONSTRATIVE_PRONOUNS.contains(&next.as_str())
        }
        "the" => {
            ELLIPTIC_AFTER_THE.contains(&next.as_str())
                && AFTER_DEMONSTRATIVE_PRONOUNS
                    .contains(&lower(subject + 2).unwrap_or_default().as_str())
        }
        _ => false,
    }
}

/// The words of `text` (runs of letters) and where they are.
fn words(text: &str) -> Vec<(Range<usize>, &str)> {
    let mut found = Vec::new();
    let mut start = None;
    for (at, c) in text.char_indices().chain([(text.len(), ' ')]) {
        match (start, c.is_alphabetic()) {
            (None, true) => start = Some(at),
            (Some(from), false) => {
                found.push((from..at, &text[from..at]));
                start = None;
            }
            _ => {}
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_subject_that_points_back_is_a_pronoun() {
        for sentence in [
            "He described the frustration of watching study after study.",
            "\"Its estimated cost was 118 million euros.",
            "But they disagreed.",
            "In 2019, it opened.",
            "It is worth being clear about what the final figure includes.",
            "This is somewhat more than the figure estimated at the time.",
            "Those who lived through that night describe it in similar terms.",
            "The first was a near miss in January 2007.",
            "In a tidal estuary with a complicated and poorly surveyed bed, such claims were \
             always likely.",
            "Such delays were common.",
        ] {
            assert!(opens_with_pronoun(sentence), "{sentence}");
        }
    }

    #[test]
    fn a_sentence_that_names_its_subject_stands_as_it_is() {
        for sentence in [
            "The barrier opened in 2019.",
            "This figure covered the construction contract itself.",
            "That recommendation led, in 1991, to the creation of the Authority.",
            "In that time we read more than four hundred documents.",
            "Hers was the loudest voice.",
            "The first study was completed in 1994.",
            "The panel heard such claims often.",
            "\"The barrier held,\" she said.",
        ] {
            assert!(!opens_with_pronoun(sentence), "{sentence}");
        }
    }
}
