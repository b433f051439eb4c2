//! The seam between the kubelet's DevicePlugin API and what the manager serves: a
//! [`Backend`] is one resource's devices and what allocating them means; [`Server`] is the
//! gRPC service for any backend. Today one backend serves shares of GPUs
//! (`crate::plugin::Shares`, for `vcuda-core` and `vcuda-memory`); whole GPUs, mdev vGPUs
//! and vfio passthrough are further backends behind the same server, so what every resource
//! owes the kubelet (the options it registers with, the complete list on every change,
//! one span per RPC with the request's devices, refusals as statuses) is written once.

use std::pin::Pin;
use std::sync::Arc;

use tokio_stream::Stream;
use tonic::{Request, Response, Status};
use vcuda_proto::deviceplugin::v1beta1 as dp;

/// Complete device lists, the first at once and another on every change (the kubelet
/// rebuilds its sets from every message).
pub type DeviceStream =
    Pin<Box<dyn Stream<Item = Result<dp::ListAndWatchResponse, Status>> + Send>>;

/// One resource the manager advertises to the kubelet. Implementations do the work and
/// decide what the kubelet reads: a refusal is a [`Status`] whose message the user sees in
/// the pod's events, so it names the fix.
#[tonic::async_trait]
pub trait Backend: Send + Sync + 'static {
    /// The resource's full name (`<domain>/vcuda-core`), for registration and the log.
    fn resource(&self) -> String;

    /// What the plugin registers with and answers GetDevicePluginOptions with.
    fn options(&self) -> dp::DevicePluginOptions;

    /// ListAndWatch: the devices now, then again at every change.
    fn watch(&self) -> DeviceStream;

    /// GetPreferredAllocation: the device IDs to prefer, per container request in order.
    async fn preferred(
        &self,
        requests: Vec<dp::ContainerPreferredAllocationRequest>,
    ) -> Result<Vec<Vec<String>>, Status>;

    /// Allocate: what each container request gets (mounts, devices, environment), in order;
    /// a refusal fails the whole request, as the kubelet treats it.
    async fn allocate(
        &self,
        requests: Vec<dp::ContainerAllocateRequest>,
    ) -> Result<Vec<dp::ContainerAllocateResponse>, Status>;

    /// PreStartContainer for the container holding `ids` (sent only if the options ask).
    async fn pre_start(&self, ids: Vec<String>) -> Result<(), Status>;
}

/// The DevicePlugin gRPC service of one backend.
pub struct Server<B: ?Sized> {
    backend: Arc<B>,
}

impl<B: Backend> Server<B> {
    pub fn new(backend: B) -> Server<B> {
        Server {
            backend: Arc::new(backend),
        }
    }
}

impl Server<dyn Backend> {
    /// The service of a backend the daemon keeps across kubelet restarts.
    pub fn shared(backend: Arc<dyn Backend>) -> Server<dyn Backend> {
        Server { backend }
    }
}

#[tonic::async_trait]
impl<B: Backend + ?Sized> dp::device_plugin_server::DevicePlugin for Server<B> {
    async fn get_device_plugin_options(
        &self,
        _: Request<dp::Empty>,
    ) -> Result<Response<dp::DevicePluginOptions>, Status> {
        Ok(Response::new(self.backend.options()))
    }

    type ListAndWatchStream = DeviceStream;

    async fn list_and_watch(
        &self,
        _: Request<dp::Empty>,
    ) -> Result<Response<DeviceStream>, Status> {
        Ok(Response::new(self.backend.watch()))
    }

    #[tracing::instrument(name = "GetPreferredAllocation", skip_all, fields(resource = %self.backend.resource()))]
    async fn get_preferred_allocation(
        &self,
        req: Request<dp::PreferredAllocationRequest>,
    ) -> Result<Response<dp::PreferredAllocationResponse>, Status> {
        let ids = self
            .backend
            .preferred(req.into_inner().container_requests)
            .await?;
        Ok(Response::new(dp::PreferredAllocationResponse {
            container_responses: ids
                .into_iter()
                .map(|device_i_ds| dp::ContainerPreferredAllocationResponse { device_i_ds })
                .collect(),
        }))
    }

    #[tracing::instrument(name = "Allocate", skip_all, fields(resource = %self.backend.resource(), devices = tracing::field::Empty))]
    async fn allocate(
        &self,
        req: Request<dp::AllocateRequest>,
    ) -> Result<Response<dp::AllocateResponse>, Status> {
        let requests = req.into_inner().container_requests;
        let first = requests.first().map_or(&[][..], |c| &c.devices_ids[..]);
        tracing::Span::current().record("devices", tracing::field::debug(Ids(first)));
        let container_responses = self.backend.allocate(requests).await?;
        Ok(Response::new(dp::AllocateResponse {
            container_responses,
        }))
    }

    #[tracing::instrument(
        name = "PreStartContainer",
        skip_all,
        fields(resource = %self.backend.resource(), devices = tracing::field::Empty, container = tracing::field::Empty)
    )]
    async fn pre_start_container(
        &self,
        req: Request<dp::PreStartContainerRequest>,
    ) -> Result<Response<dp::PreStartContainerResponse>, Status> {
        let ids = req.into_inner().devices_ids;
        tracing::Span::current().record("devices", tracing::field::debug(Ids(&ids)));
        self.backend.pre_start(ids).await?;
        Ok(Response::new(dp::PreStartContainerResponse {}))
    }
}

/// A span's view of a request's device IDs: the first few and how many (a memory request
/// holds one ID per 256 MiB), so an allocation can be followed from Allocate to
/// PreStartContainer in the log without a line of hundreds of IDs.
pub struct Ids<'a>(pub &'a [String]);

impl std::fmt::Debug for Ids<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut sorted: Vec<&String> = self.0.iter().collect();
        sorted.sort();
        let shown = sorted
            .iter()
            .take(2)
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join(",");
        match self.0.len() {
            n if n > 2 => write!(f, "{shown},… ({n})"),
            _ => write!(f, "{shown}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dp::device_plugin_server::DevicePlugin;
    use parking_lot::Mutex;
    use tokio_stream::StreamExt;

    /// A backend that records what the server hands it and answers from a script.
    #[derive(Default)]
    struct Recording {
        calls: Mutex<Vec<String>>,
        refuse: Option<Status>,
    }

    #[tonic::async_trait]
    impl Backend for Recording {
        fn resource(&self) -> String {
            "example.com/thing".into()
        }
        fn options(&self) -> dp::DevicePluginOptions {
            dp::DevicePluginOptions {
                pre_start_required: true,
                get_preferred_allocation_available: false,
            }
        }
        fn watch(&self) -> DeviceStream {
            let list = |id: &str| {
                Ok(dp::ListAndWatchResponse {
                    devices: vec![dp::Device {
                        id: id.into(),
                        health: "Healthy".into(),
                        topology: None,
                    }],
                })
            };
            Box::pin(tokio_stream::iter([list("a"), list("b")]))
        }
        async fn preferred(
            &self,
            requests: Vec<dp::ContainerPreferredAllocationRequest>,
        ) -> Result<Vec<Vec<String>>, Status> {
            self.calls
                .lock()
                .push(format!("preferred {}", requests.len()));
            Ok(requests
                .into_iter()
                .map(|r| r.available_device_i_ds[..r.allocation_size as usize].to_vec())
                .collect())
        }
        async fn allocate(
            &self,
            requests: Vec<dp::ContainerAllocateRequest>,
        ) -> Result<Vec<dp::ContainerAllocateResponse>, Status> {
            self.calls
                .lock()
                .push(format!("allocate {:?}", requests[0].devices_ids));
            if let Some(s) = &self.refuse {
                return Err(s.clone());
            }
            Ok(requests
                .iter()
                .map(|r| dp::ContainerAllocateResponse {
                    envs: [("IDS".to_string(), r.devices_ids.join(","))].into(),
                    ..Default::default()
                })
                .collect())
        }
        async fn pre_start(&self, ids: Vec<String>) -> Result<(), Status> {
            self.calls.lock().push(format!("pre_start {ids:?}"));
            Ok(())
        }
    }

    fn allocate_request(ids: &[&str]) -> Request<dp::AllocateRequest> {
        Request::new(dp::AllocateRequest {
            container_requests: vec![dp::ContainerAllocateRequest {
                devices_ids: ids.iter().map(|s| s.to_string()).collect(),
            }],
        })
    }

    /// A new device mode is a backend: the server gives the kubelet its options, its lists,
    /// and its answers in request order, and asks it nothing it was not asked.
    #[tokio::test]
    async fn the_server_carries_any_backends_answers_to_the_kubelet() {
        let server = Server::new(Recording::default());
        let opts = server
            .get_device_plugin_options(Request::new(dp::Empty {}))
            .await
            .unwrap()
            .into_inner();
        assert!(opts.pre_start_required && !opts.get_preferred_allocation_available);

        let lists: Vec<_> = server
            .list_and_watch(Request::new(dp::Empty {}))
            .await
            .unwrap()
            .into_inner()
            .map(|m| m.unwrap().devices[0].id.clone())
            .collect()
            .await;
        assert_eq!(lists, ["a", "b"]);

        let preferred = server
            .get_preferred_allocation(Request::new(dp::PreferredAllocationRequest {
                container_requests: vec![dp::ContainerPreferredAllocationRequest {
                    available_device_i_ds: vec!["x".into(), "y".into(), "z".into()],
                    must_include_device_i_ds: vec![],
                    allocation_size: 2,
                }],
            }))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(preferred.container_responses[0].device_i_ds, ["x", "y"]);

        let answer = server
            .allocate(allocate_request(&["x", "y"]))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(answer.container_responses[0].envs["IDS"], "x,y");

        server
            .pre_start_container(Request::new(dp::PreStartContainerRequest {
                devices_ids: vec!["x".into()],
            }))
            .await
            .unwrap();
        assert_eq!(
            *server.backend.calls.lock(),
            [
                "preferred 1",
                "allocate [\"x\", \"y\"]",
                "pre_start [\"x\"]"
            ]
        );
    }

    /// A backend's refusal reaches the kubelet as it said it: code and message.
    #[tokio::test]
    async fn a_backends_refusal_reaches_the_kubelet_unchanged() {
        let server = Server::new(Recording {
            refuse: Some(Status::invalid_argument(
                "vcuda: no such device; restart the kubelet",
            )),
            ..Default::default()
        });
        let err = server.allocate(allocate_request(&["q"])).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert_eq!(err.message(), "vcuda: no such device; restart the kubelet");
    }

    #[test]
    fn a_span_shows_the_first_device_ids_and_how_many() {
        let ids: Vec<String> = (0..40).rev().map(|i| format!("GPU-a-mem-{i:02}")).collect();
        assert_eq!(
            format!("{:?}", Ids(&ids)),
            "GPU-a-mem-00,GPU-a-mem-01,… (40)"
        );
        let two = ["b".to_string(), "a".to_string()];
        assert_eq!(format!("{:?}", Ids(&two)), "a,b");
        assert_eq!(format!("{:?}", Ids(&[])), "");
    }
}
