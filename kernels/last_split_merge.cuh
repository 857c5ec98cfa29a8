// The merge of a (batch, kv head)'s splits by the last of its CTAs to finish, for split plans
// whose clusters would not all be resident: no second grid and no boundary between grids.
//
// Every CTA of the group writes its normalised partial output and LSE to the scratch buffers
// (merge_warps_and_store), makes them visible device-wide and counts itself on the group's arrival
// counter. The CTA that brings the count to `num_splits` reads all the partials back from L2 and
// writes the output; it also resets the counter, which the next launch reads only after its
// grid-dependency wait, when this grid has completed.
#pragma once

#include "common.cuh"
#include "merge_state.cuh"

// Adds one to a device-wide counter with acquire-release ordering and returns the old value: a
// lighter fence than `__threadfence()` (sequentially consistent) followed by a relaxed add.
__device__ __forceinline__ unsigned arrive_acq_rel(unsigned* counter) {
    unsigned old;
    asm volatile("atom.add.acq_rel.gpu.global.u32 %0, [%1], 1;"
                 : "=r"(old)
                 : "l"(counter)
                 : "memory");
    return old;
}

// Splits whose partials one thread has in flight at once: 16 covers the plans' usual split
// counts in one round trip from L2.
constexpr int kLastMergeBatch = 16;

// Returns on every CTA; only the last one of its group writes anything.
template <typename T, int D>
__device__ __forceinline__ void merge_splits_if_last(const DecodeParams& p, int group, int kv_head,
                                                     int b) {
    // The barrier orders every thread's partial stores before thread 0's arrival, whose release
    // publishes them device-wide (cumulative over what the barrier made it observe); its acquire
    // makes the other splits' partials visible to the last CTA.
    __syncthreads();
    bool last = false;
    if (threadIdx.x == 0) {
        unsigned* counter = p.split_counters + (long long)b * p.kv_heads + kv_head;
        last = arrive_acq_rel(counter) + 1 == (unsigned)p.num_splits;
        if (last) atomicExch(counter, 0u);  // every split has arrived: ready for the next launch
    }
    if (!__syncthreads_or(last)) return;

    constexpr int QUADS = D / 4;  // four-column groups per head
    const int splits = p.num_splits;
    for (int i = threadIdx.x; i < group * QUADS; i += kThreads) {
        const int g = i / QUADS, quad = i - g * QUADS;
        const long long row = (long long)b * p.q_heads + kv_head * group + g;
        const int out_row = real_row((int)row, p.padded_group, p.real_group);
        if (out_row < 0) continue;  // a padding head
        // L2 reads (ld.global.cg): the partials were written by other SMs.
        const float* lse = p.partial_lse + row * splits;
        const float4* partial = reinterpret_cast<const float4*>(p.partial_out + row * splits * D);
        // Folded a batch at a time: the batch's loads all in flight together, then one max and
        // independent weights for the whole batch.
        MergeState<float4> state;
        for (int first = 0; first < splits; first += kLastMergeBatch) {
            float l[kLastMergeBatch], ones[kLastMergeBatch];
            float4 x[kLastMergeBatch];
#pragma unroll
            for (int j = 0; j < kLastMergeBatch; ++j) {
                const int s = first + j;
                l[j] = s < splits ? __ldcg(lse + s) : -INFINITY;
                x[j] = s < splits ? __ldcg(partial + (long long)s * QUADS + quad)
                                  : make_float4(0.f, 0.f, 0.f, 0.f);
                ones[j] = 1.f;
            }
            state.fold(l, ones, x);
        }
        store4(static_cast<T*>(p.out) + output_row(out_row, p.query_tokens, p.out_heads) * D + quad * 4,
               state.normalised());
        if (quad == 0 && p.lse_out != nullptr) p.lse_out[out_row] = state.lse2() * kLn2;
    }
}
