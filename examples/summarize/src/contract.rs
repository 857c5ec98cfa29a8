//! The rewrite contract: every sentence of a summary is a sentence of its document, or a
//! compression of exactly one. A compression keeps the content words of that source sentence in
//! their order (a change of tense or number aside) and adds none, keeps or drops each of its
//! clauses whole, and takes the numbers of each of its own clauses from one clause of the source.
//!
//! A bag-of-words check passes a sentence spliced from two, or one that turns "the uncertainty is
//! substantial" into "the detection rate is substantial" with words found elsewhere; the order,
//! the clauses and the numbers do not let either through.

use super::sentences::sentences;

/// Words that carry no content of their own: articles, prepositions, pronouns, auxiliaries and
/// conjunctions. A rewrite may add or drop them. Negations, modals and quantifiers (`not`, `may`,
/// `only`, `more`) are content: dropping one turns a statement into another.
const FUNCTION_WORDS: &[&str] = &[
    "a", "about", "an", "and", "are", "as", "at", "be", "been", "being", "by", "did", "do", "does",
    "for", "from", "had", "has", "have", "he", "her", "here", "him", "his", "i", "in", "into",
    "is", "it", "its", "me", "my", "of", "on", "onto", "or", "our", "she", "so", "that", "the",
    "their", "them", "then", "there", "these", "they", "this", "those", "to", "upon", "us", "was",
    "we", "were", "which", "who", "whom", "whose", "with", "you", "your",
];

/// Where a clause starts inside a sentence: after these marks and connectives a part of the
/// sentence states something of its own (`..., and in 1971 the aqueduct was converted`).
const CLAUSE_MARKS: &[char] = &[
    ';', ':', '\u{2014}', '\u{2013}', '(', ')', '\u{ff0c}', '\u{ff1b}', '\u{ff1a}', '\u{3001}',
];
const CLAUSE_CONNECTIVES: &[&str] = &[
    "and", "but", "while", "whereas", "which", "who", "or", "so", "although", "though", "because",
    "where", "when", "yet",
];

/// Letters of a word that decide its identity: `replaced` and `replaces` agree, `detection` and
/// `determined` do not.
const STEM_CHARS: usize = 5;

/// One content word or number of a sentence, and the clause it stands in.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Token {
    /// A stem for a word, the digits (group commas removed) for a number, the character for a
    /// CJK ideograph or syllable.
    key: String,
    number: bool,
    clause: usize,
}

/// Why a sentence breaks the contract against a source sentence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Breach {
    /// It has no content word: nothing to hold it to.
    NoContent,
    /// Its content words are not, in order, in any one source sentence.
    NotACompression,
    /// It keeps part of a clause of its source and drops the rest.
    PartClause,
    /// One of its clauses has numbers from two clauses of its source.
    SplicedNumbers,
}

/// The sentences of a document, tokenized once, to check summary sentences against.
#[derive(Debug, Clone, Default)]
pub struct RewriteContract {
    sources: Vec<Vec<Token>>,
}

impl RewriteContract {
    /// Indexes the sentences of `document`.
    pub fn new(document: &str) -> Self {
        Self {
            sources: sentences(document).into_iter().map(tokens).collect(),
        }
    }

    /// `Ok(i)` when `sentence` is sentence `i` of the document or a compression of it; otherwise
    /// the breach found against the source sentence that came closest.
    pub fn check(&self, sentence: &str) -> Result<usize, Breach> {
        let own = tokens(sentence);
        if own.iter().all(|token| token.number) {
            return Err(Breach::NoContent);
        }
        let mut closest = Breach::NotACompression;
        for (i, source) in self.sources.iter().enumerate() {
            match compresses(&own, source) {
                Ok(()) => return Ok(i),
                Err(Breach::NotACompression) => {}
                Err(breach) => closest = breach,
            }
        }
        Err(closest)
    }

    /// Whether `sentence` keeps the contract.
    pub fn holds(&self, sentence: &str) -> bool {
        self.check(sentence).is_ok()
    }
}

/// The content words of `sentence` as the contract compares them (stems, numbers, CJK
/// characters), in order: what the sentence says, for measuring how alike two sentences are.
pub(crate) fn content_keys(sentence: &str) -> Vec<String> {
    tokens(sentence)
        .into_iter()
        .map(|token| token.key)
        .collect()
}

/// Whether `own` (a summary sentence's tokens) is a compression of `source`'s: the
/// concatenation of some of its clauses, each whole, in order, with the numbers of each of its
/// own clauses from one of them.
fn compresses(own: &[Token], source: &[Token]) -> Result<(), Breach> {
    let clauses: Vec<&[Token]> = source.chunk_by(|a, b| a.clause == b.clause).collect();
    // reach[c][k]: the first k tokens of `own` are made of whole clauses among the first c;
    // from[c][k] says whether clause c - 1 was kept to get there.
    let n = own.len();
    let mut reach = vec![vec![false; n + 1]; clauses.len() + 1];
    let mut kept_last = vec![vec![false; n + 1]; clauses.len() + 1];
    reach[0][0] = true;
    for (c, clause) in clauses.iter().enumerate() {
        for k in 0..=n {
            if !reach[c][k] {
                continue;
            }
            reach[c + 1][k] = true;
            let end = k + clause.len();
            let same = end <= n
                && own[k..end]
                    .iter()
                    .zip(clause.iter())
                    .all(|(a, b)| a.key == b.key);
            if same && !reach[c + 1][end] {
                reach[c + 1][end] = true;
                kept_last[c + 1][end] = true;
            }
        }
    }
    if !reach[clauses.len()][n] {
        let mut rest = source.iter();
        let in_order = own.iter().all(|t| rest.any(|s| s.key == t.key));
        return Err(if in_order {
            Breach::PartClause
        } else {
            Breach::NotACompression
        });
    }
    // The source clause of each token of `own`, walking back.
    let mut source_clause = vec![0; n];
    let mut k = n;
    for c in (1..=clauses.len()).rev() {
        if kept_last[c][k] {
            let start = k - clauses[c - 1].len();
            source_clause[start..k].fill(c - 1);
            k = start;
        }
    }
    // The numbers of each clause of the summary sentence come from one clause of the source.
    let numbered = own
        .iter()
        .zip(&source_clause)
        .filter(|(token, _)| token.number);
    let mut first_of: std::collections::HashMap<usize, usize> = Default::default();
    for (token, &from) in numbered {
        if *first_of.entry(token.clause).or_insert(from) != from {
            return Err(Breach::SplicedNumbers);
        }
    }
    Ok(())
}

/// Whether `c` is an ideograph or syllable of a script written without spaces (Chinese, Japanese
/// kana, Korean): each is a content token of its own.
pub fn is_cjk(c: char) -> bool {
    matches!(c,
        '\u{3040}'..='\u{30ff}' | '\u{3400}'..='\u{4dbf}' | '\u{4e00}'..='\u{9fff}'
        | '\u{f900}'..='\u{faff}' | '\u{ac00}'..='\u{d7af}')
}

/// The content tokens of `sentence`, each with its clause.
fn tokens(sentence: &str) -> Vec<Token> {
    let mut found = Vec::new();
    let mut clause = 0;
    // Whether the current clause has a token yet: a boundary before any content opens none.
    let mut clause_used = false;
    let boundary = |clause: &mut usize, used: &mut bool| {
        if *used {
            *clause += 1;
            *used = false;
        }
    };
    let mut chars = sentence.char_indices().peekable();
    // The previous non-space character, to tell `, and` from `and`.
    let mut after_comma = false;
    while let Some((at, c)) = chars.next() {
        if CLAUSE_MARKS.contains(&c) || (c == '-' && sentence[at..].starts_with("- ")) {
            boundary(&mut clause, &mut clause_used);
            after_comma = false;
            continue;
        }
        if c == ',' {
            after_comma = true;
            continue;
        }
        if is_cjk(c) {
            found.push(Token {
                key: c.to_string(),
                number: false,
                clause,
            });
            clause_used = true;
            after_comma = false;
            continue;
        }
        if c.is_ascii_digit() {
            let mut number = String::from(c);
            while let Some(&(next_at, next)) = chars.peek() {
                let inside = matches!(next, ',' | '.')
                    && sentence[next_at + 1..].starts_with(|d: char| d.is_ascii_digit());
                if next.is_ascii_digit() {
                    number.push(next);
                } else if inside {
                    if next == '.' {
                        number.push('.');
                    }
                } else {
                    break;
                }
                chars.next();
            }
            found.push(Token {
                key: number,
                number: true,
                clause,
            });
            clause_used = true;
            after_comma = false;
            continue;
        }
        if c.is_alphabetic() {
            let mut word = String::from(c);
            while let Some(&(next_at, next)) = chars.peek() {
                let apostrophe = matches!(next, '\'' | '\u{2019}')
                    && sentence[next_at + next.len_utf8()..].starts_with(char::is_alphabetic);
                if (next.is_alphabetic() && !is_cjk(next)) || apostrophe {
                    word.push(if apostrophe { '\'' } else { next });
                    chars.next();
                } else {
                    break;
                }
            }
            let lower = word.to_lowercase();
            if after_comma && CLAUSE_CONNECTIVES.contains(&lower.as_str()) {
                boundary(&mut clause, &mut clause_used);
            }
            after_comma = false;
            if let Some(key) = stem(&lower) {
                found.push(Token {
                    key,
                    number: false,
                    clause,
                });
                clause_used = true;
            }
            continue;
        }
        if !c.is_whitespace() {
            after_comma = false;
        }
    }
    found
}

/// Whether a lowercase word is one a rewrite may add or drop (see [`FUNCTION_WORDS`]).
pub(crate) fn is_function_word(word: &str) -> bool {
    FUNCTION_WORDS.contains(&word)
}

/// The stem of a lowercase word, `None` for a function word: its possessive and a plural `s`
/// dropped, then its first [`STEM_CHARS`] letters.
fn stem(word: &str) -> Option<String> {
    if FUNCTION_WORDS.contains(&word) {
        return None;
    }
    let word = word.strip_suffix("'s").unwrap_or(word);
    let word = match word.strip_suffix('s') {
        Some(singular) if singular.chars().count() >= 3 && !singular.ends_with('s') => singular,
        _ => word,
    };
    Some(word.chars().take(STEM_CHARS).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(source: &str, sentence: &str) -> Result<usize, Breach> {
        RewriteContract::new(source).check(sentence)
    }

    #[test]
    fn a_source_sentence_and_its_clause_drops_keep_the_contract() {
        let source = "The barrier cost 412 million pounds, which was 44 per cent over budget, \
            and it opened in 2019. Nobody was hurt.";
        assert_eq!(
            check(source, "The barrier cost 412 million pounds, which was 44 per cent over budget, and it opened in 2019."),
            Ok(0)
        );
        assert_eq!(check(source, "The barrier cost 412 million pounds."), Ok(0));
        assert_eq!(
            check(
                source,
                "The barrier cost 412 million pounds, and it opened in 2019."
            ),
            Ok(0)
        );
        // Two clauses made one: their numbers now read as one statement.
        assert_eq!(
            check(
                source,
                "The barrier cost 412 million pounds and opened in 2019."
            ),
            Err(Breach::SplicedNumbers)
        );
        // Tense and number change.
        assert_eq!(check(source, "Nobody is hurt."), Ok(1));
    }

    #[test]
    fn added_reordered_or_dropped_content_breaks_it() {
        let source = "The barrier did not fail in 2019, and the gates were raised twice.";
        assert_eq!(
            check(source, "The barrier did fail in 2019."),
            Err(Breach::PartClause)
        );
        assert_eq!(
            check(source, "The barrier failed badly in 2019."),
            Err(Breach::NotACompression)
        );
        assert_eq!(
            check(source, "In 2019 the barrier did not fail."),
            Err(Breach::NotACompression)
        );
        assert_eq!(check(source, "In 2019."), Err(Breach::NoContent));
    }

    #[test]
    fn numbers_of_two_source_clauses_in_one_clause_break_it() {
        let source = "The trial ran from 2010 to 2012; the review came in 2015.";
        assert_eq!(check(source, "The trial ran from 2010 to 2012."), Ok(0));
        assert_eq!(
            check(
                source,
                "The trial ran from 2010 to 2012 the review came in 2015."
            ),
            Err(Breach::SplicedNumbers)
        );
        assert_eq!(
            check(
                source,
                "The trial ran from 2010 to 2012; the review came in 2015."
            ),
            Ok(0)
        );
    }

    #[test]
    fn cjk_text_is_checked_character_by_character() {
        let source = "分块注意力把缓存切成多段，每段并行计算。结果再合并。";
        assert_eq!(check(source, "分块注意力把缓存切成多段。"), Ok(0));
        assert_eq!(
            check(source, "分块注意力把缓存切成两段。"),
            Err(Breach::NotACompression)
        );
        assert_eq!(check(source, "结果再合并。"), Ok(1));
    }

    /// The four misstatements of issue 54, against the sentences they were made from.
    #[test]
    fn the_reported_misstatements_break_the_contract() {
        let cases = [
            (
                "The most sustained criticism has come from Dr. Ines Varga, a hydrologist at the \
                 university. Dr. Barlow, the independent statistician, agrees that the uncertainty \
                 is substantial: his own calculation gives a 95 per cent confidence interval for \
                 the detection rate of roughly 71 to 91 per cent.",
                "The most sustained criticism has come from Dr. Barlow, the independent \
                 statistician agrees that the detection rate is substantial: his own calculation \
                 gives a 95 per cent confidence interval of roughly 71 to 91 per cent.",
            ),
            (
                "The operator, Upper Lesk Transport Company, is putting 700,000 euros towards the \
                 pilot, and a regional development fund is contributing a further 1.1 million \
                 euros.",
                "The operator, Upper Lesk Transport Company, is putting 700,000 euros towards a \
                 regional development fund and a regional development fund contributes a \
                 further 1.1 million euros to the project.",
            ),
            (
                "In 1968 the sand filters were replaced by rapid gravity filters, and in 1971, \
                 following a contamination scare at the lower reservoir, the aqueduct was \
                 converted to carry treated water only.",
                "In 1968, the sand filters were replaced by rapid gravity filters in 1971.",
            ),
            (
                "Fixed partition sizes, such as always cutting the cache into chunks of five \
                 hundred and twelve positions, are simpler still and work well in servers with \
                 large batches.",
                "Fixed partition sizes are simpler than ever before.",
            ),
        ];
        for (source, misstatement) in cases {
            assert!(check(source, misstatement).is_err(), "{misstatement}");
            // Each source sentence itself keeps it.
            for sentence in sentences(source) {
                assert!(check(source, sentence.trim()).is_ok(), "{sentence}");
            }
        }
        // What the model may write instead: a clause dropped whole.
        assert_eq!(
            check(
                cases[2].0,
                "In 1968 the sand filters were replaced by rapid gravity filters."
            ),
            Ok(0)
        );
    }

    /// Generated sentences of three clauses with two numbers each: every choice of clauses kept
    /// whole keeps the contract; a number moved to another clause, a content word dropped or
    /// added, or two clauses swapped breaks it.
    #[test]
    fn generated_multi_clause_sentences_keep_or_break_the_contract_as_built() {
        const SUBJECTS: [&str; 6] = [
            "the council",
            "Meridian Water",
            "the surveyors",
            "Port Avel",
            "the regulator",
            "Halden Rail",
        ];
        const VERBS: [&str; 6] = [
            "spent", "counted", "reported", "recorded", "borrowed", "measured",
        ];
        const OBJECTS: [&str; 6] = [
            "million euros",
            "households",
            "kilometres",
            "complaints",
            "tonnes",
            "vessels",
        ];
        let mut seed: u64 = 0x5eed;
        let mut next = |n: usize| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) as usize % n
        };
        for _ in 0..300 {
            let clauses: Vec<(String, u32, u32)> = (0..3)
                .map(|_| {
                    let (a, b) = (1900 + next(120) as u32, 20 + next(9000) as u32);
                    let text = format!(
                        "{} {} {b} {} in {a}",
                        SUBJECTS[next(6)],
                        VERBS[next(6)],
                        OBJECTS[next(6)]
                    );
                    (text, a, b)
                })
                .collect();
            let joined = |parts: &[&str]| {
                let mut text = parts.join("; ");
                text.push('.');
                let mut chars = text.chars();
                chars
                    .next()
                    .map_or(String::new(), |c| c.to_uppercase().chain(chars).collect())
            };
            let all: Vec<&str> = clauses.iter().map(|(text, _, _)| text.as_str()).collect();
            let source = joined(&all);
            let contract = RewriteContract::new(&source);
            for keep in 1..8u32 {
                let kept: Vec<&str> = (0..3)
                    .filter(|i| keep & (1 << i) != 0)
                    .map(|i| all[i])
                    .collect();
                assert!(
                    contract.holds(&joined(&kept)),
                    "{} <- {source}",
                    joined(&kept)
                );
            }
            let (first, a0, _) = &clauses[0];
            let (_, a1, _) = &clauses[1];
            if a0 != a1 {
                // The year of the second clause put into the first.
                let moved = first.replace(&format!("in {a0}"), &format!("in {a1}"));
                assert!(!contract.holds(&joined(&[&moved])), "{moved} <- {source}");
            }
            // A content word dropped from a clause, one added, and the clauses swapped.
            let words: Vec<&str> = first.split(' ').collect();
            let dropped = words
                .iter()
                .enumerate()
                .filter(|&(i, _)| i != words.len() - 3)
                .map(|(_, w)| *w)
                .collect::<Vec<_>>()
                .join(" ");
            assert!(
                !contract.holds(&joined(&[&dropped])),
                "{dropped} <- {source}"
            );
            let added = format!("{first} twice");
            assert!(!contract.holds(&joined(&[&added])), "{added} <- {source}");
            if all[0] != all[1] && all[0] != all[2] {
                let swapped = joined(&[all[1], all[0]]);
                assert!(!contract.holds(&swapped), "{swapped} <- {source}");
            }
        }
    }

    #[test]
    fn stems_absorb_tense_and_plural_only() {
        assert_eq!(stem("replaced"), stem("replaces"));
        assert_eq!(stem("costs"), stem("cost"));
        assert_eq!(stem("the"), None);
        assert_ne!(stem("uncertainty"), stem("detection"));
        assert_eq!(stem("not"), Some("not".to_string()));
    }
}
