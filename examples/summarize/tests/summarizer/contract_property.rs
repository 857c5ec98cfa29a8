//! The rewrite contract over every document the tests and the evaluation use: each of its own
//! sentences keeps it, and a splice of two neighbouring sentences (the first half of one, the
//! second half of the next) breaks it.

use std::path::{Path, PathBuf};

use summarize::{sentences, words_in, RewriteContract};

/// The words of `sentence`, each Chinese character one.
fn words(sentence: &str) -> Vec<String> {
    if sentence.split_whitespace().count() >= 6 {
        sentence.split_whitespace().map(String::from).collect()
    } else {
        sentence.chars().map(String::from).collect()
    }
}

fn documents() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut found = Vec::new();
    for dir in [
        root.join("../data"),
        root.join("eval/tuned"),
        root.join("eval/held-out"),
    ] {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            if (name.ends_with(".md") || name.ends_with(".txt")) && name != "README.md" {
                found.push(path);
            }
        }
    }
    found.sort();
    found
}

#[test]
fn every_sentence_keeps_the_contract_and_every_splice_breaks_it() {
    let documents = documents();
    assert!(documents.len() >= 10, "{documents:?}");
    for path in documents {
        let document = std::fs::read_to_string(&path).unwrap();
        let contract = RewriteContract::new(&document);
        let own: Vec<&str> = sentences(&document)
            .into_iter()
            .map(str::trim)
            // Statements, not headings.
            .filter(|s| words_in(s) >= 6 && !s.starts_with('#'))
            .collect();
        for sentence in &own {
            assert!(contract.holds(sentence), "{}: {sentence}", path.display());
        }
        let mut splices = 0;
        for pair in own.windows(2) {
            let (a, b) = (words(pair[0]), words(pair[1]));
            let joint = if pair[0].contains(' ') { " " } else { "" };
            let (head, tail) = (a[..a.len() / 2].join(joint), b[b.len() / 2..].join(joint));
            let splice = format!("{head}{joint}{tail}");
            // Two sentences that open alike (list items of a licence: "The work must carry
            // prominent notices stating ...") splice into a compression of the second, which the
            // contract allows.
            if RewriteContract::new(pair[1]).holds(&splice) {
                continue;
            }
            assert!(!contract.holds(&splice), "{}: {splice}", path.display());
            splices += 1;
        }
        assert!(splices > 10, "{}", path.display());
    }
}
