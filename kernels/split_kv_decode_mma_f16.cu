// Tensor-core partial-pass kernels for __half inputs, one per (head dim, group bucket). They need
// sm_80 or later; built for an older target the module is empty and the CUDA-core kernels run.
#include "split_kv_decode_mma.cuh"

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
DECODE_MMA_DIMS(split_kv_decode_mma_f16, __half)
#endif
