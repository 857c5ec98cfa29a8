// The one merge of LSE-weighted partial attention results, in base 2, used by every form that
// joins partials: the warps of a CTA, the splits in the last CTA, in a cluster and in the combine
// pass. A part is (max, sum, rows): the largest score it saw, its softmax weights summed relative
// to that max, and its value rows weighted the same way. A normalised partial with base-2 LSE
// `lse` is the part (lse, 1, row).
#pragma once

#include "common.cuh"

// The row arithmetic the merge needs, on one column or four.
__device__ __forceinline__ float row_zero(float) { return 0.f; }
__device__ __forceinline__ float4 row_zero(float4) { return make_float4(0.f, 0.f, 0.f, 0.f); }
__device__ __forceinline__ float row_fma(float w, float x, float acc) { return fmaf(w, x, acc); }
__device__ __forceinline__ float4 row_fma(float w, float4 x, float4 acc) {
    return make_float4(fmaf(w, x.x, acc.x), fmaf(w, x.y, acc.y), fmaf(w, x.z, acc.z),
                       fmaf(w, x.w, acc.w));
}
__device__ __forceinline__ float row_scale(float x, float s) { return x * s; }
__device__ __forceinline__ float4 row_scale(float4 x, float s) {
    return make_float4(x.x * s, x.y * s, x.z * s, x.w * s);
}

template <typename Row> struct MergeState {
    float max = -INFINITY;  // the largest score seen
    float sum = 0.f;        // weights relative to max
    Row acc = row_zero(Row{});

    // Folds in N parts at once. The batch's max is found first, so the state rescales once and
    // the parts' weights are independent of each other; a part with max -inf weighs nothing.
    template <int N>
    __device__ __forceinline__ void fold(const float (&m)[N], const float (&l)[N], const Row (&x)[N]) {
        float new_max = max;
#pragma unroll
        for (int i = 0; i < N; ++i) new_max = fmaxf(new_max, m[i]);
        if (new_max == -INFINITY) return;  // nothing with weight yet
        // Spelled out for the empty state so that a first fold compiles to the plain weighted sum.
        const float rescale = max == -INFINITY ? 0.f : fast_exp2(max - new_max);
        sum *= rescale;
        acc = row_scale(acc, rescale);
#pragma unroll
        for (int i = 0; i < N; ++i) {
            const float w = fast_exp2(m[i] - new_max);  // 0 for a part with max -inf
            sum = fmaf(w, l[i], sum);
            acc = row_fma(w, x[i], acc);
        }
        max = new_max;
    }

    // One part.
    __device__ __forceinline__ void fold(float m, float l, Row x) {
        const float ms[1] = {m}, ls[1] = {l};
        const Row xs[1] = {x};
        fold<1>(ms, ls, xs);
    }

    // The merged rows, normalised; zeros where nothing had weight.
    __device__ __forceinline__ Row normalised() const {
        return row_scale(acc, sum > 0.f ? 1.f / sum : 0.f);
    }

    // The merged log-sum-exp, base 2; -inf where nothing had weight.
    __device__ __forceinline__ float lse2() const {
        return sum > 0.f ? max + __log2f(sum) : -INFINITY;
    }
};
