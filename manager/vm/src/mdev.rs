//! Mediated vGPUs: the types a parent GPU offers, the mdevs that exist, the device IDs
//! advertised per type, and the life cycle of seed 000 as plans over a checkpointed
//! [`Ledger`].
//!
//! **What the kernel offers** (`Documentation/driver-api/vfio-mediated-device.rst`): each
//! parent device has `mdev_supported_types/<type-id>/` (`<type-id>` is the driver's name, a
//! `-`, and the vendor's type name: `nvidia-492`) with `available_instances` and
//! `device_api` (mandatory), `name` and `description` (optional), and a write-only `create`:
//! writing a UUID creates an mdev of that type. Each mdev appears as
//! `/sys/bus/mdev/devices/<uuid>` with an `mdev_type` link and a write-only `remove`: writing
//! `1` destroys it (the vendor driver may refuse while it is in use). An mdev is its own
//! IOMMU group, so a VM opens `/dev/vfio/<its group>`.
//!
//! **Advertising** ([`advertise`]). One resource per type ([`MdevNaming`]). Devices do not
//! exist until created, so a type's devices are its capacity: the IDs of the ledger's
//! records on that parent and type (allocated devices are never withdrawn) plus as many
//! free IDs as `available_instances` says. NVIDIA's driver reports 0 available for every
//! other type once one type has instances on a GPU (seed 000: `vgpu-492: 32`, the rest 0),
//! and the counts follow. IDs are `<parent>-<type-id>-<n>` ([`DeviceId`]): stable while the
//! capacity is, and they say where to create.
//!
//! **The life cycle**, every step a plan of [`Action`]s the manager executes in order:
//! - Allocate of an ID ([`plan_allocate`]) creates a fresh mdev (a new UUID, never reused)
//!   and records it. The kubelet re-uses the IDs of deleted pods without telling the plugin
//!   (the seed's main pain), so an ID may come back while its old mdev still exists: if the
//!   pod that held it is alive, the Allocate is refused ([`MdevError::InUse`]: the kubelet
//!   re-used an ID of a live pod, and that VM keeps its vGPU); otherwise the old mdev is
//!   removed first and a fresh one created.
//! - The pod is learned later ([`Ledger::bind`], from PodResources; the kubelet's Allocate
//!   does not say it). When it is gone, [`plan_cleanup`] removes its mdevs and forgets the
//!   records; a record that never learned its pod (an admission that failed after Allocate)
//!   is forgotten the same way once older than a grace period.
//! - At start, [`plan_orphans`] removes the mdevs of the served types that no record names
//!   (left by a crash between `create` and the checkpoint).
//!
//! Invariants (property-tested against a simulated sysfs below): no ID ever maps to two
//! live mdevs (an old mdev is removed before its ID gets a new one); every `Remove` names an
//! mdev that existed when the plan was made; a refused Allocate plans nothing; no two
//! records name one mdev.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::str::FromStr;

use crate::naming::{MdevNaming, MDEV_RESOURCE_PREFIX};
use crate::pci::{PciAddress, VfioAnswer};

/// The `device_api` of mdevs a VM can use as a PCI device.
pub const VFIO_PCI_API: &str = "vfio-pci";

/// An mdev's UUID in canonical form (`8-4-4-4-12` lower-case hex), as `create` takes it and
/// `/sys/bus/mdev/devices/` names it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MdevUuid(String);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a UUID in the form mdevs are named (8-4-4-4-12 hex digits, e.g. 83b8f4f2-509f-382f-3c1e-e6bfe0fa1001)")]
pub struct UuidError(pub String);

impl FromStr for MdevUuid {
    type Err = UuidError;

    fn from_str(s: &str) -> Result<MdevUuid, UuidError> {
        let ok = s.len() == 36
            && s.char_indices().all(|(i, c)| match i {
                8 | 13 | 18 | 23 => c == '-',
                _ => c.is_ascii_hexdigit(),
            });
        if ok {
            Ok(MdevUuid(s.to_ascii_lowercase()))
        } else {
            Err(UuidError(s.to_string()))
        }
    }
}

impl MdevUuid {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for MdevUuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Where fresh UUIDs come from (random in the manager; counted in tests).
pub trait UuidSource {
    fn next_uuid(&mut self) -> MdevUuid;
}

impl<F: FnMut() -> MdevUuid> UuidSource for F {
    fn next_uuid(&mut self) -> MdevUuid {
        self()
    }
}

/// One `mdev_supported_types/<id>` directory of a parent GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MdevType {
    pub parent: PciAddress,
    /// The directory's name, e.g. `nvidia-222`.
    pub id: String,
    /// `name`, e.g. `GRID T4-1Q` (optional in the kernel's ABI).
    pub name: Option<String>,
    pub available_instances: u32,
    /// `device_api`, e.g. `vfio-pci`.
    pub device_api: String,
    /// `description` (optional), e.g. `num_heads=4, frl_config=60, framebuffer=1024M, …`.
    pub description: Option<String>,
}

/// An existing mdev (`/sys/bus/mdev/devices/<uuid>`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mdev {
    pub uuid: MdevUuid,
    /// The `mdev_type` link's target's name.
    pub type_id: String,
    /// The parent device (the directory the mdev lives in).
    pub parent: PciAddress,
    /// Its own IOMMU group (`/dev/vfio/<n>`), when the kernel gave it one.
    pub iommu_group: Option<u32>,
}

/// The mdev state of the served parents at one moment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MdevSnapshot {
    pub types: Vec<MdevType>,
    pub mdevs: Vec<Mdev>,
}

impl MdevSnapshot {
    fn mdev(&self, uuid: &MdevUuid) -> Option<&Mdev> {
        self.mdevs.iter().find(|m| &m.uuid == uuid)
    }

    fn mdev_type(&self, parent: &PciAddress, type_id: &str) -> Option<&MdevType> {
        self.types
            .iter()
            .find(|t| &t.parent == parent && t.id == type_id)
    }
}

/// An advertised device: instance `index` of type `type_id` on `parent`, written
/// `<parent>-<type_id>-<index>` (`0000:81:00.0-nvidia-492-3`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeviceId {
    pub parent: PciAddress,
    pub type_id: String,
    pub index: u32,
}

impl fmt::Display for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}-{}", self.parent, self.type_id, self.index)
    }
}

impl FromStr for DeviceId {
    type Err = ();

    fn from_str(s: &str) -> Result<DeviceId, ()> {
        let parent: PciAddress = s.get(..12).ok_or(())?.parse().map_err(|_| ())?;
        let rest = s.get(12..).and_then(|r| r.strip_prefix('-')).ok_or(())?;
        let (type_id, n) = rest.rsplit_once('-').ok_or(())?;
        let canonical = n.bytes().all(|b| b.is_ascii_digit()) && (n == "0" || !n.starts_with('0'));
        if type_id.is_empty() || !canonical {
            return Err(());
        }
        Ok(DeviceId {
            parent,
            type_id: type_id.to_string(),
            index: n.parse().map_err(|_| ())?,
        })
    }
}

/// A checkpointed allocation: the mdev an ID was given, the pod (once known), when.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub uuid: MdevUuid,
    /// The pod's UID, learned from PodResources after the Allocate.
    pub pod_uid: Option<String>,
    /// When it was allocated (seconds, the caller's clock).
    pub created: u64,
}

/// The records of the mdevs this backend created, by device ID: what the manager
/// checkpoints, and what every plan is made against.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ledger {
    records: BTreeMap<DeviceId, Record>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LedgerError {
    #[error("no mdev was allocated for device {id}; PodResources lists a device the ledger does not know (a checkpoint lost or older than the kubelet's)")]
    UnknownId { id: String },
    #[error("device {id} is recorded for pod {pod}, and PodResources now lists it for pod {other} without an Allocate in between; the record keeps {pod}")]
    BoundElsewhere {
        id: String,
        pod: String,
        other: String,
    },
    #[error("device {id} and device {other} both name mdev {uuid} in the checkpoint; the checkpoint is damaged: remove it and restart (orphans are then removed)")]
    SharedUuid {
        id: String,
        other: String,
        uuid: MdevUuid,
    },
}

impl Ledger {
    pub fn new() -> Ledger {
        Ledger::default()
    }

    /// A ledger from checkpointed records; refused when two name one mdev.
    pub fn from_records(
        records: impl IntoIterator<Item = (DeviceId, Record)>,
    ) -> Result<Ledger, LedgerError> {
        let mut ledger = Ledger::default();
        let mut by_uuid: BTreeMap<MdevUuid, DeviceId> = BTreeMap::new();
        for (id, r) in records {
            if let Some(other) = by_uuid.insert(r.uuid.clone(), id.clone()) {
                return Err(LedgerError::SharedUuid {
                    id: id.to_string(),
                    other: other.to_string(),
                    uuid: r.uuid,
                });
            }
            ledger.records.insert(id, r);
        }
        Ok(ledger)
    }

    pub fn records(&self) -> impl Iterator<Item = (&DeviceId, &Record)> {
        self.records.iter()
    }

    pub fn get(&self, id: &DeviceId) -> Option<&Record> {
        self.records.get(id)
    }

    pub fn len(&self) -> usize {
        self.records.len()
    }

    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// Learn that `id` belongs to pod `pod_uid` (PodResources lists it there). Binding it
    /// again to the same pod changes nothing.
    pub fn bind(&mut self, id: &DeviceId, pod_uid: &str) -> Result<(), LedgerError> {
        let r = self
            .records
            .get_mut(id)
            .ok_or_else(|| LedgerError::UnknownId { id: id.to_string() })?;
        match &r.pod_uid {
            Some(p) if p != pod_uid => Err(LedgerError::BoundElsewhere {
                id: id.to_string(),
                pod: p.clone(),
                other: pod_uid.to_string(),
            }),
            _ => {
                r.pod_uid = Some(pod_uid.to_string());
                Ok(())
            }
        }
    }

    /// Record an executed Allocate plan (its records replace those of the same IDs).
    pub fn commit(&mut self, plan: &AllocatePlan) {
        for (id, r) in &plan.records {
            self.records.insert(id.clone(), r.clone());
        }
    }

    /// Forget the records an executed cleanup plan dropped.
    pub fn forget(&mut self, plan: &CleanupPlan) {
        for id in &plan.forget {
            self.records.remove(id);
        }
    }
}

/// One sysfs write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Write `uuid` to `<parent>/mdev_supported_types/<type_id>/create`.
    Create {
        parent: PciAddress,
        type_id: String,
        uuid: MdevUuid,
    },
    /// Write `1` to `/sys/bus/mdev/devices/<uuid>/remove`.
    Remove { uuid: MdevUuid },
}

impl Action {
    /// What to write where: the file relative to the sysfs root, and its content.
    pub fn write(&self) -> (String, String) {
        match self {
            Action::Create {
                parent,
                type_id,
                uuid,
            } => (
                format!("bus/pci/devices/{parent}/mdev_supported_types/{type_id}/create"),
                uuid.to_string(),
            ),
            Action::Remove { uuid } => (format!("bus/mdev/devices/{uuid}/remove"), "1".into()),
        }
    }
}

/// A refused mdev Allocate. Refused, nothing is planned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MdevError {
    #[error("the kubelet asked for {id:?}, which is not an advertised vGPU of this node (unknown parent or type, or beyond its capacity now); its view is stale: it refreshes on the next ListAndWatch")]
    UnknownDevice { id: String },
    #[error("the kubelet asked for {id} twice in one request")]
    Duplicate { id: String },
    #[error("device {id} still holds mdev {uuid} of pod {pod}, which is alive: the kubelet re-used a device id of a live pod (its device checkpoint is stale or was lost); refused so that pod keeps its vGPU — the new pod fails admission and its controller retries it")]
    InUse {
        id: String,
        pod: String,
        uuid: MdevUuid,
    },
    #[error("device {id} was given mdev {uuid} {age}s ago, to a pod PodResources does not list yet; refused until it does or {grace}s have passed, so a pod being admitted keeps its vGPU (the kubelet re-used the id of an allocation it just made)")]
    Pending {
        id: String,
        uuid: MdevUuid,
        age: u64,
        grace: u64,
    },
    #[error("type {type_id} on {parent} has {available} instance(s) left and the request needs {asked}; another type may have instances on that GPU (one type per GPU), so the advertised count is stale")]
    NoInstances {
        parent: PciAddress,
        type_id: String,
        available: u32,
        asked: u32,
    },
    #[error("the UUID source gave {uuid}, which already names an mdev or a record; UUIDs must be fresh (random v4)")]
    UuidCollision { uuid: MdevUuid },
    #[error("an Allocate with no devices")]
    Empty,
}

/// The advertised device IDs of every served type, by resource name, in ID order: per
/// (parent, type) with `device_api` `vfio-pci`, the ledger's IDs there plus
/// `available_instances` free ones (the lowest indices no record uses). A type with
/// nothing recorded and nothing available advertises nothing (its resource is absent);
/// types of one name on several GPUs share their resource.
pub fn advertise(
    snapshot: &MdevSnapshot,
    ledger: &Ledger,
    naming: &MdevNaming,
) -> BTreeMap<String, Vec<DeviceId>> {
    let mut out: BTreeMap<String, Vec<DeviceId>> = BTreeMap::new();
    for t in snapshot
        .types
        .iter()
        .filter(|t| t.device_api == VFIO_PCI_API)
    {
        let ids = type_ids(t, ledger);
        if !ids.is_empty() {
            out.entry(naming.resource(&t.id, t.name.as_deref()))
                .or_default()
                .extend(ids);
        }
    }
    for ids in out.values_mut() {
        ids.sort();
    }
    out
}

/// The IDs of one type on one parent (see [`advertise`]).
fn type_ids(t: &MdevType, ledger: &Ledger) -> Vec<DeviceId> {
    let used: BTreeSet<u32> = ledger
        .records
        .keys()
        .filter(|id| id.parent == t.parent && id.type_id == t.id)
        .map(|id| id.index)
        .collect();
    let free = (0u32..)
        .filter(|i| !used.contains(i))
        .take(t.available_instances as usize);
    let mut ids: Vec<u32> = used.iter().copied().chain(free).collect();
    ids.sort_unstable();
    ids.into_iter()
        .map(|index| DeviceId {
            parent: t.parent.clone(),
            type_id: t.id.clone(),
            index,
        })
        .collect()
}

/// What the plans know of pods and time.
#[derive(Debug, Clone, Copy)]
pub struct Liveness<'a> {
    /// The UIDs of the pods known to exist (API server, else PodResources).
    pub live: &'a BTreeSet<String>,
    /// Now, seconds, the clock of [`Record::created`].
    pub now: u64,
    /// How long a record may wait to learn its pod before it counts as abandoned.
    pub grace: u64,
}

impl Liveness<'_> {
    /// Whether record `r` may still belong to a pod: its pod is alive, or it has not
    /// learned its pod and is younger than the grace period.
    fn holds(&self, r: &Record) -> bool {
        match &r.pod_uid {
            Some(pod) => self.live.contains(pod),
            None => self.now.saturating_sub(r.created) < self.grace,
        }
    }
}

/// An Allocate's plan: the writes, in order (each old mdev removed before anything is
/// created), and the records to commit once they succeeded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllocatePlan {
    pub actions: Vec<Action>,
    /// The new records, in request order (their UUIDs are the answer's, in that order).
    pub records: Vec<(DeviceId, Record)>,
}

impl AllocatePlan {
    /// The UUIDs to answer with, in request order.
    pub fn uuids(&self) -> Vec<&MdevUuid> {
        self.records.iter().map(|(_, r)| &r.uuid).collect()
    }

    /// Undo a partly executed plan: remove what it created (the caller skips those that
    /// do not exist). Removed old mdevs stay removed: their pods were gone.
    pub fn rollback(&self) -> Vec<Action> {
        self.actions
            .iter()
            .filter_map(|a| match a {
                Action::Create { uuid, .. } => Some(Action::Remove { uuid: uuid.clone() }),
                Action::Remove { .. } => None,
            })
            .collect()
    }
}

/// Plan the Allocate of device IDs `ids` (see the module documentation); `pods.now` stamps
/// the new records. An ID whose record may still belong to a pod ([`MdevError::InUse`],
/// [`MdevError::Pending`]) is refused while its mdev exists; otherwise its old mdev is
/// removed before the fresh one is created.
pub fn plan_allocate(
    ledger: &Ledger,
    snapshot: &MdevSnapshot,
    ids: &[&str],
    pods: Liveness<'_>,
    uuids: &mut dyn UuidSource,
) -> Result<AllocatePlan, MdevError> {
    if ids.is_empty() {
        return Err(MdevError::Empty);
    }
    let mut asked: Vec<(DeviceId, &MdevType)> = Vec::with_capacity(ids.len());
    for raw in ids {
        let unknown = || MdevError::UnknownDevice {
            id: raw.to_string(),
        };
        let id: DeviceId = raw.parse().map_err(|_| unknown())?;
        let t = snapshot
            .mdev_type(&id.parent, &id.type_id)
            .filter(|t| t.device_api == VFIO_PCI_API && type_ids(t, ledger).contains(&id))
            .ok_or_else(unknown)?;
        if asked.iter().any(|(a, _)| a == &id) {
            return Err(MdevError::Duplicate { id: id.to_string() });
        }
        asked.push((id, t));
    }

    let mut removes = Vec::new();
    // per (parent, type): instances created, and instances freed by the removes
    let mut need: BTreeMap<(&PciAddress, &str), (u32, u32, u32)> = BTreeMap::new();
    for (id, t) in &asked {
        let e = need
            .entry((&t.parent, t.id.as_str()))
            .or_insert((0, 0, t.available_instances));
        e.0 += 1;
        let Some(old) = ledger.get(id) else { continue };
        let Some(m) = snapshot.mdev(&old.uuid) else {
            continue; // nothing left to take from anyone
        };
        if pods.holds(old) {
            return Err(match &old.pod_uid {
                Some(pod) => MdevError::InUse {
                    id: id.to_string(),
                    pod: pod.clone(),
                    uuid: old.uuid.clone(),
                },
                None => MdevError::Pending {
                    id: id.to_string(),
                    uuid: old.uuid.clone(),
                    age: pods.now.saturating_sub(old.created),
                    grace: pods.grace,
                },
            });
        }
        {
            if m.parent == t.parent && m.type_id == t.id {
                e.1 += 1;
            }
            removes.push(Action::Remove {
                uuid: old.uuid.clone(),
            });
        }
    }
    for ((parent, type_id), (asked, freed, available)) in &need {
        if *asked > available + freed {
            return Err(MdevError::NoInstances {
                parent: (*parent).clone(),
                type_id: type_id.to_string(),
                available: *available,
                asked: *asked,
            });
        }
    }

    let mut taken: BTreeSet<MdevUuid> = snapshot.mdevs.iter().map(|m| m.uuid.clone()).collect();
    taken.extend(ledger.records.values().map(|r| r.uuid.clone()));
    let mut creates = Vec::with_capacity(asked.len());
    let mut records = Vec::with_capacity(asked.len());
    for (id, _) in asked {
        let uuid = uuids.next_uuid();
        if !taken.insert(uuid.clone()) {
            return Err(MdevError::UuidCollision { uuid });
        }
        creates.push(Action::Create {
            parent: id.parent.clone(),
            type_id: id.type_id.clone(),
            uuid: uuid.clone(),
        });
        records.push((
            id,
            Record {
                uuid,
                pod_uid: None,
                created: pods.now,
            },
        ));
    }
    removes.extend(creates);
    Ok(AllocatePlan {
        actions: removes,
        records,
    })
}

/// The Allocate answer once the plan ran: `/dev/vfio/vfio` and each new mdev's group node,
/// and `MDEV_PCI_RESOURCE_<NAME>=<uuid>[,<uuid>…]` in request order. `created` pairs each
/// UUID with the IOMMU group the kernel gave its mdev.
pub fn answer(resource: &str, created: &[(MdevUuid, u32)]) -> VfioAnswer {
    let values: Vec<&str> = created.iter().map(|(u, _)| u.as_str()).collect();
    VfioAnswer::new(
        MDEV_RESOURCE_PREFIX,
        resource,
        &values,
        created.iter().map(|(_, g)| *g),
    )
}

/// A cleanup's plan: mdevs to remove, and records to forget once removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CleanupPlan {
    pub actions: Vec<Action>,
    pub forget: Vec<DeviceId>,
}

/// Remove the mdevs of gone pods: a record whose pod is not alive, or that never learned
/// its pod within the grace period, is forgotten, its mdev (if it still exists) removed
/// first. Records of live pods stay, even if their mdev vanished (the pod still holds the
/// ID).
pub fn plan_cleanup(ledger: &Ledger, snapshot: &MdevSnapshot, pods: Liveness<'_>) -> CleanupPlan {
    let mut plan = CleanupPlan::default();
    for (id, r) in &ledger.records {
        if !pods.holds(r) {
            if snapshot.mdev(&r.uuid).is_some() {
                plan.actions.push(Action::Remove {
                    uuid: r.uuid.clone(),
                });
            }
            plan.forget.push(id.clone());
        }
    }
    plan
}

/// At start: remove the mdevs of the served types (those of `snapshot.types`) that no
/// record names — left by a crash between `create` and the checkpoint. Mdevs of other
/// parents or types are not ours and stay.
pub fn plan_orphans(ledger: &Ledger, snapshot: &MdevSnapshot) -> Vec<Action> {
    let recorded: BTreeSet<&MdevUuid> = ledger.records.values().map(|r| &r.uuid).collect();
    snapshot
        .mdevs
        .iter()
        .filter(|m| snapshot.mdev_type(&m.parent, &m.type_id).is_some())
        .filter(|m| !recorded.contains(&m.uuid))
        .map(|m| Action::Remove {
            uuid: m.uuid.clone(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pci::tests::addr;

    const GPU: &str = "0000:81:00.0";
    const GPU2: &str = "0000:c1:00.0";

    fn uuid(n: u32) -> MdevUuid {
        format!("00000000-0000-4000-8000-{n:012x}").parse().unwrap()
    }

    fn counter(start: u32) -> impl FnMut() -> MdevUuid {
        let mut n = start;
        move || {
            n += 1;
            uuid(n)
        }
    }

    fn ty(parent: &str, id: &str, available: u32) -> MdevType {
        MdevType {
            parent: addr(parent),
            id: id.into(),
            name: Some("GRID T4-1Q".into()),
            available_instances: available,
            device_api: VFIO_PCI_API.into(),
            description: None,
        }
    }

    fn did(s: &str) -> DeviceId {
        s.parse().unwrap()
    }

    fn tencent() -> MdevNaming {
        MdevNaming::Vgpu {
            domain: "tencent.com".into(),
        }
    }

    fn at(live: &BTreeSet<String>, now: u64) -> Liveness<'_> {
        Liveness {
            live,
            now,
            grace: 60,
        }
    }

    fn live(pods: &[&str]) -> BTreeSet<String> {
        pods.iter().map(|p| p.to_string()).collect()
    }

    /// Seed 000's GPU: six types; before any instance each offers 1 (as its Capacity shows).
    fn seed_types(available: [u32; 6]) -> Vec<MdevType> {
        ["277", "278", "279", "490", "491", "492"]
            .iter()
            .zip(available)
            .map(|(n, a)| ty(GPU, &format!("nvidia-{n}"), a))
            .collect()
    }

    #[test]
    fn uuids_and_ids_parse() {
        let u: MdevUuid = "83B8F4F2-509F-382F-3C1E-E6BFE0FA1001".parse().unwrap();
        assert_eq!(u.as_str(), "83b8f4f2-509f-382f-3c1e-e6bfe0fa1001");
        for bad in [
            "83b8f4f2509f382f3c1ee6bfe0fa1001",
            "83b8f4f2-509f-382f-3c1e-e6bfe0fa100g",
            "",
        ] {
            assert!(bad.parse::<MdevUuid>().is_err(), "{bad}");
        }
        let id = did("0000:81:00.0-nvidia-492-3");
        assert_eq!(id.parent, addr(GPU));
        assert_eq!(id.type_id, "nvidia-492");
        assert_eq!(id.index, 3);
        assert_eq!(id.to_string(), "0000:81:00.0-nvidia-492-3");
        for bad in [
            "0000:81:00.0-nvidia-492-03",
            "0000:81:00.0-nvidia-492-",
            "0000:81:00.0-7",
            "0000:81:00.0nvidia-492-1",
            "81:00.0-nvidia-492-1",
            "GPU-1",
        ] {
            assert!(bad.parse::<DeviceId>().is_err(), "{bad}");
        }
    }

    #[test]
    fn the_seeds_capacities() {
        let ledger = Ledger::new();
        let before = MdevSnapshot {
            types: seed_types([1; 6]),
            mdevs: vec![],
        };
        let ads = advertise(&before, &ledger, &tencent());
        let counts: Vec<_> = ads.iter().map(|(r, ids)| (r.as_str(), ids.len())).collect();
        assert_eq!(
            counts,
            [
                ("tencent.com/vgpu-277", 1),
                ("tencent.com/vgpu-278", 1),
                ("tencent.com/vgpu-279", 1),
                ("tencent.com/vgpu-490", 1),
                ("tencent.com/vgpu-491", 1),
                ("tencent.com/vgpu-492", 1),
            ]
        );
        assert_eq!(
            ads["tencent.com/vgpu-492"],
            [did("0000:81:00.0-nvidia-492-0")]
        );

        // after: vgpu-492 instances exist, the driver reports 0 for the others
        let mut ledger = Ledger::new();
        let plan = plan_allocate(
            &ledger,
            &MdevSnapshot {
                types: seed_types([0, 0, 0, 0, 0, 32]),
                mdevs: vec![],
            },
            &["0000:81:00.0-nvidia-492-5"],
            at(&live(&[]), 100),
            &mut counter(0),
        )
        .unwrap();
        ledger.commit(&plan);
        let after = MdevSnapshot {
            types: seed_types([0, 0, 0, 0, 0, 31]),
            mdevs: vec![Mdev {
                uuid: uuid(1),
                type_id: "nvidia-492".into(),
                parent: addr(GPU),
                iommu_group: Some(200),
            }],
        };
        let ads = advertise(&after, &ledger, &tencent());
        assert_eq!(ads.len(), 1, "{ads:?}");
        let ids = &ads["tencent.com/vgpu-492"];
        assert_eq!(ids.len(), 32);
        // the allocated ID stays, the free ones fill the lowest other indices
        assert!(ids.contains(&did("0000:81:00.0-nvidia-492-5")));
        assert_eq!(ids.last(), Some(&did("0000:81:00.0-nvidia-492-31")));
    }

    #[test]
    fn kubevirt_naming_merges_gpus_and_skips_other_apis() {
        let mut other = ty(GPU2, "nvidia-222", 2);
        other.name = Some("GRID T4-1Q".into());
        let mut ccw = ty(GPU2, "vfio_ccw-io", 5);
        ccw.device_api = "vfio-ccw".into();
        let snap = MdevSnapshot {
            types: vec![ty(GPU, "nvidia-222", 1), other, ccw],
            mdevs: vec![],
        };
        let ads = advertise(&snap, &Ledger::new(), &MdevNaming::KubeVirt);
        assert_eq!(ads.len(), 1);
        assert_eq!(
            ads["nvidia.com/GRID_T4-1Q"],
            [
                did("0000:81:00.0-nvidia-222-0"),
                did("0000:c1:00.0-nvidia-222-0"),
                did("0000:c1:00.0-nvidia-222-1"),
            ]
        );
    }

    #[test]
    fn allocate_creates_fresh_mdevs_and_answers() {
        let snap = MdevSnapshot {
            types: vec![ty(GPU, "nvidia-222", 4), ty(GPU2, "nvidia-222", 4)],
            mdevs: vec![],
        };
        let plan = plan_allocate(
            &Ledger::new(),
            &snap,
            &["0000:c1:00.0-nvidia-222-1", "0000:81:00.0-nvidia-222-0"],
            at(&live(&[]), 7),
            &mut counter(0),
        )
        .unwrap();
        assert_eq!(
            plan.actions,
            [
                Action::Create {
                    parent: addr(GPU2),
                    type_id: "nvidia-222".into(),
                    uuid: uuid(1)
                },
                Action::Create {
                    parent: addr(GPU),
                    type_id: "nvidia-222".into(),
                    uuid: uuid(2)
                },
            ]
        );
        assert_eq!(
            plan.actions[0].write(),
            (
                "bus/pci/devices/0000:c1:00.0/mdev_supported_types/nvidia-222/create".to_string(),
                uuid(1).to_string()
            )
        );
        assert_eq!(plan.uuids(), [&uuid(1), &uuid(2)]);
        assert_eq!(plan.records[0].1.created, 7);
        assert_eq!(plan.records[0].1.pod_uid, None);
        assert_eq!(plan.rollback().len(), 2);

        let a = answer("nvidia.com/GRID_T4-1Q", &[(uuid(1), 301), (uuid(2), 300)]);
        assert_eq!(
            a.device_nodes,
            ["/dev/vfio/vfio", "/dev/vfio/301", "/dev/vfio/300"]
        );
        assert_eq!(a.env.0, "MDEV_PCI_RESOURCE_NVIDIA_COM_GRID_T4-1Q");
        assert_eq!(a.env.1, format!("{},{}", uuid(1), uuid(2)));
    }

    /// A ledger with device 0000:81:00.0-nvidia-222-0 → uuid(1) of pod `p1`, its mdev alive.
    fn held() -> (Ledger, MdevSnapshot, DeviceId) {
        let id = did("0000:81:00.0-nvidia-222-0");
        let ledger = Ledger::from_records([(
            id.clone(),
            Record {
                uuid: uuid(1),
                pod_uid: Some("p1".into()),
                created: 1,
            },
        )])
        .unwrap();
        let snap = MdevSnapshot {
            types: vec![ty(GPU, "nvidia-222", 3)],
            mdevs: vec![Mdev {
                uuid: uuid(1),
                type_id: "nvidia-222".into(),
                parent: addr(GPU),
                iommu_group: Some(300),
            }],
        };
        (ledger, snap, id)
    }

    #[test]
    fn reuse_of_a_live_pods_id_is_refused() {
        let (ledger, snap, id) = held();
        let e = plan_allocate(
            &ledger,
            &snap,
            &[&id.to_string()],
            at(&live(&["p1"]), 9),
            &mut counter(10),
        )
        .unwrap_err();
        assert_eq!(
            e,
            MdevError::InUse {
                id: id.to_string(),
                pod: "p1".into(),
                uuid: uuid(1)
            }
        );
        let msg = e.to_string();
        assert!(msg.contains("pod p1") && msg.contains("re-used"), "{msg}");
    }

    #[test]
    fn reuse_of_a_gone_pods_id_gets_a_fresh_mdev() {
        let (ledger, snap, id) = held();
        let plan = plan_allocate(
            &ledger,
            &snap,
            &[&id.to_string()],
            at(&live(&["p2"]), 9),
            &mut counter(10),
        )
        .unwrap();
        assert_eq!(
            plan.actions,
            [
                Action::Remove { uuid: uuid(1) },
                Action::Create {
                    parent: addr(GPU),
                    type_id: "nvidia-222".into(),
                    uuid: uuid(11)
                }
            ]
        );
        assert_eq!(
            plan.actions[0].write(),
            (
                format!("bus/mdev/devices/{}/remove", uuid(1)),
                "1".to_string()
            )
        );
        let mut ledger = ledger;
        ledger.commit(&plan);
        assert_eq!(ledger.get(&id).unwrap().uuid, uuid(11));
        assert_eq!(ledger.get(&id).unwrap().pod_uid, None);
        // the old mdev already gone: only a create
        let gone = MdevSnapshot {
            mdevs: vec![],
            ..snap
        };
        let (ledger, _, _) = held();
        let plan = plan_allocate(
            &ledger,
            &gone,
            &[&id.to_string()],
            at(&live(&[]), 9),
            &mut counter(10),
        )
        .unwrap();
        assert_eq!(plan.actions.len(), 1);
        assert_eq!(plan.rollback(), [Action::Remove { uuid: uuid(11) }]);
    }

    #[test]
    fn an_unbound_record_waits_for_the_grace_period() {
        // allocated at 1, pod not learned yet: maybe a pod being admitted, maybe an
        // admission that failed after the Allocate
        let (mut ledger, snap, id) = held();
        ledger.records.get_mut(&id).unwrap().pod_uid = None;
        let ask = [id.to_string()];
        let ask: Vec<&str> = ask.iter().map(String::as_str).collect();
        let e =
            plan_allocate(&ledger, &snap, &ask, at(&live(&[]), 60), &mut counter(20)).unwrap_err();
        assert_eq!(
            e,
            MdevError::Pending {
                id: id.to_string(),
                uuid: uuid(1),
                age: 59,
                grace: 60
            }
        );
        assert!(e.to_string().contains("PodResources"), "{e}");
        let plan =
            plan_allocate(&ledger, &snap, &ask, at(&live(&[]), 61), &mut counter(20)).unwrap();
        assert_eq!(plan.actions[0], Action::Remove { uuid: uuid(1) });
        // its mdev gone: nothing to protect, replaced at once
        let empty = MdevSnapshot {
            mdevs: vec![],
            ..snap
        };
        let plan = plan_allocate(
            &ledger,
            &empty,
            &ask,
            at(&live(&["p1"]), 2),
            &mut counter(20),
        )
        .unwrap();
        assert_eq!(plan.actions.len(), 1);
    }

    #[test]
    fn refusals_plan_nothing() {
        let (ledger, snap, _) = held();
        let mut calls = 0;
        let mut src = || {
            calls += 1;
            uuid(50 + calls)
        };
        for id in [
            "0000:81:00.0-nvidia-223-0",
            "0000:82:00.0-nvidia-222-0",
            "0000:81:00.0-nvidia-222-4",
            "GPU-0",
        ] {
            assert_eq!(
                plan_allocate(&ledger, &snap, &[id], at(&live(&[]), 0), &mut src),
                Err(MdevError::UnknownDevice { id: id.into() })
            );
        }
        assert_eq!(
            plan_allocate(
                &ledger,
                &snap,
                &["0000:81:00.0-nvidia-222-1", "0000:81:00.0-nvidia-222-1"],
                at(&live(&[]), 0),
                &mut src
            ),
            Err(MdevError::Duplicate {
                id: "0000:81:00.0-nvidia-222-1".into()
            })
        );
        assert_eq!(
            plan_allocate(&ledger, &snap, &[], at(&live(&[]), 0), &mut src),
            Err(MdevError::Empty)
        );
        assert_eq!(calls, 0);
    }

    #[test]
    fn no_instances_left() {
        // advertised from a stale view: 2 free IDs, but the driver now says 1
        let ledger = Ledger::new();
        let snap = MdevSnapshot {
            types: vec![ty(GPU, "nvidia-222", 2)],
            mdevs: vec![],
        };
        let ids = ["0000:81:00.0-nvidia-222-0", "0000:81:00.0-nvidia-222-1"];
        assert!(plan_allocate(&ledger, &snap, &ids, at(&live(&[]), 0), &mut counter(0)).is_ok());
        let mut fewer = snap.clone();
        fewer.types[0].available_instances = 1;
        // index 1 is no longer advertised
        assert!(matches!(
            plan_allocate(&ledger, &fewer, &ids, at(&live(&[]), 0), &mut counter(0)),
            Err(MdevError::UnknownDevice { .. })
        ));
        // a recorded ID of a gone pod, its mdev alive, and one free ID, with 0 available:
        // the remove frees one instance, not two
        let (ledger, mut snap, id) = held();
        snap.types[0].available_instances = 0;
        let e = plan_allocate(
            &ledger,
            &snap,
            &[&id.to_string()],
            at(&live(&[]), 0),
            &mut counter(10),
        );
        assert!(e.is_ok(), "{e:?}");
        snap.types[0].available_instances = 0;
        let mut l2 = ledger.clone();
        l2.records.insert(
            did("0000:81:00.0-nvidia-222-1"),
            Record {
                uuid: uuid(2),
                pod_uid: None,
                created: 0,
            },
        );
        // record 1's mdev does not exist: it frees nothing
        let e = plan_allocate(
            &l2,
            &snap,
            &[&id.to_string(), "0000:81:00.0-nvidia-222-1"],
            at(&live(&[]), 0),
            &mut counter(0),
        )
        .unwrap_err();
        assert_eq!(
            e,
            MdevError::NoInstances {
                parent: addr(GPU),
                type_id: "nvidia-222".into(),
                available: 0,
                asked: 2
            }
        );
        assert!(e.to_string().contains("one type per GPU"), "{e}");
    }

    #[test]
    fn uuid_collisions_are_refused() {
        let (ledger, snap, _) = held();
        let e = plan_allocate(
            &ledger,
            &snap,
            &["0000:81:00.0-nvidia-222-1"],
            at(&live(&[]), 0),
            &mut || uuid(1),
        )
        .unwrap_err();
        assert_eq!(e, MdevError::UuidCollision { uuid: uuid(1) });
        let e = plan_allocate(
            &Ledger::new(),
            &MdevSnapshot {
                types: vec![ty(GPU, "nvidia-222", 2)],
                mdevs: vec![],
            },
            &["0000:81:00.0-nvidia-222-0", "0000:81:00.0-nvidia-222-1"],
            at(&live(&[]), 0),
            &mut || uuid(5),
        )
        .unwrap_err();
        assert_eq!(e, MdevError::UuidCollision { uuid: uuid(5) });
    }

    #[test]
    fn binding_pods() {
        let (mut ledger, _, id) = held();
        assert_eq!(ledger.bind(&id, "p1"), Ok(()));
        assert!(matches!(
            ledger.bind(&id, "p2"),
            Err(LedgerError::BoundElsewhere { .. })
        ));
        ledger.records.get_mut(&id).unwrap().pod_uid = None;
        assert_eq!(ledger.bind(&id, "p2"), Ok(()));
        assert_eq!(ledger.get(&id).unwrap().pod_uid.as_deref(), Some("p2"));
        assert!(matches!(
            ledger.bind(&did("0000:81:00.0-nvidia-222-9"), "p2"),
            Err(LedgerError::UnknownId { .. })
        ));
        let r = Record {
            uuid: uuid(1),
            pod_uid: None,
            created: 0,
        };
        assert!(matches!(
            Ledger::from_records([
                (did("0000:81:00.0-nvidia-222-0"), r.clone()),
                (did("0000:81:00.0-nvidia-222-1"), r)
            ]),
            Err(LedgerError::SharedUuid { .. })
        ));
    }

    #[test]
    fn cleanup_of_gone_pods_and_abandoned_records() {
        let (mut ledger, snap, id) = held();
        // p1 alive: nothing
        assert_eq!(
            plan_cleanup(&ledger, &snap, at(&live(&["p1"]), 100)),
            CleanupPlan::default()
        );
        // p1 gone: remove its mdev, forget it
        let plan = plan_cleanup(&ledger, &snap, at(&live(&[]), 100));
        assert_eq!(plan.actions, [Action::Remove { uuid: uuid(1) }]);
        assert_eq!(plan.forget, std::slice::from_ref(&id));
        // pod never learned: kept within the grace period, then removed
        ledger.records.get_mut(&id).unwrap().pod_uid = None;
        assert_eq!(
            plan_cleanup(&ledger, &snap, at(&live(&[]), 60)),
            CleanupPlan::default()
        );
        let plan = plan_cleanup(&ledger, &snap, at(&live(&[]), 61));
        assert_eq!(plan.forget, std::slice::from_ref(&id));
        // mdev already gone: forget without a remove
        let empty = MdevSnapshot {
            mdevs: vec![],
            ..snap.clone()
        };
        let plan = plan_cleanup(&ledger, &empty, at(&live(&[]), 61));
        assert!(plan.actions.is_empty());
        ledger.forget(&plan);
        assert!(ledger.is_empty());
    }

    #[test]
    fn orphans_at_start() {
        let (ledger, mut snap, _) = held();
        let orphan = Mdev {
            uuid: uuid(2),
            type_id: "nvidia-222".into(),
            parent: addr(GPU),
            iommu_group: Some(301),
        };
        // someone else's: another parent, and a type we do not serve
        let foreign = Mdev {
            uuid: uuid(3),
            type_id: "i915-GVTg_V5_4".into(),
            parent: addr("0000:00:02.0"),
            iommu_group: Some(5),
        };
        snap.mdevs.push(orphan);
        snap.mdevs.push(foreign);
        assert_eq!(
            plan_orphans(&ledger, &snap),
            [Action::Remove { uuid: uuid(2) }]
        );
        assert_eq!(plan_orphans(&ledger, &MdevSnapshot::default()), []);
    }

    /// A simulated mdev-capable sysfs: two GPUs with types A (4 instances) and B (2), one
    /// type per GPU at a time, as NVIDIA's driver behaves.
    #[derive(Debug, Clone, Default)]
    struct Sim {
        mdevs: BTreeMap<MdevUuid, (PciAddress, String)>,
    }

    const TYPES: [(&str, u32); 2] = [("nvidia-1", 4), ("nvidia-2", 2)];
    const GPUS: [&str; 2] = [GPU, GPU2];

    impl Sim {
        fn available(&self, parent: &PciAddress, type_id: &str, cap: u32) -> u32 {
            let on: Vec<&String> = self
                .mdevs
                .values()
                .filter(|(p, _)| p == parent)
                .map(|(_, t)| t)
                .collect();
            if on.iter().any(|t| *t != type_id) {
                0
            } else {
                cap - on.len() as u32
            }
        }

        fn snapshot(&self) -> MdevSnapshot {
            let mut types = Vec::new();
            for g in GPUS {
                for (t, cap) in TYPES {
                    types.push(MdevType {
                        available_instances: self.available(&addr(g), t, cap),
                        ..ty(g, t, 0)
                    });
                }
            }
            let mdevs = self
                .mdevs
                .iter()
                .enumerate()
                .map(|(i, (u, (p, t)))| Mdev {
                    uuid: u.clone(),
                    type_id: t.clone(),
                    parent: p.clone(),
                    iommu_group: Some(100 + i as u32),
                })
                .collect();
            MdevSnapshot { types, mdevs }
        }

        /// Run one action as the kernel would; Err if the kernel would refuse it.
        fn run(&mut self, a: &Action) -> Result<(), String> {
            match a {
                Action::Create {
                    parent,
                    type_id,
                    uuid,
                } => {
                    let cap = TYPES.iter().find(|(t, _)| t == type_id).unwrap().1;
                    if self.mdevs.contains_key(uuid) {
                        return Err(format!("create {uuid}: EEXIST"));
                    }
                    if self.available(parent, type_id, cap) == 0 {
                        return Err(format!("create {type_id} on {parent}: no instances"));
                    }
                    self.mdevs
                        .insert(uuid.clone(), (parent.clone(), type_id.clone()));
                }
                Action::Remove { uuid } => {
                    if self.mdevs.remove(uuid).is_none() {
                        return Err(format!("remove {uuid}: ENOENT"));
                    }
                }
            }
            Ok(())
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        /// The kubelet allocates IDs of type `r` (by index into its list) for a new pod;
        /// `buggy`: it may pick IDs it still assigns to live pods; not `admitted`: the pod
        /// fails admission after the Allocate (never runs, never listed).
        Allocate {
            r: usize,
            picks: Vec<usize>,
            buggy: bool,
            admitted: bool,
        },
        /// PodResources shows the pods of the last allocations.
        Bind,
        /// A pod is deleted.
        Delete(usize),
        /// The cleanup round (PodResources first, as the manager does).
        Cleanup,
        /// The manager crashes after a create, before the checkpoint, and restarts.
        CrashAndRestart { r: usize, pick: usize },
        /// Time passes.
        Tick(u64),
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        prop_oneof![
            4 => (
                0..4usize,
                proptest::collection::vec(0..8usize, 1..3),
                proptest::bool::weighted(0.2),
                proptest::bool::weighted(0.85),
            )
                .prop_map(|(r, picks, buggy, admitted)| Op::Allocate { r, picks, buggy, admitted }),
            2 => Just(Op::Bind),
            2 => (0..8usize).prop_map(Op::Delete),
            2 => Just(Op::Cleanup),
            1 => (0..4usize, 0..8usize).prop_map(|(r, pick)| Op::CrashAndRestart { r, pick }),
            1 => (1..100u64).prop_map(Op::Tick),
        ]
    }

    /// Run a plan on the simulator: every Remove must name an mdev of the snapshot the plan
    /// was made from, and the kernel must accept every write.
    fn exec(
        sim: &mut Sim,
        snap: &MdevSnapshot,
        actions: &[Action],
    ) -> Result<(), proptest::test_runner::TestCaseError> {
        for a in actions {
            if let Action::Remove { uuid } = a {
                proptest::prop_assert!(
                    snap.mdevs.iter().any(|m| &m.uuid == uuid),
                    "remove of unknown {uuid}"
                );
            }
            sim.run(a)
                .map_err(proptest::test_runner::TestCaseError::fail)?;
        }
        Ok(())
    }

    /// PodResources lists the admitted pods: their records learn them.
    fn bind(
        ledger: &mut Ledger,
        pods: &[(String, Vec<DeviceId>)],
        alive: &BTreeSet<String>,
        unbound: &mut Vec<usize>,
    ) {
        for i in unbound.drain(..) {
            let (pod, ids) = &pods[i];
            if alive.contains(pod) {
                for id in ids {
                    // a buggy kubelet's re-use may have given the ID to another pod since
                    let _ = ledger.bind(id, pod);
                }
            }
        }
    }

    proptest::proptest! {
        #[test]
        fn the_ledger_against_a_simulated_sysfs(ops in proptest::collection::vec(op(), 1..40)) {
            let naming = MdevNaming::KubeVirt;
            let mut sim = Sim::default();
            let mut ledger = Ledger::new();
            let mut next = 0u32;
            let mut uuids = move || { next += 1; uuid(next) };
            let mut now = 1000u64;
            const GRACE: u64 = 120;
            // the kubelet: pod → its IDs; pods alive
            let mut pods: Vec<(String, Vec<DeviceId>)> = Vec::new();
            let mut alive: BTreeSet<String> = BTreeSet::new();
            let mut unbound: Vec<usize> = Vec::new();
            // which ID each mdev was created for
            let mut created_for: BTreeMap<MdevUuid, DeviceId> = BTreeMap::new();


            for op in ops {
                match op {
                    Op::Allocate { r, picks, buggy, admitted } => {
                        let snap = sim.snapshot();
                        let ads = advertise(&snap, &ledger, &naming);
                        // resources here: one name for both types (same name): use type ids
                        let all: Vec<DeviceId> = ads.values().flatten().cloned().collect();
                        let typ = TYPES[r % 2].0;
                        let held: BTreeSet<&DeviceId> = pods.iter().filter(|(p, _)| alive.contains(p)).flat_map(|(_, ids)| ids).collect();
                        let list: Vec<&DeviceId> = all.iter().filter(|i| i.type_id == typ && (buggy || !held.contains(i))).collect();
                        if list.is_empty() { continue; }
                        let mut ids: Vec<String> = picks.iter().map(|p| list[p % list.len()].to_string()).collect();
                        let mut seen = BTreeSet::new();
                        ids.retain(|i| seen.insert(i.clone()));
                        let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
                        let before = ledger.clone();
                        match plan_allocate(&ledger, &snap, &refs, Liveness { live: &alive, now, grace: GRACE }, &mut uuids) {
                            Ok(plan) => {
                                // a correct kubelet never re-uses a live pod's ID, so never InUse
                                exec(&mut sim, &snap, &plan.actions)?;
                                for (id, rec) in &plan.records { created_for.insert(rec.uuid.clone(), id.clone()); }
                                ledger.commit(&plan);
                                let pod = format!("pod{}", pods.len());
                                if admitted {
                                    alive.insert(pod.clone());
                                    unbound.push(pods.len());
                                }
                                pods.push((pod, ids.iter().map(|i| did(i)).collect()));
                            }
                            Err(MdevError::InUse { pod, .. }) => {
                                // only a buggy kubelet re-uses a live pod's ID
                                proptest::prop_assert!(buggy && alive.contains(&pod));
                                proptest::prop_assert_eq!(&ledger, &before);
                            }
                            Err(MdevError::Pending { id, age, .. }) => {
                                // a record that has not learned its pod, within the grace
                                let r = ledger.get(&did(&id)).unwrap();
                                proptest::prop_assert!(r.pod_uid.is_none() && age < GRACE);
                                proptest::prop_assert_eq!(&ledger, &before);
                            }
                            Err(e) => proptest::prop_assert!(false, "unexpected {e}"),
                        }
                    }
                    Op::Bind => bind(&mut ledger, &pods, &alive, &mut unbound),
                    Op::Delete(i) => {
                        if !pods.is_empty() {
                            let pod = pods[i % pods.len()].0.clone();
                            alive.remove(&pod);
                        }
                    }
                    Op::Cleanup => {
                        bind(&mut ledger, &pods, &alive, &mut unbound);
                        let snap = sim.snapshot();
                        let plan = plan_cleanup(&ledger, &snap, Liveness { live: &alive, now, grace: GRACE });
                        exec(&mut sim, &snap, &plan.actions)?;
                        ledger.forget(&plan);
                    }
                    Op::CrashAndRestart { r, pick } => {
                        let snap = sim.snapshot();
                        let ads = advertise(&snap, &ledger, &naming);
                        let typ = TYPES[r % 2].0;
                        let free: Vec<DeviceId> = ads.values().flatten().filter(|i| i.type_id == typ && ledger.get(i).is_none()).cloned().collect();
                        if !free.is_empty() {
                            let id = free[pick % free.len()].to_string();
                            if let Ok(plan) = plan_allocate(&ledger, &snap, &[&id], Liveness { live: &alive, now, grace: GRACE }, &mut uuids) {
                                // the create ran, the checkpoint did not
                                exec(&mut sim, &snap, &plan.actions)?;
                                for (id, rec) in &plan.records { created_for.insert(rec.uuid.clone(), id.clone()); }
                            }
                        }
                        let snap = sim.snapshot();
                        let orphans = plan_orphans(&ledger, &snap);
                        exec(&mut sim, &snap, &orphans)?;
                        // after the restart, every mdev is recorded
                        let recorded: BTreeSet<&MdevUuid> = ledger.records().map(|(_, r)| &r.uuid).collect();
                        proptest::prop_assert!(sim.mdevs.keys().all(|u| recorded.contains(u)));
                    }
                    Op::Tick(s) => now += s,
                }
                // no ID maps to two live mdevs
                let mut per_id: BTreeMap<&DeviceId, usize> = BTreeMap::new();
                for u in sim.mdevs.keys() {
                    *per_id.entry(&created_for[u]).or_default() += 1;
                }
                proptest::prop_assert!(per_id.values().all(|n| *n <= 1), "{per_id:?}");
                // no two records name one mdev
                let uuids_in: Vec<&MdevUuid> = ledger.records().map(|(_, r)| &r.uuid).collect();
                let distinct: BTreeSet<&&MdevUuid> = uuids_in.iter().collect();
                proptest::prop_assert_eq!(distinct.len(), uuids_in.len());
                // a live pod's devices still have their records
                for (pod, ids) in &pods {
                    if alive.contains(pod) && !unbound.iter().any(|i| &pods[*i].0 == pod) {
                        for id in ids {
                            proptest::prop_assert!(ledger.get(id).is_some(), "{pod} lost {id}");
                        }
                    }
                }
            }
        }
    }
}
