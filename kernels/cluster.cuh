// Thread-block cluster primitives (sm_90): the split barrier, a CTA's rank, and stores into
// another CTA's shared memory. On earlier architectures they compile to nothing; the host
// launches clusters only on sm_90 builds.
#pragma once

#include "common.cuh"

// The cluster barrier in two halves. `cluster_arrive` with release semantics publishes this
// thread's distributed-shared-memory stores; `cluster_wait` returns once every thread of every
// CTA of the cluster has arrived, with acquire semantics.
__device__ __forceinline__ void cluster_arrive_relaxed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}

__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
    return r;
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

__device__ __forceinline__ void store_to_cluster(unsigned remote, float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(remote), "f"(x) : "memory");
#endif
}

__device__ __forceinline__ void store4_to_cluster(unsigned remote, float4 x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(remote), "f"(x.x),
                 "f"(x.y), "f"(x.z), "f"(x.w)
                 : "memory");
#endif
}

__device__ __forceinline__ void store2_to_cluster(unsigned remote, float2 x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("st.shared::cluster.v2.f32 [%0], {%1, %2};" ::"r"(remote), "f"(x.x), "f"(x.y)
                 : "memory");
#endif
}
