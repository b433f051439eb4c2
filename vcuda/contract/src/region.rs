//! The per-container usage region: a small file every CUDA process of the container maps
//! shared (and the manager reads from the host). It is a protocol: `#[repr(C)]`, a magic
//! number and a version.
//!
//! ```text
//! 0        RegionHeader   magic "VCUDARGN", version, GPU UUIDs, learned context/module costs,
//!                         run-time shares, statistics counters (throttled ns, OOM refusals)
//! 4096     Slot × 64      one per process: pid, and per GPU the bytes it holds
//! len + i       (beyond the mapping) slot i's owner lock: held by the process owning it
//! len + 64 + i  (beyond the mapping) slot i's transition lock: held while its state changes
//! ```
//!
//! **Reservation without a lock.** Each process changes only its own slot's counters. To
//! reserve `n` bytes on a GPU a process first *announces* them (adds `n` to its own counter,
//! SeqCst), then sums every slot's counters (SeqCst loads); if the sum exceeds the limit it
//! withdraws the announcement and fails. Of any set of concurrent reservers, the last to
//! announce in the SeqCst order sees all the others' announcements, so the reservations that
//! succeed never sum above the limit at any instant. A process killed at any instruction
//! leaves only its own counters behind, and those are zeroed when its slot is reclaimed.
//! There is no lock to leave held.
//!
//! **Liveness.** A process holds an open-file-description lock on its slot's byte; the
//! kernel drops it when the process dies, even by SIGKILL. Inside the container's pid
//! namespace the pid and its start time are checked too, because a child forked without
//! `exec` shares the lock.
//!
//! **Life cycle.** Claiming, reclaiming and giving up a slot are the machines of
//! [`crate::slot`], run here on the real file; every change of a slot's state happens under
//! the slot's transition lock, so no two interleave and a process killed part-way leaves a
//! state the next one finishes. The module comment there has the state machine and its
//! invariants; a model checker explores it with kills between any two steps.
//!
//! **Defence in depth.** A release of more than the slot holds (which the protocol rules
//! out) is repaired at once to zero and counted in `accounting_errors`; a counter that reads
//! negative anyway (bit 47 set: no slot holds 128 TiB) is summed as zero, never as "full".

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release, SeqCst};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64};

use crate::config::MAX_GPUS;
use crate::slot::{self, Claim, Claimed, Lock, Machine, Owners, Reclaim, Slots, Unclaim};
pub use crate::slot::{SLOT_ACTIVE, SLOT_BUSY, SLOT_FREE};

pub const REGION_MAGIC: u64 = u64::from_le_bytes(*b"VCUDARGN");
/// Version 4 appended the statistics counters `throttled_ns` and `oom_refusals`.
pub const REGION_VERSION: u32 = 4;
/// `Slot::api` holds bytes in its low 48 bits and a change count in its high 16: every
/// reservation and release bumps the count in the same atomic operation, so a reader can
/// tell whether the counter moved between two reads at no cost to the hot path.
pub const API_BYTES: u64 = (1 << 48) - 1;
const API_CHANGE: u64 = 1 << 48;
/// A counter at or above this reads as negative (a release that borrowed across zero): no
/// process holds 128 TiB of device memory.
const API_NEGATIVE: u64 = 1 << 47;
/// Processes per container.
pub const MAX_PROCS: usize = 64;

#[repr(C)]
pub struct RegionHeader {
    /// [`REGION_MAGIC`], written last when the region is created.
    pub magic: AtomicU64,
    pub version: u32,
    pub num_gpus: u32,
    pub size: u64,
    /// The container's GPUs, in config order.
    pub uuids: [[u8; 16]; MAX_GPUS],
    /// 1 + the highest slot index ever claimed; sums read the slots below it.
    pub slots_used: AtomicU32,
    pub _pad: u32,
    /// Device memory a context was measured to cost on each GPU: reserved before the next
    /// context is created so that creating one cannot overshoot the quota.
    pub ctx_cost: [AtomicU64; MAX_GPUS],
    /// Device memory a module load was last measured to cost.
    pub module_cost: [AtomicU64; MAX_GPUS],
    /// Compute share set at run time by the manager, in ppm of the GPU (0: the config's).
    pub core_override: [AtomicU64; MAX_GPUS],
    /// Elastic upper bound set at run time, in ppm (0: the config's).
    pub core_limit_override: [AtomicU64; MAX_GPUS],
    /// Statistics, written by the library, read by the manager (exported as metrics): total
    /// nanoseconds the container's processes slept in the compute limiter on each GPU
    /// (throttled launches only; a launch under its share adds nothing). `Relaxed`: an
    /// independent counter that publishes no other data, so readers need no ordering
    /// with anything else; `fetch_add` alone keeps concurrent additions from being lost.
    pub throttled_ns: [AtomicU64; MAX_GPUS],
    /// Statistics, written by the library, read by the manager: calls the library refused
    /// with `CUDA_ERROR_OUT_OF_MEMORY` on each GPU because they would have taken the
    /// container past its quota (not the driver's own out-of-memory errors). `Relaxed`, as
    /// for `throttled_ns`.
    pub oom_refusals: [AtomicU64; MAX_GPUS],
    /// Statistics, written by the library, read by the manager: accounting errors repaired
    /// on each GPU (a release of more than the process's counter held, set back to zero).
    /// The slot protocol rules them out; a non-zero value is a bug to report. Appended in
    /// space layout 4 leaves zero, so regions made before it read 0 and need no new version.
    /// `Relaxed`, as for `throttled_ns`.
    pub accounting_errors: [AtomicU64; MAX_GPUS],
}

/// One process's share of the region. 128-byte aligned so processes updating their own
/// counters do not contend for a cache line.
#[repr(C, align(128))]
pub struct Slot {
    pub state: AtomicU32,
    /// Pid in the container's namespace.
    pub pid: AtomicU32,
    /// Pid on the host, once the manager has said (0 until then).
    pub host_pid: AtomicU32,
    /// Bumped at each claim.
    pub generation: AtomicU32,
    /// Start time of `pid` (clock ticks since boot, /proc/<pid>/stat field 22; 0 if it
    /// could not be read, and then only the owner lock tells liveness).
    pub start_time: AtomicU64,
    /// Bytes reserved through allocation calls, per GPU (low 48 bits; see [`API_BYTES`]).
    pub api: [AtomicU64; MAX_GPUS],
    /// Bytes the driver charges the process beyond its allocations (contexts, modules,
    /// limits), per GPU, as last measured.
    pub hidden: [AtomicU64; MAX_GPUS],
    /// Monotonic ns at which the process last launched work on each GPU (updated by its
    /// limiter about every 50 ms, not per launch): the container's share is split among the
    /// processes launching on a GPU.
    pub launched_at: [AtomicU64; MAX_GPUS],
}

const HEADER_SIZE: usize = 4096;
const _: () = assert!(std::mem::size_of::<RegionHeader>() <= HEADER_SIZE);
pub const REGION_SIZE: usize = HEADER_SIZE + MAX_PROCS * std::mem::size_of::<Slot>();

/// A region problem. The message is one line naming the file and what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegionError {
    #[error("vcuda: region {path}: cannot {op} ({err}); check the config's `region` path and that the directory is writable")]
    Io {
        path: String,
        op: &'static str,
        err: String,
    },
    #[error("vcuda: region {path} is not a usable vcuda region ({why}); remove it when no process of the container runs")]
    Incompatible { path: String, why: String },
    #[error("vcuda: region {path} belongs to other GPUs ({why}) and live processes still use it; stop them or point the config at another region")]
    InUse { path: String, why: String },
    #[error("vcuda: region {path}: all {MAX_PROCS} process slots are held by live processes")]
    Full { path: String },
    #[error("vcuda: region {path} is empty, but vcuda-manager lays out every region it names before the container starts: it was reset (truncated or replaced) from inside the container, so its books cannot be trusted and nothing is allocated; restart the pod")]
    Reset { path: String },
}

/// A process's claim on a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotId {
    pub index: u32,
    pub generation: u32,
}

impl SlotId {
    /// No slot: reservations are refused, releases and measurements ignored (a forked
    /// child whose own claim failed must not count into its parent's slot).
    pub const NONE: SlotId = SlotId {
        index: u32::MAX,
        generation: 0,
    };
}

/// One process as the manager and `vcuda_*` see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotView {
    pub index: u32,
    pub pid: u32,
    pub host_pid: u32,
    pub api: Vec<u64>,
    pub hidden: Vec<u64>,
}

/// The mapped region. Unmaps in `Drop`.
pub struct Region {
    fd: OwnedFd,
    base: *mut u8,
    path: PathBuf,
    num_gpus: usize,
    /// Set while a thread of this process runs a slot machine. The transition locks are
    /// open-file-description locks, which do not exclude threads sharing the description.
    /// A flag rather than a mutex: a child forked while another thread held it resets it
    /// (`reopen_after_fork`) instead of waiting forever.
    changing: AtomicBool,
    /// The highest `slots_used` this process has known (process-local): sums cover at least
    /// these slots even if the header's count is lowered (any process of the container
    /// can write the header; a count of zero would make every sum zero).
    seen_used: AtomicU32,
}

// SAFETY: the mapping is shared memory accessed only through atomics (and plain fields
// written once before the magic is published); `base` never changes after construction.
unsafe impl Send for Region {}
// SAFETY: as above.
unsafe impl Sync for Region {}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: base/REGION_SIZE are what mmap returned; nothing borrows from the mapping
        // beyond &self.
        unsafe { libc::munmap(self.base.cast(), REGION_SIZE) };
    }
}

fn io(path: &Path, op: &'static str, err: std::io::Error) -> RegionError {
    RegionError::Io {
        path: path.display().to_string(),
        op,
        err: err.to_string(),
    }
}

impl Region {
    /// Open the region at `path`, creating it for `uuids` if it does not exist. A region
    /// made for other GPUs is recreated when no live process uses it, refused otherwise.
    pub fn open_or_create(path: &Path, uuids: &[[u8; 16]]) -> Result<Region, RegionError> {
        Region::open_with(path, uuids, true)
    }

    /// Open a region vcuda-manager made (the config names an allocation): the manager lays
    /// out every region before its container starts (`RegionFile::create_or_open`), so an
    /// empty one (size 0 or magic 0) can only have been reset from inside the container,
    /// where it is writable: refused ([`RegionError::Reset`]), never laid out afresh, which
    /// would forget what the container's processes hold and grant the quota again.
    pub fn open_laid_out(path: &Path, uuids: &[[u8; 16]]) -> Result<Region, RegionError> {
        Region::open_with(path, uuids, false)
    }

    fn open_with(path: &Path, uuids: &[[u8; 16]], lay_out: bool) -> Result<Region, RegionError> {
        assert!(!uuids.is_empty() && uuids.len() <= MAX_GPUS);
        let c = CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| io(path, "open it", std::io::ErrorKind::InvalidInput.into()))?;
        // SAFETY: c is NUL-terminated.
        let fd = unsafe {
            libc::open(
                c.as_ptr(),
                libc::O_RDWR | libc::O_CREAT | libc::O_CLOEXEC,
                0o666 as libc::c_uint,
            )
        };
        if fd < 0 {
            return Err(io(path, "open it", std::io::Error::last_os_error()));
        }
        // SAFETY: a descriptor we just opened and now own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // Openers take turns to check, size and lay out the file. Closing `fd` (on any error
        // below) releases the lock; so does the explicit unlock once the region is set up.
        // SAFETY: fd is open.
        if unsafe { libc::flock(fd.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(io(path, "lock it", std::io::Error::last_os_error()));
        }
        let size = file_size(&fd).map_err(|e| io(path, "stat it", e))?;
        if size != 0 && size != REGION_SIZE as u64 {
            return Err(RegionError::Incompatible {
                path: path.display().to_string(),
                why: format!("{size} bytes, expected {REGION_SIZE}"),
            });
        }
        if size == 0 {
            if !lay_out {
                return Err(RegionError::Reset {
                    path: path.display().to_string(),
                });
            }
            set_len(&fd, REGION_SIZE).map_err(|e| io(path, "size it", e))?;
        }
        let base = map(&fd).map_err(|e| io(path, "map it", e))?;
        let region = Region {
            fd,
            base,
            path: path.to_path_buf(),
            num_gpus: uuids.len(),
            changing: AtomicBool::new(false),
            seen_used: AtomicU32::new(0),
        };
        let adopted = region.adopt(uuids, lay_out);
        // Every slot in use counts, whatever the header says.
        let in_use = region
            .slots()
            .iter()
            .rposition(|s| s.state.load(Acquire) != SLOT_FREE)
            .map_or(0, |i| i as u32 + 1);
        region.seen_used.store(
            in_use.max(region.header().slots_used.load(Acquire)),
            Relaxed,
        );
        // SAFETY: the descriptor is open; unlocking a lock we hold.
        unsafe { libc::flock(region.fd.as_raw_fd(), libc::LOCK_UN) };
        adopted.map(|()| region)
    }

    /// Check the mapped file (the caller holds the flock): lay out a new one, keep a
    /// compatible one, take over one made for other GPUs that nobody uses.
    /// `lay_out`: whether an empty file (magic 0) may be laid out here.
    fn adopt(&self, uuids: &[[u8; 16]], lay_out: bool) -> Result<(), RegionError> {
        let incompatible = |why: String| RegionError::Incompatible {
            path: self.path.display().to_string(),
            why,
        };
        let h = self.header();
        let magic = h.magic.load(Acquire);
        if magic == 0 && !lay_out {
            return Err(RegionError::Reset {
                path: self.path.display().to_string(),
            });
        } else if magic == 0 {
            self.initialise(uuids);
        } else if magic != REGION_MAGIC {
            return Err(incompatible(format!("bad magic number {magic:#018x}")));
        } else if h.version != REGION_VERSION {
            return Err(incompatible(format!(
                "layout version {}, this libvcuda uses {REGION_VERSION}",
                h.version
            )));
        } else if h.num_gpus as usize != uuids.len() || h.uuids[..uuids.len()] != *uuids {
            let live = (0..MAX_PROCS as u32)
                .filter(|&i| {
                    self.slots()[i as usize].state.load(Acquire) != SLOT_FREE
                        && self.holder_alive(i, false)
                })
                .count();
            if live > 0 {
                return Err(RegionError::InUse {
                    path: self.path.display().to_string(),
                    why: format!(
                        "it counts {} GPU(s) {}, the config names {}",
                        h.num_gpus,
                        fmt_uuids(&h.uuids[..h.num_gpus as usize]),
                        fmt_uuids(uuids)
                    ),
                });
            }
            self.initialise(uuids);
        }
        Ok(())
    }

    /// Zero the file and lay out a fresh region. The caller holds the flock.
    fn initialise(&self, uuids: &[[u8; 16]]) {
        // SAFETY: we hold the flock and the region is (or is being made) unused: nobody else
        // reads or writes it until the magic is published.
        unsafe { std::ptr::write_bytes(self.base, 0, REGION_SIZE) };
        // SAFETY: as above; the header lies at the start of the mapping.
        let h = unsafe { &mut *(self.base as *mut RegionHeader) };
        h.version = REGION_VERSION;
        h.num_gpus = uuids.len() as u32;
        h.size = REGION_SIZE as u64;
        h.uuids[..uuids.len()].copy_from_slice(uuids);
        h.magic.store(REGION_MAGIC, Release);
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// After `fork`: give this process its own open file description of the region (the
    /// inherited one is shared with the parent, and so are the locks on it), keeping the
    /// descriptor number. Call in the child before claiming a slot.
    pub fn reopen_after_fork(&self) -> Result<(), RegionError> {
        let c = CString::new(self.path.as_os_str().as_encoded_bytes()).map_err(|_| {
            io(
                &self.path,
                "reopen it",
                std::io::ErrorKind::InvalidInput.into(),
            )
        })?;
        // SAFETY: c is NUL-terminated.
        let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(io(&self.path, "reopen it", std::io::Error::last_os_error()));
        }
        // SAFETY: dup3 atomically makes our descriptor number refer to the new description;
        // the old one is still the parent's, which keeps its own reference.
        let rc = unsafe { libc::dup3(fd, self.fd.as_raw_fd(), libc::O_CLOEXEC) };
        let err = std::io::Error::last_os_error();
        // SAFETY: fd is ours and no longer needed (its description lives on under self.fd).
        unsafe { libc::close(fd) };
        if rc < 0 {
            return Err(io(&self.path, "reopen it", err));
        }
        // A thread of the parent may have been changing a slot: it does not exist here.
        self.changing.store(false, Release);
        Ok(())
    }

    pub fn num_gpus(&self) -> usize {
        self.num_gpus
    }

    pub fn header(&self) -> &RegionHeader {
        // SAFETY: the mapping starts with a RegionHeader and lives as long as self.
        unsafe { &*(self.base as *const RegionHeader) }
    }

    /// Set GPU `dev`'s compute share and elastic limit at run time, in ppm of the GPU (0:
    /// back to the config's; a share of 1 000 000 or more is exclusive). Every process of the
    /// container applies it within its limiter's next tick (50 ms).
    pub fn set_core(&self, dev: usize, share_ppm: u64, limit_ppm: u64) {
        let h = self.header();
        h.core_override[dev].store(share_ppm, Relaxed);
        h.core_limit_override[dev].store(limit_ppm, Relaxed);
    }

    // ---- statistics --------------------------------------------------------------------

    /// Nanoseconds the container's processes have waited in the compute limiter on `dev`
    /// (0 for a GPU index out of range).
    pub fn throttled_ns(&self, dev: usize) -> u64 {
        self.header()
            .throttled_ns
            .get(dev)
            .map_or(0, |c| c.load(Relaxed))
    }

    /// Calls refused for the quota on `dev` (0 for a GPU index out of range).
    pub fn oom_refusals(&self, dev: usize) -> u64 {
        self.header()
            .oom_refusals
            .get(dev)
            .map_or(0, |c| c.load(Relaxed))
    }

    /// Add `ns` of limiter waiting on `dev` (out of range: nothing). Wraps only after 584
    /// years of waiting.
    pub fn add_throttled_ns(&self, dev: usize, ns: u64) {
        if let Some(c) = self.header().throttled_ns.get(dev) {
            c.fetch_add(ns, Relaxed);
        }
    }

    /// Count one call refused for the quota on `dev` (out of range: nothing).
    pub fn count_oom_refusal(&self, dev: usize) {
        if let Some(c) = self.header().oom_refusals.get(dev) {
            c.fetch_add(1, Relaxed);
        }
    }

    /// A process's slot; `None` for a [`SlotId::NONE`] (a forked child whose claim failed).
    #[inline]
    fn slot(&self, me: SlotId) -> Option<&Slot> {
        self.slots().get(me.index as usize)
    }

    pub fn slots(&self) -> &[Slot] {
        // SAFETY: MAX_PROCS slots follow the 4 KiB header inside the mapping.
        unsafe { std::slice::from_raw_parts(self.base.add(HEADER_SIZE) as *const Slot, MAX_PROCS) }
    }

    // ---- reservation ------------------------------------------------------------------

    /// Reserve `bytes` on GPU `dev` for slot `me` if the container's total stays within
    /// `limit`. Lock-free; see the module comment for why it never overshoots.
    #[inline]
    pub fn reserve(&self, me: SlotId, dev: usize, bytes: u64, limit: u64) -> bool {
        if bytes > limit {
            // Also keeps the counters far from wrapping, whatever size a caller asks for.
            return false;
        }
        let Some(s) = self.slot(me) else {
            return false;
        };
        let mine = &s.api[dev];
        mine.fetch_add(bytes.wrapping_add(API_CHANGE), SeqCst);
        if self.used_seqcst(dev) <= limit {
            return true;
        }
        mine.fetch_add(API_CHANGE.wrapping_sub(bytes), SeqCst);
        false
    }

    /// Give back `bytes` reserved earlier (exactly what was reserved: callers release only
    /// what their own bookkeeping recorded). Returns false if the counter held less, which
    /// the slot protocol rules out: the counter is then set back to zero (never left
    /// negative) and the error counted in `accounting_errors`.
    #[inline]
    pub fn release(&self, me: SlotId, dev: usize, bytes: u64) -> bool {
        let Some(s) = self.slot(me) else {
            return true;
        };
        // Subtract the bytes and count the change in one operation.
        let before = s.api[dev].fetch_add(API_CHANGE.wrapping_sub(bytes), Release);
        let had = before & API_BYTES;
        if had >= bytes {
            return true;
        }
        self.repair_underflow(s, dev, bytes - had);
        false
    }

    /// Undo the part of a release that went below zero (the borrow it took from the change
    /// count comes back with the carry).
    #[cold]
    fn repair_underflow(&self, s: &Slot, dev: usize, missing: u64) {
        s.api[dev].fetch_add(missing, SeqCst);
        if let Some(c) = self.header().accounting_errors.get(dev) {
            c.fetch_add(1, Relaxed);
        }
    }

    /// Accounting errors repaired on `dev` (0 for a GPU index out of range).
    pub fn accounting_errors(&self, dev: usize) -> u64 {
        self.header()
            .accounting_errors
            .get(dev)
            .map_or(0, |c| c.load(Relaxed))
    }

    /// This process's allocation counter on `dev`, raw: bytes and change count. Two equal
    /// readings mean nothing was reserved or released in between.
    pub fn api_raw(&self, me: SlotId, dev: usize) -> u64 {
        self.slot(me).map_or(0, |s| s.api[dev].load(SeqCst))
    }

    /// Add `bytes` without checking the limit: memory the driver already holds (counted
    /// late). The container may then be over its quota until usage drops.
    pub fn force_add(&self, me: SlotId, dev: usize, bytes: u64) {
        if let Some(s) = self.slot(me) {
            s.api[dev].fetch_add(bytes.wrapping_add(API_CHANGE), SeqCst);
        }
    }

    /// Set this process's measured hidden memory on `dev`; returns the previous value.
    pub fn set_hidden(&self, me: SlotId, dev: usize, bytes: u64) -> u64 {
        self.slot(me)
            .map_or(0, |s| s.hidden[dev].swap(bytes, SeqCst))
    }

    /// Raise this process's hidden memory on `dev` to at least `bytes`; returns the previous
    /// value. (A measurement taken while allocations are in flight can only come out low, so
    /// between teardowns the count only goes up.)
    pub fn raise_hidden(&self, me: SlotId, dev: usize, bytes: u64) -> u64 {
        self.slot(me)
            .map_or(0, |s| s.hidden[dev].fetch_max(bytes, SeqCst))
    }

    /// What the container holds on `dev` (all processes, allocations and hidden memory).
    #[inline]
    pub fn used(&self, dev: usize) -> u64 {
        self.sum(dev, Relaxed)
    }

    #[inline]
    fn used_seqcst(&self, dev: usize) -> u64 {
        self.sum(dev, SeqCst)
    }

    #[inline]
    fn sum(&self, dev: usize, order: std::sync::atomic::Ordering) -> u64 {
        // The same order for `slots_used` as for the counters: a reserver's SeqCst sum must
        // see every slot claimed before its announcement.
        let n = (self.header().slots_used.load(order)).max(self.seen_used.load(Relaxed)) as usize;
        let n = n.min(MAX_PROCS);
        self.slots()[..n].iter().fold(0u64, |acc, s| {
            acc.saturating_add(held(s.api[dev].load(order)))
                .saturating_add(s.hidden[dev].load(order))
        })
    }

    /// This process's own bytes on `dev`: (allocations, hidden).
    pub fn mine(&self, me: SlotId, dev: usize) -> (u64, u64) {
        self.slot(me).map_or((0, 0), |s| {
            (held(s.api[dev].load(Relaxed)), s.hidden[dev].load(Relaxed))
        })
    }

    // ---- processes --------------------------------------------------------------------

    fn lock_byte(
        &self,
        i: usize,
        l: Lock,
        cmd: libc::c_int,
        ltype: libc::c_int,
    ) -> std::io::Result<libc::c_int> {
        slot_lock(&self.fd, i, l, cmd, ltype)
    }

    /// Whether slot `i`'s process still runs, or is still exiting. `check_pid`: the caller is
    /// inside the container's pid namespace, where the kernel's word decides: the owner is
    /// there while its pid names a process started at its recorded start time that is not
    /// yet a zombie. The owner lock alone cannot say it: a dying process closes its
    /// descriptors (and so drops its locks) before the driver has freed its memory, and
    /// reclaiming its slot then lets a peer allocate into memory still held (the overshoot
    /// left in issue 23's kill storms); and a child forked without `exec` shares a dead
    /// owner's lock. Without `check_pid` (or a start time), the lock.
    pub fn holder_alive(&self, i: u32, check_pid: bool) -> bool {
        let s = &self.slots()[i as usize];
        let pid = s.pid.load(Relaxed);
        let start = s.start_time.load(Relaxed);
        if check_pid && pid == std::process::id() {
            return true;
        }
        if check_pid && start != 0 {
            return proc_start_time(pid) == Some(start);
        }
        !matches!(
            self.lock_byte(i as usize, Lock::Owner, libc::F_OFD_GETLK, libc::F_WRLCK),
            Ok(t) if t == libc::F_UNLCK
        )
    }

    /// The slot machines' view of this region ([`crate::slot::Slots`]).
    fn shared(&self, check_pid: bool) -> Shared<'_> {
        Shared {
            region: self,
            check_pid,
        }
    }

    /// Run a slot machine with this process's other threads kept out. Waiting for them is
    /// bounded: a thread of this process inside a machine makes a few system calls and
    /// cannot die alone (a forked child, where it does not exist, resets the flag).
    fn exclusive<M: for<'a> Machine<Shared<'a>>>(
        &self,
        m: M,
        check_pid: bool,
    ) -> <M as Machine<Shared<'_>>>::Output {
        while self
            .changing
            .compare_exchange_weak(false, true, Acquire, Relaxed)
            .is_err()
        {
            std::thread::yield_now();
        }
        let out = slot::run(m, &self.shared(check_pid));
        self.changing.store(false, Release);
        out
    }

    /// Claim a slot for the calling process.
    pub fn claim(&self) -> Result<SlotId, RegionError> {
        match self.exclusive(Claim::default(), true) {
            Some(c) => Ok(SlotId {
                index: c.index as u32,
                generation: c.generation,
            }),
            None => Err(RegionError::Full {
                path: self.path.display().to_string(),
            }),
        }
    }

    /// Give the slot up now, counters and all. (The library keeps its slot past exit instead,
    /// since the driver frees a process's memory only as it ends.) Leaves the slot to the
    /// next reclaim if someone is judging it at this moment.
    pub fn unclaim(&self, me: SlotId) {
        let me = Claimed {
            index: me.index as usize,
            generation: me.generation,
        };
        self.exclusive(Unclaim::Lock(me), true);
    }

    /// Free the slots of dead processes, and finish any slot change a killed process left
    /// half done; returns how many slots it freed. Never waits: a slot another process is
    /// changing is left to it. `check_pid` as for [`Region::holder_alive`]; without it, the
    /// caller must own no slot through this handle (the manager), since a lock never
    /// conflicts with its own open file description.
    pub fn reclaim_dead(&self, check_pid: bool) -> usize {
        self.exclusive(Reclaim::default(), check_pid)
    }

    /// Whether `me` still owns its slot (the slot protocol guarantees it while the process
    /// lives; callers check before trusting counters).
    pub fn owns(&self, me: SlotId) -> bool {
        self.slot(me).is_some_and(|s| {
            s.state.load(Acquire) == SLOT_ACTIVE && s.generation.load(Relaxed) == me.generation
        })
    }

    /// Every active process.
    /// (pid the driver reports, pid in the container) of every active slot, written into
    /// `out` (one entry per slot at most); returns how many. The driver's pid is the host pid
    /// the manager recorded, or the slot's own pid until it has. No allocation: NVML's
    /// process lists call it on every call.
    pub fn process_pids(&self, out: &mut [(u32, u32); MAX_PROCS]) -> usize {
        // Slots past every one in use are free: the bound the sums use (see `sum`).
        let used = (self.header().slots_used.load(Acquire)).max(self.seen_used.load(Relaxed));
        let mut n = 0;
        for s in &self.slots()[..(used as usize).min(MAX_PROCS)] {
            if s.state.load(Acquire) != SLOT_ACTIVE {
                continue;
            }
            let pid = s.pid.load(Relaxed);
            if pid == 0 {
                continue;
            }
            let host = s.host_pid.load(Relaxed);
            out[n] = (if host != 0 { host } else { pid }, pid);
            n += 1;
        }
        n
    }

    pub fn processes(&self) -> Vec<SlotView> {
        let g = self.num_gpus;
        self.slots()
            .iter()
            .enumerate()
            .filter(|(_, s)| s.state.load(Acquire) == SLOT_ACTIVE)
            .map(|(i, s)| SlotView {
                index: i as u32,
                pid: s.pid.load(Relaxed),
                host_pid: s.host_pid.load(Relaxed),
                api: s.api[..g].iter().map(|a| held(a.load(Relaxed))).collect(),
                hidden: s.hidden[..g].iter().map(|a| a.load(Relaxed)).collect(),
            })
            .collect()
    }
}

/// The region as the slot machines see it: one atomic action per call.
struct Shared<'a> {
    region: &'a Region,
    check_pid: bool,
}

impl Slots for Shared<'_> {
    fn count(&self) -> usize {
        MAX_PROCS
    }
    fn try_lock(&self, i: usize, l: Lock) -> bool {
        self.region
            .lock_byte(i, l, libc::F_OFD_SETLK, libc::F_WRLCK)
            .is_ok()
    }
    fn unlock(&self, i: usize, l: Lock) {
        let _ = self
            .region
            .lock_byte(i, l, libc::F_OFD_SETLK, libc::F_UNLCK);
    }
    fn state(&self, i: usize) -> u32 {
        self.region.slots()[i].state.load(Acquire)
    }
    fn set_state(&self, i: usize, state: u32) {
        self.region.slots()[i].state.store(state, Release);
    }
    fn generation(&self, i: usize) -> u32 {
        self.region.slots()[i].generation.load(Relaxed)
    }
    fn owner_alive(&self, i: usize) -> bool {
        self.region.holder_alive(i as u32, self.check_pid)
    }
    fn zero(&self, i: usize) {
        let s = &self.region.slots()[i];
        for d in 0..MAX_GPUS {
            s.api[d].store(0, Release);
            s.hidden[d].store(0, Release);
            s.launched_at[d].store(0, Release);
        }
    }
}

impl Owners for Shared<'_> {
    fn stamp(&self, i: usize) -> u32 {
        let s = &self.region.slots()[i];
        let pid = std::process::id();
        let generation = s.generation.load(Relaxed).wrapping_add(1);
        s.generation.store(generation, Relaxed);
        s.pid.store(pid, Relaxed);
        s.host_pid.store(0, Relaxed);
        s.start_time
            .store(proc_start_time(pid).unwrap_or(0), Relaxed);
        generation
    }
    fn include(&self, i: usize) {
        self.region
            .header()
            .slots_used
            .fetch_max(i as u32 + 1, SeqCst);
        self.region.seen_used.fetch_max(i as u32 + 1, Relaxed);
    }
}

/// Slot `i`'s lock `l` on the region open as `fd`: one byte beyond the end of the file
/// (never part of a mapping), an open-file-description lock. `cmd` is `F_OFD_SETLK` or
/// `F_OFD_GETLK`, neither of which waits; returns the lock type (`F_OFD_GETLK`: `F_UNLCK`
/// when it could be taken).
pub(crate) fn slot_lock(
    fd: &OwnedFd,
    i: usize,
    l: Lock,
    cmd: libc::c_int,
    ltype: libc::c_int,
) -> std::io::Result<libc::c_int> {
    let at = match l {
        Lock::Owner => REGION_SIZE + i,
        Lock::Transition => REGION_SIZE + MAX_PROCS + i,
    };
    // SAFETY: flock is plain data; zero is a valid value (l_pid must be 0 for OFD locks).
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = ltype as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = at as libc::off_t;
    fl.l_len = 1;
    // SAFETY: fd is open; fl is valid.
    if unsafe { libc::fcntl(fd.as_raw_fd(), cmd, &mut fl) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(libc::c_int::from(fl.l_type))
}

/// The bytes a raw allocation counter holds; a counter that reads negative counts as zero.
#[inline]
pub(crate) fn held(raw: u64) -> u64 {
    let b = raw & API_BYTES;
    if b >= API_NEGATIVE {
        0
    } else {
        b
    }
}

fn fmt_uuids(u: &[[u8; 16]]) -> String {
    u.iter()
        .map(crate::config::format_uuid)
        .collect::<Vec<_>>()
        .join(",")
}

/// Start time of `pid` in clock ticks since boot (field 22 of /proc/<pid>/stat), or `None`
/// if it does not exist or is a zombie.
pub fn proc_start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = stat.rsplit_once(')')?.1;
    let mut fields = rest.split_whitespace();
    let state = fields.next()?;
    if state == "Z" || state == "X" {
        return None;
    }
    // fields after the comm: state is field 3, starttime is field 22 → 19 more after state.
    fields.nth(18)?.parse().ok()
}

fn file_size(fd: &OwnedFd) -> std::io::Result<u64> {
    // SAFETY: stat is plain data filled by fstat.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fd is open; st is a valid out-pointer.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(st.st_size as u64)
}

fn set_len(fd: &OwnedFd, len: usize) -> std::io::Result<()> {
    // SAFETY: fd is open for writing.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn map(fd: &OwnedFd) -> std::io::Result<*mut u8> {
    // SAFETY: a shared mapping of a regular file we have open read-write, at a kernel-chosen
    // address.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            REGION_SIZE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    Ok(p.cast())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicI64;
    use std::sync::Arc;

    const U0: [u8; 16] = [1; 16];
    const U1: [u8; 16] = [2; 16];

    fn region() -> (tempfile::TempDir, Region) {
        let d = tempfile::tempdir().unwrap();
        let r = Region::open_or_create(&d.path().join("region"), &[U0, U1]).unwrap();
        (d, r)
    }

    /// Descriptors of this process open on `path`.
    fn fds_on(path: &Path) -> usize {
        std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
            .filter(|t| t == path)
            .count()
    }

    /// One descriptor per open region, closed with it, and none left by a refused open
    /// (issue 14: an earlier `open_or_create` leaked one per call, one per PreStartContainer
    /// for the manager's whole life).
    /// A region the manager named is never laid out by the library: empty (truncated) or
    /// zeroed (truncated and re-extended), it is refused; laid out, it opens.
    #[test]
    fn a_managed_region_reset_from_inside_is_refused_not_laid_out_again() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("region");
        std::fs::write(&p, b"").unwrap();
        let e = Region::open_laid_out(&p, &[U0]).map(|_| ()).unwrap_err();
        assert!(matches!(e, RegionError::Reset { .. }), "{e}");
        assert_eq!(
            std::fs::metadata(&p).unwrap().len(),
            0,
            "the empty file was sized"
        );
        std::fs::write(&p, vec![0u8; REGION_SIZE]).unwrap();
        let e = Region::open_laid_out(&p, &[U0]).map(|_| ()).unwrap_err();
        assert!(e.to_string().contains("reset"), "{e}");
        assert!(
            std::fs::read(&p).unwrap().iter().all(|&b| b == 0),
            "the zeroed file was laid out"
        );
        // Laid out (as the manager's RegionFile::create_or_open does), it opens.
        drop(Region::open_or_create(&p, &[U0]).unwrap());
        drop(Region::open_laid_out(&p, &[U0]).unwrap());
    }

    #[test]
    fn a_region_owns_exactly_one_descriptor_and_closes_it() {
        let d = tempfile::tempdir().unwrap();
        // /proc/self/fd links name the canonical path.
        let p = d.path().canonicalize().unwrap().join("region");
        drop(Region::open_or_create(&p, &[U0]).unwrap());
        assert_eq!(fds_on(&p), 0);
        let rs: Vec<Region> = (0..20)
            .map(|_| Region::open_or_create(&p, &[U0]).unwrap())
            .collect();
        assert_eq!(fds_on(&p), 20);
        drop(rs);
        assert_eq!(fds_on(&p), 0);
        // Refused (a file it cannot use): nothing stays open.
        let q = d.path().canonicalize().unwrap().join("garbage");
        std::fs::write(&q, [7u8; 16]).unwrap();
        assert!(Region::open_or_create(&q, &[U0]).is_err());
        assert_eq!(fds_on(&q), 0);
    }

    #[test]
    fn run_time_shares_are_seen_by_every_opener() {
        let (d, r) = region();
        r.set_core(1, 250_000, 600_000);
        let other = Region::open_or_create(&d.path().join("region"), &[U0, U1]).unwrap();
        assert_eq!(other.header().core_override[1].load(Relaxed), 250_000);
        assert_eq!(other.header().core_limit_override[1].load(Relaxed), 600_000);
        assert_eq!(other.header().core_override[0].load(Relaxed), 0);
    }

    #[test]
    fn statistics_counters_are_per_gpu_and_shared_by_every_opener() {
        let (d, r) = region();
        let other = Region::open_or_create(&d.path().join("region"), &[U0, U1]).unwrap();
        assert_eq!(
            (r.throttled_ns(0), r.oom_refusals(0)),
            (0, 0),
            "a new region"
        );
        r.add_throttled_ns(0, 1_500);
        other.add_throttled_ns(0, 2_500);
        other.add_throttled_ns(1, 7);
        r.count_oom_refusal(1);
        r.count_oom_refusal(1);
        other.count_oom_refusal(1);
        for h in [&r, &other] {
            assert_eq!(h.throttled_ns(0), 4_000);
            assert_eq!(h.throttled_ns(1), 7);
            assert_eq!(h.oom_refusals(0), 0, "GPUs are counted separately");
            assert_eq!(h.oom_refusals(1), 3);
        }
        // Out of range: read as 0, written nowhere, never a panic.
        for dev in [MAX_GPUS, MAX_GPUS + 1, usize::MAX] {
            r.add_throttled_ns(dev, 1);
            r.count_oom_refusal(dev);
            assert_eq!((r.throttled_ns(dev), r.oom_refusals(dev)), (0, 0));
        }
        assert_eq!((r.throttled_ns(1), r.oom_refusals(1)), (7, 3));
        // Slots coming and going leave the container's statistics alone.
        let me = r.claim().unwrap();
        r.unclaim(me);
        assert_eq!(other.throttled_ns(0), 4_000);
    }

    #[test]
    fn concurrent_counting_loses_nothing() {
        let (d, r) = region();
        let r = Arc::new(r);
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let r = if t % 2 == 0 {
                    r.clone()
                } else {
                    Arc::new(Region::open_or_create(&d.path().join("region"), &[U0, U1]).unwrap())
                };
                std::thread::spawn(move || {
                    for _ in 0..10_000 {
                        r.add_throttled_ns(1, 3);
                        r.count_oom_refusal(0);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(r.throttled_ns(1), 4 * 10_000 * 3);
        assert_eq!(r.oom_refusals(0), 4 * 10_000);
    }

    #[test]
    fn an_older_layout_is_refused() {
        let (d, r) = region();
        let path = d.path().join("region");
        drop(r);
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[8..12].copy_from_slice(&3u32.to_le_bytes());
        std::fs::write(&path, &bytes).unwrap();
        let e = Region::open_or_create(&path, &[U0, U1])
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("layout version 3"), "{e}");
    }

    #[test]
    fn layout_is_stable() {
        assert_eq!(std::mem::size_of::<Slot>(), 256);
        assert_eq!(REGION_SIZE, 4096 + 64 * 256);
        assert!(std::mem::size_of::<RegionHeader>() <= 4096);
        // Readers outside Rust (tests/gpusim/e2e/limit_common.py and vcuda_common.py, the
        // manager) use these.
        assert_eq!(std::mem::offset_of!(RegionHeader, core_override), 288);
        assert_eq!(std::mem::offset_of!(RegionHeader, core_limit_override), 352);
        assert_eq!(std::mem::offset_of!(RegionHeader, throttled_ns), 416);
        assert_eq!(std::mem::offset_of!(RegionHeader, oom_refusals), 480);
        assert_eq!(std::mem::offset_of!(RegionHeader, accounting_errors), 544);
        assert_eq!(std::mem::size_of::<RegionHeader>(), 608);
        assert_eq!(std::mem::offset_of!(Slot, launched_at), 152);
    }

    #[test]
    fn reserve_stops_at_the_limit_and_release_gives_back() {
        let (_d, r) = region();
        let me = r.claim().unwrap();
        assert!(r.reserve(me, 0, 600, 1000));
        assert!(!r.reserve(me, 0, 401, 1000));
        assert!(r.reserve(me, 0, 400, 1000));
        assert!(r.reserve(me, 1, 1000, 1000), "GPUs are counted separately");
        let raw = r.api_raw(me, 0);
        assert!(!r.reserve(me, 0, 1, 1000));
        assert_ne!(
            r.api_raw(me, 0),
            raw,
            "a refused reservation is a change too"
        );
        assert_eq!(r.api_raw(me, 0) & API_BYTES, 1000);
        assert_eq!(r.used(0), 1000);
        r.release(me, 0, 1000);
        assert_eq!(r.used(0), 0);
        r.set_hidden(me, 0, 300);
        assert!(!r.reserve(me, 0, 701, 1000), "hidden memory counts");
        assert!(
            !r.reserve(me, 0, u64::MAX - 10, 1000),
            "absurd sizes are refused, not wrapped"
        );
        assert_eq!(r.mine(me, 0), (0, 300));
        assert_eq!(r.raise_hidden(me, 0, 200), 300);
        assert_eq!(r.mine(me, 0), (0, 300), "raise never lowers");
    }

    #[test]
    fn attach_sees_the_same_counters_and_other_gpus_are_refused() {
        let (d, r) = region();
        let me = r.claim().unwrap();
        assert!(r.reserve(me, 1, 77, u64::MAX));
        let again = Region::open_or_create(&d.path().join("region"), &[U0, U1]).unwrap();
        assert_eq!(again.used(1), 77);
        let e = Region::open_or_create(&d.path().join("region"), &[U1])
            .err()
            .unwrap();
        assert!(matches!(e, RegionError::InUse { .. }), "{e}");
        assert!(e.to_string().contains("live processes"), "{e}");
        r.unclaim(me);
        drop(again);
        drop(r);
        // nobody uses it any more: a config naming other GPUs takes it over
        let fresh = Region::open_or_create(&d.path().join("region"), &[U1]).unwrap();
        assert_eq!(fresh.num_gpus(), 1);
        assert_eq!(fresh.used(0), 0);
    }

    #[test]
    fn garbage_file_is_reported() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("r");
        std::fs::write(&p, vec![7u8; REGION_SIZE]).unwrap();
        let e = Region::open_or_create(&p, &[U0]).err().unwrap().to_string();
        assert!(
            e.contains("not a usable vcuda region") && e.contains("bad magic"),
            "{e}"
        );
        std::fs::write(&p, b"short").unwrap();
        assert!(Region::open_or_create(&p, &[U0]).is_err());
    }

    #[test]
    fn a_dead_process_is_reclaimed() {
        let (d, r) = region();
        let path = d.path().join("region");
        // SAFETY: the child only claims a slot, reserves and _exits; no locks are shared
        // with the parent's threads in between.
        let child = unsafe { libc::fork() };
        if child == 0 {
            let r2 = Region::open_or_create(&path, &[U0, U1]).unwrap();
            let me = r2.claim().unwrap();
            r2.reserve(me, 0, 5000, u64::MAX);
            // SAFETY: terminate the child at once, as a kill would.
            unsafe { libc::_exit(0) };
        }
        let mut status = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(child, &mut status, 0) };
        assert_eq!(r.used(0), 5000);
        let me = r.claim().unwrap();
        assert_eq!(r.reclaim_dead(true), 1);
        assert_eq!(r.used(0), 0);
        assert!(r.owns(me));
        assert_eq!(r.reclaim_dead(true), 0, "we are alive");
    }

    /// A dying process drops its locks before the driver frees its memory: while its pid
    /// still names it (not yet a zombie), its slot stays counted.
    #[test]
    fn an_owner_whose_lock_is_gone_but_which_still_runs_is_not_reclaimed() {
        let (d, r) = region();
        let path = d.path().join("region");
        let mut go = [0i32; 2];
        // SAFETY: a pipe for the parent to tell the child when to end.
        assert_eq!(unsafe { libc::pipe(go.as_mut_ptr()) }, 0);
        // SAFETY: the child claims, reserves, drops its lock and waits; no locks are shared
        // with the parent's threads in between.
        let child = unsafe { libc::fork() };
        if child == 0 {
            let r2 = Region::open_or_create(&path, &[U0, U1]).unwrap();
            let me = r2.claim().unwrap();
            r2.reserve(me, 0, 5000, u64::MAX);
            let _ = r2.lock_byte(
                me.index as usize,
                Lock::Owner,
                libc::F_OFD_SETLK,
                libc::F_UNLCK,
            );
            let mut b = [0u8; 1];
            // SAFETY: the child keeps only the read end, and reads it until the parent closes
            // the write end.
            unsafe {
                libc::close(go[1]);
                libc::read(go[0], b.as_mut_ptr().cast(), 1)
            };
            // SAFETY: end the child at once.
            unsafe { libc::_exit(0) };
        }
        // SAFETY: the parent keeps only the write end.
        unsafe { libc::close(go[0]) };
        let unlocked = || {
            r.slots().iter().enumerate().any(|(i, s)| {
                s.state.load(Acquire) == SLOT_ACTIVE
                    && matches!(r.lock_byte(i, Lock::Owner, libc::F_OFD_GETLK, libc::F_WRLCK), Ok(t) if t == libc::F_UNLCK)
            })
        };
        while !unlocked() {
            std::thread::yield_now();
        }
        assert_eq!(r.reclaim_dead(true), 0, "still running: not reclaimed");
        assert_eq!(r.used(0), 5000);
        // SAFETY: closing our end lets the child end; then reap it.
        unsafe { libc::close(go[1]) };
        let mut status = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(child, &mut status, 0) };
        assert_eq!(r.reclaim_dead(true), 1);
        assert_eq!(r.used(0), 0);
    }

    /// Many threads reserving and releasing at random never hold more than the limit,
    /// counted by a shadow counter that only successful reservations increase.
    #[test]
    fn concurrent_reservations_never_overshoot() {
        let (_d, r) = region();
        let r = Arc::new(r);
        let held = Arc::new(AtomicI64::new(0));
        let limit = 1_000_000u64;
        let threads: Vec<_> = (0..8)
            .map(|t| {
                let (r, held) = (r.clone(), held.clone());
                std::thread::spawn(move || {
                    let me = r.claim().unwrap();
                    let mut mine = Vec::new();
                    let mut x = 0x9E37_79B9u64 ^ t;
                    for _ in 0..20_000 {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        if !x.is_multiple_of(3) || mine.is_empty() {
                            let n = 1 + x % 200_000;
                            if r.reserve(me, 0, n, limit) {
                                let now = held.fetch_add(n as i64, SeqCst) + n as i64;
                                assert!(now as u64 <= limit, "held {now} > limit");
                                mine.push(n);
                            }
                        } else {
                            let n = mine.swap_remove((x as usize / 3) % mine.len());
                            held.fetch_sub(n as i64, SeqCst);
                            r.release(me, 0, n);
                        }
                    }
                    for n in mine {
                        held.fetch_sub(n as i64, SeqCst);
                        r.release(me, 0, n);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(r.used(0), 0);
    }

    /// What a process killed part-way through a slot change leaves: the slot BUSY, its
    /// counters as they were, no lock held. The next reclaim (or claim) finishes it.
    #[test]
    fn a_slot_left_mid_transition_is_recovered() {
        let (_d, r) = region();
        let dead = r.claim().unwrap();
        assert!(r.reserve(dead, 0, 700, 1000));
        // The kernel drops a killed process's locks; its slot is left BUSY.
        let _ = r.lock_byte(
            dead.index as usize,
            Lock::Owner,
            libc::F_OFD_SETLK,
            libc::F_UNLCK,
        );
        r.slots()[dead.index as usize]
            .state
            .store(SLOT_BUSY, Release);
        assert_eq!(r.used(0), 700, "still counted");
        assert_eq!(r.reclaim_dead(true), 1);
        assert_eq!(r.used(0), 0);
        assert_eq!(
            r.slots()[dead.index as usize].state.load(Acquire),
            SLOT_FREE
        );
        // A claim that finds it BUSY recovers it too.
        r.slots()[0].state.store(SLOT_BUSY, Release);
        r.slots()[0].api[1].store(123, Release);
        let me = r.claim().unwrap();
        assert_eq!(me.index, 0);
        assert_eq!(r.used(1), 0);
    }

    /// A slot whose transition lock another process holds is left to it: a reclaimer
    /// never waits, and never changes a slot someone else is changing.
    #[test]
    fn a_slot_being_changed_by_another_process_is_left_alone() {
        let (d, r) = region();
        let other = Region::open_or_create(&d.path().join("region"), &[U0, U1]).unwrap();
        let dead = r.claim().unwrap();
        assert!(r.reserve(dead, 0, 500, 1000));
        let _ = r.lock_byte(
            dead.index as usize,
            Lock::Owner,
            libc::F_OFD_SETLK,
            libc::F_UNLCK,
        );
        // `other` (another open file description, as another process has) is mid-change.
        assert!(other
            .shared(true)
            .try_lock(dead.index as usize, Lock::Transition));
        assert_eq!(r.reclaim_dead(false), 0);
        assert_eq!(r.used(0), 500);
        let next = r.claim().unwrap();
        assert_ne!(next.index, dead.index, "a claim skips it too");
        other
            .shared(true)
            .unlock(dead.index as usize, Lock::Transition);
        assert_eq!(other.reclaim_dead(false), 1);
        assert_eq!(r.used(0), 0);
        assert!(r.owns(next));
    }

    #[test]
    fn a_release_below_zero_is_repaired_and_counted_and_never_reads_as_full() {
        let (_d, r) = region();
        let me = r.claim().unwrap();
        assert!(r.reserve(me, 0, 100, 1000));
        assert!(!r.release(me, 0, 300), "more than was reserved");
        assert_eq!(r.mine(me, 0), (0, 0));
        assert_eq!(r.accounting_errors(0), 1);
        assert_eq!(r.accounting_errors(1), 0);
        assert!(r.reserve(me, 0, 1000, 1000), "the whole quota is there");
        assert!(r.release(me, 0, 1000));
        // A counter that reads negative anyway (written by hand) sums as zero.
        let other = r.claim().unwrap();
        r.slots()[other.index as usize].api[0].store(API_BYTES - (5 << 20), Release);
        assert_eq!(r.used(0), 0);
        assert!(r.reserve(me, 0, 1000, 1000));
        assert_eq!(r.processes()[1].api[0], 0);
    }

    #[test]
    fn process_pids_are_the_active_slots_with_the_drivers_pid_first() {
        let (_d, r) = region();
        let a = r.claim().unwrap();
        let b = r.claim().unwrap();
        let mut out = [(0, 0); MAX_PROCS];
        let own = std::process::id();
        assert_eq!(r.process_pids(&mut out), 2);
        assert_eq!(
            &out[..2],
            &[(own, own), (own, own)],
            "no host pid yet: the slot's own"
        );
        r.slots()[b.index as usize].host_pid.store(9001, Release);
        assert_eq!(r.process_pids(&mut out), 2);
        assert_eq!(
            out[1],
            (9001, own),
            "the host pid the manager recorded, for the driver"
        );
        r.unclaim(a);
        assert_eq!(r.process_pids(&mut out), 1);
        assert_eq!(out[0], (9001, own));
        assert_eq!(
            r.processes().len(),
            1,
            "the same slots as processes() shows"
        );
    }

    /// Any process of the container can write the header. Zeroing its slot count once made
    /// every sum zero (a 1 GiB container held 6.4 GiB): a process counts every slot it has
    /// known in use, and one opening the region counts every slot not free.
    #[test]
    fn a_zeroed_slot_count_hides_nothing() {
        let (d, r) = region();
        let a = r.claim().unwrap();
        let b = r.claim().unwrap();
        assert!(r.reserve(b, 0, 900, 1000));
        r.header().slots_used.store(0, Release);
        assert_eq!(r.used(0), 900);
        assert!(!r.reserve(a, 0, 200, 1000));
        let fresh = Region::open_or_create(&d.path().join("region"), &[U0, U1]).unwrap();
        assert_eq!(fresh.used(0), 900);
        // nor from the NVML process lists (Region::process_pids reads the same bound)
        let mut out = [(0, 0); MAX_PROCS];
        assert_eq!(r.process_pids(&mut out), 2);
        assert_eq!(fresh.process_pids(&mut out), 2);
    }

    #[test]
    fn no_slot_means_no_reservation() {
        let (_d, r) = region();
        let none = SlotId::NONE;
        assert!(!r.reserve(none, 0, 1, 1000));
        assert!(r.release(none, 0, 1));
        r.force_add(none, 0, 5);
        assert_eq!(r.set_hidden(none, 0, 5), 0);
        assert_eq!(
            (r.mine(none, 0), r.used(0), r.owns(none)),
            ((0, 0), 0, false)
        );
    }

    #[test]
    fn opening_a_region_leaks_no_descriptor() {
        let (d, r) = region();
        let fds = || std::fs::read_dir("/proc/self/fd").unwrap().count();
        let before = fds();
        for _ in 0..20 {
            drop(Region::open_or_create(&d.path().join("region"), &[U0, U1]).unwrap());
        }
        // Other tests' threads open files too: the 20 opens must not all have stayed.
        assert!(fds() < before + 20, "{before} → {}", fds());
        drop(r);
    }

    #[test]
    fn an_unclaimed_slot_is_free_for_the_next_process() {
        let (_d, r) = region();
        let me = r.claim().unwrap();
        assert!(r.reserve(me, 0, 10, 1000));
        r.unclaim(me);
        assert!(!r.owns(me));
        assert_eq!(r.used(0), 0);
        let next = r.claim().unwrap();
        assert_eq!(next.index, me.index);
        assert_ne!(next.generation, me.generation);
        r.unclaim(me); // a stale claim changes nothing
        assert!(r.owns(next));
    }

    #[test]
    fn start_time_is_read() {
        assert!(proc_start_time(std::process::id()).is_some());
        assert!(proc_start_time(u32::MAX - 1).is_none());
    }
}
