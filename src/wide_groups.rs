//! Query groups wider than a CUDA block holds: multi-query models such as Falcon-7B (71 query
//! heads on one kv head) or gpt_bigcode (48).
//!
//! A block of the CUDA kernels holds up to [`MAX_GROUP`] query heads of one kv head, the M
//! dimension of its tensor-core tiles. A wider group runs as `⌈group / MAX_GROUP⌉` blocks of
//! query heads per kv head, which the kernels treat as kv heads of their own that read the same
//! K and V, so one launch covers every group. Blocks must hold equal numbers of query heads, so a
//! group they do not divide is padded with zero query heads whose outputs are dropped.

use candle_core::{bail, Result};

use crate::validate::DecodeDims;

/// Query heads one CUDA block holds at most: the largest compiled group bucket.
pub(crate) const MAX_GROUP: usize = 16;

/// Blocks that one kv head with `group` query heads runs as.
fn blocks_per_kv_head(group: usize) -> usize {
    group.div_ceil(MAX_GROUP).max(1)
}

/// Query heads of one kv head after padding: the smallest multiple of its blocks that holds the
/// group (the group itself when they divide it).
pub(crate) fn padded_group(group: usize) -> usize {
    let blocks = blocks_per_kv_head(group);
    blocks * group.div_ceil(blocks)
}

/// Whether a group needs zero query heads added before the CUDA kernels can run it.
pub(crate) fn needs_padding(dims: &DecodeDims) -> bool {
    padded_group(dims.group_size()) != dims.group_size()
}

/// The sizes the kernels see, and the blocks per kv head: every kv head of a group (already
/// padded) wider than a block becomes its blocks, block `j` of kv head `h` holding query heads
/// `h * group + j * (group / blocks) ..` in order, which is how the kernels number the query
/// heads of a kv head. Groups within a block pass through with one block per kv head.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the CUDA launch is its caller
pub(crate) fn query_blocks(dims: DecodeDims) -> Result<(DecodeDims, usize)> {
    let group = dims.group_size();
    let blocks = blocks_per_kv_head(group);
    if !group.is_multiple_of(blocks) {
        bail!(
            "split-kv attention: a CUDA block holds up to {MAX_GROUP} query heads per kv head, and \
             {group} do not split into equal blocks; run it through SplitKvAttention::forward, \
             which pads the group to {}",
            padded_group(group)
        )
    }
    let kernel_dims = DecodeDims {
        kv_heads: dims.kv_heads * blocks,
        ..dims
    };
    Ok((kernel_dims, blocks))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dims(q_heads: usize, kv_heads: usize) -> DecodeDims {
        DecodeDims {
            batch: 2,
            q_heads,
            kv_heads,
            head_dim: 128,
            kv_len: 1000,
        }
    }

    #[test]
    fn groups_pad_to_equal_blocks() {
        // group → padded group (blocks × heads each)
        for (group, want) in [
            (1, 1),
            (16, 16),
            (17, 18),
            (20, 20),
            (32, 32),
            (33, 33),
            (48, 48),
            (71, 75),
            (128, 128),
            (129, 135),
        ] {
            let padded = padded_group(group);
            assert_eq!(padded, want, "group {group}");
            let blocks = blocks_per_kv_head(group);
            assert!(padded / blocks <= MAX_GROUP && padded - group < blocks);
            assert_eq!(needs_padding(&dims(group * 2, 2)), padded != group);
        }
    }

    #[test]
    fn wide_groups_become_blocks() -> Result<()> {
        // (q heads, kv heads) → (kernel kv heads, blocks per kv head)
        for (q_heads, kv_heads, want) in [
            (16, 1, (1, 1)),
            (32, 8, (8, 1)),
            (18, 1, (2, 2)),
            (48, 1, (3, 3)),
            (75, 1, (5, 5)),
            (64, 2, (4, 2)),
            (36, 2, (4, 2)),
            (1, 1, (1, 1)),
        ] {
            let (got, blocks) = query_blocks(dims(q_heads, kv_heads))?;
            assert_eq!((got.kv_heads, blocks), want, "{q_heads}/{kv_heads}");
            assert_eq!(got.q_heads, q_heads);
            assert!(got.group_size() <= MAX_GROUP);
        }
        // Unpadded: an error naming the way round.
        for (q_heads, kv_heads) in [(71, 1), (17, 1), (34, 2)] {
            let err = query_blocks(dims(q_heads, kv_heads)).unwrap_err();
            assert!(
                err.to_string().contains("SplitKvAttention::forward"),
                "{err}"
            );
        }
        Ok(())
    }
}
