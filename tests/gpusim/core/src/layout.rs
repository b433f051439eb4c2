//! The shared state file's layout. This is a protocol between every process using the same
//! `GPUSIM_STATE`: `#[repr(C)]`, a magic number and a version. Change it and bump
//! [`VERSION`].
//!
//! ```text
//! offset 0                 Header        magic, version, sizes, config text, process-table lock
//! Header::SIZE             ProcSlot × MAX_PROCS   one per process that used libcuda
//! ...                      Gpu × num_gpus          per-GPU lock, memory (used, peak), XIDs, scheduler
//! file_size + slot         (beyond the mapping) one byte per slot, OFD-locked by its owner
//! ```
//!
//! Concurrency: fields that are `Atomic*` may be read or written without a lock; everything
//! inside `Gpu::sched` is read and written only under `Gpu::lock`; `ProcSlot` claiming and
//! releasing happen under `Header::procs_lock`. Lock order: `procs_lock` before any
//! `Gpu::lock`, and never two `Gpu::lock`s at once.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU64};

use crate::robust::RawRobustMutex;

/// "GPUSIMST" little-endian.
pub const MAGIC: u64 = u64::from_le_bytes(*b"GPUSIMST");
/// Layout version; bump on any change to the structs below.
/// Version 3: memory in use is the sum of the process slots (no separate total).
/// Version 4: a process slot records the pid namespace its pid belongs to.
pub const VERSION: u32 = 4;
pub const MAX_GPUS: usize = 8;
pub const MAX_PROCS: usize = 128;
/// Contexts per GPU (across all processes) that can hold queued work.
pub const MAX_QUEUES: usize = 48;
/// Largest launch queue a context can have (`launch_queue_depth` ≤ this).
pub const QUEUE_CAP: usize = 1024;
/// NVML sample periods remembered per GPU (128 × 1/6 s ≈ 21 s).
pub const PERIODS: usize = 128;
pub const XID_RING: usize = 64;
pub const CONFIG_MAX: usize = 32 * 1024;
pub const NONE: u32 = u32::MAX;

pub const SLOT_FREE: u32 = 0;
pub const SLOT_ACTIVE: u32 = 1;

#[repr(C)]
pub struct Header {
    /// [`MAGIC`], written last when the file is created.
    pub magic: AtomicU64,
    pub version: u32,
    pub num_gpus: u32,
    pub file_size: u64,
    pub config_fingerprint: u64,
    /// CLOCK_REALTIME − CLOCK_MONOTONIC in ns when the file was created: every process
    /// converts timeline instants to wall-clock timestamps with the same offset.
    pub realtime_offset_ns: AtomicI64,
    pub config_len: u32,
    pub _pad: u32,
    /// Monotonic ns of the last dead-process sweep.
    pub last_reap_ns: AtomicU64,
    /// XIDs injected on any GPU: the futex word NVML event-set waiters sleep on.
    pub xid_total: AtomicU32,
    pub _pad2: u32,
    pub procs_lock: RawRobustMutex,
    pub config_text: UnsafeCell<[u8; CONFIG_MAX]>,
}

/// One process that has initialised libcuda.
#[repr(C)]
pub struct ProcSlot {
    pub state: AtomicU32,
    pub pid: AtomicU32,
    /// Bumped at every claim, so a queue can tell a reused slot from its owner.
    pub generation: AtomicU32,
    /// The pid namespace `pid` is a number in (the inode of the owner's
    /// `/proc/self/ns/pid`, low 32 bits; 0 = unknown). A process in a container sees other
    /// containers' and the host's pids as meaningless or as someone else's, so it judges a
    /// slot of another namespace by its lock alone.
    pub pid_ns: AtomicU32,
    /// Process name (comm), NUL padded, 8 bytes per word.
    pub name: [AtomicU64; 8],
    /// Device memory held, bytes, per GPU (contexts, modules, allocations).
    pub mem: [AtomicU64; MAX_GPUS],
    /// Kernel time completed on each GPU, ns (ground truth).
    pub busy_ns: [AtomicU64; MAX_GPUS],
    /// Kernels completed on each GPU.
    pub kernels: [AtomicU64; MAX_GPUS],
    /// Contexts alive on each GPU.
    pub contexts: [AtomicU32; MAX_GPUS],
}

#[repr(C)]
pub struct XidRec {
    /// Sequence number of this record (1-based); 0 = empty.
    pub seq: AtomicU64,
    pub xid: AtomicU64,
    pub time_ns: AtomicU64,
}

#[repr(C)]
pub struct Gpu {
    pub lock: RawRobustMutex,
    /// Highest memory in use (the sum of the process slots' charges) since the file was
    /// created or `gpusim reset-peak`, recorded after reaping dead processes.
    pub mem_peak: AtomicU64,
    /// Number of XIDs injected; also the futex word event waiters sleep on.
    pub xid_count: AtomicU32,
    pub _pad: u32,
    pub xids: [XidRec; XID_RING],
    pub sched: UnsafeCell<Sched>,
}

/// One queued kernel (or graph launch) of a context.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Entry {
    /// Device time still to run, ns.
    pub remaining: u64,
    /// Monotonic ns at which it completed (valid once the queue head has passed it).
    pub done_at: u64,
    /// Kernels it stands for (1, or a graph's kernel count).
    pub kernels: u32,
    pub _pad: u32,
}

/// A context's launch queue on one GPU: entries with sequence numbers `head..tail` are
/// pending; `entries[seq % QUEUE_CAP]` holds entry `seq`.
#[repr(C)]
pub struct Queue {
    /// Owning process slot, or [`NONE`] when free.
    pub owner: u32,
    pub owner_pid: u32,
    pub owner_generation: u32,
    pub _pad: u32,
    pub head: u64,
    pub tail: u64,
    /// Sum of `remaining` over pending entries.
    pub pending: u64,
    pub entries: [Entry; QUEUE_CAP],
}

/// What one sample period saw.
#[repr(C)]
pub struct Period {
    /// Period index (monotonic ns / period length), or u64::MAX when unused.
    pub k: u64,
    /// ns in which a kernel ran.
    pub busy: u64,
    pub proc_busy: [u32; MAX_PROCS],
    pub proc_pid: [u32; MAX_PROCS],
}

/// The per-GPU timeline, read and written under `Gpu::lock` only.
#[repr(C)]
pub struct Sched {
    /// The timeline has been simulated up to this monotonic ns.
    pub sim_time: u64,
    /// Queue running now, or [`NONE`].
    pub cur: u32,
    pub _pad: u32,
    /// How long `cur` has run in its current time slice.
    pub slice_used: u64,
    /// All kernel time ever run, ns.
    pub busy_total: u64,
    pub periods: [Period; PERIODS],
    pub queues: [Queue; MAX_QUEUES],
}

pub const fn align_up(x: usize, a: usize) -> usize {
    x.div_ceil(a) * a
}

pub const HEADER_SIZE: usize = align_up(std::mem::size_of::<Header>(), 4096);
pub const SLOTS_SIZE: usize = align_up(std::mem::size_of::<ProcSlot>() * MAX_PROCS, 4096);
pub const GPU_SIZE: usize = align_up(std::mem::size_of::<Gpu>(), 4096);

/// Bytes the state file takes for `num_gpus` GPUs.
pub const fn file_size(num_gpus: usize) -> usize {
    HEADER_SIZE + SLOTS_SIZE + GPU_SIZE * num_gpus
}

pub const fn slot_offset(i: usize) -> usize {
    HEADER_SIZE + std::mem::size_of::<ProcSlot>() * i
}

pub const fn gpu_offset(g: usize) -> usize {
    HEADER_SIZE + SLOTS_SIZE + GPU_SIZE * g
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_stable_and_aligned() {
        assert_eq!(std::mem::size_of::<Entry>(), 24);
        assert_eq!(std::mem::align_of::<Gpu>(), 8);
        assert!(
            file_size(8) < 16 << 20,
            "state file stays small: {}",
            file_size(8)
        );
        assert_eq!(gpu_offset(0) % 4096, 0);
    }
}
