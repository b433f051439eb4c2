//! The control loop, at NVML's sampling cadence (~1/6 s): for every started allocation,
//! reclaim what dead processes held, write its compute share into its region (hard or
//! elastic), and run the watchdog — the memory the *driver* reports for the container's
//! processes against its quota, which catches a process that bypasses the library (static
//! binary, raw ioctls). Every ~10 s, allocations whose container the kubelet no longer
//! lists are removed.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use nvml_wrapper::Nvml;
use tracing::{info, warn};
use vcuda_contract::config::parse_uuid;
use vcuda_contract::region::Region;

use crate::allocation::Allocation;
use crate::gpus;
use crate::identity;
use crate::ids::Kind;
use crate::metrics::{ContainerRow, GpuRow, Snapshot};
use crate::plugin::Shared;

const PERIOD: Duration = Duration::from_millis(167);
const GC_PERIOD: Duration = Duration::from_secs(10);
/// How often pod UIDs still unknown are looked up in the kubelet's checkpoint.
const UID_LOOKUP_PERIOD: Duration = Duration::from_secs(1);
/// An allocation is not collected before its container had time to start.
const GC_GRACE_SECS: u64 = 120;

/// Which allocation a host process belongs to: registered host pids first, then the pod
/// cgroup of unregistered ones (which is how a bypassing process is found).
pub fn owner_of(
    pid: u32,
    registered: &HashMap<u32, String>,
    by_uid: &BTreeMap<String, String>,
    cgroup: &dyn Fn(u32) -> Option<String>,
) -> Option<String> {
    if let Some(a) = registered.get(&pid) {
        return Some(a.clone());
    }
    let text = cgroup(pid)?;
    by_uid
        .iter()
        .find(|(uid, _)| identity::in_pod(&text, uid))
        .map(|(_, a)| a.clone())
}

/// Containers over their quota: (allocation, GPU index, driver-reported bytes, quota).
pub fn violations(
    usage: &BTreeMap<(String, usize), u64>,
    quota: &dyn Fn(&str, usize) -> Option<u64>,
) -> Vec<(String, usize, u64, u64)> {
    usage
        .iter()
        .filter_map(|((a, g), &used)| {
            let q = quota(a, *g)?;
            (used > q).then(|| (a.clone(), *g, used, q))
        })
        .collect()
}

/// Start the loop on a thread of its own: its work (NVML, /proc, regions, the kubelet's
/// checkpoint) blocks, and the gRPC services' runtime threads must stay free for the
/// kubelet. `rt` runs the one asynchronous step (PodResources for garbage collection).
pub fn start(
    nvml: &'static Nvml,
    shared: Arc<Shared>,
    rt: tokio::runtime::Handle,
) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("control-loop".into())
        .spawn(move || run(nvml, shared, rt))
        .map(|_| ())
}

fn run(nvml: &'static Nvml, shared: Arc<Shared>, rt: tokio::runtime::Handle) {
    let mut regions: HashMap<String, Region> = HashMap::new();
    let mut over_before: Vec<(String, usize)> = Vec::new();
    // Watchdog violations per (allocation, GPU) since start: the metric.
    let mut violated: HashMap<(String, usize), u64> = HashMap::new();
    let mut last_gc = Instant::now();
    let mut last_uid_lookup = Instant::now() - UID_LOOKUP_PERIOD;
    let mut next = Instant::now();
    loop {
        // A fixed cadence; a slow round is not made up for by a burst of quick ones.
        next = (next + PERIOD).max(Instant::now());
        std::thread::sleep(next.saturating_duration_since(Instant::now()));
        // Pod UIDs (for attributing processes by cgroup) of containers none of whose
        // processes registered yet — e.g. one that bypasses the library. The kubelet's
        // checkpoint is read at most once a second for this, and outside the lock.
        if last_uid_lookup.elapsed() >= UID_LOOKUP_PERIOD && shared.core.lock().uids_wanted() {
            last_uid_lookup = Instant::now();
            let path = shared.core.lock().settings.kubelet_checkpoint.clone();
            let entries = crate::core::read_checkpoint(&path);
            shared.core.lock().apply_pod_uids(&entries);
        }
        let (allocs, settings, layout_region, gpu_memory, placed, uuids) = {
            let c = shared.core.lock();
            // What is allocated on each GPU (started or not), for the metrics.
            let placed: Vec<(Vec<String>, u32, u64)> = c
                .allocations()
                .map(|a| (a.gpus.clone(), a.percent, a.quota))
                .collect();
            let gpu_memory: Vec<u64> = c.inventory.gpus.iter().map(|g| g.memory).collect();
            let allocs: Vec<Allocation> =
                c.allocations().filter(|a| a.finished()).cloned().collect();
            let files: HashMap<String, std::path::PathBuf> = allocs
                .iter()
                .map(|a| (a.id.clone(), c.layout.region_file(&a.id)))
                .collect();
            (
                allocs,
                c.settings.clone(),
                files,
                gpu_memory,
                placed,
                c.inventory.node.uuids.clone(),
            )
        };
        regions.retain(|id, _| allocs.iter().any(|a| &a.id == id));
        let mut registered: HashMap<u32, String> = HashMap::new();
        for a in &allocs {
            if !regions.contains_key(&a.id) {
                let ids: Vec<[u8; 16]> = a.gpus.iter().filter_map(|u| parse_uuid(u)).collect();
                match Region::open_or_create(&layout_region[&a.id], &ids) {
                    Ok(r) => {
                        regions.insert(a.id.clone(), r);
                    }
                    Err(e) => {
                        warn!(allocation = %a.id, error = %e, "cannot open the region");
                        continue;
                    }
                }
            }
            let r = &regions[&a.id];
            let n = r.reclaim_dead(false);
            if n > 0 {
                info!(allocation = %a.id, processes = n, "reclaimed dead processes");
            }
            let share = if a.percent >= 100 {
                1_000_000
            } else {
                u64::from(a.percent) * 10_000
            };
            let limit = a
                .core_limit
                .filter(|&l| l > a.percent)
                .map_or(0, |l| u64::from(l) * 10_000);
            for dev in 0..a.gpus.len() {
                r.set_core(dev, share, limit);
            }
            for p in r.processes() {
                if p.host_pid != 0 {
                    registered.insert(p.host_pid, a.id.clone());
                }
            }
        }

        // Watchdog.
        let by_uid: BTreeMap<String, String> = allocs
            .iter()
            .filter_map(|a| Some((a.owner.as_ref()?.uid.clone()?, a.id.clone())))
            .collect();
        let proc_root = settings.proc_root.clone();
        let cgroup =
            |pid: u32| std::fs::read_to_string(proc_root.join(pid.to_string()).join("cgroup")).ok();
        let mut usage: BTreeMap<(String, usize), u64> = BTreeMap::new();
        let mut pids: BTreeMap<String, Vec<u32>> = BTreeMap::new();
        for (g, uuid) in uuids.iter().enumerate() {
            let Ok(list) = gpus::processes(nvml, g as u32) else {
                continue;
            };
            for p in list {
                if let Some(a) = owner_of(p.pid, &registered, &by_uid, &cgroup) {
                    if let Some(dev) = allocs
                        .iter()
                        .find(|x| x.id == a)
                        .and_then(|x| x.gpus.iter().position(|u| u == uuid))
                    {
                        *usage.entry((a.clone(), dev)).or_default() += p.bytes;
                        pids.entry(a).or_default().push(p.pid);
                    }
                }
            }
        }
        // Whole GPUs have no quota beyond the GPU itself.
        let quota = |id: &str, _dev: usize| {
            let a = allocs.iter().find(|a| a.id == id)?;
            Some(if a.percent >= 100 { u64::MAX } else { a.quota })
        };
        let over = violations(&usage, &quota);
        let mut now_over = Vec::new();
        for (id, dev, used, q) in over {
            now_over.push((id.clone(), dev));
            // Twice in a row: the library releases right after the driver frees, so one
            // sample may catch a free in flight.
            if !over_before.contains(&(id.clone(), dev)) {
                continue;
            }
            *violated.entry((id.clone(), dev)).or_default() += 1;
            let who = allocs
                .iter()
                .find(|a| a.id == id)
                .and_then(|a| a.owner.as_ref())
                .map(|o| o.key())
                .unwrap_or_default();
            let ps = pids.get(&id).cloned().unwrap_or_default();
            warn!(allocation = %id, container = %who, gpu = dev, used_mib = used >> 20, quota_mib = q >> 20, pids = ?ps, "watchdog: the driver reports more memory than the quota (a process bypasses libvcuda?)");
            if settings.watchdog_kill {
                for pid in ps {
                    // SAFETY: kill(2) on a pid the driver listed for this container's GPU.
                    let rc = unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
                    warn!(pid, ok = rc == 0, "watchdog: killed");
                }
            }
        }
        over_before = now_over;
        violated.retain(|(id, _), _| allocs.iter().any(|a| &a.id == id));
        let health = shared.health.borrow().clone();
        *shared.metrics.lock() = snapshot(
            &uuids,
            &gpu_memory,
            &health,
            &placed,
            &allocs,
            &regions,
            &usage,
            &violated,
        );

        if last_gc.elapsed() >= GC_PERIOD {
            last_gc = Instant::now();
            rt.block_on(collect(&shared, &settings));
            if let Err(e) = shared.core.lock().compact_checkpoint() {
                warn!(error = %e, "cannot compact the checkpoint; it keeps growing until this is fixed");
            }
        }
    }
}

/// What the metrics show after this round (pure but for reading the regions' counters).
#[allow(clippy::too_many_arguments)]
fn snapshot(
    uuids: &[String],
    gpu_memory: &[u64],
    health: &[bool],
    placed: &[(Vec<String>, u32, u64)],
    allocs: &[Allocation],
    regions: &HashMap<String, Region>,
    driver: &BTreeMap<(String, usize), u64>,
    violated: &HashMap<(String, usize), u64>,
) -> Snapshot {
    let gpus = uuids
        .iter()
        .enumerate()
        .map(|(i, uuid)| {
            let total = gpu_memory.get(i).copied().unwrap_or(0);
            let mut row = GpuRow {
                index: i,
                uuid: uuid.clone(),
                memory_total: total,
                healthy: health.get(i).copied().unwrap_or(true),
                ..GpuRow::default()
            };
            for (_, percent, quota) in placed.iter().filter(|(on, _, _)| on.contains(uuid)) {
                let whole = *percent >= 100;
                row.core_allocated += if whole { 100 } else { u64::from(*percent) };
                row.memory_allocated += if whole { total } else { *quota };
            }
            row
        })
        .collect();
    let mut containers = Vec::new();
    for a in allocs {
        let Some(owner) = a.owner.as_ref() else {
            continue;
        };
        for (dev, uuid) in a.gpus.iter().enumerate() {
            let index = uuids.iter().position(|u| u == uuid).unwrap_or(dev);
            let whole = a.percent >= 100;
            let share = if whole { 100 } else { u64::from(a.percent) };
            let key = (a.id.clone(), dev);
            containers.push(ContainerRow {
                namespace: owner.namespace.clone(),
                pod: owner.pod.clone(),
                container: owner.container.clone(),
                gpu_index: index,
                gpu_uuid: uuid.clone(),
                core_share: share,
                core_limit: a
                    .core_limit
                    .map_or(share, |l| u64::from(l).max(share).min(100)),
                memory_quota: if whole {
                    gpu_memory.get(index).copied().unwrap_or(0)
                } else {
                    a.quota
                },
                memory_used: regions.get(&a.id).map_or(0, |r| r.used(dev)),
                memory_driver: driver.get(&key).copied().unwrap_or(0),
                watchdog_violations: violated.get(&key).copied().unwrap_or(0),
            });
        }
    }
    Snapshot { gpus, containers }
}

/// Remove allocations no container holds any more (per PodResources), after a grace period.
async fn collect(shared: &Shared, settings: &crate::settings::Settings) {
    let Ok(list) = shared.fresh_list(&settings.pod_resources_socket).await else {
        return;
    };
    let core_name = Kind::Core.resource(&settings.domain);
    let held: std::collections::HashSet<&str> = list
        .pod_resources
        .iter()
        .flat_map(|p| &p.containers)
        .flat_map(|c| &c.devices)
        .filter(|d| d.resource_name == core_name)
        .flat_map(|d| d.device_ids.iter().map(String::as_str))
        .collect();
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut core = shared.core.lock();
    let gone: Vec<String> = core
        .allocations()
        .filter(|a| {
            now.saturating_sub(a.created) > GC_GRACE_SECS
                && !a.cores.iter().any(|c| held.contains(c.as_str()))
        })
        .map(|a| a.id.clone())
        .collect();
    for id in gone {
        info!(allocation = %id, "its container is gone: removing the allocation");
        if let Err(e) = core.remove(&id) {
            warn!(allocation = %id, error = %e, "cannot remove the allocation");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn processes_are_attributed_by_registration_then_cgroup() {
        let registered: HashMap<u32, String> = [(10, "a1".to_string())].into();
        let by_uid: BTreeMap<String, String> = [("uid-2".to_string(), "a2".to_string())].into();
        let cg = |pid: u32| match pid {
            20 => Some("0::/kubepods/poduid-2/x\n".to_string()),
            30 => Some("0::/system.slice/sshd.service\n".to_string()),
            _ => None,
        };
        assert_eq!(
            owner_of(10, &registered, &by_uid, &cg).as_deref(),
            Some("a1")
        );
        assert_eq!(
            owner_of(20, &registered, &by_uid, &cg).as_deref(),
            Some("a2"),
            "unregistered: a bypass is found by its cgroup"
        );
        assert_eq!(owner_of(30, &registered, &by_uid, &cg), None);
    }

    #[test]
    fn usage_over_quota_is_a_violation() {
        let usage: BTreeMap<(String, usize), u64> = [
            (("a1".to_string(), 0), 5 << 30),
            (("a2".to_string(), 0), 1 << 30),
        ]
        .into();
        let q = |id: &str, _| Some(if id == "a1" { 4 << 30 } else { 2 << 30 });
        assert_eq!(
            violations(&usage, &q),
            vec![("a1".to_string(), 0, 5 << 30, 4 << 30)]
        );
    }
}
