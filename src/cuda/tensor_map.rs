//! TMA descriptors (`CUtensorMap`): how the sm_90a prefill copies whole K/V tiles into shared
//! memory with one instruction per 64-dim column block. Encoded on the host by the driver (no
//! device work), passed in the kernel's parameter block.

use candle_core::DType;
use cudarc::driver::sys;

/// A `CUtensorMap`: 128 opaque bytes, 64-byte aligned, as `kernels/prefill.cuh` declares it.
#[repr(C, align(64))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TensorMap {
    pub opaque: [u64; 16],
}

impl TensorMap {
    /// No descriptor: the kernel reads it only when told one was built.
    pub const NONE: Self = Self { opaque: [0; 16] };
}

/// A 4-D tensor of 16-bit elements at device address `base`: `dims` innermost first, `strides`
/// in bytes of dims 1 to 3 (dim 0 is contiguous). Boxes of `box_dims` elements land in shared
/// memory with the 128-byte swizzle, so a box's innermost extent must be 64 elements.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tiled4d {
    pub dtype: DType,
    pub base: u64,
    pub dims: [u64; 4],
    pub strides: [u64; 3],
    pub box_dims: [u32; 4],
}

impl Tiled4d {
    /// The descriptor, or `None` where TMA cannot take the tensor (an address or stride not a
    /// multiple of 16 bytes, a stride of 2^40 bytes or more, a dim past 2^32, another dtype) or
    /// the driver refuses it: the caller then copies with plain loads.
    pub fn encode(&self) -> Option<TensorMap> {
        let data_type = match self.dtype {
            DType::BF16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            DType::F16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
            _ => return None,
        };
        let strides_fit = self
            .strides
            .iter()
            .all(|&s| s.is_multiple_of(16) && s < (1u64 << 40));
        let dims_fit = self.dims.iter().all(|&d| (1..=1u64 << 32).contains(&d));
        if !self.base.is_multiple_of(16) || !strides_fit || !dims_fit || self.box_dims[0] != 64 {
            return None;
        }
        let mut map = sys::CUtensorMap { opaque: [0; 16] };
        let element_strides = [1u32; 4];
        // SAFETY: every pointer is to a live local array of the length the rank (4) asks for;
        // the driver only writes `map`.
        let result = unsafe {
            sys::cuTensorMapEncodeTiled(
                &mut map,
                data_type,
                4,
                self.base as *mut std::ffi::c_void,
                self.dims.as_ptr(),
                self.strides.as_ptr(),
                self.box_dims.as_ptr(),
                element_strides.as_ptr(),
                sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
                sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        };
        (result == sys::CUresult::CUDA_SUCCESS).then_some(TensorMap { opaque: map.opaque })
    }
}
