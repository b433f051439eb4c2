//! The Lease watch (I/O): every `--lease-poll`, list the vcuda-manager Leases
//! ([`LEASE_SELECTOR`]) in the namespaces the nodes' inventories name, feed their change
//! tokens to the [`Tracker`](crate::liveness::Tracker) in [`AppState::liveness`], and log what
//! changed: a node that became lost (with the pods bound there, whose GPUs stay booked until
//! they are deleted), a node that is back, and once per node one that publishes no Lease (an
//! older vcuda-manager: not checked). The verbs ask the same tracker
//! ([`AppState::lost`]). Above `state`; nothing imports it but the binary.
//!
//! Listing per namespace (not cluster-wide) keeps the scheduler's right to a namespaced
//! `list leases` where the managers run. A failed list changes nothing: the tracker judges
//! only on successful polls, so a scheduler cut off from the API server loses no node.

use std::collections::BTreeSet;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod as KPod;
use kube::api::ListParams;
use kube::Api;
use tracing::{info, warn};
use vcuda_cluster::{LeaseRef, INVENTORY_ANNOTATION};

use crate::liveness::{self, Change, LEASE_SELECTOR};
use crate::state::AppState;

/// `--lease-poll`'s default.
pub const DEFAULT_POLL: Duration = Duration::from_secs(2);

/// A Lease's change token: anything a renewal changes.
fn token(l: &Lease) -> String {
    let spec = l.spec.as_ref();
    format!(
        "{}|{}|{}",
        l.metadata.resource_version.as_deref().unwrap_or(""),
        spec.and_then(|s| s.renew_time.as_ref())
            .map(|t| t.0.to_rfc3339())
            .unwrap_or_default(),
        spec.and_then(|s| s.holder_identity.as_deref())
            .unwrap_or(""),
    )
}

/// Logs a failure when its message changes (not every poll); `None` logs a recovery.
fn note(last: &mut Option<String>, what: &str, error: Option<String>) {
    match error {
        Some(e) => {
            if last.as_ref() != Some(&e) {
                warn!(error = %e, "{what}; node liveness is not updated meanwhile (no node is judged lost for it)");
            }
            *last = Some(e);
        }
        None => {
            if last.take().is_some() {
                info!("{what} again");
            }
        }
    }
}

/// Runs for ever: poll every `poll`, and call `report` with the number of lost nodes after
/// each sweep (the `vcuda_scheduler_nodes_lost` gauge).
pub async fn watch<F>(state: AppState, poll: Duration, report: F)
where
    F: Fn(usize) + Send + 'static,
{
    let mut tick = tokio::time::interval(poll.max(Duration::from_millis(10)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut list_error = None;
    loop {
        tick.tick().await;
        // The nodes and the Leases their inventories name (node list reused ≤ 2 s).
        let metas = match state.node_metas(false).await {
            Ok(m) => m,
            Err(e) => {
                note(
                    &mut list_error,
                    "cannot list nodes for their liveness",
                    Some(format!("{e}; check the scheduler's RBAC (list nodes)")),
                );
                continue;
            }
        };
        // GPU nodes only: a node without an inventory is refused for that already.
        let nodes: Vec<(String, Option<LeaseRef>)> = metas
            .iter()
            .filter(|(_, m)| m.annotations.contains_key(INVENTORY_ANNOTATION))
            .map(|(name, m)| (name.clone(), liveness::lease_of(&m.annotations)))
            .collect();
        let namespaces: BTreeSet<&str> = nodes
            .iter()
            .filter_map(|(_, l)| l.as_ref().map(|l| l.namespace.as_str()))
            .collect();
        let mut listed = Vec::new();
        let mut failed = None;
        for ns in namespaces {
            let api: Api<Lease> = Api::namespaced(state.client.clone(), ns);
            match api
                .list(&ListParams::default().labels(LEASE_SELECTOR))
                .await
            {
                Ok(list) => listed.extend(list.items.iter().filter_map(|l| {
                    Some((
                        l.metadata
                            .namespace
                            .clone()
                            .unwrap_or_else(|| ns.to_string()),
                        l.metadata.name.clone()?,
                        token(l),
                    ))
                })),
                Err(e) => {
                    failed = Some(format!("cannot list the vcuda-manager Leases in namespace {ns}: {e}; check the scheduler's RBAC (list leases.coordination.k8s.io there)"));
                    break;
                }
            }
        }
        if failed.is_some() {
            note(&mut list_error, "cannot list Leases", failed);
            continue;
        }
        note(&mut list_error, "listing Leases", None);
        let changes = {
            let now = state.liveness.now_ms();
            let mut t = state
                .liveness
                .tracker
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            t.observe(now, listed);
            let changes = t.sweep(now, &nodes);
            report(t.lost_nodes());
            changes
        };
        for c in changes {
            match c {
                Change::Lost {
                    node,
                    lease,
                    unchanged_ms,
                } => {
                    warn!(node = %node, lease = %lease, unchanged_ms, "{}", liveness::refusal(&node, &lease, unchanged_ms));
                    log_bound_pods(&state, &node).await;
                }
                Change::Back { node } => {
                    info!(node = %node, "node {node} is back: its vcuda-manager Lease changed again; pods are placed there again");
                }
                Change::Unchecked { node } => {
                    info!(node = %node, "node {node}'s {INVENTORY_ANNOTATION} names no Lease (an older vcuda-manager): its liveness is not checked; upgrade its manager");
                }
            }
        }
    }
}

/// Log the pods bound to a lost node: they are not rescheduled by us, and their GPUs stay
/// booked in its inventory until they are deleted.
async fn log_bound_pods(state: &AppState, node: &str) {
    let lp = ListParams::default().fields(&format!("spec.nodeName={node}"));
    match Api::<KPod>::all(state.client.clone()).list(&lp).await {
        Ok(list) => {
            let pods: Vec<String> = list
                .items
                .iter()
                .map(|p| {
                    format!(
                        "{}/{}",
                        p.metadata.namespace.as_deref().unwrap_or(""),
                        p.metadata.name.as_deref().unwrap_or("")
                    )
                })
                .collect();
            warn!(node, pods = %pods.join(" "), count = pods.len(),
                "pods bound to lost node {node}: {}; their GPUs stay booked there until they are deleted (kubectl delete pod, or the node lifecycle controller's eviction)",
                if pods.is_empty() { "none".to_string() } else { pods.join(", ") });
        }
        Err(e) => {
            warn!(node, error = %e, "cannot list the pods bound to lost node {node}; check the scheduler's RBAC (list pods)")
        }
    }
}
