//! Cutting a long text into chunks of at most a given number of tokens, at natural boundaries.
//!
//! The text is tokenized once; each token's starting byte tells how many tokens any span holds.
//! A chunk ends at the last paragraph break that fits. A paragraph too long for one chunk is cut
//! at a sentence end, a sentence too long at a space, and text without spaces anywhere.

use tokenizers::Tokenizer;

use super::sentences;
use super::SummarizeError;

/// The byte offset where each token of `text` starts, in order.
pub(crate) fn token_starts(
    tokenizer: &Tokenizer,
    text: &str,
) -> Result<Vec<usize>, SummarizeError> {
    let encoding = tokenizer
        .encode(text, false)
        .map_err(SummarizeError::tokenizing("the text"))?;
    // Offsets should already be sorted; the running maximum makes sure, since the search below
    // relies on it. A tokenizer's offsets should also fall on character boundaries of the text;
    // snapping them there keeps a faulty one from making the chunks' slicing fail.
    let mut last = 0;
    Ok(encoding
        .get_offsets()
        .iter()
        .map(|&(start, _)| {
            last = last.max(floor_char_boundary(text, start));
            last
        })
        .collect())
}

/// Splits `text` into trimmed, non-empty chunks of at most `budget` tokens each, where
/// `token_starts` is the output of [`token_starts`] for `text`.
pub(crate) fn split_into_chunks<'t>(
    text: &'t str,
    token_starts: &[usize],
    budget: usize,
) -> Vec<&'t str> {
    let budget = budget.max(1);
    let mut chunks = Vec::new();
    let mut pos = 0;
    loop {
        pos += text[pos..].len() - text[pos..].trim_start().len();
        if pos >= text.len() {
            break;
        }
        let first = token_starts.partition_point(|&start| start < pos);
        let Some(&limit) = token_starts.get(first.saturating_add(budget)) else {
            chunks.push(text[pos..].trim_end());
            break;
        };
        // Several tokens can start at one byte (pieces of one multi-byte character): still move on.
        let limit = if limit > pos {
            limit
        } else {
            next_char_boundary(text, pos)
        };
        let cut = best_cut(text, pos, limit);
        let chunk = text[pos..cut].trim_end();
        if !chunk.is_empty() {
            chunks.push(chunk);
        }
        pos = cut;
    }
    chunks
}

/// Where to end a chunk that starts at `pos` and must end by `limit`: after the last blank line,
/// else after the last sentence, else at the last whitespace, else at `limit`. The first two are
/// only taken in the second half of the span, so that chunks stay reasonably full.
fn best_cut(text: &str, pos: usize, limit: usize) -> usize {
    let span = &text[pos..limit];
    let half = span.len() / 2;
    if let Some(cut) = last_paragraph_break(span).filter(|&cut| cut > half) {
        return pos + cut;
    }
    if let Some(cut) = last_sentence_end(span).filter(|&cut| cut > half) {
        return pos + cut;
    }
    if let Some(cut) = span.rfind(char::is_whitespace).filter(|&cut| cut > 0) {
        return pos + cut;
    }
    limit
}

/// The byte just after the last blank line of `span` (a line holding only whitespace).
fn last_paragraph_break(span: &str) -> Option<usize> {
    let mut line_end = span.len();
    // Walk the lines backwards; `line_end` is the index of the newline that ends the current line.
    while let Some(newline) = span[..line_end].rfind('\n') {
        if line_end < span.len() && span[newline + 1..line_end].trim().is_empty() {
            return Some(line_end + 1);
        }
        line_end = newline;
    }
    None
}

/// The byte just after the last sentence end (see [`sentence_end_at`](sentences::sentence_end_at)) or where the last line
/// break starts.
fn last_sentence_end(span: &str) -> Option<usize> {
    let line_break = span.rfind('\n').filter(|&at| at > 0);
    sentences::last_sentence_end(span).max(line_break)
}

/// The last character boundary of `text` at or before `pos`, or its length when `pos` is past it.
fn floor_char_boundary(text: &str, pos: usize) -> usize {
    if pos >= text.len() {
        return text.len();
    }
    (0..=pos)
        .rev()
        .find(|&i| text.is_char_boundary(i))
        .unwrap_or(0)
}

fn next_char_boundary(text: &str, pos: usize) -> usize {
    (pos + 1..=text.len())
        .find(|&i| text.is_char_boundary(i))
        .unwrap_or(text.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_tokenizer::{word_starts, word_tokenizer};

    fn chunks(text: &str, budget: usize) -> Vec<&str> {
        let chunks = split_into_chunks(text, &word_starts(text), budget);
        for chunk in &chunks {
            assert!(
                word_starts(chunk).len() <= budget,
                "{chunk:?} exceeds {budget} tokens"
            );
            assert!(!chunk.trim().is_empty());
        }
        // Nothing is lost or reordered: only whitespace between chunks goes away.
        let squash = |s: &str| s.split_whitespace().collect::<Vec<_>>().join(" ");
        assert_eq!(squash(&chunks.join(" ")), squash(text));
        chunks
    }

    #[test]
    fn short_text_is_one_chunk() {
        assert_eq!(
            chunks("  One small paragraph.  \n", 50),
            vec!["One small paragraph."]
        );
    }

    #[test]
    fn packs_whole_paragraphs() {
        let text = "a b c d.\n\ne f g h.\n\ni j k l.\n\nm n o p.";
        assert_eq!(
            chunks(text, 9),
            vec!["a b c d.\n\ne f g h.", "i j k l.\n\nm n o p."]
        );
        assert_eq!(chunks(text, 4).len(), 4);
    }

    #[test]
    fn blank_lines_with_spaces_count_as_paragraph_breaks() {
        let text = "a b c d.\n  \t\ne f g h.\r\n\r\ni j k l.";
        assert_eq!(chunks(text, 6), vec!["a b c d.", "e f g h.", "i j k l."]);
    }

    #[test]
    fn a_long_paragraph_is_cut_at_sentences() {
        let text = "One two three. Four five six! Seven eight nine? Ten eleven twelve.";
        assert_eq!(
            chunks(text, 7),
            vec![
                "One two three. Four five six!",
                "Seven eight nine? Ten eleven twelve."
            ]
        );
    }

    #[test]
    fn a_long_sentence_is_cut_at_spaces() {
        let text = "w0 w1 w2 w3 w4 w5 w6 w7 w8 w9";
        assert_eq!(chunks(text, 4), vec!["w0 w1 w2 w3", "w4 w5 w6 w7", "w8 w9"]);
    }

    #[test]
    fn text_without_spaces_is_cut_at_token_boundaries() {
        // No whitespace at all; each token is three two-byte characters.
        let text = "ééé".repeat(10);
        let starts: Vec<usize> = (0..text.len()).step_by(6).collect();
        let chunks = split_into_chunks(&text, &starts, 4);
        assert_eq!(chunks.len(), 3);
        assert_eq!(chunks.concat(), text);
    }

    #[test]
    fn a_small_paragraph_break_early_in_the_chunk_is_not_used() {
        // Cutting after "Title" would leave a one-word chunk; the sentence end is better.
        let text = "Title\n\nAlpha beta gamma delta. Epsilon zeta eta theta.";
        assert_eq!(
            chunks(text, 7),
            vec![
                "Title\n\nAlpha beta gamma delta.",
                "Epsilon zeta eta theta."
            ]
        );
    }

    #[test]
    fn token_starts_are_byte_offsets() {
        let text = "  héllo wörld\n\nagain";
        let starts = token_starts(&word_tokenizer(), text).unwrap();
        assert_eq!(starts, vec![2, 9, 17]);
        assert_eq!(starts, word_starts(text));
    }

    #[test]
    fn offsets_are_snapped_to_character_boundaries() {
        let text = "aé";
        assert_eq!(floor_char_boundary(text, 0), 0);
        assert_eq!(floor_char_boundary(text, 2), 1);
        assert_eq!(floor_char_boundary(text, 3), 3);
        assert_eq!(floor_char_boundary(text, 10), 3);
    }
}
