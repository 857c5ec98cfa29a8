//! The rules that decide which drafted tokens the target model keeps.
//!
//! Greedy: keep the longest prefix of drafts that equals the target's most likely token, then
//! emit the target's own choice at the first mismatch (or after the last draft); the output is
//! exactly plain greedy decoding. Sampling: keep draft `x` with probability
//! `min(1, p(x) / q(x))`; at the first rejection draw from `norm(max(0, p − q))`, and after the
//! last draft from `p`. The emitted tokens are then distributed as sampling from `p` alone
//! (Leviathan et al., 2023; Chen et al., 2023). A deterministic drafter has `q = onehot(x)`.

use candle_core::{bail, Result};
use rand::Rng;

/// How the target model picks its tokens.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Sampling {
    /// The most likely token every time.
    Greedy,
    /// Softmax of the logits divided by the temperature (> 0).
    Temperature(f64),
    /// [`Sampling::Temperature`] restricted to the `top_k` most likely tokens, then to the most
    /// likely ones whose probabilities add up to `top_p` (either may be absent), renormalized.
    Truncated {
        temperature: f64,
        top_k: Option<usize>,
        top_p: Option<f64>,
    },
}

impl Sampling {
    /// The distribution tokens are drawn from after `logits`; `None` for greedy decoding.
    pub(crate) fn distribution(self, logits: &[f32]) -> Result<Option<Vec<f64>>> {
        match self {
            Sampling::Greedy => Ok(None),
            Sampling::Temperature(t) => probabilities(logits, t).map(Some),
            Sampling::Truncated {
                temperature,
                top_k,
                top_p,
            } => {
                let p = probabilities(logits, temperature)?;
                truncated(p, top_k, top_p).map(Some)
            }
        }
    }

    /// Checks the temperature, `top_k ≥ 1` and `top_p` in (0, 1].
    pub(crate) fn check(self) -> Result<()> {
        let (temperature, top_k, top_p) = match self {
            Sampling::Greedy => return Ok(()),
            Sampling::Temperature(t) => (t, None, None),
            Sampling::Truncated {
                temperature,
                top_k,
                top_p,
            } => (temperature, top_k, top_p),
        };
        if !(temperature > 0.0 && temperature.is_finite()) {
            bail!("speculative decoding: the temperature must be positive, got {temperature}")
        }
        if top_k == Some(0) {
            bail!("speculative decoding: top_k must be at least 1")
        }
        if let Some(p) = top_p {
            if !(p > 0.0 && p <= 1.0) {
                bail!("speculative decoding: top_p must be in (0, 1], got {p}")
            }
        }
        Ok(())
    }
}

/// `p` kept on its `top_k` most likely tokens, then on the most likely ones whose probabilities
/// add up to `top_p` of what is left (at least one), renormalized.
fn truncated(mut p: Vec<f64>, top_k: Option<usize>, top_p: Option<f64>) -> Result<Vec<f64>> {
    Sampling::Truncated {
        temperature: 1.0,
        top_k,
        top_p,
    }
    .check()?;
    let mut order: Vec<usize> = (0..p.len()).collect();
    order.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
    let mut keep = top_k.unwrap_or(p.len()).min(p.len());
    if let Some(top_p) = top_p {
        let total: f64 = order[..keep].iter().map(|&i| p[i]).sum();
        let mut sum = 0.0;
        let mut within = 0;
        for &i in &order[..keep] {
            within += 1;
            sum += p[i];
            if sum >= top_p * total {
                break;
            }
        }
        keep = within.max(1);
    }
    for &i in &order[keep..] {
        p[i] = 0.0;
    }
    let total: f64 = p.iter().sum();
    p.iter_mut().for_each(|x| *x /= total);
    Ok(p)
}

/// The target's choice after one verification pass: how many drafts it keeps, and the token it
/// emits after them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Verdict {
    pub accepted: usize,
    pub next: u32,
}

/// The index of the largest logit (the first of equal ones).
pub(crate) fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// `softmax(logits / temperature)`, in f64.
pub(crate) fn probabilities(logits: &[f32], temperature: f64) -> Result<Vec<f64>> {
    if !(temperature > 0.0 && temperature.is_finite()) {
        bail!("speculative decoding: the temperature must be positive, got {temperature}")
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    if !max.is_finite() {
        bail!("speculative decoding: the logits have no finite maximum")
    }
    let mut p: Vec<f64> = logits
        .iter()
        .map(|&x| ((x as f64 - max) / temperature).exp())
        .collect();
    let total: f64 = p.iter().sum();
    p.iter_mut().for_each(|x| *x /= total);
    Ok(p)
}

/// A token drawn from the distribution `weights` (non-negative, not all zero).
pub(crate) fn draw_from(weights: &[f64], rng: &mut impl Rng) -> Result<u32> {
    let total: f64 = weights.iter().sum();
    if !(total > 0.0 && total.is_finite()) {
        bail!("speculative decoding: nothing to sample from (total weight {total})")
    }
    let mut r = rng.random::<f64>() * total;
    for (i, &w) in weights.iter().enumerate() {
        if r < w {
            return Ok(i as u32);
        }
        r -= w;
    }
    // Rounding can leave r a hair above the last weight: take the last token with weight.
    let last = weights.iter().rposition(|&w| w > 0.0).unwrap_or(0);
    Ok(last as u32)
}

/// Verifies `drafts` against the target's logits: `target[i]` are the logits after the context
/// and the first `i` drafts, `drafts.len() + 1` rows of them. `draft_probs[i]`, where given,
/// is the drafter's distribution when it proposed `drafts[i]`; without it the drafter is taken
/// as deterministic.
pub(crate) fn verify(
    drafts: &[u32],
    draft_probs: Option<&[Vec<f64>]>,
    target: &[Vec<f32>],
    sampling: Sampling,
    rng: &mut impl Rng,
) -> Result<Verdict> {
    if target.len() != drafts.len() + 1 {
        bail!(
            "speculative decoding: {} drafts need {} rows of target logits, got {}",
            drafts.len(),
            drafts.len() + 1,
            target.len()
        )
    }
    if let Some(q) = draft_probs {
        if q.len() != drafts.len() {
            bail!(
                "speculative decoding: {} drafts came with {} distributions",
                drafts.len(),
                q.len()
            )
        }
    }
    let vocab = target[0].len();
    if let Some(&bad) = drafts.iter().find(|&&d| d as usize >= vocab) {
        bail!("speculative decoding: drafted token {bad} is outside the vocabulary ({vocab})")
    }
    if sampling == Sampling::Greedy {
        let accepted = drafts
            .iter()
            .enumerate()
            .take_while(|&(i, &d)| argmax(&target[i]) == d)
            .count();
        return Ok(Verdict {
            accepted,
            next: argmax(&target[accepted]),
        });
    }
    let distribution = |logits: &[f32]| -> Result<Vec<f64>> {
        match sampling.distribution(logits)? {
            Some(p) => Ok(p),
            None => bail!("speculative decoding: greedy sampling has no distribution"),
        }
    };
    for (i, &d) in drafts.iter().enumerate() {
        let p = distribution(&target[i])?;
        let q_d = draft_probs.map_or(1.0, |q| q[i][d as usize]);
        let keep = if q_d > 0.0 {
            (p[d as usize] / q_d).min(1.0)
        } else {
            1.0
        };
        if rng.random::<f64>() < keep {
            continue;
        }
        // Rejected: draw from the part of p that q does not cover.
        let residual: Vec<f64> = match draft_probs {
            Some(q) => p.iter().zip(&q[i]).map(|(p, q)| (p - q).max(0.0)).collect(),
            None => {
                let mut r = p.clone();
                r[d as usize] = 0.0;
                r
            }
        };
        let next = if residual.iter().sum::<f64>() > 0.0 {
            draw_from(&residual, rng)?
        } else {
            draw_from(&p, rng)? // p equals q here: any draw from p is exact
        };
        return Ok(Verdict { accepted: i, next });
    }
    let p = distribution(&target[drafts.len()])?;
    Ok(Verdict {
        accepted: drafts.len(),
        next: draw_from(&p, rng)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, SeedableRng};

    #[test]
    fn greedy_keeps_the_prefix_the_target_agrees_with() -> Result<()> {
        let mut rng = StdRng::seed_from_u64(1);
        // The target's argmax after each prefix: 2, 0, 3, 1.
        let target = vec![
            vec![0.0, 1.0, 5.0, 0.0],
            vec![4.0, 1.0, 0.0, 0.0],
            vec![0.0, 1.0, 0.0, 2.0],
            vec![0.0, 9.0, 0.0, 2.0],
        ];
        let v = verify(&[2, 0, 1], None, &target, Sampling::Greedy, &mut rng)?;
        assert_eq!(
            v,
            Verdict {
                accepted: 2,
                next: 3
            }
        );
        let v = verify(&[2, 0, 3], None, &target, Sampling::Greedy, &mut rng)?;
        assert_eq!(
            v,
            Verdict {
                accepted: 3,
                next: 1
            }
        );
        let v = verify(&[1, 0, 3], None, &target, Sampling::Greedy, &mut rng)?;
        assert_eq!(
            v,
            Verdict {
                accepted: 0,
                next: 2
            }
        );
        let v = verify(&[], None, &target[..1], Sampling::Greedy, &mut rng)?;
        assert_eq!(
            v,
            Verdict {
                accepted: 0,
                next: 2
            }
        );
        Ok(())
    }

    /// The first emitted token's frequencies over many trials against the target's p.
    fn first_token_frequencies(draft_q: Option<Vec<f64>>, seed: u64) -> Result<Vec<f64>> {
        let logits = vec![vec![1.0f32, 0.2, -0.5, 2.0], vec![0.0; 4]];
        let mut rng = StdRng::seed_from_u64(seed);
        let trials = 200_000;
        let mut counts = [0usize; 4];
        for _ in 0..trials {
            // The drafter proposes from q when it has one (else always token 0).
            let (draft, probs) = match &draft_q {
                Some(q) => (draw_from(q, &mut rng)?, Some(vec![q.clone()])),
                None => (0, None),
            };
            let v = verify(
                &[draft],
                probs.as_deref(),
                &logits,
                Sampling::Temperature(0.7),
                &mut rng,
            )?;
            let first = if v.accepted == 1 { draft } else { v.next };
            counts[first as usize] += 1;
        }
        Ok(counts.iter().map(|&c| c as f64 / trials as f64).collect())
    }

    #[test]
    fn sampling_keeps_the_target_distribution() -> Result<()> {
        let p = probabilities(&[1.0, 0.2, -0.5, 2.0], 0.7)?;
        let drafters = [
            None,
            Some(vec![0.25, 0.25, 0.25, 0.25]),
            Some(vec![0.7, 0.1, 0.1, 0.1]),
            Some(vec![0.0, 0.0, 0.5, 0.5]),
        ];
        for (i, q) in drafters.into_iter().enumerate() {
            let freq = first_token_frequencies(q.clone(), i as u64)?;
            for (f, want) in freq.iter().zip(&p) {
                // 200k trials: a standard error under 0.0012.
                assert!((f - want).abs() < 0.006, "drafter {q:?}: {freq:?} vs {p:?}");
            }
        }
        Ok(())
    }

    /// Top-k then top-p keeps the most likely tokens, renormalized, and speculative sampling
    /// under it emits tokens distributed as that truncated distribution.
    #[test]
    fn truncated_sampling_keeps_the_truncated_distribution() -> Result<()> {
        let logits = [1.0, 0.2, -0.5, 2.0, 0.9];
        let sampling = Sampling::Truncated {
            temperature: 0.7,
            top_k: Some(4),
            top_p: Some(0.8),
        };
        let want = sampling.distribution(&logits)?.expect("a distribution");
        // Token 2 is past the top 4, and the top-p cut drops at least the least likely kept one.
        assert_eq!(want[2], 0.0);
        assert!((want.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        assert!(want.iter().filter(|&&p| p > 0.0).count() < 4);
        let mut rng = StdRng::seed_from_u64(11);
        let target = vec![logits.to_vec(), logits.to_vec()];
        let n = 40_000;
        let mut counts = [0usize; 5];
        for _ in 0..n {
            // A deterministic draft of token 0, which the truncated distribution may reject.
            let v = verify(&[0], None, &target, sampling, &mut rng)?;
            let first = if v.accepted == 1 { 0 } else { v.next };
            counts[first as usize] += 1;
        }
        for (c, p) in counts.iter().zip(&want) {
            let got = *c as f64 / n as f64;
            assert!((got - p).abs() < 0.01, "frequency {got} against {p}");
        }
        let bad = Sampling::Truncated {
            temperature: 0.7,
            top_k: Some(0),
            top_p: None,
        };
        assert!(bad.check().is_err());
        Ok(())
    }

    #[test]
    fn bad_inputs_are_errors() {
        let mut rng = StdRng::seed_from_u64(3);
        let target = vec![vec![0.0f32; 4]; 2];
        assert!(verify(&[1, 2], None, &target, Sampling::Greedy, &mut rng).is_err());
        assert!(verify(&[9], None, &target, Sampling::Greedy, &mut rng).is_err());
        assert!(verify(&[1], None, &target, Sampling::Temperature(0.0), &mut rng).is_err());
        assert!(verify(&[1], Some(&[]), &target, Sampling::Greedy, &mut rng).is_err());
    }
}
