// The end of the partial pass, shared by both kernel families: every warp of the CTA has left its
// online-softmax state (unnormalised output row, running max, running sum, all base 2) for each
// query head in shared memory; this merges the warps and writes the final output (one split), the
// split's normalised output and LSE to their owners in the cluster (kernels/cluster_merge.cuh), or
// both to the scratch buffers of a merge through memory (the combine pass or the last CTA).
#pragma once

#include "cluster_merge.cuh"
#include "common.cuh"
#include "merge_state.cuh"

// Floats per (warp, head) slot: the output row, then the max and the sum, padded so that slots
// stay 16-byte aligned for the float4 reads of the merge and sit 8 banks apart, which keeps the
// tensor-core warps' float2 writes of eight heads at once free of bank conflicts.
template <int D> __host__ __device__ constexpr int merge_slot_floats() { return D + 8; }

template <int D, int GMAX> __host__ __device__ constexpr int merge_smem_bytes() {
    return kWarps * GMAX * merge_slot_floats<D>() * (int)sizeof(float);
}

// `merge` holds [warp][head][merge_slot_floats]; the caller has synchronised the CTA after
// filling it. With `cluster_receive` (the receive area, at the same offset in every CTA of the
// cluster) the result goes to its owners instead of the scratch buffers. Each thread finishes
// four consecutive columns of one head, so the warps' weights are worked out once per four
// outputs and every shared-memory read is a float4.
template <typename T, int D, int GMAX>
__device__ __forceinline__ void merge_warps_and_store(const DecodeParams& p, const float* merge,
                                                      int group, int split, int kv_head, int b,
                                                      unsigned char* cluster_receive) {
    constexpr int SLOT = merge_slot_floats<D>();
    constexpr int QUADS = D / 4;  // four-column groups per head
    const bool single = p.num_splits == 1;
    for (int i = threadIdx.x; i < group * QUADS; i += kThreads) {
        const int g = i / QUADS, c = (i - g * QUADS) * 4;
        float m[kWarps], l[kWarps];
        float4 x[kWarps];
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
            const float* slot = merge + (w * GMAX + g) * SLOT;
            m[w] = slot[D];  // -inf for a warp that saw no rows
            l[w] = slot[D + 1];
            x[w] = *reinterpret_cast<const float4*>(slot + c);
        }
        MergeState<float4> state;
        state.fold(m, l, x);
        const float4 value = state.normalised();
        const float lse2 = state.lse2();
        const long long row_index = (long long)b * p.q_heads + kv_head * group + g;
        if (single) {
            const int row = real_row((int)row_index, p.padded_group, p.real_group);
            if (row >= 0) {
                const long long out_row = output_row(row, p.query_tokens, p.out_heads);
                store4(static_cast<T*>(p.out) + out_row * D + c, value);
                if (c == 0 && p.lse_out != nullptr) p.lse_out[row] = lse2 * kLn2;
            }
        } else if (cluster_receive != nullptr) {
            push_slice_to_owner<D, GMAX>(cluster_receive, group, p.num_splits, split, i, g, value,
                                         c == 0, lse2);
        } else {
            const long long slot = row_index * p.num_splits + split;
            store4(p.partial_out + slot * D + c, value);
            if (c == 0) p.partial_lse[slot] = lse2;
        }
    }
}
