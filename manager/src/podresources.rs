//! The kubelet's PodResources API, which PreStartContainer asks which container it is for:
//! one kept channel, one `List` at a time, the answer cached by [`crate::lookup`]'s rules;
//! and the prefetch, which lists once Allocates are quiet and configures the containers it
//! shows ahead of their PreStartContainer.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tonic::Status;
use tracing::info;
use vcuda_proto::podresources::v1 as pr;

use crate::core::PreStart;
use crate::state::Shared;
use vcuda_cluster::Reservations;
use vcuda_manager_core::allocation::Holdings;
use vcuda_manager_core::assign::{self, Decision, PodFacts};
use vcuda_manager_core::ids::Kind;
use vcuda_manager_core::modes::{self, Resource};

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

/// How long Allocates must have been quiet before the manager lists PodResources ahead of
/// PreStartContainer (a container's resources are allocated back to back; the sandbox the
/// kubelet creates before starting it takes far longer).
const PREFETCH_QUIET: Duration = Duration::from_millis(5);

/// How often a node serving more than one mode looks for ended containers while a GPU is
/// locked ([`Shared::release_loop`]).
pub const RELEASE_EVERY: Duration = Duration::from_secs(1);

impl Shared {
    /// Which container holds `ids` of `kind`, and what it holds of both resources: from the
    /// cached list when [`ListCache::usable`] allows, else from a fresh `List`.
    pub async fn holdings(
        &self,
        socket: &std::path::Path,
        names: &modes::Settings,
        ids: &[String],
    ) -> Result<Option<Holdings>, PodResourcesError> {
        let cached = self.lists.lock().usable();
        if let Some(found) = cached.and_then(|l| find(&l, names, ids)) {
            return Ok(Some(found));
        }
        let listing = self.listing.lock().await;
        // A list that arrived while we waited for the lock may do.
        let cached = self.lists.lock().usable();
        if let Some(found) = cached.and_then(|l| find(&l, names, ids)) {
            return Ok(Some(found));
        }
        let list = self.fresh_list(socket).await?;
        drop(listing);
        Ok(find(&list, names, ids))
    }

    /// Release the mode locks of containers PodResources no longer lists (a fresh `List`;
    /// nothing when the kubelet does not answer). Returns how many were released.
    pub async fn release_ended(&self) -> usize {
        let (socket, asked) = {
            let core = self.core.lock();
            (
                core.settings.pod_resources_socket.clone(),
                core.locks.asked(unix_now()),
            )
        };
        let Ok(list) = self.fresh_list(&socket).await else {
            return 0;
        };
        let held = held_ids(&list);
        let core = &mut *self.core.lock();
        let n = core.locks.release_gone(&|id| held.contains(id), asked);
        if n > 0 {
            core.changed.notify_one();
        }
        n
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
        let asked = self.core.lock().locks.asked(unix_now());
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
        // Every list shows which locks' containers the kubelet has recorded.
        let held = held_ids(&list);
        self.core
            .lock()
            .locks
            .observe(&|id| held.contains(id), asked);
        Ok(list)
    }

    /// Runs for ever: every [`RELEASE_EVERY`] while a GPU is locked on a node serving more
    /// than one mode, release the locks of ended containers, so that a GPU serves the other
    /// modes again within about that long of its last pod's end (the control loop's
    /// collection, every ~10 s, would be slow for that).
    pub async fn release_loop(self: Arc<Self>) {
        loop {
            tokio::time::sleep(RELEASE_EVERY).await;
            if self.core.lock().locks.unlock_wanted() {
                self.release_ended().await;
            }
        }
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
        let names = core.locks.settings().clone();
        let waiting: Vec<Vec<String>> = core
            .allocations()
            .filter(|a| !a.finished())
            .map(|a| a.cores.clone())
            .collect();
        for cores in waiting {
            let Some(held) = find(&list, &names, &cores) else {
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
            let assigned = pod.map_or(Decision::None, |p| {
                assign::effective(
                    p,
                    &held.container,
                    cluster.and_then(|c| c.1),
                    &core.overrides,
                )
                .into()
            });
            let start = PreStart {
                kind: Kind::Core,
                ids: &cores,
                held: Some(held),
                pod_uid: None,
                pod,
                assigned,
            };
            match core.pre_start_with(start) {
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

/// Every device ID any container of `list` holds, of any resource (ours are unique across
/// resources: `…-core-…`, `…-mem-…`, `…-sgpu-NN`, a bare UUID).
pub fn held_ids(list: &pr::ListPodResourcesResponse) -> std::collections::HashSet<&str> {
    list.pod_resources
        .iter()
        .flat_map(|p| &p.containers)
        .flat_map(|c| &c.devices)
        .flat_map(|d| d.device_ids.iter().map(String::as_str))
        .collect()
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The container of a PodResources list holding any of `ids` (device IDs are unique across
/// our resources, so any entry of the container's counts), and what it holds of each of
/// our resources, named by `names` (the list has one entry per device: group by name).
pub fn find(
    list: &pr::ListPodResourcesResponse,
    names: &modes::Settings,
    ids: &[String],
) -> Option<Holdings> {
    let name = |r: Resource| names.resource_name(r);
    let (core_name, mem_name, slice_name, whole_name) = (
        name(Resource::Shared(Kind::Core)),
        name(Resource::Shared(Kind::Memory)),
        name(Resource::Slice),
        name(Resource::Whole),
    );
    let ours = [&core_name, &mem_name, &slice_name, &whole_name];
    for pod in &list.pod_resources {
        for c in &pod.containers {
            let of = |name: &str| -> Vec<String> {
                c.devices
                    .iter()
                    .filter(|d| d.resource_name == name)
                    .flat_map(|d| d.device_ids.clone())
                    .collect()
            };
            let mine = c
                .devices
                .iter()
                .filter(|d| ours.contains(&&d.resource_name))
                .flat_map(|d| &d.device_ids)
                .any(|d| ids.contains(d));
            if mine {
                return Some(Holdings {
                    namespace: pod.namespace.clone(),
                    pod: pod.name.clone(),
                    container: c.name.clone(),
                    cores: of(&core_name),
                    memory: of(&mem_name),
                    slices: of(&slice_name),
                    whole: of(&whole_name),
                });
            }
        }
    }
    None
}
