//! The simulated device manager: its state, admission, container start, pod deletion and
//! kubelet restarts. The gRPC faces (Registration, PodResources, the client of each plugin)
//! are in [`crate::grpc`].
//!
//! Each "kubelet process" is a tokio runtime of its own holding the Registration and
//! PodResources servers and every connection to a plugin. A kubelet restart shuts that
//! runtime down, so every socket the kubelet had open closes at once, as when the process
//! dies; what survives is what the real kubelet keeps: the checkpoint file and the pods
//! (which live in the API server and the container runtime).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use prost::Message;
use tokio::sync::watch;
use tonic::transport::Channel;
use tracing::{info, warn};

use crate::api::{
    AdmitRequest, AdmitResult, ContainerResult, ContainerStatus, Options, PodStatus, Rejection,
    ResourceRequest, ResourceStatus, StartResult, Status,
};
use crate::checkpoint::{self, Checkpoint, DeviceIds};
use crate::grpc;
use crate::merge::{merge, RunOptions};
use crate::proto::deviceplugin::{
    device_plugin_client::DevicePluginClient, AllocateRequest, ContainerAllocateRequest,
    ContainerAllocateResponse, ContainerPreferredAllocationRequest, DevicePluginOptions,
    ListAndWatchResponse, PreStartContainerRequest, PreferredAllocationRequest,
};
use crate::proto::podresources as pr;

/// The kubelet's registration socket inside the plugin directory.
pub const KUBELET_SOCKET: &str = "kubelet.sock";
/// `pluginapi.Healthy`.
pub const HEALTHY: &str = "Healthy";
/// `KubeletPreStartContainerRPCTimeoutInSecs` (kubelet.md §6).
pub const PRE_START_TIMEOUT: Duration = Duration::from_secs(30);
/// The kubelet's dial timeout for a registering plugin (kubelet.md §1.4).
pub const DIAL_TIMEOUT: Duration = Duration::from_secs(10);

/// Where the simulated kubelet lives.
#[derive(Debug, Clone)]
pub struct Config {
    /// The device-plugin directory (`/var/lib/kubelet/device-plugins` on a node).
    pub plugin_dir: PathBuf,
    /// The PodResources socket (`/var/lib/kubelet/pod-resources/kubelet.sock` on a node).
    pub pod_resources_socket: PathBuf,
    pub dial_timeout: Duration,
    pub pre_start_timeout: Duration,
    /// How long the container runtime takes to create a pod's sandbox, between admission
    /// and the first container start when `admit` starts the containers.
    pub sandbox_time: Duration,
    /// The kubelet release played (`--kubelet-version`).
    pub profile: crate::versions::Profile,
    /// The container runtime's part (`--runtime docker`): None stops at PreStartContainer.
    pub runtime: Option<crate::runtime::RuntimeConfig>,
}

impl Config {
    pub fn new(plugin_dir: impl Into<PathBuf>, pod_resources_socket: impl Into<PathBuf>) -> Self {
        Config {
            plugin_dir: plugin_dir.into(),
            pod_resources_socket: pod_resources_socket.into(),
            dial_timeout: DIAL_TIMEOUT,
            pre_start_timeout: PRE_START_TIMEOUT,
            sandbox_time: Duration::ZERO,
            profile: crate::versions::Profile::default(),
            runtime: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("pod {namespace}/{pod} already exists; delete it first (kubelet-sim delete --pod {pod} --namespace {namespace})")]
    PodExists { namespace: String, pod: String },
    #[error("no pod {namespace}/{pod}; `kubelet-sim status` lists the pods")]
    NoSuchPod { namespace: String, pod: String },
    #[error("pod {namespace}/{pod} has no container {container:?}; `kubelet-sim status` lists its containers")]
    NoSuchContainer {
        namespace: String,
        pod: String,
        container: String,
    },
    #[error("invalid pod: {0}")]
    InvalidPod(String),
    #[error("timed out after {seconds:.1}s waiting for {what}")]
    Timeout { seconds: f64, what: String },
    #[error("timed out after {seconds:.1}s waiting for capacity {want}; last seen {seen}")]
    CapacityTimeout {
        seconds: f64,
        /// What was awaited, e.g. `a.com/x=4 (allocatable 4)`.
        want: String,
        /// The same resources' capacity (allocatable) when the wait gave up.
        seen: String,
    },
    #[error("{resource} has no plugin connected; wait-registered first")]
    NotConnected { resource: String },
    #[error("{resource}: {message}")]
    Rpc { resource: String, message: String },
    #[error("{context}: {source}")]
    Io {
        context: String,
        source: std::io::Error,
    },
}

impl SimError {
    pub(crate) fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> SimError {
        let context = context.into();
        move |source| SimError::Io { context, source }
    }
}

/// A running simulated kubelet. Dropping it kills the kubelet (its sockets stay on disk, as
/// after a real kubelet dies).
pub struct Simulator {
    inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) config: Config,
    state: Mutex<State>,
    changed: watch::Sender<u64>,
    /// Admission is serialized, as in the kubelet's admit handler; pod deletion and kubelet
    /// restarts take it too. PreStartContainer does not.
    admit_lock: tokio::sync::Mutex<()>,
    process: Mutex<Option<tokio::runtime::Runtime>>,
}

#[derive(Default)]
struct State {
    /// Bumped at every kubelet start; late work of a dead incarnation is dropped.
    incarnation: u64,
    restarts: u64,
    next_generation: u64,
    next_uid: u64,
    resources: BTreeMap<String, Resource>,
    /// Active pods (the API server's and runtime's view; survives kubelet restarts).
    pods: Vec<Pod>,
    /// uid → container → resource → allocation (the device manager's `podDevices`).
    pod_devices: BTreeMap<String, BTreeMap<String, BTreeMap<String, Alloc>>>,
    warnings: Vec<String>,
    rpc_timings: std::collections::VecDeque<crate::api::RpcTiming>,
}

impl State {
    fn timed(&mut self, rpc: &str, resource: &str, took: std::time::Duration) {
        if self.rpc_timings.len() >= 10_000 {
            self.rpc_timings.pop_front();
        }
        self.rpc_timings.push_back(crate::api::RpcTiming {
            rpc: rpc.into(),
            resource: resource.into(),
            micros: took.as_micros() as u64,
        });
    }
}

struct Resource {
    endpoint: Endpoint,
    /// Every device of the last ListAndWatch message → its NUMA nodes (empty: none).
    all: BTreeMap<String, Vec<i64>>,
    healthy: BTreeSet<String>,
    registrations: u64,
    messages: u64,
}

enum Endpoint {
    Connected(Connected),
    /// Stream ended (options kept) or restored from the checkpoint (no options).
    Stopped {
        socket: Option<PathBuf>,
        options: Option<DevicePluginOptions>,
    },
}

struct Connected {
    generation: u64,
    socket: PathBuf,
    client: DevicePluginClient<Channel>,
    options: DevicePluginOptions,
    register_options: Option<DevicePluginOptions>,
}

struct Pod {
    uid: String,
    name: String,
    namespace: String,
    containers: Vec<PodContainer>,
}

struct PodContainer {
    name: String,
    resources: Vec<ResourceRequest>,
    starts: u32,
    last_start_error: Option<String>,
    /// The engine's container of the last successful start (`--runtime docker`).
    runtime: Option<crate::runtime::Started>,
}

struct Alloc {
    per_numa: BTreeMap<i64, Vec<String>>,
    response: ContainerAllocateResponse,
}

impl Alloc {
    fn ids(&self) -> BTreeSet<String> {
        self.per_numa.values().flatten().cloned().collect()
    }
}

impl Endpoint {
    /// What an RPC to the plugin needs: the client (None: stopped) and the options.
    fn rpc(
        &self,
    ) -> (
        Option<DevicePluginClient<Channel>>,
        Option<DevicePluginOptions>,
    ) {
        match self {
            Endpoint::Connected(c) => (Some(c.client.clone()), Some(c.options)),
            Endpoint::Stopped { options, .. } => (None, *options),
        }
    }

    fn generation(&self) -> Option<u64> {
        match self {
            Endpoint::Connected(c) => Some(c.generation),
            Endpoint::Stopped { .. } => None,
        }
    }
}

impl Resource {
    fn stopped() -> Self {
        Resource {
            endpoint: Endpoint::Stopped {
                socket: None,
                options: None,
            },
            all: BTreeMap::new(),
            healthy: BTreeSet::new(),
            registrations: 0,
            messages: 0,
        }
    }
}

impl State {
    /// `isDevicePluginResource`: registered, or something of it is allocated.
    fn is_device_plugin_resource(&self, resource: &str) -> bool {
        self.resources.contains_key(resource)
            || self
                .pod_devices
                .values()
                .flat_map(|c| c.values())
                .any(|r| r.contains_key(resource))
    }

    fn allocated(&self, resource: &str) -> BTreeSet<String> {
        self.pod_devices
            .values()
            .flat_map(|c| c.values())
            .filter_map(|r| r.get(resource))
            .flat_map(|a| a.ids())
            .collect()
    }

    /// `UpdateAllocatedDevices`: forget allocations of pods that are no longer active.
    fn gc(&mut self) {
        let active: BTreeSet<&str> = self.pods.iter().map(|p| p.uid.as_str()).collect();
        self.pod_devices
            .retain(|uid, _| active.contains(uid.as_str()));
    }

    fn pod(&self, namespace: &str, name: &str) -> Option<&Pod> {
        self.pods
            .iter()
            .find(|p| p.name == name && p.namespace == namespace)
    }

    fn alloc(&self, uid: &str, container: &str, resource: &str) -> Option<&Alloc> {
        self.pod_devices.get(uid)?.get(container)?.get(resource)
    }

    fn container_devices(&self, uid: &str, container: &str) -> BTreeMap<String, Vec<String>> {
        self.pod_devices
            .get(uid)
            .and_then(|c| c.get(container))
            .map(|r| {
                r.iter()
                    .map(|(res, a)| (res.clone(), a.ids().into_iter().collect()))
                    .collect()
            })
            .unwrap_or_default()
    }

    fn run_options(&self, uid: &str, container: &PodContainer) -> RunOptions {
        merge(container.resources.iter().filter_map(|r| {
            self.alloc(uid, &container.name, &r.resource)
                .map(|a| (r.resource.as_str(), &a.response))
        }))
    }

    /// What the runtime is given: before 1.29 the kubelet drops `cdi_devices`
    /// (`DevicePluginCDIDevices` off).
    fn runtime_options(&self, uid: &str, container: &PodContainer, cdi: bool) -> RunOptions {
        let mut o = self.run_options(uid, container);
        if !cdi {
            o.cdi_devices.clear();
        }
        o
    }

    fn to_checkpoint(&self) -> Checkpoint {
        let mut entries = Vec::new();
        for (uid, containers) in &self.pod_devices {
            for (container, resources) in containers {
                for (resource, a) in resources {
                    entries.push(checkpoint::Entry {
                        pod_uid: uid.clone(),
                        container_name: container.clone(),
                        resource_name: resource.clone(),
                        device_ids: DeviceIds::from_per_numa(&a.per_numa),
                        alloc_resp: checkpoint::encode_alloc_resp(&a.response.encode_to_vec()),
                    });
                }
            }
        }
        Checkpoint {
            data: checkpoint::Data {
                pod_device_entries: (!entries.is_empty()).then_some(entries),
                registered_devices: self
                    .resources
                    .iter()
                    .map(|(name, r)| (name.clone(), r.healthy.iter().cloned().collect()))
                    .collect(),
            },
            checksum: 0,
            boot_id: checkpoint::boot_id(),
        }
    }

    /// `readCheckpoint`: allocations back, and every registered resource with an empty
    /// healthy set and a stopped endpoint without options.
    fn restore(&mut self, cp: Checkpoint) {
        for e in cp.data.pod_device_entries.unwrap_or_default() {
            let response = checkpoint::decode_alloc_resp(&e.alloc_resp)
                .map_err(|e| e.to_string())
                .and_then(|b| ContainerAllocateResponse::decode(&b[..]).map_err(|e| e.to_string()));
            match response {
                Ok(response) => {
                    let alloc = Alloc {
                        per_numa: e.device_ids.per_numa(),
                        response,
                    };
                    self.pod_devices
                        .entry(e.pod_uid)
                        .or_default()
                        .entry(e.container_name)
                        .or_default()
                        .insert(e.resource_name, alloc);
                }
                Err(reason) => {
                    let w = checkpoint::CheckpointError::AllocResp {
                        pod_uid: e.pod_uid,
                        container: e.container_name,
                        reason,
                    };
                    warn!("{w}; entry skipped");
                    self.warnings.push(w.to_string());
                }
            }
        }
        for name in cp.data.registered_devices.into_keys() {
            self.resources.insert(name, Resource::stopped());
        }
    }
}

/// Go's rendering of a gRPC error, as the kubelet puts it in messages.
pub(crate) fn go_err(s: &tonic::Status) -> String {
    format!("rpc error: code = {:?} desc = {}", s.code(), s.message())
}

fn endpoint_stopped(resource: &str) -> String {
    format!("endpoint {resource} has been stopped")
}

fn options_out(o: &DevicePluginOptions) -> Options {
    Options {
        pre_start_required: o.pre_start_required,
        get_preferred_allocation_available: o.get_preferred_allocation_available,
    }
}

impl Inner {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn notify(&self) {
        self.changed.send_modify(|v| *v = v.wrapping_add(1));
    }

    /// Writes the checkpoint under the state lock, so whoever sees a state also finds it
    /// on disk (and writes land in order).
    fn write_checkpoint(&self, st: &State) {
        if let Err(e) = checkpoint::write(&self.config.plugin_dir, &st.to_checkpoint()) {
            warn!("{e}");
        }
    }

    /// `PluginConnected`: the newest registration of a resource wins. Returns the endpoint's
    /// generation, or None if this kubelet incarnation is gone.
    pub(crate) fn plugin_connected(
        &self,
        incarnation: u64,
        resource: &str,
        socket: PathBuf,
        client: DevicePluginClient<Channel>,
        options: DevicePluginOptions,
        register_options: Option<DevicePluginOptions>,
    ) -> Option<u64> {
        let mut st = self.state();
        if st.incarnation != incarnation {
            return None;
        }
        st.next_generation += 1;
        let generation = st.next_generation;
        let r = st
            .resources
            .entry(resource.to_string())
            .or_insert_with(Resource::stopped);
        r.endpoint = Endpoint::Connected(Connected {
            generation,
            socket,
            client,
            options,
            register_options,
        });
        r.registrations += 1;
        r.messages = 0;
        drop(st);
        info!(resource, generation, ?options, "device plugin connected");
        self.notify();
        Some(generation)
    }

    /// `genericDeviceUpdateCallback`: every message is the complete list.
    pub(crate) fn list_and_watch_message(
        &self,
        incarnation: u64,
        resource: &str,
        generation: u64,
        msg: ListAndWatchResponse,
    ) {
        {
            let mut st = self.state();
            if st.incarnation != incarnation {
                return;
            }
            let Some(r) = st.resources.get_mut(resource) else {
                return;
            };
            if r.endpoint.generation() != Some(generation) {
                let w = format!(
                    "{resource}: ignored a ListAndWatch message from a replaced endpoint; a real \
                     kubelet would apply it (stop the old plugin server before registering again)"
                );
                warn!("{w}");
                st.warnings.push(w);
                return;
            }
            r.all = msg
                .devices
                .iter()
                .map(|d| {
                    let nodes = d
                        .topology
                        .as_ref()
                        .map(|t| t.nodes.iter().map(|n| n.id).collect())
                        .unwrap_or_default();
                    (d.id.clone(), nodes)
                })
                .collect();
            r.healthy = msg
                .devices
                .iter()
                .filter(|d| d.health == HEALTHY)
                .map(|d| d.id.clone())
                .collect();
            r.messages += 1;
            info!(
                resource,
                total = r.all.len(),
                healthy = r.healthy.len(),
                "ListAndWatch message"
            );
            self.write_checkpoint(&st);
        }
        self.notify();
    }

    /// `PluginDisconnected`: the stream ended, every device of the resource is unhealthy.
    pub(crate) fn list_and_watch_ended(&self, incarnation: u64, resource: &str, generation: u64) {
        {
            let mut st = self.state();
            if st.incarnation != incarnation {
                return;
            }
            let Some(r) = st.resources.get_mut(resource) else {
                return;
            };
            match &r.endpoint {
                Endpoint::Connected(c) if c.generation == generation => {
                    r.endpoint = Endpoint::Stopped {
                        socket: Some(c.socket.clone()),
                        options: Some(c.options),
                    };
                    r.healthy.clear();
                    warn!(resource, "ListAndWatch ended: all devices unhealthy");
                }
                _ => {
                    let w = format!(
                        "{resource}: the ListAndWatch stream of a replaced endpoint ended after a \
                         newer registration; a real kubelet (1.26+ code) would then mark {resource} \
                         unhealthy and stop the new endpoint (stop the old plugin server before \
                         registering again)"
                    );
                    warn!("{w}");
                    st.warnings.push(w);
                }
            }
        }
        self.notify();
    }
}

/// PodResources v1 answers (kubelet.md §8).
impl Inner {
    /// `List`: every active pod, its containers, their recorded devices. Garbage-collects
    /// allocations of pods that are gone, as the kubelet's List does.
    pub(crate) fn list_pod_resources(&self) -> Vec<pr::PodResources> {
        let mut st = self.state();
        st.gc();
        st.pods.iter().map(|p| st.pod_resources(p)).collect()
    }

    /// `Get`: one pod by name and namespace.
    pub(crate) fn get_pod_resources(
        &self,
        namespace: &str,
        name: &str,
    ) -> Option<pr::PodResources> {
        let st = self.state();
        st.pod(namespace, name).map(|p| st.pod_resources(p))
    }

    /// `GetAllocatableResources`: the healthy devices of every resource (capacity-like: not
    /// minus what is allocated).
    pub(crate) fn allocatable_devices(&self) -> Vec<pr::ContainerDevices> {
        let st = self.state();
        let mut out = Vec::new();
        for (name, r) in &st.resources {
            for id in &r.healthy {
                if let Some(nodes) = r.all.get(id) {
                    push_device(&mut out, name, id, nodes);
                }
            }
        }
        out
    }
}

/// `containerDevicesFromResourceDeviceInstances`: one `ContainerDevices` per device, and per
/// NUMA node when the device has topology (none when it has not).
fn push_device(out: &mut Vec<pr::ContainerDevices>, resource: &str, id: &str, nodes: &[i64]) {
    let entry = |topology| pr::ContainerDevices {
        resource_name: resource.to_string(),
        device_ids: vec![id.to_string()],
        topology,
    };
    if nodes.is_empty() {
        out.push(entry(None));
    }
    for n in nodes {
        out.push(entry(Some(pr::TopologyInfo {
            nodes: vec![pr::NumaNode { id: *n }],
        })));
    }
}

impl State {
    fn pod_resources(&self, p: &Pod) -> pr::PodResources {
        pr::PodResources {
            name: p.name.clone(),
            namespace: p.namespace.clone(),
            containers: p
                .containers
                .iter()
                .map(|c| {
                    let mut devices = Vec::new();
                    if let Some(res) = self.pod_devices.get(&p.uid).and_then(|m| m.get(&c.name)) {
                        for (resource, a) in res {
                            // Invert NUMA → IDs into ID → NUMA nodes ("-1" = none).
                            let mut nodes: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
                            for (n, ids) in &a.per_numa {
                                for id in ids {
                                    let e = nodes.entry(id.as_str()).or_default();
                                    if *n != checkpoint::NO_TOPOLOGY {
                                        e.push(*n);
                                    }
                                }
                            }
                            for (id, ns) in nodes {
                                push_device(&mut devices, resource, id, &ns);
                            }
                        }
                    }
                    pr::ContainerResources {
                        name: c.name.clone(),
                        devices,
                        ..Default::default()
                    }
                })
                .collect(),
        }
    }
}

impl Simulator {
    /// Starts the kubelet: reads the checkpoint, deletes the sockets in the plugin directory,
    /// serves PodResources and then Registration on `<plugin dir>/kubelet.sock`.
    pub fn start(config: Config) -> Result<Self, SimError> {
        std::fs::create_dir_all(&config.plugin_dir).map_err(SimError::io(format!(
            "cannot create the plugin directory {}",
            config.plugin_dir.display()
        )))?;
        let sim = Simulator {
            inner: Arc::new(Inner {
                config,
                state: Mutex::new(State::default()),
                changed: watch::channel(0).0,
                admit_lock: tokio::sync::Mutex::new(()),
                process: Mutex::new(None),
            }),
        };
        sim.boot()?;
        Ok(sim)
    }

    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    pub fn kubelet_socket(&self) -> PathBuf {
        self.inner.config.plugin_dir.join(KUBELET_SOCKET)
    }

    pub fn checkpoint_path(&self) -> PathBuf {
        self.inner.config.plugin_dir.join(checkpoint::FILE_NAME)
    }

    fn boot(&self) -> Result<(), SimError> {
        let cfg = &self.inner.config;
        let incarnation = {
            let mut st = self.inner.state();
            st.incarnation += 1;
            st.resources.clear();
            st.pod_devices.clear();
            match checkpoint::read(&cfg.plugin_dir) {
                Ok(Some(cp)) => st.restore(cp),
                Ok(None) => {}
                Err(e) => {
                    // As the kubelet: "Continue after failing to read checkpoint file".
                    warn!("{e}");
                    st.warnings.push(e.to_string());
                }
            }
            st.incarnation
        };
        remove_sockets(&cfg.plugin_dir)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("kubelet")
            .enable_all()
            .build()
            .map_err(SimError::io("cannot start the kubelet's runtime"))?;
        let pod_resources = bind(&cfg.pod_resources_socket)?;
        runtime.spawn(grpc::serve_pod_resources(self.inner.clone(), pod_resources));
        let registration = bind(&cfg.plugin_dir.join(KUBELET_SOCKET))?;
        runtime.spawn(grpc::serve_registration(
            self.inner.clone(),
            incarnation,
            registration,
        ));
        *self.inner.process.lock().unwrap_or_else(|e| e.into_inner()) = Some(runtime);
        info!(plugin_dir = %cfg.plugin_dir.display(), incarnation, "kubelet started");
        self.inner.notify();
        Ok(())
    }

    fn kill(&self) {
        if let Some(rt) = self
            .inner
            .process
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            rt.shutdown_background();
        }
        let mut st = self.inner.state();
        st.incarnation += 1;
        for r in st.resources.values_mut() {
            if let Endpoint::Connected(c) = &r.endpoint {
                r.endpoint = Endpoint::Stopped {
                    socket: Some(c.socket.clone()),
                    options: Some(c.options),
                };
            }
        }
    }

    /// A kubelet restart (kubelet.md §2): the process dies (every connection closes), then
    /// starts again from its checkpoint. Pods keep running and keep their allocations; no
    /// Allocate is issued for them.
    pub async fn restart(&self) -> Result<(), SimError> {
        let _serial = self.inner.admit_lock.lock().await;
        info!("kubelet restart");
        self.kill();
        self.inner.state().restarts += 1;
        self.boot()
    }

    /// Admits a pod (kubelet.md §4, §5): per container in order, per resource in order:
    /// choose devices (healthy minus allocated; GetPreferredAllocation's hint first), one
    /// Allocate RPC with one ContainerAllocateRequest, record after it returns. Then, unless
    /// `start` is false, starts each container (PreStartContainer).
    pub async fn admit(&self, req: AdmitRequest) -> Result<AdmitResult, SimError> {
        validate(&req)?;
        let serial = self.inner.admit_lock.lock().await;
        let uid = {
            let mut st = self.inner.state();
            if st.pod(&req.namespace, &req.pod).is_some() {
                return Err(SimError::PodExists {
                    namespace: req.namespace,
                    pod: req.pod,
                });
            }
            let uid = match &req.uid {
                Some(uid) => {
                    if let Some(p) = st.pods.iter().find(|p| &p.uid == uid) {
                        return Err(SimError::InvalidPod(format!(
                            "uid {uid} is already pod {}/{}'s; a pod's uid is unique",
                            p.namespace, p.name
                        )));
                    }
                    uid.clone()
                }
                None => loop {
                    st.next_uid += 1;
                    // With a container runtime the uid names host-wide things (the pod's
                    // cgroup, its containers' names): a random one, so that two
                    // kubelet-sims on one engine never meet.
                    let random = self.inner.config.runtime.as_ref().and_then(|_| {
                        std::fs::read_to_string("/proc/sys/kernel/random/uuid")
                            .ok()
                            .map(|u| u.trim().to_string())
                    });
                    let uid = random
                        .unwrap_or_else(|| format!("00000000-0000-4000-8000-{:012x}", st.next_uid));
                    if !st.pods.iter().any(|p| p.uid == uid) {
                        break uid;
                    }
                },
            };
            st.pods.push(Pod {
                uid: uid.clone(),
                name: req.pod.clone(),
                namespace: req.namespace.clone(),
                containers: req
                    .containers
                    .iter()
                    .map(|c| PodContainer {
                        name: c.name.clone(),
                        resources: c.resources.clone(),
                        starts: 0,
                        last_start_error: None,
                        runtime: None,
                    })
                    .collect(),
            });
            st.gc();
            uid
        };
        self.inner.notify();
        info!(pod = %req.pod, namespace = %req.namespace, %uid, "admitting");

        let mut ignored = Vec::new();
        for c in &req.containers {
            let mut recorded = false;
            for r in c.resources.iter().filter(|r| r.quantity > 0) {
                if !self.inner.state().is_device_plugin_resource(&r.resource) {
                    ignored.push(r.resource.clone());
                    continue;
                }
                let need = usize::try_from(r.quantity).unwrap_or(usize::MAX);
                if let Err(e) = self.allocate(&uid, &c.name, &r.resource, need).await {
                    let message = format!("Allocate failed due to {e}, which is unexpected");
                    warn!(pod = %req.pod, "rejected: {message}");
                    {
                        let mut st = self.inner.state();
                        st.pods.retain(|p| p.uid != uid);
                        st.pod_devices.remove(&uid);
                    }
                    self.inner.notify();
                    return Ok(AdmitResult {
                        pod: req.pod,
                        namespace: req.namespace,
                        uid,
                        admitted: false,
                        rejection: Some(Rejection {
                            reason: "UnexpectedAdmissionError".into(),
                            message,
                        }),
                        ignored_resources: ignored,
                        containers: vec![],
                    });
                }
                recorded = true;
            }
            if recorded {
                self.inner.write_checkpoint(&self.inner.state());
            }
        }
        let cdi = self.inner.config.profile.passes_cdi_devices();
        let mut containers = {
            let st = self.inner.state();
            let pod = st
                .pod(&req.namespace, &req.pod)
                .expect("admitted pod is present");
            pod.containers
                .iter()
                .map(|c| ContainerResult {
                    name: c.name.clone(),
                    devices: st.container_devices(&uid, &c.name),
                    allocate_response: st.runtime_options(&uid, c, cdi),
                    start: None,
                })
                .collect::<Vec<_>>()
        };
        drop(serial);
        if req.start {
            // The runtime creates the pod sandbox (RunPodSandbox) before any container starts.
            if !self.inner.config.sandbox_time.is_zero() {
                tokio::time::sleep(self.inner.config.sandbox_time).await;
            }
            for c in &mut containers {
                c.start = Some(
                    self.start_container(&req.namespace, &req.pod, &c.name)
                        .await?,
                );
            }
        }
        Ok(AdmitResult {
            pod: req.pod,
            namespace: req.namespace,
            uid,
            admitted: true,
            rejection: None,
            ignored_resources: ignored,
            containers,
        })
    }

    /// `devicesToAllocate` + the Allocate RPC of `allocateContainerResources`. On success the
    /// allocation is recorded; the error is the kubelet's message.
    async fn allocate(
        &self,
        uid: &str,
        container: &str,
        resource: &str,
        need: usize,
    ) -> Result<(), String> {
        let (available, client, options) = {
            let st = self.inner.state();
            let r = st
                .resources
                .get(resource)
                .ok_or_else(|| format!("cannot allocate unregistered device {resource}"))?;
            if r.healthy.is_empty() {
                return Err(format!(
                    "no healthy devices present; cannot allocate unhealthy devices {resource}"
                ));
            }
            let in_use = st.allocated(resource);
            let available: Vec<String> = r.healthy.difference(&in_use).cloned().collect();
            if available.len() < need {
                return Err(format!(
                    "requested number of devices unavailable for {resource}. Requested: {need}, Available: {}",
                    available.len()
                ));
            }
            let (client, options) = r.endpoint.rpc();
            (available, client, options)
        };

        let mut picked: Vec<String> = Vec::with_capacity(need);
        if options.is_some_and(|o| o.get_preferred_allocation_available) {
            let mut client = client.clone().ok_or_else(|| endpoint_stopped(resource))?;
            let request = PreferredAllocationRequest {
                container_requests: vec![ContainerPreferredAllocationRequest {
                    available_device_i_ds: available.clone(),
                    must_include_device_i_ds: vec![],
                    allocation_size: i32::try_from(need).unwrap_or(i32::MAX),
                }],
            };
            let hint = client
                .get_preferred_allocation(request)
                .await
                .map_err(|s| {
                    format!(
                        "device plugin GetPreferredAllocation rpc failed with err: {}",
                        go_err(&s)
                    )
                })?
                .into_inner()
                .container_responses
                .into_iter()
                .next()
                .map(|r| r.device_i_ds)
                .unwrap_or_default();
            // The hint is advisory: intersect it with the available set.
            for id in hint {
                if picked.len() < need && available.contains(&id) && !picked.contains(&id) {
                    picked.push(id);
                }
            }
        }
        // Fill any shortfall from the rest of the available devices.
        for id in &available {
            if picked.len() == need {
                break;
            }
            if !picked.contains(id) {
                picked.push(id.clone());
            }
        }

        let mut client = client.ok_or_else(|| endpoint_stopped(resource))?;
        info!(resource, container, devices = ?picked, "Allocate");
        let t0 = std::time::Instant::now();
        let response = client
            .allocate(AllocateRequest {
                container_requests: vec![ContainerAllocateRequest {
                    devices_ids: picked.clone(),
                }],
            })
            .await
            .map_err(|s| go_err(&s))?
            .into_inner();
        self.inner.state().timed("Allocate", resource, t0.elapsed());
        let response = response
            .container_responses
            .into_iter()
            .next()
            .ok_or_else(|| "no containers return in allocation response".to_string())?;
        {
            let mut st = self.inner.state();
            let mut per_numa: BTreeMap<i64, Vec<String>> = BTreeMap::new();
            let nodes_of = |id: &str| {
                st.resources
                    .get(resource)
                    .and_then(|r| r.all.get(id))
                    .cloned()
                    .unwrap_or_default()
            };
            for id in &picked {
                let nodes = nodes_of(id);
                if nodes.is_empty() {
                    per_numa
                        .entry(checkpoint::NO_TOPOLOGY)
                        .or_default()
                        .push(id.clone());
                }
                for n in nodes {
                    per_numa.entry(n).or_default().push(id.clone());
                }
            }
            st.pod_devices
                .entry(uid.to_string())
                .or_default()
                .entry(container.to_string())
                .or_default()
                .insert(resource.to_string(), Alloc { per_numa, response });
        }
        self.inner.notify();
        Ok(())
    }

    /// Starts (or restarts) a container: PreStartContainer per resource whose plugin asked
    /// for it, with the container's recorded devices (kubelet.md §6). No Allocate.
    pub async fn start_container(
        &self,
        namespace: &str,
        pod: &str,
        container: &str,
    ) -> Result<StartResult, SimError> {
        let (uid, resources) = {
            let st = self.inner.state();
            let p = st.pod(namespace, pod).ok_or_else(|| SimError::NoSuchPod {
                namespace: namespace.into(),
                pod: pod.into(),
            })?;
            let c = p
                .containers
                .iter()
                .find(|c| c.name == container)
                .ok_or_else(|| SimError::NoSuchContainer {
                    namespace: namespace.into(),
                    pod: pod.into(),
                    container: container.into(),
                })?;
            (p.uid.clone(), c.resources.clone())
        };
        let mut called = Vec::new();
        let mut outcome = Ok(());
        for r in resources.iter().filter(|r| r.quantity > 0) {
            match self.pre_start(&uid, container, &r.resource).await {
                Ok(true) => called.push(r.resource.clone()),
                Ok(false) => {}
                Err(e) => {
                    outcome = Err(e);
                    break;
                }
            }
        }
        // The runtime creates the container after PreStartContainer (`--runtime docker`).
        let mut started = None;
        if outcome.is_ok() {
            match self.run_container(&uid, namespace, pod, container).await {
                Ok(s) => started = s,
                Err(e) => outcome = Err(e),
            }
        }
        let starts = {
            let mut st = self.inner.state();
            let c = st
                .pods
                .iter_mut()
                .find(|p| p.uid == uid)
                .and_then(|p| p.containers.iter_mut().find(|c| c.name == container));
            match c {
                Some(c) => {
                    match &outcome {
                        Ok(()) => {
                            c.starts += 1;
                            c.last_start_error = None;
                            if started.is_some() {
                                c.runtime = started.clone();
                            }
                        }
                        Err(e) => c.last_start_error = Some(e.clone()),
                    }
                    c.starts
                }
                None => 0,
            }
        };
        self.inner.notify();
        if let Err(e) = &outcome {
            warn!(pod, container, "container start failed: {e}");
        }
        Ok(StartResult {
            pod: pod.into(),
            namespace: namespace.into(),
            container: container.into(),
            started: outcome.is_ok(),
            error: outcome.err(),
            pre_start_called: called,
            starts,
            runtime: started,
        })
    }

    /// `--runtime docker`: creates the container (replacing the previous one on a
    /// restart, whose restart count is this container's successful starts so far). Ok(None)
    /// without a runtime.
    async fn run_container(
        &self,
        uid: &str,
        namespace: &str,
        pod: &str,
        container: &str,
    ) -> Result<Option<crate::runtime::Started>, String> {
        use crate::runtime;
        let Some(cfg) = self.inner.config.runtime.clone() else {
            return Ok(None);
        };
        let cdi = self.inner.config.profile.passes_cdi_devices();
        let (answer, restart_count, previous) = {
            let st = self.inner.state();
            let p = st.pods.iter().find(|p| p.uid == uid);
            let Some(c) = p.and_then(|p| p.containers.iter().find(|c| c.name == container)) else {
                return Err(format!(
                    "pod {namespace}/{pod} was deleted while its container {container} started"
                ));
            };
            (
                st.runtime_options(uid, c, cdi),
                c.starts,
                c.runtime.as_ref().map(|r| r.id.clone()),
            )
        };
        let parent = runtime::pod_cgroup_parent(cfg.cgroup_driver, uid);
        let name = runtime::container_name(container, pod, namespace, uid, restart_count);
        let id = runtime::Identity {
            name: &name,
            cgroup_parent: &parent,
            pod,
            namespace,
            uid,
            container,
            restart_count,
        };
        let started = runtime::Docker::new(cfg)
            .start(&id, &answer, previous.as_deref())
            .await
            .map_err(|e| e.to_string())?;
        info!(pod, container, name = %started.name, host_pid = started.host_pid, "container running");
        Ok(Some(started))
    }

    /// Removes the engine's containers of the given pods and the pods' cgroup directories.
    async fn remove_runtime_containers(&self, pods: Vec<(String, Vec<String>)>) {
        let Some(cfg) = self.inner.config.runtime.clone() else {
            return;
        };
        let driver = cfg.cgroup_driver;
        let docker = crate::runtime::Docker::new(cfg);
        for (uid, ids) in pods {
            for id in ids {
                docker.remove(&id).await;
            }
            docker.remove_pod_cgroups(&crate::runtime::pod_cgroup_parent(driver, &uid));
        }
    }

    /// The engine's containers of every pod, removed (at `serve`'s exit; a real kubelet
    /// leaves them running, and finds them again when it starts).
    pub async fn remove_all_containers(&self) {
        let pods = {
            let st = self.inner.state();
            st.pods.iter().map(runtime_ids).collect()
        };
        self.remove_runtime_containers(pods).await;
    }

    /// Calls the plugin's GetDevicePluginOptions `count` times, in groups of `group` back to
    /// back with `gap` of idleness before each group, and returns each round trip in
    /// microseconds (also in `rpc_timings`): the transport's own cost, the floor under every
    /// other RPC's latency.
    pub async fn ping(
        &self,
        resource: &str,
        count: u32,
        group: u32,
        gap: std::time::Duration,
    ) -> Result<Vec<u64>, SimError> {
        let not_connected = || SimError::NotConnected {
            resource: resource.to_string(),
        };
        let client = {
            let st = self.inner.state();
            let r = st.resources.get(resource).ok_or_else(not_connected)?;
            r.endpoint.rpc().0
        };
        let mut client = client.ok_or_else(not_connected)?;
        let mut out = Vec::new();
        for i in 0..count {
            if !gap.is_zero() && i % group.max(1) == 0 {
                tokio::time::sleep(gap).await;
            }
            let t0 = std::time::Instant::now();
            client
                .get_device_plugin_options(crate::proto::deviceplugin::Empty {})
                .await
                .map_err(|s| SimError::Rpc {
                    resource: resource.to_string(),
                    message: go_err(&s),
                })?;
            let took = t0.elapsed();
            self.inner
                .state()
                .timed("GetDevicePluginOptions", resource, took);
            out.push(took.as_micros() as u64);
        }
        Ok(out)
    }

    /// `callPreStartContainerIfNeeded`; Ok(true) if the RPC was made.
    async fn pre_start(&self, uid: &str, container: &str, resource: &str) -> Result<bool, String> {
        let (client, devices) = {
            let st = self.inner.state();
            if !st.is_device_plugin_resource(resource) {
                return Ok(false);
            }
            let r = st.resources.get(resource).ok_or_else(|| {
                format!("endpoint not found in cache for a registered resource: {resource}")
            })?;
            let (client, options) = r.endpoint.rpc();
            if !options.is_some_and(|o| o.pre_start_required) {
                return Ok(false);
            }
            let devices: Vec<String> = st
                .alloc(uid, container, resource)
                .ok_or_else(|| {
                    format!("no devices found allocated in local cache for pod {uid}, container {container}, resource {resource}")
                })?
                .ids()
                .into_iter()
                .collect();
            (client, devices)
        };
        let mut client = client.ok_or_else(|| endpoint_stopped(resource))?;
        let failed =
            |e: String| format!("device plugin PreStartContainer rpc failed with err: {e}");
        let timeout = self.inner.config.pre_start_timeout;
        let mut request = tonic::Request::new(PreStartContainerRequest {
            devices_ids: devices,
        });
        request.set_timeout(timeout);
        info!(resource, container, "PreStartContainer");
        let t0 = std::time::Instant::now();
        let res = tokio::time::timeout(timeout, client.pre_start_container(request)).await;
        self.inner
            .state()
            .timed("PreStartContainer", resource, t0.elapsed());
        match res {
            Err(_) => Err(failed(
                "rpc error: code = DeadlineExceeded desc = context deadline exceeded".into(),
            )),
            Ok(Err(s)) => Err(failed(go_err(&s))),
            Ok(Ok(_)) => Ok(true),
        }
    }

    /// Deletes a pod: it leaves the active set at once (PodResources stops listing it) and its
    /// devices are free for the next admission. As in the kubelet, its checkpoint entries
    /// linger until the next write (garbage collection runs at the next allocation or List).
    pub async fn delete(&self, namespace: &str, pod: &str) -> Result<(), SimError> {
        let _serial = self.inner.admit_lock.lock().await;
        let gone = {
            let mut st = self.inner.state();
            let gone: Vec<_> = st
                .pods
                .iter()
                .filter(|p| p.name == pod && p.namespace == namespace)
                .map(runtime_ids)
                .collect();
            if gone.is_empty() {
                return Err(SimError::NoSuchPod {
                    namespace: namespace.into(),
                    pod: pod.into(),
                });
            }
            st.pods
                .retain(|p| !(p.name == pod && p.namespace == namespace));
            gone
        };
        info!(pod, namespace, "pod deleted");
        self.inner.notify();
        // The runtime stops and removes the pod's containers, then the kubelet its cgroup.
        self.remove_runtime_containers(gone).await;
        Ok(())
    }

    pub fn status(&self) -> Status {
        let cfg = &self.inner.config;
        let st = self.inner.state();
        Status {
            plugin_dir: cfg.plugin_dir.display().to_string(),
            kubelet_socket: self.kubelet_socket().display().to_string(),
            pod_resources_socket: cfg.pod_resources_socket.display().to_string(),
            restarts: st.restarts,
            resources: st
                .resources
                .iter()
                .map(|(name, r)| {
                    let (state, socket, options, register_options) = match &r.endpoint {
                        Endpoint::Connected(c) => (
                            "registered",
                            Some(&c.socket),
                            Some(options_out(&c.options)),
                            c.register_options.as_ref().map(options_out),
                        ),
                        Endpoint::Stopped { socket, options } => (
                            "stopped",
                            socket.as_ref(),
                            options.as_ref().map(options_out),
                            None,
                        ),
                    };
                    ResourceStatus {
                        name: name.clone(),
                        state: state.into(),
                        endpoint: socket.map(|s| relative(s, &cfg.plugin_dir)),
                        options,
                        register_options,
                        registrations: r.registrations,
                        list_and_watch_messages: r.messages,
                        devices: r.all.keys().cloned().collect(),
                        healthy: r.healthy.iter().cloned().collect(),
                        allocated: st.allocated(name).into_iter().collect(),
                        capacity: r.all.len(),
                        allocatable: r.healthy.len(),
                    }
                })
                .collect(),
            pods: st
                .pods
                .iter()
                .map(|p| PodStatus {
                    name: p.name.clone(),
                    namespace: p.namespace.clone(),
                    uid: p.uid.clone(),
                    containers: p
                        .containers
                        .iter()
                        .map(|c| ContainerStatus {
                            name: c.name.clone(),
                            requests: c.resources.clone(),
                            devices: st.container_devices(&p.uid, &c.name),
                            starts: c.starts,
                            last_start_error: c.last_start_error.clone(),
                            runtime: c.runtime.clone(),
                        })
                        .collect(),
                })
                .collect(),
            warnings: st.warnings.clone(),
            rpc_timings: st.rpc_timings.iter().cloned().collect(),
        }
    }

    /// Waits until `done(status)` holds; re-checks on every state change (no polling).
    pub async fn wait_for(
        &self,
        timeout: Duration,
        what: &str,
        done: impl Fn(&Status) -> bool,
    ) -> Result<Status, SimError> {
        let mut changes = self.inner.changed.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let s = self.status();
            if done(&s) {
                return Ok(s);
            }
            match tokio::time::timeout_at(deadline, changes.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) | Err(_) => {
                    return Err(SimError::Timeout {
                        seconds: timeout.as_secs_f64(),
                        what: what.to_string(),
                    })
                }
            }
        }
    }

    /// Waits until `resource` is registered and its plugin has sent a device list.
    pub async fn wait_registered(
        &self,
        resource: &str,
        timeout: Duration,
    ) -> Result<ResourceStatus, SimError> {
        let what = format!(
            "{resource} to register and send its device list (is the device plugin running and \
             registering at {}?)",
            self.kubelet_socket().display()
        );
        let s = self
            .wait_for(timeout, &what, |s| {
                s.resource(resource)
                    .is_some_and(|r| r.state == "registered" && r.list_and_watch_messages > 0)
            })
            .await?;
        Ok(s.resource(resource).cloned().expect("checked above"))
    }
}

impl Simulator {
    /// Waits until every resource of `capacity` has that many devices (a resource never
    /// registered has 0) and every resource of `allocatable` that many healthy ones, woken by
    /// every state change (a ListAndWatch message, a restart). On timeout the error gives
    /// what was last seen.
    pub async fn wait_capacity(
        &self,
        capacity: &BTreeMap<String, usize>,
        allocatable: &BTreeMap<String, usize>,
        timeout: Duration,
    ) -> Result<Status, SimError> {
        let done = |s: &Status| capacity_matches(s, capacity, allocatable);
        match self.wait_for(timeout, "capacity", done).await {
            Err(SimError::Timeout { seconds, .. }) => Err(SimError::CapacityTimeout {
                seconds,
                want: capacity_text(capacity, allocatable),
                seen: {
                    let s = self.status();
                    let count = |r: &str, alloc: bool| {
                        s.resource(r)
                            .map_or(0, |r| if alloc { r.allocatable } else { r.capacity })
                    };
                    let cap: BTreeMap<String, usize> = capacity
                        .keys()
                        .map(|r| (r.clone(), count(r, false)))
                        .collect();
                    let all: BTreeMap<String, usize> = allocatable
                        .keys()
                        .map(|r| (r.clone(), count(r, true)))
                        .collect();
                    capacity_text(&cap, &all)
                },
            }),
            other => other,
        }
    }
}

/// Whether `s` shows these capacities and allocatable counts (absent resource: 0).
fn capacity_matches(
    s: &Status,
    capacity: &BTreeMap<String, usize>,
    allocatable: &BTreeMap<String, usize>,
) -> bool {
    let count = |r: &str, alloc: bool| {
        s.resource(r)
            .map_or(0, |r| if alloc { r.allocatable } else { r.capacity })
    };
    capacity.iter().all(|(r, &n)| count(r, false) == n)
        && allocatable.iter().all(|(r, &n)| count(r, true) == n)
}

/// `a.com/x=4, b.com/y=2 (allocatable a.com/x=3)`.
fn capacity_text(
    capacity: &BTreeMap<String, usize>,
    allocatable: &BTreeMap<String, usize>,
) -> String {
    let list = |m: &BTreeMap<String, usize>| {
        m.iter()
            .map(|(r, n)| format!("{r}={n}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    if allocatable.is_empty() {
        format!("{{{}}}", list(capacity))
    } else {
        format!(
            "{{{}}} (allocatable {{{}}})",
            list(capacity),
            list(allocatable)
        )
    }
}

impl Drop for Simulator {
    fn drop(&mut self) {
        self.kill();
    }
}

fn validate(req: &AdmitRequest) -> Result<(), SimError> {
    let bad = |m: String| Err(SimError::InvalidPod(m));
    if req.pod.is_empty() || req.namespace.is_empty() {
        return bad("pod name and namespace must not be empty".into());
    }
    if let Some(uid) = &req.uid {
        // It names the pod's cgroup and checkpoint entries: no path separators, no blanks.
        if uid.is_empty()
            || !uid
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            return bad(format!(
                "uid {uid:?} must be non-empty and only letters, digits, '-' and '_' (a UUID)"
            ));
        }
    }
    if req.containers.is_empty() {
        return bad(format!(
            "pod {} has no containers; give at least one --container",
            req.pod
        ));
    }
    let mut names = BTreeSet::new();
    for c in &req.containers {
        if c.name.is_empty() || !names.insert(c.name.as_str()) {
            return bad(format!(
                "container names must be non-empty and unique; {:?} is not",
                c.name
            ));
        }
    }
    Ok(())
}

/// A pod's uid and the engine ids of its containers.
fn runtime_ids(p: &Pod) -> (String, Vec<String>) {
    let ids = p
        .containers
        .iter()
        .filter_map(|c| c.runtime.as_ref().map(|r| r.id.clone()))
        .collect();
    (p.uid.clone(), ids)
}

fn relative(path: &Path, dir: &Path) -> String {
    path.strip_prefix(dir).unwrap_or(path).display().to_string()
}

/// Removes every socket in the plugin directory (not the checkpoint, not other files, not
/// directories), as the kubelet's `CleanupPluginDirectory` does on start.
fn remove_sockets(dir: &Path) -> Result<(), SimError> {
    use std::os::unix::fs::FileTypeExt;
    let entries = std::fs::read_dir(dir).map_err(SimError::io(format!(
        "cannot read the plugin directory {}",
        dir.display()
    )))?;
    for entry in entries.flatten() {
        let path = entry.path();
        if entry.file_name() == checkpoint::FILE_NAME {
            continue;
        }
        if std::fs::metadata(&path).is_ok_and(|m| m.file_type().is_socket()) {
            std::fs::remove_file(&path)
                .map_err(SimError::io(format!("cannot remove {}", path.display())))?;
            info!(path = %path.display(), "removed socket");
        }
    }
    Ok(())
}

/// Binds a Unix socket, replacing a stale socket (never another kind of file).
pub(crate) fn bind(path: &Path) -> Result<std::os::unix::net::UnixListener, SimError> {
    use std::os::unix::fs::FileTypeExt;
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => std::fs::remove_file(path).map_err(SimError::io(
            format!("cannot remove the old socket {}", path.display()),
        ))?,
        Ok(_) => {
            return Err(SimError::Io {
                context: format!("cannot listen on {}", path.display()),
                source: std::io::Error::new(
                    std::io::ErrorKind::AlreadyExists,
                    "a file that is not a socket is in the way; choose another path",
                ),
            })
        }
        Err(_) => {}
    }
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)
            .map_err(SimError::io(format!("cannot create {}", parent.display())))?;
    }
    let l = std::os::unix::net::UnixListener::bind(path)
        .map_err(SimError::io(format!("cannot listen on {}", path.display())))?;
    l.set_nonblocking(true)
        .map_err(SimError::io(format!("cannot listen on {}", path.display())))?;
    Ok(l)
}
