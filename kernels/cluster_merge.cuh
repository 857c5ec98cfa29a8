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

// `local` in the shared memory of cluster CTA `rank`.
__device__ __forceinline__ float load_from_cta(const float* local, unsigned rank) {
    float v = 0.f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(local));
    unsigned remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
#endif
    return v;
}

// `result` holds this CTA's [head][D] outputs and [head] LSEs (merge_warps_and_store). The
// output elements of the group are dealt round-robin over the cluster's threads.
template <typename T, int D, int GMAX>
__device__ __forceinline__ void merge_across_cluster(const DecodeParams& p, const float* result,
                                                     int group, int kv_head, int b) {
    cluster_sync();
    const unsigned rank = cluster_rank();
    const int splits = min((int)cluster_size(), kMaxCluster);
    for (int i = rank * kThreads + threadIdx.x; i < group * D; i += splits * kThreads) {
        const int g = i / D, c = i - g * D;
        // Both loads of every split issued before any is used: one DSMEM round trip.
        float lse[kMaxCluster], x[kMaxCluster];
#pragma unroll
        for (int s = 0; s < kMaxCluster; ++s) {
            lse[s] = s < splits ? load_from_cta(result + GMAX * D + g, s) : -INFINITY;
            x[s] = s < splits ? load_from_cta(result + g * D + c, s) : 0.f;
        }
        float m = -INFINITY;
#pragma unroll
        for (int s = 0; s < kMaxCluster; ++s) m = fmaxf(m, lse[s]);
        float value = 0.f, sum = 0.f;
        if (m != -INFINITY) {
#pragma unroll
            for (int s = 0; s < kMaxCluster; ++s) {
                const float w = fast_exp2(lse[s] - m);  // 0 for an empty or absent split
                value = fmaf(w, x[s], value);
                sum += w;
            }
        }
        const long long row = (long long)b * p.q_heads + kv_head * group + g;
        static_cast<T*>(p.out)[row * D + c] = from_float<T>(sum > 0.f ? value / sum : 0.f);
        if (c == 0 && p.lse_out != nullptr)
            p.lse_out[row] = sum > 0.f ? (m + __log2f(sum)) * kLn2 : -INFINITY;
    }
    // No CTA may leave (releasing its shared memory) while another still reads it.
    cluster_sync();
}
