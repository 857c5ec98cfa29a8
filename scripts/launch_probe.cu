// Launch-gap probe: what one kernel boundary costs on this GPU when kernels are replayed from a
// CUDA graph, with and without programmatic dependent launch (PDL), for grids shaped like the
// decode kernel's (128 CTAs of 128 threads, with or without a large shared-memory request).
// Each kernel spins for `body_ns` on the global timer after its grid-dependency wait and writes
// one word, so the period per kernel minus the body is the boundary's cost.
//
// Not part of the crate's build. Build and run:
//   nvcc -O3 -arch=sm_90 -std=c++17 -cudart static scripts/launch_probe.cu -o launch_probe
//   ./launch_probe
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
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
    cudaGraph_t graph;
    cudaGraphExec_t exec;
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
    CK(cudaStreamEndCapture(s, &graph));
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
    CK(cudaGraphExecDestroy(exec));
    CK(cudaGraphDestroy(graph));
    CK(cudaStreamDestroy(s));
    CK(cudaFree(out));
    return t[t.size() / 2];
}

int main() {
    int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    for (int ctas : {64, 128, sms}) {
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
    return 0;
}
