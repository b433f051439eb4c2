//! Multi-Instance GPU: every gpusim GPU is a MIG-capable GPU with MIG mode disabled (current
//! and pending), as an A100/H100 out of the box. Answers pinned from NVIDIA's NVML API
//! reference, "Multi Instance GPU Management"
//! (https://docs.nvidia.com/deploy/nvml-api/group__nvmlMultiInstanceGPU.html) and the same
//! text in nvml.h's comments. The other MIG functions (creating instances, placements, compute
//! instances) are generated stubs (unsupported.rs): `NVML_ERROR_NOT_SUPPORTED`, which the
//! reference gives for a device without MIG mode enabled.

use std::ffi::c_uint;

use crate::dev;
use crate::ffi::Out;
use crate::types::*;

/// `NVML_DEVICE_MIG_DISABLE` (nvml.h: `#define NVML_DEVICE_MIG_DISABLE 0x0`).
pub const NVML_DEVICE_MIG_DISABLE: c_uint = 0;

/// `nvmlGpuInstance_t`: a handle gpusim never hands out (MIG is disabled).
pub struct nvmlGpuInstance_st {
    _opaque: [u8; 0],
}
pub type nvmlGpuInstance_t = *mut nvmlGpuInstance_st;

/// nvml.h's `nvmlGpuInstanceProfileInfo_t`; opaque here: with MIG disabled nothing is written.
#[repr(C)]
pub struct nvmlGpuInstanceProfileInfo_t {
    _opaque: [u8; 0],
}

/// nvml.h's `nvmlGpuInstanceProfileInfo_v2_t`; opaque here, as above.
#[repr(C)]
pub struct nvmlGpuInstanceProfileInfo_v2_t {
    _opaque: [u8; 0],
}

/// Current and pending MIG mode: both `NVML_DEVICE_MIG_DISABLE`.
fn mig_mode(current: Out<c_uint>, pending: Out<c_uint>) -> NvmlResult {
    if current.is_null() || pending.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    current.write(NVML_DEVICE_MIG_DISABLE)?;
    pending.write(NVML_DEVICE_MIG_DISABLE)
}

nvml_api! {
    /// Reference: "Get MIG mode for the device ... Returns the current mode,
    /// NVML_DEVICE_MIG_DISABLE or NVML_DEVICE_MIG_ENABLE" (and the pending one, applied at the
    /// next reset). MIG is off on every gpusim GPU: both `NVML_DEVICE_MIG_DISABLE`.
    fn nvmlDeviceGetMigMode(device: nvmlDevice_t, currentMode: Out<c_uint>, pendingMode: Out<c_uint>) {
        dev(device)?;
        mig_mode(currentMode, pendingMode)
    }

    /// Reference: whether a handle is a MIG device handle. No handle gpusim gives out is one.
    fn nvmlDeviceIsMigDeviceHandle(device: nvmlDevice_t, isMigDevice: Out<c_uint>) {
        dev(device)?;
        isMigDevice.write(0)
    }

    /// Reference: "Returns zero if MIG is not supported or enabled."
    fn nvmlDeviceGetMaxMigDeviceCount(device: nvmlDevice_t, count: Out<c_uint>) {
        dev(device)?;
        count.write(0)
    }

    /// Reference: `NVML_ERROR_NOT_FOUND` "if no valid MIG device was found at index"; with MIG
    /// disabled there is none at any index (`NVML_ERROR_INVALID_ARGUMENT` for a NULL
    /// `migDevice`).
    fn nvmlDeviceGetMigDeviceHandleByIndex(device: nvmlDevice_t, _index: c_uint, migDevice: Out<nvmlDevice_t>) {
        dev(device)?;
        if migDevice.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        Err(NVML_ERROR_NOT_FOUND)
    }

    /// Reference: `NVML_ERROR_INVALID_ARGUMENT` "if migDevice ... is invalid": no handle gpusim
    /// gives out is a MIG device handle.
    fn nvmlDeviceGetDeviceHandleFromMigDeviceHandle(migDevice: nvmlDevice_t, _device: Out<nvmlDevice_t>) {
        dev(migDevice)?;
        Err(NVML_ERROR_INVALID_ARGUMENT)
    }

    /// Reference: `NVML_ERROR_NOT_SUPPORTED` "if device is not supported" (a GPU handle, not a
    /// MIG device handle).
    fn nvmlDeviceGetGpuInstanceId(device: nvmlDevice_t, _id: Out<c_uint>) {
        dev(device)?;
        Err(NVML_ERROR_NOT_SUPPORTED)
    }

    /// As nvmlDeviceGetGpuInstanceId.
    fn nvmlDeviceGetComputeInstanceId(device: nvmlDevice_t, _id: Out<c_uint>) {
        dev(device)?;
        Err(NVML_ERROR_NOT_SUPPORTED)
    }

    /// Reference: `NVML_ERROR_NOT_SUPPORTED` "If device doesn't have MIG mode enabled".
    fn nvmlDeviceGetGpuInstances(device: nvmlDevice_t, _profileId: c_uint, gpuInstances: Out<nvmlGpuInstance_t>, count: Out<c_uint>) {
        dev(device)?;
        if gpuInstances.is_null() || count.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        Err(NVML_ERROR_NOT_SUPPORTED)
    }

    /// Reference: `NVML_ERROR_NOT_SUPPORTED` "If device doesn't support MIG or profile isn't
    /// supported"; the GPU instance profiles exist only in MIG mode (the versioned call below
    /// says so outright), so none is supported while it is disabled.
    fn nvmlDeviceGetGpuInstanceProfileInfo(device: nvmlDevice_t, _profile: c_uint, info: Out<nvmlGpuInstanceProfileInfo_t>) {
        dev(device)?;
        if info.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        Err(NVML_ERROR_NOT_SUPPORTED)
    }

    /// Reference: `NVML_ERROR_NOT_SUPPORTED` "If device doesn't have MIG mode enabled or profile
    /// isn't supported".
    fn nvmlDeviceGetGpuInstanceProfileInfoV(device: nvmlDevice_t, _profile: c_uint, info: Out<nvmlGpuInstanceProfileInfo_v2_t>) {
        dev(device)?;
        if info.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        Err(NVML_ERROR_NOT_SUPPORTED)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mig_mode_is_disabled_now_and_after_reset() {
        let (mut cur, mut pend) = (7, 7);
        assert_eq!(
            mig_mode(Out::from_mut(&mut cur), Out::from_mut(&mut pend)),
            Ok(())
        );
        assert_eq!(
            (cur, pend),
            (NVML_DEVICE_MIG_DISABLE, NVML_DEVICE_MIG_DISABLE)
        );
        let null: Out<c_uint> = Out::null();
        assert_eq!(
            mig_mode(null, Out::from_mut(&mut pend)),
            Err(NVML_ERROR_INVALID_ARGUMENT)
        );
    }

    #[test]
    fn exports_need_init() {
        let (mut cur, mut pend) = (7, 7);
        // SAFETY: valid pointers; the handle is never dereferenced.
        let r = unsafe {
            nvmlDeviceGetMigMode(
                std::ptr::null_mut(),
                Out::from_mut(&mut cur),
                Out::from_mut(&mut pend),
            )
        };
        assert_eq!(r, NVML_ERROR_UNINITIALIZED);
        assert_eq!((cur, pend), (7, 7));
    }
}
