//! [`MixedStep`]: one step of sequences that each bring their own number of new positions, made
//! by [`PagedKvCache::begin_mixed_step`](super::PagedKvCache::begin_mixed_step).

use candle_core::{Device, Result, Tensor};

use super::{PagedStep, SequenceId};

/// One step of sequences that each bring their own number of new positions: prompt chunks of
/// some beside one-token decode rows of others, so that the work done token by token (the
/// projections, the MLP) runs once over all of them.
///
/// The step's tokens are laid end to end, sequence by sequence in the step's order: sequence
/// `s` owns tokens `offset(s) .. offset(s) + counts()[s]`. Attention reads them by shape: the
/// sequences that bring the same count form a [`StepGroup`], a uniform [`PagedStep`] the op runs
/// in one call (all the one-token rows together), and [`MixedStep::order`] puts the groups'
/// outputs back in the step's token order.
#[derive(Debug, Clone)]
pub struct MixedStep {
    ids: Vec<SequenceId>,
    counts: Vec<usize>,
    /// Each sequence's length before the step: where its first new token sits.
    starts: Vec<usize>,
    groups: Vec<StepGroup>,
    order: Option<Tensor>,
}

/// The sequences of a [`MixedStep`] that bring the same number of new positions.
#[derive(Debug, Clone)]
pub struct StepGroup {
    /// A uniform step of the group's sequences, in the mixed step's order.
    pub step: PagedStep,
    /// u32 `(batch · t,)`: where each of the group's tokens sits among the mixed step's tokens,
    /// sequence by sequence.
    pub tokens: Tensor,
}

impl MixedStep {
    /// Puts together the uniform `steps` of the groups of `counts` (each group's sequences in
    /// the order of `counts`, the groups in the order their counts first appear); `starts` are
    /// the sequences' lengths before the step.
    pub(super) fn new(
        counts: &[(SequenceId, usize)],
        starts: Vec<usize>,
        steps: Vec<PagedStep>,
        device: &Device,
    ) -> Result<Self> {
        let mut offsets = Vec::with_capacity(counts.len());
        let mut total = 0;
        for (_, count) in counts {
            offsets.push(total);
            total += count;
        }
        let offset_of = |id: SequenceId| {
            counts
                .iter()
                .position(|(other, _)| *other == id)
                .map(|s| offsets[s])
        };
        // Where each token of the groups, laid end to end, comes from in the step.
        let mut gathered: Vec<u32> = Vec::with_capacity(total);
        let mut groups = Vec::with_capacity(steps.len());
        for step in steps {
            let mut tokens = Vec::with_capacity(step.batch() * step.t());
            for &id in step.ids() {
                let Some(offset) = offset_of(id) else {
                    candle_core::bail!("mixed step: sequence {id:?} of a group is not in the step")
                };
                tokens.extend((offset..offset + step.t()).map(|i| i as u32));
            }
            gathered.extend_from_slice(&tokens);
            let len = tokens.len();
            groups.push(StepGroup {
                step,
                tokens: Tensor::from_vec(tokens, len, device)?,
            });
        }
        let in_order = gathered.iter().enumerate().all(|(i, &t)| t as usize == i);
        let order = if in_order {
            None
        } else {
            let mut inverse = vec![0u32; total];
            for (position, &token) in gathered.iter().enumerate() {
                inverse[token as usize] = position as u32;
            }
            Some(Tensor::from_vec(inverse, total, device)?)
        };
        let (ids, counts): (Vec<SequenceId>, Vec<usize>) = counts.iter().copied().unzip();
        Ok(Self {
            ids,
            counts,
            starts,
            groups,
            order,
        })
    }

    /// The step's sequences, in its order.
    pub fn ids(&self) -> &[SequenceId] {
        &self.ids
    }

    /// The new positions each sequence brings, in the step's order.
    pub fn counts(&self) -> &[usize] {
        &self.counts
    }

    /// Sequences in the step.
    pub fn batch(&self) -> usize {
        self.ids.len()
    }

    /// New positions of all the sequences together.
    pub fn tokens(&self) -> usize {
        self.counts.iter().sum()
    }

    /// The position in its sequence of each of the step's tokens, in the step's token order.
    pub fn positions(&self) -> Vec<usize> {
        self.starts
            .iter()
            .zip(&self.counts)
            .flat_map(|(&start, &count)| start..start + count)
            .collect()
    }

    /// The index among the step's tokens of each sequence's last token.
    pub fn last_tokens(&self) -> Vec<usize> {
        self.counts
            .iter()
            .scan(0, |end, count| {
                *end += count;
                Some(*end - 1)
            })
            .collect()
    }

    /// The sequences grouped by the positions they bring, each group a uniform step.
    pub fn groups(&self) -> &[StepGroup] {
        &self.groups
    }

    /// u32 `(tokens,)`: for each of the step's tokens, its index among the groups' tokens laid
    /// end to end; `None` when the groups already hold them in the step's order.
    pub fn order(&self) -> Option<&Tensor> {
        self.order.as_ref()
    }
}
