//! Query groups wider than a CUDA block holds: multi-query models such as Falcon-7B (71 query
//! heads on one kv head) or gpt_bigcode (48).
//!
//! A block of the CUDA kernels holds up to [`MAX_GROUP`] query heads of one kv head, the M
//! dimension of its tensor-core tiles. A wider group on a single kv head runs as
//! `⌈group / MAX_GROUP⌉` virtual kv heads that all read that head's K and V (a head stride of 0),
//! so one launch still covers it. Virtual heads must hold equal numbers of query heads, so a group
//! they do not divide is padded with zero query heads whose outputs are dropped. Wide groups over
//! several kv heads run one kv head per call.

use candle_core::{bail, Result};

use crate::validate::DecodeDims;

/// Query heads one CUDA block holds at most: the largest compiled group bucket.
pub(crate) const MAX_GROUP: usize = 16;

/// Whether these sizes need more than one block per kv head on CUDA.
pub(crate) fn is_wide(dims: &DecodeDims) -> bool {
    dims.group_size() > MAX_GROUP
}

/// Virtual kv heads that one kv head with `group` query heads runs as.
fn virtual_heads(group: usize) -> usize {
    group.div_ceil(MAX_GROUP).max(1)
}

/// Query heads of one kv head after padding: the smallest multiple of its virtual heads that holds
/// the group (the group itself when they divide it).
pub(crate) fn padded_group(group: usize) -> usize {
    let parts = virtual_heads(group);
    parts * group.div_ceil(parts)
}

/// The sizes the kernels see: a single kv head whose group (already padded) is wider than a block
/// becomes its virtual kv heads; query head `v * (group / parts) + i` is member `i` of virtual
/// head `v`, as the kernels number them. Sizes within a block pass through.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the CUDA launch is its caller
pub(crate) fn virtual_kv_heads(dims: DecodeDims) -> Result<DecodeDims> {
    let group = dims.group_size();
    if group <= MAX_GROUP {
        return Ok(dims);
    }
    let parts = virtual_heads(group);
    if dims.kv_heads != 1 || !group.is_multiple_of(parts) {
        bail!(
            "split-kv attention: a CUDA block holds up to {MAX_GROUP} query heads per kv head, got \
             {} query heads on {} kv heads; run it through SplitKvAttention::forward, which splits \
             wider groups into blocks",
            dims.q_heads,
            dims.kv_heads
        )
    }
    Ok(DecodeDims {
        kv_heads: parts,
        ..dims
    })
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
        // group → padded group (virtual heads × heads each)
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
            let parts = virtual_heads(group);
            assert!(padded / parts <= MAX_GROUP && padded - group < parts);
        }
    }

    #[test]
    fn padded_multi_query_groups_become_virtual_kv_heads() -> Result<()> {
        for (q_heads, want) in [(16, 1), (18, 2), (48, 3), (75, 5), (1, 1)] {
            let got = virtual_kv_heads(dims(q_heads, 1))?;
            assert_eq!(got.kv_heads, want, "{q_heads}/1");
            assert_eq!(got.q_heads, q_heads);
            assert!(got.group_size() <= MAX_GROUP);
        }
        assert_eq!(virtual_kv_heads(dims(32, 8))?.kv_heads, 8);
        // Unpadded or over several kv heads: an error naming the way round.
        for (q_heads, kv_heads) in [(71, 1), (17, 1), (64, 2)] {
            let err = virtual_kv_heads(dims(q_heads, kv_heads)).unwrap_err();
            assert!(
                err.to_string().contains("SplitKvAttention::forward"),
                "{err}"
            );
        }
        Ok(())
    }
}
