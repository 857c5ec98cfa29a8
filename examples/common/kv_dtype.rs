//! `--kv-dtype`: the dtype a model's KV cache stores keys and values in, shared by the binaries.

#![allow(dead_code)]

use candle_core::DType;
use clap::ValueEnum;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum KvDtypeArg {
    /// e4m3 with scale 1: half the bytes of bf16 per position; keys and values beyond ±448
    /// saturate there.
    Fp8,
    Bf16,
    F16,
    F32,
}

impl KvDtypeArg {
    pub fn dtype(self) -> DType {
        match self {
            KvDtypeArg::Fp8 => DType::F8E4M3,
            KvDtypeArg::Bf16 => DType::BF16,
            KvDtypeArg::F16 => DType::F16,
            KvDtypeArg::F32 => DType::F32,
        }
    }
}

/// The name reports give a K/V dtype, as PyTorch spells it (`bench_decode` writes the same).
pub fn kv_dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::F8E4M3 => "float8_e4m3fn",
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        DType::F32 => "float32",
        other => other.as_str(),
    }
}
