//! NVML as the container sees it: only its GPUs, their memory the size of the quota, only its
//! processes. (The virtualizing hooks are added here; this file also gives the rest of the
//! library the real NVML handles of the container's GPUs.)

use std::ffi::c_char;

use crate::ffi::*;
use crate::init::Vcuda;

hooks! {}

/// The real NVML handle of config GPU `dev`, initialising NVML for libvcuda's own use on
/// first call.
pub fn real_handle(v: &Vcuda, dev: usize) -> Option<usize> {
    let handles = v.nvml_handles.get_or_init(|| {
        if v.nvml == 0 || ext!(NVML_ERROR_FUNCTION_NOT_FOUND, nvmlInit_v2()) != NVML_SUCCESS {
            return Vec::new();
        }
        v.cfg
            .gpu
            .iter()
            .map(|g| {
                let name = std::ffi::CString::new(g.uuid.as_str()).unwrap_or_default();
                let mut h: nvmlDevice_t = std::ptr::null_mut();
                let rc = ext!(
                    NVML_ERROR_FUNCTION_NOT_FOUND,
                    nvmlDeviceGetHandleByUUID(name.as_ptr() as *const c_char, &mut h)
                );
                if rc == NVML_SUCCESS {
                    h as usize
                } else {
                    0
                }
            })
            .collect()
    });
    handles.get(dev).copied().filter(|&h| h != 0)
}
