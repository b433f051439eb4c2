//! The bind verb (I/O): reserve the pod's GPUs on the Node, then create the Binding.
//!
//! 1. Read the Pod (its UID must be the one kube-scheduler placed) and the Node, and refuse
//!    a pair kube-scheduler itself would never produce ([`eligibility::check`]: another
//!    scheduler's pod, a cordoned or untolerated tainted node, an unmatched nodeSelector or
//!    required node affinity): the extender's binding right must not be a way around them.
//! 2. Re-run [`placement::filter`] against the Node's inventory + current reservations.
//!    Whole-GPU and slice pods (issue 19) reserve nothing and get no assignment: the
//!    kubelet picks their devices and vcuda-manager steers and locks; their bind is the
//!    check and a plain Binding (as for a pod asking for no vcuda resource). A whole-GPU
//!    pod on a node without a vcuda inventory (another device plugin) binds unchecked.
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
//!
//! With `--quota-configmap`, the Node's labels are checked against the namespace's pool in
//! step 2, and a namespace with a quota first claims the pod's charges on the quota
//! ConfigMap ([`admission::claim`], also a compare-and-swap) between steps 2 and 3; the claim
//! is removed again if the bind fails afterwards. Reservations older than
//! `--reservation-ttl` are ignored and dropped from the annotation this bind writes.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node as KNode, Pod as KPod};
use kube::api::{Patch, PatchParams, PostParams};
use kube::Api;
use serde_json::json;
use thiserror::Error;
use vcuda_cluster::{
    Reservation, Reservations, ASSIGNMENT_ANNOTATION, RESERVATIONS_ANNOTATION, SCHEMA,
};

use crate::admission::{self, AdmissionError, HeldClaim, CLAIM_DEADLINE};
use crate::eligibility::{self, Ineligible};
use crate::extender::{ExtenderBindingArgs, Pod};
use crate::placement::{self, Expiry, NodeView};
use crate::quota::{self, Amount};
use crate::request::pod_request_with;
use crate::state::{node_view, now_ms, AppState};

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
    #[error("pod {pod}: {source}")]
    Admission {
        pod: String,
        #[source]
        source: AdmissionError,
    },
    #[error("pod {pod} may not go to node {node}: {source}")]
    Quota {
        pod: String,
        node: String,
        #[source]
        source: AdmissionError,
    },
    #[error("pod {pod}: its quota claim is {age_ms} ms old, past the {deadline_s} s deadline (the API server is slow); reservation and claim released, the pod is retried")]
    Late {
        pod: String,
        age_ms: u64,
        deadline_s: u64,
    },
    /// kube-scheduler would never have chosen this node for this pod.
    #[error("{0}")]
    Ineligible(#[from] Ineligible),
    #[error("{0}")]
    Internal(String),
}

impl BindError {
    /// Every [`BindError::kind`]: its own, and those of the errors it carries
    /// ([`AdmissionError::kind`], [`Ineligible::kind`]).
    pub const KINDS: &'static [&'static str] = &[
        "api_read",
        "pod_recreated",
        "already_bound",
        "no_fit",
        "invalid_request",
        "node_contended",
        "reserve_failed",
        "binding_failed",
        "quota_config",
        "not_in_pool",
        "no_quota_for_model",
        "over_quota",
        "quota_list_pods",
        "quota_list_nodes",
        "quota_contended",
        "quota_write",
        "claim_late",
        "scheduler_name",
        "cordoned",
        "untolerated_taint",
        "node_selector",
        "node_affinity",
        "internal",
    ];

    /// A short stable snake_case name of the refusal: the `reason` label of
    /// `vcuda_scheduler_bind_refusals_total`. A quota or eligibility refusal is named by the
    /// error it carries (`over_quota`, `untolerated_taint`, ...).
    pub fn kind(&self) -> &'static str {
        match self {
            BindError::Read { .. } => "api_read",
            BindError::Recreated { .. } => "pod_recreated",
            BindError::AlreadyBound { .. } => "already_bound",
            BindError::NoFit { .. } => "no_fit",
            BindError::Request { .. } => "invalid_request",
            BindError::Contended { .. } => "node_contended",
            BindError::Reserve { .. } => "reserve_failed",
            BindError::Binding { .. } => "binding_failed",
            BindError::Admission { source, .. } | BindError::Quota { source, .. } => source.kind(),
            BindError::Late { .. } => "claim_late",
            BindError::Ineligible(e) => e.kind(),
            BindError::Internal(_) => "internal",
        }
    }
}

fn is_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(r) if r.code == 409)
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
    let mut held = None;
    let out = bind_holding(state, args, &mut held).await;
    if let (Err(_), Some(h), Some(src)) = (&out, &held, &state.quota) {
        admission::unclaim(state, src, h).await;
    }
    out
}

/// [`bind`]; `held` is the quota claim written, if any (the caller removes it on error).
async fn bind_holding(
    state: &AppState,
    args: &ExtenderBindingArgs,
    held: &mut Option<HeldClaim>,
) -> Result<(), BindError> {
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
    let req = pod_request_with(&pod, &state.resource_names()).map_err(|e| BindError::Request {
        pod: pod_id.clone(),
        reason: e.to_string(),
    })?;
    let admission_err = |source| BindError::Admission {
        pod: pod_id.clone(),
        source,
    };
    // The namespace's rule (cached read: an edit applies within seconds; the quota itself
    // is checked on a fresh read when claiming).
    let gate = match (&state.quota, req.is_empty()) {
        (Some(src), false) => {
            let snap = src.snapshot(&state.client).await;
            src.gate(&snap, &args.pod_namespace)
                .map_err(admission_err)?
        }
        _ => None,
    };
    let quota_err = |source| BindError::Quota {
        pod: pod_id.clone(),
        node: args.node.clone(),
        source,
    };
    let expiry = state.expiry();

    // Reserve, with the Node's resourceVersion as the precondition.
    let mut assignment = None;
    let mut reserved = false;
    for attempt in 1..=MAX_ATTEMPTS {
        let knode = nodes.get(&args.node).await.map_err(|e| BindError::Read {
            what: format!("node {}", args.node),
            source: e,
        })?;
        // Checked on every read of the Node: a taint added meanwhile also refuses.
        eligibility::check(&kpod, &knode, &state.scheduler_names)?;
        let rv = knode.metadata.resource_version.clone().unwrap_or_default();
        let ann = knode.metadata.annotations.clone().unwrap_or_default();
        if !ann.contains_key(vcuda_cluster::INVENTORY_ANNOTATION)
            && placement::foreign_node_passes(&req)
        {
            // No vcuda-manager there: another device plugin serves the whole GPUs; a plain
            // Binding (pool checked, nothing to reserve or assign).
            if let Some(g) = &gate {
                let labels = knode.metadata.labels.clone().unwrap_or_default();
                g.check_pool(&labels).map_err(quota_err)?;
            }
            break;
        }
        let mut res = reservations(&args.node, &ann).map_err(|reason| BindError::NoFit {
            pod: pod_id.clone(),
            reason,
        })?;
        // A retried bind of the same pod replaces its own reservation; stale ones go.
        res.pods.retain(|r| r.uid != uid && expiry.live(r));
        let mut clean = ann.clone();
        clean.insert(
            RESERVATIONS_ANNOTATION.to_string(),
            serde_json::to_string(&res).unwrap_or_default(),
        );
        let view: NodeView =
            node_view(&args.node, &clean, Expiry::NEVER).map_err(|reason| BindError::NoFit {
                pod: pod_id.clone(),
                reason,
            })?;
        if let Some(g) = &gate {
            let labels = knode.metadata.labels.clone().unwrap_or_default();
            g.check_pool(&labels).map_err(quota_err)?;
        }
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
        // Quota: claim before reserving; again only if this placement charges other models.
        if let (Some(g), Some(src)) = (&gate, &state.quota) {
            let models: BTreeMap<String, Amount> =
                quota::charges(&view, &choice).into_iter().collect();
            if g.rule.quota.is_some() && held.as_ref().map(|h| &h.models) != Some(&models) {
                let claim = admission::claim(
                    state,
                    src,
                    &args.pod_namespace,
                    &args.pod_name,
                    &uid,
                    &models,
                )
                .await
                .map_err(quota_err)?;
                if claim.is_some() {
                    *held = claim;
                }
            }
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

    // A claim must not turn into a Binding after it may have expired (see admission).
    if let Some(h) = held.as_ref() {
        let age_ms = now_ms().saturating_sub(h.created_unix_ms);
        if age_ms > CLAIM_DEADLINE.as_millis() as u64 {
            if reserved {
                release(&nodes, &args.node, &uid, expiry).await;
            }
            return Err(BindError::Late {
                pod: pod_id,
                age_ms,
                deadline_s: CLAIM_DEADLINE.as_secs(),
            });
        }
    }

    // Bind, recording the assignment on the pod in the same write.
    let mut meta = json!({"name": args.pod_name, "namespace": args.pod_namespace, "uid": uid});
    if let Some(mut a) = assignment.filter(|a| !a.containers.is_empty()) {
        // The kubelet admits pods in bind order: the manager orders pending pods by this.
        a.bound_unix_ms = Some(now_ms());
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
            release(&nodes, &args.node, &uid, expiry).await;
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

/// Remove the pod's reservation from the node (best effort, with resourceVersion); stale
/// reservations go too.
async fn release(nodes: &Api<KNode>, node: &str, uid: &str, expiry: Expiry) {
    for _ in 0..MAX_ATTEMPTS {
        let Ok(knode) = nodes.get(node).await else {
            break;
        };
        let rv = knode.metadata.resource_version.clone().unwrap_or_default();
        let ann = knode.metadata.annotations.unwrap_or_default();
        let Ok(mut res) = reservations(node, &ann) else {
            break;
        };
        if !res.pods.iter().any(|r| r.uid == uid) {
            return;
        }
        res.pods.retain(|r| r.uid != uid && expiry.live(r));
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

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;
    use crate::quota::QuotaRefusal;

    fn api() -> kube::Error {
        kube::Error::Api(kube::core::ErrorResponse {
            status: "Failure".into(),
            message: "no".into(),
            reason: "Forbidden".into(),
            code: 403,
        })
    }

    /// One of each refusal, nested ones included. A variant added to an enum without a line
    /// here fails to compile in `covered`.
    fn every_refusal() -> Vec<BindError> {
        let s = String::new;
        let refusals = [
            QuotaRefusal::NotInPool {
                namespace: s(),
                label: s(),
                want: s(),
                have: None,
            },
            QuotaRefusal::NoQuotaForModel {
                namespace: s(),
                model: s(),
            },
            QuotaRefusal::OverQuota {
                namespace: s(),
                key: s(),
                resource: crate::quota::Resource::Core,
                limit: 1,
                used: 1,
                asked: 1,
            },
        ];
        let mut admission: Vec<AdmissionError> = refusals
            .into_iter()
            .map(|refusal| AdmissionError::Refused { refusal, cm: s() })
            .collect();
        admission.extend([
            AdmissionError::Config(s()),
            AdmissionError::ListPods {
                namespace: s(),
                source: Box::new(api()),
            },
            AdmissionError::ListNodes {
                namespace: s(),
                source: Box::new(api()),
            },
            AdmissionError::Contended {
                cm: s(),
                attempts: 1,
            },
            AdmissionError::Write {
                cm: s(),
                name: s(),
                source: Box::new(api()),
            },
        ]);
        let ineligible = [
            Ineligible::SchedulerName {
                pod: s(),
                node: s(),
                scheduler: s(),
                served: s(),
            },
            Ineligible::Unschedulable {
                pod: s(),
                node: s(),
            },
            Ineligible::Taint {
                pod: s(),
                node: s(),
                taint: s(),
            },
            Ineligible::NodeSelector {
                pod: s(),
                node: s(),
                key: s(),
                wanted: s(),
                found: s(),
            },
            Ineligible::Affinity {
                pod: s(),
                node: s(),
                reason: s(),
            },
        ];
        let mut out = vec![
            BindError::Read {
                what: s(),
                source: api(),
            },
            BindError::Recreated {
                pod: s(),
                expected: s(),
                found: s(),
            },
            BindError::AlreadyBound {
                pod: s(),
                node: s(),
            },
            BindError::NoFit {
                pod: s(),
                reason: s(),
            },
            BindError::Request {
                pod: s(),
                reason: s(),
            },
            BindError::Contended {
                node: s(),
                attempts: 1,
            },
            BindError::Reserve {
                node: s(),
                source: api(),
            },
            BindError::Binding {
                pod: s(),
                node: s(),
                source: api(),
            },
            BindError::Late {
                pod: s(),
                age_ms: 1,
                deadline_s: 1,
            },
            BindError::Internal(s()),
        ];
        out.extend(ineligible.into_iter().map(BindError::Ineligible));
        out.extend(admission.into_iter().map(|source| BindError::Quota {
            pod: s(),
            node: s(),
            source,
        }));
        out.push(BindError::Admission {
            pod: s(),
            source: AdmissionError::Config(s()),
        });
        out
    }

    /// Compiles only while `every_refusal` names each variant of each enum.
    #[allow(dead_code)]
    fn covered(b: &BindError, a: &AdmissionError, q: &QuotaRefusal, i: &Ineligible) {
        match b {
            BindError::Read { .. }
            | BindError::Recreated { .. }
            | BindError::AlreadyBound { .. }
            | BindError::NoFit { .. }
            | BindError::Request { .. }
            | BindError::Contended { .. }
            | BindError::Reserve { .. }
            | BindError::Binding { .. }
            | BindError::Admission { .. }
            | BindError::Quota { .. }
            | BindError::Late { .. }
            | BindError::Ineligible(_)
            | BindError::Internal(_) => {}
        }
        match a {
            AdmissionError::Config(_)
            | AdmissionError::Refused { .. }
            | AdmissionError::ListPods { .. }
            | AdmissionError::ListNodes { .. }
            | AdmissionError::Contended { .. }
            | AdmissionError::Write { .. } => {}
        }
        match q {
            QuotaRefusal::NotInPool { .. }
            | QuotaRefusal::NoQuotaForModel { .. }
            | QuotaRefusal::OverQuota { .. } => {}
        }
        match i {
            Ineligible::SchedulerName { .. }
            | Ineligible::Unschedulable { .. }
            | Ineligible::Taint { .. }
            | Ineligible::NodeSelector { .. }
            | Ineligible::Affinity { .. } => {}
        }
    }

    #[test]
    fn every_refusal_has_its_own_listed_snake_case_kind() {
        let all = every_refusal();
        // Admission and Quota carry the same errors: the kind names the error carried.
        let distinct: BTreeSet<&str> = all
            .iter()
            .filter(|e| !matches!(e, BindError::Admission { .. }))
            .map(BindError::kind)
            .collect();
        assert_eq!(
            distinct.len(),
            all.len() - 1,
            "two refusals share a kind: {distinct:?}"
        );
        let listed: BTreeSet<&str> = BindError::KINDS.iter().copied().collect();
        assert_eq!(listed.len(), BindError::KINDS.len(), "KINDS repeats one");
        let seen: BTreeSet<&str> = all.iter().map(BindError::kind).collect();
        assert_eq!(
            seen, listed,
            "BindError::KINDS is not the kinds refusals have"
        );
        for k in &listed {
            assert!(
                !k.is_empty() && k.chars().all(|c| c.is_ascii_lowercase() || c == '_'),
                "{k} is not snake_case"
            );
        }
        let nested: BTreeSet<&str> = AdmissionError::KINDS
            .iter()
            .chain(Ineligible::KINDS)
            .chain(QuotaRefusal::KINDS)
            .copied()
            .collect();
        assert!(
            nested.is_subset(&listed),
            "{nested:?} not all in {listed:?}"
        );
        let admission: BTreeSet<&str> = all
            .iter()
            .filter_map(|e| match e {
                BindError::Quota { source, .. } => Some(source.kind()),
                _ => None,
            })
            .collect();
        assert_eq!(admission, AdmissionError::KINDS.iter().copied().collect());
    }
}
