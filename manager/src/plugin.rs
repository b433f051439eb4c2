//! The device-plugin backend of every resource the manager serves, one [`Shares`] per
//! resource behind the generic DevicePlugin server ([`crate::backend::Server`]): shares —
//! GPUs cut into `vcuda-core` (1 % of a GPU each) and `vcuda-memory` (256 MiB each) — and,
//! when their modes are enabled (issue 19), whole GPUs and slices. Each lists only the
//! devices of GPUs unlocked or locked to its mode, again at every lock change. Thin:
//! decisions are in [`crate::core`], [`crate::locks`] and the pure crate. What the kubelet
//! reads of a refusal is decided here, in one place ([`refusal`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use tokio_stream::StreamExt;
use tonic::Status;
use tracing::{info, warn};
use vcuda_proto::deviceplugin::v1beta1 as dp;

use crate::backend::{Backend, DeviceStream};
use crate::core::{Core, CoreError, PreStart};
use crate::podresources::PodResourcesError;
use crate::state::Shared;
use vcuda_manager_core::allocation::Answer;
use vcuda_manager_core::assign::Decision;
use vcuda_manager_core::ids::{all_ids, DeviceId, Kind};
use vcuda_manager_core::modes::{Resource, SliceId};

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

/// The backend of one resource.
pub struct Shares {
    /// Which resource; for the share resources, `kind` is its kind (for whole GPUs and
    /// slices, [`Kind::Core`]: a slice allocation keeps its IDs where a share keeps its
    /// `vcuda-core` IDs).
    mode_resource: Resource,
    kind: Kind,
    /// Its full name: `<domain>/vcuda-core`, `<domain>/sgpu`, `nvidia.com/gpu`…
    resource: String,
    shared: Arc<Shared>,
}

impl Shares {
    pub fn new(mode_resource: Resource, shared: Arc<Shared>) -> Shares {
        let resource = shared
            .core
            .lock()
            .locks
            .settings()
            .resource_name(mode_resource);
        let kind = match mode_resource {
            Resource::Shared(kind) => kind,
            Resource::Whole | Resource::Slice => Kind::Core,
        };
        Shares {
            mode_resource,
            kind,
            resource,
            shared,
        }
    }
}

/// The device-plugin socket of a resource, in the kubelet's plugin directory.
pub fn socket(resource: Resource) -> &'static str {
    match resource {
        Resource::Shared(kind) => kind.socket(),
        Resource::Whole => "vcuda-whole.sock",
        Resource::Slice => "vcuda-sgpu.sock",
    }
}

/// The complete device list of `resource` (the kubelet rebuilds its sets from every
/// message): every device of each GPU that serves its mode now.
pub fn devices(core: &Core, resource: Resource, health: &[bool]) -> Vec<dp::Device> {
    let inv = &core.inventory;
    let mut out = Vec::new();
    for (g, gpu) in inv.gpus.iter().enumerate() {
        if !core.locks.advertises(resource, &gpu.uuid) {
            continue;
        }
        let healthy = health.get(g).copied().unwrap_or(true);
        let topology = inv
            .numa
            .get(g)
            .copied()
            .flatten()
            .map(|n| dp::TopologyInfo {
                nodes: vec![dp::NumaNode { id: n }],
            });
        let ids: Vec<String> = match resource {
            Resource::Shared(kind) => all_ids(&gpu.uuid, kind, gpu.memory)
                .iter()
                .map(ToString::to_string)
                .collect(),
            Resource::Whole => vec![gpu.uuid.clone()],
            Resource::Slice => (0..core.locks.settings().slices())
                .map(|k| SliceId::new(&gpu.uuid, k).to_string())
                .collect(),
        };
        for id in ids {
            out.push(dp::Device {
                id,
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
        // With `--cdi`, the allocation's spec makes the same edits as the fields above,
        // which stay for runtimes (and kubelets before 1.29) that do not apply CDI.
        cdi_devices: a
            .cdi_devices
            .into_iter()
            .map(|name| dp::CdiDevice { name })
            .collect(),
    }
}

impl Shares {
    /// Allocate every container request under the state lock: the lock (kept, for the
    /// caller to record under) and the answers, or the first refusal.
    fn attempt(
        &self,
        requests: &[dp::ContainerAllocateRequest],
    ) -> Result<
        (
            parking_lot::MutexGuard<'_, Core>,
            Vec<dp::ContainerAllocateResponse>,
        ),
        CoreError,
    > {
        let mut core = self.shared.core.lock();
        let mut answers = Vec::new();
        for c in requests {
            let answer = match self.mode_resource {
                Resource::Shared(kind) => core.allocate(kind, &c.devices_ids)?,
                Resource::Whole => core.allocate_whole(&c.devices_ids)?,
                Resource::Slice => core.allocate_slices(&c.devices_ids)?,
            };
            answers.push(to_proto(answer));
        }
        Ok((core, answers))
    }
}

#[tonic::async_trait]
impl Backend for Shares {
    fn resource(&self) -> String {
        self.resource.clone()
    }

    fn options(&self) -> dp::DevicePluginOptions {
        options_of(self.mode_resource)
    }

    fn watch(&self) -> DeviceStream {
        let shared = self.shared.clone();
        let resource = self.mode_resource;
        // The current list at once, then the whole list again at every health change and
        // every lock change.
        let health =
            tokio_stream::wrappers::WatchStream::new(self.shared.health.subscribe()).map(|_| ());
        let locks =
            tokio_stream::wrappers::WatchStream::new(self.shared.core.lock().locks.subscribe())
                .map(|_| ());
        let stream = health.merge(locks).map(move |()| {
            let health = shared.health.borrow().clone();
            let devices = devices(&shared.core.lock(), resource, &health);
            Ok(dp::ListAndWatchResponse { devices })
        });
        Box::pin(stream)
    }

    async fn preferred(
        &self,
        requests: Vec<dp::ContainerPreferredAllocationRequest>,
    ) -> Result<Vec<Vec<String>>, Status> {
        let Resource::Shared(_) = self.mode_resource else {
            // Whole GPUs and slices: away from GPUs locked elsewhere, onto GPUs in the mode.
            let core = self.shared.core.lock();
            return Ok(requests
                .into_iter()
                .map(|c| {
                    core.locks.modes().steer(
                        self.mode_resource,
                        &c.available_device_i_ds,
                        &c.must_include_device_i_ds,
                        c.allocation_size.max(0) as usize,
                        None,
                    )
                })
                .collect());
        };
        let decided = match &self.shared.api {
            Some(api) => self.shared.decide(api, self.kind, &requests).await,
            None => vec![None; requests.len()],
        };
        let mut core = self.shared.core.lock();
        // The kubelet's view may be older than a lock: prefer only GPUs that serve shares.
        let serves = |id: &String| {
            DeviceId::parse(id).is_some_and(|d| core.locks.advertises(self.mode_resource, &d.uuid))
        };
        let requests: Vec<_> = requests
            .into_iter()
            .map(|mut c| {
                c.available_device_i_ds.retain(|id| serves(id));
                c
            })
            .collect();
        Ok(requests
            .into_iter()
            .zip(decided)
            .map(|(c, want)| {
                core.preferred_with(
                    self.kind,
                    &c.available_device_i_ds,
                    &c.must_include_device_i_ds,
                    c.allocation_size.max(0) as usize,
                    want.as_deref(),
                )
            })
            .collect())
    }

    async fn allocate(
        &self,
        requests: Vec<dp::ContainerAllocateRequest>,
    ) -> Result<Vec<dp::ContainerAllocateResponse>, Status> {
        let t0 = Instant::now();
        let resource = &self.resource;
        let mut released = false;
        let (core, container_responses) = loop {
            let reason = match self.attempt(&requests) {
                Ok(done) => break done,
                Err(reason) => reason,
            };
            // A GPU locked elsewhere, or a device held: the holder's container may have
            // ended since the last PodResources pass. Ask once, then judge again.
            if !released && reason.is_lock_conflict() {
                released = true;
                self.shared.release_ended().await;
                continue;
            }
            warn!(%resource, %reason, kind = reason.kind(), "Allocate refused");
            return Err(refusal(Rpc::Allocate, &reason));
        };
        {
            // Recorded under the state lock (lock order: core, then lists), so that whoever
            // holds the state lock sees every allocation it holds reflected in the cache's
            // rules ([`Shared::finish_ahead`]).
            let mut lists = self.shared.lists.lock();
            for c in &requests {
                lists.answered(resource, &c.devices_ids, t0);
            }
        }
        drop(core);
        *self.shared.last_allocate.lock() = Instant::now();
        self.shared.prefetch_wanted.notify_one();
        tracing::debug!(us = t0.elapsed().as_micros() as u64, "Allocate handled");
        Ok(container_responses)
    }

    async fn pre_start(&self, ids: Vec<String>) -> Result<(), Status> {
        let t0 = Instant::now();
        if self.mode_resource == Resource::Whole {
            return Ok(()); // not asked for: nothing to configure
        }
        let (socket, names) = {
            let core = self.shared.core.lock();
            if let Some(id) = core.already_started(self.kind, &ids) {
                tracing::debug!(allocation = %id, us = t0.elapsed().as_micros() as u64, "PreStartContainer: already configured");
                return Ok(());
            }
            (
                core.settings.pod_resources_socket.clone(),
                core.locks.settings().clone(),
            )
        };
        let t1 = Instant::now();
        let held = self
            .shared
            .holdings(&socket, &names, &ids)
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
            _ => (None, Decision::None),
        };
        let res = self.shared.core.lock().pre_start_with(PreStart {
            kind: self.kind,
            ids: &ids,
            held,
            pod_uid: None,
            pod: pod.as_ref(),
            assigned,
        });
        match res {
            Ok(id) => {
                info!(allocation = %id, container = who.as_deref().unwrap_or("?"), us = t0.elapsed().as_micros() as u64, "container configured");
                Ok(())
            }
            Err(reason) => {
                warn!(%reason, kind = reason.kind(), "PreStartContainer refused");
                Err(refusal(Rpc::PreStartContainer, &reason))
            }
        }
    }
}

/// The options the share plugins register with (and answer GetDevicePluginOptions with).
pub fn options() -> dp::DevicePluginOptions {
    options_of(Resource::Shared(Kind::Core))
}

/// The options of `resource`'s plugin: PreStartContainer configures the library for shares
/// and slices; a whole GPU has nothing to configure.
pub fn options_of(resource: Resource) -> dp::DevicePluginOptions {
    dp::DevicePluginOptions {
        pre_start_required: resource != Resource::Whole,
        get_preferred_allocation_available: true,
    }
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
}
