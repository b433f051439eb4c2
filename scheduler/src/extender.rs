//! The scheduler extender v1 JSON (`k8s.io/kube-scheduler/extender/v1`).
//!
//! The extender types have no json tags, so their keys are the Go field names in PascalCase;
//! Go emits nil pointers, slices and maps as `null`, and so do we (`Option` → `null`). The
//! embedded `v1.Pod` / `v1.NodeList` use Kubernetes camelCase and are cut down to what the
//! scheduler reads; a [`Node`] keeps every other field (`rest`) because a filter that is not
//! `nodeCacheCapable` returns the nodes it was sent. `tests/extender_conformance.rs` checks
//! the keys against the upstream Go file.

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer, Serialize};
use serde_json::{Map, Value};

/// Highest score a prioritize answer may give (upstream `MaxExtenderPriority`).
pub const MAX_EXTENDER_PRIORITY: i64 = 10;
/// Lowest score (upstream `MinExtenderPriority`).
pub const MIN_EXTENDER_PRIORITY: i64 = 0;

/// `null` → the type's default (Go sends `null` for nil maps and slices).
fn null_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// Object metadata: the fields the scheduler reads; the others are kept in `rest`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ObjectMeta {
    #[serde(default)]
    pub name: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub namespace: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub uid: String,
    #[serde(
        default,
        deserialize_with = "null_default",
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    pub labels: BTreeMap<String, String>,
    #[serde(
        default,
        deserialize_with = "null_default",
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    pub annotations: BTreeMap<String, String>,
    /// Every other metadata field (resourceVersion, ownerReferences, …), unchanged.
    #[serde(flatten)]
    pub rest: Map<String, Value>,
}

/// A resource quantity as Kubernetes serialises it: a string (`"100"`, `"1k"`, `"40Gi"`);
/// a JSON number is accepted too and kept as its decimal text.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Quantity(pub String);

impl<'de> Deserialize<'de> for Quantity {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match Value::deserialize(d)? {
            Value::String(s) => Ok(Quantity(s)),
            Value::Number(n) => Ok(Quantity(n.to_string())),
            other => Err(serde::de::Error::custom(format!(
                "a resource quantity must be a string or a number, not {other}"
            ))),
        }
    }
}

/// A container's `resources`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Resources {
    #[serde(
        default,
        deserialize_with = "null_default",
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    pub limits: BTreeMap<String, Quantity>,
    #[serde(
        default,
        deserialize_with = "null_default",
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    pub requests: BTreeMap<String, Quantity>,
}

/// A container: its name and resources only.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Container {
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub resources: Resources,
}

/// A pod's spec: its containers only.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodSpec {
    #[serde(default, deserialize_with = "null_default")]
    pub containers: Vec<Container>,
    #[serde(
        default,
        deserialize_with = "null_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub init_containers: Vec<Container>,
}

/// A `v1.Pod`, cut down to what the scheduler reads.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Pod {
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: PodSpec,
}

/// A `v1.Node`: metadata parsed, everything else (spec, status, …) kept unchanged.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Node {
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(flatten)]
    pub rest: Map<String, Value>,
}

/// A `v1.NodeList`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeList {
    #[serde(default, deserialize_with = "null_default")]
    pub items: Vec<Node>,
    #[serde(flatten)]
    pub rest: Map<String, Value>,
}

/// Request of the filter and prioritize verbs. With `nodeCacheCapable` only `NodeNames` is
/// set; otherwise only `Nodes`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ExtenderArgs {
    #[serde(rename = "Pod")]
    pub pod: Option<Pod>,
    #[serde(rename = "Nodes", default)]
    pub nodes: Option<NodeList>,
    #[serde(rename = "NodeNames", default)]
    pub node_names: Option<Vec<String>>,
}

/// Answer of the filter verb. `FailedAndUnresolvableNodes` says preemption would not help.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ExtenderFilterResult {
    #[serde(rename = "Nodes", default)]
    pub nodes: Option<NodeList>,
    #[serde(rename = "NodeNames", default)]
    pub node_names: Option<Vec<String>>,
    /// Node name → why it failed.
    #[serde(rename = "FailedNodes", default, deserialize_with = "null_default")]
    pub failed_nodes: BTreeMap<String, String>,
    /// Node name → why it failed, preemption would not help.
    #[serde(
        rename = "FailedAndUnresolvableNodes",
        default,
        deserialize_with = "null_default"
    )]
    pub failed_and_unresolvable_nodes: BTreeMap<String, String>,
    /// Non-empty: the whole call failed.
    #[serde(rename = "Error", default)]
    pub error: String,
}

/// One node's score in a prioritize answer (`HostPriorityList` = `Vec<HostPriority>`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostPriority {
    #[serde(rename = "Host")]
    pub host: String,
    /// [`MIN_EXTENDER_PRIORITY`]..=[`MAX_EXTENDER_PRIORITY`].
    #[serde(rename = "Score")]
    pub score: i64,
}

/// Answer of the prioritize verb.
pub type HostPriorityList = Vec<HostPriority>;

/// Request of the bind verb.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExtenderBindingArgs {
    #[serde(rename = "PodName")]
    pub pod_name: String,
    #[serde(rename = "PodNamespace")]
    pub pod_namespace: String,
    #[serde(rename = "PodUID")]
    pub pod_uid: String,
    #[serde(rename = "Node")]
    pub node: String,
}

/// Answer of the bind verb; an empty `Error` means bound.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExtenderBindingResult {
    #[serde(rename = "Error", default)]
    pub error: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_filter_request_from_the_scheduler_parses_and_nodes_keep_unknown_fields() {
        let j = r#"{"Pod":{"metadata":{"name":"p","namespace":"ml","uid":"u1",
              "annotations":{"vcuda.io/gpu-count":"2"},"resourceVersion":"7"},
              "spec":{"containers":[{"name":"c","image":"x",
                "resources":{"limits":{"tencent.com/vcuda-core":"120","memory":"1Gi"},"requests":null}}]},
              "status":{}},
            "Nodes":{"metadata":{},"items":[{"metadata":{"name":"n1","labels":{"pool":"a"},
              "annotations":null,"resourceVersion":"42"},"status":{"capacity":{"cpu":"8"}}}]},
            "NodeNames":null}"#;
        let a: ExtenderArgs = serde_json::from_str(j).unwrap();
        let pod = a.pod.as_ref().unwrap();
        assert_eq!(pod.metadata.namespace, "ml");
        assert_eq!(pod.metadata.annotations["vcuda.io/gpu-count"], "2");
        assert_eq!(
            pod.spec.containers[0].resources.limits["tencent.com/vcuda-core"],
            Quantity("120".into())
        );
        assert!(pod.spec.containers[0].resources.requests.is_empty(), "null");
        assert!(a.node_names.is_none());
        let node = &a.nodes.as_ref().unwrap().items[0];
        assert_eq!(node.metadata.labels["pool"], "a");
        // returned nodes are the nodes sent: nothing lost
        let back = serde_json::to_value(node).unwrap();
        assert_eq!(back["metadata"]["resourceVersion"], "42");
        assert_eq!(back["status"]["capacity"]["cpu"], "8");
    }

    #[test]
    fn results_use_pascal_case_and_go_nulls() {
        let r = ExtenderFilterResult {
            node_names: Some(vec!["n1".into()]),
            failed_nodes: BTreeMap::from([("n2".to_string(), "no GPU".to_string())]),
            ..Default::default()
        };
        assert_eq!(
            serde_json::to_string(&r).unwrap(),
            r#"{"Nodes":null,"NodeNames":["n1"],"FailedNodes":{"n2":"no GPU"},"FailedAndUnresolvableNodes":{},"Error":""}"#
        );
        let back: ExtenderFilterResult = serde_json::from_str(
            r#"{"Nodes":null,"NodeNames":["n1"],"FailedNodes":{"n2":"no GPU"},"FailedAndUnresolvableNodes":null,"Error":""}"#,
        )
        .unwrap();
        assert_eq!(back, r);
        let p: HostPriorityList = vec![HostPriority {
            host: "n1".into(),
            score: 7,
        }];
        assert_eq!(
            serde_json::to_string(&p).unwrap(),
            r#"[{"Host":"n1","Score":7}]"#
        );
        let b: ExtenderBindingArgs = serde_json::from_str(
            r#"{"PodName":"p","PodNamespace":"ml","PodUID":"u1","Node":"n1"}"#,
        )
        .unwrap();
        assert_eq!((b.pod_uid.as_str(), b.node.as_str()), ("u1", "n1"));
    }

    #[test]
    fn a_quantity_that_is_neither_string_nor_number_is_refused() {
        let e = serde_json::from_str::<Quantity>("[1]").unwrap_err();
        assert!(e.to_string().contains("string or a number"), "{e}");
        assert_eq!(serde_json::from_str::<Quantity>("5").unwrap().0, "5");
    }
}
