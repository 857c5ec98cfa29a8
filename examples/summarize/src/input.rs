//! Reading the documents, from files, folders or standard input.

use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::Result;
use summarize::decode_text;

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

/// The documents `paths` name: files as given, a folder's `.md` and `.txt` files in name order,
/// and `-` (standard input) only alone.
pub fn document_paths(paths: &[PathBuf]) -> Result<Vec<PathBuf>> {
    if paths.len() > 1 && paths.iter().any(|p| p.as_os_str() == "-") {
        bad_input!("`-` (standard input) can only be the one document");
    }
    let mut documents = Vec::new();
    for path in paths {
        if !path.is_dir() {
            documents.push(path.clone());
            continue;
        }
        let entries = match std::fs::read_dir(path) {
            Ok(entries) => entries,
            Err(e) => bad_input!("cannot list {}: {e}", path.display()),
        };
        let mut found: Vec<PathBuf> = entries
            .filter_map(|entry| entry.ok().map(|e| e.path()))
            .filter(|p| p.is_file() && p.extension().is_some_and(|ext| ext == "md" || ext == "txt"))
            .collect();
        if found.is_empty() {
            bad_input!("{} holds no .md or .txt document", path.display());
        }
        found.sort();
        documents.extend(found);
    }
    Ok(documents)
}
