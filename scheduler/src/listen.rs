//! The extender's listener (I/O): TLS that admits only clients holding a certificate from
//! `--client-ca` (kube-scheduler's), and bounds on what any client can hold.
//!
//! The extender acts with kube-scheduler's cluster-wide binding right, so who may call it
//! matters as much as what it checks. Every connection:
//! - needs a permit: at most [`Limits::max_connections`] are served at once. When all are
//!   held, the listener accepts the next connection and makes room for it by closing the
//!   connection idle the longest (no request in progress: still in its TLS handshake or
//!   sending its first request's headers, or between keep-alive requests), once that one
//!   has been idle for [`EVICT_AFTER`] ([`crate::idle`] decides). A connection with a
//!   request in progress (from its headers until its response is handed over) is never
//!   closed for room: if every one is busy, the new connection waits, and those behind it
//!   wait in the kernel's accept queue. So a flood of idle connections delays a client by
//!   the flood's accept-queue backlog at `max_connections` per [`EVICT_AFTER`], not by a
//!   header deadline per `max_connections` of them, and cannot make the process run out of
//!   memory or descriptors (`max_connections` served, plus the one being made room for);
//! - finishes its TLS handshake within [`Limits::header_timeout`] (a client without an
//!   acceptable certificate is refused there, before a byte of HTTP is read);
//! - sends each request's headers within [`Limits::header_timeout`] (hyper's
//!   `header_read_timeout`, which also ends idle keep-alive connections) and its body within
//!   [`Limits::body_timeout`] ([`body_deadline`]), else is closed.
//!
//! Certificates are read once at start: rotate them by restarting the pods (a rolling
//! restart of the Deployment, whose replicas share nothing).

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
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
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use thiserror::Error;
use tokio::net::TcpListener;
use tokio::sync::{oneshot, Notify, OwnedSemaphorePermit, Semaphore, TryAcquireError};
use tokio_rustls::TlsAcceptor;

use crate::idle::{ConnId, Eviction, Idle};

/// The bounds every connection is held to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// TLS handshake, and each request's headers (and idle time between requests).
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
/// `max_connections - 1` newer connections have come) to finish its TLS handshake and send
/// its request's headers, a round trip or two. Short, because it sets how fast a flood
/// drains (`max_connections` per this long): while the flood outpaces that, the kernel's
/// accept queue stays full and drops new clients' SYNs (each retried after 1 s, then 3 s).
pub const EVICT_AFTER: Duration = Duration::from_millis(20);

/// The largest request body read (a full NodeList of a large cluster without
/// `nodeCacheCapable` stays well below it).
pub const MAX_BODY: usize = 16 << 20;

/// Why the TLS setup cannot be used; each names the file and what to do.
#[derive(Debug, Error)]
pub enum TlsError {
    #[error("cannot read {what} {path}: {source}; check --tls-cert, --tls-key and --client-ca (deploy/certs/make-certs.sh makes all three)")]
    Read {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{what} {path} holds no PEM {kind}: {detail}; give the file deploy/certs/make-certs.sh wrote")]
    Pem {
        what: &'static str,
        path: PathBuf,
        kind: &'static str,
        detail: String,
    },
    #[error("the client CA {path} is not usable: {detail}")]
    ClientCa { path: PathBuf, detail: String },
    #[error("the server certificate {cert} and key {key} do not make a TLS configuration: {detail} (does the key belong to the certificate?)")]
    Config {
        cert: PathBuf,
        key: PathBuf,
        detail: String,
    },
}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        what,
        path: path.to_path_buf(),
        source,
    })
}

fn certs(what: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read(what, path)?;
    let pem_err = |detail: String| TlsError::Pem {
        what,
        path: path.to_path_buf(),
        kind: "CERTIFICATE",
        detail,
    };
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem_err(e.to_string()))?;
    if certs.is_empty() {
        return Err(pem_err("no certificate found".into()));
    }
    Ok(certs)
}

/// The server side of TLS: this certificate chain and key, and only clients whose
/// certificate chains to `client_ca` (HTTP/1.1 only, as kube-scheduler's extender client).
pub fn server_config(
    cert: &Path,
    key: &Path,
    client_ca: &Path,
) -> Result<Arc<ServerConfig>, TlsError> {
    let chain = certs("server certificate", cert)?;
    let key_pem = read("server key", key)?;
    let private = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| TlsError::Pem {
        what: "server key",
        path: key.to_path_buf(),
        kind: "PRIVATE KEY",
        detail: e.to_string(),
    })?;
    let mut roots = RootCertStore::empty();
    for c in certs("client CA", client_ca)? {
        roots.add(c).map_err(|e| TlsError::ClientCa {
            path: client_ca.to_path_buf(),
            detail: e.to_string(),
        })?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .build()
        .map_err(|e| TlsError::ClientCa {
            path: client_ca.to_path_buf(),
            detail: e.to_string(),
        })?;
    let config_err = |detail: String| TlsError::Config {
        cert: cert.to_path_buf(),
        key: key.to_path_buf(),
        detail,
    };
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| config_err(e.to_string()))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, private)
        .map_err(|e| config_err(e.to_string()))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// Middleware: read the whole body within `limit`, else answer 408 and close.
pub async fn body_deadline(limit: Duration, req: Request, next: Next) -> Response {
    let (parts, body) = req.into_parts();
    match tokio::time::timeout(limit, axum::body::to_bytes(body, MAX_BODY)).await {
        Ok(Ok(bytes)) => {
            next.run(Request::from_parts(parts, Body::from(bytes)))
                .await
        }
        Ok(Err(e)) => (
            StatusCode::BAD_REQUEST,
            format!("cannot read the request body: {e}"),
        )
            .into_response(),
        Err(_) => {
            tracing::warn!(path = %parts.uri.path(), timeout = ?limit, "request body not received in time; connection closed");
            (
                StatusCode::REQUEST_TIMEOUT,
                [(axum::http::header::CONNECTION, "close")],
                format!("the request body did not arrive within {limit:?} (--body-timeout)"),
            )
                .into_response()
        }
    }
}

/// Serve `app` on `listener` until the process ends: over TLS with `tls`, plain HTTP
/// without (development only), every connection held to `limits`; when all
/// `limits.max_connections` are held, a new connection takes the place of the one idle the
/// longest (see the module's documentation).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    tls: Option<Arc<ServerConfig>>,
    limits: Limits,
) -> io::Result<()> {
    let app = app
        .layer(axum::middleware::from_fn(move |req, next| {
            body_deadline(limits.body_timeout, req, next)
        }))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY));
    let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let conns = Arc::new(Conns::default());
    let acceptor = tls.map(TlsAcceptor::from);
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
        let acceptor = acceptor.clone();
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
                match acceptor {
                    None => connection(TokioIo::new(stream), service, limits, peer).await,
                    Some(acc) => {
                        match tokio::time::timeout(limits.header_timeout, acc.accept(stream)).await
                        {
                            Ok(Ok(tls)) => {
                                connection(TokioIo::new(tls), service, limits, peer).await
                            }
                            Ok(Err(e)) => {
                                tracing::warn!(%peer, error = %e, "TLS handshake refused (a client without kube-scheduler's certificate?)")
                            }
                            Err(_) => {
                                tracing::warn!(%peer, "TLS handshake not finished in time; closed")
                            }
                        }
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

/// `GET /metrics`: `metrics`' OpenMetrics text. Served with [`serve`] on its own port,
/// plain HTTP (Prometheus has no client certificate; a scrape cannot reach the verbs), held
/// to the same deadlines.
pub fn metrics_router(metrics: Arc<crate::metrics::Metrics>) -> Router {
    Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let text = metrics.encode();
            async move {
                (
                    [(
                        axum::http::header::CONTENT_TYPE,
                        crate::metrics::CONTENT_TYPE,
                    )],
                    text,
                )
            }
        }),
    )
}

async fn connection<I>(io: TokioIo<I>, service: Tracked, limits: Limits, peer: SocketAddr)
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
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
    use tokio::net::TcpStream;
    use tokio::sync::mpsc;

    /// A plain listener with `max` permits serving `/ok` at once and `/hold`, which reports
    /// on `entered` and answers once the test adds a permit to the returned semaphore.
    async fn server(max: usize) -> (SocketAddr, mpsc::UnboundedReceiver<()>, Arc<Semaphore>) {
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
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let limits = Limits {
            header_timeout: Duration::from_secs(60), // no deadline ends a connection here
            body_timeout: Duration::from_secs(60),
            max_connections: max,
        };
        tokio::spawn(serve(listener, app, None, limits));
        (addr, entered, release)
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
        let (addr, mut entered, release) = server(3).await;
        let mut busy = TcpStream::connect(addr).await.unwrap();
        send(&mut busy, "/hold").await;
        entered.recv().await.unwrap();
        let mut oldest = TcpStream::connect(addr).await.unwrap(); // connected, sends nothing
        let mut newer = TcpStream::connect(addr).await.unwrap();
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
        let (addr, mut entered, release) = server(1).await;
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
        let (addr, _entered, _release) = server(1).await;
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

    #[test]
    fn unusable_files_are_named_with_the_fix() {
        let dir = std::env::temp_dir().join(format!("vcuda-listen-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let missing = dir.join("missing.pem");
        let e = server_config(&missing, &missing, &missing)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("server certificate")
                && e.contains("missing.pem")
                && e.contains("make-certs.sh"),
            "{e}"
        );
        let junk = dir.join("junk.pem");
        std::fs::write(&junk, "not pem").unwrap();
        let e = server_config(&junk, &junk, &junk).unwrap_err().to_string();
        assert!(
            e.contains("holds no PEM CERTIFICATE") && e.contains("junk.pem"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
