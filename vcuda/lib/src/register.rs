//! Registration with the manager. When the config names a `socket` and an `allocation`, each
//! process introduces itself to vcuda-manager over the control socket
//! ([`vcuda_contract::control`]): `Hello { allocation, slot, generation, pid, start_time }`,
//! answered by `Welcome { host_pid }` (the manager writes the host pid into the slot itself;
//! we only log it) or `Refused { reason }`. A forked child registers the slot it claims
//! (`init::after_fork`, once `state` has renewed the state).
//!
//! **Never in the application's way.** All of it runs on a thread of its own, started with
//! the process's state; no CUDA or NVML call waits for it, and nothing here panics into the
//! application (the thread body is also under `catch_unwind`). Each attempt connects with a
//! `UnixStream` — not a `File` on the descriptor: std sends with `MSG_NOSIGNAL`, so a manager
//! that went away yields `EPIPE`, never a SIGPIPE that would kill the application — with
//! read and write timeouts of [`IO_TIMEOUT`], sends the Hello, reads one reply and closes.
//! The connect itself has no timeout (std offers none without unsafe socket calls); it can
//! only block while a live manager's listen backlog is full, and then only this thread.
//!
//! **Outcomes.** Welcome: done (debug log). Refused: the reason is logged once at warn level
//! and the thread ends — asking again would get the same answer. Anything else (no socket
//! yet, connection refused, the manager restarting, no reply in time, a reply we cannot
//! decode): retried after [`FIRST_RETRY`], doubling to [`MAX_RETRY`], for the life of the
//! process, so a manager that starts late or restarts still learns the process. Failures
//! to reach the manager are logged at debug level (expected while it is down); a manager
//! that answers badly is reported at warn level once.
//!
//! Why not in the sweep thread: an attempt can take up to two [`IO_TIMEOUT`]s and the
//! back-off grows to half a minute; inside the sweep that would hold up reclaiming dead
//! processes and measuring hidden memory (a 0.5 s cadence), or tangle its loop with a second
//! timer. A thread of its own is simple and ends once the manager has answered, so a
//! registered process carries no extra thread.
//!
//! Plain std socket calls go through no CUDA or NVML hook, so the library's own-lookup
//! guard (`dlsym::with_own_lookup`) is not needed here.

use std::io;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use vcuda_contract::control::{self, ControlError, Hello, Reply, Request};

use crate::log::{log, DEBUG, WARN};
use crate::state::Vcuda;

/// Read and write timeout of one attempt.
pub const IO_TIMEOUT: Duration = Duration::from_secs(1);
/// Wait before the first retry; doubled after each failure up to [`MAX_RETRY`].
pub const FIRST_RETRY: Duration = Duration::from_secs(1);
pub const MAX_RETRY: Duration = Duration::from_secs(30);

/// Start registering this process's slot, if the config names a socket and an allocation.
/// Called once the slot is claimed (start-up, and in a forked child after it claimed its
/// own). Returns at once; the work runs on the `vcuda-register` thread.
pub fn start(v: &Vcuda) {
    let Some((socket, allocation)) = v.registration() else {
        return;
    };
    let Some(hello) = hello(v, allocation) else {
        log!(
            DEBUG,
            "not registering with the manager: this process holds no slot of its own"
        );
        return;
    };
    let socket = socket.to_path_buf();
    let spawned = std::thread::Builder::new()
        .name("vcuda-register".into())
        .stack_size(128 * 1024)
        .spawn(move || {
            let _ = std::panic::catch_unwind(move || {
                register(
                    &socket,
                    &hello,
                    Backoff::new(FIRST_RETRY, MAX_RETRY),
                    crate::state::stopping,
                )
            });
        });
    if let Err(e) = spawned {
        log!(
            WARN,
            "cannot start the registration thread ({e}): the manager does not learn of this process"
        );
    }
}

/// The Hello for this process's slot, read back from the slot (what the manager will check
/// it against). `None` unless the slot is held, and by this process (a forked child whose
/// claim failed still points at its parent's slot).
fn hello(v: &Vcuda, allocation: &str) -> Option<Hello> {
    let (me, pid, start_time) = v.held_slot()?;
    if pid != std::process::id() {
        return None;
    }
    Some(Hello {
        allocation: allocation.to_owned(),
        slot: me.index,
        generation: me.generation,
        pid,
        start_time,
    })
}

/// How registration ended (for tests; the thread just ends).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Welcome {
        host_pid: u32,
    },
    Refused {
        reason: String,
    },
    /// `stop` said so before the manager answered.
    Stopped,
}

/// Delays between attempts: `first`, doubling, capped at `max`.
#[derive(Debug, Clone, Copy)]
pub struct Backoff {
    next: Duration,
    max: Duration,
}

impl Backoff {
    pub fn new(first: Duration, max: Duration) -> Backoff {
        Backoff { next: first, max }
    }

    /// The next delay, doubling the one after it.
    pub fn next_delay(&mut self) -> Duration {
        let d = self.next.min(self.max);
        self.next = d.saturating_mul(2).min(self.max);
        d
    }
}

/// One failed attempt.
#[derive(Debug)]
enum Failure {
    /// No manager to talk to (not running, restarting, socket not there yet).
    Unreachable(io::Error),
    /// Connected, but no usable answer.
    Exchange(ControlError),
    /// A well-formed reply that does not answer a Hello.
    Unexpected(Reply),
}

/// Attempt until the manager answers or `stop()` is true; sleeps `backoff` between
/// attempts.
fn register(
    socket: &Path,
    hello: &Hello,
    mut backoff: Backoff,
    stop: impl Fn() -> bool,
) -> Outcome {
    let frame = control::encode_request(&Request::Hello(hello.clone()));
    let mut warned = false;
    loop {
        if stop() {
            return Outcome::Stopped;
        }
        let failure = match exchange(socket, &frame) {
            Ok(Reply::Welcome { host_pid }) => {
                log!(
                    DEBUG,
                    "registered with the manager at {} (allocation {:?}, slot {} generation {}): host pid {host_pid}",
                    socket.display(),
                    hello.allocation,
                    hello.slot,
                    hello.generation
                );
                return Outcome::Welcome { host_pid };
            }
            Ok(Reply::Refused { reason }) => {
                log!(
                    WARN,
                    "the manager at {} refused to register this process (allocation {:?}, slot {}): {reason}; not asking again",
                    socket.display(),
                    hello.allocation,
                    hello.slot
                );
                return Outcome::Refused { reason };
            }
            Ok(other) => Failure::Unexpected(other),
            Err(f) => f,
        };
        let delay = backoff.next_delay();
        match &failure {
            Failure::Unreachable(e) => log!(
                DEBUG,
                "cannot reach the manager at {} ({e}); retrying in {delay:?}",
                socket.display()
            ),
            Failure::Exchange(e) if !warned => {
                warned = true;
                log!(
                    WARN,
                    "registering with the manager at {}: {e}; retrying in {delay:?}",
                    socket.display()
                );
            }
            Failure::Unexpected(r) if !warned => {
                warned = true;
                log!(
                    WARN,
                    "registering with the manager at {}: it answered {r:?} to Hello; retrying in {delay:?}",
                    socket.display()
                );
            }
            other => log!(
                DEBUG,
                "registering with the manager at {}: {other:?}; retrying in {delay:?}",
                socket.display()
            ),
        }
        std::thread::sleep(delay);
    }
}

/// One attempt: connect, send the Hello frame, read one reply, close (on drop).
fn exchange(socket: &Path, frame: &[u8]) -> Result<Reply, Failure> {
    let mut s = UnixStream::connect(socket).map_err(Failure::Unreachable)?;
    let io = |e: io::Error| Failure::Exchange(ControlError::Io(e));
    s.set_read_timeout(Some(IO_TIMEOUT)).map_err(io)?;
    s.set_write_timeout(Some(IO_TIMEOUT)).map_err(io)?;
    control::write_frame(&mut s, frame).map_err(Failure::Exchange)?;
    control::read_reply(&mut s).map_err(Failure::Exchange)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;
    use std::path::PathBuf;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
    use std::sync::Arc;

    fn hello() -> Hello {
        Hello {
            allocation: "alloc-1".into(),
            slot: 2,
            generation: 5,
            pid: 77,
            start_time: 1234,
        }
    }

    fn fast() -> Backoff {
        Backoff::new(Duration::from_millis(10), Duration::from_millis(40))
    }

    /// A manager that answers each connection with `replies[i]` (None: close silently).
    fn manager(path: &Path, replies: Vec<Option<Reply>>) -> std::thread::JoinHandle<Vec<Request>> {
        let l = UnixListener::bind(path).unwrap();
        std::thread::spawn(move || {
            let mut got = Vec::new();
            for r in replies {
                let (mut s, _) = l.accept().unwrap();
                got.push(control::read_request(&mut s).unwrap());
                if let Some(r) = r {
                    control::write_frame(&mut s, &control::encode_reply(&r)).unwrap();
                }
            }
            got
        })
    }

    #[test]
    fn backoff_doubles_to_the_cap() {
        let mut b = Backoff::new(Duration::from_secs(1), Duration::from_secs(30));
        let got: Vec<u64> = (0..8).map(|_| b.next_delay().as_secs()).collect();
        assert_eq!(got, [1, 2, 4, 8, 16, 30, 30, 30]);
    }

    #[test]
    fn welcome_after_a_failed_exchange_and_an_unexpected_reply() {
        let dir = tempfile_dir();
        let path = dir.join("m.sock");
        let m = manager(
            &path,
            vec![
                None,
                Some(Reply::Pong),
                Some(Reply::Welcome { host_pid: 4242 }),
            ],
        );
        let out = register(&path, &hello(), fast(), || false);
        assert_eq!(out, Outcome::Welcome { host_pid: 4242 });
        let got = m.join().unwrap();
        assert_eq!(got, vec![Request::Hello(hello()); 3]);
    }

    #[test]
    fn refused_is_final() {
        let dir = tempfile_dir();
        let path = dir.join("m.sock");
        let m = manager(&path, vec![Some(Reply::refused("unknown allocation"))]);
        let out = register(&path, &hello(), fast(), || false);
        assert_eq!(
            out,
            Outcome::Refused {
                reason: "unknown allocation".into()
            }
        );
        assert_eq!(m.join().unwrap().len(), 1);
    }

    #[test]
    fn an_absent_manager_is_retried_until_it_appears() {
        let dir = tempfile_dir();
        let path = dir.join("m.sock");
        let tries = Arc::new(AtomicUsize::new(0));
        let t = tries.clone();
        let p = path.clone();
        let h = std::thread::spawn(move || {
            register(&p, &hello(), fast(), move || {
                t.fetch_add(1, Relaxed);
                false
            })
        });
        // Bind only once the library has failed a few times.
        while tries.load(Relaxed) < 3 {
            std::thread::sleep(Duration::from_millis(5));
        }
        let m = manager(&path, vec![Some(Reply::Welcome { host_pid: 9 })]);
        assert_eq!(h.join().unwrap(), Outcome::Welcome { host_pid: 9 });
        assert_eq!(m.join().unwrap().len(), 1);
    }

    #[test]
    fn stop_ends_the_retries() {
        let dir = tempfile_dir();
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let path = dir.join("absent.sock");
        let h =
            std::thread::spawn(move || register(&path, &hello(), fast(), move || s.load(Relaxed)));
        stop.store(true, Relaxed);
        assert_eq!(h.join().unwrap(), Outcome::Stopped);
    }

    #[test]
    fn a_silent_manager_times_out() {
        let dir = tempfile_dir();
        let path = dir.join("m.sock");
        let l = UnixListener::bind(&path).unwrap();
        let frame = control::encode_request(&Request::Hello(hello()));
        let t0 = std::time::Instant::now();
        let r = exchange(&path, &frame);
        assert!(
            matches!(r, Err(Failure::Exchange(ControlError::Io(_)))),
            "{r:?}"
        );
        assert!(t0.elapsed() < IO_TIMEOUT * 3, "{:?}", t0.elapsed());
        drop(l);
    }

    /// A fresh directory under the system temp dir, removed when dropped.
    struct TempDir(PathBuf);

    impl std::ops::Deref for TempDir {
        type Target = Path;
        fn deref(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn tempfile_dir() -> TempDir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let d = std::env::temp_dir().join(format!(
            "vcuda-register-{}-{}",
            std::process::id(),
            N.fetch_add(1, Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        TempDir(d)
    }
}
