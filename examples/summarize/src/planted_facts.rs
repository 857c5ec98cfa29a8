//! Scoring a summary against facts planted in its document: how many it recalls, and which
//! numbers and names it invented.

use std::path::Path;

use anyhow::Result;
use serde_json::Value;
use summarize::{is_cjk, Grounding, Mention};

use crate::bad_input::bad_input;

/// One planted fact and the forms that state it, e.g. `412 million` and `412,000,000`.
#[derive(Debug, Clone)]
struct PlantedFact {
    fact: String,
    forms: Vec<String>,
}

/// The facts planted in a document, read from a JSON file:
/// `{"facts": [{"fact": "the final cost", "forms": ["412 million", "412m"]}, ...]}`.
#[derive(Debug, Clone)]
pub struct PlantedFacts {
    facts: Vec<PlantedFact>,
}

/// How a summary did on the planted facts.
#[derive(Debug, Clone)]
pub struct FactScore {
    pub planted: usize,
    /// The facts the summary states in one of their forms.
    pub recalled: Vec<String>,
    pub missed: Vec<String>,
    /// The numbers and names of the summary its document does not ground (see [`Grounding`]).
    pub invented: Vec<String>,
}

impl PlantedFacts {
    /// Reads the fact list at `path`; fails with a reason when it is not one.
    pub fn read(path: &Path) -> Result<Self> {
        let name = path.display();
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(e) => bad_input!("cannot read the fact list {name}: {e}"),
        };
        let json: Value = match serde_json::from_str(&text) {
            Ok(json) => json,
            Err(e) => bad_input!("the fact list {name} is not JSON: {e}"),
        };
        let Some(entries) = json.get("facts").and_then(Value::as_array) else {
            bad_input!("the fact list {name} has no \"facts\" array");
        };
        let mut facts = Vec::with_capacity(entries.len());
        for (i, entry) in entries.iter().enumerate() {
            let fact = entry.get("fact").and_then(Value::as_str);
            let forms: Option<Vec<String>> =
                entry
                    .get("forms")
                    .and_then(Value::as_array)
                    .and_then(|forms| {
                        forms
                            .iter()
                            .map(|f| Some(f.as_str()?.to_string()))
                            .collect()
                    });
            match (fact, forms) {
                (Some(fact), Some(forms)) if forms.iter().all(|f| !f.trim().is_empty()) && !forms.is_empty() => {
                    facts.push(PlantedFact {
                        fact: fact.to_string(),
                        forms,
                    })
                }
                _ => bad_input!(
                    "the fact list {name}: fact {} needs a \"fact\" string and a non-empty \"forms\" array of non-blank strings",
                    i + 1
                ),
            }
        }
        if facts.is_empty() {
            bad_input!("the fact list {name} lists no facts");
        }
        Ok(Self { facts })
    }

    /// How many facts are planted.
    pub fn len(&self) -> usize {
        self.facts.len()
    }

    /// Scores `summary` of `document`. A fact is recalled when the summary contains one of its
    /// forms as whole words, ignoring case and how much whitespace separates the words.
    pub fn score(&self, summary: &str, document: &str) -> FactScore {
        let text = normalized(summary);
        let (recalled, missed): (Vec<&PlantedFact>, Vec<&PlantedFact>) =
            self.facts.iter().partition(|fact| {
                fact.forms
                    .iter()
                    .any(|form| contains_words(&text, &normalized(form)))
            });
        let invented = Grounding::new(document)
            .ungrounded(summary)
            .into_iter()
            .map(|mention| match mention {
                Mention::Number(number) => number,
                Mention::Name { word, .. } => word,
            })
            .collect();
        FactScore {
            planted: self.facts.len(),
            recalled: recalled.iter().map(|fact| fact.fact.clone()).collect(),
            missed: missed.iter().map(|fact| fact.fact.clone()).collect(),
            invented,
        }
    }
}

/// Lowercase, with every run of whitespace one space.
fn normalized(text: &str) -> String {
    text.split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .to_lowercase()
}

/// Whether `needle` occurs in `haystack` with no letter or digit right before or after it. A
/// Chinese or Japanese character is a word of its own, so it bounds a form as a space does.
fn contains_words(haystack: &str, needle: &str) -> bool {
    let is_word = |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric() && !is_cjk(c));
    haystack.match_indices(needle).any(|(at, _)| {
        !is_word(haystack[..at].chars().next_back())
            && !is_word(haystack[at + needle.len()..].chars().next())
    })
}
