//! The control socket: libvcuda in each container process says hello here, and `vcuda-smi`
//! asks what the node looks like. The socket's peer credentials give the host pid;
//! [`crate::core::Core::hello`] checks a claim, [`crate::core::Core::check_in_pod`] a
//! container's query (it sees only itself). The same protocol is served on the host's
//! query socket, which no container is given, for the whole node's view. Every
//! connection is on its own: a malformed, oversized or unknown message closes that
//! connection (logged) and nothing else; frames are capped by the protocol; a peer that
//! sends nothing is dropped after a timeout.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::Semaphore;
use tracing::{debug, info, warn};
use vcuda_contract::control::{
    decode_request, encode_reply, view_frames, FrameDecoder, Hello, Reply, Request,
};

use crate::plugin::Shared;

/// Longest a connection may take to deliver a frame.
const FRAME_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections served at once (each is short-lived).
const MAX_CONNECTIONS: usize = 256;

/// Bind the control socket (replacing a stale one), world-connectable: which container a
/// process belongs to is checked per message, not by file permissions.
pub fn bind(path: &Path) -> std::io::Result<UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let l = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))?;
    Ok(l)
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

/// Bind the host's query socket (replacing a stale one), for root only.
pub fn bind_host(path: &Path) -> std::io::Result<UnixListener> {
    let l = bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(l)
}

/// Serve until the task is dropped.
pub async fn serve(listener: UnixListener, shared: Arc<Shared>, scope: Scope) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                warn!(error = %e, "control socket: accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            debug!("control socket: too many connections, dropping one");
            continue;
        };
        let shared = shared.clone();
        tokio::spawn(async move {
            let _permit = permit;
            if let Err(e) = connection(stream, &shared, scope).await {
                warn!(reason = %e, "control socket: connection closed");
            }
        });
    }
}

async fn connection(mut stream: UnixStream, shared: &Shared, scope: Scope) -> Result<(), String> {
    let pid = stream
        .peer_cred()
        .map_err(|e| format!("no peer credentials: {e}"))?
        .pid()
        .and_then(|p| u32::try_from(p).ok())
        .ok_or("the peer's pid is unknown")?;
    let mut dec = FrameDecoder::default();
    let mut buf = [0u8; 4096];
    loop {
        let frame = loop {
            if let Some(f) = dec.next_frame().map_err(|e| format!("pid {pid}: {e}"))? {
                break f;
            }
            let n = tokio::time::timeout(FRAME_TIMEOUT, stream.read(&mut buf))
                .await
                .map_err(|_| format!("pid {pid}: no complete message within {FRAME_TIMEOUT:?}"))?
                .map_err(|e| format!("pid {pid}: {e}"))?;
            if n == 0 {
                return Ok(()); // closed
            }
            dec.push(&buf[..n]);
        };
        let reply = match decode_request(&frame).map_err(|e| format!("pid {pid}: {e}"))? {
            Request::Ping => Reply::Pong,
            Request::Query { allocation } => match query(shared, scope, allocation, pid) {
                Ok(view) => {
                    for f in view_frames(&view) {
                        stream
                            .write_all(&f)
                            .await
                            .map_err(|e| format!("pid {pid}: {e}"))?;
                    }
                    continue;
                }
                Err(reason) => {
                    debug!(pid, %reason, "query refused");
                    Reply::refused(&reason)
                }
            },
            Request::Hello(_) if scope == Scope::Node => Reply::refused(
                "processes register on the container's socket, not the host's query socket",
            ),
            Request::Hello(h) => match register(shared, &h, pid) {
                Ok(host_pid) => {
                    info!(pid, allocation = %h.allocation, slot = h.slot, "process registered");
                    Reply::Welcome { host_pid }
                }
                Err(reason) => {
                    warn!(pid, allocation = %h.allocation, %reason, "registration refused");
                    Reply::refused(not_yours(&h.allocation))
                }
            },
        };
        let refused = matches!(reply, Reply::Refused { .. });
        stream
            .write_all(&encode_reply(&reply))
            .await
            .map_err(|e| format!("pid {pid}: {e}"))?;
        if refused {
            return Ok(());
        }
    }
}

/// The one answer a container gets when it may not act for `allocation`, whether the
/// allocation is another container's or does not exist: telling those apart (or naming the
/// pod that holds it) would let a tenant probe its neighbours. The reason goes to the log.
fn not_yours(allocation: &str) -> String {
    format!("this process does not belong to allocation {allocation:?} on this node (or there is no such allocation); the node's vcuda-manager log says why")
}

/// Check a process's `Hello` and record it. The state lock is held only to look the
/// allocation up (a statement of its own: a guard in a `match` scrutinee would live through
/// the whole match); the checks read /proc and the container's region without it, so a
/// container cannot stall the kubelet's calls through them.
fn register(shared: &Shared, hello: &Hello, pid: u32) -> Result<u32, String> {
    let claimant = shared.core.lock().claimant(&hello.allocation)?;
    claimant.hello(hello, pid)
}

/// What a query on `scope`'s socket from host process `pid` may see.
fn query(
    shared: &Shared,
    scope: Scope,
    allocation: Option<String>,
    pid: u32,
) -> Result<vcuda_contract::view::View, String> {
    if shared.view.lock().schema == 0 {
        return Err("vcuda-manager is starting and has no view yet; try again in a second".into());
    }
    match (scope, allocation) {
        (Scope::Node, None) => Ok(shared.view.lock().clone()),
        (Scope::Container, None) => Err(format!(
            "the node's view is served on the host's query socket ({}), not in containers; \
             here vcuda-smi shows its own container",
            shared.core.lock().settings.query_socket_path().display()
        )),
        (scope, Some(id)) => {
            if scope == Scope::Container {
                let claimant = shared.core.lock().claimant(&id);
                if let Err(reason) = claimant.and_then(|c| c.check_in_pod(pid)) {
                    warn!(pid, allocation = %id, %reason, "query refused");
                    return Err(not_yours(&id));
                }
            }
            shared.view.lock().only(&id).ok_or_else(|| {
                format!("allocation {id} is not in the manager's view yet (started in the last fraction of a second?); try again")
            })
        }
    }
}
