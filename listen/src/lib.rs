//! A bounded HTTP/1.1 listener (I/O): what any client can hold of a server is capped, so
//! nothing a client does (opening many connections, sending slowly, sending nothing) can
//! stall the server for its other clients or exhaust its memory or file descriptors.
//! vcuda-scheduler serves its extender (over TLS) and its `/metrics` with [`serve`],
//! vcuda-manager its `/metrics` (../shared/reference/threat-model.md: bounded connections and
//! deadlines on every socket a tenant can reach).
//!
//! Every connection:
//! - needs a permit: at most [`Limits::max_connections`] are served at once. When all are
//!   held, the listener accepts the next connection and makes room for it by closing the
//!   connection idle the longest (no request in progress: still in its handshake or
//!   sending its first request's headers, or between keep-alive requests), once that one
//!   has been idle for [`EVICT_AFTER`] ([`idle`] decides). A connection with a request in
//!   progress (from its headers until its response is handed over) is never closed for
//!   room: if every one is busy, the new connection waits, and those behind it wait in the
//!   kernel's accept queue. So a flood of idle connections delays a client by the flood's
//!   accept-queue backlog at `max_connections` per [`EVICT_AFTER`], not by a header deadline
//!   per `max_connections` of them, and cannot make the process run out of memory or
//!   descriptors (`max_connections` served, plus the one being made room for);
//! - finishes its [`Handshake`] (TLS, for instance; none for [`Plain`]) within
//!   [`Limits::header_timeout`];
//! - sends each request's headers within [`Limits::header_timeout`] (hyper's
//!   `header_read_timeout`, which also ends idle keep-alive connections) and its body, of at
//!   most the `max_body` bytes [`serve`] is given, within [`Limits::body_timeout`]
//!   ([`body_deadline`]), else is closed.
//!
//! Connections beyond the permits wait in the kernel's accept queue: [`bind`] makes it
//! [`BACKLOG`] long (std's and tokio's `bind` ask for 128). An attacker holding more idle
//! connections than the permits plus that queue keeps the queue full, so a new client's SYN
//! races the flood's reconnections for a place (a dropped SYN is retried after 1 s, then
//! 3 s); the server's memory and descriptors stay bounded all the same.
//!
//! - [`idle`] — which connection to close for room (pure, property-tested).

#![forbid(unsafe_code)]

pub mod idle;

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::{oneshot, Notify, OwnedSemaphorePermit, Semaphore, TryAcquireError};

use crate::idle::{ConnId, Eviction, Idle};

/// The bounds every connection is held to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// The handshake, and each request's headers (and idle time between requests).
    pub header_timeout: Duration,
    /// Each request's body, from its headers on.
    pub body_timeout: Duration,
    /// Connections served at once (when all are held, the one idle the longest makes room
    /// for a new one).
    pub max_connections: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            max_connections: 256,
        }
    }
}

/// How long a connection must have been idle before a new one may close it to take its
/// permit: a client that has just connected gets at least this long (and until
/// `max_connections - 1` newer connections have come) to finish its handshake and send its
/// request's headers, a round trip or two. Short, because it sets how fast a flood drains
/// (`max_connections` per this long): while the flood outpaces that, the kernel's accept
/// queue stays full and drops new clients' SYNs (each retried after 1 s, then 3 s).
pub const EVICT_AFTER: Duration = Duration::from_millis(20);

/// The accept queue [`bind`] asks for (the kernel caps it at `net.core.somaxconn`, 4096 by
/// default since Linux 5.4): a flood of idle connections up to this many beyond the permits
/// waits there, costing the server no descriptor, and a new client still finds a place
/// behind it (draining at `max_connections` per [`EVICT_AFTER`]).
pub const BACKLOG: u32 = 1024;

/// A listener on `addr` (address reuse on, as `TcpListener::bind`) with an accept queue of
/// [`BACKLOG`]. Call it inside a Tokio runtime.
pub fn bind(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(BACKLOG)
}

/// What an accepted connection goes through before HTTP is served on it, within
/// [`Limits::header_timeout`] (else it is closed): nothing ([`Plain`]) or, say, a TLS
/// handshake.
pub trait Handshake: Clone + Send + Sync + 'static {
    /// The stream HTTP is served on.
    type Io: AsyncRead + AsyncWrite + Unpin + Send + 'static;

    /// The stream to serve, or `None` to close the connection (the implementation logs
    /// why).
    fn handshake(
        &self,
        stream: TcpStream,
        peer: SocketAddr,
    ) -> impl Future<Output = Option<Self::Io>> + Send;
}

/// Plain HTTP: no handshake.
#[derive(Debug, Clone, Copy, Default)]
pub struct Plain;

impl Handshake for Plain {
    type Io = TcpStream;

    async fn handshake(&self, stream: TcpStream, _peer: SocketAddr) -> Option<TcpStream> {
        Some(stream)
    }
}

/// Middleware: read the whole body (at most `max_body` bytes) within `limit`, else answer
/// 400 (too large, or unreadable), or 408 and close.
pub async fn body_deadline(limit: Duration, max_body: usize, req: Request, next: Next) -> Response {
    let (parts, body) = req.into_parts();
    match tokio::time::timeout(limit, axum::body::to_bytes(body, max_body)).await {
        Ok(Ok(bytes)) => {
            next.run(Request::from_parts(parts, Body::from(bytes)))
                .await
        }
        Ok(Err(e)) => (
            StatusCode::BAD_REQUEST,
            format!("cannot read the request body (at most {max_body} bytes): {e}"),
        )
            .into_response(),
        Err(_) => {
            tracing::warn!(path = %parts.uri.path(), timeout = ?limit, "request body not received in time; connection closed");
            (
                StatusCode::REQUEST_TIMEOUT,
                [(axum::http::header::CONNECTION, "close")],
                format!("the request body did not arrive within {limit:?} (the body deadline)"),
            )
                .into_response()
        }
    }
}

/// Serve `app` on `listener` until the process ends: each connection through `handshake`,
/// held to `limits`, request bodies of at most `max_body` bytes; when all
/// `limits.max_connections` are held, a new connection takes the place of the one idle the
/// longest (see the crate's documentation). Returns only if the permits' semaphore closes
/// (it never does).
pub async fn serve<H: Handshake>(
    listener: TcpListener,
    app: Router,
    handshake: H,
    limits: Limits,
    max_body: usize,
) -> io::Result<()> {
    let app = app
        .layer(axum::middleware::from_fn(move |req, next| {
            body_deadline(limits.body_timeout, max_body, req, next)
        }))
        .layer(axum::extract::DefaultBodyLimit::max(max_body));
    let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let conns = Arc::new(Conns::default());
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(s) => s,
            // Out of descriptors, or the peer went away before accept: not the server's end.
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let permit = match permits.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(TryAcquireError::NoPermits) => make_room(&permits, &conns).await?,
            Err(e @ TryAcquireError::Closed) => return Err(io::Error::other(e)),
        };
        let _ = stream.set_nodelay(true);
        let app = app.clone();
        let handshake = handshake.clone();
        let conns = conns.clone();
        tokio::spawn(async move {
            let _permit = permit;
            // Registered (idle, so closable for room) only once this task runs: it reads
            // whatever the client has already sent in this same poll, so a request waiting
            // in the socket is in progress before the connection can be chosen.
            let (close, closed) = oneshot::channel::<()>();
            let id = conns.lock().admit(Instant::now(), close);
            conns.changed.notify_one();
            let _registered = Registered(conns.clone(), id);
            let service = Tracked {
                inner: TowerToHyperService::new(app),
                conns,
                id,
            };
            let work = async move {
                match tokio::time::timeout(limits.header_timeout, handshake.handshake(stream, peer))
                    .await
                {
                    Ok(Some(io)) => connection(TokioIo::new(io), service, limits, peer).await,
                    Ok(None) => {} // refused: the handshake said why
                    Err(_) => {
                        tracing::warn!(%peer, "handshake not finished in time; closed")
                    }
                }
            };
            tokio::select! {
                () = work => {}
                // the sender dropped: chosen by `make_room` (idle, so no request is cut)
                _ = closed => tracing::debug!(%peer, "idle connection closed to make room for a new one"),
            }
        });
    }
}

/// The live connections of one [`serve`]: which are idle, and a signal each time one is
/// registered or becomes idle (the accept loop may be waiting for one to close).
#[derive(Default)]
struct Conns {
    idle: Mutex<Idle<oneshot::Sender<()>>>,
    changed: Notify,
}

impl Conns {
    fn lock(&self) -> MutexGuard<'_, Idle<oneshot::Sender<()>>> {
        // the registry's operations cannot panic halfway: its state stays consistent
        self.idle.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// All permits are held and a connection is waiting: close the connection idle the longest
/// (once idle for [`EVICT_AFTER`]) and take its permit, or wait for a permit, for that one
/// to ripen, or for a busy one to become idle.
async fn make_room(permits: &Arc<Semaphore>, conns: &Conns) -> io::Result<OwnedSemaphorePermit> {
    loop {
        let eviction = conns.lock().evict(Instant::now(), EVICT_AFTER);
        let ripe = match eviction {
            // dropping its sender ends its task, which releases its permit
            Eviction::Close(_, close) => {
                drop(close);
                return permits
                    .clone()
                    .acquire_owned()
                    .await
                    .map_err(io::Error::other);
            }
            Eviction::NotBefore(t) => Some(tokio::time::Instant::from_std(t)),
            Eviction::AllBusy => None,
        };
        let ripens = async {
            match ripe {
                Some(t) => tokio::time::sleep_until(t).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            p = permits.clone().acquire_owned() => return p.map_err(io::Error::other),
            () = ripens => {}
            () = conns.changed.notified() => {}
        }
    }
}

/// Unregisters a connection when its task ends (however it ends).
struct Registered(Arc<Conns>, ConnId);

impl Drop for Registered {
    fn drop(&mut self) {
        self.0.lock().remove(self.1);
    }
}

/// A request in progress on a connection: from its headers until its response body has
/// been handed to the connection (or dropped); then the connection is idle again.
struct Busy(Arc<Conns>, ConnId);

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.lock().end(self.1, Instant::now());
        self.0.changed.notify_one();
    }
}

/// The connection's service: `inner`, with each request marked in progress on the
/// connection's entry in `conns` while it is served.
#[derive(Clone)]
struct Tracked {
    inner: TowerToHyperService<Router>,
    conns: Arc<Conns>,
    id: ConnId,
}

type Served = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

impl hyper::service::Service<hyper::Request<hyper::body::Incoming>> for Tracked {
    type Response = Response;
    type Error = Infallible;
    type Future = Served;

    fn call(&self, req: hyper::Request<hyper::body::Incoming>) -> Served {
        if !self.conns.lock().begin(self.id) {
            // closed for room an instant ago (its task ends at its next poll): serve nothing
            return Box::pin(std::future::ready(Ok((
                StatusCode::SERVICE_UNAVAILABLE,
                [(axum::http::header::CONNECTION, "close")],
                "the connection was closed to make room for another; retry",
            )
                .into_response())));
        }
        let busy = Busy(self.conns.clone(), self.id);
        let served = hyper::service::Service::call(&self.inner, req);
        Box::pin(async move {
            let response = served.await?;
            Ok(response.map(|body| Body::new(Guarded { body, _busy: busy })))
        })
    }
}

/// A response body that keeps its request in progress until hyper has taken its last
/// frame (hyper drops the body then).
struct Guarded {
    body: Body,
    _busy: Busy,
}

impl hyper::body::Body for Guarded {
    type Data = hyper::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

async fn connection<I>(io: TokioIo<I>, service: Tracked, limits: Limits, peer: SocketAddr)
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let served = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .serve_connection(io, service)
        .await;
    if let Err(e) = served {
        tracing::debug!(%peer, error = %e, "connection ended");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::sync::mpsc;

    /// A listener with `max` permits and the header deadline `header`, serving `/ok` at
    /// once and `/hold`, which reports on `entered` and answers once the test adds a permit
    /// to the returned semaphore.
    async fn server_with<H: Handshake>(
        max: usize,
        header: Duration,
        handshake: H,
    ) -> (SocketAddr, mpsc::UnboundedReceiver<()>, Arc<Semaphore>) {
        let (tx, entered) = mpsc::unbounded_channel();
        let release = Arc::new(Semaphore::new(0));
        let held = release.clone();
        let app = Router::new()
            .route("/ok", axum::routing::get(|| async { "ok" }))
            .route(
                "/hold",
                axum::routing::get(move || {
                    let (tx, held) = (tx.clone(), held.clone());
                    async move {
                        let _ = tx.send(());
                        held.acquire().await.unwrap().forget();
                        "held"
                    }
                }),
            );
        let listener = bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = listener.local_addr().unwrap();
        let limits = Limits {
            header_timeout: header,
            body_timeout: Duration::from_secs(60),
            max_connections: max,
        };
        tokio::spawn(serve(listener, app, handshake, limits, 64));
        (addr, entered, release)
    }

    /// Plain HTTP, each connection's peer address sent on `0` once it is registered (its
    /// handshake runs right after), so a test knows the order connections became idle in.
    #[derive(Clone)]
    struct Announce(mpsc::UnboundedSender<SocketAddr>);

    impl Handshake for Announce {
        type Io = TcpStream;

        async fn handshake(&self, stream: TcpStream, peer: SocketAddr) -> Option<TcpStream> {
            let _ = self.0.send(peer);
            Some(stream)
        }
    }

    /// `server_with` over [`Announce`], with no deadline that would end a connection during
    /// a test; and the receiver of the registered connections' addresses.
    async fn server(
        max: usize,
    ) -> (
        SocketAddr,
        mpsc::UnboundedReceiver<()>,
        Arc<Semaphore>,
        mpsc::UnboundedReceiver<SocketAddr>,
    ) {
        let (tx, registered) = mpsc::unbounded_channel();
        let (addr, entered, release) =
            server_with(max, Duration::from_secs(60), Announce(tx)).await;
        (addr, entered, release, registered)
    }

    /// A connection to `addr`, once the server has registered it.
    async fn registered(
        addr: SocketAddr,
        registered: &mut mpsc::UnboundedReceiver<SocketAddr>,
    ) -> TcpStream {
        let s = TcpStream::connect(addr).await.unwrap();
        let me = s.local_addr().unwrap();
        while registered.recv().await.unwrap() != me {}
        s
    }

    async fn send(s: &mut TcpStream, path: &str) {
        let req = format!("GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await.unwrap();
    }

    /// Everything the server sends until it closes (a reset counts as a close).
    async fn until_closed(s: &mut TcpStream, within: Duration) -> String {
        let mut got = Vec::new();
        match tokio::time::timeout(within, s.read_to_end(&mut got)).await {
            Ok(_) => String::from_utf8_lossy(&got).into_owned(),
            Err(_) => panic!("still open after {within:?}; got {got:?}"),
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_new_connection_takes_the_place_of_the_one_idle_the_longest_never_a_busy_one() {
        let (addr, mut entered, release, mut reg) = server(3).await;
        let mut busy = TcpStream::connect(addr).await.unwrap();
        send(&mut busy, "/hold").await;
        entered.recv().await.unwrap();
        let mut oldest = registered(addr, &mut reg).await; // connected, sends nothing
        let mut newer = registered(addr, &mut reg).await;
        let started = std::time::Instant::now();
        let mut client = TcpStream::connect(addr).await.unwrap();
        send(&mut client, "/ok").await;
        let answer = until_closed(&mut client, Duration::from_secs(5)).await;
        assert!(
            answer.starts_with("HTTP/1.1 200") && answer.ends_with("ok"),
            "{answer}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "waited {:?} behind idle connections",
            started.elapsed()
        );
        assert_eq!(until_closed(&mut oldest, Duration::from_secs(1)).await, "");
        // the one mid-request was kept, and so was the younger idle one
        release.add_permits(1);
        let answer = until_closed(&mut busy, Duration::from_secs(5)).await;
        assert!(answer.ends_with("held"), "{answer}");
        send(&mut newer, "/ok").await;
        let answer = until_closed(&mut newer, Duration::from_secs(5)).await;
        assert!(answer.ends_with("ok"), "{answer}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn with_every_connection_busy_a_new_one_waits_for_one_to_finish() {
        let (addr, mut entered, release, _reg) = server(1).await;
        let mut busy = TcpStream::connect(addr).await.unwrap();
        send(&mut busy, "/hold").await;
        entered.recv().await.unwrap();
        let mut waiting = TcpStream::connect(addr).await.unwrap();
        send(&mut waiting, "/ok").await;
        let mut buf = [0u8; 64];
        let early = tokio::time::timeout(Duration::from_millis(500), waiting.read(&mut buf)).await;
        assert!(
            early.is_err(),
            "answered while the only permit was busy: {early:?}"
        );
        release.add_permits(1);
        let answer = until_closed(&mut busy, Duration::from_secs(5)).await;
        assert!(
            answer.ends_with("held"),
            "the busy connection was cut: {answer}"
        );
        let answer = until_closed(&mut waiting, Duration::from_secs(5)).await;
        assert!(answer.ends_with("ok"), "{answer}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_idle_keep_alive_connection_makes_room_after_its_response() {
        let (addr, _entered, _release, _reg) = server(1).await;
        let mut kept = TcpStream::connect(addr).await.unwrap();
        kept.write_all(b"GET /ok HTTP/1.1\r\nHost: t\r\n\r\n")
            .await
            .unwrap();
        let mut buf = vec![0u8; 1024];
        let n = kept.read(&mut buf).await.unwrap();
        let first = String::from_utf8_lossy(&buf[..n]).into_owned();
        assert!(
            first.starts_with("HTTP/1.1 200") && first.ends_with("ok"),
            "{first}"
        );
        // kept alive and idle now: the next client gets its permit
        let mut client = TcpStream::connect(addr).await.unwrap();
        send(&mut client, "/ok").await;
        let answer = until_closed(&mut client, Duration::from_secs(5)).await;
        assert!(answer.ends_with("ok"), "{answer}");
        assert_eq!(until_closed(&mut kept, Duration::from_secs(1)).await, "");
    }

    /// A handshake that never finishes (a client stalling in TLS, say).
    #[derive(Clone)]
    struct Stalls;

    impl Handshake for Stalls {
        type Io = TcpStream;

        async fn handshake(&self, _stream: TcpStream, _peer: SocketAddr) -> Option<TcpStream> {
            std::future::pending().await
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_handshake_not_finished_by_the_header_deadline_is_closed() {
        let (addr, _entered, _release) = server_with(4, Duration::from_millis(300), Stalls).await;
        let mut s = TcpStream::connect(addr).await.unwrap();
        let started = std::time::Instant::now();
        assert_eq!(until_closed(&mut s, Duration::from_secs(5)).await, "");
        assert!(
            started.elapsed() >= Duration::from_millis(250),
            "closed after {:?}, before the deadline",
            started.elapsed()
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn headers_that_never_end_are_closed_at_the_deadline_and_a_body_past_the_cap_refused() {
        let (addr, _entered, _release) = server_with(4, Duration::from_millis(300), Plain).await;
        let mut slow = TcpStream::connect(addr).await.unwrap();
        let started = std::time::Instant::now();
        slow.write_all(b"GET /ok HTTP/1.1\r\nHost: t\r\n")
            .await
            .unwrap();
        let answer = until_closed(&mut slow, Duration::from_secs(5)).await;
        assert!(
            answer.is_empty() || answer.starts_with("HTTP/1.1 408"),
            "{answer}"
        );
        assert!(
            started.elapsed() >= Duration::from_millis(250),
            "closed after {:?}, before the deadline",
            started.elapsed()
        );
        let mut big = TcpStream::connect(addr).await.unwrap();
        let mut req =
            b"GET /ok HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Length: 65\r\n\r\n"
                .to_vec();
        req.extend([b'x'; 65]);
        big.write_all(&req).await.unwrap();
        let answer = until_closed(&mut big, Duration::from_secs(5)).await;
        assert!(
            answer.starts_with("HTTP/1.1 400") && answer.contains("at most 64 bytes"),
            "{answer}"
        );
    }

    #[tokio::test]
    async fn the_accept_queue_holds_a_flood_beyond_std_s_128() {
        let listener = bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = listener.local_addr().unwrap();
        // nothing accepts: every connection waits in the queue; past a full queue the
        // kernel drops the SYN and the connect takes a 1 s retry at least
        let mut held = Vec::new();
        for i in 0..300 {
            match tokio::time::timeout(Duration::from_millis(900), TcpStream::connect(addr)).await {
                Ok(s) => held.push(s.unwrap()),
                Err(_) => panic!("connection {i} found the accept queue full"),
            }
        }
    }
}
