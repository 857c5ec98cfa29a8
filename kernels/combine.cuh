// The combine pass of split-KV decode attention: merges each (batch, query head)'s partial outputs
// through their base-2 log-sum-exps. One CTA per row; splits with lse = -inf weigh nothing, and a
// row with no positions at all gets zeros and lse = -inf.
//
// The pass is a chain of L2 round trips once the partial grid completes, so it is laid out to make
// as few as possible: the CTA's threads tile (split lane × 4-column group), each thread loads the
// partial rows and LSEs of up to kBatch splits at once, folds them with its own running max, and
// the split lanes merge once through shared memory. Up to kBatch · (128 / (D / 4)) splits (32 at
// D = 128) cost one round trip.

#pragma once

#include "common.cuh"

constexpr int kCombineThreads = 128;
constexpr int kBatch = 8;             // splits in flight per thread

// A running (max, sum, weighted row slice) of base-2 LSE-weighted partial outputs.
struct Folded {
    float max = -INFINITY;
    float sum = 0.f;
    float4 acc = {0.f, 0.f, 0.f, 0.f};

    __device__ __forceinline__ void add(float lse, float4 x) {
        const float new_max = fmaxf(max, lse);
        if (new_max == -INFINITY) return;  // nothing with weight yet
        const float rescale = fast_exp2(max - new_max);  // 0 when max was -inf
        const float w = fast_exp2(lse - new_max);        // 0 when lse is -inf
        sum = fmaf(sum, rescale, w);
        acc.x = fmaf(acc.x, rescale, w * x.x);
        acc.y = fmaf(acc.y, rescale, w * x.y);
        acc.z = fmaf(acc.z, rescale, w * x.z);
        acc.w = fmaf(acc.w, rescale, w * x.w);
        max = new_max;
    }
};

template <typename T>
__device__ __forceinline__ void combine(const CombineParams& p) {
    __shared__ float4 acc_s[kCombineThreads];
    __shared__ float max_s[kCombineThreads], sum_s[kCombineThreads];
    // Let the next kernel (e.g. the output projection) start streaming its weights early.
    allow_dependent_launch();
    wait_for_prerequisite_grid();
    const int row = blockIdx.x;  // the caller's numbering; the partials are padded
    const int partial_row = padded_row(row, p.padded_group, p.real_group);
    const int splits = p.num_splits, d = p.head_dim;
    const int groups = d / 4;                     // 4-column groups per row
    const int lanes = kCombineThreads / groups;   // split lanes
    if (d % 4 != 0 || lanes == 0) __trap();       // head dims are multiples of 16, at most 256
    const int group = threadIdx.x % groups, lane = threadIdx.x / groups;
    const float* lse = p.partial_lse + (long long)partial_row * splits;
    const float4* partial = reinterpret_cast<const float4*>(p.partial_out + (long long)partial_row * splits * d);

    Folded f;
    if (lane < lanes) {
        for (int first = lane; first < splits; first += kBatch * lanes) {
            float l[kBatch];
            float4 x[kBatch];
#pragma unroll
            for (int i = 0; i < kBatch; ++i) {
                const int s = first + i * lanes;
                l[i] = s < splits ? lse[s] : -INFINITY;
                x[i] = s < splits ? partial[(long long)s * groups + group] : make_float4(0.f, 0.f, 0.f, 0.f);
            }
#pragma unroll
            for (int i = 0; i < kBatch; ++i) f.add(l[i], x[i]);
        }
    }
    acc_s[threadIdx.x] = f.acc;
    max_s[threadIdx.x] = f.max;
    sum_s[threadIdx.x] = f.sum;
    __syncthreads();

    // Every split lane saw the same splits for each column group, so lane j's max and sum can be
    // read from any of its threads (column group 0).
    float m = -INFINITY;
    for (int j = 0; j < lanes; ++j) m = fmaxf(m, max_s[j * groups]);
    float total = 0.f;
    if (m != -INFINITY)
        for (int j = 0; j < lanes; ++j) total += sum_s[j * groups] * fast_exp2(max_s[j * groups] - m);
    const float inv_total = total > 0.f ? 1.f / total : 0.f;
    T* out = static_cast<T*>(p.out) + (long long)row * d;
    const float* acc = reinterpret_cast<const float*>(acc_s);
    for (int c = threadIdx.x; c < d; c += kCombineThreads) {
        float value = 0.f;
        if (m != -INFINITY)
            for (int j = 0; j < lanes; ++j)
                value = fmaf(acc[(j * groups + c / 4) * 4 + c % 4], fast_exp2(max_s[j * groups] - m), value);
        out[c] = from_float<T>(value * inv_total);
    }
    if (threadIdx.x == 0 && p.lse_out != nullptr)
        p.lse_out[row] = total > 0.f ? (m + __log2f(total)) * kLn2 : -INFINITY;
}
