//! The process-wide state, made on the first CUDA or NVML call: the container config, the
//! real libraries, the shared region and this process's slot in it. Any failure here fails
//! closed: every CUDA call returns `CUDA_ERROR_NOT_PERMITTED` and every NVML call
//! `NVML_ERROR_NO_PERMISSION`, and one line on stderr says which file and what is wrong.
//!
//! Also: which GPUs the driver shows (`CUDA_VISIBLE_DEVICES`, composed from the config and
//! whatever the application asked for), fork handling (a child gets its own slot and
//! accounting), and the sweep thread (reclaims dead processes' reservations, measures memory
//! the driver charges that no allocation call shows).

use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::{c_void, CStr};
use std::sync::atomic::{
    AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering::Acquire, Ordering::Relaxed,
    Ordering::Release,
};
use std::sync::OnceLock;
use std::time::Duration;

use parking_lot::Mutex;
use vcuda_contract::config::{format_uuid, ContainerConfig, MAX_GPUS};
use vcuda_contract::region::{Region, SlotId};

use crate::ffi::*;
use crate::hooks::{self, Lib};
use crate::log::{log, DEBUG, INFO, WARN};
use crate::table::AllocTable;

/// Why GPU use is refused (printed once).
pub struct Failure {
    pub msg: String,
}

/// Objects whose memory is tracked by handle rather than by pointer.
#[derive(Default)]
pub struct Objects {
    /// CUarray / CUmipmappedArray → (bytes, GPU).
    pub arrays: HashMap<usize, (u64, usize)>,
    /// VMM handles and their mappings (`quota::VmmHandles`).
    pub(crate) vmm: crate::quota::VmmHandles,
    /// Memory pool → (GPU, bytes reserved for it).
    pub pools: HashMap<usize, (usize, u64)>,
    /// Graph memory reserved per GPU, as last read.
    pub graph_mem: [u64; MAX_GPUS],
    /// Whether any graph memory node was ever made (then launches refresh graph memory).
    pub graph_nodes_seen: bool,
}

/// CUDA ordinal → config index, as the driver showed it after `cuInit`: a launch of a
/// multi-GPU process looks its GPU up here, so reads take no lock. Written once per
/// successful `cuInit` (the same answer each time); `len` is published last.
#[derive(Default)]
struct Visible {
    /// Ordinals the driver shows, plus one; 0 = not yet known (ordinals follow the config).
    len_plus_one: AtomicUsize,
    /// Config index of each ordinal below that.
    map: [AtomicU8; MAX_GPUS],
}

/// A published view of [`Visible`].
struct VisibleView<'a> {
    len: usize,
    map: &'a [AtomicU8; MAX_GPUS],
}

impl Visible {
    fn get(&self) -> Option<VisibleView<'_>> {
        match self.len_plus_one.load(Acquire) {
            0 => None,
            n => Some(VisibleView {
                len: (n - 1).min(MAX_GPUS),
                map: &self.map,
            }),
        }
    }

    fn set(&self, vis: &[usize]) {
        for (slot, &d) in self.map.iter().zip(vis) {
            slot.store(u8::try_from(d).unwrap_or(u8::MAX), Relaxed);
        }
        self.len_plus_one
            .store(vis.len().min(MAX_GPUS) + 1, Release);
    }
}

pub struct Vcuda {
    pub cfg: ContainerConfig,
    /// Quota per GPU (config index), bytes.
    pub limits: Vec<u64>,
    pub region: Region,
    pub cuda: usize,
    pub nvml: usize,
    /// Packed SlotId (index << 32 | generation).
    me: AtomicU64,
    pub allocs: AllocTable,
    pub objs: Mutex<Objects>,
    /// CUDA ordinal → config index, once the driver is initialised (read on every launch of
    /// a multi-GPU process: lock-free).
    visible: Visible,
    /// Config index the single visible GPU has (fast path), or usize::MAX.
    single: AtomicU64,
    /// Real NVML handles of the config's GPUs (config order), once NVML is initialised.
    pub nvml_handles: OnceLock<Vec<usize>>,
    /// Synchronisations (which let pools give cached memory back to the device) hold this
    /// shared; a stream-ordered allocation that counts on a pool's cached memory holds it
    /// exclusively, so that memory cannot vanish between the check and the driver call.
    pub pool_sync: parking_lot::RwLock<()>,
    /// Serialises this process's stream-ordered allocations among themselves (another
    /// thread's allocation could otherwise take the cached memory one counts on).
    pub pool_alloc: Mutex<()>,
    /// The compute limiter's buckets.
    pub limiter: crate::limit::Limiter,
}

static STATE: OnceLock<Result<Vcuda, Failure>> = OnceLock::new();
static FORKED: AtomicBool = AtomicBool::new(false);
static EXITING: AtomicBool = AtomicBool::new(false);
static REPORTED: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// Set while libvcuda itself looks symbols up, so our own dlsym hook stays out of it.
    static OWN_LOOKUP: Cell<bool> = const { Cell::new(false) };
}

pub fn in_own_lookup() -> bool {
    OWN_LOOKUP.try_with(|c| c.get()).unwrap_or(true)
}

fn with_own_lookup<T>(f: impl FnOnce() -> T) -> T {
    let _ = OWN_LOOKUP.try_with(|c| c.set(true));
    let r = f();
    let _ = OWN_LOOKUP.try_with(|c| c.set(false));
    r
}

/// The state, started on first use. `Err` when GPU use is refused.
#[inline]
pub fn vc() -> Result<&'static Vcuda, &'static Failure> {
    let st = match STATE.get() {
        Some(s) => s,
        None => STATE.get_or_init(start),
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

fn start() -> Result<Vcuda, Failure> {
    with_own_lookup(start_inner)
}

fn start_inner() -> Result<Vcuda, Failure> {
    let fail = |msg: String| Failure { msg };
    let path = ContainerConfig::path_from_env();
    let cfg = ContainerConfig::load(&path).map_err(|e| fail(e.to_string()))?;
    crate::dlsym::set_real_libraries(&cfg.cuda_library, &cfg.nvml_library);
    let cuda = crate::dlsym::open_library(&cfg.cuda_library).map_err(|e| {
        fail(format!(
            "vcuda: config {}: cannot load the CUDA driver {:?} ({e}); GPU use is refused",
            path.display(),
            cfg.cuda_library
        ))
    })?;
    let nvml = match crate::dlsym::open_library(&cfg.nvml_library) {
        Ok(h) => h,
        Err(e) => {
            log!(WARN, "cannot load NVML {:?} ({e}): NVML calls fail and hidden memory is measured from cuMemGetInfo", cfg.nvml_library);
            std::ptr::null_mut()
        }
    };
    let lookup = |lib: Lib, name: &CStr| -> *mut c_void {
        let h = match lib {
            Lib::Cuda => cuda,
            Lib::Nvml => nvml,
        };
        if h.is_null() {
            return std::ptr::null_mut();
        }
        // SAFETY: h is a handle our own dlopen returned; we never close it.
        unsafe { crate::dlsym::real_dlsym(h, name) }
    };
    hooks::load_all(&lookup);
    hooks::index_real(&lookup);
    let region =
        Region::open_or_create(&cfg.region, &cfg.uuids()).map_err(|e| fail(e.to_string()))?;
    region.reclaim_dead(true);
    let me = region.claim().map_err(|e| fail(e.to_string()))?;
    let limits = cfg.gpu.iter().map(|g| g.memory_mib << 20).collect();
    let v = Vcuda {
        limits,
        region,
        cuda: cuda as usize,
        nvml: nvml as usize,
        me: AtomicU64::new(pack(me)),
        allocs: AllocTable::new(16),
        objs: Mutex::new(Objects::default()),
        visible: Visible::default(),
        single: AtomicU64::new(u64::MAX),
        nvml_handles: OnceLock::new(),
        pool_sync: parking_lot::RwLock::new(()),
        pool_alloc: Mutex::new(()),
        limiter: crate::limit::Limiter::new(&cfg.gpu.iter().map(|g| g.core).collect::<Vec<_>>()),
        cfg,
    };
    // SAFETY: registering plain extern "C" functions without captured state.
    unsafe {
        libc::atexit(at_exit);
        libc::pthread_atfork(None, None, Some(in_child));
    }
    start_sweeper();
    crate::limit::start_controller();
    // Registration with the manager (register.rs): a thread of its own, never waited for.
    crate::register::start(&v);
    log!(
        INFO,
        "limits {:?} bytes, region {}",
        v.limits,
        v.cfg.region.display()
    );
    Ok(v)
}

fn pack(s: SlotId) -> u64 {
    (u64::from(s.index) << 32) | u64::from(s.generation)
}

/// At exit the slot is deliberately kept: the driver frees this process's device memory only
/// as the process ends, after exit handlers run. Giving the reservation back earlier would
/// let a peer allocate into memory that is still held. The slot is reclaimed once the
/// process is gone (its lock is dropped by the kernel), by the next peer that needs the
/// room or by the sweep.
extern "C" fn at_exit() {
    EXITING.store(true, Relaxed);
}

/// Whether background threads should stop (the process exits, or this is a forked child
/// whose threads were not copied and are restarted by `after_fork`).
pub fn stopping() -> bool {
    EXITING.load(Relaxed) || FORKED.load(Relaxed)
}

extern "C" fn in_child() {
    FORKED.store(true, Relaxed);
}

fn start_sweeper() {
    let spawned = std::thread::Builder::new()
        .name("vcuda-sweep".into())
        .stack_size(256 * 1024)
        .spawn(|| loop {
            std::thread::sleep(Duration::from_millis(500));
            if EXITING.load(Relaxed) || FORKED.load(Relaxed) {
                return;
            }
            if let Some(Ok(v)) = STATE.get() {
                v.sweep();
            }
        });
    if let Err(e) = spawned {
        log!(WARN, "cannot start the sweep thread ({e}); dead processes are reclaimed only when memory runs out");
    }
}

impl Vcuda {
    /// This process's slot.
    #[inline]
    pub fn me(&self) -> SlotId {
        let p = self.me.load(Relaxed);
        SlotId {
            index: crate::conv::low32(p >> 32),
            generation: crate::conv::low32(p),
        }
    }

    /// In a forked child: a new open file description of the region, a slot of its own, and
    /// none of the parent's allocations.
    #[cold]
    fn after_fork(&self) {
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
        self.limiter.reset_after_fork();
        FORKED.store(false, Release);
        start_sweeper();
        crate::limit::start_controller();
        // Registration (register.rs): the child's own slot; skipped if its claim failed.
        crate::register::start(self);
    }

    /// Quota of GPU `dev` (config index).
    #[inline]
    pub fn limit(&self, dev: usize) -> u64 {
        self.limits[dev]
    }

    /// Reserve `bytes` on `dev` for this process if the container stays within its quota;
    /// on refusal, reclaim dead processes and refresh pool figures, then try once more.
    #[inline]
    pub fn reserve(&self, dev: usize, bytes: u64) -> bool {
        let me = self.me();
        if self.region.reserve(me, dev, bytes, self.limits[dev]) {
            return true;
        }
        self.reserve_slow(me, dev, bytes)
    }

    #[cold]
    fn reserve_slow(&self, me: SlotId, dev: usize, bytes: u64) -> bool {
        let reclaimed = self.region.reclaim_dead(true);
        crate::memory::refresh_pools(self);
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

    /// The config index of the current context's GPU, or `None` without a context.
    #[inline]
    pub fn current_dev(&self) -> Option<usize> {
        let s = self.single.load(Relaxed);
        if s != u64::MAX {
            return Some(crate::conv::usize_of(s));
        }
        self.dev_of_ordinal(crate::drv::ctx_ordinal()?)
    }

    /// The CUDA ordinal of config GPU `dev`, if the driver shows it.
    pub fn ordinal_of(&self, dev: usize) -> Option<CUdevice> {
        match self.visible.get() {
            None => CUdevice::try_from(dev).ok(),
            Some(vis) => (0..vis.len)
                .find(|&o| usize::from(vis.map[o].load(Relaxed)) == dev)
                .and_then(|o| CUdevice::try_from(o).ok()),
        }
    }

    /// Config index of CUDA ordinal `ord`.
    pub fn dev_of_ordinal(&self, ord: CUdevice) -> Option<usize> {
        let ord = usize::try_from(ord).ok()?;
        match self.visible.get() {
            // Before cuInit was verified: ordinals follow the config.
            None => (ord < self.limits.len()).then_some(ord),
            Some(vis) => (ord < vis.len).then(|| usize::from(vis.map[ord].load(Relaxed))),
        }
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

    /// Periodic upkeep (sweep thread): reclaim dead processes, refresh pool and graph
    /// memory, measure hidden memory.
    fn sweep(&self) {
        let n = self.region.reclaim_dead(true);
        if n > 0 {
            log!(INFO, "reclaimed {n} dead process slot(s)");
        }
        if EXITING.load(Relaxed) {
            return;
        }
        crate::memory::refresh_pools(self);
        crate::memory::refresh_graph_mem(self);
        for dev in 0..self.limits.len() {
            crate::context::reconcile(self, dev);
        }
    }
}

/// Which config GPUs a `CUDA_VISIBLE_DEVICES` value selects, in its order. Entries are
/// indices into the container's GPUs or (prefixes of) their UUIDs; as CUDA does, the list
/// stops at the first invalid or repeated entry.
pub fn compose_visible(app: Option<&str>, assigned: &[[u8; 16]]) -> Vec<usize> {
    let Some(spec) = app else {
        return (0..assigned.len()).collect();
    };
    let names: Vec<String> = assigned
        .iter()
        .map(|u| format_uuid(u).to_ascii_lowercase())
        .collect();
    let mut out = Vec::new();
    for entry in spec.split(',') {
        let e = entry.trim();
        let pick = if !e.is_empty() && e.bytes().all(|b| b.is_ascii_digit()) {
            e.parse::<usize>().ok().filter(|&i| i < assigned.len())
        } else if e.len() > 4 && e[..4].eq_ignore_ascii_case("GPU-") {
            let lower = e.to_ascii_lowercase();
            let hits: Vec<usize> = names
                .iter()
                .enumerate()
                .filter(|(_, n)| n.starts_with(&lower))
                .map(|(i, _)| i)
                .collect();
            (hits.len() == 1).then(|| hits[0])
        } else {
            None
        };
        match pick {
            Some(i) if !out.contains(&i) => out.push(i),
            _ => break,
        }
    }
    out
}

/// The `CUDA_VISIBLE_DEVICES` value that shows the driver exactly `sel` of `assigned`.
pub fn visible_value(sel: &[usize], assigned: &[[u8; 16]]) -> String {
    sel.iter()
        .map(|&i| format_uuid(&assigned[i]))
        .collect::<Vec<_>>()
        .join(",")
}

/// Make the driver show only the container's GPUs. Called from the library constructor
/// (before `main`, while the process has one thread) and again before the real `cuInit`,
/// in case the application changed `CUDA_VISIBLE_DEVICES` in between.
pub fn restrict_visible_devices(cfg: &ContainerConfig) {
    let assigned = cfg.uuids();
    let current = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let want = visible_value(&compose_visible(current.as_deref(), &assigned), &assigned);
    if current.as_deref() != Some(want.as_str()) {
        log!(DEBUG, "CUDA_VISIBLE_DEVICES {:?} -> {:?}", current, want);
        // SAFETY: set_var is unsound only while other threads read the environment; this runs
        // in the constructor (one thread) or just before cuInit (see the README's caveat).
        unsafe { std::env::set_var("CUDA_VISIBLE_DEVICES", &want) };
    }
}

/// The library constructor: restrict the driver's devices before anything runs. Silent on
/// any problem (a process that never uses CUDA must not notice libvcuda).
extern "C" fn constructor() {
    let _ = std::panic::catch_unwind(|| {
        if let Ok(cfg) = ContainerConfig::load(&ContainerConfig::path_from_env()) {
            crate::dlsym::set_real_libraries(&cfg.cuda_library, &cfg.nvml_library);
            restrict_visible_devices(&cfg);
        }
    });
}

#[used]
#[unsafe(link_section = ".init_array")]
static CONSTRUCTOR: extern "C" fn() = constructor;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ordinal_map_is_unknown_until_set_and_then_what_the_driver_showed() {
        let v = Visible::default();
        assert!(
            v.get().is_none(),
            "before cuInit: ordinals follow the config"
        );
        // The driver shows config GPUs 2 and 0 (CUDA_VISIBLE_DEVICES=2,0).
        v.set(&[2, 0]);
        let view = v.get().expect("set");
        assert_eq!(view.len, 2);
        let map: Vec<u8> = (0..view.len).map(|o| view.map[o].load(Relaxed)).collect();
        assert_eq!(map, [2, 0]);
        // Set again after another cuInit with fewer GPUs: the shorter view wins.
        v.set(&[1]);
        assert_eq!(v.get().map(|w| w.len), Some(1));
        // No driver can show more GPUs than the table holds.
        v.set(&(0..MAX_GPUS + 3).collect::<Vec<_>>());
        assert_eq!(v.get().map(|w| w.len), Some(MAX_GPUS));
    }

    fn uuids() -> Vec<[u8; 16]> {
        vec![[0xaa; 16], [0xab; 16], [0x10; 16]]
    }

    #[test]
    fn visible_devices_compose_with_the_applications_choice() {
        let a = uuids();
        assert_eq!(compose_visible(None, &a), vec![0, 1, 2]);
        assert_eq!(compose_visible(Some("2,0"), &a), vec![2, 0]);
        assert_eq!(compose_visible(Some(" 1 "), &a), vec![1]);
        assert_eq!(
            compose_visible(Some("1,7,0"), &a),
            vec![1],
            "stops at an index the container lacks"
        );
        assert_eq!(
            compose_visible(Some("0,0,1"), &a),
            vec![0],
            "stops at a repeat"
        );
        assert_eq!(compose_visible(Some(""), &a), Vec::<usize>::new());
        assert_eq!(
            compose_visible(Some("GPU-10101010"), &a),
            vec![2],
            "UUID prefix"
        );
        assert_eq!(
            compose_visible(Some("GPU-a"), &a),
            Vec::<usize>::new(),
            "ambiguous prefix"
        );
        assert_eq!(compose_visible(Some("MIG-1,0"), &a), Vec::<usize>::new());
        let full = format_uuid(&a[1]).to_uppercase().replace("GPU", "gpu");
        assert_eq!(compose_visible(Some(&full), &a), vec![1]);
        // our own value composes to itself, so children and re-checks are idempotent
        let v = visible_value(&[2, 0], &a);
        assert_eq!(compose_visible(Some(&v), &a), vec![2, 0]);
    }
}
