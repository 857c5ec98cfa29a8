//! A sentence whose subject is a pronoun ("He described...", "Its bid was the lowest") leans on
//! the sentence before it for what the pronoun stands for. A summary takes sentences out of their
//! text, so such a sentence must name it instead, or stay out.
//!
//! The pronoun is replaced only where the sentence before it leaves one reading: it opens with a
//! name as its subject, and the pronoun fits that name (`he` or `she` a person, `it` an
//! institution named with `the`). Anything else would guess, and a wrong guess states something
//! the text does not.

use std::borrow::Cow;
use std::ops::Range;

use super::sentences::sentence_spans;
use super::stray_quotes::without_stray_quotes;

/// What a pronoun in subject position stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Referent {
    /// `he`, `his`.
    Man,
    /// `she`, `her`.
    Woman,
    /// `it`, `its`.
    Thing,
    /// `they`, `their`, demonstratives used alone (`This is...`, `Those who...`) and `such`
    /// before a noun (`Such claims were...`): a group, a kind or a whole statement, never one
    /// name.
    Other,
}

/// A pronoun in subject position.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Pronoun {
    at: Range<usize>,
    referent: Referent,
    /// `his`, `her`, `its`, `their`: the name then takes `'s`.
    possessive: bool,
    /// `it` before a form of "be" or "seem" may stand for nothing ("It is worth noting").
    maybe_empty: bool,
    /// Whether it opens the sentence (so that a name put there keeps its capital).
    opens: bool,
}

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

/// Words after which `it` may be empty: `It is worth...`, `It seems that...`.
const AFTER_EMPTY_IT: &[&str] = &[
    "appears", "appeared", "is", "remains", "remained", "s", "seems", "seemed", "was",
];

/// Titles that open a person's name, and whom they name.
const TITLES: &[(&str, Option<Referent>)] = &[
    ("Mr", Some(Referent::Man)),
    ("Sir", Some(Referent::Man)),
    ("Lord", Some(Referent::Man)),
    ("Mrs", Some(Referent::Woman)),
    ("Ms", Some(Referent::Woman)),
    ("Miss", Some(Referent::Woman)),
    ("Dame", Some(Referent::Woman)),
    ("Lady", Some(Referent::Woman)),
    ("Dr", None),
    ("Professor", None),
];

/// Capitalized words that open a sentence without being a name.
const NOT_NAMES: &[&str] = &[
    "a", "after", "all", "an", "and", "as", "at", "before", "both", "but", "by", "during", "each",
    "for", "from", "he", "her", "his", "if", "in", "it", "its", "many", "most", "no", "of", "on",
    "one", "our", "she", "since", "some", "that", "their", "these", "they", "this", "those", "to",
    "under", "we", "when", "while", "with",
];

/// `sentence` made to stand alone: itself when its subject is no pronoun; with the pronoun
/// replaced by the name that opens `previous` (the sentence before it in its text) when that name
/// is what the pronoun stands for; `None` when what it stands for cannot be told.
pub(crate) fn standalone<'s>(sentence: &'s str, previous: Option<&str>) -> Option<Cow<'s, str>> {
    let Some(pronoun) = pronoun_subject(sentence) else {
        return Some(Cow::Borrowed(sentence));
    };
    let name = previous.and_then(|previous| named_subject(previous, &pronoun))?;
    let name = if pronoun.opens {
        name.to_string()
    } else {
        // "However, the Authority..."
        match name.strip_prefix("The ") {
            Some(rest) => format!("the {rest}"),
            None => name.to_string(),
        }
    };
    let possessive = if pronoun.possessive { "'s" } else { "" };
    Some(Cow::Owned(format!(
        "{}{name}{possessive}{}",
        &sentence[..pronoun.at.start],
        &sentence[pronoun.at.end..]
    )))
}

/// The sentences of `text` (see [`sentence_spans`]), each trimmed, with its quotation marks
/// paired (see [`without_stray_quotes`]) and made to stand alone (see [`standalone`]) after the
/// sentence before it in its paragraph, or `None` where it cannot: one per span, in order.
pub(crate) fn standalone_sentences(text: &str) -> Vec<(Range<usize>, Option<String>)> {
    let mut found = Vec::new();
    // The sentence before, as it stands alone where it does, in the same paragraph.
    let mut previous: Option<String> = None;
    for span in sentence_spans(text) {
        let sentence = &text[span.clone()];
        let tidy = without_stray_quotes(sentence.trim());
        let alone = standalone(&tidy, previous.as_deref()).map(Cow::into_owned);
        previous = (!sentence.ends_with('\n')).then(|| alone.clone().unwrap_or(tidy));
        found.push((span, alone));
    }
    found
}

/// Whether the subject of `sentence` is a pronoun.
pub(crate) fn opens_with_pronoun(sentence: &str) -> bool {
    pronoun_subject(sentence).is_some()
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

/// The pronoun in subject position of `sentence`, if its subject is one.
fn pronoun_subject(sentence: &str) -> Option<Pronoun> {
    let words = words(sentence);
    let lower = |i: usize| words.get(i).map(|(_, word)| word.to_lowercase());
    let first = lower(0)?;
    let subject = if CONNECTIVES.contains(&first.as_str()) {
        1
    } else if OPENING_PHRASE_WORDS.contains(&first.as_str()) {
        // The word after the comma that closes the opening phrase.
        let comma = sentence.find(',')?;
        let after = words.iter().position(|(at, _)| at.start > comma)?;
        if after > MAX_OPENING_PHRASE_WORDS {
            return None;
        }
        after
    } else {
        0
    };
    let word = lower(subject)?;
    let next = lower(subject + 1).unwrap_or_default();
    let (referent, possessive) = match word.as_str() {
        "he" => (Referent::Man, false),
        "his" => (Referent::Man, true),
        "she" => (Referent::Woman, false),
        "her" => (Referent::Woman, true),
        "it" => (Referent::Thing, false),
        "its" => (Referent::Thing, true),
        "they" => (Referent::Other, false),
        "their" => (Referent::Other, true),
        // "Such claims were likely": the claims are in the sentence before.
        "such" => (Referent::Other, false),
        "this" | "that" | "these" | "those"
            if AFTER_DEMONSTRATIVE_PRONOUNS.contains(&next.as_str()) =>
        {
            (Referent::Other, false)
        }
        // "The first was a near miss": the noun is in the sentence before.
        "the"
            if ELLIPTIC_AFTER_THE.contains(&next.as_str())
                && AFTER_DEMONSTRATIVE_PRONOUNS
                    .contains(&lower(subject + 2).unwrap_or_default().as_str()) =>
        {
            (Referent::Other, false)
        }
        _ => return None,
    };
    Some(Pronoun {
        at: words[subject].0.clone(),
        referent,
        possessive,
        maybe_empty: word == "it" && AFTER_EMPTY_IT.contains(&next.as_str()),
        opens: subject == 0,
    })
}

/// The name that opens `previous` as its subject, when `pronoun` can stand for it: a person's
/// name (two capitalized words or more, or a title and a name) for `he` or `she`, with the
/// title's sex where it has one; an institution's (`The` and capitalized words) for `it`.
fn named_subject<'p>(previous: &'p str, pronoun: &Pronoun) -> Option<&'p str> {
    if pronoun.maybe_empty || pronoun.referent == Referent::Other {
        return None;
    }
    let statement = previous.trim_end();
    if !statement.ends_with(['.', '!', '?', '"', '\u{201d}', ')']) {
        // A heading or a fragment.
        return None;
    }
    let words = words(previous);
    let (first_range, first) = words.first()?;
    // The name: the first word and the capitalized words right after it, one space apart.
    let mut end = 1;
    while let Some((range, word)) = words.get(end) {
        let gap = &previous[words[end - 1].0.end..range.start];
        if gap != " " || !word.starts_with(char::is_uppercase) {
            break;
        }
        end += 1;
    }
    let name_range = first_range.start..words[end - 1].0.end;
    // A subject is followed by its verb or set off by a comma, not by `'s` (`The Authority's
    // board`) or a colon.
    let after = &previous[name_range.end..];
    let followed_by_verb = after
        .strip_prefix(' ')
        .is_some_and(|rest| rest.starts_with(char::is_lowercase));
    if !(followed_by_verb || after.starts_with(',')) {
        return None;
    }
    let title = TITLES.iter().find(|(title, _)| title == first);
    let fits = match (pronoun.referent, title) {
        (Referent::Thing, _) => *first == "The" && end >= 2,
        (_, _) if *first == "The" => false,
        (person, Some((_, sex))) => end >= 2 && sex.is_none_or(|sex| sex == person),
        (_, None) => end >= 2 && !NOT_NAMES.contains(&first.to_lowercase().as_str()),
    };
    fits.then(|| &previous[name_range])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alone<'s>(sentence: &'s str, previous: &str) -> Option<Cow<'s, str>> {
        standalone(sentence, Some(previous))
    }

    #[test]
    fn a_pronoun_for_the_name_before_it_becomes_the_name() {
        assert_eq!(
            alone(
                "He described the frustration of watching study after study.",
                "Mr Fairweather gave evidence to the panel at some length. "
            )
            .as_deref(),
            Some("Mr Fairweather described the frustration of watching study after study.")
        );
        assert_eq!(
            alone(
                "She chaired the partnership of councils that put together the bid. ",
                "Elspeth Rainsford, who was mayor of Port Ellery from 2009 to 2021, made the \
                 barrier the first priority of her time in office. "
            )
            .as_deref(),
            Some(
                "Elspeth Rainsford chaired the partnership of councils that put together the bid. "
            )
        );
        assert_eq!(
            alone(
                "Its first study compared three broad options.",
                "The Tarrow Estuary Authority was created in 1991."
            )
            .as_deref(),
            Some("The Tarrow Estuary Authority's first study compared three broad options.")
        );
        assert_eq!(
            alone(
                "However, it kept the harbour open.",
                "The Authority took over the channel in 1991."
            )
            .as_deref(),
            Some("However, the Authority kept the harbour open.")
        );
        assert_eq!(
            alone(
                "In 2019, his workshop reopened.",
                "Professor Dariusz Kowalczyk chaired the panel."
            )
            .as_deref(),
            Some("In 2019, Professor Dariusz Kowalczyk's workshop reopened.")
        );
    }

    #[test]
    fn a_pronoun_that_may_stand_for_something_else_leaves_the_sentence_out() {
        for (sentence, previous) in [
            // `Its` is the contractor's, which is no subject.
            (
                "Its bid was the lowest of the three by a considerable margin.",
                "The contract was awarded in the summer of 2013 to Brackwater Civil Engineering, \
                 a firm with a long record of building harbours.",
            ),
            // A place or a person: `it` takes only a name with `the`.
            (
                "It grew up as a fishing harbour.",
                "Port Ellery stands on the north bank, just inside the mouth.",
            ),
            // The title says whom `he` cannot be.
            (
                "He said the contingency was adequate.",
                "Mrs Rainsford told the panel that she had been criticised.",
            ),
            // `it` before `is` may stand for nothing.
            (
                "It is worth being clear about what the final figure includes.",
                "The Authority approved the final figure.",
            ),
            // A group, or the statement before.
            (
                "They estimated its cost at around one hundred and fifty million.",
                "The Consultants Group reported in 1994.",
            ),
            (
                "This is somewhat more than the figure estimated at the time.",
                "Mr Fairweather gave evidence.",
            ),
            (
                "Those who lived through that night describe it in similar terms.",
                "Mr Fairweather gave evidence.",
            ),
            (
                "The first was a near miss in January 2007.",
                "Two events changed the debate.",
            ),
            (
                "The fourth is a mismatch between the compiler and the driver.",
                "The third is a missing module.",
            ),
            (
                "In a tidal estuary with a complicated and poorly surveyed bed, such claims were \
                 always likely.",
                "Brackwater claimed for unforeseen ground conditions.",
            ),
            ("Such delays were common.", "Mr Fairweather gave evidence."),
            // The sentence before is a heading, or opens with no name.
            ("He chaired the panel.", "## 3. Professor Kowalczyk"),
            ("He chaired the panel.", "In November 1987 the sea came in."),
            (
                "He chaired the panel.",
                "The Authority's board met Mr Ashdown.",
            ),
        ] {
            assert_eq!(alone(sentence, previous), None, "{sentence}");
        }
        assert_eq!(standalone("He chaired the panel.", None), None);
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
            assert_eq!(
                standalone(sentence, None),
                Some(Cow::Borrowed(sentence)),
                "{sentence}"
            );
        }
        assert!(opens_with_pronoun(
            "\"Its estimated cost was 118 million euros."
        ));
        assert!(opens_with_pronoun("But they disagreed."));
    }

    #[test]
    fn each_sentence_of_a_text_stands_alone_after_the_one_before_it() {
        let text = "Mr Fairweather gave evidence. He described the frustration. \"His group met \
            often.\nHe left.\n\nIt held.";
        let alone: Vec<Option<String>> = standalone_sentences(text)
            .into_iter()
            .map(|(_, sentence)| sentence)
            .collect();
        assert_eq!(
            alone,
            [
                Some("Mr Fairweather gave evidence.".to_string()),
                // The name comes through the sentence before, itself made to stand alone.
                Some("Mr Fairweather described the frustration.".to_string()),
                Some("Mr Fairweather's group met often.".to_string()),
                // A line break ends the paragraph, and what a pronoun can lean on.
                None,
                None,
            ]
        );
    }
}
