//! A scripted fake device plugin: a tonic DevicePlugin server on a Unix socket in the plugin
//! directory that records every call (across plugins, in order) and can be told to fail or
//! to hold a call until the test releases it.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kubelet_sim::grpc::connect_unix;
use kubelet_sim::proto::deviceplugin::{
    self as dp, device_plugin_server, registration_client::RegistrationClient,
};
use kubelet_sim::proto::podresources::pod_resources_lister_client::PodResourcesListerClient;
use kubelet_sim::{Config, Simulator};
use tokio::sync::{mpsc, oneshot, watch, Semaphore};
use tokio_stream::{wrappers::UnixListenerStream, wrappers::WatchStream, Stream, StreamExt};
use tonic::{Request, Response, Status};

pub const CORE: &str = "tencent.com/vcuda-core";
pub const MEM: &str = "tencent.com/vcuda-memory";
/// Generous bound for waits that end on a signal.
pub const T: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    GetOptions,
    ListAndWatch,
    Preferred {
        available: Vec<String>,
        must_include: Vec<String>,
        size: i32,
    },
    /// The device IDs of each ContainerAllocateRequest.
    Allocate(Vec<Vec<String>>),
    PreStart(Vec<String>),
}

/// Every call every plugin received, in order, as `(resource, call)`.
#[derive(Default)]
pub struct Recorder {
    calls: Mutex<Vec<(String, Call)>>,
}

impl Recorder {
    fn push(&self, resource: &str, call: Call) {
        self.calls
            .lock()
            .unwrap()
            .push((resource.to_string(), call));
    }

    pub fn all(&self) -> Vec<(String, Call)> {
        self.calls.lock().unwrap().clone()
    }

    pub fn of(&self, resource: &str) -> Vec<Call> {
        self.all()
            .into_iter()
            .filter(|(r, _)| r == resource)
            .map(|(_, c)| c)
            .collect()
    }

    /// Allocate / Preferred / PreStart calls only, in order.
    pub fn rpcs(&self) -> Vec<(String, Call)> {
        self.all()
            .into_iter()
            .filter(|(_, c)| !matches!(c, Call::GetOptions | Call::ListAndWatch))
            .collect()
    }

    pub fn allocates(&self, resource: &str) -> Vec<Vec<Vec<String>>> {
        self.of(resource)
            .into_iter()
            .filter_map(|c| match c {
                Call::Allocate(r) => Some(r),
                _ => None,
            })
            .collect()
    }

    pub fn clear(&self) {
        self.calls.lock().unwrap().clear();
    }
}

/// Holds a call: it reports on `entered`, then waits for a permit on `release`.
#[derive(Clone)]
pub struct Gate {
    pub entered: mpsc::UnboundedSender<()>,
    pub release: Arc<Semaphore>,
}

impl Gate {
    pub fn new() -> (Gate, mpsc::UnboundedReceiver<()>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (
            Gate {
                entered: tx,
                release: Arc::new(Semaphore::new(0)),
            },
            rx,
        )
    }

    async fn pass(&self) {
        let _ = self.entered.send(());
        self.release.acquire().await.unwrap().forget();
    }
}

#[derive(Default, Clone)]
pub struct Script {
    pub options: dp::DevicePluginOptions,
    pub fail_options: bool,
    pub fail_allocate: Option<String>,
    pub fail_pre_start: Option<String>,
    /// GetPreferredAllocation's answer (None: an empty list).
    pub hint: Option<Vec<String>>,
    pub gate_allocate: Option<Gate>,
    pub gate_pre_start: Option<Gate>,
}

impl Script {
    pub fn with_options(
        pre_start_required: bool,
        get_preferred_allocation_available: bool,
    ) -> Self {
        Script {
            options: dp::DevicePluginOptions {
                pre_start_required,
                get_preferred_allocation_available,
            },
            ..Default::default()
        }
    }
}

/// The suffix of a resource name, e.g. `VCUDA_CORE`.
pub fn tag(resource: &str) -> String {
    resource
        .rsplit('/')
        .next()
        .unwrap()
        .to_uppercase()
        .replace('-', "_")
}

/// What the fake plugin answers to Allocate for one container request.
pub fn fake_response(resource: &str, ids: &[String]) -> dp::ContainerAllocateResponse {
    let t = tag(resource);
    let lower = t.to_lowercase();
    dp::ContainerAllocateResponse {
        envs: [
            (format!("FAKE_{t}"), ids.join(",")),
            ("FAKE_SHARED".to_string(), resource.to_string()),
        ]
        .into_iter()
        .collect(),
        mounts: vec![
            dp::Mount {
                container_path: format!("/fake/{lower}"),
                host_path: format!("/host/{lower}"),
                read_only: true,
            },
            dp::Mount {
                container_path: "/fake/shared".into(),
                host_path: format!("/host/{lower}/shared"),
                read_only: false,
            },
        ],
        devices: vec![dp::DeviceSpec {
            container_path: "/dev/fake".into(),
            host_path: format!("/dev/fake-{lower}"),
            permissions: "rw".into(),
        }],
        annotations: [(format!("fake.example.com/{lower}"), ids.join(","))]
            .into_iter()
            .collect(),
        cdi_devices: vec![],
    }
}

struct Svc {
    resource: String,
    recorder: Arc<Recorder>,
    script: Arc<Mutex<Script>>,
    devices: watch::Receiver<Option<Vec<dp::Device>>>,
}

type LawStream = Pin<Box<dyn Stream<Item = Result<dp::ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl device_plugin_server::DevicePlugin for Svc {
    async fn get_device_plugin_options(
        &self,
        _: Request<dp::Empty>,
    ) -> Result<Response<dp::DevicePluginOptions>, Status> {
        self.recorder.push(&self.resource, Call::GetOptions);
        let s = self.script.lock().unwrap().clone();
        if s.fail_options {
            return Err(Status::internal("scripted GetDevicePluginOptions failure"));
        }
        Ok(Response::new(s.options))
    }

    type ListAndWatchStream = LawStream;

    async fn list_and_watch(&self, _: Request<dp::Empty>) -> Result<Response<LawStream>, Status> {
        self.recorder.push(&self.resource, Call::ListAndWatch);
        let stream = WatchStream::new(self.devices.clone())
            .take_while(|d| d.is_some())
            .map(|d| {
                Ok(dp::ListAndWatchResponse {
                    devices: d.unwrap_or_default(),
                })
            });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<dp::PreferredAllocationRequest>,
    ) -> Result<Response<dp::PreferredAllocationResponse>, Status> {
        let r = request.into_inner();
        for c in &r.container_requests {
            self.recorder.push(
                &self.resource,
                Call::Preferred {
                    available: c.available_device_i_ds.clone(),
                    must_include: c.must_include_device_i_ds.clone(),
                    size: c.allocation_size,
                },
            );
        }
        let hint = self.script.lock().unwrap().hint.clone().unwrap_or_default();
        Ok(Response::new(dp::PreferredAllocationResponse {
            container_responses: r
                .container_requests
                .iter()
                .map(|_| dp::ContainerPreferredAllocationResponse {
                    device_i_ds: hint.clone(),
                })
                .collect(),
        }))
    }

    async fn allocate(
        &self,
        request: Request<dp::AllocateRequest>,
    ) -> Result<Response<dp::AllocateResponse>, Status> {
        let r = request.into_inner();
        let ids: Vec<Vec<String>> = r
            .container_requests
            .iter()
            .map(|c| c.devices_ids.clone())
            .collect();
        self.recorder
            .push(&self.resource, Call::Allocate(ids.clone()));
        let s = self.script.lock().unwrap().clone();
        if let Some(g) = &s.gate_allocate {
            g.pass().await;
        }
        if let Some(m) = s.fail_allocate {
            return Err(Status::internal(m));
        }
        Ok(Response::new(dp::AllocateResponse {
            container_responses: ids
                .iter()
                .map(|ids| fake_response(&self.resource, ids))
                .collect(),
        }))
    }

    async fn pre_start_container(
        &self,
        request: Request<dp::PreStartContainerRequest>,
    ) -> Result<Response<dp::PreStartContainerResponse>, Status> {
        let mut ids = request.into_inner().devices_ids;
        ids.sort();
        self.recorder.push(&self.resource, Call::PreStart(ids));
        let s = self.script.lock().unwrap().clone();
        if let Some(g) = &s.gate_pre_start {
            g.pass().await;
        }
        if let Some(m) = s.fail_pre_start {
            return Err(Status::internal(m));
        }
        Ok(Response::new(dp::PreStartContainerResponse {}))
    }
}

pub struct FakePlugin {
    pub resource: String,
    pub endpoint: String,
    pub socket: PathBuf,
    pub recorder: Arc<Recorder>,
    pub script: Arc<Mutex<Script>>,
    devices: watch::Sender<Option<Vec<dp::Device>>>,
    server: Option<(oneshot::Sender<()>, tokio::task::JoinHandle<()>)>,
}

impl FakePlugin {
    /// Serves on `<plugin_dir>/<endpoint>` (first, as a plugin must, kubelet.md §1.1).
    pub fn start(
        plugin_dir: &Path,
        resource: &str,
        endpoint: &str,
        recorder: &Arc<Recorder>,
        script: Script,
    ) -> FakePlugin {
        let mut p = FakePlugin {
            resource: resource.to_string(),
            endpoint: endpoint.to_string(),
            socket: plugin_dir.join(endpoint),
            recorder: recorder.clone(),
            script: Arc::new(Mutex::new(script)),
            devices: watch::channel(Some(vec![])).0,
            server: None,
        };
        p.serve();
        p
    }

    fn serve(&mut self) {
        let _ = std::fs::remove_file(&self.socket);
        if self.devices.borrow().is_none() {
            self.devices.send_replace(Some(vec![]));
        }
        let listener = tokio::net::UnixListener::bind(&self.socket).unwrap();
        let svc = Svc {
            resource: self.resource.clone(),
            recorder: self.recorder.clone(),
            script: self.script.clone(),
            devices: self.devices.subscribe(),
        };
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(device_plugin_server::DevicePluginServer::new(svc))
                .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async {
                    let _ = rx.await;
                })
                .await
                .unwrap();
        });
        self.server = Some((tx, task));
    }

    /// Sends a complete device list on every open ListAndWatch stream (and to later ones).
    pub fn set_devices(&self, devices: Vec<dp::Device>) {
        self.devices.send_replace(Some(devices));
    }

    pub fn script(&self, f: impl FnOnce(&mut Script)) {
        f(&mut self.script.lock().unwrap());
    }

    pub async fn register(&self, kubelet_socket: &Path) -> Result<(), Status> {
        let options = self.script.lock().unwrap().options;
        self.register_as(kubelet_socket, "v1beta1", &self.resource, options)
            .await
    }

    pub async fn register_as(
        &self,
        kubelet_socket: &Path,
        version: &str,
        resource: &str,
        options: dp::DevicePluginOptions,
    ) -> Result<(), Status> {
        let channel = connect_unix(kubelet_socket)
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        RegistrationClient::new(channel)
            .register(dp::RegisterRequest {
                version: version.to_string(),
                endpoint: self.endpoint.clone(),
                resource_name: resource.to_string(),
                options: Some(options),
            })
            .await
            .map(|_| ())
    }

    /// Ends every ListAndWatch stream and stops serving (the plugin process is gone).
    pub async fn stop(&mut self) {
        self.devices.send_replace(None);
        if let Some((tx, task)) = self.server.take() {
            let _ = tx.send(());
            let abort = task.abort_handle();
            if tokio::time::timeout(T, task).await.is_err() {
                abort.abort();
            }
        }
    }

    /// Stops and serves again on the same path, keeping the last device list.
    pub async fn restart(&mut self) {
        let last = self.devices.borrow().clone();
        self.stop().await;
        self.serve();
        self.devices.send_replace(last.or(Some(vec![])));
    }
}

pub fn dev(id: &str, healthy: bool) -> dp::Device {
    dp::Device {
        id: id.to_string(),
        health: if healthy { "Healthy" } else { "Unhealthy" }.to_string(),
        topology: None,
    }
}

pub fn dev_numa(id: &str, node: i64) -> dp::Device {
    dp::Device {
        topology: Some(dp::TopologyInfo {
            nodes: vec![dp::NumaNode { id: node }],
        }),
        ..dev(id, true)
    }
}

/// `n` healthy devices `<prefix>00`, `<prefix>01`, ... (sorting = numbering).
pub fn devs(prefix: &str, n: usize) -> Vec<dp::Device> {
    (0..n)
        .map(|i| dev(&format!("{prefix}{i:02}"), true))
        .collect()
}

pub fn ids(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

pub struct Env {
    pub dir: tempfile::TempDir,
    pub plugin_dir: PathBuf,
    pub pod_resources: PathBuf,
    pub sim: Simulator,
    pub recorder: Arc<Recorder>,
}

impl Env {
    pub fn new() -> Env {
        Env::with(|_| {})
    }

    pub fn with(tune: impl FnOnce(&mut Config)) -> Env {
        let dir = tempfile::tempdir().unwrap();
        let plugin_dir = dir.path().join("device-plugins");
        let pod_resources = dir.path().join("pod-resources").join("kubelet.sock");
        let mut config = Config::new(&plugin_dir, &pod_resources);
        tune(&mut config);
        let sim = Simulator::start(config).unwrap();
        Env {
            dir,
            plugin_dir,
            pod_resources,
            sim,
            recorder: Arc::new(Recorder::default()),
        }
    }

    pub fn plugin(&self, resource: &str, endpoint: &str, script: Script) -> FakePlugin {
        FakePlugin::start(&self.plugin_dir, resource, endpoint, &self.recorder, script)
    }

    /// A plugin that is serving, registered, and whose device list the kubelet has read.
    pub async fn registered(
        &self,
        resource: &str,
        endpoint: &str,
        script: Script,
        devices: Vec<dp::Device>,
    ) -> FakePlugin {
        let p = self.plugin(resource, endpoint, script);
        p.set_devices(devices);
        p.register(&self.sim.kubelet_socket()).await.unwrap();
        self.sim.wait_registered(resource, T).await.unwrap();
        p
    }

    pub async fn pod_resources(&self) -> PodResourcesListerClient<tonic::transport::Channel> {
        PodResourcesListerClient::new(connect_unix(&self.pod_resources).await.unwrap())
    }
}
