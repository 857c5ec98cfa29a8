//! Ending an answer on a whole sentence, as left by a generation that hit its token limit, with
//! each sentence's quotation marks paired: all at once for a finished answer, or piece by piece
//! while it streams, with the same result.

use super::sentences::last_sentence_end;
use super::stray_quotes::tidy_quotes;

/// What a finished sentence ends with.
const SENTENCE_CLOSERS: [char; 5] = ['.', '!', '?', '"', ')'];

/// `text` without a trailing unfinished sentence, as left by a generation that hit its token
/// limit, and without stray quotation marks (see [`tidy_quotes`]), trimmed. Text with no
/// complete sentence at all is kept whole.
pub(crate) fn whole_sentences(text: &str) -> String {
    tidy_quotes(drop_unfinished_sentence(text))
        .trim()
        .to_string()
}

/// `text`, trimmed, without a trailing unfinished sentence. Unlike chunking, a line break ends no
/// sentence here: models copy hard-wrapped lines.
fn drop_unfinished_sentence(text: &str) -> &str {
    let text = text.trim();
    if text.ends_with(SENTENCE_CLOSERS) {
        return text;
    }
    last_sentence_end(text).map_or(text, |end| text[..end].trim_end())
}

/// Passes on a streamed answer a whole sentence at a time, its quotation marks paired, so that an
/// answer cut by the token limit ends on its last whole sentence, as
/// [`MapReduce::finish`](super::MapReduce::finish) returns it: the pieces released, joined, are
/// the finished summary.
#[derive(Debug, Default)]
pub struct WholeSentences {
    /// Text after the last sentence end, held back until the sentence completes.
    pending: String,
    released_text: bool,
}

impl WholeSentences {
    /// Nothing received yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes the next piece of the answer and returns the text it completes, which may be empty.
    pub fn push(&mut self, piece: &str) -> String {
        self.pending.push_str(piece);
        match last_sentence_end(&self.pending) {
            Some(end) => {
                let rest = self.pending.split_off(end);
                let done = std::mem::replace(&mut self.pending, rest);
                self.release(&done)
            }
            None => String::new(),
        }
    }

    /// Ends the answer and returns the rest of it: the held-back tail, unless it is an unfinished
    /// sentence after whole ones.
    pub fn finish(&mut self) -> String {
        let tail = std::mem::take(&mut self.pending);
        let tail = tail.trim_end();
        if !self.released_text || tail.ends_with(SENTENCE_CLOSERS) {
            self.release(tail)
        } else {
            String::new()
        }
    }

    /// Whether any text was released, so the shown answer needs its closing line break.
    pub fn released_text(&self) -> bool {
        self.released_text
    }

    fn release(&mut self, text: &str) -> String {
        let text = tidy_quotes(text);
        // Answers often open with whitespace; skip it, as the finished summary is trimmed too.
        let text = if self.released_text {
            text.as_str()
        } else {
            text.trim_start()
        };
        if !text.is_empty() {
            self.released_text = true;
        }
        text.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Streams `pieces` and returns what was released.
    fn streamed(pieces: &[&str]) -> String {
        let mut sentences = WholeSentences::new();
        let mut shown: String = pieces.iter().map(|piece| sentences.push(piece)).collect();
        shown.push_str(&sentences.finish());
        assert_eq!(sentences.released_text(), !shown.is_empty());
        shown
    }

    #[test]
    fn pairs_the_quotation_marks_of_each_sentence() {
        assert_eq!(
            whole_sentences("\"Its budget was £286 million.\" The mayor said: \"It will hold. Cut"),
            "Its budget was £286 million. The mayor said: \"It will hold.\""
        );
        assert_eq!(
            whole_sentences(" The mayor said: \"It will hold. It is built.\"\n"),
            "The mayor said: \"It will hold.\" It is built."
        );
    }

    #[test]
    fn drops_an_unfinished_last_sentence() {
        assert_eq!(drop_unfinished_sentence("One. Two is cut"), "One.");
        assert_eq!(drop_unfinished_sentence("\n One. Two"), "One.");
        assert_eq!(
            drop_unfinished_sentence("One. Two!\nThree and"),
            "One. Two!"
        );
        assert_eq!(
            drop_unfinished_sentence("Done. Finished.  \n"),
            "Done. Finished."
        );
        assert_eq!(
            drop_unfinished_sentence("no sentence ends here"),
            "no sentence ends here"
        );
    }

    #[test]
    fn releases_text_at_sentence_ends_only() {
        let mut sentences = WholeSentences::new();
        assert_eq!(sentences.push("  One"), "");
        assert!(!sentences.released_text());
        assert_eq!(sentences.push(" two."), "");
        // The sentence end shows once the whitespace after it arrives; leading space is dropped.
        assert_eq!(sentences.push(" Three"), "One two.");
        assert!(sentences.released_text());
        assert_eq!(sentences.push("! Four, and"), " Three!");
        assert_eq!(sentences.finish(), "");
    }

    #[test]
    fn streams_the_same_text_as_the_finished_answer() {
        let answers: [&[&str]; 9] = [
            &[" One. Two", " is cut"],
            &["One. Two!", "\nThree and"],
            &["Done.", " Finished.", "  \n"],
            &["no sentence", " ends here"],
            &["He said \"", "yes.\" Then", " left (quietly)"],
            &["Ends with a quote: \"", "fine\""],
            &["\"Its cost was", " 118 million euros.\" It", " opened."],
            &["She said: \"Yes. ", "No.\" Then", " a cut"],
            &[" \"", "Quoted. Then", " cut"],
        ];
        for pieces in answers {
            assert_eq!(
                streamed(pieces),
                whole_sentences(&pieces.concat()),
                "{pieces:?}"
            );
        }
    }

    #[test]
    fn releases_nothing_for_a_blank_answer() {
        assert_eq!(streamed(&[]), "");
        assert_eq!(streamed(&["  ", "\n"]), "");
    }
}
