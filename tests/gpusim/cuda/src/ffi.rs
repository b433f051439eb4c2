//! The one place where C pointers and Rust meet: typed wrappers for the raw pointers the
//! driver API passes (each with the NULL check the real driver makes), opaque handles, the
//! panic guard, and the `repr(C)` structs of `cuda.h` (sizes checked in tests against the
//! official header).
//!
//! The wrappers' accessors are safe functions over raw pointers. That rests on the C API
//! contract: a non-NULL pointer the application passes to the driver points to a valid
//! object of the documented type for the duration of the call. A wrapper can only be made
//! by the C caller (the fields are private), so no Rust code can forge one.

use std::ffi::{c_char, c_void, CStr};
use std::panic::AssertUnwindSafe;

use crate::errors::*;

pub type R = Result<(), CUresult>;

/// Run an export's body: `Ok` is `CUDA_SUCCESS`, `Err(code)` is the code, and a panic (a bug
/// in gpusim) becomes `CUDA_ERROR_UNKNOWN` instead of unwinding into C.
pub fn guard(f: impl FnOnce() -> R) -> CUresult {
    match std::panic::catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => CUDA_SUCCESS,
        Ok(Err(e)) => e,
        Err(_) => CUDA_ERROR_UNKNOWN,
    }
}

/// An out-parameter `T*`.
#[repr(transparent)]
pub struct Out<T>(*mut T);

impl<T> Out<T> {
    /// A NULL out-pointer, for optional parameters an internal caller does not want.
    pub fn null() -> Out<T> {
        Out(std::ptr::null_mut())
    }

    /// Store `v`; a NULL pointer is `CUDA_ERROR_INVALID_VALUE`, as the driver reports.
    pub fn write(&self, v: T) -> R {
        if self.0.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: non-NULL, and by the API contract points to writable storage for a T.
        unsafe { self.0.write(v) };
        Ok(())
    }

    /// Store `v` if the pointer is not NULL (optional out-parameters).
    pub fn write_opt(&self, v: T) {
        let _ = self.write(v);
    }

    pub fn is_null(&self) -> bool {
        self.0.is_null()
    }

    /// The caller's object, to read and update in place (in/out parameters). The object is
    /// the C caller's, lent for the call, not borrowed from `self`.
    #[allow(clippy::mut_from_ref)]
    pub fn get_mut(&self) -> Result<&mut T, CUresult> {
        if self.0.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: non-NULL, and by the API contract a valid, exclusively-lent T.
        Ok(unsafe { &mut *self.0 })
    }
}

/// An input `const T*`.
#[repr(transparent)]
pub struct In<T>(*const T);

impl<T> In<T> {
    /// A pointer the application passed inside another argument (a struct field), under the
    /// same contract as a direct argument.
    pub fn from_raw(p: *const T) -> In<T> {
        In(p)
    }

    pub fn get(&self) -> Result<&T, CUresult> {
        self.opt().ok_or(CUDA_ERROR_INVALID_VALUE)
    }

    pub fn opt(&self) -> Option<&T> {
        // SAFETY: by the API contract a non-NULL pointer points to a valid T for the call.
        (!self.0.is_null()).then(|| unsafe { &*self.0 })
    }

    /// `n` consecutive Ts (an array argument); NULL is allowed only when `n` is 0.
    pub fn slice(&self, n: usize) -> Result<&[T], CUresult> {
        if n == 0 {
            return Ok(&[]);
        }
        if self.0.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the API contract makes the pointer an array of at least n Ts.
        Ok(unsafe { std::slice::from_raw_parts(self.0, n) })
    }
}

/// A NUL-terminated input string.
#[repr(transparent)]
pub struct CStrIn(*const c_char);

impl CStrIn {
    pub fn get(&self) -> Result<&str, CUresult> {
        if self.0.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: by the API contract a NUL-terminated string.
        let s = unsafe { CStr::from_ptr(self.0) };
        s.to_str().map_err(|_| CUDA_ERROR_INVALID_VALUE)
    }
}

/// A caller-provided character buffer (`char *name, int len` in cuDeviceGetName and
/// friends).
#[repr(transparent)]
pub struct OutStr(*mut c_char);

impl OutStr {
    /// Copy `s` into the `len`-byte buffer, truncated and NUL-terminated.
    pub fn write(&self, len: i32, s: &str) -> R {
        if self.0.is_null() || len <= 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let n = s.len().min(len as usize - 1);
        // SAFETY: the caller gave `len` writable bytes; we write n + 1 ≤ len of them.
        unsafe {
            std::ptr::copy_nonoverlapping(s.as_ptr(), self.0.cast::<u8>(), n);
            *self.0.add(n) = 0;
        }
        Ok(())
    }
}

/// An opaque handle (`CUcontext`, `CUstream`, …): our id, as a pointer.
#[repr(transparent)]
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Handle(*mut c_void);

impl Handle {
    pub const NULL: Handle = Handle(std::ptr::null_mut());

    pub fn from_id(id: u64) -> Handle {
        Handle(id as usize as *mut c_void)
    }

    pub fn id(self) -> u64 {
        self.0 as usize as u64
    }

    pub fn is_null(self) -> bool {
        self.0.is_null()
    }
}

pub type CUdevice = i32;
/// `CU_DEVICE_CPU`: the host, where a device ordinal may name it.
pub const CU_DEVICE_CPU: CUdevice = -1;
pub type CUdeviceptr = u64;
pub type CUdeviceptrV1 = u32;
pub type CUcontext = Handle;
pub type CUmodule = Handle;
pub type CUfunction = Handle;
pub type CUkernel = Handle;
pub type CUlibrary = Handle;
pub type CUstream = Handle;
pub type CUevent = Handle;
pub type CUarray = Handle;
pub type CUmipmappedArray = Handle;
pub type CUmemoryPool = Handle;
pub type CUgraph = Handle;
pub type CUgraphNode = Handle;
pub type CUgraphExec = Handle;
pub type CUmemGenericAllocationHandle = u64;

/// `CU_STREAM_LEGACY` and `CU_STREAM_PER_THREAD`.
pub const STREAM_LEGACY: u64 = 0x1;
pub const STREAM_PER_THREAD: u64 = 0x2;

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct CUuuid {
    pub bytes: [u8; 16],
}

#[repr(C)]
pub struct CUdevprop {
    pub max_threads_per_block: i32,
    pub max_threads_dim: [i32; 3],
    pub max_grid_size: [i32; 3],
    pub shared_mem_per_block: i32,
    pub total_constant_memory: i32,
    pub simd_width: i32,
    pub mem_pitch: i32,
    pub regs_per_block: i32,
    pub clock_rate: i32,
    pub texture_align: i32,
}

#[repr(C)]
pub struct CUlaunchAttribute {
    pub id: u32,
    pub pad: [u8; 4],
    pub value: [u8; 64],
}

#[repr(C)]
pub struct CUlaunchConfig {
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_mem_bytes: u32,
    pub stream: CUstream,
    pub attrs: *const CUlaunchAttribute,
    pub num_attrs: u32,
}

pub const CU_LAUNCH_ATTRIBUTE_COOPERATIVE: u32 = 2;

#[repr(C)]
pub struct CudaLaunchParams {
    pub function: CUfunction,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_mem_bytes: u32,
    pub stream: CUstream,
    pub kernel_params: *mut *mut c_void,
}

#[repr(C)]
pub struct CudaMemcpy2D {
    pub src_x_in_bytes: usize,
    pub src_y: usize,
    pub src_memory_type: u32,
    pub src_host: *const c_void,
    pub src_device: CUdeviceptr,
    pub src_array: CUarray,
    pub src_pitch: usize,
    pub dst_x_in_bytes: usize,
    pub dst_y: usize,
    pub dst_memory_type: u32,
    pub dst_host: *mut c_void,
    pub dst_device: CUdeviceptr,
    pub dst_array: CUarray,
    pub dst_pitch: usize,
    pub width_in_bytes: usize,
    pub height: usize,
}

#[repr(C)]
pub struct CudaMemcpy3D {
    pub src_x_in_bytes: usize,
    pub src_y: usize,
    pub src_z: usize,
    pub src_lod: usize,
    pub src_memory_type: u32,
    pub src_host: *const c_void,
    pub src_device: CUdeviceptr,
    pub src_array: CUarray,
    pub reserved0: *mut c_void,
    pub src_pitch: usize,
    pub src_height: usize,
    pub dst_x_in_bytes: usize,
    pub dst_y: usize,
    pub dst_z: usize,
    pub dst_lod: usize,
    pub dst_memory_type: u32,
    pub dst_host: *mut c_void,
    pub dst_device: CUdeviceptr,
    pub dst_array: CUarray,
    pub reserved1: *mut c_void,
    pub dst_pitch: usize,
    pub dst_height: usize,
    pub width_in_bytes: usize,
    pub height: usize,
    pub depth: usize,
}

pub const CU_MEMORYTYPE_HOST: u32 = 1;
pub const CU_MEMORYTYPE_DEVICE: u32 = 2;
pub const CU_MEMORYTYPE_ARRAY: u32 = 3;
pub const CU_MEMORYTYPE_UNIFIED: u32 = 4;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct CudaArrayDescriptor {
    pub width: usize,
    pub height: usize,
    pub format: u32,
    pub num_channels: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct CudaArrayDescriptorV1 {
    pub width: u32,
    pub height: u32,
    pub format: u32,
    pub num_channels: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct CudaArray3DDescriptor {
    pub width: usize,
    pub height: usize,
    pub depth: usize,
    pub format: u32,
    pub num_channels: u32,
    pub flags: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct CudaArray3DDescriptorV1 {
    pub width: u32,
    pub height: u32,
    pub depth: u32,
    pub format: u32,
    pub num_channels: u32,
    pub flags: u32,
}

#[repr(C)]
pub struct CudaArrayMemoryRequirements {
    pub size: usize,
    pub alignment: usize,
    pub reserved: [u32; 4],
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUmemLocation {
    pub kind: u32,
    pub id: i32,
}

pub const CU_MEM_LOCATION_TYPE_NONE: u32 = 0;
pub const CU_MEM_LOCATION_TYPE_DEVICE: u32 = 1;
pub const CU_MEM_LOCATION_TYPE_HOST: u32 = 2;
pub const CU_MEM_LOCATION_TYPE_HOST_NUMA: u32 = 3;
/// CUDA 13: part of a device's memory; `id` is then `{ u8 deviceId; u8 localityDomainId; }`.
pub const CU_MEM_LOCATION_TYPE_DEVICE_LOCALITY_DOMAIN: u32 = 6;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUmemAllocationProp {
    pub kind: u32,
    pub requested_handle_types: u32,
    pub location: CUmemLocation,
    pub win32_handle_meta_data: *mut c_void,
    pub alloc_flags: [u8; 8],
}

// SAFETY: the only pointer field is an opaque Windows handle value gpusim never
// dereferences; the struct is otherwise plain data, so moving it across threads is sound.
unsafe impl Send for CUmemAllocationProp {}
// SAFETY: as above; shared references only read plain data.
unsafe impl Sync for CUmemAllocationProp {}

pub const CU_MEM_ALLOCATION_TYPE_PINNED: u32 = 1;
pub const CU_MEM_ALLOCATION_TYPE_MANAGED: u32 = 2;

#[repr(C)]
pub struct CUmemAccessDesc {
    pub location: CUmemLocation,
    pub flags: u32,
}

#[repr(C)]
pub struct CUmemPoolProps {
    pub alloc_type: u32,
    pub handle_types: u32,
    pub location: CUmemLocation,
    pub win32_security_attributes: *mut c_void,
    pub max_size: usize,
    pub usage: u16,
    pub reserved: [u8; 54],
}

#[repr(C)]
pub struct CudaKernelNodeParams {
    pub func: CUfunction,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_mem_bytes: u32,
    pub kernel_params: *mut *mut c_void,
    pub extra: *mut *mut c_void,
    pub kern: CUkernel,
    pub ctx: CUcontext,
}

#[repr(C)]
pub struct CudaKernelNodeParamsV1 {
    pub func: CUfunction,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_mem_bytes: u32,
    pub kernel_params: *mut *mut c_void,
    pub extra: *mut *mut c_void,
}

#[repr(C)]
pub struct CudaMemAllocNodeParams {
    pub pool_props: CUmemPoolProps,
    pub access_descs: *const CUmemAccessDesc,
    pub access_desc_count: usize,
    pub bytesize: usize,
    pub dptr: CUdeviceptr,
}

/// `CUgraphNodeParams`: a 4-byte type, padding, a 232-byte union, and a trailing field.
#[repr(C)]
pub struct CUgraphNodeParams {
    pub kind: u32,
    pub reserved0: [i32; 3],
    pub union: [u64; 29],
    pub reserved2: i64,
}

pub const CU_GRAPH_NODE_TYPE_KERNEL: u32 = 0;
pub const CU_GRAPH_NODE_TYPE_EMPTY: u32 = 5;
pub const CU_GRAPH_NODE_TYPE_MEM_ALLOC: u32 = 10;
pub const CU_GRAPH_NODE_TYPE_MEM_FREE: u32 = 11;

#[repr(C)]
pub struct CudaGraphInstantiateParams {
    pub flags: u64,
    pub upload_stream: CUstream,
    pub error_node_out: CUgraphNode,
    pub result_out: u32,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    /// Sizes and offsets printed by a C program compiled against cuda.h 12.9 (x86_64).
    #[test]
    fn layouts_match_cuda_h() {
        assert_eq!(size_of::<CUuuid>(), 16);
        assert_eq!(size_of::<CUdevprop>(), 56);
        assert_eq!(size_of::<CUlaunchConfig>(), 56);
        assert_eq!(offset_of!(CUlaunchConfig, stream), 32);
        assert_eq!(offset_of!(CUlaunchConfig, attrs), 40);
        assert_eq!(offset_of!(CUlaunchConfig, num_attrs), 48);
        assert_eq!(size_of::<CUlaunchAttribute>(), 72);
        assert_eq!(offset_of!(CUlaunchAttribute, value), 8);
        assert_eq!(size_of::<CudaLaunchParams>(), 56);
        assert_eq!(offset_of!(CudaLaunchParams, stream), 40);
        assert_eq!(offset_of!(CudaLaunchParams, kernel_params), 48);
        assert_eq!(size_of::<CudaMemcpy2D>(), 128);
        assert_eq!(offset_of!(CudaMemcpy2D, src_memory_type), 16);
        assert_eq!(offset_of!(CudaMemcpy2D, src_pitch), 48);
        assert_eq!(offset_of!(CudaMemcpy2D, dst_memory_type), 72);
        assert_eq!(offset_of!(CudaMemcpy2D, dst_pitch), 104);
        assert_eq!(offset_of!(CudaMemcpy2D, height), 120);
        assert_eq!(size_of::<CudaMemcpy3D>(), 200);
        assert_eq!(offset_of!(CudaMemcpy3D, src_memory_type), 32);
        assert_eq!(offset_of!(CudaMemcpy3D, src_pitch), 72);
        assert_eq!(offset_of!(CudaMemcpy3D, dst_memory_type), 120);
        assert_eq!(offset_of!(CudaMemcpy3D, dst_height), 168);
        assert_eq!(offset_of!(CudaMemcpy3D, depth), 192);
        assert_eq!(size_of::<CudaArrayDescriptor>(), 24);
        assert_eq!(offset_of!(CudaArrayDescriptor, format), 16);
        assert_eq!(size_of::<CudaArray3DDescriptor>(), 40);
        assert_eq!(offset_of!(CudaArray3DDescriptor, flags), 32);
        assert_eq!(size_of::<CudaArrayMemoryRequirements>(), 32);
        assert_eq!(size_of::<CUmemAllocationProp>(), 32);
        assert_eq!(offset_of!(CUmemAllocationProp, location), 8);
        assert_eq!(offset_of!(CUmemAllocationProp, alloc_flags), 24);
        assert_eq!(size_of::<CUmemLocation>(), 8);
        assert_eq!(size_of::<CUmemAccessDesc>(), 12);
        assert_eq!(size_of::<CUmemPoolProps>(), 88);
        assert_eq!(offset_of!(CUmemPoolProps, max_size), 24);
        assert_eq!(offset_of!(CUmemPoolProps, usage), 32);
        assert_eq!(size_of::<CudaKernelNodeParams>(), 72);
        assert_eq!(offset_of!(CudaKernelNodeParams, kern), 56);
        assert_eq!(size_of::<CudaKernelNodeParamsV1>(), 56);
        assert_eq!(size_of::<CudaMemAllocNodeParams>(), 120);
        assert_eq!(offset_of!(CudaMemAllocNodeParams, access_descs), 88);
        assert_eq!(offset_of!(CudaMemAllocNodeParams, dptr), 112);
        assert_eq!(size_of::<CUgraphNodeParams>(), 256);
        assert_eq!(offset_of!(CUgraphNodeParams, union), 16);
        assert_eq!(offset_of!(CUgraphNodeParams, reserved2), 248);
        assert_eq!(size_of::<CudaGraphInstantiateParams>(), 32);
    }
}
