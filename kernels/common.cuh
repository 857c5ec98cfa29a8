// Shared device helpers: the launch parameter blocks, dtype conversions, 16-byte async copies
// and fast base-2 exponentials.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

// Must match `DecodeParams` in src/cuda.rs field for field.
struct DecodeParams {
    const void* q;
    const void* k;
    const void* v;
    void* out;              // (b, h_q, d) in the input dtype; written by the partial pass unless
                            // merge == kMergeByCombinePass
    float* lse_out;         // (b, h_q) natural log, or null when not wanted
    float* partial_out;     // (b, h_q, num_splits, d) normalised partial outputs (merges through memory)
    float* partial_lse;     // (b, h_q, num_splits) base-2 log-sum-exps (merges through memory)
    const uint32_t* seqlens;  // (b,) or null
    unsigned* split_counters;  // (b, h_kv) arrival counters, all 0 between launches (kMergeByLastCta)
    long long q_batch_stride, q_head_stride;
    long long k_batch_stride, k_seq_stride, k_head_stride;
    long long v_batch_stride, v_seq_stride, v_head_stride;
    int batch, q_heads, kv_heads, kv_len;
    int num_splits, chunk_size;
    float scale_log2;       // softmax_scale * log2(e)
    int merge;              // how the splits of each (b, kv head) are merged: SplitMerge
    int blocks_per_kv_head; // kv heads here are blocks of query heads; K/V head = kv_head / this
    int padded_group;       // query heads per K/V head as numbered here (see real_row)
    int real_group;         // of which the first real_group exist in q, out and lse_out
    int lockstep_tiles;     // tiles between the cluster barriers of the lockstep forms
};

// Must match `SplitMerge` in src/cuda.rs. With one split the partial pass writes the output.
enum SplitMerge : int {
    kMergeByCombinePass = 0,  // a second grid (kernels/combine.cu)
    kMergeInCluster = 1,      // the splits are one cluster (kernels/cluster_merge.cuh)
    kMergeByLastCta = 2,      // the last split to finish (kernels/last_split_merge.cuh)
};

// Must match `CombineParams` in src/cuda.rs.
struct CombineParams {
    const float* partial_out;
    const float* partial_lse;
    void* out;
    float* lse_out;  // or null
    int rows;        // b * h_q, the caller's query heads
    int num_splits;
    int head_dim;
    int padded_group;  // as in DecodeParams: the partials are numbered with padding
    int real_group;
    int reserved;
};

// Wide groups are padded to equal blocks of query heads (src/wide_groups.rs): the kernels number
// the query heads of each (batch, K/V head) as a run of padded_group, of which the first
// real_group exist in the caller's q, out and LSE. Row `padded` of that numbering in the
// caller's tensors, or -1 for a padding head. Without padding the numberings agree and the
// divisions are skipped: at short contexts they sit on the critical path.
__device__ __forceinline__ int real_row(int padded, int padded_group, int real_group) {
    if (padded_group == real_group) return padded;
    const int run = padded / padded_group, i = padded - run * padded_group;
    return i < real_group ? run * real_group + i : -1;
}

// The inverse: row `real` of the caller's tensors in the kernels' numbering.
__device__ __forceinline__ int padded_row(int real, int padded_group, int real_group) {
    if (padded_group == real_group) return real;
    const int run = real / real_group;
    return run * padded_group + (real - run * real_group);
}

// Both partial kernels run four independently streaming warps per CTA.
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;

constexpr float kLn2 = 0.69314718055994530942f;

__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

// Four consecutive output elements in the output dtype, one 8- or 16-byte store.
__device__ __forceinline__ void store4(float* dst, float4 x) {
    *reinterpret_cast<float4*>(dst) = x;
}
__device__ __forceinline__ void store4(__half* dst, float4 x) {
    const __half2 lo = __floats2half2_rn(x.x, x.y), hi = __floats2half2_rn(x.z, x.w);
    uint2 packed;
    packed.x = *reinterpret_cast<const uint32_t*>(&lo);
    packed.y = *reinterpret_cast<const uint32_t*>(&hi);
    *reinterpret_cast<uint2*>(dst) = packed;
}
__device__ __forceinline__ void store4(__nv_bfloat16* dst, float4 x) {
    const __nv_bfloat162 lo = __floats2bfloat162_rn(x.x, x.y), hi = __floats2bfloat162_rn(x.z, x.w);
    uint2 packed;
    packed.x = *reinterpret_cast<const uint32_t*>(&lo);
    packed.y = *reinterpret_cast<const uint32_t*>(&hi);
    *reinterpret_cast<uint2*>(dst) = packed;
}

// Eight consecutive elements from 16-byte aligned shared memory, widened to f32.
__device__ __forceinline__ void load8(const __half* p, float (&f)[8]) {
    uint4 raw = *reinterpret_cast<const uint4*>(p);
    const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float2 x = __half22float2(h[i]);
        f[2 * i] = x.x;
        f[2 * i + 1] = x.y;
    }
}

__device__ __forceinline__ void load8(const __nv_bfloat16* p, float (&f)[8]) {
    uint4 raw = *reinterpret_cast<const uint4*>(p);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float2 x = __bfloat1622float2(h[i]);
        f[2 * i] = x.x;
        f[2 * i + 1] = x.y;
    }
}

__device__ __forceinline__ void load8(const float* p, float (&f)[8]) {
    float4 a = *reinterpret_cast<const float4*>(p);
    float4 b = *reinterpret_cast<const float4*>(p + 4);
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
    f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}

// 16-byte global → shared copy that bypasses L1. With `valid` false nothing is read and the
// destination is zero-filled, which is how ragged tails are masked without touching memory past
// the sequence.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
    unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    int src_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem),
                 "r"(src_bytes));
}

// A full 16-byte copy to a shared-space address (from `__cvta_generic_to_shared`).
__device__ __forceinline__ void cp_async16_to(unsigned dst, const void* gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem));
}

// An L2 policy for data read once, such as the K/V stream: its lines are the first evicted, so
// the stream does not push out the kernel's code, the query or the split scratch.
__device__ __forceinline__ unsigned long long l2_evict_first_policy() {
    unsigned long long policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    return policy;
}

// `cp_async16_to` with an L2 cache policy. (No zero-filling form: on sm_90 the copy with both a
// source size and a cache policy assembled to an instruction that faults.)
__device__ __forceinline__ void cp_async16_to_hint(unsigned dst, const void* gmem,
                                                   unsigned long long policy) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\n" ::"r"(dst),
                 "l"(gmem), "l"(policy));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Programmatic dependent launch (sm_90): the partial kernel lets the combine kernel be scheduled
// early, and the combine kernel waits for the partial grid to complete before reading its output.
// Without a dependent launch both are no-ops.
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_for_prerequisite_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ unsigned dynamic_smem_bytes() {
    unsigned n;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
    return n;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}
