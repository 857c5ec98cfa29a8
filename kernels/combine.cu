// The combine pass of split-KV decode attention: merges each (batch, query head)'s partial outputs
// through their base-2 log-sum-exps. One CTA per row; splits with lse = -inf weigh nothing, and a
// row with no positions at all gets zeros and lse = -inf.

#include "common.cuh"

constexpr int kMaxSplits = 256;  // src/plan.rs MAX_SPLITS

template <typename T>
__device__ __forceinline__ void combine(const CombineParams& p) {
    __shared__ float weight_s[kMaxSplits];
    __shared__ float inv_total_s;
    __shared__ float lse_s;
    // Let the next kernel (e.g. the output projection) start streaming its weights early.
    allow_dependent_launch();
    wait_for_prerequisite_grid();
    const int row = blockIdx.x;
    const int splits = p.num_splits;
    const float* lse = p.partial_lse + (long long)row * splits;
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        float m = -INFINITY;
        for (int s = lane; s < splits; s += 32) m = fmaxf(m, lse[s]);
        m = warp_max(m);
        float total = 0.f;
        for (int s = lane; s < splits; s += 32) {
            const float w = m == -INFINITY ? 0.f : fast_exp2(lse[s] - m);
            weight_s[s] = w;
            total += w;
        }
        total = warp_sum(total);
        if (lane == 0) {
            inv_total_s = total > 0.f ? 1.f / total : 0.f;
            lse_s = total > 0.f ? (m + __log2f(total)) * kLn2 : -INFINITY;
        }
    }
    __syncthreads();
    const float* partial = p.partial_out + (long long)row * splits * p.head_dim;
    T* out = static_cast<T*>(p.out) + (long long)row * p.head_dim;
    for (int c = threadIdx.x; c < p.head_dim; c += blockDim.x) {
        float acc = 0.f;
        for (int s = 0; s < splits; ++s) acc = fmaf(weight_s[s], partial[(long long)s * p.head_dim + c], acc);
        out[c] = from_float<T>(acc * inv_total_s);
    }
    if (threadIdx.x == 0 && p.lse_out != nullptr) p.lse_out[row] = lse_s;
}

extern "C" __global__ void split_kv_combine_f16(const CombineParams p) { combine<__half>(p); }
extern "C" __global__ void split_kv_combine_bf16(const CombineParams p) { combine<__nv_bfloat16>(p); }
extern "C" __global__ void split_kv_combine_f32(const CombineParams p) { combine<float>(p); }
