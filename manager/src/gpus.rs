//! The node's GPUs through NVML: inventory and topology at start (fast: registration must
//! not wait on slow NVML work), XID health afterwards, and per-process samples for the
//! control loop. What they mean (the [`Inventory`] type, the XID health rule) is in
//! `vcuda_manager_core::inventory`.

use std::ffi::OsStr;
use std::path::Path;
use std::time::Duration;

use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::TopologyLevel;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::Nvml;

use vcuda_manager_core::allocation::Gpu;
use vcuda_manager_core::inventory::Inventory;
use vcuda_manager_core::placement::{Link, Node};

/// Most NVLink lanes a GPU has (NVML_NVLINK_MAX_LINKS).
const MAX_NVLINKS: u32 = 18;

/// Load NVML (the given library, or the system's `libnvidia-ml.so.1`). Leaked: the daemon
/// uses it until it exits, and event sets borrow it from other threads.
pub fn open(lib: Option<&Path>) -> Result<&'static Nvml, NvmlError> {
    let nvml = match lib {
        Some(p) => Nvml::builder().lib_path(p.as_os_str()).init()?,
        None => Nvml::builder()
            .lib_path(OsStr::new("libnvidia-ml.so.1"))
            .init()?,
    };
    Ok(Box::leak(Box::new(nvml)))
}

/// Find the GPUs, their memory, device minors and how they are connected.
pub fn discover(nvml: &Nvml) -> Result<Inventory, NvmlError> {
    let n = nvml.device_count()?;
    let mut gpus = Vec::new();
    let mut bus = Vec::new();
    let (mut models, mut compute) = (Vec::new(), Vec::new());
    for i in 0..n {
        let d = nvml.device_by_index(i)?;
        models.push(d.name().unwrap_or_default());
        compute.push(
            d.cuda_compute_capability()
                .map(|c| format!("{}.{}", c.major, c.minor))
                .unwrap_or_default(),
        );
        gpus.push(Gpu {
            uuid: d.uuid()?,
            memory: d.memory_info()?.total,
            minor: d.minor_number().unwrap_or(i),
        });
        bus.push(d.pci_info().map(|p| p.bus_id).unwrap_or_default());
    }
    let mut links = vec![vec![Link::System; gpus.len()]; gpus.len()];
    for (a, row) in links.iter_mut().enumerate() {
        let da = nvml.device_by_index(a as u32)?;
        for (b, link) in row.iter_mut().enumerate() {
            if a == b {
                continue;
            }
            let lanes = (0..MAX_NVLINKS)
                .filter(|&l| {
                    let link = da.link_wrapper_for(l);
                    link.is_active().unwrap_or(false)
                        && link
                            .remote_pci_info()
                            .is_ok_and(|p| same_bus(&p.bus_id, &bus[b]))
                })
                .count() as u32;
            *link = if lanes > 0 {
                Link::NvLink(lanes)
            } else {
                let db = nvml.device_by_index(b as u32)?;
                match da.topology_common_ancestor(db) {
                    Ok(TopologyLevel::Internal | TopologyLevel::Single) => Link::Switch,
                    Ok(TopologyLevel::Multiple) => Link::MultiSwitch,
                    Ok(TopologyLevel::HostBridge) => Link::HostBridge,
                    Ok(TopologyLevel::Node) => Link::Node,
                    _ => Link::System,
                }
            };
        }
    }
    let numa = bus.iter().map(|b| numa_node(b)).collect();
    let node = Node {
        uuids: gpus.iter().map(|g| g.uuid.clone()).collect(),
        memory: gpus.iter().map(|g| g.memory).collect(),
        links,
    };
    Ok(Inventory {
        gpus,
        node,
        numa,
        models,
        compute,
    })
}

/// PCI bus ids compare without case and whatever the domain's width.
pub(crate) fn same_bus(a: &str, b: &str) -> bool {
    fn norm(s: &str) -> String {
        let s = s.trim_end_matches('\0').to_ascii_lowercase();
        match s.split(':').collect::<Vec<_>>().as_slice() {
            [domain, bus, dev] => format!(
                "{:x}:{bus}:{dev}",
                u64::from_str_radix(domain, 16).unwrap_or(0)
            ),
            _ => s,
        }
    }
    norm(a) == norm(b)
}

/// The GPU's NUMA node from sysfs (`-1` or unreadable: none).
fn numa_node(bus_id: &str) -> Option<i64> {
    let bdf = bus_id.trim_end_matches('\0').to_ascii_lowercase();
    let bdf = bdf
        .strip_prefix("0000")
        .map_or(bdf.clone(), |r| r.to_string());
    for candidate in [bdf.clone(), format!("0000{bdf}")] {
        let p = format!("/sys/bus/pci/devices/{candidate}/numa_node");
        if let Ok(s) = std::fs::read_to_string(&p) {
            return s.trim().parse::<i64>().ok().filter(|&n| n >= 0);
        }
    }
    None
}

/// Block on NVML's XID events of every GPU and hand each to `on_xid(gpu index, xid)`;
/// returns when `stop()` says so (checked every `poll`). Runs on its own thread.
pub fn watch_xids(
    nvml: &'static Nvml,
    uuids: &[String],
    poll: Duration,
    stop: &dyn Fn() -> bool,
    on_xid: &mut dyn FnMut(usize, Option<u64>),
) -> Result<(), NvmlError> {
    let mut set = nvml.create_event_set()?;
    for i in 0..uuids.len() {
        let d = nvml.device_by_index(i as u32)?;
        set = d
            .register_events(EventTypes::CRITICAL_XID_ERROR, set)
            .map_err(|e| e.error)?;
    }
    while !stop() {
        match set.wait(poll.as_millis() as u32) {
            Ok(ev) => {
                let uuid = ev.device.uuid().unwrap_or_default();
                let g = uuids.iter().position(|u| *u == uuid).unwrap_or(usize::MAX);
                let xid = match ev.event_data {
                    Some(XidError::Value(x)) => Some(x),
                    _ => None,
                };
                on_xid(g, xid);
            }
            Err(NvmlError::Timeout) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// One process's memory on a GPU, from NVML.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcMemory {
    pub pid: u32,
    pub bytes: u64,
}

/// Processes with a context on GPU `index` and the memory the driver charges them.
pub fn processes(nvml: &Nvml, index: u32) -> Result<Vec<ProcMemory>, NvmlError> {
    let d = nvml.device_by_index(index)?;
    Ok(d.running_compute_processes()?
        .into_iter()
        .map(|p| ProcMemory {
            pid: p.pid,
            bytes: match p.used_gpu_memory {
                UsedGpuMemory::Used(b) => b,
                UsedGpuMemory::Unavailable => 0,
            },
        })
        .collect())
}

/// A process's utilization sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcUtil {
    pub pid: u32,
    pub sm_util: u32,
    pub timestamp_us: u64,
}

/// What one GPU did lately.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GpuSample {
    pub memory_used: u64,
    pub utilization: Option<u32>,
    /// Samples newer than the `last_seen` asked with.
    pub processes: Vec<ProcUtil>,
}

/// GPU `index`'s memory in use, utilization and per-process samples newer than
/// `last_seen_us` (whatever NVML cannot answer is left empty).
pub fn sample(nvml: &Nvml, index: u32, last_seen_us: u64) -> GpuSample {
    let Ok(d) = nvml.device_by_index(index) else {
        return GpuSample::default();
    };
    GpuSample {
        memory_used: d.memory_info().map_or(0, |m| m.used),
        utilization: d.utilization_rates().ok().map(|u| u.gpu),
        processes: d
            .process_utilization_stats(last_seen_us)
            .map(|v| {
                v.into_iter()
                    .map(|s| ProcUtil {
                        pid: s.pid,
                        sm_util: s.sm_util,
                        timestamp_us: s.timestamp,
                    })
                    .collect()
            })
            .unwrap_or_default(),
    }
}

/// GPU `index`'s product name.
pub fn name(nvml: &Nvml, index: u32) -> Result<String, NvmlError> {
    nvml.device_by_index(index)?.name()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_ids_compare_with_or_without_domain() {
        assert!(same_bus("00000000:07:00.0", "0000:07:00.0"));
        assert!(same_bus("00000000:0F:00.0", "00000000:0f:00.0"));
        assert!(!same_bus("00000000:07:00.0", "00000000:0F:00.0"));
    }
}
