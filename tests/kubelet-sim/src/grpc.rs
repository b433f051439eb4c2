//! The kubelet's gRPC faces: the Registration server on `kubelet.sock` (kubelet.md §1), the
//! PodResources v1 server (§8), and the client side of each registered plugin (§1.4–1.5, §3).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::{Channel, Endpoint, Server, Uri};
use tonic::{Request, Response, Status};
use tracing::{info, warn};

use crate::names;
use crate::proto::deviceplugin::{
    self as dp, device_plugin_client::DevicePluginClient, registration_server,
};
use crate::proto::podresources::{self as pr, pod_resources_lister_server};
use crate::sim::{go_err, Inner};
use crate::versions::{Authority, Method};
use crate::wire::SendsPath;

/// Connects to a gRPC server on a Unix socket, once. The authority is `localhost`, as the
/// kubelet's dial sets it since 1.26.
pub async fn connect_unix(path: &Path) -> Result<Channel, tonic::transport::Error> {
    connect_plugin(path, Authority::Localhost).await
}

/// Connects to a device plugin's socket, once, sending `authority` as the kubelet release
/// played does: `localhost`, or (before 1.26) the socket path, put on the wire by
/// [`SendsPath`].
pub async fn connect_plugin(
    path: &Path,
    authority: Authority,
) -> Result<Channel, tonic::transport::Error> {
    let path = path.to_path_buf();
    Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move {
                let s = UnixStream::connect(&path).await?;
                Ok::<_, std::io::Error>(TokioIo::new(match authority {
                    Authority::Localhost => SendsPath::untouched(s),
                    Authority::SocketPath => SendsPath::new(s, &path.to_string_lossy()),
                }))
            }
        }))
        .await
}

/// The kubelet's blocking dial: retries until connected or `timeout` passes (grpc-go's
/// `WithBlock` retries a refused or missing socket with back-off; we retry every 100 ms).
async fn dial(path: &Path, timeout: Duration, authority: Authority) -> Result<Channel, String> {
    const RETRY: Duration = Duration::from_millis(100);
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        match tokio::time::timeout_at(deadline, connect_plugin(path, authority)).await {
            Ok(Ok(channel)) => return Ok(channel),
            Ok(Err(e)) if tokio::time::Instant::now() + RETRY >= deadline => {
                return Err(format!("{}: {}", path.display(), chain(&e)))
            }
            Ok(Err(_)) => tokio::time::sleep(RETRY).await,
            Err(_) => return Err("context deadline exceeded".into()),
        }
    }
}

/// An error with its sources ("transport error: connection refused ...").
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

struct Registration {
    inner: Arc<Inner>,
    incarnation: u64,
}

#[tonic::async_trait]
impl registration_server::Registration for Registration {
    /// The kubelet's `Register`: validate, then connect back **inside the call** and ask for
    /// the options (an error fails Register), then read ListAndWatch in the background.
    async fn register(
        &self,
        request: Request<dp::RegisterRequest>,
    ) -> Result<Response<dp::Empty>, Status> {
        let req = request.into_inner();
        let resource = req.resource_name.clone();
        info!(%resource, endpoint = %req.endpoint, version = %req.version, "Register");
        let reject = |m: String| {
            warn!(%resource, "Register rejected: {m}");
            Status::unknown(m)
        };
        names::check_version(&req.version).map_err(reject)?;
        names::check_resource_name(&resource).map_err(reject)?;
        let socket: PathBuf = self.inner.config.plugin_dir.join(&req.endpoint);
        let profile = self.inner.config.profile;
        if !profile.options_in_register() {
            // Before 1.25 Register returns at once; the plugin is dialled afterwards and its
            // options are the RegisterRequest's (kubernetes#109016 changed both).
            let (inner, incarnation) = (self.inner.clone(), self.incarnation);
            tokio::spawn(async move {
                let channel =
                    match dial(&socket, inner.config.dial_timeout, profile.authority()).await {
                        Ok(c) => c,
                        Err(e) => return warn!(%resource, "failed to dial device plugin: {e}"),
                    };
                let client = DevicePluginClient::new(channel);
                let options = req.options.unwrap_or_default();
                let Some(generation) = inner.plugin_connected(
                    incarnation,
                    &resource,
                    socket,
                    client.clone(),
                    options,
                    req.options,
                ) else {
                    return;
                };
                run_client(inner, incarnation, resource, generation, client).await;
            });
            return Ok(Response::new(dp::Empty {}));
        }
        let channel = dial(&socket, self.inner.config.dial_timeout, profile.authority())
            .await
            .map_err(|e| reject(format!("failed to dial device plugin: {e}")))?;
        let mut client = DevicePluginClient::new(channel);
        let options = client
            .get_device_plugin_options(dp::Empty {})
            .await
            .map_err(|s| {
                reject(format!(
                    "failed to get device plugin options: {}",
                    go_err(&s)
                ))
            })?
            .into_inner();
        let generation = self
            .inner
            .plugin_connected(
                self.incarnation,
                &resource,
                socket,
                client.clone(),
                options,
                req.options,
            )
            .ok_or_else(|| Status::unavailable("the kubelet is restarting; register again"))?;
        tokio::spawn(run_client(
            self.inner.clone(),
            self.incarnation,
            resource,
            generation,
            client,
        ));
        Ok(Response::new(dp::Empty {}))
    }
}

/// The kubelet's plugin client `Run`: ListAndWatch (no deadline) for as long as it lives.
async fn run_client(
    inner: Arc<Inner>,
    incarnation: u64,
    resource: String,
    generation: u64,
    mut client: DevicePluginClient<Channel>,
) {
    match client.list_and_watch(dp::Empty {}).await {
        Err(s) => warn!(%resource, "ListAndWatch failed: {}", go_err(&s)),
        Ok(stream) => {
            let mut stream = stream.into_inner();
            loop {
                match stream.message().await {
                    Ok(Some(msg)) => {
                        inner.list_and_watch_message(incarnation, &resource, generation, msg)
                    }
                    Ok(None) => {
                        warn!(%resource, "ListAndWatch ended");
                        break;
                    }
                    Err(s) => {
                        warn!(%resource, "ListAndWatch ended: {}", go_err(&s));
                        break;
                    }
                }
            }
        }
    }
    inner.list_and_watch_ended(incarnation, &resource, generation);
}

struct PodResources {
    inner: Arc<Inner>,
}

#[tonic::async_trait]
impl pod_resources_lister_server::PodResourcesLister for PodResources {
    async fn list(
        &self,
        _: Request<pr::ListPodResourcesRequest>,
    ) -> Result<Response<pr::ListPodResourcesResponse>, Status> {
        Ok(Response::new(pr::ListPodResourcesResponse {
            pod_resources: self.inner.list_pod_resources(),
        }))
    }

    async fn get_allocatable_resources(
        &self,
        _: Request<pr::AllocatableResourcesRequest>,
    ) -> Result<Response<pr::AllocatableResourcesResponse>, Status> {
        available(
            self.inner.config.profile.get_allocatable(),
            "GetAllocatableResources",
        )?;
        Ok(Response::new(pr::AllocatableResourcesResponse {
            devices: self.inner.allocatable_devices(),
            ..Default::default()
        }))
    }

    async fn get(
        &self,
        request: Request<pr::GetPodResourcesRequest>,
    ) -> Result<Response<pr::GetPodResourcesResponse>, Status> {
        available(self.inner.config.profile.get(), "Get")?;
        let r = request.into_inner();
        match self.inner.get_pod_resources(&r.pod_namespace, &r.pod_name) {
            Some(p) => Ok(Response::new(pr::GetPodResourcesResponse {
                pod_resources: Some(p),
            })),
            None => Err(Status::unknown(format!(
                "pod {} in namespace {} not found",
                r.pod_name, r.pod_namespace
            ))),
        }
    }
}

/// A PodResources method as the release played has it: served, refused by its feature
/// gate, or not in its API at all (grpc-go's answer for an unknown method).
fn available(m: Method, name: &str) -> Result<(), Status> {
    match m {
        Method::On => Ok(()),
        Method::GateOff(msg) => Err(Status::unknown(msg)),
        Method::Absent => Err(Status::unimplemented(format!(
            "unknown method {name} for service v1.PodResourcesLister"
        ))),
    }
}

pub(crate) async fn serve_registration(
    inner: Arc<Inner>,
    incarnation: u64,
    listener: std::os::unix::net::UnixListener,
) {
    let Some(incoming) = incoming(listener, "Registration") else {
        return;
    };
    let svc = registration_server::RegistrationServer::new(Registration { inner, incarnation });
    if let Err(e) = Server::builder()
        .add_service(svc)
        .serve_with_incoming(incoming)
        .await
    {
        warn!("Registration server ended: {}", chain(&e));
    }
}

pub(crate) async fn serve_pod_resources(
    inner: Arc<Inner>,
    listener: std::os::unix::net::UnixListener,
) {
    let Some(incoming) = incoming(listener, "PodResources") else {
        return;
    };
    let svc = pod_resources_lister_server::PodResourcesListerServer::new(PodResources { inner });
    if let Err(e) = Server::builder()
        .add_service(svc)
        .serve_with_incoming(incoming)
        .await
    {
        warn!("PodResources server ended: {}", chain(&e));
    }
}

fn incoming(listener: std::os::unix::net::UnixListener, what: &str) -> Option<UnixListenerStream> {
    match tokio::net::UnixListener::from_std(listener) {
        Ok(l) => Some(UnixListenerStream::new(l)),
        Err(e) => {
            warn!("{what} server: {e}");
            None
        }
    }
}
