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

use hyper_util::rt::TokioIo;
use tokio::net::{UnixListener, UnixStream};
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::{Channel, Endpoint, Error, Uri};

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
/// `tonic::transport::Server::serve_with_incoming` takes.
pub fn incoming(listener: UnixListener) -> UnixListenerStream {
    UnixListenerStream::new(listener)
}
