// Hopper (sm_90a) building blocks: warpgroup matrix products (`wgmma`), their shared-memory
// descriptors, mbarriers, named barriers and register reallocation between warpgroups.
//
// A warpgroup is four consecutive warps starting at a warp index divisible by 4. Its product
// D (64 × N, f32) holds, per thread, the accumulator layout of eight-column mma.sync m16n8
// tiles side by side: warp w of the group owns rows 16w..16w+15; lane l holds rows
// 16w + l/4 (+8) and columns 8i + 2(l%4) (+1) in d[4i .. 4i+3].
//
// Operands in shared memory use the 128-byte swizzle: a tile of R rows × 64 16-bit elements is
// R lines of 128 bytes whose 16-byte pieces are permuted, piece j of row r stored at piece
// j ^ (r % 8); wider rows are such tiles side by side (all dims 0-63 of every row, then 64-127,
// ...). Each tile starts 1024-byte aligned.
#pragma once

// wgmma and setmaxnreg exist on the architecture-specific target only.
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "wgmma.cuh needs the sm_90a target: -gencode=arch=compute_90a,code=sm_90a"
#endif

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

// The byte offset of 16-byte piece `piece` of row `row` in a 128-byte-swizzled tile of `rows`
// rows (see above).
__host__ __device__ constexpr unsigned swizzled_offset(int rows, int row, int piece) {
    return (unsigned)((piece / 8) * rows * 128 + row * 128 + (((piece % 8) ^ (row % 8)) * 16));
}

// A shared-memory matrix descriptor for the 128-byte swizzle: start address, leading and stride
// byte offsets (in 16-byte units), swizzle mode 1 in bits 62-63.
__device__ __forceinline__ uint64_t wgmma_desc(unsigned addr, unsigned leading, unsigned stride) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)((leading >> 4) & 0x3FFF) << 16) |
           ((uint64_t)((stride >> 4) & 0x3FFF) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Pins accumulator registers in place around asynchronous products: the compiler may not move
// or copy them while a product that writes them is in flight.
template <int R> __device__ __forceinline__ void wgmma_hold(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
template <int R> __device__ __forceinline__ void wgmma_hold(uint32_t (&d)[R][4]) {
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(d[i][j])::"memory");
}

// Register reallocation: a warpgroup gives registers back or takes them (a multiple of 8).
template <int N> __device__ __forceinline__ void registers_release() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N> __device__ __forceinline__ void registers_claim() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

// Named barriers (id 0 is __syncthreads'): `threads` arrive in all, some waiting, some not.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// mbarriers on 32-bit shared-space addresses.
__device__ __forceinline__ void mbarrier_init(unsigned bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(unsigned bar) {
    asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.release.cta.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar)
                 : "memory");
}
// Waits until the phase of parity `parity` has completed.
__device__ __forceinline__ bool mbarrier_try_wait(unsigned bar, unsigned parity) {
    unsigned done;
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
    return done != 0;
}
__device__ __forceinline__ void mbarrier_wait(unsigned bar, unsigned parity) {
    while (!mbarrier_try_wait(bar, parity)) {
    }
}

// Arrives on `bar` and adds `bytes` to the transaction count its phase waits for (the bytes a
// tensor copy will deliver to it).
__device__ __forceinline__ void mbarrier_arrive_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
                 : "memory");
}

// One box of a 4-D tensor (TMA) from global into shared memory at `dst`, at coordinates
// (c0, c1, c2, c3) of the descriptor `map` (a kernel parameter's address), completing `bytes`
// on the mbarrier `bar`. The descriptor's swizzle lays the box out as the operands here expect.
__device__ __forceinline__ void tma_load_4d(unsigned dst, const void* map, int c0, int c1, int c2, int c3,
                                            unsigned bar) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
        "[%6];\n" ::"r"(dst),
        "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
        : "memory");
}

// Brings a TMA descriptor (a kernel parameter) into the descriptor cache ahead of its first use.
__device__ __forceinline__ void tma_prefetch_descriptor(const void* map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(map) : "memory");
}

// Orders this thread's ordinary shared-memory writes (cp.async ones included, once waited for)
// before later reads by the tensor cores' asynchronous proxy.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// The products. ss: S = Q · Kᵀ shape, D (64 × N, f32) = or += A · Bᵀ with A and B K-major in
// shared memory (`accumulate` 0 overwrites D). rs: O += P · V shape, D (64 × N, f32) += A · B with
// A (64 × 16) in registers as the m16n8k16 A fragment of each warp's 16 rows and B N-major in
// shared memory, transposed on the fly. bf16 and f16 differ only in the instruction's type names,
// so one macro writes both element types' products.

// D's accumulators d[i], d[i + 1], ... as read-write asm operands, 8, 32, 64 or 128 of them.
#define WGMMA_ACC8(d, i)                                                                           \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
        "+f"(d[i + 6]), "+f"(d[i + 7])
#define WGMMA_ACC32(d, i) WGMMA_ACC8(d, i), WGMMA_ACC8(d, i + 8), WGMMA_ACC8(d, i + 16), WGMMA_ACC8(d, i + 24)
#define WGMMA_ACC64(d, i) WGMMA_ACC32(d, i), WGMMA_ACC32(d, i + 32)
#define WGMMA_ACC128(d) WGMMA_ACC64(d, 0), WGMMA_ACC64(d, 64)

// The accumulators' operand numbers in the instruction: %0 up to D's register count.
#define WGMMA_OPERANDS32 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, " \
    "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define WGMMA_OPERANDS64 \
    WGMMA_OPERANDS32 ", " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, " \
    "%49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define WGMMA_OPERANDS128 \
    WGMMA_OPERANDS64 ", " \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, " \
    "%81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, " \
    "%98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, " \
    "%126, %127"

// The start of a product's asm: the predicate `p` (D accumulates) from operand `SCALE_D`, then
// the m64nNk16 instruction for element type `TYPE` up to its accumulator list.
#define WGMMA_BEGIN(SCALE_D, N, TYPE)                        \
    "{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE_D ", 0;\n" \
    "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " {"

// The products of the element type whose PTX name is `TYPE`.
#define WGMMA_PRODUCTS(TYPE)                                                                                         \
    static __device__ __forceinline__ void ss(float (&d)[32], uint64_t a, uint64_t b, int accumulate) {              \
        asm volatile(WGMMA_BEGIN("%34", 64, TYPE) WGMMA_OPERANDS32 "}, %32, %33, p, 1, 1, 0, 0;\n}\n"                \
                     : WGMMA_ACC32(d, 0)                                                                             \
                     : "l"(a), "l"(b), "r"(accumulate)                                                               \
                     : "memory");                                                                                    \
    }                                                                                                                \
    static __device__ __forceinline__ void ss(float (&d)[64], uint64_t a, uint64_t b, int accumulate) {              \
        asm volatile(WGMMA_BEGIN("%66", 128, TYPE) WGMMA_OPERANDS64 "}, %64, %65, p, 1, 1, 0, 0;\n}\n"               \
                     : WGMMA_ACC64(d, 0)                                                                             \
                     : "l"(a), "l"(b), "r"(accumulate)                                                               \
                     : "memory");                                                                                    \
    }                                                                                                                \
    static __device__ __forceinline__ void rs(float (&d)[32], const uint32_t (&a)[4], uint64_t b, int accumulate) {  \
        asm volatile(WGMMA_BEGIN("%37", 64, TYPE) WGMMA_OPERANDS32 "}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"  \
                     : WGMMA_ACC32(d, 0)                                                                             \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate)                           \
                     : "memory");                                                                                    \
    }                                                                                                                \
    static __device__ __forceinline__ void rs(float (&d)[64], const uint32_t (&a)[4], uint64_t b, int accumulate) {  \
        asm volatile(WGMMA_BEGIN("%69", 128, TYPE) WGMMA_OPERANDS64 "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n" \
                     : WGMMA_ACC64(d, 0)                                                                             \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate)                           \
                     : "memory");                                                                                    \
    }                                                                                                                \
    static __device__ __forceinline__ void rs(float (&d)[128], const uint32_t (&a)[4], uint64_t b, int accumulate) { \
        asm volatile(WGMMA_BEGIN("%133", 256, TYPE) WGMMA_OPERANDS128                                                \
                     "}, {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"                                           \
                     : WGMMA_ACC128(d)                                                                               \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate)                           \
                     : "memory");                                                                                    \
    }

template <typename T> struct Wgmma;
template <> struct Wgmma<__nv_bfloat16> {
    WGMMA_PRODUCTS("bf16")
};
template <> struct Wgmma<__half> {
    WGMMA_PRODUCTS("f16")
};

