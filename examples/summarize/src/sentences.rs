//! Cutting text into sentences, for checking and ranking them one by one.

use std::ops::Range;

/// What may close a quotation or an aside right after the mark that ends a sentence: the
/// sentence ends after them (`He said "yes." Then...`).
const CLOSERS: [char; 5] = ['"', '\u{201d}', '\u{2019}', ')', ']'];

/// The sentences of `text`, in order: each ends after `.`, `!` or `?` followed by whitespace
/// (with any closing quotes and brackets between them), or at a line break that ends a block
/// (see `line_break_ends_block`), and keeps the whitespace after it, so that the pieces joined
/// are the text. A decimal point (`4.2`) ends nothing, as no whitespace follows it.
pub fn sentences(text: &str) -> Vec<&str> {
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
    // A heading is one piece to its line's end: `## 2. Methods` is no sentence `2.` and another.
    let mut heading_end = 0;
    while let Some(c) = text[at..].chars().next() {
        if at == start && text[at..].starts_with('#') {
            heading_end = text[at..].find('\n').map_or(text.len(), |i| at + i);
        }
        let end = if c == '\n' && line_break_ends_block(text, at) {
            Some(at + 1)
        } else if at < heading_end {
            None
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

/// Whether the line break at byte `at` of `text` ends a block (a paragraph, a heading, a list
/// item, a table row) rather than wrapping a paragraph's text: plain text is often wrapped at
/// about 72 columns, and a line of it is no sentence. A break wraps when both lines hold text
/// and neither is a heading, list item, table row or quotation.
fn line_break_ends_block(text: &str, at: usize) -> bool {
    let before = text[..at].rsplit('\n').next().unwrap_or_default().trim();
    let after = text[at + 1..].split('\n').next().unwrap_or_default().trim();
    let opens_block = |line: &str| {
        let marker = line.split_whitespace().next().unwrap_or_default();
        line.starts_with(['#', '|', '>'])
            || ["-", "*", "+", "\u{2022}"].contains(&marker)
            || (marker.len() > 1
                && marker.ends_with(['.', ')'])
                && marker[..marker.len() - 1]
                    .chars()
                    .all(|c| c.is_ascii_digit()))
    };
    before.is_empty()
        || after.is_empty()
        || opens_block(after)
        || before.starts_with(['#', '|'])
        || before.ends_with('|')
}

/// Marks that end a sentence in scripts written without spaces between sentences (Chinese,
/// Japanese: `。！？`; Devanagari `।`; Arabic `؟` and `۔`): no whitespace need follow them.
const UNSPACED_ENDS: [char; 8] = [
    '\u{3002}', '\u{ff01}', '\u{ff1f}', '\u{ff0e}', '\u{0964}', '\u{061f}', '\u{06d4}', '\u{2026}',
];

/// What may close a quotation or an aside after an unspaced end (`」`, `』`, `）`, `”`).
const UNSPACED_CLOSERS: [char; 6] = [
    '\u{300d}', '\u{300f}', '\u{ff09}', '\u{201d}', '\u{2019}', '"',
];

/// Abbreviations whose full stop ends no sentence (`Dr. Barlow`).
const ABBREVIATIONS: [&str; 14] = [
    "Dr", "Mr", "Mrs", "Ms", "St", "Prof", "No", "vs", "etc", "e.g", "i.e", "Fig", "approx", "cf",
];

/// When the character at byte `at` of `text` ends a sentence, the byte just after it and the
/// closing quotes and brackets that follow it: a `.`, `!` or `?` followed by whitespace (a
/// decimal point and an abbreviation's stop end nothing), or a full stop of a script written
/// without spaces.
pub(crate) fn sentence_end_at(text: &str, at: usize) -> Option<usize> {
    let rest = &text[at..];
    let mark = rest.chars().next()?;
    if UNSPACED_ENDS.contains(&mark) {
        let closed = rest[mark.len_utf8()..]
            .trim_start_matches(|c| UNSPACED_ENDS.contains(&c) || UNSPACED_CLOSERS.contains(&c));
        return Some(text.len() - closed.len());
    }
    if !matches!(mark, '.' | '!' | '?') {
        return None;
    }
    if mark == '.' {
        let word = text[..at]
            .rsplit(|c: char| c.is_whitespace() || c == '(')
            .next()
            .unwrap_or_default();
        if ABBREVIATIONS.contains(&word) {
            return None;
        }
    }
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

/// The length of `text` in words: its runs of non-space characters, each character of a script
/// written without spaces (Chinese, Japanese) counted as a word of its own. Summaries and the
/// baselines they are measured against are held to the same count of these.
pub fn words_in(text: &str) -> usize {
    let cjk = text.chars().filter(|&c| crate::contract::is_cjk(c)).count();
    let spaced = text
        .split(|c: char| c.is_whitespace() || crate::contract::is_cjk(c))
        .filter(|word| word.chars().any(char::is_alphanumeric))
        .count();
    cjk + spaced
}

/// Whether `sentence` opens as a sentence does, with a capital letter (after any opening quote or
/// bracket): a fragment left where a sentence was cut (`19.32 plus 1.28, which is roughly 26.2.`)
/// does not.
pub(crate) fn opens_with_capital(sentence: &str) -> bool {
    // A script without case (Chinese, Arabic, Devanagari) opens with any letter.
    sentence
        .chars()
        .find(|c| c.is_alphanumeric())
        .is_some_and(|c| c.is_uppercase() || (c.is_alphabetic() && !c.is_lowercase()))
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
    fn a_numbered_heading_is_one_piece() {
        assert_eq!(
            sentences(
                "## 2. Methods\n\nWe met. Then left.\n### 2.1 Site: Dr. Lee's farm\nIt rained."
            ),
            [
                "## 2. Methods\n\n",
                "We met. ",
                "Then left.\n",
                "### 2.1 Site: Dr. Lee's farm\n",
                "It rained."
            ]
        );
    }

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
    fn a_wrapped_paragraph_is_cut_at_its_sentence_ends_only() {
        let text = "  The licenses for most works are designed\nto take away your freedom.  By \
            contrast,\nthe License is free.\n\n## Terms\nEach licensee is addressed\n- as you\n\
            1. Definitions\n| a | b |\nLast line";
        assert_eq!(
            sentences(text),
            [
                "  The licenses for most works are designed\nto take away your freedom.  ",
                "By contrast,\nthe License is free.\n\n",
                "## Terms\n",
                "Each licensee is addressed\n",
                "- as you\n",
                // A list number's stop ends a piece, as it always has.
                "1. ",
                "Definitions\n",
                "| a | b |\n",
                "Last line"
            ]
        );
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
    fn unspaced_scripts_end_sentences_at_their_own_marks() {
        let text = "分块注意力把缓存切成多段。每段并行计算！结果呢？「好。」最后合并";
        assert_eq!(
            sentences(text),
            [
                "分块注意力把缓存切成多段。",
                "每段并行计算！",
                "结果呢？",
                "「好。」",
                "最后合并"
            ]
        );
        assert_eq!(
            sentences("यह पहला है। यह दूसरा है।"),
            ["यह पहला है। ", "यह दूसरा है।"]
        );
    }

    #[test]
    fn an_abbreviation_ends_no_sentence() {
        assert_eq!(
            sentences("The critic was Dr. Barlow, e.g. in 2019. Then"),
            ["The critic was Dr. Barlow, e.g. in 2019. ", "Then"]
        );
    }

    #[test]
    fn empty_text_has_no_sentences() {
        assert!(sentences("").is_empty());
        assert_eq!(sentences("  "), ["  "]);
    }
}
