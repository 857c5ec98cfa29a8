//! The op on CUDA: each call runs on the decode forms (a few query tokens, one pass over a
//! sequence's K/V per block of 16 query rows) or on the prefill forms (any number of query
//! tokens, one pass per tile of a kv head's query rows); `prefill::route` decides.

use candle_core::backend::BackendStorage;
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Result, Tensor};

use super::decode;
use super::prefill::{self, PrefillFamily};
use crate::op::call::DecodeCall;
use crate::op::plan::SplitPlan;

/// The prefill family a test forces on this thread's calls; `None`: the rule decides.
fn forced_route() -> Option<PrefillFamily> {
    #[cfg(feature = "test-hooks")]
    {
        crate::test_hooks::forced_prefill_family()
    }
    #[cfg(not(feature = "test-hooks"))]
    {
        None
    }
}

/// Notes for the test hooks and benchmarks which kernel ran the call: the prefill instance's
/// symbol, or "decode".
fn record_form(_form: &'static str) {
    #[cfg(feature = "test-hooks")]
    crate::test_hooks::record_attention_form(_form);
}

/// The split plan the CUDA path would use for this call, for `dtype` queries and K/V stored as
/// `kv_dtype`.
pub(crate) fn split_plan(
    call: &DecodeCall,
    dev: &CudaDevice,
    dtypes: (DType, DType),
) -> Result<SplitPlan> {
    match prefill::route(call, dev, dtypes, forced_route())? {
        Some(spec) => prefill::split_plan(call, dev, spec),
        None => decode::split_plan(call, dev, dtypes),
    }
}

/// Runs a validated call: the output, and the natural-log LSE `(b, h_q, t)` where the call asked
/// for it.
pub(crate) fn forward(
    call: &DecodeCall,
    q: (&CudaStorage, &Layout),
    k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
) -> Result<(CudaStorage, Option<Tensor>)> {
    let dtypes = (q.0.dtype(), k.0.dtype());
    match prefill::route(call, q.0.device(), dtypes, forced_route())? {
        Some(spec) => {
            record_form(spec.symbol);
            prefill::forward(call, spec, q, k, v)
        }
        None => {
            record_form("decode");
            decode::forward(call, q, k, v)
        }
    }
}
