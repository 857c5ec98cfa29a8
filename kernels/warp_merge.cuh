// The end of the partial pass, shared by both kernel families: every warp of the CTA has left its
// online-softmax state (unnormalised output row, running max, running sum, all base 2) for each
// query head in shared memory; this merges the warps and writes the final output (one split), the
// split's normalised output and LSE to shared memory for a merge across the cluster, or both to
// the scratch buffers of the combine pass.
#pragma once

#include "common.cuh"

// Floats per (warp, head) slot: the output row, then the max and the sum.
template <int D> __host__ __device__ constexpr int merge_slot_floats() { return D + 2; }

template <int D, int GMAX> __host__ __device__ constexpr int merge_smem_bytes() {
    return kWarps * GMAX * merge_slot_floats<D>() * (int)sizeof(float);
}

// A CTA's merged result for the cluster merge: [head][D] normalised outputs, then [head] LSEs.
template <int D, int GMAX> __host__ __device__ constexpr int cluster_result_bytes() {
    return GMAX * (D + 1) * (int)sizeof(float);
}

// `merge` holds [warp][head][D + 2]; the caller has synchronised the CTA after filling it.
// `cluster_result` (shared memory, or null) takes the result instead of the scratch buffers.
template <typename T, int D, int GMAX>
__device__ __forceinline__ void merge_warps_and_store(const DecodeParams& p, const float* merge,
                                                      int group, int split, int kv_head, int b,
                                                      float* cluster_result) {
    constexpr int SLOT = merge_slot_floats<D>();
    const bool single = p.num_splits == 1;
    for (int i = threadIdx.x; i < group * D; i += kThreads) {
        const int g = i / D, c = i - g * D;
        float m = -INFINITY;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) m = fmaxf(m, merge[(w * GMAX + g) * SLOT + D]);
        float value = 0.f;
        float lse2 = -INFINITY;
        if (m != -INFINITY) {
            float total = 0.f, sum = 0.f;
#pragma unroll
            for (int w = 0; w < kWarps; ++w) {
                const float* slot = merge + (w * GMAX + g) * SLOT;
                const float weight = fast_exp2(slot[D] - m);  // 0 for a warp that saw no rows
                total = fmaf(weight, slot[c], total);
                sum = fmaf(weight, slot[D + 1], sum);
            }
            value = total / sum;
            lse2 = m + __log2f(sum);
        }
        const long long row_index = (long long)b * p.q_heads + kv_head * group + g;
        if (single) {
            static_cast<T*>(p.out)[row_index * D + c] = from_float<T>(value);
            if (c == 0 && p.lse_out != nullptr) p.lse_out[row_index] = lse2 * kLn2;
        } else if (cluster_result != nullptr) {
            cluster_result[g * D + c] = value;
            if (c == 0) cluster_result[GMAX * D + g] = lse2;
        } else {
            const long long slot = row_index * p.num_splits + split;
            p.partial_out[slot * D + c] = value;
            if (c == 0) p.partial_lse[slot] = lse2;
        }
    }
}
