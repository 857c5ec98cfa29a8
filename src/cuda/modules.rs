//! The kernel modules in a device's context. build.rs embeds one fatbin per module: machine code
//! for the build's target, which loads as is, and the PTX, which the driver compiles for newer
//! GPUs. A module is loaded the first time one of its kernels is needed, once per context, and
//! kept for the life of the process.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use candle_core::{CudaDevice, Error, Result};
use cudarc::driver::{sys, CudaContext, CudaFunction, CudaModule, DriverError};
use cudarc::nvrtc::Ptx;

use super::launch::compiled_compute_cap;

/// One module in one context: empty until the first thread that needs it has loaded it.
type Slot = Arc<Mutex<Option<Arc<CudaModule>>>>;

/// Loaded modules by context handle and module name. A loaded module holds its context, so no
/// other context can take over a handle this map still has.
static MODULES: OnceLock<Mutex<HashMap<(usize, &'static str), Slot>>> = OnceLock::new();

/// The kernel `symbol` of `module` (whose fatbin is `image`) in `dev`'s context, loading the
/// module there first if no kernel of it ran there yet.
pub(crate) fn function(
    dev: &CudaDevice,
    module: &'static str,
    image: &'static [u8],
    symbol: &str,
) -> Result<CudaFunction> {
    let stream = dev.cuda_stream();
    let ctx = stream.context();
    let loaded = loaded_module(ctx, module, image)?;
    loaded.load_function(symbol).map_err(|e| {
        Error::Msg(format!(
            "getting kernel `{symbol}` from module `{module}`: {e}"
        ))
    })
}

fn loaded_module(
    ctx: &Arc<CudaContext>,
    module: &'static str,
    image: &'static [u8],
) -> Result<Arc<CudaModule>> {
    // The map is locked only to find the module's slot; loads of different modules proceed in
    // parallel, and a second thread needing the same module waits on its slot.
    let slot: Slot = {
        let modules = MODULES.get_or_init(Default::default);
        let mut modules = modules.lock().unwrap_or_else(PoisonError::into_inner);
        modules
            .entry((ctx.cu_ctx() as usize, module))
            .or_default()
            .clone()
    };
    // A slot holds either nothing or a whole module, so a panic elsewhere cannot leave it torn.
    let mut slot = slot.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(loaded) = slot.as_ref() {
        return Ok(loaded.clone());
    }
    // cudarc takes the image as a buffer of its own, freed once the driver has loaded it.
    let loaded = ctx
        .load_module(Ptx::from_binary(image.to_vec()))
        .map_err(|e| load_error(ctx, module, e))?;
    *slot = Some(loaded.clone());
    Ok(loaded)
}

/// What a failed load means, in terms of the build that made the image.
fn load_error(ctx: &CudaContext, module: &str, err: DriverError) -> Error {
    use sys::CUresult::{
        CUDA_ERROR_INVALID_PTX, CUDA_ERROR_JIT_COMPILER_NOT_FOUND, CUDA_ERROR_NO_BINARY_FOR_GPU,
        CUDA_ERROR_UNSUPPORTED_PTX_VERSION,
    };
    let built = compiled_compute_cap();
    let gpu = match ctx.compute_capability() {
        Ok((major, minor)) => format!("{major}{minor}"),
        Err(_) => "unknown".to_string(),
    };
    let oldest: u32 = env!("CANDLE_SPLITKV_MIN_COMPUTE_CAP").parse().unwrap_or(0);
    let too_old = ctx
        .compute_capability()
        .is_ok_and(|(major, minor)| ((major * 10 + minor) as u32) < oldest);
    let why = match err.0 {
        CUDA_ERROR_NO_BINARY_FOR_GPU if too_old => format!(
            "the kernels need compute capability {oldest} or later (Ampere's asynchronous copies \
             and tensor-core instructions), and this GPU has {gpu}; on it, use the CPU path \
             (Device::Cpu)"
        ),
        CUDA_ERROR_NO_BINARY_FOR_GPU => format!(
            "it holds machine code for compute capability {built} and PTX that only GPUs of \
             {built} or later can compile, and this GPU has compute capability {gpu}; build with \
             CUDA_COMPUTE_CAP={gpu}"
        ),
        CUDA_ERROR_UNSUPPORTED_PTX_VERSION
        | CUDA_ERROR_INVALID_PTX
        | CUDA_ERROR_JIT_COMPILER_NOT_FOUND => format!(
            "it holds no machine code for this GPU (compute capability {gpu}, the build's is \
             {built}) and the driver cannot compile its PTX, which a CUDA toolkit newer than the \
             driver made; build with CUDA_COMPUTE_CAP={gpu}, or with a toolkit the driver supports"
        ),
        _ => return Error::Msg(format!("loading kernel module `{module}`: {err}")),
    };
    Error::Msg(format!(
        "cannot load kernel module `{module}` ({err}): {why}"
    ))
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::cuda::kernels::KERNELS;

    /// Every kernel of the table resolves in its module's image. On a GPU the build targets, this
    /// also prints how long each module took to load (run alone, with `--nocapture`, for a
    /// process that loaded nothing before).
    #[test]
    fn every_kernel_is_in_its_module() -> Result<()> {
        let dev = match candle_core::Device::new_cuda(0) {
            Ok(dev) => dev.as_cuda_device()?.clone(),
            Err(e) => {
                println!("skipping: no CUDA device ({e})");
                return Ok(());
            }
        };
        let mut names: Vec<&'static str> = KERNELS.iter().map(|k| k.module).collect();
        names.sort_unstable();
        names.dedup();
        let start = Instant::now();
        for name in names {
            let module_start = Instant::now();
            for kernel in KERNELS.iter().filter(|k| k.module == name) {
                kernel.load(&dev)?;
            }
            println!("{name}: {:?}", module_start.elapsed());
        }
        println!("all modules: {:?}", start.elapsed());
        Ok(())
    }
}
