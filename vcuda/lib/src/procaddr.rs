//! `cuGetProcAddress` and `cuGetProcAddress_v2`. The real driver picks the variant for the
//! caller's name, CUDA version and flags; we then hand back our wrapper of exactly that
//! variant (recognised by the real function's address), or the real pointer when we do not
//! wrap it. The status out-parameter is the driver's, untouched.

use std::ffi::{c_char, c_int, c_void};

use crate::ffi::*;
use crate::state::cuda;

hooks! {
    Cuda fn cuGetProcAddress(symbol: *const c_char, pfn: *mut *mut c_void, version: c_int, flags: u64) -> CUresult => get_proc_v1;
    Cuda fn cuGetProcAddress_v2(symbol: *const c_char, pfn: *mut *mut c_void, version: c_int, flags: u64, status: *mut u32) -> CUresult => get_proc_v2;
}

const MISSING: CUresult = CUDA_ERROR_NOT_SUPPORTED;

/// Replace the real pointer the driver returned with our wrapper of the same function.
fn substitute(rc: CUresult, pfn: *mut *mut c_void) -> CUresult {
    if rc == CUDA_SUCCESS && !pfn.is_null() {
        // SAFETY: the driver wrote *pfn (possibly NULL for an unknown symbol).
        let p = unsafe { *pfn };
        if let Some(w) = crate::hook::wrapper_for_real(p as usize) {
            // SAFETY: as above; we replace it with the address of our wrapper of that function.
            unsafe { *pfn = w as *mut c_void };
        }
    }
    rc
}

unsafe fn get_proc_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
    status: *mut u32,
) -> CUresult {
    if let Err(e) = cuda() {
        return e;
    }
    substitute(
        forward!(
            MISSING,
            cuGetProcAddress_v2(symbol, pfn, version, flags, status)
        ),
        pfn,
    )
}

unsafe fn get_proc_v1(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
) -> CUresult {
    if let Err(e) = cuda() {
        return e;
    }
    substitute(
        forward!(MISSING, cuGetProcAddress(symbol, pfn, version, flags)),
        pfn,
    )
}
