//! The simulator's requests and results: what the control socket carries as JSON and what
//! the library API returns.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::merge::RunOptions;

/// The namespace used when none is given.
pub const DEFAULT_NAMESPACE: &str = "default";

fn default_namespace() -> String {
    DEFAULT_NAMESPACE.to_string()
}

fn yes() -> bool {
    true
}

/// A pod to admit: containers in order, each with its extended-resource limits in order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdmitRequest {
    pub pod: String,
    #[serde(default = "default_namespace")]
    pub namespace: String,
    pub containers: Vec<ContainerRequest>,
    /// Start every container (PreStartContainer) once admitted, as the pod worker would.
    #[serde(default = "yes")]
    pub start: bool,
    /// The pod's uid, as the API server assigned it (`metadata.uid`). Absent: kubelet-sim
    /// makes one up. Used everywhere the kubelet uses the uid (checkpoint, status).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerRequest {
    pub name: String,
    /// `(resource, quantity)` in the order the kubelet walks them (a Go map: random there).
    #[serde(default)]
    pub resources: Vec<ResourceRequest>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResourceRequest {
    pub resource: String,
    pub quantity: u64,
}

impl AdmitRequest {
    /// A pod in the default namespace, started on admission.
    pub fn new(pod: &str, containers: Vec<ContainerRequest>) -> Self {
        AdmitRequest {
            pod: pod.to_string(),
            namespace: default_namespace(),
            containers,
            start: true,
            uid: None,
        }
    }

    pub fn no_start(mut self) -> Self {
        self.start = false;
        self
    }

    /// The pod's uid as the API server gave it (instead of one kubelet-sim makes up).
    pub fn with_uid(mut self, uid: &str) -> Self {
        self.uid = Some(uid.to_string());
        self
    }
}

impl ContainerRequest {
    /// `ContainerRequest::new("main", &[("example.com/x", 2)])`.
    pub fn new(name: &str, resources: &[(&str, u64)]) -> Self {
        ContainerRequest {
            name: name.to_string(),
            resources: resources
                .iter()
                .map(|(r, q)| ResourceRequest {
                    resource: r.to_string(),
                    quantity: *q,
                })
                .collect(),
        }
    }
}

/// Parses the CLI's `NAME:RESOURCE=QTY[,RESOURCE=QTY...]` (or just `NAME`).
pub fn parse_container_spec(spec: &str) -> Result<ContainerRequest, String> {
    let usage = "expected NAME:RESOURCE=QTY[,RESOURCE=QTY...], e.g. main:tencent.com/vcuda-core=50,tencent.com/vcuda-memory=4";
    let (name, list) = spec.split_once(':').unwrap_or((spec, ""));
    if name.is_empty() {
        return Err(format!("container {spec:?}: empty name; {usage}"));
    }
    let mut resources = Vec::new();
    for item in list.split(',').filter(|s| !s.is_empty()) {
        let (resource, qty) = item
            .rsplit_once('=')
            .ok_or_else(|| format!("container {spec:?}: {item:?} has no '='; {usage}"))?;
        let quantity = qty.parse().map_err(|_| {
            format!("container {spec:?}: quantity {qty:?} is not a whole number; {usage}")
        })?;
        resources.push(ResourceRequest {
            resource: resource.to_string(),
            quantity,
        });
    }
    Ok(ContainerRequest {
        name: name.to_string(),
        resources,
    })
}

/// Why a pod was rejected (the pod status the real kubelet would set).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rejection {
    /// `UnexpectedAdmissionError`.
    pub reason: String,
    pub message: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdmitResult {
    pub pod: String,
    pub namespace: String,
    pub uid: String,
    pub admitted: bool,
    /// Set when `admitted` is false.
    pub rejection: Option<Rejection>,
    /// Requested resources the device manager does not know (never registered, nothing
    /// allocated): the real kubelet drops them from its checks and the container gets nothing.
    pub ignored_resources: Vec<String>,
    pub containers: Vec<ContainerResult>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerResult {
    pub name: String,
    /// Resource → device IDs the container was allocated.
    pub devices: BTreeMap<String, Vec<String>>,
    /// The merged Allocate responses of its resources, as the kubelet hands them to the
    /// runtime (before 1.29 without `cdi_devices`, which it drops).
    pub allocate_response: RunOptions,
    /// Present when the container was started on admission.
    pub start: Option<StartResult>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StartResult {
    pub pod: String,
    pub namespace: String,
    pub container: String,
    pub started: bool,
    /// Why the start failed (a PreStartContainer error fails the start, not the admission).
    pub error: Option<String>,
    /// Resources PreStartContainer was called for, in order.
    pub pre_start_called: Vec<String>,
    /// Successful starts of this container so far (restarts included).
    pub starts: u32,
    /// What the container runtime did (`serve --runtime docker`): the engine's container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime: Option<crate::runtime::Started>,
}

/// `kubelet-sim status`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Status {
    pub plugin_dir: String,
    pub kubelet_socket: String,
    pub pod_resources_socket: String,
    /// Kubelet restarts so far.
    pub restarts: u64,
    pub resources: Vec<ResourceStatus>,
    pub pods: Vec<PodStatus>,
    /// Things a real kubelet would handle differently or badly (see README).
    pub warnings: Vec<String>,
    /// How long the plugin took to answer each Allocate and PreStartContainer, as the kubelet
    /// sees it (the last 10 000), for benchmarks.
    #[serde(default)]
    pub rpc_timings: Vec<RpcTiming>,
}

/// One device-plugin RPC's round trip.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RpcTiming {
    /// `Allocate` or `PreStartContainer`.
    pub rpc: String,
    pub resource: String,
    pub micros: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResourceStatus {
    pub name: String,
    /// `registered` (endpoint connected) or `stopped` (stream ended, or kubelet restarted).
    pub state: String,
    /// Endpoint socket, relative to the plugin directory.
    pub endpoint: Option<String>,
    /// From GetDevicePluginOptions (what the kubelet uses); null after a kubelet restart.
    pub options: Option<Options>,
    /// From the RegisterRequest (informational).
    pub register_options: Option<Options>,
    pub registrations: u64,
    /// ListAndWatch messages received since the current registration.
    pub list_and_watch_messages: u64,
    /// Every device of the last message (capacity).
    pub devices: Vec<String>,
    /// Healthy ones (allocatable).
    pub healthy: Vec<String>,
    /// Allocated to pods.
    pub allocated: Vec<String>,
    pub capacity: usize,
    pub allocatable: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Options {
    pub pre_start_required: bool,
    pub get_preferred_allocation_available: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodStatus {
    pub name: String,
    pub namespace: String,
    pub uid: String,
    pub containers: Vec<ContainerStatus>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerStatus {
    pub name: String,
    pub requests: Vec<ResourceRequest>,
    /// Resource → allocated device IDs (recorded after Allocate returned).
    pub devices: BTreeMap<String, Vec<String>>,
    pub starts: u32,
    pub last_start_error: Option<String>,
    /// The engine's container of the last successful start (`serve --runtime docker`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime: Option<crate::runtime::Started>,
}

impl Status {
    pub fn resource(&self, name: &str) -> Option<&ResourceStatus> {
        self.resources.iter().find(|r| r.name == name)
    }

    pub fn pod(&self, namespace: &str, name: &str) -> Option<&PodStatus> {
        self.pods
            .iter()
            .find(|p| p.name == name && p.namespace == namespace)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn container_specs() {
        let c = parse_container_spec("main:tencent.com/vcuda-core=50,tencent.com/vcuda-memory=4")
            .unwrap();
        assert_eq!(
            c,
            ContainerRequest::new(
                "main",
                &[
                    ("tencent.com/vcuda-core", 50),
                    ("tencent.com/vcuda-memory", 4)
                ]
            )
        );
        assert_eq!(parse_container_spec("side").unwrap().resources, vec![]);
        assert!(parse_container_spec(":a/b=1").is_err());
        assert!(parse_container_spec("m:a/b")
            .unwrap_err()
            .contains("no '='"));
        assert!(parse_container_spec("m:a/b=x")
            .unwrap_err()
            .contains("whole number"));
    }

    #[test]
    fn admit_request_defaults() {
        let r: AdmitRequest =
            serde_json::from_str(r#"{"pod":"p","containers":[{"name":"c"}]}"#).unwrap();
        assert_eq!(r.namespace, "default");
        assert!(r.start);
        assert_eq!(r.uid, None);
        let r: AdmitRequest = serde_json::from_str(
            r#"{"pod":"p","uid":"6f1c0a52-0000-4000-8000-000000000001","containers":[{"name":"c"}]}"#,
        )
        .unwrap();
        assert_eq!(
            r.uid.as_deref(),
            Some("6f1c0a52-0000-4000-8000-000000000001")
        );
    }
}
