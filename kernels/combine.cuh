// Merging one (batch, query head)'s split partials through their base-2 log-sum-exps, shared by
// the combine kernel and by the partial kernels' fused combine (the last split to finish merges).
// Splits with lse = -inf weigh nothing; a row with no positions at all gets zeros and lse = -inf.
#pragma once

#include "common.cuh"

constexpr int kMaxSplits = 256;  // src/plan.rs MAX_SPLITS

// Run by a whole CTA. `weight_s` is shared memory for kMaxSplits floats. The partials may
// have been written by other CTAs of the same grid, so they are read past L1.
template <typename T>
__device__ __forceinline__ void combine_row(const float* partial_out, const float* partial_lse,
                                            int splits, int head_dim, T* out, float* lse_out,
                                            float* weight_s) {
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        float m = -INFINITY;
        for (int s = lane; s < splits; s += 32) m = fmaxf(m, __ldcg(partial_lse + s));
        m = warp_max(m);
        float total = 0.f;
        for (int s = lane; s < splits; s += 32) {
            const float w = m == -INFINITY ? 0.f : fast_exp2(__ldcg(partial_lse + s) - m);
            weight_s[s] = w;
            total += w;
        }
        total = warp_sum(total);
        const float inv_total = total > 0.f ? 1.f / total : 0.f;
        for (int s = lane; s < splits; s += 32) weight_s[s] *= inv_total;
        if (lane == 0 && lse_out != nullptr) *lse_out = total > 0.f ? (m + __log2f(total)) * kLn2 : -INFINITY;
    }
    __syncthreads();
    for (int c = threadIdx.x; c < head_dim; c += blockDim.x) {
        float acc = 0.f;
        for (int s = 0; s < splits; ++s)
            acc = fmaf(weight_s[s], __ldcg(partial_out + (long long)s * head_dim + c), acc);
        out[c] = from_float<T>(acc);
    }
    __syncthreads();  // weight_s is reused by the next row
}
