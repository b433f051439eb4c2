//! The shared state file: creation (safe when many processes race), mapping (an RAII owner
//! that unmaps in `Drop`), process slots with kernel-backed liveness, device memory
//! accounting, launch queues on the device timeline, NVML-style sampling and XID events.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release, SeqCst};
use std::sync::atomic::{AtomicU32, AtomicU64};

use crate::config::{Config, ConfigError};
use crate::layout::*;
use crate::robust::LockError;
use crate::sched::{Params, Sink};

/// Why the simulated driver cannot start or go on. Every message is one line that names the
/// file and says what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SimError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(
        "gpusim: state file {path}: cannot {op}: {err}; set GPUSIM_STATE to a writable file path"
    )]
    StateIo {
        path: String,
        op: &'static str,
        err: String,
    },
    #[error("gpusim: state file {path} is corrupt ({why}); delete it (rm {path}) and restart the processes that use it")]
    StateCorrupt { path: String, why: String },
    #[error("gpusim: state file {path} was written by a different gpusim (state layout version {found}; this gpusim uses version {VERSION}); delete it (rm {path}) and restart the processes that use it")]
    StateVersion { path: String, found: u32 },
    #[error("gpusim: state file {path} was created for other GPUs than GPUSIM_CONFIG={config} describes; delete it or set GPUSIM_STATE to another path")]
    ConfigMismatch { path: String, config: String },
    #[error("gpusim: state file {path}: {err}")]
    Lock { path: String, err: LockError },
    #[error("gpusim: state file {path}: all {MAX_PROCS} process slots are held by live processes")]
    NoProcessSlot { path: String },
}

/// Monotonic clock in ns (vDSO, no system call).
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: ts is a valid out-pointer; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn realtime_ns() -> i64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: as above.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) };
    ts.tv_sec * 1_000_000_000 + ts.tv_nsec
}

/// Sleep until monotonic time `t` (ns). Returns at once if `t` has passed.
///
/// Waiting for the simulated GPU should wake about as promptly as a real `cuStreamSynchronize`
/// (a few µs: the driver spins by default), not after Linux's 50 µs default timer slack plus
/// the wake-up latency. So the calling thread sleeps with 1 ns slack (restored after) until
/// 50 µs before `t`, then yields the CPU in a loop until `t`.
pub fn sleep_until(t: u64) {
    const SPIN_NS: u64 = 50_000;
    let now = now_ns();
    if t <= now {
        return;
    }
    if t - now > SPIN_NS {
        sleep_until_slack(t - SPIN_NS);
    }
    while now_ns() < t {
        std::thread::yield_now();
    }
}

fn sleep_until_slack(t: u64) {
    // SAFETY: PR_GET_TIMERSLACK / PR_SET_TIMERSLACK only read or set this thread's slack.
    let slack = unsafe { libc::prctl(libc::PR_GET_TIMERSLACK, 0, 0, 0, 0) };
    // SAFETY: as above.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1, 0, 0, 0) };
    sleep_until_inner(t);
    if slack > 0 {
        // SAFETY: as above; restores the slack read before.
        unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, slack as libc::c_ulong, 0, 0, 0) };
    }
}

fn sleep_until_inner(t: u64) {
    let ts = libc::timespec {
        tv_sec: (t / 1_000_000_000) as libc::time_t,
        tv_nsec: (t % 1_000_000_000) as libc::c_long,
    };
    loop {
        // SAFETY: ts is a valid timespec; the remaining-time pointer may be NULL with TIMER_ABSTIME.
        let rc = unsafe {
            libc::clock_nanosleep(
                libc::CLOCK_MONOTONIC,
                libc::TIMER_ABSTIME,
                &ts,
                std::ptr::null_mut(),
            )
        };
        if rc != libc::EINTR {
            return;
        }
    }
}

/// The state file path: `GPUSIM_STATE`, or `/tmp/gpusim-<uid>.state`.
pub fn default_state_path() -> PathBuf {
    if let Some(p) = std::env::var_os("GPUSIM_STATE").filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    // SAFETY: getuid cannot fail.
    let uid = unsafe { libc::getuid() };
    PathBuf::from(format!("/tmp/gpusim-{uid}.state"))
}

/// A process's claim on a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcHandle {
    pub slot: u32,
    pub generation: u32,
    pub pid: u32,
}

/// One process as `gpusim status` and NVML see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcInfo {
    pub slot: u32,
    pub pid: u32,
    pub name: String,
    pub memory: u64,
    pub busy_ns: u64,
    pub kernels: u64,
    pub contexts: u32,
}

/// One per-process utilization sample, as `nvmlDeviceGetProcessUtilization` returns it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcSample {
    pub pid: u32,
    /// Wall-clock µs at the end of the sample period.
    pub timestamp_us: u64,
    pub sm_util: u32,
    pub mem_util: u32,
}

/// A GPU's figures at one instant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuView {
    pub index: usize,
    pub memory_total: u64,
    pub memory_reserved: u64,
    pub memory_used: u64,
    /// Highest `memory_used` since the state was created or the peak was last reset.
    pub memory_peak: u64,
    /// Utilization of the last complete sample period, percent.
    pub sm_util: u32,
    pub mem_util: u32,
    /// Kernel time ever run on this GPU, ns (ground truth).
    pub busy_ns: u64,
    /// The instant these figures describe (monotonic ns).
    pub time_ns: u64,
    pub processes: Vec<ProcInfo>,
}

/// Memory utilization as a fixed fraction of SM utilization (gpusim does not model memory
/// traffic): 40 %.
pub fn mem_util_of(sm_util: u32) -> u32 {
    (sm_util * 4 + 5) / 10
}

/// The mapped state file. Unmaps and closes in `Drop`.
pub struct State {
    fd: OwnedFd,
    base: *mut u8,
    len: usize,
    path: PathBuf,
    pub config: Config,
    params: Params,
}

// SAFETY: the mapping is shared memory accessed only through atomics or under the robust
// mutexes it contains; `base` is never reassigned after construction.
unsafe impl Send for State {}
// SAFETY: as above.
unsafe impl Sync for State {}

impl Drop for State {
    fn drop(&mut self) {
        // SAFETY: base/len are exactly what mmap returned; nothing borrows from the mapping
        // past the State's lifetime (all accessors borrow &self).
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

struct FlockGuard<'a>(&'a OwnedFd);
impl Drop for FlockGuard<'_> {
    fn drop(&mut self) {
        // SAFETY: the fd is open for the guard's lifetime.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

/// Guard over one GPU's scheduler, holding its lock.
pub struct SchedGuard<'a> {
    gpu: &'a Gpu,
}

impl std::ops::Deref for SchedGuard<'_> {
    type Target = Sched;
    fn deref(&self) -> &Sched {
        // SAFETY: the guard holds gpu.lock, which owns every access to `sched`.
        unsafe { &*self.gpu.sched.get() }
    }
}
impl std::ops::DerefMut for SchedGuard<'_> {
    fn deref_mut(&mut self) -> &mut Sched {
        // SAFETY: as above; &mut self makes this the only reference through the guard.
        unsafe { &mut *self.gpu.sched.get() }
    }
}
impl Drop for SchedGuard<'_> {
    fn drop(&mut self) {
        self.gpu.lock.unlock();
    }
}

struct SlotSink<'a> {
    slots: &'a [ProcSlot],
    g: usize,
}
impl Sink for SlotSink<'_> {
    fn busy(&mut self, slot: u32, ns: u64) {
        if let Some(s) = self.slots.get(slot as usize) {
            s.busy_ns[self.g].fetch_add(ns, Relaxed);
        }
    }
    fn completed(&mut self, slot: u32, kernels: u32) {
        if let Some(s) = self.slots.get(slot as usize) {
            s.kernels[self.g].fetch_add(u64::from(kernels), Relaxed);
        }
    }
}

fn io_err(path: &Path, op: &'static str, err: std::io::Error) -> SimError {
    SimError::StateIo {
        path: path.display().to_string(),
        op,
        err: err.to_string(),
    }
}

impl State {
    /// Open (or create) the state file named by `GPUSIM_STATE` for the GPUs `GPUSIM_CONFIG`
    /// describes. With `GPUSIM_CONFIG` unset, an existing state file's GPUs are used, and a
    /// new one gets the built-in default.
    pub fn open_from_env() -> Result<State, SimError> {
        let config = match std::env::var_os("GPUSIM_CONFIG").filter(|p| !p.is_empty()) {
            Some(p) => Some((Config::load(Path::new(&p))?, PathBuf::from(p))),
            None => None,
        };
        State::open(&default_state_path(), config)
    }

    /// Open or create `path`. `config` is the GPU description the caller wants (and where it
    /// came from); `None` accepts whatever the file holds.
    pub fn open(path: &Path, config: Option<(Config, PathBuf)>) -> Result<State, SimError> {
        let cpath = CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| {
            io_err(
                path,
                "open it",
                std::io::Error::from(std::io::ErrorKind::InvalidInput),
            )
        })?;
        // SAFETY: cpath is NUL-terminated; open has no other preconditions.
        let fd = unsafe {
            libc::open(
                cpath.as_ptr(),
                libc::O_RDWR | libc::O_CREAT | libc::O_CLOEXEC,
                0o666 as libc::c_uint,
            )
        };
        if fd < 0 {
            return Err(io_err(path, "open it", std::io::Error::last_os_error()));
        }
        // SAFETY: fd is a freshly opened descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // Creation is serialised by flock on the file itself; readers of an existing file
        // take it too, so nobody sees a half-written header.
        // SAFETY: fd is open.
        if unsafe { libc::flock(fd.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(io_err(path, "lock it", std::io::Error::last_os_error()));
        }
        let (base, len, config) = {
            let _flock = FlockGuard(&fd);
            State::setup(&fd, path, config)?
        };
        let params = params_of(&config);
        Ok(State {
            fd,
            base,
            len,
            path: path.to_path_buf(),
            params,
            config,
        })
    }

    /// Map the file, creating its contents if nobody has; the caller holds the flock.
    fn setup(
        fd: &OwnedFd,
        path: &Path,
        config: Option<(Config, PathBuf)>,
    ) -> Result<(*mut u8, usize, Config), SimError> {
        let size = fstat_size(fd).map_err(|e| io_err(path, "stat it", e))?;
        if size > 0 && size < HEADER_SIZE as u64 {
            return Err(SimError::StateCorrupt {
                path: path.display().to_string(),
                why: format!("{size} bytes, shorter than its {HEADER_SIZE}-byte header"),
            });
        }
        // A zero magic means the creator died before finishing: create it again.
        let existing = size > 0 && {
            let head = Mapping::new(fd, HEADER_SIZE).map_err(|e| io_err(path, "map it", e))?;
            // SAFETY: the mapping is HEADER_SIZE bytes, at least size_of::<Header>().
            let magic = unsafe { &*(head.ptr as *const Header) }.magic.load(Acquire);
            magic != 0
        };
        if !existing {
            let (config, _) = config.unwrap_or_else(|| {
                (
                    Config::default_config(),
                    PathBuf::from("<built-in default>"),
                )
            });
            return State::create(fd, path, config);
        }
        State::attach(fd, path, size, config)
    }

    fn create(
        fd: &OwnedFd,
        path: &Path,
        config: Config,
    ) -> Result<(*mut u8, usize, Config), SimError> {
        let n = config.gpu.len();
        let len = file_size(n);
        let text = config.to_toml();
        if text.len() > CONFIG_MAX {
            return Err(SimError::Config(ConfigError::Invalid {
                path: "GPUSIM_CONFIG".into(),
                line: 1,
                msg: format!(
                    "the config is {} bytes written out; gpusim stores at most {CONFIG_MAX}",
                    text.len()
                ),
            }));
        }
        // Start from zeros even if a creator died half-way before us.
        for size in [0, len] {
            // SAFETY: fd is open for writing; ftruncate has no memory-safety preconditions.
            if unsafe { libc::ftruncate(fd.as_raw_fd(), size as libc::off_t) } != 0 {
                return Err(io_err(path, "size it", std::io::Error::last_os_error()));
            }
        }
        let map = Mapping::new(fd, len).map_err(|e| io_err(path, "map it", e))?;
        let now = now_ns();
        {
            // SAFETY: we hold the creation flock and the magic is 0, so no other process
            // touches the file; the header fits in the mapping.
            let h = unsafe { &mut *(map.ptr as *mut Header) };
            h.version = VERSION;
            h.num_gpus = n as u32;
            h.file_size = len as u64;
            h.config_fingerprint = config.fingerprint();
            h.realtime_offset_ns
                .store(realtime_ns() - now as i64, Relaxed);
            h.config_len = text.len() as u32;
            h.config_text.get_mut()[..text.len()].copy_from_slice(text.as_bytes());
            // SAFETY: exclusive access as above.
            unsafe { h.procs_lock.init() };
        }
        for g in 0..n {
            // SAFETY: gpu_offset(g) + size_of::<Gpu>() ≤ len; exclusive access during creation.
            let gpu = unsafe { &*(map.ptr.add(gpu_offset(g)) as *const Gpu) };
            // SAFETY: exclusive access during creation.
            unsafe { gpu.lock.init() };
            // SAFETY: exclusive access during creation; no guard exists yet.
            unsafe { &mut *gpu.sched.get() }.reset(now);
        }
        // SAFETY: the header is initialised; publishing the magic makes the file usable.
        unsafe { &*(map.ptr as *const Header) }
            .magic
            .store(MAGIC, Release);
        Ok((map.take(), len, config))
    }

    fn attach(
        fd: &OwnedFd,
        path: &Path,
        size: u64,
        want: Option<(Config, PathBuf)>,
    ) -> Result<(*mut u8, usize, Config), SimError> {
        let corrupt = |why: String| SimError::StateCorrupt {
            path: path.display().to_string(),
            why,
        };
        let head = Mapping::new(fd, HEADER_SIZE).map_err(|e| io_err(path, "map it", e))?;
        // SAFETY: the mapping holds a whole Header.
        let h = unsafe { &*(head.ptr as *const Header) };
        let magic = h.magic.load(Acquire);
        if magic != MAGIC {
            return Err(corrupt(format!(
                "bad magic number {magic:#018x}, expected {MAGIC:#018x}"
            )));
        }
        if h.version != VERSION {
            return Err(SimError::StateVersion {
                path: path.display().to_string(),
                found: h.version,
            });
        }
        let n = h.num_gpus as usize;
        if n == 0 || n > MAX_GPUS || h.file_size != file_size(n) as u64 || size != h.file_size {
            return Err(corrupt(format!(
                "{n} GPUs, recorded size {} and actual size {size} do not match",
                h.file_size
            )));
        }
        let clen = h.config_len as usize;
        if clen > CONFIG_MAX {
            return Err(corrupt(format!(
                "config length {clen} exceeds {CONFIG_MAX}"
            )));
        }
        // SAFETY: config_text is plain bytes inside the mapping, written once at creation.
        let text = unsafe { &(&*h.config_text.get())[..clen] };
        let text =
            std::str::from_utf8(text).map_err(|_| corrupt("stored config is not UTF-8".into()))?;
        let stored = Config::parse(text, "(stored in the state file)")
            .map_err(|e| corrupt(e.to_string()))?;
        if stored.gpu.len() != n || stored.fingerprint() != h.config_fingerprint {
            return Err(corrupt(
                "stored config does not match its fingerprint".into(),
            ));
        }
        if let Some((want, from)) = want {
            if want.fingerprint() != stored.fingerprint() {
                return Err(SimError::ConfigMismatch {
                    path: path.display().to_string(),
                    config: from.display().to_string(),
                });
            }
        }
        drop(head);
        let len = file_size(n);
        let map = Mapping::new(fd, len).map_err(|e| io_err(path, "map it", e))?;
        Ok((map.take(), len, stored))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn num_gpus(&self) -> usize {
        self.config.gpu.len()
    }

    fn header(&self) -> &Header {
        // SAFETY: the mapping starts with a Header and lives as long as self.
        unsafe { &*(self.base as *const Header) }
    }

    /// All process slots.
    pub fn slots(&self) -> &[ProcSlot] {
        // SAFETY: MAX_PROCS slots follow the header inside the mapping (see layout).
        unsafe {
            std::slice::from_raw_parts(self.base.add(slot_offset(0)) as *const ProcSlot, MAX_PROCS)
        }
    }

    /// GPU `g`'s shared block. Panics if `g` is out of range (callers validate ordinals).
    pub fn gpu(&self, g: usize) -> &Gpu {
        assert!(g < self.num_gpus());
        // SAFETY: gpu_offset(g) + size_of::<Gpu>() ≤ len for g < num_gpus.
        unsafe { &*(self.base.add(gpu_offset(g)) as *const Gpu) }
    }

    pub fn params(&self) -> Params {
        self.params
    }

    fn lock_err(&self, err: LockError) -> SimError {
        SimError::Lock {
            path: self.path.display().to_string(),
            err,
        }
    }

    /// Lock GPU `g`'s scheduler and bring its timeline up to now.
    pub fn sched(&self, g: usize) -> Result<SchedGuard<'_>, SimError> {
        let gpu = self.gpu(g);
        gpu.lock.lock().map_err(|e| self.lock_err(e))?;
        let mut guard = SchedGuard { gpu };
        let mut sink = SlotSink {
            slots: self.slots(),
            g,
        };
        guard.advance(now_ns(), &self.params, &mut sink);
        Ok(guard)
    }

    /// Wall-clock µs of monotonic instant `t`.
    pub fn wall_us(&self, t: u64) -> u64 {
        ((t as i64 + self.header().realtime_offset_ns.load(Relaxed)) / 1000) as u64
    }

    // ---- processes ----------------------------------------------------------------------

    fn liveness_lock(
        &self,
        slot: u32,
        cmd: libc::c_int,
        ltype: libc::c_int,
    ) -> std::io::Result<libc::c_int> {
        let mut fl: libc::flock = {
            // SAFETY: flock is plain data; all-zero is valid (and l_pid must be 0 for OFD locks).
            unsafe { std::mem::zeroed() }
        };
        fl.l_type = ltype as libc::c_short;
        fl.l_whence = libc::SEEK_SET as libc::c_short;
        fl.l_start = (self.len + slot as usize) as libc::off_t;
        fl.l_len = 1;
        // SAFETY: fd is open; fl is a valid flock.
        if unsafe { libc::fcntl(self.fd.as_raw_fd(), cmd, &mut fl) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(libc::c_int::from(fl.l_type))
    }

    /// Whether the process holding slot `i` still runs: its open-file-description lock on
    /// the slot's byte is held (the kernel drops it when the process dies, even by SIGKILL)
    /// and, where its pid means something here (the same pid namespace), that pid is alive
    /// and not a zombie (a forked child can keep the lock alive). A slot of another pid
    /// namespace (a process in another container, or on the host as seen from a container)
    /// is judged by the lock alone: its pid may be unused here, or another process's.
    fn slot_alive(&self, i: u32, own_ns: u32) -> bool {
        let s = &self.slots()[i as usize];
        let pid = s.pid.load(Relaxed);
        let ns = s.pid_ns.load(Relaxed);
        // Our own open file description never conflicts with itself, so know our own slot
        // by our identity (a host pid, in a container: crate::hostpid).
        let (me, me_ns) = crate::hostpid::known_identity();
        if pid == me && (ns == 0 || ns == me_ns) {
            return true;
        }
        match self.liveness_lock(i, libc::F_OFD_GETLK, libc::F_WRLCK) {
            Ok(t) if t == libc::F_UNLCK => return false,
            Ok(_) => {}
            Err(_) => return true,
        }
        // A pid means something here only in our own pid namespace.
        let here = ns == 0 || ns == own_ns;
        !here || pid_alive(pid)
    }

    /// Claim a process slot for the calling process.
    pub fn register_process(&self) -> Result<ProcHandle, SimError> {
        self.reap_dead();
        // The driver's name for this process: its host pid (crate::hostpid). Asked before
        // the process table's lock is taken: it may wait on a socket.
        let (pid, pid_ns) = crate::hostpid::identity();
        let h = self.header();
        h.procs_lock.lock().map_err(|e| self.lock_err(e))?;
        let res = self.claim_slot(pid, pid_ns);
        h.procs_lock.unlock();
        res
    }

    fn claim_slot(&self, pid: u32, pid_ns: u32) -> Result<ProcHandle, SimError> {
        let name = std::fs::read_to_string("/proc/self/comm").unwrap_or_default();
        for (i, s) in self.slots().iter().enumerate() {
            if s.state.load(Acquire) != SLOT_FREE {
                continue;
            }
            // A dead owner's forked child may still hold the byte; then take another slot.
            if self
                .liveness_lock(i as u32, libc::F_OFD_SETLK, libc::F_WRLCK)
                .is_err()
            {
                continue;
            }
            let generation = s.generation.load(Relaxed).wrapping_add(1);
            s.generation.store(generation, Relaxed);
            s.pid.store(pid, Relaxed);
            s.pid_ns.store(pid_ns, Relaxed);
            store_name(&s.name, name.trim_end());
            for g in 0..MAX_GPUS {
                s.mem[g].store(0, Relaxed);
                s.busy_ns[g].store(0, Relaxed);
                s.kernels[g].store(0, Relaxed);
                s.contexts[g].store(0, Relaxed);
            }
            s.state.store(SLOT_ACTIVE, Release);
            return Ok(ProcHandle {
                slot: i as u32,
                generation,
                pid,
            });
        }
        Err(SimError::NoProcessSlot {
            path: self.path.display().to_string(),
        })
    }

    /// Release everything the calling process holds (normal exit), without waiting longer
    /// than `timeout_ms` for a lock.
    pub fn unregister_process(&self, p: ProcHandle) {
        let h = self.header();
        if h.procs_lock.lock().is_err() {
            return;
        }
        let s = &self.slots()[p.slot as usize];
        if s.state.load(Acquire) == SLOT_ACTIVE && s.generation.load(Relaxed) == p.generation {
            self.release_slot(p.slot);
            let _ = self.liveness_lock(p.slot, libc::F_OFD_SETLK, libc::F_UNLCK);
        }
        h.procs_lock.unlock();
    }

    /// Free a slot: discard its queued work, give its memory back. Caller holds procs_lock.
    fn release_slot(&self, i: u32) {
        let s = &self.slots()[i as usize];
        for g in 0..self.num_gpus() {
            if let Ok(mut sched) = self.sched(g) {
                for qi in 0..MAX_QUEUES {
                    if sched.queues[qi].owner == i {
                        sched.release_queue(qi);
                    }
                }
            }
            s.mem[g].store(0, SeqCst);
            s.contexts[g].store(0, Relaxed);
        }
        s.state.store(SLOT_FREE, Release);
    }

    /// Reclaim every slot whose process has died. Returns how many were freed.
    pub fn reap_dead(&self) -> usize {
        self.header().last_reap_ns.store(now_ns(), Relaxed);
        let h = self.header();
        if h.procs_lock.lock().is_err() {
            return 0;
        }
        let mut freed = 0;
        let own_ns = crate::hostpid::own_pid_ns();
        for i in 0..MAX_PROCS as u32 {
            if self.slots()[i as usize].state.load(Acquire) == SLOT_ACTIVE
                && !self.slot_alive(i, own_ns)
            {
                self.release_slot(i);
                freed += 1;
            }
        }
        h.procs_lock.unlock();
        freed
    }

    /// Reap at most every 10 ms; cheap to call on busy paths.
    pub fn maybe_reap(&self) {
        let last = self.header().last_reap_ns.load(Relaxed);
        if now_ns().saturating_sub(last) > 10_000_000 {
            self.reap_dead();
        }
    }

    /// Processes holding a slot, with their figures on GPU `g`.
    pub fn processes(&self, g: usize) -> Vec<ProcInfo> {
        let mut v = Vec::new();
        for (i, s) in self.slots().iter().enumerate() {
            if s.state.load(Acquire) != SLOT_ACTIVE {
                continue;
            }
            v.push(ProcInfo {
                slot: i as u32,
                pid: s.pid.load(Relaxed),
                name: load_name(&s.name),
                memory: s.mem[g].load(Relaxed),
                busy_ns: s.busy_ns[g].load(Relaxed),
                kernels: s.kernels[g].load(Relaxed),
                contexts: s.contexts[g].load(Relaxed),
            });
        }
        v
    }

    // ---- memory -------------------------------------------------------------------------

    /// Memory available to processes on GPU `g` (physical minus driver-reserved).
    pub fn usable_memory(&self, g: usize) -> u64 {
        let c = &self.config.gpu[g];
        c.memory_bytes() - c.reserved_bytes()
    }

    /// Charge `bytes` of device memory on GPU `g` to process `p`; false if the GPU is full.
    pub fn charge(&self, g: usize, p: &ProcHandle, bytes: u64) -> bool {
        if self.try_charge(g, p, bytes) {
            return true;
        }
        // Full: memory held by processes that died may be what is missing, reaped by this
        // call or by a concurrent one (which is why the count reaped here does not matter).
        self.reap_dead();
        self.try_charge(g, p, bytes)
    }

    /// Memory is counted only in the process slots, never in a separate total: a process
    /// killed between two updates would leave such a total wrong for good (a SIGKILL storm
    /// leaked hundreds of MiB into it). A charge announces the bytes in its own slot, then
    /// sums every slot and withdraws if the GPU is over capacity (two charges racing for the
    /// last bytes may both withdraw: a rare, spurious "full", never an overcommit).
    fn try_charge(&self, g: usize, p: &ProcHandle, bytes: u64) -> bool {
        let cap = self.usable_memory(g);
        let mine = &self.slots()[p.slot as usize].mem[g];
        mine.fetch_add(bytes, SeqCst);
        let used = self.sum_mem(g, SeqCst);
        if used > cap {
            mine.fetch_sub(bytes, SeqCst);
            return false;
        }
        // The real driver frees a process's memory the moment it dies; gpusim notices deaths
        // lazily. So a new high-water mark is recorded only after reaping the dead, as what
        // is in use then: the peak never counts a dead process's memory with a live one's,
        // however many charges race (each that would raise it reaps first).
        let gpu = self.gpu(g);
        if used > gpu.mem_peak.load(Relaxed) {
            self.reap_dead();
            gpu.mem_peak.fetch_max(self.sum_mem(g, SeqCst), Relaxed);
        }
        true
    }

    /// Give back `bytes` charged earlier.
    pub fn uncharge(&self, g: usize, p: &ProcHandle, bytes: u64) {
        let s = &self.slots()[p.slot as usize];
        if s.state.load(Acquire) != SLOT_ACTIVE || s.generation.load(Relaxed) != p.generation {
            return; // reaped meanwhile: already given back
        }
        s.mem[g].fetch_sub(bytes, SeqCst);
    }

    /// Memory in use on GPU `g`: every process slot's charges (a free slot's are zero).
    fn sum_mem(&self, g: usize, order: std::sync::atomic::Ordering) -> u64 {
        self.slots()
            .iter()
            .fold(0u64, |acc, s| acc.saturating_add(s.mem[g].load(order)))
    }

    pub fn memory_used(&self, g: usize) -> u64 {
        self.sum_mem(g, Relaxed)
    }

    /// The most memory GPU `g` has had in use at once since the state was created or
    /// [`State::reset_peak`].
    pub fn memory_peak(&self, g: usize) -> u64 {
        self.gpu(g).mem_peak.load(Relaxed)
    }

    /// Start measuring GPU `g`'s peak afresh: set it to the memory in use now. A charge
    /// racing with the reset is not lost: the peak ends at least at the use when this returns.
    pub fn reset_peak(&self, g: usize) {
        let gpu = self.gpu(g);
        gpu.mem_peak.store(self.memory_used(g), Relaxed);
        gpu.mem_peak.fetch_max(self.memory_used(g), Relaxed);
    }

    pub fn add_context(&self, g: usize, p: &ProcHandle, delta: i32) {
        let c = &self.slots()[p.slot as usize].contexts[g];
        if delta >= 0 {
            c.fetch_add(delta as u32, Relaxed);
        } else {
            let _ = c.fetch_update(Relaxed, Relaxed, |v| {
                Some(v.saturating_sub(delta.unsigned_abs()))
            });
        }
    }

    // ---- launch queues ------------------------------------------------------------------

    /// A launch queue on GPU `g` for a new context of `p`; `None` when every queue of the
    /// GPU is taken.
    pub fn create_queue(&self, g: usize, p: &ProcHandle) -> Result<Option<usize>, SimError> {
        self.maybe_reap();
        let mut s = self.sched(g)?;
        Ok(s.claim_queue(p.slot, p.pid, p.generation))
    }

    /// Drop queue `qi` of GPU `g` and its pending work, if `p` still owns it.
    pub fn destroy_queue(&self, g: usize, qi: usize, p: &ProcHandle) -> Result<(), SimError> {
        let mut s = self.sched(g)?;
        if owns(&s, qi, p) {
            s.release_queue(qi);
        }
        Ok(())
    }

    /// Queue `duration_ns` of work (standing for `kernels` kernels); blocks while the
    /// context already has `launch_queue_depth` entries pending. Returns the entry's
    /// sequence number.
    pub fn launch(
        &self,
        g: usize,
        qi: usize,
        duration_ns: u64,
        kernels: u32,
    ) -> Result<u64, SimError> {
        self.launch_harvest(g, qi, duration_ns, kernels, &mut |_, _| {})
    }

    /// [`State::launch`], first handing `harvest(seq, done_at)` the completed entry whose
    /// record the new one overwrites (the ring keeps the last `QUEUE_CAP` entries), so the
    /// caller can keep completion times it still needs (recorded events).
    pub fn launch_harvest(
        &self,
        g: usize,
        qi: usize,
        duration_ns: u64,
        kernels: u32,
        harvest: &mut dyn FnMut(u64, u64),
    ) -> Result<u64, SimError> {
        self.maybe_reap();
        let depth = u64::from(self.config.launch_queue_depth);
        loop {
            let mut s = self.sched(g)?;
            let q = &s.queues[qi];
            if q.tail - q.head < depth {
                if let Some(old) = q.tail.checked_sub(QUEUE_CAP as u64) {
                    harvest(old, q.entries[(old % QUEUE_CAP as u64) as usize].done_at);
                }
                return Ok(s.push(qi, duration_ns, kernels));
            }
            let oldest = q.tail - depth;
            let until = s.predict(qi, oldest, &self.params);
            drop(s);
            if let Some(t) = until {
                sleep_until(t.max(now_ns() + 1_000));
            }
        }
    }

    /// Whether entry `seq` of queue `qi` has completed.
    pub fn is_done(&self, g: usize, qi: usize, seq: u64) -> Result<bool, SimError> {
        let s = self.sched(g)?;
        Ok(seq < s.queues[qi].head)
    }

    /// Block until entry `seq` of queue `qi` completes.
    pub fn wait(&self, g: usize, qi: usize, seq: u64) -> Result<(), SimError> {
        loop {
            let until = {
                let s = self.sched(g)?;
                match s.predict(qi, seq, &self.params) {
                    None => return Ok(()),
                    Some(t) => t,
                }
            };
            self.maybe_reap();
            sleep_until(until.max(now_ns() + 1_000));
        }
    }

    /// When entry `seq` of queue `qi` completed, if it has and its record is still kept.
    pub fn done_at(&self, g: usize, qi: usize, seq: u64) -> Result<Option<u64>, SimError> {
        let s = self.sched(g)?;
        let q = &s.queues[qi];
        if seq >= q.head || q.tail - seq > QUEUE_CAP as u64 {
            return Ok(None);
        }
        Ok(Some(q.entries[(seq % QUEUE_CAP as u64) as usize].done_at))
    }

    // ---- NVML-style views ---------------------------------------------------------------

    /// The GPU's figures now: memory, last-period utilization, processes.
    pub fn view(&self, g: usize) -> Result<GpuView, SimError> {
        self.reap_dead();
        let (sm, busy, time) = {
            let s = self.sched(g)?;
            let p = self.params.period_ns;
            let k = s.sim_time / p;
            let busy = s.period_busy(k.saturating_sub(1));
            (pct(busy, p), s.busy_total, s.sim_time)
        };
        let c = &self.config.gpu[g];
        Ok(GpuView {
            index: g,
            memory_total: c.memory_bytes(),
            memory_reserved: c.reserved_bytes(),
            memory_used: self.memory_used(g),
            memory_peak: self.memory_peak(g),
            sm_util: sm,
            mem_util: mem_util_of(sm),
            busy_ns: busy,
            time_ns: time,
            processes: self.processes(g),
        })
    }

    /// Per-process samples of complete periods newer than wall-clock `last_seen_us` (0 = all
    /// kept), newest first: one per process per period in which it ran.
    pub fn process_samples(
        &self,
        g: usize,
        last_seen_us: u64,
    ) -> Result<Vec<ProcSample>, SimError> {
        let s = self.sched(g)?;
        let p = self.params.period_ns;
        let newest = (s.sim_time / p).saturating_sub(1);
        let mut out = Vec::new();
        for back in 0..PERIODS as u64 {
            let Some(k) = newest.checked_sub(back) else {
                break;
            };
            let ts = self.wall_us((k + 1) * p);
            if ts <= last_seen_us {
                break;
            }
            let Some(pr) = s.period(k) else { continue };
            for i in 0..MAX_PROCS {
                if pr.proc_busy[i] > 0 {
                    let sm = pct(u64::from(pr.proc_busy[i]), p).max(1);
                    out.push(ProcSample {
                        pid: pr.proc_pid[i],
                        timestamp_us: ts,
                        sm_util: sm,
                        mem_util: mem_util_of(sm),
                    });
                }
            }
        }
        Ok(out)
    }

    /// Device utilization samples (wall µs, percent) of complete periods newer than
    /// `last_seen_us`, oldest first.
    pub fn device_samples(&self, g: usize, last_seen_us: u64) -> Result<Vec<(u64, u32)>, SimError> {
        let s = self.sched(g)?;
        let p = self.params.period_ns;
        let newest = (s.sim_time / p).saturating_sub(1);
        let mut out = Vec::new();
        for back in (0..PERIODS as u64).rev() {
            let Some(k) = newest.checked_sub(back) else {
                continue;
            };
            let ts = self.wall_us((k + 1) * p);
            if ts > last_seen_us {
                out.push((ts, pct(s.period_busy(k), p)));
            }
        }
        Ok(out)
    }

    // ---- XID events ---------------------------------------------------------------------

    /// Record XID `xid` on GPU `g` and wake event waiters.
    pub fn inject_xid(&self, g: usize, xid: u64) {
        let gpu = self.gpu(g);
        let _guard = self.sched(g);
        let n = gpu.xid_count.load(Relaxed) + 1;
        let rec = &gpu.xids[(n as usize - 1) % XID_RING];
        rec.xid.store(xid, Relaxed);
        rec.time_ns.store(now_ns(), Relaxed);
        rec.seq.store(u64::from(n), Release);
        gpu.xid_count.store(n, Release);
        let total = &self.header().xid_total;
        total.fetch_add(1, Release);
        futex_wake(total);
    }

    /// XIDs injected on GPU `g` so far.
    pub fn xid_count(&self, g: usize) -> u32 {
        self.gpu(g).xid_count.load(Acquire)
    }

    /// The XID with sequence number `n` (1-based) on GPU `g`, if still kept.
    pub fn xid(&self, g: usize, n: u32) -> Option<u64> {
        let rec = &self.gpu(g).xids[(n as usize).checked_sub(1)? % XID_RING];
        (rec.seq.load(Acquire) == u64::from(n)).then(|| rec.xid.load(Relaxed))
    }

    /// The counter of all XIDs, to pass to [`State::wait_xid_change`].
    pub fn xid_total(&self) -> u32 {
        self.header().xid_total.load(Acquire)
    }

    /// Sleep until an XID is injected on any GPU (the total moves off `seen`) or until
    /// `timeout_ms` passes.
    pub fn wait_xid_change(&self, seen: u32, timeout_ms: u32) {
        let ts = libc::timespec {
            tv_sec: (timeout_ms / 1000) as libc::time_t,
            tv_nsec: ((timeout_ms % 1000) * 1_000_000) as libc::c_long,
        };
        // SAFETY: the futex word lives in the shared mapping for as long as self; a relative
        // timeout is passed; FUTEX_WAIT returns at once if the word is not `seen`.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                self.header().xid_total.as_ptr(),
                libc::FUTEX_WAIT,
                seen,
                &ts as *const libc::timespec,
                0usize,
                0u32,
            );
        }
    }
}

fn owns(s: &Sched, qi: usize, p: &ProcHandle) -> bool {
    let q = &s.queues[qi];
    q.owner == p.slot && q.owner_generation == p.generation
}

fn pct(busy: u64, period: u64) -> u32 {
    (((busy * 100) + period / 2) / period).min(100) as u32
}

fn params_of(c: &Config) -> Params {
    Params {
        timeslice_ns: c.timeslice_us * 1000,
        period_ns: c.sample_period_us * 1000,
    }
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: word is a valid aligned u32 in the shared mapping; FUTEX_WAKE has no other
    // preconditions.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            0usize,
            0usize,
            0u32,
        );
    }
}

fn pid_alive(pid: u32) -> bool {
    // SAFETY: kill with signal 0 only checks for existence.
    if unsafe { libc::kill(pid as libc::pid_t, 0) } != 0
        && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
    {
        return false;
    }
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            // state is the field after the parenthesised comm
            let state = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.trim_start().chars().next());
            !matches!(state, Some('Z') | Some('X'))
        }
        Err(_) => false,
    }
}

fn store_name(words: &[AtomicU64; 8], name: &str) {
    let mut buf = [0u8; 64];
    let n = name.len().min(63);
    buf[..n].copy_from_slice(&name.as_bytes()[..n]);
    for (i, w) in words.iter().enumerate() {
        w.store(
            u64::from_le_bytes(buf[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8])),
            Relaxed,
        );
    }
}

fn load_name(words: &[AtomicU64; 8]) -> String {
    let mut buf = Vec::with_capacity(64);
    for w in words {
        buf.extend_from_slice(&w.load(Relaxed).to_le_bytes());
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

fn fstat_size(fd: &OwnedFd) -> std::io::Result<u64> {
    // SAFETY: stat is plain data; fstat fills it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fd is open, st is a valid out-pointer.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(st.st_size as u64)
}

/// A shared mapping of the state file; unmapped on drop unless taken.
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

impl Mapping {
    fn new(fd: &OwnedFd, len: usize) -> std::io::Result<Mapping> {
        // SAFETY: mapping a regular file we have open read-write; the kernel picks the address.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Mapping { ptr: p.cast(), len })
    }

    fn take(self) -> *mut u8 {
        let p = self.ptr;
        std::mem::forget(self);
        p
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: ptr/len came from mmap and nothing borrows from this temporary mapping.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp_state() -> (tempfile::TempDir, State) {
        let dir = tempfile::tempdir().unwrap();
        let st = State::open(
            &dir.path().join("s"),
            Some((Config::default_config(), "x".into())),
        )
        .unwrap();
        (dir, st)
    }

    #[test]
    fn create_then_attach_sees_same_gpus() {
        let (dir, st) = tmp_state();
        let p = st.register_process().unwrap();
        assert!(st.charge(0, &p, 1 << 20));
        let again = State::open(&dir.path().join("s"), None).unwrap();
        assert_eq!(again.config, st.config);
        assert_eq!(again.memory_used(0), 1 << 20);
        assert_eq!(again.processes(0)[0].memory, 1 << 20);
    }

    #[test]
    fn mismatched_config_is_refused() {
        let (dir, _st) = tmp_state();
        let mut other = Config::default_config();
        other.gpu[0].memory_mib = 1024;
        let e = State::open(&dir.path().join("s"), Some((other, "/x.toml".into())))
            .err()
            .unwrap();
        assert!(
            e.to_string()
                .contains("was created for other GPUs than GPUSIM_CONFIG=/x.toml"),
            "{e}"
        );
    }

    #[test]
    fn corrupt_file_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s");
        std::fs::write(&path, vec![0xAB; file_size(2)]).unwrap();
        let e = State::open(&path, None).err().unwrap().to_string();
        assert!(
            e.contains("is corrupt")
                && e.contains("bad magic")
                && e.contains(path.to_str().unwrap()),
            "{e}"
        );
        assert!(!e.contains('\n'));
        std::fs::write(&path, b"junk").unwrap();
        let e = State::open(&path, None).err().unwrap().to_string();
        assert!(
            e.contains("is corrupt") && e.contains("shorter than"),
            "{e}"
        );
        // an interrupted creation (size set, magic never written) is simply redone
        std::fs::write(&path, vec![0; file_size(2)]).unwrap();
        assert!(State::open(&path, None).is_ok());
    }

    #[test]
    fn memory_is_capped_and_given_back() {
        let (_d, st) = tmp_state();
        let p = st.register_process().unwrap();
        let cap = st.usable_memory(1);
        assert!(st.charge(1, &p, cap - 10));
        assert!(!st.charge(1, &p, 11));
        assert!(st.charge(1, &p, 10));
        st.uncharge(1, &p, cap);
        assert_eq!(st.memory_used(1), 0);
        st.unregister_process(p);
        assert!(st.processes(1).is_empty());
    }

    #[test]
    fn peak_is_the_high_water_mark_until_reset() {
        let (_d, st) = tmp_state();
        let p = st.register_process().unwrap();
        assert_eq!(st.memory_peak(0), 0);
        assert!(st.charge(0, &p, 100 << 20));
        assert!(st.charge(0, &p, 50 << 20));
        assert_eq!(st.memory_peak(0), 150 << 20);
        st.uncharge(0, &p, 150 << 20);
        assert_eq!(st.memory_used(0), 0);
        assert_eq!(st.memory_peak(0), 150 << 20, "freeing keeps the peak");
        assert!(st.charge(0, &p, 20 << 20));
        assert_eq!(
            st.memory_peak(0),
            150 << 20,
            "a smaller charge keeps the peak"
        );
        // a failed charge moves nothing
        assert!(!st.charge(0, &p, st.usable_memory(0)));
        assert_eq!(st.memory_peak(0), 150 << 20);
        assert_eq!(st.view(0).unwrap().memory_peak, 150 << 20);
        // other GPUs have their own peak
        assert_eq!(st.memory_peak(1), 0);
        st.reset_peak(0);
        assert_eq!(
            st.memory_peak(0),
            20 << 20,
            "reset brings the peak to the current use"
        );
        assert!(st.charge(0, &p, 10 << 20));
        assert_eq!(st.memory_peak(0), 30 << 20);
        st.unregister_process(p);
        assert_eq!(st.memory_used(0), 0);
        assert_eq!(st.memory_peak(0), 30 << 20, "process exit keeps the peak");
        st.reset_peak(0);
        assert_eq!(st.memory_peak(0), 0);
    }

    #[test]
    fn other_layout_version_is_refused_with_advice() {
        let (dir, st) = tmp_state();
        drop(st);
        let path = dir.path().join("s");
        let mut bytes = std::fs::read(&path).unwrap();
        let at = std::mem::offset_of!(Header, version);
        bytes[at..at + 4].copy_from_slice(&(VERSION - 1).to_le_bytes());
        std::fs::write(&path, bytes).unwrap();
        let e = State::open(&path, None).err().unwrap();
        assert!(
            matches!(e, SimError::StateVersion { found, .. } if found == VERSION - 1),
            "{e}"
        );
        let e = e.to_string();
        let rm = format!("delete it (rm {})", path.display());
        assert!(
            e.contains(&format!("state layout version {}", VERSION - 1)) && e.contains(&rm),
            "{e}"
        );
        assert!(!e.contains('\n'));
    }

    #[test]
    fn launches_complete_and_are_counted() {
        let (_d, st) = tmp_state();
        let p = st.register_process().unwrap();
        let q = st.create_queue(0, &p).unwrap().unwrap();
        let t0 = now_ns();
        let a = st.launch(0, q, 2_000_000, 1).unwrap();
        let b = st.launch(0, q, 3_000_000, 1).unwrap();
        st.wait(0, q, b).unwrap();
        let elapsed = now_ns() - t0;
        assert!(elapsed >= 5_000_000, "waited {elapsed}");
        let da = st.done_at(0, q, a).unwrap().unwrap();
        let db = st.done_at(0, q, b).unwrap().unwrap();
        assert_eq!(db - da, 3_000_000);
        let v = st.view(0).unwrap();
        assert_eq!(v.processes[0].busy_ns, 5_000_000);
        assert_eq!(v.processes[0].kernels, 2);
    }

    #[test]
    fn xids_are_numbered_and_kept() {
        let (_d, st) = tmp_state();
        let before = st.xid_total();
        st.inject_xid(1, 79);
        st.inject_xid(1, 48);
        assert_eq!(st.xid_count(1), 2);
        assert_eq!(st.xid(1, 1), Some(79));
        assert_eq!(st.xid(1, 2), Some(48));
        assert_eq!(st.xid(0, 1), None);
        assert_eq!(st.xid_total(), before + 2);
        // returns at once because the counter already moved
        st.wait_xid_change(before, 10_000);
    }
}
