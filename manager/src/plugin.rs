//! The kubelet-facing gRPC services: one `DevicePlugin` server per resource, and the
//! PodResources lookup PreStartContainer needs. Thin: decisions are in [`crate::core`].
//! What the kubelet reads of a refusal is decided here, in one place ([`refusal`]).

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::watch;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status};
use tracing::{info, warn};
use vcuda_proto::deviceplugin::v1beta1 as dp;
use vcuda_proto::podresources::v1 as pr;

use crate::apiserver::ApiServer;
use crate::core::{Core, CoreError};
use crate::lookup::ListCache;
use vcuda_cluster::{GpuShare, Reservations};
use vcuda_manager_core::allocation::{Answer, Holdings};
use vcuda_manager_core::assign::{self, AssignError, Holds, PodFacts};
use vcuda_manager_core::ids::{all_ids, DeviceId, Kind};

/// The kubelet's PodResources API did not answer a `List`.
#[derive(Debug, thiserror::Error)]
pub enum PodResourcesError {
    #[error("cannot ask the kubelet's PodResources API at {}: {source}; is --pod-resources-socket the kubelet's, and the kubelet running?", socket.display())]
    Connect {
        socket: std::path::PathBuf,
        source: tonic::transport::Error,
    },
    #[error("cannot ask the kubelet's PodResources API at {}: {}", socket.display(), status.message())]
    List {
        socket: std::path::PathBuf,
        status: Status,
    },
}

impl PodResourcesError {
    /// A short stable name for counting errors by kind.
    pub fn kind(&self) -> &'static str {
        match self {
            PodResourcesError::Connect { .. } => "pod-resources-connect",
            PodResourcesError::List { .. } => "pod-resources-list",
        }
    }
}

/// The two RPCs that can refuse a container.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rpc {
    Allocate,
    PreStartContainer,
}

/// What the kubelet reads when `rpc` refuses: the message (prefixed `vcuda: `, which the
/// user sees in the pod's events) and a code. The request's faults are
/// `InvalidArgument` (Allocate: devices that cannot be served) or `FailedPrecondition`
/// (PreStartContainer: what was allocated would run wrong); the node's own faults (its
/// files, checkpoint, region, random source) are `Internal`. The kubelet fails the pod's
/// admission or start on any code alike; the code is for whoever reads the status.
pub fn refusal(rpc: Rpc, e: &CoreError) -> Status {
    let message = format!("vcuda: {e}");
    match (e.is_node_fault(), rpc) {
        (true, _) => Status::internal(message),
        (false, Rpc::Allocate) => Status::invalid_argument(message),
        (false, Rpc::PreStartContainer) => Status::failed_precondition(message),
    }
}

/// What the kubelet reads when PreStartContainer cannot ask PodResources which container
/// it is for: `Unavailable` (the kubelet's own API did not answer; a retry may do).
pub fn pod_resources_refusal(e: &PodResourcesError) -> Status {
    Status::unavailable(format!("vcuda: {e}"))
}

/// What every service shares.
pub struct Shared {
    pub core: Mutex<Core>,
    /// Health of each GPU (NVML order); ListAndWatch streams follow it.
    pub health: watch::Sender<Vec<bool>>,
    /// The PodResources connection, made on first use and kept (it re-dials by itself).
    pub pod_resources: tokio::sync::Mutex<Option<tonic::transport::Channel>>,
    /// The latest PodResources list and whether PreStartContainer may use it.
    pub lists: Mutex<ListCache>,
    /// Held while listing, so that a PreStartContainer and the prefetch never list at once:
    /// the second finds the first's answer.
    pub listing: tokio::sync::Mutex<()>,
    /// Woken by every answered Allocate: list once they go quiet ([`Shared::prefetch`]).
    pub prefetch_wanted: tokio::sync::Notify,
    /// When the last Allocate was answered.
    pub last_allocate: Mutex<Instant>,
    /// What `vcuda-smi` and `/metrics` show (the control loop replaces it every round).
    pub view: Arc<Mutex<vcuda_contract::view::View>>,
    /// The API server, when the manager uses one.
    pub api: Option<Arc<ApiServer>>,
}

/// How long Allocates must have been quiet before the manager lists PodResources ahead of
/// PreStartContainer (a container's resources are allocated back to back; the sandbox the
/// kubelet creates before starting it takes far longer).
const PREFETCH_QUIET: Duration = Duration::from_millis(5);

/// The device plugin of one resource.
pub struct Plugin {
    pub kind: Kind,
    pub shared: Arc<Shared>,
}

/// The complete device list of `kind` (the kubelet rebuilds its sets from every message).
pub fn devices(core: &Core, kind: Kind, health: &[bool]) -> Vec<dp::Device> {
    let inv = &core.inventory;
    let mut out = Vec::new();
    for (g, gpu) in inv.gpus.iter().enumerate() {
        let healthy = health.get(g).copied().unwrap_or(true);
        let topology = inv
            .numa
            .get(g)
            .copied()
            .flatten()
            .map(|n| dp::TopologyInfo {
                nodes: vec![dp::NumaNode { id: n }],
            });
        for id in all_ids(&gpu.uuid, kind, gpu.memory) {
            out.push(dp::Device {
                id: id.to_string(),
                health: if healthy { "Healthy" } else { "Unhealthy" }.into(),
                topology: topology.clone(),
            });
        }
    }
    out
}

fn to_proto(a: Answer) -> dp::ContainerAllocateResponse {
    dp::ContainerAllocateResponse {
        envs: a.envs.into_iter().collect(),
        mounts: a
            .mounts
            .into_iter()
            .map(|m| dp::Mount {
                container_path: m.container,
                host_path: m.host.display().to_string(),
                read_only: m.read_only,
            })
            .collect(),
        devices: a
            .devices
            .into_iter()
            .map(|d| dp::DeviceSpec {
                container_path: d.container,
                host_path: d.host,
                permissions: d.permissions,
            })
            .collect(),
        annotations: a.annotations.into_iter().collect::<HashMap<_, _>>(),
        cdi_devices: Vec::new(),
    }
}

type DeviceStream = Pin<Box<dyn Stream<Item = Result<dp::ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl dp::device_plugin_server::DevicePlugin for Plugin {
    async fn get_device_plugin_options(
        &self,
        _: Request<dp::Empty>,
    ) -> Result<Response<dp::DevicePluginOptions>, Status> {
        Ok(Response::new(options()))
    }

    type ListAndWatchStream = DeviceStream;

    async fn list_and_watch(
        &self,
        _: Request<dp::Empty>,
    ) -> Result<Response<DeviceStream>, Status> {
        let shared = self.shared.clone();
        let kind = self.kind;
        // The current list at once, then the whole list again at every health change.
        let stream = tokio_stream::wrappers::WatchStream::new(self.shared.health.subscribe()).map(
            move |health| {
                let devices = devices(&shared.core.lock(), kind, &health);
                Ok(dp::ListAndWatchResponse { devices })
            },
        );
        Ok(Response::new(Box::pin(stream)))
    }

    #[tracing::instrument(name = "GetPreferredAllocation", skip_all, fields(resource = ?self.kind))]
    async fn get_preferred_allocation(
        &self,
        req: Request<dp::PreferredAllocationRequest>,
    ) -> Result<Response<dp::PreferredAllocationResponse>, Status> {
        let requests = req.into_inner().container_requests;
        let decided = match &self.shared.api {
            Some(api) => self.shared.decide(api, self.kind, &requests).await,
            None => vec![None; requests.len()],
        };
        let mut core = self.shared.core.lock();
        let container_responses = requests
            .into_iter()
            .zip(decided)
            .map(|(c, want)| dp::ContainerPreferredAllocationResponse {
                device_i_ds: core.preferred_with(
                    self.kind,
                    &c.available_device_i_ds,
                    &c.must_include_device_i_ds,
                    c.allocation_size.max(0) as usize,
                    want.as_deref(),
                ),
            })
            .collect();
        Ok(Response::new(dp::PreferredAllocationResponse {
            container_responses,
        }))
    }

    #[tracing::instrument(name = "Allocate", skip_all, fields(resource = ?self.kind, devices = tracing::field::Empty))]
    async fn allocate(
        &self,
        req: Request<dp::AllocateRequest>,
    ) -> Result<Response<dp::AllocateResponse>, Status> {
        let t0 = Instant::now();
        let mut core = self.shared.core.lock();
        let resource = self.kind.resource(&core.settings.domain);
        let mut container_responses = Vec::new();
        let requests = req.into_inner().container_requests;
        tracing::Span::current().record("devices", tracing::field::debug(first_ids(&requests)));
        for c in &requests {
            match core.allocate(self.kind, &c.devices_ids) {
                Ok(a) => container_responses.push(to_proto(a)),
                Err(reason) => {
                    warn!(%resource, %reason, kind = reason.kind(), "Allocate refused");
                    return Err(refusal(Rpc::Allocate, &reason));
                }
            }
        }
        {
            // Recorded under the state lock (lock order: core, then lists), so that whoever
            // holds the state lock sees every allocation it holds reflected in the cache's
            // rules ([`Shared::finish_ahead`]).
            let mut lists = self.shared.lists.lock();
            for c in &requests {
                lists.answered(&resource, &c.devices_ids, t0);
            }
        }
        drop(core);
        *self.shared.last_allocate.lock() = Instant::now();
        self.shared.prefetch_wanted.notify_one();
        tracing::debug!(us = t0.elapsed().as_micros() as u64, "Allocate handled");
        Ok(Response::new(dp::AllocateResponse {
            container_responses,
        }))
    }

    #[tracing::instrument(
        name = "PreStartContainer",
        skip_all,
        fields(resource = ?self.kind, devices = tracing::field::Empty, container = tracing::field::Empty)
    )]
    async fn pre_start_container(
        &self,
        req: Request<dp::PreStartContainerRequest>,
    ) -> Result<Response<dp::PreStartContainerResponse>, Status> {
        let t0 = Instant::now();
        let ids = req.into_inner().devices_ids;
        tracing::Span::current().record("devices", tracing::field::debug(Ids(&ids)));
        let (socket, domain) = {
            let core = self.shared.core.lock();
            if let Some(id) = core.already_started(self.kind, &ids) {
                tracing::debug!(allocation = %id, us = t0.elapsed().as_micros() as u64, "PreStartContainer: already configured");
                return Ok(Response::new(dp::PreStartContainerResponse {}));
            }
            (
                core.settings.pod_resources_socket.clone(),
                core.settings.domain.clone(),
            )
        };
        let t1 = Instant::now();
        let held = self
            .shared
            .holdings(&socket, &domain, self.kind, &ids)
            .await
            .map_err(|e| {
                warn!(reason = %e, kind = e.kind(), "PreStartContainer refused");
                pod_resources_refusal(&e)
            })?;
        tracing::debug!(us = t1.elapsed().as_micros() as u64, "PodResources lookup");
        let who = held
            .as_ref()
            .map(|h| format!("{}/{}/{}", h.namespace, h.pod, h.container));
        if let Some(w) = &who {
            tracing::Span::current().record("container", w.as_str());
        }
        let (pod, assigned) = match (&self.shared.api, &held) {
            (Some(api), Some(h)) => self.shared.follow(api, h).await,
            _ => (None, None),
        };
        let res = self.shared.core.lock().pre_start_with(
            self.kind,
            &ids,
            held,
            None,
            pod.as_ref(),
            assigned,
        );
        match res {
            Ok(id) => {
                info!(allocation = %id, container = who.as_deref().unwrap_or("?"), us = t0.elapsed().as_micros() as u64, "container configured");
                Ok(Response::new(dp::PreStartContainerResponse {}))
            }
            Err(reason) => {
                warn!(%reason, kind = reason.kind(), "PreStartContainer refused");
                Err(refusal(Rpc::PreStartContainer, &reason))
            }
        }
    }
}

/// A span's view of a request's device IDs: the first few and how many (a memory request
/// holds one ID per 256 MiB), so an allocation can be followed from Allocate to
/// PreStartContainer in the log without a line of hundreds of IDs.
struct Ids<'a>(&'a [String]);

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

/// [`Ids`] of the first container request of an Allocate.
fn first_ids(requests: &[dp::ContainerAllocateRequest]) -> Ids<'_> {
    Ids(requests.first().map_or(&[][..], |c| &c.devices_ids))
}

/// The options both plugins register with (and answer GetDevicePluginOptions with).
pub fn options() -> dp::DevicePluginOptions {
    dp::DevicePluginOptions {
        pre_start_required: true,
        get_preferred_allocation_available: true,
    }
}

impl Shared {
    /// Which container holds `ids` of `kind`, and what it holds of both resources: from the
    /// cached list when [`ListCache::usable`] allows, else from a fresh `List`.
    pub async fn holdings(
        &self,
        socket: &std::path::Path,
        domain: &str,
        kind: Kind,
        ids: &[String],
    ) -> Result<Option<Holdings>, PodResourcesError> {
        let cached = self.lists.lock().usable();
        if let Some(found) = cached.and_then(|l| find(&l, domain, kind, ids)) {
            return Ok(Some(found));
        }
        let listing = self.listing.lock().await;
        // A list that arrived while we waited for the lock may do.
        let cached = self.lists.lock().usable();
        if let Some(found) = cached.and_then(|l| find(&l, domain, kind, ids)) {
            return Ok(Some(found));
        }
        let list = self.fresh_list(socket).await?;
        drop(listing);
        Ok(find(&list, domain, kind, ids))
    }

    /// `List` now (and cache the answer).
    pub async fn fresh_list(
        &self,
        socket: &std::path::Path,
    ) -> Result<Arc<pr::ListPodResourcesResponse>, PodResourcesError> {
        let channel = {
            let mut cached = self.pod_resources.lock().await;
            match cached.as_ref() {
                Some(c) => c.clone(),
                None => {
                    let endpoint = tonic::transport::Endpoint::from_static("http://localhost")
                        .connect_timeout(Duration::from_secs(2))
                        .timeout(Duration::from_secs(10));
                    let c = vcuda_proto::uds::connect_with(endpoint, socket)
                        .await
                        .map_err(|source| PodResourcesError::Connect {
                            socket: socket.to_path_buf(),
                            source,
                        })?;
                    *cached = Some(c.clone());
                    c
                }
            }
        };
        let token = self.lists.lock().requesting();
        let mut client = pr::pod_resources_lister_client::PodResourcesListerClient::new(channel);
        let list = match client.list(pr::ListPodResourcesRequest {}).await {
            Ok(l) => Arc::new(l.into_inner()),
            Err(status) => {
                *self.pod_resources.lock().await = None; // dial afresh next time
                return Err(PodResourcesError::List {
                    socket: socket.to_path_buf(),
                    status,
                });
            }
        };
        self.lists.lock().store(token, list.clone(), Instant::now());
        Ok(list)
    }

    /// Runs for ever: once Allocates have been quiet for [`PREFETCH_QUIET`], list
    /// PodResources so that the coming PreStartContainers find the answer waiting.
    pub async fn prefetch(self: Arc<Self>) {
        loop {
            self.prefetch_wanted.notified().await;
            loop {
                let quiet_at = *self.last_allocate.lock() + PREFETCH_QUIET;
                if Instant::now() >= quiet_at {
                    break;
                }
                tokio::time::sleep_until(quiet_at.into()).await;
            }
            let listing = self.listing.lock().await;
            if self.lists.lock().stale() {
                let socket = self.core.lock().settings.pod_resources_socket.clone();
                if let Err(e) = self.fresh_list(&socket).await {
                    tracing::debug!(error = %e, "PodResources prefetch failed; PreStartContainer will list itself");
                }
            }
            drop(listing);
            // With the API server, a container is configured only with its pod's
            // annotations at hand (assignment, gpu-count).
            let cluster = match &self.api {
                Some(api) => match api.vouched_pods().await {
                    Ok(c) => Some(c),
                    Err(e) => {
                        tracing::debug!(error = %e, "not configuring ahead: PreStartContainer will read the pod");
                        continue;
                    }
                },
                None => None,
            };
            self.finish_ahead(cluster.as_ref().map(|(p, r)| (p.as_slice(), r.as_ref())));
        }
    }

    /// With a list as good as a fresh one, do PreStartContainer's work now for the
    /// allocations it shows (pair, config, region), so that PreStartContainer finds them
    /// done. What fails here is left for PreStartContainer to fail with its reason.
    fn finish_ahead(&self, cluster: Option<(&[PodFacts], Option<&Reservations>)>) {
        // Hold the state lock throughout: Allocates record under it, so no allocation can
        // appear between checking the list and configuring from it (a list older than an
        // Allocate of the same cores would name the previous holder).
        let mut core = self.core.lock();
        let Some(list) = self.lists.lock().usable() else {
            return;
        };
        let domain = core.settings.domain.clone();
        let waiting: Vec<Vec<String>> = core
            .allocations()
            .filter(|a| !a.finished())
            .map(|a| a.cores.clone())
            .collect();
        for cores in waiting {
            let Some(held) = find(&list, &domain, Kind::Core, &cores) else {
                continue;
            };
            let who = format!("{}/{}/{}", held.namespace, held.pod, held.container);
            let pod = cluster.map(|(ps, _)| {
                ps.iter()
                    .find(|p| p.namespace == held.namespace && p.name == held.pod)
            });
            if pod == Some(None) {
                continue; // bound after the list: PreStartContainer reads it
            }
            let pod = pod.flatten();
            let assigned = pod.and_then(|p| {
                assign::effective(
                    p,
                    &held.container,
                    cluster.and_then(|c| c.1),
                    &core.overrides,
                )
                .transpose()
            });
            match core.pre_start_with(Kind::Core, &cores, Some(held), None, pod, assigned) {
                Ok(id) => {
                    info!(allocation = %id, container = %who, "container configured ahead of PreStartContainer")
                }
                Err(e) => {
                    tracing::debug!(container = %who, error = %e, "not configured ahead; PreStartContainer will say why")
                }
            }
        }
    }
}

impl Shared {
    /// With the API server: for each container of a GetPreferredAllocation, the GPUs the
    /// answer should use (see [`assign::admitting`] and [`assign::wanted`]); `None` where the
    /// manager chooses by itself (no pod found, the API server or PodResources not
    /// answering).
    pub async fn decide(
        &self,
        api: &ApiServer,
        kind: Kind,
        requests: &[dp::ContainerPreferredAllocationRequest],
    ) -> Vec<Option<Vec<(String, usize)>>> {
        let none = vec![None; requests.len()];
        let node = self.core.lock().inventory.node.clone();
        let (pods, reservations) = match api.vouched_pods().await {
            Ok(c) => c,
            Err(e) => {
                warn!(error = %e, "GetPreferredAllocation without the scheduler's assignments");
                return none;
            }
        };
        // Nothing to follow: no list needed.
        if !pods.iter().any(|p| {
            !p.finished && (p.assignment.is_some() || matches!(p.gpu_count, Ok(n) if n > 1))
        }) {
            return none;
        }
        let (holds, gpus_of) = match self.holds().await {
            Ok(h) => h,
            Err(e) => {
                warn!(error = %e, "GetPreferredAllocation without PodResources: choosing by myself");
                return none;
            }
        };
        let other = match kind {
            Kind::Core => Kind::Memory,
            Kind::Memory => Kind::Core,
        };
        let core = self.core.lock();
        requests
            .iter()
            .map(|r| {
                let size = r.allocation_size.max(0) as u64;
                let (p, c) = assign::admitting(&pods, &holds, kind, size)?;
                let available: Vec<DeviceId> = r
                    .available_device_i_ds
                    .iter()
                    .filter_map(|i| DeviceId::parse(i))
                    .collect();
                let went = gpus_of
                    .get(&(p.namespace.clone(), p.name.clone(), c.name.clone(), other))
                    .cloned()
                    .unwrap_or_default();
                let assigned =
                    assign::effective(p, &c.name, reservations.as_ref(), &core.overrides)
                        .ok()
                        .flatten();
                let want = assign::wanted(
                    p,
                    c,
                    assigned.as_deref(),
                    kind,
                    &node,
                    &available,
                    &went,
                );
                tracing::debug!(pod = %format!("{}/{}", p.namespace, p.name), container = %c.name, ?want, "GetPreferredAllocation for");
                want
            })
            .collect()
    }

    /// Who holds which of our resources now (a fresh PodResources list), and on which GPUs.
    pub async fn holds(
        &self,
    ) -> Result<(Holds, HashMap<(String, String, String, Kind), Vec<String>>), PodResourcesError>
    {
        let (socket, domain) = {
            let core = self.core.lock();
            (
                core.settings.pod_resources_socket.clone(),
                core.settings.domain.clone(),
            )
        };
        let list = {
            let _listing = self.listing.lock().await;
            self.fresh_list(&socket).await?
        };
        let (core_name, mem_name) = (Kind::Core.resource(&domain), Kind::Memory.resource(&domain));
        let mut holds = Holds::new();
        let mut gpus_of: HashMap<(String, String, String, Kind), Vec<String>> = HashMap::new();
        for p in &list.pod_resources {
            for c in &p.containers {
                for d in &c.devices {
                    let k = if d.resource_name == core_name {
                        Kind::Core
                    } else if d.resource_name == mem_name {
                        Kind::Memory
                    } else {
                        continue;
                    };
                    if d.device_ids.is_empty() {
                        continue;
                    }
                    let key = (p.namespace.clone(), p.name.clone(), c.name.clone(), k);
                    let g = gpus_of.entry(key.clone()).or_default();
                    for id in d.device_ids.iter().filter_map(|i| DeviceId::parse(i)) {
                        if !g.contains(&id.uuid) {
                            g.push(id.uuid);
                        }
                    }
                    holds.insert(key);
                }
            }
        }
        Ok((holds, gpus_of))
    }

    /// PreStartContainer with the API server: the pod, and the scheduler's decision its
    /// container must agree with. When the devices disagree but an identical pending pod was
    /// assigned exactly them (the kubelet admitted the two in another order than they were
    /// bound), the two decisions are exchanged ([`assign::partner`]): this container's
    /// decision becomes what it holds, the other pod's becomes this one's, and the publisher
    /// writes the exchange into the Node's reservations.
    pub async fn follow(
        &self,
        api: &ApiServer,
        held: &Holdings,
    ) -> (Option<PodFacts>, Option<Result<Vec<GpuShare>, AssignError>>) {
        let (pod, reservations) = match api.vouched_pod(&held.namespace, &held.pod).await {
            Ok(c) => c,
            Err(e) => {
                warn!(error = %e, "PreStartContainer without the pod's annotations (assignment and gpu-count not checked)");
                return (None, None);
            }
        };
        let Some(pod) = pod else {
            return (None, None);
        };
        let (assigned, actual) = {
            let core = self.core.lock();
            let assigned = assign::effective(
                &pod,
                &held.container,
                reservations.as_ref(),
                &core.overrides,
            )
            .transpose();
            (assigned, core.unchecked_shape(held))
        };
        let (Some(Ok(x_assigned)), Some(actual)) = (&assigned, actual) else {
            return (Some(pod), assigned);
        };
        if assign::shape(x_assigned) == actual {
            return (Some(pod), assigned);
        }
        // A disagreement: is it an exchange with an identical pod?
        let (pods, holds) = match tokio::join!(api.node_pods(), self.holds()) {
            (Ok(mut p), Ok((h, _))) => {
                for y in &mut p {
                    assign::vouch(y, reservations.as_ref());
                }
                (p, h)
            }
            (Err(e), _) => {
                warn!(error = %e, "cannot look for an identical pod to exchange with");
                return (Some(pod), assigned);
            }
            (_, Err(e)) => {
                warn!(error = %e, "cannot look for an identical pod to exchange with");
                return (Some(pod), assigned);
            }
        };
        let mut core = self.core.lock();
        let models: HashMap<String, String> = core
            .inventory
            .gpus
            .iter()
            .zip(&core.inventory.models)
            .map(|(g, m)| (g.uuid.clone(), m.clone()))
            .collect();
        let effective = |y: &PodFacts| {
            assign::effective(
                y,
                &y.containers[0].name,
                reservations.as_ref(),
                &core.overrides,
            )
            .ok()
            .flatten()
        };
        let model = |u: &str| models.get(u).cloned().unwrap_or_default();
        let Some(y) = assign::partner(&pods, &holds, &pod, x_assigned, &actual, &effective, &model)
        else {
            return (Some(pod), assigned);
        };
        let gpu_memory = |u: &str| {
            core.inventory
                .gpus
                .iter()
                .find(|g| g.uuid == u)
                .map_or(0, |g| g.memory)
        };
        // What this container holds, as shares (a whole GPU's memory is the GPU's).
        let mine: Vec<GpuShare> = actual
            .iter()
            .map(|(u, &(c, b))| GpuShare {
                uuid: u.clone(),
                core_percent: c,
                memory_bytes: if c >= 100 { gpu_memory(u) } else { b },
            })
            .collect();
        info!(
            pod = %format!("{}/{}", pod.namespace, pod.name),
            with = %format!("{}/{}", y.namespace, y.name),
            "the kubelet admitted two identical pods in another order than they were bound: their assignments are exchanged"
        );
        let y_uid = y.uid.clone();
        core.overrides.insert(y_uid, x_assigned.clone());
        core.changed.notify_one();
        (Some(pod), Some(Ok(mine)))
    }
}

/// The container of a PodResources list holding any of `ids` of `kind` (the list has one
/// entry per device: group by resource name).
pub fn find(
    list: &pr::ListPodResourcesResponse,
    domain: &str,
    kind: Kind,
    ids: &[String],
) -> Option<Holdings> {
    let (core_name, mem_name, mine) = (
        Kind::Core.resource(domain),
        Kind::Memory.resource(domain),
        kind.resource(domain),
    );
    for pod in &list.pod_resources {
        for c in &pod.containers {
            let of = |name: &str| -> Vec<String> {
                c.devices
                    .iter()
                    .filter(|d| d.resource_name == name)
                    .flat_map(|d| d.device_ids.clone())
                    .collect()
            };
            if of(&mine).iter().any(|d| ids.contains(d)) {
                return Some(Holdings {
                    namespace: pod.namespace.clone(),
                    pod: pod.name.clone(),
                    container: c.name.clone(),
                    cores: of(&core_name),
                    memory: of(&mem_name),
                });
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use vcuda_manager_core::placement::PlacementError;

    /// The kubelet reads the reason with a code that tells the request's fault from the
    /// node's.
    #[test]
    fn refusals_reach_the_kubelet_with_their_reason_and_code() {
        let request = CoreError::Placement(PlacementError::NoCores);
        let s = refusal(Rpc::Allocate, &request);
        assert_eq!(s.code(), tonic::Code::InvalidArgument);
        assert_eq!(s.message(), "vcuda: vcuda-core: no devices were allocated");
        let s = refusal(Rpc::PreStartContainer, &request);
        assert_eq!(s.code(), tonic::Code::FailedPrecondition);
        let node = CoreError::Files(crate::files::FileError::CreateDir {
            path: "/run/vcuda/alloc/a1/etc".into(),
            source: std::io::Error::from(std::io::ErrorKind::PermissionDenied),
        });
        for rpc in [Rpc::Allocate, Rpc::PreStartContainer] {
            let s = refusal(rpc, &node);
            assert_eq!(s.code(), tonic::Code::Internal);
            assert!(s.message().contains("/run/vcuda/alloc/a1/etc"), "{s:?}");
        }
        let e = PodResourcesError::List {
            socket: "/var/lib/kubelet/pod-resources/kubelet.sock".into(),
            status: Status::unavailable("no kubelet"),
        };
        let s = pod_resources_refusal(&e);
        assert_eq!(s.code(), tonic::Code::Unavailable);
        assert_eq!(
            s.message(),
            "vcuda: cannot ask the kubelet's PodResources API at /var/lib/kubelet/pod-resources/kubelet.sock: no kubelet"
        );
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
        assert_eq!(format!("{:?}", first_ids(&[])), "");
    }
}
