//! gRPC over Unix sockets, the only transport the kubelet's device manager and PodResources API
//! use. tonic speaks TCP out of the box; these helpers make a Unix socket a one-liner on either
//! side.
//!
//! Serving (the device plugin side):
//! ```no_run
//! # async fn f(svc: vcuda_proto::deviceplugin::v1beta1::registration_server::RegistrationServer<impl vcuda_proto::deviceplugin::v1beta1::registration_server::Registration>) -> Result<(), Box<dyn std::error::Error>> {
//! let listener = tokio::net::UnixListener::bind("/var/lib/kubelet/device-plugins/vcuda.sock")?;
//! tonic::transport::Server::builder()
//!     .add_service(svc)
//!     .serve_with_incoming(vcuda_proto::uds::incoming(listener))
//!     .await?;
//! # Ok(()) }
//! ```
//! Calling (registering with the kubelet):
//! ```no_run
//! # async fn f() -> Result<(), Box<dyn std::error::Error>> {
//! use vcuda_proto::{constants, deviceplugin::v1beta1::registration_client::RegistrationClient};
//! let channel = vcuda_proto::uds::connect(constants::KUBELET_SOCKET).await?;
//! let mut client = RegistrationClient::new(channel);
//! # Ok(()) }
//! ```

use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{UnixListener, UnixStream};
use tokio_stream::wrappers::UnixListenerStream;
use tokio_stream::{Stream, StreamExt};
use tonic::transport::server::Connected;
use tonic::transport::{Channel, Endpoint, Error, Uri};

use crate::authority;

/// The URI every Unix-socket channel uses. Only its authority reaches the server (as the HTTP/2
/// `:authority`); `localhost` is what the kubelet itself sends when it dials a plugin.
const AUTHORITY_URI: &str = "http://localhost";

/// Connects to the gRPC server listening on the Unix socket `path`, with tonic's defaults (no
/// connect timeout: wrap the call in `tokio::time::timeout`, or use [`connect_with`]).
pub async fn connect(path: impl AsRef<Path>) -> Result<Channel, Error> {
    connect_with(Endpoint::from_static(AUTHORITY_URI), path).await
}

/// Connects `endpoint` (its URI is ignored apart from the authority, its settings such as
/// `connect_timeout` and `timeout` apply) to the Unix socket `path`. The channel re-dials `path`
/// whenever it reconnects, so a server restarting on the same path is picked up.
pub async fn connect_with(endpoint: Endpoint, path: impl AsRef<Path>) -> Result<Channel, Error> {
    let path: PathBuf = path.as_ref().to_owned();
    endpoint
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move { UnixStream::connect(path).await.map(TokioIo::new) }
        }))
        .await
}

/// Turns a bound listener into the stream of connections
/// `tonic::transport::Server::serve_with_incoming` takes. Each connection reads through
/// [`Lenient`], so clients that send a socket path (or an empty value) as the HTTP/2
/// `:authority`, as kubelets 1.20–1.25 do, are served like any other (see
/// [`crate::authority`]).
pub fn incoming(
    listener: UnixListener,
) -> impl Stream<Item = std::io::Result<Lenient<UnixStream>>> + Send + 'static {
    UnixListenerStream::new(listener).map(|c| c.map(Lenient::new))
}

/// Bytes read per call from the client (the kubelet's requests are far smaller).
const READ_CHUNK: usize = 16 * 1024;

/// One accepted connection whose client-to-server bytes pass through an
/// [`authority::Rewriter`]; writes go straight to the socket. A client the rewriter gives
/// up on (see [`authority::ShimError`]) reads as an `InvalidData` error, which ends the
/// connection.
pub struct Lenient<S> {
    inner: S,
    shim: authority::Rewriter,
    /// Rewritten bytes not yet read by the server, from `at`.
    ready: Vec<u8>,
    at: usize,
    scratch: Box<[u8]>,
}

impl<S> Lenient<S> {
    pub fn new(inner: S) -> Lenient<S> {
        Lenient {
            inner,
            shim: authority::Rewriter::new(),
            ready: Vec::new(),
            at: 0,
            scratch: vec![0; READ_CHUNK].into_boxed_slice(),
        }
    }

    /// How many `:authority` values this connection has had replaced.
    pub fn rewritten(&self) -> u64 {
        self.shim.rewritten()
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Lenient<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let me = self.get_mut();
        loop {
            if me.at < me.ready.len() {
                let n = out.remaining().min(me.ready.len() - me.at);
                out.put_slice(&me.ready[me.at..me.at + n]);
                me.at += n;
                if me.at == me.ready.len() {
                    me.ready.clear();
                    me.at = 0;
                }
                return Poll::Ready(Ok(()));
            }
            let mut buf = ReadBuf::new(&mut me.scratch);
            ready!(Pin::new(&mut me.inner).poll_read(cx, &mut buf))?;
            let got = buf.filled();
            if got.is_empty() {
                // End of stream (a partial frame held back is dropped: h2 would refuse it).
                return Poll::Ready(Ok(()));
            }
            me.shim
                .feed(got, &mut me.ready)
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Lenient<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

impl Connected for Lenient<UnixStream> {
    type ConnectInfo = <UnixStream as Connected>::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}
