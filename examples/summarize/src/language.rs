//! Whether a document is in English, the language the default model reads: a document in
//! another language is summarized from its own sentences instead.

/// The commonest English words; running English text has about one in four of its words among
/// them, other languages written in Latin letters (Spanish, French, German) a few in a hundred.
const ENGLISH_FUNCTION_WORDS: &[&str] = &[
    "a", "an", "and", "are", "as", "at", "be", "by", "for", "from", "has", "have", "in", "is",
    "it", "its", "not", "of", "on", "or", "that", "the", "this", "to", "was", "were", "which",
    "with",
];

/// The share of English function words above which a text reads as English.
const MIN_FUNCTION_WORD_SHARE: f64 = 0.12;

/// Whether `text` reads as English: most of its letters are Latin, and enough of its words are
/// English function words.
pub fn reads_as_english(text: &str) -> bool {
    let letters = text.chars().filter(|c| c.is_alphabetic()).count();
    let latin = text
        .chars()
        .filter(|c| c.is_ascii_alphabetic() || ('\u{c0}'..='\u{24f}').contains(c))
        .count();
    if letters == 0 || latin * 2 < letters {
        return false;
    }
    let words: Vec<String> = text
        .split(|c: char| !c.is_alphabetic())
        .filter(|word| !word.is_empty())
        .map(str::to_lowercase)
        .collect();
    let function = words
        .iter()
        .filter(|word| ENGLISH_FUNCTION_WORDS.contains(&word.as_str()))
        .count();
    function as f64 >= MIN_FUNCTION_WORD_SHARE * words.len() as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn english_reads_as_english_and_other_languages_do_not() {
        assert!(reads_as_english(
            "The barrier was built in 2019 and it protects the town from the sea."
        ));
        assert!(!reads_as_english(
            "La barrera se construyó en 2019 y protege la ciudad del mar durante las tormentas."
        ));
        assert!(!reads_as_english(
            "Der Damm wurde 2019 gebaut und schützt die Stadt vor dem Meer."
        ));
        assert!(!reads_as_english(
            "分块注意力把缓存切成多段，每段并行计算。"
        ));
        assert!(!reads_as_english("2019 12 3"));
    }
}
