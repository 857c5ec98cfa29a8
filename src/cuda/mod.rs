//! The CUDA backend: the kernels that build.rs compiles from `kernels/`, looked up in the table it
//! generates, planned for the device at hand and launched on candle's stream with no host
//! synchronisation.
//!
//! The op hands this side a [`DecodeCall`](crate::op::call::DecodeCall) and gets tensors back;
//! nothing here reads the op itself.

pub(crate) mod cache_write;
mod decode;
mod decode_kernel;
mod dispatch;
pub(crate) mod fp8_convert;
// CUDA graphs and the RoPE split serve the model stack's decode step.
#[cfg(feature = "models")]
pub(crate) mod graph;
pub(crate) mod kernels;
pub(crate) mod launch;
mod lockstep;
pub(crate) mod memory;
mod modules;
mod planner;
pub(crate) mod prefill;
#[cfg(feature = "models")]
pub(crate) mod rope_split;
mod split_counters;
pub(crate) mod swiglu;
pub(crate) mod tensor_map;
mod wide_groups;

pub(crate) use dispatch::{forward, split_plan};
