//! How to cut the KV sequence into splits.
//!
//! Decode attention has one query row per head, so the only parallelism is over
//! `(batch, kv head)` pairs. When there are fewer pairs than the hardware can run at once, the KV
//! sequence is cut into contiguous chunks ("splits") that run in parallel and are merged afterwards
//! through their log-sum-exps. The same plan drives the CPU (workers = threads) and CUDA paths
//! (workers = one CTA per SM for the tensor-core kernels, every resident CTA for the others).

/// Chunks never get shorter than this: below it the per-split fixed cost (setup, partial write,
/// merge) outweighs the parallelism gained.
pub const MIN_CHUNK: usize = 256;

/// Chunk lengths are rounded up to a multiple of this, so that every split but the last streams
/// whole tiles.
pub const CHUNK_ALIGN: usize = 64;

/// Upper bound on the number of splits, which bounds the scratch buffer.
pub const MAX_SPLITS: usize = 256;

/// The result of [`plan`]: `num_splits` chunks of `chunk_size` positions each, the last one
/// possibly shorter. `num_splits * chunk_size >= seq_len`, and no split is entirely empty unless
/// `seq_len == 0`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SplitPlan {
    pub num_splits: usize,
    pub chunk_size: usize,
}

/// Chooses a split count for `batch * kv_heads` independent units over `seq_len` positions on
/// hardware that runs `parallel_slots` units at once.
///
/// - No split when the units alone fill the slots, or when the sequence is at most one chunk.
/// - Otherwise as many splits as fit in one wave of the slots, with chunks of at least
///   [`MIN_CHUNK`] positions, rounded to [`CHUNK_ALIGN`], and at most [`MAX_SPLITS`] splits.
#[cfg(test)]
pub fn plan(batch: usize, kv_heads: usize, seq_len: usize, parallel_slots: usize) -> SplitPlan {
    plan_with_min_chunk(batch, kv_heads, seq_len, parallel_slots, MIN_CHUNK)
}

/// [`plan`] with another floor than [`MIN_CHUNK`] on the chunk length, for backends whose
/// per-split cost is lower (at least [`CHUNK_ALIGN`]).
pub fn plan_with_min_chunk(
    batch: usize,
    kv_heads: usize,
    seq_len: usize,
    parallel_slots: usize,
    min_chunk: usize,
) -> SplitPlan {
    let min_chunk = min_chunk.max(CHUNK_ALIGN);
    let units = (batch * kv_heads).max(1);
    let slots = parallel_slots.max(1);
    if seq_len <= min_chunk || units >= slots {
        return SplitPlan {
            num_splits: 1,
            chunk_size: seq_len.max(1),
        };
    }
    // Round down: one more split than fits would start a second, nearly empty wave.
    let wanted = (slots / units).clamp(1, MAX_SPLITS);
    chunked(seq_len, wanted, min_chunk)
}

/// The plan for a split count forced by the caller: `num_splits` is clamped to what the sequence
/// allows (at least one position per split), and the chunk size follows.
pub fn forced(seq_len: usize, num_splits: usize) -> SplitPlan {
    let splits = num_splits.clamp(1, seq_len.max(1));
    let chunk_size = seq_len.div_ceil(splits).max(1);
    SplitPlan {
        num_splits: seq_len.div_ceil(chunk_size).max(1),
        chunk_size,
    }
}

/// `splits` chunks of [`CHUNK_ALIGN`]-rounded length over `seq_len` positions, or fewer where the
/// rounding leaves the last ones empty.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub fn aligned(seq_len: usize, splits: usize) -> SplitPlan {
    chunked(seq_len, splits.max(1), CHUNK_ALIGN)
}

/// CTAs of a persistent grid walking `items` work items on at most `resident` slots: as few
/// rounds of items as the slots allow, then as few CTAs as those rounds need, so that every CTA
/// walks the same number of items or one fewer (512 items on 264 slots: 256 CTAs of two items,
/// rather than 264 of which 16 walk one while the rest wait on their second).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub fn persistent_ctas(items: usize, resident: usize) -> usize {
    let rounds = items.div_ceil(resident.max(1)).max(1);
    items.div_ceil(rounds)
}

fn chunked(seq_len: usize, wanted_splits: usize, min_chunk: usize) -> SplitPlan {
    let chunk = seq_len.div_ceil(wanted_splits).max(min_chunk);
    let chunk_size = chunk.div_ceil(CHUNK_ALIGN) * CHUNK_ALIGN;
    let num_splits = seq_len.div_ceil(chunk_size);
    if num_splits > MAX_SPLITS {
        return chunked(seq_len, MAX_SPLITS, min_chunk);
    }
    SplitPlan {
        num_splits,
        chunk_size,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_rounds_chunks_and_drops_empty_splits() {
        assert_eq!(
            aligned(1024, 3),
            SplitPlan {
                num_splits: 3,
                chunk_size: 384
            }
        );
        // 100 / 3 rounds to one 64-position chunk and a shorter second one.
        assert_eq!(
            aligned(100, 3),
            SplitPlan {
                num_splits: 2,
                chunk_size: 64
            }
        );
        for (len, splits) in [(1, 1), (4096, 12), (131072, 7), (5000, 16)] {
            let p = aligned(len, splits);
            covers(p, len);
            assert!(p.num_splits <= splits);
            assert_eq!(p.chunk_size % CHUNK_ALIGN, 0);
        }
    }

    fn covers(p: SplitPlan, seq_len: usize) {
        assert!(p.num_splits >= 1);
        assert!(
            p.num_splits * p.chunk_size >= seq_len,
            "{p:?} does not cover {seq_len}"
        );
        if seq_len > 0 {
            assert!(
                (p.num_splits - 1) * p.chunk_size < seq_len,
                "{p:?} has an empty split for {seq_len}"
            );
        }
    }

    #[test]
    fn short_sequences_are_not_split() {
        for l in [0, 1, 2, 255, 256] {
            let p = plan(1, 1, l, 132);
            assert_eq!(p.num_splits, 1);
            covers(p, l);
        }
    }

    #[test]
    fn full_card_is_not_split() {
        let p = plan(64, 8, 131072, 264);
        assert_eq!(p.num_splits, 1);
        assert_eq!(p.chunk_size, 131072);
    }

    #[test]
    fn long_single_sequence_fills_the_slots() {
        let p = plan(1, 8, 131072, 264);
        assert_eq!(p.num_splits, 33);
        assert_eq!(p.chunk_size % CHUNK_ALIGN, 0);
        covers(p, 131072);
        assert!(8 * p.num_splits >= 264);
    }

    #[test]
    fn split_work_fits_in_one_wave() {
        for (b, h) in [(1, 8), (4, 8), (16, 8), (1, 32), (4, 32), (2, 3)] {
            let p = plan(b, h, 131072, 264);
            assert!(p.num_splits > 1, "{b}x{h} should split");
            assert!(
                b * h * p.num_splits <= 264,
                "{b}x{h}: {p:?} spills into a second wave"
            );
            assert!(
                b * h * (p.num_splits + 1) > 264,
                "{b}x{h}: {p:?} leaves a split's worth idle"
            );
        }
    }

    #[test]
    fn chunks_respect_the_minimum() {
        let p = plan(1, 1, 1000, 1000);
        assert!(p.chunk_size >= MIN_CHUNK);
        covers(p, 1000);
    }

    #[test]
    fn splits_are_capped() {
        let p = plan(1, 1, 10_000_000, 100_000);
        assert!(p.num_splits <= MAX_SPLITS);
        covers(p, 10_000_000);
    }

    #[test]
    fn every_plan_covers_its_sequence() {
        for b in [1, 2, 3, 16] {
            for h in [1, 2, 3, 8, 32] {
                for l in [1, 7, 257, 4097, 50000, 131072] {
                    for slots in [1, 2, 8, 132, 528] {
                        covers(plan(b, h, l, slots), l);
                    }
                }
            }
        }
    }

    #[test]
    fn persistent_grids_balance_their_rounds() {
        assert_eq!(persistent_ctas(512, 264), 256);
        assert_eq!(persistent_ctas(512, 132), 128);
        assert_eq!(persistent_ctas(2048, 132), 128);
        assert_eq!(persistent_ctas(100, 132), 100);
        assert_eq!(persistent_ctas(0, 132), 0);
        for items in 1..2000 {
            for resident in [1, 7, 132, 264] {
                let ctas = persistent_ctas(items, resident);
                assert!(
                    ctas >= 1 && ctas <= resident.min(items),
                    "{items} on {resident}"
                );
                // The same rounds as the widest grid, and no CTA idle in the last round but one.
                let rounds = items.div_ceil(resident);
                assert_eq!(items.div_ceil(ctas), rounds, "{items} on {resident}");
                assert!(items > (rounds - 1) * ctas, "{items} on {resident}");
            }
        }
    }

    #[test]
    fn forced_plans_cover_and_clamp() {
        for l in [1, 2, 255, 256, 257, 4097] {
            for n in 1..=64 {
                let p = forced(l, n);
                covers(p, l);
                assert!(p.num_splits <= n.max(1));
            }
        }
        assert_eq!(forced(0, 5).num_splits, 1);
    }
}
