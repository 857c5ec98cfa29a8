//! Cutting text into sentences, for checking and ranking them one by one.

use std::ops::Range;

/// The sentences of `text`, in order: each ends after `.`, `!` or `?` followed by whitespace, or
/// at a line break, and keeps the whitespace after it, so that the pieces joined are the text.
/// A decimal point (`4.2`) ends nothing, as no whitespace follows it.
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
    let mut chars = text.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        let next = chars.peek().map(|&(_, next)| next);
        let ends =
            c == '\n' || (matches!(c, '.' | '!' | '?') && next.is_some_and(char::is_whitespace));
        if !ends {
            continue;
        }
        // The whitespace after the end belongs to this sentence.
        let mut end = i + c.len_utf8();
        while let Some(&(j, w)) = chars.peek() {
            if !w.is_whitespace() {
                break;
            }
            end = j + w.len_utf8();
            chars.next();
        }
        pieces.push(start..end);
        start = end;
    }
    if start < text.len() {
        pieces.push(start..text.len());
    }
    pieces
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
    fn empty_text_has_no_sentences() {
        assert!(sentences("").is_empty());
        assert_eq!(sentences("  "), ["  "]);
    }
}
