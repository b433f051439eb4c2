//! The NVML ABI as nvml.h (NVML API 12, nvidia-nvml-dev-cu12 12.9.79) declares it: return
//! codes, the enum values gpusim uses, and the `#[repr(C)]` structs its functions fill.
//! Names are nvml.h's, so code reads like the header. Sizes are pinned by the tests at the
//! bottom, whose numbers come from `sizeof` in a C program compiled with gcc against nvml.h.

use std::ffi::{c_char, c_int, c_longlong, c_uint, c_ulong, c_ulonglong, c_ushort};

use crate::ffi::Buf;

/// `nvmlReturn_t`: a C enum, passed as `unsigned int`.
pub type nvmlReturn_t = c_uint;

pub const NVML_SUCCESS: nvmlReturn_t = 0;
pub const NVML_ERROR_UNINITIALIZED: nvmlReturn_t = 1;
pub const NVML_ERROR_INVALID_ARGUMENT: nvmlReturn_t = 2;
pub const NVML_ERROR_NOT_SUPPORTED: nvmlReturn_t = 3;
pub const NVML_ERROR_NO_PERMISSION: nvmlReturn_t = 4;
pub const NVML_ERROR_ALREADY_INITIALIZED: nvmlReturn_t = 5;
pub const NVML_ERROR_NOT_FOUND: nvmlReturn_t = 6;
pub const NVML_ERROR_INSUFFICIENT_SIZE: nvmlReturn_t = 7;
pub const NVML_ERROR_INSUFFICIENT_POWER: nvmlReturn_t = 8;
pub const NVML_ERROR_DRIVER_NOT_LOADED: nvmlReturn_t = 9;
pub const NVML_ERROR_TIMEOUT: nvmlReturn_t = 10;
pub const NVML_ERROR_IRQ_ISSUE: nvmlReturn_t = 11;
pub const NVML_ERROR_LIBRARY_NOT_FOUND: nvmlReturn_t = 12;
pub const NVML_ERROR_FUNCTION_NOT_FOUND: nvmlReturn_t = 13;
pub const NVML_ERROR_CORRUPTED_INFOROM: nvmlReturn_t = 14;
pub const NVML_ERROR_GPU_IS_LOST: nvmlReturn_t = 15;
pub const NVML_ERROR_RESET_REQUIRED: nvmlReturn_t = 16;
pub const NVML_ERROR_OPERATING_SYSTEM: nvmlReturn_t = 17;
pub const NVML_ERROR_LIB_RM_VERSION_MISMATCH: nvmlReturn_t = 18;
pub const NVML_ERROR_IN_USE: nvmlReturn_t = 19;
pub const NVML_ERROR_MEMORY: nvmlReturn_t = 20;
pub const NVML_ERROR_NO_DATA: nvmlReturn_t = 21;
pub const NVML_ERROR_VGPU_ECC_NOT_SUPPORTED: nvmlReturn_t = 22;
pub const NVML_ERROR_INSUFFICIENT_RESOURCES: nvmlReturn_t = 23;
pub const NVML_ERROR_FREQ_NOT_SUPPORTED: nvmlReturn_t = 24;
pub const NVML_ERROR_ARGUMENT_VERSION_MISMATCH: nvmlReturn_t = 25;
pub const NVML_ERROR_DEPRECATED: nvmlReturn_t = 26;
pub const NVML_ERROR_NOT_READY: nvmlReturn_t = 27;
pub const NVML_ERROR_GPU_NOT_FOUND: nvmlReturn_t = 28;
pub const NVML_ERROR_INVALID_STATE: nvmlReturn_t = 29;
pub const NVML_ERROR_UNKNOWN: nvmlReturn_t = 999;

/// Shorthand for the bodies of exported functions.
pub type NvmlResult = Result<(), nvmlReturn_t>;

// ---- opaque handles -------------------------------------------------------------------------

/// What an `nvmlDevice_t` points at: one entry of [`crate::ffi::DEVICES`].
#[repr(C)]
pub struct nvmlDevice_st {
    pub index: u32,
}
pub type nvmlDevice_t = *mut nvmlDevice_st;

/// What an `nvmlEventSet_t` points at (never dereferenced: see [`crate::events`]).
#[repr(C)]
pub struct nvmlEventSet_st {
    _opaque: [u8; 0],
}
pub type nvmlEventSet_t = *mut nvmlEventSet_st;

// ---- enums (C enums are `unsigned int` on the ABIs gpusim supports) --------------------------

pub type nvmlEnableState_t = c_uint;
pub const NVML_FEATURE_DISABLED: nvmlEnableState_t = 0;
pub const NVML_FEATURE_ENABLED: nvmlEnableState_t = 1;

pub type nvmlBrandType_t = c_uint;
pub const NVML_BRAND_QUADRO: nvmlBrandType_t = 1;
pub const NVML_BRAND_GEFORCE: nvmlBrandType_t = 5;
pub const NVML_BRAND_TITAN: nvmlBrandType_t = 6;
pub const NVML_BRAND_NVIDIA_RTX: nvmlBrandType_t = 13;
pub const NVML_BRAND_NVIDIA: nvmlBrandType_t = 14;
pub const NVML_BRAND_GEFORCE_RTX: nvmlBrandType_t = 15;

pub type nvmlDeviceArchitecture_t = c_uint;
pub const NVML_DEVICE_ARCH_KEPLER: nvmlDeviceArchitecture_t = 2;
pub const NVML_DEVICE_ARCH_MAXWELL: nvmlDeviceArchitecture_t = 3;
pub const NVML_DEVICE_ARCH_PASCAL: nvmlDeviceArchitecture_t = 4;
pub const NVML_DEVICE_ARCH_VOLTA: nvmlDeviceArchitecture_t = 5;
pub const NVML_DEVICE_ARCH_TURING: nvmlDeviceArchitecture_t = 6;
pub const NVML_DEVICE_ARCH_AMPERE: nvmlDeviceArchitecture_t = 7;
pub const NVML_DEVICE_ARCH_ADA: nvmlDeviceArchitecture_t = 8;
pub const NVML_DEVICE_ARCH_HOPPER: nvmlDeviceArchitecture_t = 9;
pub const NVML_DEVICE_ARCH_BLACKWELL: nvmlDeviceArchitecture_t = 10;
pub const NVML_DEVICE_ARCH_UNKNOWN: nvmlDeviceArchitecture_t = 0xffff_ffff;

pub type nvmlGpuTopologyLevel_t = c_uint;
pub const NVML_TOPOLOGY_INTERNAL: nvmlGpuTopologyLevel_t = 0;
pub const NVML_TOPOLOGY_SINGLE: nvmlGpuTopologyLevel_t = 10;
pub const NVML_TOPOLOGY_MULTIPLE: nvmlGpuTopologyLevel_t = 20;
pub const NVML_TOPOLOGY_HOSTBRIDGE: nvmlGpuTopologyLevel_t = 30;
pub const NVML_TOPOLOGY_NODE: nvmlGpuTopologyLevel_t = 40;
pub const NVML_TOPOLOGY_SYSTEM: nvmlGpuTopologyLevel_t = 50;

pub type nvmlGpuP2PStatus_t = c_uint;
pub const NVML_P2P_STATUS_OK: nvmlGpuP2PStatus_t = 0;
pub const NVML_P2P_STATUS_CHIPSET_NOT_SUPPORED: nvmlGpuP2PStatus_t = 1;
pub const NVML_P2P_STATUS_NOT_SUPPORTED: nvmlGpuP2PStatus_t = 5;

pub type nvmlGpuP2PCapsIndex_t = c_uint;
pub const NVML_P2P_CAPS_INDEX_READ: nvmlGpuP2PCapsIndex_t = 0;
pub const NVML_P2P_CAPS_INDEX_WRITE: nvmlGpuP2PCapsIndex_t = 1;
pub const NVML_P2P_CAPS_INDEX_NVLINK: nvmlGpuP2PCapsIndex_t = 2;
pub const NVML_P2P_CAPS_INDEX_ATOMICS: nvmlGpuP2PCapsIndex_t = 3;
pub const NVML_P2P_CAPS_INDEX_PCI: nvmlGpuP2PCapsIndex_t = 4;

pub type nvmlNvLinkCapability_t = c_uint;
pub const NVML_NVLINK_CAP_P2P_SUPPORTED: nvmlNvLinkCapability_t = 0;
pub const NVML_NVLINK_CAP_SYSMEM_ACCESS: nvmlNvLinkCapability_t = 1;
pub const NVML_NVLINK_CAP_P2P_ATOMICS: nvmlNvLinkCapability_t = 2;
pub const NVML_NVLINK_CAP_SYSMEM_ATOMICS: nvmlNvLinkCapability_t = 3;
pub const NVML_NVLINK_CAP_SLI_BRIDGE: nvmlNvLinkCapability_t = 4;
pub const NVML_NVLINK_CAP_VALID: nvmlNvLinkCapability_t = 5;
/// `NVML_NVLINK_MAX_LINKS`.
pub const NVML_NVLINK_MAX_LINKS: c_uint = 18;

/// `nvmlNvlinkVersion_t` values.
pub const NVML_NVLINK_VERSION_1_0: c_uint = 1;
pub const NVML_NVLINK_VERSION_2_0: c_uint = 2;
pub const NVML_NVLINK_VERSION_2_2: c_uint = 3;
pub const NVML_NVLINK_VERSION_3_0: c_uint = 4;
pub const NVML_NVLINK_VERSION_3_1: c_uint = 5;
pub const NVML_NVLINK_VERSION_4_0: c_uint = 6;
pub const NVML_NVLINK_VERSION_5_0: c_uint = 7;

pub type nvmlClockType_t = c_uint;
pub const NVML_CLOCK_GRAPHICS: nvmlClockType_t = 0;
pub const NVML_CLOCK_SM: nvmlClockType_t = 1;
pub const NVML_CLOCK_MEM: nvmlClockType_t = 2;
pub const NVML_CLOCK_VIDEO: nvmlClockType_t = 3;

pub type nvmlClockId_t = c_uint;
pub const NVML_CLOCK_ID_CURRENT: nvmlClockId_t = 0;
pub const NVML_CLOCK_ID_APP_CLOCK_TARGET: nvmlClockId_t = 1;
pub const NVML_CLOCK_ID_APP_CLOCK_DEFAULT: nvmlClockId_t = 2;
pub const NVML_CLOCK_ID_CUSTOMER_BOOST_MAX: nvmlClockId_t = 3;

pub type nvmlPstates_t = c_uint;
pub const NVML_PSTATE_0: nvmlPstates_t = 0;
pub const NVML_PSTATE_8: nvmlPstates_t = 8;

pub type nvmlTemperatureSensors_t = c_uint;
pub const NVML_TEMPERATURE_GPU: nvmlTemperatureSensors_t = 0;

pub type nvmlTemperatureThresholds_t = c_uint;
pub const NVML_TEMPERATURE_THRESHOLD_SHUTDOWN: nvmlTemperatureThresholds_t = 0;
pub const NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: nvmlTemperatureThresholds_t = 1;
pub const NVML_TEMPERATURE_THRESHOLD_MEM_MAX: nvmlTemperatureThresholds_t = 2;
pub const NVML_TEMPERATURE_THRESHOLD_GPU_MAX: nvmlTemperatureThresholds_t = 3;
pub const NVML_TEMPERATURE_THRESHOLD_COUNT: nvmlTemperatureThresholds_t = 8;

pub type nvmlSamplingType_t = c_uint;
pub const NVML_GPU_UTILIZATION_SAMPLES: nvmlSamplingType_t = 1;
pub const NVML_MEMORY_UTILIZATION_SAMPLES: nvmlSamplingType_t = 2;
pub const NVML_SAMPLINGTYPE_COUNT: nvmlSamplingType_t = 10;

pub type nvmlValueType_t = c_uint;
pub const NVML_VALUE_TYPE_UNSIGNED_INT: nvmlValueType_t = 1;
pub const NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: nvmlValueType_t = 3;

pub type nvmlComputeMode_t = c_uint;
pub const NVML_COMPUTEMODE_DEFAULT: nvmlComputeMode_t = 0;

pub type nvmlPcieUtilCounter_t = c_uint;
pub const NVML_PCIE_UTIL_COUNT: nvmlPcieUtilCounter_t = 2;

pub type nvmlMemoryErrorType_t = c_uint;
pub const NVML_MEMORY_ERROR_TYPE_COUNT: nvmlMemoryErrorType_t = 2;
pub type nvmlEccCounterType_t = c_uint;
pub const NVML_ECC_COUNTER_TYPE_COUNT: nvmlEccCounterType_t = 2;

pub type nvmlInforomObject_t = c_uint;
pub type nvmlDriverModel_t = c_uint;

pub type nvmlAffinityScope_t = c_uint;
pub const NVML_AFFINITY_SCOPE_NODE: nvmlAffinityScope_t = 0;
pub const NVML_AFFINITY_SCOPE_SOCKET: nvmlAffinityScope_t = 1;

/// `nvmlProcessDetailList_t.mode` (`NVML_PROCESS_MODE_*`).
pub const NVML_PROCESS_MODE_COMPUTE: c_uint = 0;
pub const NVML_PROCESS_MODE_GRAPHICS: c_uint = 1;
pub const NVML_PROCESS_MODE_MPS: c_uint = 2;

/// `nvmlEventType*` bits.
pub const nvmlEventTypeSingleBitEccError: c_ulonglong = 0x1;
pub const nvmlEventTypeDoubleBitEccError: c_ulonglong = 0x2;
pub const nvmlEventTypeXidCriticalError: c_ulonglong = 0x8;

/// `nvmlClocksEventReasonGpuIdle`.
pub const nvmlClocksEventReasonGpuIdle: c_ulonglong = 0x1;
/// Every reason gpusim could report: GpuIdle | ApplicationsClocksSetting | SwPowerCap |
/// HwSlowdown | SyncBoost | SwThermalSlowdown | HwThermalSlowdown | HwPowerBrakeSlowdown.
pub const SUPPORTED_CLOCKS_EVENT_REASONS: c_ulonglong =
    0x1 | 0x2 | 0x4 | 0x8 | 0x10 | 0x20 | 0x40 | 0x80;

/// Field ids of `nvmlDeviceGetFieldValues` gpusim answers.
pub const NVML_FI_DEV_NVLINK_LINK_COUNT: c_uint = 91;
pub const NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX: c_uint = 138;
pub const NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_RX: c_uint = 141;

/// `NVML_INIT_FLAG_NO_GPUS | NVML_INIT_FLAG_NO_ATTACH`.
pub const NVML_INIT_FLAGS_KNOWN: c_uint = 1 | 2;

/// `NVML_STRUCT_VERSION(name, ver)`: the struct's size with the version in the top byte.
pub const fn struct_version<T>(ver: u32) -> c_uint {
    std::mem::size_of::<T>() as c_uint | (ver << 24)
}

// ---- structs --------------------------------------------------------------------------------

#[repr(C)]
#[derive(Clone, Copy)]
pub struct nvmlPciInfo_t {
    pub busIdLegacy: [c_char; 16],
    pub domain: c_uint,
    pub bus: c_uint,
    pub device: c_uint,
    pub pciDeviceId: c_uint,
    pub pciSubSystemId: c_uint,
    pub busId: [c_char; 32],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct nvmlMemory_t {
    pub total: c_ulonglong,
    pub free: c_ulonglong,
    pub used: c_ulonglong,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct nvmlMemory_v2_t {
    pub version: c_uint,
    pub total: c_ulonglong,
    pub reserved: c_ulonglong,
    pub free: c_ulonglong,
    pub used: c_ulonglong,
}
/// `nvmlMemory_v2` (0x02000028 on 64-bit Linux).
pub const nvmlMemory_v2: c_uint = struct_version::<nvmlMemory_v2_t>(2);

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct nvmlBAR1Memory_t {
    pub bar1Total: c_ulonglong,
    pub bar1Free: c_ulonglong,
    pub bar1Used: c_ulonglong,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct nvmlProcessInfo_v1_t {
    pub pid: c_uint,
    pub usedGpuMemory: c_ulonglong,
}

/// `nvmlProcessInfo_v2_t`, also named `nvmlProcessInfo_t` (the `_v3` functions' entries).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct nvmlProcessInfo_t {
    pub pid: c_uint,
    pub usedGpuMemory: c_ulonglong,
    pub gpuInstanceId: c_uint,
    pub computeInstanceId: c_uint,
}
pub type nvmlProcessInfo_v2_t = nvmlProcessInfo_t;

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct nvmlProcessDetail_v1_t {
    pub pid: c_uint,
    pub usedGpuMemory: c_ulonglong,
    pub gpuInstanceId: c_uint,
    pub computeInstanceId: c_uint,
    pub usedGpuCcProtectedMemory: c_ulonglong,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct nvmlProcessDetailList_t {
    pub version: c_uint,
    pub mode: c_uint,
    pub numProcArrayEntries: c_uint,
    pub procArray: Buf<nvmlProcessDetail_v1_t>,
}
pub const nvmlProcessDetailList_v1: c_uint = struct_version::<nvmlProcessDetailList_t>(1);

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct nvmlUtilization_t {
    pub gpu: c_uint,
    pub memory: c_uint,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct nvmlProcessUtilizationSample_t {
    pub pid: c_uint,
    pub timeStamp: c_ulonglong,
    pub smUtil: c_uint,
    pub memUtil: c_uint,
    pub encUtil: c_uint,
    pub decUtil: c_uint,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct nvmlProcessUtilizationInfo_v1_t {
    pub timeStamp: c_ulonglong,
    pub pid: c_uint,
    pub smUtil: c_uint,
    pub memUtil: c_uint,
    pub encUtil: c_uint,
    pub decUtil: c_uint,
    pub jpgUtil: c_uint,
    pub ofaUtil: c_uint,
}

/// `nvmlProcessesUtilizationInfo_t` (`_v1_t`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct nvmlProcessesUtilizationInfo_t {
    pub version: c_uint,
    pub processSamplesCount: c_uint,
    pub lastSeenTimeStamp: c_ulonglong,
    pub procUtilArray: Buf<nvmlProcessUtilizationInfo_v1_t>,
}
pub const nvmlProcessesUtilizationInfo_v1: c_uint =
    struct_version::<nvmlProcessesUtilizationInfo_t>(1);

/// `nvmlTemperature_t` (`_v1_t`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct nvmlTemperature_t {
    pub version: c_uint,
    pub sensorType: nvmlTemperatureSensors_t,
    pub temperature: c_int,
}
pub const nvmlTemperature_v1: c_uint = struct_version::<nvmlTemperature_t>(1);

#[repr(C)]
#[derive(Clone, Copy)]
pub struct nvmlEventData_t {
    pub device: nvmlDevice_t,
    pub eventType: c_ulonglong,
    pub eventData: c_ulonglong,
    pub gpuInstanceId: c_uint,
    pub computeInstanceId: c_uint,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub union nvmlValue_t {
    pub dVal: f64,
    pub siVal: c_int,
    pub uiVal: c_uint,
    pub ulVal: c_ulong,
    pub ullVal: c_ulonglong,
    pub sllVal: c_longlong,
    pub usVal: c_ushort,
}

impl nvmlValue_t {
    /// An `unsigned int` value with the union's other bytes zero.
    pub fn uint(v: c_uint) -> nvmlValue_t {
        let mut x = nvmlValue_t { ullVal: 0 };
        x.uiVal = v;
        x
    }
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct nvmlSample_t {
    pub timeStamp: c_ulonglong,
    pub sampleValue: nvmlValue_t,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct nvmlFieldValue_t {
    pub fieldId: c_uint,
    pub scopeId: c_uint,
    pub timestamp: c_longlong,
    pub latencyUsec: c_longlong,
    pub valueType: nvmlValueType_t,
    pub nvmlReturn: nvmlReturn_t,
    pub value: nvmlValue_t,
}

/// `nvmlConfComputeMemSizeInfo_t` (only declared for its signature; gpusim has no
/// confidential computing).
#[repr(C)]
pub struct nvmlConfComputeMemSizeInfo_t {
    pub protectedMemSizeKib: c_ulonglong,
    pub unprotectedMemSizeKib: c_ulonglong,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{align_of, size_of};

    /// Expected sizes: printed by a C program with `sizeof(...)` and `_Alignof(...)`, compiled
    /// by gcc on x86_64 Linux against nvml.h from nvidia-nvml-dev-cu12 12.9.79.
    #[test]
    fn struct_sizes_match_nvml_h() {
        assert_eq!(size_of::<nvmlPciInfo_t>(), 68);
        assert_eq!(align_of::<nvmlPciInfo_t>(), 4);
        assert_eq!(size_of::<nvmlMemory_t>(), 24);
        assert_eq!(size_of::<nvmlMemory_v2_t>(), 40);
        assert_eq!(size_of::<nvmlBAR1Memory_t>(), 24);
        assert_eq!(size_of::<nvmlProcessInfo_v1_t>(), 16);
        assert_eq!(size_of::<nvmlProcessInfo_t>(), 24);
        assert_eq!(size_of::<nvmlProcessDetail_v1_t>(), 32);
        assert_eq!(size_of::<nvmlProcessDetailList_t>(), 24);
        assert_eq!(size_of::<nvmlUtilization_t>(), 8);
        assert_eq!(size_of::<nvmlProcessUtilizationSample_t>(), 32);
        assert_eq!(size_of::<nvmlProcessUtilizationInfo_v1_t>(), 40);
        assert_eq!(size_of::<nvmlProcessesUtilizationInfo_t>(), 24);
        assert_eq!(size_of::<nvmlTemperature_t>(), 12);
        assert_eq!(size_of::<nvmlEventData_t>(), 32);
        assert_eq!(size_of::<nvmlValue_t>(), 8);
        assert_eq!(size_of::<nvmlSample_t>(), 16);
        assert_eq!(size_of::<nvmlFieldValue_t>(), 40);
        assert_eq!(size_of::<nvmlConfComputeMemSizeInfo_t>(), 16);
    }

    #[test]
    fn field_offsets_match_nvml_h() {
        assert_eq!(std::mem::offset_of!(nvmlPciInfo_t, busId), 36);
        assert_eq!(std::mem::offset_of!(nvmlEventData_t, eventType), 8);
        assert_eq!(std::mem::offset_of!(nvmlFieldValue_t, value), 32);
        assert_eq!(
            std::mem::offset_of!(nvmlProcessesUtilizationInfo_t, procUtilArray),
            16
        );
        assert_eq!(std::mem::offset_of!(nvmlMemory_v2_t, total), 8);
    }

    #[test]
    fn struct_versions_match_nvml_h() {
        assert_eq!(nvmlMemory_v2, 0x0200_0028);
        assert_eq!(nvmlProcessesUtilizationInfo_v1, 0x0100_0018);
        assert_eq!(nvmlTemperature_v1, 0x0100_000c);
        assert_eq!(nvmlProcessDetailList_v1, 0x0100_0018);
    }

    #[test]
    fn value_union_keeps_uint_in_low_bytes() {
        let v = nvmlValue_t::uint(77);
        // SAFETY: every field of the union is plain data; uint() initialised all 8 bytes.
        assert_eq!(unsafe { v.ullVal }, 77);
    }
}
