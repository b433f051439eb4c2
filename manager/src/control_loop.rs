//! The control loop, at NVML's sampling cadence (~1/6 s): for every started allocation,
//! reclaim what dead processes held, write its compute share into its region (hard or
//! elastic), and run the watchdog — the memory and compute the *driver* reports for the
//! container's processes against its quota and limit, which catches a process that
//! bypasses the library (static binary, raw ioctls). Every ~10 s, allocations whose
//! container the kubelet no longer lists are removed.
//!
//! This is the shell: what to do when, and the watchdogs' verdicts, are decided by
//! `vcuda_manager_core::rounds::Rounds` (a state machine given the time); here the loop
//! reads (NVML, /proc, regions, the kubelet), feeds it what it read, and carries out its
//! actions.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use nvml_wrapper::Nvml;
use tracing::{info, warn};
use vcuda_contract::region_file::{RegionFile, Snapshot};

use crate::core::{Registration, Unopened};
use crate::gpus;
use crate::settings::Settings;
use crate::state::Shared;
use vcuda_contract::view::{ContainerGpuView, ContainerView, GpuView, ProcessView, View, SCHEMA};
use vcuda_manager_core::allocation::Allocation;
use vcuda_manager_core::identity;
use vcuda_manager_core::ids::{AllocationId, PodUid};
use vcuda_manager_core::rounds::{
    self, Action, Cadence, Event, Faults, Rounds, Step, Utilization, Verdict,
};
use vcuda_manager_core::watchdog::{self, ComputeWatch, Key};

/// A process's utilization sample older than this (ms) means it has been idle.
const UTIL_FRESH_MS: u64 = 1_000;

/// Which allocation a host process belongs to: registered host pids first, then the pod
/// cgroup of unregistered ones (which is how a bypassing process is found).
pub fn owner_of(
    pid: u32,
    registered: &HashMap<u32, AllocationId>,
    by_uid: &BTreeMap<PodUid, AllocationId>,
    cgroup: &dyn Fn(u32) -> Option<String>,
) -> Option<AllocationId> {
    if let Some(a) = registered.get(&pid) {
        return Some(a.clone());
    }
    let text = cgroup(pid)?;
    by_uid
        .iter()
        .find(|(uid, _)| identity::in_pod(&text, uid.as_str()))
        .map(|(_, a)| a.clone())
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
    let (share, limit) = rounds::region_rates(a);
    for dev in 0..a.gpus.len() {
        r.set_core(dev, share, limit)?;
    }
    r.read()
}

/// The watchdog's kill: every process in `pids` still in the allocation's pod.
fn kill_all(proc_root: &Path, alloc: Option<&Allocation>, pids: &[u32]) {
    let uid = alloc.and_then(|a| a.owner.as_ref()?.uid.clone());
    for &pid in pids {
        match uid.as_ref().map(|u| kill_in_pod(proc_root, pid, u)) {
            Some(Ok(true)) => warn!(pid, "watchdog: killed"),
            Some(Ok(false)) => warn!(pid, "watchdog: not killed: no longer in the pod's cgroup"),
            Some(Err(e)) => warn!(pid, error = %e, "watchdog: cannot kill"),
            None => warn!(pid, "watchdog: not killed: the pod's uid is unknown"),
        }
    }
}

/// Start time of host process `pid` (from `proc_root`), if it runs.
fn proc_start(proc_root: &Path, pid: u32) -> Option<u64> {
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
fn kill_in_pod(proc_root: &Path, pid: u32, uid: &PodUid) -> Result<bool, KillError> {
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
    if !identity::in_pod(&cgroup, uid.as_str()) {
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
    let mut shell = Shell::new(nvml, shared, rt);
    // The compute watchdog's rule (vcuda_manager_core::watchdog), over its window.
    let compute = ComputeWatch::new(
        shell.settings.watchdog_compute_window.as_millis() as u64,
        shell.settings.watchdog_compute_margin,
    );
    let mut rounds = Rounds::new(Cadence::default(), compute);
    let mut action = rounds.action();
    loop {
        action = match action {
            Action::Sleep { until_ms } => {
                let now_ms = shell.sleep_until(until_ms);
                rounds.step(Event::Woke { now_ms })
            }
            first => {
                // Every line a round logs carries its number.
                let _round = tracing::debug_span!("round", n = rounds.round()).entered();
                shell.round(&mut rounds, first)
            }
        };
    }
}

/// The loop's reading and writing: it carries out what [`Rounds`] asks and keeps what the
/// next rounds need besides the decisions' state.
struct Shell {
    nvml: &'static Nvml,
    shared: Arc<Shared>,
    /// Runs the one asynchronous step (PodResources, for garbage collection).
    rt: tokio::runtime::Handle,
    settings: Settings,
    /// Times handed to [`Rounds`] are milliseconds since this.
    epoch: Instant,
    /// Allocations whose region could not be used (logged once per episode).
    faults: Faults,
    /// GPU names, for the view.
    names: Vec<String>,
    /// Per GPU: the newest process-utilization sample seen.
    last_seen: Vec<u64>,
    /// Per (GPU, pid): its last utilization and when (ms) it was seen.
    recent: HashMap<(usize, u32), (u32, u64)>,
}

/// What one round read, step by step; the view shows it at the round's end.
#[derive(Default)]
struct Round {
    /// Started allocations.
    allocs: Vec<Allocation>,
    /// Every allocation's (GPUs, percent, quota), started or not.
    placed: Vec<(Vec<String>, u32, u64)>,
    gpu_memory: Vec<u64>,
    uuids: Vec<String>,
    /// What each region said; `None`: it did not read (the container's fault).
    snapshots: HashMap<AllocationId, Option<Snapshot>>,
    /// Registered processes (the kernel vouched for them), by host pid.
    known: BTreeMap<u32, Registration>,
    /// Host pid → allocation, and → pid in its container, for registered processes.
    registered: HashMap<u32, AllocationId>,
    inner_pid: HashMap<u32, u32>,
    /// Pod UID → allocation, for attributing unregistered processes by cgroup.
    by_uid: BTreeMap<PodUid, AllocationId>,
    /// Driver-reported memory per (allocation, GPU of the allocation) and per (allocation,
    /// host pid); the pids per allocation, in the driver's order.
    usage: BTreeMap<Key, u64>,
    proc_mem: BTreeMap<(AllocationId, u32), u64>,
    pids: BTreeMap<AllocationId, Vec<u32>>,
    gpu_obs: Vec<gpus::GpuSample>,
    /// Summed utilization per (allocation, GPU of the allocation).
    util: BTreeMap<Key, u32>,
}

impl Round {
    fn alloc(&self, id: &AllocationId) -> Option<&Allocation> {
        self.allocs.iter().find(|a| &a.id == id)
    }

    /// The index, among allocation `id`'s GPUs, of the GPU `uuid`.
    fn dev_of(&self, id: &AllocationId, uuid: &str) -> Option<usize> {
        self.alloc(id)?.gpus.iter().position(|u| u == uuid)
    }

    /// Which started allocation host process `pid` belongs to ([`owner_of`]).
    fn owner(&self, proc_root: &Path, pid: u32) -> Option<AllocationId> {
        let cgroup =
            |pid: u32| std::fs::read_to_string(proc_root.join(pid.to_string()).join("cgroup")).ok();
        owner_of(pid, &self.registered, &self.by_uid, &cgroup)
    }
}

impl Shell {
    fn new(nvml: &'static Nvml, shared: Arc<Shared>, rt: tokio::runtime::Handle) -> Shell {
        let (settings, count) = {
            let c = shared.core.lock();
            (c.settings.clone(), c.inventory.gpus.len())
        };
        Shell {
            nvml,
            shared,
            rt,
            settings,
            epoch: Instant::now(),
            faults: Faults::default(),
            names: (0..count as u32)
                .map(|i| gpus::name(nvml, i).unwrap_or_default())
                .collect(),
            last_seen: vec![0; count],
            recent: HashMap::new(),
        }
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Sleep until `until_ms`; returns when it woke.
    fn sleep_until(&self, until_ms: u64) -> u64 {
        std::thread::sleep(Duration::from_millis(until_ms).saturating_sub(self.epoch.elapsed()));
        self.now_ms()
    }

    /// Carry out one round's actions, from `action` until `rounds` says to sleep (returned).
    fn round(&mut self, rounds: &mut Rounds, mut action: Action) -> Action {
        let mut seen = Round::default();
        loop {
            let event = match &action {
                Action::Sleep { .. } => return action,
                Action::Do { step, .. } => match step {
                    Step::LookUpUids => self.look_up_uids(),
                    Step::Tend => {
                        seen = self.tend();
                        let started = seen.allocs.iter().map(|a| a.id.clone()).collect();
                        Event::Tended { started }
                    }
                    Step::WatchMemory => self.watch_memory(&mut seen),
                    Step::Sample => self.sample(&mut seen),
                    Step::Publish => self.publish(&seen, rounds),
                    Step::Collect => self.collect_garbage(),
                },
                Action::Enforce { verdicts, .. } => self.enforce(&seen, verdicts),
            };
            action = rounds.step(event);
        }
    }

    /// Pod UIDs (for attributing processes by cgroup) of containers none of whose
    /// processes registered yet — e.g. one that bypasses the library — from the kubelet's
    /// checkpoint, read outside the lock.
    #[tracing::instrument(level = "debug", skip_all)]
    fn look_up_uids(&self) -> Event {
        if !self.shared.core.lock().uids_wanted() {
            return Event::NothingWanted;
        }
        let entries = crate::core::read_checkpoint(&self.settings.kubelet_checkpoint);
        self.shared.core.lock().apply_pod_uids(&entries);
        Event::Done {
            now_ms: self.now_ms(),
        }
    }

    /// Every started allocation's region (reclaim, share, read), then who is whose.
    #[tracing::instrument(level = "debug", skip_all)]
    fn tend(&mut self) -> Round {
        let (mut round, (mut regions, missing)) = {
            let c = self.shared.core.lock();
            let round = Round {
                allocs: c.allocations().filter(|a| a.finished()).cloned().collect(),
                placed: c
                    .allocations()
                    .map(|a| (a.gpus.clone(), a.percent, a.quota))
                    .collect(),
                gpu_memory: c.inventory.gpus.iter().map(|g| g.memory).collect(),
                uuids: c.inventory.node.uuids.clone(),
                known: c.registrations(),
                ..Round::default()
            };
            (round, c.regions())
        };
        regions.extend(self.open_missing(missing));
        round.snapshots = tend_all(&regions, &round.allocs, &mut self.faults);
        self.attribute(&mut round);
        round
    }

    /// After a manager restart: open the regions of running containers (outside the state
    /// lock; never following a link), and keep them for the allocations' life.
    fn open_missing(&mut self, missing: Vec<Unopened>) -> Vec<(AllocationId, Arc<RegionFile>)> {
        let mut opened = Vec::new();
        for Unopened { id, path, uuids } in missing {
            match RegionFile::open(&path, &uuids) {
                Ok(r) => {
                    let r = Arc::new(r);
                    self.shared.core.lock().adopt_region(&id, r.clone());
                    opened.push((id, r));
                }
                Err(e) => {
                    if self.faults.failed(&id) {
                        warn!(allocation = %id, error = %e, "cannot open the region");
                    }
                }
            }
        }
        opened
    }

    /// Who is whose: the processes the kernel vouched for at registration, less those gone
    /// since; after a manager restart, the region's claims the kernel confirms. Never a
    /// host pid as the container wrote it.
    fn attribute(&self, r: &mut Round) {
        let proc_root = &self.settings.proc_root;
        let gone: Vec<u32> = r
            .known
            .iter()
            .filter(|(pid, reg)| proc_start(proc_root, **pid) != Some(reg.start_time))
            .map(|(pid, _)| *pid)
            .collect();
        r.known.retain(|pid, _| !gone.contains(pid));
        let vouched = self.vouch(r);
        if !gone.is_empty() || !vouched.is_empty() {
            let mut c = self.shared.core.lock();
            c.forget(&gone);
            for (pid, reg) in vouched {
                c.register(pid, reg);
            }
        }
        r.registered = r
            .known
            .iter()
            .map(|(p, reg)| (*p, reg.allocation.clone()))
            .collect();
        r.inner_pid = r.known.iter().map(|(p, reg)| (*p, reg.pid)).collect();
        r.by_uid = r
            .allocs
            .iter()
            .filter_map(|a| Some((a.owner.as_ref()?.uid.clone()?, a.id.clone())))
            .collect();
    }

    /// The regions' claims of processes not registered yet that the kernel confirms (added
    /// to `r.known`).
    fn vouch(&self, r: &mut Round) -> Vec<(u32, Registration)> {
        let mut vouched = Vec::new();
        for (id, s) in r
            .snapshots
            .iter()
            .filter_map(|(id, s)| Some((id, s.as_ref()?)))
        {
            for p in s.active().filter(|p| p.host_pid != 0) {
                if r.known.contains_key(&p.host_pid) {
                    continue;
                }
                let claimant = self.shared.core.lock().claimant(id);
                if claimant
                    .and_then(|c| c.verify(p.host_pid, p.pid, p.start_time))
                    .is_ok()
                {
                    let reg = Registration {
                        allocation: id.clone(),
                        pid: p.pid,
                        start_time: p.start_time,
                    };
                    r.known.insert(p.host_pid, reg.clone());
                    vouched.push((p.host_pid, reg));
                }
            }
        }
        vouched
    }

    /// The memory the driver reports for each container's processes (registered, or in
    /// its pod's cgroup) on each of its GPUs, against its quota.
    #[tracing::instrument(level = "debug", skip_all)]
    fn watch_memory(&self, r: &mut Round) -> Event {
        let mut found = Vec::new();
        for (g, uuid) in r.uuids.iter().enumerate() {
            let Ok(list) = gpus::processes(self.nvml, g as u32) else {
                continue;
            };
            for p in list {
                let Some(a) = r.owner(&self.settings.proc_root, p.pid) else {
                    continue;
                };
                if let Some(dev) = r.dev_of(&a, uuid) {
                    found.push((a, dev, p.pid, p.bytes));
                }
            }
        }
        for (a, dev, pid, bytes) in found {
            *r.usage.entry(Key::new(a.clone(), dev)).or_default() += bytes;
            *r.proc_mem.entry((a.clone(), pid)).or_default() += bytes;
            r.pids.entry(a).or_default().push(pid);
        }
        let quota = |id: &AllocationId, _dev: usize| r.alloc(id).map(watchdog::memory_quota);
        Event::MemoryRead {
            over: watchdog::violations(&r.usage, &quota),
        }
    }

    /// What the GPUs did: memory, utilization, and each process's utilization (NVML
    /// returns the samples newer than the last one seen; a process without a recent sample
    /// was idle), summed per container GPU for the compute watchdog.
    #[tracing::instrument(level = "debug", skip_all)]
    fn sample(&mut self, r: &mut Round) -> Event {
        let now_ms = self.now_ms();
        for (g, seen) in self.last_seen.iter_mut().enumerate() {
            let mut s = gpus::sample(self.nvml, g as u32, *seen);
            s.processes.sort_by_key(|p| p.timestamp_us); // the newest sample wins
            for p in &s.processes {
                *seen = (*seen).max(p.timestamp_us);
                self.recent.insert((g, p.pid), (p.sm_util, now_ms));
            }
            r.gpu_obs.push(s);
        }
        self.recent
            .retain(|_, (_, at)| now_ms.saturating_sub(*at) < UTIL_FRESH_MS);
        for (&(g, pid), &(sm, _)) in &self.recent {
            let Some(uuid) = r.uuids.get(g) else { continue };
            let Some(a) = r.owner(&self.settings.proc_root, pid) else {
                continue;
            };
            if let Some(dev) = r.dev_of(&a, uuid) {
                *r.util.entry(Key::new(a, dev)).or_default() += sm;
            }
        }
        let utilization = r
            .allocs
            .iter()
            .filter_map(|a| Some((a, watchdog::compute_limit(a)?)))
            .flat_map(|(a, limit_percent)| {
                (0..a.gpus.len()).map(move |dev| (a.id.clone(), dev, limit_percent))
            })
            .map(|(id, dev, limit_percent)| {
                let key = Key::new(id, dev);
                Utilization {
                    percent: r.util.get(&key).copied().unwrap_or(0),
                    key,
                    limit_percent,
                }
            })
            .collect();
        Event::Sampled {
            now_ms,
            utilization,
        }
    }

    /// Act on the watchdog's verdicts: say so, and kill the container's processes if
    /// configured (only those still in its pod: [`kill_in_pod`]).
    #[tracing::instrument(level = "debug", skip_all, fields(verdicts = verdicts.len()))]
    fn enforce(&self, r: &Round, verdicts: &[Verdict]) -> Event {
        let proc_root = &self.settings.proc_root;
        for v in verdicts {
            let Key {
                alloc: id,
                gpu: dev,
            } = match v {
                Verdict::Memory(o) => &o.key,
                Verdict::Compute { key, .. } => key,
            };
            let alloc = r.alloc(id);
            let who = alloc
                .and_then(|a| a.owner.as_ref())
                .map(|o| o.key())
                .unwrap_or_default();
            let ps = match v {
                Verdict::Memory(o) => {
                    let ps = r.pids.get(id).cloned().unwrap_or_default();
                    warn!(allocation = %id, container = %who, gpu = dev, used_mib = o.used >> 20, quota_mib = o.quota >> 20, pids = ?ps, "watchdog: the driver reports more memory than the quota (a process bypasses libvcuda?)");
                    ps
                }
                Verdict::Compute {
                    mean_percent,
                    limit_percent,
                    ..
                } => {
                    let ps = self.busy_pids(r, id, *dev);
                    warn!(allocation = %id, container = %who, gpu = dev, utilization_percent = mean_percent, limit_percent = limit_percent, window_s = self.settings.watchdog_compute_window.as_secs(), pids = ?ps, "watchdog: the driver reports more compute than the limit (a process bypasses libvcuda?)");
                    ps
                }
            };
            if self.settings.watchdog_kill {
                kill_all(proc_root, alloc, &ps);
            }
        }
        Event::Done {
            now_ms: self.now_ms(),
        }
    }

    /// The processes of allocation `id` with a recent non-zero utilization sample on its
    /// GPU `dev`.
    fn busy_pids(&self, r: &Round, id: &AllocationId, dev: usize) -> Vec<u32> {
        let gpu = r.alloc(id).and_then(|a| a.gpus.get(dev));
        self.recent
            .iter()
            .filter(|((g, _), (sm, _))| *sm > 0 && r.uuids.get(*g) == gpu)
            .map(|((_, pid), _)| *pid)
            .filter(|pid| r.owner(&self.settings.proc_root, *pid).as_ref() == Some(id))
            .collect()
    }

    /// The one view both the query API and `/metrics` show.
    #[tracing::instrument(level = "debug", skip_all)]
    fn publish(&self, r: &Round, rounds: &Rounds) -> Event {
        let health = self.shared.health.borrow().clone();
        let observed = Observed {
            uuids: &r.uuids,
            names: &self.names,
            gpu_memory: &r.gpu_memory,
            gpus: &r.gpu_obs,
            health: &health,
            placed: &r.placed,
            allocs: &r.allocs,
            regions: &r.snapshots,
            driver: &r.usage,
            util: &r.util,
            proc_mem: &r.proc_mem,
            inner_pid: &r.inner_pid,
            known: &r.known,
            violated: rounds.memory_violations(),
            compute_violated: rounds.compute_violations(),
        };
        let mut view = observed.view();
        view.modes = self.shared.core.lock().locks.mode_views();
        *self.shared.view.lock() = view;
        Event::Done {
            now_ms: self.now_ms(),
        }
    }

    /// Remove allocations whose container left PodResources, and compact the checkpoint.
    #[tracing::instrument(level = "debug", skip_all)]
    fn collect_garbage(&self) -> Event {
        self.rt.block_on(collect(&self.shared, &self.settings));
        if let Err(e) = self.shared.core.lock().compact_checkpoint() {
            warn!(error = %e, "cannot compact the checkpoint; it keeps growing until this is fixed");
        }
        Event::Done {
            now_ms: self.now_ms(),
        }
    }
}

/// Every region's care this round ([`tend`]): what each said, `None` where it did not read
/// (the container's fault, logged once per episode). A region that fails keeps no other
/// from being tended.
fn tend_all(
    regions: &[(AllocationId, Arc<RegionFile>)],
    allocs: &[Allocation],
    faults: &mut Faults,
) -> HashMap<AllocationId, Option<Snapshot>> {
    let mut snapshots = HashMap::new();
    for (id, r) in regions {
        let Some(a) = allocs.iter().find(|a| &a.id == id) else {
            continue;
        };
        let snapshot = tend(r, a).inspect_err(|e| {
            if faults.failed(id) {
                warn!(allocation = %id, error = %e, "the container's region is unusable: its usage counts as its whole quota until it is fixed");
            }
        });
        if snapshot.is_ok() && faults.read(id) {
            info!(allocation = %id, "the container's region is readable again");
        }
        snapshots.insert(id.clone(), snapshot.ok());
    }
    faults.retain(|id| allocs.iter().any(|a| &a.id == id));
    snapshots
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
    regions: &'a HashMap<AllocationId, Option<Snapshot>>,
    /// Driver-reported memory per (allocation, GPU of the allocation).
    driver: &'a BTreeMap<Key, u64>,
    /// Summed utilization per (allocation, GPU of the allocation).
    util: &'a BTreeMap<Key, u32>,
    /// Driver-reported memory per (allocation, host pid).
    proc_mem: &'a BTreeMap<(AllocationId, u32), u64>,
    inner_pid: &'a HashMap<u32, u32>,
    /// Registered processes (the kernel vouched for them), by host pid.
    known: &'a BTreeMap<u32, Registration>,
    /// The watchdogs' verdicts per (allocation, GPU of the allocation) since start.
    violated: &'a BTreeMap<Key, u64>,
    compute_violated: &'a BTreeMap<Key, u64>,
}

impl Observed<'_> {
    /// The view `vcuda-smi` and `/metrics` show after this round.
    fn view(&self) -> View {
        View {
            modes: Vec::new(),
            schema: SCHEMA,
            scope: "node".into(),
            taken_unix: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            gpus: (0..self.uuids.len()).map(|i| self.gpu(i)).collect(),
            containers: self
                .allocs
                .iter()
                .filter_map(|a| self.container(a))
                .collect(),
        }
    }

    /// The node's GPU `i`: what the driver says, and what is allocated on it.
    fn gpu(&self, i: usize) -> GpuView {
        let uuid = &self.uuids[i];
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
        for (_, percent, quota) in self.placed.iter().filter(|(on, _, _)| on.contains(uuid)) {
            let whole = *percent >= 100;
            g.core_allocated_percent += if whole { 100 } else { *percent };
            g.memory_allocated_bytes += if whole { total } else { *quota };
        }
        g
    }

    /// Started allocation `a`'s container (`None` before PreStartContainer named it).
    fn container(&self, a: &Allocation) -> Option<ContainerView> {
        let owner = a.owner.as_ref()?;
        Some(ContainerView {
            namespace: owner.namespace.clone(),
            pod: owner.pod.clone(),
            container: owner.container.clone(),
            allocation: a.id.to_string(),
            gpus: (0..a.gpus.len())
                .map(|dev| self.container_gpu(a, dev))
                .collect(),
            processes: self.processes(a),
        })
    }

    /// Allocation `a`'s GPU `dev` as its container sees it.
    fn container_gpu(&self, a: &Allocation, dev: usize) -> ContainerGpuView {
        let uuid = &a.gpus[dev];
        let region = self.regions.get(&a.id);
        let snapshot = region.and_then(Option::as_ref);
        let whole = a.percent >= 100;
        let share = if whole { 100 } else { a.percent };
        let index = self.uuids.iter().position(|u| u == uuid).unwrap_or(dev);
        let key = Key::new(a.id.clone(), dev);
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
            watchdog_compute_violations: self.compute_violated.get(&key).copied().unwrap_or(0),
        }
    }

    /// Allocation `a`'s registered processes, and any other the driver lists in the pod's
    /// cgroup.
    fn processes(&self, a: &Allocation) -> Vec<ProcessView> {
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
        processes.into_values().collect()
    }
}

/// Remove allocations no container holds any more (per PodResources), after a grace period.
async fn collect(shared: &Shared, settings: &Settings) {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let asked = shared.core.lock().locks.asked(now);
    let Ok(list) = shared.fresh_list(&settings.pod_resources_socket).await else {
        return;
    };
    // Every resource's IDs: a share allocation is keyed by its vcuda-core IDs, a slice
    // allocation by its sgpu IDs, and the mode locks by any of ours.
    let held: HashSet<&str> = crate::podresources::held_ids(&list);
    let mut core = shared.core.lock();
    if core.locks.release_gone(&|id| held.contains(id), asked) > 0 {
        core.changed.notify_one(); // the inventory shows the GPUs unlocked
    }
    let gone = rounds::collectable(core.allocations(), &|c| held.contains(c), now);
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
        let uid1 = PodUid::from("uid-1");
        let e = kill_in_pod(d.path(), pid, &uid1).unwrap_err();
        assert!(
            matches!(&e, KillError::Cgroup { path, .. } if path.ends_with(format!("{pid}/cgroup"))),
            "{e:?}"
        );
        assert_eq!(e.kind(), "cgroup");
        let dir = d.path().join(pid.to_string());
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("cgroup"), "0::/kubepods/poduid-2/x\n").unwrap();
        assert!(!kill_in_pod(d.path(), pid, &uid1).unwrap(), "another pod's");
        assert!(child.try_wait().unwrap().is_none(), "still running");
        std::fs::write(dir.join("cgroup"), "0::/kubepods/poduid-1/x\n").unwrap();
        assert!(kill_in_pod(d.path(), pid, &uid1).unwrap());
        let status = child.wait().unwrap();
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(libc::SIGKILL)
        );
        assert!(matches!(
            kill_in_pod(d.path(), u32::MAX, &uid1),
            Err(KillError::PidRange { .. })
        ));
    }

    #[test]
    fn processes_are_attributed_by_registration_then_cgroup() {
        let registered: HashMap<u32, AllocationId> = [(10, "a1".into())].into();
        let by_uid: BTreeMap<PodUid, AllocationId> = [("uid-2".into(), "a2".into())].into();
        let cg = |pid: u32| match pid {
            20 => Some("0::/kubepods/poduid-2/x\n".to_string()),
            30 => Some("0::/system.slice/sshd.service\n".to_string()),
            _ => None,
        };
        assert_eq!(
            owner_of(10, &registered, &by_uid, &cg)
                .as_ref()
                .map(AllocationId::as_str),
            Some("a1")
        );
        assert_eq!(
            owner_of(20, &registered, &by_uid, &cg)
                .as_ref()
                .map(AllocationId::as_str),
            Some("a2"),
            "unregistered: a bypass is found by its cgroup"
        );
        assert_eq!(owner_of(30, &registered, &by_uid, &cg), None);
    }

    #[test]
    fn a_region_that_does_not_read_keeps_no_other_from_being_tended() {
        let d = tempfile::tempdir().unwrap();
        let uuid = [7u8; 16];
        let alloc = |id: &str| Allocation {
            slice: false,
            id: id.into(),
            cores: vec![],
            gpus: vec!["GPU-7".into()],
            percent: 30,
            memory: vec![],
            quota: 1 << 30,
            core_limit: None,
            owner: None,
            created: 0,
        };
        let allocs = [alloc("a1"), alloc("a2"), alloc("a3")];
        let regions: Vec<(AllocationId, Arc<RegionFile>)> = ["a1", "a2", "a3"]
            .iter()
            .map(|id| {
                let r = RegionFile::create_or_open(&d.path().join(id), &[uuid]).unwrap();
                (AllocationId::from(*id), Arc::new(r))
            })
            .collect();
        // The container of a2 truncates its region.
        std::fs::OpenOptions::new()
            .write(true)
            .open(d.path().join("a2"))
            .unwrap()
            .set_len(100)
            .unwrap();
        let mut faults = Faults::default();
        let seen = tend_all(&regions, &allocs, &mut faults);
        assert!(
            seen["a1"].is_some() && seen["a3"].is_some(),
            "the others read"
        );
        assert!(seen["a2"].is_none(), "a2 counts as full");
        for id in ["a1", "a3"] {
            let bytes = std::fs::read(d.path().join(id)).unwrap();
            let at = std::mem::offset_of!(vcuda_contract::region::RegionHeader, core_override);
            let share = u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap());
            assert_eq!(share, 300_000, "{id}: its share written");
        }
        assert!(
            !faults.failed(&"a2".into()),
            "a2's episode is already reported"
        );
        assert!(faults.failed(&"a1".into()));
    }
}
