//! The manager's handle on a container's usage region: a file every process of the
//! container can write, truncate, lock or (where its directory is mounted) replace.
//!
//! So the manager never maps it (a tenant that truncates a mapped file kills the reader with
//! SIGBUS), never takes `flock` on it or waits on any of its locks (a tenant could hold them
//! for ever), and never resolves its path again once it holds a descriptor: it opens the file
//! once, `O_NOFOLLOW`, before the container exists, and keeps that descriptor for the
//! allocation's life. Every read is one `pread` of the whole file into the manager's own
//! buffer, checked for size and shape by a pure parser ([`parse`], fuzzed); its few writes
//! are `pwrite`s of single aligned fields. A region that does not parse is the container's
//! fault ([`RegionFault`]): the caller refuses, counts and logs, and goes on.
//!
//! Reclaiming dead processes' slots runs the library's own [`Reclaim`] machine over
//! `pread`/`pwrite` and non-blocking `fcntl` locks on this descriptor.

use std::ffi::CString;
use std::mem::{offset_of, size_of};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use crate::config::MAX_GPUS;
use crate::region::{
    held, slot_lock, RegionHeader, Slot, MAX_PROCS, REGION_MAGIC, REGION_SIZE, REGION_VERSION,
};
use crate::slot::{self, Lock, Reclaim, Slots, SLOT_ACTIVE};

const HEADER_SIZE: usize = REGION_SIZE - MAX_PROCS * size_of::<Slot>();

/// Why a region cannot be used. `Io` is a system error on the manager's side; every other
/// kind is something the container did to its file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegionFault {
    #[error("region {path}: cannot {op} ({err})")]
    Io {
        path: String,
        op: &'static str,
        err: String,
    },
    #[error("region {path} is not a regular file of {REGION_SIZE} bytes any more ({why}); the container changed it: its usage cannot be read until it is recreated")]
    Shape { path: String, why: String },
    #[error("region {path} does not hold a vcuda region for this allocation ({why}); the container wrote it")]
    Content { path: String, why: String },
}

/// One process slot as read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotRecord {
    pub index: u32,
    pub state: u32,
    pub pid: u32,
    pub host_pid: u32,
    pub generation: u32,
    pub start_time: u64,
    /// Bytes per GPU (a counter that reads negative: 0).
    pub api: Vec<u64>,
    pub hidden: Vec<u64>,
}

/// What a region said at one read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    pub throttled_ns: Vec<u64>,
    pub oom_refusals: Vec<u64>,
    pub accounting_errors: Vec<u64>,
    /// Every slot that is not free.
    pub slots: Vec<SlotRecord>,
}

impl Snapshot {
    /// What the container's processes hold on `dev` (every slot, whatever its header says
    /// is in use: a header the container zeroed must not hide anything).
    pub fn used(&self, dev: usize) -> u64 {
        self.slots.iter().fold(0u64, |acc, s| {
            acc.saturating_add(s.api.get(dev).copied().unwrap_or(0))
                .saturating_add(s.hidden.get(dev).copied().unwrap_or(0))
        })
    }

    /// The processes holding a slot.
    pub fn active(&self) -> impl Iterator<Item = &SlotRecord> {
        self.slots.iter().filter(|s| s.state == SLOT_ACTIVE)
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

fn per_gpu(b: &[u8], at: usize, n: usize) -> Vec<u64> {
    (0..n).map(|d| u64_at(b, at + 8 * d)).collect()
}

fn slot_at(i: usize) -> usize {
    HEADER_SIZE + i * size_of::<Slot>()
}

/// Parse a whole region file made for `uuids`. Total: any bytes give `Ok` or `Err`, never
/// a panic (fuzzed). `Err` says what is wrong in words.
pub fn parse(b: &[u8], uuids: &[[u8; 16]]) -> Result<Snapshot, String> {
    if b.len() != REGION_SIZE {
        return Err(format!("{} bytes, expected {REGION_SIZE}", b.len()));
    }
    let magic = u64_at(b, offset_of!(RegionHeader, magic));
    if magic != REGION_MAGIC {
        return Err(format!("bad magic number {magic:#018x}"));
    }
    let version = u32_at(b, offset_of!(RegionHeader, version));
    if version != REGION_VERSION {
        return Err(format!(
            "layout version {version}, expected {REGION_VERSION}"
        ));
    }
    let n = u32_at(b, offset_of!(RegionHeader, num_gpus)) as usize;
    let at = offset_of!(RegionHeader, uuids);
    if n != uuids.len()
        || n > MAX_GPUS
        || (0..n).any(|d| b[at + 16 * d..at + 16 * (d + 1)] != uuids[d])
    {
        return Err(format!(
            "it counts {n} GPU(s) that are not the allocation's {}",
            uuids.len()
        ));
    }
    let slots = (0..MAX_PROCS)
        .map(|i| {
            let s = slot_at(i);
            SlotRecord {
                index: i as u32,
                state: u32_at(b, s + offset_of!(Slot, state)),
                pid: u32_at(b, s + offset_of!(Slot, pid)),
                host_pid: u32_at(b, s + offset_of!(Slot, host_pid)),
                generation: u32_at(b, s + offset_of!(Slot, generation)),
                start_time: u64_at(b, s + offset_of!(Slot, start_time)),
                api: per_gpu(b, s + offset_of!(Slot, api), n)
                    .into_iter()
                    .map(held)
                    .collect(),
                hidden: per_gpu(b, s + offset_of!(Slot, hidden), n),
            }
        })
        .filter(|s| s.state != slot::SLOT_FREE || s.api.iter().chain(&s.hidden).any(|&v| v != 0))
        .collect();
    Ok(Snapshot {
        throttled_ns: per_gpu(b, offset_of!(RegionHeader, throttled_ns), n),
        oom_refusals: per_gpu(b, offset_of!(RegionHeader, oom_refusals), n),
        accounting_errors: per_gpu(b, offset_of!(RegionHeader, accounting_errors), n),
        slots,
    })
}

/// The manager's descriptor of one region (see the module comment).
#[derive(Debug)]
pub struct RegionFile {
    fd: OwnedFd,
    path: PathBuf,
    uuids: Vec<[u8; 16]>,
}

impl RegionFile {
    /// Create the region for `uuids` at `path` — a directory only the manager can write,
    /// before any container sees it — or, if the file is there (a manager restart, or
    /// PreStartContainer asked again), open it as [`RegionFile::open`] does. The file is
    /// made world-writable through the descriptor: the container's processes run as any
    /// user.
    pub fn create_or_open(path: &Path, uuids: &[[u8; 16]]) -> Result<RegionFile, RegionFault> {
        let fd = match open(path, libc::O_CREAT | libc::O_EXCL) {
            Ok(fd) => fd,
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
                return RegionFile::open(path, uuids)
            }
            Err(e) => return Err(io(path, "create it", e)),
        };
        let r = RegionFile {
            fd,
            path: path.to_path_buf(),
            uuids: uuids.to_vec(),
        };
        // SAFETY: fd is open.
        if unsafe { libc::fchmod(r.fd.as_raw_fd(), 0o666) } != 0 {
            return Err(io(
                path,
                "make it writable",
                std::io::Error::last_os_error(),
            ));
        }
        let mut bytes = vec![0u8; REGION_SIZE];
        let put = |b: &mut [u8], at: usize, v: &[u8]| b[at..at + v.len()].copy_from_slice(v);
        put(
            &mut bytes,
            offset_of!(RegionHeader, version),
            &REGION_VERSION.to_le_bytes(),
        );
        put(
            &mut bytes,
            offset_of!(RegionHeader, num_gpus),
            &(uuids.len() as u32).to_le_bytes(),
        );
        put(
            &mut bytes,
            offset_of!(RegionHeader, size),
            &(REGION_SIZE as u64).to_le_bytes(),
        );
        for (d, u) in uuids.iter().enumerate() {
            put(&mut bytes, offset_of!(RegionHeader, uuids) + 16 * d, u);
        }
        // The magic last (libvcuda lays out a region whose magic is 0 itself).
        r.write_at(&bytes[8..], 8)?;
        r.write_at(&REGION_MAGIC.to_le_bytes(), offset_of!(RegionHeader, magic))?;
        Ok(r)
    }

    /// Open an existing region for `uuids`: `O_NOFOLLOW` (a symlink is refused), a regular
    /// file of the region's size, and one that parses.
    pub fn open(path: &Path, uuids: &[[u8; 16]]) -> Result<RegionFile, RegionFault> {
        let fd = open(path, 0).map_err(|e| io(path, "open it", e))?;
        let r = RegionFile {
            fd,
            path: path.to_path_buf(),
            uuids: uuids.to_vec(),
        };
        r.read()?;
        Ok(r)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn shape(&self, why: String) -> RegionFault {
        RegionFault::Shape {
            path: self.path.display().to_string(),
            why,
        }
    }

    /// Check that the descriptor still refers to a regular file of the region's size.
    fn check_shape(&self) -> Result<(), RegionFault> {
        // SAFETY: stat is plain data filled by fstat.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fd is open; st is a valid out-pointer.
        if unsafe { libc::fstat(self.fd.as_raw_fd(), &mut st) } != 0 {
            return Err(io(&self.path, "stat it", std::io::Error::last_os_error()));
        }
        if st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return Err(self.shape("not a regular file".into()));
        }
        if st.st_size as u64 != REGION_SIZE as u64 {
            return Err(self.shape(format!("{} bytes", st.st_size)));
        }
        Ok(())
    }

    /// Read and parse the whole region.
    pub fn read(&self) -> Result<Snapshot, RegionFault> {
        self.check_shape()?;
        let mut buf = vec![0u8; REGION_SIZE];
        let n = self.read_at(&mut buf, 0)?;
        buf.truncate(n);
        parse(&buf, &self.uuids).map_err(|why| RegionFault::Content {
            path: self.path.display().to_string(),
            why,
        })
    }

    /// Set GPU `dev`'s run-time compute share and limit (ppm; see `Region::set_core`).
    pub fn set_core(&self, dev: usize, share_ppm: u64, limit_ppm: u64) -> Result<(), RegionFault> {
        if dev >= MAX_GPUS {
            return Ok(());
        }
        self.check_shape()?;
        self.write_at(
            &share_ppm.to_le_bytes(),
            offset_of!(RegionHeader, core_override) + 8 * dev,
        )?;
        self.write_at(
            &limit_ppm.to_le_bytes(),
            offset_of!(RegionHeader, core_limit_override) + 8 * dev,
        )
    }

    /// Tell the process in slot `index` its host pid.
    pub fn set_host_pid(&self, index: u32, host_pid: u32) -> Result<(), RegionFault> {
        if index as usize >= MAX_PROCS {
            return Ok(());
        }
        self.check_shape()?;
        self.write_at(
            &host_pid.to_le_bytes(),
            slot_at(index as usize) + offset_of!(Slot, host_pid),
        )
    }

    /// Free the slots of dead processes (the library's [`Reclaim`], never waiting on a lock);
    /// returns how many.
    pub fn reclaim_dead(&self) -> Result<usize, RegionFault> {
        self.check_shape()?;
        Ok(slot::run(Reclaim::default(), self))
    }

    fn read_at(&self, buf: &mut [u8], at: usize) -> Result<usize, RegionFault> {
        let mut done = 0;
        while done < buf.len() {
            // SAFETY: fd is open; the buffer is ours and at least `len - done` long.
            let n = unsafe {
                libc::pread(
                    self.fd.as_raw_fd(),
                    buf[done..].as_mut_ptr().cast(),
                    buf.len() - done,
                    (at + done) as libc::off_t,
                )
            };
            match n {
                0 => break, // shorter than it was a moment ago: the parser says so
                n if n > 0 => done += n as usize,
                _ => {
                    let e = std::io::Error::last_os_error();
                    if e.kind() != std::io::ErrorKind::Interrupted {
                        return Err(io(&self.path, "read it", e));
                    }
                }
            }
        }
        Ok(done)
    }

    fn write_at(&self, bytes: &[u8], at: usize) -> Result<(), RegionFault> {
        // SAFETY: fd is open; bytes is a valid buffer of its length.
        let n = unsafe {
            libc::pwrite(
                self.fd.as_raw_fd(),
                bytes.as_ptr().cast(),
                bytes.len(),
                at as libc::off_t,
            )
        };
        if n != bytes.len() as isize {
            return Err(io(&self.path, "write it", std::io::Error::last_os_error()));
        }
        Ok(())
    }

    fn lock_cmd(&self, i: usize, l: Lock, cmd: libc::c_int, ltype: libc::c_int) -> Option<i32> {
        slot_lock(&self.fd, i, l, cmd, ltype).ok()
    }

    fn u64_field(&self, at: usize) -> u64 {
        let mut b = [0u8; 8];
        match self.read_at(&mut b, at) {
            Ok(8) => u64::from_le_bytes(b),
            _ => 0,
        }
    }

    fn u32_field(&self, at: usize) -> u32 {
        let mut b = [0u8; 4];
        match self.read_at(&mut b, at) {
            Ok(4) => u32::from_le_bytes(b),
            _ => u32::MAX, // unreadable: no state the machines act on
        }
    }
}

/// The reclaim machine's actions, on the descriptor. Reads and writes are single aligned
/// `pread`/`pwrite`s of a field; the state is one byte wide in practice, so a write never
/// tears it. Locks are tried, never waited for.
impl Slots for RegionFile {
    fn count(&self) -> usize {
        MAX_PROCS
    }
    fn try_lock(&self, i: usize, l: Lock) -> bool {
        self.lock_cmd(i, l, libc::F_OFD_SETLK, libc::F_WRLCK)
            .is_some()
    }
    fn unlock(&self, i: usize, l: Lock) {
        self.lock_cmd(i, l, libc::F_OFD_SETLK, libc::F_UNLCK);
    }
    fn state(&self, i: usize) -> u32 {
        self.u32_field(slot_at(i) + offset_of!(Slot, state))
    }
    fn set_state(&self, i: usize, state: u32) {
        let _ = self.write_at(&state.to_le_bytes(), slot_at(i) + offset_of!(Slot, state));
    }
    fn generation(&self, i: usize) -> u32 {
        self.u32_field(slot_at(i) + offset_of!(Slot, generation))
    }
    /// The manager sees no container's pid namespace. The owner lock held: alive. Gone: the
    /// owner is exiting or dead, and only the kernel can tell which (a dying process drops
    /// its locks before the driver frees its memory). So the slot is taken for dead only if
    /// the host pid the manager gave it (at registration) no longer names a process started
    /// at the slot's start time; a slot without one is left to the container's own
    /// processes, whose check is exact. (A container that writes these fields can only keep
    /// its own dead slots counted.)
    fn owner_alive(&self, i: usize) -> bool {
        let locked = self
            .lock_cmd(i, Lock::Owner, libc::F_OFD_GETLK, libc::F_WRLCK)
            .is_none_or(|t| t != libc::F_UNLCK);
        if locked {
            return true;
        }
        let host_pid = self.u32_field(slot_at(i) + offset_of!(Slot, host_pid));
        let start = self.u64_field(slot_at(i) + offset_of!(Slot, start_time));
        host_pid == 0
            || host_pid == u32::MAX
            || start == 0
            || crate::region::proc_start_time(host_pid) == Some(start)
    }
    fn zero(&self, i: usize) {
        let from = slot_at(i) + offset_of!(Slot, api);
        let to = slot_at(i) + offset_of!(Slot, launched_at) + 8 * MAX_GPUS;
        let _ = self.write_at(&vec![0u8; to - from], from);
    }
}

fn open(path: &Path, extra: libc::c_int) -> std::io::Result<OwnedFd> {
    let c = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    // SAFETY: c is NUL-terminated. O_NONBLOCK: opening never waits (a FIFO put in its place).
    let fd = unsafe {
        libc::open(
            c.as_ptr(),
            libc::O_RDWR | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC | extra,
            0o600 as libc::c_uint,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a descriptor we just opened and now own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn io(path: &Path, op: &'static str, err: std::io::Error) -> RegionFault {
    RegionFault::Io {
        path: path.display().to_string(),
        op,
        err: err.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::region::Region;
    use proptest::prelude::*;

    const U: [[u8; 16]; 2] = [[1; 16], [2; 16]];

    fn made() -> (tempfile::TempDir, PathBuf, RegionFile) {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("region");
        let f = RegionFile::create_or_open(&p, &U).unwrap();
        (d, p, f)
    }

    #[test]
    fn the_library_uses_what_the_manager_made_and_the_manager_reads_it() {
        let (_d, p, f) = made();
        let lib = Region::open_or_create(&p, &U).unwrap();
        let me = lib.claim().unwrap();
        assert!(lib.reserve(me, 1, 4096, 1 << 20));
        lib.add_throttled_ns(0, 5);
        let s = f.read().unwrap();
        assert_eq!((s.used(0), s.used(1)), (0, 4096));
        assert_eq!(s.throttled_ns, vec![5, 0]);
        let mine: Vec<_> = s.active().map(|r| (r.index, r.pid)).collect();
        assert_eq!(mine, vec![(me.index, std::process::id())]);
        f.set_core(1, 250_000, 600_000).unwrap();
        f.set_host_pid(me.index, 4242).unwrap();
        assert_eq!(
            lib.header().core_override[1].load(std::sync::atomic::Ordering::Relaxed),
            250_000
        );
        assert_eq!(lib.processes()[0].host_pid, 4242);
        // Opening again (a manager restart) finds the same region.
        assert_eq!(
            RegionFile::create_or_open(&p, &U)
                .unwrap()
                .read()
                .unwrap()
                .used(1),
            4096
        );
    }

    #[test]
    fn a_truncated_region_is_the_containers_fault_not_a_crash() {
        let (_d, p, f) = made();
        let lib = Region::open_or_create(&p, &U).unwrap();
        let me = lib.claim().unwrap();
        assert!(lib.reserve(me, 0, 10, 100));
        drop(lib);
        std::fs::OpenOptions::new()
            .write(true)
            .open(&p)
            .unwrap()
            .set_len(0)
            .unwrap();
        for e in [
            f.read().err(),
            f.set_core(0, 1, 1).err(),
            f.reclaim_dead().err(),
        ] {
            let e = e.expect("refused");
            assert!(matches!(e, RegionFault::Shape { .. }), "{e}");
            assert!(e.to_string().contains("0 bytes"), "{e}");
        }
        std::fs::OpenOptions::new()
            .write(true)
            .open(&p)
            .unwrap()
            .set_len(REGION_SIZE as u64 + 7)
            .unwrap();
        assert!(matches!(f.read(), Err(RegionFault::Shape { .. })));
    }

    #[test]
    fn the_descriptor_is_kept_whatever_happens_to_the_path() {
        let (d, p, f) = made();
        // The container swaps its region for a symlink to a neighbour's.
        let other = d.path().join("neighbour");
        let n = RegionFile::create_or_open(&other, &U).unwrap();
        std::fs::remove_file(&p).unwrap();
        std::os::unix::fs::symlink(&other, &p).unwrap();
        f.set_core(0, 50_000, 0).unwrap();
        let lib = Region::open_or_create(&other, &U).unwrap();
        assert_eq!(
            lib.header().core_override[0].load(std::sync::atomic::Ordering::Relaxed),
            0,
            "the neighbour is untouched"
        );
        drop(n);
        // Opening that path again refuses to follow the link, and creates nothing anywhere.
        let e = RegionFile::create_or_open(&p, &U).unwrap_err();
        assert!(matches!(e, RegionFault::Io { .. }), "{e}");
        std::fs::remove_file(&p).unwrap();
        std::os::unix::fs::symlink(d.path().join("nowhere"), &p).unwrap();
        assert!(RegionFile::create_or_open(&p, &U).is_err());
        assert!(!d.path().join("nowhere").exists());
    }

    #[test]
    fn a_fifo_or_a_directory_in_its_place_is_refused_without_waiting() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("region");
        let c = CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: c is NUL-terminated.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o666) }, 0);
        assert!(RegionFile::open(&p, &U).is_err());
        std::fs::remove_file(&p).unwrap();
        std::fs::create_dir(&p).unwrap();
        assert!(RegionFile::create_or_open(&p, &U).is_err());
    }

    #[test]
    fn a_locked_region_is_read_and_reclaimed_without_waiting() {
        let (_d, p, f) = made();
        let lib = Region::open_or_create(&p, &U).unwrap();
        // The container holds every lock it can: flock, and every byte of the file.
        let hold = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&p)
            .unwrap();
        // SAFETY: fd is open.
        assert_eq!(unsafe { libc::flock(hold.as_raw_fd(), libc::LOCK_EX) }, 0);
        let me = lib.claim().unwrap();
        assert!(lib.reserve(me, 0, 7, 100));
        assert_eq!(f.read().unwrap().used(0), 7);
        assert_eq!(f.reclaim_dead().unwrap(), 0, "its owner lives");
        f.set_host_pid(me.index, 1).unwrap();
    }

    #[test]
    fn the_manager_reclaims_a_dead_processs_slot() {
        let (_d, p, f) = made();
        // SAFETY: the child only claims, reserves and _exits.
        let child = unsafe { libc::fork() };
        if child == 0 {
            let r = Region::open_or_create(&p, &U).unwrap();
            let me = r.claim().unwrap();
            r.reserve(me, 0, 5000, u64::MAX);
            // SAFETY: end the child at once, as a kill would.
            unsafe { libc::_exit(0) };
        }
        let mut status = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(child, &mut status, 0) };
        let s = f.read().unwrap();
        assert_eq!(s.used(0), 5000);
        assert_eq!(
            f.reclaim_dead().unwrap(),
            0,
            "unregistered: left to the container's processes"
        );
        // Registered (the manager wrote its host pid): the kernel says it is gone.
        let index = s.active().next().unwrap().index;
        f.set_host_pid(index, child as u32).unwrap();
        assert_eq!(f.reclaim_dead().unwrap(), 1);
        let s = f.read().unwrap();
        assert_eq!((s.used(0), s.slots.len()), (0, 0));
    }

    #[test]
    fn a_region_for_other_gpus_or_of_another_version_does_not_parse() {
        let (_d, p, _f) = made();
        let mut b = std::fs::read(&p).unwrap();
        assert!(parse(&b, &U).is_ok());
        assert!(parse(&b, &U[..1]).unwrap_err().contains("GPU"));
        b[offset_of!(RegionHeader, version)] = 3;
        assert!(parse(&b, &U).unwrap_err().contains("version 3"));
        assert!(parse(&b[..100], &U).unwrap_err().contains("100 bytes"));
    }

    proptest! {
        /// Whatever the container writes, the parser answers without panicking.
        #[test]
        fn parsing_is_total(
            edits in proptest::collection::vec((0..REGION_SIZE, any::<u8>()), 0..64),
            len in prop_oneof![Just(REGION_SIZE), 0..REGION_SIZE + 64],
        ) {
            let (_d, p, _f) = made();
            let mut b = std::fs::read(&p).unwrap();
            for (at, v) in edits {
                b[at] = v;
            }
            b.resize(len, 0xA5);
            if let Ok(s) = parse(&b, &U) {
                prop_assert!(s.slots.len() <= MAX_PROCS);
                // A counter reads as bytes held or as zero, never as a negative wrapped
                // to "almost 2^48"; sums saturate.
                prop_assert!(s.slots.iter().flat_map(|r| &r.api).all(|&v| v < 1 << 47));
                let _ = (s.used(0), s.used(1), s.used(7));
            }
        }
    }
}
