//! What the container sees of device memory through CUDA: a GPU the size of its quota.
//! `cuMemGetInfo` reports total = min(quota, physical) and free = min(quota − what the
//! container holds, the device's real free memory), never below zero; `cuDeviceTotalMem`
//! reports min(quota, physical). What "holds" includes the memory the driver charges for
//! this process's contexts and modules, also what no hooked call saw (measured by NVML at
//! the first `cuMemGetInfo`), so `cudaMemGetInfo` right after the runtime initialises
//! shows free = quota − the context's cost.

use std::ffi::c_uint;

use crate::conv::{u32_sat, u64_of, usize_of};
use crate::ffi::*;
use crate::state::{cuda, Vcuda};

hooks! {
    Cuda fn cuMemGetInfo(free: *mut c_uint, total: *mut c_uint) -> CUresult => mem_info_v1;
    Cuda fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult => mem_info_v2;
    Cuda fn cuDeviceTotalMem(bytes: *mut c_uint, dev: CUdevice) -> CUresult => total_mem_v1;
    Cuda fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult => total_mem_v2;
}

const MISSING: CUresult = CUDA_ERROR_NOT_SUPPORTED;

/// (free, total) as the container sees them, from the driver's (free, total) on `dev`.
pub fn virtual_info(v: &Vcuda, dev: usize, real_free: u64, real_total: u64) -> (u64, u64) {
    let total = v.quota_of(dev).min(real_total);
    let free = total.saturating_sub(v.used_on(dev)).min(real_free);
    (free, total)
}

unsafe fn mem_info_v2(free: *mut usize, total: *mut usize) -> CUresult {
    let v = match cuda() {
        Ok(v) => v,
        Err(e) => return e,
    };
    let rc = forward!(MISSING, cuMemGetInfo_v2(free, total));
    if rc != CUDA_SUCCESS || free.is_null() || total.is_null() {
        return rc;
    }
    let Some(dev) = v.current_dev() else {
        return rc;
    };
    v.look_at_hidden(dev);
    // SAFETY: the driver just wrote both (non-NULL) outputs.
    let (f, t) = unsafe { virtual_info(v, dev, *free as u64, *total as u64) };
    // SAFETY: as above.
    unsafe {
        *free = usize_of(f);
        *total = usize_of(t);
    }
    rc
}

unsafe fn mem_info_v1(free: *mut c_uint, total: *mut c_uint) -> CUresult {
    let v = match cuda() {
        Ok(v) => v,
        Err(e) => return e,
    };
    let (mut rf, mut rt) = (0usize, 0usize);
    let rc = forward!(MISSING, cuMemGetInfo_v2(&mut rf, &mut rt));
    if rc != CUDA_SUCCESS {
        return forward!(MISSING, cuMemGetInfo(free, total));
    }
    if free.is_null() || total.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let dev = v.current_dev().unwrap_or(0);
    v.look_at_hidden(dev);
    let (f, t) = virtual_info(v, dev, rf as u64, rt as u64);
    // SAFETY: non-NULL outputs the caller passed; the 32-bit API clamps.
    unsafe {
        *free = u32_sat(f);
        *total = u32_sat(t);
    }
    CUDA_SUCCESS
}

unsafe fn total_mem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult {
    let v = match cuda() {
        Ok(v) => v,
        Err(e) => return e,
    };
    let rc = forward!(MISSING, cuDeviceTotalMem_v2(bytes, dev));
    if rc == CUDA_SUCCESS && !bytes.is_null() {
        if let Some(d) = v.dev_of_ordinal(dev) {
            // SAFETY: the driver wrote the (non-NULL) output.
            unsafe { *bytes = usize_of(u64_of(*bytes).min(v.quota_of(d))) };
        }
    }
    rc
}

unsafe fn total_mem_v1(bytes: *mut c_uint, dev: CUdevice) -> CUresult {
    let v = match cuda() {
        Ok(v) => v,
        Err(e) => return e,
    };
    let rc = forward!(MISSING, cuDeviceTotalMem(bytes, dev));
    if rc == CUDA_SUCCESS && !bytes.is_null() {
        if let Some(d) = v.dev_of_ordinal(dev) {
            // SAFETY: the driver wrote the (non-NULL) output.
            unsafe { *bytes = u32_sat(u64::from(*bytes).min(v.quota_of(d))) };
        }
    }
    rc
}
