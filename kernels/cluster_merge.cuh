// The merge of a (batch, kv head)'s splits without a combine pass (sm_90). The host launches the
// splits of each (batch, kv head) as one thread-block cluster; each CTA leaves its normalised
// output and base-2 LSE per query head in its own shared memory, and after a cluster barrier the
// CTAs read each other's results through distributed shared memory, each finishing a slice of
// the outputs. No scratch round trip through L2 and no second grid.
#pragma once

#include "common.cuh"

// Largest cluster the host asks for (the non-portable H100/H200 limit); src/cuda.rs MAX_CLUSTER.
constexpr int kMaxCluster = 16;

// Every thread of every CTA of the cluster arrives, then waits for all the others; shared-memory
// writes before it are visible to the whole cluster after it.
__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n"
                 "barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}

__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
    return r;
}

__device__ __forceinline__ unsigned cluster_size() {
    unsigned n = 1;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
#endif
    return n;
}

// The same shared-memory address in cluster CTA `rank`.
__device__ __forceinline__ unsigned cluster_address(const void* local, unsigned rank) {
    unsigned remote = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(local));
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
#endif
    return remote;
}

__device__ __forceinline__ float load_from_cluster(unsigned remote) {
    float v = 0.f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
#endif
    return v;
}

__device__ __forceinline__ float4 load4_from_cluster(unsigned remote) {
    float4 v = {0.f, 0.f, 0.f, 0.f};
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(remote)
                 : "memory");
#endif
    return v;
}

// Merges W (1 or 4) consecutive output columns of one head per thread. `result` holds each
// CTA's [head][D] outputs and [head] LSEs (merge_warps_and_store). Single columns are dealt
// rank-major, so the first CTAs' threads are all busy; groups of four round-robin over the CTAs,
// so every SM of the cluster shares the distributed-shared-memory reads.
template <typename T, int D, int GMAX, int W>
__device__ __forceinline__ void merge_cluster_columns(const DecodeParams& p, const float* result,
                                                      int group, int kv_head, int b,
                                                      unsigned rank, int splits) {
    static_assert(W == 1 || W == 4, "one or four columns per thread");
    constexpr int PER_HEAD = D / W;
    const int first = W == 1 ? rank * kThreads + threadIdx.x : threadIdx.x * splits + rank;
    for (int i = first; i < group * PER_HEAD; i += kThreads * splits) {
        const int g = i / PER_HEAD, c = (i - g * PER_HEAD) * W;
        // Both loads of every split issued before any is used: one DSMEM round trip.
        float lse[kMaxCluster];
        float4 x[kMaxCluster];
#pragma unroll
        for (int s = 0; s < kMaxCluster; ++s) {
            lse[s] = s < splits ? load_from_cluster(cluster_address(result + GMAX * D + g, s))
                                : -INFINITY;
            const unsigned at = cluster_address(result + g * D + c, s);
            if constexpr (W == 4)
                x[s] = s < splits ? load4_from_cluster(at) : make_float4(0.f, 0.f, 0.f, 0.f);
            else
                x[s] = make_float4(s < splits ? load_from_cluster(at) : 0.f, 0.f, 0.f, 0.f);
        }
        float m = -INFINITY;
#pragma unroll
        for (int s = 0; s < kMaxCluster; ++s) m = fmaxf(m, lse[s]);
        float4 value = {0.f, 0.f, 0.f, 0.f};
        float sum = 0.f;
        if (m != -INFINITY) {
#pragma unroll
            for (int s = 0; s < kMaxCluster; ++s) {
                const float w = fast_exp2(lse[s] - m);  // 0 for an empty or absent split
                value.x = fmaf(w, x[s].x, value.x);
                if constexpr (W == 4) {
                    value.y = fmaf(w, x[s].y, value.y);
                    value.z = fmaf(w, x[s].z, value.z);
                    value.w = fmaf(w, x[s].w, value.w);
                }
                sum += w;
            }
        }
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        const long long row = (long long)b * p.q_heads + kv_head * group + g;
        T* out = static_cast<T*>(p.out) + row * D + c;
        if constexpr (W == 4)
            store4(out, make_float4(value.x * inv, value.y * inv, value.z * inv, value.w * inv));
        else
            *out = from_float<T>(value.x * inv);
        if (c == 0 && p.lse_out != nullptr)
            p.lse_out[row] = sum > 0.f ? (m + __log2f(sum)) * kLn2 : -INFINITY;
    }
}

// The cluster's merge of its splits, between two cluster barriers. One column per thread while
// that takes a single pass over the cluster's threads (8 splits, group 4: 512 columns for 1024
// threads); beyond that four per thread, which cuts the passes and the repeated LSE reads
// (3 splits, group 8: three passes become one; H200, b = 4, 64/8, 1K: 10.1 → 9.2 µs).
template <typename T, int D, int GMAX>
__device__ __forceinline__ void merge_across_cluster(const DecodeParams& p, const float* result,
                                                     int group, int kv_head, int b) {
    cluster_sync();
    const unsigned rank = cluster_rank();
    const int splits = min((int)cluster_size(), kMaxCluster);
    if (group * D <= splits * kThreads)
        merge_cluster_columns<T, D, GMAX, 1>(p, result, group, kv_head, b, rank, splits);
    else
        merge_cluster_columns<T, D, GMAX, 4>(p, result, group, kv_head, b, rank, splits);
    // No CTA may leave (releasing its shared memory) while another still reads it.
    cluster_sync();
}
