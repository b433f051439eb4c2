//! Process identity as a kernel driver sees it: the host pid.
//!
//! The real NVIDIA driver names processes by their pid in the host's (the initial) pid
//! namespace, also for processes inside a container's pid namespace: that is what NVML
//! reports to the node's tools (vcuda-manager, nvidia-smi on the host) and, famously, to
//! tools inside containers too. A library in a container cannot learn its host pid by
//! itself, so gpusim asks a small service on the host (`gpusim pid-service`, the node's side
//! of the simulated driver, as the kernel is the real one's): a process connects to its Unix
//! socket, mounted into the container, and the service answers with the connecting process's
//! pid as its own (host) pid namespace sees it (`SO_PEERCRED`, translated by the kernel) and
//! that namespace's id. Without `GPUSIM_PID_SOCKET` (every process on the host), a process's
//! identity is `getpid()` in its own namespace, as before.

use std::io::{Read, Write};
use std::os::unix::io::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

/// The environment variable naming the service's socket (inside a container).
pub const SOCKET_ENV: &str = "GPUSIM_PID_SOCKET";

/// The calling process's pid namespace: the low 32 bits of `/proc/self/ns/pid`'s inode
/// (namespace inodes are 32-bit numbers on Linux); 0 where it cannot be read.
pub fn own_pid_ns() -> u32 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self/ns/pid").map_or(0, |m| m.ino() as u32)
}

/// The last identity asked for: `getpid()` when asked (high 32 bits) and the pid answered
/// (low 32), and the namespace answered. A forked child has another `getpid()`, so it never
/// takes its parent's. Atomics, not a lock: a fork can happen at any instant.
static ASKED: AtomicU64 = AtomicU64::new(0);
static ASKED_NS: AtomicU32 = AtomicU32::new(0);

fn getpid() -> u32 {
    // SAFETY: getpid cannot fail.
    unsafe { libc::getpid() as u32 }
}

/// Who the calling process is to the simulated driver: (pid, pid namespace). From the
/// service when `GPUSIM_PID_SOCKET` names one, else `getpid()` here. A service that does not
/// answer within 2 s, or answers nonsense, leaves the local identity (the process still
/// works; only the pids NVML reports are then the container's). Asked once per process.
pub fn identity() -> (u32, u32) {
    if let Some(id) = cached() {
        return id;
    }
    let local = (getpid(), own_pid_ns());
    let id = match std::env::var_os(SOCKET_ENV) {
        Some(path) if !path.is_empty() => ask(std::path::Path::new(&path)).unwrap_or(local),
        _ => local,
    };
    ASKED_NS.store(id.1, Ordering::Relaxed);
    ASKED.store(
        (u64::from(getpid()) << 32) | u64::from(id.0),
        Ordering::Release,
    );
    id
}

/// The calling process's identity without asking anyone: what [`identity`] answered in this
/// process, else the local one.
pub fn known_identity() -> (u32, u32) {
    cached().unwrap_or_else(|| (getpid(), own_pid_ns()))
}

fn cached() -> Option<(u32, u32)> {
    let v = ASKED.load(Ordering::Acquire);
    (v != 0 && (v >> 32) as u32 == getpid()).then(|| (v as u32, ASKED_NS.load(Ordering::Relaxed)))
}

fn ask(path: &std::path::Path) -> Option<(u32, u32)> {
    let mut s = UnixStream::connect(path).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    let mut buf = [0u8; 8];
    s.read_exact(&mut buf).ok()?;
    decode(buf)
}

/// The service's answer: pid and pid namespace, little-endian u32 each; a zero pid is no
/// answer.
pub fn encode(pid: u32, ns: u32) -> [u8; 8] {
    let mut b = [0u8; 8];
    b[..4].copy_from_slice(&pid.to_le_bytes());
    b[4..].copy_from_slice(&ns.to_le_bytes());
    b
}

pub fn decode(b: [u8; 8]) -> Option<(u32, u32)> {
    let pid = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    let ns = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    (pid != 0).then_some((pid, ns))
}

/// The pid of the process at the other end of `s`, in the caller's pid namespace.
pub fn peer_pid(s: &UnixStream) -> std::io::Result<u32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: the descriptor is an open socket; cred and len are valid out-pointers of the
    // sizes given.
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(cred.pid as u32)
}

/// Answer every connection on `listener` with its peer's pid; runs until accepting fails.
/// One exchange per connection, each bounded by a 1 s write timeout, so a client that does
/// not read cannot hold the service.
pub fn serve(listener: &UnixListener) -> std::io::Result<()> {
    let ns = own_pid_ns();
    for conn in listener.incoming() {
        let mut s = match conn {
            Ok(s) => s,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if let Ok(pid) = peer_pid(&s) {
            let _ = s.set_write_timeout(Some(Duration::from_secs(1)));
            let _ = s.write_all(&encode(pid, ns));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_answer_round_trips_and_zero_is_no_answer() {
        assert_eq!(decode(encode(4242, 4026531836)), Some((4242, 4026531836)));
        assert_eq!(decode(encode(0, 7)), None);
    }

    #[test]
    fn the_service_names_the_connecting_process() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pid.sock");
        let l = UnixListener::bind(&path).unwrap();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let pid = peer_pid(&s).unwrap();
            s.write_all(&encode(pid, own_pid_ns())).unwrap();
        });
        // Same process, same namespace: the service's answer is our own pid.
        assert_eq!(ask(&path), Some((std::process::id(), own_pid_ns())));
        t.join().unwrap();
    }

    #[test]
    fn without_a_service_the_identity_is_local() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(ask(&dir.path().join("absent.sock")), None);
    }
}
