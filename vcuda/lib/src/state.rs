//! The process-wide state ([`Vcuda`]) and the way every wrapper reaches it ([`vc`],
//! [`cuda`], [`nvml`]): the container config, the shared region and this process's slot in
//! it, the pointer table, the objects tracked by handle, the limiter's buckets. Its fields
//! are private: wrappers act through methods that keep the invariants (reserve before the
//! driver call, release what was counted, read the region only through what it means).
//!
//! Below every wrapper module and above the pieces it holds (`table`, `quota`, `visible`,
//! `buckets`, `drv`). Making the state (and renewing it in a forked child) needs the modules
//! above: `init` does that, and the crate root hands it here as a [`Lifecycle`]
//! (`crate::LIFECYCLE`), so nothing here names a module above it.

use std::collections::HashMap;
use std::ffi::{c_char, CString};
use std::path::Path;
use std::sync::atomic::{
    AtomicBool, AtomicU32, AtomicU64, Ordering::Acquire, Ordering::Relaxed, Ordering::Release,
};
use std::sync::OnceLock;

use parking_lot::{Mutex, RwLock, RwLockReadGuard};
use vcuda_contract::config::{format_uuid, ContainerConfig};
use vcuda_contract::region::{Region, SlotId, SlotView, MAX_PROCS};
use vcuda_limiter as lim;

use crate::buckets::Limiter;
pub use crate::costs::Cost;
use crate::costs::CostBooks;
use crate::ffi::*;
use crate::log::{log, DEBUG, WARN};
use crate::pools::{GraphMem, PoolBooks, PoolDriver, PoolTable};
use crate::quota::{Books, VmmHandles};
use crate::table::{AllocTable, Rec};
use crate::visible::Visible;

/// Why GPU use is refused (printed once).
pub struct Failure {
    pub msg: String,
}

/// How the state is made and renewed, which takes the modules above this one (`init`'s
/// start-up and fork handling). The crate root names them: `crate::LIFECYCLE`.
pub struct Lifecycle {
    /// Make the state (on the first CUDA or NVML call).
    pub start: fn() -> Result<Vcuda, Failure>,
    /// In a forked child, once the state is renewed: restart the background threads.
    pub after_fork: fn(&'static Vcuda),
    /// Measure this process's hidden memory on a GPU, only raising it (`context`'s, the
    /// sweep's measurement); whether NVML gave a clean reading.
    pub measure_hidden: fn(&Vcuda, usize) -> bool,
}

/// Objects whose memory is tracked by handle rather than by pointer (under one lock).
#[derive(Default)]
struct Objects {
    /// CUarray / CUmipmappedArray → (bytes, GPU).
    arrays: HashMap<usize, (u64, usize)>,
    /// VMM handles and their mappings (`quota::VmmHandles`).
    vmm: VmmHandles,
    /// Memory pools and what is counted for each (`pools::PoolTable`).
    pools: PoolTable,
    /// Each GPU's graph memory as last read, and whether a graph memory node was made.
    graph: GraphMem,
}

pub struct Vcuda {
    cfg: ContainerConfig,
    /// Quota per GPU (config index), bytes.
    limits: Vec<u64>,
    region: Region,
    /// The real NVML's dlopen handle (0: not loaded).
    nvml: usize,
    /// Packed SlotId (index << 32 | generation).
    me: AtomicU64,
    allocs: AllocTable,
    objs: Mutex<Objects>,
    /// CUDA ordinal → config index, once the driver is initialised (read on every launch of
    /// a multi-GPU process: lock-free).
    visible: Visible,
    /// Config index the single visible GPU has (fast path), or usize::MAX.
    single: AtomicU64,
    /// The pid NVML last listed this process under (0: never). While it is still the pid
    /// the driver knows us by, NVML not listing us means we hold nothing (after our last
    /// context went), not that the pid is unknown.
    listed_pid: AtomicU32,
    /// GPUs (bit per config index) on which this process's hidden memory has been measured
    /// once by [`Vcuda::reserve`]'s first look, and how many first looks were tried (see
    /// [`Vcuda::look_at_hidden`]).
    hidden_looked: AtomicU32,
    hidden_tries: AtomicU32,
    /// Real NVML handles of the config's GPUs (config order), once NVML is initialised.
    nvml_handles: OnceLock<Vec<usize>>,
    /// Synchronisations (which let pools give cached memory back to the device) hold this
    /// shared; a stream-ordered allocation that counts on a pool's cached memory holds it
    /// exclusively, so that memory cannot vanish between the check and the driver call.
    pool_sync: RwLock<()>,
    /// Serialises this process's stream-ordered allocations among themselves (another
    /// thread's allocation could otherwise take the cached memory one counts on).
    pool_alloc: Mutex<()>,
    /// The compute limiter's buckets.
    limiter: Limiter,
}

static STATE: OnceLock<Result<Vcuda, Failure>> = OnceLock::new();
static FORKED: AtomicBool = AtomicBool::new(false);
static EXITING: AtomicBool = AtomicBool::new(false);
static REPORTED: AtomicBool = AtomicBool::new(false);

/// The state, started on first use. `Err` when GPU use is refused.
#[inline]
pub fn vc() -> Result<&'static Vcuda, &'static Failure> {
    let st = match STATE.get() {
        Some(s) => s,
        None => STATE.get_or_init(crate::LIFECYCLE.start),
    };
    match st {
        Ok(v) => {
            if FORKED.load(Relaxed) {
                v.after_fork();
            }
            Ok(v)
        }
        Err(f) => {
            if !REPORTED.swap(true, Relaxed) {
                crate::log::line(&f.msg);
            }
            Err(f)
        }
    }
}

/// `vc()` for CUDA wrappers: the refusal as a CUresult.
#[inline]
pub fn cuda() -> Result<&'static Vcuda, CUresult> {
    vc().map_err(|_| CUDA_ERROR_NOT_PERMITTED)
}

/// `vc()` for NVML wrappers.
#[inline]
pub fn nvml() -> Result<&'static Vcuda, nvmlReturn_t> {
    vc().map_err(|_| NVML_ERROR_NO_PERMISSION)
}

/// The state if it was started and GPU use is allowed; never starts it (the sweep thread).
pub fn started() -> Option<&'static Vcuda> {
    STATE.get().and_then(|s| s.as_ref().ok())
}

/// The state if it was started, GPU use is allowed and no fork is pending: what the launch
/// bypass may act on (it never starts the state nor renews it after a fork).
#[inline(always)]
pub fn started_unforked() -> Option<&'static Vcuda> {
    if FORKED.load(Relaxed) {
        return None;
    }
    started()
}

/// At exit the slot is deliberately kept: the driver frees this process's device memory only
/// as the process ends, after exit handlers run. Giving the reservation back earlier would
/// let a peer allocate into memory that is still held. The slot is reclaimed once the
/// process is gone (its lock is dropped by the kernel), by the next peer that needs the
/// room or by the sweep. (Registered with `atexit` at start-up.)
pub extern "C" fn at_exit() {
    EXITING.store(true, Relaxed);
}

/// In a forked child (registered with `pthread_atfork`): the state is renewed on its next
/// use.
pub extern "C" fn in_child() {
    FORKED.store(true, Relaxed);
}

/// Whether the process is exiting.
pub fn exiting() -> bool {
    EXITING.load(Relaxed)
}

/// Whether background threads should stop (the process exits, or this is a forked child
/// whose threads were not copied and are restarted by `after_fork`).
pub fn stopping() -> bool {
    EXITING.load(Relaxed) || FORKED.load(Relaxed)
}

fn pack(s: SlotId) -> u64 {
    (u64::from(s.index) << 32) | u64::from(s.generation)
}

impl Vcuda {
    /// The state of a process holding slot `me` of `region`, under `cfg`; `nvml` is the real
    /// NVML's handle (null: none).
    pub fn new(
        cfg: ContainerConfig,
        region: Region,
        me: SlotId,
        nvml: *mut std::ffi::c_void,
    ) -> Vcuda {
        Vcuda {
            limits: cfg.gpu.iter().map(|g| g.memory_mib << 20).collect(),
            region,
            nvml: nvml as usize,
            me: AtomicU64::new(pack(me)),
            allocs: AllocTable::new(16),
            objs: Mutex::new(Objects::default()),
            visible: Visible::default(),
            single: AtomicU64::new(u64::MAX),
            listed_pid: AtomicU32::new(0),
            hidden_looked: AtomicU32::new(0),
            hidden_tries: AtomicU32::new(0),
            nvml_handles: OnceLock::new(),
            pool_sync: RwLock::new(()),
            pool_alloc: Mutex::new(()),
            limiter: Limiter::new(&cfg.gpu.iter().map(|g| g.core).collect::<Vec<_>>()),
            cfg,
        }
    }

    /// In a forked child: a new open file description of the region, a slot of its own, and
    /// none of the parent's allocations; then the threads ([`Lifecycle::after_fork`]).
    #[cold]
    fn after_fork(&'static self) {
        static LOCK: Mutex<()> = Mutex::new(());
        let _g = LOCK.lock();
        if !FORKED.load(Acquire) {
            return;
        }
        self.allocs.clear();
        *self.objs.lock() = Objects::default();
        let claimed = self
            .region
            .reopen_after_fork()
            .and_then(|()| self.region.claim());
        // Without a slot of its own the child must not count into its parent's.
        let me = claimed.unwrap_or_else(|e| {
            crate::log::line(&format!(
                "{e} (in a forked child: its allocations are refused)"
            ));
            SlotId::NONE
        });
        self.me.store(pack(me), Relaxed);
        self.listed_pid.store(0, Relaxed);
        self.hidden_looked.store(0, Relaxed);
        self.hidden_tries.store(0, Relaxed);
        self.limiter.reset_after_fork();
        FORKED.store(false, Release);
        (crate::LIFECYCLE.after_fork)(self);
    }

    // ---- the config ------------------------------------------------------------------------

    /// How many GPUs the container is given.
    #[inline]
    pub fn gpu_count(&self) -> usize {
        self.limits.len()
    }

    /// Quota of GPU `dev` (config index), bytes.
    #[inline]
    pub fn quota_of(&self, dev: usize) -> u64 {
        self.limits[dev]
    }

    /// The UUIDs of the container's GPUs, config order.
    pub fn assigned_uuids(&self) -> Vec<[u8; 16]> {
        self.cfg.uuids()
    }

    /// The UUIDs of the container's GPUs as NVML names them (`GPU-…`), config order.
    pub fn uuid_names(&self) -> impl Iterator<Item = &str> {
        self.cfg.gpu.iter().map(|g| g.uuid.as_str())
    }

    /// Where to say Hello to the manager, and the allocation to name: `None` unless the
    /// config gives both.
    pub fn registration(&self) -> Option<(&Path, &str)> {
        Some((self.cfg.socket.as_deref()?, self.cfg.allocation.as_deref()?))
    }

    /// The container's share and limit on `dev` (ppm): the run-time values in the region if
    /// set, else the config's. In a container vcuda-manager made (the config names an
    /// allocation) the run-time values may only lower the config's (`share_and_limit`).
    pub fn container_share(&self, dev: usize) -> (u64, u64) {
        let h = self.region.header();
        let g = &self.cfg.gpu[dev];
        share_and_limit(
            h.core_override[dev].load(Relaxed),
            h.core_limit_override[dev].load(Relaxed),
            u64::from(g.core) * (lim::PPM / 100),
            u64::from(g.core_limit.unwrap_or(0)) * (lim::PPM / 100),
            self.cfg.allocation.is_some(),
        )
    }

    /// Make the driver show only the container's GPUs (before the real `cuInit`).
    pub fn restrict_visible_devices(&self) {
        crate::visible::restrict_visible_devices(&self.cfg);
    }

    // ---- this process's slot ---------------------------------------------------------------

    /// This process's slot.
    #[inline]
    pub fn me(&self) -> SlotId {
        let p = self.me.load(Relaxed);
        SlotId {
            index: crate::conv::low32(p >> 32),
            generation: crate::conv::low32(p),
        }
    }

    /// This process's slot with its holder's pid and start time, as the slot says; `None`
    /// unless this process's slot is held (a forked child whose claim failed holds none).
    pub fn held_slot(&self) -> Option<(SlotId, u32, u64)> {
        let me = self.me();
        let slot = self.region.slots().get(usize::try_from(me.index).ok()?)?;
        let pid = slot.pid.load(Relaxed);
        if !self.region.owns(me) {
            return None;
        }
        Some((me, pid, slot.start_time.load(Relaxed)))
    }

    /// The pid the driver knows this process by (the manager tells us the host pid when
    /// namespaces differ; standalone, ours).
    pub fn driver_pid(&self) -> u32 {
        let me = self.me();
        let host = self
            .region
            .slots()
            .get(me.index as usize)
            .map_or(0, |s| s.host_pid.load(Relaxed));
        if host != 0 {
            host
        } else {
            std::process::id()
        }
    }

    /// NVML listed this process under `pid`.
    pub fn note_listed(&self, pid: u32) {
        self.listed_pid.store(pid, Relaxed);
    }

    /// Whether NVML has listed this process under `pid` (so its absence from a later list
    /// means it holds nothing, not that `pid` is not the driver's).
    pub fn was_listed_as(&self, pid: u32) -> bool {
        pid != 0 && self.listed_pid.load(Relaxed) == pid
    }

    /// The container's processes, as the region lists them.
    pub fn container_processes(&self) -> Vec<SlotView> {
        self.region.processes()
    }

    /// (driver's pid, container pid) of the container's active processes, into `out`;
    /// how many (no allocation).
    pub fn container_process_pids(&self, out: &mut [(u32, u32); MAX_PROCS]) -> usize {
        self.region.process_pids(out)
    }

    /// Reclaim the slots of dead processes; returns how many.
    pub fn reclaim_dead(&self) -> usize {
        self.region.reclaim_dead(true)
    }

    // ---- memory: the container's books -----------------------------------------------------

    /// What the container's processes hold on `dev`, bytes.
    #[inline]
    pub fn used_on(&self, dev: usize) -> u64 {
        self.region.used(dev)
    }

    /// What this process holds on `dev`: (counted through allocation calls, hidden).
    pub fn held_by_me(&self, dev: usize) -> (u64, u64) {
        self.region.mine(self.me(), dev)
    }

    /// Reserve `bytes` on `dev` for this process if the container stays within its quota;
    /// on refusal, reclaim dead processes and refresh pool figures, then try once more.
    #[inline]
    pub fn reserve(&self, dev: usize, bytes: u64) -> bool {
        if self.hidden_looked.load(Relaxed) & (1 << dev) == 0 {
            self.look_at_hidden(dev);
        }
        let me = self.me();
        if self.region.reserve(me, dev, bytes, self.limits[dev]) {
            return true;
        }
        self.reserve_slow(me, dev, bytes)
    }

    /// Count what the driver already charges this process on `dev` that no hooked call
    /// showed (a module loaded through the runtime's private table, what a library makes
    /// through `cuGetExportTable`), before the first reservation and the first
    /// `cuMemGetInfo` rely on the books. Once per GPU once
    /// NVML has given a clean reading; at most 8 tries in all while it does not (before the
    /// process has a context NVML does not list it), so a process NVML never lists does not
    /// pay for a query on every allocation. The sweep measures it anyway every 500 ms.
    #[cold]
    #[inline(never)]
    pub fn look_at_hidden(&self, dev: usize) {
        if self.hidden_looked.load(Relaxed) & (1 << dev) != 0 {
            return;
        }
        if self.hidden_tries.fetch_add(1, Relaxed) >= 8 {
            // Given up until the next teardown: every GPU counts as looked at, so the
            // allocation path is back to one load.
            self.hidden_looked.store(u32::MAX, Relaxed);
            return;
        }
        if (crate::LIFECYCLE.measure_hidden)(self, dev) {
            self.hidden_looked.fetch_or(1 << dev, Relaxed);
        }
    }

    /// After a teardown: the next reservation or `cuMemGetInfo` looks again.
    pub fn look_at_hidden_again(&self) {
        self.hidden_looked.store(0, Relaxed);
        self.hidden_tries.store(0, Relaxed);
    }

    #[cold]
    fn reserve_slow(&self, me: SlotId, dev: usize, bytes: u64) -> bool {
        let reclaimed = self.region.reclaim_dead(true);
        self.refresh_pools();
        let ok = self.region.reserve(me, dev, bytes, self.limits[dev]);
        log!(
            DEBUG,
            "reserve {bytes} on GPU {dev}: {} (reclaimed {reclaimed} dead processes; container uses {} of {})",
            if ok { "granted" } else { "refused" },
            self.region.used(dev),
            self.limits[dev]
        );
        ok
    }

    /// Give back `bytes` on `dev`.
    #[inline]
    pub fn release(&self, dev: usize, bytes: u64) {
        if !self.region.release(self.me(), dev, bytes) {
            log!(
                WARN,
                "released {bytes} on GPU {dev}, more than this process had counted: its counter was set to zero (a vcuda bug: please report it)"
            );
        }
    }

    /// Count `bytes` the driver already holds, without checking the quota.
    pub fn force_add(&self, dev: usize, bytes: u64) {
        self.region.force_add(self.me(), dev, bytes);
    }

    /// The library refuses a call on `dev` for the quota: count it in the region (the
    /// manager exports the count) and return `CUDA_ERROR_OUT_OF_MEMORY`. Only for the
    /// library's own refusals; an out-of-memory error the driver returns is passed on
    /// uncounted.
    #[cold]
    #[inline(never)]
    pub fn refuse_for_quota(&self, dev: usize) -> CUresult {
        self.region.count_oom_refusal(dev);
        CUDA_ERROR_OUT_OF_MEMORY
    }

    /// This process's raw allocation counter on `dev` (changes with every reservation and
    /// release: a reading taken while it did not move is clean).
    pub fn api_raw(&self, dev: usize) -> u64 {
        self.region.api_raw(self.me(), dev)
    }

    /// Raise this process's hidden memory on `dev` to `bytes` (never lowers); returns what
    /// it was.
    pub fn raise_hidden(&self, dev: usize, bytes: u64) -> u64 {
        self.region.raise_hidden(self.me(), dev, bytes)
    }

    /// Set this process's hidden memory on `dev`; returns what it was.
    pub fn set_hidden(&self, dev: usize, bytes: u64) -> u64 {
        self.region.set_hidden(self.me(), dev, bytes)
    }

    /// Add `bytes` to this process's hidden memory on `dev`.
    pub fn add_hidden(&self, dev: usize, bytes: u64) {
        let me = self.me();
        let (_, h) = self.region.mine(me, dev);
        self.region.set_hidden(me, dev, h + bytes);
    }

    /// The cost of one context or module on `dev` last measured by any of the container's
    /// processes (0: none yet).
    pub fn learned_cost(&self, what: Cost, dev: usize) -> u64 {
        self.cost_cell(what, dev).load(Relaxed)
    }

    /// One context or module was measured at `cost` on `dev` (the learned cost only grows).
    pub fn learn_cost(&self, what: Cost, dev: usize, cost: u64) {
        self.cost_cell(what, dev).fetch_max(cost, Relaxed);
    }

    fn cost_cell(&self, what: Cost, dev: usize) -> &AtomicU64 {
        let h = self.region.header();
        match what {
            Cost::Context => &h.ctx_cost[dev],
            Cost::Module => &h.module_cost[dev],
        }
    }

    // ---- the pointer table and the objects tracked by handle -------------------------------

    /// Remember a live allocation.
    #[inline]
    pub fn remember_alloc(&self, ptr: u64, rec: Rec) {
        self.allocs.insert(ptr, rec)
    }

    /// Forget a live allocation, returning what it counted.
    #[inline]
    pub fn forget_alloc(&self, ptr: u64) -> Option<Rec> {
        self.allocs.remove(ptr)
    }

    /// Every live allocation (a snapshot).
    pub fn live_allocs(&self) -> Vec<(u64, Rec)> {
        self.allocs.entries()
    }

    /// Remember an array (or mipmapped array) counted at `bytes` on `dev`.
    pub fn remember_array(&self, arr: usize, bytes: u64, dev: usize) {
        self.objs.lock().arrays.insert(arr, (bytes, dev));
    }

    /// Forget an array and release what it counted; whether it was known.
    pub fn forget_array(&self, arr: usize) -> bool {
        let gone = self.objs.lock().arrays.remove(&arr);
        if let Some((bytes, dev)) = gone {
            self.release(dev, bytes);
        }
        gone.is_some()
    }

    /// The known arrays (a snapshot).
    pub fn arrays(&self) -> Vec<usize> {
        self.objs.lock().arrays.keys().copied().collect()
    }

    /// Act on the VMM handles' books (under the objects lock).
    pub(crate) fn with_vmm<T>(&self, f: impl FnOnce(&mut VmmHandles) -> T) -> T {
        f(&mut self.objs.lock().vmm)
    }

    /// A pool was made on `dev` (nothing counted for it yet).
    pub fn add_pool(&self, pool: CUmemoryPool, dev: usize) {
        self.objs.lock().pools.add(pool as usize, dev);
    }

    /// A pool was destroyed: release what was counted for it.
    pub fn drop_pool(&self, pool: CUmemoryPool) {
        crate::pools::drop_pool(self, pool as usize);
    }

    /// Re-read every known pool (they shrink at synchronisations the application makes).
    pub fn refresh_pools(&self) {
        crate::pools::refresh_pools(&RealPools, self);
    }

    /// Hold while a call may let pools give cached memory back to the device
    /// (synchronisations, trims).
    #[inline]
    pub fn pools_may_shrink(&self) -> RwLockReadGuard<'_, ()> {
        self.pool_sync.read()
    }

    /// A graph memory node was made (from now on, launches refresh graph memory).
    pub fn saw_graph_memory(&self) {
        self.objs.lock().graph.saw();
    }

    // ---- which GPU -------------------------------------------------------------------------

    /// The config index of the current context's GPU, or `None` without a context.
    #[inline]
    pub fn current_dev(&self) -> Option<usize> {
        if let Some(s) = self.single_dev() {
            return Some(s);
        }
        self.dev_of_ordinal(crate::drv::ctx_ordinal()?)
    }

    /// The config index of the one GPU the driver shows, without a driver call (`None` when
    /// it shows several, or before `cuInit`).
    #[inline(always)]
    pub fn single_dev(&self) -> Option<usize> {
        let s = self.single.load(Relaxed);
        (s != u64::MAX).then(|| crate::conv::usize_of(s))
    }

    /// The CUDA ordinal of config GPU `dev`, if the driver shows it.
    pub fn ordinal_of(&self, dev: usize) -> Option<CUdevice> {
        self.visible.ordinal_of(dev)
    }

    /// Config index of CUDA ordinal `ord`.
    #[inline]
    pub fn dev_of_ordinal(&self, ord: CUdevice) -> Option<usize> {
        let ord = usize::try_from(ord).ok()?;
        self.visible.dev_of(ord, self.limits.len())
    }

    /// Record what the driver shows after a successful real `cuInit`, or refuse.
    pub fn set_visible(&self, uuids: &[[u8; 16]]) -> Result<(), String> {
        let mine = self.cfg.uuids();
        let mut vis = Vec::new();
        for u in uuids {
            match mine.iter().position(|m| m == u) {
                Some(i) => vis.push(i),
                None => {
                    return Err(format!(
                        "vcuda: the driver shows GPU {} which the container's config does not assign (CUDA_VISIBLE_DEVICES={:?}); GPU use is refused",
                        format_uuid(u),
                        std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_default()
                    ))
                }
            }
        }
        self.single.store(
            if vis.len() == 1 {
                vis[0] as u64
            } else {
                u64::MAX
            },
            Relaxed,
        );
        self.visible.set(&vis);
        Ok(())
    }

    /// The real NVML handle of config GPU `dev`, initialising NVML for libvcuda's own use on
    /// first call.
    pub fn nvml_handle(&self, dev: usize) -> Option<usize> {
        let handles = self.nvml_handles.get_or_init(|| {
            if self.nvml == 0 || ext!(NVML_ERROR_FUNCTION_NOT_FOUND, nvmlInit_v2()) != NVML_SUCCESS
            {
                return Vec::new();
            }
            self.cfg
                .gpu
                .iter()
                .map(|g| {
                    let name = CString::new(g.uuid.as_str()).unwrap_or_default();
                    let mut h: nvmlDevice_t = std::ptr::null_mut();
                    let rc = ext!(
                        NVML_ERROR_FUNCTION_NOT_FOUND,
                        nvmlDeviceGetHandleByUUID(name.as_ptr() as *const c_char, &mut h)
                    );
                    if rc == NVML_SUCCESS {
                        h as usize
                    } else {
                        0
                    }
                })
                .collect()
        });
        handles.get(dev).copied().filter(|&h| h != 0)
    }

    // ---- compute -----------------------------------------------------------------------------

    /// The compute limiter's buckets, probes and markers (`limit` acts on them).
    #[inline(always)]
    pub fn limiter(&self) -> &Limiter {
        &self.limiter
    }

    /// A throttled launch on `dev` slept `ns` (the region's `throttled_ns`).
    #[inline]
    pub fn add_throttled_ns(&self, dev: usize, ns: u64) {
        self.region.add_throttled_ns(dev, ns);
    }

    /// This process launched on `dev` at `now` (monotonic ns): published in its slot.
    pub fn note_launched(&self, dev: usize, now: u64) {
        if let Some(s) = self.region.slots().get(self.me().index as usize) {
            s.launched_at[dev].store(now, Relaxed);
        }
    }

    /// How many of the container's processes launched on `dev` within `window` ns of `now`.
    pub fn launchers(&self, dev: usize, now: u64, window: u64) -> usize {
        self.region
            .slots()
            .iter()
            .take(self.region.header().slots_used.load(Relaxed) as usize)
            .filter(|s| {
                let t = s.launched_at[dev].load(Relaxed);
                t != 0 && now.saturating_sub(t) < window
            })
            .count()
    }

    /// Where the region lives (for the log).
    pub fn region_path(&self) -> &Path {
        &self.cfg.region
    }

    /// The quotas of the container's GPUs, bytes (for the log).
    pub fn quotas(&self) -> &[u64] {
        &self.limits
    }
}

/// The container's books are the shared region's totals and this process's pointer table.
impl Books for Vcuda {
    #[inline(always)]
    fn current_dev(&self) -> Option<usize> {
        Vcuda::current_dev(self)
    }
    #[inline(always)]
    fn reserve(&self, dev: usize, bytes: u64) -> bool {
        Vcuda::reserve(self, dev, bytes)
    }
    #[inline(always)]
    fn release(&self, dev: usize, bytes: u64) {
        Vcuda::release(self, dev, bytes)
    }
    fn refuse_for_quota(&self, dev: usize) -> CUresult {
        Vcuda::refuse_for_quota(self, dev)
    }
    #[inline(always)]
    fn insert(&self, ptr: u64, rec: Rec) {
        self.allocs.insert(ptr, rec)
    }
    #[inline(always)]
    fn remove(&self, ptr: u64) -> Option<Rec> {
        self.allocs.remove(ptr)
    }
    fn ordinal_of(&self, dev: usize) -> CUdevice {
        Vcuda::ordinal_of(self, dev).unwrap_or(0)
    }
}

/// What the pool path asks the real driver (zero-sized; here, below the wrappers, because
/// [`Vcuda::reserve`]'s slow path re-reads the pools).
pub(crate) struct RealPools;

impl PoolDriver for RealPools {
    fn pool_reserved(&self, pool: usize) -> Option<u64> {
        crate::drv::pool_reserved(pool as CUmemoryPool)
    }
    fn pool_used(&self, pool: usize) -> Option<u64> {
        crate::drv::pool_attr(pool as CUmemoryPool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT)
    }
    fn default_pool(&self, ordinal: CUdevice) -> Option<usize> {
        let mut p: CUmemoryPool = std::ptr::null_mut();
        (ext!(
            CUDA_ERROR_NOT_SUPPORTED,
            cuDeviceGetMemPool(&mut p, ordinal)
        ) == CUDA_SUCCESS)
            .then_some(p as usize)
    }
    fn capturing(&self, stream: usize) -> bool {
        let mut status: u32 = 0;
        ext!(
            CUDA_ERROR_NOT_SUPPORTED,
            cuStreamIsCapturing(stream as CUstream, &mut status)
        ) == CUDA_SUCCESS
            && status == 1
    }
    fn graph_reserved(&self, ordinal: CUdevice) -> Option<u64> {
        let mut now: u64 = 0;
        (ext!(
            CUDA_ERROR_NOT_SUPPORTED,
            cuDeviceGetGraphMemAttribute(
                ordinal,
                CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT,
                (&mut now as *mut u64).cast()
            )
        ) == CUDA_SUCCESS)
            .then_some(now)
    }
}

/// The pool and graph memory tables live under the objects lock; a stream-ordered
/// allocation is serialised with this process's others and, if no synchronisation runs
/// now, excludes them while it counts on a pool's cache.
impl PoolBooks for Vcuda {
    fn force_add(&self, dev: usize, bytes: u64) {
        Vcuda::force_add(self, dev, bytes)
    }
    fn with_pools<T>(&self, f: impl FnOnce(&mut PoolTable) -> T) -> T {
        f(&mut self.objs.lock().pools)
    }
    fn with_graph<T>(&self, f: impl FnOnce(&mut GraphMem) -> T) -> T {
        f(&mut self.objs.lock().graph)
    }
    fn stream_ordered<T>(&self, f: impl FnOnce(bool) -> T) -> T {
        let _serial = self.pool_alloc.lock();
        let exclusive = self.pool_sync.try_write();
        let r = f(exclusive.is_some());
        drop(exclusive);
        r
    }
    fn shrinking<T>(&self, f: impl FnOnce() -> T) -> T {
        let _shared = self.pools_may_shrink();
        f()
    }
    fn gpu_count(&self) -> usize {
        Vcuda::gpu_count(self)
    }
    fn shown_ordinal(&self, dev: usize) -> Option<CUdevice> {
        Vcuda::ordinal_of(self, dev)
    }
}

/// Hidden memory is this process's slot's; learned costs are the region's header's.
impl CostBooks for Vcuda {
    fn api_raw(&self, dev: usize) -> u64 {
        Vcuda::api_raw(self, dev)
    }
    fn raise_hidden(&self, dev: usize, bytes: u64) -> u64 {
        Vcuda::raise_hidden(self, dev, bytes)
    }
    fn set_hidden(&self, dev: usize, bytes: u64) -> u64 {
        Vcuda::set_hidden(self, dev, bytes)
    }
    fn add_hidden(&self, dev: usize, bytes: u64) {
        Vcuda::add_hidden(self, dev, bytes)
    }
    fn learned_cost(&self, what: Cost, dev: usize) -> u64 {
        Vcuda::learned_cost(self, what, dev)
    }
    fn learn_cost(&self, what: Cost, dev: usize, cost: u64) {
        Vcuda::learn_cost(self, what, dev, cost)
    }
    fn used_on(&self, dev: usize) -> u64 {
        Vcuda::used_on(self, dev)
    }
    fn quota_of(&self, dev: usize) -> u64 {
        Vcuda::quota_of(self, dev)
    }
}

/// A share and limit (ppm) from the region's run-time values (0: unset) and the config's.
/// `capped`: the config is vcuda-manager's (it names an allocation). The region is writable
/// from inside the container, the config is not, so there a run-time value may lower what
/// the config grants, never raise it: the manager writes the allocation's own values
/// (`rounds::region_rates`, from the allocation the config was written from), so an honest
/// region never asks for more. Without the cap root in a 30 % container that wrote 100 %
/// into its region got the whole GPU until the compute watchdog caught it
/// (tests/containers/test_limiter_in_containers.py). Without a manager (a config of one's
/// own, no allocation) whoever writes the region sets the share at run time, uncapped.
fn share_and_limit(
    run_share: u64,
    run_limit: u64,
    cfg_share: u64,
    cfg_limit: u64,
    capped: bool,
) -> (u64, u64) {
    let pick = |run: u64, cfg: u64| match (run, capped) {
        (0, _) => cfg,
        (run, true) => run.min(cfg),
        (run, false) => run,
    };
    let share = pick(run_share, cfg_share);
    // A limit below the share (0: none, a hard share) is the share. A run-time limit in a
    // managed region is capped at what the config grants: its limit, or else its share.
    let limit = match run_limit {
        0 => cfg_limit,
        run if capped => run.min(cfg_limit.max(cfg_share)),
        run => run,
    };
    (share, limit.max(share))
}

#[cfg(test)]
mod share_tests {
    use super::share_and_limit;
    use proptest::prelude::*;

    #[test]
    fn under_the_manager_the_config_grants_and_the_region_may_only_lower() {
        let f = |rs, rl, cs, cl| share_and_limit(rs, rl, cs, cl, true);
        // unset run-time values: the config's
        assert_eq!(f(0, 0, 300_000, 0), (300_000, 300_000));
        assert_eq!(f(0, 0, 300_000, 600_000), (300_000, 600_000));
        // the manager's own values
        assert_eq!(f(300_000, 600_000, 300_000, 600_000), (300_000, 600_000));
        // raised from inside the container: capped
        assert_eq!(f(1_000_000, 0, 300_000, 0), (300_000, 300_000));
        assert_eq!(f(0, 1_000_000, 300_000, 0), (300_000, 300_000));
        assert_eq!(
            f(1_000_000, 1_000_000, 300_000, 600_000),
            (300_000, 600_000)
        );
        // lowered: kept, and hard
        assert_eq!(f(100_000, 0, 300_000, 0), (100_000, 100_000));
    }

    #[test]
    fn without_a_manager_the_region_sets_the_share_at_run_time() {
        let f = |rs, rl, cs, cl| share_and_limit(rs, rl, cs, cl, false);
        assert_eq!(f(600_000, 0, 200_000, 0), (600_000, 600_000));
        assert_eq!(f(0, 0, 200_000, 0), (200_000, 200_000));
        // a share lowered at run time stays hard: its limit is not the config's share
        assert_eq!(f(100_000, 0, 200_000, 0), (100_000, 100_000));
        assert_eq!(f(200_000, 600_000, 200_000, 0), (200_000, 600_000));
    }

    proptest! {
        #[test]
        fn nothing_written_into_a_managed_region_raises_the_share_or_the_limit(
            run_share in any::<u64>(), run_limit in any::<u64>(),
            cfg_share in 0u64..=1_000_000, cfg_limit in 0u64..=1_000_000,
        ) {
            let (share, limit) = share_and_limit(run_share, run_limit, cfg_share, cfg_limit, true);
            prop_assert!(share <= cfg_share);
            prop_assert!(limit <= cfg_limit.max(cfg_share));
            prop_assert!(share <= limit);
        }

        #[test]
        fn without_a_manager_the_values_are_what_was_there_before(
            run_share in any::<u64>(), run_limit in any::<u64>(),
            cfg_share in 0u64..=1_000_000, cfg_limit in 0u64..=1_000_000,
        ) {
            // the formula before the cap
            let share = if run_share == 0 { cfg_share } else { run_share };
            let limit = if run_limit == 0 { cfg_limit } else { run_limit };
            prop_assert_eq!(
                share_and_limit(run_share, run_limit, cfg_share, cfg_limit, false),
                (share, limit.max(share))
            );
        }
    }
}
