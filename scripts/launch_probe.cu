// Launch-gap probe: what one kernel boundary costs on this GPU when kernels are replayed from a
// CUDA graph, with and without programmatic dependent launch (PDL), for grids shaped like the
// decode kernel's (128 CTAs of 128 threads, with or without a large shared-memory request).
// Each kernel spins for `body_ns` on the global timer after its grid-dependency wait and writes
// one word, so the period per kernel minus the body is the boundary's cost. A second part times
// pairs shaped like the partial and combine passes, the combine waiting either for the whole
// previous grid or only for an arrival count the partial CTAs bump after their writes. A third
// times the pair with the op's stream-ordered allocations captured into the graph as well.
//
// Not part of the crate's build. Build and run:
//   nvcc -O3 -arch=sm_90 -std=c++17 -cudart static scripts/launch_probe.cu -o launch_probe
//   ./launch_probe
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

__device__ __forceinline__ uint64_t global_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Median over 7 replays of `graph` (after one warm-up replay) of the time per call, for a graph
// of `chain` calls; destroys the graph.
static float replay_us_per_call(cudaGraph_t graph, cudaStream_t s, int chain) {
    cudaGraphExec_t exec;
    CK(cudaGraphInstantiate(&exec, graph, 0));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    CK(cudaGraphLaunch(exec, s));
    std::vector<float> t;
    for (int r = 0; r < 7; ++r) {
        CK(cudaEventRecord(e0, s));
        CK(cudaGraphLaunch(exec, s));
        CK(cudaEventRecord(e1, s));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        t.push_back(ms * 1000.f / chain);
    }
    std::sort(t.begin(), t.end());
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    CK(cudaGraphExecDestroy(exec));
    CK(cudaGraphDestroy(graph));
    return t[t.size() / 2];
}

__global__ void step(unsigned* out, unsigned body_ns) {
    extern __shared__ unsigned char smem[];
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
    const uint64_t start = global_ns();
    while (global_ns() - start < body_ns) {
    }
    if (threadIdx.x == 0) out[blockIdx.x] = (unsigned)start + smem[0] * 0u;
}

static float period_us(int ctas, int smem, unsigned body_ns, bool pdl, int chain) {
    unsigned* out;
    CK(cudaMalloc(&out, 4096 * sizeof(unsigned)));
    if (smem > 48 * 1024)
        CK(cudaFuncSetAttribute((const void*)step, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                smem));
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < chain; ++i) {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(ctas);
        cfg.blockDim = dim3(128);
        cfg.dynamicSmemBytes = smem;
        cfg.stream = s;
        cudaLaunchAttribute attr[1];
        attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[0].val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = attr;
        cfg.numAttrs = pdl ? 1 : 0;
        CK(cudaLaunchKernelEx(&cfg, step, out, body_ns));
    }
    cudaGraph_t graph;
    CK(cudaStreamEndCapture(s, &graph));
    const float us = replay_us_per_call(graph, s, chain);
    CK(cudaStreamDestroy(s));
    CK(cudaFree(out));
    return us;
}

// A partial-pass stand-in: spins, writes a word, then counts itself done on `arrivals`.
__global__ void partial_like(unsigned* out, unsigned* arrivals, unsigned body_ns) {
    extern __shared__ unsigned char smem[];
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
    const uint64_t start = global_ns();
    while (global_ns() - start < body_ns) {
    }
    if (threadIdx.x == 0) {
        out[blockIdx.x] = (unsigned)start + smem[0] * 0u;
        __threadfence();
        atomicAdd(arrivals, 1u);
    }
}

// A combine stand-in: waits for the whole previous grid (griddepcontrol.wait), or only for
// `expected` arrivals on the counter, then reads what the partial CTAs wrote.
__global__ void combine_like(const unsigned* in, unsigned* out, const unsigned* arrivals,
                             unsigned expected, int by_count) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    if (by_count) {
        if (threadIdx.x == 0)
            while (*(volatile const unsigned*)arrivals < expected) {
            }
        __syncthreads();
        __threadfence();
    } else {
        asm volatile("griddepcontrol.wait;" ::: "memory");
    }
    if (threadIdx.x == 0) out[blockIdx.x] = in[blockIdx.x * 4 % 128];
}

// Period of one (partial_like, combine_like) pair in a graph of `chain` pairs, both launched as
// programmatic dependents; each pair counts on its own zeroed counter. With `allocs` = 1 or 2 each
// pair also allocates, as stream-ordered allocations captured into the graph, what the op does
// (the output; the output and the split scratch) and frees them after the combine, as a tensor
// dropped after the call is.
static float pair_period_us(int smem, unsigned body_ns, int by_count, int allocs, int chain) {
    unsigned *fixed_scratch, *fixed_out, *counters;
    CK(cudaMalloc(&fixed_scratch, 65536 * sizeof(unsigned)));
    CK(cudaMalloc(&fixed_out, 4096 * sizeof(unsigned)));
    CK(cudaMalloc(&counters, chain * sizeof(unsigned)));
    if (smem > 48 * 1024)
        CK(cudaFuncSetAttribute((const void*)partial_like,
                                cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
    CK(cudaMemsetAsync(counters, 0, chain * sizeof(unsigned), s));
    for (int i = 0; i < chain; ++i) {
        unsigned* out = fixed_out;
        unsigned* scratch = fixed_scratch;
        if (allocs >= 1) CK(cudaMallocAsync((void**)&out, 4096 * sizeof(unsigned), s));
        if (allocs >= 2) CK(cudaMallocAsync((void**)&scratch, 65536 * sizeof(unsigned), s));
        cudaLaunchAttribute attr[1];
        attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[0].val.programmaticStreamSerializationAllowed = 1;
        cudaLaunchConfig_t a = {};
        a.gridDim = dim3(128);
        a.blockDim = dim3(128);
        a.dynamicSmemBytes = smem;
        a.stream = s;
        a.attrs = attr;
        a.numAttrs = i == 0 ? 0 : 1;
        CK(cudaLaunchKernelEx(&a, partial_like, scratch, counters + i, body_ns));
        cudaLaunchConfig_t b = {};
        b.gridDim = dim3(32);
        b.blockDim = dim3(128);
        b.stream = s;
        b.attrs = attr;
        b.numAttrs = 1;
        CK(cudaLaunchKernelEx(&b, combine_like, (const unsigned*)scratch, out,
                              (const unsigned*)(counters + i), 128u, by_count));
        if (allocs >= 2) CK(cudaFreeAsync(scratch, s));
        if (allocs >= 1) CK(cudaFreeAsync(out, s));
    }
    cudaGraph_t graph;
    CK(cudaStreamEndCapture(s, &graph));
    const float us = replay_us_per_call(graph, s, chain);
    CK(cudaStreamDestroy(s));
    CK(cudaFree(fixed_scratch));
    CK(cudaFree(fixed_out));
    CK(cudaFree(counters));
    return us;
}

int main(int argc, char** argv) {
    // `launch_probe allocs` runs only the last part.
    const bool only_allocs = argc > 1 && strcmp(argv[1], "allocs") == 0;
    int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    for (int ctas : {64, 128, sms}) {
        if (only_allocs) break;
        for (int smem : {0, 100 * 1024, 160 * 1024}) {
            for (unsigned body : {0u, 2000u, 5000u}) {
                for (int pdl : {0, 1}) {
                    const float us = period_us(ctas, smem, body, pdl, 200);
                    printf("{\"ctas\":%d,\"smem_kib\":%d,\"body_us\":%.1f,\"pdl\":%d,\"period_us\":%.2f,"
                           "\"boundary_us\":%.2f}\n",
                           ctas, smem / 1024, body / 1000.0, pdl, us, us - body / 1000.0);
                    fflush(stdout);
                }
            }
        }
    }
    // The partial/combine pair: the combine waiting for the whole grid against waiting for an
    // arrival count.
    for (int smem : {0, 100 * 1024}) {
        if (only_allocs) break;
        for (unsigned body : {0u, 2000u, 5000u}) {
            for (int by_count : {0, 1}) {
                const float us = pair_period_us(smem, body, by_count, 0, 200);
                printf("{\"pair\":1,\"smem_kib\":%d,\"body_us\":%.1f,\"combine_waits_on\":\"%s\","
                       "\"period_us\":%.2f,\"overhead_us\":%.2f}\n",
                       smem / 1024, body / 1000.0, by_count ? "count" : "grid", us,
                       us - body / 1000.0);
                fflush(stdout);
            }
        }
    }
    // The same pair with the op's allocations captured into the graph.
    for (unsigned body : {0u, 2000u}) {
        for (int allocs : {0, 1, 2}) {
            const float us = pair_period_us(100 * 1024, body, 0, allocs, 200);
            printf("{\"pair\":1,\"allocs_per_call\":%d,\"body_us\":%.1f,\"period_us\":%.2f,"
                   "\"overhead_us\":%.2f}\n",
                   allocs, body / 1000.0, us, us - body / 1000.0);
            fflush(stdout);
        }
    }
    return 0;
}
