//! Real CUDA and NVML functions libvcuda calls for its own bookkeeping, without wrapping
//! them (the application reaches them directly).

use std::ffi::{c_int, c_uint, c_void};

use crate::ffi::*;

externs! {
    Cuda fn cuCtxGetDevice(*mut CUdevice) -> CUresult;
    Cuda fn cuCtxGetCurrent(*mut CUcontext) -> CUresult;
    Cuda fn cuDeviceGetCount(*mut c_int) -> CUresult;
    Cuda fn cuDeviceGetUuid_v2(*mut CUuuid, CUdevice) -> CUresult;
    Cuda fn cuDeviceGetUuid(*mut CUuuid, CUdevice) -> CUresult;
    Cuda fn cuDeviceGetMemPool(*mut CUmemoryPool, CUdevice) -> CUresult;
    Cuda fn cuMemPoolGetAttribute(CUmemoryPool, u32, *mut c_void) -> CUresult;
    Cuda fn cuStreamIsCapturing(CUstream, *mut u32) -> CUresult;
    Cuda fn cuDeviceGetGraphMemAttribute(CUdevice, u32, *mut c_void) -> CUresult;
    Cuda fn cuPointerGetAttribute(*mut c_void, u32, CUdeviceptr) -> CUresult;
    Cuda fn cuArrayGetMemoryRequirements(*mut CUDA_ARRAY_MEMORY_REQUIREMENTS, CUarray, CUdevice) -> CUresult;
    Cuda fn cuMipmappedArrayGetMemoryRequirements(*mut CUDA_ARRAY_MEMORY_REQUIREMENTS, CUmipmappedArray, CUdevice) -> CUresult;
    Cuda fn cuArrayGetDescriptor_v2(*mut CUDA_ARRAY_DESCRIPTOR, CUarray) -> CUresult;
    Cuda fn cuDevicePrimaryCtxGetState(CUdevice, *mut c_uint, *mut c_int) -> CUresult;
    Cuda fn cuCtxGetLimit(*mut usize, u32) -> CUresult;
    Cuda fn cuMemGetInfo_v2(*mut usize, *mut usize) -> CUresult;
    Cuda fn cuEventCreate(*mut CUevent, c_uint) -> CUresult;
    Cuda fn cuEventRecord(CUevent, CUstream) -> CUresult;
    Cuda fn cuEventQuery(CUevent) -> CUresult;
    Cuda fn cuEventElapsedTime(*mut f32, CUevent, CUevent) -> CUresult;
    Cuda fn cuEventDestroy_v2(CUevent) -> CUresult;
    Cuda fn cuStreamGetDevice(CUstream, *mut CUdevice) -> CUresult;
    Nvml fn nvmlInit_v2() -> nvmlReturn_t;
    Nvml fn nvmlDeviceGetSamples(nvmlDevice_t, u32, u64, *mut u32, *mut c_uint, *mut nvmlSample_t) -> nvmlReturn_t;
    Nvml fn nvmlDeviceGetProcessUtilization(nvmlDevice_t, *mut nvmlProcessUtilizationSample_t, *mut c_uint, u64) -> nvmlReturn_t;
    Nvml fn nvmlDeviceGetHandleByUUID(*const std::ffi::c_char, *mut nvmlDevice_t) -> nvmlReturn_t;
    Nvml fn nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t, *mut c_uint, *mut nvmlProcessInfo_t) -> nvmlReturn_t;
    Nvml fn nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t, *mut c_uint, *mut nvmlProcessInfo_t) -> nvmlReturn_t;
    Nvml fn nvmlDeviceGetMemoryInfo(nvmlDevice_t, *mut nvmlMemory_t) -> nvmlReturn_t;
}

/// The CUDA ordinal of the current context's device.
pub fn ctx_ordinal() -> Option<CUdevice> {
    let mut d: CUdevice = -1;
    (ext!(CUDA_ERROR_NOT_SUPPORTED, cuCtxGetDevice(&mut d)) == CUDA_SUCCESS).then_some(d)
}

/// A memory pool's attribute `attr` (a `u64` one), as the driver reports it.
pub(crate) fn pool_attr(pool: CUmemoryPool, attr: u32) -> Option<u64> {
    let mut val: u64 = 0;
    (ext!(
        CUDA_ERROR_NOT_SUPPORTED,
        cuMemPoolGetAttribute(pool, attr, (&mut val as *mut u64).cast())
    ) == CUDA_SUCCESS)
        .then_some(val)
}

/// What the pool has reserved from the device, as the driver reports it.
pub(crate) fn pool_reserved(pool: CUmemoryPool) -> Option<u64> {
    pool_attr(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)
}
