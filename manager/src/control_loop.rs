//! The control loop, at NVML's sampling cadence (~1/6 s): for every started allocation,
//! reclaim what dead processes held, write its compute share into its region (hard or
//! elastic), and run the watchdog — the memory the *driver* reports for the container's
//! processes against its quota, which catches a process that bypasses the library (static
//! binary, raw ioctls). Every ~10 s, allocations whose container the kubelet no longer
//! lists are removed.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use nvml_wrapper::Nvml;
use tracing::{info, warn};
use vcuda_contract::region_file::{RegionFile, Snapshot};

use crate::core::Registration;
use crate::gpus;
use crate::state::Shared;
use vcuda_contract::view::{ContainerGpuView, ContainerView, GpuView, ProcessView, View, SCHEMA};
use vcuda_manager_core::allocation::Allocation;
use vcuda_manager_core::identity;
use vcuda_manager_core::ids::Kind;
use vcuda_manager_core::watchdog::ComputeWatch;

const PERIOD: Duration = Duration::from_millis(167);
const GC_PERIOD: Duration = Duration::from_secs(10);
/// A process's utilization sample older than this means it has been idle.
const UTIL_FRESH: Duration = Duration::from_secs(1);
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

/// One round's care of an allocation's region: reclaim what dead processes held, write
/// its compute share (hard or elastic), and read what it says. Every step goes through the
/// descriptor the manager holds and never waits; an error is the container's doing.
fn tend(
    r: &RegionFile,
    a: &Allocation,
) -> Result<Snapshot, vcuda_contract::region_file::RegionFault> {
    let n = r.reclaim_dead()?;
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
        r.set_core(dev, share, limit)?;
    }
    r.read()
}

/// The watchdog's kill: every process in `pids` still in the allocation's pod.
fn kill_all(proc_root: &std::path::Path, alloc: Option<&Allocation>, pids: &[u32]) {
    let uid = alloc.and_then(|a| a.owner.as_ref()?.uid.clone());
    for &pid in pids {
        match uid.as_deref().map(|u| kill_in_pod(proc_root, pid, u)) {
            Some(Ok(true)) => warn!(pid, "watchdog: killed"),
            Some(Ok(false)) => warn!(pid, "watchdog: not killed: no longer in the pod's cgroup"),
            Some(Err(e)) => warn!(pid, error = %e, "watchdog: cannot kill"),
            None => warn!(pid, "watchdog: not killed: the pod's uid is unknown"),
        }
    }
}

/// Start time of host process `pid` (from `proc_root`), if it runs.
fn proc_start(proc_root: &std::path::Path, pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(proc_root.join(pid.to_string()).join("stat")).ok()?;
    identity::start_time(&stat)
}

/// The watchdog could not kill a process (it keeps running over its limit; the log says
/// why).
#[derive(Debug, thiserror::Error)]
pub enum KillError {
    #[error("pid {pid} out of range")]
    PidRange { pid: u32 },
    #[error("pidfd_open: {source} (Linux 5.3 or newer is needed to kill safely)")]
    PidfdOpen { source: std::io::Error },
    #[error("cannot read its cgroup {}: {source}", path.display())]
    Cgroup {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("pidfd_send_signal: {source}")]
    Signal { source: std::io::Error },
}

impl KillError {
    /// A short stable name for counting errors by kind.
    pub fn kind(&self) -> &'static str {
        match self {
            KillError::PidRange { .. } => "pid-range",
            KillError::PidfdOpen { .. } => "pidfd-open",
            KillError::Cgroup { .. } => "cgroup",
            KillError::Signal { .. } => "signal",
        }
    }
}

/// SIGKILL host process `pid` if it is (still) in the cgroup of pod `uid`. The check and
/// the signal go through one pidfd, opened first, so a pid reused in between can never
/// redirect the kill to another process. Returns whether it signalled.
fn kill_in_pod(proc_root: &std::path::Path, pid: u32, uid: &str) -> Result<bool, KillError> {
    let pid = libc::pid_t::try_from(pid).map_err(|_| KillError::PidRange { pid })?;
    // SAFETY: pidfd_open(2) takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(KillError::PidfdOpen {
            source: std::io::Error::last_os_error(),
        });
    }
    // SAFETY: a descriptor pidfd_open just returned, owned from here on.
    let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as i32) };
    let path = proc_root.join(pid.to_string()).join("cgroup");
    let cgroup =
        std::fs::read_to_string(&path).map_err(|source| KillError::Cgroup { path, source })?;
    if !identity::in_pod(&cgroup, uid) {
        return Ok(false);
    }
    use std::os::fd::AsRawFd;
    // SAFETY: pidfd_send_signal(2) on the pidfd we own, no siginfo, no flags.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            fd.as_raw_fd(),
            libc::SIGKILL,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    if rc != 0 {
        return Err(KillError::Signal {
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(true)
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
    // Allocations whose region could not be used last round (logged once per episode).
    let mut faulty: HashSet<String> = HashSet::new();
    let mut over_before: Vec<(String, usize)> = Vec::new();
    // Watchdog violations per (allocation, GPU) since start: the metric.
    let mut violated: HashMap<(String, usize), u64> = HashMap::new();
    // The compute watchdog's samples, and its violations per (allocation, GPU) since start.
    let (window, margin) = {
        let c = shared.core.lock();
        (
            c.settings.watchdog_compute_window,
            c.settings.watchdog_compute_margin,
        )
    };
    let mut compute = ComputeWatch::new(window.as_millis() as u64, margin);
    let mut compute_violated: HashMap<(String, usize), u64> = HashMap::new();
    let epoch = Instant::now();
    let mut last_gc = Instant::now();
    let mut last_uid_lookup = Instant::now() - UID_LOOKUP_PERIOD;
    let mut next = Instant::now();
    // Per GPU: the newest process-utilization sample seen; per (GPU, pid): its last
    // utilization and when it was seen.
    let count = shared.core.lock().inventory.gpus.len();
    let mut last_seen: Vec<u64> = vec![0; count];
    let mut recent: HashMap<(usize, u32), (u32, Instant)> = HashMap::new();
    let names: Vec<String> = (0..count as u32)
        .map(|i| gpus::name(nvml, i).unwrap_or_default())
        .collect();
    let mut round: u64 = 0;
    loop {
        // A fixed cadence; a slow round is not made up for by a burst of quick ones.
        next = (next + PERIOD).max(Instant::now());
        std::thread::sleep(next.saturating_duration_since(Instant::now()));
        round += 1;
        // Every line a round logs carries its number.
        let _round = tracing::debug_span!("round", n = round).entered();
        // Pod UIDs (for attributing processes by cgroup) of containers none of whose
        // processes registered yet — e.g. one that bypasses the library. The kubelet's
        // checkpoint is read at most once a second for this, and outside the lock.
        if last_uid_lookup.elapsed() >= UID_LOOKUP_PERIOD && shared.core.lock().uids_wanted() {
            last_uid_lookup = Instant::now();
            let path = shared.core.lock().settings.kubelet_checkpoint.clone();
            let entries = crate::core::read_checkpoint(&path);
            shared.core.lock().apply_pod_uids(&entries);
        }
        let (allocs, settings, (mut regions, missing), gpu_memory, placed, uuids, mut known) = {
            let c = shared.core.lock();
            // What is allocated on each GPU (started or not), for the metrics.
            let placed: Vec<(Vec<String>, u32, u64)> = c
                .allocations()
                .map(|a| (a.gpus.clone(), a.percent, a.quota))
                .collect();
            let gpu_memory: Vec<u64> = c.inventory.gpus.iter().map(|g| g.memory).collect();
            let allocs: Vec<Allocation> =
                c.allocations().filter(|a| a.finished()).cloned().collect();
            (
                allocs,
                c.settings.clone(),
                c.regions(),
                gpu_memory,
                placed,
                c.inventory.node.uuids.clone(),
                c.registrations(),
            )
        };
        // After a manager restart: open the regions of running containers (outside the
        // state lock; never following a link), and keep them for the allocations' life.
        for crate::core::Unopened { id, path, uuids } in missing {
            match RegionFile::open(&path, &uuids) {
                Ok(r) => {
                    let r = Arc::new(r);
                    shared.core.lock().adopt_region(&id, r.clone());
                    regions.push((id, r));
                }
                Err(e) => {
                    if faulty.insert(id.clone()) {
                        warn!(allocation = %id, error = %e, "cannot open the region");
                    }
                }
            }
        }
        // What each region said this round; `None`: it did not read (the container's fault).
        let mut snapshots: HashMap<String, Option<Snapshot>> = HashMap::new();
        for (id, r) in &regions {
            let Some(a) = allocs.iter().find(|a| &a.id == id) else {
                continue;
            };
            let snapshot = tend(r, a).inspect_err(|e| {
                if faulty.insert(id.clone()) {
                    warn!(allocation = %id, error = %e, "the container's region is unusable: its usage counts as its whole quota until it is fixed");
                }
            });
            if snapshot.is_ok() && faulty.remove(id) {
                info!(allocation = %id, "the container's region is readable again");
            }
            snapshots.insert(id.clone(), snapshot.ok());
        }
        // Who is whose: the processes the kernel vouched for at registration, less those
        // gone since; after a manager restart, the region's claims the kernel confirms.
        // Never a host pid as the container wrote it.
        let proc_root = settings.proc_root.clone();
        let gone: Vec<u32> = known
            .iter()
            .filter(|(pid, r)| proc_start(&proc_root, **pid) != Some(r.start_time))
            .map(|(pid, _)| *pid)
            .collect();
        known.retain(|pid, _| !gone.contains(pid));
        let mut vouched = Vec::new();
        for (id, s) in snapshots
            .iter()
            .filter_map(|(id, s)| Some((id, s.as_ref()?)))
        {
            for p in s.active().filter(|p| p.host_pid != 0) {
                if known.contains_key(&p.host_pid) {
                    continue;
                }
                let claimant = shared.core.lock().claimant(id);
                if claimant
                    .and_then(|c| c.verify(p.host_pid, p.pid, p.start_time))
                    .is_ok()
                {
                    let r = Registration {
                        allocation: id.clone(),
                        pid: p.pid,
                        start_time: p.start_time,
                    };
                    known.insert(p.host_pid, r.clone());
                    vouched.push((p.host_pid, r));
                }
            }
        }
        if !gone.is_empty() || !vouched.is_empty() {
            let mut c = shared.core.lock();
            c.forget(&gone);
            for (pid, r) in vouched {
                c.register(pid, r);
            }
        }
        let registered: HashMap<u32, String> = known
            .iter()
            .map(|(p, r)| (*p, r.allocation.clone()))
            .collect();
        // host pid → pid in its container, for registered processes.
        let inner_pid: HashMap<u32, u32> = known.iter().map(|(p, r)| (*p, r.pid)).collect();
        faulty.retain(|id| allocs.iter().any(|a| &a.id == id));

        // Watchdog.
        let by_uid: BTreeMap<String, String> = allocs
            .iter()
            .filter_map(|a| Some((a.owner.as_ref()?.uid.clone()?, a.id.clone())))
            .collect();
        let cgroup =
            |pid: u32| std::fs::read_to_string(proc_root.join(pid.to_string()).join("cgroup")).ok();
        let mut usage: BTreeMap<(String, usize), u64> = BTreeMap::new();
        let mut pids: BTreeMap<String, Vec<u32>> = BTreeMap::new();
        let mut proc_mem: BTreeMap<(String, u32), u64> = BTreeMap::new();
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
                        *proc_mem.entry((a.clone(), p.pid)).or_default() += p.bytes;
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
                kill_all(&proc_root, allocs.iter().find(|a| a.id == id), &ps);
            }
        }
        over_before = now_over;
        violated.retain(|(id, _), _| allocs.iter().any(|a| &a.id == id));

        // What the GPUs did: memory, utilization, and each process's utilization (NVML
        // returns the samples newer than the last one seen; a process without a recent
        // sample was idle).
        let now = Instant::now();
        let mut gpu_obs = Vec::new();
        for (g, seen) in last_seen.iter_mut().enumerate() {
            let mut s = gpus::sample(nvml, g as u32, *seen);
            s.processes.sort_by_key(|p| p.timestamp_us); // the newest sample wins
            for p in &s.processes {
                *seen = (*seen).max(p.timestamp_us);
                recent.insert((g, p.pid), (p.sm_util, now));
            }
            gpu_obs.push(s);
        }
        recent.retain(|_, (_, at)| now.duration_since(*at) < UTIL_FRESH);
        let mut util: HashMap<(String, usize), u32> = HashMap::new();
        for (&(g, pid), &(sm, _)) in &recent {
            let Some(uuid) = uuids.get(g) else { continue };
            if let Some(a) = owner_of(pid, &registered, &by_uid, &cgroup) {
                if let Some(dev) = allocs
                    .iter()
                    .find(|x| x.id == a)
                    .and_then(|x| x.gpus.iter().position(|u| u == uuid))
                {
                    *util.entry((a, dev)).or_default() += sm;
                }
            }
        }
        // The compute watchdog: a container's driver-reported utilization on each of its
        // GPUs against its limit, over a window (vcuda_manager_core::watchdog).
        let now_ms = epoch.elapsed().as_millis() as u64;
        for a in allocs.iter().filter(|a| a.percent < 100) {
            let limit = a.core_limit.unwrap_or(a.percent).max(a.percent);
            for dev in 0..a.gpus.len() {
                let key = (a.id.clone(), dev);
                let used = util.get(&key).copied().unwrap_or(0);
                let Some(mean) = compute.observe(key.clone(), now_ms, used, limit) else {
                    continue;
                };
                *compute_violated.entry(key).or_default() += 1;
                let who = a.owner.as_ref().map(|o| o.key()).unwrap_or_default();
                let ps: Vec<u32> = recent
                    .iter()
                    .filter(|((g, _), (sm, _))| *sm > 0 && uuids.get(*g) == a.gpus.get(dev))
                    .map(|((_, pid), _)| *pid)
                    .filter(|pid| {
                        owner_of(*pid, &registered, &by_uid, &cgroup).as_deref()
                            == Some(a.id.as_str())
                    })
                    .collect();
                warn!(allocation = %a.id, container = %who, gpu = dev, utilization_percent = mean, limit_percent = limit, window_s = settings.watchdog_compute_window.as_secs(), pids = ?ps, "watchdog: the driver reports more compute than the limit (a process bypasses libvcuda?)");
                if settings.watchdog_kill {
                    kill_all(&proc_root, Some(a), &ps);
                }
            }
        }
        compute.retain(|(id, _)| allocs.iter().any(|a| &a.id == id));
        compute_violated.retain(|(id, _), _| allocs.iter().any(|a| &a.id == id));

        let health = shared.health.borrow().clone();
        let observed = Observed {
            uuids: &uuids,
            names: &names,
            gpu_memory: &gpu_memory,
            gpus: &gpu_obs,
            health: &health,
            placed: &placed,
            allocs: &allocs,
            regions: &snapshots,
            driver: &usage,
            util: &util,
            proc_mem: &proc_mem,
            inner_pid: &inner_pid,
            known: &known,
            violated: &violated,
            compute_violated: &compute_violated,
        };
        *shared.view.lock() = observed.view();

        if last_gc.elapsed() >= GC_PERIOD {
            last_gc = Instant::now();
            rt.block_on(collect(&shared, &settings));
            if let Err(e) = shared.core.lock().compact_checkpoint() {
                warn!(error = %e, "cannot compact the checkpoint; it keeps growing until this is fixed");
            }
        }
    }
}

/// One of a region's per-GPU statistics (0 when unread).
fn stat(s: Option<&Snapshot>, field: impl Fn(&Snapshot) -> &Vec<u64>, dev: usize) -> u64 {
    s.and_then(|s| field(s).get(dev).copied()).unwrap_or(0)
}

/// Everything one round observed, for [`Observed::view`].
struct Observed<'a> {
    uuids: &'a [String],
    names: &'a [String],
    gpu_memory: &'a [u64],
    gpus: &'a [gpus::GpuSample],
    health: &'a [bool],
    /// Every allocation's (GPUs, percent, quota), started or not.
    placed: &'a [(Vec<String>, u32, u64)],
    /// Started allocations.
    allocs: &'a [Allocation],
    /// What each allocation's region said this round (`None`: unreadable, counted full).
    regions: &'a HashMap<String, Option<Snapshot>>,
    /// Driver-reported memory per (allocation, GPU of the allocation).
    driver: &'a BTreeMap<(String, usize), u64>,
    /// Summed utilization per (allocation, GPU of the allocation).
    util: &'a HashMap<(String, usize), u32>,
    /// Driver-reported memory per (allocation, host pid).
    proc_mem: &'a BTreeMap<(String, u32), u64>,
    inner_pid: &'a HashMap<u32, u32>,
    /// Registered processes (the kernel vouched for them), by host pid.
    known: &'a BTreeMap<u32, Registration>,
    violated: &'a HashMap<(String, usize), u64>,
    compute_violated: &'a HashMap<(String, usize), u64>,
}

impl Observed<'_> {
    /// The view `vcuda-smi` and `/metrics` show after this round.
    fn view(&self) -> View {
        let gpus = self
            .uuids
            .iter()
            .enumerate()
            .map(|(i, uuid)| {
                let total = self.gpu_memory.get(i).copied().unwrap_or(0);
                let obs = self.gpus.get(i);
                let mut g = GpuView {
                    index: i as u32,
                    uuid: uuid.clone(),
                    name: self.names.get(i).cloned().unwrap_or_default(),
                    memory_total_bytes: total,
                    memory_used_bytes: obs.map_or(0, |o| o.memory_used),
                    utilization_percent: obs.and_then(|o| o.utilization),
                    healthy: self.health.get(i).copied().unwrap_or(true),
                    ..GpuView::default()
                };
                for (_, percent, quota) in self.placed.iter().filter(|(on, _, _)| on.contains(uuid))
                {
                    let whole = *percent >= 100;
                    g.core_allocated_percent += if whole { 100 } else { *percent };
                    g.memory_allocated_bytes += if whole { total } else { *quota };
                }
                g
            })
            .collect();
        let mut containers = Vec::new();
        for a in self.allocs {
            let Some(owner) = a.owner.as_ref() else {
                continue;
            };
            let region = self.regions.get(&a.id);
            let snapshot = region.and_then(Option::as_ref);
            let whole = a.percent >= 100;
            let share = if whole { 100 } else { a.percent };
            let gpus = a
                .gpus
                .iter()
                .enumerate()
                .map(|(dev, uuid)| {
                    let index = self.uuids.iter().position(|u| u == uuid).unwrap_or(dev);
                    let key = (a.id.clone(), dev);
                    ContainerGpuView {
                        index: index as u32,
                        uuid: uuid.clone(),
                        core_share_percent: share,
                        core_limit_percent: a.core_limit.map_or(share, |l| l.clamp(share, 100)),
                        utilization_percent: Some(self.util.get(&key).copied().unwrap_or(0)),
                        // A region the container broke counts as full, never as empty.
                        memory_used_bytes: match region {
                            Some(Some(s)) => s.used(dev),
                            Some(None) => a.quota,
                            None => 0,
                        },
                        memory_quota_bytes: if whole {
                            self.gpu_memory.get(index).copied().unwrap_or(0)
                        } else {
                            a.quota
                        },
                        memory_driver_bytes: self.driver.get(&key).copied().unwrap_or(0),
                        throttled_ns: stat(snapshot, |s| &s.throttled_ns, dev),
                        oom_refusals: stat(snapshot, |s| &s.oom_refusals, dev),
                        accounting_errors: stat(snapshot, |s| &s.accounting_errors, dev),
                        watchdog_violations: self.violated.get(&key).copied().unwrap_or(0),
                        watchdog_compute_violations: self
                            .compute_violated
                            .get(&key)
                            .copied()
                            .unwrap_or(0),
                    }
                })
                .collect();
            // Registered processes, and any other the driver lists in the pod's cgroup.
            let mut processes: BTreeMap<u32, ProcessView> = BTreeMap::new();
            for (host_pid, r) in self.known.iter().filter(|(_, r)| r.allocation == a.id) {
                processes.insert(
                    *host_pid,
                    ProcessView {
                        host_pid: *host_pid,
                        pid: r.pid,
                        memory_bytes: 0,
                    },
                );
            }
            for ((id, host_pid), bytes) in self.proc_mem.range((a.id.clone(), 0)..) {
                if id != &a.id {
                    break;
                }
                let e = processes.entry(*host_pid).or_insert(ProcessView {
                    host_pid: *host_pid,
                    pid: self.inner_pid.get(host_pid).copied().unwrap_or(0),
                    memory_bytes: 0,
                });
                e.memory_bytes += bytes;
            }
            containers.push(ContainerView {
                namespace: owner.namespace.clone(),
                pod: owner.pod.clone(),
                container: owner.container.clone(),
                allocation: a.id.clone(),
                gpus,
                processes: processes.into_values().collect(),
            });
        }
        View {
            schema: SCHEMA,
            scope: "node".into(),
            taken_unix: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            gpus,
            containers,
        }
    }
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

    /// The watchdog kills only a process the kernel still puts in the pod's cgroup, and says
    /// why not otherwise.
    #[test]
    fn the_watchdog_kills_only_inside_the_pod_and_says_why_not() {
        let d = tempfile::tempdir().unwrap();
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = child.id();
        let e = kill_in_pod(d.path(), pid, "uid-1").unwrap_err();
        assert!(
            matches!(&e, KillError::Cgroup { path, .. } if path.ends_with(format!("{pid}/cgroup"))),
            "{e:?}"
        );
        assert_eq!(e.kind(), "cgroup");
        let dir = d.path().join(pid.to_string());
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("cgroup"), "0::/kubepods/poduid-2/x\n").unwrap();
        assert!(
            !kill_in_pod(d.path(), pid, "uid-1").unwrap(),
            "another pod's"
        );
        assert!(child.try_wait().unwrap().is_none(), "still running");
        std::fs::write(dir.join("cgroup"), "0::/kubepods/poduid-1/x\n").unwrap();
        assert!(kill_in_pod(d.path(), pid, "uid-1").unwrap());
        let status = child.wait().unwrap();
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(libc::SIGKILL)
        );
        assert!(matches!(
            kill_in_pod(d.path(), u32::MAX, "uid-1"),
            Err(KillError::PidRange { .. })
        ));
    }

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
