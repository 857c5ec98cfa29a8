//! A salience signal from outside the text, such as a model's: a score for some sentences of a
//! document, which selection weighs beside centrality and new facts. The sentences it may score
//! are a pool the text's own salience picks first ([`sentence_pool`](crate::sentence_pool)), so
//! that a model reads a bounded number of tokens whatever the document's length.

use std::collections::HashMap;

/// Scores of some sentences of a document, by their place among its sentences. Selection then
/// picks among these sentences only, each weighed by its score over the mean score (see
/// [`MapReduce::with_model_salience`](crate::MapReduce::with_model_salience)).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ModelSalience {
    scores: HashMap<usize, f64>,
}

impl ModelSalience {
    /// Scores of the sentences at `positions`; a score that is not finite and positive counts
    /// as none.
    pub fn new(scores: impl IntoIterator<Item = (usize, f64)>) -> Self {
        Self {
            scores: scores
                .into_iter()
                .filter(|(_, score)| score.is_finite() && *score > 0.0)
                .collect(),
        }
    }

    /// The score of the sentence at `position`, if it has one.
    pub fn score(&self, position: usize) -> Option<f64> {
        self.scores.get(&position).copied()
    }

    /// Whether no sentence is scored.
    pub fn is_empty(&self) -> bool {
        self.scores.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scores_that_are_not_finite_and_positive_are_none() {
        let salience = ModelSalience::new([(0, 2.0), (1, 0.0), (2, f64::NAN), (3, -1.0)]);
        assert_eq!(salience.score(0), Some(2.0));
        assert_eq!(salience.score(1), None);
        assert_eq!(salience.score(2), None);
        assert_eq!(salience.score(3), None);
        assert_eq!(salience.score(4), None);
        assert!(ModelSalience::new([(5, f64::INFINITY)]).is_empty());
    }
}
