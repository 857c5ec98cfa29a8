//! Query groups wider than a CUDA block holds: multi-query models such as Falcon-7B (71 query
//! heads on one kv head) or gpt_bigcode (48), and calls with several query tokens per sequence.
//!
//! The kernels see a kv head's query rows, its query heads times the query tokens, as one group
//! (see `query_row` in kernels/common.cuh): verifying 8 drafted tokens of a model with 4 query
//! heads per kv head is a group of 32 rows.
//!
//! A block of the CUDA kernels holds up to [`max_group`] query heads of one kv head, the M
//! dimension of its tensor-core tiles. A wider group runs as `⌈group / max_group()⌉` blocks of
//! query heads per kv head, which the kernels treat as kv heads of their own that read the same
//! K and V, so one launch covers every group. Blocks hold equal numbers of query heads, so a group
//! they do not divide is padded inside the kernels: the padding heads' queries read as zero and
//! their outputs are never stored, and the caller's tensors keep their own shapes.
//!
//! Since every block streams its kv head's K/V, a wide group does one pass of tensor-core work
//! per block and byte: large calls plan for every resident CTA slot, and on sm_90 run the blocks
//! of each kv head as one cluster in lock step, so that they share each tile through L2 (see
//! `fills_every_slot` and `lockstep_cluster` in src/cuda/lockstep.rs).

use super::kernels::KernelForm;
use crate::op::validate::DecodeDims;

/// Query heads one CUDA block holds at most: the widest group bound that both kernel families
/// are compiled for.
fn max_group() -> usize {
    let cuda_cores = KernelForm::CudaCore.max_group();
    match KernelForm::TensorCore.max_group() {
        0 => cuda_cores,
        tensor_cores => tensor_cores.min(cuda_cores),
    }
}

/// Blocks that one kv head with `group` query heads runs as.
fn blocks_per_kv_head(group: usize) -> usize {
    group.div_ceil(max_group()).max(1)
}

/// Query heads of one kv head after padding: the smallest multiple of its blocks that holds the
/// group (the group itself when they divide it).
pub(crate) fn padded_group(group: usize) -> usize {
    let blocks = blocks_per_kv_head(group);
    blocks * group.div_ceil(blocks)
}

/// How the kernels see a call: its sizes with every kv head's group padded and cut into blocks,
/// which the kernels treat as kv heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct QueryBlocks {
    /// The sizes the kernels see: `q_heads` counting padded query rows (one query each, so
    /// `q_len` 1), `kv_heads` counting blocks.
    pub dims: DecodeDims,
    /// Blocks per kv head of the call: a block reads kv head `block / blocks_per_kv_head`.
    pub blocks_per_kv_head: usize,
    /// Query rows per kv head as the kernels number them, padding included.
    pub padded_group: usize,
    /// Query rows per kv head in the caller's tensors: the first of each padded run.
    pub real_group: usize,
}

/// The kernels' view of a call: each kv head's query rows (heads × query tokens) padded with
/// zero rows to equal blocks of at most [`max_group`], block `j` of kv head `h` holding padded
/// rows `h * padded_group + j * (padded_group / blocks) ..` in order. Groups within a block pass
/// through as one block per kv head without padding.
pub(crate) fn query_blocks(dims: DecodeDims) -> QueryBlocks {
    let real_group = dims.group_size() * dims.q_len;
    let blocks = blocks_per_kv_head(real_group);
    let padded_group = padded_group(real_group);
    QueryBlocks {
        dims: DecodeDims {
            q_heads: dims.kv_heads * padded_group,
            kv_heads: dims.kv_heads * blocks,
            q_len: 1,
            ..dims
        },
        blocks_per_kv_head: blocks,
        padded_group,
        real_group,
    }
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
            q_len: 1,
            pages: None,
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
            assert!(padded / blocks <= max_group() && padded - group < blocks);
        }
    }

    #[test]
    fn wide_groups_become_padded_blocks() {
        // (q heads, kv heads) → (kernel q heads, kernel kv heads, blocks per kv head)
        for (q_heads, kv_heads, want) in [
            (16, 1, (16, 1, 1)),
            (32, 8, (32, 8, 1)),
            (17, 1, (18, 2, 2)),
            (48, 1, (48, 3, 3)),
            (71, 1, (75, 5, 5)),
            (64, 2, (64, 4, 2)),
            (34, 2, (36, 4, 2)),
            (1, 1, (1, 1, 1)),
        ] {
            let blocks = query_blocks(dims(q_heads, kv_heads));
            let got = (
                blocks.dims.q_heads,
                blocks.dims.kv_heads,
                blocks.blocks_per_kv_head,
            );
            assert_eq!(got, want, "{q_heads}/{kv_heads}");
            assert!(blocks.dims.group_size() <= max_group());
            assert_eq!(blocks.real_group * kv_heads, q_heads);
            assert_eq!(blocks.padded_group * kv_heads, blocks.dims.q_heads);
        }
    }

    #[test]
    fn query_tokens_widen_the_group() {
        // (q heads, kv heads, tokens) → (kernel q heads, kernel kv heads, blocks per kv head)
        for (q_heads, kv_heads, t, want) in [
            (32, 8, 4, (128, 8, 1)),
            (32, 8, 8, (256, 16, 2)),
            (64, 8, 8, (512, 32, 4)),
            (32, 32, 16, (512, 32, 1)),
            (16, 1, 3, (48, 3, 3)),
        ] {
            let blocks = query_blocks(DecodeDims {
                q_len: t,
                ..dims(q_heads, kv_heads)
            });
            let got = (
                blocks.dims.q_heads,
                blocks.dims.kv_heads,
                blocks.blocks_per_kv_head,
            );
            assert_eq!(got, want, "{q_heads}/{kv_heads} t = {t}");
            assert_eq!(blocks.dims.q_len, 1);
            assert_eq!(blocks.real_group, q_heads / kv_heads * t);
        }
    }
}
