// Partial-pass kernels for __nv_bfloat16 inputs, one per (head dim, group bucket).
#include "split_kv_decode.cuh"

DECODE_DIMS(split_kv_decode_bf16, __nv_bfloat16)
