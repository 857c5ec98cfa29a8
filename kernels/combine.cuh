// The combine pass of split-KV decode attention: merges each (batch, query head)'s partial outputs
// through their base-2 log-sum-exps. One CTA per row; splits with lse = -inf weigh nothing, and a
// row with no positions at all gets zeros and lse = -inf.
//
// The pass is a chain of L2 round trips once the partial grid completes, so it is laid out to make
// as few as possible: the CTA's threads tile (split lane × 4-column group), each thread loads the
// partial rows and LSEs of up to kBatch splits at once and folds them into its own state, and the
// split lanes' states merge once through shared memory (kernels/merge_state.cuh). Up to
// kBatch · (128 / (D / 4)) splits (32 at D = 128) cost one round trip.

#pragma once

#include "common.cuh"
#include "merge_state.cuh"

constexpr int kCombineThreads = 128;
constexpr int kBatch = 8;             // splits in flight per thread

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

    MergeState<float4> f;
    if (lane < lanes) {
        for (int first = lane; first < splits; first += kBatch * lanes) {
            float l[kBatch], ones[kBatch];
            float4 x[kBatch];
#pragma unroll
            for (int i = 0; i < kBatch; ++i) {
                const int s = first + i * lanes;
                l[i] = s < splits ? lse[s] : -INFINITY;
                x[i] = s < splits ? partial[(long long)s * groups + group] : make_float4(0.f, 0.f, 0.f, 0.f);
                ones[i] = 1.f;
            }
            f.fold(l, ones, x);
        }
    }
    acc_s[threadIdx.x] = f.acc;
    max_s[threadIdx.x] = f.max;
    sum_s[threadIdx.x] = f.sum;
    __syncthreads();

    // Every split lane saw the same splits for each column group, so lane j's max and sum can be
    // read from any of its threads (column group 0); the lanes' states merge column by column.
    T* out = static_cast<T*>(p.out) + output_row(row, p.query_tokens, p.out_heads) * d;
    const float* acc = reinterpret_cast<const float*>(acc_s);
    MergeState<float> total;
    for (int c = threadIdx.x; c < d; c += kCombineThreads) {
        total = MergeState<float>{};
        for (int j = 0; j < lanes; ++j)
            total.fold(max_s[j * groups], sum_s[j * groups], acc[(j * groups + c / 4) * 4 + c % 4]);
        out[c] = from_float<T>(total.normalised());
    }
    // Thread 0 merged column 0, and every column merges the same maxes and sums.
    if (threadIdx.x == 0 && p.lse_out != nullptr) p.lse_out[row] = total.lse2() * kLn2;
}
