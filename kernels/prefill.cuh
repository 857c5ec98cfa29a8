// Causal prefill attention on tensor cores (f16/bf16 queries; K/V f16/bf16 or fp8 e4m3;
// mma.sync m16n8k16, sm_80 and later): FlashAttention-2's forward pass over a KV cache whose last
// t positions are the query tokens. Query token i of a sequence of `len` positions sees keys
// [begin_i, end_i) with end_i = len - t + 1 + i (the mask aligned to the end of the cache; in the
// windowed forms window_right further, up to len) and begin_i = 0, or end_i - 1 - window_left
// with a sliding window; a token that sees no key gets zeros and an LSE of -inf.
//
// Work: one CTA per (query tile, batch, kv head, split). A query tile is kRows query rows of one
// kv head, where row r of a (batch, kv head) is query token r / group of its query head
// kv_head * group + r % group: the rows of a GQA group sit side by side, so the CTA streams its
// kv head's K/V once for the whole group. The grid counts splits fastest, then kv heads, then
// batches, then query tiles from the last: the tiles that see the most keys start first.
//
// Per CTA, K/V tiles of kKeys positions stream through a ring of kStages shared-memory stages
// (cp.async, one block barrier per tile), or, where shared memory holds one tile of each only
// (kSplitKv), through one K and one V buffer on waits of their own; from the diagonal down, so
// the tiles that need a mask come first and the rest run unmasked. Each warp owns kMTiles × 16
// consecutive rows:
//   S (rows × keys) = Q (rows × D) · Kᵀ   — Q fragments by `ldmatrix` (held in registers or
//                                           reloaded per tile), K fragments by `ldmatrix`
//   O (rows × D)   += P (rows × keys) · V — P straight from the S accumulators, V fragments by
//                                           `ldmatrix.trans`
// with the running max and sum of each row in registers, base-2 exponentials with log2(e) folded
// into the scale, and O rescaled only when some row's max moves. A warp skips the product of a
// tile none of its rows sees. Shared-memory rows are padded to an odd number of 16-byte pieces,
// so that `ldmatrix` reads are free of bank conflicts.
//
// Splits: when the query tiles are too few to fill the GPU (a short chunk after a long past),
// the host cuts each tile's K/V range into num_splits; each split writes its normalised partial
// output and base-2 LSE, and kernels/combine.cuh merges them.
//
// fp8 K/V widen to f16 pairs in registers and the products run in f16, as in the decode kernel:
// the query is staged in shared memory as f16, its dims permuted within each k-step to the
// order in which a lane holds a key's bytes, and the value product's accumulator columns are
// put back in order when stored.
//
// The host guarantees: q_heads % kv_heads == 0; q, k and v rows 16-byte aligned (base pointers
// and strides); K/V row strides × kKeys below 2^31 bytes; scale_log2 > 0; the output contiguous.
#pragma once

#include "common.cuh"
#include "split_kv_decode_mma.cuh"

// The launch parameters (plain fields, for a generated Rust twin). Strides are in elements.
// A TMA descriptor (CUtensorMap), opaque to the kernels: 128 bytes, 64-byte aligned.
struct alignas(64) TensorMap {
    unsigned long long opaque[16];
};

struct PrefillParams {
    const void* q;            // (b, t, h_q, d)
    const void* k;            // (b, L, h_kv, d); paged: a pool (pages, page_size, h_kv, d)
    const void* v;
    void* out;                // (b, t, h_q, d), contiguous, q's dtype; written when num_splits == 1
    float* lse_out;           // (b, h_q, t) natural log, or null; written when num_splits == 1
    float* partial_out;       // (b, h_q, t, num_splits, d) normalised partial outputs (splits > 1)
    float* partial_lse;       // (b, h_q, t, num_splits) base-2 log-sum-exps (splits > 1)
    const uint32_t* seqlens;  // (b,) sequence lengths, or null: every sequence is kv_len long
    const uint32_t* block_table;  // paged: (b, max_pages) each sequence's pages in order
    long long q_batch_stride, q_seq_stride, q_head_stride;
    long long k_batch_stride, k_seq_stride, k_head_stride;  // paged: the batch stride is the page's
    long long v_batch_stride, v_seq_stride, v_head_stride;
    int batch, q_heads, kv_heads;
    int kv_len;               // positions in the K/V view (paged: the longest sequence allowed)
    int query_tokens;         // t
    int num_splits;
    float scale_log2;         // softmax_scale * k_scale * log2(e)
    float v_scale;            // real values are stored ones × v_scale (1 for f16/bf16)
    // Read by the windowed forms only:
    int window_left;          // a query sees at most this many positions before its own; -1: all
    int window_right;         // and this many after its own (0: causal), at most query_tokens - 1
    float softcap_log2;       // soft cap c·log2(e) of the base-2 scores; 0: none
    float softcap_exp2;       // 2/c (see soft_capped in common.cuh)
    // Read by the paged forms only:
    int max_pages;            // entries per sequence in block_table
    int page_size;            // positions per page
    unsigned page_magic;      // pos / page_size = (umulhi(pos, page_magic) + pos) >> page_shift
    int page_shift;
    // Read by the sm_90a forms with K/V in q's dtype, not paged, when `tma` is 1: K and V as 4-D
    // tensors (d, position, kv head, batch) whose boxes are one 64-dim column block of a tile
    // (kernels/prefill_sm90.cuh), 128-byte swizzled.
    int tma;
    TensorMap k_map;
    TensorMap v_map;
};

// The tile shape of a head dim. Rows per warp: 32 (two m-tiles) lets each K and V fragment read
// from shared memory feed two products, which keeps `ldmatrix` traffic below the tensor cores'
// rate; the query is then reloaded from shared memory per tile, except at D = 64 where it fits
// in registers. Keys per tile: 32 at D = 80..128, where a 64-key score tile beside the 128
// accumulator registers of 32 rows would spill. At D = 256 the accumulator of 16 rows alone
// takes 128 registers, so warps hold one m-tile.
//
// Builds for targets before sm_90 keep within kMaxSmemPerCta (99 KiB), where 128 rows and two
// stages of 64-key tiles at D = 256 would take 198 KiB: there (kNarrow) four warps of 16 rows
// hold one 64-key K tile and one V tile, 99 KiB to the byte, on waits of their own
// (kSplitKv): V lands while the scores are computed, the next K while the values are (32-key
// tiles through two stages of both measured slower: twice the softmax passes per key).
template <int D> struct PrefillShape {
    // 128 query rows and two stages of 64-key K and V tiles, 16-bit rows padded by 16 bytes.
    static constexpr int kWideBytes = (128 + 2 * 2 * 64) * (2 * D + 16);
    static constexpr bool kNarrow = D > 128 && kWideBytes > kMaxSmemPerCta;
    static constexpr int kWarps = D <= 128 || kNarrow ? 4 : 8;
    static constexpr int kMTiles = D <= 128 ? 2 : 1;   // 16-row m-tiles per warp
    static constexpr int kKeys = D <= 64 || D > 128 ? 64 : 32;  // K/V positions per tile
    static constexpr bool kSplitKv = kNarrow;  // one K and one V buffer, each on its own wait
    static constexpr int kStages = kSplitKv ? 1 : 2;  // K/V tiles in the ring
    static constexpr bool kQueryInRegisters = D <= 64;
    static constexpr int kMinCtasPerSm = D <= 128 ? 2 : 1;
};

// A kernel instance's types and features. Variant: the form's flags (generated from
// kernels.toml's axes): kPaged, K/V in a page pool read through a block table; kWindowed, a
// sliding window and soft-capping. A traits struct may also name its own Shape.
template <typename Elem, typename KvElem, int HeadDim, class Variant> struct PrefillTraits {
    using T = Elem;     // q and output
    using KV = KvElem;  // K/V storage: T, or __nv_fp8_e4m3
    static constexpr int kHeadDim = HeadDim;
    static constexpr bool kPaged = Variant::kPaged;
    static constexpr bool kWindowed = Variant::kWindowed;
    using Shape = PrefillShape<HeadDim>;
};

// Rows of ROW_BYTES in shared memory, padded by 16 bytes where the row holds an even number of
// 16-byte pieces: the eight rows an `ldmatrix` phase reads at one piece then sit in eight
// distinct bank groups (an odd stride in pieces), and every fragment address is a per-lane base
// plus an immediate.
template <int ROW_BYTES> struct PaddedRows {
    static constexpr int kPieces = ROW_BYTES / 16;
    static constexpr int kStride = ROW_BYTES + (kPieces % 2 == 0 ? 16 : 0);
    static __host__ __device__ constexpr int offset(int row, int piece) { return row * kStride + piece * 16; }
};

// Sizes derived from a traits struct; the host reads kThreads, kSmemBytes and kRows (query rows
// per CTA, to size the grid).
template <class Traits> struct PrefillTiling {
    using Shape = typename Traits::Shape;
    static constexpr int kHeadDim = Traits::kHeadDim;
    static constexpr bool kFp8 = sizeof(typename Traits::KV) == 1;
    static constexpr int kWarps = Shape::kWarps;
    static constexpr int kThreads = kWarps * 32;
    static constexpr int kMTiles = Shape::kMTiles;
    static constexpr int kRows = kWarps * kMTiles * 16;
    static constexpr int kKeys = Shape::kKeys;
    static constexpr int kStages = Shape::kStages;
    static constexpr bool kSplitKv = Shape::kSplitKv;
    static constexpr bool kQueryInRegisters = Shape::kQueryInRegisters;
    static constexpr int kMinCtasPerSm = Shape::kMinCtasPerSm;
    static constexpr int kQueryRowBytes = kHeadDim * 2;  // the products' operands are 16-bit
    static constexpr int kKvRowBytes = kHeadDim * (int)sizeof(typename Traits::KV);
    static constexpr int kQueryBytes = kRows * PaddedRows<kQueryRowBytes>::kStride;
    static constexpr int kKvTileBytes = kKeys * PaddedRows<kKvRowBytes>::kStride;
    static constexpr int kStageBytes = 2 * kKvTileBytes;  // K then V
    static constexpr int kSmemBytes = kQueryBytes + kStages * kStageBytes;
    static_assert(kSmemBytes <= kMaxSmemPerCta, "the form fits the target's shared memory");
};

// `ldmatrix` on 32-bit shared-space addresses.
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldsm_x2(uint32_t (&r)[2], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(addr));
}
__device__ __forceinline__ void ldsm_x2_trans(uint32_t (&r)[2], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(addr));
}

// Where query token `token` of `tokens` in a sequence of `len` positions stops seeing keys (past
// its own position, or window_right past it), and from where it sees them (window_left < 0: from
// the start).
__device__ __forceinline__ int prefill_key_end(int len, int token, int tokens, int window_right = 0) {
    const int end = max(0, len - tokens + 1 + token);
    return window_right > 0 ? min(len, end + window_right) : end;
}
__device__ __forceinline__ int prefill_key_begin(int len, int token, int tokens, int window_left) {
    return window_left < 0 ? 0 : max(0, len - tokens + token - window_left);
}

// A work item, from its index in the grid's order (see the top of this file).
struct PrefillWorkItem {
    int b, kv_head, split, q_tile;
};
__device__ __forceinline__ PrefillWorkItem prefill_work_item(const PrefillParams& p, int index, int q_tiles) {
    PrefillWorkItem w;
    w.split = index % p.num_splits;
    index /= p.num_splits;
    w.kv_head = index % p.kv_heads;
    index /= p.kv_heads;
    w.b = index % p.batch;
    w.q_tile = q_tiles - 1 - index / p.batch;
    return w;
}

// The page and row of position `pos` (see kernels/paged_kv.cuh).
__device__ __forceinline__ PagedRow prefill_paged_row(const PrefillParams& p, const uint32_t* pages, int pos) {
    const unsigned n = static_cast<unsigned>(pos);
    const int index = static_cast<int>((__umulhi(n, p.page_magic) + n) >> p.page_shift);
    return {static_cast<long long>(__ldg(pages + index)), pos - index * p.page_size};
}

// A 16-byte global → shared copy to a shared-space address; with `valid` false nothing is read
// and the destination is zero-filled.
__device__ __forceinline__ void cp_async16_zfill(unsigned dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async16_full(unsigned dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}

// Sixteen query elements as f16 (saturated), in the order fp8 keys hold their dims: k-step
// column 2c, 2c+1 ← dims 4c, 4c+1 and 2c+8, 2c+9 ← dims 4c+2, 4c+3 (see the decode kernel).
template <typename T> __device__ __forceinline__ void permuted_f16_kstep(const T* src, uint4 (&dst)[2]) {
    float lo[8], hi[8];
    load8(src, lo);
    load8(src + 8, hi);
    auto dim = [&](int i) { return fminf(fmaxf(i < 8 ? lo[i] : hi[i - 8], -65504.f), 65504.f); };
    uint32_t* out = reinterpret_cast<uint32_t*>(dst);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        out[c] = TensorCore<__half>::pack(dim(4 * c), dim(4 * c + 1));
        out[4 + c] = TensorCore<__half>::pack(dim(4 * c + 2), dim(4 * c + 3));
    }
}

template <class Traits> __device__ __forceinline__ void prefill_attention(const PrefillParams& p) {
    using Cfg = PrefillTiling<Traits>;
    using T = typename Traits::T;
    using KV = typename Traits::KV;
    constexpr bool FP8 = Cfg::kFp8;
    constexpr bool PAGED = Traits::kPaged;
    constexpr bool WINDOWED = Traits::kWindowed;
    using TC = TensorCore<typename ProductType<T, FP8>::type>;
    using Out = TensorCore<T>;
    constexpr int D = Cfg::kHeadDim;
    constexpr int MT = Cfg::kMTiles;
    constexpr int N = Cfg::kKeys;
    constexpr int STAGES = Cfg::kStages;
    constexpr int THREADS = Cfg::kThreads;
    constexpr int M = Cfg::kRows;
    constexpr bool QREG = Cfg::kQueryInRegisters;
    constexpr int KSTEPS = D / 16;      // k-steps of the score product
    constexpr int NTILES = D / 8;       // n-tiles of the value product
    constexpr int SN = N / 8;           // n-tiles of the score product
    constexpr int PSTEPS = N / 16;      // k-steps of the value product
    using QRows = PaddedRows<Cfg::kQueryRowBytes>;
    using KvRows = PaddedRows<Cfg::kKvRowBytes>;
    constexpr int KV_PIECES = KvRows::kPieces;
    static_assert(sizeof(T) == 2, "queries are f16 or bf16");
    static_assert(FP8 || sizeof(KV) == sizeof(T), "K/V are T or fp8");
    static_assert(D % 16 == 0 && N % 16 == 0, "head dim and tile keys are multiples of 16");
    constexpr bool SPLIT_KV = Cfg::kSplitKv;
    static_assert(STAGES >= 2 || SPLIT_KV, "at least one tile in flight while one is computed");

    extern __shared__ __align__(16) unsigned char smem[];
    if (dynamic_smem_bytes() < (unsigned)Cfg::kSmemBytes) __trap();

    // The work item; query tiles count down so that the longest rows start first.
    const int group = p.q_heads / p.kv_heads;
    const int tokens = p.query_tokens;
    const int rows_total = tokens * group;
    const int q_tiles = (rows_total + M - 1) / M;
    const PrefillWorkItem item = prefill_work_item(p, blockIdx.x, q_tiles);
    const int b = item.b, kv_head = item.kv_head, split = item.split, q_tile = item.q_tile;
    int len = p.kv_len;
    if (p.seqlens != nullptr) len = min(len, (int)p.seqlens[b]);
    const int window = WINDOWED ? p.window_left : -1;
    const int right = WINDOWED ? p.window_right : 0;

    const int row0 = q_tile * M;
    const int last_row = min(row0 + M, rows_total) - 1;
    const int kv_begin = prefill_key_begin(len, row0 / group, tokens, window);
    const int kv_end = prefill_key_end(len, last_row / group, tokens, right);
    const int tile_begin = kv_begin / N;
    const int tiles = kv_end > kv_begin ? (kv_end + N - 1) / N - tile_begin : 0;
    const int lo = tile_begin + (int)((long long)tiles * split / p.num_splits);
    const int hi = tile_begin + (int)((long long)tiles * (split + 1) / p.num_splits);
    const int count = hi - lo;  // this split's tiles: hi - 1 down to lo

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int quad_row = lane >> 2, quad_col = lane & 3;
    const int warp_row0 = warp * MT * 16;  // within the tile

    // The warp's keys: it computes a tile that any of its rows sees, and masks one that not all
    // of them see whole.
    const int warp_first = row0 + warp_row0;
    const int warp_last = min(warp_first + MT * 16, rows_total) - 1;
    const bool warp_rows = warp_first < rows_total;
    const int warp_end = warp_rows ? prefill_key_end(len, warp_last / group, tokens, right) : 0;
    const int warp_begin = warp_rows ? prefill_key_begin(len, warp_first / group, tokens, window) : 0;
    const int warp_full_end = warp_rows ? prefill_key_end(len, warp_first / group, tokens, right) : 0;
    const int warp_full_begin = warp_rows ? prefill_key_begin(len, warp_last / group, tokens, window) : 0;

    // K/V tile loads: the CTA's threads copy the tile's 16-byte pieces, consecutive threads on
    // consecutive pieces of a row; positions past the sequence are zero-filled, never read.
    // Row strides in 32 bits: a tile's rows span less than 2^31 bytes (see the top).
    const int k_row_bytes = static_cast<int>(p.k_seq_stride * (long long)sizeof(KV));
    const int v_row_bytes = static_cast<int>(p.v_seq_stride * (long long)sizeof(KV));
    const long long k_outer_bytes = p.k_batch_stride * (long long)sizeof(KV);  // batch or page
    const long long v_outer_bytes = p.v_batch_stride * (long long)sizeof(KV);
    const char* const k_base = static_cast<const char*>(p.k) + (PAGED ? 0 : b * k_outer_bytes) +
                               kv_head * p.k_head_stride * (long long)sizeof(KV);
    const char* const v_base = static_cast<const char*>(p.v) + (PAGED ? 0 : b * v_outer_bytes) +
                               kv_head * p.v_head_stride * (long long)sizeof(KV);
    const uint32_t* const pages = PAGED ? p.block_table + (long long)b * p.max_pages : nullptr;
    const unsigned q_smem = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    const unsigned ring_smem = q_smem + Cfg::kQueryBytes;
    constexpr int TILE_PIECES = N * KV_PIECES;
    constexpr int LOADS = (TILE_PIECES + THREADS - 1) / THREADS;
    // Where the threads divide into whole rows, a thread copies the same piece of rows
    // load_row + j·kRowStep: its shared offsets are one base plus immediates and its sources
    // one address plus multiples of a stride.
    constexpr int kRowStep = THREADS / KV_PIECES;
    constexpr bool kFixedPiece = THREADS % KV_PIECES == 0 && N % kRowStep == 0;
    const int load_row = threadIdx.x / KV_PIECES, load_piece = threadIdx.x % KV_PIECES;
    const unsigned load_dst = KvRows::offset(load_row, load_piece);
    // Tile n's K (with_k) and V (with_v) rows into ring stage `slot`.
    auto load_tile = [&](int slot, int n, bool with_k, bool with_v) {
        const int k0 = n * N;
        const unsigned k_s = ring_smem + slot * Cfg::kStageBytes;
        const unsigned v_s = k_s + Cfg::kKvTileBytes;
        if constexpr (kFixedPiece && !PAGED) {
            const char* k_src = k_base + (long long)(k0 + load_row) * k_row_bytes + load_piece * 16;
            const char* v_src = v_base + (long long)(k0 + load_row) * v_row_bytes + load_piece * 16;
            const int rows_left = len - k0 - load_row;  // rows of this thread's first left
#pragma unroll
            for (int j = 0; j < LOADS; ++j) {
                const bool valid = j * kRowStep < rows_left;
                const unsigned dst = load_dst + j * kRowStep * KvRows::kStride;
                if (with_k) cp_async16_zfill(k_s + dst, valid ? k_src + j * kRowStep * k_row_bytes : k_base, valid);
                if (with_v) cp_async16_zfill(v_s + dst, valid ? v_src + j * kRowStep * v_row_bytes : v_base, valid);
            }
        } else {
#pragma unroll
            for (int j = 0; j < LOADS; ++j) {
                const int i = threadIdx.x + j * THREADS;
                if (TILE_PIECES % THREADS != 0 && i >= TILE_PIECES) break;
                const int r = i / KV_PIECES, c = i - (i / KV_PIECES) * KV_PIECES;
                const unsigned dst = KvRows::offset(r, c);
                const int pos = k0 + r;
                const bool valid = pos < len;
                long long k_at = 0, v_at = 0;
                if constexpr (PAGED) {
                    if (valid) {
                        const PagedRow at = prefill_paged_row(p, pages, pos);
                        k_at = at.page * k_outer_bytes + (long long)at.row * k_row_bytes;
                        v_at = at.page * v_outer_bytes + (long long)at.row * v_row_bytes;
                    }
                } else if (valid) {
                    k_at = (long long)pos * k_row_bytes;
                    v_at = (long long)pos * v_row_bytes;
                }
                if (with_k) cp_async16_zfill(k_s + dst, k_base + k_at + c * 16, valid);
                if (with_v) cp_async16_zfill(v_s + dst, v_base + v_at + c * 16, valid);
            }
        }
    };

    // The query tile, as 16-bit rows in shared memory (fp8 K/V: f16, permuted); rows past the
    // group's last are zero.
    const T* const q = static_cast<const T*>(p.q) + b * p.q_batch_stride;
    auto query_row = [&](int r) -> const T* {
        const int row = row0 + r;
        if (row >= rows_total) return nullptr;
        const int token = row / group;
        const int head = kv_head * group + (row - token * group);
        return q + token * p.q_seq_stride + head * p.q_head_stride;
    };
    if (count > 0) {
        if constexpr (FP8) {
            for (int i = threadIdx.x; i < M * KSTEPS; i += THREADS) {
                const int r = i / KSTEPS, ks = i - (i / KSTEPS) * KSTEPS;
                const T* src = query_row(r);
                uint4 x[2] = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
                if (src != nullptr) permuted_f16_kstep(src + ks * 16, x);
                *reinterpret_cast<uint4*>(smem + QRows::offset(r, 2 * ks)) = x[0];
                *reinterpret_cast<uint4*>(smem + QRows::offset(r, 2 * ks + 1)) = x[1];
            }
        } else {
            constexpr int Q_PIECES = QRows::kPieces;
            for (int i = threadIdx.x; i < M * Q_PIECES; i += THREADS) {
                const int r = i / Q_PIECES, c = i - (i / Q_PIECES) * Q_PIECES;
                const T* src = query_row(r);
                cp_async16_zfill(q_smem + QRows::offset(r, c), src != nullptr ? src + c * 8 : q, src != nullptr);
            }
        }
    }
    if constexpr (SPLIT_KV) {
        if (count > 0) load_tile(0, hi - 1, true, false);  // the first K, with the query
    }
    cp_async_commit();
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < count) load_tile(s, hi - 1 - s, true, true);
        cp_async_commit();
    }

    // ldmatrix lane addressing. Q (A operand): matrices (rows 0-7, k lo), (rows 8-15, k lo),
    // (rows 0-7, k hi), (rows 8-15, k hi). K: (keys 0-7, dims lo), (keys 0-7, dims hi),
    // (keys 8-15, lo), (keys 8-15, hi): the B fragments of two 8-key n-tiles. V (transposed):
    // (keys 0-7, dims c), (keys 8-15, c), (keys 0-7, c + 8), (keys 8-15, c + 8): the B fragments
    // of two 8-dim n-tiles. fp8: a piece is a whole k-step (K) or 16 dims (V), so the pairs of
    // pieces below are pairs of k-steps or of 16-dim groups.
    const unsigned q_lane = q_smem + QRows::offset(warp_row0 + (lane & 15), lane >> 4);
    const unsigned k_lane = KvRows::offset((lane >> 4) * 8 + (lane & 7), (lane >> 3) & 1);
    const unsigned v_lane = KvRows::offset(((lane >> 3) & 1) * 8 + (lane & 7), lane >> 4);
    auto load_q_frag = [&](uint32_t (&f)[4], int mt, int ks) {
        ldsm_x4(f, q_lane + QRows::offset(mt * 16, 2 * ks));
    };

    constexpr int QREG_STEPS = QREG ? KSTEPS : 1;
    uint32_t q_frag[MT][QREG_STEPS][4];
    if constexpr (QREG) {
        cp_async_wait<STAGES - 1>();  // the query's group, the oldest
        __syncthreads();
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int ks = 0; ks < KSTEPS; ++ks) load_q_frag(q_frag[mt][ks], mt, ks);
    }

    float acc[MT][NTILES][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NTILES; ++nt)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[mt][nt][j] = 0.f;
    // Per row: the largest score seen (raw dot products; base-2 scores in the windowed form,
    // which transforms them first) and this thread's part of the weights' sum against it.
    float run_max[MT][2], run_sum[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            run_max[mt][h] = -INFINITY;
            run_sum[mt][h] = 0.f;
        }
    const float exp_scale = WINDOWED ? 1.f : p.scale_log2;

    // S = Q · Kᵀ for the tile in stage `k_s`. s[mt][nt][j]: row quad_row (+8 for j >= 2) of
    // m-tile mt, key k0 + nt*8 + quad_col*2 + (j&1).
    auto score_tile = [&](float (&s)[MT][SN][4], unsigned k_s) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < SN; ++nt)
#pragma unroll
                for (int j = 0; j < 4; ++j) s[mt][nt][j] = 0.f;
        if constexpr (FP8) {
            // One ldmatrix.x4 holds two k-steps of both 8-key n-tiles: (keys 0-7, ks),
            // (keys 0-7, ks + 1), (keys 8-15, ks), (keys 8-15, ks + 1).
#pragma unroll
            for (int ks = 0; ks < KSTEPS; ks += 2) {
                const bool pair = ks + 1 < KSTEPS;
                uint32_t qa[MT][2][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int step = 0; step < 2; ++step) {
                        if (step == 1 && !pair) break;
                        if constexpr (QREG) {
#pragma unroll
                            for (int j = 0; j < 4; ++j) qa[mt][step][j] = q_frag[mt][QREG ? ks + step : 0][j];
                        } else {
                            load_q_frag(qa[mt][step], mt, ks + step);
                        }
                    }
#pragma unroll
                for (int kp = 0; kp < PSTEPS; ++kp) {
                    if (pair) {
                        uint32_t kf[4];
                        ldsm_x4(kf, k_s + k_lane + KvRows::offset(kp * 16, ks));
#pragma unroll
                        for (int step = 0; step < 2; ++step)
#pragma unroll
                            for (int half = 0; half < 2; ++half) {
                                const uint32_t x = kf[half * 2 + step];
                                const uint32_t b0 = e4m3x2_to_f16x2(x), b1 = e4m3x2_to_f16x2(x >> 16);
#pragma unroll
                                for (int mt = 0; mt < MT; ++mt)
                                    TC::mma(s[mt][2 * kp + half], qa[mt][step], b0, b1);
                            }
                    } else {  // an odd last k-step (D = 80)
                        uint32_t kf[2];
                        ldsm_x2(kf, k_s + KvRows::offset(kp * 16 + (lane & 15), ks));
#pragma unroll
                        for (int half = 0; half < 2; ++half) {
                            const uint32_t b0 = e4m3x2_to_f16x2(kf[half]);
                            const uint32_t b1 = e4m3x2_to_f16x2(kf[half] >> 16);
#pragma unroll
                            for (int mt = 0; mt < MT; ++mt) TC::mma(s[mt][2 * kp + half], qa[mt][0], b0, b1);
                        }
                    }
                }
            }
        } else {
#pragma unroll
            for (int ks = 0; ks < KSTEPS; ++ks) {
                uint32_t qa[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    if constexpr (QREG) {
#pragma unroll
                        for (int j = 0; j < 4; ++j) qa[mt][j] = q_frag[mt][QREG ? ks : 0][j];
                    } else {
                        load_q_frag(qa[mt], mt, ks);
                    }
                }
#pragma unroll
                for (int kp = 0; kp < PSTEPS; ++kp) {
                    uint32_t kf[4];
                    ldsm_x4(kf, k_s + k_lane + KvRows::offset(kp * 16, 2 * ks));
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        TC::mma(s[mt][2 * kp], qa[mt], kf[0], kf[1]);
                        TC::mma(s[mt][2 * kp + 1], qa[mt], kf[2], kf[3]);
                    }
                }
            }
        }

    };

    // Mask, soft-cap, the online softmax and O += P · V for the tile of keys from k0 whose
    // scores are s and whose V sits at `v_s`.
    auto attend_tile = [&](float (&s)[MT][SN][4], int k0, unsigned v_s) {
        // Masks: only on tiles that not every row of the warp sees whole.
        const bool masked = k0 + N > warp_full_end || (WINDOWED && k0 < warp_full_begin);
        if (masked) {
            // The keys each of this thread's rows sees (rows quad_row and quad_row + 8 of each
            // m-tile); rows past the group's last are zero queries that see nothing and are
            // never stored. Worked out here, on the few masked tiles, rather than held.
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int r = row0 + warp_row0 + mt * 16 + quad_row + 8 * h;
                    const int token = r / group;
                    const int end = r < rows_total ? prefill_key_end(len, token, tokens, right) : 0;
                    const int begin = prefill_key_begin(len, token, tokens, window);
#pragma unroll
                    for (int nt = 0; nt < SN; ++nt)
#pragma unroll
                        for (int j = 0; j < 2; ++j) {
                            const int key = k0 + nt * 8 + quad_col * 2 + j;
                            if (key >= end || (WINDOWED && key < begin)) s[mt][nt][2 * h + j] = -INFINITY;
                        }
                }
        }
        if constexpr (WINDOWED) {
            const bool capped = p.softcap_log2 > 0.f;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < SN; ++nt)
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        const float x = s[mt][nt][j] * p.scale_log2;
                        if (capped) {
                            const float e = fast_exp2(x * p.softcap_exp2);
                            const float y = p.softcap_log2 - __fdividef(2.f * p.softcap_log2, e + 1.f);
                            s[mt][nt][j] = x == -INFINITY ? x : y;
                        } else {
                            s[mt][nt][j] = x;
                        }
                    }
        }

        // The rows' new maxes; the accumulators rescale only when one of the warp's moved.
        float factor[MT][2];
        bool moved = false;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float m = run_max[mt][h];
#pragma unroll
                for (int nt = 0; nt < SN; ++nt) m = fmaxf(m, fmaxf(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]));
                m = quad_max(m);
                factor[mt][h] = 1.f;
                if (m > run_max[mt][h]) {
                    factor[mt][h] = fast_exp2((run_max[mt][h] - m) * exp_scale);  // 0 from -inf
                    moved = true;
                }
                run_max[mt][h] = m;
            }
        if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    run_sum[mt][h] *= factor[mt][h];
#pragma unroll
                    for (int nt = 0; nt < NTILES; ++nt) {
                        acc[mt][nt][2 * h] *= factor[mt][h];
                        acc[mt][nt][2 * h + 1] *= factor[mt][h];
                    }
                }
        }

        // P = 2^(s·scale − max·scale) as the A fragments of the value product: (row lo, keys lo),
        // (row hi, keys lo), (row lo, keys hi), (row hi, keys hi) of each 16 keys. A row that
        // has seen nothing yet (max -inf) takes its weights against 0: all of them are 0.
        uint32_t pf[MT][PSTEPS][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            float base[2];
#pragma unroll
            for (int h = 0; h < 2; ++h)
                base[h] = run_max[mt][h] == -INFINITY ? 0.f : -run_max[mt][h] * exp_scale;
#pragma unroll
            for (int nt = 0; nt < SN; ++nt)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const float w0 = fast_exp2(fmaf(s[mt][nt][2 * h], exp_scale, base[h]));
                    const float w1 = fast_exp2(fmaf(s[mt][nt][2 * h + 1], exp_scale, base[h]));
                    run_sum[mt][h] += w0 + w1;
                    pf[mt][nt / 2][(nt % 2) * 2 + h] = TC::pack(w0, w1);
                }
        }

        // O += P · V.
#pragma unroll
        for (int kk = 0; kk < PSTEPS; ++kk) {
            if constexpr (FP8) {
                constexpr int V_PIECES = KV_PIECES;  // a piece is 16 dims
                // Byte pairs (dims 2r, 2r+1 of keys 2c, 2c+1) split into n-tile 2·piece (even
                // dims) and 2·piece + 1 (odd dims).
                auto piece_product = [&](int piece, uint32_t keys_lo, uint32_t keys_hi) {
                    const uint32_t lo = __byte_perm(keys_lo, 0, 0x3120);
                    const uint32_t hi = __byte_perm(keys_hi, 0, 0x3120);
                    const uint32_t even0 = e4m3x2_to_f16x2(lo), even1 = e4m3x2_to_f16x2(hi);
                    const uint32_t odd0 = e4m3x2_to_f16x2(lo >> 16), odd1 = e4m3x2_to_f16x2(hi >> 16);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        TC::mma(acc[mt][2 * piece], pf[mt][kk], even0, even1);
                        TC::mma(acc[mt][2 * piece + 1], pf[mt][kk], odd0, odd1);
                    }
                };
#pragma unroll
                for (int piece = 0; piece + 1 < V_PIECES; piece += 2) {
                    uint32_t vf[4];
                    ldsm_x4_trans(vf, v_s + v_lane + KvRows::offset(kk * 16, piece));
                    piece_product(piece, vf[0], vf[1]);
                    piece_product(piece + 1, vf[2], vf[3]);
                }
                if constexpr (V_PIECES % 2 == 1) {  // D = 80
                    uint32_t vf[2];
                    ldsm_x2_trans(vf, v_s + KvRows::offset(kk * 16 + (lane & 15), V_PIECES - 1));
                    piece_product(V_PIECES - 1, vf[0], vf[1]);
                }
            } else {
#pragma unroll
                for (int pair = 0; pair < NTILES / 2; ++pair) {
                    uint32_t vf[4];
                    ldsm_x4_trans(vf, v_s + v_lane + KvRows::offset(kk * 16, 2 * pair));
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        TC::mma(acc[mt][2 * pair], pf[mt][kk], vf[0], vf[1]);
                        TC::mma(acc[mt][2 * pair + 1], pf[mt][kk], vf[2], vf[3]);
                    }
                }
            }
        }
    };

    if constexpr (SPLIT_KV) {
        // Step `it` streams key tile hi - 1 - it: its V is copied while its scores are computed,
        // and the next tile's K while its values are.
        const unsigned k_s = ring_smem, v_s = ring_smem + Cfg::kKvTileBytes;
        for (int it = 0; it < count; ++it) {
            cp_async_wait<0>();
            __syncthreads();  // K visible to all; every warp done with the last tile's V
            load_tile(0, hi - 1 - it, false, true);
            cp_async_commit();
            const int k0 = (hi - 1 - it) * N;
            const bool sees = k0 < warp_end && k0 + N > warp_begin;  // some row of this warp
            float s[MT][SN][4];
            if (sees) score_tile(s, k_s);
            cp_async_wait<0>();
            __syncthreads();  // V visible to all; every warp done with this tile's K
            if (it + 1 < count) load_tile(0, hi - 2 - it, true, false);
            cp_async_commit();
            if (sees) attend_tile(s, k0, v_s);
        }
    } else {
        // Step `it` of this split streams key tile hi - 1 - it from ring stage it % STAGES.
        int slot = 0;
        for (int it = 0; it < count; ++it) {
            cp_async_wait<STAGES - 2>();
            __syncthreads();  // tile `it` visible to all; the slot of tile it - 1 free for reuse
            if (it + STAGES - 1 < count) load_tile((it + STAGES - 1) % STAGES, hi - STAGES - it, true, true);
            cp_async_commit();
            const unsigned k_s = ring_smem + slot * Cfg::kStageBytes;
            slot = slot + 1 == STAGES ? 0 : slot + 1;
            const int k0 = (hi - 1 - it) * N;
            if (k0 >= warp_end || k0 + N <= warp_begin) continue;  // no row of this warp sees it
            float s[MT][SN][4];
            score_tile(s, k_s);
            attend_tile(s, k0, k_s + Cfg::kKvTileBytes);
        }
    }
    cp_async_wait<0>();  // no copy outstanding at exit

    // Normalise and store: the output and LSE (one split), or the split's partial state.
    const bool single = p.num_splits == 1;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float sum = quad_sum(run_sum[mt][h]);
            const int r = row0 + warp_row0 + mt * 16 + quad_row + 8 * h;
            if (r >= rows_total) continue;
            const float inv = sum > 0.f ? p.v_scale / sum : 0.f;
            const float lse2 = sum > 0.f ? run_max[mt][h] * exp_scale + __log2f(sum) : -INFINITY;
            const int token = r / group;
            const int head = kv_head * group + (r - token * group);
            const long long lse_row = ((long long)b * p.q_heads + head) * tokens + token;
            if (single) {
                T* const o = static_cast<T*>(p.out) + (((long long)b * tokens + token) * p.q_heads + head) * D;
                if constexpr (FP8) {
                    // n-tiles 2c and 2c + 1 hold the even and odd dims of dims 16c..16c+15.
#pragma unroll
                    for (int c = 0; c < NTILES / 2; ++c)
                        store4(o + c * 16 + quad_col * 4,
                               make_float4(acc[mt][2 * c][2 * h] * inv, acc[mt][2 * c + 1][2 * h] * inv,
                                           acc[mt][2 * c][2 * h + 1] * inv, acc[mt][2 * c + 1][2 * h + 1] * inv));
                } else {
#pragma unroll
                    for (int nt = 0; nt < NTILES; ++nt)
                        *reinterpret_cast<uint32_t*>(o + nt * 8 + quad_col * 2) =
                            Out::pack(acc[mt][nt][2 * h] * inv, acc[mt][nt][2 * h + 1] * inv);
                }
                if (quad_col == 0 && p.lse_out != nullptr) p.lse_out[lse_row] = lse2 * kLn2;
            } else {
                const long long part = lse_row * p.num_splits + split;
                float* const o = p.partial_out + part * D;
                if constexpr (FP8) {
#pragma unroll
                    for (int c = 0; c < NTILES / 2; ++c)
                        store4(o + c * 16 + quad_col * 4,
                               make_float4(acc[mt][2 * c][2 * h] * inv, acc[mt][2 * c + 1][2 * h] * inv,
                                           acc[mt][2 * c][2 * h + 1] * inv, acc[mt][2 * c + 1][2 * h + 1] * inv));
                } else {
#pragma unroll
                    for (int nt = 0; nt < NTILES; ++nt)
                        *reinterpret_cast<float2*>(o + nt * 8 + quad_col * 2) =
                            make_float2(acc[mt][nt][2 * h] * inv, acc[mt][nt][2 * h + 1] * inv);
                }
                if (quad_col == 0) p.partial_lse[part] = lse2;
            }
        }
}
