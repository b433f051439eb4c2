//! Devices: enumeration and lookup, identity (name, UUID, PCI, serial, brand, architecture),
//! memory, running processes and fixed modes (compute, persistence, display, ECC). MIG is in
//! [`crate::mig`].

use std::ffi::{c_char, c_int, c_uint};

use gpusim_core::config::{normalize_bus_id, parse_uuid};
use gpusim_core::GpuConfig;

use crate::ffi::{handle_of, Buf, CStrIn, CharBuf, Out};
use crate::types::*;
use crate::{dev, state, Dev};

/// Instance ids of a process outside MIG.
const NO_MIG_ID: c_uint = 0xFFFF_FFFF;

nvml_api! {
    fn nvmlDeviceGetCount(deviceCount: Out<c_uint>) {
        deviceCount.write(state()?.num_gpus() as c_uint)
    }

    fn nvmlDeviceGetCount_v2(deviceCount: Out<c_uint>) {
        deviceCount.write(state()?.num_gpus() as c_uint)
    }

    fn nvmlDeviceGetHandleByIndex(index: c_uint, device: Out<nvmlDevice_t>) {
        handle_by_index(index, device)
    }

    fn nvmlDeviceGetHandleByIndex_v2(index: c_uint, device: Out<nvmlDevice_t>) {
        handle_by_index(index, device)
    }

    /// Case-insensitive; a string that is not a GPU UUID is `NVML_ERROR_INVALID_ARGUMENT`, an
    /// unknown one (or a MIG UUID) `NVML_ERROR_NOT_FOUND`.
    fn nvmlDeviceGetHandleByUUID(uuid: CStrIn, device: Out<nvmlDevice_t>) {
        let st = state()?;
        let want = uuid.to_string()?;
        if device.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        if parse_uuid(&want).is_none() && !want.starts_with("MIG-") {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let g = st.config.gpu.iter().position(|c| c.uuid.eq_ignore_ascii_case(&want)).ok_or(NVML_ERROR_NOT_FOUND)?;
        device.write(handle_of(g))
    }

    fn nvmlDeviceGetHandleBySerial(serial: CStrIn, device: Out<nvmlDevice_t>) {
        let st = state()?;
        let want = serial.to_string()?;
        if device.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let g = st.config.gpu.iter().position(|c| serial_of(c) == want).ok_or(NVML_ERROR_NOT_FOUND)?;
        device.write(handle_of(g))
    }

    fn nvmlDeviceGetHandleByPciBusId(pciBusId: CStrIn, device: Out<nvmlDevice_t>) {
        handle_by_bus_id(pciBusId, device)
    }

    /// Accepts "domain:bus:device.function" (4- or 8-digit domain), "domain:bus:device" and
    /// "bus:device.function", in hex of either case.
    fn nvmlDeviceGetHandleByPciBusId_v2(pciBusId: CStrIn, device: Out<nvmlDevice_t>) {
        handle_by_bus_id(pciBusId, device)
    }

    fn nvmlDeviceGetIndex(device: nvmlDevice_t, index: Out<c_uint>) {
        index.write(dev(device)?.g as c_uint)
    }

    fn nvmlDeviceGetMinorNumber(device: nvmlDevice_t, minorNumber: Out<c_uint>) {
        minorNumber.write(dev(device)?.g as c_uint)
    }

    fn nvmlDeviceGetName(device: nvmlDevice_t, name: CharBuf, length: c_uint) {
        let d = dev(device)?;
        name.write_str(length, &d.cfg().name)
    }

    fn nvmlDeviceGetUUID(device: nvmlDevice_t, uuid: CharBuf, length: c_uint) {
        let d = dev(device)?;
        uuid.write_str(length, &d.cfg().uuid)
    }

    /// A 13-digit board serial number derived from the UUID.
    fn nvmlDeviceGetSerial(device: nvmlDevice_t, serial: CharBuf, length: c_uint) {
        let d = dev(device)?;
        serial.write_str(length, &serial_of(d.cfg()))
    }

    fn nvmlDeviceGetBoardId(device: nvmlDevice_t, boardId: Out<c_uint>) {
        let d = dev(device)?;
        let (dom, bus, devn, func) = d.cfg().pci_parts();
        boardId.write((dom << 16) | (bus << 8) | (devn << 3) | func)
    }

    fn nvmlDeviceGetBrand(device: nvmlDevice_t, r#type: Out<nvmlBrandType_t>) {
        let d = dev(device)?;
        r#type.write(brand_of(&d.cfg().name))
    }

    fn nvmlDeviceGetArchitecture(device: nvmlDevice_t, arch: Out<nvmlDeviceArchitecture_t>) {
        let d = dev(device)?;
        arch.write(arch_of(d.cfg().cc()))
    }

    fn nvmlDeviceGetCudaComputeCapability(device: nvmlDevice_t, major: Out<c_int>, minor: Out<c_int>) {
        let d = dev(device)?;
        if major.is_null() || minor.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let (ma, mi) = d.cfg().cc();
        major.write(ma)?;
        minor.write(mi)
    }

    fn nvmlDeviceGetNumGpuCores(device: nvmlDevice_t, numCores: Out<c_uint>) {
        let d = dev(device)?;
        numCores.write(d.cfg().sm_count * 64)
    }

    fn nvmlDeviceGetMemoryBusWidth(device: nvmlDevice_t, busWidth: Out<c_uint>) {
        let d = dev(device)?;
        busWidth.write(bus_width_of(d.cfg().cc()))
    }

    fn nvmlDeviceGetVbiosVersion(device: nvmlDevice_t, version: CharBuf, length: c_uint) {
        dev(device)?;
        version.write_str(length, "92.00.45.00.05")
    }

    fn nvmlDeviceGetPciInfo(device: nvmlDevice_t, pci: Out<nvmlPciInfo_t>) {
        pci.write(pci_info(dev(device)?.cfg()))
    }

    fn nvmlDeviceGetPciInfo_v2(device: nvmlDevice_t, pci: Out<nvmlPciInfo_t>) {
        pci.write(pci_info(dev(device)?.cfg()))
    }

    fn nvmlDeviceGetPciInfo_v3(device: nvmlDevice_t, pci: Out<nvmlPciInfo_t>) {
        pci.write(pci_info(dev(device)?.cfg()))
    }

    // ---- memory ------------------------------------------------------------------------

    /// v1: `used` includes the driver-reserved memory; `free = total - used`.
    fn nvmlDeviceGetMemoryInfo(device: nvmlDevice_t, memory: Out<nvmlMemory_t>) {
        let d = dev(device)?;
        if memory.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let v = d.view()?;
        let used = v.memory_used.saturating_add(v.memory_reserved).min(v.memory_total);
        memory.write(nvmlMemory_t { total: v.memory_total, free: v.memory_total - used, used })
    }

    /// v2 (caller sets `version = nvmlMemory_v2`): `reserved` separate, `used` excludes it,
    /// `free = total - reserved - used`.
    fn nvmlDeviceGetMemoryInfo_v2(device: nvmlDevice_t, memory: Out<nvmlMemory_v2_t>) {
        let d = dev(device)?;
        let version = memory.read_version()?;
        if version != nvmlMemory_v2 {
            return Err(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
        }
        let v = d.view()?;
        let reserved = v.memory_reserved.min(v.memory_total);
        let used = v.memory_used.min(v.memory_total - reserved);
        memory.write(nvmlMemory_v2_t {
            version,
            total: v.memory_total,
            reserved,
            free: v.memory_total - reserved - used,
            used,
        })
    }

    /// BAR1 aperture: the next power of two at or above the memory size (64 GiB for an
    /// A100-40GB), 1 MiB of it in use.
    fn nvmlDeviceGetBAR1MemoryInfo(device: nvmlDevice_t, bar1Memory: Out<nvmlBAR1Memory_t>) {
        let d = dev(device)?;
        let total = d.cfg().memory_bytes().next_power_of_two().max(256 << 20);
        let used = 1 << 20;
        bar1Memory.write(nvmlBAR1Memory_t { bar1Total: total, bar1Free: total - used, bar1Used: used })
    }

    // ---- processes ---------------------------------------------------------------------

    fn nvmlDeviceGetComputeRunningProcesses(device: nvmlDevice_t, infoCount: Out<c_uint>, infos: Buf<nvmlProcessInfo_v1_t>) {
        let list = compute_processes(&dev(device)?)?;
        fill_processes(&list, infoCount, infos, |pid, mem| nvmlProcessInfo_v1_t { pid, usedGpuMemory: mem })
    }

    fn nvmlDeviceGetComputeRunningProcesses_v2(device: nvmlDevice_t, infoCount: Out<c_uint>, infos: Buf<nvmlProcessInfo_v2_t>) {
        let list = compute_processes(&dev(device)?)?;
        fill_processes(&list, infoCount, infos, process_info)
    }

    fn nvmlDeviceGetComputeRunningProcesses_v3(device: nvmlDevice_t, infoCount: Out<c_uint>, infos: Buf<nvmlProcessInfo_t>) {
        let list = compute_processes(&dev(device)?)?;
        fill_processes(&list, infoCount, infos, process_info)
    }

    /// gpusim runs no graphics: always an empty list.
    fn nvmlDeviceGetGraphicsRunningProcesses(device: nvmlDevice_t, infoCount: Out<c_uint>, infos: Buf<nvmlProcessInfo_v1_t>) {
        dev(device)?;
        fill_processes(&[], infoCount, infos, |pid, mem| nvmlProcessInfo_v1_t { pid, usedGpuMemory: mem })
    }

    fn nvmlDeviceGetGraphicsRunningProcesses_v2(device: nvmlDevice_t, infoCount: Out<c_uint>, infos: Buf<nvmlProcessInfo_v2_t>) {
        dev(device)?;
        fill_processes(&[], infoCount, infos, process_info)
    }

    fn nvmlDeviceGetGraphicsRunningProcesses_v3(device: nvmlDevice_t, infoCount: Out<c_uint>, infos: Buf<nvmlProcessInfo_t>) {
        dev(device)?;
        fill_processes(&[], infoCount, infos, process_info)
    }

    /// gpusim has no MPS server: always an empty list.
    fn nvmlDeviceGetMPSComputeRunningProcesses(device: nvmlDevice_t, infoCount: Out<c_uint>, infos: Buf<nvmlProcessInfo_v1_t>) {
        dev(device)?;
        fill_processes(&[], infoCount, infos, |pid, mem| nvmlProcessInfo_v1_t { pid, usedGpuMemory: mem })
    }

    fn nvmlDeviceGetMPSComputeRunningProcesses_v2(device: nvmlDevice_t, infoCount: Out<c_uint>, infos: Buf<nvmlProcessInfo_v2_t>) {
        dev(device)?;
        fill_processes(&[], infoCount, infos, process_info)
    }

    fn nvmlDeviceGetMPSComputeRunningProcesses_v3(device: nvmlDevice_t, infoCount: Out<c_uint>, infos: Buf<nvmlProcessInfo_t>) {
        dev(device)?;
        fill_processes(&[], infoCount, infos, process_info)
    }

    /// The versioned process list (`plist->version = nvmlProcessDetailList_v1`; a wrong
    /// version or mode is `NVML_ERROR_INVALID_ARGUMENT`, as nvml.h documents for this call).
    fn nvmlDeviceGetRunningProcessDetailList(device: nvmlDevice_t, plist: Out<nvmlProcessDetailList_t>) {
        let d = dev(device)?;
        let mut p = plist.read()?;
        if p.version != nvmlProcessDetailList_v1 {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let list = match p.mode {
            NVML_PROCESS_MODE_COMPUTE => compute_processes(&d)?,
            NVML_PROCESS_MODE_GRAPHICS | NVML_PROCESS_MODE_MPS => Vec::new(),
            _ => return Err(NVML_ERROR_INVALID_ARGUMENT),
        };
        let mut count = p.numProcArrayEntries;
        let res = fill_processes(&list, Out::from_mut(&mut count), p.procArray, |pid, mem| nvmlProcessDetail_v1_t {
            pid,
            usedGpuMemory: mem,
            gpuInstanceId: NO_MIG_ID,
            computeInstanceId: NO_MIG_ID,
            usedGpuCcProtectedMemory: 0,
        });
        p.numProcArrayEntries = count;
        plist.write(p)?;
        res
    }

    // ---- fixed modes -------------------------------------------------------------------

    fn nvmlDeviceGetComputeMode(device: nvmlDevice_t, mode: Out<nvmlComputeMode_t>) {
        dev(device)?;
        mode.write(NVML_COMPUTEMODE_DEFAULT)
    }

    fn nvmlDeviceGetPersistenceMode(device: nvmlDevice_t, mode: Out<nvmlEnableState_t>) {
        dev(device)?;
        mode.write(NVML_FEATURE_ENABLED)
    }

    fn nvmlDeviceGetDisplayMode(device: nvmlDevice_t, display: Out<nvmlEnableState_t>) {
        dev(device)?;
        display.write(NVML_FEATURE_DISABLED)
    }

    fn nvmlDeviceGetDisplayActive(device: nvmlDevice_t, isActive: Out<nvmlEnableState_t>) {
        dev(device)?;
        isActive.write(NVML_FEATURE_DISABLED)
    }

    fn nvmlDeviceGetEccMode(device: nvmlDevice_t, current: Out<nvmlEnableState_t>, pending: Out<nvmlEnableState_t>) {
        dev(device)?;
        if current.is_null() || pending.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        current.write(NVML_FEATURE_ENABLED)?;
        pending.write(NVML_FEATURE_ENABLED)
    }

    /// Windows only.
    fn nvmlDeviceGetDriverModel(device: nvmlDevice_t, _current: Out<nvmlDriverModel_t>, _pending: Out<nvmlDriverModel_t>) {
        dev(device)?;
        Err(NVML_ERROR_NOT_SUPPORTED)
    }

    /// Windows only.
    fn nvmlDeviceGetDriverModel_v2(device: nvmlDevice_t, _current: Out<nvmlDriverModel_t>, _pending: Out<nvmlDriverModel_t>) {
        dev(device)?;
        Err(NVML_ERROR_NOT_SUPPORTED)
    }

    fn nvmlDeviceGetBoardPartNumber(device: nvmlDevice_t, _partNumber: CharBuf, _length: c_uint) {
        dev(device)?;
        Err(NVML_ERROR_NOT_SUPPORTED)
    }

    fn nvmlDeviceGetInforomVersion(device: nvmlDevice_t, _object: nvmlInforomObject_t, _version: CharBuf, _length: c_uint) {
        dev(device)?;
        Err(NVML_ERROR_NOT_SUPPORTED)
    }

    fn nvmlDeviceGetInforomImageVersion(device: nvmlDevice_t, _version: CharBuf, _length: c_uint) {
        dev(device)?;
        Err(NVML_ERROR_NOT_SUPPORTED)
    }

    /// No confidential computing.
    fn nvmlDeviceGetConfComputeMemSizeInfo(device: nvmlDevice_t, _memInfo: Out<nvmlConfComputeMemSizeInfo_t>) {
        dev(device)?;
        Err(NVML_ERROR_NOT_SUPPORTED)
    }
}

fn handle_by_index(index: c_uint, device: Out<nvmlDevice_t>) -> NvmlResult {
    let st = state()?;
    if index as usize >= st.num_gpus() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    device.write(handle_of(index as usize))
}

fn handle_by_bus_id(bus_id: CStrIn, device: Out<nvmlDevice_t>) -> NvmlResult {
    let st = state()?;
    let s = bus_id.to_string()?;
    if device.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    let s = s.trim();
    // "domain:bus:device" names function 0.
    let with_func = if s.contains('.') {
        s.to_string()
    } else {
        format!("{s}.0")
    };
    let want = normalize_bus_id(&with_func).ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
    let g = st
        .config
        .gpu
        .iter()
        .position(|c| normalize_bus_id(&c.pci_bus_id).as_deref() == Some(want.as_str()))
        .ok_or(NVML_ERROR_NOT_FOUND)?;
    device.write(handle_of(g))
}

/// (pid, device memory) of every process with a context on the GPU, dead ones reaped first.
fn compute_processes(d: &Dev) -> Result<Vec<(c_uint, u64)>, nvmlReturn_t> {
    Ok(d.view()?
        .processes
        .iter()
        .filter(|p| p.contexts > 0)
        .map(|p| (p.pid, p.memory))
        .collect())
}

fn process_info(pid: c_uint, mem: u64) -> nvmlProcessInfo_t {
    nvmlProcessInfo_t {
        pid,
        usedGpuMemory: mem,
        gpuInstanceId: NO_MIG_ID,
        computeInstanceId: NO_MIG_ID,
    }
}

/// The `*infoCount` protocol: too small (0 included) → `NVML_ERROR_INSUFFICIENT_SIZE` with the
/// needed count; none running → success with 0 (`infos` may be NULL then); else the entries.
fn fill_processes<T: Copy>(
    list: &[(c_uint, u64)],
    info_count: Out<c_uint>,
    infos: Buf<T>,
    make: impl Fn(c_uint, u64) -> T,
) -> NvmlResult {
    let cap = info_count.read()? as usize;
    if list.len() > cap {
        info_count.write(list.len() as c_uint)?;
        return Err(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    let items: Vec<T> = list.iter().map(|&(pid, mem)| make(pid, mem)).collect();
    infos.write_all(&items, cap)?;
    info_count.write(items.len() as c_uint)
}

/// Copy `s` into a fixed C char array, NUL-terminated (truncated if it does not fit).
fn c_array<const N: usize>(s: &str) -> [c_char; N] {
    let mut out = [0 as c_char; N];
    for (o, b) in out.iter_mut().zip(s.bytes().take(N - 1)) {
        *o = b as c_char;
    }
    out
}

/// One known board: a name fragment, its PCI device id and subsystem id.
struct Model {
    name: &'static str,
    device_id: u32,
    subsys_id: u32,
}

/// Most specific fragments first ("A100-SXM4-80GB" before "A100", "L40S" before "L40").
const MODELS: &[Model] = &[
    Model {
        name: "A100-SXM4-80GB",
        device_id: 0x20B2,
        subsys_id: 0x1463,
    },
    Model {
        name: "A100-SXM4-40GB",
        device_id: 0x20B0,
        subsys_id: 0x134F,
    },
    Model {
        name: "A100 80GB PCIe",
        device_id: 0x20B5,
        subsys_id: 0x1533,
    },
    Model {
        name: "A100-PCIE-40GB",
        device_id: 0x20F1,
        subsys_id: 0x145F,
    },
    Model {
        name: "A100",
        device_id: 0x20B0,
        subsys_id: 0x134F,
    },
    Model {
        name: "A30",
        device_id: 0x20B7,
        subsys_id: 0x1532,
    },
    Model {
        name: "A10",
        device_id: 0x2236,
        subsys_id: 0x1482,
    },
    Model {
        name: "H100 80GB HBM3",
        device_id: 0x2330,
        subsys_id: 0x16C1,
    },
    Model {
        name: "H100 PCIe",
        device_id: 0x2331,
        subsys_id: 0x1626,
    },
    Model {
        name: "H100 NVL",
        device_id: 0x2321,
        subsys_id: 0x1839,
    },
    Model {
        name: "H100",
        device_id: 0x2330,
        subsys_id: 0x16C1,
    },
    Model {
        name: "H200",
        device_id: 0x2335,
        subsys_id: 0x18BE,
    },
    Model {
        name: "B200",
        device_id: 0x2901,
        subsys_id: 0x1999,
    },
    Model {
        name: "L40S",
        device_id: 0x26B9,
        subsys_id: 0x1851,
    },
    Model {
        name: "L40",
        device_id: 0x26B5,
        subsys_id: 0x169D,
    },
    Model {
        name: "L4",
        device_id: 0x27B8,
        subsys_id: 0x16CA,
    },
    Model {
        name: "T4",
        device_id: 0x1EB8,
        subsys_id: 0x12A2,
    },
    Model {
        name: "V100-SXM2-32GB",
        device_id: 0x1DB5,
        subsys_id: 0x1249,
    },
    Model {
        name: "V100-SXM2-16GB",
        device_id: 0x1DB1,
        subsys_id: 0x1212,
    },
    Model {
        name: "V100",
        device_id: 0x1DB4,
        subsys_id: 0x1214,
    },
];

const NVIDIA_VENDOR: u32 = 0x10DE;

/// (device id, subsystem id) of a GPU: by model name, else a typical part of its
/// architecture.
fn pci_ids(c: &GpuConfig) -> (u32, u32) {
    if let Some(m) = MODELS.iter().find(|m| c.name.contains(m.name)) {
        return (m.device_id, m.subsys_id);
    }
    let dev_id = match arch_of(c.cc()) {
        NVML_DEVICE_ARCH_VOLTA => 0x1DB1,
        NVML_DEVICE_ARCH_TURING => 0x1EB8,
        NVML_DEVICE_ARCH_AMPERE => 0x20B0,
        NVML_DEVICE_ARCH_ADA => 0x26B9,
        NVML_DEVICE_ARCH_HOPPER => 0x2330,
        NVML_DEVICE_ARCH_BLACKWELL => 0x2901,
        _ => 0x1000,
    };
    (dev_id, 0x1450)
}

pub fn pci_info(c: &GpuConfig) -> nvmlPciInfo_t {
    let (domain, bus, device, func) = c.pci_parts();
    let (dev_id, subsys) = pci_ids(c);
    nvmlPciInfo_t {
        busIdLegacy: c_array(&format!(
            "{:04X}:{bus:02X}:{device:02X}.{func:X}",
            domain & 0xffff
        )),
        domain,
        bus,
        device,
        pciDeviceId: (dev_id << 16) | NVIDIA_VENDOR,
        pciSubSystemId: (subsys << 16) | NVIDIA_VENDOR,
        busId: c_array(&format!("{domain:08X}:{bus:02X}:{device:02X}.{func:X}")),
    }
}

/// A stable 13-digit serial number from the UUID.
fn serial_of(c: &GpuConfig) -> String {
    let u = c.uuid_bytes();
    let x = u64::from_le_bytes([u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]]);
    format!("156{:010}", x % 10_000_000_000)
}

fn brand_of(name: &str) -> nvmlBrandType_t {
    let rtx = name.contains("RTX");
    if name.contains("GeForce") {
        if rtx {
            NVML_BRAND_GEFORCE_RTX
        } else {
            NVML_BRAND_GEFORCE
        }
    } else if name.contains("TITAN") {
        NVML_BRAND_TITAN
    } else if name.contains("Quadro") {
        NVML_BRAND_QUADRO
    } else if rtx {
        NVML_BRAND_NVIDIA_RTX
    } else {
        // Data-center parts (A100, H100, ...) report "NVIDIA" on current drivers.
        NVML_BRAND_NVIDIA
    }
}

pub fn arch_of((major, minor): (i32, i32)) -> nvmlDeviceArchitecture_t {
    match (major, minor) {
        (3, _) => NVML_DEVICE_ARCH_KEPLER,
        (5, _) => NVML_DEVICE_ARCH_MAXWELL,
        (6, _) => NVML_DEVICE_ARCH_PASCAL,
        (7, 0..=4) => NVML_DEVICE_ARCH_VOLTA,
        (7, _) => NVML_DEVICE_ARCH_TURING,
        (8, 9) => NVML_DEVICE_ARCH_ADA,
        (8, _) => NVML_DEVICE_ARCH_AMPERE,
        (9, _) => NVML_DEVICE_ARCH_HOPPER,
        (10.., _) => NVML_DEVICE_ARCH_BLACKWELL,
        _ => NVML_DEVICE_ARCH_UNKNOWN,
    }
}

/// Memory bus width in bits: HBM parts (x.0 data-center chips) are wide, others GDDR.
fn bus_width_of(cc: (i32, i32)) -> c_uint {
    match cc {
        (7, 0) => 4096,
        (8, 0) | (9, 0) => 5120,
        (10, 0) => 8192,
        (7, 5) => 256,
        _ => 384,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpusim_core::Config;

    fn c_str(a: &[c_char]) -> String {
        let bytes: Vec<u8> = a
            .iter()
            .take_while(|&&c| c != 0)
            .map(|&c| c as u8)
            .collect();
        String::from_utf8(bytes).unwrap()
    }

    #[test]
    fn pci_info_of_default_gpu() {
        let c = Config::default_config();
        let p = pci_info(&c.gpu[1]);
        assert_eq!(c_str(&p.busId), "00000000:0F:00.0");
        assert_eq!(c_str(&p.busIdLegacy), "0000:0F:00.0");
        assert_eq!((p.domain, p.bus, p.device), (0, 0x0f, 0));
        assert_eq!(p.pciDeviceId, 0x20B0_10DE);
        assert_eq!(p.pciSubSystemId, 0x134F_10DE);
    }

    #[test]
    fn architectures_follow_compute_capability() {
        assert_eq!(arch_of((7, 0)), NVML_DEVICE_ARCH_VOLTA);
        assert_eq!(arch_of((7, 5)), NVML_DEVICE_ARCH_TURING);
        assert_eq!(arch_of((8, 0)), NVML_DEVICE_ARCH_AMPERE);
        assert_eq!(arch_of((8, 6)), NVML_DEVICE_ARCH_AMPERE);
        assert_eq!(arch_of((8, 9)), NVML_DEVICE_ARCH_ADA);
        assert_eq!(arch_of((9, 0)), NVML_DEVICE_ARCH_HOPPER);
        assert_eq!(arch_of((10, 0)), NVML_DEVICE_ARCH_BLACKWELL);
        assert_eq!(arch_of((12, 0)), NVML_DEVICE_ARCH_BLACKWELL);
        assert_eq!(arch_of((4, 0)), NVML_DEVICE_ARCH_UNKNOWN);
    }

    #[test]
    fn process_list_protocol() {
        let list = [(10, 100), (11, 200)];
        let mk = |pid, mem| nvmlProcessInfo_v1_t {
            pid,
            usedGpuMemory: mem,
        };
        // size query with count 0 and NULL infos
        let mut n: c_uint = 0;
        let r = fill_processes(&list, Out::from_mut(&mut n), Buf::null(), mk);
        assert_eq!((r, n), (Err(NVML_ERROR_INSUFFICIENT_SIZE), 2));
        // nothing running: success, count 0
        let mut n: c_uint = 0;
        assert_eq!(
            fill_processes(&[], Out::from_mut(&mut n), Buf::null(), mk),
            Ok(())
        );
        assert_eq!(n, 0);
        // big enough
        let mut out = [mk(0, 0); 5];
        let mut n: c_uint = 5;
        assert_eq!(
            fill_processes(&list, Out::from_mut(&mut n), Buf::from_slice(&mut out), mk),
            Ok(())
        );
        assert_eq!(n, 2);
        assert_eq!(out[1], mk(11, 200));
        // count > 0 but NULL infos
        let mut n: c_uint = 5;
        assert_eq!(
            fill_processes(&list, Out::from_mut(&mut n), Buf::null(), mk),
            Err(NVML_ERROR_INVALID_ARGUMENT)
        );
    }

    #[test]
    fn serial_is_13_digits_and_stable() {
        let c = Config::default_config();
        let s = serial_of(&c.gpu[0]);
        assert_eq!(s.len(), 13);
        assert!(s.bytes().all(|b| b.is_ascii_digit()));
        assert_ne!(s, serial_of(&c.gpu[1]));
    }
}
