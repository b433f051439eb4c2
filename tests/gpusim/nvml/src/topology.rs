//! Topology from the config's `[[link]]` tables: PCIe common ancestors, nearest GPUs, P2P
//! capabilities, NVLink lanes (link indices of a GPU are handed to its peers in config order),
//! CPU/memory affinity and NUMA node, and the field values tools read for NVLink.

use std::ffi::{c_int, c_uint, c_ulong};

use gpusim_core::{Config, PcieLevel};

use crate::device::{arch_of, pci_info};
use crate::ffi::{handle_of, Buf, Out};
use crate::system::fill_handles;
use crate::types::*;
use crate::{dev, Dev};

/// `nvmlIntNvLinkDeviceType_t` values.
const NVML_NVLINK_DEVICE_TYPE_GPU: c_uint = 0;
pub type nvmlIntNvLinkDeviceType_t = c_uint;

nvml_api! {
    /// The same GPU is `NVML_TOPOLOGY_INTERNAL`; others as their `[[link]]` `pcie` says.
    fn nvmlDeviceGetTopologyCommonAncestor(device1: nvmlDevice_t, device2: nvmlDevice_t, pathInfo: Out<nvmlGpuTopologyLevel_t>) {
        let a = dev(device1)?;
        let b = dev(device2)?;
        pathInfo.write(level_between(&a.st.config, a.g, b.g))
    }

    /// Other GPUs no farther than `level`. `*count == 0` asks for the number.
    fn nvmlDeviceGetTopologyNearestGpus(device: nvmlDevice_t, level: nvmlGpuTopologyLevel_t, count: Out<c_uint>, deviceArray: Buf<nvmlDevice_t>) {
        let d = dev(device)?;
        let valid = [
            NVML_TOPOLOGY_INTERNAL,
            NVML_TOPOLOGY_SINGLE,
            NVML_TOPOLOGY_MULTIPLE,
            NVML_TOPOLOGY_HOSTBRIDGE,
            NVML_TOPOLOGY_NODE,
            NVML_TOPOLOGY_SYSTEM,
        ];
        if !valid.contains(&level) {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let near: Vec<nvmlDevice_t> = (0..d.st.num_gpus())
            .filter(|&o| o != d.g && level_between(&d.st.config, d.g, o) <= level)
            .map(handle_of)
            .collect();
        fill_handles(&near, count, deviceArray)
    }

    /// NVLINK: OK iff NVLink lanes join the two. READ/WRITE/ATOMICS: OK over NVLink or
    /// within one PCIe host bridge, else `NVML_P2P_STATUS_CHIPSET_NOT_SUPPORED`. PCI: OK within
    /// one host bridge. A GPU with itself: `NVML_P2P_STATUS_NOT_SUPPORTED`.
    fn nvmlDeviceGetP2PStatus(device1: nvmlDevice_t, device2: nvmlDevice_t, p2pIndex: nvmlGpuP2PCapsIndex_t, p2pStatus: Out<nvmlGpuP2PStatus_t>) {
        let a = dev(device1)?;
        let b = dev(device2)?;
        if p2pIndex > NVML_P2P_CAPS_INDEX_PCI {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        p2pStatus.write(p2p_status(&a.st.config, a.g, b.g, p2pIndex))
    }

    /// Links below the GPU's lane count are active; links up to `NVML_NVLINK_MAX_LINKS` exist
    /// but are inactive.
    fn nvmlDeviceGetNvLinkState(device: nvmlDevice_t, link: c_uint, isActive: Out<nvmlEnableState_t>) {
        let d = dev(device)?;
        let state = if lane_peer(&d, link)?.is_some() { NVML_FEATURE_ENABLED } else { NVML_FEATURE_DISABLED };
        isActive.write(state)
    }

    /// The `nvmlNvlinkVersion_t` of the GPU's architecture (3.0 for A100).
    fn nvmlDeviceGetNvLinkVersion(device: nvmlDevice_t, link: c_uint, version: Out<c_uint>) {
        let d = dev(device)?;
        lane_peer(&d, link)?.ok_or(NVML_ERROR_NOT_SUPPORTED)?;
        version.write(nvlink_version(d.cfg().cc()))
    }

    fn nvmlDeviceGetNvLinkCapability(device: nvmlDevice_t, link: c_uint, capability: nvmlNvLinkCapability_t, capResult: Out<c_uint>) {
        let d = dev(device)?;
        let active = lane_peer(&d, link)?.is_some();
        let has = match capability {
            NVML_NVLINK_CAP_P2P_SUPPORTED | NVML_NVLINK_CAP_P2P_ATOMICS | NVML_NVLINK_CAP_VALID => active,
            NVML_NVLINK_CAP_SYSMEM_ACCESS | NVML_NVLINK_CAP_SYSMEM_ATOMICS | NVML_NVLINK_CAP_SLI_BRIDGE => false,
            _ => return Err(NVML_ERROR_INVALID_ARGUMENT),
        };
        capResult.write(c_uint::from(has))
    }

    fn nvmlDeviceGetNvLinkRemotePciInfo(device: nvmlDevice_t, link: c_uint, pci: Out<nvmlPciInfo_t>) {
        remote_pci_info(device, link, pci)
    }

    /// The PCI identity of the GPU at the other end of `link`.
    fn nvmlDeviceGetNvLinkRemotePciInfo_v2(device: nvmlDevice_t, link: c_uint, pci: Out<nvmlPciInfo_t>) {
        remote_pci_info(device, link, pci)
    }

    /// Every NVLink in gpusim joins two GPUs (no NVSwitch).
    fn nvmlDeviceGetNvLinkRemoteDeviceType(device: nvmlDevice_t, link: c_uint, pNvLinkDeviceType: Out<nvmlIntNvLinkDeviceType_t>) {
        let d = dev(device)?;
        lane_peer(&d, link)?.ok_or(NVML_ERROR_NOT_SUPPORTED)?;
        pNvLinkDeviceType.write(NVML_NVLINK_DEVICE_TYPE_GPU)
    }

    // ---- affinity ----------------------------------------------------------------------

    /// The CPUs of the GPU's NUMA node (all online CPUs if the host has no such node).
    fn nvmlDeviceGetCpuAffinity(device: nvmlDevice_t, cpuSetSize: c_uint, cpuSet: Buf<c_ulong>) {
        let d = dev(device)?;
        cpu_affinity(&d, cpuSetSize, cpuSet)
    }

    fn nvmlDeviceGetCpuAffinityWithinScope(device: nvmlDevice_t, cpuSetSize: c_uint, cpuSet: Buf<c_ulong>, scope: nvmlAffinityScope_t) {
        let d = dev(device)?;
        if scope != NVML_AFFINITY_SCOPE_NODE && scope != NVML_AFFINITY_SCOPE_SOCKET {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        cpu_affinity(&d, cpuSetSize, cpuSet)
    }

    /// The GPU's NUMA node (node 0 when the config says -1).
    fn nvmlDeviceGetMemoryAffinity(device: nvmlDevice_t, nodeSetSize: c_uint, nodeSet: Buf<c_ulong>, scope: nvmlAffinityScope_t) {
        let d = dev(device)?;
        if nodeSetSize == 0 || nodeSet.is_null() || (scope != NVML_AFFINITY_SCOPE_NODE && scope != NVML_AFFINITY_SCOPE_SOCKET) {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let node = d.cfg().numa_node.max(0) as usize;
        nodeSet.write_all(&bitmask(&[node], nodeSetSize as usize), nodeSetSize as usize)
    }

    /// The config's `numa_node`; `NVML_ERROR_NOT_SUPPORTED` when it is -1 (no NUMA placement).
    fn nvmlDeviceGetNumaNodeId(device: nvmlDevice_t, node: Out<c_uint>) {
        let d = dev(device)?;
        let n = d.cfg().numa_node;
        if n < 0 {
            return Err(NVML_ERROR_NOT_SUPPORTED);
        }
        node.write(n as c_uint)
    }

    // ---- field values ------------------------------------------------------------------

    /// Answers `NVML_FI_DEV_NVLINK_LINK_COUNT` and the NVLink throughput counters (always 0:
    /// gpusim moves no data); every other field gets `NVML_ERROR_NOT_SUPPORTED` in its own
    /// `nvmlReturn`.
    fn nvmlDeviceGetFieldValues(device: nvmlDevice_t, valuesCount: c_int, values: Buf<nvmlFieldValue_t>) {
        let d = dev(device)?;
        if valuesCount < 0 || values.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let n = valuesCount as usize;
        let lanes = nvlink_peers(&d.st.config, d.g).len() as c_uint;
        let now_us = wall_us();
        let mut vals = values.read_all(n)?;
        for v in vals.iter_mut() {
            v.timestamp = now_us;
            v.latencyUsec = 0;
            let (ret, ty, val) = match v.fieldId {
                NVML_FI_DEV_NVLINK_LINK_COUNT => (NVML_SUCCESS, NVML_VALUE_TYPE_UNSIGNED_INT, nvmlValue_t::uint(lanes)),
                NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX..=NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_RX if lanes == 0 => {
                    (NVML_ERROR_NOT_SUPPORTED, NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, nvmlValue_t { ullVal: 0 })
                }
                NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX..=NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_RX => {
                    // scopeId is the link; u32::MAX means all links together.
                    let ok = v.scopeId < lanes || v.scopeId == c_uint::MAX;
                    let ret = if ok { NVML_SUCCESS } else { NVML_ERROR_INVALID_ARGUMENT };
                    (ret, NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, nvmlValue_t { ullVal: 0 })
                }
                _ => (NVML_ERROR_NOT_SUPPORTED, NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, nvmlValue_t { ullVal: 0 }),
            };
            v.nvmlReturn = ret;
            v.valueType = ty;
            v.value = val;
        }
        values.write_all(&vals, n)
    }
}

fn level_between(c: &Config, a: usize, b: usize) -> nvmlGpuTopologyLevel_t {
    if a == b {
        NVML_TOPOLOGY_INTERNAL
    } else {
        c.link_between(a, b).0.nvml_level()
    }
}

fn p2p_status(c: &Config, a: usize, b: usize, index: nvmlGpuP2PCapsIndex_t) -> nvmlGpuP2PStatus_t {
    if a == b {
        return NVML_P2P_STATUS_NOT_SUPPORTED;
    }
    let (pcie, lanes) = c.link_between(a, b);
    let same_bridge = pcie.nvml_level() <= PcieLevel::HostBridge.nvml_level();
    let ok = match index {
        NVML_P2P_CAPS_INDEX_NVLINK => lanes > 0,
        NVML_P2P_CAPS_INDEX_READ | NVML_P2P_CAPS_INDEX_WRITE | NVML_P2P_CAPS_INDEX_ATOMICS => {
            lanes > 0 || same_bridge
        }
        _ => same_bridge,
    };
    match (ok, index) {
        (true, _) => NVML_P2P_STATUS_OK,
        (false, NVML_P2P_CAPS_INDEX_NVLINK) => NVML_P2P_STATUS_NOT_SUPPORTED,
        (false, _) => NVML_P2P_STATUS_CHIPSET_NOT_SUPPORED,
    }
}

/// The peer at the far end of each of GPU `g`'s NVLink lanes, by link index: lanes are handed
/// out to the `[[link]]` tables naming `g` in config order (at most 18).
pub fn nvlink_peers(c: &Config, g: usize) -> Vec<usize> {
    let mut peers = Vec::new();
    for l in &c.link {
        let peer = match l.gpus {
            [a, b] if a == g => b,
            [a, b] if b == g => a,
            _ => continue,
        };
        peers.extend(std::iter::repeat_n(peer, l.nvlinks as usize));
    }
    peers.truncate(NVML_NVLINK_MAX_LINKS as usize);
    peers
}

/// The peer on `link` of the device, `None` for an inactive link, or
/// `NVML_ERROR_INVALID_ARGUMENT` past `NVML_NVLINK_MAX_LINKS`.
fn lane_peer(d: &Dev, link: c_uint) -> Result<Option<usize>, nvmlReturn_t> {
    if link >= NVML_NVLINK_MAX_LINKS {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    Ok(nvlink_peers(&d.st.config, d.g).get(link as usize).copied())
}

fn remote_pci_info(device: nvmlDevice_t, link: c_uint, pci: Out<nvmlPciInfo_t>) -> NvmlResult {
    let d = dev(device)?;
    let peer = lane_peer(&d, link)?.ok_or(NVML_ERROR_NOT_SUPPORTED)?;
    pci.write(pci_info(&d.st.config.gpu[peer]))
}

fn nvlink_version(cc: (i32, i32)) -> c_uint {
    match (arch_of(cc), cc) {
        (NVML_DEVICE_ARCH_PASCAL, _) => NVML_NVLINK_VERSION_1_0,
        (NVML_DEVICE_ARCH_VOLTA, _) => NVML_NVLINK_VERSION_2_0,
        (NVML_DEVICE_ARCH_TURING, _) => NVML_NVLINK_VERSION_2_2,
        (NVML_DEVICE_ARCH_AMPERE, (8, 0)) => NVML_NVLINK_VERSION_3_0,
        (NVML_DEVICE_ARCH_AMPERE | NVML_DEVICE_ARCH_ADA, _) => NVML_NVLINK_VERSION_3_1,
        (NVML_DEVICE_ARCH_HOPPER, _) => NVML_NVLINK_VERSION_4_0,
        _ => NVML_NVLINK_VERSION_5_0,
    }
}

fn cpu_affinity(d: &Dev, size: c_uint, set: Buf<c_ulong>) -> NvmlResult {
    if size == 0 || set.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    let node = d.cfg().numa_node.max(0);
    let cpus = read_cpu_list(&format!("/sys/devices/system/node/node{node}/cpulist"))
        .or_else(|| read_cpu_list("/sys/devices/system/cpu/online"))
        .unwrap_or_else(|| vec![0]);
    set.write_all(&bitmask(&cpus, size as usize), size as usize)
}

fn read_cpu_list(path: &str) -> Option<Vec<usize>> {
    parse_cpu_list(std::fs::read_to_string(path).ok()?.trim())
}

/// Parse a kernel CPU list such as "0-3,8,10-11".
fn parse_cpu_list(s: &str) -> Option<Vec<usize>> {
    let mut out = Vec::new();
    for part in s.split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => out.extend(a.parse::<usize>().ok()?..=b.parse::<usize>().ok()?),
            None => out.push(part.parse().ok()?),
        }
    }
    (!out.is_empty()).then_some(out)
}

/// `words` 64-bit words with the given bits set (bits past the end dropped).
fn bitmask(bits: &[usize], words: usize) -> Vec<c_ulong> {
    let mut v = vec![0 as c_ulong; words];
    let w = c_ulong::BITS as usize;
    for &b in bits {
        if let Some(word) = v.get_mut(b / w) {
            *word |= 1 << (b % w);
        }
    }
    v
}

fn wall_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    const THREE: &str = r#"
[[gpu]]
name = "NVIDIA A100-SXM4-80GB"
uuid = "GPU-00000000-0000-0000-0000-000000000001"
memory_mib = 81920
sm_count = 108
max_threads_per_sm = 2048
compute_capability = "8.0"
pci_bus_id = "00000000:07:00.0"

[[gpu]]
name = "NVIDIA A100-SXM4-80GB"
uuid = "GPU-00000000-0000-0000-0000-000000000002"
memory_mib = 81920
sm_count = 108
max_threads_per_sm = 2048
compute_capability = "8.0"
pci_bus_id = "00000000:0F:00.0"

[[gpu]]
name = "NVIDIA A100-SXM4-80GB"
uuid = "GPU-00000000-0000-0000-0000-000000000003"
memory_mib = 81920
sm_count = 108
max_threads_per_sm = 2048
compute_capability = "8.0"
pci_bus_id = "00000000:47:00.0"
numa_node = 1

[[link]]
gpus = [0, 1]
nvlinks = 4
pcie = "switch"

[[link]]
gpus = [2, 0]
nvlinks = 2
"#;

    #[test]
    fn lanes_go_to_peers_in_config_order() {
        let c = Config::parse(THREE, "t").unwrap();
        assert_eq!(nvlink_peers(&c, 0), vec![1, 1, 1, 1, 2, 2]);
        assert_eq!(nvlink_peers(&c, 1), vec![0; 4]);
        assert_eq!(nvlink_peers(&c, 2), vec![0, 0]);
    }

    #[test]
    fn p2p_follows_links() {
        let c = Config::parse(THREE, "t").unwrap();
        assert_eq!(level_between(&c, 0, 0), NVML_TOPOLOGY_INTERNAL);
        assert_eq!(level_between(&c, 0, 1), NVML_TOPOLOGY_SINGLE);
        assert_eq!(level_between(&c, 0, 2), NVML_TOPOLOGY_SYSTEM);
        assert_eq!(level_between(&c, 1, 2), NVML_TOPOLOGY_SYSTEM);
        assert_eq!(
            p2p_status(&c, 0, 2, NVML_P2P_CAPS_INDEX_NVLINK),
            NVML_P2P_STATUS_OK
        );
        assert_eq!(
            p2p_status(&c, 0, 2, NVML_P2P_CAPS_INDEX_READ),
            NVML_P2P_STATUS_OK
        );
        assert_eq!(
            p2p_status(&c, 0, 2, NVML_P2P_CAPS_INDEX_PCI),
            NVML_P2P_STATUS_CHIPSET_NOT_SUPPORED
        );
        assert_eq!(
            p2p_status(&c, 1, 2, NVML_P2P_CAPS_INDEX_NVLINK),
            NVML_P2P_STATUS_NOT_SUPPORTED
        );
        assert_eq!(
            p2p_status(&c, 1, 2, NVML_P2P_CAPS_INDEX_WRITE),
            NVML_P2P_STATUS_CHIPSET_NOT_SUPPORED
        );
        assert_eq!(
            p2p_status(&c, 0, 1, NVML_P2P_CAPS_INDEX_PCI),
            NVML_P2P_STATUS_OK
        );
    }

    #[test]
    fn cpu_lists_and_masks() {
        assert_eq!(
            parse_cpu_list("0-3,8,10-11"),
            Some(vec![0, 1, 2, 3, 8, 10, 11])
        );
        assert_eq!(parse_cpu_list(""), None);
        assert_eq!(parse_cpu_list("x"), None);
        assert_eq!(bitmask(&[0, 1, 65, 200], 2), vec![0b11, 0b10]);
    }
}
