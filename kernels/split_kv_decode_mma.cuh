// The partial pass of split-KV decode attention on tensor cores (f16/bf16, sm_80 and later).
//
// One CTA per (split, kv head, batch), as in the CUDA-core kernel, or, for grids of more than one
// wave, persistent CTAs that walk those work items. The same streaming shape either way: each of
// the four warps owns a private cp.async ring and an interleaved share of the chunk's tiles,
// so the main loop has no block-wide barrier; the warps merge once per item.
//
// The GQA group is the M dimension of `mma.m16n8k16`: the query rows of one kv head (its query
// heads, times the query tokens where there are several) form a 16-row A operand (rows past the
// group are zero), so each 16 rows of K cost D/16 × 2 MMAs for
// the scores and D/8 MMAs for the values, whatever the group size. That moves the dot products
// off the CUDA cores, which is what limits large groups there. A tile is 16 rows (32 at D ≤ 64);
// per 16 rows of it and warp:
//   S (16 heads × 16 rows)  = Q (16 × D)  · Kᵀ   — K fragments by `ldmatrix`
//   O (16 heads × D)       += P (16 × 16) · V    — V fragments by `ldmatrix.trans`
// The score accumulator's layout is the A-operand layout of the second product, so P never
// leaves registers. Softmax statistics stay per thread (two heads each) and are combined across
// the four lanes of a quad once per tile (max) or once per chunk (sum).
//
// fp8 (e4m3) K/V stream as bytes, half those of f16/bf16 per position, and widen to f16 pairs in
// registers (sm_89 and later); the products then run on f16 operands. The byte layout decides
// which elements a lane's fragments hold, so two index permutations stand in for a transpose:
//   - keys: an `ldmatrix` row of 16 bytes is one k-step (16 dims), and a lane holds dims
//     4c..4c+3 of its key; the query fragment takes the same dims in the same order (k-step
//     columns 2c, 2c+1 ← dims 4c, 4c+1 and 2c+8, 2c+9 ← 4c+2, 4c+3), which leaves the dot
//     products as they were;
//   - values: `ldmatrix.trans` moves byte pairs, so a lane holds dims 2r, 2r+1 of keys 2c and
//     2c+1; a byte permute splits them into the B fragments of two n-tiles, the even and the odd
//     dims of the 16, and the accumulator's columns are put back in order when it is stored.
#pragma once

#include "cluster_merge.cuh"
#include "common.cuh"
#include "last_split_merge.cuh"
#include "paged_kv.cuh"
#include "tensor_core.cuh"
#include "warp_merge.cuh"

// Bytes of K+V ring per warp: three 8 KiB stages at D = 128 (16 rows) and D = 64 (32 rows).
constexpr int kMmaRingBytesPerWarp = 26 * 1024;

// KV: the K/V storage type, 16-bit or fp8.
template <typename KV, int D, int GMAX> struct MmaTiling {
    static constexpr int kRowBytes = D * (int)sizeof(KV);
    // Rows per tile: 16 (one m16n8k16 k-step of the value product), or 32 or 64 where a row is
    // at most 128 or 64 bytes, so that a tile still carries 8 KiB of K+V and the loop's fixed
    // work per tile (ring wait, copy issue, max shuffles, rescale) is paid per as many bytes as
    // at D = 128.
    static constexpr int kRows = kRowBytes <= 64 ? 64 : (kRowBytes <= 128 ? 32 : 16);
    static constexpr int kRowBlocks = kRows / 16;
    // Rows stay dense, so that every eight lanes' 16-byte async copies fill one aligned 128-byte
    // line of shared memory (a copy that straddles two lines costs twice). The eight rows an
    // `ldmatrix` phase reads must then sit in distinct banks: a row moves the bank by PIECES
    // (mod 8) pieces, so rows repeat the bank pattern every kRowsPerCycle and each such run XORs
    // its pieces with a different value below kPieceGroup (see piece_offset).
    static constexpr int kPieces = kRowBytes / 16;
    static constexpr int kPieceGroup = kPieces % 8 == 0 ? 8 : (kPieces % 4 == 0 ? 4 : (kPieces % 2 == 0 ? 2 : 1));
    static constexpr int kRowsPerCycle = 8 / kPieceGroup;
    static constexpr int kStageBytes = 2 * kRows * kRowBytes;
    static constexpr int kStagesWanted = kMmaRingBytesPerWarp / kStageBytes;
    // At least three, so that two tiles are in flight while one is computed; at D = 256 that is
    // 48 KiB a warp, past kMmaRingBytesPerWarp. Fewer where kMaxSmemPerCta holds fewer; at
    // D = 256 with 16-bit K/V not even two fit 99 KiB, and the host runs the CUDA-core form on a
    // GPU that cannot give this one its shared memory.
    static constexpr int kStagesClamped = kStagesWanted < 3 ? 3 : (kStagesWanted > 8 ? 8 : kStagesWanted);
    static constexpr int kStagesFit = kMaxSmemPerCta / (kWarps * kStageBytes);
    static constexpr int kStages = kStagesClamped <= kStagesFit || kStagesFit < 2 ? kStagesClamped : kStagesFit;
    static constexpr int kRingBytes = kWarps * kStages * kStageBytes;
    // The warps' states, after the ring is drained.
    static constexpr int kMergeBytes = merge_smem_bytes<D, GMAX>();
    static constexpr int kSmemBytes = kRingBytes > kMergeBytes ? kRingBytes : kMergeBytes;
    // A cluster merge adds the receive area past both: the other CTAs push into it while this
    // one may still be streaming.
    static constexpr int kClusterSmemBytes = kSmemBytes + cluster_receive_bytes<D, GMAX>();
    // The persistent form keeps the ring streaming while it merges, so the areas sit side by side.
    static constexpr int kPersistentSmemBytes = kRingBytes + merge_smem_bytes<D, GMAX>();
};

// c += a · b as above, with a and b f16 and the product f32, whatever T is: for fp8 K/V, whose
// elements widen to f16.
template <typename T, bool FP8> struct ProductType { using type = T; };
template <typename T> struct ProductType<T, true> { using type = __half; };

// Two e4m3 values, the low and high byte of `pair`, as an f16 pair (one instruction on sm_89+).
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t pair) {
    uint32_t out;
    const uint16_t bits = static_cast<uint16_t>(pair);
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(out) : "h"(bits));
    return out;
}

// Two query elements as an f16 pair, saturated to f16's range, for products with fp8 K.
template <typename T> __device__ __forceinline__ uint32_t to_f16x2(const T* x) {
    const float lo = fminf(fmaxf(to_float(x[0]), -65504.f), 65504.f);
    const float hi = fminf(fmaxf(to_float(x[1]), -65504.f), 65504.f);
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}

// Four 8×8 b16 matrices from shared memory; lanes 8i..8i+7 address the rows of matrix i.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem) {
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

// Two matrices; lanes 0-7 and 8-15 address their rows.
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], const void* smem) {
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(a));
}

__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&r)[2], const void* smem) {
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(a));
}

__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// The ring slot of 16-byte piece `piece` of row `row`: XOR-ing with a value below kPieceGroup
// keeps each piece within its row (kPieces is a multiple of kPieceGroup) and is its own inverse.
template <typename KV, int D, int GMAX>
__device__ __forceinline__ int piece_slot(int row, int piece) {
    using Cfg = MmaTiling<KV, D, GMAX>;
    return piece ^ ((row / Cfg::kRowsPerCycle) & (Cfg::kPieceGroup - 1));
}

// Byte offset of 16-byte piece `piece` of row `row` within a K or V tile.
template <typename KV, int D, int GMAX>
__device__ __forceinline__ int piece_offset(int row, int piece) {
    return row * MmaTiling<KV, D, GMAX>::kRowBytes + piece_slot<KV, D, GMAX>(row, piece) * 16;
}

// One work item: a (split, kv head, batch) and the part of its chunk that exists. A "kv head"
// is a block of at most GMAX query heads; wide groups have several per K/V head.
struct MmaItem {
    int split, kv_head, b;
    int start, end;   // positions [start, end) of this split
    int len;          // positions of the sequence
    int shared_end;   // end, or below it the positions every query token sees (visible_end)
    int my_tiles;     // tiles of the chunk this warp streams
    const char* k;    // row 0 of (b, kv_head); paged: of (page 0, kv_head)
    const char* v;
};

// Item `index` counts splits fastest, then kv heads, then batches, like the one-item grid.
template <typename KV, int ROWS, class V>
__device__ __forceinline__ MmaItem mma_item(const DecodeParams& p, int index, int warp) {
    MmaItem it;
    if constexpr (V::kPersistent) {
        it.split = index % p.num_splits;
        const int rest = index / p.num_splits;
        it.kv_head = rest % p.kv_heads;
        it.b = rest / p.kv_heads;
    } else {  // the CTA's own item, without the divisions
        it.split = blockIdx.x;
        it.kv_head = blockIdx.y;
        it.b = blockIdx.z;
    }
    int len = p.kv_len;
    if (p.seqlens != nullptr) len = min(len, (int)p.seqlens[it.b]);
    const SplitRange range = split_range(p, it.split, len);
    // Positions before the first query token's window are never streamed.
    it.start = V::kWindowed ? max(range.start, visible_begin(p, len, 0)) : range.start;
    it.end = range.end;
    it.len = len;
    it.shared_end = min(it.end, visible_end<V>(p, len, 0));
    const int num_tiles = it.end > it.start ? (it.end - it.start + ROWS - 1) / ROWS : 0;
    // This warp's n-th tile is the chunk's tile (warp + n * kWarps).
    it.my_tiles = num_tiles > warp ? (num_tiles - warp + kWarps - 1) / kWarps : 0;
    const int kv_source = it.kv_head / p.blocks_per_kv_head;  // the K/V head this block reads
    if constexpr (V::kPaged) {
        it.k = reinterpret_cast<const char*>(static_cast<const KV*>(p.k) + kv_source * p.k_head_stride);
        it.v = reinterpret_cast<const char*>(static_cast<const KV*>(p.v) + kv_source * p.v_head_stride);
    } else {
        it.k = reinterpret_cast<const char*>(static_cast<const KV*>(p.k) + it.b * p.k_batch_stride +
                                             kv_source * p.k_head_stride);
        it.v = reinterpret_cast<const char*>(static_cast<const KV*>(p.v) + it.b * p.v_batch_stride +
                                             kv_source * p.v_head_stride);
    }
    return it;
}

// The partial pass, its phases as functions of one struct: the shapes they share are its
// constants. V, the form's variant (kernels.toml's axes):
// - kPersistent: a grid of one wave whose CTAs take items blockIdx.x, + gridDim.x, ...; each
//   warp's ring streams on across item boundaries, so the next item's first tiles are in flight
//   while this one is merged and stored (multi-wave grids otherwise pay a ramp per CTA).
//   Otherwise one item per CTA, at (blockIdx.x, blockIdx.y, blockIdx.z) = (split, kv head, batch).
// - kLastCtaMerge (one item per CTA only): the splits of each (batch, kv head) merge in the CTA
//   that finishes last (kernels/last_split_merge.cuh), a form of its own so that the other forms'
//   code is not shaped around that merge's registers.
// - kLockstep (one item per CTA only, sm_90): the blocks of query heads that read one K/V head
//   (wide groups) run as a cluster along y, and its CTAs hold each other within
//   `p.lockstep_tiles` tiles, so that the first to stream a tile leaves it in L2 for the others.
// - kWindowed: a sliding window (p.window_left) and soft-capping (p.softcap_log2), a form of its
//   own so that the others' code is not touched by either.
// - kPaged: K/V in a pool of pages read through the block table (kernels/paged_kv.cuh).
// KV: the K/V storage type, T or fp8 (e4m3).
template <typename T, typename KV, int D, int GMAX, class V> struct MmaDecode {
    static_assert(sizeof(T) == 2, "tensor-core path is for 16-bit inputs");
    static_assert(D % 16 == 0, "head dim must be a multiple of 16");
    static constexpr bool FP8 = sizeof(KV) == 1;
    static_assert(FP8 || sizeof(KV) == sizeof(T), "K/V are T or fp8");
    using Cfg = MmaTiling<KV, D, GMAX>;
    using TC = TensorCore<typename ProductType<T, FP8>::type>;
    static constexpr int ROWS = Cfg::kRows;
    static constexpr int RB = Cfg::kRowBlocks;  // 16-row blocks per tile
    static constexpr int ROW_BYTES = Cfg::kRowBytes;
    static constexpr int STAGES = Cfg::kStages;
    static constexpr int KSTEPS = D / 16;         // k-steps of the score product
    // Two score accumulators per row block past four k-steps; not at D = 256, which already spills.
    static constexpr bool SPLIT_CHAINS = KSTEPS > 4 && D <= 128;
    static constexpr int NTILES = D / 8;          // n-tiles of the value product
    static constexpr int PIECES = Cfg::kPieces;   // 16-byte pieces per row
    static constexpr bool kUpper = GMAX > 8;      // heads 8..15 (the fragments' upper rows) exist
    static constexpr int SMEM = V::kPersistent ? Cfg::kPersistentSmemBytes : Cfg::kSmemBytes;

    static_assert(!(V::kPersistent && V::kLastCtaMerge), "the persistent form merges splits in the combine pass");
    static_assert(!(V::kPersistent && V::kLockstep), "persistent CTAs of one cluster walk different items");

    // Where a row's pieces divide a warp evenly, each lane copies the same pieces of every tile:
    // rows lane_row + j * LANE_ROWS, piece lane_piece. Their source offsets within a tile and
    // their ring offsets are then fixed per thread, so a full tile costs one address per tensor
    // and an add per copy; the per-row clamping is left to a chunk's last, partial tile.
    static constexpr bool kLaneFixed = 32 % PIECES == 0 && ROWS * PIECES / 32 <= 8;
    static constexpr int LANE_ROWS = kLaneFixed ? 32 / PIECES : 1;
    static constexpr int PER_LANE = kLaneFixed ? ROWS * PIECES / 32 : 1;

    // Load: Q as A fragments, one set per k-step; rows past the group, and padding heads, are
    // zero. row_end: where the positions that rows quad_row and quad_row + 8 see end in the item;
    // row_begin (windowed forms): where they begin.
    static __device__ __forceinline__ void load_q(const DecodeParams& p, const MmaItem& it,
                                                  int group, int quad_row, int quad_col,
                                                  uint32_t (&q_frag)[KSTEPS][4], int (&row_end)[2],
                                                  int (&row_begin)[2]) {
        const T* q = static_cast<const T*>(p.q) + it.b * p.q_batch_stride;
        auto head_row = [&](int head, int& end) -> const T* {
            end = it.end;
            if (head >= group) return nullptr;
            const int real = real_row(it.kv_head * group + head, p.padded_group, p.real_group);
            if (real < 0) return nullptr;
            const QueryRow r = query_row(real, p.query_tokens);
            end = min(it.end, visible_end<V>(p, it.len, r.token));
            return q + r.token * p.q_seq_stride + (long long)r.head * p.q_head_stride;
        };
        if constexpr (V::kWindowed) {
            auto head_begin = [&](int head) {
                const int real = head < group
                    ? real_row(it.kv_head * group + head, p.padded_group, p.real_group)
                    : -1;
                return real < 0 ? 0 : visible_begin(p, it.len, query_row(real, p.query_tokens).token);
            };
            row_begin[0] = head_begin(quad_row);
            row_begin[1] = kUpper ? head_begin(quad_row + 8) : 0;
        }
        const T* lo = head_row(quad_row, row_end[0]);
        const T* hi = nullptr;
        row_end[1] = it.end;
        if constexpr (kUpper) hi = head_row(quad_row + 8, row_end[1]);
        auto q_pair = [](const T* row, int col) -> uint32_t {
            if (row == nullptr) return 0u;
            if constexpr (FP8) return to_f16x2(row + col);
            return *reinterpret_cast<const uint32_t*>(row + col);
        };
        // fp8 K: the k-step's columns in the order a lane holds its key's dims (see the top).
        constexpr int kLaneCols = FP8 ? 4 : 2, kUpperCols = FP8 ? 2 : 8;
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
            const int col = ks * 16 + quad_col * kLaneCols;
            q_frag[ks][0] = q_pair(lo, col);
            q_frag[ks][1] = q_pair(hi, col);
            q_frag[ks][2] = q_pair(lo, col + kUpperCols);
            q_frag[ks][3] = q_pair(hi, col + kUpperCols);
        }
    }

    // Scores: S = Q · Kᵀ for the tile at `stage_offset` in the warp's `ring`. s[rb][nt][j]: head
    // quad_row (j < 2) or quad_row + 8 (j >= 2), tile row rb*16 + nt*8 + quad_col*2 + (j&1).
    // k_lane_row, k_lane_piece: this lane's ldmatrix row address (see run).
    // The ring and an offset rather than the stage's address: the stage's address as an argument of
    // both this and accumulate makes nvcc fold the ring's addresses differently in the loads.
    static __device__ __forceinline__ void scores(float (&s)[RB][2][4], const unsigned char* ring,
                                                  int stage_offset,
                                                  const uint32_t (&q_frag)[KSTEPS][4],
                                                  int k_lane_row, int k_lane_piece, int lane) {
        const unsigned char* stage = ring + stage_offset;
        // Long k-step chains are split in two (even and odd k-steps, summed at the end) so
        // that each dependent chain of MMAs is at most four long.
        float s_odd[RB][2][4];
#pragma unroll
        for (int rb = 0; rb < RB; ++rb) {
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                for (int j = 0; j < 4; ++j) s[rb][nt][j] = s_odd[rb][nt][j] = 0.f;
            if constexpr (FP8) {
                // A 16-byte piece is a k-step: one ldmatrix.x4 holds two k-steps of both
                // 8-row n-tiles, (rows 0-7, ks), (rows 0-7, ks + 1), (rows 8-15, ks), ...
#pragma unroll
                for (int ks = 0; ks < KSTEPS; ks += 2) {
                    if (ks + 1 < KSTEPS) {
                        uint32_t kf[4];
                        ldmatrix_x4(kf, stage + piece_offset<KV, D, GMAX>(rb * 16 + k_lane_row,
                                                                         ks + k_lane_piece));
#pragma unroll
                        for (int step = 0; step < 2; ++step) {
                            float (&chain)[2][4] = SPLIT_CHAINS && step == 1 ? s_odd[rb] : s[rb];
#pragma unroll
                            for (int nt = 0; nt < 2; ++nt) {
                                const uint32_t x = kf[nt * 2 + step];
                                TC::mma(chain[nt], q_frag[ks + step], e4m3x2_to_f16x2(x),
                                        e4m3x2_to_f16x2(x >> 16));
                            }
                        }
                    } else {  // an odd last k-step (D = 80)
                        uint32_t kf[2];
                        ldmatrix_x2(kf, stage + piece_offset<KV, D, GMAX>(rb * 16 + (lane & 15), ks));
#pragma unroll
                        for (int nt = 0; nt < 2; ++nt)
                            TC::mma(s[rb][nt], q_frag[ks], e4m3x2_to_f16x2(kf[nt]),
                                    e4m3x2_to_f16x2(kf[nt] >> 16));
                    }
                }
            } else {
#pragma unroll
                for (int ks = 0; ks < KSTEPS; ++ks) {
                    uint32_t kf[4];
                    ldmatrix_x4(kf, stage + piece_offset<KV, D, GMAX>(rb * 16 + k_lane_row,
                                                                     ks * 2 + k_lane_piece));
                    float (&chain)[2][4] = SPLIT_CHAINS && ks % 2 == 1 ? s_odd[rb] : s[rb];
                    TC::mma(chain[0], q_frag[ks], kf[0], kf[1]);
                    TC::mma(chain[1], q_frag[ks], kf[2], kf[3]);
                }
            }
            if constexpr (SPLIT_CHAINS)
#pragma unroll
                for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                    for (int j = 0; j < 4; ++j) s[rb][nt][j] += s_odd[rb][nt][j];
        }
    }

    // Scores: scaled to log2 units, the positions a query row does not see masked out, and
    // soft-capped (windowed forms). `first`: the tile's first position.
    static __device__ __forceinline__ void mask_scores(const DecodeParams& p, const MmaItem& it,
                                                       float (&s)[RB][2][4], int first, int quad_col,
                                                       const int (&row_end)[2],
                                                       const int (&row_begin)[2]) {
        bool full = first + ROWS <= it.shared_end;
        // From here on every query token sees the positions.
        if constexpr (V::kWindowed) full = full && first >= visible_begin(p, it.len, p.query_tokens - 1);
#pragma unroll
        for (int rb = 0; rb < RB; ++rb)
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int row = first + rb * 16 + nt * 8 + quad_col * 2 + (j & 1);
                    if constexpr (V::kWindowed) {
                        const bool seen = row < row_end[j >> 1] && row >= row_begin[j >> 1];
                        s[rb][nt][j] = full || seen ? s[rb][nt][j] * p.scale_log2 : -INFINITY;
                    } else {
                        s[rb][nt][j] = full || row < row_end[j >> 1] ? s[rb][nt][j] * p.scale_log2
                                                                     : -INFINITY;
                    }
                }
        if constexpr (V::kWindowed) {
            if (p.softcap_log2 > 0.f) {
#pragma unroll
                for (int rb = 0; rb < RB; ++rb)
#pragma unroll
                    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                        for (int j = 0; j < 4; ++j) s[rb][nt][j] = soft_capped(p, s[rb][nt][j]);
            }
        }
    }

    // Softmax update: the running max and sum take the tile in, the accumulator is rescaled to
    // the new max, and the tile's weights come out as P, the A fragments of the value product
    // (one per 16-row block).
    static __device__ __forceinline__ void softmax_update(const float (&s)[RB][2][4],
                                                          float (&run_max)[2], float (&run_sum)[2],
                                                          float (&acc)[NTILES][4],
                                                          uint32_t (&p_frag)[RB][4]) {
        // base: the max the weights are taken against; 0 while a query row has seen nothing
        // (with several query tokens a tile can be masked whole for the earlier ones).
        float rescale[2] = {1.f, 1.f}, base[2] = {0.f, 0.f};
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            if (h == 1 && !kUpper) break;
            float thread_max = -INFINITY;
#pragma unroll
            for (int rb = 0; rb < RB; ++rb)
                thread_max = fmaxf(thread_max, fmaxf(fmaxf(s[rb][0][2 * h], s[rb][0][2 * h + 1]),
                                                     fmaxf(s[rb][1][2 * h], s[rb][1][2 * h + 1])));
            const float new_max = fmaxf(run_max[h], quad_max(thread_max));
            base[h] = new_max == -INFINITY ? 0.f : new_max;
            rescale[h] = fast_exp2(run_max[h] - base[h]);
            run_max[h] = new_max;
        }

        // The sum uses the rounded weights, so the output is an exact convex combination of the
        // rows it weights. A fragment order: (head lo, k lo), (head hi, k lo), (head lo, k hi),
        // (head hi, k hi).
        float tile_sum[2] = {0.f, 0.f};
#pragma unroll
        for (int rb = 0; rb < RB; ++rb)
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    if (h == 1 && !kUpper) {
                        p_frag[rb][nt * 2 + h] = 0u;
                        continue;
                    }
                    const uint32_t packed = TC::pack(fast_exp2(s[rb][nt][2 * h] - base[h]),
                                                     fast_exp2(s[rb][nt][2 * h + 1] - base[h]));
                    const float2 rounded = TC::unpack(packed);
                    tile_sum[h] += rounded.x + rounded.y;
                    p_frag[rb][nt * 2 + h] = packed;
                }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            if (h == 1 && !kUpper) break;
            run_sum[h] = run_sum[h] * rescale[h] + tile_sum[h];
        }
#pragma unroll
        for (int nt = 0; nt < NTILES; ++nt) {
            acc[nt][0] *= rescale[0];
            acc[nt][1] *= rescale[0];
            if constexpr (kUpper) {
                acc[nt][2] *= rescale[1];
                acc[nt][3] *= rescale[1];
            }
        }
    }

    // Accumulate: O += P · V for the tile at `stage_offset` in the warp's `ring` (see scores).
    // v_lane_row, v_lane_piece: this lane's ldmatrix row address (see run).
    static __device__ __forceinline__ void accumulate(float (&acc)[NTILES][4],
                                                      const uint32_t (&p_frag)[RB][4],
                                                      const unsigned char* ring, int stage_offset,
                                                      int v_lane_row, int v_lane_piece, int lane) {
        const unsigned char* stage = ring + stage_offset;
#pragma unroll
        for (int rb = 0; rb < RB; ++rb) {
            if constexpr (FP8) {
                // A piece is 16 dims: its byte pairs (dims 2r, 2r+1 of keys 2c, 2c+1) split
                // into n-tile 2·piece (even dims) and 2·piece + 1 (odd dims).
                auto piece_product = [&](int piece, uint32_t rows_lo, uint32_t rows_hi) {
                    const uint32_t lo = __byte_perm(rows_lo, 0, 0x3120);
                    const uint32_t hi = __byte_perm(rows_hi, 0, 0x3120);
                    TC::mma(acc[2 * piece], p_frag[rb], e4m3x2_to_f16x2(lo), e4m3x2_to_f16x2(hi));
                    TC::mma(acc[2 * piece + 1], p_frag[rb], e4m3x2_to_f16x2(lo >> 16),
                            e4m3x2_to_f16x2(hi >> 16));
                };
#pragma unroll
                for (int piece = 0; piece + 1 < PIECES; piece += 2) {
                    uint32_t vf[4];  // (rows 0-7, piece), (rows 8-15, piece), then piece + 1
                    ldmatrix_x4_trans(vf, stage + ROWS * ROW_BYTES +
                                              piece_offset<KV, D, GMAX>(rb * 16 + v_lane_row,
                                                                        piece + v_lane_piece));
                    piece_product(piece, vf[0], vf[1]);
                    piece_product(piece + 1, vf[2], vf[3]);
                }
                if constexpr (PIECES % 2 == 1) {  // D = 80
                    uint32_t vf[2];
                    ldmatrix_x2_trans(vf, stage + ROWS * ROW_BYTES +
                                              piece_offset<KV, D, GMAX>(rb * 16 + (lane & 15),
                                                                        PIECES - 1));
                    piece_product(PIECES - 1, vf[0], vf[1]);
                }
            } else {
#pragma unroll
                for (int pair = 0; pair < NTILES / 2; ++pair) {
                    uint32_t vf[4];
                    ldmatrix_x4_trans(vf, stage + ROWS * ROW_BYTES +
                                              piece_offset<KV, D, GMAX>(rb * 16 + v_lane_row,
                                                                        pair * 2 + v_lane_piece));
                    TC::mma(acc[2 * pair], p_frag[rb], vf[0], vf[1]);
                    TC::mma(acc[2 * pair + 1], p_frag[rb], vf[2], vf[3]);
                }
            }
        }
    }

    // Write: this warp's state of the item (its scaled accumulator, max and sum per query row)
    // into its slots of the merge area.
    static __device__ __forceinline__ void write_state(const DecodeParams& p, float* merge,
                                                       const float (&acc)[NTILES][4],
                                                       const float (&run_max)[2],
                                                       const float (&run_sum)[2], int group,
                                                       int warp, int quad_row, int quad_col) {
        constexpr int SLOT = merge_slot_floats<D>();
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            if (h == 1 && !kUpper) break;
            const int head = quad_row + 8 * h;
            const float sum = quad_sum(run_sum[h]);
            if (head < group) {
                float* slot = merge + (warp * GMAX + head) * SLOT;
                // The values' scale is linear, so it applies once here.
                const float vs = p.v_scale;
                if constexpr (FP8) {
                    // n-tiles 2c and 2c + 1 hold the even and odd dims of dims 16c..16c+15.
#pragma unroll
                    for (int c = 0; c < NTILES / 2; ++c) {
                        float* at = slot + c * 16 + quad_col * 4;
                        *reinterpret_cast<float2*>(at) =
                            make_float2(acc[2 * c][2 * h] * vs, acc[2 * c + 1][2 * h] * vs);
                        *reinterpret_cast<float2*>(at + 2) = make_float2(
                            acc[2 * c][2 * h + 1] * vs, acc[2 * c + 1][2 * h + 1] * vs);
                    }
                } else {
#pragma unroll
                    for (int nt = 0; nt < NTILES; ++nt)
                        *reinterpret_cast<float2*>(slot + nt * 8 + quad_col * 2) =
                            make_float2(acc[nt][2 * h] * vs, acc[nt][2 * h + 1] * vs);
                }
                if (quad_col == 0) {
                    slot[D] = run_max[h];
                    slot[D + 1] = sum;
                }
            }
        }
    }

    static __device__ __forceinline__ void run(const DecodeParams& p) {
        extern __shared__ __align__(16) unsigned char smem[];
        if (dynamic_smem_bytes() < (unsigned)SMEM) __trap();
        if (V::kLastCtaMerge && (p.merge != kMergeByLastCta || p.split_counters == nullptr)) __trap();
        if (V::kLockstep && (p.merge == kMergeInCluster || p.lockstep_tiles < 1)) __trap();
        // The cluster merge's first barrier phase: arrived at once, waited on before the first
        // push, so that no CTA stores into another that has not started.
        const bool cluster = !V::kPersistent && !V::kLastCtaMerge && !V::kLockstep &&
                             p.num_splits > 1 && p.merge == kMergeInCluster;
        if (cluster) {
            if (dynamic_smem_bytes() < (unsigned)Cfg::kClusterSmemBytes) __trap();
            cluster_arrive_relaxed();
        }
        allow_dependent_launch();

        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        const int quad_row = lane >> 2;  // fragment row: head quad_row (and quad_row + 8)
        const int quad_col = lane & 3;   // fragment column pair
        const int group = p.q_heads / p.kv_heads;
        const int items = p.num_splits * p.kv_heads * p.batch;
        const int first_item = V::kPersistent
            ? blockIdx.x
            : blockIdx.x + p.num_splits * (blockIdx.y + p.kv_heads * blockIdx.z);
        const int item_stride = V::kPersistent ? gridDim.x : items;
        // Up to here nothing has touched global memory, so the CTA may run ahead of the previous
        // kernel (programmatic launch); from here on it reads what that kernel wrote.
        wait_for_prerequisite_grid();

        unsigned char* ring = smem + warp * STAGES * Cfg::kStageBytes;
        const long long k_row_bytes = p.k_seq_stride * (long long)sizeof(KV);
        const long long v_row_bytes = p.v_seq_stride * (long long)sizeof(KV);
        const int lane_row = kLaneFixed ? lane / PIECES : 0, lane_piece = kLaneFixed ? lane % PIECES : 0;
        const unsigned ring_shared = static_cast<unsigned>(__cvta_generic_to_shared(ring));
        int lane_dst[PER_LANE];
#pragma unroll
        for (int j = 0; j < PER_LANE; ++j)
            lane_dst[j] = piece_offset<KV, D, GMAX>(lane_row + j * LANE_ROWS, lane_piece);
        const long long k_lane = lane_row * k_row_bytes + lane_piece * 16;
        const long long v_lane = lane_row * v_row_bytes + lane_piece * 16;
        const long long k_page_bytes = p.k_batch_stride * (long long)sizeof(KV);
        const long long v_page_bytes = p.v_batch_stride * (long long)sizeof(KV);
        const unsigned long long stream_policy = l2_evict_first_policy();

        // Load: tile n of this warp's share of item `it`, K then V, into ring slot `slot`. A lambda
        // over the copy state above, not a function of this struct: handed that state as
        // arguments, nvcc orders the kernels' registers differently and moves their spills.
        auto load_tile = [&](int slot, const MmaItem& it, int n) {
            const int first = it.start + (warp + n * kWarps) * ROWS;
            // Paged: each row looks its page up in the sequence's row of the block table (pages may
            // be shorter than a tile).
            const uint32_t* pages = V::kPaged ? p.block_table + (long long)it.b * p.max_pages : nullptr;
            if constexpr (V::kPaged) {
                if (kLaneFixed && first + ROWS <= it.end) {
                    const unsigned k_dst = ring_shared + slot * Cfg::kStageBytes;
                    const unsigned v_dst = k_dst + ROWS * ROW_BYTES;
#pragma unroll
                    for (int j = 0; j < PER_LANE; ++j) {
                        const PagedRow at = paged_row(p, pages, first + lane_row + j * LANE_ROWS);
                        cp_async16_to_hint(k_dst + lane_dst[j],
                                           it.k + at.page * k_page_bytes + at.row * k_row_bytes +
                                               lane_piece * 16,
                                           stream_policy);
                        cp_async16_to_hint(v_dst + lane_dst[j],
                                           it.v + at.page * v_page_bytes + at.row * v_row_bytes +
                                               lane_piece * 16,
                                           stream_policy);
                    }
                    return;
                }
            } else if (kLaneFixed && first + ROWS <= it.end) {
                const char* k_src = it.k + first * k_row_bytes + k_lane;
                const char* v_src = it.v + first * v_row_bytes + v_lane;
                const unsigned k_dst = ring_shared + slot * Cfg::kStageBytes;
                const unsigned v_dst = k_dst + ROWS * ROW_BYTES;
#pragma unroll
                for (int j = 0; j < PER_LANE; ++j) {
                    cp_async16_to_hint(k_dst + lane_dst[j], k_src + j * LANE_ROWS * k_row_bytes, stream_policy);
                    cp_async16_to_hint(v_dst + lane_dst[j], v_src + j * LANE_ROWS * v_row_bytes, stream_policy);
                }
                return;
            }
            unsigned char* k_s = ring + slot * Cfg::kStageBytes;
            unsigned char* v_s = k_s + ROWS * ROW_BYTES;
#pragma unroll
            for (int i = lane; i < ROWS * PIECES; i += 32) {
                // Each eight lanes must fill one aligned line. Rows of whole groups of eight pieces
                // do that with lanes on consecutive pieces (the XOR permutes within a line), which
                // keeps a lane's source offset the same in every row; other rows take consecutive
                // slots instead.
                constexpr bool kLanesOnPieces = Cfg::kPieceGroup == 8;
                const int r = i / PIECES, at = i - r * PIECES;
                const int col = kLanesOnPieces ? at : piece_slot<KV, D, GMAX>(r, at);
                const bool valid = first + r < it.end;
                const long long pos = valid ? first + r : it.start;  // never past the end
                const int dst = kLanesOnPieces ? piece_offset<KV, D, GMAX>(r, col) : i * 16;
                if constexpr (V::kPaged) {
                    const PagedRow at = paged_row(p, pages, static_cast<int>(pos));
                    cp_async16(k_s + dst, it.k + at.page * k_page_bytes + at.row * k_row_bytes + col * 16,
                               valid);
                    cp_async16(v_s + dst, it.v + at.page * v_page_bytes + at.row * v_row_bytes + col * 16,
                               valid);
                } else {
                    cp_async16(k_s + dst, it.k + pos * k_row_bytes + col * 16, valid);
                    cp_async16(v_s + dst, it.v + pos * v_row_bytes + col * 16, valid);
                }
            }
        };

        uint32_t q_frag[KSTEPS][4];
        int row_end[2], row_begin[2] = {0, 0};

        // The load cursor walks this warp's tiles of every item of the CTA in the order the
        // compute loop consumes them, STAGES - 1 tiles ahead, skipping items where the warp has
        // none.
        int load_index = first_item, load_n = 0, issued = 0;
        MmaItem load_item{};
        if (load_index < items) load_item = mma_item<KV, ROWS, V>(p, load_index, warp);
        const MmaItem first = load_item;
        // The first item's query before its K/V: issued behind the ring's copies, these few loads
        // would queue behind them and hold up the first tile's product.
        if (first_item < items) load_q(p, first, group, quad_row, quad_col, q_frag, row_end, row_begin);
        auto settle_load = [&]() {
            if constexpr (!V::kPersistent) {
                // One item per CTA: past its last tile the cursor is done. Spelled out, since the
                // walk below would find nothing yet keep a second copy of the item's addresses.
                if (load_n >= load_item.my_tiles) load_index = items;
            } else {
                while (load_index < items && load_n >= load_item.my_tiles) {
                    load_index += item_stride;
                    load_n = 0;
                    if (load_index < items) load_item = mma_item<KV, ROWS, V>(p, load_index, warp);
                }
            }
        };
        auto issue_next = [&]() {
            if (load_index < items) {
                load_tile(issued % STAGES, load_item, load_n);
                ++issued;
                ++load_n;
                settle_load();
            }
            cp_async_commit();
        };
        settle_load();
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s) issue_next();

        // ldmatrix row addresses, as offsets into a stage. K (non-transposed): matrices are
        // (rows 0-7, dims lo), (rows 0-7, dims hi), (rows 8-15, lo), (rows 8-15, hi) of a k-step,
        // the B fragments of both 8-row n-tiles. V (transposed): (rows 0-7, cols c), (rows 8-15,
        // c), (rows 0-7, c + 8), (rows 8-15, c + 8), the B fragments of two 8-column n-tiles.
        const int k_lane_row = (lane >> 4) * 8 + (lane & 7), k_lane_piece = (lane >> 3) & 1;
        const int v_lane_row = ((lane >> 3) & 1) * 8 + (lane & 7), v_lane_piece = lane >> 4;

        // Lockstep: every warp of the cluster arrives at tiles lockstep_tiles, 2 ·
        // lockstep_tiles, ... below the tiles all of them stream (their items differ only in the
        // block of query heads), and waits on the previous arrival before the next one.
        constexpr int kNoSync = 0x7fffffff;
        int next_sync = kNoSync, last_sync = 0;
        bool arrived = false;
        int consumed = 0;  // tiles this warp has taken out of its ring
        if constexpr (V::kLockstep) {
            const int tiles = first.end > first.start ? (first.end - first.start + ROWS - 1) / ROWS : 0;
            last_sync = tiles / kWarps - 1;
            if (p.lockstep_tiles <= last_sync) next_sync = p.lockstep_tiles;
        }
        for (int index = first_item; index < items; index += item_stride) {
            const MmaItem it = index == first_item ? first : mma_item<KV, ROWS, V>(p, index, warp);

            if (index != first_item) load_q(p, it, group, quad_row, quad_col, q_frag, row_end, row_begin);

            float acc[NTILES][4];
#pragma unroll
            for (int nt = 0; nt < NTILES; ++nt)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[nt][j] = 0.f;
            // Running max and (this thread's columns of the) running sum for heads quad_row, +8.
            float run_max[2] = {-INFINITY, -INFINITY};
            float run_sum[2] = {0.f, 0.f};

            for (int n = 0; n < it.my_tiles; ++n, ++consumed) {
                if constexpr (V::kLockstep) {
                    if (n == next_sync) {
                        if (arrived) cluster_wait();
                        cluster_arrive_relaxed();
                        arrived = true;
                        next_sync = n + p.lockstep_tiles <= last_sync ? n + p.lockstep_tiles : kNoSync;
                    }
                }
                cp_async_wait<STAGES - 2>();
                __syncwarp();  // this tile visible to the whole warp; the previous slot free for reuse
                issue_next();

                // The stage's offset before the tile's first position: nvcc's code for the loop
                // follows this order.
                const int stage_offset = (consumed % STAGES) * Cfg::kStageBytes;
                const int first = it.start + (warp + n * kWarps) * ROWS;
                float s[RB][2][4];
                scores(s, ring, stage_offset, q_frag, k_lane_row, k_lane_piece, lane);
                mask_scores(p, it, s, first, quad_col, row_end, row_begin);
                uint32_t p_frag[RB][4];
                softmax_update(s, run_max, run_sum, acc, p_frag);
                accumulate(acc, p_frag, ring, stage_offset, v_lane_row, v_lane_piece, lane);
            }

            if (V::kLockstep && arrived) cluster_wait();  // no arrival left pending at exit

            // Leave this warp's state in shared memory. One item per CTA: the merge area overlays
            // the ring, free once every copy has landed. Persistent: it sits after the ring, which
            // already holds the next item's first tiles.
            if constexpr (!V::kPersistent) cp_async_wait<0>();
            __syncthreads();
            float* merge = reinterpret_cast<float*>(V::kPersistent ? smem + Cfg::kRingBytes : smem);
            write_state(p, merge, acc, run_max, run_sum, group, warp, quad_row, quad_col);
            __syncthreads();
            if constexpr (V::kPersistent) {
                merge_warps_and_store<T, D, GMAX>(p, merge, group, it.split, it.kv_head, it.b, nullptr);
                __syncthreads();  // the next item's merge reuses the area
            } else if constexpr (V::kLastCtaMerge) {
                merge_warps_and_store<T, D, GMAX>(p, merge, group, it.split, it.kv_head, it.b, nullptr);
                merge_splits_if_last<T, D>(p, group, it.kv_head, it.b);
            } else {
                unsigned char* receive = cluster ? smem + Cfg::kSmemBytes : nullptr;
                if (cluster) cluster_wait();  // every CTA of the cluster has started
                merge_warps_and_store<T, D, GMAX>(p, merge, group, it.split, it.kv_head, it.b, receive);
                if (cluster) merge_pushed_slices<T, D, GMAX>(p, receive, group, it.kv_head, it.b);
            }
        }
    }
};

template <typename T, typename KV, int D, int GMAX, class V>
__device__ __forceinline__ void decode_partial_mma(const DecodeParams& p) {
    MmaDecode<T, KV, D, GMAX, V>::run(p);
}
