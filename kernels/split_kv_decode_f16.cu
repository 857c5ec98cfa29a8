// Partial-pass kernels for __half inputs, one per (head dim, group bucket).
#include "split_kv_decode.cuh"

DECODE_DIMS(split_kv_decode_f16, __half)
