//! Rejecting what is not a text document.

use std::fmt;

/// Above this share of bytes in invalid UTF-8 sequences, the input is taken for binary data. Below
/// it (a stray Latin-1 byte or two), the bad bytes become U+FFFD and the text is summarized.
const MAX_INVALID_UTF8_SHARE: f64 = 0.1;

/// Why some bytes are not a document to summarize.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotADocument {
    /// The bytes contain NUL bytes, which text does not.
    NulBytes {
        /// The document's name, as given to [`decode_text`].
        name: String,
    },
    /// More than a tenth of the bytes are not valid UTF-8.
    NotUtf8 {
        /// The document's name, as given to [`decode_text`].
        name: String,
        /// How many bytes belong to no valid UTF-8 sequence.
        invalid: usize,
        /// How many bytes there are.
        total: usize,
    },
    /// There is nothing but whitespace.
    Empty {
        /// The document's name, as given to [`decode_text`].
        name: String,
    },
}

impl fmt::Display for NotADocument {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NotADocument::NulBytes { name } => write!(
                f,
                "{name} looks like binary data (it contains NUL bytes), not a text document"
            ),
            NotADocument::NotUtf8 {
                name,
                invalid,
                total,
            } => write!(
                f,
                "{name} looks like binary data ({invalid} of {total} bytes are not valid UTF-8), \
                 not a text document"
            ),
            NotADocument::Empty { name } => {
                write!(f, "{name} is empty: there is nothing to summarize")
            }
        }
    }
}

impl std::error::Error for NotADocument {}

/// Turns the bytes of the document called `name` into text, or says why they are not a document.
///
/// A few bytes of invalid UTF-8 (a stray Latin-1 character) become U+FFFD; more than a tenth of
/// them, or any NUL byte, mean binary data.
pub fn decode_text(name: &str, bytes: Vec<u8>) -> Result<String, NotADocument> {
    if bytes.contains(&0) {
        return Err(NotADocument::NulBytes {
            name: name.to_string(),
        });
    }
    let text = match String::from_utf8(bytes) {
        Ok(text) => text,
        Err(e) => {
            let bytes = e.into_bytes();
            let invalid = invalid_utf8_bytes(&bytes);
            if invalid as f64 > MAX_INVALID_UTF8_SHARE * bytes.len() as f64 {
                return Err(NotADocument::NotUtf8 {
                    name: name.to_string(),
                    invalid,
                    total: bytes.len(),
                });
            }
            String::from_utf8_lossy(&bytes).into_owned()
        }
    };
    if text.trim().is_empty() {
        return Err(NotADocument::Empty {
            name: name.to_string(),
        });
    }
    Ok(text)
}

/// Counts the bytes that belong to no valid UTF-8 sequence.
fn invalid_utf8_bytes(mut bytes: &[u8]) -> usize {
    let mut invalid = 0;
    while !bytes.is_empty() {
        match std::str::from_utf8(bytes) {
            Ok(_) => break,
            Err(e) => {
                let bad = e.error_len().unwrap_or(bytes.len() - e.valid_up_to());
                invalid += bad;
                bytes = &bytes[e.valid_up_to() + bad..];
            }
        }
    }
    invalid
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(result: Result<String, NotADocument>) -> String {
        result.unwrap_err().to_string()
    }

    #[test]
    fn accepts_text_and_keeps_it_verbatim() {
        let text = "Split-KV decoding.\n\nSecond paragraph, with ünïcode.";
        assert_eq!(decode_text("doc", text.as_bytes().to_vec()).unwrap(), text);
    }

    #[test]
    fn rejects_empty_and_whitespace_only() {
        assert!(message(decode_text("doc", vec![])).contains("empty"));
        assert!(message(decode_text("doc", b" \n\t\r\n ".to_vec())).contains("empty"));
    }

    #[test]
    fn rejects_nul_bytes() {
        assert!(message(decode_text("doc", b"text\0more".to_vec())).contains("NUL"));
    }

    #[test]
    fn rejects_mostly_invalid_utf8_but_tolerates_a_stray_byte() {
        let binary: Vec<u8> = (0..400u32).map(|i| 0x80 + (i % 0x7f) as u8).collect();
        assert!(message(decode_text("doc", binary)).contains("not valid UTF-8"));

        let mut latin1 = b"caf".to_vec();
        latin1.push(0xe9); // 'é' in Latin-1
        latin1.extend_from_slice(b" au lait, a long enough sentence around one odd byte.");
        let text = decode_text("doc", latin1).unwrap();
        assert!(text.starts_with("caf\u{FFFD} au lait"));
    }

    #[test]
    fn counts_invalid_bytes() {
        assert_eq!(invalid_utf8_bytes(b"abc"), 0);
        assert_eq!(invalid_utf8_bytes(&[b'a', 0xff, b'b', 0xfe]), 2);
        // A truncated multi-byte sequence at the end counts as invalid too.
        assert_eq!(invalid_utf8_bytes(&[b'a', 0xe2, 0x82]), 2);
    }
}
