// Streaming-read probe: how fast can an H200 read two large arrays (K and V) with
//  - the decode kernel's pattern: per-warp cp.async rings over interleaved 16-row tiles
//  - the same pattern with 1D bulk copies (cp.async.bulk + mbarrier), one lane per warp issuing
//  - plain 16-byte loads, grid-stride, many warps per SM (the classic bandwidth test)
// Each CTA reads one contiguous chunk of K and the same chunk of V, as a (head, split) does in a
// head-major cache. Prints one JSON line per configuration.
//
// Not part of the crate's build. Build and run (argument: MiB of each of K and V, default 1024):
//   nvcc -O3 -arch=sm_90 -std=c++17 -cudart static scripts/stream_probe.cu -o stream_probe
//   ./stream_probe 4096
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <algorithm>
#include <vector>

#define CK(x)                                                                     \
    do {                                                                          \
        cudaError_t e = (x);                                                      \
        if (e != cudaSuccess) {                                                   \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x,             \
                    cudaGetErrorString(e));                                       \
            exit(1);                                                              \
        }                                                                         \
    } while (0)

struct Args {
    const char* k;
    const char* v;
    long long chunk_bytes;  // per CTA, of each of K and V
    int tile_bytes;         // per warp and tile, of each of K and V
    unsigned* sink;
};

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// The decode kernel's pattern: warp w takes tiles w, w + W, w + 2W, ... of its CTA's chunk, with
// STAGES - 1 tiles in flight.
template <int STAGES>
__global__ void ring_cp_async(Args a) {
    extern __shared__ __align__(128) unsigned char smem[];
    const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int stage_bytes = 2 * a.tile_bytes;
    unsigned char* ring = smem + warp * STAGES * stage_bytes;
    const char* k = a.k + blockIdx.x * a.chunk_bytes;
    const char* v = a.v + blockIdx.x * a.chunk_bytes;
    const int tiles = (int)(a.chunk_bytes / a.tile_bytes);
    const int mine = tiles > warp ? (tiles - warp + warps - 1) / warps : 0;
    int issued = 0;
    auto issue = [&]() {
        if (issued < mine) {
            const long long off = (long long)(warp + issued * warps) * a.tile_bytes;
            unsigned char* s = ring + (issued % STAGES) * stage_bytes;
            for (int i = lane * 16; i < a.tile_bytes; i += 32 * 16) {
                cp_async16(s + i, k + off + i);
                cp_async16(s + a.tile_bytes + i, v + off + i);
            }
        }
        ++issued;
        cp_commit();
    };
    for (int s = 0; s < STAGES - 1; ++s) issue();
    unsigned acc = 0;
    for (int n = 0; n < mine; ++n) {
        cp_wait<STAGES - 2>();
        __syncwarp();
        const unsigned char* s = ring + (n % STAGES) * stage_bytes;
        acc ^= *reinterpret_cast<const unsigned*>(s + lane * 4) ^
               *reinterpret_cast<const unsigned*>(s + a.tile_bytes + lane * 4);
        __syncwarp();
        issue();
    }
    if (acc == 0x12345678u) a.sink[0] = acc;
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned count) {
    unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(bar));
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(a), "r"(count));
}
__device__ __forceinline__ void mbar_expect(uint64_t* bar, unsigned bytes) {
    unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(bar));
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(a), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
    unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(bar));
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra WAIT_%=;\n"
        "}\n" ::"r"(a),
        "r"(parity)
        : "memory");
}
__device__ __forceinline__ void bulk_copy(void* smem, const void* gmem, unsigned bytes,
                                          uint64_t* bar) {
    unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    unsigned b = static_cast<unsigned>(__cvta_generic_to_shared(bar));
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(d),
        "l"(gmem), "r"(bytes), "r"(b)
        : "memory");
}

// Same pattern, one bulk copy per tile and tensor, issued by lane 0, completion on an mbarrier.
template <int STAGES>
__global__ void ring_bulk(Args a) {
    extern __shared__ __align__(128) unsigned char smem[];
    const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int stage_bytes = 2 * a.tile_bytes;
    uint64_t* bars = reinterpret_cast<uint64_t*>(smem) + warp * STAGES;
    unsigned char* ring = smem + 1024 + warp * STAGES * stage_bytes;
    if (lane == 0)
        for (int s = 0; s < STAGES; ++s) mbar_init(&bars[s], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    __syncwarp();
    const char* k = a.k + blockIdx.x * a.chunk_bytes;
    const char* v = a.v + blockIdx.x * a.chunk_bytes;
    const int tiles = (int)(a.chunk_bytes / a.tile_bytes);
    const int mine = tiles > warp ? (tiles - warp + warps - 1) / warps : 0;
    int issued = 0;
    auto issue = [&]() {
        if (issued < mine && lane == 0) {
            const long long off = (long long)(warp + issued * warps) * a.tile_bytes;
            const int slot = issued % STAGES;
            unsigned char* s = ring + slot * stage_bytes;
            mbar_expect(&bars[slot], 2 * a.tile_bytes);
            bulk_copy(s, k + off, a.tile_bytes, &bars[slot]);
            bulk_copy(s + a.tile_bytes, v + off, a.tile_bytes, &bars[slot]);
        }
        ++issued;
    };
    for (int s = 0; s < STAGES - 1; ++s) issue();
    unsigned acc = 0;
    for (int n = 0; n < mine; ++n) {
        const int slot = n % STAGES;
        mbar_wait(&bars[slot], (n / STAGES) & 1);
        const unsigned char* s = ring + slot * stage_bytes;
        acc ^= *reinterpret_cast<const unsigned*>(s + lane * 4) ^
               *reinterpret_cast<const unsigned*>(s + a.tile_bytes + lane * 4);
        __syncwarp();
        issue();
    }
    if (acc == 0x12345678u) a.sink[0] = acc;
}

// Classic: every thread streams 16-byte loads, UNROLL in flight, over its CTA's chunk.
template <int UNROLL>
__global__ void plain_loads(Args a) {
    const uint4* k = reinterpret_cast<const uint4*>(a.k + blockIdx.x * a.chunk_bytes);
    const uint4* v = reinterpret_cast<const uint4*>(a.v + blockIdx.x * a.chunk_bytes);
    const long long n = a.chunk_bytes / 16;
    unsigned acc = 0;
    for (long long base = threadIdx.x; base < n; base += (long long)blockDim.x * UNROLL) {
        uint4 x[UNROLL], y[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const long long i = base + (long long)u * blockDim.x;
            if (i < n) {
                x[u] = __ldcs(k + i);
                y[u] = __ldcs(v + i);
            } else {
                x[u] = y[u] = make_uint4(0, 0, 0, 0);
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) acc ^= x[u].x ^ y[u].w;
    }
    if (acc == 0x12345678u) a.sink[0] = acc;
}

typedef void (*Kernel)(Args);

static float time_kernel(Kernel kern, dim3 grid, dim3 block, int smem, Args a, int reps) {
    if (smem > 48 * 1024)
        CK(cudaFuncSetAttribute((const void*)kern, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                smem));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    for (int i = 0; i < 3; ++i) kern<<<grid, block, smem>>>(a);
    CK(cudaGetLastError());
    std::vector<float> t;
    for (int r = 0; r < reps; ++r) {
        CK(cudaEventRecord(e0));
        for (int i = 0; i < 10; ++i) kern<<<grid, block, smem>>>(a);
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        t.push_back(ms * 100.f);  // µs per launch
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

int main(int argc, char** argv) {
    int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const long long total = (argc > 1 ? atoll(argv[1]) : 1024) << 20;  // MiB of K (and of V)
    char *k, *v;
    unsigned* sink;
    CK(cudaMalloc(&k, total));
    CK(cudaMalloc(&v, total));
    CK(cudaMalloc(&sink, 64));
    CK(cudaMemset(k, 1, total));
    CK(cudaMemset(v, 2, total));
    CK(cudaDeviceSynchronize());

    auto report = [&](const char* mode, int ctas, int warps, int stages, int tile, float us) {
        const double bytes = 2.0 * (double)total;
        printf("{\"mode\":\"%s\",\"mib\":%lld,\"ctas\":%d,\"warps\":%d,\"stages\":%d,\"tile\":%d,"
               "\"us\":%.2f,\"TBps\":%.3f}\n",
               mode, total >> 20, ctas, warps, stages, tile, us, bytes / us / 1e6);
        fflush(stdout);
    };
    const int tiles_ctas[] = {128, sms};
    for (int ctas : tiles_ctas) {
        Args a{k, v, total / ctas / 4096 * 4096, 4096, sink};
        // Ring shapes: (warps, stages) with 4 KiB tiles per tensor (16 rows x 256 B).
        const int shapes[][2] = {{4, 2}, {4, 3}, {4, 4}, {4, 5}, {8, 2}, {8, 3}, {8, 4}, {2, 5}, {2, 8}};
        for (auto& sh : shapes) {
            const int warps = sh[0], stages = sh[1];
            const int smem = warps * stages * 2 * a.tile_bytes;
            Kernel kern = nullptr, bulk = nullptr;
            switch (stages) {
                case 2: kern = ring_cp_async<2>; bulk = ring_bulk<2>; break;
                case 3: kern = ring_cp_async<3>; bulk = ring_bulk<3>; break;
                case 4: kern = ring_cp_async<4>; bulk = ring_bulk<4>; break;
                case 5: kern = ring_cp_async<5>; bulk = ring_bulk<5>; break;
                case 8: kern = ring_cp_async<8>; bulk = ring_bulk<8>; break;
            }
            if (smem + 1024 > 227 * 1024) continue;
            report("cp_async", ctas, warps, stages, a.tile_bytes,
                   time_kernel(kern, ctas, warps * 32, smem, a, 7));
            report("bulk", ctas, warps, stages, a.tile_bytes,
                   time_kernel(bulk, ctas, warps * 32, smem + 1024, a, 7));
        }
        // Bulk copies of 16 KiB tiles per tensor, two warps (the shared memory allows no more).
        Args big = a;
        big.tile_bytes = 16384;
        big.chunk_bytes = total / ctas / 16384 * 16384;
        for (int stages : {2, 3}) {
            const int smem = 2 * stages * 2 * big.tile_bytes + 1024;
            report("bulk", ctas, 2, stages, big.tile_bytes,
                   time_kernel(stages == 2 ? ring_bulk<2> : ring_bulk<3>, ctas, 64, smem, big, 7));
        }
    }
    // Plain loads: many CTAs per SM.
    for (int per_sm : {1, 2, 4, 8}) {
        const int ctas = sms * per_sm;
        Args a{k, v, total / ctas / 4096 * 4096, 0, sink};
        report("ldg_u4", ctas, 256 / 32, 4, 0, time_kernel(plain_loads<4>, ctas, 256, 0, a, 7));
        report("ldg_u8", ctas, 256 / 32, 8, 0, time_kernel(plain_loads<8>, ctas, 256, 0, a, 7));
    }
    return 0;
}
