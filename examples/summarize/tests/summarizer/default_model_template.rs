//! The default model's own chat template (from its GGUF metadata), rendered with its special
//! tokens, gives the ChatML prompt and ends turns at `<|im_end|>`. Skipped with a notice when the
//! default model is not in its cache.

use anyhow::Result;
use candle_core::quantized::gguf_file;
use summarize::ChatTemplate;

use crate::common;

#[test]
fn the_default_models_template_renders_chatml() -> Result<()> {
    let Some(path) = common::cached_default_model() else {
        return Ok(());
    };
    let mut file = std::fs::File::open(&path)?;
    let content = gguf_file::Content::read(&mut file)?;
    let template = match content.metadata.get("tokenizer.chat_template") {
        Some(value) => Some(value.to_string()?.clone()),
        None => None,
    };
    assert!(template.is_some(), "the default model has no chat template");
    let chat = ChatTemplate::new(template.as_deref(), "<|im_start|>", "<|im_end|>")?;
    let (system, user) = ("Be brief.", "Summarize the text.");
    assert_eq!(
        chat.render(system, user)?,
        ChatTemplate::chatml().render(system, user)?
    );
    assert_eq!(chat.end_of_turn(), "<|im_end|>");
    Ok(())
}
