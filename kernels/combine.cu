// The combine pass of split-KV decode attention, for launches without the fused combine: one CTA
// per (batch, query head) row.

#include "combine.cuh"

template <typename T>
__device__ __forceinline__ void combine(const CombineParams& p) {
    __shared__ float weight_s[kMaxSplits];
    const long long row = blockIdx.x;
    combine_row<T>(p.partial_out + row * p.num_splits * p.head_dim, p.partial_lse + row * p.num_splits,
                   p.num_splits, p.head_dim, static_cast<T*>(p.out) + row * p.head_dim,
                   p.lse_out == nullptr ? nullptr : p.lse_out + row, weight_s);
}

extern "C" __global__ void split_kv_combine_f16(const CombineParams p) { combine<__half>(p); }
extern "C" __global__ void split_kv_combine_bf16(const CombineParams p) { combine<__nv_bfloat16>(p); }
extern "C" __global__ void split_kv_combine_f32(const CombineParams p) { combine<float>(p); }
