// Matrix-vector product for the decode step, y = W·f(x), with the elementwise work around a
// projection in a transformer layer fused into it:
// - prologue f: the identity, or RMSNorm(x)·g;
// - epilogue: the plain product, a residual added before the single rounding to the output type,
//   or SwiGLU over interleaved [gate, up] row pairs, y_i = silu(W_2i·f(x))·(W_2i+1·f(x)).
// The streaming core takes the epilogue as a policy (which two rows make a pair, and what becomes
// of their sums), so other kernels reuse it with epilogues of their own (qkv_rope_append.cuh).
//
// Each weight row is read exactly once, so the kernel is a stream of 16-byte loads. The unit of
// work is a pair of rows; pairs are dealt round-robin to every warp of the grid, so no warp has
// more than one pair more than another. Two forms keep the stream's bytes in flight in different
// places: the register form in two double-buffered tiles of registers per warp, the ring form in
// a ring of shared-memory slots per warp filled by cp.async. The transformed input is staged
// once per CTA in shared memory.
//
// Programmatic dependent launch (sm_90): a CTA issues its first tiles of weights, which depend
// on nothing, before it waits for the previous kernel's output, so this kernel's weight stream
// overlaps the tail of the kernel before.

#pragma once

#include "common.cuh"

// The launch parameters; build.rs generates their Rust twin.
struct MatVecParams {
    const void* x;            // k elements
    const void* w;            // (n, k), row-major, rows 16-byte aligned
    const void* norm_weight;  // k elements (RmsNorm prologue only)
    const void* residual;     // n elements (Residual epilogue only)
    void* y;                  // n elements, or n / 2 for SwiGLU
    int n;
    int k;
    int prologue;             // MatVecPrologue
    int epilogue;             // MatVecEpilogue
    float eps;
};

enum MatVecPrologue : int {
    kProloguePlain = 0,
    kPrologueRmsNorm = 1,
};

enum MatVecEpilogue : int {
    kEpiloguePlain = 0,
    kEpilogueResidual = 1,
    kEpilogueSwiGlu = 2,
};

constexpr int kMatVecWarps = 8;
constexpr int kMatVecThreads = kMatVecWarps * 32;

// A 16-byte load of weights that are read once: no L1 allocation, 256-byte L2 fetches.
__device__ __forceinline__ uint4 load_stream16(const uint4* p) {
    uint4 v;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
#else
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
#endif
    return v;
}

__device__ __forceinline__ void widen8(const uint4& raw, const __half*, float (&f)[8]) {
    const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 x = __half22float2(h[i]);
        f[2 * i] = x.x;
        f[2 * i + 1] = x.y;
    }
}

__device__ __forceinline__ void widen8(const uint4& raw, const __nv_bfloat16*, float (&f)[8]) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 x = __bfloat1622float2(h[i]);
        f[2 * i] = x.x;
        f[2 * i + 1] = x.y;
    }
}

template <typename T>
__device__ __forceinline__ uint4 narrow8(const float (&f)[8]) {
    uint4 raw;
    T* h = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) h[i] = from_float<T>(f[i]);
    return raw;
}

template <typename T>
__device__ __forceinline__ float round_to(float x) {
    return to_float(from_float<T>(x));
}

// Writes f(x) into shared memory. RMSNorm rounds its output to T, as the unfused op does, so the
// product sees the same input as the unfused chain. x and g are loaded together (one round trip
// to L2); each thread later rewrites only the vectors it wrote, so the normalisation pass needs
// no barrier of its own.
template <typename T>
__device__ void stage_input(const MatVecParams& p, uint4* x_s, uint4* g_s) {
    const int vecs = p.k / 8;
    const uint4* x = static_cast<const uint4*>(p.x);
    if (p.prologue != kPrologueRmsNorm) {
        for (int i = threadIdx.x; i < vecs; i += kMatVecThreads) x_s[i] = x[i];
        return;
    }
    const uint4* g = static_cast<const uint4*>(p.norm_weight);
    float sum_sq = 0.f;
    for (int i = threadIdx.x; i < vecs; i += kMatVecThreads) {
        const uint4 raw = x[i];
        g_s[i] = g[i];
        float f[8];
        widen8(raw, static_cast<T*>(nullptr), f);
#pragma unroll
        for (int j = 0; j < 8; ++j) sum_sq = fmaf(f[j], f[j], sum_sq);
        x_s[i] = raw;
    }
    __shared__ float warp_sums[kMatVecWarps];
    sum_sq = warp_sum(sum_sq);
    if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = sum_sq;
    __syncthreads();
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < kMatVecWarps; ++w) total += warp_sums[w];
    const float inv_rms = rsqrtf(total / static_cast<float>(p.k) + p.eps);
    for (int i = threadIdx.x; i < vecs; i += kMatVecThreads) {
        float f[8], gain[8];
        widen8(x_s[i], static_cast<T*>(nullptr), f);
        widen8(g_s[i], static_cast<T*>(nullptr), gain);
#pragma unroll
        for (int j = 0; j < 8; ++j) f[j] = f[j] * inv_rms * gain[j];
        x_s[i] = narrow8<T>(f);
    }
}

// One tile: kUnroll 16-byte vectors of each row of a pair, per lane; a warp's tile covers
// 32 · kUnroll · 8 columns.
template <int kUnroll>
struct Tile {
    uint4 v[2][kUnroll];
};

// Where step `s` of a warp reads: its (s / tiles_per_row)-th pair, tile s % tiles_per_row.
struct StepPlace {
    int pair;
    int first_vec;  // includes the lane
    bool last_of_row;
};

// A warp's walk over its row pairs, tile by tile: pairs are dealt round-robin to every warp of
// the grid.
template <int kUnroll>
struct PairWalk {
    static constexpr int kTileVecs = 32 * kUnroll;
    int warp_id, warps, tiles_per_row, steps, lane;

    __device__ __forceinline__ PairWalk(const MatVecParams& p, int vecs) {
        lane = threadIdx.x % 32;
        warp_id = blockIdx.x * kMatVecWarps + threadIdx.x / 32;
        warps = gridDim.x * kMatVecWarps;
        const int pairs = (p.n + 1) / 2;
        tiles_per_row = (vecs + kTileVecs - 1) / kTileVecs;
        const int my_pairs = warp_id < pairs ? (pairs - warp_id + warps - 1) / warps : 0;
        steps = my_pairs * tiles_per_row;
    }

    __device__ __forceinline__ StepPlace place(int s) const {
        const int nth = s / tiles_per_row;
        const int tile = s - nth * tiles_per_row;
        return StepPlace{warp_id + nth * warps, tile * kTileVecs + lane, tile == tiles_per_row - 1};
    }
};

// One 16-byte piece of each row of a pair against the staged input's piece.
template <typename T>
__device__ __forceinline__ void accumulate_piece(const uint4& x, const uint4& w0, const uint4& w1,
                                                 float& acc0, float& acc1) {
    float xf[8], f0[8], f1[8];
    widen8(x, static_cast<T*>(nullptr), xf);
    widen8(w0, static_cast<T*>(nullptr), f0);
    widen8(w1, static_cast<T*>(nullptr), f1);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        acc0 = fmaf(f0[j], xf[j], acc0);
        acc1 = fmaf(f1[j], xf[j], acc1);
    }
}

// The two weight rows a pair of outputs reads; `second` is -1 where the pair has one row.
struct PairRows {
    int first, second;
};

// The epilogue of the fused projection: rows (2i, 2i + 1) make pair i, and their sums go through
// p.epilogue into y. An epilogue policy provides `rows(pair)` and `finish(pair, sum0, sum1)`, the
// latter called by one lane with the pair's reduced sums.
template <typename T> struct ProductEpilogue {
    const MatVecParams& p;

    __device__ __forceinline__ PairRows rows(int pair) const {
        return PairRows{2 * pair, 2 * pair + 1 < p.n ? 2 * pair + 1 : -1};
    }

    __device__ __forceinline__ void finish(int pair, float sum0, float sum1) const {
        T* y = static_cast<T*>(p.y);
        const int row0 = 2 * pair;
        if (p.epilogue == kEpilogueSwiGlu) {
            // Rounded where the unfused chain (product, silu, multiply) rounds.
            const float gate = round_to<T>(sum0);
            const float up = round_to<T>(sum1);
            const float silu = round_to<T>(gate / (1.f + __expf(-gate)));
            y[pair] = from_float<T>(silu * up);
            return;
        }
        const T* residual = static_cast<const T*>(p.residual);
        const bool add = p.epilogue == kEpilogueResidual;
        y[row0] = from_float<T>(sum0 + (add ? to_float(residual[row0]) : 0.f));
        if (row0 + 1 < p.n)
            y[row0 + 1] = from_float<T>(sum1 + (add ? to_float(residual[row0 + 1]) : 0.f));
    }
};

// A pair's row sums, reduced over the warp, through the epilogue (lane 0 finishes).
template <class Epilogue>
__device__ __forceinline__ void finish_pair(const Epilogue& epilogue, int pair, int lane, float acc0, float acc1) {
    const float sum0 = warp_sum(acc0);
    const float sum1 = warp_sum(acc1);
    if (lane == 0) epilogue.finish(pair, sum0, sum1);
}

// The register form: a warp keeps two tiles in flight in registers (double-buffered).
template <typename T, int kUnroll, class Epilogue>
__device__ __forceinline__ void matvec_stream(const MatVecParams& p, const Epilogue& epilogue) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int vecs = p.k / 8;
    uint4* x_s = reinterpret_cast<uint4*>(smem);
    uint4* g_s = x_s + vecs;
    const PairWalk<kUnroll> walk(p, vecs);
    const int steps = walk.steps;
    const uint4* w = static_cast<const uint4*>(p.w);

    auto load = [&](int s, Tile<kUnroll>& t) {
        const StepPlace at = walk.place(s);
        const PairRows rows = epilogue.rows(at.pair);
        const uint4* r0 = w + static_cast<long long>(rows.first) * vecs;
        const uint4* r1 = w + static_cast<long long>(rows.second >= 0 ? rows.second : rows.first) * vecs;
        const bool has_row1 = rows.second >= 0;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int v = at.first_vec + u * 32;
            const bool in_row = v < vecs;
            t.v[0][u] = in_row ? load_stream16(r0 + v) : make_uint4(0, 0, 0, 0);
            t.v[1][u] = in_row && has_row1 ? load_stream16(r1 + v) : make_uint4(0, 0, 0, 0);
        }
    };

    // The first two tiles of weights do not depend on the previous kernel: start them now.
    Tile<kUnroll> a, b;
    if (steps > 0) load(0, a);
    if (steps > 1) load(1, b);
    allow_dependent_launch();
    wait_for_prerequisite_grid();
    stage_input<T>(p, x_s, g_s);
    __syncthreads();

    float acc0 = 0.f, acc1 = 0.f;
    auto consume = [&](int s, const Tile<kUnroll>& t) {
        const StepPlace at = walk.place(s);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int v = at.first_vec + u * 32;
            if (v < vecs) accumulate_piece<T>(x_s[v], t.v[0][u], t.v[1][u], acc0, acc1);
        }
        if (!at.last_of_row) return;
        finish_pair(epilogue, at.pair, walk.lane, acc0, acc1);
        acc0 = acc1 = 0.f;
    };

    // Two register buffers: while one tile is consumed, the next is in flight.
    for (int s = 0; s < steps; s += 2) {
        consume(s, a);
        if (s + 2 < steps) load(s + 2, a);
        if (s + 1 < steps) {
            consume(s + 1, b);
            if (s + 3 < steps) load(s + 3, b);
        }
    }
}

template <typename T, int kUnroll>
__device__ __forceinline__ void matvec(const MatVecParams& p) {
    matvec_stream<T, kUnroll>(p, ProductEpilogue<T>{p});
}

// The ring form (sm_80 and later): each warp streams its tiles through a ring of kStages slots
// in shared memory, filled by cp.async. The bytes in flight then live in shared memory, not in
// registers, and one CTA per SM keeps more of them in flight than the register form's two. A
// lane reads back only the pieces it copied itself, so the ring needs no barrier; and the next
// copy is issued before a warp waits, so every slot is in flight while it does.
template <int kUnroll, int kStages>
struct MatVecRingLayout {
    static constexpr int kSlotVecs = 2 * 32 * kUnroll;  // one tile of a pair
    // The rings of all warps, at the base of shared memory; the staged input follows.
    static constexpr int kRingBytes = kMatVecWarps * kStages * kSlotVecs * 16;
};

template <typename T, int kUnroll, int kStages, class Epilogue>
__device__ __forceinline__ void matvec_ring_stream(const MatVecParams& p, const Epilogue& epilogue) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    using Ring = MatVecRingLayout<kUnroll, kStages>;
    constexpr int kTileVecs = 32 * kUnroll;
    extern __shared__ __align__(16) unsigned char smem[];
    const int vecs = p.k / 8;
    const PairWalk<kUnroll> walk(p, vecs);
    const int steps = walk.steps;
    const int lane = walk.lane;
    uint4* ring = reinterpret_cast<uint4*>(smem) + (threadIdx.x / 32) * kStages * Ring::kSlotVecs;
    uint4* x_s = reinterpret_cast<uint4*>(smem + Ring::kRingBytes);
    uint4* g_s = x_s + vecs;
    const uint4* w = static_cast<const uint4*>(p.w);
    const unsigned long long policy = l2_evict_first_policy();

    // Step s's copies into its slot, one commit group per step (empty past the end, so that the
    // group count stays in step with s).
    auto issue = [&](int s) {
        if (s < steps) {
            const StepPlace at = walk.place(s);
            const PairRows rows = epilogue.rows(at.pair);
            const uint4* r0 = w + static_cast<long long>(rows.first) * vecs;
            const uint4* r1 = w + static_cast<long long>(rows.second >= 0 ? rows.second : rows.first) * vecs;
            const bool has_row1 = rows.second >= 0;
            const unsigned slot =
                static_cast<unsigned>(__cvta_generic_to_shared(ring + (s % kStages) * Ring::kSlotVecs + lane));
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                const int v = at.first_vec + u * 32;
                if (v < vecs) {
                    cp_async16_to_hint(slot + u * 32 * 16, r0 + v, policy);
                    if (has_row1) cp_async16_to_hint(slot + (kTileVecs + u * 32) * 16, r1 + v, policy);
                }
            }
        }
        cp_async_commit();
    };

    // The weights do not depend on the previous kernel: fill the ring before waiting for it.
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) issue(s);
    allow_dependent_launch();
    wait_for_prerequisite_grid();
    stage_input<T>(p, x_s, g_s);
    __syncthreads();

    float acc0 = 0.f, acc1 = 0.f;
    for (int s = 0; s < steps; ++s) {
        // The slot step s + kStages - 1 fills was consumed by step s - 1.
        issue(s + kStages - 1);
        cp_async_wait<kStages - 1>();
        const StepPlace at = walk.place(s);
        const uint4* slot = ring + (s % kStages) * Ring::kSlotVecs + lane;
        const bool has_row1 = epilogue.rows(at.pair).second >= 0;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int v = at.first_vec + u * 32;
            if (v < vecs) {
                const uint4 w1 = has_row1 ? slot[kTileVecs + u * 32] : make_uint4(0, 0, 0, 0);
                accumulate_piece<T>(x_s[v], slot[u * 32], w1, acc0, acc1);
            }
        }
        if (!at.last_of_row) continue;
        finish_pair(epilogue, at.pair, lane, acc0, acc1);
        acc0 = acc1 = 0.f;
    }
    cp_async_wait<0>();
#endif
}

template <typename T, int kUnroll, int kStages>
__device__ __forceinline__ void matvec_ring(const MatVecParams& p) {
    matvec_ring_stream<T, kUnroll, kStages>(p, ProductEpilogue<T>{p});
}
