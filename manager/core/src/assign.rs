//! What the manager decides with the API server's view of its pods (pure: no client, no
//! clock). The I/O is in [`crate::apiserver`].
//!
//! - [`facts`]: a Pod cut down to what matters here (uid, creation, the scheduler's
//!   `vcuda.io/assignment`, `vcuda.io/gpu-count`, each container's vcuda requests).
//! - [`admitting`]: which container a GetPreferredAllocation is for. The request names no
//!   pod, but the kubelet admits one pod at a time, in the order pods were bound to its node,
//!   and a pod's containers in order (init containers first), each container's resources
//!   back to back; a container holds devices (PodResources) from its Allocate on. So: a
//!   container holding its other resource but not this one is certainly it; else it is the
//!   first container still missing a resource, of the earliest-bound pod (the scheduler
//!   records `boundUnixMs` in the assignment), if it asks exactly this many. If that guess is
//!   wrong (the kubelet received pods out of bind order), [`check_assignment`] fails the
//!   container with the reason rather than letting it run where the scheduler did not
//!   count it.
//! - [`wanted`]: the GPUs (and how many device IDs on each) GetPreferredAllocation should
//!   answer for it: the scheduler's assignment, else an even `gpu-count` split.
//! - [`check_assignment`]: PreStartContainer's agreement check.
//! - [`node_inventory`] and [`retire`]: what the manager publishes on its Node.

use std::collections::{BTreeMap, HashSet};

use k8s_openapi::api::core::v1::{Container, Pod};
use vcuda_cluster::{
    Allocated, Assignment, GpuInventory, GpuShare, NodeInventory, PeerLink, PodHolding,
    Reservations, ASSIGNMENT_ANNOTATION, GPU_COUNT_ANNOTATION, MAX_GPU_COUNT, SCHEMA,
};

use crate::allocation::Allocation;
use crate::ids::{ContainerRef, DeviceId, Kind, PodRef, PodUid, CORES_PER_GPU, MEMORY_UNIT};
use crate::inventory::Inventory;
use crate::placement::{split_gpus, Link, Node};

/// The pod's word from the API server cannot be followed, or the kubelet's devices disagree
/// with it. Each says which pod (and container) and what to do; PreStartContainer refuses
/// the container with it, which the user reads on the pod.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AssignError {
    #[error("pod {pod}: annotation {ASSIGNMENT_ANNOTATION} is not readable ({error}); it is written by vcuda-scheduler at bind: delete the pod to schedule it again")]
    Unreadable {
        /// "namespace/name".
        pod: String,
        error: String,
    },
    #[error("pod {pod}: annotation {ASSIGNMENT_ANNOTATION} has schema {schema} but this vcuda-manager reads {SCHEMA}; upgrade vcuda-manager")]
    Schema { pod: String, schema: u32 },
    #[error("pod {pod}: pod annotation {GPU_COUNT_ANNOTATION} = {value:?} is not a number from 1 to {MAX_GPU_COUNT}; set it to the number of GPUs to split each container's share over, and create the pod again")]
    GpuCount { pod: String, value: String },
    #[error("{pod} container {container}: the scheduler's {ASSIGNMENT_ANNOTATION} has no entry for this container (it names {}); delete the pod to schedule it again", names.join(", "))]
    NoEntry {
        pod: String,
        container: String,
        /// The containers the assignment names.
        names: Vec<String>,
    },
    #[error("{pod} container {container}: the API server cannot be reached to read the pod's {ASSIGNMENT_ANNOTATION} and {GPU_COUNT_ANNOTATION} ({error}), so the container is not started unchecked; it starts once the node reaches the API server again (the kubelet retries the start), or run vcuda-manager with --api off to trust the kubelet's devices alone")]
    Unverified {
        pod: String,
        container: String,
        error: String,
    },
    #[error("{pod} container {container}: the scheduler assigned {} ({ASSIGNMENT_ANNOTATION}) but the kubelet allocated {}; the node changed after scheduling (another pod took that share), so the scheduler's accounting would be wrong. Delete the pod to schedule it again", show(assigned), show(actual))]
    Disagrees {
        pod: String,
        container: String,
        assigned: Shape,
        actual: Shape,
    },
}

impl AssignError {
    /// A short stable name for counting errors by kind.
    pub fn kind(&self) -> &'static str {
        match self {
            AssignError::Unreadable { .. } => "assignment-unreadable",
            AssignError::Schema { .. } => "assignment-schema",
            AssignError::GpuCount { .. } => "gpu-count",
            AssignError::NoEntry { .. } => "assignment-no-entry",
            AssignError::Disagrees { .. } => "assignment-disagrees",
            AssignError::Unverified { .. } => "api-unreachable",
        }
    }
}

/// One container's vcuda requests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerFacts {
    pub name: String,
    /// `vcuda-core` units.
    pub core: u64,
    /// `vcuda-memory` units (256 MiB).
    pub memory: u64,
    /// An init container (the kubelet may hand its devices on to an app container).
    pub init: bool,
}

impl ContainerFacts {
    fn amount(&self, kind: Kind) -> u64 {
        match kind {
            Kind::Core => self.core,
            Kind::Memory => self.memory,
        }
    }
}

/// What the manager reads of a Pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodFacts {
    pub namespace: String,
    pub name: String,
    pub uid: PodUid,
    /// RFC 3339 (sorts as time).
    pub created: String,
    /// When the pod was bound, ms since the epoch, as well as known: the scheduler's
    /// `boundUnixMs`, else the PodScheduled condition's time (seconds), else creation.
    pub bound_ms: u64,
    /// The same without the assignment's word: the PodScheduled condition's time, else
    /// creation (what [`vouch`] falls back to).
    pub scheduled_ms: u64,
    /// Succeeded, Failed, or being deleted.
    pub finished: bool,
    /// The scheduler's assignment; `Err` when the annotation is not readable.
    pub assignment: Option<Result<Assignment, AssignError>>,
    /// `vcuda.io/gpu-count` (1 when unset); `Err` when invalid.
    pub gpu_count: Result<u32, AssignError>,
    /// Containers asking for vcuda resources, in the kubelet's order (init containers
    /// first).
    pub containers: Vec<ContainerFacts>,
}

impl PodFacts {
    /// The pod by name.
    pub fn key(&self) -> PodRef {
        PodRef::new(self.namespace.clone(), self.name.clone())
    }

    /// Its container `container`.
    pub fn container(&self, container: &str) -> ContainerRef {
        ContainerRef::new(self.namespace.clone(), self.name.clone(), container)
    }

    /// One container asks for vcuda resources, and no init container does: its
    /// reservation on the Node is that container's shares, and it may be exchanged with an
    /// identical pod ([`partner`]).
    pub fn single(&self) -> bool {
        matches!(self.containers.as_slice(), [c] if !c.init)
    }
}

fn units(c: &Container, resource: &str) -> u64 {
    let r = c.resources.as_ref();
    let q = r
        .and_then(|r| r.limits.as_ref())
        .and_then(|l| l.get(resource))
        .or_else(|| {
            r.and_then(|r| r.requests.as_ref())
                .and_then(|l| l.get(resource))
        });
    q.and_then(|q| q.0.trim().parse().ok()).unwrap_or(0)
}

/// Cut a Pod down to [`PodFacts`].
pub fn facts(pod: &Pod, domain: &str) -> PodFacts {
    let meta = &pod.metadata;
    let ann = meta.annotations.clone().unwrap_or_default();
    let who = format!(
        "{}/{}",
        meta.namespace.as_deref().unwrap_or_default(),
        meta.name.as_deref().unwrap_or_default()
    );
    let assignment = ann.get(ASSIGNMENT_ANNOTATION).map(|s| {
        serde_json::from_str::<Assignment>(s)
            .map_err(|e| AssignError::Unreadable {
                pod: who.clone(),
                error: e.to_string(),
            })
            .and_then(|a| {
                if a.schema > SCHEMA {
                    Err(AssignError::Schema {
                        pod: who.clone(),
                        schema: a.schema,
                    })
                } else {
                    Ok(a)
                }
            })
    });
    let gpu_count = match ann.get(GPU_COUNT_ANNOTATION) {
        None => Ok(1),
        Some(v) => match v.trim().parse::<u32>() {
            Ok(n) if (1..=MAX_GPU_COUNT).contains(&n) => Ok(n),
            _ => Err(AssignError::GpuCount {
                pod: who.clone(),
                value: v.clone(),
            }),
        },
    };
    let (core, mem) = (Kind::Core.resource(domain), Kind::Memory.resource(domain));
    let spec = pod.spec.as_ref();
    let inits = spec.and_then(|s| s.init_containers.as_ref());
    let containers = inits
        .into_iter()
        .flatten()
        .map(|c| (c, true))
        .chain(
            spec.map(|s| s.containers.iter())
                .into_iter()
                .flatten()
                .map(|c| (c, false)),
        )
        .map(|(c, init)| ContainerFacts {
            name: c.name.clone(),
            core: units(c, &core),
            memory: units(c, &mem),
            init,
        })
        .filter(|c| c.core > 0 || c.memory > 0)
        .collect();
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    let created_ms = meta
        .creation_timestamp
        .as_ref()
        .map_or(0, |t| t.0.timestamp_millis().max(0) as u64);
    let scheduled_ms = pod
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| {
            cs.iter()
                .find(|c| c.type_ == "PodScheduled" && c.status == "True")
        })
        .and_then(|c| c.last_transition_time.as_ref())
        .map(|t| t.0.timestamp_millis().max(0) as u64);
    let scheduled_ms = scheduled_ms.unwrap_or(created_ms);
    let bound_ms = match &assignment {
        Some(Ok(a)) => a.bound_unix_ms,
        _ => None,
    }
    .unwrap_or(scheduled_ms);
    PodFacts {
        bound_ms,
        scheduled_ms,
        namespace: meta.namespace.clone().unwrap_or_default(),
        name: meta.name.clone().unwrap_or_default(),
        uid: PodUid::new(meta.uid.clone().unwrap_or_default()),
        created: meta
            .creation_timestamp
            .as_ref()
            .map(|t| t.0.to_string())
            .unwrap_or_default(),
        finished: meta.deletion_timestamp.is_some()
            || matches!(phase, Some("Succeeded" | "Failed")),
        assignment,
        gpu_count,
        containers,
    }
}

/// Drop the pod's `vcuda.io/assignment` unless vcuda-scheduler bound the pod: the pod's
/// owner can write its annotations (at creation, with `spec.nodeName` set to skip the
/// scheduler, or by patching them after the bind), but not the Node's
/// `vcuda.io/reservations`, which the scheduler writes before every Binding and the manager
/// retires only once every app container is set up. So the assignment is followed only
/// while a reservation names the pod's UID and holds, on every GPU the assignment names, at
/// least what the assignment puts there (the app containers' sum, or any one init
/// container; for a pod with one such container, the reservation is what is followed).
/// Otherwise it is a tenant's word: dropped, with its `boundUnixMs`, and the
/// manager places the pod as if it had none. Returns why, for the log.
pub fn vouch(pod: &mut PodFacts, reservations: Option<&Reservations>) -> Option<String> {
    let Some(Ok(a)) = &pod.assignment else {
        return None;
    };
    let who = format!("pod {}/{}", pod.namespace, pod.name);
    let why = match reservations.and_then(|r| r.pods.iter().find(|r| pod.uid == r.uid.as_str())) {
        None => Some(format!("{who} carries {ASSIGNMENT_ANNOTATION} but no vcuda-scheduler reservation on this node names it (bound by another scheduler, created with spec.nodeName, or reserved too long ago): ignored, the manager places it itself")),
        // One container: [`effective`] follows the reservation itself (an exchange with an
        // identical pod rewrites it), not the annotation.
        Some(r) if pod.single() && !r.gpus.is_empty() => None,
        Some(r) => {
            let init: HashSet<&str> = pod
                .containers
                .iter()
                .filter(|c| c.init)
                .map(|c| c.name.as_str())
                .collect();
            // per GPU: (app core, app memory, init core, init memory)
            let mut per: BTreeMap<&str, (u64, u64, u64, u64)> = BTreeMap::new();
            for (container, shares) in &a.containers {
                for s in shares {
                    let e = per.entry(s.uuid.as_str()).or_default();
                    let (c, m) = (u64::from(s.core_percent), s.memory_bytes);
                    if init.contains(container.as_str()) {
                        (e.2, e.3) = (e.2.max(c), e.3.max(m));
                    } else {
                        (e.0, e.1) = (e.0.saturating_add(c), e.1.saturating_add(m));
                    }
                }
            }
            per.iter()
                .find(|(uuid, &(ac, am, ic, im))| {
                    !r.gpus.iter().any(|g| {
                        g.uuid == **uuid
                            && u64::from(g.core_percent) >= ac.max(ic)
                            && g.memory_bytes >= am.max(im)
                    })
                })
                .map(|(uuid, _)| format!("{who}: {ASSIGNMENT_ANNOTATION} puts more on GPU {uuid} than vcuda-scheduler reserved for it on this node (the annotation was edited after the bind): ignored, the manager places it itself"))
        }
    };
    if why.is_some() {
        pod.assignment = None;
        pod.bound_ms = pod.scheduled_ms;
    }
    why
}

/// Who holds which resource, from PodResources: (container, kind).
pub type Holds = HashSet<(ContainerRef, Kind)>;

/// The pod and container a GetPreferredAllocation of `size` IDs of `kind` is for (module
/// documentation), or `None` when no pending container matches.
///
/// 1. A container that holds its other resource but not this one is certainly it: the
///    kubelet allocates a container's resources back to back.
/// 2. Else the first container still missing a resource, of the pod bound earliest (the
///    kubelet admits pods in the order they were bound to it), if it asks this many.
pub fn admitting<'a>(
    pods: &'a [PodFacts],
    holds: &Holds,
    kind: Kind,
    size: u64,
) -> Option<(&'a PodFacts, &'a ContainerFacts)> {
    let mut order: Vec<&PodFacts> = pods.iter().filter(|p| !p.finished).collect();
    order.sort_by(|a, b| {
        (a.bound_ms, &a.created, &a.namespace, &a.name).cmp(&(
            b.bound_ms,
            &b.created,
            &b.namespace,
            &b.name,
        ))
    });
    let held =
        |p: &PodFacts, c: &ContainerFacts, k: Kind| holds.contains(&(p.container(&c.name), k));
    let other = match kind {
        Kind::Core => Kind::Memory,
        Kind::Memory => Kind::Core,
    };
    for p in &order {
        for c in &p.containers {
            if c.amount(kind) == size
                && !held(p, c, kind)
                && c.amount(other) > 0
                && held(p, c, other)
            {
                return Some((p, c));
            }
        }
    }
    for p in order {
        // The kubelet allocates a pod's containers in order: its first container still
        // missing a resource is the one being allocated, if it is this pod at all.
        let next = p.containers.iter().find(|c| {
            [Kind::Core, Kind::Memory]
                .iter()
                .any(|&k| c.amount(k) > 0 && !held(p, c, k))
        });
        if let Some(c) = next {
            if c.amount(kind) == size && !held(p, c, kind) {
                return Some((p, c));
            }
        }
    }
    None
}

/// How many device IDs of `kind` an assigned share stands for on its GPU.
fn share_units(s: &GpuShare, kind: Kind) -> u64 {
    match kind {
        Kind::Core => u64::from(s.core_percent.min(CORES_PER_GPU)),
        Kind::Memory => s.memory_bytes / MEMORY_UNIT,
    }
}

/// The GPUs GetPreferredAllocation should answer for `container` of `pod`, with how many IDs
/// of `kind` on each: where the container's other resource already went (`other`: a
/// container's resources stay together whatever was assigned), else the scheduler's decision
/// (`assigned`, see [`effective`]), else an even `gpu-count` split. `None`: choose as
/// without the API server.
pub fn wanted(
    pod: &PodFacts,
    container: &ContainerFacts,
    assigned: Option<&[GpuShare]>,
    kind: Kind,
    node: &Node,
    available: &[DeviceId],
    other: &[String],
) -> Option<Vec<(String, usize)>> {
    let size = container.amount(kind);
    if !other.is_empty() && size.is_multiple_of(other.len() as u64) {
        let each = (size / other.len() as u64) as usize;
        return Some(other.iter().map(|g| (g.clone(), each)).collect());
    }
    if let Some(shares) = assigned {
        // Whole GPUs asked with some vcuda-memory: the assignment's memory is the GPUs'
        // own; any IDs on the first assigned GPU will do.
        if kind == Kind::Memory && shares.iter().all(|s| s.core_percent >= CORES_PER_GPU) {
            return shares
                .first()
                .map(|s| vec![(s.uuid.clone(), size as usize)]);
        }
        return Some(
            shares
                .iter()
                .map(|s| (s.uuid.clone(), share_units(s, kind) as usize))
                .filter(|w| w.1 > 0)
                .collect(),
        );
    }
    let n = *pod.gpu_count.as_ref().ok()?;
    if n > 1 && size.is_multiple_of(u64::from(n)) {
        return split_gpus(
            node,
            available,
            n as usize,
            (size / u64::from(n)) as usize,
            other,
        );
    }
    None
}

/// The scheduler's decision for `container` as it stands now: an exchange this manager has
/// made and not yet published (`overrides`, by pod uid), else the pod's reservation on the
/// Node (which records published exchanges; pods with a [`PodFacts::single`] container only),
/// else the pod's `vcuda.io/assignment`. `Ok(None)`: the pod has no assignment (nothing to
/// follow or agree with).
pub fn effective(
    pod: &PodFacts,
    container: &str,
    reservations: Option<&Reservations>,
    overrides: &BTreeMap<PodUid, Vec<GpuShare>>,
) -> Result<Option<Vec<GpuShare>>, AssignError> {
    let a = match &pod.assignment {
        None => return Ok(None),
        Some(Err(e)) => return Err(e.clone()),
        Some(Ok(a)) => a,
    };
    let Some(shares) = a.containers.get(container) else {
        return Err(AssignError::NoEntry {
            pod: format!("{}/{}", pod.namespace, pod.name),
            container: container.to_string(),
            names: a.containers.keys().cloned().collect(),
        });
    };
    if pod.single() {
        if let Some(o) = overrides.get(&pod.uid) {
            return Ok(Some(o.clone()));
        }
        let reserved = reservations
            .and_then(|r| r.pods.iter().find(|r| pod.uid == r.uid.as_str()))
            .filter(|r| !r.gpus.is_empty());
        if let Some(r) = reserved {
            return Ok(Some(r.gpus.clone()));
        }
    }
    Ok(Some(shares.clone()))
}

/// The scheduler's decision for a container, as PreStartContainer checks the container's
/// devices against it (from [`effective`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Nothing to agree with: no API server or pod to ask, or the pod has no assignment.
    None,
    /// The shares the container's devices must agree with.
    Follow(Vec<GpuShare>),
    /// The pod's assignment cannot be followed (not readable, or no entry for the
    /// container): refused unless the container was configured before.
    Unreadable(AssignError),
    /// The API server could not be asked for the pod ([`AssignError::Unverified`]): a
    /// container configured before (a restart) starts as it was checked then; a new one is
    /// refused until the pod can be read (a partitioned node starts nothing unchecked).
    Unverified(AssignError),
}

impl From<Result<Option<Vec<GpuShare>>, AssignError>> for Decision {
    fn from(effective: Result<Option<Vec<GpuShare>>, AssignError>) -> Self {
        match effective {
            Ok(None) => Decision::None,
            Ok(Some(shares)) => Decision::Follow(shares),
            Err(e) => Decision::Unreadable(e),
        }
    }
}

/// Per GPU: (core %, memory bytes); a whole GPU is (100, 0), its memory being the GPU's.
pub type Shape = BTreeMap<String, (u32, u64)>;

/// The [`Shape`] of assigned shares.
pub fn shape(shares: &[GpuShare]) -> Shape {
    let mut out = Shape::new();
    for s in shares {
        let whole = s.core_percent >= CORES_PER_GPU;
        let e = out.entry(s.uuid.clone()).or_default();
        e.0 += s.core_percent.min(CORES_PER_GPU);
        e.1 += if whole { 0 } else { s.memory_bytes };
    }
    out
}

/// The [`Shape`] of what a container holds: `alloc` (its GPUs and share of each) and its
/// `vcuda-memory` IDs.
pub fn actual_shape(alloc: &Allocation, memory: &[DeviceId]) -> Shape {
    let whole = alloc.percent >= CORES_PER_GPU;
    let mut out = Shape::new();
    for g in &alloc.gpus {
        out.entry(g.clone()).or_default().0 += alloc.percent.min(CORES_PER_GPU);
    }
    if !whole {
        for m in memory {
            out.entry(m.uuid.clone()).or_default().1 += MEMORY_UNIT;
        }
    }
    out
}

fn show(m: &Shape) -> String {
    m.iter()
        .map(|(u, (c, b))| {
            if *c >= CORES_PER_GPU {
                format!("{u} whole")
            } else {
                format!("{u} ({c} %, {} MiB)", b >> 20)
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// PreStartContainer: does what the container holds (`actual`) agree with the scheduler's
/// decision for it (`assigned`, see [`effective`])? Checked before anything else about the
/// devices, so a disagreement is reported as one.
pub fn check_assignment(
    pod: &PodFacts,
    container: &str,
    assigned: &[GpuShare],
    actual: &Shape,
) -> Result<(), AssignError> {
    let assigned = shape(assigned);
    if &assigned == actual {
        return Ok(());
    }
    Err(AssignError::Disagrees {
        pod: format!("{}/{}", pod.namespace, pod.name),
        container: container.to_string(),
        assigned,
        actual: actual.clone(),
    })
}

/// When the kubelet admits identical pods in another order than they were bound, pod `x` may
/// get what was assigned to another: the pending pod whose decision is exactly what `x` holds
/// (`actual`), with the same request, one vcuda container, on GPUs of the same models, and
/// holding no devices yet (earliest bound first). Exchanging their decisions keeps the
/// scheduler's accounting exact: per GPU the same amounts are taken, by the same models, and
/// that pod is then steered to `x`'s assigned GPUs.
pub fn partner<'a>(
    pods: &'a [PodFacts],
    holds: &Holds,
    x: &PodFacts,
    x_assigned: &[GpuShare],
    actual: &Shape,
    effective: &dyn Fn(&PodFacts) -> Option<Vec<GpuShare>>,
    model: &dyn Fn(&str) -> String,
) -> Option<&'a PodFacts> {
    if !x.single() {
        return None;
    }
    let models = |s: &Shape| {
        let mut m: Vec<(String, u32, u64)> =
            s.iter().map(|(u, &(c, b))| (model(u), c, b)).collect();
        m.sort();
        m
    };
    if models(&shape(x_assigned)) != models(actual) {
        return None;
    }
    let mut candidates: Vec<&PodFacts> = pods
        .iter()
        .filter(|y| {
            y.uid != x.uid
                && !y.finished
                && y.single()
                && y.containers[0].core == x.containers[0].core
                && y.containers[0].memory == x.containers[0].memory
                && y.gpu_count == x.gpu_count
                && ![Kind::Core, Kind::Memory]
                    .iter()
                    .any(|&k| holds.contains(&(y.container(&y.containers[0].name), k)))
                && effective(y).is_some_and(|e| &shape(&e) == actual)
        })
        .collect();
    candidates.sort_by_key(|y| (y.bound_ms, y.created.clone()));
    candidates.first().copied()
}

fn link(l: Link) -> vcuda_cluster::Link {
    use vcuda_cluster::Link as C;
    match l {
        Link::NvLink(lanes) => C::NvLink { lanes },
        Link::Switch => C::SamePcieSwitch,
        Link::MultiSwitch => C::MultiplePcieSwitches,
        Link::HostBridge => C::SameHostBridge,
        Link::Node => C::SameNumaNode,
        Link::System => C::System,
    }
}

/// What the manager publishes in `vcuda.io/gpus`: each GPU, its links, health and what its
/// allocations hold (a whole GPU counts 100 % and its memory; an allocation PreStartContainer
/// has not finished counts its share and no memory yet: its pod's reservation still counts
/// the memory until [`retire`] drops it).
pub fn node_inventory(
    inv: &Inventory,
    health: &[bool],
    allocs: &[Allocation],
    pods: &[PodFacts],
) -> NodeInventory {
    let gpus: Vec<GpuInventory> = inv
        .gpus
        .iter()
        .enumerate()
        .map(|(i, g)| {
            let mut allocated = Allocated::default();
            for a in allocs.iter().filter(|a| a.gpus.contains(&g.uuid)) {
                let (c, m) = take(a, g.memory);
                allocated.core_percent += c;
                allocated.memory_bytes += m;
            }
            allocated.core_percent = allocated.core_percent.min(CORES_PER_GPU);
            allocated.memory_bytes = allocated.memory_bytes.min(g.memory);
            GpuInventory {
                index: i as u32,
                uuid: g.uuid.clone(),
                model: inv.models.get(i).cloned().unwrap_or_default(),
                compute_capability: inv.compute.get(i).cloned().unwrap_or_default(),
                memory_bytes: g.memory,
                numa_node: inv
                    .numa
                    .get(i)
                    .copied()
                    .flatten()
                    .and_then(|n| u32::try_from(n).ok()),
                links: (0..inv.gpus.len())
                    .filter(|&j| j != i)
                    .map(|j| PeerLink {
                        peer: j as u32,
                        link: link(inv.node.links[i][j]),
                    })
                    .collect(),
                healthy: health.get(i).copied().unwrap_or(true),
                allocated,
                mode: None,
                slices_held: 0,
            }
        })
        .collect();
    let pods = holdings(inv, allocs, pods);
    NodeInventory {
        schema: SCHEMA,
        gpus,
        pods,
        lease: None,
        modes: None,
    }
}

/// What an allocation takes on one GPU of `memory` bytes: (percent, bytes).
fn take(a: &Allocation, memory: u64) -> (u32, u64) {
    if a.slice {
        // One slice of K on this GPU: 100/K % (its quota is memory / K), whatever its limit.
        let percent = u64::from(CORES_PER_GPU) * a.quota / memory.max(1);
        (percent.min(u64::from(CORES_PER_GPU)) as u32, a.quota)
    } else if a.percent >= CORES_PER_GPU {
        (CORES_PER_GPU, memory)
    } else {
        (a.percent, a.quota)
    }
}

/// Per pod with set-up allocations (an owner): per GPU, the larger of its app containers'
/// sum and any one init container (whose container is an init one is read from `pods`; a
/// pod not listed counts every container as an app container, the larger figure), capped
/// at the whole GPU. The record namespace quotas count (see [`PodHolding`]).
pub fn holdings(inv: &Inventory, allocs: &[Allocation], pods: &[PodFacts]) -> Vec<PodHolding> {
    // pod → GPU index → ((app core, app memory), (init core, init memory))
    type Sums = BTreeMap<usize, ((u32, u64), (u32, u64))>;
    let mut by_pod: BTreeMap<PodRef, (Option<&str>, Sums)> = BTreeMap::new();
    for a in allocs {
        let Some(o) = &a.owner else { continue };
        let facts = pods
            .iter()
            .find(|p| p.namespace == o.namespace && p.name == o.pod);
        let init =
            facts.is_some_and(|p| p.containers.iter().any(|c| c.name == o.container && c.init));
        let uid = facts
            .map(|p| p.uid.as_str())
            .or(o.uid.as_ref().map(PodUid::as_str));
        let entry = by_pod
            .entry(PodRef::new(o.namespace.as_str(), o.pod.as_str()))
            .or_insert_with(|| (uid, Sums::new()));
        for (i, g) in inv.gpus.iter().enumerate() {
            if !a.gpus.contains(&g.uuid) {
                continue;
            }
            let (c, m) = take(a, g.memory);
            let sums = entry.1.entry(i).or_default();
            if init {
                sums.1 .0 = sums.1 .0.max(c);
                sums.1 .1 = sums.1 .1.max(m);
            } else {
                sums.0 .0 = sums.0 .0.saturating_add(c);
                sums.0 .1 = sums.0 .1.saturating_add(m);
            }
        }
    }
    by_pod
        .into_iter()
        .map(|(PodRef { namespace, name }, (uid, sums))| PodHolding {
            namespace,
            name,
            uid: uid.map(str::to_string),
            gpus: sums
                .into_iter()
                .map(|(i, ((ac, am), (ic, im)))| GpuShare {
                    uuid: inv.gpus[i].uuid.clone(),
                    core_percent: ac.max(ic).min(CORES_PER_GPU),
                    memory_bytes: am.max(im).min(inv.gpus[i].memory),
                })
                .collect(),
        })
        .collect()
}

/// After a publish: which exchanges (`overrides`, by pod uid) the manager still keeps. An
/// exchange is kept while its pod is live on this node (`live`), even once the Node's
/// reservation carries it: a reader (GetPreferredAllocation, PreStartContainer) may have
/// read the reservations before the write and look at the overrides after it, and would
/// then follow the pod's decision from before the exchange (and refuse a container, or
/// answer the wrong GPU). Both agree once published, so keeping it is never wrong; it ends
/// with the pod. One made after the publish read them (`published` differs) is kept too.
pub fn keep_overrides(
    overrides: &mut BTreeMap<PodUid, Vec<GpuShare>>,
    published: &BTreeMap<PodUid, Vec<GpuShare>>,
    live: &HashSet<&str>,
) {
    overrides.retain(|uid, o| published.get(uid) != Some(o) || live.contains(uid.as_str()));
}

/// The reservations on the Node that are over (their uids): the pod's every app container is
/// allocated and configured here (the inventory counts it now), the pod has finished, or no
/// pod with that uid is bound here `grace_ms` after the reservation was made (a bind that
/// failed, a pod deleted before it started). `pods` is a fresh list of the node's pods.
pub fn retire(
    res: &Reservations,
    pods: &[PodFacts],
    allocs: &[Allocation],
    now_ms: u64,
    grace_ms: u64,
) -> Vec<String> {
    let owned: HashSet<ContainerRef> = allocs
        .iter()
        .filter_map(|a| a.owner.as_ref())
        .map(|o| o.container_ref())
        .collect();
    let by_uid: BTreeMap<&str, &PodFacts> = pods.iter().map(|p| (p.uid.as_str(), p)).collect();
    res.pods
        .iter()
        .filter(|r| match by_uid.get(r.uid.as_str()) {
            Some(p) => {
                p.finished
                    || p.containers
                        .iter()
                        .filter(|c| c.core > 0 && !c.init)
                        .all(|c| owned.contains(&p.container(&c.name)))
            }
            None => now_ms.saturating_sub(r.created_unix_ms) > grace_ms,
        })
        .map(|r| r.uid.clone())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::allocation::{Gpu, Owner};
    use crate::ids::all_ids;
    use vcuda_cluster::Reservation;

    const A: &str = "GPU-5a1c2e4f-0d3b-4c8a-9e61-7b2f10c3d401";
    const B: &str = "GPU-5a1c2e4f-0d3b-4c8a-9e61-7b2f10c3d402";

    fn pod(name: &str, created: &str, containers: &[(&str, u64, u64)]) -> PodFacts {
        PodFacts {
            namespace: "ns".into(),
            name: name.into(),
            uid: PodUid::new(format!("uid-{name}")),
            created: created.into(),
            bound_ms: 0,
            scheduled_ms: 0,
            finished: false,
            assignment: None,
            gpu_count: Ok(1),
            containers: containers
                .iter()
                .map(|&(n, core, memory)| ContainerFacts {
                    name: n.into(),
                    core,
                    memory,
                    init: false,
                })
                .collect(),
        }
    }

    fn assign(p: &mut PodFacts, container: &str, shares: &[(&str, u32, u64)]) {
        let mut a = Assignment {
            schema: SCHEMA,
            containers: BTreeMap::new(),
            bound_unix_ms: None,
        };
        a.containers.insert(
            container.into(),
            shares
                .iter()
                .map(|&(u, c, gib)| GpuShare {
                    uuid: u.into(),
                    core_percent: c,
                    memory_bytes: gib << 30,
                })
                .collect(),
        );
        p.assignment = Some(Ok(a));
    }

    fn hold(h: &mut Holds, pod: &str, c: &str, k: Kind) {
        h.insert((ContainerRef::new("ns", pod, c), k));
    }

    fn node() -> Node {
        Node {
            uuids: vec![A.into(), B.into()],
            memory: vec![40 << 30; 2],
            links: vec![vec![Link::System; 2]; 2],
        }
    }

    #[test]
    fn a_pod_is_read_for_its_uid_annotations_and_vcuda_requests() {
        let j = serde_json::json!({
            "metadata": {"name": "p", "namespace": "ml", "uid": "u-1",
                "creationTimestamp": "2026-11-22T05:00:00Z",
                "annotations": {
                    "vcuda.io/gpu-count": "2",
                    "vcuda.io/assignment": "{\"schema\":1,\"containers\":{\"main\":[{\"uuid\":\"GPU-a\",\"corePercent\":30,\"memoryBytes\":1073741824}]}}"
                }},
            "spec": {
                "initContainers": [{"name": "warm", "resources": {"limits": {"tencent.com/vcuda-core": "10", "tencent.com/vcuda-memory": "4"}}}],
                "containers": [
                    {"name": "main", "resources": {"limits": {"tencent.com/vcuda-core": "60", "tencent.com/vcuda-memory": "8"}}},
                    {"name": "sidecar", "resources": {"limits": {"cpu": "1"}}}
                ]},
            "status": {"phase": "Pending"}
        });
        let pod: Pod = serde_json::from_value(j).unwrap();
        let f = facts(&pod, "tencent.com");
        assert_eq!((f.uid.as_str(), f.finished), ("u-1", false));
        assert_eq!(f.gpu_count, Ok(2));
        assert_eq!(
            f.containers.len(),
            2,
            "the sidecar asks for nothing of ours"
        );
        assert_eq!(
            (f.containers[0].name.as_str(), f.containers[0].init),
            ("warm", true)
        );
        assert_eq!((f.containers[1].core, f.containers[1].memory), (60, 8));
        let a = f.assignment.unwrap().unwrap();
        assert_eq!(a.containers["main"][0].core_percent, 30);

        let mut bad: Pod = pod.clone();
        let ann = bad.metadata.annotations.as_mut().unwrap();
        ann.insert("vcuda.io/gpu-count".into(), "0".into());
        ann.insert("vcuda.io/assignment".into(), "{".into());
        bad.metadata.deletion_timestamp = pod.metadata.creation_timestamp.clone();
        let f = facts(&bad, "tencent.com");
        let e = f.gpu_count.unwrap_err();
        assert!(
            matches!(&e, AssignError::GpuCount { value, .. } if value == "0"),
            "{e:?}"
        );
        assert!(
            e.to_string().contains("is not a number from 1 to 16"),
            "{e}"
        );
        let e = f.assignment.unwrap().unwrap_err();
        assert!(matches!(e, AssignError::Unreadable { .. }), "{e:?}");
        assert!(
            e.to_string().contains("not readable") && e.to_string().contains("pod "),
            "{e}"
        );
        assert!(f.finished, "being deleted");
    }

    #[test]
    fn the_container_being_admitted_is_the_earliest_pods_next_one() {
        let pods = vec![
            pod("late", "2026-01-01T00:00:02Z", &[("c", 30, 16)]),
            pod(
                "early",
                "2026-01-01T00:00:01Z",
                &[("a", 30, 16), ("b", 50, 8)],
            ),
        ];
        let mut h = Holds::new();
        let (p, c) = admitting(&pods, &h, Kind::Core, 30).unwrap();
        assert_eq!((p.name.as_str(), c.name.as_str()), ("early", "a"));
        // Its core allocated: its memory is next, then its second container.
        hold(&mut h, "early", "a", Kind::Core);
        assert_eq!(admitting(&pods, &h, Kind::Memory, 16).unwrap().1.name, "a");
        hold(&mut h, "early", "a", Kind::Memory);
        assert_eq!(admitting(&pods, &h, Kind::Core, 50).unwrap().1.name, "b");
        // A size that only the later pod asks for: that pod (the earlier is not admitting
        // 30 any more: its next container asks 50).
        assert_eq!(admitting(&pods, &h, Kind::Core, 30).unwrap().0.name, "late");
        hold(&mut h, "early", "b", Kind::Core);
        hold(&mut h, "early", "b", Kind::Memory);
        hold(&mut h, "late", "c", Kind::Core);
        hold(&mut h, "late", "c", Kind::Memory);
        assert_eq!(admitting(&pods, &h, Kind::Core, 30), None);
        let mut done = pods.clone();
        done[0].finished = true;
        done[1].finished = true;
        assert_eq!(admitting(&done, &Holds::new(), Kind::Core, 30), None);
    }

    #[test]
    fn bind_order_decides_and_a_half_allocated_container_comes_first() {
        // Created in the same second; bound y first, then x: the kubelet admits y first.
        let mut x = pod("x", "2026-01-01T00:00:01Z", &[("c", 30, 16)]);
        let mut y = pod("y", "2026-01-01T00:00:01Z", &[("c", 30, 16)]);
        x.bound_ms = 2_000;
        y.bound_ms = 1_000;
        let pods = vec![x, y];
        let mut h = Holds::new();
        assert_eq!(admitting(&pods, &h, Kind::Core, 30).unwrap().0.name, "y");
        // x's core went first (x was admitted first after all): its memory is x's, whatever
        // the order says.
        hold(&mut h, "x", "c", Kind::Core);
        assert_eq!(admitting(&pods, &h, Kind::Memory, 16).unwrap().0.name, "x");
    }

    #[test]
    fn the_assignment_or_an_even_split_is_wanted() {
        let mut p = pod("p", "t", &[("c", 60, 16)]);
        assign(&mut p, "c", &[(B, 60, 4)]);
        let c = p.containers[0].clone();
        let n = node();
        let avail = all_ids(A, Kind::Core, 0);
        let assigned = effective(&p, "c", None, &BTreeMap::new()).unwrap();
        let a = assigned.as_deref();
        assert_eq!(
            wanted(&p, &c, a, Kind::Core, &n, &avail, &[]),
            Some(vec![(B.to_string(), 60)])
        );
        assert_eq!(
            wanted(&p, &c, a, Kind::Memory, &n, &avail, &[]),
            Some(vec![(B.to_string(), 16)])
        );
        // The container's core already went to A: its memory follows it there.
        assert_eq!(
            wanted(&p, &c, a, Kind::Memory, &n, &avail, &[A.into()]),
            Some(vec![(A.to_string(), 16)])
        );
        // No assignment, gpu-count 2: 30 + 30, best fit, or where the memory went.
        let mut q = pod("q", "t", &[("c", 60, 16)]);
        q.gpu_count = Ok(2);
        let qc = q.containers[0].clone();
        let avail: Vec<DeviceId> = all_ids(A, Kind::Core, 0)
            .into_iter()
            .chain(all_ids(B, Kind::Core, 0).into_iter().skip(50))
            .collect();
        let w = wanted(&q, &qc, None, Kind::Core, &n, &avail, &[]).unwrap();
        assert_eq!(w, vec![(B.to_string(), 30), (A.to_string(), 30)]);
        let w = wanted(&q, &qc, None, Kind::Core, &n, &avail, &[A.into(), B.into()]).unwrap();
        assert_eq!(w, vec![(A.to_string(), 30), (B.to_string(), 30)]);
        // No assignment, one GPU: the manager's own choice.
        let r = pod("r", "t", &[("c", 60, 16)]);
        assert_eq!(
            wanted(
                &r,
                &r.containers[0].clone(),
                None,
                Kind::Core,
                &n,
                &avail,
                &[]
            ),
            None
        );
    }

    #[test]
    fn the_decision_is_an_exchange_else_the_reservation_else_the_assignment() {
        let mut p = pod("p", "t", &[("c", 60, 16)]);
        assert_eq!(effective(&p, "c", None, &BTreeMap::new()), Ok(None));
        assign(&mut p, "c", &[(A, 60, 4)]);
        let share = |u: &str| GpuShare {
            uuid: u.into(),
            core_percent: 60,
            memory_bytes: 4 << 30,
        };
        let res = Reservations {
            schema: SCHEMA,
            pods: vec![vcuda_cluster::Reservation {
                namespace: "ns".into(),
                name: "p".into(),
                uid: p.uid.to_string(),
                gpus: vec![share(B)],
                created_unix_ms: 0,
            }],
        };
        let none = BTreeMap::new();
        assert_eq!(effective(&p, "c", None, &none), Ok(Some(vec![share(A)])));
        assert_eq!(
            effective(&p, "c", Some(&res), &none),
            Ok(Some(vec![share(B)]))
        );
        let o = BTreeMap::from([(p.uid.clone(), vec![share(A)])]);
        assert_eq!(effective(&p, "c", Some(&res), &o), Ok(Some(vec![share(A)])));
        let e = effective(&p, "other", None, &none).unwrap_err();
        assert!(
            matches!(&e, AssignError::NoEntry { container, names, .. } if container == "other" && names == &["c"]),
            "{e:?}"
        );
        assert!(e.to_string().contains("no entry for this container"), "{e}");
        // Two vcuda containers: the pod's reservation is a sum, not this container's.
        let mut two = pod("p", "t", &[("c", 60, 16), ("d", 10, 4)]);
        two.assignment = p.assignment.clone();
        assert_eq!(
            effective(&two, "c", Some(&res), &o),
            Ok(Some(vec![share(A)]))
        );
    }

    #[test]
    fn the_decision_to_check_against_is_named() {
        let mut p = pod("p", "t", &[("c", 60, 16)]);
        let none = BTreeMap::new();
        assert_eq!(
            Decision::from(effective(&p, "c", None, &none)),
            Decision::None
        );
        assign(&mut p, "c", &[(A, 60, 4)]);
        let Decision::Follow(shares) = effective(&p, "c", None, &none).into() else {
            panic!("an assignment is followed");
        };
        assert_eq!(shares, effective(&p, "c", None, &none).unwrap().unwrap());
        assert!(matches!(
            effective(&p, "other", None, &none).into(),
            Decision::Unreadable(AssignError::NoEntry { .. })
        ));
    }

    #[test]
    fn identical_pods_admitted_out_of_order_are_exchanged_and_no_other() {
        let mk = |name: &str, bound: u64, gpu: &str| {
            let mut p = pod(name, "t", &[("c", 30, 16)]);
            p.bound_ms = bound;
            assign(&mut p, "c", &[(gpu, 30, 4)]);
            p
        };
        let x = mk("x", 1, A);
        let y = mk("y", 2, B);
        let mut other_size = mk("z", 0, B);
        other_size.containers[0].memory = 8;
        let pods = vec![x.clone(), y.clone(), other_size];
        let eff = |q: &PodFacts| effective(q, "c", None, &BTreeMap::new()).ok().flatten();
        let same_model = |_: &str| "A100".to_string();
        let x_assigned = eff(&x).unwrap();
        let mut actual = Shape::new();
        actual.insert(B.to_string(), (30, 4 << 30));
        let h = Holds::new();
        let got = partner(&pods, &h, &x, &x_assigned, &actual, &eff, &same_model);
        assert_eq!(
            got.map(|p| p.name.as_str()),
            Some("y"),
            "z asks another size"
        );
        // y already holds devices: it is not pending, no exchange.
        let mut held = Holds::new();
        hold(&mut held, "y", "c", Kind::Core);
        assert_eq!(
            partner(&pods, &held, &x, &x_assigned, &actual, &eff, &same_model),
            None
        );
        // Another model: the namespace's quota would count the wrong model.
        let by_gpu = |u: &str| if u == A { "A100" } else { "T4" }.to_string();
        assert_eq!(
            partner(&pods, &h, &x, &x_assigned, &actual, &eff, &by_gpu),
            None
        );
        // Nobody was assigned exactly what x holds.
        actual.insert(B.to_string(), (30, 2 << 30));
        assert_eq!(
            partner(&pods, &h, &x, &x_assigned, &actual, &eff, &same_model),
            None
        );
    }

    #[test]
    fn a_published_exchange_is_followed_by_a_reader_holding_the_reservations_from_before_it() {
        // x was bound to A and y to B; the kubelet admitted y first, so x follows B now.
        let mut x = pod("x", "t", &[("c", 10, 8)]);
        assign(&mut x, "c", &[(A, 10, 2)]);
        let before = Reservations {
            schema: SCHEMA,
            pods: vec![Reservation {
                namespace: "ns".into(),
                name: "x".into(),
                uid: x.uid.as_str().into(),
                created_unix_ms: 0,
                gpus: vec![GpuShare {
                    uuid: A.into(),
                    core_percent: 10,
                    memory_bytes: 2 << 30,
                }],
            }],
        };
        let exchanged = vec![GpuShare {
            uuid: B.into(),
            core_percent: 10,
            memory_bytes: 2 << 30,
        }];
        let mut overrides = BTreeMap::from([(x.uid.clone(), exchanged.clone())]);
        // The publisher wrote the exchange into the reservation; a reader read the Node
        // just before that write.
        let published = overrides.clone();
        let live = HashSet::from([x.uid.as_str()]);
        keep_overrides(&mut overrides, &published, &live);
        assert_eq!(
            effective(&x, "c", Some(&before), &overrides).unwrap(),
            Some(exchanged.clone()),
            "the reader follows the exchange, not the reservation it read before the write"
        );
        // An exchange made after the publisher read the overrides is kept whatever.
        let mut later = BTreeMap::from([(x.uid.clone(), before.pods[0].gpus.clone())]);
        keep_overrides(&mut later, &published, &HashSet::new());
        assert_eq!(later.len(), 1);
        // The pod is gone: its exchange with it.
        keep_overrides(&mut overrides, &published, &HashSet::new());
        assert!(overrides.is_empty());
    }

    fn alloc(gpus: &[&str], percent: u32, quota: u64) -> Allocation {
        Allocation {
            slice: false,
            id: "a1".into(),
            cores: vec![],
            gpus: gpus.iter().map(|g| g.to_string()).collect(),
            percent,
            memory: vec![],
            quota,
            core_limit: None,
            owner: None,
            created: 0,
        }
    }

    #[test]
    fn a_disagreement_with_the_assignment_is_refused_in_words() {
        let mem = |gpus: &[&str], units: usize| -> Vec<DeviceId> {
            gpus.iter()
                .flat_map(|g| all_ids(g, Kind::Memory, 40 << 30).into_iter().take(units))
                .collect()
        };
        let mut p = pod("p", "t", &[("c", 60, 16)]);
        let check = |p: &PodFacts, alloc: &Allocation, memory: &[DeviceId]| {
            let a = effective(p, "c", None, &BTreeMap::new())?.unwrap();
            check_assignment(p, "c", &a, &actual_shape(alloc, memory))
        };
        assign(&mut p, "c", &[(B, 60, 4)]);
        assert_eq!(check(&p, &alloc(&[B], 60, 0), &mem(&[B], 16)), Ok(()));
        let e = check(&p, &alloc(&[A], 60, 0), &mem(&[A], 16)).unwrap_err();
        assert!(matches!(e, AssignError::Disagrees { .. }), "{e:?}");
        let e = e.to_string();
        assert!(
            e.contains(A)
                && e.contains(B)
                && e.contains(ASSIGNMENT_ANNOTATION)
                && e.contains("Delete the pod"),
            "{e}"
        );
        let e = check(&p, &alloc(&[B], 60, 0), &mem(&[B], 8))
            .unwrap_err()
            .to_string();
        assert!(e.contains("4096 MiB") && e.contains("2048 MiB"), "{e}");
        // Memory on the assigned GPU, cores elsewhere: a disagreement, said as one.
        let e = check(&p, &alloc(&[A], 60, 0), &mem(&[B], 16))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(ASSIGNMENT_ANNOTATION) && e.contains(&format!("{A} (60 %, 0 MiB)")),
            "{e}"
        );
        // A split over two GPUs, and whole GPUs (memory not compared).
        assign(&mut p, "c", &[(A, 30, 2), (B, 30, 2)]);
        assert_eq!(check(&p, &alloc(&[B, A], 30, 0), &mem(&[A, B], 8)), Ok(()));
        assign(&mut p, "c", &[(A, 100, 40)]);
        assert_eq!(check(&p, &alloc(&[A], 100, 0), &mem(&[A], 4)), Ok(()));
        let unreadable = AssignError::Unreadable {
            pod: "t/p".into(),
            error: "EOF".into(),
        };
        p.assignment = Some(Err(unreadable.clone()));
        assert_eq!(check(&p, &alloc(&[A], 100, 0), &[]), Err(unreadable));
    }

    /// Two 40 GiB A100s, A and B, on a node without NVLink or NUMA information.
    fn two_a100s() -> Inventory {
        Inventory {
            gpus: vec![
                Gpu {
                    uuid: A.into(),
                    memory: 40 << 30,
                    minor: 0,
                },
                Gpu {
                    uuid: B.into(),
                    memory: 40 << 30,
                    minor: 1,
                },
            ],
            node: node(),
            numa: vec![None, None],
            models: vec!["NVIDIA A100-SXM4-40GB".into(); 2],
            compute: vec!["8.0".into(); 2],
        }
    }

    #[test]
    fn the_inventory_counts_what_allocations_hold() {
        let inv = Inventory {
            node: Node {
                links: vec![vec![Link::NvLink(4); 2]; 2],
                ..node()
            },
            numa: vec![Some(0), None],
            ..two_a100s()
        };
        let allocs = vec![
            alloc(&[A], 30, 4 << 30),
            alloc(&[A], 20, 0), // not configured yet: no memory
            alloc(&[B], 100, 0),
        ];
        let n = node_inventory(&inv, &[true, false], &allocs, &[]);
        assert!(n.pods.is_empty(), "no allocation has an owner yet");
        assert_eq!(
            n.gpus[0].allocated,
            Allocated {
                core_percent: 50,
                memory_bytes: 4 << 30
            }
        );
        assert_eq!(
            n.gpus[1].allocated,
            Allocated {
                core_percent: 100,
                memory_bytes: 40 << 30
            }
        );
        assert_eq!((n.gpus[0].healthy, n.gpus[1].healthy), (true, false));
        assert_eq!(
            n.gpus[0].links,
            vec![PeerLink {
                peer: 1,
                link: vcuda_cluster::Link::NvLink { lanes: 4 }
            }]
        );
        assert_eq!((n.gpus[0].numa_node, n.gpus[1].numa_node), (Some(0), None));
        assert_eq!(n.gpus[1].compute_capability(), (8, 0));
    }

    #[test]
    fn the_inventory_records_what_each_pod_holds_init_containers_at_their_largest() {
        let inv = two_a100s();
        let owned = |gpus: &[&str], percent, quota, pod: &str, container: &str| Allocation {
            owner: Some(Owner {
                namespace: "ns".into(),
                pod: pod.into(),
                container: container.into(),
                uid: None,
            }),
            ..alloc(gpus, percent, quota)
        };
        let mut p = pod("p", "t", &[("init", 40, 8), ("a", 20, 4), ("b", 30, 4)]);
        p.containers[0].init = true;
        let allocs = vec![
            owned(&[A], 40, 8 << 30, "p", "init"),
            owned(&[A], 20, 1 << 30, "p", "a"),
            owned(&[A], 30, 1 << 30, "p", "b"),
            owned(&[B], 100, 0, "q", "c"), // a pod the manager does not list: no uid
            alloc(&[B], 10, 0),            // not set up yet: its reservation counts it
        ];
        let n = node_inventory(&inv, &[true, true], &allocs, &[p]);
        let share = |uuid: &str, core_percent, memory_bytes| GpuShare {
            uuid: uuid.into(),
            core_percent,
            memory_bytes,
        };
        assert_eq!(
            n.pods,
            vec![
                PodHolding {
                    namespace: "ns".into(),
                    name: "p".into(),
                    uid: Some("uid-p".into()),
                    // app 20 + 30 = 50 % beats the init container's 40 %; its 8 GiB beats 2
                    gpus: vec![share(A, 50, 8 << 30)],
                },
                PodHolding {
                    namespace: "ns".into(),
                    name: "q".into(),
                    uid: None,
                    gpus: vec![share(B, 100, 40 << 30)],
                },
            ]
        );
    }

    #[test]
    fn an_assignment_is_followed_only_while_the_schedulers_reservation_vouches_for_it() {
        let share = |uuid: &str, core_percent, gib: u64| GpuShare {
            uuid: uuid.into(),
            core_percent,
            memory_bytes: gib << 30,
        };
        let reserved = |uid: &str, gpus: Vec<GpuShare>| Reservations {
            schema: SCHEMA,
            pods: vec![Reservation {
                namespace: "ns".into(),
                name: "x".into(),
                uid: uid.into(),
                gpus,
                created_unix_ms: 0,
            }],
        };
        // `assign` for one more container
        let add = |p: &mut PodFacts, container: &str, shares: &[(&str, u32, u64)]| {
            let Some(Ok(mut a)) = p.assignment.take() else {
                panic!("assign first")
            };
            assign(p, container, shares);
            let Some(Ok(b)) = p.assignment.take() else {
                unreachable!()
            };
            a.containers.extend(b.containers);
            p.assignment = Some(Ok(a));
        };
        let two = || {
            let mut p = pod("p", "t", &[("a", 30, 8), ("b", 20, 8)]);
            assign(&mut p, "a", &[(A, 30, 2)]);
            add(&mut p, "b", &[(A, 20, 2)]);
            p.bound_ms = 1; // the assignment's boundUnixMs
            p.scheduled_ms = 7;
            p
        };
        // The scheduler's own: reserved 50 % and 4 GiB on A for this uid.
        let mut p = two();
        let ok = reserved("uid-p", vec![share(A, 50, 4)]);
        assert_eq!(vouch(&mut p, Some(&ok)), None);
        assert!(matches!(p.assignment, Some(Ok(_))) && p.bound_ms == 1);
        // Created with spec.nodeName and a forged assignment: no reservation names it.
        for res in [None, Some(reserved("uid-other", vec![share(A, 50, 4)]))] {
            let mut p = two();
            let why = vouch(&mut p, res.as_ref()).expect("refused");
            assert!(
                why.contains("pod ns/p") && why.contains("no vcuda-scheduler reservation"),
                "{why}"
            );
            assert_eq!(
                (p.assignment.is_none(), p.bound_ms),
                (true, 7),
                "its bound time goes too"
            );
        }
        // Edited after the bind: steered to GPU B, or more than reserved on A.
        let mut p = two();
        add(&mut p, "b", &[(B, 20, 2)]);
        let why = vouch(&mut p, Some(&ok)).expect("refused");
        assert!(
            why.contains(B) && why.contains("edited after the bind"),
            "{why}"
        );
        let mut p = two();
        add(&mut p, "b", &[(A, 70, 2)]);
        assert!(vouch(&mut p, Some(&ok)).is_some());
        // One container: the reservation is followed (an exchange rewrites it), not the text.
        let mut p = pod("s", "t", &[("c", 50, 8)]);
        assign(&mut p, "c", &[(B, 50, 2)]);
        assert_eq!(
            vouch(&mut p, Some(&reserved("uid-s", vec![share(A, 50, 2)]))),
            None
        );
        assert_eq!(
            effective(
                &p,
                "c",
                Some(&reserved("uid-s", vec![share(A, 50, 2)])),
                &BTreeMap::new()
            ),
            Ok(Some(vec![share(A, 50, 2)]))
        );
        // No assignment: nothing to say.
        let mut p = pod("n", "t", &[("c", 50, 8)]);
        assert_eq!(vouch(&mut p, None), None);
    }

    #[test]
    fn reservations_end_when_the_pod_is_allocated_finished_or_gone() {
        let r = |name: &str, at: u64| Reservation {
            namespace: "ns".into(),
            name: name.into(),
            uid: format!("uid-{name}"),
            gpus: vec![],
            created_unix_ms: at,
        };
        let res = Reservations {
            schema: SCHEMA,
            pods: vec![
                r("running", 0),
                r("half", 0),
                r("done", 0),
                r("gone", 1_000),
                r("new", 50_000),
            ],
        };
        let mut done = pod("done", "t", &[("c", 10, 4)]);
        done.finished = true;
        let pods = vec![
            pod("running", "t", &[("a", 10, 4), ("b", 10, 4)]),
            pod("half", "t", &[("a", 10, 4), ("b", 10, 4)]),
            done,
        ];
        let owned = |p: &str, c: &str| {
            let mut a = alloc(&[A], 10, 1 << 30);
            a.owner = Some(Owner {
                namespace: "ns".into(),
                pod: p.into(),
                container: c.into(),
                uid: None,
            });
            a
        };
        let allocs = vec![
            owned("running", "a"),
            owned("running", "b"),
            owned("half", "a"),
        ];
        let mut gone = retire(&res, &pods, &allocs, 60_000, 30_000);
        gone.sort();
        assert_eq!(gone, vec!["uid-done", "uid-gone", "uid-running"]);
    }
}
