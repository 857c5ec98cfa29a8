//! Quotation marks that pair with nothing. A sentence cut out of a quotation of several sentences
//! keeps its half of the pair (`"We will build it.` or `It will hold."`), and a small model often
//! puts its rewrite in quotation marks, or opens them and never closes them. A summary's sentence
//! keeps the quotations it makes and no other marks.

use super::sentences::sentences;

/// Marks that open a quotation; a straight `"` opens one where it starts a word.
const OPENING: char = '\u{201c}';
/// Marks that close a quotation; a straight `"` closes one where it ends a word.
const CLOSING: char = '\u{201d}';
const STRAIGHT: char = '"';

/// `text` with [`without_stray_quotes`] applied to each of its sentences.
pub(crate) fn tidy_quotes(text: &str) -> String {
    sentences(text)
        .into_iter()
        .map(without_stray_quotes)
        .collect()
}

/// `sentence` with its quotation marks paired: a pair that encloses the whole sentence (a quoted
/// rewrite) and a closing mark that closes nothing are removed; an opening mark never closed is
/// removed where it opens the sentence, and closed at the sentence's end otherwise (the
/// quotation runs on into the next sentence of its text). Single quotes are left alone, as they
/// are also apostrophes. Whitespace around the sentence is kept.
pub(crate) fn without_stray_quotes(sentence: &str) -> String {
    let body = sentence.trim();
    let lead = &sentence[..sentence.len() - sentence.trim_start().len()];
    let trail = &sentence[lead.len() + body.len()..];

    let marks: Vec<(usize, char)> = body
        .char_indices()
        .filter(|&(_, c)| matches!(c, STRAIGHT | OPENING | CLOSING))
        .collect();
    if marks.is_empty() {
        return sentence.to_string();
    }
    // Pair the marks like brackets; what pairs with nothing is stray.
    let mut open: Vec<usize> = Vec::new();
    let mut pairs: Vec<(usize, usize)> = Vec::new();
    let mut stray_closing: Vec<usize> = Vec::new();
    for &(at, mark) in &marks {
        if opens(body, at, mark) {
            open.push(at);
        } else if let Some(start) = open.pop() {
            pairs.push((start, at));
        } else {
            stray_closing.push(at);
        }
    }
    let mut remove: Vec<usize> = stray_closing;
    let mut close_at_end = false;
    for &at in &open {
        if at == 0 {
            remove.push(at);
        } else {
            close_at_end = true;
        }
    }
    // A pair around the whole sentence, its final mark inside or outside: `"It held."`,
    // `"It held".`
    if let Some(&(start, end)) = pairs.iter().find(|&&(start, _)| start == 0) {
        let after = &body[end + body[end..].chars().next().map_or(1, char::len_utf8)..];
        if after.chars().all(|c| matches!(c, '.' | '!' | '?')) {
            remove.extend([start, end]);
        }
    }

    let mut tidy = String::with_capacity(sentence.len() + 3);
    tidy.push_str(lead);
    let mut kept = String::with_capacity(body.len());
    for (at, c) in body.char_indices() {
        if !remove.contains(&at) {
            kept.push(c);
        }
    }
    tidy.push_str(kept.trim());
    if close_at_end {
        tidy.push(STRAIGHT);
    }
    tidy.push_str(trail);
    tidy
}

/// Whether the mark at byte `at` of `text` opens a quotation: a curly opening mark does, and a
/// straight one that starts a word (after whitespace, an opening bracket or a dash, or at the start).
fn opens(text: &str, at: usize, mark: char) -> bool {
    match mark {
        OPENING => true,
        CLOSING => false,
        _ => text[..at].chars().next_back().is_none_or(|before| {
            before.is_whitespace() || matches!(before, '(' | '[' | '-' | '\u{2014}' | ':')
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sentence_cut_from_a_quotation_loses_its_stray_mark() {
        // The head of a quotation of two sentences: the quotation is closed at its end.
        assert_eq!(
            without_stray_quotes(
                "Mrs Rainsford said: \"We were assured the contingency was adequate. "
            ),
            "Mrs Rainsford said: \"We were assured the contingency was adequate.\" "
        );
        // Its tail: the closing mark closes nothing.
        assert_eq!(
            without_stray_quotes("It would not be enough.\" "),
            "It would not be enough. "
        );
        // A rewrite that opens a quotation and never closes it.
        assert_eq!(
            without_stray_quotes("\"Its estimated cost was 118 million euros."),
            "Its estimated cost was 118 million euros."
        );
        assert_eq!(
            without_stray_quotes("\u{201c}The barrier opened in 2019."),
            "The barrier opened in 2019."
        );
    }

    #[test]
    fn a_quoted_rewrite_is_unquoted() {
        for quoted in [
            "\"The barrier cost £412 million.\"",
            "\"The barrier cost £412 million\".",
            "\u{201c}The barrier cost £412 million.\u{201d}",
        ] {
            assert_eq!(
                without_stray_quotes(quoted),
                "The barrier cost £412 million.",
                "{quoted}"
            );
        }
    }

    #[test]
    fn quotations_a_sentence_makes_stay() {
        for sentence in [
            "The mayor called the barrier \"a triumph of patience\". ",
            "\"We will build it,\" said the mayor, \"and it will hold.\"",
            "Residents called it \u{201c}the wall\u{201d} from the first day.",
            "The Authority's board, the town's council and Ms O'Neill agreed.",
            "No quotation here.\n",
        ] {
            assert_eq!(without_stray_quotes(sentence), sentence);
        }
    }

    #[test]
    fn a_closing_mark_after_a_comma_pairs_with_the_next_opening_one() {
        // A straight mark after a word closes; only the one that closes nothing goes.
        assert_eq!(
            without_stray_quotes("safe,\" he said, \"and dry.\""),
            "safe, he said, \"and dry.\""
        );
    }

    #[test]
    fn every_sentence_of_a_text_is_tidied() {
        assert_eq!(
            tidy_quotes(
                "\"Port Ellery flooded in 1987. The barrier opened in 2019.\" It cost \
                 £412 million."
            ),
            "Port Ellery flooded in 1987. The barrier opened in 2019. It cost £412 million."
        );
    }
}
