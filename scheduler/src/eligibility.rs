//! May this pod be bound to this node at all? (pure)
//!
//! The bind verb acts with kube-scheduler's cluster-wide binding right: a tenant who can
//! reach the extender could otherwise bind its own pending pod onto any node. [`check`]
//! refuses, before anything is written, a pod/node pair that kube-scheduler itself would
//! never produce, by re-running the node-local, stateless parts of its Filter phase:
//!
//! - the profile: `spec.schedulerName` (the API server defaults it to
//!   [`DEFAULT_SCHEDULER_NAME`]) must be one this extender serves;
//! - `NodeUnschedulable` (`pkg/scheduler/framework/plugins/nodeunschedulable`): a cordoned
//!   node (`spec.unschedulable`) takes only pods tolerating
//!   `node.kubernetes.io/unschedulable:NoSchedule`;
//! - `TaintToleration` (`pkg/scheduler/framework/plugins/tainttoleration`, `Filter`): every
//!   `NoSchedule` / `NoExecute` taint must be tolerated (`PreferNoSchedule` only scores);
//! - `NodeAffinity` (`component-helpers/scheduling/corev1/nodeaffinity`,
//!   `GetRequiredNodeAffinity` + `RequiredNodeAffinity.Match`): `spec.nodeSelector` and
//!   `requiredDuringSchedulingIgnoredDuringExecution`.
//!
//! Where upstream's behaviour is only reachable by objects the API server refuses to store
//! (a `matchFields` key other than `metadata.name`, a Node without a name), this module
//! refuses rather than accepts. Stateful filters (resources, ports, volumes, inter-pod
//! affinity, topology spread) and `spec.nodeName` are the caller's business.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Node, NodeSelectorRequirement, NodeSelectorTerm, Pod, Taint, Toleration,
};
use thiserror::Error;

/// What the API server sets `spec.schedulerName` to when a pod leaves it out.
pub const DEFAULT_SCHEDULER_NAME: &str = "default-scheduler";

/// The taint key kube-scheduler's `NodeUnschedulable` plugin checks tolerations against.
pub const UNSCHEDULABLE_TAINT_KEY: &str = "node.kubernetes.io/unschedulable";

/// Why kube-scheduler would never bind the pod to the node; every message names the pod
/// (`namespace/name`), the node, the offending item and the fix.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum Ineligible {
    #[error("cannot bind pod {pod} to node {node}: the pod is for scheduler {scheduler:?} (spec.schedulerName) but this extender serves {served} (--scheduler-name); leave the pod to {scheduler:?}, or add it to --scheduler-name if this extender is configured in that profile")]
    SchedulerName {
        pod: String,
        node: String,
        scheduler: String,
        served: String,
    },
    #[error("cannot bind pod {pod} to node {node}: the node is cordoned (spec.unschedulable) and the pod does not tolerate {UNSCHEDULABLE_TAINT_KEY}:NoSchedule; uncordon the node (kubectl uncordon {node}) or let kube-scheduler pick another node")]
    Unschedulable { pod: String, node: String },
    #[error("cannot bind pod {pod} to node {node}: the pod does not tolerate the node's taint {taint}; add a matching toleration to the pod, remove the taint from the node, or let kube-scheduler pick another node")]
    Taint {
        pod: String,
        node: String,
        /// `key=value:Effect` (`key:Effect` without a value).
        taint: String,
    },
    #[error("cannot bind pod {pod} to node {node}: the pod's spec.nodeSelector asks for {key}={wanted:?} but the node has {found}; label the node or change the pod's nodeSelector")]
    NodeSelector {
        pod: String,
        node: String,
        key: String,
        wanted: String,
        /// `key="value"` or `no label key`.
        found: String,
    },
    #[error("cannot bind pod {pod} to node {node}: the node matches none of the pod's required node affinity terms (spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution): {reason}; pick a node the affinity selects, or change the pod's affinity")]
    Affinity {
        pod: String,
        node: String,
        /// Why each term fails, `term N: …` joined by `; `.
        reason: String,
    },
}

impl Ineligible {
    /// Every [`Ineligible::kind`].
    pub const KINDS: &'static [&'static str] = &[
        "scheduler_name",
        "cordoned",
        "untolerated_taint",
        "node_selector",
        "node_affinity",
    ];

    /// A short stable snake_case name of the refusal (a metric's `reason` label).
    pub fn kind(&self) -> &'static str {
        match self {
            Ineligible::SchedulerName { .. } => "scheduler_name",
            Ineligible::Unschedulable { .. } => "cordoned",
            Ineligible::Taint { .. } => "untolerated_taint",
            Ineligible::NodeSelector { .. } => "node_selector",
            Ineligible::Affinity { .. } => "node_affinity",
        }
    }
}

/// Refuse `pod` on `node` when kube-scheduler (running one of `scheduler_names`) would
/// never place it there; the first reason found is returned.
pub fn check(pod: &Pod, node: &Node, scheduler_names: &[String]) -> Result<(), Ineligible> {
    let pod_id = pod_id(pod);
    let node_name = node.metadata.name.clone().unwrap_or_default();
    let spec = pod.spec.clone().unwrap_or_default();
    let node_spec = node.spec.clone().unwrap_or_default();
    let tolerations = spec.tolerations.as_deref().unwrap_or(&[]);

    // The API server defaults an empty spec.schedulerName to "default-scheduler"
    // (pkg/apis/core/v1/defaults.go, SetDefaults_PodSpec).
    let scheduler = spec
        .scheduler_name
        .as_deref()
        .filter(|s| !s.is_empty())
        .unwrap_or(DEFAULT_SCHEDULER_NAME);
    if !scheduler_names.iter().any(|s| s == scheduler) {
        return Err(Ineligible::SchedulerName {
            pod: pod_id,
            node: node_name,
            scheduler: scheduler.to_string(),
            served: served(scheduler_names),
        });
    }

    // nodeunschedulable.Filter: spec.unschedulable unless the pod tolerates
    // {Key: node.kubernetes.io/unschedulable, Effect: NoSchedule}.
    if node_spec.unschedulable == Some(true) {
        let cordon = Taint {
            key: UNSCHEDULABLE_TAINT_KEY.to_string(),
            effect: "NoSchedule".to_string(),
            ..Default::default()
        };
        if !tolerations_tolerate_taint(tolerations, &cordon) {
            return Err(Ineligible::Unschedulable {
                pod: pod_id,
                node: node_name,
            });
        }
    }

    // tainttoleration.Filter: only NoSchedule and NoExecute taints filter;
    // FindMatchingUntoleratedTaint returns the first one no toleration tolerates.
    if let Some(taint) = node_spec.taints.iter().flatten().find(|t| {
        (t.effect == "NoSchedule" || t.effect == "NoExecute")
            && !tolerations_tolerate_taint(tolerations, t)
    }) {
        return Err(Ineligible::Taint {
            pod: pod_id,
            node: node_name,
            taint: show_taint(taint),
        });
    }

    let empty = BTreeMap::new();
    let labels = node.metadata.labels.as_ref().unwrap_or(&empty);

    // nodeaffinity.RequiredNodeAffinity.Match: spec.nodeSelector is
    // labels.SelectorFromSet — every pair must be present with that exact value.
    for (key, wanted) in spec.node_selector.iter().flatten() {
        let have = labels.get(key);
        if have != Some(wanted) {
            return Err(Ineligible::NodeSelector {
                pod: pod_id,
                node: node_name,
                key: key.clone(),
                wanted: wanted.clone(),
                found: match have {
                    Some(v) => format!("{key}={v:?}"),
                    None => format!("no label {key}"),
                },
            });
        }
    }

    // ... and then the required affinity, when the pod has one (absent: every node).
    let required = spec
        .affinity
        .as_ref()
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|na| {
            na.required_during_scheduling_ignored_during_execution
                .as_ref()
        });
    if let Some(required) = required {
        if let Err(reason) = match_terms(&required.node_selector_terms, labels, &node_name) {
            return Err(Ineligible::Affinity {
                pod: pod_id,
                node: node_name,
                reason,
            });
        }
    }
    Ok(())
}

/// `namespace/name` (just `name` without a namespace).
fn pod_id(pod: &Pod) -> String {
    let name = pod.metadata.name.as_deref().unwrap_or_default();
    match pod.metadata.namespace.as_deref() {
        Some(ns) if !ns.is_empty() => format!("{ns}/{name}"),
        _ => name.to_string(),
    }
}

fn served(names: &[String]) -> String {
    if names.is_empty() {
        return "no scheduler".to_string();
    }
    names
        .iter()
        .map(|n| format!("{n:?}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn show_taint(t: &Taint) -> String {
    match t.value.as_deref() {
        Some(v) if !v.is_empty() => format!("{}={}:{}", t.key, v, t.effect),
        _ => format!("{}:{}", t.key, t.effect),
    }
}

/// k8s.io/api/core/v1 toleration.go, `(*Toleration).ToleratesTaint`:
/// 1. an empty effect matches every effect, else the effects must be equal;
/// 2. an empty key matches every key, else the keys must be equal;
/// 3. operator "" or `Equal` compares the values (absent = ""), `Exists` ignores them.
///
/// Upstream also has `Lt` / `Gt` (numeric, behind the alpha feature gate
/// TaintTolerationComparisonOperators, off by default); they, and every other operator,
/// tolerate nothing here.
fn tolerates(t: &Toleration, taint: &Taint) -> bool {
    let effect = t.effect.as_deref().unwrap_or_default();
    if !effect.is_empty() && effect != taint.effect {
        return false;
    }
    let key = t.key.as_deref().unwrap_or_default();
    if !key.is_empty() && key != taint.key {
        return false;
    }
    match t.operator.as_deref().unwrap_or_default() {
        "" | "Equal" => {
            t.value.as_deref().unwrap_or_default() == taint.value.as_deref().unwrap_or_default()
        }
        "Exists" => true,
        _ => false,
    }
}

/// component-helpers/scheduling/corev1/helpers.go, `TolerationsTolerateTaint`: any one
/// toleration suffices.
fn tolerations_tolerate_taint(tolerations: &[Toleration], taint: &Taint) -> bool {
    tolerations.iter().any(|t| tolerates(t, taint))
}

/// nodeaffinity.go, `LazyErrorNodeSelector.Match`: the terms are ORed; an empty term (no
/// matchExpressions and no matchFields) is skipped, so an empty term list matches no node;
/// a term that does not parse does not match (the others still may). `Err` says why each
/// term fails.
fn match_terms(
    terms: &[NodeSelectorTerm],
    labels: &BTreeMap<String, String>,
    node_name: &str,
) -> Result<(), String> {
    if terms.is_empty() {
        return Err("the nodeSelectorTerms list is empty, which matches no node".to_string());
    }
    let mut misses = Vec::with_capacity(terms.len());
    for (i, term) in terms.iter().enumerate() {
        match term_miss(term, labels, node_name) {
            None => return Ok(()),
            Some(why) => misses.push(format!("term {i}: {why}")),
        }
    }
    Err(misses.join("; "))
}

/// Why one term does not match (`None`: it matches). nodeaffinity.go,
/// `newNodeSelectorTerm` + `nodeSelectorTerm.match`: parse errors first, then
/// matchExpressions (labels) AND matchFields (fields), each ANDed within.
fn term_miss(
    term: &NodeSelectorTerm,
    labels: &BTreeMap<String, String>,
    node_name: &str,
) -> Option<String> {
    let exprs = term.match_expressions.as_deref().unwrap_or(&[]);
    let fields = term.match_fields.as_deref().unwrap_or(&[]);
    // isEmptyNodeSelectorTerm: "nil or empty term selects no objects".
    if exprs.is_empty() && fields.is_empty() {
        return Some(
            "it has no matchExpressions and no matchFields, which matches no node".to_string(),
        );
    }
    // A parse error anywhere in the term means the term does not match.
    for r in exprs {
        if let Some(bad) = label_requirement_invalid(r) {
            return Some(format!("matchExpressions {}: {bad}", show_req(r)));
        }
    }
    for r in fields {
        if let Some(bad) = field_requirement_invalid(r) {
            return Some(format!("matchFields {}: {bad}", show_req(r)));
        }
    }
    for r in exprs {
        if !label_requirement_matches(r, labels) {
            let has = match labels.get(&r.key) {
                Some(v) => format!("node has {}={v:?}", r.key),
                None => format!("node has no label {}", r.key),
            };
            return Some(format!("matchExpressions {} fails: {has}", show_req(r)));
        }
    }
    for r in fields {
        if !field_requirement_matches(r, node_name) {
            return Some(format!(
                "matchFields {} fails: node is {node_name:?}",
                show_req(r)
            ));
        }
    }
    None
}

fn show_req(r: &NodeSelectorRequirement) -> String {
    let values = r.values.as_deref().unwrap_or(&[]);
    if values.is_empty() {
        format!("{} {}", r.key, r.operator)
    } else {
        format!("{} {} {values:?}", r.key, r.operator)
    }
}

/// nodeaffinity.go `nodeSelectorRequirementsAsSelector` + apimachinery labels/selector.go
/// `NewRequirement`: the operator must be known, the key a qualified name, every value a
/// label value; In/NotIn need values, Exists/DoesNotExist none, Gt/Lt exactly one integer.
fn label_requirement_invalid(r: &NodeSelectorRequirement) -> Option<String> {
    let values = r.values.as_deref().unwrap_or(&[]);
    match r.operator.as_str() {
        "In" | "NotIn" if values.is_empty() => {
            return Some("In and NotIn need at least one value".to_string())
        }
        "In" | "NotIn" => {}
        "Exists" | "DoesNotExist" if !values.is_empty() => {
            return Some("Exists and DoesNotExist take no values".to_string())
        }
        "Exists" | "DoesNotExist" => {}
        "Gt" | "Lt" if values.len() != 1 || values[0].parse::<i64>().is_err() => {
            return Some("Gt and Lt need exactly one integer value".to_string())
        }
        "Gt" | "Lt" => {}
        other => {
            return Some(format!(
                "operator {other:?} is not one of In, NotIn, Exists, DoesNotExist, Gt, Lt"
            ))
        }
    }
    if !is_qualified_name(&r.key) {
        return Some(format!("{:?} is not a valid label key", r.key));
    }
    if let Some(v) = values.iter().find(|v| !is_label_value(v)) {
        return Some(format!("{v:?} is not a valid label value"));
    }
    None
}

/// apimachinery labels/selector.go, `(*Requirement).Matches`.
fn label_requirement_matches(
    r: &NodeSelectorRequirement,
    labels: &BTreeMap<String, String>,
) -> bool {
    let values = r.values.as_deref().unwrap_or(&[]);
    let have = labels.get(&r.key);
    match r.operator.as_str() {
        "In" => have.is_some_and(|v| values.contains(v)),
        // NotIn: a node without the label matches.
        "NotIn" => have.is_none_or(|v| !values.contains(v)),
        "Exists" => have.is_some(),
        "DoesNotExist" => have.is_none(),
        // Gt/Lt: the label must exist and parse as an int64 (strconv.ParseInt base 10).
        op @ ("Gt" | "Lt") => {
            let (Some(have), Some(bound)) = (
                have.and_then(|v| v.parse::<i64>().ok()),
                values.first().and_then(|v| v.parse::<i64>().ok()),
            ) else {
                return false;
            };
            if op == "Gt" {
                have > bound
            } else {
                have < bound
            }
        }
        _ => false,
    }
}

/// nodeaffinity.go `nodeSelectorRequirementsAsFieldSelector`: In/NotIn only, exactly one
/// value. The API server (validation.go, `ValidateNodeFieldSelectorRequirement`) also
/// admits only the key `metadata.name`; any other key is refused here too.
fn field_requirement_invalid(r: &NodeSelectorRequirement) -> Option<String> {
    let values = r.values.as_deref().unwrap_or(&[]);
    if r.operator != "In" && r.operator != "NotIn" {
        return Some(format!(
            "operator {:?} is not In or NotIn (the only ones for fields)",
            r.operator
        ));
    }
    if values.len() != 1 {
        return Some("In and NotIn on a field need exactly one value".to_string());
    }
    if r.key != "metadata.name" {
        return Some(format!(
            "{:?} is not a node field selector key (only metadata.name is)",
            r.key
        ));
    }
    None
}

/// fields `OneTermEqualSelector` / `OneTermNotEqualSelector` on `metadata.name`.
/// Upstream skips matchFields for a Node without a name (`len(nodeFields) > 0`); a stored
/// Node always has one, so here the name is simply compared ("" when absent).
fn field_requirement_matches(r: &NodeSelectorRequirement, node_name: &str) -> bool {
    let value = r.values.as_deref().and_then(|v| v.first());
    let equal = value.is_some_and(|v| v == node_name);
    match r.operator.as_str() {
        "In" => equal,
        "NotIn" => !equal,
        _ => false,
    }
}

/// apimachinery validation `IsQualifiedName`: `[prefix/]name`, prefix a DNS-1123
/// subdomain, name a label name.
fn is_qualified_name(s: &str) -> bool {
    match s.split_once('/') {
        None => is_label_name(s),
        Some((prefix, name)) => {
            !name.contains('/') && is_dns1123_subdomain(prefix) && is_label_name(name)
        }
    }
}

/// `([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]`, 1 to 63 characters.
fn is_label_name(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
}

/// apimachinery validation `IsValidLabelValue`: empty, or a label name.
fn is_label_value(s: &str) -> bool {
    s.is_empty() || is_label_name(s)
}

/// apimachinery validation `IsDNS1123Subdomain`: at most 253 characters, dot-separated
/// labels of `[a-z0-9]([-a-z0-9]*[a-z0-9])?`.
fn is_dns1123_subdomain(s: &str) -> bool {
    s.len() <= 253
        && s.split('.').all(|l| {
            let b = l.as_bytes();
            !b.is_empty()
                && b[0].is_ascii_alphanumeric()
                && b[b.len() - 1].is_ascii_alphanumeric()
                && b.iter()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::{json, Value};

    fn pod(spec: Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"namespace": "team-a", "name": "p"},
            "spec": spec,
        }))
        .unwrap()
    }

    /// A pod with just these tolerations.
    fn tolerating(tolerations: Value) -> Pod {
        pod(json!({"containers": [], "tolerations": tolerations}))
    }

    /// A pod with just this required node affinity (the `nodeSelectorTerms` list).
    fn affine(terms: Value) -> Pod {
        pod(json!({"containers": [], "affinity": {"nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}
        }}}))
    }

    fn node(labels: Value, taints: Value) -> Node {
        serde_json::from_value(json!({
            "metadata": {"name": "n1", "labels": labels},
            "spec": {"taints": taints},
        }))
        .unwrap()
    }

    fn tainted(taints: Value) -> Node {
        node(json!({}), taints)
    }

    fn labelled(labels: Value) -> Node {
        node(labels, json!([]))
    }

    fn default_names() -> Vec<String> {
        vec![DEFAULT_SCHEDULER_NAME.to_string()]
    }

    fn run(p: &Pod, n: &Node) -> Result<(), Ineligible> {
        check(p, n, &default_names())
    }

    fn plain() -> Pod {
        pod(json!({"containers": []}))
    }

    // --- scheduler name -------------------------------------------------------------

    // pkg/apis/core/v1/defaults.go SetDefaults_PodSpec: an empty schedulerName becomes
    // "default-scheduler".
    #[test]
    fn absent_or_empty_scheduler_name_is_default_scheduler() {
        assert_eq!(run(&plain(), &labelled(json!({}))), Ok(()));
        let empty = pod(json!({"containers": [], "schedulerName": ""}));
        assert_eq!(run(&empty, &labelled(json!({}))), Ok(()));
        // ... and is refused by an extender serving only other profiles.
        let e = check(&plain(), &labelled(json!({})), &["gpu".to_string()]).unwrap_err();
        assert!(
            matches!(e, Ineligible::SchedulerName { ref scheduler, .. } if scheduler == DEFAULT_SCHEDULER_NAME)
        );
    }

    // kube-scheduler only schedules pods whose spec.schedulerName is one of its profiles
    // (pkg/scheduler/scheduler.go, frameworkForPod / responsibleForPod).
    #[test]
    fn foreign_scheduler_name_is_refused_with_a_readable_reason() {
        let p = pod(json!({"containers": [], "schedulerName": "volcano"}));
        let names = vec!["default-scheduler".to_string(), "gpu".to_string()];
        let m = check(&p, &labelled(json!({})), &names)
            .unwrap_err()
            .to_string();
        assert!(m.contains("pod team-a/p to node n1"), "{m}");
        assert!(m.contains("scheduler \"volcano\""), "{m}");
        assert!(
            m.contains("\"default-scheduler\", \"gpu\" (--scheduler-name)"),
            "{m}"
        );
        let ok = pod(json!({"containers": [], "schedulerName": "gpu"}));
        assert_eq!(check(&ok, &labelled(json!({})), &names), Ok(()));
    }

    // --- taints ---------------------------------------------------------------------

    // tainttoleration.Filter: NoExecute filters like NoSchedule.
    #[test]
    fn untolerated_no_execute_taint_is_refused() {
        let n = tainted(json!([{"key": "gpu", "value": "broken", "effect": "NoExecute"}]));
        let e = run(&plain(), &n).unwrap_err();
        assert_eq!(
            e,
            Ineligible::Taint {
                pod: "team-a/p".into(),
                node: "n1".into(),
                taint: "gpu=broken:NoExecute".into()
            }
        );
        assert!(e.to_string().contains("add a matching toleration"), "{e}");
    }

    // tainttoleration.Filter: NoSchedule filters.
    #[test]
    fn untolerated_no_schedule_taint_is_refused() {
        let n = tainted(json!([{"key": "dedicated", "effect": "NoSchedule"}]));
        let m = run(&plain(), &n).unwrap_err().to_string();
        assert!(m.contains("taint dedicated:NoSchedule"), "{m}");
    }

    // tainttoleration.Filter's predicate keeps only NoSchedule and NoExecute;
    // PreferNoSchedule only lowers the score.
    #[test]
    fn prefer_no_schedule_never_refuses() {
        let n = tainted(json!([
            {"key": "a", "effect": "PreferNoSchedule"},
            {"key": "b", "value": "x", "effect": "PreferNoSchedule"}
        ]));
        assert_eq!(run(&plain(), &n), Ok(()));
    }

    // toleration.go ToleratesTaint rule 3: an empty key with Exists matches every key
    // (and every value; no effect matches every effect).
    #[test]
    fn exists_with_empty_key_tolerates_every_taint() {
        let n = tainted(json!([
            {"key": "a", "value": "1", "effect": "NoSchedule"},
            {"key": "b", "effect": "NoExecute"},
            {"key": "node.kubernetes.io/not-ready", "effect": "NoExecute"}
        ]));
        assert_eq!(
            run(&tolerating(json!([{"operator": "Exists"}])), &n),
            Ok(())
        );
    }

    // toleration.go ToleratesTaint rule 1: an empty effect matches every effect.
    #[test]
    fn effectless_toleration_tolerates_both_effects() {
        let p = tolerating(json!([{"key": "gpu", "operator": "Equal", "value": "t"}]));
        let n = tainted(json!([
            {"key": "gpu", "value": "t", "effect": "NoSchedule"},
            {"key": "gpu", "value": "t", "effect": "NoExecute"}
        ]));
        assert_eq!(run(&p, &n), Ok(()));
    }

    // toleration.go ToleratesTaint rule 1: a set effect must equal the taint's.
    #[test]
    fn toleration_for_another_effect_does_not_tolerate() {
        let p = tolerating(json!([{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]));
        let n = tainted(json!([{"key": "gpu", "effect": "NoExecute"}]));
        assert!(matches!(run(&p, &n), Err(Ineligible::Taint { .. })));
    }

    // toleration.go ToleratesTaint: Equal compares the values.
    #[test]
    fn equal_with_wrong_value_is_refused() {
        let p = tolerating(json!([{"key": "gpu", "operator": "Equal", "value": "a100"}]));
        let n = tainted(json!([{"key": "gpu", "value": "h100", "effect": "NoSchedule"}]));
        let m = run(&p, &n).unwrap_err().to_string();
        assert!(m.contains("gpu=h100:NoSchedule"), "{m}");
    }

    // toleration.go ToleratesTaint: an empty operator means Equal, and an absent value
    // equals an absent (empty) taint value.
    #[test]
    fn missing_operator_means_equal() {
        let n = tainted(json!([{"key": "gpu", "effect": "NoSchedule"}]));
        assert_eq!(run(&tolerating(json!([{"key": "gpu"}])), &n), Ok(()));
        let wrong = tolerating(json!([{"key": "gpu", "value": "x"}]));
        assert!(run(&wrong, &n).is_err());
    }

    // toleration.go ToleratesTaint: Exists ignores the value; a set key must match.
    #[test]
    fn exists_ignores_value_but_not_key() {
        let n = tainted(json!([{"key": "gpu", "value": "h100", "effect": "NoSchedule"}]));
        let p = tolerating(json!([{"key": "gpu", "operator": "Exists", "value": "ignored"}]));
        assert_eq!(run(&p, &n), Ok(()));
        let other = tolerating(json!([{"key": "tpu", "operator": "Exists"}]));
        assert!(run(&other, &n).is_err());
    }

    // toleration.go ToleratesTaint `default: return false`; Lt/Gt are alpha-gated
    // (TaintTolerationComparisonOperators) and tolerate nothing here.
    #[test]
    fn unknown_or_comparison_operators_tolerate_nothing() {
        let n = tainted(json!([{"key": "gpu", "value": "5", "effect": "NoSchedule"}]));
        for op in ["Gt", "Lt", "exists", "Bogus"] {
            let p = tolerating(json!([{"key": "gpu", "operator": op, "value": "1"}]));
            assert!(run(&p, &n).is_err(), "{op}");
        }
    }

    // helpers.go TolerationsTolerateTaint / FindMatchingUntoleratedTaint: each filtering
    // taint needs some toleration; the first untolerated one is reported.
    #[test]
    fn every_taint_needs_a_toleration() {
        let n = tainted(json!([
            {"key": "a", "effect": "NoSchedule"},
            {"key": "b", "effect": "NoSchedule"}
        ]));
        let p = tolerating(json!([{"key": "a", "operator": "Exists"}]));
        let e = run(&p, &n).unwrap_err();
        assert!(matches!(e, Ineligible::Taint { ref taint, .. } if taint == "b:NoSchedule"));
    }

    // nodeunschedulable.Filter: a cordoned node is refused unless the pod tolerates
    // node.kubernetes.io/unschedulable:NoSchedule.
    #[test]
    fn cordoned_node_needs_the_unschedulable_toleration() {
        let mut n = labelled(json!({}));
        n.spec.get_or_insert_with(Default::default).unschedulable = Some(true);
        let m = run(&plain(), &n).unwrap_err().to_string();
        assert!(
            m.contains("cordoned") && m.contains("kubectl uncordon n1"),
            "{m}"
        );
        let p = tolerating(
            json!([{"key": UNSCHEDULABLE_TAINT_KEY, "operator": "Exists",
                                   "effect": "NoSchedule"}]),
        );
        assert_eq!(run(&p, &n), Ok(()));
    }

    // --- nodeSelector ---------------------------------------------------------------

    // nodeaffinity.go GetRequiredNodeAffinity: labels.SelectorFromSet(spec.nodeSelector)
    // — every pair present with the same value.
    #[test]
    fn node_selector_mismatch_is_refused() {
        let p = pod(json!({"containers": [], "nodeSelector": {"gpu": "a100", "zone": "z1"}}));
        assert_eq!(
            run(
                &p,
                &labelled(json!({"gpu": "a100", "zone": "z1", "x": "y"}))
            ),
            Ok(())
        );
        let e = run(&p, &labelled(json!({"gpu": "h100", "zone": "z1"}))).unwrap_err();
        let m = e.to_string();
        assert!(
            m.contains("gpu=\"a100\"") && m.contains("node has gpu=\"h100\""),
            "{m}"
        );
        let m = run(&p, &labelled(json!({"gpu": "a100"})))
            .unwrap_err()
            .to_string();
        assert!(m.contains("no label zone"), "{m}");
    }

    // --- required node affinity -----------------------------------------------------

    fn expr(key: &str, op: &str, values: &[&str]) -> Value {
        json!({"matchExpressions": [{"key": key, "operator": op, "values": values}]})
    }

    fn ok_on(terms: Value, labels: Value) -> bool {
        run(&affine(terms), &labelled(labels)).is_ok()
    }

    // labels/selector.go Requirement.Matches, In: the label exists with a listed value.
    #[test]
    fn affinity_in() {
        let t = json!([expr("gpu", "In", &["a100", "h100"])]);
        assert!(ok_on(t.clone(), json!({"gpu": "h100"})));
        assert!(!ok_on(t.clone(), json!({"gpu": "t4"})));
        assert!(!ok_on(t, json!({})));
    }

    // Requirement.Matches, NotIn: a missing label matches; a listed value does not.
    #[test]
    fn affinity_not_in() {
        let t = json!([expr("gpu", "NotIn", &["t4"])]);
        assert!(ok_on(t.clone(), json!({"gpu": "h100"})));
        assert!(ok_on(t.clone(), json!({})));
        assert!(!ok_on(t, json!({"gpu": "t4"})));
    }

    // Requirement.Matches, Exists / DoesNotExist: presence of the key only.
    #[test]
    fn affinity_exists_and_does_not_exist() {
        let exists = json!([expr("gpu", "Exists", &[])]);
        assert!(ok_on(exists.clone(), json!({"gpu": ""})));
        assert!(!ok_on(exists, json!({"cpu": "x"})));
        let absent = json!([expr("gpu", "DoesNotExist", &[])]);
        assert!(ok_on(absent.clone(), json!({"cpu": "x"})));
        assert!(!ok_on(absent, json!({"gpu": "a100"})));
    }

    // Requirement.Matches, Gt / Lt: label and bound parsed as int64, strict comparison;
    // a missing or non-integer label does not match.
    #[test]
    fn affinity_gt_and_lt() {
        let gt = json!([expr("gpus", "Gt", &["4"])]);
        assert!(ok_on(gt.clone(), json!({"gpus": "8"})));
        assert!(!ok_on(gt.clone(), json!({"gpus": "4"})));
        assert!(!ok_on(gt.clone(), json!({"gpus": "many"})));
        assert!(!ok_on(gt, json!({})));
        let lt = json!([expr("gpus", "Lt", &["4"])]);
        assert!(ok_on(lt.clone(), json!({"gpus": "3"})));
        assert!(!ok_on(lt, json!({"gpus": "4"})));
    }

    // labels/selector.go NewRequirement: Gt/Lt need exactly one integer; In/NotIn need
    // values; Exists takes none; nodeaffinity.go: an unknown operator is a parse error;
    // a term that does not parse does not match.
    #[test]
    fn malformed_requirements_do_not_match() {
        let labels = json!({"gpus": "8", "gpu": "a100"});
        assert!(!ok_on(json!([expr("gpus", "Gt", &["x"])]), labels.clone()));
        assert!(!ok_on(
            json!([expr("gpus", "Gt", &["1", "2"])]),
            labels.clone()
        ));
        assert!(!ok_on(json!([expr("gpu", "In", &[])]), labels.clone()));
        assert!(!ok_on(
            json!([expr("gpu", "Exists", &["a100"])]),
            labels.clone()
        ));
        assert!(!ok_on(
            json!([expr("gpu", "Matches", &["a100"])]),
            labels.clone()
        ));
        // invalid label key / value (NewRequirement validateLabelKey / validateLabelValue)
        assert!(!ok_on(
            json!([expr("bad key", "Exists", &[])]),
            labels.clone()
        ));
        assert!(!ok_on(
            json!([expr("gpu", "NotIn", &["no spaces"])]),
            labels.clone()
        ));
        let m = run(
            &affine(json!([expr("gpu", "Matches", &["a100"])])),
            &labelled(labels),
        )
        .unwrap_err()
        .to_string();
        assert!(m.contains("term 0: matchExpressions gpu Matches"), "{m}");
    }

    // nodeaffinity.go nodeSelectorRequirementsAsFieldSelector: In/NotIn with one value,
    // compared with the node's metadata.name.
    #[test]
    fn affinity_match_fields_metadata_name() {
        let field = |op: &str, v: &[&str]| json!([{"matchFields": [{"key": "metadata.name", "operator": op, "values": v}]}]);
        assert!(ok_on(field("In", &["n1"]), json!({})));
        assert!(!ok_on(field("In", &["n2"]), json!({})));
        assert!(ok_on(field("NotIn", &["n2"]), json!({})));
        assert!(!ok_on(field("NotIn", &["n1"]), json!({})));
        // exactly one value; Exists is not a field operator; only metadata.name
        assert!(!ok_on(field("In", &["n1", "n2"]), json!({})));
        assert!(!ok_on(field("Exists", &[]), json!({})));
        let other = json!([{"matchFields": [{"key": "spec.podCIDR", "operator": "NotIn",
                                              "values": ["x"]}]}]);
        assert!(!ok_on(other, json!({})));
    }

    // nodeaffinity.go nodeSelectorTerm.match: matchExpressions AND matchFields.
    #[test]
    fn expressions_and_fields_of_a_term_are_anded() {
        let t = json!([{
            "matchExpressions": [{"key": "gpu", "operator": "Exists"},
                                 {"key": "zone", "operator": "In", "values": ["z1"]}],
            "matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]
        }]);
        assert!(ok_on(t.clone(), json!({"gpu": "a", "zone": "z1"})));
        assert!(!ok_on(t.clone(), json!({"gpu": "a", "zone": "z2"})));
        assert!(!ok_on(t, json!({"zone": "z1"})));
    }

    // nodeaffinity.go LazyErrorNodeSelector.Match: terms are ORed, and a term that does
    // not parse does not stop a later one from matching.
    #[test]
    fn terms_are_ored() {
        let t = json!([
            expr("gpu", "In", &["h100"]),
            expr("gpu", "Bogus", &[]),
            expr("zone", "In", &["z1"])
        ]);
        assert!(ok_on(t.clone(), json!({"gpu": "h100"})));
        assert!(ok_on(t.clone(), json!({"zone": "z1"})));
        let e = run(&affine(t), &labelled(json!({"gpu": "t4", "zone": "z2"}))).unwrap_err();
        let m = e.to_string();
        assert!(matches!(e, Ineligible::Affinity { .. }));
        assert!(
            m.contains("term 0: matchExpressions gpu In [\"h100\"] fails: node has gpu=\"t4\"")
                && m.contains("term 1: ")
                && m.contains("term 2: "),
            "{m}"
        );
    }

    // nodeaffinity.go NewLazyErrorNodeSelector / isEmptyNodeSelectorTerm: an empty term
    // list, and a term with neither expressions nor fields, match no node.
    #[test]
    fn empty_term_list_and_empty_terms_match_nothing() {
        let m = run(&affine(json!([])), &labelled(json!({"gpu": "a"})))
            .unwrap_err()
            .to_string();
        assert!(m.contains("nodeSelectorTerms list is empty"), "{m}");
        assert!(!ok_on(json!([{}]), json!({"gpu": "a"})));
        assert!(!ok_on(
            json!([{"matchExpressions": [], "matchFields": []}]),
            json!({})
        ));
        // an empty term next to a matching one is only skipped
        assert!(ok_on(
            json!([{}, expr("gpu", "Exists", &[])]),
            json!({"gpu": "a"})
        ));
    }

    // nodeaffinity.go RequiredNodeAffinity.Match: nodeSelector AND affinity.
    #[test]
    fn node_selector_and_affinity_both_apply() {
        let mut p = affine(json!([expr("gpu", "Exists", &[])]));
        p.spec.as_mut().unwrap().node_selector =
            Some([("zone".to_string(), "z1".to_string())].into());
        assert_eq!(
            run(&p, &labelled(json!({"gpu": "a", "zone": "z1"}))),
            Ok(())
        );
        assert!(matches!(
            run(&p, &labelled(json!({"gpu": "a"}))),
            Err(Ineligible::NodeSelector { .. })
        ));
        assert!(matches!(
            run(&p, &labelled(json!({"zone": "z1"}))),
            Err(Ineligible::Affinity { .. })
        ));
    }

    // apimachinery validation IsQualifiedName / IsValidLabelValue / IsDNS1123Subdomain.
    #[test]
    fn label_syntax() {
        for ok in [
            "gpu",
            "vcuda.io/gpu-count",
            "a.b-c/X_y.z",
            "node-role.kubernetes.io/gpu",
        ] {
            assert!(is_qualified_name(ok), "{ok}");
        }
        for bad in [
            "",
            "/a",
            "a/",
            "A.io/x",
            "a/b/c",
            "-a",
            "a-",
            &"x".repeat(64),
        ] {
            assert!(!is_qualified_name(bad), "{bad}");
        }
        assert!(is_label_value("") && is_label_value("h100") && !is_label_value("-5"));
    }

    // --- properties -----------------------------------------------------------------

    fn any_taint() -> impl Strategy<Value = Value> {
        (
            "[a-z./-]{0,12}",
            proptest::option::of("[a-z0-9]{0,6}"),
            prop_oneof![
                Just("NoSchedule".to_string()),
                Just("NoExecute".to_string()),
                Just("PreferNoSchedule".to_string()),
                "[A-Za-z]{0,10}",
            ],
        )
            .prop_map(|(key, value, effect)| json!({"key": key, "value": value, "effect": effect}))
    }

    fn any_node() -> impl Strategy<Value = Node> {
        (
            proptest::collection::vec(any_taint(), 0..6),
            proptest::collection::btree_map("[a-z]{1,5}", "[a-z0-9]{0,5}", 0..4),
            any::<bool>(),
        )
            .prop_map(|(taints, labels, cordoned)| {
                let mut n = node(json!(labels), json!(taints));
                n.spec.as_mut().unwrap().unschedulable = Some(cordoned);
                n
            })
    }

    proptest! {
        // toleration.go ToleratesTaint rule 3 (empty key + Exists tolerates everything):
        // with no selector and no affinity such a pod fits every node, whatever its
        // taints and labels and cordoned or not.
        #[test]
        fn tolerate_everything_fits_every_node(n in any_node()) {
            let p = tolerating(json!([{"operator": "Exists"}]));
            prop_assert_eq!(run(&p, &n), Ok(()));
        }

        // tainttoleration.Filter: a pod without tolerations is refused exactly when the
        // (uncordoned) node has a NoSchedule or NoExecute taint.
        #[test]
        fn no_tolerations_is_refused_iff_a_filtering_taint(n in any_node()) {
            let mut n = n;
            n.spec.as_mut().unwrap().unschedulable = None;
            let filtering = n.spec.as_ref().unwrap().taints.iter().flatten()
                .any(|t| t.effect == "NoSchedule" || t.effect == "NoExecute");
            let r = run(&plain(), &n);
            prop_assert_eq!(r.is_err(), filtering);
            if let Err(e) = r {
                prop_assert!(matches!(e, Ineligible::Taint { .. }), "{}", e);
            }
        }
    }
}
