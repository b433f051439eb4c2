//! The bind verb (I/O): reserve the pod's GPUs on the Node, then create the Binding.
//!
//! 1. Read the Pod (its UID must be the one kube-scheduler placed) and the Node.
//! 2. Re-run [`placement::filter`] against the Node's inventory + current reservations.
//! 3. Merge-patch the Node's [`RESERVATIONS_ANNOTATION`] with the reservation appended, the
//!    patch carrying the Node's `metadata.resourceVersion`. A 409 Conflict means someone else
//!    (another replica, the manager) wrote the Node since step 1: re-read and re-check, up to
//!    [`MAX_ATTEMPTS`] times. The API server's compare-and-swap is the only serialisation, so
//!    two replicas can never both fit the same free share: no global lock is needed.
//! 4. Create the Binding (`pods/{name}/binding`) carrying the [`ASSIGNMENT_ANNOTATION`]; the
//!    API server copies a Binding's annotations onto the Pod in the same write that sets
//!    `spec.nodeName`, so a pod never carries an assignment without being bound.
//! 5. If the Binding fails, the reservation is removed again (best effort, also with the
//!    Node's resourceVersion).

use std::time::{SystemTime, UNIX_EPOCH};

use k8s_openapi::api::core::v1::{Node as KNode, Pod as KPod};
use kube::api::{Patch, PatchParams, PostParams};
use kube::Api;
use serde_json::json;
use thiserror::Error;
use vcuda_cluster::{
    Reservation, Reservations, ASSIGNMENT_ANNOTATION, RESERVATIONS_ANNOTATION, SCHEMA,
};

use crate::extender::{ExtenderBindingArgs, Pod};
use crate::placement::{self, NodeView};
use crate::request::pod_request;
use crate::server::{node_view, AppState};

/// How many times a bind re-reads the Node after a 409 Conflict.
pub const MAX_ATTEMPTS: u32 = 10;

/// Why a bind did not happen. The text goes back to kube-scheduler in `Error`.
#[derive(Debug, Error)]
pub enum BindError {
    #[error("cannot read {what}: {source}; check the scheduler's RBAC and the API server")]
    Read {
        what: String,
        #[source]
        source: kube::Error,
    },
    #[error("pod {pod} has uid {found}, not {expected}: it was recreated; it is rescheduled")]
    Recreated {
        pod: String,
        expected: String,
        found: String,
    },
    #[error("pod {pod} is already bound to node {node}")]
    AlreadyBound { pod: String, node: String },
    #[error("pod {pod} no longer fits: {reason}")]
    NoFit { pod: String, reason: String },
    #[error("pod {pod} cannot be read as a vcuda request: {reason}")]
    Request { pod: String, reason: String },
    #[error(
        "node {node} kept changing: {attempts} conflicting writes in a row; the pod is retried"
    )]
    Contended { node: String, attempts: u32 },
    #[error("cannot write the reservation on node {node}: {source}; check the scheduler's RBAC (patch nodes)")]
    Reserve {
        node: String,
        #[source]
        source: kube::Error,
    },
    #[error("cannot create the binding of pod {pod} to {node}: {source} (reservation released)")]
    Binding {
        pod: String,
        node: String,
        #[source]
        source: kube::Error,
    },
    #[error("{0}")]
    Internal(String),
}

fn is_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(r) if r.code == 409)
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The Node's reservations (a malformed annotation is an error: it would hide commitments).
fn reservations(
    node: &str,
    ann: &std::collections::BTreeMap<String, String>,
) -> Result<Reservations, String> {
    match ann.get(RESERVATIONS_ANNOTATION) {
        None => Ok(Reservations {
            schema: SCHEMA,
            pods: Vec::new(),
        }),
        Some(s) => serde_json::from_str(s).map_err(|e| {
            format!("node {node}: annotation {RESERVATIONS_ANNOTATION} is not valid JSON: {e}")
        }),
    }
}

/// Bind the pod (see the module documentation).
pub async fn bind(state: &AppState, args: &ExtenderBindingArgs) -> Result<(), BindError> {
    let pod_id = format!("{}/{}", args.pod_namespace, args.pod_name);
    let pods: Api<KPod> = Api::namespaced(state.client.clone(), &args.pod_namespace);
    let nodes: Api<KNode> = Api::all(state.client.clone());

    let kpod = pods
        .get(&args.pod_name)
        .await
        .map_err(|e| BindError::Read {
            what: format!("pod {pod_id}"),
            source: e,
        })?;
    let uid = kpod.metadata.uid.clone().unwrap_or_default();
    if !args.pod_uid.is_empty() && uid != args.pod_uid {
        return Err(BindError::Recreated {
            pod: pod_id,
            expected: args.pod_uid.clone(),
            found: uid,
        });
    }
    if let Some(n) = kpod.spec.as_ref().and_then(|s| s.node_name.clone()) {
        return Err(BindError::AlreadyBound {
            pod: pod_id,
            node: n,
        });
    }
    let pod: Pod = serde_json::to_value(&kpod)
        .and_then(serde_json::from_value)
        .map_err(|e| BindError::Internal(format!("pod {pod_id} does not convert: {e}")))?;
    let req = pod_request(&pod, &state.domain).map_err(|e| BindError::Request {
        pod: pod_id.clone(),
        reason: e.to_string(),
    })?;

    // Reserve, with the Node's resourceVersion as the precondition.
    let mut assignment = None;
    let mut reserved = false;
    for attempt in 1..=MAX_ATTEMPTS {
        let knode = nodes.get(&args.node).await.map_err(|e| BindError::Read {
            what: format!("node {}", args.node),
            source: e,
        })?;
        let rv = knode.metadata.resource_version.clone().unwrap_or_default();
        let ann = knode.metadata.annotations.clone().unwrap_or_default();
        let mut res = reservations(&args.node, &ann).map_err(|reason| BindError::NoFit {
            pod: pod_id.clone(),
            reason,
        })?;
        // A retried bind of the same pod replaces its own reservation.
        res.pods.retain(|r| r.uid != uid);
        let mut clean = ann.clone();
        clean.insert(
            RESERVATIONS_ANNOTATION.to_string(),
            serde_json::to_string(&res).unwrap_or_default(),
        );
        let view: NodeView = node_view(&args.node, &clean).map_err(|reason| BindError::NoFit {
            pod: pod_id.clone(),
            reason,
        })?;
        let choice =
            placement::filter(&view, &req, &state.policy).map_err(|reason| BindError::NoFit {
                pod: pod_id.clone(),
                reason: format!("node {}: {reason}", args.node),
            })?;
        assignment = Some(choice.assignment(&view));
        let gpus = choice.per_gpu(&view);
        if gpus.is_empty() {
            break; // nothing to reserve (a pod without vcuda resources)
        }
        res.schema = SCHEMA;
        res.pods.push(Reservation {
            namespace: args.pod_namespace.clone(),
            name: args.pod_name.clone(),
            uid: uid.clone(),
            gpus,
            created_unix_ms: now_ms(),
        });
        let value = serde_json::to_string(&res)
            .map_err(|e| BindError::Internal(format!("reservations do not serialise: {e}")))?;
        let patch = json!({"metadata": {"resourceVersion": rv, "annotations": {RESERVATIONS_ANNOTATION: value}}});
        match nodes
            .patch(&args.node, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => {
                reserved = true;
                break;
            }
            Err(e) if is_conflict(&e) => {
                tracing::debug!(node = %args.node, pod = %pod_id, attempt, "node changed meanwhile; re-reading");
                if attempt == MAX_ATTEMPTS {
                    return Err(BindError::Contended {
                        node: args.node.clone(),
                        attempts: MAX_ATTEMPTS,
                    });
                }
            }
            Err(e) => {
                return Err(BindError::Reserve {
                    node: args.node.clone(),
                    source: e,
                })
            }
        }
    }

    // Bind, recording the assignment on the pod in the same write.
    let mut meta = json!({"name": args.pod_name, "namespace": args.pod_namespace, "uid": uid});
    if let Some(a) = assignment.filter(|a| !a.containers.is_empty()) {
        meta["annotations"] =
            json!({ASSIGNMENT_ANNOTATION: serde_json::to_string(&a).unwrap_or_default()});
    }
    let binding = json!({
        "apiVersion": "v1", "kind": "Binding", "metadata": meta,
        "target": {"apiVersion": "v1", "kind": "Node", "name": args.node},
    });
    let body = serde_json::to_vec(&binding)
        .map_err(|e| BindError::Internal(format!("binding does not serialise: {e}")))?;
    if let Err(e) = pods
        .create_subresource::<serde_json::Value>(
            "binding",
            &args.pod_name,
            &PostParams::default(),
            body,
        )
        .await
    {
        if reserved {
            release(&nodes, &args.node, &uid).await;
        }
        return Err(BindError::Binding {
            pod: pod_id,
            node: args.node.clone(),
            source: e,
        });
    }
    tracing::info!(pod = %pod_id, node = %args.node, "bound");
    Ok(())
}

/// Remove the pod's reservation from the node (best effort, with resourceVersion).
async fn release(nodes: &Api<KNode>, node: &str, uid: &str) {
    for _ in 0..MAX_ATTEMPTS {
        let Ok(knode) = nodes.get(node).await else {
            break;
        };
        let rv = knode.metadata.resource_version.clone().unwrap_or_default();
        let ann = knode.metadata.annotations.unwrap_or_default();
        let Ok(mut res) = reservations(node, &ann) else {
            break;
        };
        let before = res.pods.len();
        res.pods.retain(|r| r.uid != uid);
        if res.pods.len() == before {
            return;
        }
        let value = serde_json::to_string(&res).unwrap_or_default();
        let patch = json!({"metadata": {"resourceVersion": rv, "annotations": {RESERVATIONS_ANNOTATION: value}}});
        match nodes
            .patch(node, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => return,
            Err(e) if is_conflict(&e) => continue,
            Err(e) => {
                tracing::warn!(node, uid, error = %e, "could not release a reservation");
                return;
            }
        }
    }
    tracing::warn!(
        node,
        uid,
        "could not release a reservation: the node kept changing"
    );
}
