// The merge of a (batch, kv head)'s splits without a combine pass (sm_90). The host launches the
// splits of each (batch, kv head) as one thread-block cluster. Each output column has an owner
// CTA (one thread per column where the cluster has threads enough, else slices of four columns
// dealt round robin); every CTA pushes its normalised columns and its LSEs into the owners'
// shared memory (distributed shared memory stores, which need no reply), one cluster barrier
// makes them visible, and each owner merges from local shared memory. No scratch round trip
// through L2, no second grid, and no remote loads or closing barrier.
#pragma once

#include "cluster.cuh"
#include "common.cuh"
#include "merge_state.cuh"

// Largest cluster the host asks for (the non-portable H100/H200 limit); the host reads it from
// the generated kernel table.
constexpr int kMaxCluster = 16;

// The receive area of a CTA: what the sources pushed to it, then every source's LSEs,
// [source][head]. Where the cluster has a thread per output column (group * D <= splits *
// kThreads), CTA r owns columns [r * kThreads, (r + 1) * kThreads), one per thread, and receives
// [source][kThreads] floats; otherwise slices of four columns are dealt round robin and it
// receives [source][slot] float4s, ceil(group * D / 4 / splits) slots per source.
template <int D, int GMAX> __host__ __device__ constexpr int cluster_slice_bytes() {
    constexpr int slices = (GMAX * D / 4 + kMaxCluster) * 16;  // float4 slots, a spare per source
    constexpr int columns = kMaxCluster * kThreads * 4;         // a float per thread and source
    return slices > columns ? slices : columns;
}
template <int D, int GMAX> __host__ __device__ constexpr int cluster_receive_bytes() {
    return cluster_slice_bytes<D, GMAX>() + kMaxCluster * GMAX * (int)sizeof(float);
}

// Slice `quad` (four-column group `quad` of the flattened [head][D / 4]) belongs to CTA
// quad % splits, at slot quad / splits: the owners share the merge evenly.
__device__ __forceinline__ int cluster_slots(int group, int quads_per_head, int splits) {
    return (group * quads_per_head + splits - 1) / splits;
}

// One output column per thread of the cluster where there are threads enough.
__device__ __forceinline__ bool cluster_merges_columns(int group, int head_dim, int splits) {
    return group * head_dim <= splits * kThreads;
}

// Called by every thread of a CTA that holds this split's normalised slice `quad` (head g): sends
// it, and once per head (`with_lse`) the head's LSE to every owner, to the owners' receive areas.
template <int D, int GMAX>
__device__ __forceinline__ void push_slice_to_owner(unsigned char* receive, int group, int splits,
                                                    int split, int quad, int g, float4 value,
                                                    bool with_lse, float lse2) {
    constexpr int QUADS = D / 4;
    float* lses = reinterpret_cast<float*>(receive + cluster_slice_bytes<D, GMAX>());
    if (cluster_merges_columns(group, D, splits)) {
        // Columns 4 * quad .. + 3 lie within one owner's range (kThreads is a multiple of 4).
        const int column = quad * 4;
        float* columns = reinterpret_cast<float*>(receive);
        store4_to_cluster(cluster_address(columns + split * kThreads + column % kThreads,
                                          column / kThreads),
                          value);
    } else {
        const int slots = cluster_slots(group, QUADS, splits);
        float4* slices = reinterpret_cast<float4*>(receive);
        store4_to_cluster(cluster_address(slices + split * slots + quad / splits, quad % splits),
                          value);
    }
    if (with_lse)
        for (int owner = 0; owner < splits; ++owner)
            store_to_cluster(cluster_address(lses + split * GMAX + g, owner), lse2);
}

// After every CTA has pushed: one barrier, then each owner merges its slices across the splits
// and writes the output. Nothing reads another CTA's shared memory afterwards, so CTAs may leave.
template <typename T, int D, int GMAX>
__device__ __forceinline__ void merge_pushed_slices(const DecodeParams& p,
                                                    const unsigned char* receive, int group,
                                                    int kv_head, int b) {
    cluster_arrive();
    cluster_wait();
    constexpr int QUADS = D / 4;
    const int splits = p.num_splits;
    const int rank = (int)cluster_rank();
    const float* lses = reinterpret_cast<const float*>(receive + cluster_slice_bytes<D, GMAX>());
    if (cluster_merges_columns(group, D, splits)) {
        const int column = rank * kThreads + threadIdx.x;
        if (column >= group * D) return;
        const int g = column / D, c = column - g * D;
        const float* columns = reinterpret_cast<const float*>(receive);
        float lse[kMaxCluster], ones[kMaxCluster], x[kMaxCluster];
#pragma unroll
        for (int s = 0; s < kMaxCluster; ++s) {
            lse[s] = s < splits ? lses[s * GMAX + g] : -INFINITY;
            x[s] = s < splits ? columns[s * kThreads + threadIdx.x] : 0.f;
            ones[s] = 1.f;
        }
        MergeState<float> state;
        state.fold(lse, ones, x);
        const int row = real_row(b * p.q_heads + kv_head * group + g, p.padded_group, p.real_group);
        if (row < 0) return;  // a padding head
        static_cast<T*>(p.out)[output_row(row, p.query_tokens, p.out_heads) * D + c] =
            from_float<T>(state.normalised());
        if (c == 0 && p.lse_out != nullptr) p.lse_out[row] = state.lse2() * kLn2;
        return;
    }
    const int slots = cluster_slots(group, QUADS, splits);
    const float4* slices = reinterpret_cast<const float4*>(receive);
    for (int slot = threadIdx.x; slot < slots; slot += kThreads) {
        const int quad_index = slot * splits + rank;
        if (quad_index >= group * QUADS) break;
        const int g = quad_index / QUADS, c = (quad_index - g * QUADS) * 4;
        float lse[kMaxCluster], ones[kMaxCluster];
        float4 x[kMaxCluster];
#pragma unroll
        for (int s = 0; s < kMaxCluster; ++s) {
            lse[s] = s < splits ? lses[s * GMAX + g] : -INFINITY;
            x[s] = s < splits ? slices[s * slots + slot] : make_float4(0.f, 0.f, 0.f, 0.f);
            ones[s] = 1.f;
        }
        MergeState<float4> state;
        state.fold(lse, ones, x);
        const int row = real_row(b * p.q_heads + kv_head * group + g, p.padded_group, p.real_group);
        if (row < 0) continue;  // a padding head
        store4(static_cast<T*>(p.out) + output_row(row, p.query_tokens, p.out_heads) * D + c,
               state.normalised());
        if (c == 0 && p.lse_out != nullptr) p.lse_out[row] = state.lse2() * kLn2;
    }
}
