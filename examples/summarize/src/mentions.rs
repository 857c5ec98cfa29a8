//! The numbers and names a text states: what a summary must not get wrong.

use super::sentences::sentences;

/// A number or a name found in a text.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Mention {
    /// A run of digits with its decimal point, group commas removed: `4,200` is `4200`, `£4.2m`
    /// is `4.2`, `2nd` is `2`. Numbers written in words are not numbers here.
    Number(String),
    /// A word of two letters or more that starts with a capital, as written.
    Name {
        /// The word.
        word: String,
        /// Whether it opens its sentence, where any word is capitalized.
        sentence_start: bool,
    },
}

/// The numbers and names of `text`, in order. Words are runs of letters: `Ashdown's` holds the
/// name `Ashdown`, `Port-Ellery` the names `Port` and `Ellery`.
pub(crate) fn mentions(text: &str) -> Vec<Mention> {
    let mut found = Vec::new();
    for sentence in sentences(text) {
        let mut first_word = true;
        let mut rest = sentence;
        while let Some(start) = rest.find(|c: char| c.is_alphanumeric()) {
            rest = &rest[start..];
            let Some(first) = rest.chars().next() else {
                break;
            };
            if first.is_ascii_digit() {
                let (number, len) = number_at(rest);
                found.push(Mention::Number(number));
                rest = &rest[len..];
            } else if first.is_alphabetic() {
                let len = rest
                    .find(|c: char| !c.is_alphabetic())
                    .unwrap_or(rest.len());
                let word = &rest[..len];
                if first.is_uppercase() && word.chars().nth(1).is_some() {
                    found.push(Mention::Name {
                        word: word.to_string(),
                        sentence_start: first_word,
                    });
                }
                first_word = false;
                rest = &rest[len..];
            } else {
                // Other alphanumerics (digits of other scripts) are neither.
                rest = &rest[first.len_utf8()..];
            }
        }
    }
    found
}

/// The number that starts `text` (an ASCII digit) with group commas removed, and its length in
/// bytes. A comma is a group separator when exactly three digits follow it; a point is a
/// decimal point when a digit follows it.
pub(crate) fn number_at(text: &str) -> (String, usize) {
    let bytes = text.as_bytes();
    let digit = |i: usize| bytes.get(i).is_some_and(u8::is_ascii_digit);
    let mut number = String::new();
    let mut i = 0;
    let mut seen_point = false;
    loop {
        if digit(i) {
            number.push(char::from(bytes[i]));
            i += 1;
        } else if bytes.get(i) == Some(&b',') && (1..=3).all(|k| digit(i + k)) && !digit(i + 4) {
            i += 1;
        } else if bytes.get(i) == Some(&b'.') && !seen_point && digit(i + 1) {
            number.push('.');
            seen_point = true;
            i += 1;
        } else {
            break;
        }
    }
    (number, i)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn number(s: &str) -> Mention {
        Mention::Number(s.to_string())
    }

    fn name(word: &str, sentence_start: bool) -> Mention {
        Mention::Name {
            word: word.to_string(),
            sentence_start,
        }
    }

    #[test]
    fn finds_numbers_in_their_written_forms() {
        assert_eq!(
            mentions("paid £4,200,000 or £4.2m on the 2nd, 18,600 homes, 1987."),
            [
                number("4200000"),
                number("4.2"),
                number("2"),
                number("18600"),
                number("1987")
            ]
        );
        // A comma before other than three digits, and a point before no digit, end a number.
        assert_eq!(
            mentions("1,2 and 3,4567 and 5."),
            [
                number("1"),
                number("2"),
                number("3"),
                number("4567"),
                number("5")
            ]
        );
        assert_eq!(mentions("1.2.3"), [number("1.2"), number("3")]);
    }

    #[test]
    fn finds_capitalized_words_and_whether_they_open_a_sentence() {
        assert_eq!(
            mentions("The panel met Ms Ashdown's team. In Port-Ellery, a B road.\nOK then"),
            [
                name("The", true),
                name("Ms", false),
                name("Ashdown", false),
                name("In", true),
                name("Port", false),
                name("Ellery", false),
                name("OK", true),
            ]
        );
        // A number opening a sentence leaves the next word first.
        assert_eq!(
            mentions("2019: Opened."),
            [number("2019"), name("Opened", true)]
        );
    }

    #[test]
    fn non_ascii_letters_are_letters() {
        assert_eq!(
            mentions("Élodie met Søren."),
            [name("Élodie", true), name("Søren", false)]
        );
    }
}
