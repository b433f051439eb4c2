//! NVML as the container sees it: only its GPUs, their memory the size of the quota, only its
//! processes. (The real NVML handles libvcuda uses for itself are the state's:
//! `Vcuda::nvml_handle`.)
//!
//! - **Enumeration.** The container's GPUs are its config's, in config order, as far as the
//!   real NVML has them; that order is the container's NVML index order (NVML ignores
//!   `CUDA_VISIBLE_DEVICES`, as the real one does). Handles are the real ones, looked up by
//!   UUID through the *caller's* NVML initialisation (so `NVML_ERROR_UNINITIALIZED` and the
//!   like come through); a lookup by UUID, bus id or serial of any other GPU is
//!   `NVML_ERROR_NOT_FOUND`.
//! - **Memory.** total = min(quota, physical), used = what the container holds on the GPU
//!   (the shared region), free = total − used, never below zero; v2's `reserved` is 0.
//! - **Processes.** Every `nvmlDevice*RunningProcesses*` keeps only the container's processes
//!   (NVML reports host pids; the region knows each slot's host pid), reported by their
//!   container pid, with nvml.h's `*infoCount` protocol; so do the per-process utilization
//!   samples (`nvmlDeviceGetProcessUtilization`, `nvmlDeviceGetProcessesUtilizationInfo`) and
//!   the accounting lists (`nvmlDeviceGetAccountingPids`; `nvmlDeviceGetAccountingStats`
//!   answers only the container's pids).
//!
//! - **The lookup cache.** Finding the container's handles by UUID costs the real NVML a
//!   string search per GPU; memory info and process lists need them on every call. The
//!   handles of a complete lookup (every GPU found, or absent) are kept ([`GpuCache`]) until
//!   the caller initialises or shuts NVML down again (`nvmlInit*`, `nvmlShutdown`), the only
//!   events after which the real NVML may hand out other handles; a lookup with a failed GPU
//!   (`NVML_ERROR_GPU_IS_LOST`, say) is not kept, so the failure is asked about again.
//!
//! Everything else NVML offers passes through untouched.

use std::ffi::{c_char, c_uint, CString};
use std::mem::MaybeUninit;
use std::sync::atomic::{fence, AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;

use vcuda_contract::config::MAX_GPUS;
use vcuda_contract::region::MAX_PROCS;

use crate::conv::u32_sat;
use crate::ffi::*;
use crate::state::{nvml, Vcuda};

hooks! {
    Nvml fn nvmlInit() -> nvmlReturn_t => init_v1;
    Nvml fn nvmlInit_v2() -> nvmlReturn_t => init_v2;
    Nvml fn nvmlInitWithFlags(flags: c_uint) -> nvmlReturn_t => init_with_flags;
    Nvml fn nvmlShutdown() -> nvmlReturn_t => shutdown;
    Nvml fn nvmlDeviceGetCount(deviceCount: *mut c_uint) -> nvmlReturn_t => count_v1;
    Nvml fn nvmlDeviceGetCount_v2(deviceCount: *mut c_uint) -> nvmlReturn_t => count_v2;
    Nvml fn nvmlDeviceGetHandleByIndex(index: c_uint, device: *mut nvmlDevice_t) -> nvmlReturn_t => by_index_v1;
    Nvml fn nvmlDeviceGetHandleByIndex_v2(index: c_uint, device: *mut nvmlDevice_t) -> nvmlReturn_t => by_index_v2;
    Nvml fn nvmlDeviceGetHandleByUUID(uuid: *const c_char, device: *mut nvmlDevice_t) -> nvmlReturn_t => by_uuid;
    Nvml fn nvmlDeviceGetHandleByPciBusId(pciBusId: *const c_char, device: *mut nvmlDevice_t) -> nvmlReturn_t => by_bus_id_v1;
    Nvml fn nvmlDeviceGetHandleByPciBusId_v2(pciBusId: *const c_char, device: *mut nvmlDevice_t) -> nvmlReturn_t => by_bus_id_v2;
    Nvml fn nvmlDeviceGetHandleBySerial(serial: *const c_char, device: *mut nvmlDevice_t) -> nvmlReturn_t => by_serial;
    Nvml fn nvmlDeviceGetIndex(device: nvmlDevice_t, index: *mut c_uint) -> nvmlReturn_t => get_index;
    Nvml fn nvmlDeviceGetMemoryInfo(device: nvmlDevice_t, memory: *mut nvmlMemory_t) -> nvmlReturn_t => memory_v1;
    Nvml fn nvmlDeviceGetMemoryInfo_v2(device: nvmlDevice_t, memory: *mut nvmlMemory_v2_t) -> nvmlReturn_t => memory_v2;
    Nvml fn nvmlDeviceGetComputeRunningProcesses(device: nvmlDevice_t, infoCount: *mut c_uint, infos: *mut nvmlProcessInfo_v1_t) -> nvmlReturn_t => compute_v1;
    Nvml fn nvmlDeviceGetComputeRunningProcesses_v2(device: nvmlDevice_t, infoCount: *mut c_uint, infos: *mut nvmlProcessInfo_t) -> nvmlReturn_t => compute_v2;
    Nvml fn nvmlDeviceGetComputeRunningProcesses_v3(device: nvmlDevice_t, infoCount: *mut c_uint, infos: *mut nvmlProcessInfo_t) -> nvmlReturn_t => compute_v3;
    Nvml fn nvmlDeviceGetGraphicsRunningProcesses(device: nvmlDevice_t, infoCount: *mut c_uint, infos: *mut nvmlProcessInfo_v1_t) -> nvmlReturn_t => graphics_v1;
    Nvml fn nvmlDeviceGetGraphicsRunningProcesses_v2(device: nvmlDevice_t, infoCount: *mut c_uint, infos: *mut nvmlProcessInfo_t) -> nvmlReturn_t => graphics_v2;
    Nvml fn nvmlDeviceGetGraphicsRunningProcesses_v3(device: nvmlDevice_t, infoCount: *mut c_uint, infos: *mut nvmlProcessInfo_t) -> nvmlReturn_t => graphics_v3;
    Nvml fn nvmlDeviceGetMPSComputeRunningProcesses(device: nvmlDevice_t, infoCount: *mut c_uint, infos: *mut nvmlProcessInfo_v1_t) -> nvmlReturn_t => mps_v1;
    Nvml fn nvmlDeviceGetMPSComputeRunningProcesses_v2(device: nvmlDevice_t, infoCount: *mut c_uint, infos: *mut nvmlProcessInfo_t) -> nvmlReturn_t => mps_v2;
    Nvml fn nvmlDeviceGetMPSComputeRunningProcesses_v3(device: nvmlDevice_t, infoCount: *mut c_uint, infos: *mut nvmlProcessInfo_t) -> nvmlReturn_t => mps_v3;
    Nvml fn nvmlDeviceGetProcessUtilization(device: nvmlDevice_t, utilization: *mut nvmlProcessUtilizationSample_t, processSamplesCount: *mut c_uint, lastSeenTimeStamp: u64) -> nvmlReturn_t => process_utilization;
    Nvml fn nvmlDeviceGetProcessesUtilizationInfo(device: nvmlDevice_t, procesesUtilInfo: *mut nvmlProcessesUtilizationInfo_t) -> nvmlReturn_t => processes_utilization;
    Nvml fn nvmlDeviceGetAccountingPids(device: nvmlDevice_t, count: *mut c_uint, pids: *mut c_uint) -> nvmlReturn_t => accounting_pids;
    Nvml fn nvmlDeviceGetAccountingStats(device: nvmlDevice_t, pid: c_uint, stats: *mut nvmlAccountingStats_t) -> nvmlReturn_t => accounting_stats;
    Nvml fn nvmlDeviceGetAccountingStats_v2(device: nvmlDevice_t, stats: *mut nvmlAccountingStats_v2_t) -> nvmlReturn_t => accounting_stats_v2;
}

/// What a wrapper returns when the real NVML lacks the function.
const MISSING: nvmlReturn_t = NVML_ERROR_FUNCTION_NOT_FOUND;

// ---- the container's GPUs ---------------------------------------------------------------

/// One config GPU as the real NVML shows it now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    /// Its real handle.
    Handle(usize),
    /// The real NVML does not have it: not one of the container's devices.
    Absent,
    /// It exists but the lookup failed (e.g. `NVML_ERROR_GPU_IS_LOST`): a device whose
    /// handle cannot be had; its index returns this error.
    Failed(nvmlReturn_t),
}

/// What a lookup by UUID returned, for one GPU: `Err` when NVML as a whole cannot answer
/// (not initialised, function missing), which the caller gets as is.
pub fn classify(rc: nvmlReturn_t, handle: nvmlDevice_t) -> Result<Found, nvmlReturn_t> {
    match rc {
        NVML_SUCCESS if !handle.is_null() => Ok(Found::Handle(handle as usize)),
        NVML_SUCCESS => Ok(Found::Failed(NVML_ERROR_UNKNOWN)),
        NVML_ERROR_NOT_FOUND | NVML_ERROR_INVALID_ARGUMENT => Ok(Found::Absent),
        NVML_ERROR_UNINITIALIZED
        | NVML_ERROR_FUNCTION_NOT_FOUND
        | NVML_ERROR_DRIVER_NOT_LOADED
        | NVML_ERROR_LIBRARY_NOT_FOUND => Err(rc),
        other => Ok(Found::Failed(other)),
    }
}

const NVML_ERROR_DRIVER_NOT_LOADED: nvmlReturn_t = 9;
const NVML_ERROR_LIBRARY_NOT_FOUND: nvmlReturn_t = 12;

/// The config's GPUs, in config order (at most [`MAX_GPUS`]).
#[derive(Debug, Clone, Copy)]
pub struct Gpus {
    found: [Found; MAX_GPUS],
    n: usize,
}

impl Gpus {
    pub fn new(found: &[Found]) -> Gpus {
        let mut g = Gpus {
            found: [Found::Absent; MAX_GPUS],
            n: found.len().min(MAX_GPUS),
        };
        g.found[..g.n].copy_from_slice(&found[..g.n]);
        g
    }

    /// The container's devices in its NVML index order: (config index, what was found).
    fn devices(&self) -> impl Iterator<Item = (usize, Found)> + '_ {
        self.found[..self.n]
            .iter()
            .copied()
            .enumerate()
            .filter(|(_, f)| *f != Found::Absent)
    }

    /// How many devices the container has.
    pub fn count(&self) -> usize {
        self.devices().count()
    }

    /// Container index `i`: its config index and what was found.
    pub fn at(&self, i: usize) -> Option<(usize, Found)> {
        self.devices().nth(i)
    }

    /// (container index, config index) of a real handle, if it is one of the container's.
    pub fn position(&self, handle: nvmlDevice_t) -> Option<(usize, usize)> {
        if handle.is_null() {
            return None;
        }
        self.devices()
            .enumerate()
            .find(|(_, (_, f))| *f == Found::Handle(handle as usize))
            .map(|(i, (dev, _))| (i, dev))
    }
}

/// The config GPUs' UUIDs as C strings (made once).
fn uuids(v: &Vcuda) -> &'static [CString] {
    static UUIDS: OnceLock<Vec<CString>> = OnceLock::new();
    UUIDS.get_or_init(|| {
        v.uuid_names()
            .map(|u| CString::new(u).unwrap_or_default())
            .collect()
    })
}

/// The container's GPUs as a complete lookup found them, kept until the caller's NVML is
/// initialised or shut down again. A seqlock over atomics: readers never wait and take no
/// lock (a reader that meets a write in progress looks up afresh), one writer at a time
/// (another gives up keeping its result), and what a reader accepts was written whole under
/// the current generation, which [`GpuCache::invalidate`] bumps without waiting for anyone
/// (so a lookup that raced an `nvmlShutdown` is never served after it). A child forked in the
/// middle of a write finds the sequence odd forever and always looks up afresh: slower, never
/// wrong.
pub struct GpuCache {
    /// Even: stable; odd: a write in progress.
    seq: AtomicU64,
    /// Bumped by every `nvmlInit*` and `nvmlShutdown` of the caller.
    generation: AtomicU64,
    /// The generation the kept lookup was made under (`u64::MAX`: none kept).
    kept: AtomicU64,
    n: AtomicUsize,
    /// Each config GPU's real handle, 0 for one NVML does not have.
    handles: [AtomicUsize; MAX_GPUS],
}

impl Default for GpuCache {
    fn default() -> Self {
        Self::new()
    }
}

impl GpuCache {
    pub const fn new() -> GpuCache {
        GpuCache {
            seq: AtomicU64::new(0),
            generation: AtomicU64::new(0),
            kept: AtomicU64::new(u64::MAX),
            n: AtomicUsize::new(0),
            handles: [const { AtomicUsize::new(0) }; MAX_GPUS],
        }
    }

    /// The generation a lookup starting now runs under (pass it to [`GpuCache::keep`]).
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Forget what is kept: NVML may hand out other handles from now on.
    pub fn invalidate(&self) {
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// The kept lookup, if there is one of the current generation and no write is in
    /// progress.
    pub fn get(&self) -> Option<Gpus> {
        let s1 = self.seq.load(Ordering::Acquire);
        if s1 & 1 == 1 {
            return None;
        }
        let kept = self.kept.load(Ordering::Relaxed);
        let n = self.n.load(Ordering::Relaxed).min(MAX_GPUS);
        let mut found = [Found::Absent; MAX_GPUS];
        for (f, h) in found.iter_mut().zip(&self.handles).take(n) {
            let h = h.load(Ordering::Relaxed);
            if h != 0 {
                *f = Found::Handle(h);
            }
        }
        fence(Ordering::Acquire);
        if self.seq.load(Ordering::Relaxed) != s1 || kept != self.generation() {
            return None;
        }
        Some(Gpus::new(&found[..n]))
    }

    /// Keep `found`, looked up under `generation`, unless a GPU failed (asked again next
    /// time) or another write is in progress.
    pub fn keep(&self, generation: u64, found: &[Found]) {
        if found.iter().any(|f| matches!(f, Found::Failed(_))) {
            return;
        }
        let s = self.seq.load(Ordering::Relaxed);
        if s & 1 == 1
            || self
                .seq
                .compare_exchange(s, s + 1, Ordering::Acquire, Ordering::Relaxed)
                .is_err()
        {
            return;
        }
        fence(Ordering::Release);
        let n = found.len().min(MAX_GPUS);
        for (h, f) in self.handles.iter().zip(found).take(n) {
            h.store(
                match f {
                    Found::Handle(h) => *h,
                    _ => 0,
                },
                Ordering::Relaxed,
            );
        }
        self.n.store(n, Ordering::Relaxed);
        self.kept.store(generation, Ordering::Relaxed);
        self.seq.store(s + 2, Ordering::Release);
    }
}

static CACHE: GpuCache = GpuCache::new();

/// The container's GPUs in the real NVML: the kept lookup ([`GpuCache`]), else a lookup
/// now, through the caller's initialisation (libvcuda's own, `Vcuda::nvml_handle`, is not
/// used: a caller that has not initialised NVML gets `NVML_ERROR_UNINITIALIZED` as it would
/// without libvcuda — unless libvcuda has initialised NVML for itself, which a process
/// shares).
fn container_gpus(v: &Vcuda) -> Result<Gpus, nvmlReturn_t> {
    if let Some(g) = CACHE.get() {
        return Ok(g);
    }
    let generation = CACHE.generation();
    let mut found = [Found::Absent; MAX_GPUS];
    let names = uuids(v);
    let n = names.len().min(MAX_GPUS);
    for (f, name) in found.iter_mut().zip(&names[..n]) {
        let mut h: nvmlDevice_t = std::ptr::null_mut();
        let rc = forward!(MISSING, nvmlDeviceGetHandleByUUID(name.as_ptr(), &mut h));
        *f = classify(rc, h)?;
    }
    CACHE.keep(generation, &found[..n]);
    Ok(Gpus::new(&found[..n]))
}

macro_rules! state {
    () => {
        match nvml() {
            Ok(v) => v,
            Err(e) => return e,
        }
    };
}

// ---- initialisation ----------------------------------------------------------------------

unsafe fn init_v1() -> nvmlReturn_t {
    state!();
    CACHE.invalidate();
    forward!(MISSING, nvmlInit())
}

unsafe fn init_v2() -> nvmlReturn_t {
    state!();
    CACHE.invalidate();
    forward!(MISSING, nvmlInit_v2())
}

unsafe fn init_with_flags(flags: c_uint) -> nvmlReturn_t {
    state!();
    CACHE.invalidate();
    forward!(MISSING, nvmlInitWithFlags(flags))
}

/// The handles kept are forgotten before and after: a lookup racing the shutdown is not kept.
unsafe fn shutdown() -> nvmlReturn_t {
    state!();
    CACHE.invalidate();
    let rc = forward!(MISSING, nvmlShutdown());
    CACHE.invalidate();
    rc
}

// ---- enumeration -------------------------------------------------------------------------

/// Write the container's device count after the real call `rc` succeeded.
fn count_after(v: &Vcuda, rc: nvmlReturn_t, out: *mut c_uint) -> nvmlReturn_t {
    if rc != NVML_SUCCESS || out.is_null() {
        return rc;
    }
    let gpus = match container_gpus(v) {
        Ok(g) => g,
        Err(e) => return e,
    };
    // SAFETY: non-NULL, and the real function just wrote it.
    unsafe { *out = u32_sat(gpus.count()) };
    NVML_SUCCESS
}

unsafe fn count_v1(count: *mut c_uint) -> nvmlReturn_t {
    let v = state!();
    let rc = forward!(MISSING, nvmlDeviceGetCount(count));
    count_after(v, rc, count)
}

unsafe fn count_v2(count: *mut c_uint) -> nvmlReturn_t {
    let v = state!();
    let rc = forward!(MISSING, nvmlDeviceGetCount_v2(count));
    count_after(v, rc, count)
}

unsafe fn by_index_v1(index: c_uint, device: *mut nvmlDevice_t) -> nvmlReturn_t {
    let v = state!();
    if real().nvmlDeviceGetHandleByIndex.is_none() {
        return MISSING;
    }
    by_index(v, index, device)
}

unsafe fn by_index_v2(index: c_uint, device: *mut nvmlDevice_t) -> nvmlReturn_t {
    let v = state!();
    if real().nvmlDeviceGetHandleByIndex_v2.is_none() {
        return MISSING;
    }
    by_index(v, index, device)
}

/// Container index `index` → the real handle of that GPU, looked up by UUID (the real
/// function of the same name is not called: its indices are the machine's).
fn by_index(v: &Vcuda, index: c_uint, device: *mut nvmlDevice_t) -> nvmlReturn_t {
    let gpus = match container_gpus(v) {
        Ok(g) => g,
        Err(e) => return e,
    };
    if device.is_null() {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    match gpus.at(index as usize) {
        Some((_, Found::Handle(h))) => {
            // SAFETY: non-NULL output the caller passed.
            unsafe { *device = h as nvmlDevice_t };
            NVML_SUCCESS
        }
        Some((_, Found::Failed(e))) => e,
        Some((_, Found::Absent)) | None => NVML_ERROR_INVALID_ARGUMENT,
    }
}

/// Hand out the handle a real lookup found only if it is one of the container's GPUs.
fn keep_if_mine(
    v: &Vcuda,
    device: *mut nvmlDevice_t,
    lookup: impl FnOnce(*mut nvmlDevice_t) -> nvmlReturn_t,
) -> nvmlReturn_t {
    if device.is_null() {
        return lookup(device);
    }
    let mut h: nvmlDevice_t = std::ptr::null_mut();
    let rc = lookup(&mut h);
    if rc != NVML_SUCCESS {
        return rc;
    }
    match container_gpus(v).map(|g| g.position(h)) {
        Ok(Some(_)) => {
            // SAFETY: non-NULL output the caller passed.
            unsafe { *device = h };
            NVML_SUCCESS
        }
        Ok(None) => NVML_ERROR_NOT_FOUND,
        Err(e) => e,
    }
}

unsafe fn by_uuid(uuid: *const c_char, device: *mut nvmlDevice_t) -> nvmlReturn_t {
    let v = state!();
    keep_if_mine(v, device, |d| {
        forward!(MISSING, nvmlDeviceGetHandleByUUID(uuid, d))
    })
}

unsafe fn by_bus_id_v1(bus_id: *const c_char, device: *mut nvmlDevice_t) -> nvmlReturn_t {
    let v = state!();
    keep_if_mine(v, device, |d| {
        forward!(MISSING, nvmlDeviceGetHandleByPciBusId(bus_id, d))
    })
}

unsafe fn by_bus_id_v2(bus_id: *const c_char, device: *mut nvmlDevice_t) -> nvmlReturn_t {
    let v = state!();
    keep_if_mine(v, device, |d| {
        forward!(MISSING, nvmlDeviceGetHandleByPciBusId_v2(bus_id, d))
    })
}

unsafe fn by_serial(serial: *const c_char, device: *mut nvmlDevice_t) -> nvmlReturn_t {
    let v = state!();
    keep_if_mine(v, device, |d| {
        forward!(MISSING, nvmlDeviceGetHandleBySerial(serial, d))
    })
}

unsafe fn get_index(device: nvmlDevice_t, index: *mut c_uint) -> nvmlReturn_t {
    let v = state!();
    if index.is_null() {
        return forward!(MISSING, nvmlDeviceGetIndex(device, index));
    }
    let mut real_index: c_uint = 0;
    let rc = forward!(MISSING, nvmlDeviceGetIndex(device, &mut real_index));
    if rc != NVML_SUCCESS {
        return rc;
    }
    match container_gpus(v).map(|g| g.position(device)) {
        Ok(Some((i, _))) => {
            // SAFETY: non-NULL output the caller passed.
            unsafe { *index = u32_sat(i) };
            NVML_SUCCESS
        }
        Ok(None) => NVML_ERROR_INVALID_ARGUMENT,
        Err(e) => e,
    }
}

// ---- memory ------------------------------------------------------------------------------

/// Device memory as the container sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VirtualMemory {
    pub total: u64,
    pub used: u64,
    pub free: u64,
}

/// The container's view of a GPU with quota `limit` whose real total is `real_total`, while
/// the container holds `used` on it: total = min(quota, physical), free = total − used
/// saturating at 0 (usage counted late can exceed the quota; free never wraps).
pub fn virtual_memory(limit: u64, real_total: u64, used: u64) -> VirtualMemory {
    let total = limit.min(real_total);
    VirtualMemory {
        total,
        used,
        free: total.saturating_sub(used),
    }
}

/// The config index of `device` if it is one of the container's GPUs (`Err`: NVML cannot
/// say, returned to the caller).
fn config_dev(v: &Vcuda, device: nvmlDevice_t) -> Result<Option<usize>, nvmlReturn_t> {
    Ok(container_gpus(v)?.position(device).map(|(_, dev)| dev))
}

unsafe fn memory_v1(device: nvmlDevice_t, memory: *mut nvmlMemory_t) -> nvmlReturn_t {
    let v = state!();
    let rc = forward!(MISSING, nvmlDeviceGetMemoryInfo(device, memory));
    if rc != NVML_SUCCESS || memory.is_null() {
        return rc;
    }
    let dev = match config_dev(v, device) {
        Ok(Some(d)) => d,
        Ok(None) => return rc,
        Err(e) => return e,
    };
    // SAFETY: non-NULL, and the real function just filled it.
    let m = unsafe { &mut *memory };
    let vm = virtual_memory(v.quota_of(dev), m.total, v.used_on(dev));
    m.total = vm.total;
    m.used = vm.used;
    m.free = vm.free;
    rc
}

unsafe fn memory_v2(device: nvmlDevice_t, memory: *mut nvmlMemory_v2_t) -> nvmlReturn_t {
    let v = state!();
    // The real function checks `version` and the handle.
    let rc = forward!(MISSING, nvmlDeviceGetMemoryInfo_v2(device, memory));
    if rc != NVML_SUCCESS || memory.is_null() {
        return rc;
    }
    let dev = match config_dev(v, device) {
        Ok(Some(d)) => d,
        Ok(None) => return rc,
        Err(e) => return e,
    };
    // SAFETY: non-NULL, and the real function just filled it.
    let m = unsafe { &mut *memory };
    let vm = virtual_memory(v.quota_of(dev), m.total, v.used_on(dev));
    m.total = vm.total;
    m.reserved = 0;
    m.used = vm.used;
    m.free = vm.free;
    rc
}

// ---- processes ---------------------------------------------------------------------------

/// A process-list entry (`nvmlProcessInfo_v1_t`, or `nvmlProcessInfo_t` for v2 and v3).
pub trait ProcEntry: Copy + Default {
    fn pid(&self) -> u32;
    fn set_pid(&mut self, pid: u32);
}

impl ProcEntry for nvmlProcessInfo_v1_t {
    fn pid(&self) -> u32 {
        self.pid
    }
    fn set_pid(&mut self, pid: u32) {
        self.pid = pid;
    }
}

impl ProcEntry for nvmlProcessInfo_t {
    fn pid(&self) -> u32 {
        self.pid
    }
    fn set_pid(&mut self, pid: u32) {
        self.pid = pid;
    }
}

/// Keep the container's entries of a real process list, with container pids, moved to the
/// front of `list` in their order; returns how many. `pids`: (pid the driver reports, pid in
/// the container) of the container's processes (`Region::process_pids`). In place: NVML's
/// process lists run it on every call.
pub fn keep_container_processes<T: ProcEntry>(list: &mut [T], pids: &[(u32, u32)]) -> usize {
    let mut n = 0;
    for i in 0..list.len() {
        let e = list[i];
        if let Some(&(_, mine)) = pids.iter().find(|(host, _)| *host == e.pid()) {
            let mut e = e;
            e.set_pid(mine);
            list[n] = e;
            n += 1;
        }
    }
    n
}

/// What nvml.h's `*infoCount` protocol makes of `needed` entries for a caller offering room
/// for `cap` (`infos_null`: it passed `infos = NULL`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fill {
    /// Write `needed` entries (maybe 0) and set `*infoCount` to it: `NVML_SUCCESS`.
    Write(usize),
    /// Set `*infoCount` to the count needed: `NVML_ERROR_INSUFFICIENT_SIZE`.
    TooSmall(usize),
    /// `NVML_ERROR_INVALID_ARGUMENT`: `infos` is NULL though this is not a size query.
    Invalid,
}

pub fn fill(needed: usize, cap: usize, infos_null: bool) -> Fill {
    if cap == 0 {
        // The size query; `infos` may be NULL.
        return if needed == 0 {
            Fill::Write(0)
        } else {
            Fill::TooSmall(needed)
        };
    }
    if infos_null {
        return Fill::Invalid;
    }
    if needed > cap {
        Fill::TooSmall(needed)
    } else {
        Fill::Write(needed)
    }
}

type ProcFn<T> = unsafe extern "C" fn(nvmlDevice_t, *mut c_uint, *mut T) -> nvmlReturn_t;

/// Entries read into a buffer on the stack before one on the heap is needed.
const STACK_ENTRIES: usize = 64;

/// A real list read by nvml.h's count protocol: `call(buffer, &mut count)` is the real
/// function with room for `count` entries. Up to [`STACK_ENTRIES`] entries land in `stack`,
/// left uninitialised by the caller (zeroing 1.5 KiB on every call cost more than the rest of
/// the wrapper); a longer list is read again into `heap`, grown while the driver says it is
/// too small.
fn read_list<'a, T: ProcEntry>(
    stack: &'a mut [MaybeUninit<T>; STACK_ENTRIES],
    heap: &'a mut Vec<T>,
    mut call: impl FnMut(*mut T, &mut c_uint) -> nvmlReturn_t,
) -> Result<&'a mut [T], nvmlReturn_t> {
    let mut n = u32_sat(STACK_ENTRIES);
    match call(stack.as_mut_ptr().cast::<T>(), &mut n) {
        NVML_SUCCESS => {
            let n = (n as usize).min(STACK_ENTRIES);
            // SAFETY: on success nvml.h's protocol has the function write `*count` entries
            // from the start of the buffer (at most the room it was given), so the first `n`
            // are initialised; `T` is a plain C struct of integers.
            return Ok(unsafe {
                std::slice::from_raw_parts_mut(stack.as_mut_ptr().cast::<T>(), n)
            });
        }
        NVML_ERROR_INSUFFICIENT_SIZE => {}
        e => return Err(e),
    }
    heap.resize(
        (n as usize).max(STACK_ENTRIES).saturating_mul(2),
        T::default(),
    );
    for _ in 0..8 {
        let mut n = u32_sat(heap.len());
        match call(heap.as_mut_ptr(), &mut n) {
            NVML_SUCCESS => {
                heap.truncate(n as usize);
                return Ok(&mut heap[..]);
            }
            NVML_ERROR_INSUFFICIENT_SIZE => {
                let want = (n as usize).max(heap.len()).saturating_mul(2);
                heap.resize(want, T::default());
            }
            e => return Err(e),
        }
    }
    // The list kept growing faster than we could read it.
    Err(NVML_ERROR_UNKNOWN)
}

/// The container's entries of a real list, with container pids, moved to its front.
fn keep_mine<'l, T: ProcEntry>(v: &Vcuda, list: &'l mut [T]) -> &'l [T] {
    let mut pids = [(0u32, 0u32); MAX_PROCS];
    let np = v.container_process_pids(&mut pids);
    let kept = keep_container_processes(list, &pids[..np]);
    &list[..kept]
}

/// Copy `kept` to the caller's `out` (room for `*count` entries) and set `*count`, by the
/// protocol of the utilization and accounting lists: `out` NULL or too small:
/// `NVML_ERROR_INSUFFICIENT_SIZE` with the count needed.
///
/// # Safety
/// `count` non-NULL; `out` NULL or with room for `*count` entries.
unsafe fn answer_list<T: Copy>(kept: &[T], count: *mut c_uint, out: *mut T) -> nvmlReturn_t {
    // SAFETY: the caller's contract.
    let cap = unsafe { *count } as usize;
    // SAFETY: as above.
    unsafe { *count = u32_sat(kept.len()) };
    if out.is_null() || kept.len() > cap {
        return if kept.is_empty() {
            NVML_SUCCESS
        } else {
            NVML_ERROR_INSUFFICIENT_SIZE
        };
    }
    if !kept.is_empty() {
        // SAFETY: room for `cap` >= kept.len() entries; our buffer cannot overlap it.
        unsafe { std::ptr::copy_nonoverlapping(kept.as_ptr(), out, kept.len()) };
    }
    NVML_SUCCESS
}

/// Any `nvmlDevice*RunningProcesses*`: the real list, filtered to the container's processes
/// with container pids, returned with nvml.h's `*infoCount` protocol. Processes are filtered
/// on every GPU, whichever way the handle was had.
///
/// # Safety
/// The caller's arguments as nvml.h documents them.
unsafe fn processes<T: ProcEntry>(
    pick: fn(&'static Real) -> Option<ProcFn<T>>,
    device: nvmlDevice_t,
    info_count: *mut c_uint,
    infos: *mut T,
) -> nvmlReturn_t {
    let v = state!();
    let Some(f) = pick(real()) else {
        return MISSING;
    };
    if info_count.is_null() {
        // SAFETY: the caller's arguments, unchanged: the real function reports the error.
        return unsafe { f(device, info_count, infos) };
    }
    // Up to STACK_ENTRIES entries (every process on the GPU, the container's or not) are
    // read and filtered on the stack; only a longer list takes the heap.
    let mut stack = [const { MaybeUninit::<T>::uninit() }; STACK_ENTRIES];
    let mut heap = Vec::new();
    // SAFETY: a buffer with room for `n` entries of the type the real function writes.
    let read = read_list(&mut stack, &mut heap, |buf, n| unsafe { f(device, n, buf) });
    let list = match read {
        Ok(l) => keep_mine(v, l),
        Err(e) => return e,
    };
    // SAFETY: non-NULL; nvml.h: the caller sets it to the size of `infos`.
    let cap = unsafe { *info_count } as usize;
    match fill(list.len(), cap, infos.is_null()) {
        Fill::Write(n) => {
            if n > 0 {
                // SAFETY: `infos` is non-NULL (fill checked) with room for `cap` >= n
                // entries, and cannot overlap our own vector.
                unsafe { std::ptr::copy_nonoverlapping(list.as_ptr(), infos, n) };
            }
            // SAFETY: non-NULL, as above.
            unsafe { *info_count = u32_sat(n) };
            NVML_SUCCESS
        }
        Fill::TooSmall(n) => {
            // SAFETY: non-NULL, as above.
            unsafe { *info_count = u32_sat(n) };
            NVML_ERROR_INSUFFICIENT_SIZE
        }
        Fill::Invalid => NVML_ERROR_INVALID_ARGUMENT,
    }
}

/// The process-list wrappers: `name => real function, entry type`.
macro_rules! process_lists {
    ($( $imp:ident => $real:ident, $ty:ty; )*) => {$(
        unsafe fn $imp(device: nvmlDevice_t, info_count: *mut c_uint, infos: *mut $ty) -> nvmlReturn_t {
            // SAFETY: the caller's arguments as nvml.h documents them.
            unsafe { processes(|r| r.$real, device, info_count, infos) }
        }
    )*};
}

process_lists! {
    compute_v1 => nvmlDeviceGetComputeRunningProcesses, nvmlProcessInfo_v1_t;
    compute_v2 => nvmlDeviceGetComputeRunningProcesses_v2, nvmlProcessInfo_t;
    compute_v3 => nvmlDeviceGetComputeRunningProcesses_v3, nvmlProcessInfo_t;
    graphics_v1 => nvmlDeviceGetGraphicsRunningProcesses, nvmlProcessInfo_v1_t;
    graphics_v2 => nvmlDeviceGetGraphicsRunningProcesses_v2, nvmlProcessInfo_t;
    graphics_v3 => nvmlDeviceGetGraphicsRunningProcesses_v3, nvmlProcessInfo_t;
    mps_v1 => nvmlDeviceGetMPSComputeRunningProcesses, nvmlProcessInfo_v1_t;
    mps_v2 => nvmlDeviceGetMPSComputeRunningProcesses_v2, nvmlProcessInfo_t;
    mps_v3 => nvmlDeviceGetMPSComputeRunningProcesses_v3, nvmlProcessInfo_t;
}

// ---- per-process utilization and accounting ---------------------------------------------
//
// Lists of other processes by pid: without a filter a tenant read every other container's
// host pids (and how busy each is) on its GPU. Filtered like the process lists: only the
// container's processes, by their container pids; none of its own is "no samples".

impl ProcEntry for nvmlProcessUtilizationSample_t {
    fn pid(&self) -> u32 {
        self.pid
    }
    fn set_pid(&mut self, pid: u32) {
        self.pid = pid;
    }
}

impl ProcEntry for nvmlProcessUtilizationInfo_v1_t {
    fn pid(&self) -> u32 {
        self.pid
    }
    fn set_pid(&mut self, pid: u32) {
        self.pid = pid;
    }
}

/// An accounting pid list entry.
impl ProcEntry for c_uint {
    fn pid(&self) -> u32 {
        *self
    }
    fn set_pid(&mut self, pid: u32) {
        *self = pid;
    }
}

unsafe fn process_utilization(
    device: nvmlDevice_t,
    utilization: *mut nvmlProcessUtilizationSample_t,
    count: *mut c_uint,
    last_seen: u64,
) -> nvmlReturn_t {
    let v = state!();
    let Some(f) = real().nvmlDeviceGetProcessUtilization else {
        return MISSING;
    };
    if count.is_null() {
        // SAFETY: the caller's arguments, unchanged: the real function reports the error.
        return unsafe { f(device, utilization, count, last_seen) };
    }
    let mut stack = [const { MaybeUninit::uninit() }; STACK_ENTRIES];
    let mut heap = Vec::new();
    // SAFETY: a buffer with room for `n` samples.
    let read = read_list(&mut stack, &mut heap, |buf, n| unsafe {
        f(device, buf, n, last_seen)
    });
    let kept = match read {
        Ok(l) => keep_mine(v, l),
        Err(e) => return e,
    };
    if kept.is_empty() {
        return NVML_ERROR_NOT_FOUND;
    }
    // SAFETY: `count` non-NULL; nvml.h: `utilization` NULL or room for `*count` samples.
    unsafe { answer_list(kept, count, utilization) }
}

unsafe fn processes_utilization(
    device: nvmlDevice_t,
    info: *mut nvmlProcessesUtilizationInfo_t,
) -> nvmlReturn_t {
    let v = state!();
    let Some(f) = real().nvmlDeviceGetProcessesUtilizationInfo else {
        return MISSING;
    };
    // SAFETY: NULL-checked; the caller's struct as nvml.h documents it.
    let Some(info) = (unsafe { info.as_mut() }) else {
        // SAFETY: the caller's arguments, unchanged: the real function reports the error.
        return unsafe { f(device, info) };
    };
    if info.version != NVML_PROCESSES_UTILIZATION_INFO_V1 {
        // SAFETY: as above: the real function answers a version it may know and we do not.
        return unsafe { f(device, info) };
    }
    let last_seen = info.lastSeenTimeStamp;
    let mut stack = [const { MaybeUninit::uninit() }; STACK_ENTRIES];
    let mut heap = Vec::new();
    let read = read_list(&mut stack, &mut heap, |buf, n| {
        let mut ours = nvmlProcessesUtilizationInfo_v1_t {
            version: NVML_PROCESSES_UTILIZATION_INFO_V1,
            processSamplesCount: *n,
            lastSeenTimeStamp: last_seen,
            procUtilArray: buf,
        };
        // SAFETY: our own struct, its array with room for `processSamplesCount` entries.
        let rc = unsafe { f(device, &mut ours) };
        *n = ours.processSamplesCount;
        rc
    });
    let kept = match read {
        Ok(l) => keep_mine(v, l),
        Err(e) => return e,
    };
    if kept.is_empty() {
        return NVML_ERROR_NOT_FOUND;
    }
    // SAFETY: the count is the caller's struct's field; nvml.h: `procUtilArray` NULL or with
    // room for `processSamplesCount` entries.
    unsafe { answer_list(kept, &mut info.processSamplesCount, info.procUtilArray) }
}

unsafe fn accounting_pids(
    device: nvmlDevice_t,
    count: *mut c_uint,
    pids: *mut c_uint,
) -> nvmlReturn_t {
    let v = state!();
    let Some(f) = real().nvmlDeviceGetAccountingPids else {
        return MISSING;
    };
    if count.is_null() {
        // SAFETY: the caller's arguments, unchanged: the real function reports the error.
        return unsafe { f(device, count, pids) };
    }
    let mut stack = [const { MaybeUninit::uninit() }; STACK_ENTRIES];
    let mut heap = Vec::new();
    // SAFETY: a buffer with room for `n` pids.
    let read = read_list(&mut stack, &mut heap, |buf, n| unsafe { f(device, n, buf) });
    let kept = match read {
        Ok(l) => keep_mine(v, l),
        Err(e) => return e,
    };
    // SAFETY: `count` non-NULL; nvml.h: `pids` NULL or room for `*count` pids.
    unsafe { answer_list(kept, count, pids) }
}

/// `nvmlAccountingStats_v2_t` (NVML 13 only, so not in ffi.rs, whose structs are checked
/// against both header sets): the caller names the process in `pid`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct nvmlAccountingStats_v2_t {
    pub pid: u32,
    pub isRunning: u32,
    pub gpuUtilization: u32,
    pub memoryUtilization: u32,
    pub maxMemoryUsage: u64,
    pub sampleCount: u32,
    pub sumGpuUtil: u64,
    pub sumFbUtil: u64,
    pub time: u64,
    pub startTime: u64,
}

/// The host pid of the container's process `pid` (its own namespace's), if it is one.
fn host_pid_of(v: &Vcuda, pid: c_uint) -> Option<u32> {
    let mut pids = [(0u32, 0u32); MAX_PROCS];
    let np = v.container_process_pids(&mut pids);
    pids[..np]
        .iter()
        .find(|(_, mine)| *mine == pid)
        .map(|&(host, _)| host)
}

/// A pid of the container is asked about by its host pid; any other pid is
/// `NVML_ERROR_NOT_FOUND`, as for a process the driver has no record of.
unsafe fn accounting_stats(
    device: nvmlDevice_t,
    pid: c_uint,
    stats: *mut nvmlAccountingStats_t,
) -> nvmlReturn_t {
    let v = state!();
    match host_pid_of(v, pid) {
        Some(host) => forward!(MISSING, nvmlDeviceGetAccountingStats(device, host, stats)),
        None if real().nvmlDeviceGetAccountingStats.is_none() => MISSING,
        None => NVML_ERROR_NOT_FOUND,
    }
}

/// [`accounting_stats`] for NVML 13's `_v2`, whose caller names the process in `stats.pid`:
/// asked by its host pid, answered with the container's pid back in place.
unsafe fn accounting_stats_v2(
    device: nvmlDevice_t,
    stats: *mut nvmlAccountingStats_v2_t,
) -> nvmlReturn_t {
    let v = state!();
    if real().nvmlDeviceGetAccountingStats_v2.is_none() {
        return MISSING;
    }
    // SAFETY: NULL-checked; the caller's struct as nvml.h documents it.
    let Some(st) = (unsafe { stats.as_mut() }) else {
        return forward!(MISSING, nvmlDeviceGetAccountingStats_v2(device, stats));
    };
    let mine = st.pid;
    let Some(host) = host_pid_of(v, mine) else {
        return NVML_ERROR_NOT_FOUND;
    };
    st.pid = host;
    let rc = forward!(MISSING, nvmlDeviceGetAccountingStats_v2(device, stats));
    // SAFETY: the same caller's struct, which the real function may have written.
    unsafe { (*stats).pid = mine };
    rc
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v3(pid: u32, mem: u64) -> nvmlProcessInfo_t {
        nvmlProcessInfo_t {
            pid,
            used_gpu_memory: mem,
            gpu_instance_id: 0xFFFF_FFFF,
            compute_instance_id: 0xFFFF_FFFF,
        }
    }

    fn handles(g: &Gpus) -> Vec<Found> {
        g.found[..g.n].to_vec()
    }

    #[test]
    fn the_cache_keeps_a_complete_lookup_until_nvml_is_initialised_or_shut_down() {
        let c = GpuCache::new();
        assert!(c.get().is_none(), "nothing kept yet");
        let found = [Found::Handle(0x10), Found::Absent, Found::Handle(0x30)];
        let g0 = c.generation();
        c.keep(g0, &found);
        assert_eq!(handles(&c.get().unwrap()), found);
        assert_eq!(c.get().unwrap().count(), 2);
        c.invalidate();
        assert!(c.get().is_none(), "an nvmlInit or nvmlShutdown forgets it");
        // a lookup begun before the invalidation is not served after it
        c.keep(g0, &found);
        assert!(c.get().is_none());
        let g1 = c.generation();
        c.keep(g1, &found[..1]);
        assert_eq!(handles(&c.get().unwrap()), [Found::Handle(0x10)]);
    }

    #[test]
    fn a_lookup_with_a_failed_gpu_is_not_kept() {
        let c = GpuCache::new();
        c.keep(
            c.generation(),
            &[Found::Handle(1), Found::Failed(NVML_ERROR_UNKNOWN)],
        );
        assert!(c.get().is_none());
    }

    #[test]
    fn readers_never_see_a_torn_or_stale_lookup() {
        // One writer keeps lookups whose handles are all equal to their generation + 1 and
        // invalidates in between; readers must only ever see all-equal handles of the
        // current-or-later generation, never a mix.
        use std::sync::atomic::AtomicBool;
        use std::sync::Arc;
        let c = Arc::new(GpuCache::new());
        let stop = Arc::new(AtomicBool::new(false));
        let readers: Vec<_> = (0..3)
            .map(|_| {
                let (c, stop) = (c.clone(), stop.clone());
                std::thread::spawn(move || {
                    let mut seen = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let before = c.generation();
                        if let Some(g) = c.get() {
                            let hs = handles(&g);
                            let Found::Handle(first) = hs[0] else {
                                panic!("{hs:?}")
                            };
                            assert!(
                                hs.iter().all(|h| *h == Found::Handle(first)),
                                "torn: {hs:?}"
                            );
                            assert!(first as u64 > before, "stale: {first} under {before}");
                            seen += 1;
                        }
                    }
                    seen
                })
            })
            .collect();
        for _ in 0..5_000 {
            let g = c.generation();
            let h = usize::try_from(g + 1).unwrap();
            c.keep(g, &[Found::Handle(h); MAX_GPUS]);
            std::thread::yield_now();
            c.invalidate();
        }
        stop.store(true, Ordering::Relaxed);
        let seen: u64 = readers.into_iter().map(|r| r.join().unwrap()).sum();
        assert!(
            seen > 0,
            "the readers saw nothing kept: the test tested nothing"
        );
    }

    #[test]
    fn memory_is_the_quota_and_never_underflows() {
        let gib = 1u64 << 30;
        assert_eq!(
            virtual_memory(2 * gib, 40 * gib, gib / 2),
            VirtualMemory {
                total: 2 * gib,
                used: gib / 2,
                free: gib + gib / 2
            }
        );
        // a quota above the physical size shows the physical size
        assert_eq!(virtual_memory(80 * gib, 40 * gib, 0).total, 40 * gib);
        // usage counted late may pass the quota: free is 0, not 2^64 - something
        let over = virtual_memory(2 * gib, 40 * gib, 3 * gib);
        assert_eq!((over.total, over.used, over.free), (2 * gib, 3 * gib, 0));
        assert_eq!(virtual_memory(2 * gib, 40 * gib, 2 * gib).free, 0);
        assert_eq!(virtual_memory(0, 40 * gib, u64::MAX).free, 0);
    }

    #[test]
    fn processes_are_the_containers_with_container_pids() {
        // slot 1: the manager told us host pid 9001; slot 2: standalone, pid is the host's
        // (Region::process_pids, tested in vcuda-contract, makes these pairs)
        let pids = [(9001, 17), (4242, 4242)];
        let mut real = [v3(9001, 100), v3(17, 200), v3(5555, 300), v3(4242, 400)];
        let n = keep_container_processes(&mut real, &pids);
        let mine = &real[..n];
        assert_eq!(
            mine.iter()
                .map(|e| (e.pid, e.used_gpu_memory, e.gpu_instance_id))
                .collect::<Vec<_>>(),
            vec![(17, 100, 0xFFFF_FFFF), (4242, 400, 0xFFFF_FFFF)],
            "host pid 17 is another container's process, not our pid 17"
        );
        let mut v1 = [
            nvmlProcessInfo_v1_t {
                pid: 1,
                used_gpu_memory: 5,
            },
            nvmlProcessInfo_v1_t {
                pid: 9001,
                used_gpu_memory: 6,
            },
        ];
        let n1 = keep_container_processes(&mut v1, &pids);
        assert_eq!((n1, v1[0].pid, v1[0].used_gpu_memory), (1, 17, 6));
        let mut real = [v3(9001, 100), v3(17, 200)];
        assert_eq!(keep_container_processes(&mut real, &[]), 0);
    }

    #[test]
    fn the_nvml13_accounting_struct_has_the_headers_size() {
        assert_eq!(std::mem::size_of::<nvmlAccountingStats_v2_t>(), 64);
    }

    #[test]
    fn info_count_follows_nvml_h() {
        // size query: *infoCount = 0, infos may be NULL
        assert_eq!(fill(0, 0, true), Fill::Write(0), "none running: success, 0");
        assert_eq!(fill(3, 0, true), Fill::TooSmall(3));
        assert_eq!(fill(3, 0, false), Fill::TooSmall(3));
        // room offered
        assert_eq!(fill(3, 2, false), Fill::TooSmall(3));
        assert_eq!(fill(3, 3, false), Fill::Write(3));
        assert_eq!(fill(1, 8, false), Fill::Write(1));
        assert_eq!(fill(0, 8, false), Fill::Write(0));
        // NULL infos only for the size query
        assert_eq!(fill(1, 8, true), Fill::Invalid);
        assert_eq!(fill(0, 8, true), Fill::Invalid);
    }

    #[test]
    fn container_indices_skip_gpus_the_driver_lacks() {
        let gpus = Gpus::new(&[
            Found::Handle(0x100),
            Found::Absent,
            Found::Failed(15),
            Found::Handle(0x300),
        ]);
        assert_eq!(gpus.count(), 3);
        assert_eq!(gpus.at(0), Some((0, Found::Handle(0x100))));
        assert_eq!(gpus.at(1), Some((2, Found::Failed(15))));
        assert_eq!(gpus.at(2), Some((3, Found::Handle(0x300))));
        assert_eq!(gpus.at(3), None);
        assert_eq!(gpus.position(0x300 as nvmlDevice_t), Some((2, 3)));
        assert_eq!(gpus.position(0x100 as nvmlDevice_t), Some((0, 0)));
        assert_eq!(gpus.position(0x200 as nvmlDevice_t), None);
        assert_eq!(gpus.position(std::ptr::null_mut()), None);
    }

    #[test]
    fn lookups_sort_errors() {
        let h = 0x40 as nvmlDevice_t;
        assert_eq!(classify(NVML_SUCCESS, h), Ok(Found::Handle(0x40)));
        assert_eq!(
            classify(NVML_ERROR_NOT_FOUND, std::ptr::null_mut()),
            Ok(Found::Absent)
        );
        assert_eq!(
            classify(NVML_ERROR_UNINITIALIZED, std::ptr::null_mut()),
            Err(NVML_ERROR_UNINITIALIZED)
        );
        assert_eq!(
            classify(15, std::ptr::null_mut()),
            Ok(Found::Failed(15)),
            "GPU_IS_LOST: the device exists"
        );
    }
}
