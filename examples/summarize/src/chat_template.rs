//! Rendering a system + user conversation with the model's own chat template.
//!
//! Models ship their chat format as a Jinja template (in the GGUF metadata or
//! tokenizer_config.json). It is rendered as the model's tooling renders it, with the Python
//! string methods templates call, `raise_exception`, and the `bos_token`/`eos_token` variables.
//! A model without a template gets ChatML.

use minijinja::{context, Environment, Error, ErrorKind, Value};

use super::SummarizeError;

/// ChatML, for models that ship no template.
const CHATML: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' \
    + message['content'] + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}\
    {{ '<|im_start|>assistant\\n' }}{% endif %}";

const NAME: &str = "chat";

/// Stands in for an assistant's answer, to find what the template writes after one.
const ANSWER_MARK: &str = "ANSWERMARK7731";

/// A model's chat template, ready to render the summarizer's conversations.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    /// Whether the template takes a system message; if not, it leads the user message.
    system_role: bool,
    end_of_turn: String,
}

impl ChatTemplate {
    /// The model's template, with the texts of its beginning- and end-of-sequence tokens (empty
    /// where it has none); ChatML when `template` is `None`. Fails where the template does not
    /// parse, or cannot render a system and a user message (or a user message alone).
    pub fn new(
        template: Option<&str>,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<Self, SummarizeError> {
        let mut env = Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<Value, Error> {
                Err(Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_template_owned(NAME, template.unwrap_or(CHATML).to_string())
            .map_err(template_error)?;
        let mut chat = Self {
            env,
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
            system_role: true,
            end_of_turn: String::new(),
        };
        // Some templates refuse a system message (they raise): it then leads the user's.
        if chat.render("S", "U").is_err() {
            chat.system_role = false;
            chat.render("S", "U")?;
        }
        chat.end_of_turn = chat.find_end_of_turn();
        Ok(chat)
    }

    /// ChatML (`<|im_start|>role\n…<|im_end|>`).
    pub fn chatml() -> Self {
        Self::new(None, "", "").expect("the built-in ChatML template renders")
    }

    /// The prompt for a system and a user message, ending where the assistant's answer begins.
    pub fn render(&self, system: &str, user: &str) -> Result<String, SummarizeError> {
        self.render_messages(&self.messages(system, user), true)
    }

    /// The text that closes the assistant's turn, the first thing the template writes after an
    /// answer (`<|im_end|>`, `<|eot_id|>`, …), or the end-of-sequence token's text where it
    /// writes nothing there: generation stops at it.
    pub fn end_of_turn(&self) -> &str {
        &self.end_of_turn
    }

    fn messages(&self, system: &str, user: &str) -> Vec<Value> {
        let message = |role: &str, content: String| context! { role => role, content => content };
        if self.system_role {
            vec![
                message("system", system.to_string()),
                message("user", user.to_string()),
            ]
        } else {
            vec![message("user", format!("{system}\n\n{user}"))]
        }
    }

    fn render_messages(
        &self,
        messages: &[Value],
        add_generation_prompt: bool,
    ) -> Result<String, SummarizeError> {
        let template = self.env.get_template(NAME).map_err(template_error)?;
        template
            .render(context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token,
                eos_token => self.eos_token,
            })
            .map_err(template_error)
    }

    fn find_end_of_turn(&self) -> String {
        let mut messages = self.messages("S", "U");
        messages.push(context! { role => "assistant", content => ANSWER_MARK });
        let after = self
            .render_messages(&messages, false)
            .ok()
            .and_then(|text| {
                let at = text.find(ANSWER_MARK)? + ANSWER_MARK.len();
                let marker: String = text[at..]
                    .chars()
                    .take_while(|c| !c.is_whitespace())
                    .collect();
                (!marker.is_empty()).then_some(marker)
            });
        after.unwrap_or_else(|| self.eos_token.clone())
    }
}

fn template_error(e: Error) -> SummarizeError {
    SummarizeError::ChatTemplate {
        reason: e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // A template in the style of SmolLM2-Instruct's: ChatML with a default system message.
    const CHATML_WITH_DEFAULT_SYSTEM: &str = "{% for message in messages %}{% if loop.first and \
        messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' \
        }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + \
        '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ \
        '<|im_start|>assistant\\n' }}{% endif %}";

    // Header-style turns with the beginning-of-sequence token and a trimmed content.
    const HEADERS: &str = "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' \
        + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' \
        }}{% endfor %}{% if add_generation_prompt %}{{ \
        '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}";

    // Turns that refuse a system role, in Python string style.
    const NO_SYSTEM: &str = "{% for message in messages %}{% if message['role'] == 'system' %}{{ \
        raise_exception('System role not supported') }}{% endif %}{{ '<start_of_turn>' + \
        message['role'] + '\\n' + message['content'].strip() + '<end_of_turn>\\n' }}{% endfor %}\
        {% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}";

    #[test]
    fn chatml_is_the_fallback() {
        let chat = ChatTemplate::chatml();
        assert_eq!(
            chat.render("Be brief.", "Summarize: x").unwrap(),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSummarize: x<|im_end|>\n\
             <|im_start|>assistant\n"
        );
        assert_eq!(chat.end_of_turn(), "<|im_end|>");
        let with_default = ChatTemplate::new(Some(CHATML_WITH_DEFAULT_SYSTEM), "", "").unwrap();
        assert_eq!(
            with_default.render("Be brief.", "Summarize: x").unwrap(),
            chat.render("Be brief.", "Summarize: x").unwrap()
        );
    }

    #[test]
    fn header_templates_take_the_bos_token_and_filters() {
        let chat =
            ChatTemplate::new(Some(HEADERS), "<|begin_of_text|>", "<|end_of_text|>").unwrap();
        let prompt = chat.render("S", "  U  ").unwrap();
        assert!(prompt.starts_with("<|begin_of_text|><|start_header_id|>system"));
        assert!(prompt.contains("<|end_header_id|>\n\nU<|eot_id|>"));
        assert!(prompt.ends_with("<|start_header_id|>assistant<|end_header_id|>\n\n"));
        assert_eq!(chat.end_of_turn(), "<|eot_id|>");
    }

    #[test]
    fn a_template_without_a_system_role_gets_it_in_the_user_message() {
        let chat = ChatTemplate::new(Some(NO_SYSTEM), "<bos>", "<eos>").unwrap();
        assert_eq!(
            chat.render("Be brief.", "Summarize: x").unwrap(),
            "<start_of_turn>user\nBe brief.\n\nSummarize: x<end_of_turn>\n<start_of_turn>model\n"
        );
        assert_eq!(chat.end_of_turn(), "<end_of_turn>");
    }

    #[test]
    fn the_end_of_sequence_token_ends_turns_the_template_leaves_open() {
        let open = "{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}";
        let chat = ChatTemplate::new(Some(open), "", "</s>").unwrap();
        assert_eq!(chat.end_of_turn(), "</s>");
    }

    #[test]
    fn broken_templates_are_errors() {
        for bad in ["{% for m in messages %}", "{{ raise_exception('no') }}"] {
            let err = ChatTemplate::new(Some(bad), "", "").unwrap_err();
            assert!(err.to_string().contains("chat template"), "{err}");
        }
    }
}
