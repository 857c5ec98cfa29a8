//! Reading the document, from a file or standard input.

use std::io::Read;
use std::path::Path;

use anyhow::Result;
use candle_splitkv::summarize::decode_text;

use crate::bad_input::{bad_input, BadInput};

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
    Ok(decode_text(&name, bytes).map_err(|e| BadInput(e.to_string()))?)
}
