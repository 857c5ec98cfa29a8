//! The prompts that ask the model for a summary.

use tokenizers::Tokenizer;

use super::{ChatTemplate, SummarizeError};

/// Without a system message SmolLM2 ends its answer before writing anything.
const SYSTEM: &str = "You are a helpful assistant who writes concise, accurate summaries.";

/// Asked for a plain summary, small models write about the text ("the report discusses...") and
/// drop its particulars; asked to keep them, they copy more of the sentences that state them.
const KEEP_FACTS: &str = "Keep its names, numbers and dates.";

/// What a generation is asked to do. The instruction follows the text: small models lose an
/// instruction placed before a long text, and then continue or repeat the text instead.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Task<'t> {
    /// The whole document fits at once.
    Document(&'t str),
    /// One chunk of a longer document.
    Part(&'t str),
    /// Summaries of consecutive parts, to be merged into one.
    Summaries(&'t str),
}

impl Task<'_> {
    fn user_message(self) -> String {
        match self {
            // Joined summaries read like a short document; asked to "combine summaries", small
            // models tend to describe the list instead of summarizing it.
            Task::Document(text) | Task::Summaries(text) => {
                format!("{text}\n\nSummarize the text above in a short paragraph. {KEEP_FACTS}")
            }
            // Parts are small (a few sentences): asked for one short sentence, the model copies
            // the one that states the most, often tightened; asked for more, it also copies those
            // that state less.
            Task::Part(text) => {
                format!("{text}\n\nRewrite the text above as one short sentence. {KEEP_FACTS}")
            }
        }
    }
}

/// The tokens of the prompt for `task`. The special-token markers of the chat format are
/// recognized as such.
pub(crate) fn encode_prompt(
    tokenizer: &Tokenizer,
    chat: &ChatTemplate,
    task: Task,
) -> Result<Vec<u32>, SummarizeError> {
    let prompt = chat.render(SYSTEM, &task.user_message())?;
    let encoding = tokenizer
        .encode(prompt.as_str(), false)
        .map_err(SummarizeError::tokenizing("the prompt"))?;
    Ok(encoding.get_ids().to_vec())
}

/// The most tokens a prompt takes besides the text it carries.
pub(crate) fn prompt_overhead(
    tokenizer: &Tokenizer,
    chat: &ChatTemplate,
) -> Result<usize, SummarizeError> {
    let mut overhead = 0;
    for task in [Task::Document(""), Task::Part(""), Task::Summaries("")] {
        overhead = overhead.max(encode_prompt(tokenizer, chat, task)?.len());
    }
    Ok(overhead)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_tokenizer::word_tokenizer;

    #[test]
    fn the_instruction_follows_the_text() {
        let part = Task::Part("Chunk text.").user_message();
        assert!(part.starts_with("Chunk text.\n\n"));
        assert!(part.ends_with(&format!("as one short sentence. {KEEP_FACTS}")));
        for task in [Task::Document("Text."), Task::Summaries("Text.")] {
            let message = task.user_message();
            assert!(message.starts_with("Text.\n\n"));
            assert!(message.ends_with(&format!("in a short paragraph. {KEEP_FACTS}")));
        }
    }

    #[test]
    fn prompts_carry_the_system_message_and_the_text() {
        let tokenizer = word_tokenizer();
        let words = |s: &str| s.split_whitespace().count();
        let prompt = ChatTemplate::chatml()
            .render(SYSTEM, &Task::Part("a b c").user_message())
            .unwrap();
        assert!(prompt.contains(SYSTEM));
        let tokens =
            encode_prompt(&tokenizer, &ChatTemplate::chatml(), Task::Part("a b c")).unwrap();
        assert_eq!(tokens.len(), words(&prompt));
        // The overhead is that of the longest instruction, without the text.
        let overhead = prompt_overhead(&tokenizer, &ChatTemplate::chatml()).unwrap();
        assert_eq!(overhead, tokens.len() - 3);
    }
}
