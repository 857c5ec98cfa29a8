//! The model's salience of a document's sentences: how much attention an instruction to name
//! the document's most important facts, put after them, pays each sentence. The model reads the
//! sentences the text's own salience picks first (a pool of bounded length, so the cost does not
//! grow with the document), then the instruction; each sentence scores the attention weight the
//! instruction's tokens put on its tokens, summed over heads and the instruction's tokens and
//! averaged over layers (`Llama::forward_with_attention`).

use anyhow::{Context, Result};
use candle_core::{DType, Tensor};
use summarize::{sentence_pool, ModelSalience};

use crate::generation::Generator;

/// The instruction whose attention scores the sentences before it.
const INSTRUCTION: &str = "\n\nThe most important facts of this text are:";

/// The first tokens of the text take a large share of every layer's attention whatever they say
/// (an attention sink); they are left out of the scores.
const SINK_TOKENS: usize = 4;

/// The model's salience of the sentences of `document` that selection picks first, up to
/// `pool_tokens` of its tokens.
pub fn attention_salience(
    generator: &mut Generator,
    document: &str,
    pool_tokens: usize,
) -> Result<ModelSalience> {
    let tokenizer = generator.tokenizer();
    let pool = sentence_pool(tokenizer, document, pool_tokens)?;
    if pool.is_empty() {
        return Ok(ModelSalience::default());
    }
    // The pool as one text, one paragraph per sentence, with where each sentence starts.
    let mut text = String::new();
    let mut starts = Vec::with_capacity(pool.len());
    for sentence in &pool {
        if !text.is_empty() {
            text.push_str("\n\n");
        }
        starts.push(text.len());
        text.push_str(&sentence.text);
    }
    let encoding = tokenizer
        .encode(text.as_str(), false)
        .map_err(anyhow::Error::msg)
        .context("tokenizing the sentences to score")?;
    let instruction = tokenizer
        .encode(INSTRUCTION, false)
        .map_err(anyhow::Error::msg)
        .context("tokenizing the instruction")?;
    let tokens = encoding.get_ids();
    let room = generator.context_length().saturating_sub(instruction.len());
    let tokens = &tokens[..tokens.len().min(room)];
    let mass = generator.attention_to(tokens, instruction.get_ids())?;
    // Each token's mass goes to the sentence its text starts in.
    let mut scores = vec![0.0f64; pool.len()];
    for (token, (&(start, _), weight)) in encoding.get_offsets().iter().zip(&mass).enumerate() {
        if token < SINK_TOKENS {
            continue;
        }
        let sentence = starts.partition_point(|&s| s <= start).saturating_sub(1);
        scores[sentence] += f64::from(*weight);
    }
    Ok(ModelSalience::new(
        pool.iter().map(|s| s.position).zip(scores),
    ))
}

/// Per position of the cache, the attention weight the last `queries` rows put on it, summed
/// over heads and rows and averaged over `weights`' layers (each `(heads, rows, len)`).
pub fn attention_mass(weights: &[Tensor], queries: usize) -> Result<Vec<f32>> {
    let mut total: Option<Tensor> = None;
    for layer in weights {
        let rows = layer.dim(1)?;
        let mass = layer
            .narrow(1, rows - queries.min(rows), queries.min(rows))?
            .to_dtype(DType::F32)?
            .sum((0, 1))?;
        total = Some(match total {
            Some(t) => (t + mass)?,
            None => mass,
        });
    }
    let Some(total) = total else {
        return Ok(Vec::new());
    };
    Ok((total / weights.len() as f64)?.to_vec1::<f32>()?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn mass_sums_heads_and_rows_and_averages_layers() {
        // Two layers, two heads, two rows over three positions; the last row only.
        let a = Tensor::new(
            &[
                [[1.0f32, 0.0, 0.0], [0.5, 0.5, 0.0]],
                [[1.0, 0.0, 0.0], [0.0, 0.5, 0.5]],
            ],
            &Device::Cpu,
        )
        .unwrap();
        let b = Tensor::new(
            &[
                [[1.0f32, 0.0, 0.0], [0.0, 0.0, 1.0]],
                [[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]],
            ],
            &Device::Cpu,
        )
        .unwrap();
        let mass = attention_mass(&[a, b], 1).unwrap();
        assert_eq!(mass, [0.25, 0.5, 1.25]);
        assert!(attention_mass(&[], 1).unwrap().is_empty());
    }
}
