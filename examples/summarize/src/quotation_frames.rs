//! Small models asked to rewrite a text often copy it inside a frame: `The original text was:
//! "..."`, `The text is: "..."`. The frame says nothing about the document; the quotation is
//! the answer.

use super::sentences::sentences;

/// The most words a frame has before its colon.
const MAX_FRAME_WORDS: usize = 8;

/// Words by which a frame refers to the text it was given.
const FRAME_WORDS: [&str; 2] = ["text", "sentence"];

const OPENING_QUOTES: [char; 2] = ['"', '\u{201c}'];
const CLOSING_QUOTES: [char; 2] = ['"', '\u{201d}'];

/// `answer` with each framed quotation replaced by what it quotes: the frame, the opening quote
/// and the closing quote (in the same sentence or a later one) removed.
pub(crate) fn unframe_quotations(answer: &str) -> String {
    let mut out = String::with_capacity(answer.len());
    // Inside a quotation whose frame was removed, waiting for its closing quote.
    let mut open = false;
    for sentence in sentences(answer) {
        let mut text = sentence;
        if !open {
            if let Some(quoted) = quoted_after_frame(sentence) {
                text = quoted;
                open = true;
            }
        }
        match text.find(CLOSING_QUOTES).filter(|_| open) {
            Some(at) => {
                let quote_len = text[at..].chars().next().map_or(1, char::len_utf8);
                out.push_str(&text[..at]);
                out.push_str(&text[at + quote_len..]);
                open = false;
            }
            None => out.push_str(text),
        }
    }
    out
}

/// What follows the opening quote, when `sentence` opens with a frame: a few words that refer to
/// the text, a colon, and a quotation.
fn quoted_after_frame(sentence: &str) -> Option<&str> {
    let colon = sentence.find(':')?;
    let frame = &sentence[..colon];
    let after = sentence[colon + 1..].trim_start();
    let quote = after
        .chars()
        .next()
        .filter(|c| OPENING_QUOTES.contains(c))?;
    let words: Vec<String> = frame
        .split(|c: char| !c.is_alphanumeric())
        .filter(|word| !word.is_empty())
        .map(str::to_lowercase)
        .collect();
    let refers_to_text = words
        .iter()
        .any(|word| FRAME_WORDS.contains(&word.as_str()));
    (refers_to_text && words.len() <= MAX_FRAME_WORDS && !frame.contains(OPENING_QUOTES))
        .then(|| &after[quote.len_utf8()..])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_framed_quotation_becomes_what_it_quotes() {
        assert_eq!(
            unframe_quotations(
                "The original text was: \"In all, 1,340 properties were flooded.\" It held."
            ),
            "In all, 1,340 properties were flooded. It held."
        );
        assert_eq!(
            unframe_quotations("The text is: \u{201c}Two. Sentences.\u{201d}"),
            "Two. Sentences."
        );
        // A quotation left open loses its frame and its opening quote only.
        assert_eq!(
            unframe_quotations("The text is: \"After it, the output is added."),
            "After it, the output is added."
        );
    }

    #[test]
    fn other_colons_and_quotations_stay() {
        for answer in [
            "The mayor said: \"We will build it.\"",
            "Costs rose: \"text\" was not the word.",
            "The review of the whole long text, written over many months by the panel, \
             concludes: \"Build it.\"",
            "Two options: the text or the sentence.",
        ] {
            assert_eq!(unframe_quotations(answer), answer);
        }
    }
}
