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
    let scores = without_recency(&scores, &pool_tokens_of(&starts, encoding.get_offsets()));
    Ok(ModelSalience::new(
        pool.iter().map(|s| s.position).zip(scores),
    ))
}

/// Tokens of each sentence, by where each starts in the text.
fn pool_tokens_of(starts: &[usize], offsets: &[(usize, usize)]) -> Vec<f64> {
    let mut tokens = vec![0.0; starts.len()];
    for &(start, _) in offsets {
        let sentence = starts.partition_point(|&s| s <= start).saturating_sub(1);
        tokens[sentence] += 1.0;
    }
    tokens
}

/// Sentences this many either side make the attention a sentence gets for its place alone.
const RECENCY_WINDOW: usize = 5;

/// The instruction attends most to the sentences nearest it (on the explainer, half its weight
/// falls on the last tenth of them): each sentence's attention per token over the mean of its
/// neighbours', times its tokens, so that what is left is its content, not its place.
fn without_recency(scores: &[f64], tokens: &[f64]) -> Vec<f64> {
    let density: Vec<f64> = scores
        .iter()
        .zip(tokens)
        .map(|(s, t)| s / t.max(1.0))
        .collect();
    (0..density.len())
        .map(|i| {
            let near = &density
                [i.saturating_sub(RECENCY_WINDOW)..(i + RECENCY_WINDOW + 1).min(density.len())];
            let trend = near.iter().sum::<f64>() / near.len() as f64;
            if trend > 0.0 {
                density[i] / trend * tokens[i]
            } else {
                0.0
            }
        })
        .collect()
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
    fn attention_that_grows_with_position_alone_is_taken_out() {
        // Attention per token rising sentence by sentence says nothing of any of them; one
        // sentence with three times its neighbours' stands out.
        let tokens = [10.0; 12];
        let rising: Vec<f64> = (0..12).map(|i| 10.0 * 1.1f64.powi(i)).collect();
        let flat = without_recency(&rising, &tokens);
        let spread = flat.iter().cloned().fold(0.0, f64::max)
            - flat.iter().cloned().fold(f64::MAX, f64::min);
        // Mostly: at the ends the neighbours lie on one side only.
        let raw = rising[11] - rising[0];
        assert!(spread < 0.3 * raw, "{flat:?}");
        let mut peaked = vec![10.0; 12];
        peaked[6] = 30.0;
        let adjusted = without_recency(&peaked, &tokens);
        assert!(adjusted[6] > 2.0 * adjusted[0], "{adjusted:?}");
        assert_eq!(without_recency(&[0.0, 0.0], &[3.0, 4.0]), [0.0, 0.0]);
    }

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
