//! Following the scheduler through the API server: which GPUs a GetPreferredAllocation
//! should answer with, and the pod's word PreStartContainer checks the devices against
//! (the decisions are `vcuda_manager_core::assign`'s; this is the reading).

use std::collections::HashMap;
use std::time::Duration;

use tracing::{info, warn};
use vcuda_proto::deviceplugin::v1beta1 as dp;

use crate::apiserver::ApiServer;
use crate::podresources::PodResourcesError;
use crate::state::Shared;
use vcuda_cluster::GpuShare;
use vcuda_manager_core::allocation::Holdings;
use vcuda_manager_core::assign::{self, AssignError, Decision, Holds, PodFacts};
use vcuda_manager_core::ids::{ContainerRef, DeviceId, Kind};

/// The GPUs (UUIDs, in PodResources' order) each container's resource is on.
pub type GpusOf = HashMap<(ContainerRef, Kind), Vec<String>>;

/// How long a kubelet call waits for the API server (the kubelet gives a PreStartContainer
/// 30 s): a node cut off from it answers within this, refusing what it cannot check.
const API_DEADLINE: Duration = Duration::from_secs(5);

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
        let (pods, reservations) = match tokio::time::timeout(API_DEADLINE, api.vouched_pods())
            .await
        {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => {
                warn!(error = %e, "GetPreferredAllocation without the scheduler's assignments");
                return none;
            }
            Err(_) => {
                warn!(deadline_s = API_DEADLINE.as_secs(), "GetPreferredAllocation without the scheduler's assignments: the API server did not answer in time");
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
                    .get(&(p.container(&c.name), other))
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
                tracing::debug!(pod = %p.key(), container = %c.name, ?want, "GetPreferredAllocation for");
                want
            })
            .collect()
    }

    /// Who holds which of our resources now (a fresh PodResources list), and on which GPUs.
    pub async fn holds(&self) -> Result<(Holds, GpusOf), PodResourcesError> {
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
        let mut gpus_of = GpusOf::new();
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
                    let key = (ContainerRef::new(&p.namespace, &p.name, &c.name), k);
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
    pub async fn follow(&self, api: &ApiServer, held: &Holdings) -> (Option<PodFacts>, Decision) {
        let read = tokio::time::timeout(API_DEADLINE, api.vouched_pod(&held.namespace, &held.pod));
        let (pod, reservations) = match read.await {
            Ok(Ok(c)) => c,
            failed => {
                let error = match failed {
                    Ok(Err(e)) => e.to_string(),
                    _ => format!("no answer within {} s", API_DEADLINE.as_secs()),
                };
                warn!(%error, "PreStartContainer cannot read the pod from the API server: only a container configured before starts");
                let unverified = AssignError::Unverified {
                    pod: format!("{}/{}", held.namespace, held.pod),
                    container: held.container.clone(),
                    error,
                };
                return (None, Decision::Unverified(unverified));
            }
        };
        let Some(pod) = pod else {
            return (None, Decision::None);
        };
        let (assigned, actual) = {
            let core = self.core.lock();
            let assigned = assign::effective(
                &pod,
                &held.container,
                reservations.as_ref(),
                &core.overrides,
            )
            .into();
            (assigned, core.unchecked_shape(held))
        };
        let (Decision::Follow(x_assigned), Some(actual)) = (&assigned, actual) else {
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
            pod = %pod.key(),
            with = %y.key(),
            "the kubelet admitted two identical pods in another order than they were bound: their assignments are exchanged"
        );
        let y_uid = y.uid.clone();
        core.overrides.insert(y_uid, x_assigned.clone());
        core.changed.notify_one();
        (Some(pod), Decision::Follow(mine))
    }
}
