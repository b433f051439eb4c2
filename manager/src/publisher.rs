//! The one task that writes the node's Node annotations: the GPUs in `vcuda.io/gpus` and the
//! scheduler's reservations that are over (through the client in [`crate::apiserver`];
//! decisions in [`vcuda_manager_core::assign`]). Above [`crate::plugin`], whose shared state it reads.
//!
//! **Publishing.** After any change of the allocations or of GPU health (debounced by
//! [`DEBOUNCE`]) and every [`REFRESH`] otherwise, it lists the node's pods, reads the Node,
//! computes the inventory and the reservations that are over, and merge-patches both
//! annotations with the Node's `resourceVersion` as precondition (409 → read again). Nothing
//! is written when nothing changed.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::json;
use tracing::{debug, info, warn};
use vcuda_cluster::{Reservations, INVENTORY_ANNOTATION, RESERVATIONS_ANNOTATION, SCHEMA};

use crate::apiserver::{ApiError, ApiServer};
use crate::state::Shared;
use vcuda_manager_core::assign;

/// Wait this long after a change before publishing (a pod's containers change together).
pub const DEBOUNCE: Duration = Duration::from_millis(100);
/// Publish at least this often (health, reservations of pods that never came).
pub const REFRESH: Duration = Duration::from_secs(10);
/// A reservation whose pod is not bound here this long after the bind is dropped.
pub const RESERVATION_GRACE: Duration = Duration::from_secs(60);
/// Attempts per publication when the Node keeps changing under us.
const ATTEMPTS: u32 = 10;

/// A publication did not happen (it is tried again: every 2 s while it fails).
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    #[error(transparent)]
    Api(#[from] ApiError),
    #[error("cannot encode annotation {annotation}: {source}")]
    Encode {
        annotation: &'static str,
        source: serde_json::Error,
    },
    #[error("node {node} changed under every one of {attempts} attempts to write it; is another writer patching it in a loop?")]
    KeptChanging { node: String, attempts: u32 },
}

impl PublishError {
    /// A short stable name for counting errors by kind.
    pub fn kind(&self) -> &'static str {
        match self {
            PublishError::Api(e) => e.kind(),
            PublishError::Encode { .. } => "encode",
            PublishError::KeptChanging { .. } => "kept-changing",
        }
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// At shutdown: publish every GPU as unhealthy, so that the scheduler sends no pod here
/// while no device plugin answers the kubelet (it would be refused at admission). The
/// next manager publishes the real health at start. Bounded: a shutdown never waits on
/// the API server for more than 2 s.
pub async fn withdraw(api: &ApiServer, shared: &Shared) {
    let attempt = async {
        for _ in 0..ATTEMPTS {
            if publish_once(api, shared, true).await? {
                return Ok(());
            }
        }
        Err(PublishError::KeptChanging {
            node: api.node.clone(),
            attempts: ATTEMPTS,
        })
    };
    match tokio::time::timeout(Duration::from_secs(2), attempt).await {
        Ok(Ok(())) => {
            info!(node = %api.node, "vcuda.io/gpus marked unhealthy until the manager is back")
        }
        Ok(Err(e)) => warn!(error = %e, "cannot mark the GPUs unhealthy at shutdown"),
        Err(_) => warn!(
            "cannot mark the GPUs unhealthy at shutdown: the API server did not answer in 2 s"
        ),
    }
}

/// Publish once (`down`: every GPU unhealthy): `Ok(true)` written or nothing to write,
/// `Ok(false)` conflict (retry).
async fn publish_once(api: &ApiServer, shared: &Shared, down: bool) -> Result<bool, PublishError> {
    let pods = api.node_pods().await?;
    let (rv, ann) = api.node_annotations().await?;
    let (inventory, allocs, overrides, gpu_modes, node_modes) = {
        let core = shared.core.lock();
        (
            core.inventory.clone(),
            core.allocations().cloned().collect::<Vec<_>>(),
            core.overrides.clone(),
            core.locks.gpu_modes(),
            core.locks.node_modes(),
        )
    };
    let mut health = shared.health.borrow().clone();
    if down {
        health.iter_mut().for_each(|h| *h = false);
    }
    // An allocation PreStartContainer has not finished counts only while the kubelet still
    // holds its devices: an admission that failed after Allocate leaves one behind until
    // garbage collection. (Its pod's reservation counts it meanwhile.)
    let socket = shared.core.lock().settings.pod_resources_socket.clone();
    let list = {
        let _listing = shared.listing.lock().await;
        shared.fresh_list(&socket).await.ok()
    };
    let held: Option<HashSet<String>> = list.map(|l| {
        l.pod_resources
            .iter()
            .flat_map(|p| &p.containers)
            .flat_map(|c| &c.devices)
            .flat_map(|d| d.device_ids.iter().cloned())
            .collect()
    });
    let counted: Vec<_> = allocs
        .iter()
        .filter(|a| {
            a.finished()
                || held
                    .as_ref()
                    .is_none_or(|h| a.cores.iter().any(|c| h.contains(c)))
        })
        .cloned()
        .collect();
    let mut inv = assign::node_inventory(&inventory, &health, &counted, &pods);
    // The Lease the scheduler checks this node's liveness by (crate::lease renews it).
    inv.lease = Some(api.holder.lease.clone());
    // Each GPU's mode, and the node's modes (absent on a node serving shares only, as
    // before modes: an older scheduler reads it unchanged).
    for (g, (uuid, mode, slices)) in inv.gpus.iter_mut().zip(gpu_modes) {
        if g.uuid == uuid {
            g.mode = mode.map(crate::locks::gpu_mode);
            g.slices_held = slices;
        }
    }
    inv.modes = node_modes;
    let inv_json = serde_json::to_string(&inv).map_err(|source| PublishError::Encode {
        annotation: INVENTORY_ANNOTATION,
        source,
    })?;
    let mut patch = serde_json::Map::new();
    if ann.get(INVENTORY_ANNOTATION) != Some(&inv_json) {
        patch.insert(INVENTORY_ANNOTATION.into(), json!(inv_json));
    }
    let mut retired = Vec::new();
    let mut exchanged = Vec::new();
    if let Some(text) = ann.get(RESERVATIONS_ANNOTATION) {
        match serde_json::from_str::<Reservations>(text) {
            Ok(mut res) => {
                // Exchanges first (assign::partner): a retired pod's and its partner's
                // reservations change in the same write.
                for r in &mut res.pods {
                    if let Some(o) = overrides.get(r.uid.as_str()) {
                        if &r.gpus != o {
                            r.gpus = o.clone();
                            exchanged.push(r.uid.clone());
                        }
                    }
                }
                retired = assign::retire(
                    &res,
                    &pods,
                    &allocs,
                    unix_ms(),
                    RESERVATION_GRACE.as_millis() as u64,
                );
                if !retired.is_empty() || !exchanged.is_empty() {
                    res.pods.retain(|r| !retired.contains(&r.uid));
                    res.schema = SCHEMA;
                    let v = serde_json::to_string(&res).map_err(|source| PublishError::Encode {
                        annotation: RESERVATIONS_ANNOTATION,
                        source,
                    })?;
                    patch.insert(RESERVATIONS_ANNOTATION.into(), json!(v));
                }
            }
            Err(e) => {
                warn!(node = %api.node, error = %e, "annotation {RESERVATIONS_ANNOTATION} is not readable; left as it is")
            }
        }
    }
    // After a write (or when none was needed): see assign::keep_overrides.
    let live: HashSet<&str> = pods
        .iter()
        .filter(|p| !p.finished)
        .map(|p| p.uid.as_str())
        .collect();
    let forget = |shared: &Shared| {
        assign::keep_overrides(&mut shared.core.lock().overrides, &overrides, &live);
    };
    if patch.is_empty() {
        forget(shared);
        return Ok(true);
    }
    if !api.patch_annotations(&rv, patch).await? {
        return Ok(false);
    }
    forget(shared);
    debug!(node = %api.node, retired = retired.len(), exchanged = exchanged.len(), "published vcuda.io/gpus");
    if !retired.is_empty() {
        info!(node = %api.node, pods = %retired.join(","), "reservations retired: the pods are allocated here (or gone)");
    }
    Ok(true)
}

/// Runs for ever: publish after every change (debounced) and every [`REFRESH`].
pub async fn publish_loop(api: Arc<ApiServer>, shared: Arc<Shared>) {
    let changed = shared.core.lock().changed.clone();
    let mut health = shared.health.subscribe();
    // The last failure's message: a failure is logged when it changes, not every 2 s.
    let mut last_error: Option<String> = None;
    loop {
        for _ in 0..ATTEMPTS {
            match publish_once(&api, &shared, false).await {
                Ok(true) => {
                    if last_error.take().is_some() {
                        info!(node = %api.node, "publishing vcuda.io/gpus again");
                    }
                    break;
                }
                Ok(false) => continue,
                Err(e) => {
                    let text = e.to_string();
                    if last_error.as_ref() != Some(&text) {
                        warn!(error = %text, kind = e.kind(), "cannot publish the node's GPUs; retrying");
                    }
                    last_error = Some(text);
                    break;
                }
            }
        }
        let wait = if last_error.is_some() {
            Duration::from_secs(2)
        } else {
            REFRESH
        };
        tokio::select! {
            _ = changed.notified() => {}
            _ = health.changed() => {}
            _ = tokio::time::sleep(wait) => {}
        }
        tokio::time::sleep(DEBOUNCE).await;
    }
}
