// Causal prefill attention for sm_90a (Hopper): the form of kernels/prefill.cuh built on
// warpgroup matrix products, after FlashAttention-3. Same parameter block (PrefillParams), work
// items, masking, GQA row packing, varlen, paging and split/combine conventions, for K/V in q's
// dtype or fp8 e4m3 (contiguous, strided or paged) at head dims 64, 128 and 256. Sliding windows
// and soft-capping stay on kernels/prefill.cuh.
//
// A CTA is a producer warpgroup and kConsumers consumer warpgroups (two; three at D = 64) over
// work items of kRows = 64 · kConsumers query rows, one after another: the grid is persistent, as
// many CTAs as fit, the items dealt in rounds (sm90_item_of_round).
//   producer (warps 0-3): warps 0-1 copy K tiles and warps 2-3 V tiles of kKeys positions into
//     a ring of kStages stages and arrive on the tile's `full` mbarrier; they wait on its `empty`
//     mbarrier before reusing a slot. K and V have barriers of their own, so a K slot frees as
//     soon as its scores are done. A tile wholly inside its sequence, with K/V in q's dtype and
//     not paged, comes by TMA where the host built descriptors (p.tma): one thread issues a box
//     per 64-dim column block, whose bytes complete the full barrier. Other tiles come by 16-byte
//     cp.async (zero-filling positions past the sequence; any row stride; paged rows through
//     the block table), waited for and fenced for the tensor cores' proxy.
//     fp8 K/V: the copies land in a staging ring of their own, and each thread widens the
//     pieces it copied to q's dtype into the swizzled ring (produce_fp8_tiles below), so the
//     products run in q's dtype on the values the cache holds exactly.
//   the consumers (warps 4-7, 8-11, ...), 64 rows each, each copying its own query rows (an item's
//     next as soon as its last scores are done): S = Q · Kᵀ by wgmma with Q and K from
//     shared memory; masking and the online softmax in registers; O += P · V by wgmma with P
//     from registers and V from shared memory. The products of tile j's scores and of tile
//     j - 1's values are issued together, so the softmax of tile j runs while P · V of j - 1
//     is in flight; and the consumers take turns issuing, in a ring of named barriers, so one's
//     softmax overlaps the others' products.
// `setmaxnreg` moves registers from the producer to the consumers.
//
// Shared memory: Q (kRows × D), then kStages × (K tile, V tile), each 128-byte swizzled in
// 64-dim column blocks (kernels/wgmma.cuh), then the mbarriers, then (fp8) kStagingStages ×
// (K tile, V tile) of plain fp8 rows; the host passes kSmemBytes (which includes 1 KB of slack
// for aligning the tiles to 1024 bytes).
//
// Build: the sm_90a target (-gencode=arch=compute_90a,code=sm_90a); the wrapper kernel carries
// __launch_bounds__(kThreads, 1), which setmaxnreg needs. The host guarantees what
// kernels/prefill.cuh lists, launches kThreads threads per CTA, at most one CTA per work item (a
// query tile of kRows rows, batch, kv head and split, numbered as prefill.cuh describes; one
// CTA fits an SM), and raises the kernel's dynamic shared-memory limit to kSmemBytes.
#pragma once

#include "prefill.cuh"
#include "wgmma.cuh"

// A compile-time switch of a consumer's tile step (whether it carries the mask code, whether it
// is an item's last): a type, so that each kind of step compiles to a body of its own.
template <bool kOn> struct StepSwitch {
    static constexpr bool value = kOn;
};

// The tile shape of a head dim: K/V positions per tile and ring stages (as many as shared memory
// holds: the ring hides the copies' latency). At D = 256 the output accumulator alone takes 128
// registers a thread, so score tiles are 64 keys wide. fp8 K/V give some of the ring's shared
// memory to the staging ring, which hides the global loads; widening takes only shared memory.
template <int D, bool FP8> struct PrefillSm90Shape {
    static constexpr int kKeys = D <= 128 ? 128 : 64;
    static constexpr int kStages = D <= 64 ? (FP8 ? 4 : 6) : D <= 128 ? (FP8 ? 2 : 3) : 2;
    static constexpr int kStagingStages = !FP8 ? 0 : D <= 64 ? 3 : D <= 128 ? 2 : 1;
    static constexpr bool kPingPong = true;  // consumers take turns issuing products
    // The reference max moves only past a factor of 2^8 and O's rescale is skipped when no row of
    // a warp moved (the consumers' softmax): measured faster at D = 256, where the rescale is
    // 128 multiplies a tile, and slower at 64 (the vote and the branch cost more than they save).
    static constexpr bool kLazyRescale = D > 128;
    // Consumer warpgroups of 64 rows. At D = 64 a tile's softmax takes as long as its products,
    // so a third consumer keeps the tensor cores fed while two exponentiate (FA3 runs 192 rows
    // there too).
    static constexpr int kConsumers = D <= 64 && !FP8 ? 3 : 2;
};

template <class Traits> using PrefillSm90ShapeOf = PrefillSm90Shape<Traits::kHeadDim, sizeof(typename Traits::KV) == 1>;

template <class Traits, class Shape = PrefillSm90ShapeOf<Traits>> struct PrefillSm90Tiling {
    static constexpr int kHeadDim = Traits::kHeadDim;
    static constexpr bool kFp8 = sizeof(typename Traits::KV) == 1;
    static constexpr int kConsumers = Shape::kConsumers;  // warpgroups of 64 rows
    static constexpr int kThreads = (kConsumers + 1) * 128;
    static constexpr int kRows = kConsumers * 64;
    static constexpr int kKeys = Shape::kKeys;
    static constexpr int kStages = Shape::kStages;
    static constexpr bool kPingPong = Shape::kPingPong;
    static constexpr bool kLazyRescale = Shape::kLazyRescale;
    // setmaxnreg moves registers within what the CTA got at launch (the most a thread of kThreads
    // can have, a multiple of 8), so the consumers can claim only what the producer released.
    static constexpr int kLaunchRegisters = (65536 / kThreads) / 8 * 8;
    // fp8: a batch of pieces in flight; three consumers: the 160 registers a consumer needs.
    static constexpr int kProducerRegisters = kFp8 ? 56 : kConsumers > 2 ? 32 : 40;
    static constexpr int kConsumerRegisters =
        (kLaunchRegisters * kThreads - kProducerRegisters * 128) / (128 * kConsumers) / 8 * 8;
    static constexpr int kQueryBytes = kRows * kHeadDim * 2;
    static constexpr int kKvTileBytes = kKeys * kHeadDim * 2;
    static constexpr int kStageBytes = 2 * kKvTileBytes;  // K then V
    static constexpr int kBarrierBytes = 4 * kStages * 8;  // K full, V full, K empty, V empty
    static constexpr int kStagingStages = Shape::kStagingStages;
    static constexpr int kStagedTileBytes = kKeys * kHeadDim;  // fp8: one byte a value
    static constexpr int kStagingStageBytes = 2 * kStagedTileBytes;  // K then V
    static constexpr int kSmemBytes =
        1024 + kQueryBytes + kStages * kStageBytes + kBarrierBytes + kStagingStages * kStagingStageBytes;
    static_assert(!kFp8 || kStagingStages > 0, "fp8 K/V are staged");
    static_assert(kHeadDim % 64 == 0 && kHeadDim <= 256, "head dims 64, 128, 256");
    static_assert(kProducerRegisters * 128 + kConsumerRegisters * 128 * kConsumers <= kLaunchRegisters * kThreads,
                  "the consumers claim no more than the producer releases");
};

// How far past the reference max a tile's scores may go before a lazy reference moves, as log2
// of the factor: weights up to 2^8 (see the consumers' softmax).
constexpr float kLog2MaxGrowth = 8.f;

__device__ __forceinline__ float quad_max4(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
// The largest of the COUNT scores of half h of a thread's score fragment (s[4i + 2h], s[4i + 2h + 1]
// for i < COUNT / 2), reduced as a tree.
template <int COUNT, int R> __device__ __forceinline__ float tree_max(const float (&s)[R], int h) {
    static_assert((COUNT & (COUNT - 1)) == 0 && COUNT >= 2 && 2 * COUNT == R, "a power-of-two half");
    constexpr int LEVELS = COUNT >= 32 ? 4 : COUNT >= 16 ? 3 : COUNT >= 8 ? 2 : COUNT >= 4 ? 1 : 0;  // COUNT / 2 → 1
    static_assert(COUNT <= 32 && (COUNT / 2) >> LEVELS == 1, "halvings from COUNT / 2 values to one");
    float m[COUNT / 2];
#pragma unroll
    for (int i = 0; i < COUNT / 2; ++i) m[i] = fmaxf(s[4 * i + 2 * h], s[4 * i + 2 * h + 1]);
    // A fixed trip count at every level, so that every index is a constant and m stays in registers.
#pragma unroll
    for (int level = 0; level < LEVELS; ++level) {
        const int width = (COUNT / 4) >> level;
#pragma unroll
        for (int i = 0; i < COUNT / 4; ++i)
            if (i < width) m[i] = fmaxf(m[i], m[i + width]);
    }
    return m[0];
}
__device__ __forceinline__ float quad_sum4(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Widening e4m3 to T by bit placement: a byte's exponent and mantissa bits go into T's fields
// (its sign onto T's sign), then one multiply by 2^(T's exponent bias - 7) gives the value, e4m3's
// subnormals included. Exact: T holds every e4m3 value. The e4m3 NaN pattern widens to a finite
// value; the crate's quantizer saturates and never stores it.
template <typename T> struct E4m3Widening;
template <> struct E4m3Widening<__nv_bfloat16> {  // 8 exponent bits: magnitude bits move 4 down
    static constexpr int kShift = 4;
    static constexpr uint32_t kMagnitude = 0x07F007F0u;
    static __device__ __forceinline__ uint32_t scale(uint32_t x) {
        uint32_t out;
        asm("mul.rn.bf16x2 %0, %1, %2;\n" : "=r"(out) : "r"(x), "r"(0x7B807B80u));  // 2^120
        return out;
    }
};
template <> struct E4m3Widening<__half> {  // 5 exponent bits: magnitude bits move 1 down
    static constexpr int kShift = 1;
    static constexpr uint32_t kMagnitude = 0x3F803F80u;
    static __device__ __forceinline__ uint32_t scale(uint32_t x) {
        uint32_t out;
        asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(out) : "r"(x), "r"(0x5C005C00u));  // 2^8
        return out;
    }
};

// Four e4m3 values (the bytes of `x`, lowest first) as two pairs of T.
template <typename T> __device__ __forceinline__ void widen_e4m3x4(uint32_t x, uint32_t& lo, uint32_t& hi) {
    using W = E4m3Widening<T>;
    // Bytes 0, 1 (then 2, 3) of x in the high bytes of two 16-bit lanes.
    auto place = [](uint32_t pair) { return (pair & 0x80008000u) | ((pair >> W::kShift) & W::kMagnitude); };
    lo = W::scale(place(__byte_perm(x, 0u, 0x1404)));
    hi = W::scale(place(__byte_perm(x, 0u, 0x3424)));
}

__device__ __forceinline__ uint4 ld_shared_u4(unsigned addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
    return v;
}
__device__ __forceinline__ void st_shared_u4(unsigned addr, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d));
}

// Copies one producer thread's 16-byte pieces of a K or V tile into shared memory: the rows
// first_key + j·ROW_STEP for j < ROWS (zero-filled from `rows_left` on; paged rows through the
// block table) from `base` (the thread's piece of row 0), piece j to shared address dst_of(j).
// A tile whose rows all lie in one contiguous sequence takes a path without per-row checks, fully
// unrolled, so that each piece costs an address step and the copy: the producer warps share
// their schedulers with the consumers, and every instruction they issue delays a softmax.
template <int ROWS, int ROW_STEP, bool PAGED, class DstOf>
__device__ __forceinline__ void copy_tile_pieces(const PrefillParams& p, const uint32_t* pages, const char* base,
                                                 long long row_bytes, long long outer_bytes, int first_key,
                                                 int rows_left, DstOf dst_of) {
    const char* src = base + first_key * row_bytes;
    if (!PAGED && rows_left > (ROWS - 1) * ROW_STEP) {
        const long long step = ROW_STEP * row_bytes;
#pragma unroll
        for (int j = 0; j < ROWS; ++j) {
            cp_async16_full(dst_of(j), src);
            src += step;
        }
        return;
    }
#pragma unroll 4
    for (int j = 0; j < ROWS; ++j) {
        const bool valid = j * ROW_STEP < rows_left;
        const char* from = valid ? src : base;
        if constexpr (PAGED) {
            if (valid) {
                const PagedRow at = prefill_paged_row(p, pages, first_key + j * ROW_STEP);
                from = base + at.page * outer_bytes + at.row * row_bytes;
            }
        }
        cp_async16_zfill(dst_of(j), from, valid);
        src += ROW_STEP * row_bytes;
    }
}

// Where the producer of an fp8 call works: the item's batch row, kv head, length and tiles (tile
// it streams keys from (hi - 1 - it)·kKeys), the tiles the CTA streamed before it (the ring
// position), and the shared-memory rings and barriers.
struct Fp8ProducerItem {
    int b, kv_head, len, hi, count, before;
    unsigned ring, staging, k_full, v_full, k_empty, v_empty;
};

// The producer of an fp8 call. Warps 0-1 handle K tiles and warps 2-3 V tiles; each thread of a
// half copies one 16-value piece of rows row + j·ROW_STEP of each tile into the staging ring
// (kStagingStages tiles ahead), and once they land widens those same pieces to T, two
// 16-byte pieces of the swizzled tile each, then announces the tile on its `full` barrier. A
// thread reads only what it copied, so the staging ring needs no barrier of its own.
template <class Cfg, typename T, bool PAGED>
__device__ __forceinline__ void produce_fp8_tiles(const PrefillParams& p, const Fp8ProducerItem& w) {
    constexpr int D = Cfg::kHeadDim;
    constexpr int N = Cfg::kKeys;
    constexpr int STAGES = Cfg::kStages;
    constexpr int STAGING = Cfg::kStagingStages;
    constexpr int PIECES = D / 16;
    constexpr int ROW_STEP = 64 / PIECES;
    const bool is_v = threadIdx.x >= 64;
    const int t = threadIdx.x % 64;
    // Each eight threads (one phase of a 16-byte shared-memory access) take the four pieces of
    // one 64-dim column block in two neighbouring rows: their widened pieces then fall in eight
    // different 16-byte bank groups of the swizzled tile.
    constexpr int BLOCKS = D / 64;
    const int group = t / 8, lane = t % 8;
    const int piece = (group % BLOCKS) * 4 + lane % 4, row = 2 * (group / BLOCKS) + lane / 4;
    // The staging ring holds an odd row's 128-byte lines with their halves swapped, so that the
    // two rows' pieces of a column block do not share banks there either. A thread reads back
    // only what it copied, so the order is its own.
    const int staged_piece = (piece * 16) ^ (D >= 128 && row % 2 ? 64 : 0);
    const long long row_bytes = is_v ? p.v_seq_stride : p.k_seq_stride;  // one byte a value
    const long long outer_bytes = is_v ? p.v_batch_stride : p.k_batch_stride;  // batch or page
    const char* const base = static_cast<const char*>(is_v ? p.v : p.k) + (PAGED ? 0 : w.b * outer_bytes) +
                             w.kv_head * (is_v ? p.v_head_stride : p.k_head_stride) + piece * 16;
    const uint32_t* const pages = PAGED ? p.block_table + (long long)w.b * p.max_pages : nullptr;
    const unsigned full = is_v ? w.v_full : w.k_full, empty = is_v ? w.v_empty : w.k_empty;
    const unsigned tiles = w.ring + (is_v ? Cfg::kKvTileBytes : 0);
    const unsigned staged = w.staging + (is_v ? Cfg::kStagedTileBytes : 0) + row * D + staged_piece;

    auto copy = [&](int it) {
        const int k0 = (w.hi - 1 - it) * N;
        const unsigned dst = staged + (it % STAGING) * Cfg::kStagingStageBytes;
        copy_tile_pieces<N / ROW_STEP, ROW_STEP, PAGED>(p, pages, base, row_bytes, outer_bytes, k0 + row,
                                                        w.len - k0 - row,
                                                        [&](int j) { return dst + j * ROW_STEP * D; });
    };
    // One commit group per tile, empty past the last, so that waiting for all but the newest
    // STAGING - 1 groups always means "tile it has landed".
#pragma unroll
    for (int it = 0; it < STAGING; ++it) {
        if (it < w.count) copy(it);
        cp_async_commit();
    }
    for (int it = 0; it < w.count; ++it) {
        const int at = w.before + it;  // position in the ring
        const int slot = at % STAGES;
        cp_async_wait<STAGING - 1>();
        if (at >= STAGES) mbarrier_wait(empty + 8 * slot, (at / STAGES + 1) & 1);
        const unsigned from = staged + (it % STAGING) * Cfg::kStagingStageBytes;
        const unsigned to = tiles + slot * Cfg::kStageBytes;
        // A batch of pieces is loaded before any is widened: one producer warp per scheduler
        // has no other warp to hide a load's latency behind, so its loads must overlap.
        constexpr int BATCH = 4;
        static_assert((N / ROW_STEP) % BATCH == 0, "a tile's pieces come in whole batches");
#pragma unroll 1
        for (int j0 = 0; j0 < N / ROW_STEP; j0 += BATCH) {
            uint4 x[BATCH];
#pragma unroll
            for (int u = 0; u < BATCH; ++u) x[u] = ld_shared_u4(from + (j0 + u) * ROW_STEP * D);
#pragma unroll
            for (int u = 0; u < BATCH; ++u) {
                uint32_t w0, w1, w2, w3, w4, w5, w6, w7;
                widen_e4m3x4<T>(x[u].x, w0, w1);
                widen_e4m3x4<T>(x[u].y, w2, w3);
                widen_e4m3x4<T>(x[u].z, w4, w5);
                widen_e4m3x4<T>(x[u].w, w6, w7);
                const int r = row + (j0 + u) * ROW_STEP;
                st_shared_u4(to + swizzled_offset(N, r, 2 * piece), w0, w1, w2, w3);
                st_shared_u4(to + swizzled_offset(N, r, 2 * piece + 1), w4, w5, w6, w7);
            }
        }
        fence_proxy_async();
        mbarrier_arrive(full + 8 * slot);
        if (it + STAGING < w.count) copy(it + STAGING);
        cp_async_commit();
    }
}

// One work item: a query tile of kRows rows of one (batch, kv head) and split, numbered as
// prefill.cuh's grid counts them, and the K/V tiles it streams (hi - 1 down to hi - count).
struct Sm90Item {
    int b, kv_head, split, row0, len, hi, count;
};
__device__ __forceinline__ Sm90Item sm90_item(const PrefillParams& p, int index, int q_tiles, int rows, int keys) {
    const int group = p.q_heads / p.kv_heads;
    const int rows_total = p.query_tokens * group;
    const PrefillWorkItem item = prefill_work_item(p, index, q_tiles);
    Sm90Item w;
    w.b = item.b;
    w.kv_head = item.kv_head;
    w.split = item.split;
    w.row0 = item.q_tile * rows;
    w.len = p.kv_len;
    if (p.seqlens != nullptr) w.len = min(w.len, (int)p.seqlens[w.b]);
    const int last_row = min(w.row0 + rows, rows_total) - 1;
    const int tiles = (prefill_key_end(w.len, last_row / group, p.query_tokens) + keys - 1) / keys;
    const int lo = (int)((long long)tiles * w.split / p.num_splits);
    w.hi = (int)((long long)tiles * (w.split + 1) / p.num_splits);
    w.count = w.hi - lo;
    return w;
}

// The item a CTA takes in its round r of the persistent grid: the items are dealt out in rounds
// of gridDim.x, longest first, and every other round in reverse, so that the CTA that took the
// longest item of one round takes the shortest of the next. -1 past the last item.
__device__ __forceinline__ int sm90_item_of_round(int round, int items) {
    const int first = round * (int)gridDim.x;
    const int index = first + (round % 2 ? (int)gridDim.x - 1 - (int)blockIdx.x : (int)blockIdx.x);
    return index < items ? index : -1;
}

template <class Traits, class Shape = PrefillSm90ShapeOf<Traits>>
__device__ __forceinline__ void prefill_attention_sm90(const PrefillParams& p) {
    using Cfg = PrefillSm90Tiling<Traits, Shape>;
    using T = typename Traits::T;
    using MMA = Wgmma<T>;
    using Out = TensorCore<T>;
    static_assert(sizeof(typename Traits::KV) == sizeof(T) || Cfg::kFp8, "K/V in q's dtype or fp8");
    static_assert(!Traits::kWindowed, "windowed and soft-capped forms: prefill.cuh");
    constexpr bool PAGED = Traits::kPaged;
    constexpr int D = Cfg::kHeadDim;
    constexpr int N = Cfg::kKeys;
    constexpr int STAGES = Cfg::kStages;
    constexpr int M = Cfg::kRows;
    constexpr int PIECES = D / 8;  // 16-byte pieces per row
    constexpr int KSTEPS = D / 16;  // k-steps of S = Q · Kᵀ
    constexpr int PSTEPS = N / 16;  // k-steps of O += P · V
    constexpr int SREGS = N / 2;    // score accumulators per thread
    constexpr int OREGS = D / 2;    // output accumulators per thread

    extern __shared__ __align__(16) unsigned char smem[];  // tiles aligned at run time
    if (dynamic_smem_bytes() < (unsigned)Cfg::kSmemBytes) __trap();
    const unsigned q_smem = (static_cast<unsigned>(__cvta_generic_to_shared(smem)) + 1023u) & ~1023u;
    const unsigned ring_smem = q_smem + Cfg::kQueryBytes;
    // mbarriers, stage s at + 8s: a K or V tile has landed (full) or been read (empty).
    const unsigned k_full = ring_smem + STAGES * Cfg::kStageBytes;
    const unsigned v_full = k_full + 8 * STAGES;
    const unsigned k_empty = v_full + 8 * STAGES;
    const unsigned v_empty = k_empty + 8 * STAGES;
    const unsigned staging_smem = v_empty + 8 * STAGES;  // fp8 only; 8-byte barriers keep it 16-byte aligned

    // The work items, as prefill.cuh numbers them; a CTA takes one per round (sm90_item_of_round).
    const int group = p.q_heads / p.kv_heads;
    const int tokens = p.query_tokens;
    const int rows_total = tokens * group;
    const int q_tiles = (rows_total + M - 1) / M;
    const int items = q_tiles * p.batch * p.kv_heads * p.num_splits;

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbarrier_init(k_full + 8 * s, 64);  // the producer's K or V half
            mbarrier_init(v_full + 8 * s, 64);
            mbarrier_init(k_empty + 8 * s, 4 * Cfg::kConsumers);  // one per consumer warp
            mbarrier_init(v_empty + 8 * s, 4 * Cfg::kConsumers);
        }
    }
    __syncthreads();

    // The same on every lane of a warp; read from lane 0 the compiler knows it (uniform registers
    // for what derives from it, such as the consumers' descriptors).
    const int warpgroup = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);
    if (warpgroup == 0) {
        // Producer: warps 0-1 copy K tiles, warps 2-3 V tiles, each half on its own barriers, so
        // that a K tile is announced, and its slot reused, independently of the V tile beside it.
        // Thread t of a half copies piece t % PIECES of rows t / PIECES + j·ROW_STEP.
        // Tiles of one item follow the last tile of the item before in the ring, so the copies of
        // an item start while the consumers finish the one before.
        registers_release<Cfg::kProducerRegisters>();
        int before = 0;  // tiles streamed for earlier items
        for (int round = 0;; ++round) {
        const int index = sm90_item_of_round(round, items);
        if (index < 0) break;
        const Sm90Item w = sm90_item(p, index, q_tiles, M, N);
        if constexpr (Cfg::kFp8) {
            produce_fp8_tiles<Cfg, T, PAGED>(p, {w.b, w.kv_head, w.len, w.hi, w.count, before, ring_smem,
                                                staging_smem, k_full, v_full, k_empty, v_empty});
            before += w.count;
            continue;
        }
        constexpr int ROW_STEP = 64 / PIECES;
        const bool is_v = threadIdx.x >= 64;
        const int t = threadIdx.x % 64;
        const int piece = t % PIECES, row = t / PIECES;
        const long long row_bytes = (is_v ? p.v_seq_stride : p.k_seq_stride) * 2;
        const long long outer_bytes = (is_v ? p.v_batch_stride : p.k_batch_stride) * 2;  // batch or page
        const char* const base = static_cast<const char*>(is_v ? p.v : p.k) + (PAGED ? 0 : w.b * outer_bytes) +
                                 w.kv_head * (is_v ? p.v_head_stride : p.k_head_stride) * 2 + piece * 16;
        const uint32_t* const pages = PAGED ? p.block_table + (long long)w.b * p.max_pages : nullptr;
        const unsigned full = is_v ? v_full : k_full, empty = is_v ? v_empty : k_empty;
        const unsigned tiles_smem = ring_smem + (is_v ? Cfg::kKvTileBytes : 0);
        if (!PAGED && p.tma && round == 0 && t == 0) tma_prefetch_descriptor(is_v ? &p.v_map : &p.k_map);
        bool pending = false;  // tile it - 1 copied but not yet announced
        auto announce = [&](int it) {
            fence_proxy_async();
            mbarrier_arrive(full + 8 * ((before + it) % STAGES));
        };
        for (int it = 0; it < w.count; ++it) {
            const int at = before + it;  // position in the ring
            const int slot = at % STAGES;
            if (at >= STAGES) {
                // Announce everything before blocking: the consumers may need tile it - 1 to
                // free the slot of tile it - STAGES.
                if (pending) {
                    cp_async_wait<0>();
                    announce(it - 1);
                    pending = false;
                }
                mbarrier_wait(empty + 8 * slot, (at / STAGES + 1) & 1);
            }
            const int k0 = (w.hi - 1 - it) * N;
            if (!PAGED && p.tma && k0 + N <= w.len) {
                // A whole tile inside the sequence: one thread issues a TMA box per 64-dim column
                // block, which lands in the swizzled layout and completes its bytes on the full
                // barrier; the half's other threads arrive at once. An empty commit group keeps
                // one group per tile for the cp.async tiles around it.
                const unsigned bar = full + 8 * slot;
                if (t == 0) {
                    mbarrier_arrive_expect_tx(bar, Cfg::kKvTileBytes);
#pragma unroll
                    for (int j = 0; j < D / 64; ++j)
                        tma_load_4d(tiles_smem + slot * Cfg::kStageBytes + j * N * 128, is_v ? &p.v_map : &p.k_map,
                                    j * 64, k0, w.kv_head, w.b, bar);
                } else {
                    mbarrier_arrive(bar);
                }
                cp_async_commit();
                if (pending) {
                    cp_async_wait<1>();
                    announce(it - 1);
                }
                pending = false;
                continue;
            }
            const unsigned dst = tiles_smem + slot * Cfg::kStageBytes + swizzled_offset(N, row, piece);
            // Rows row + j·ROW_STEP, 8 rows per swizzle period: the piece's slot in the row
            // alternates with j when ROW_STEP < 8 (a few registers, not one address per row).
            constexpr int PERIOD = ROW_STEP >= 8 ? 1 : 8 / ROW_STEP;
            unsigned swz[PERIOD];
#pragma unroll
            for (int j = 0; j < PERIOD; ++j)
                swz[j] = swizzled_offset(N, row + j * ROW_STEP, piece) - swizzled_offset(N, row, piece) - j * ROW_STEP * 128;
            copy_tile_pieces<N / ROW_STEP, ROW_STEP, PAGED>(
                p, pages, base, row_bytes, outer_bytes, k0 + row, w.len - k0 - row,
                [&](int j) { return dst + j * ROW_STEP * 128 + swz[j % PERIOD]; });
            cp_async_commit();
            if (pending) {
                cp_async_wait<1>();
                announce(it - 1);
            }
            pending = true;
        }
        if (pending) {
            cp_async_wait<0>();
            announce(w.count - 1);
        }
        before += w.count;
        }
        return;
    }

    // Consumers.
    registers_claim<Cfg::kConsumerRegisters>();
    const int consumer = warpgroup - 1;
    const int ct = threadIdx.x - warpgroup * 128;
    const int warp = ct / 32, lane = ct % 32;
    const int quad_row = lane >> 2, quad_col = lane & 3;
    const int wg_row0 = consumer * 64;  // within the tile
    const float scale = p.scale_log2;

    // The consumers take turns issuing products, item after item, in a ring: consumer c waits on
    // named barrier 1 + c and hands over to the next on its barrier. The first turn is the first
    // consumer's, and the first consumer absorbs the last one's final hand-over after the last
    // item. Barriers 1 + kConsumers + c: a consumer's own warps.
    constexpr int C = Cfg::kConsumers;
    static_assert(1 + 2 * C <= 16, "turn and own barriers fit the 16 named barriers");
    auto turn_begin = [&] {
        if constexpr (Cfg::kPingPong) named_barrier_sync(1 + consumer, 256);
    };
    auto turn_end = [&] {
        if constexpr (Cfg::kPingPong) named_barrier_arrive(1 + (consumer + 1 == C ? 0 : consumer + 1), 256);
    };
    if constexpr (Cfg::kPingPong) {
        if (consumer == C - 1) named_barrier_arrive(1, 256);
    }
    const int own_barrier = 1 + C + consumer;

    // This warpgroup's 64 query rows of an item (rows past the group's last are zero) into its
    // half of the Q tile, as cp.async copies of the calling thread's pieces; the caller commits.
    auto copy_query_rows = [&](const Sm90Item& item) {
        const T* const q = static_cast<const T*>(p.q) + item.b * p.q_batch_stride;
        for (int i = ct; i < 64 * PIECES; i += 128) {
            const int r = wg_row0 + i / PIECES, c = i % PIECES;
            const int row = item.row0 + r;
            const bool valid = row < rows_total;
            const T* src = q;
            if (valid) {
                const int token = row / group;
                const int head = item.kv_head * group + (row - token * group);
                src = q + token * p.q_seq_stride + head * p.q_head_stride + c * 8;
            }
            cp_async16_zfill(q_smem + swizzled_offset(M, r, c), src, valid);
        }
        cp_async_commit();
    };

    int before = 0;  // tiles consumed for earlier items: the ring position
    bool q_in_flight = false;  // the next item's query rows were copied during the item before
    for (int round = 0;; ++round) {
    const int index = sm90_item_of_round(round, items);
    if (index < 0) break;
    const Sm90Item w = sm90_item(p, index, q_tiles, M, N);
    const int b = w.b, kv_head = w.kv_head, split = w.split, row0 = w.row0, len = w.len, hi = w.hi;
    const int count = w.count;
    // This thread's rows: wg_row0 + 16·warp + quad_row (+8).
    const int my_row = row0 + wg_row0 + warp * 16 + quad_row;
    // Keys every row of this warpgroup sees: tiles from there on need no mask.
    const int wg_first = row0 + wg_row0;
    const int wg_full_end = wg_first < rows_total ? prefill_key_end(len, wg_first / group, tokens) : 0;

    float o[OREGS];
#pragma unroll
    for (int i = 0; i < OREGS; ++i) o[i] = 0.f;
    float run_max[2] = {-INFINITY, -INFINITY}, run_sum[2] = {0.f, 0.f};

    if (count > 0) {
        // This warpgroup's query rows, copied now unless they were copied during the item
        // before (once every warp of it had issued its last scores), then visible to wgmma.
        {
            if (!q_in_flight) {
                if (round > 0) named_barrier_sync(own_barrier, 128);
                copy_query_rows(w);
            }
            cp_async_wait<0>();
            fence_proxy_async();
            named_barrier_sync(own_barrier, 128);
        }
        q_in_flight = false;

        // Descriptors: Q rows of this warpgroup and K (K-major, 8-row groups 1024 bytes apart);
        // V (N-major: 64-dim blocks N·128 bytes apart, 8-key groups 1024 bytes apart).
        const uint64_t q_desc = wgmma_desc(q_smem + wg_row0 * 128, 16, 1024);
        auto k_desc = [&](int slot) { return wgmma_desc(ring_smem + slot * Cfg::kStageBytes, 16, 1024); };
        auto v_desc = [&](int slot) {
            return wgmma_desc(ring_smem + slot * Cfg::kStageBytes + Cfg::kKvTileBytes, N * 128, 1024);
        };
        // k-step ks of a K-major operand of `rows` rows: its 64-dim block, then 32 bytes a step.
        auto kmajor_step = [](int rows, int ks) -> uint64_t {
            return (uint64_t)(((ks / 4) * rows * 128 + (ks % 4) * 32) >> 4);
        };

        float s[SREGS];
        uint32_t pf[PSTEPS][4];

        auto issue_scores = [&](int slot) {
            const uint64_t kd = k_desc(slot);
#pragma unroll
            for (int ks = 0; ks < KSTEPS; ++ks)
                MMA::ss(s, q_desc + kmajor_step(M, ks), kd + kmajor_step(N, ks), ks > 0);
        };
        auto issue_values = [&](int slot) {
            const uint64_t vd = v_desc(slot);
#pragma unroll
            for (int kk = 0; kk < PSTEPS; ++kk) MMA::rs(o, pf[kk], vd + (uint64_t)((kk * 16 * 128) >> 4), 1);
        };
        auto release = [&](unsigned empty, int slot) {
            __syncwarp();
            if (lane == 0) mbarrier_arrive(empty + 8 * slot);
        };

        // Mask (`mask` on: the tile reaches past some row's last key) and exponentiate the scores
        // of the tile from key k0 in place; returns the factor by which each row's earlier
        // output must shrink.
        auto softmax = [&](auto mask, int k0, float (&factor)[2]) {
            if (decltype(mask)::value && k0 + N > wg_full_end) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int r = my_row + 8 * h;
                    const int end = r < rows_total ? prefill_key_end(len, r / group, tokens) : 0;
#pragma unroll
                    for (int i = 0; i < N / 8; ++i)
#pragma unroll
                        for (int j = 0; j < 2; ++j)
                            if (k0 + i * 8 + quad_col * 2 + j >= end) s[4 * i + 2 * h + j] = -INFINITY;
                }
            }
            // The row maxima and sums reduce as trees and in several partial sums: one warp per
            // scheduler runs its softmax while the other consumer's products are in flight, so
            // the length of a dependency chain is time the tensor cores wait.
            float m[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) m[h] = fmaxf(run_max[h], tree_max<N / 4>(s, h));
#pragma unroll
            for (int h = 0; h < 2; ++h) m[h] = quad_max4(m[h]);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                // Lazily, the reference max moves only when a score passes it by more than a
                // factor of 2^kLog2MaxGrowth: below that the weights stay under that factor,
                // which f32 sums and T's products hold as well, and O keeps its scale (no
                // rescale). The output and LSE use the same reference, so the result does not
                // depend on it. Otherwise it moves with every new max.
                const bool moves = Cfg::kLazyRescale ? (m[h] - run_max[h]) * scale > kLog2MaxGrowth  // true from -inf
                                                     : m[h] > run_max[h];
                factor[h] = moves ? fast_exp2((run_max[h] - m[h]) * scale) : 1.f;  // 0 from -inf
                if (moves) run_max[h] = m[h];
                const float base = run_max[h] == -INFINITY ? 0.f : -run_max[h] * scale;
                float sum[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int i = 0; i < N / 8; ++i)
#pragma unroll
                    for (int j = 0; j < 2; ++j) {
                        const float w = fast_exp2(fmaf(s[4 * i + 2 * h + j], scale, base));
                        s[4 * i + 2 * h + j] = w;
                        sum[(2 * i + j) % 4] += w;
                    }
                run_sum[h] = run_sum[h] * factor[h] + ((sum[0] + sum[1]) + (sum[2] + sum[3]));
            }
        };
        auto rescale_and_pack = [&](const float (&factor)[2]) {
            // Lazily, most tiles move no reference max of the warp's rows (see softmax): skip
            // the rescale's multiplies then.
            if (!Cfg::kLazyRescale || __any_sync(0xffffffffu, factor[0] != 1.f || factor[1] != 1.f)) {
#pragma unroll
                for (int i = 0; i < D / 8; ++i) {
                    o[4 * i] *= factor[0];
                    o[4 * i + 1] *= factor[0];
                    o[4 * i + 2] *= factor[1];
                    o[4 * i + 3] *= factor[1];
                }
            }
#pragma unroll
            for (int kk = 0; kk < PSTEPS; ++kk)
#pragma unroll
                for (int j = 0; j < 4; ++j) pf[kk][j] = Out::pack(s[8 * kk + 2 * j], s[8 * kk + 2 * j + 1]);
        };

        // Once every warp of this warpgroup has its last scores, the Q tile is free: copy the
        // next item's query rows now, so that they land while this item's last products and its
        // output finish.
        auto prefetch_next_query = [&] {
            const int next = sm90_item_of_round(round + 1, items);
            if (next < 0) return;
            const Sm90Item upcoming = sm90_item(p, next, q_tiles, M, N);
            if (upcoming.count == 0) return;
            named_barrier_sync(own_barrier, 128);
            copy_query_rows(upcoming);
            q_in_flight = true;
        };

        // Tile it streams keys from (hi - 1 - it)·N, from ring position before + it.
        {
            const int slot = before % STAGES;
            mbarrier_wait(k_full + 8 * slot, (before / STAGES) & 1);
            turn_begin();
            wgmma_hold(s);
            wgmma_fence();
            issue_scores(slot);
            wgmma_commit();
            turn_end();
            wgmma_wait<0>();
            wgmma_hold(s);
            release(k_empty, slot);
            if (count == 1) prefetch_next_query();
            float factor[2];
            softmax(StepSwitch<true>{}, (hi - 1) * N, factor);
            rescale_and_pack(factor);
        }
        // Tiles it ≥ 1. Keys run downwards, so the tiles that need a mask (those reaching past
        // the warpgroup's first row's last key) come first; the rest run a loop of their own
        // with no mask code in it, which the compiler schedules as one straight body.
        // The last tile (`last`) also starts the next item's query copy.
        auto tile = [&](int it, auto mask, auto last) {
            const int at = before + it;
            const int slot = at % STAGES, prev = (at - 1) % STAGES;
            mbarrier_wait(k_full + 8 * slot, (at / STAGES) & 1);
            mbarrier_wait(v_full + 8 * prev, ((at - 1) / STAGES) & 1);
            turn_begin();
            wgmma_hold(s);
            wgmma_hold(o);
            wgmma_hold(pf);
            wgmma_fence();
            issue_scores(slot);
            wgmma_commit();
            issue_values(prev);
            wgmma_commit();
            turn_end();
            wgmma_wait<1>();  // the scores
            wgmma_hold(s);
            release(k_empty, slot);
            if constexpr (decltype(last)::value) prefetch_next_query();
            float factor[2];
            softmax(mask, (hi - 1 - it) * N, factor);
            wgmma_wait<0>();  // the values of tile it - 1
            wgmma_hold(o);
            wgmma_hold(pf);
            release(v_empty, prev);
            rescale_and_pack(factor);
        };
        // Tile it needs the mask while (hi - it)·N > wg_full_end, i.e. it < hi - wg_full_end / N.
        // The bound is the same on every lane; read from lane 0 the compiler knows it, and keeps
        // the loops' counters and the descriptors built from them in uniform registers.
        const int masked_end = __shfl_sync(0xffffffffu, max(1, min(count - 1, hi - wg_full_end / N)), 0);
        int it = 1;
        for (; it < masked_end; ++it) tile(it, StepSwitch<true>{}, StepSwitch<false>{});
        for (; it < count - 1; ++it) tile(it, StepSwitch<false>{}, StepSwitch<false>{});
        if (count > 1) tile(count - 1, StepSwitch<true>{}, StepSwitch<true>{});
        {
            const int last = count - 1;
            mbarrier_wait(v_full + 8 * ((before + last) % STAGES), ((before + last) / STAGES) & 1);
            turn_begin();
            wgmma_hold(o);
            wgmma_hold(pf);
            wgmma_fence();
            issue_values((before + last) % STAGES);
            wgmma_commit();
            turn_end();
            wgmma_wait<0>();
            wgmma_hold(o);
            release(v_empty, (before + last) % STAGES);  // the next item's tiles follow in the ring
        }
    }

    // Normalise and store: the output and LSE (one split), or the split's partial state.
    const bool single = p.num_splits == 1;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const float sum = quad_sum4(run_sum[h]);
        const int r = my_row + 8 * h;
        if (r >= rows_total) continue;
        const float inv = sum > 0.f ? p.v_scale / sum : 0.f;
        const float lse2 = sum > 0.f ? run_max[h] * scale + __log2f(sum) : -INFINITY;
        const int token = r / group;
        const int head = kv_head * group + (r - token * group);
        const long long lse_row = ((long long)b * p.q_heads + head) * tokens + token;
        if (single) {
            T* const out = static_cast<T*>(p.out) + (((long long)b * tokens + token) * p.q_heads + head) * D;
#pragma unroll
            for (int i = 0; i < D / 8; ++i)
                *reinterpret_cast<uint32_t*>(out + i * 8 + quad_col * 2) =
                    Out::pack(o[4 * i + 2 * h] * inv, o[4 * i + 2 * h + 1] * inv);
            if (quad_col == 0 && p.lse_out != nullptr) p.lse_out[lse_row] = lse2 * kLn2;
        } else {
            const long long part = lse_row * p.num_splits + split;
            float* const out = p.partial_out + part * D;
#pragma unroll
            for (int i = 0; i < D / 8; ++i)
                *reinterpret_cast<float2*>(out + i * 8 + quad_col * 2) =
                    make_float2(o[4 * i + 2 * h] * inv, o[4 * i + 2 * h + 1] * inv);
            if (quad_col == 0) p.partial_lse[part] = lse2;
        }
    }
    before += count;
    }
    if constexpr (Cfg::kPingPong) {
        if (consumer == 0) named_barrier_sync(1, 256);
    }
}
