//! The schemas vcuda's cluster-level parts share: what `vcuda-manager` publishes on its Node
//! ([`NodeInventory`]), what `vcuda-scheduler` records on a Pod ([`Assignment`]) and on a Node
//! ([`Reservations`]), and the multi-GPU request annotation ([`GPU_COUNT_ANNOTATION`]).
//!
//! Serde only: no Kubernetes client, no clock, no I/O. All JSON is camelCase; units are in
//! the field names' documentation (core in percent of one GPU, memory in bytes). Every
//! annotation value carries `schema` = [`SCHEMA`]; it is bumped only when a field changes
//! meaning or a required field is added, so a reader can refuse what it does not understand.
//! Unknown fields are ignored on read (a newer writer may add optional ones).

#![forbid(unsafe_code)]

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The schema version written in every annotation value of this crate.
pub const SCHEMA: u32 = 1;

/// Node annotation holding the node's [`NodeInventory`] (JSON), written by vcuda-manager.
pub const INVENTORY_ANNOTATION: &str = "vcuda.io/gpus";

/// Pod annotation holding the scheduler's [`Assignment`] (JSON).
pub const ASSIGNMENT_ANNOTATION: &str = "vcuda.io/assignment";

/// Node annotation holding the scheduler's [`Reservations`] (JSON).
pub const RESERVATIONS_ANNOTATION: &str = "vcuda.io/reservations";

/// Pod annotation asking for a container's share to be split over several GPUs.
///
/// **Contract.** The value is a decimal integer `N` (1..=[`MAX_GPU_COUNT`]). It applies to
/// every container of the pod that requests `vcuda-core`. Such a container's limits are the
/// *totals*: with `vcuda-core: C` and `vcuda-memory: M` it gets `C / N` percent of compute and
/// `M / N` memory units on each of `N` distinct GPUs, even when `C` is a multiple of 100
/// (`C = 100, N = 2` is half of each of two GPUs, not one whole GPU). The request is refused
/// when `C` or `M` is not divisible by `N`, when `C / N` is not a share (it must be 1..=99:
/// whole GPUs are asked for with `vcuda-core: 100·n` and no annotation), or when `M` is 0 (a
/// share needs memory).
/// `N = 1` is the same as no annotation. Example: `vcuda-core: 120`, `vcuda-memory: 32`,
/// `vcuda.io/gpu-count: "2"` → 60 % and 16 units (4 GiB) on each of two GPUs.
pub const GPU_COUNT_ANNOTATION: &str = "vcuda.io/gpu-count";

/// The largest `vcuda.io/gpu-count` accepted.
pub const MAX_GPU_COUNT: u32 = 16;

/// `vcuda-core` units per GPU: 1..=99 is a share of one GPU, `100·n` is `n` whole GPUs.
pub const CORES_PER_GPU: u32 = 100;

/// Bytes per `vcuda-memory` unit (256 MiB), as the manager advertises them.
pub const MEMORY_UNIT: u64 = 256 << 20;

/// How two GPUs are connected, best first. Mirrors vcuda-manager's `placement::Link`
/// (which NVML reports), one variant for each of its variants.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "camelCase")]
pub enum Link {
    /// NVLink with `lanes` links between the two GPUs.
    #[serde(rename_all = "camelCase")]
    NvLink {
        /// Number of NVLink lanes (≥ 1).
        lanes: u32,
    },
    /// Behind one PCIe switch.
    SamePcieSwitch,
    /// Several PCIe switches, no host bridge crossed.
    MultiplePcieSwitches,
    /// The same PCIe host bridge.
    SameHostBridge,
    /// The same NUMA node (across host bridges).
    SameNumaNode,
    /// Across NUMA nodes (the SMP interconnect).
    System,
}

impl Link {
    /// A score to maximise: any NVLink beats any PCIe path; more lanes beat fewer.
    pub fn score(self) -> u32 {
        match self {
            Link::NvLink { lanes } => 1000 + lanes.min(1000),
            Link::SamePcieSwitch => 50,
            Link::MultiplePcieSwitches => 40,
            Link::SameHostBridge => 30,
            Link::SameNumaNode => 20,
            Link::System => 0,
        }
    }

    /// The class of the link (lanes ignored): `NvLink` > `SamePcieSwitch` > … > `System`.
    pub fn class(self) -> LinkClass {
        match self {
            Link::NvLink { .. } => LinkClass::NvLink,
            Link::SamePcieSwitch => LinkClass::SamePcieSwitch,
            Link::MultiplePcieSwitches => LinkClass::MultiplePcieSwitches,
            Link::SameHostBridge => LinkClass::SameHostBridge,
            Link::SameNumaNode => LinkClass::SameNumaNode,
            Link::System => LinkClass::System,
        }
    }
}

/// A [`Link`] without its lane count, ordered worst (`System`) to best (`NvLink`); used for
/// "at least this well connected" settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum LinkClass {
    /// Across NUMA nodes.
    System,
    /// The same NUMA node.
    SameNumaNode,
    /// The same host bridge.
    SameHostBridge,
    /// Several PCIe switches.
    MultiplePcieSwitches,
    /// One PCIe switch.
    SamePcieSwitch,
    /// NVLink.
    NvLink,
}

/// How one GPU reaches another GPU of the same node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PeerLink {
    /// The other GPU's `index` in the same inventory.
    pub peer: u32,
    /// The connection.
    pub link: Link,
}

/// What is already committed on a GPU by the kubelet (allocations the manager holds).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Allocated {
    /// Sum of the compute shares allocated on the GPU, percent (0..=100; a whole-GPU
    /// allocation counts 100).
    pub core_percent: u32,
    /// Sum of the memory quotas allocated on the GPU, bytes (a whole-GPU allocation counts
    /// the GPU's memory).
    pub memory_bytes: u64,
}

/// One GPU of a node as the manager sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuInventory {
    /// NVML index on the node (0-based).
    pub index: u32,
    /// NVML UUID (`GPU-…`): the identity used in assignments and reservations.
    pub uuid: String,
    /// NVML model name, e.g. `NVIDIA A100-SXM4-40GB` (quotas match on it).
    pub model: String,
    /// CUDA compute capability as `major.minor`, e.g. `"8.0"`.
    pub compute_capability: String,
    /// Device memory, bytes.
    pub memory_bytes: u64,
    /// NUMA node of the GPU's PCIe root, when the platform reports one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa_node: Option<u32>,
    /// How this GPU reaches each other GPU of the node (one entry per peer).
    #[serde(default)]
    pub links: Vec<PeerLink>,
    /// Whether the manager currently advertises the GPU's devices as healthy.
    pub healthy: bool,
    /// What the kubelet has allocated on the GPU.
    #[serde(default)]
    pub allocated: Allocated,
    /// The sharing mode the GPU is locked to (its first allocation's, until its last one in
    /// that mode ends); `None` while it is unlocked, and from writers before modes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<GpuMode>,
    /// How many of its slices are held (slice mode); 0 otherwise.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub slices_held: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// A sharing mode of a node's GPUs (issue 19, seed 002's mixed deployment).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum GpuMode {
    /// Whole GPUs, exclusive (the resource named by [`NodeModes::whole_resource`]).
    Whole,
    /// K equal slices per GPU ([`NodeModes::slice_resource`]), n slices on n GPUs.
    Slice,
    /// `vcuda-core` + `vcuda-memory` shares.
    Shared,
}

/// Which sharing modes a node serves and how ([`NodeInventory::modes`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeModes {
    /// The modes enabled on the node.
    pub enabled: Vec<GpuMode>,
    /// Slices per GPU (K).
    pub slices: u32,
    /// The whole-GPU resource's name, e.g. `nvidia.com/gpu`.
    pub whole_resource: String,
    /// The slice resource's name, `<domain>/sgpu`.
    pub slice_resource: String,
}

impl GpuInventory {
    /// `(major, minor)` of the compute capability; `(0, 0)` when unparsable (treated as the
    /// oldest).
    pub fn compute_capability(&self) -> (u32, u32) {
        let mut it = self.compute_capability.splitn(2, '.');
        let major = it.next().and_then(|s| s.trim().parse().ok());
        let minor = it.next().and_then(|s| s.trim().parse().ok()).unwrap_or(0);
        major.map_or((0, 0), |m| (m, minor))
    }

    /// The link to the GPU with index `peer`; [`Link::System`] when not listed.
    pub fn link_to(&self, peer: u32) -> Link {
        self.links
            .iter()
            .find(|l| l.peer == peer)
            .map_or(Link::System, |l| l.link)
    }
}

/// The value of [`INVENTORY_ANNOTATION`]: the node's GPUs, in NVML index order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeInventory {
    /// [`SCHEMA`] of the writer.
    pub schema: u32,
    /// The GPUs.
    pub gpus: Vec<GpuInventory>,
    /// What each pod the manager has set up holds here (its containers' allocations, after
    /// PreStartContainer). Namespace quotas count these: unlike a pod's own annotations,
    /// a tenant cannot edit them (optional: absent from older writers).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pods: Vec<PodHolding>,
    /// The `coordination.k8s.io/v1` Lease the manager renews while it runs (every
    /// `durationSeconds / 4`): a scheduler stops placing pods here once it has seen the
    /// Lease unchanged for longer than `durationSeconds` (the node is lost: dead or cut off
    /// from the API server). Optional: absent from older writers, whose nodes are not
    /// checked for liveness.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<LeaseRef>,
    /// The sharing modes the node serves (optional: absent from older writers and from a
    /// node serving shares only, which means [`GpuMode::Shared`] alone).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub modes: Option<NodeModes>,
}

/// Which Lease proves a node's vcuda-manager alive, and for how long one renewal counts.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LeaseRef {
    /// The Lease's namespace (the manager's own, e.g. `vcuda-system`).
    pub namespace: String,
    /// The Lease's name (`vcuda-manager-<node name>`).
    pub name: String,
    /// Seconds one renewal keeps the node alive (the Lease's `leaseDurationSeconds`, ≥ 1).
    pub duration_seconds: u32,
}

impl std::fmt::Display for LeaseRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// What one pod holds on the node, as vcuda-manager allocated it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodHolding {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub name: String,
    /// The pod's UID, when the manager knows it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
    /// Per GPU: the larger of its app containers' sum and any one init container (a whole
    /// GPU: 100 % and the GPU's memory).
    pub gpus: Vec<GpuShare>,
}

/// An amount on one GPU: used in [`Assignment`]s and [`Reservation`]s.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuShare {
    /// The GPU's UUID.
    pub uuid: String,
    /// Compute share on it, percent (1..=100; 100 = the whole GPU).
    pub core_percent: u32,
    /// Memory quota on it, bytes (for a whole GPU: the GPU's memory).
    pub memory_bytes: u64,
}

/// The value of [`ASSIGNMENT_ANNOTATION`]: where the scheduler placed each container of the
/// pod that asks for vcuda resources.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Assignment {
    /// [`SCHEMA`] of the writer.
    pub schema: u32,
    /// Container name → its GPUs (one entry for a share, `N` for `gpu-count: N` or `N`
    /// whole GPUs). Init containers are included under their names.
    pub containers: BTreeMap<String, Vec<GpuShare>>,
    /// When the scheduler bound the pod, milliseconds since the Unix epoch (UTC). The
    /// kubelet admits pods in the order they were bound to its node; the manager uses this to
    /// tell which pending pod a GetPreferredAllocation is for (optional: absent from older
    /// writers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bound_unix_ms: Option<u64>,
}

/// A pod the scheduler bound to the node whose GPUs the kubelet has not allocated yet.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Reservation {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub name: String,
    /// The pod's UID (a re-created pod of the same name is another reservation).
    pub uid: String,
    /// What the pod takes, per GPU, summed over its concurrently running containers.
    pub gpus: Vec<GpuShare>,
    /// When the scheduler bound the pod, milliseconds since the Unix epoch (UTC); stale
    /// reservations are dropped by the scheduler after a timeout.
    pub created_unix_ms: u64,
}

/// The value of [`RESERVATIONS_ANNOTATION`]: the optimistic-concurrency record of binds.
///
/// The kubelet's counts lag a bind by seconds, so two binds racing for one GPU would both see
/// it free. A bind therefore re-reads the Node, checks that the pod still fits against the
/// inventory **plus** these reservations, appends its own reservation, and writes the Node with
/// the `resourceVersion` it read. A conflict (HTTP 409) means another bind or the manager
/// changed the Node in between: re-read and re-check, never write blindly, so the GPUs are
/// never over-committed. A reservation ends when the manager's inventory shows the pod's
/// allocation (or it times out); until then it is counted even if that means counting twice
/// (conservative, never over-committing).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Reservations {
    /// [`SCHEMA`] of the writer.
    pub schema: u32,
    /// The reservations, oldest first.
    pub pods: Vec<Reservation>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inventory() -> NodeInventory {
        NodeInventory {
            schema: SCHEMA,
            gpus: vec![
                GpuInventory {
                    index: 0,
                    uuid: "GPU-a".into(),
                    model: "NVIDIA A100-SXM4-40GB".into(),
                    compute_capability: "8.0".into(),
                    memory_bytes: 40 << 30,
                    numa_node: Some(0),
                    links: vec![PeerLink {
                        peer: 1,
                        link: Link::NvLink { lanes: 12 },
                    }],
                    healthy: true,
                    allocated: Allocated {
                        core_percent: 30,
                        memory_bytes: 4 << 30,
                    },
                    mode: None,
                    slices_held: 0,
                },
                GpuInventory {
                    index: 1,
                    uuid: "GPU-b".into(),
                    model: "NVIDIA A100-SXM4-40GB".into(),
                    compute_capability: "8.0".into(),
                    memory_bytes: 40 << 30,
                    numa_node: None,
                    links: vec![PeerLink {
                        peer: 0,
                        link: Link::SamePcieSwitch,
                    }],
                    healthy: false,
                    allocated: Allocated::default(),
                    mode: None,
                    slices_held: 0,
                },
            ],
            pods: vec![],
            lease: None,
            modes: None,
        }
    }

    #[test]
    fn pod_holdings_are_pinned_and_optional() {
        let mut inv = inventory();
        inv.pods.push(PodHolding {
            namespace: "ml".into(),
            name: "train".into(),
            uid: Some("u-1".into()),
            gpus: vec![GpuShare {
                uuid: "GPU-a".into(),
                core_percent: 30,
                memory_bytes: 4 << 30,
            }],
        });
        let json = serde_json::to_string(&inv).unwrap();
        assert!(
            json.ends_with(r#""pods":[{"namespace":"ml","name":"train","uid":"u-1","gpus":[{"uuid":"GPU-a","corePercent":30,"memoryBytes":4294967296}]}]}"#),
            "{json}"
        );
        assert_eq!(serde_json::from_str::<NodeInventory>(&json).unwrap(), inv);
        // An older writer's inventory has none; an empty list is not written.
        assert!(!serde_json::to_string(&inventory())
            .unwrap()
            .contains("pods"));
    }

    #[test]
    fn inventory_json_is_pinned() {
        let json = serde_json::to_string(&inventory()).unwrap();
        assert_eq!(
            json,
            r#"{"schema":1,"gpus":[{"index":0,"uuid":"GPU-a","model":"NVIDIA A100-SXM4-40GB","computeCapability":"8.0","memoryBytes":42949672960,"numaNode":0,"links":[{"peer":1,"link":{"type":"nvLink","lanes":12}}],"healthy":true,"allocated":{"corePercent":30,"memoryBytes":4294967296}},{"index":1,"uuid":"GPU-b","model":"NVIDIA A100-SXM4-40GB","computeCapability":"8.0","memoryBytes":42949672960,"links":[{"peer":0,"link":{"type":"samePcieSwitch"}}],"healthy":false,"allocated":{"corePercent":0,"memoryBytes":0}}]}"#
        );
        let back: NodeInventory = serde_json::from_str(&json).unwrap();
        assert_eq!(back, inventory());
    }

    #[test]
    fn every_link_round_trips_and_orders() {
        let all = [
            Link::NvLink { lanes: 4 },
            Link::SamePcieSwitch,
            Link::MultiplePcieSwitches,
            Link::SameHostBridge,
            Link::SameNumaNode,
            Link::System,
        ];
        for w in all.windows(2) {
            assert!(w[0].score() > w[1].score(), "{w:?}");
            assert!(w[0].class() > w[1].class(), "{w:?}");
        }
        for l in all {
            let j = serde_json::to_string(&l).unwrap();
            assert_eq!(serde_json::from_str::<Link>(&j).unwrap(), l, "{j}");
        }
        assert!(Link::NvLink { lanes: 12 }.score() > Link::NvLink { lanes: 4 }.score());
    }

    #[test]
    fn readers_ignore_unknown_fields_and_default_optional_ones() {
        let j = r#"{"schema":1,"future":true,"gpus":[{"index":3,"uuid":"GPU-x","model":"T4","computeCapability":"7.5","memoryBytes":16,"healthy":true,"new":1}]}"#;
        let inv: NodeInventory = serde_json::from_str(j).unwrap();
        let g = &inv.gpus[0];
        assert_eq!(
            (g.index, g.numa_node, g.allocated),
            (3, None, Allocated::default())
        );
        assert_eq!(g.compute_capability(), (7, 5));
        assert_eq!(g.link_to(0), Link::System, "unlisted peer");
    }

    #[test]
    fn the_lease_is_pinned_and_optional() {
        let mut inv = inventory();
        let without = serde_json::to_string(&inv).unwrap();
        assert!(!without.contains("lease"), "{without}");
        assert_eq!(
            serde_json::from_str::<NodeInventory>(&without)
                .unwrap()
                .lease,
            None,
            "an older writer's inventory has no lease"
        );
        inv.lease = Some(LeaseRef {
            namespace: "vcuda-system".into(),
            name: "vcuda-manager-n1".into(),
            duration_seconds: 40,
        });
        let json = serde_json::to_string(&inv).unwrap();
        assert!(
            json.ends_with(r#""lease":{"namespace":"vcuda-system","name":"vcuda-manager-n1","durationSeconds":40}}"#),
            "{json}"
        );
        assert_eq!(serde_json::from_str::<NodeInventory>(&json).unwrap(), inv);
        assert_eq!(
            inv.lease.unwrap().to_string(),
            "vcuda-system/vcuda-manager-n1"
        );
    }

    #[test]
    fn compute_capability_parses_or_is_oldest() {
        let mut g = inventory().gpus[0].clone();
        g.compute_capability = "9.0".into();
        assert_eq!(g.compute_capability(), (9, 0));
        g.compute_capability = "12".into();
        assert_eq!(g.compute_capability(), (12, 0));
        g.compute_capability = "n/a".into();
        assert_eq!(g.compute_capability(), (0, 0));
    }

    #[test]
    fn assignment_and_reservations_json_are_pinned() {
        let share = GpuShare {
            uuid: "GPU-a".into(),
            core_percent: 60,
            memory_bytes: 4 << 30,
        };
        let mut a = Assignment {
            schema: SCHEMA,
            containers: BTreeMap::from([("train".to_string(), vec![share.clone()])]),
            bound_unix_ms: None,
        };
        let j = serde_json::to_string(&a).unwrap();
        assert_eq!(
            j,
            r#"{"schema":1,"containers":{"train":[{"uuid":"GPU-a","corePercent":60,"memoryBytes":4294967296}]}}"#
        );
        assert_eq!(serde_json::from_str::<Assignment>(&j).unwrap(), a);
        a.bound_unix_ms = Some(1_700_000_000_123);
        let j = serde_json::to_string(&a).unwrap();
        assert!(j.ends_with(r#","boundUnixMs":1700000000123}"#), "{j}");
        assert_eq!(serde_json::from_str::<Assignment>(&j).unwrap(), a);

        let r = Reservations {
            schema: SCHEMA,
            pods: vec![Reservation {
                namespace: "ml".into(),
                name: "p".into(),
                uid: "u-1".into(),
                gpus: vec![share],
                created_unix_ms: 1_700_000_000_000,
            }],
        };
        let j = serde_json::to_string(&r).unwrap();
        assert_eq!(
            j,
            r#"{"schema":1,"pods":[{"namespace":"ml","name":"p","uid":"u-1","gpus":[{"uuid":"GPU-a","corePercent":60,"memoryBytes":4294967296}],"createdUnixMs":1700000000000}]}"#
        );
        assert_eq!(serde_json::from_str::<Reservations>(&j).unwrap(), r);
    }
}
