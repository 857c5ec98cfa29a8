// The partial pass of split-KV decode attention.
//
// One CTA per (split, kv head, batch); all query heads of the GQA group are handled together, so
// each K/V element is read from HBM once per group.
//
// Inside the CTA every warp streams its own interleaved share of the chunk ("warp tiles") through
// a private cp.async ring, so the main loop needs no block-wide barrier. A warp covers RPS rows at
// a time, LPR lanes per row, 8 head-dim elements per lane: q·k is a per-lane partial dot finished
// by a butterfly over the row's lanes. Each warp keeps its own base-2 online softmax; the warps'
// states are merged once, through shared memory, at the end of the chunk.
//
// With one split the CTA writes the final output; otherwise a normalised partial and its LSE.
#pragma once

#include "common.cuh"
#include "paged_kv.cuh"
#include "warp_merge.cuh"

// Target bytes of K+V in flight per warp (the ring size).
constexpr int kRingBytesPerWarp = 24 * 1024;

template <typename T, int D, int GMAX> struct Tiling {
    static constexpr int kChunks = D / 8;  // 8-element chunks per row
    static constexpr int kLanesPerRow = kChunks <= 8 ? 8 : (kChunks <= 16 ? 16 : 32);
    static constexpr int kRowsPerStep = 32 / kLanesPerRow;
    // q lives in registers for small groups and in shared memory (after the ring) for GMAX 16.
    static constexpr bool kQInRegisters = GMAX <= 8;
    static constexpr int kQBytes = kQInRegisters ? 0 : GMAX * D * (int)sizeof(float);
    // The ring's share of kMaxSmemPerCta, and the bytes of a stage of `steps` steps.
    static constexpr int kRingBudget = kMaxSmemPerCta - kQBytes;
    static constexpr int stage_bytes(int steps) { return 2 * kRowsPerStep * steps * D * (int)sizeof(T); }
    // Steps per tile: fewer where two stages of the wanted tile would not fit the budget.
    static constexpr int steps_within_budget(int steps) {
        return steps > 1 && kWarps * 2 * stage_bytes(steps) > kRingBudget ? steps_within_budget(steps / 2) : steps;
    }
    static constexpr int kSteps = steps_within_budget(GMAX <= 4 ? 8 : (GMAX == 8 ? 4 : 2));
    static constexpr int kRows = kRowsPerStep * kSteps;  // rows per warp tile
    static constexpr int kStageBytes = stage_bytes(kSteps);
    static constexpr int kStagesWanted = kRingBytesPerWarp / kStageBytes;
    static constexpr int kStagesFit = kRingBudget / (kWarps * kStageBytes);
    static constexpr int kStagesClamped = kStagesWanted < 2 ? 2 : (kStagesWanted > 8 ? 8 : kStagesWanted);
    static constexpr int kStages = kStagesClamped < kStagesFit ? kStagesClamped : kStagesFit;
    static constexpr int kRingBytes = kWarps * kStages * kStageBytes;
    static constexpr int kMergeBytes = merge_smem_bytes<D, GMAX>();
    static constexpr int kSmemBytes = kRingBytes > kMergeBytes ? kRingBytes : kMergeBytes;
    static constexpr int kTotalSmem = kSmemBytes + kQBytes;
    static_assert(kStages >= 2 && kTotalSmem <= kMaxSmemPerCta, "the form fits the target's shared memory");
};

// V, the form's variant (kernels.toml's axes): kWindowed applies a sliding window (p.window_left)
// and soft-capping (p.softcap_log2), in forms of their own so that the others' code is not
// touched by either; kPaged reads K/V through the block table.
template <typename T, int D, int GMAX, class V>
__device__ __forceinline__ void decode_partial(const DecodeParams& p) {
    using Cfg = Tiling<T, D, GMAX>;
    constexpr int CHUNKS = Cfg::kChunks;
    constexpr int LPR = Cfg::kLanesPerRow;
    constexpr int RPS = Cfg::kRowsPerStep;
    constexpr int STEPS = Cfg::kSteps;
    constexpr int ROWS = Cfg::kRows;
    constexpr int STAGES = Cfg::kStages;
    constexpr int PIECES = D * (int)sizeof(T) / 16;  // 16-byte pieces per row

    extern __shared__ __align__(16) unsigned char smem[];
    if (dynamic_smem_bytes() < (unsigned)Cfg::kTotalSmem) __trap();
    allow_dependent_launch();

    const int tid = threadIdx.x;
    const int warp = tid / 32, lane = tid % 32;
    const int row_in_step = lane / LPR;
    const int chunk = lane % LPR;
    const bool active = chunk < CHUNKS;
    const int split = blockIdx.x, kv_head = blockIdx.y, b = blockIdx.z;
    const int group = p.q_heads / p.kv_heads;
    // Nothing global is touched before this point (programmatic launch, see the MMA kernel).
    wait_for_prerequisite_grid();

    int len = p.kv_len;
    if (p.seqlens != nullptr) len = min(len, (int)p.seqlens[b]);
    const SplitRange range = split_range(p, split, len);
    // Positions before the first query token's window are never streamed.
    const int start = V::kWindowed ? max(range.start, visible_begin(p, len, 0)) : range.start;
    const int end = range.end;
    const int num_tiles = end > start ? (end - start + ROWS - 1) / ROWS : 0;
    // In [shared_begin, shared_end) every query row sees every position; elsewhere row g sees
    // [row_begin[g], row_end[g]). Without a window both begins are 0.
    const int shared_end = min(end, visible_end<V>(p, len, 0));
    const int shared_begin = V::kWindowed ? visible_begin(p, len, p.query_tokens - 1) : 0;
    int row_begin[GMAX], row_end[GMAX];

    // Queries, pre-scaled so that scores come out in base 2.
    float q_reg[Cfg::kQInRegisters ? GMAX : 1][8];
    float* q_s = reinterpret_cast<float*>(smem + Cfg::kSmemBytes);
    const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride;
    // Query row g of this block in the caller's q, or head -1 past the group or for a padding head.
    auto query = [&](int g) -> QueryRow {
        const int real = g < group ? real_row(kv_head * group + g, p.padded_group, p.real_group) : -1;
        return real < 0 ? QueryRow{-1, 0} : query_row(real, p.query_tokens);
    };
    auto q_row = [&](int g) -> long long {
        const QueryRow r = query(g);
        return r.head < 0 ? -1 : r.token * p.q_seq_stride + (long long)r.head * p.q_head_stride;
    };
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
        const QueryRow r = query(g);
        row_end[g] = r.head < 0 ? end : min(end, visible_end<V>(p, len, r.token));
        row_begin[g] = V::kWindowed && r.head >= 0 ? visible_begin(p, len, r.token) : 0;
    }
    if constexpr (Cfg::kQInRegisters) {
#pragma unroll
        for (int g = 0; g < GMAX; ++g) {
            const long long row = q_row(g);
#pragma unroll
            for (int j = 0; j < 8; ++j)
                q_reg[g][j] = (row >= 0 && active)
                    ? to_float(q[row + chunk * 8 + j]) * p.scale_log2
                    : 0.f;
        }
    } else {
        for (int i = tid; i < GMAX * D; i += kThreads) {
            const int g = i / D, c = i - g * D;
            const long long row = q_row(g);
            q_s[i] = row >= 0 ? to_float(q[row + c]) * p.scale_log2 : 0.f;
        }
        __syncthreads();
    }

    T* ring = reinterpret_cast<T*>(smem) + (size_t)warp * STAGES * (Cfg::kStageBytes / sizeof(T));
    const int kv_source = kv_head / p.blocks_per_kv_head;  // the K/V head this block of queries reads
    // Paged: row 0 of (page 0, the K/V head), each row found through the sequence's pages.
    const T* k_base = V::kPaged
        ? static_cast<const T*>(p.k) + kv_source * p.k_head_stride
        : static_cast<const T*>(p.k) + b * p.k_batch_stride + kv_source * p.k_head_stride;
    const T* v_base = V::kPaged
        ? static_cast<const T*>(p.v) + kv_source * p.v_head_stride
        : static_cast<const T*>(p.v) + b * p.v_batch_stride + kv_source * p.v_head_stride;
    const uint32_t* pages = V::kPaged ? p.block_table + (long long)b * p.max_pages : nullptr;
    // This warp's n-th tile is the chunk's tile (warp + n * kWarps).
    const int my_tiles = num_tiles > warp ? (num_tiles - warp + kWarps - 1) / kWarps : 0;
    auto load_tile = [&](int n) {
        T* k_s = ring + (size_t)(n % STAGES) * 2 * ROWS * D;
        T* v_s = k_s + ROWS * D;
        const int first = start + (warp + n * kWarps) * ROWS;
#pragma unroll
        for (int i = lane; i < ROWS * PIECES; i += 32) {
            const int r = i / PIECES, c = i - r * PIECES;
            const bool valid = first + r < end;
            const long long pos = valid ? first + r : start;  // never form an address past the end
            if constexpr (V::kPaged) {
                const PagedRow at = paged_row(p, pages, static_cast<int>(pos));
                const T* k_row = k_base + at.page * p.k_batch_stride + at.row * p.k_seq_stride;
                const T* v_row = v_base + at.page * p.v_batch_stride + at.row * p.v_seq_stride;
                cp_async16(reinterpret_cast<char*>(k_s + r * D) + c * 16,
                           reinterpret_cast<const char*>(k_row) + c * 16, valid);
                cp_async16(reinterpret_cast<char*>(v_s + r * D) + c * 16,
                           reinterpret_cast<const char*>(v_row) + c * 16, valid);
            } else {
                cp_async16(reinterpret_cast<char*>(k_s + r * D) + c * 16,
                           reinterpret_cast<const char*>(k_base + pos * p.k_seq_stride) + c * 16,
                           valid);
                cp_async16(reinterpret_cast<char*>(v_s + r * D) + c * 16,
                           reinterpret_cast<const char*>(v_base + pos * p.v_seq_stride) + c * 16,
                           valid);
            }
        }
    };
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < my_tiles) load_tile(s);
        cp_async_commit();
    }

    float run_max[GMAX], run_sum[GMAX], acc[GMAX][8];
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
        run_max[g] = -INFINITY;
        run_sum[g] = 0.f;
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[g][j] = 0.f;
    }

    for (int n = 0; n < my_tiles; ++n) {
        cp_async_wait<STAGES - 2>();
        __syncwarp();  // tile n visible to the whole warp; slot n-1 free for reuse
        if (n + STAGES - 1 < my_tiles) load_tile(n + STAGES - 1);
        cp_async_commit();

        const T* k_s = ring + (size_t)(n % STAGES) * 2 * ROWS * D;
        const T* v_s = k_s + ROWS * D;
        const int first = start + (warp + n * kWarps) * ROWS;

        // Scores of this lane's row in every step, for every head.
        float score[GMAX][STEPS];
#pragma unroll
        for (int step = 0; step < STEPS; ++step) {
            const int row = step * RPS + row_in_step;
            float kf[8];
            if (active) {
                load8(k_s + row * D + chunk * 8, kf);
            } else {
#pragma unroll
                for (int j = 0; j < 8; ++j) kf[j] = 0.f;
            }
#pragma unroll
            for (int g = 0; g < GMAX; ++g) {
                float x = 0.f;
                if constexpr (Cfg::kQInRegisters) {
#pragma unroll
                    for (int j = 0; j < 8; ++j) x = fmaf(kf[j], q_reg[g][j], x);
                } else {
                    const float4* qv = reinterpret_cast<const float4*>(q_s + g * D + chunk * 8);
                    const float4 a = active ? qv[0] : make_float4(0.f, 0.f, 0.f, 0.f);
                    const float4 e = active ? qv[1] : make_float4(0.f, 0.f, 0.f, 0.f);
                    x = fmaf(kf[0], a.x, x); x = fmaf(kf[1], a.y, x);
                    x = fmaf(kf[2], a.z, x); x = fmaf(kf[3], a.w, x);
                    x = fmaf(kf[4], e.x, x); x = fmaf(kf[5], e.y, x);
                    x = fmaf(kf[6], e.z, x); x = fmaf(kf[7], e.w, x);
                }
                score[g][step] = x;
            }
#pragma unroll
            for (int o = LPR / 2; o > 0; o >>= 1)
#pragma unroll
                for (int g = 0; g < GMAX; ++g)
                    score[g][step] += __shfl_xor_sync(0xffffffffu, score[g][step], o);
            const int pos = first + row;
            const bool shared = pos < shared_end && (!V::kWindowed || pos >= shared_begin);
#pragma unroll
            for (int g = 0; g < GMAX; ++g) {
                const bool seen = pos < row_end[g] && (!V::kWindowed || pos >= row_begin[g]);
                score[g][step] = shared || seen ? score[g][step] : -INFINITY;
            }
            if constexpr (V::kWindowed) {
                if (p.softcap_log2 > 0.f) {
#pragma unroll
                    for (int g = 0; g < GMAX; ++g) score[g][step] = soft_capped(p, score[g][step]);
                }
            }
        }

        // Online softmax: one max per head over the warp tile, shared by all lanes.
#pragma unroll
        for (int g = 0; g < GMAX; ++g) {
            if (g >= group) continue;
            float tile_max = score[g][0];
#pragma unroll
            for (int step = 1; step < STEPS; ++step) tile_max = fmaxf(tile_max, score[g][step]);
#pragma unroll
            for (int o = LPR; o < 32; o <<= 1) tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, o));
            const float new_max = fmaxf(run_max[g], tile_max);
            // 0 while this row has seen nothing (a tile can be masked whole for the earlier of
            // several query tokens).
            const float base = new_max == -INFINITY ? 0.f : new_max;
            const float rescale = fast_exp2(run_max[g] - base);
            float tile_sum = 0.f;
#pragma unroll
            for (int step = 0; step < STEPS; ++step) {
                score[g][step] = fast_exp2(score[g][step] - base);
                tile_sum += score[g][step];
            }
            run_sum[g] = run_sum[g] * rescale + tile_sum;  // this lane's rows only
            run_max[g] = new_max;
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[g][j] *= rescale;
        }

        // Values: this lane's 8 columns of its rows.
        if (active) {
#pragma unroll
            for (int step = 0; step < STEPS; ++step) {
                const int row = step * RPS + row_in_step;
                float vf[8];
                load8(v_s + row * D + chunk * 8, vf);
#pragma unroll
                for (int g = 0; g < GMAX; ++g) {
                    if (g < group) {
#pragma unroll
                        for (int j = 0; j < 8; ++j) acc[g][j] = fmaf(score[g][step], vf[j], acc[g][j]);
                    }
                }
            }
        }
    }

    // Fold the rows of each step together: lanes of a row group share max and rescales.
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
#pragma unroll
        for (int o = LPR; o < 32; o <<= 1) {
            run_sum[g] += __shfl_xor_sync(0xffffffffu, run_sum[g], o);
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[g][j] += __shfl_xor_sync(0xffffffffu, acc[g][j], o);
        }
    }

    // Merge the warps through shared memory (the rings are free once every copy has landed).
    cp_async_wait<0>();
    __syncthreads();
    float* merge = reinterpret_cast<float*>(smem);  // [warp][g][slot]: outputs, max, sum
    if (row_in_step == 0) {
#pragma unroll
        for (int g = 0; g < GMAX; ++g) {
            if (g >= group) continue;
            float* slot = merge + (warp * GMAX + g) * merge_slot_floats<D>();
            if (active) {
#pragma unroll
                for (int j = 0; j < 8; ++j) slot[chunk * 8 + j] = acc[g][j] * p.v_scale;
            }
            if (lane == 0) {
                slot[D] = run_max[g];
                slot[D + 1] = run_sum[g];
            }
        }
    }
    __syncthreads();

    merge_warps_and_store<T, D, GMAX>(p, merge, group, split, kv_head, b, nullptr);
}
