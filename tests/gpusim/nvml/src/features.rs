//! Features a datacenter GPU has but nothing in gpusim uses: per-process accounting (off),
//! ECC memory health (on, never an error), video encoder and frame-buffer-capture sessions
//! (none) and virtualization (bare metal). Answers pinned from NVIDIA's NVML API reference
//! (https://docs.nvidia.com/deploy/nvml-api/), cited per function; nvml.h carries the same
//! text in its comments. ECC mode and the aggregate ECC counters are in device.rs and
//! telemetry.rs, encoder/decoder utilization in telemetry.rs.

use std::ffi::{c_uint, c_ulonglong};

use crate::dev;
use crate::ffi::Out;
use crate::types::*;

/// nvml.h's `nvmlAccountingStats_t`; opaque here: with accounting disabled nothing is written.
#[repr(C)]
pub struct nvmlAccountingStats_t {
    _opaque: [u8; 0],
}

/// nvml.h's `nvmlEncoderSessionInfo_t`; opaque here: there is never a session to write.
#[repr(C)]
pub struct nvmlEncoderSessionInfo_t {
    _opaque: [u8; 0],
}

/// nvml.h's `nvmlFBCSessionInfo_t`; opaque here, as above.
#[repr(C)]
pub struct nvmlFBCSessionInfo_t {
    _opaque: [u8; 0],
}

/// nvml.h's `nvmlFBCStats_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct nvmlFBCStats_t {
    pub sessionsCount: c_uint,
    pub averageFPS: c_uint,
    pub averageLatency: c_uint,
}

pub type nvmlPageRetirementCause_t = c_uint;
/// nvml.h: `NVML_PAGE_RETIREMENT_CAUSE_COUNT` (multiple single-bit, double-bit).
pub const NVML_PAGE_RETIREMENT_CAUSE_COUNT: nvmlPageRetirementCause_t = 2;

pub type nvmlMemoryLocation_t = c_uint;
/// nvml.h (API 12 and 13): `NVML_MEMORY_LOCATION_COUNT`, after `NVML_MEMORY_LOCATION_SRAM = 7`.
pub const NVML_MEMORY_LOCATION_COUNT: nvmlMemoryLocation_t = 8;

pub type nvmlGpuVirtualizationMode_t = c_uint;
/// nvml.h: `NVML_GPU_VIRTUALIZATION_MODE_NONE = 0`, "Represents Bare Metal GPU".
pub const NVML_GPU_VIRTUALIZATION_MODE_NONE: nvmlGpuVirtualizationMode_t = 0;

/// A retired-page query: no page was ever retired, so the count is 0 whatever the buffer.
fn no_retired_pages(cause: nvmlPageRetirementCause_t, pageCount: Out<c_uint>) -> NvmlResult {
    if cause >= NVML_PAGE_RETIREMENT_CAUSE_COUNT {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    pageCount.write(0)
}

/// A session-list query (`*sessionCount` in: the array's size, out: the sessions written):
/// there are none, so 0 and success whatever the array.
fn no_sessions(sessionCount: Out<c_uint>) -> NvmlResult {
    sessionCount.read()?;
    sessionCount.write(0)
}

/// A memory error counter: ECC is on and no error ever happened, so 0 for every valid query.
fn memory_error_counter(
    errorType: nvmlMemoryErrorType_t,
    counterType: nvmlEccCounterType_t,
    locationType: nvmlMemoryLocation_t,
    count: Out<c_ulonglong>,
) -> NvmlResult {
    if errorType >= NVML_MEMORY_ERROR_TYPE_COUNT
        || counterType >= NVML_ECC_COUNTER_TYPE_COUNT
        || locationType >= NVML_MEMORY_LOCATION_COUNT
    {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    count.write(0)
}

nvml_api! {
    // ---- accounting: https://docs.nvidia.com/deploy/nvml-api/group__nvmlAccountingStats.html

    /// Reference: accounting mode "reset to default (Disabled) when driver unloads"; gpusim
    /// never enables it (nvmlDeviceSetAccountingMode is NOT_SUPPORTED).
    fn nvmlDeviceGetAccountingMode(device: nvmlDevice_t, mode: Out<nvmlEnableState_t>) {
        dev(device)?;
        mode.write(NVML_FEATURE_DISABLED)
    }

    /// Reference: `NVML_ERROR_NOT_SUPPORTED` "if the device doesn't support this feature or
    /// accounting mode is disabled"; `NVML_ERROR_INVALID_ARGUMENT` if `bufferSize` is NULL.
    fn nvmlDeviceGetAccountingBufferSize(device: nvmlDevice_t, bufferSize: Out<c_uint>) {
        dev(device)?;
        if bufferSize.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        Err(NVML_ERROR_NOT_SUPPORTED)
    }

    /// Reference: `NVML_ERROR_INVALID_ARGUMENT` "if device is invalid or count is NULL",
    /// `NVML_ERROR_NOT_SUPPORTED` "if ... accounting mode is disabled".
    fn nvmlDeviceGetAccountingPids(device: nvmlDevice_t, count: Out<c_uint>, _pids: Out<c_uint>) {
        dev(device)?;
        if count.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        Err(NVML_ERROR_NOT_SUPPORTED)
    }

    /// Reference: `NVML_ERROR_INVALID_ARGUMENT` "if device is invalid or stats are NULL",
    /// `NVML_ERROR_NOT_SUPPORTED` "if device doesn't support this feature or accounting mode is
    /// disabled" (which comes before `NVML_ERROR_NOT_FOUND`, "process stats were not found":
    /// with accounting off no pid has stats).
    fn nvmlDeviceGetAccountingStats(device: nvmlDevice_t, _pid: c_uint, stats: Out<nvmlAccountingStats_t>) {
        dev(device)?;
        if stats.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        Err(NVML_ERROR_NOT_SUPPORTED)
    }

    // ---- ECC memory health: https://docs.nvidia.com/deploy/nvml-api/group__nvmlDeviceQueries.html

    /// Reference: "Retrieves the requested memory error counter for the device ... Requires ECC
    /// Mode to be enabled" (it is: nvmlDeviceGetEccMode); `NVML_ERROR_INVALID_ARGUMENT` for an
    /// invalid type, counter type or location, or a NULL `count`. No error ever happened: 0.
    fn nvmlDeviceGetMemoryErrorCounter(
        device: nvmlDevice_t,
        errorType: nvmlMemoryErrorType_t,
        counterType: nvmlEccCounterType_t,
        locationType: nvmlMemoryLocation_t,
        count: Out<c_ulonglong>,
    ) {
        dev(device)?;
        memory_error_counter(errorType, counterType, locationType, count)
    }

    /// Reference: `pageCount` in: the `addresses` buffer size ("Set to 0 to query the size"),
    /// out: the number of retired pages of `cause`; `NVML_ERROR_INVALID_ARGUMENT` for a NULL
    /// `pageCount` or an invalid cause. No page was retired: 0.
    fn nvmlDeviceGetRetiredPages(device: nvmlDevice_t, cause: nvmlPageRetirementCause_t, pageCount: Out<c_uint>, _addresses: Out<c_ulonglong>) {
        dev(device)?;
        no_retired_pages(cause, pageCount)
    }

    /// As nvmlDeviceGetRetiredPages, with the retirement timestamps (none).
    fn nvmlDeviceGetRetiredPages_v2(
        device: nvmlDevice_t,
        cause: nvmlPageRetirementCause_t,
        pageCount: Out<c_uint>,
        _addresses: Out<c_ulonglong>,
        _timestamps: Out<c_ulonglong>,
    ) {
        dev(device)?;
        no_retired_pages(cause, pageCount)
    }

    /// Reference: "Check if any pages are pending retirement and need a reboot": none.
    fn nvmlDeviceGetRetiredPagesPendingStatus(device: nvmlDevice_t, isPending: Out<nvmlEnableState_t>) {
        dev(device)?;
        isPending.write(NVML_FEATURE_DISABLED)
    }

    /// Reference: rows remapped for correctable and uncorrectable errors, whether a remapping
    /// is pending and whether one ever failed (Ampere or newer, NOT_SUPPORTED only with MIG
    /// enabled): 0, 0, no, no.
    fn nvmlDeviceGetRemappedRows(device: nvmlDevice_t, corrRows: Out<c_uint>, uncRows: Out<c_uint>, isPending: Out<c_uint>, failureOccurred: Out<c_uint>) {
        dev(device)?;
        if corrRows.is_null() || uncRows.is_null() || isPending.is_null() || failureOccurred.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        corrRows.write(0)?;
        uncRows.write(0)?;
        isPending.write(0)?;
        failureOccurred.write(0)
    }

    // ---- encoder and frame buffer capture: group__nvmlDeviceQueries.html

    /// Reference: "To query the number of active encoder sessions, call this function with
    /// *sessionCount = 0. The code will return NVML_SUCCESS with number of active encoder
    /// sessions updated in *sessionCount"; `NVML_ERROR_INVALID_ARGUMENT` if it is NULL. No
    /// session is ever active: 0.
    fn nvmlDeviceGetEncoderSessions(device: nvmlDevice_t, sessionCount: Out<c_uint>, _sessionInfos: Out<nvmlEncoderSessionInfo_t>) {
        dev(device)?;
        no_sessions(sessionCount)
    }

    /// Reference: as nvmlDeviceGetEncoderSessions, for frame buffer capture sessions: 0.
    fn nvmlDeviceGetFBCSessions(device: nvmlDevice_t, sessionCount: Out<c_uint>, _sessionInfo: Out<nvmlFBCSessionInfo_t>) {
        dev(device)?;
        no_sessions(sessionCount)
    }

    /// Reference: the count of active encoder sessions, their trailing average FPS and encode
    /// latency; `NVML_ERROR_INVALID_ARGUMENT` if any is NULL. No session: 0, 0, 0.
    fn nvmlDeviceGetEncoderStats(device: nvmlDevice_t, sessionCount: Out<c_uint>, averageFps: Out<c_uint>, averageLatency: Out<c_uint>) {
        dev(device)?;
        if sessionCount.is_null() || averageFps.is_null() || averageLatency.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        sessionCount.write(0)?;
        averageFps.write(0)?;
        averageLatency.write(0)
    }

    /// Reference: the frame buffer capture sessions' statistics; `NVML_ERROR_INVALID_ARGUMENT`
    /// if `fbcStats` is NULL. No session: all zero.
    fn nvmlDeviceGetFBCStats(device: nvmlDevice_t, fbcStats: Out<nvmlFBCStats_t>) {
        dev(device)?;
        fbcStats.write(nvmlFBCStats_t::default())
    }

    // ---- virtualization: group__nvmlDeviceQueries.html (vGPU queries are generated stubs:
    // NOT_SUPPORTED on a host that is not a vGPU host)

    /// Reference: "Get the virtualization mode corresponding to the GPU", one of
    /// NVML_GPU_VIRTUALIZATION_?; gpusim's GPUs are bare metal: `NVML_GPU_VIRTUALIZATION_MODE_NONE`.
    fn nvmlDeviceGetVirtualizationMode(device: nvmlDevice_t, pVirtualMode: Out<nvmlGpuVirtualizationMode_t>) {
        dev(device)?;
        pVirtualMode.write(NVML_GPU_VIRTUALIZATION_MODE_NONE)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fbc_stats_layout() {
        assert_eq!(std::mem::size_of::<nvmlFBCStats_t>(), 12);
    }

    #[test]
    fn memory_errors_are_zero_for_valid_queries_only() {
        let mut n = 9;
        assert_eq!(memory_error_counter(1, 1, 2, Out::from_mut(&mut n)), Ok(()));
        assert_eq!(n, 0);
        n = 9;
        assert_eq!(
            memory_error_counter(2, 0, 0, Out::from_mut(&mut n)),
            Err(NVML_ERROR_INVALID_ARGUMENT)
        );
        assert_eq!(
            memory_error_counter(0, 2, 0, Out::from_mut(&mut n)),
            Err(NVML_ERROR_INVALID_ARGUMENT)
        );
        assert_eq!(
            memory_error_counter(0, 0, 8, Out::from_mut(&mut n)),
            Err(NVML_ERROR_INVALID_ARGUMENT)
        );
        assert_eq!(
            memory_error_counter(0, 0, 7, Out::null()),
            Err(NVML_ERROR_INVALID_ARGUMENT)
        );
        assert_eq!(n, 9);
    }

    #[test]
    fn no_retired_pages_and_no_sessions() {
        let mut n = 5;
        assert_eq!(no_retired_pages(0, Out::from_mut(&mut n)), Ok(()));
        assert_eq!(n, 0);
        assert_eq!(
            no_retired_pages(2, Out::from_mut(&mut n)),
            Err(NVML_ERROR_INVALID_ARGUMENT)
        );
        assert_eq!(
            no_retired_pages(1, Out::null()),
            Err(NVML_ERROR_INVALID_ARGUMENT)
        );
        n = 16;
        assert_eq!(no_sessions(Out::from_mut(&mut n)), Ok(()));
        assert_eq!(n, 0);
        assert_eq!(no_sessions(Out::null()), Err(NVML_ERROR_INVALID_ARGUMENT));
    }

    #[test]
    fn exports_need_init() {
        let mut m = 7;
        // SAFETY: a valid pointer; the handle is never dereferenced.
        let r = unsafe { nvmlDeviceGetAccountingMode(std::ptr::null_mut(), Out::from_mut(&mut m)) };
        assert_eq!(r, NVML_ERROR_UNINITIALIZED);
        assert_eq!(m, 7);
    }
}
