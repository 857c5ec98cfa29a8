//! Cutting text into sentences, for checking and ranking them one by one.

use std::ops::Range;

/// What may close a quotation or an aside right after the mark that ends a sentence: the
/// sentence ends after them (`He said "yes." Then...`).
const CLOSERS: [char; 5] = ['"', '\u{201d}', '\u{2019}', ')', ']'];

/// The sentences of `text`, in order: each ends after `.`, `!` or `?` followed by whitespace
/// (with any closing quotes and brackets between them), or at a line break, and keeps the
/// whitespace after it, so that the pieces joined are the text. A decimal point (`4.2`) ends
/// nothing, as no whitespace follows it.
pub(crate) fn sentences(text: &str) -> Vec<&str> {
    sentence_spans(text)
        .into_iter()
        .map(|span| &text[span])
        .collect()
}

/// The byte ranges of the [`sentences`] of `text`.
pub(crate) fn sentence_spans(text: &str) -> Vec<Range<usize>> {
    let mut pieces = Vec::new();
    let mut start = 0;
    let mut at = 0;
    while let Some(c) = text[at..].chars().next() {
        let end = if c == '\n' {
            Some(at + 1)
        } else {
            sentence_end_at(text, at)
        };
        let Some(end) = end else {
            at += c.len_utf8();
            continue;
        };
        // The whitespace after the end belongs to this sentence.
        let end = text.len() - text[end..].trim_start().len();
        pieces.push(start..end);
        start = end;
        at = end;
    }
    if start < text.len() {
        pieces.push(start..text.len());
    }
    pieces
}

/// When the character at byte `at` of `text` is a `.`, `!` or `?` that ends a sentence (whitespace
/// follows it, after any closing quotes and brackets), the byte just after those closers.
pub(crate) fn sentence_end_at(text: &str, at: usize) -> Option<usize> {
    let rest = &text[at..];
    let mark = rest
        .chars()
        .next()
        .filter(|c| matches!(c, '.' | '!' | '?'))?;
    let closed = rest[mark.len_utf8()..].trim_start_matches(CLOSERS);
    closed
        .starts_with(char::is_whitespace)
        .then_some(text.len() - closed.len())
}

/// The byte just after the last sentence end of `text` (see [`sentence_end_at`]); a line break is
/// none here.
pub(crate) fn last_sentence_end(text: &str) -> Option<usize> {
    text.char_indices()
        .rev()
        .find_map(|(at, _)| sentence_end_at(text, at))
}

/// Whether `sentence` opens as a sentence does, with a capital letter (after any opening quote or
/// bracket): a fragment left where a sentence was cut (`19.32 plus 1.28, which is roughly 26.2.`)
/// does not.
pub(crate) fn opens_with_capital(sentence: &str) -> bool {
    sentence
        .chars()
        .find(|c| c.is_alphanumeric())
        .is_some_and(char::is_uppercase)
}

/// Whether `sentence` is a glossary entry rather than a statement: a term of at most four words,
/// a colon, and a definition that opens with a lowercase article (`Online softmax: a way to
/// compute...`). It names no subject and states nothing on its own.
pub(crate) fn is_definition(sentence: &str) -> bool {
    let Some((term, definition)) = sentence.trim().split_once(':') else {
        return false;
    };
    let article = definition.split_whitespace().next().unwrap_or_default();
    (1..=4).contains(&term.split_whitespace().count())
        && ["a", "an", "the", "one"].contains(&article)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuts_after_sentence_ends_and_line_breaks() {
        let text = "First one. Second!  Third?\nA heading\n\nCost 4.2 million. End";
        let pieces = sentences(text);
        assert_eq!(
            pieces,
            [
                "First one. ",
                "Second!  ",
                "Third?\n",
                "A heading\n\n",
                "Cost 4.2 million. ",
                "End"
            ]
        );
        assert_eq!(pieces.concat(), text);
    }

    #[test]
    fn a_closing_quote_or_bracket_after_the_end_stays_with_its_sentence() {
        let text = "The mayor said: \"We will build it.\" Work began in 2013. (It was late.) \
            \u{201c}Never again,\u{201d} she said. Done";
        assert_eq!(
            sentences(text),
            [
                "The mayor said: \"We will build it.\" ",
                "Work began in 2013. ",
                "(It was late.) ",
                "\u{201c}Never again,\u{201d} she said. ",
                "Done"
            ]
        );
        assert_eq!(last_sentence_end("Yes.\" No"), Some(5));
        assert_eq!(last_sentence_end("A. B.\""), Some(2));
        assert_eq!(last_sentence_end("no end"), None);
    }

    #[test]
    fn a_fragment_does_not_open_with_a_capital() {
        assert!(opens_with_capital("The output is about 26.2."));
        assert!(opens_with_capital(" \"\u{c9}lodie agreed.\""));
        assert!(!opens_with_capital(
            "19.32 plus 1.28, which is roughly 26.2."
        ));
        assert!(!opens_with_capital("g. the barrier."));
        assert!(!opens_with_capital(""));
    }

    #[test]
    fn a_glossary_entry_is_a_definition() {
        assert!(is_definition(
            "Online softmax: a way to compute softmax in one pass over tiles."
        ));
        assert!(is_definition("KV cache: the stored keys and values."));
        assert!(!is_definition(
            "The feed-forward part follows: another normalization and a gate."
        ));
        assert!(!is_definition(
            "Three habits make a large difference: the first is coalescing."
        ));
        assert!(!is_definition("The barrier opened in 2019."));
    }

    #[test]
    fn empty_text_has_no_sentences() {
        assert!(sentences("").is_empty());
        assert_eq!(sentences("  "), ["  "]);
    }
}
