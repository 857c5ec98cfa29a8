//! How central each sentence of a text is: the stationary distribution of a random walk over a
//! graph of sentences joined by how alike they are (PageRank). Two published weightings:
//! LexRank (Erkan and Radev, 2004) joins sentences by the cosine of their TF-IDF vectors;
//! TextRank (Mihalcea and Tarau, 2004) by the words they share, over the logs of their lengths.

use std::collections::HashMap;

use super::contract::{content_keys, is_cjk};

/// The probability of following an edge rather than jumping to any sentence.
const DAMPING: f64 = 0.85;
/// Power iterations stop when no score moves by more than this.
const TOLERANCE: f64 = 1e-7;
const MAX_ITERATIONS: usize = 200;

/// The terms of a sentence: its content words (as `content_keys` finds them), and for text written
/// without spaces, each pair of neighbouring characters as well (a Chinese word is mostly two).
pub fn terms(sentence: &str) -> Vec<String> {
    let keys = content_keys(sentence);
    let cjk = |key: &str| key.chars().next().is_some_and(is_cjk);
    let pairs: Vec<String> = keys
        .windows(2)
        .filter(|pair| cjk(&pair[0]) && cjk(&pair[1]))
        .map(|pair| format!("{}{}", pair[0], pair[1]))
        .collect();
    keys.into_iter().chain(pairs).collect()
}

/// The TF-IDF vectors of `sentences` (lists of terms), each scaled to length 1, as sorted
/// (term index, weight) pairs.
pub fn tfidf_vectors(sentences: &[Vec<String>]) -> Vec<Vec<(usize, f64)>> {
    weighted_vectors(sentences, 1.0)
}

/// TF-IDF vectors whose inverse frequency is `ln(n / df) + smoothing`.
fn weighted_vectors(sentences: &[Vec<String>], smoothing: f64) -> Vec<Vec<(usize, f64)>> {
    let mut index: HashMap<&str, usize> = HashMap::new();
    let mut document_frequency: Vec<usize> = Vec::new();
    let ids: Vec<Vec<usize>> = sentences
        .iter()
        .map(|terms| {
            let mut ids: Vec<usize> = terms
                .iter()
                .map(|term| {
                    let next = index.len();
                    let id = *index.entry(term).or_insert(next);
                    if id == document_frequency.len() {
                        document_frequency.push(0);
                    }
                    id
                })
                .collect();
            ids.sort_unstable();
            let mut distinct = ids.clone();
            distinct.dedup();
            for &id in &distinct {
                document_frequency[id] += 1;
            }
            ids
        })
        .collect();
    let n = sentences.len() as f64;
    ids.into_iter()
        .map(|ids| {
            let mut vector: Vec<(usize, f64)> = Vec::new();
            for id in ids {
                match vector.last_mut() {
                    Some((last, weight)) if *last == id => *weight += 1.0,
                    _ => vector.push((id, 1.0)),
                }
            }
            for (id, weight) in &mut vector {
                *weight *= (n / document_frequency[*id] as f64).ln() + smoothing;
            }
            let norm = vector.iter().map(|(_, w)| w * w).sum::<f64>().sqrt();
            if norm > 0.0 {
                vector.iter_mut().for_each(|(_, w)| *w /= norm);
            }
            vector
        })
        .collect()
}

/// The cosine of two vectors of [`tfidf_vectors`].
pub fn cosine(a: &[(usize, f64)], b: &[(usize, f64)]) -> f64 {
    let (mut i, mut j, mut sum) = (0, 0, 0.0);
    while i < a.len() && j < b.len() {
        match a[i].0.cmp(&b[j].0) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => {
                sum += a[i].1 * b[j].1;
                i += 1;
                j += 1;
            }
        }
    }
    sum
}

/// LexRank: the stationary distribution of a walk over the TF-IDF cosine graph of `sentences`.
/// Without a threshold, every pair is joined by its cosine and the walk is PageRank's (continuous
/// LexRank, as selection uses it). With a `threshold`, as the published method and its Python
/// package compute it: inverse frequencies `ln(n / df)`, each sentence joined to itself and to
/// every sentence whose cosine exceeds the threshold with equal weight, and the distribution
/// found by the power method in each connected part of the graph, scaled to the part's size.
pub fn lexrank(sentences: &[Vec<String>], threshold: Option<f64>) -> Vec<f64> {
    let Some(threshold) = threshold else {
        let vectors = tfidf_vectors(sentences);
        let n = vectors.len();
        let mut weights = vec![vec![0.0; n]; n];
        for i in 0..n {
            for j in i + 1..n {
                let similarity = cosine(&vectors[i], &vectors[j]);
                weights[i][j] = similarity;
                weights[j][i] = similarity;
            }
        }
        return pagerank(&weights);
    };
    let vectors = weighted_vectors(sentences, 0.0);
    let n = vectors.len();
    let neighbours: Vec<Vec<usize>> = (0..n)
        .map(|i| {
            (0..n)
                .filter(|&j| i == j || cosine(&vectors[i], &vectors[j]) > threshold)
                .collect()
        })
        .collect();
    let mut scores = vec![0.0; n];
    let mut part = vec![usize::MAX; n];
    for start in 0..n {
        if part[start] != usize::MAX {
            continue;
        }
        // The connected part of `start`.
        let mut members = vec![start];
        part[start] = start;
        let mut at = 0;
        while at < members.len() {
            for &j in &neighbours[members[at]] {
                if part[j] == usize::MAX {
                    part[j] = start;
                    members.push(j);
                }
            }
            at += 1;
        }
        let mut x: Vec<f64> = vec![1.0; n];
        for _ in 0..MAX_ITERATIONS * 5 {
            let mut next = vec![0.0; n];
            for &i in &members {
                let share = x[i] / neighbours[i].len() as f64;
                for &j in &neighbours[i] {
                    next[j] += share;
                }
            }
            let moved = members
                .iter()
                .map(|&i| (next[i] - x[i]).abs())
                .fold(0.0, f64::max);
            x = next;
            if moved < TOLERANCE {
                break;
            }
        }
        for &i in &members {
            scores[i] = x[i];
        }
    }
    scores
}

/// TextRank: PageRank over the graph of `sentences` joined by the Mihalcea-Tarau similarity, the
/// number of terms two sentences share over the sum of the logs of their lengths.
pub fn textrank(sentences: &[Vec<String>]) -> Vec<f64> {
    let sets: Vec<std::collections::HashSet<&str>> = sentences
        .iter()
        .map(|terms| terms.iter().map(String::as_str).collect())
        .collect();
    let n = sets.len();
    let mut weights = vec![vec![0.0; n]; n];
    for i in 0..n {
        for j in i + 1..n {
            let (a, b) = (sentences[i].len(), sentences[j].len());
            let logs = (a as f64).ln() + (b as f64).ln();
            if a < 2 || b < 2 || logs <= 0.0 {
                continue;
            }
            let shared = sets[i].intersection(&sets[j]).count() as f64;
            weights[i][j] = shared / logs;
            weights[j][i] = shared / logs;
        }
    }
    pagerank(&weights)
}

/// The PageRank scores of the nodes of the weighted undirected graph `weights`: a walk follows
/// an edge in proportion to its weight with probability [`DAMPING`], else jumps to any node; a
/// node with no edge jumps. The scores add up to 1.
pub(crate) fn pagerank(weights: &[Vec<f64>]) -> Vec<f64> {
    let n = weights.len();
    if n == 0 {
        return Vec::new();
    }
    let out: Vec<f64> = weights.iter().map(|row| row.iter().sum()).collect();
    let mut scores = vec![1.0 / n as f64; n];
    for _ in 0..MAX_ITERATIONS {
        // What nodes without edges hand out, spread over all.
        let dangling: f64 = (0..n).filter(|&j| out[j] == 0.0).map(|j| scores[j]).sum();
        let base = (1.0 - DAMPING) / n as f64 + DAMPING * dangling / n as f64;
        let next: Vec<f64> = (0..n)
            .map(|i| {
                let inflow: f64 = (0..n)
                    .filter(|&j| out[j] > 0.0 && weights[j][i] > 0.0)
                    .map(|j| scores[j] * weights[j][i] / out[j])
                    .sum();
                base + DAMPING * inflow
            })
            .collect();
        let moved = next
            .iter()
            .zip(&scores)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        scores = next;
        if moved < TOLERANCE {
            break;
        }
    }
    scores
}

#[cfg(test)]
mod tests {
    use super::*;

    fn terms_of(text: &[&str]) -> Vec<Vec<String>> {
        text.iter().map(|sentence| terms(sentence)).collect()
    }

    #[test]
    fn the_sentence_most_like_the_others_ranks_first() {
        let sentences = terms_of(&[
            "The tidal barrier protects the town from storm surges.",
            "The barrier closed twice during storm surges last winter.",
            "Storm surges flooded the town before the barrier existed.",
            "A bakery opened on the high street.",
        ]);
        for scores in [lexrank(&sentences, None), textrank(&sentences)] {
            let best = (0..4)
                .max_by(|&a, &b| scores[a].total_cmp(&scores[b]))
                .unwrap();
            assert_ne!(best, 3, "{scores:?}");
            assert!(scores[3] < scores[0], "{scores:?}");
            assert!(scores.iter().all(|s| s.is_finite() && *s >= 0.0));
        }
    }

    #[test]
    fn thresholded_lexrank_scores_each_connected_part_by_its_links() {
        // 0-1-2 a chain, 3 alone: the middle of the chain gets the most, a sentence alone 1.
        let sentences: Vec<Vec<String>> = [
            "alpha beta gamma",
            "gamma delta epsilon",
            "epsilon zeta eta",
            "theta iota kappa",
        ]
        .iter()
        .map(|s| s.split(' ').map(String::from).collect())
        .collect();
        let scores = lexrank(&sentences, Some(0.1));
        assert!(scores[1] > scores[0] && scores[1] > scores[2], "{scores:?}");
        assert!((scores[3] - 1.0).abs() < 1e-6, "{scores:?}");
        assert!(
            (scores[..3].iter().sum::<f64>() - 3.0).abs() < 1e-6,
            "{scores:?}"
        );
    }

    #[test]
    fn cjk_terms_include_character_pairs() {
        assert_eq!(
            terms("缓存切分"),
            ["缓", "存", "切", "分", "缓存", "存切", "切分"]
        );
    }

    #[test]
    fn no_sentences_no_scores() {
        assert!(lexrank(&[], None).is_empty());
        assert!(pagerank(&[]).is_empty());
    }
}
