//! Reading the document and rejecting what is not a text document.

use std::io::Read;
use std::path::Path;

use anyhow::Result;

use crate::bad_input::bad_input;

/// Above this share of bytes in invalid UTF-8 sequences, the input is taken for binary data. Below
/// it (a stray Latin-1 byte or two), the bad bytes become U+FFFD and the text is summarized.
const MAX_INVALID_UTF8_SHARE: f64 = 0.1;

/// Reads the document at `path` (`-` for standard input) and checks that it is non-empty text.
pub fn read_document(path: &Path) -> Result<String> {
    let (name, bytes) = if path.as_os_str() == "-" {
        let mut bytes = Vec::new();
        if let Err(e) = std::io::stdin().read_to_end(&mut bytes) {
            bad_input!("cannot read standard input: {e}");
        }
        ("standard input".to_string(), bytes)
    } else {
        let name = path.display().to_string();
        if path.is_dir() {
            bad_input!("{name} is a directory, not a document");
        }
        match std::fs::read(path) {
            Ok(bytes) => (name, bytes),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                bad_input!("{name}: no such file")
            }
            Err(e) => bad_input!("cannot read {name}: {e}"),
        }
    };
    decode_text(&name, bytes)
}

/// Turns the bytes into text, or says why they are not a document.
pub fn decode_text(name: &str, bytes: Vec<u8>) -> Result<String> {
    if bytes.contains(&0) {
        bad_input!("{name} looks like binary data (it contains NUL bytes), not a text document");
    }
    let text = match String::from_utf8(bytes) {
        Ok(text) => text,
        Err(e) => {
            let bytes = e.into_bytes();
            let invalid = invalid_utf8_bytes(&bytes);
            if invalid as f64 > MAX_INVALID_UTF8_SHARE * bytes.len() as f64 {
                bad_input!(
                    "{name} looks like binary data ({invalid} of {} bytes are not valid UTF-8), \
                     not a text document",
                    bytes.len()
                );
            }
            String::from_utf8_lossy(&bytes).into_owned()
        }
    };
    if text.trim().is_empty() {
        bad_input!("{name} is empty: there is nothing to summarize");
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

    fn message(result: Result<String>) -> String {
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
