//! Rendering a system + user conversation in the model's chat format.
//!
//! Models ship their template as Jinja. A summarizer only ever renders one shape of conversation
//! (a system message, a user message, then the assistant's turn), so instead of a Jinja engine
//! this recognizes the format from the template's markers and writes that shape directly.

/// The chat formats this renderer knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChatFormat {
    /// `<|im_start|>role\n...<|im_end|>` (SmolLM2, Qwen, and the fallback).
    ChatMl,
    /// `<|start_header_id|>role<|end_header_id|>\n\n...<|eot_id|>` (Llama 3).
    Llama3,
}

impl ChatFormat {
    /// Picks the format from the model's template; ChatML when there is none or it is unknown.
    pub fn detect(template: Option<&str>) -> Self {
        match template {
            Some(t) if t.contains("<|start_header_id|>") => ChatFormat::Llama3,
            _ => ChatFormat::ChatMl,
        }
    }

    /// The prompt for a system and a user message, ending where the assistant's answer begins.
    pub(crate) fn render(self, system: &str, user: &str) -> String {
        match self {
            ChatFormat::ChatMl => format!(
                "<|im_start|>system\n{system}<|im_end|>\n\
                 <|im_start|>user\n{user}<|im_end|>\n\
                 <|im_start|>assistant\n"
            ),
            ChatFormat::Llama3 => format!(
                "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n{system}<|eot_id|>\
                 <|start_header_id|>user<|end_header_id|>\n\n{user}<|eot_id|>\
                 <|start_header_id|>assistant<|end_header_id|>\n\n"
            ),
        }
    }

    /// The token text that closes the assistant's turn; generation stops there.
    pub fn end_of_turn(self) -> &'static str {
        match self {
            ChatFormat::ChatMl => "<|im_end|>",
            ChatFormat::Llama3 => "<|eot_id|>",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // The start of SmolLM2-Instruct's template, as stored in its GGUF.
    const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] \
        != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, \
        trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] \
        + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}";

    #[test]
    fn detects_the_format_and_falls_back_to_chatml() {
        assert_eq!(ChatFormat::detect(Some(SMOLLM2)), ChatFormat::ChatMl);
        let llama3 = "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>' }}";
        assert_eq!(ChatFormat::detect(Some(llama3)), ChatFormat::Llama3);
        assert_eq!(ChatFormat::detect(None), ChatFormat::ChatMl);
        assert_eq!(ChatFormat::detect(Some("{{ bos }}")), ChatFormat::ChatMl);
    }

    #[test]
    fn renders_chatml_like_the_template() {
        let prompt = ChatFormat::ChatMl.render("Be brief.", "Summarize: x");
        assert_eq!(
            prompt,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSummarize: x<|im_end|>\n\
             <|im_start|>assistant\n"
        );
    }

    #[test]
    fn renders_llama3() {
        let prompt = ChatFormat::Llama3.render("S", "U");
        assert!(prompt.starts_with("<|begin_of_text|><|start_header_id|>system"));
        assert!(prompt.ends_with("<|start_header_id|>assistant<|end_header_id|>\n\n"));
        assert_eq!(ChatFormat::Llama3.end_of_turn(), "<|eot_id|>");
    }
}
