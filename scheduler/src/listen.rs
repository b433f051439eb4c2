//! The extender's listener (I/O): TLS that admits only clients holding a certificate from
//! `--client-ca` (kube-scheduler's), and bounds on what any client can hold.
//!
//! The extender acts with kube-scheduler's cluster-wide binding right, so who may call it
//! matters as much as what it checks. Every connection:
//! - waits for a permit first: at most [`Limits::max_connections`] are served at once; the
//!   rest wait in the kernel's accept queue, so a flood cannot make the process run out of
//!   memory or descriptors;
//! - finishes its TLS handshake within [`Limits::header_timeout`] (a client without an
//!   acceptable certificate is refused there, before a byte of HTTP is read);
//! - sends each request's headers within [`Limits::header_timeout`] (hyper's
//!   `header_read_timeout`, which also ends idle keep-alive connections) and its body within
//!   [`Limits::body_timeout`] ([`body_deadline`]), else is closed.
//!
//! Certificates are read once at start: rotate them by restarting the pods (a rolling
//! restart of the Deployment, whose replicas share nothing).

use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

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
use tokio::sync::Semaphore;
use tokio_rustls::TlsAcceptor;

/// The bounds every connection is held to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// TLS handshake, and each request's headers (and idle time between requests).
    pub header_timeout: Duration,
    /// Each request's body, from its headers on.
    pub body_timeout: Duration,
    /// Connections served at once.
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
/// without (development only), every connection held to `limits`.
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
    let acceptor = tls.map(TlsAcceptor::from);
    loop {
        let permit = permits
            .clone()
            .acquire_owned()
            .await
            .map_err(io::Error::other)?;
        let (stream, peer) = match listener.accept().await {
            Ok(s) => s,
            // Out of descriptors, or the peer went away before accept: not the server's end.
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let app = app.clone();
        let acceptor = acceptor.clone();
        tokio::spawn(async move {
            let _permit = permit;
            match acceptor {
                None => connection(TokioIo::new(stream), app, limits, peer).await,
                Some(acc) => {
                    match tokio::time::timeout(limits.header_timeout, acc.accept(stream)).await {
                        Ok(Ok(tls)) => connection(TokioIo::new(tls), app, limits, peer).await,
                        Ok(Err(e)) => {
                            tracing::warn!(%peer, error = %e, "TLS handshake refused (a client without kube-scheduler's certificate?)")
                        }
                        Err(_) => {
                            tracing::warn!(%peer, "TLS handshake not finished in time; closed")
                        }
                    }
                }
            }
        });
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

async fn connection<I>(io: TokioIo<I>, app: Router, limits: Limits, peer: SocketAddr)
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let served = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .serve_connection(io, TowerToHyperService::new(app))
        .await;
    if let Err(e) = served {
        tracing::debug!(%peer, error = %e, "connection ended");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
