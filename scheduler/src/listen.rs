//! The extender's listener (I/O): TLS that admits only clients holding a certificate from
//! `--client-ca` (kube-scheduler's), and bounds on what any client can hold.
//!
//! The extender acts with kube-scheduler's cluster-wide binding right, so who may call it
//! matters as much as what it checks. The accept loop is `vcuda-listen`'s
//! ([`vcuda_listen::serve`], shared with vcuda-manager's `/metrics`): every connection
//! - needs a permit: at most [`Limits::max_connections`] are served at once; when all are
//!   held, the connection idle the longest (still in its TLS handshake or sending its first
//!   request's headers, or between keep-alive requests) makes room for a new one once idle
//!   for [`EVICT_AFTER`]; one with a request in progress never does, so a flood of idle
//!   connections can neither hold clients off for a header deadline per
//!   `max_connections` of them nor exhaust memory or descriptors;
//! - finishes its TLS handshake within [`Limits::header_timeout`] (a client without an
//!   acceptable certificate is refused there, before a byte of HTTP is read);
//! - sends each request's headers within [`Limits::header_timeout`] (hyper's
//!   `header_read_timeout`, which also ends idle keep-alive connections) and its body, at
//!   most [`MAX_BODY`], within [`Limits::body_timeout`], else is closed.
//!
//! This module adds what is the extender's own: the TLS configuration ([`server_config`])
//! and its handshake, and the `/metrics` router.
//!
//! Certificates are read once at start: rotate them by restarting the pods (a rolling
//! restart of the Deployment, whose replicas share nothing).

use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use axum::Router;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use thiserror::Error;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;
use vcuda_listen::{Handshake, Plain};

pub use vcuda_listen::{bind, Limits, BACKLOG, EVICT_AFTER};

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

/// The server side of TLS: this certificate chain and key, HTTP/1.1 only. With `client_ca`,
/// only clients whose certificate chains to it (kube-scheduler's extender client); without,
/// any client (vcuda-webhook: the API server presents no client certificate by default).
pub fn server_config(
    cert: &Path,
    key: &Path,
    client_ca: Option<&Path>,
) -> Result<Arc<ServerConfig>, TlsError> {
    let chain = certs("server certificate", cert)?;
    let key_pem = read("server key", key)?;
    let private = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| TlsError::Pem {
        what: "server key",
        path: key.to_path_buf(),
        kind: "PRIVATE KEY",
        detail: e.to_string(),
    })?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier = match client_ca {
        None => WebPkiClientVerifier::no_client_auth(),
        Some(client_ca) => {
            let mut roots = RootCertStore::empty();
            for c in certs("client CA", client_ca)? {
                roots.add(c).map_err(|e| TlsError::ClientCa {
                    path: client_ca.to_path_buf(),
                    detail: e.to_string(),
                })?;
            }
            WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                .build()
                .map_err(|e| TlsError::ClientCa {
                    path: client_ca.to_path_buf(),
                    detail: e.to_string(),
                })?
        }
    };
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

/// Serve `app` on `listener` until the process ends: over TLS with `tls`, plain HTTP
/// without (development only), every connection held to `limits`, request bodies of at
/// most [`MAX_BODY`]; when all `limits.max_connections` are held, a new connection takes
/// the place of the one idle the longest ([`vcuda_listen::serve`]).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    tls: Option<Arc<ServerConfig>>,
    limits: Limits,
) -> io::Result<()> {
    serve_bounded(listener, app, tls, limits, MAX_BODY).await
}

/// [`serve`] with request bodies of at most `max_body` bytes (vcuda-webhook's is smaller:
/// what a connection can hold of its memory is what bounds it under a flood).
pub async fn serve_bounded(
    listener: TcpListener,
    app: Router,
    tls: Option<Arc<ServerConfig>>,
    limits: Limits,
    max_body: usize,
) -> io::Result<()> {
    match tls {
        None => vcuda_listen::serve(listener, app, Plain, limits, max_body).await,
        Some(config) => {
            let tls = Tls(TlsAcceptor::from(config));
            vcuda_listen::serve(listener, app, tls, limits, max_body).await
        }
    }
}

/// The TLS handshake, held to the header deadline by [`vcuda_listen::serve`]; a client
/// without an acceptable certificate is refused there, before a byte of HTTP is read.
#[derive(Clone)]
struct Tls(TlsAcceptor);

impl Handshake for Tls {
    type Io = TlsStream<TcpStream>;

    async fn handshake(&self, stream: TcpStream, peer: SocketAddr) -> Option<Self::Io> {
        match self.0.accept(stream).await {
            Ok(tls) => Some(tls),
            Err(e) => {
                tracing::warn!(%peer, error = %e, "TLS handshake refused (for the extender: a client without kube-scheduler's certificate?)");
                None
            }
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unusable_files_are_named_with_the_fix() {
        let dir = std::env::temp_dir().join(format!("vcuda-listen-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let missing = dir.join("missing.pem");
        let e = server_config(&missing, &missing, Some(&missing))
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
        let e = server_config(&junk, &junk, Some(&junk))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("holds no PEM CERTIFICATE") && e.contains("junk.pem"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
