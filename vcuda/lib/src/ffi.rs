//! The CUDA driver and NVML types libvcuda's wrappers use, as `cuda.h` (12.9 / 13.x) and
//! `nvml.h` declare them (sizes pinned by tests), and the panic guard every export runs
//! under.

#![allow(non_camel_case_types, dead_code)]

use std::ffi::c_void;
use std::panic::AssertUnwindSafe;

pub type CUresult = u32;
pub type nvmlReturn_t = u32;
pub type CUdevice = i32;
pub type CUdeviceptr = u64;
pub type CUdeviceptr_v1 = u32;
pub type CUcontext = *mut c_void;
pub type CUmodule = *mut c_void;
pub type CUlibrary = *mut c_void;
pub type CUstream = *mut c_void;
pub type CUevent = *mut c_void;
pub type CUarray = *mut c_void;
pub type CUmipmappedArray = *mut c_void;
pub type CUmemoryPool = *mut c_void;
pub type CUgraph = *mut c_void;
pub type CUgraphNode = *mut c_void;
pub type CUgraphExec = *mut c_void;
pub type CUfunction = *mut c_void;
pub type CUmemGenericAllocationHandle = u64;
pub type nvmlDevice_t = *mut c_void;

pub const CUDA_SUCCESS: CUresult = 0;
pub const CUDA_ERROR_INVALID_VALUE: CUresult = 1;
pub const CUDA_ERROR_OUT_OF_MEMORY: CUresult = 2;
pub const CUDA_ERROR_NOT_INITIALIZED: CUresult = 3;
pub const CUDA_ERROR_NO_DEVICE: CUresult = 100;
pub const CUDA_ERROR_INVALID_CONTEXT: CUresult = 201;
pub const CUDA_ERROR_NOT_FOUND: CUresult = 500;
pub const CUDA_ERROR_NOT_PERMITTED: CUresult = 800;
pub const CUDA_ERROR_NOT_SUPPORTED: CUresult = 801;
pub const CUDA_ERROR_UNKNOWN: CUresult = 999;

pub const NVML_SUCCESS: nvmlReturn_t = 0;
pub const NVML_ERROR_UNINITIALIZED: nvmlReturn_t = 1;
pub const NVML_ERROR_INVALID_ARGUMENT: nvmlReturn_t = 2;
pub const NVML_ERROR_NOT_SUPPORTED: nvmlReturn_t = 3;
pub const NVML_ERROR_NO_PERMISSION: nvmlReturn_t = 4;
pub const NVML_ERROR_NOT_FOUND: nvmlReturn_t = 6;
pub const NVML_ERROR_INSUFFICIENT_SIZE: nvmlReturn_t = 7;
pub const NVML_ERROR_ARGUMENT_VERSION_MISMATCH: nvmlReturn_t = 25;
/// `nvmlProcessesUtilizationInfo_v1`: NVML_STRUCT_VERSION(ProcessesUtilizationInfo, 1), the
/// struct's size (24 bytes, pinned by a test) with the version in the top byte.
pub const NVML_PROCESSES_UTILIZATION_INFO_V1: u32 = 24 | (1 << 24);
pub const CUDA_ERROR_NOT_READY: CUresult = 600;
pub const NVML_ERROR_FUNCTION_NOT_FOUND: nvmlReturn_t = 13;
pub const NVML_ERROR_UNKNOWN: nvmlReturn_t = 999;

/// A panic in a wrapper (a bug in libvcuda) must not unwind into C: both APIs' "unknown
/// error" is 999, which is what the caller gets instead.
pub const PANIC_RESULT: u32 = 999;

/// Run a wrapper body; a panic becomes [`PANIC_RESULT`].
#[inline(always)]
pub fn catch(f: impl FnOnce() -> u32) -> u32 {
    catch_or(PANIC_RESULT, f)
}

/// Run a body whose API has its own error value for "something went wrong" (libvcuda's C
/// API: -1); a panic becomes `on_panic`.
#[inline(always)]
pub fn catch_or<T>(on_panic: T, f: impl FnOnce() -> T) -> T {
    match std::panic::catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(_) => on_panic,
    }
}

pub const CU_MEM_LOCATION_TYPE_DEVICE: u32 = 1;
pub const CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT: u32 = 5;
pub const CU_MEMPOOL_ATTR_USED_MEM_CURRENT: u32 = 7;
pub const CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT: u32 = 2;
pub const CU_POINTER_ATTRIBUTE_RANGE_SIZE: u32 = 12;

/// `CU_STREAM_PER_THREAD`: the per-thread default stream, as a handle.
pub const CU_STREAM_PER_THREAD: CUstream = 0x2 as CUstream;
pub const CU_EVENT_DEFAULT: u32 = 0;

/// `CUlaunchConfig` (cuLaunchKernelEx); libvcuda reads only the stream.
#[repr(C)]
pub struct CUlaunchConfig {
    pub gridDimX: u32,
    pub gridDimY: u32,
    pub gridDimZ: u32,
    pub blockDimX: u32,
    pub blockDimY: u32,
    pub blockDimZ: u32,
    pub sharedMemBytes: u32,
    pub hStream: CUstream,
    pub attrs: *mut c_void,
    pub numAttrs: u32,
}

/// `CUDA_LAUNCH_PARAMS` (cuLaunchCooperativeKernelMultiDevice); libvcuda reads the stream.
#[repr(C)]
pub struct CUDA_LAUNCH_PARAMS {
    pub function: CUfunction,
    pub gridDimX: u32,
    pub gridDimY: u32,
    pub gridDimZ: u32,
    pub blockDimX: u32,
    pub blockDimY: u32,
    pub blockDimZ: u32,
    pub sharedMemBytes: u32,
    pub hStream: CUstream,
    pub kernelParams: *mut *mut c_void,
}

/// One NVML sample of a device-wide value (`nvmlDeviceGetSamples`); `sampleValue` is the
/// 8-byte `nvmlValue_t` union, read here only as an unsigned integer.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct nvmlSample_t {
    pub timeStamp: u64,
    pub sampleValue: u64,
}

/// `nvmlSamplingType_t`: the GPU's utilization samples.
pub const NVML_GPU_UTILIZATION_SAMPLES: u32 = 1;

/// One NVML per-process utilization sample.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct nvmlProcessUtilizationSample_t {
    pub pid: u32,
    pub timeStamp: u64,
    pub smUtil: u32,
    pub memUtil: u32,
    pub encUtil: u32,
    pub decUtil: u32,
}

/// `nvmlProcessUtilizationInfo_v1_t`: one process's utilization sample, versioned form.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct nvmlProcessUtilizationInfo_v1_t {
    pub timeStamp: u64,
    pub pid: u32,
    pub smUtil: u32,
    pub memUtil: u32,
    pub encUtil: u32,
    pub decUtil: u32,
    pub jpgUtil: u32,
    pub ofaUtil: u32,
}

/// `nvmlProcessesUtilizationInfo_t` (v1): the caller's array and the protocol's counts.
#[repr(C)]
pub struct nvmlProcessesUtilizationInfo_v1_t {
    pub version: u32,
    pub processSamplesCount: u32,
    pub lastSeenTimeStamp: u64,
    pub procUtilArray: *mut nvmlProcessUtilizationInfo_v1_t,
}
pub type nvmlProcessesUtilizationInfo_t = nvmlProcessesUtilizationInfo_v1_t;

/// `nvmlAccountingStats_t`: passed through untouched, never read here.
pub type nvmlAccountingStats_t = c_void;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUuuid {
    pub bytes: [u8; 16],
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUmemLocation {
    pub kind: u32,
    pub id: i32,
}

#[repr(C)]
pub struct CUmemAllocationProp {
    pub kind: u32,
    pub requested_handle_types: u32,
    pub location: CUmemLocation,
    pub win32_handle_meta_data: *mut c_void,
    pub alloc_flags: [u8; 8],
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
pub struct CUDA_ARRAY_DESCRIPTOR {
    pub width: usize,
    pub height: usize,
    pub format: u32,
    pub num_channels: u32,
}

#[repr(C)]
pub struct CUDA_ARRAY_DESCRIPTOR_v1 {
    pub width: u32,
    pub height: u32,
    pub format: u32,
    pub num_channels: u32,
}

#[repr(C)]
pub struct CUDA_ARRAY3D_DESCRIPTOR {
    pub width: usize,
    pub height: usize,
    pub depth: usize,
    pub format: u32,
    pub num_channels: u32,
    pub flags: u32,
}

#[repr(C)]
pub struct CUDA_ARRAY3D_DESCRIPTOR_v1 {
    pub width: u32,
    pub height: u32,
    pub depth: u32,
    pub format: u32,
    pub num_channels: u32,
    pub flags: u32,
}

#[repr(C)]
#[derive(Default)]
pub struct CUDA_ARRAY_MEMORY_REQUIREMENTS {
    pub size: usize,
    pub alignment: usize,
    pub reserved: [u32; 4],
}

#[repr(C)]
pub struct CUDA_MEM_ALLOC_NODE_PARAMS {
    pub pool_props: CUmemPoolProps,
    pub access_descs: *const c_void,
    pub access_desc_count: usize,
    pub bytesize: usize,
    pub dptr: CUdeviceptr,
}

/// `CUgraphNodeParams`: the node type, then a 232-byte union at offset 16.
#[repr(C)]
pub struct CUgraphNodeParams {
    pub kind: u32,
    pub reserved0: [i32; 3],
    pub union: [u64; 29],
    pub reserved2: i64,
}

pub const CU_GRAPH_NODE_TYPE_MEM_ALLOC: u32 = 10;

/// `CUexecAffinityParam` (only passed through).
#[repr(C)]
pub struct CUexecAffinityParam {
    pub kind: u32,
    pub value: u32,
}

/// `CUctxCreateParams` (only passed through).
#[repr(C)]
pub struct CUctxCreateParams {
    pub exec_affinity_params: *mut CUexecAffinityParam,
    pub num_exec_affinity_params: i32,
    pub cig_params: *mut c_void,
}

/// `CUgraphEdgeData` (only passed through).
#[repr(C)]
pub struct CUgraphEdgeData {
    pub from_port: u8,
    pub to_port: u8,
    pub kind: u8,
    pub reserved: [u8; 5],
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct nvmlMemory_t {
    pub total: u64,
    pub free: u64,
    pub used: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct nvmlMemory_v2_t {
    pub version: u32,
    pub total: u64,
    pub reserved: u64,
    pub free: u64,
    pub used: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct nvmlProcessInfo_v1_t {
    pub pid: u32,
    pub used_gpu_memory: u64,
}

/// `nvmlProcessInfo_v2_t` and `nvmlProcessInfo_t` (v3) share this layout.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct nvmlProcessInfo_t {
    pub pid: u32,
    pub used_gpu_memory: u64,
    pub gpu_instance_id: u32,
    pub compute_instance_id: u32,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    /// Sizes from a C program compiled against cuda.h 12.9 and nvml.h (x86_64).
    #[test]
    fn layouts_match_the_headers() {
        assert_eq!(size_of::<CUuuid>(), 16);
        assert_eq!(size_of::<CUmemAllocationProp>(), 32);
        assert_eq!(offset_of!(CUmemAllocationProp, location), 8);
        assert_eq!(size_of::<CUmemPoolProps>(), 88);
        assert_eq!(size_of::<CUDA_ARRAY_DESCRIPTOR>(), 24);
        assert_eq!(size_of::<CUDA_ARRAY3D_DESCRIPTOR>(), 40);
        assert_eq!(size_of::<CUDA_ARRAY_MEMORY_REQUIREMENTS>(), 32);
        assert_eq!(size_of::<CUDA_MEM_ALLOC_NODE_PARAMS>(), 120);
        assert_eq!(offset_of!(CUDA_MEM_ALLOC_NODE_PARAMS, dptr), 112);
        assert_eq!(size_of::<CUgraphNodeParams>(), 256);
        assert_eq!(size_of::<CUexecAffinityParam>(), 8);
        assert_eq!(size_of::<CUctxCreateParams>(), 24);
        assert_eq!(size_of::<CUgraphEdgeData>(), 8);
        assert_eq!(size_of::<nvmlMemory_t>(), 24);
        assert_eq!(size_of::<nvmlMemory_v2_t>(), 40);
        assert_eq!(size_of::<nvmlProcessInfo_v1_t>(), 16);
        assert_eq!(size_of::<nvmlProcessInfo_t>(), 24);
        assert_eq!(size_of::<nvmlProcessUtilizationInfo_v1_t>(), 40);
        assert_eq!(size_of::<nvmlProcessesUtilizationInfo_v1_t>(), 24);
        assert_eq!(NVML_PROCESSES_UTILIZATION_INFO_V1, 0x0100_0018);
        assert_eq!(size_of::<CUlaunchConfig>(), 56);
        assert_eq!(offset_of!(CUlaunchConfig, hStream), 32);
        assert_eq!(size_of::<CUDA_LAUNCH_PARAMS>(), 56);
        assert_eq!(offset_of!(CUDA_LAUNCH_PARAMS, hStream), 40);
        assert_eq!(size_of::<nvmlProcessUtilizationSample_t>(), 32);
    }
}
