//! The VM backends served (issue 20; the decisions are `vcuda_vm`'s): one [`Passthrough`]
//! backend per GPU model bound to `vfio-pci`, one [`MdevBackend`] per mediated-device type,
//! over one [`VmNode`] that owns their I/O — reading the `--sysfs-root` / `--dev-root`
//! trees, the sysfs writes that create and remove mdevs, the mdev checkpoint, and the
//! kubelet's PodResources for which pod holds which vGPU.
//!
//! Invariants: an mdev is in the checkpoint before its Allocate answers (a crash after
//! `create` and before the checkpoint leaves an orphan, removed at the next start; never a
//! checkpointed mdev that does not exist but is handed out); an Allocate that fails part
//! way removes what it created; a `remove` the driver refuses (the VM still holds the
//! device) keeps the record, retried every [`REFRESH`] — nothing waits on it.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::watch;
use tokio_stream::wrappers::WatchStream;
use tokio_stream::StreamExt;
use tonic::Status;
use tracing::{info, warn};
use vcuda_proto::deviceplugin::v1beta1 as dp;
use vcuda_proto::podresources::v1 as pr;
use vcuda_vm::mdev::{self, Action, DeviceId, Ledger, Liveness, MdevSnapshot, MdevUuid, Record};
use vcuda_vm::naming::{self, MdevNaming, PciIds};
use vcuda_vm::pci::{PciAddress, Snapshot};
use vcuda_vm::sysfs::{self, SysfsError};

use crate::backend::{Backend, DeviceStream};
use crate::settings::{Settings, VmBackend};

/// How often the trees are read again (health, capacity) and PodResources asked which pods
/// hold vGPUs (removal of the gone ones).
pub const REFRESH: Duration = Duration::from_secs(1);

/// The mdev checkpoint's file name in `--state-dir`.
pub const CHECKPOINT: &str = "vm-mdevs.json";

/// Why the VM backends cannot start.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error(transparent)]
    Sysfs(#[from] SysfsError),
    #[error("cannot read the mdev checkpoint {}: {source}; it is written by the manager only: if it is damaged, remove it and restart (the mdevs it named are then removed as orphans)", path.display())]
    CheckpointRead {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the mdev checkpoint {} is not the manager's ({reason}); remove it and restart (the mdevs it named are then removed as orphans)", path.display())]
    CheckpointParse { path: PathBuf, reason: String },
    #[error("cannot write the mdev checkpoint {}: {source}; is --state-dir writable and not full?", path.display())]
    CheckpointWrite {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write {content:?} to {}: {source}", path.display())]
    Write {
        path: PathBuf,
        content: String,
        source: std::io::Error,
    },
    #[error("mdev {uuid} was created but {} does not show it; the driver did not make it", path.display())]
    NotCreated { uuid: MdevUuid, path: PathBuf },
    #[error("its removal has not returned within {}s (the driver waits for the VM to let go of mdev {uuid})", REMOVE_WAIT_ALLOCATE.as_secs())]
    RemovePending { uuid: MdevUuid },
}

impl VmError {
    /// A short stable name for counting errors by kind.
    pub fn kind(&self) -> &'static str {
        match self {
            VmError::Sysfs(_) => "sysfs",
            VmError::CheckpointRead { .. } => "vm-checkpoint-read",
            VmError::CheckpointParse { .. } => "vm-checkpoint-parse",
            VmError::CheckpointWrite { .. } => "vm-checkpoint-write",
            VmError::Write { .. } => "sysfs-write",
            VmError::NotCreated { .. } => "mdev-not-created",
            VmError::RemovePending { .. } => "mdev-remove-pending",
        }
    }
}

/// A resource of the VM backends, ready to serve.
pub struct Plugin {
    pub name: String,
    pub backend: Arc<dyn Backend>,
}

/// The node's VM side: what was found at start, the trees as last read, the mdev ledger.
pub struct VmNode {
    sysfs: PathBuf,
    dev: PathBuf,
    pod_resources: PathBuf,
    checkpoint: PathBuf,
    naming: MdevNaming,
    grace: u64,
    /// The passthrough GPUs by resource (fixed at start: binding a GPU of a new model to
    /// vfio-pci needs a restart to be served; a served GPU's health follows its binding).
    models: BTreeMap<String, Vec<PciAddress>>,
    /// The GPUs whose mdev types are served.
    parents: Vec<PciAddress>,
    pci: watch::Sender<Snapshot>,
    mdev: parking_lot::Mutex<MdevBook>,
    /// Bumped whenever the advertised mdev devices may have changed.
    mdev_changed: watch::Sender<u64>,
    /// The served mdev resources' names.
    mdev_resources: BTreeSet<String>,
    /// The kept PodResources channel (dialled again after an error).
    pr_channel: tokio::sync::Mutex<Option<tonic::transport::Channel>>,
    /// `remove` writes in flight, each on a thread of its own.
    removals: Removals,
}

/// How long the refresh loop waits for a `remove` it starts, and an Allocate for the
/// removal of a re-used ID's old mdev, before going on without it.
const REMOVE_WAIT_CLEANUP: Duration = Duration::from_millis(100);
const REMOVE_WAIT_ALLOCATE: Duration = Duration::from_secs(1);

/// `remove` writes that may block: on current kernels, writing `1` to an mdev's `remove`
/// blocks until the VM holding it lets go (vfio asks the user to release the device and
/// waits); older vendor drivers refuse with EBUSY instead. A VM — a tenant — must not be
/// able to stall the manager that way, so each write runs on a thread of its own and the
/// caller waits a bounded time: done, refused, or still pending (looked at again later,
/// never written twice).
pub struct Removals {
    sysfs: PathBuf,
    inflight:
        parking_lot::Mutex<BTreeMap<MdevUuid, std::sync::mpsc::Receiver<Result<(), VmError>>>>,
}

/// Where a `remove` stands.
#[derive(Debug)]
pub enum Removal {
    Done,
    /// The write has not returned: the driver waits for the VM to let go.
    Pending,
}

impl Removals {
    pub fn new(sysfs: PathBuf) -> Removals {
        Removals {
            sysfs,
            inflight: parking_lot::Mutex::new(BTreeMap::new()),
        }
    }

    /// Remove mdev `uuid` (start the write, or look at the one in flight), waiting at most
    /// `wait`.
    pub fn remove(&self, uuid: &MdevUuid, wait: Duration) -> Result<Removal, VmError> {
        let taken = self.inflight.lock().remove(uuid);
        let rx = match taken {
            Some(rx) => rx,
            None => {
                let (tx, rx) = std::sync::mpsc::channel();
                let path = self
                    .sysfs
                    .join(Action::Remove { uuid: uuid.clone() }.write().0);
                std::thread::Builder::new()
                    .name("mdev-remove".into())
                    .spawn(move || {
                        let _ = tx.send(write_file(&path, "1"));
                    })
                    .map_err(|source| VmError::Write {
                        path: self.sysfs.join("bus/mdev/devices").join(uuid.as_str()),
                        content: "1".into(),
                        source,
                    })?;
                rx
            }
        };
        match rx.recv_timeout(wait) {
            Ok(result) => result.map(|()| Removal::Done),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                self.inflight.lock().insert(uuid.clone(), rx);
                Ok(Removal::Pending)
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Ok(Removal::Pending),
        }
    }

    /// Whether a `remove` of `uuid` is still in flight.
    pub fn pending(&self, uuid: &MdevUuid) -> bool {
        self.inflight.lock().contains_key(uuid)
    }
}

/// Write `content` to an existing sysfs file (no create, no truncate).
fn write_file(path: &Path, content: &str) -> Result<(), VmError> {
    let err = |source| VmError::Write {
        path: path.to_path_buf(),
        content: content.to_string(),
        source,
    };
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(err)?;
    f.write_all(content.as_bytes()).map_err(err)
}

struct MdevBook {
    ledger: Ledger,
    snapshot: MdevSnapshot,
    /// Disagreements between PodResources and the ledger already logged (each once, not
    /// every second).
    warned: BTreeSet<String>,
}

impl VmNode {
    /// Find what to serve, load the mdev checkpoint and remove orphans; the plugins to
    /// register (passthrough models, then mdev types).
    pub fn open(settings: &Settings) -> Result<(Arc<VmNode>, Vec<Plugin>), VmError> {
        let vm = &settings.vm;
        let pci = sysfs::pci_snapshot(&vm.sysfs_root, &vm.dev_root)?;
        let ids = vm
            .pci_ids
            .as_deref()
            .and_then(|p| match sysfs::read_pci_ids(p) {
                Ok(ids) => Some(ids),
                Err(e) => {
                    warn!(error = %e, "passthrough models are named by device id");
                    None
                }
            });
        let models = if vm.serves(VmBackend::Passthrough) {
            passthrough_models(&pci, ids.as_ref())
        } else {
            BTreeMap::new()
        };
        let mut parents = Vec::new();
        if vm.serves(VmBackend::Mdev) {
            for gpu in pci.nvidia_gpus() {
                if !sysfs::read_mdev_types(&vm.sysfs_root, &gpu.address)?.is_empty() {
                    parents.push(gpu.address.clone());
                }
            }
        }
        let checkpoint = settings.state_dir.join(CHECKPOINT);
        let ledger = load_checkpoint(&checkpoint)?;
        let snapshot = sysfs::mdev_snapshot(&vm.sysfs_root, &parents)?;
        let mdev_resources: BTreeSet<String> = snapshot
            .types
            .iter()
            .filter(|t| t.device_api == mdev::VFIO_PCI_API)
            .map(|t| vm.mdev_naming.resource(&t.id, t.name.as_deref()))
            .collect();
        let node = Arc::new(VmNode {
            sysfs: vm.sysfs_root.clone(),
            dev: vm.dev_root.clone(),
            pod_resources: settings.pod_resources_socket.clone(),
            checkpoint,
            naming: vm.mdev_naming.clone(),
            grace: vm.mdev_grace,
            models,
            parents,
            pci: watch::channel(pci).0,
            mdev: parking_lot::Mutex::new(MdevBook {
                ledger,
                snapshot,
                warned: BTreeSet::new(),
            }),
            mdev_changed: watch::channel(0).0,
            mdev_resources,
            pr_channel: tokio::sync::Mutex::new(None),
            removals: Removals::new(vm.sysfs_root.clone()),
        });
        node.remove_orphans()?;
        for (name, addrs) in &node.models {
            info!(resource = %name, gpus = %join(addrs), "serving passthrough GPUs");
            let pci = node.pci.borrow();
            for addr in addrs {
                if let Err(why) = pci.health(addr) {
                    warn!(gpu = %addr, kind = why.kind(), "passthrough GPU unhealthy: {why}");
                }
            }
        }
        if !node.parents.is_empty() {
            info!(gpus = %join(&node.parents), types = ?node.mdev_resources, "serving mdev vGPUs");
        }
        let mut plugins: Vec<Plugin> = node
            .models
            .keys()
            .map(|name| Plugin {
                name: name.clone(),
                backend: Arc::new(Passthrough {
                    node: node.clone(),
                    resource: name.clone(),
                }),
            })
            .collect();
        plugins.extend(node.mdev_resources.iter().map(|name| Plugin {
            name: name.clone(),
            backend: Arc::new(MdevBackend {
                node: node.clone(),
                resource: name.clone(),
            }) as Arc<dyn Backend>,
        }));
        Ok((node, plugins))
    }

    /// The GPUs the mdev backend owns (their PCI addresses): the container modes must not
    /// hand them out.
    pub fn mdev_parents(&self) -> &[PciAddress] {
        &self.parents
    }

    /// At start: remove the mdevs of served types no record names.
    fn remove_orphans(&self) -> Result<(), VmError> {
        let book = self.mdev.lock();
        for a in mdev::plan_orphans(&book.ledger, &book.snapshot) {
            let Action::Remove { uuid } = &a else {
                continue;
            };
            info!(mdev = %uuid, "removing an mdev no checkpoint record names (left by a crash)");
            match self.removals.remove(uuid, REMOVE_WAIT_ALLOCATE) {
                Ok(Removal::Done) => {}
                Ok(Removal::Pending) => {
                    warn!(mdev = %uuid, "an orphaned mdev is still held by a VM; its removal waits for it to let go")
                }
                Err(e) => {
                    warn!(error = %e, "cannot remove an orphaned mdev; it stays until removed by hand")
                }
            }
        }
        drop(book);
        self.reread_mdevs()?;
        Ok(())
    }

    /// Runs for ever: every [`REFRESH`], read the trees again (health and capacity follow),
    /// learn from PodResources which pod holds which vGPU and remove those of gone pods.
    pub async fn refresh_loop(self: Arc<Self>) {
        let mut tick = tokio::time::interval(REFRESH);
        loop {
            tick.tick().await;
            if !self.models.is_empty() {
                match sysfs::pci_snapshot(&self.sysfs, &self.dev) {
                    Ok(s) => self.publish_pci(s),
                    Err(e) => warn!(error = %e, "cannot read the PCI devices; health unchanged"),
                }
            }
            if self.parents.is_empty() {
                continue;
            }
            if let Err(e) = self.reread_mdevs() {
                warn!(error = %e, "cannot read the mdevs; capacity unchanged");
                continue;
            }
            if self.mdev.lock().ledger.is_empty() {
                continue;
            }
            match self.list_pods().await {
                Ok(list) => self.cleanup(&list),
                Err(e) => {
                    warn!(error = %e, "cannot ask PodResources which pods hold vGPUs; none removed this round")
                }
            }
        }
    }

    /// Publish a new PCI snapshot, logging each served GPU's health change with its reason.
    fn publish_pci(&self, new: Snapshot) {
        self.pci.send_if_modified(|cur| {
            if *cur == new {
                return false;
            }
            for addr in self.models.values().flatten() {
                let (was, now) = (cur.health(addr), new.health(addr));
                if was != now {
                    match &now {
                        Ok(()) => info!(gpu = %addr, "passthrough GPU healthy again"),
                        Err(why) => {
                            warn!(gpu = %addr, kind = why.kind(), "passthrough GPU unhealthy: {why}")
                        }
                    }
                }
            }
            *cur = new;
            true
        });
    }

    /// The last snapshot with the devices `asked` and their groups' members read afresh, and
    /// the group nodes: what an Allocate decides on (the kubelet's view may be a second old;
    /// reading every PCI device of the node per Allocate would cost far more).
    fn fresh_pci(&self, asked: &[PciAddress]) -> Result<Snapshot, VmError> {
        let last = self.pci.borrow().clone();
        let groups: BTreeSet<u32> = asked
            .iter()
            .filter_map(|a| last.device(a).and_then(|d| d.iommu_group))
            .collect();
        let mut devices: BTreeMap<PciAddress, vcuda_vm::pci::PciDevice> = last
            .devices()
            .map(|d| (d.address.clone(), d.clone()))
            .collect();
        let again: BTreeSet<PciAddress> = asked
            .iter()
            .cloned()
            .chain(
                groups
                    .iter()
                    .flat_map(|g| last.group(*g).map(|d| d.address.clone())),
            )
            .collect();
        for addr in again {
            match sysfs::read_pci_device(&self.sysfs, &addr) {
                Ok(d) => {
                    devices.insert(addr, d);
                }
                Err(SysfsError::Io { source, .. })
                    if source.kind() == std::io::ErrorKind::NotFound =>
                {
                    devices.remove(&addr); // unplugged: Gone
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok(Snapshot::new(
            devices.into_values().collect(),
            sysfs::read_vfio_groups(&self.dev)?,
        ))
    }

    /// Bring `book`'s snapshot up to date for `parents` (their types re-read) and the mdevs
    /// `uuids` (each, with its parent and type, added or dropped as sysfs shows it now).
    fn refresh_book(
        &self,
        book: &mut MdevBook,
        parents: &BTreeSet<PciAddress>,
        mdevs: &[(MdevUuid, PciAddress, String)],
    ) -> Result<(), VmError> {
        for p in parents.iter().filter(|p| self.parents.contains(p)) {
            let types = sysfs::read_mdev_types(&self.sysfs, p)?;
            book.snapshot.types.retain(|t| &t.parent != p);
            book.snapshot.types.extend(types);
        }
        for (uuid, parent, type_id) in mdevs {
            book.snapshot.mdevs.retain(|m| &m.uuid != uuid);
            let entry = self.sysfs.join("bus/mdev/devices").join(uuid.as_str());
            if std::fs::symlink_metadata(&entry).is_err() {
                continue; // gone
            }
            let group = std::fs::read_link(entry.join("iommu_group"))
                .ok()
                .and_then(|l| l.file_name()?.to_str()?.parse().ok());
            book.snapshot.mdevs.push(mdev::Mdev {
                uuid: uuid.clone(),
                type_id: type_id.clone(),
                parent: parent.clone(),
                iommu_group: group,
            });
        }
        Ok(())
    }

    fn reread_mdevs(&self) -> Result<(), VmError> {
        let s = sysfs::mdev_snapshot(&self.sysfs, &self.parents)?;
        let mut book = self.mdev.lock();
        if book.snapshot != s {
            book.snapshot = s;
            drop(book);
            self.mdev_changed.send_modify(|n| *n += 1);
        }
        Ok(())
    }

    /// Bind the ledger's records to the pods PodResources lists them for, then remove the
    /// mdevs of pods it no longer lists (a `remove` refused stays for the next round).
    fn cleanup(&self, list: &pr::ListPodResourcesResponse) {
        let mut book = self.mdev.lock();
        let before = book.ledger.clone();
        let MdevBook { ledger, warned, .. } = &mut *book;
        let live = bind_pods(ledger, list, &self.mdev_resources, warned);
        if book.ledger != before {
            if let Err(e) = save_checkpoint(&self.checkpoint, &book.ledger) {
                warn!(error = %e, "the pods learned are not checkpointed; learned again after a restart");
            }
        }
        let pods = Liveness {
            live: &live,
            now: unix_now(),
            grace: self.grace,
        };
        let plan = mdev::plan_cleanup(&book.ledger, &book.snapshot, pods);
        if plan.forget.is_empty() {
            return;
        }
        let mut done = mdev::CleanupPlan::default();
        for id in &plan.forget {
            let Some(r) = book.ledger.get(id) else {
                continue;
            };
            let remove = Action::Remove {
                uuid: r.uuid.clone(),
            };
            if plan.actions.contains(&remove) {
                let first = !self.removals.pending(&r.uuid);
                match self.removals.remove(&r.uuid, REMOVE_WAIT_CLEANUP) {
                    Ok(Removal::Done) => {}
                    Ok(Removal::Pending) => {
                        if first {
                            warn!(device = %id, mdev = %r.uuid, "cannot remove the mdev of a gone pod yet: the driver waits for its VM to let go; looked at again every second");
                        }
                        continue;
                    }
                    Err(e) => {
                        warn!(device = %id, error = %e, "cannot remove the mdev of a gone pod (is its VM still running?); retried in a second");
                        continue;
                    }
                }
                info!(device = %id, mdev = %r.uuid, pod = ?r.pod_uid, "removed the mdev of a gone pod");
            } else {
                info!(device = %id, mdev = %r.uuid, "forgot a record whose mdev is gone");
            }
            done.forget.push(id.clone());
        }
        if done.forget.is_empty() {
            return;
        }
        book.ledger.forget(&done);
        if let Err(e) = save_checkpoint(&self.checkpoint, &book.ledger) {
            warn!(error = %e, "the removals are not checkpointed; at the next start their records are forgotten anyway (their mdevs are gone)");
        }
        drop(book);
        if let Err(e) = self.reread_mdevs() {
            warn!(error = %e, "cannot read the mdevs");
        }
        self.mdev_changed.send_modify(|n| *n += 1);
    }

    /// One sysfs write; a `Create` is checked to have made the device.
    fn execute(&self, action: &Action) -> Result<(), VmError> {
        let (rel, content) = action.write();
        write_file(&self.sysfs.join(rel), &content)?;
        if let Action::Create { uuid, .. } = action {
            let dev = self.sysfs.join("bus/mdev/devices").join(uuid.as_str());
            if std::fs::symlink_metadata(&dev).is_err() {
                return Err(VmError::NotCreated {
                    uuid: uuid.clone(),
                    path: dev,
                });
            }
        }
        Ok(())
    }

    /// `List` on the kubelet's PodResources socket.
    async fn list_pods(&self) -> Result<pr::ListPodResourcesResponse, PodsError> {
        let channel = {
            let mut kept = self.pr_channel.lock().await;
            match kept.as_ref() {
                Some(c) => c.clone(),
                None => {
                    let endpoint = tonic::transport::Endpoint::from_static("http://localhost")
                        .connect_timeout(Duration::from_secs(2))
                        .timeout(Duration::from_secs(10));
                    let c = vcuda_proto::uds::connect_with(endpoint, &self.pod_resources)
                        .await
                        .map_err(|e| PodsError {
                            socket: self.pod_resources.clone(),
                            reason: e.to_string(),
                        })?;
                    *kept = Some(c.clone());
                    c
                }
            }
        };
        let mut client = pr::pod_resources_lister_client::PodResourcesListerClient::new(channel);
        match client.list(pr::ListPodResourcesRequest {}).await {
            Ok(r) => Ok(r.into_inner()),
            Err(s) => {
                *self.pr_channel.lock().await = None; // dial afresh next time
                Err(PodsError {
                    socket: self.pod_resources.clone(),
                    reason: s.message().to_string(),
                })
            }
        }
    }

    /// The Allocate of mdev device IDs `ids` of `resource`: plan against a fresh read,
    /// create, checkpoint, answer. Refused or failed, nothing it created is left.
    async fn allocate_mdevs(
        &self,
        resource: &str,
        ids: &[String],
    ) -> Result<dp::ContainerAllocateResponse, Status> {
        let list = self.list_pods().await.map_err(|e| {
            Status::unavailable(format!(
                "vcuda: {e}; without it a re-used device id cannot be told from a live pod's, so nothing is created"
            ))
        })?;
        let mut book = self.mdev.lock();
        // Fresh where it decides: the asked types' counts, and whether the asked IDs' old
        // mdevs still exist (the rest of the snapshot is at most a refresh old).
        let parents: BTreeSet<PciAddress> = ids
            .iter()
            .filter_map(|raw| raw.parse::<DeviceId>().ok())
            .map(|id| id.parent)
            .collect();
        let olds: Vec<(MdevUuid, PciAddress, String)> = ids
            .iter()
            .filter_map(|raw| raw.parse::<DeviceId>().ok())
            .filter_map(|id| {
                book.ledger
                    .get(&id)
                    .map(|r| (r.uuid.clone(), id.parent.clone(), id.type_id.clone()))
            })
            .collect();
        self.refresh_book(&mut book, &parents, &olds)
            .map_err(node_fault)?;
        let MdevBook { ledger, warned, .. } = &mut *book;
        let live = bind_pods(ledger, &list, &self.mdev_resources, warned);
        let pods = Liveness {
            live: &live,
            now: unix_now(),
            grace: self.grace,
        };
        let asked: Vec<&str> = ids.iter().map(String::as_str).collect();
        for raw in &asked {
            let ok = raw
                .parse::<DeviceId>()
                .ok()
                .and_then(|id| {
                    book.snapshot
                        .types
                        .iter()
                        .find(|t| t.parent == id.parent && t.id == id.type_id)
                })
                .is_some_and(|t| self.naming.resource(&t.id, t.name.as_deref()) == resource);
            if !ok {
                return Err(Status::invalid_argument(format!(
                    "vcuda: {}",
                    mdev::MdevError::UnknownDevice {
                        id: raw.to_string()
                    }
                )));
            }
        }
        let plan = mdev::plan_allocate(&book.ledger, &book.snapshot, &asked, pods, &mut fresh_uuid)
            .map_err(|e| match e {
                mdev::MdevError::UuidCollision { .. } => Status::internal(format!("vcuda: {e}")),
                mdev::MdevError::UnknownDevice { .. }
                | mdev::MdevError::Duplicate { .. }
                | mdev::MdevError::Empty => Status::invalid_argument(format!("vcuda: {e}")),
                _ => Status::failed_precondition(format!("vcuda: {e}")),
            })?;
        let mut failed = None;
        let mut failed_remove = None;
        for (i, a) in plan.actions.iter().enumerate() {
            let done = match a {
                Action::Remove { uuid } => match self.removals.remove(uuid, REMOVE_WAIT_ALLOCATE) {
                    Ok(Removal::Done) => Ok(()),
                    Ok(Removal::Pending) => Err(VmError::RemovePending { uuid: uuid.clone() }),
                    Err(e) => Err(e),
                },
                Action::Create { .. } => self.execute(a),
            };
            if let Err(e) = done {
                if let Action::Remove { uuid } = a {
                    failed_remove = Some(uuid.clone());
                }
                failed = Some((i, e));
                break;
            }
        }
        let result = match failed {
            Some((i, e)) => Err(e).inspect_err(|_| self.undo(&plan, i + 1)),
            None => {
                let mut next = book.ledger.clone();
                next.commit(&plan);
                match save_checkpoint(&self.checkpoint, &next) {
                    Ok(()) => {
                        book.ledger = next;
                        Ok(())
                    }
                    Err(e) => {
                        self.undo(&plan, plan.actions.len());
                        Err(e)
                    }
                }
            }
        };
        // What the plan touched, as it is now (created, removed, or undone). A removed mdev
        // was in the snapshot: the plan removes only mdevs it shows.
        let touched: Vec<(MdevUuid, PciAddress, String)> = plan
            .actions
            .iter()
            .filter_map(|a| match a {
                Action::Create {
                    parent,
                    type_id,
                    uuid,
                } => Some((uuid.clone(), parent.clone(), type_id.clone())),
                Action::Remove { uuid } => book
                    .snapshot
                    .mdevs
                    .iter()
                    .find(|m| &m.uuid == uuid)
                    .map(|m| (uuid.clone(), m.parent.clone(), m.type_id.clone())),
            })
            .collect();
        let reread = self.refresh_book(&mut book, &parents, &touched);
        drop(book);
        self.mdev_changed.send_modify(|n| *n += 1);
        result.map_err(|e| match failed_remove {
            // The kubelet re-used the id of a gone pod whose VM still holds its vGPU.
            Some(uuid) => Status::failed_precondition(format!(
                "vcuda: the device's previous mdev {uuid} (its pod is gone) cannot be removed: {e}; its VM has not released it, so the driver refuses; the device is refused until it does (the manager retries the removal every second) and the pod's controller retries the pod"
            )),
            None => node_fault(e),
        })?;
        reread.map_err(node_fault)?;
        let book = self.mdev.lock();
        let mut created = Vec::with_capacity(plan.records.len());
        for uuid in plan.uuids() {
            let group = book
                .snapshot
                .mdevs
                .iter()
                .find(|m| &m.uuid == uuid)
                .and_then(|m| m.iommu_group)
                .ok_or_else(|| {
                    node_fault(VmError::NotCreated {
                        uuid: uuid.clone(),
                        path: self.sysfs.join("bus/mdev/devices").join(uuid.as_str()),
                    })
                })?;
            created.push((uuid.clone(), group));
        }
        for (id, r) in &plan.records {
            info!(device = %id, mdev = %r.uuid, "created an mdev");
        }
        Ok(vfio_response(&mdev::answer(resource, &created)))
    }

    /// Remove what the first `executed` actions of `plan` created.
    fn undo(&self, plan: &mdev::AllocatePlan, executed: usize) {
        let partial = mdev::AllocatePlan {
            actions: plan.actions[..executed.min(plan.actions.len())].to_vec(),
            records: Vec::new(),
        };
        for a in partial.rollback() {
            if let Action::Remove { uuid } = &a {
                if std::fs::symlink_metadata(
                    self.sysfs.join("bus/mdev/devices").join(uuid.as_str()),
                )
                .is_err()
                {
                    continue;
                }
            }
            if let Err(e) = self.execute(&a) {
                warn!(error = %e, "cannot undo a failed Allocate's mdev; it is removed as an orphan at the next start");
            }
        }
    }
}

/// PodResources did not answer.
#[derive(Debug, thiserror::Error)]
#[error("cannot ask the kubelet's PodResources API at {}: {reason}; is --pod-resources-socket the kubelet's, and the kubelet running?", socket.display())]
pub struct PodsError {
    socket: PathBuf,
    reason: String,
}

/// A node's own fault in an Allocate (its sysfs, its checkpoint).
fn node_fault(e: VmError) -> Status {
    Status::internal(format!("vcuda: {e}"))
}

/// The served passthrough GPUs, by resource name, in address order.
fn passthrough_models(pci: &Snapshot, ids: Option<&PciIds>) -> BTreeMap<String, Vec<PciAddress>> {
    let mut out: BTreeMap<String, Vec<PciAddress>> = BTreeMap::new();
    for gpu in pci.vfio_gpus() {
        out.entry(naming::passthrough_resource(ids, gpu.device))
            .or_default()
            .push(gpu.address.clone());
    }
    out
}

/// Bind every record PodResources lists under a served mdev resource to its pod
/// (`namespace/name`: PodResources v1 gives no UID); the pods listed, all of them. A
/// disagreement is logged once (`warned` remembers it).
fn bind_pods(
    ledger: &mut Ledger,
    list: &pr::ListPodResourcesResponse,
    resources: &BTreeSet<String>,
    warned: &mut BTreeSet<String>,
) -> BTreeSet<String> {
    let mut live = BTreeSet::new();
    for pod in &list.pod_resources {
        let key = format!("{}/{}", pod.namespace, pod.name);
        for c in &pod.containers {
            for d in c
                .devices
                .iter()
                .filter(|d| resources.contains(&d.resource_name))
            {
                for raw in &d.device_ids {
                    let Ok(id) = raw.parse::<DeviceId>() else {
                        continue;
                    };
                    if let Err(e) = ledger.bind(&id, &key) {
                        if warned.insert(e.to_string()) {
                            warn!(error = %e, "PodResources and the mdev checkpoint disagree");
                        }
                    }
                }
            }
        }
        live.insert(key);
    }
    live
}

/// A fresh random (version 4) UUID.
fn fresh_uuid() -> MdevUuid {
    let mut b = [0u8; 16];
    // The OS random source does not fail on Linux once booted; a failure leaves zeros,
    // which `plan_allocate` refuses as a collision after the first.
    let _ = getrandom::fill(&mut b);
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
    .parse()
    .expect("a formatted UUID parses")
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn join(addrs: &[PciAddress]) -> String {
    addrs
        .iter()
        .map(PciAddress::as_str)
        .collect::<Vec<_>>()
        .join(",")
}

/// The kubelet's answer for a VFIO allocation: the device nodes (same path inside) and the
/// variable.
fn vfio_response(a: &vcuda_vm::pci::VfioAnswer) -> dp::ContainerAllocateResponse {
    dp::ContainerAllocateResponse {
        envs: [a.env.clone()].into_iter().collect(),
        devices: a
            .device_nodes
            .iter()
            .map(|n| dp::DeviceSpec {
                container_path: n.clone(),
                host_path: n.clone(),
                permissions: "mrw".into(),
            })
            .collect(),
        ..Default::default()
    }
}

/// The checkpoint: `{"version": 1, "records": [{"id", "uuid", "pod", "created"}]}`.
#[derive(serde::Serialize, serde::Deserialize)]
struct CheckpointFile {
    version: u32,
    records: Vec<CheckpointRecord>,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct CheckpointRecord {
    id: String,
    uuid: String,
    pod: Option<String>,
    created: u64,
}

fn load_checkpoint(path: &Path) -> Result<Ledger, VmError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Ledger::new()),
        Err(source) => {
            return Err(VmError::CheckpointRead {
                path: path.to_path_buf(),
                source,
            })
        }
    };
    let bad = |reason: String| VmError::CheckpointParse {
        path: path.to_path_buf(),
        reason,
    };
    let file: CheckpointFile = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    if file.version != 1 {
        return Err(bad(format!(
            "version {}, this manager writes 1",
            file.version
        )));
    }
    let mut records = Vec::with_capacity(file.records.len());
    for r in file.records {
        let id: DeviceId =
            r.id.parse()
                .map_err(|_| bad(format!("{:?} is not a device id", r.id)))?;
        let uuid: MdevUuid = r
            .uuid
            .parse()
            .map_err(|_| bad(format!("{:?} is not a UUID", r.uuid)))?;
        records.push((
            id,
            Record {
                uuid,
                pod_uid: r.pod,
                created: r.created,
            },
        ));
    }
    Ledger::from_records(records).map_err(|e| bad(e.to_string()))
}

/// Write the ledger atomically (a temporary file renamed over the old, synced).
fn save_checkpoint(path: &Path, ledger: &Ledger) -> Result<(), VmError> {
    let file = CheckpointFile {
        version: 1,
        records: ledger
            .records()
            .map(|(id, r)| CheckpointRecord {
                id: id.to_string(),
                uuid: r.uuid.to_string(),
                pod: r.pod_uid.clone(),
                created: r.created,
            })
            .collect(),
    };
    let err = |source| VmError::CheckpointWrite {
        path: path.to_path_buf(),
        source,
    };
    let tmp = path.with_extension("json.tmp");
    let text = serde_json::to_vec_pretty(&file).map_err(|e| err(e.into()))?;
    let mut f = std::fs::File::create(&tmp).map_err(err)?;
    f.write_all(&text).map_err(err)?;
    f.sync_all().map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)
}

/// One passthrough model's resource.
struct Passthrough {
    node: Arc<VmNode>,
    resource: String,
}

impl Passthrough {
    fn devices(&self, pci: &Snapshot) -> Vec<dp::Device> {
        self.node.models[&self.resource]
            .iter()
            .map(|addr| dp::Device {
                id: addr.to_string(),
                health: if pci.health(addr).is_ok() {
                    "Healthy"
                } else {
                    "Unhealthy"
                }
                .into(),
                topology: pci
                    .device(addr)
                    .and_then(|d| d.numa_node)
                    .map(numa_topology),
            })
            .collect()
    }
}

/// ListAndWatch over a watched value: the device list now, then again whenever the value
/// changes and the list with it (the same list is not sent twice).
fn changes<T: Clone + Send + Sync + 'static>(
    rx: watch::Receiver<T>,
    mut list: impl FnMut(&T) -> Vec<dp::Device> + Send + 'static,
) -> DeviceStream {
    let mut last: Option<Vec<dp::Device>> = None;
    Box::pin(WatchStream::new(rx).filter_map(move |v| {
        let devices = list(&v);
        if last.as_ref() == Some(&devices) {
            return None;
        }
        last = Some(devices.clone());
        Some(Ok(dp::ListAndWatchResponse { devices }))
    }))
}

fn numa_topology(node: u32) -> dp::TopologyInfo {
    dp::TopologyInfo {
        nodes: vec![dp::NumaNode { id: node as i64 }],
    }
}

fn no_preferred() -> Status {
    Status::unimplemented("vcuda: this resource does not offer GetPreferredAllocation")
}

#[tonic::async_trait]
impl Backend for Passthrough {
    fn resource(&self) -> String {
        self.resource.clone()
    }

    fn options(&self) -> dp::DevicePluginOptions {
        // Preferred allocations keep IOMMU groups whole (the kubelet's own pick may split one).
        dp::DevicePluginOptions {
            pre_start_required: false,
            get_preferred_allocation_available: true,
        }
    }

    fn watch(&self) -> DeviceStream {
        let me = Passthrough {
            node: self.node.clone(),
            resource: self.resource.clone(),
        };
        changes(self.node.pci.subscribe(), move |pci| me.devices(pci))
    }

    async fn preferred(
        &self,
        requests: Vec<dp::ContainerPreferredAllocationRequest>,
    ) -> Result<Vec<Vec<String>>, Status> {
        let pci = self.node.pci.borrow().clone();
        Ok(requests
            .iter()
            .map(|r| {
                let available: Vec<&str> =
                    r.available_device_i_ds.iter().map(String::as_str).collect();
                let must: Vec<&str> = r
                    .must_include_device_i_ds
                    .iter()
                    .map(String::as_str)
                    .collect();
                pci.preferred(&available, &must, r.allocation_size.max(0) as usize)
            })
            .collect())
    }

    async fn allocate(
        &self,
        requests: Vec<dp::ContainerAllocateRequest>,
    ) -> Result<Vec<dp::ContainerAllocateResponse>, Status> {
        let asked: Vec<PciAddress> = requests
            .iter()
            .flat_map(|r| &r.devices_ids)
            .filter_map(|id| id.parse().ok())
            .collect();
        let pci = self.node.fresh_pci(&asked).map_err(node_fault)?;
        let served = &self.node.models[&self.resource];
        requests
            .iter()
            .map(|r| {
                let ids: Vec<&str> = r.devices_ids.iter().map(String::as_str).collect();
                if let Some(other) = ids
                    .iter()
                    .find(|id| !served.iter().any(|a| a.as_str() == **id))
                {
                    return Err(Status::invalid_argument(format!(
                        "vcuda: {}",
                        vcuda_vm::pci::AllocateError::UnknownDevice {
                            id: other.to_string()
                        }
                    )));
                }
                pci.allocate(&self.resource, &ids)
                    .map(|a| vfio_response(&a))
                    .map_err(|e| Status::invalid_argument(format!("vcuda: {e}")))
            })
            .collect()
    }

    async fn pre_start(&self, _: Vec<String>) -> Result<(), Status> {
        Ok(())
    }
}

/// One mdev type's resource.
struct MdevBackend {
    node: Arc<VmNode>,
    resource: String,
}

impl MdevBackend {
    fn devices(node: &VmNode, resource: &str) -> Vec<dp::Device> {
        let book = node.mdev.lock();
        let pci = node.pci.borrow();
        mdev::advertise(&book.snapshot, &book.ledger, &node.naming)
            .remove(resource)
            .unwrap_or_default()
            .into_iter()
            .map(|id| dp::Device {
                health: "Healthy".into(),
                topology: pci
                    .device(&id.parent)
                    .and_then(|d| d.numa_node)
                    .map(numa_topology),
                id: id.to_string(),
            })
            .collect()
    }
}

#[tonic::async_trait]
impl Backend for MdevBackend {
    fn resource(&self) -> String {
        self.resource.clone()
    }

    fn options(&self) -> dp::DevicePluginOptions {
        dp::DevicePluginOptions::default()
    }

    fn watch(&self) -> DeviceStream {
        let (node, resource) = (self.node.clone(), self.resource.clone());
        changes(self.node.mdev_changed.subscribe(), move |_| {
            MdevBackend::devices(&node, &resource)
        })
    }

    async fn preferred(
        &self,
        _: Vec<dp::ContainerPreferredAllocationRequest>,
    ) -> Result<Vec<Vec<String>>, Status> {
        Err(no_preferred())
    }

    async fn allocate(
        &self,
        requests: Vec<dp::ContainerAllocateRequest>,
    ) -> Result<Vec<dp::ContainerAllocateResponse>, Status> {
        let mut out = Vec::with_capacity(requests.len());
        for r in &requests {
            out.push(
                self.node
                    .allocate_mdevs(&self.resource, &r.devices_ids)
                    .await?,
            );
        }
        Ok(out)
    }

    async fn pre_start(&self, _: Vec<String>) -> Result<(), Status> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fresh_uuids_are_version_4_and_differ() {
        let a = fresh_uuid();
        let b = fresh_uuid();
        assert_ne!(a, b);
        let s = a.to_string();
        assert_eq!(s.len(), 36);
        assert_eq!(&s[14..15], "4");
        assert!(matches!(&s[19..20], "8" | "9" | "a" | "b"));
    }

    #[test]
    fn the_checkpoint_keeps_every_record_and_refuses_what_it_did_not_write() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(CHECKPOINT);
        assert!(load_checkpoint(&path).unwrap().is_empty(), "absent: empty");
        let id: DeviceId = "0000:81:00.0-nvidia-492-3".parse().unwrap();
        let ledger = Ledger::from_records([(
            id.clone(),
            Record {
                uuid: "5b1f8a4e-0c2d-4e6f-8a9b-0c1d2e3f4a5b".parse().unwrap(),
                pod_uid: Some("vms/vm-a".into()),
                created: 42,
            },
        )])
        .unwrap();
        save_checkpoint(&path, &ledger).unwrap();
        assert_eq!(load_checkpoint(&path).unwrap(), ledger);

        std::fs::write(
            &path,
            r#"{"version": 1, "records": [{"id": "x", "uuid": "y", "pod": null, "created": 0}]}"#,
        )
        .unwrap();
        let e = load_checkpoint(&path).unwrap_err().to_string();
        assert!(
            e.contains("\"x\" is not a device id") && e.contains("remove it and restart"),
            "{e}"
        );
        std::fs::write(&path, "{").unwrap();
        assert!(matches!(
            load_checkpoint(&path),
            Err(VmError::CheckpointParse { .. })
        ));
    }

    /// A VM holding its vGPU makes the kernel's `remove` write block (a FIFO without a
    /// reader plays that): the caller gets `Pending` within its wait, asking again neither
    /// blocks nor writes a second time, and once the VM lets go the removal is done.
    #[test]
    fn a_remove_the_driver_holds_does_not_block_the_manager() {
        use std::io::Read;
        let dir = tempfile::tempdir().unwrap();
        let uuid: MdevUuid = "5b1f8a4e-0c2d-4e6f-8a9b-0c1d2e3f4a5b".parse().unwrap();
        let d = dir.path().join("bus/mdev/devices").join(uuid.as_str());
        std::fs::create_dir_all(&d).unwrap();
        let fifo = d.join("remove");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(made.success());
        let r = Removals::new(dir.path().to_path_buf());
        assert!(matches!(
            r.remove(&uuid, Duration::from_millis(50)),
            Ok(Removal::Pending)
        ));
        assert!(r.pending(&uuid));
        assert!(matches!(
            r.remove(&uuid, Duration::from_millis(10)),
            Ok(Removal::Pending)
        ));
        // the VM lets go: the one write in flight completes, and only it
        let mut written = String::new();
        std::fs::File::open(&fifo)
            .unwrap()
            .read_to_string(&mut written)
            .unwrap();
        assert_eq!(written, "1");
        assert!(matches!(
            r.remove(&uuid, Duration::from_secs(10)),
            Ok(Removal::Done)
        ));
        assert!(!r.pending(&uuid));
    }

    fn list(pods: &[(&str, &str, &[&str])]) -> pr::ListPodResourcesResponse {
        pr::ListPodResourcesResponse {
            pod_resources: pods
                .iter()
                .map(|(name, resource, ids)| pr::PodResources {
                    name: name.to_string(),
                    namespace: "vms".into(),
                    containers: vec![pr::ContainerResources {
                        name: "compute".into(),
                        devices: vec![pr::ContainerDevices {
                            resource_name: resource.to_string(),
                            device_ids: ids.iter().map(|s| s.to_string()).collect(),
                            topology: None,
                        }],
                        ..Default::default()
                    }],
                })
                .collect(),
        }
    }

    /// PodResources tells which pod holds a vGPU (by namespace/name) and which pods live;
    /// devices of other resources are not ours to bind.
    #[test]
    fn podresources_binds_records_of_served_resources_only() {
        let id: DeviceId = "0000:81:00.0-nvidia-492-0".parse().unwrap();
        let mut ledger = Ledger::from_records([(
            id.clone(),
            Record {
                uuid: "5b1f8a4e-0c2d-4e6f-8a9b-0c1d2e3f4a5b".parse().unwrap(),
                pod_uid: None,
                created: 0,
            },
        )])
        .unwrap();
        let served: BTreeSet<String> = ["tencent.com/vgpu-492".to_string()].into();
        let mut warned = BTreeSet::new();
        let live = bind_pods(
            &mut ledger,
            &list(&[
                ("other", "nvidia.com/gpu", &["0000:81:00.0-nvidia-492-0"]),
                (
                    "vm-a",
                    "tencent.com/vgpu-492",
                    &["0000:81:00.0-nvidia-492-0"],
                ),
            ]),
            &served,
            &mut warned,
        );
        assert!(warned.is_empty());
        assert_eq!(
            ledger.get(&id).unwrap().pod_uid.as_deref(),
            Some("vms/vm-a")
        );
        assert_eq!(
            live,
            ["vms/other".to_string(), "vms/vm-a".to_string()].into()
        );
        // a device the ledger does not know (a lost checkpoint): said once, not every second
        let unknown = list(&[(
            "vm-b",
            "tencent.com/vgpu-492",
            &["0000:81:00.0-nvidia-492-5"],
        )]);
        bind_pods(&mut ledger, &unknown, &served, &mut warned);
        bind_pods(&mut ledger, &unknown, &served, &mut warned);
        assert_eq!(warned.len(), 1, "{warned:?}");
    }
}
