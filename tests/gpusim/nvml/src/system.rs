//! System queries: driver, NVML and CUDA versions, process names, and `nvmlErrorString`.

use std::ffi::{c_char, c_int, c_uint, CStr};

use crate::ffi::{handle_of, Buf, CharBuf, Out};
use crate::state;
use crate::types::*;

nvml_api! {
    fn nvmlSystemGetDriverVersion(version: CharBuf, length: c_uint) {
        let st = state()?;
        version.write_str(length, &st.config.driver_version)
    }

    /// The NVML API major (the CUDA major of the driver: 12 for a CUDA 12.x driver, 13 from
    /// R580 on) followed by the driver version, e.g. "12.575.57.08", "13.580.65.06".
    fn nvmlSystemGetNVMLVersion(version: CharBuf, length: c_uint) {
        let st = state()?;
        version.write_str(length, &library_version(&st.config))
    }

    fn nvmlSystemGetCudaDriverVersion(cudaDriverVersion: Out<c_int>) {
        cudaDriverVersion.write(state()?.config.cuda_version)
    }

    fn nvmlSystemGetCudaDriverVersion_v2(cudaDriverVersion: Out<c_int>) {
        cudaDriverVersion.write(state()?.config.cuda_version)
    }

    /// The process's argv[0] (its comm for processes without a command line), cropped to
    /// `length` as nvml.h documents; `NVML_ERROR_NOT_FOUND` if no such process.
    fn nvmlSystemGetProcessName(pid: c_uint, name: CharBuf, length: c_uint) {
        state()?;
        if length == 0 {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let n = process_name(pid).ok_or(NVML_ERROR_NOT_FOUND)?;
        name.write_cropped(length, &n)
    }

    /// GPUs with affinity to CPU `cpuNumber`: gpusim does not model CPU locality, so all of
    /// them. `*count == 0` asks for the number.
    fn nvmlSystemGetTopologyGpuSet(_cpuNumber: c_uint, count: Out<c_uint>, deviceArray: Buf<nvmlDevice_t>) {
        let st = state()?;
        let all: Vec<nvmlDevice_t> = (0..st.num_gpus()).map(handle_of).collect();
        fill_handles(&all, count, deviceArray)
    }
}

/// What `nvmlSystemGetNVMLVersion` reports: NVML's API major, which is the CUDA major of the
/// driver (`cuda_version`), then the driver version.
pub fn library_version(config: &gpusim_core::Config) -> String {
    format!("{}.{}", config.cuda_version / 1000, config.driver_version)
}

/// `*count == 0`: report how many; else write up to `*count` handles and the number written.
pub fn fill_handles(
    all: &[nvmlDevice_t],
    count: Out<c_uint>,
    array: Buf<nvmlDevice_t>,
) -> NvmlResult {
    let cap = count.read()? as usize;
    if cap == 0 {
        return count.write(all.len() as c_uint);
    }
    if array.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    let n = all.len().min(cap);
    array.write_all(&all[..n], cap)?;
    count.write(n as c_uint)
}

fn process_name(pid: c_uint) -> Option<String> {
    if pid == 0 {
        return None;
    }
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok();
    let argv0 = cmdline
        .as_deref()
        .and_then(|c| c.split(|&b| b == 0).next())
        .filter(|a| !a.is_empty());
    match argv0 {
        Some(a) => Some(String::from_utf8_lossy(a).into_owned()),
        None => std::fs::read_to_string(format!("/proc/{pid}/comm"))
            .ok()
            .map(|s| s.trim_end().to_owned()),
    }
}

/// nvmlErrorString: a static description of every code nvml.h defines.
#[no_mangle]
pub extern "C" fn nvmlErrorString(result: nvmlReturn_t) -> *const c_char {
    error_string(result).as_ptr()
}

pub fn error_string(result: nvmlReturn_t) -> &'static CStr {
    match result {
        NVML_SUCCESS => c"Success",
        NVML_ERROR_UNINITIALIZED => c"Uninitialized",
        NVML_ERROR_INVALID_ARGUMENT => c"Invalid Argument",
        NVML_ERROR_NOT_SUPPORTED => c"Not Supported",
        NVML_ERROR_NO_PERMISSION => c"Insufficient Permissions",
        NVML_ERROR_ALREADY_INITIALIZED => c"Already Initialized",
        NVML_ERROR_NOT_FOUND => c"Not Found",
        NVML_ERROR_INSUFFICIENT_SIZE => c"Insufficient Size",
        NVML_ERROR_INSUFFICIENT_POWER => c"Insufficient External Power",
        NVML_ERROR_DRIVER_NOT_LOADED => c"Driver Not Loaded",
        NVML_ERROR_TIMEOUT => c"Timeout",
        NVML_ERROR_IRQ_ISSUE => c"Interrupt Request Issue",
        NVML_ERROR_LIBRARY_NOT_FOUND => c"NVML Shared Library Not Found",
        NVML_ERROR_FUNCTION_NOT_FOUND => c"Function Not Found",
        NVML_ERROR_CORRUPTED_INFOROM => c"Corrupted infoROM",
        NVML_ERROR_GPU_IS_LOST => c"GPU is lost",
        NVML_ERROR_RESET_REQUIRED => c"GPU requires restart",
        NVML_ERROR_OPERATING_SYSTEM => c"The operating system has blocked the request.",
        NVML_ERROR_LIB_RM_VERSION_MISMATCH => c"RM has detected an NVML/RM version mismatch.",
        NVML_ERROR_IN_USE => c"In use by another client",
        NVML_ERROR_MEMORY => c"Insufficient Memory",
        NVML_ERROR_NO_DATA => c"No data",
        NVML_ERROR_VGPU_ECC_NOT_SUPPORTED => {
            c"The requested vgpu operation is not available on target device, because ECC is enabled"
        }
        NVML_ERROR_INSUFFICIENT_RESOURCES => c"Ran out of critical resources, other than memory",
        NVML_ERROR_FREQ_NOT_SUPPORTED => c"The requested frequency is not supported",
        NVML_ERROR_ARGUMENT_VERSION_MISMATCH => c"The provided version is invalid/unsupported",
        NVML_ERROR_DEPRECATED => c"The requested functionality has been deprecated",
        NVML_ERROR_NOT_READY => c"The system is not ready for the request",
        NVML_ERROR_GPU_NOT_FOUND => c"No GPUs were found",
        NVML_ERROR_INVALID_STATE => c"Resource is in invalid state",
        NVML_ERROR_UNKNOWN => c"Unknown Error",
        _ => c"Unknown Error",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_has_its_own_string() {
        let codes: Vec<nvmlReturn_t> = (0..=29).chain([999]).collect();
        let mut seen = std::collections::HashSet::new();
        for c in &codes {
            assert!(seen.insert(error_string(*c)), "duplicate string for {c}");
        }
        assert_eq!(error_string(12345), c"Unknown Error");
    }

    #[test]
    fn library_version_follows_the_cuda_major() {
        let c12 = gpusim_core::Config::default_config();
        assert_eq!(library_version(&c12), "12.575.57.08");
        let text = gpusim_core::config::default_config_text(13050).unwrap();
        let c13 = gpusim_core::Config::parse(&text, "x").unwrap();
        assert_eq!(library_version(&c13), "13.580.65.06");
    }

    #[test]
    fn own_process_has_a_name() {
        // SAFETY: getpid cannot fail.
        let me = unsafe { libc::getpid() } as c_uint;
        assert!(process_name(me).is_some_and(|n| !n.is_empty()));
        assert_eq!(process_name(0), None);
    }
}
