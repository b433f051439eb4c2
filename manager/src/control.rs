//! The control socket: libvcuda in each container process says hello here, and `vcuda-smi`
//! asks what the node looks like. The socket's peer credentials give the host pid;
//! [`crate::core::Claimant::hello`] checks a claim, [`crate::core::Claimant::check_in_pod`]
//! a container's query (it sees only itself), both outside the state lock. The same
//! protocol is served on the host's query socket, which no container is given, for the
//! whole node's view. Every connection is on its own and carries one exchange: a
//! malformed, oversized or unknown message closes that connection (logged) and nothing
//! else; frames are capped by the protocol; a connection lives at most
//! [`CONNECTION_DEADLINE`] however slowly its peer sends, and one container (peer cgroup)
//! holds at most [`MAX_PER_CONTAINER`] at once.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::Semaphore;
use tracing::{debug, info, warn};
use vcuda_contract::control::{
    decode_request, encode_reply, view_frames, DecodeError, FrameDecoder, FrameError, Hello, Reply,
    Request,
};
use vcuda_contract::view::View;

use crate::core::ClaimError;
use crate::state::Shared;
use vcuda_manager_core::ids::AllocationId;

/// A connection ended without its exchange: what the log says (the peer gets nothing more,
/// the stream being unusable). Each names the peer's host pid.
#[derive(Debug, thiserror::Error)]
pub enum ConnectionError {
    #[error("pid {pid}: {source}")]
    Io { pid: u32, source: std::io::Error },
    #[error("pid {pid}: {source}")]
    Frame { pid: u32, source: FrameError },
    #[error("pid {pid}: {source}")]
    Decode { pid: u32, source: DecodeError },
}

impl ConnectionError {
    /// A short stable name for counting errors by kind.
    pub fn kind(&self) -> &'static str {
        match self {
            ConnectionError::Io { .. } => "io",
            ConnectionError::Frame { source, .. } => source.kind(),
            ConnectionError::Decode { source, .. } => source.kind(),
        }
    }
}

/// Why a query is not answered with a view. What the peer reads is [`QueryError::reply`].
#[derive(Debug, thiserror::Error)]
pub enum QueryError {
    #[error("vcuda-manager is starting and has no view yet; try again in a second")]
    Starting,
    #[error("the node's view is served on the host's query socket ({}), not in containers; here vcuda-smi shows its own container", query_socket.display())]
    NodeViewInContainer { query_socket: PathBuf },
    /// The asking process may not see the allocation: the reason is for the log only.
    #[error("{}", not_yours(allocation))]
    NotYours {
        allocation: AllocationId,
        reason: ClaimError,
    },
    #[error("allocation {allocation} is not in the manager's view yet (started in the last fraction of a second?); try again")]
    NotInView { allocation: AllocationId },
}

impl QueryError {
    /// A short stable name for counting errors by kind.
    pub fn kind(&self) -> &'static str {
        match self {
            QueryError::Starting => "starting",
            QueryError::NodeViewInContainer { .. } => "node-view-in-container",
            QueryError::NotYours { .. } => "not-yours",
            QueryError::NotInView { .. } => "not-in-view",
        }
    }

    /// What the peer reads: the message, which for [`QueryError::NotYours`] hides the
    /// reason (it goes to the log).
    pub fn reply(&self) -> Reply {
        Reply::refused(self.to_string())
    }
}

/// Longest a connection may live, from accept to the end of its one exchange: a peer
/// that sends slowly (a byte every few seconds) is cut off all the same.
const CONNECTION_DEADLINE: Duration = Duration::from_secs(5);
/// Connections served at once (each is short-lived).
const MAX_CONNECTIONS: usize = 256;
/// Connections one container (one cgroup) may hold at once: its processes register once
/// each, so a few suffice, and no container can take every permit from the others.
const MAX_PER_CONTAINER: usize = 8;
/// How often the socket file is checked for having disappeared.
const REBIND_CHECK: Duration = Duration::from_secs(1);

/// Open connections per peer cgroup (see [`MAX_PER_CONTAINER`]).
#[derive(Default)]
struct Gate {
    open: parking_lot::Mutex<std::collections::HashMap<String, usize>>,
}

/// A connection's place at the [`Gate`], given back on drop.
struct Pass {
    gate: Arc<Gate>,
    key: String,
}

impl Gate {
    fn enter(gate: &Arc<Gate>, key: String) -> Option<Pass> {
        let mut open = gate.open.lock();
        let n = open.entry(key.clone()).or_default();
        if *n >= MAX_PER_CONTAINER {
            return None;
        }
        *n += 1;
        Some(Pass {
            gate: gate.clone(),
            key,
        })
    }
}

impl Drop for Pass {
    fn drop(&mut self) {
        let mut open = self.gate.open.lock();
        if let Some(n) = open.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.key);
            }
        }
    }
}

/// Bind the control socket (replacing a stale one), world-connectable: which container a
/// process belongs to is checked per message, not by file permissions.
pub fn bind(path: &Path) -> std::io::Result<UnixListener> {
    bind_with_mode(path, 0o666)
}

/// Bind a socket at `path` that is never reachable with another mode than `mode`: bound in
/// a fresh directory only the manager can enter (0700), given its mode there, then renamed
/// into place (replacing a stale socket atomically). Bound at `path` and chmod-ed after, the
/// host's query socket was connectable by anyone, whatever the umask, until the chmod.
fn bind_with_mode(path: &Path, mode: u32) -> std::io::Result<UnixListener> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::DirBuilderExt;
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let private = dir.join(format!(
        ".{name}.bind-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::DirBuilder::new().mode(0o700).create(&private)?;
    let staged = private.join("s");
    let bound = (|| {
        // Bound through the directory's descriptor: a socket path may hold only 107 bytes,
        // and the staging path is longer than the socket's own.
        let dirfd = std::fs::File::open(&private)?;
        let short = PathBuf::from(format!("/proc/self/fd/{}/s", dirfd.as_raw_fd()));
        let l = UnixListener::bind(&short)?;
        std::fs::set_permissions(&staged, std::fs::Permissions::from_mode(mode))?;
        std::fs::rename(&staged, path)?;
        Ok(l)
    })();
    let _ = std::fs::remove_file(&staged);
    let _ = std::fs::remove_dir(&private);
    bound
}

/// Which socket a connection came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// The socket mounted into containers: registration, and queries about one's own
    /// container.
    Container,
    /// The host's query socket: the whole node.
    Node,
}

/// Bind the host's query socket (replacing a stale one), for root only: mode 0600 from the
/// moment it is reachable at `path`.
pub fn bind_host(path: &Path) -> std::io::Result<UnixListener> {
    bind_with_mode(path, 0o600)
}

/// Serve until the task is dropped. Each connection carries one exchange (a request and
/// its answer) within [`CONNECTION_DEADLINE`]; at most [`MAX_CONNECTIONS`] at once, and
/// [`MAX_PER_CONTAINER`] per peer cgroup (read from `proc_root`).
///
/// If the socket file disappears or is replaced (it is mounted read-only into containers,
/// but the host may lose it), it is bound again within [`REBIND_CHECK`].
pub async fn serve(
    mut listener: UnixListener,
    path: PathBuf,
    shared: Arc<Shared>,
    scope: Scope,
    proc_root: PathBuf,
) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let gate = Arc::new(Gate::default());
    let mut bound = inode(&path);
    let mut check = tokio::time::interval(REBIND_CHECK);
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = check.tick() => {
                if inode(&path) != bound || bound.is_none() {
                    let again = match scope {
                        Scope::Container => bind(&path),
                        Scope::Node => bind_host(&path),
                    };
                    match again {
                        Ok(l) => {
                            warn!(path = %path.display(), "the socket file was gone or replaced: bound it again");
                            listener = l;
                            bound = inode(&path);
                        }
                        Err(e) => warn!(path = %path.display(), error = %e, "cannot bind the socket again"),
                    }
                }
                continue;
            }
        };
        let (stream, _) = match accepted {
            Ok(s) => s,
            Err(e) => {
                warn!(error = %e, "control socket: accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Some(pid) = peer_pid(&stream) else {
            debug!("control socket: a peer without credentials, dropped");
            continue;
        };
        // Which container: its cgroup (the kernel's word, not the peer's). An unreadable one
        // (the process is gone) shares one key with every other such peer.
        let cgroup = std::fs::read_to_string(proc_root.join(pid.to_string()).join("cgroup"))
            .unwrap_or_default();
        let Some(pass) = Gate::enter(&gate, cgroup) else {
            debug!(pid, "control socket: its container holds {MAX_PER_CONTAINER} connections already; dropped");
            continue;
        };
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            debug!("control socket: too many connections, dropping one");
            continue;
        };
        let shared = shared.clone();
        tokio::spawn(async move {
            let _held = (permit, pass);
            match tokio::time::timeout(CONNECTION_DEADLINE, connection(stream, pid, &shared, scope))
                .await
            {
                Ok(Ok(())) => {}
                Ok(Err(e)) => warn!(reason = %e, "control socket: connection closed"),
                Err(_) => warn!(
                    pid,
                    "control socket: no complete exchange within {CONNECTION_DEADLINE:?}; closed"
                ),
            }
        });
    }
}

/// The (device, inode) of the socket file at `path`, if it is a socket.
fn inode(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let m = std::fs::symlink_metadata(path).ok()?;
    m.file_type().is_socket().then(|| (m.dev(), m.ino()))
}

fn peer_pid(stream: &UnixStream) -> Option<u32> {
    let pid = stream.peer_cred().ok()?.pid()?;
    u32::try_from(pid).ok()
}

/// One exchange: a request, its answer, and the connection closes.
async fn connection(
    mut stream: UnixStream,
    pid: u32,
    shared: &Shared,
    scope: Scope,
) -> Result<(), ConnectionError> {
    let io = |source| ConnectionError::Io { pid, source };
    let mut dec = FrameDecoder::default();
    let mut buf = [0u8; 4096];
    let frame = loop {
        if let Some(f) = dec
            .next_frame()
            .map_err(|source| ConnectionError::Frame { pid, source })?
        {
            break f;
        }
        let n = stream.read(&mut buf).await.map_err(io)?;
        if n == 0 {
            return Ok(()); // closed
        }
        dec.push(&buf[..n]);
    };
    let request =
        decode_request(&frame).map_err(|source| ConnectionError::Decode { pid, source })?;
    let reply = match request {
        Request::Ping => Reply::Pong,
        Request::Query { allocation } => {
            match query(shared, scope, allocation.map(AllocationId::from), pid) {
                Ok(view) => {
                    for f in view_frames(&view) {
                        stream.write_all(&f).await.map_err(io)?;
                    }
                    return Ok(());
                }
                Err(e) => {
                    match &e {
                        QueryError::NotYours { allocation, reason } => {
                            warn!(pid, %allocation, %reason, "query refused")
                        }
                        _ => debug!(pid, reason = %e, "query refused"),
                    }
                    e.reply()
                }
            }
        }
        Request::Hello(_) if scope == Scope::Node => Reply::refused(
            "processes register on the container's socket, not the host's query socket",
        ),
        Request::Hello(h) => {
            // The wire's string is an allocation id from here on.
            let allocation = AllocationId::new(h.allocation.as_str());
            match register(shared, &allocation, &h, pid) {
                Ok(host_pid) => {
                    info!(pid, %allocation, slot = h.slot, "process registered");
                    Reply::Welcome { host_pid }
                }
                Err(reason) => {
                    warn!(pid, %allocation, %reason, kind = reason.kind(), "registration refused");
                    // Whatever the reason, the peer reads the one neutral refusal.
                    Reply::refused(not_yours(&allocation))
                }
            }
        }
    };
    stream.write_all(&encode_reply(&reply)).await.map_err(io)
}

/// The one answer a container gets when it may not act for `allocation`, whether the
/// allocation is another container's or does not exist: telling those apart (or naming the
/// pod that holds it) would let a tenant probe its neighbours. The reason goes to the log.
fn not_yours(allocation: &AllocationId) -> String {
    let allocation = allocation.as_str();
    format!("this process does not belong to allocation {allocation:?} on this node (or there is no such allocation); the node's vcuda-manager log says why")
}

/// Check a process's `Hello` and record it. The state lock is held only to look the
/// allocation up (a statement of its own: a guard in a `match` scrutinee would live through
/// the whole match); the checks read /proc and the container's region without it, so a
/// container cannot stall the kubelet's calls through them.
fn register(
    shared: &Shared,
    allocation: &AllocationId,
    hello: &Hello,
    pid: u32,
) -> Result<u32, ClaimError> {
    let claimant = shared.core.lock().claimant(allocation)?;
    let registration = claimant.hello(hello, pid)?;
    shared.core.lock().register(pid, registration);
    Ok(pid)
}

/// What a query on `scope`'s socket from host process `pid` may see.
fn query(
    shared: &Shared,
    scope: Scope,
    allocation: Option<AllocationId>,
    pid: u32,
) -> Result<View, QueryError> {
    if shared.view.lock().schema == 0 {
        return Err(QueryError::Starting);
    }
    match (scope, allocation) {
        (Scope::Node, None) => Ok(shared.view.lock().clone()),
        (Scope::Container, None) => Err(QueryError::NodeViewInContainer {
            query_socket: shared.core.lock().settings.query_socket_path(),
        }),
        (scope, Some(id)) => {
            if scope == Scope::Container {
                let claimant = shared.core.lock().claimant(&id);
                if let Err(reason) = claimant.and_then(|c| c.check_in_pod(pid)) {
                    return Err(QueryError::NotYours {
                        allocation: id,
                        reason,
                    });
                }
            }
            shared
                .view
                .lock()
                .only(id.as_str())
                .ok_or(QueryError::NotInView { allocation: id })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileTypeExt;

    fn mode(p: &Path) -> u32 {
        std::fs::metadata(p)
            .expect("socket exists")
            .permissions()
            .mode()
            & 0o777
    }

    /// The host's query socket is 0600 and the containers' socket 0666 from the moment
    /// either exists at its path (issue 14: the query socket was bound 0666 and chmod-ed
    /// after); a stale socket is replaced; nothing of the staging is left behind.
    #[tokio::test]
    async fn sockets_appear_with_their_mode_and_replace_a_stale_one() {
        let top = tempfile::tempdir().expect("tempdir");
        // Deep enough that a staging directory beside the socket would pass the 107 bytes
        // a socket path may hold (the e2e tests' paths are this long).
        let dir = top.path().join("d".repeat(40)).join("e".repeat(30));
        std::fs::create_dir_all(&dir).unwrap();
        let host = dir.join("query.sock");
        let l = bind_host(&host).expect("bind the query socket");
        assert!(std::fs::metadata(&host).unwrap().file_type().is_socket());
        assert_eq!(mode(&host), 0o600);
        UnixStream::connect(&host).await.expect("connectable");
        drop(l);
        // Bound again over the stale file (a restart).
        let _l = bind_host(&host).expect("bind over a stale socket");
        assert_eq!(mode(&host), 0o600);
        let ctl = dir.join("vcuda.sock");
        let _c = bind(&ctl).expect("bind the control socket");
        assert_eq!(mode(&ctl), 0o666);
        let mut names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, ["query.sock", "vcuda.sock"]);
    }

    /// A container asking about another's allocation reads the one neutral refusal: not
    /// the pod that holds it, nor whether it exists (the reason goes to the log).
    #[test]
    fn a_refused_query_tells_the_peer_nothing_of_the_reason() {
        let e = QueryError::NotYours {
            allocation: "a1".into(),
            reason: ClaimError::NotInPod {
                host_pid: 7,
                owner: "default/victim/main".into(),
                uid: "u".into(),
                allocation: "a1".into(),
            },
        };
        assert_eq!(e.kind(), "not-yours");
        let Reply::Refused { reason } = e.reply() else {
            panic!("not a refusal")
        };
        assert_eq!(reason, not_yours(&"a1".into()));
        assert!(!reason.contains("victim"), "{reason}");
        let Reply::Refused { reason } = (QueryError::NodeViewInContainer {
            query_socket: "/run/vcuda/query.sock".into(),
        })
        .reply() else {
            panic!("not a refusal")
        };
        assert!(
            reason.contains("host's query socket (/run/vcuda/query.sock)"),
            "{reason}"
        );
    }

    /// Whatever sits at the socket's path (a symlink to a file the manager can write, say)
    /// is replaced, never followed: the rename swaps the name, the target is untouched.
    #[tokio::test]
    async fn a_symlink_planted_at_the_socket_path_is_replaced_not_followed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let target = dir.path().join("precious");
        std::fs::write(&target, b"keep").unwrap();
        let path = dir.path().join("query.sock");
        std::os::unix::fs::symlink(&target, &path).unwrap();
        let _l = bind_host(&path).expect("bind over the symlink");
        let meta = std::fs::symlink_metadata(&path).unwrap();
        assert!(meta.file_type().is_socket(), "{:?}", meta.file_type());
        assert_eq!(mode(&path), 0o600);
        assert_eq!(std::fs::read(&target).unwrap(), b"keep");
        assert!(std::fs::metadata(&target).unwrap().is_file());
    }
}
