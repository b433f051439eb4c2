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
//!   container pid, with nvml.h's `*infoCount` protocol.
//!
//! Everything else NVML offers passes through untouched.

use std::ffi::{c_char, c_uint, CString};
use std::sync::OnceLock;

use vcuda_contract::config::MAX_GPUS;
use vcuda_contract::region::SlotView;

use crate::conv::u32_sat;
use crate::ffi::*;
use crate::state::{nvml, Vcuda};

hooks! {
    Nvml fn nvmlInit() -> nvmlReturn_t => init_v1;
    Nvml fn nvmlInit_v2() -> nvmlReturn_t => init_v2;
    Nvml fn nvmlInitWithFlags(flags: c_uint) -> nvmlReturn_t => init_with_flags;
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

/// Look the container's GPUs up in the real NVML now, through the caller's initialisation
/// (libvcuda's own, `Vcuda::nvml_handle`, is not used: a caller that has not initialised NVML
/// gets `NVML_ERROR_UNINITIALIZED` as it would without libvcuda — unless libvcuda has
/// initialised NVML for itself, which a process shares).
fn container_gpus(v: &Vcuda) -> Result<Gpus, nvmlReturn_t> {
    let mut found = [Found::Absent; MAX_GPUS];
    let names = uuids(v);
    let n = names.len().min(MAX_GPUS);
    for (f, name) in found.iter_mut().zip(&names[..n]) {
        let mut h: nvmlDevice_t = std::ptr::null_mut();
        let rc = forward!(MISSING, nvmlDeviceGetHandleByUUID(name.as_ptr(), &mut h));
        *f = classify(rc, h)?;
    }
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
    forward!(MISSING, nvmlInit())
}

unsafe fn init_v2() -> nvmlReturn_t {
    state!();
    forward!(MISSING, nvmlInit_v2())
}

unsafe fn init_with_flags(flags: c_uint) -> nvmlReturn_t {
    state!();
    forward!(MISSING, nvmlInitWithFlags(flags))
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

/// (pid the driver reports, pid in the container) of every active process of the container:
/// the driver's is the host pid the manager recorded, or the slot's own pid until it has.
pub fn container_pids(slots: &[SlotView]) -> Vec<(u32, u32)> {
    slots
        .iter()
        .filter(|s| s.pid != 0)
        .map(|s| {
            let host = if s.host_pid != 0 { s.host_pid } else { s.pid };
            (host, s.pid)
        })
        .collect()
}

/// The container's entries of a real process list, with container pids.
pub fn filter_processes<T: ProcEntry>(real: &[T], pids: &[(u32, u32)]) -> Vec<T> {
    real.iter()
        .filter_map(|e| {
            let &(_, mine) = pids.iter().find(|(host, _)| *host == e.pid())?;
            let mut e = *e;
            e.set_pid(mine);
            Some(e)
        })
        .collect()
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

/// The real list, read into our own buffer (grown while the driver says it is too small).
fn read_real<T: ProcEntry>(f: ProcFn<T>, device: nvmlDevice_t) -> Result<Vec<T>, nvmlReturn_t> {
    let mut buf = vec![T::default(); 32];
    for _ in 0..8 {
        let mut n = u32_sat(buf.len());
        // SAFETY: `buf` has room for `n` entries of the type the real function writes.
        let rc = unsafe { f(device, &mut n, buf.as_mut_ptr()) };
        match rc {
            NVML_SUCCESS => {
                buf.truncate(n as usize);
                return Ok(buf);
            }
            NVML_ERROR_INSUFFICIENT_SIZE => {
                let want = (n as usize).max(buf.len()).saturating_mul(2);
                buf.resize(want, T::default());
            }
            e => return Err(e),
        }
    }
    // The list kept growing faster than we could read it.
    Err(NVML_ERROR_UNKNOWN)
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
    let list = match read_real(f, device) {
        Ok(l) => filter_processes(&l, &container_pids(&v.container_processes())),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(pid: u32, host_pid: u32) -> SlotView {
        SlotView {
            index: 0,
            pid,
            host_pid,
            api: vec![0],
            hidden: vec![0],
        }
    }

    fn v3(pid: u32, mem: u64) -> nvmlProcessInfo_t {
        nvmlProcessInfo_t {
            pid,
            used_gpu_memory: mem,
            gpu_instance_id: 0xFFFF_FFFF,
            compute_instance_id: 0xFFFF_FFFF,
        }
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
        let pids = container_pids(&[slot(17, 9001), slot(4242, 0), slot(0, 0)]);
        assert_eq!(pids, vec![(9001, 17), (4242, 4242)]);
        let real = [v3(9001, 100), v3(17, 200), v3(5555, 300), v3(4242, 400)];
        let mine = filter_processes(&real, &pids);
        assert_eq!(
            mine.iter()
                .map(|e| (e.pid, e.used_gpu_memory, e.gpu_instance_id))
                .collect::<Vec<_>>(),
            vec![(17, 100, 0xFFFF_FFFF), (4242, 400, 0xFFFF_FFFF)],
            "host pid 17 is another container's process, not our pid 17"
        );
        let v1 = [
            nvmlProcessInfo_v1_t {
                pid: 1,
                used_gpu_memory: 5,
            },
            nvmlProcessInfo_v1_t {
                pid: 9001,
                used_gpu_memory: 6,
            },
        ];
        let m1 = filter_processes(&v1, &pids);
        assert_eq!((m1.len(), m1[0].pid, m1[0].used_gpu_memory), (1, 17, 6));
        assert!(filter_processes(&real, &[]).is_empty());
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
