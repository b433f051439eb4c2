//! The generated servers and clients talking over a Unix socket through `vcuda_proto::uds`, the
//! way the manager and the kubelet do: a unary call (Registration), an error status, and a
//! server stream (ListAndWatch).

use std::path::Path;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use tokio::net::UnixListener;
use tokio_stream::{Stream, StreamExt};
use tonic::transport::Server;
use tonic::{Request, Response, Status};
use vcuda_proto::constants::{HEALTHY, VERSION};
use vcuda_proto::deviceplugin::v1beta1::{
    device_plugin_client::DevicePluginClient,
    device_plugin_server::{DevicePlugin, DevicePluginServer},
    registration_client::RegistrationClient,
    registration_server::{Registration, RegistrationServer},
    AllocateRequest, AllocateResponse, Device, DevicePluginOptions, Empty, ListAndWatchResponse,
    PreStartContainerRequest, PreStartContainerResponse, PreferredAllocationRequest,
    PreferredAllocationResponse, RegisterRequest,
};
use vcuda_proto::uds;

/// A kubelet's Registration service that records what it is sent and, like the kubelet,
/// rejects an unsupported API version.
#[derive(Clone, Default)]
struct Recorder(Arc<Mutex<Vec<RegisterRequest>>>);

#[tonic::async_trait]
impl Registration for Recorder {
    async fn register(&self, request: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        let request = request.into_inner();
        if request.version != VERSION {
            return Err(Status::invalid_argument(format!(
                "unsupported version {}",
                request.version
            )));
        }
        self.0.lock().expect("recorder lock").push(request);
        Ok(Response::new(Empty {}))
    }
}

/// Binds `path` and serves `router` on it in the background.
fn serve(path: &Path, router: tonic::transport::server::Router) {
    let listener = UnixListener::bind(path).expect("bind");
    tokio::spawn(async move {
        router
            .serve_with_incoming(uds::incoming(listener))
            .await
            .expect("serve")
    });
}

#[tokio::test]
async fn registration_over_unix_socket() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("kubelet.sock");
    let recorder = Recorder::default();
    serve(
        &socket,
        Server::builder().add_service(RegistrationServer::new(recorder.clone())),
    );

    let mut client = RegistrationClient::new(uds::connect(&socket).await.expect("connect"));
    let request = RegisterRequest {
        version: VERSION.into(),
        endpoint: "vcuda-core.sock".into(),
        resource_name: "tencent.com/vcuda-core".into(),
        options: Some(DevicePluginOptions {
            pre_start_required: false,
            get_preferred_allocation_available: true,
        }),
    };
    client.register(request.clone()).await.expect("register");
    assert_eq!(
        *recorder.0.lock().expect("recorder lock"),
        std::slice::from_ref(&request)
    );

    // An error status crosses the socket intact.
    let status = client
        .register(RegisterRequest {
            version: "v1alpha".into(),
            ..request
        })
        .await
        .expect_err("old version must be rejected");
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert_eq!(status.message(), "unsupported version v1alpha");
    assert_eq!(recorder.0.lock().expect("recorder lock").len(), 1);
}

/// A device plugin whose ListAndWatch sends two lists and ends.
struct TwoLists;

fn list(health: &str) -> ListAndWatchResponse {
    ListAndWatchResponse {
        devices: vec![Device {
            id: "GPU-0-0".into(),
            health: health.into(),
            topology: None,
        }],
    }
}

#[tonic::async_trait]
impl DevicePlugin for TwoLists {
    type ListAndWatchStream =
        Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send>>;

    async fn get_device_plugin_options(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(DevicePluginOptions::default()))
    }
    async fn list_and_watch(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let lists = [list(HEALTHY), list("Unhealthy")].map(Ok);
        Ok(Response::new(Box::pin(tokio_stream::iter(lists))))
    }
    async fn get_preferred_allocation(
        &self,
        _: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        Err(Status::unimplemented("not needed"))
    }
    async fn allocate(
        &self,
        _: Request<AllocateRequest>,
    ) -> Result<Response<AllocateResponse>, Status> {
        Err(Status::unimplemented("not needed"))
    }
    async fn pre_start_container(
        &self,
        _: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        Err(Status::unimplemented("not needed"))
    }
}

#[tokio::test]
async fn list_and_watch_streams_over_unix_socket() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("vcuda-core.sock");
    serve(
        &socket,
        Server::builder().add_service(DevicePluginServer::new(TwoLists)),
    );

    let mut client = DevicePluginClient::new(uds::connect(&socket).await.expect("connect"));
    let stream = client
        .list_and_watch(Empty {})
        .await
        .expect("list_and_watch")
        .into_inner();
    let lists: Vec<ListAndWatchResponse> = stream.map(|r| r.expect("stream item")).collect().await;
    assert_eq!(lists, [list(HEALTHY), list("Unhealthy")]);
}

#[tokio::test]
async fn connect_to_missing_socket_fails() {
    let dir = tempfile::tempdir().expect("tempdir");
    let missing = dir.path().join("nobody.sock");
    assert!(uds::connect(&missing).await.is_err());
}
