//! The manager's state: allocations, the placement pairing, and the checkpoint that lets a
//! restarted manager pick them up. Synchronous and I/O-light (its own files only): the gRPC
//! services and the control socket call into it under one lock, briefly.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use vcuda_cluster::GpuShare;
use vcuda_contract::config::parse_uuid;
use vcuda_contract::control::Hello;
use vcuda_contract::region_file::{RegionFault, RegionFile};

use crate::cdi::{CdiError, SpecDir};
use crate::files::{create_dir, remove_dir, write_atomic, FileError};
use crate::journal::{Journal, JournalError};
use crate::locks::Locks;
use crate::settings::Settings;
use vcuda_manager_core::allocation::{
    answer, container_config, finish, gpu_answer, parse_ids, plan, Allocation, Answer, DeviceError,
    FinishError, Holdings, Layout, Owner, CONTAINER_LIBRARY,
};
use vcuda_manager_core::assign::{
    actual_shape, check_assignment, AssignError, Decision, PodFacts, Shape,
};
use vcuda_manager_core::identity;
use vcuda_manager_core::ids::{AllocationId, ContainerRef, DeviceId, Kind, PodUid};
use vcuda_manager_core::inventory::Inventory;
use vcuda_manager_core::modes::{GpuSpec, ModeError, Resource, SliceId, Use};
use vcuda_manager_core::placement::{
    check_memory, preferred, preferred_on, Pairing, PlacementError,
};

/// Why an Allocate or PreStartContainer is refused, or the state cannot be opened or
/// changed. The request's own faults (devices, placement, the pod's annotations) are told
/// apart from the node's (its files, its random source), for the gRPC status
/// ([`CoreError::is_node_fault`]); each message names the container or path and what to do.
#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    #[error(transparent)]
    Device(#[from] DeviceError),
    #[error(transparent)]
    Placement(#[from] PlacementError),
    #[error(transparent)]
    Finish(#[from] FinishError),
    #[error(transparent)]
    Assignment(#[from] AssignError),
    #[error("the kubelet's PodResources API lists no container holding {resource} {device}; is --pod-resources-socket ({}) the kubelet's?", socket.display())]
    NotListed {
        resource: String,
        /// The first device ID of the call.
        device: String,
        socket: PathBuf,
    },
    #[error("{container}: vcuda-memory without vcuda-core; request {core_resource} too (1 to 99 for a share of one GPU, 100·n for whole GPUs)")]
    MemoryWithoutCore {
        /// "namespace/pod container name".
        container: String,
        core_resource: String,
    },
    #[error("{container}: its vcuda-core devices were not allocated by this manager (was its state directory {} lost?); delete the pod to allocate again", state_dir.display())]
    UnknownCores {
        container: String,
        state_dir: PathBuf,
    },
    #[error(transparent)]
    Files(#[from] FileError),
    #[error(transparent)]
    Journal(#[from] JournalError),
    #[error(transparent)]
    Region(#[from] RegionFault),
    #[error("cannot draw an allocation id from the kernel's random source: {0}; is /dev/urandom (getrandom(2)) available to the manager?")]
    RandomId(getrandom::Error),
    #[error(transparent)]
    Cdi(#[from] CdiError),
    #[error(transparent)]
    Mode(#[from] ModeError),
    #[error("{container} asks for {}: a container gets GPUs of one sharing mode (whole GPUs, slices, or vcuda-core/vcuda-memory shares), each configured its own way; ask for one of them, or split the work into containers", resources.join(" and "))]
    MixedModes {
        container: String,
        resources: Vec<String>,
    },
    #[error("the sharing-mode settings do not fit this node's GPUs: {0}")]
    ModeSettings(#[from] crate::settings::SettingsError),
}

impl CoreError {
    /// A short stable name for counting errors by kind.
    pub fn kind(&self) -> &'static str {
        match self {
            CoreError::Device(e) => e.kind(),
            CoreError::Placement(e) => e.kind(),
            CoreError::Finish(e) => e.kind(),
            CoreError::Assignment(e) => e.kind(),
            CoreError::NotListed { .. } => "not-listed",
            CoreError::MemoryWithoutCore { .. } => "memory-without-core",
            CoreError::UnknownCores { .. } => "unknown-cores",
            CoreError::Files(e) => e.kind(),
            CoreError::Journal(e) => e.kind(),
            CoreError::Region(_) => "region",
            CoreError::RandomId(_) => "random-id",
            CoreError::Cdi(e) => e.kind(),
            CoreError::Mode(e) => e.kind(),
            CoreError::MixedModes { .. } => "mixed-modes",
            CoreError::ModeSettings(e) => e.kind(),
        }
    }

    /// Whether a mode lock refused it because a GPU or device is held (by another mode, or
    /// another container): worth judging again once ended containers are released.
    pub fn is_lock_conflict(&self) -> bool {
        matches!(
            self,
            CoreError::Mode(
                ModeError::LockedToOtherMode { .. }
                    | ModeError::GpuTaken { .. }
                    | ModeError::SliceTaken { .. }
            )
        )
    }

    /// Whether the node is at fault (its files, checkpoint, region, random source), not the
    /// request: a retry of the same request may succeed once the host is fixed.
    pub fn is_node_fault(&self) -> bool {
        match self {
            CoreError::Device(_)
            | CoreError::Placement(_)
            | CoreError::Finish(_)
            | CoreError::Assignment(_)
            | CoreError::NotListed { .. }
            | CoreError::MemoryWithoutCore { .. }
            | CoreError::UnknownCores { .. }
            | CoreError::Mode(_)
            | CoreError::MixedModes { .. } => false,
            CoreError::ModeSettings(_)
            | CoreError::Files(_)
            | CoreError::Journal(_)
            | CoreError::Region(_)
            | CoreError::RandomId(_)
            | CoreError::Cdi(_) => true,
        }
    }
}

/// Why a process may not act for an allocation (register, or ask about its container). On a
/// container's socket the peer reads only a neutral refusal (`control::not_yours`); these
/// messages go to the manager's log.
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    #[error("no allocation {:?} on this node", allocation.as_str())]
    UnknownAllocation { allocation: AllocationId },
    #[error("allocation {allocation} has not been started by the kubelet")]
    NotStarted { allocation: AllocationId },
    #[error("allocation {allocation} ({owner}): the kubelet's checkpoint names no pod UID for it, so the process's cgroup cannot be checked; is --kubelet-checkpoint the kubelet's kubelet_internal_checkpoint?")]
    NoPodUid {
        allocation: AllocationId,
        /// `namespace/pod/container`.
        owner: String,
    },
    #[error("cannot read {}: {source} (has the process exited? is --proc-root the host's /proc?)", path.display())]
    Proc {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("process {host_pid} is not in the cgroup of pod {owner} (uid {uid}), which holds allocation {allocation}")]
    NotInPod {
        host_pid: u32,
        /// `namespace/pod/container`.
        owner: String,
        uid: PodUid,
        allocation: AllocationId,
    },
    #[error("process {host_pid} claims pid {pid} in its namespace, which it is not")]
    WrongPid { host_pid: u32, pid: u32 },
    #[error("process {host_pid} did not start at the time its slot says")]
    WrongStart { host_pid: u32 },
    #[error("slot {slot} of allocation {allocation} is not held by pid {pid}")]
    SlotNotHeld {
        slot: u32,
        allocation: AllocationId,
        pid: u32,
    },
    #[error(transparent)]
    Region(#[from] RegionFault),
}

impl ClaimError {
    /// A short stable name for counting errors by kind.
    pub fn kind(&self) -> &'static str {
        match self {
            ClaimError::UnknownAllocation { .. } => "unknown-allocation",
            ClaimError::NotStarted { .. } => "not-started",
            ClaimError::NoPodUid { .. } => "no-pod-uid",
            ClaimError::Proc { .. } => "proc",
            ClaimError::NotInPod { .. } => "not-in-pod",
            ClaimError::WrongPid { .. } => "wrong-pid",
            ClaimError::WrongStart { .. } => "wrong-start",
            ClaimError::SlotNotHeld { .. } => "slot-not-held",
            ClaimError::Region(_) => "region",
        }
    }
}

/// A PreStartContainer to configure ([`Core::pre_start_with`]): which devices, who the
/// container holding them is, and what the scheduler decided for it.
#[derive(Debug)]
pub struct PreStart<'a> {
    /// The resource the kubelet asks for.
    pub kind: Kind,
    /// Its device IDs.
    pub ids: &'a [String],
    /// What PodResources says the container holds; `None`: it lists no container with
    /// these devices.
    pub held: Option<Holdings>,
    /// The pod UID the kubelet's checkpoint gives; `None`: the pod's (`pod`), if any.
    pub pod_uid: Option<PodUid>,
    /// The pod as the API server shows it: its `vcuda.io/gpu-count` decides whether a split
    /// over GPUs is right, and its uid is the owner's when the kubelet's checkpoint named
    /// none; `None`: no API server (a split is refused).
    pub pod: Option<&'a PodFacts>,
    /// The scheduler's decision for the container ([`vcuda_manager_core::assign::effective`]):
    /// the devices must agree with it, unless this container was configured before (it was
    /// checked then) or `pod` is `None`.
    pub assigned: Decision,
}

/// The manager's state.
pub struct Core {
    pub settings: Settings,
    pub inventory: Inventory,
    pub layout: Layout,
    allocs: BTreeMap<AllocationId, Allocation>,
    journal: Journal,
    pairing: Pairing,
    epoch: Instant,
    /// Notified at every change of the allocations (the inventory publisher waits on it).
    pub changed: std::sync::Arc<tokio::sync::Notify>,
    /// Exchanges of identical pods' decisions not yet written to the Node's reservations:
    /// pod uid → the shares it now stands for ([`vcuda_manager_core::assign::partner`]).
    pub overrides: BTreeMap<PodUid, Vec<GpuShare>>,
    /// Each started allocation's region, opened once: at PreStartContainer, before its
    /// container exists, or (after a manager restart) by the control loop, outside the
    /// state lock. Never opened again by path while held.
    regions: BTreeMap<AllocationId, Arc<RegionFile>>,
    /// Registered processes by host pid ([`Registration`]).
    registrations: BTreeMap<u32, Registration>,
    /// The CDI spec directory (`--cdi`), if it is written or cleaned.
    cdi: Option<SpecDir>,
    /// Which sharing mode each GPU is locked to, and by which allocations (issue 19).
    pub locks: Locks,
}

impl Core {
    /// Load the checkpoint (if any) and prepare the state and run directories: the preload
    /// file every container mounts, and the allocation directories.
    pub fn open(settings: Settings, inventory: Inventory) -> Result<Core, CoreError> {
        let layout = Layout {
            state_dir: settings.state_dir.clone(),
            run_dir: settings.run_dir.clone(),
            socket_dir: settings
                .socket_path()
                .parent()
                .map(Path::to_path_buf)
                .unwrap_or_default(),
            library: settings.library.clone(),
        };
        create_dir(&layout.state_dir)?;
        create_dir(&layout.allocations_dir())?;
        create_dir(&layout.socket_dir)?;
        write_atomic(
            &layout.preload_file(),
            format!("{CONTAINER_LIBRARY}\n").as_bytes(),
            0o644,
        )?;
        let (journal, replay) = Journal::open(&layout.journal())?;
        if let Some(first) = &replay.first_skipped {
            tracing::warn!(
                checkpoint = %layout.journal().display(),
                skipped = replay.skipped,
                first = %first,
                "checkpoint lines that could not be read were dropped; their containers keep running, and PreStartContainer for them fails with a reason"
            );
        }
        let on_disk: Vec<AllocationId> = std::fs::read_dir(layout.allocations_dir())
            .map(|rd| {
                rd.flatten()
                    .map(|e| AllocationId::new(e.file_name().to_string_lossy()))
                    .collect()
            })
            .unwrap_or_default();
        // What the checkpoint does not know, no container was started with: an Allocate or
        // PreStartContainer whose record failed was refused. (A running container keeps its
        // mounts whatever happens to the host paths.)
        for orphan in on_disk
            .iter()
            .filter(|n| !replay.allocations.contains_key(*n))
        {
            let dir = layout.dir(orphan);
            match std::fs::remove_dir_all(&dir) {
                Ok(()) => {
                    tracing::info!(dir = %dir.display(), "removed an allocation directory the checkpoint does not know")
                }
                Err(e) => {
                    tracing::warn!(dir = %dir.display(), error = %e, "cannot remove an allocation directory the checkpoint does not know")
                }
            }
        }
        let cdi = SpecDir::open(settings.cdi, &settings.cdi_spec_dir)?;
        let gpus = inventory
            .gpus
            .iter()
            .map(|g| GpuSpec {
                uuid: g.uuid.clone(),
                memory: g.memory,
            })
            .collect();
        let locks = Locks::restore(
            settings.mode_settings(gpus)?,
            &read_checkpoint(&settings.kubelet_checkpoint),
            unix_now(),
        );
        if let Some(cdi) = &cdi {
            sync_cdi(cdi, &layout, &inventory, &replay.allocations);
        }
        Ok(Core {
            settings,
            inventory,
            layout,
            allocs: replay.allocations,
            journal,
            pairing: Pairing::default(),
            epoch: Instant::now(),
            changed: Default::default(),
            overrides: BTreeMap::new(),
            regions: BTreeMap::new(),
            registrations: BTreeMap::new(),
            cdi,
            locks,
        })
    }

    /// Whether Allocate writes CDI specs and returns their names.
    pub fn cdi_writes(&self) -> bool {
        self.cdi.as_ref().is_some_and(SpecDir::writes)
    }

    /// Record one allocation's current state in the checkpoint.
    fn save(&mut self, id: &AllocationId) -> Result<(), JournalError> {
        self.changed.notify_one();
        match self.allocs.get(id) {
            Some(a) => self.journal.put(a),
            None => Ok(()),
        }
    }

    /// Rewrite the checkpoint compact when it has grown (the control loop calls this, off
    /// the RPC path).
    pub fn compact_checkpoint(&mut self) -> Result<bool, JournalError> {
        self.journal.compact_if_needed(&self.allocs)
    }

    /// Make an allocation's directories (again, after a reboot emptied the run directory).
    fn make_dirs(&self, id: &AllocationId) -> Result<(), FileError> {
        for d in [self.layout.config_dir(id), self.layout.region_dir(id)] {
            create_dir(&d)?;
        }
        Ok(())
    }

    fn now(&self) -> Duration {
        self.epoch.elapsed()
    }

    pub fn allocations(&self) -> impl Iterator<Item = &Allocation> {
        self.allocs.values()
    }

    pub fn allocation(&self, id: &AllocationId) -> Option<&Allocation> {
        self.allocs.get(id)
    }

    /// GetPreferredAllocation for one container.
    pub fn preferred(
        &mut self,
        kind: Kind,
        available: &[String],
        must: &[String],
        size: usize,
    ) -> Vec<String> {
        self.preferred_with(kind, available, must, size, None)
    }

    /// GetPreferredAllocation when the GPUs are decided (`want`: UUID and how many IDs on
    /// each, from the scheduler's assignment or a `gpu-count` split); falls back to
    /// [`Core::preferred`]'s own choice when that cannot be honoured exactly.
    pub fn preferred_with(
        &mut self,
        kind: Kind,
        available: &[String],
        must: &[String],
        size: usize,
        want: Option<&[(String, usize)]>,
    ) -> Vec<String> {
        let parse = |v: &[String]| -> Vec<DeviceId> {
            v.iter()
                .filter_map(|s| DeviceId::parse(s))
                .filter(|d| d.kind == kind)
                .collect()
        };
        let now = self.now();
        if let Some(want) = want {
            match preferred_on(kind, &parse(available), &parse(must), size, want) {
                Some(ids) => {
                    if let Some(first) = ids.first() {
                        self.pairing.placed(kind, &first.uuid, now);
                    }
                    return ids.iter().map(ToString::to_string).collect();
                }
                None => tracing::info!(
                    resource = %kind.resource(&self.settings.domain),
                    size,
                    wanted = ?want,
                    "the assigned GPUs do not have these devices free; choosing by myself (PreStartContainer will judge)"
                ),
            }
        }
        let hint = self.pairing.take_hint(kind, now);
        let ids = preferred(
            &self.inventory.node,
            kind,
            &parse(available),
            &parse(must),
            size,
            hint.as_deref(),
        );
        if let Some(first) = ids.first() {
            self.pairing.placed(kind, &first.uuid, now);
        }
        ids.iter().map(ToString::to_string).collect()
    }

    /// Allocate for one container. `vcuda-core` makes (or, for the same IDs, finds) the
    /// allocation and answers its mounts; `vcuda-memory` validates and answers nothing.
    pub fn allocate(&mut self, kind: Kind, ids: &[String]) -> Result<Answer, CoreError> {
        let parsed = parse_ids(kind, ids)?;
        let now = self.now();
        if kind == Kind::Memory {
            let placed = check_memory(&self.inventory.node, &parsed)?;
            self.locks.admit(Resource::Shared(kind), ids, unix_now())?;
            self.pairing.placed(Kind::Memory, &placed.gpus[0], now);
            self.supersede(kind, ids);
            return Ok(Answer::default());
        }
        let (gpus, percent) = plan(&parsed)?;
        self.locks.admit(Resource::Shared(kind), ids, unix_now())?;
        self.pairing.placed(Kind::Core, &gpus[0], now);
        let mut sorted = ids.to_vec();
        sorted.sort();
        self.supersede(kind, ids);
        let alloc = Allocation {
            id: new_id()?,
            cores: sorted,
            gpus,
            percent,
            memory: Vec::new(),
            quota: 0,
            core_limit: None,
            owner: None,
            created: unix_now(),
            slice: false,
        };
        self.record(alloc)
    }

    /// Allocate for a container asking for whole GPUs (issue 19): the GPUs locked to whole
    /// mode for it, and the answer NVIDIA's device plugin gives (device nodes and
    /// `NVIDIA_VISIBLE_DEVICES`); no library, no config: nothing is enforced on a GPU of
    /// its own.
    pub fn allocate_whole(&mut self, ids: &[String]) -> Result<Answer, CoreError> {
        self.locks.admit(Resource::Whole, ids, unix_now())?;
        self.changed.notify_one(); // the inventory shows the GPU's mode
        let mut a = Answer::default();
        gpu_answer(&mut a, ids, &self.inventory.gpus);
        Ok(a)
    }

    /// Allocate for a container asking for slices (issue 19): n slices on n GPUs, each with
    /// a memory quota of its GPU's memory / K (the least of them, if the GPUs differ), and
    /// the same mounts as a share (the library enforces the quota).
    pub fn allocate_slices(&mut self, ids: &[String]) -> Result<Answer, CoreError> {
        let settings = self.locks.settings();
        let slices: Vec<SliceId> = match Use::parse(settings, Resource::Slice, ids)? {
            Use::Slices(s) => s,
            _ => Vec::new(),
        };
        let quota = slices
            .iter()
            .filter_map(|s| settings.slice_memory(&s.uuid))
            .min()
            .unwrap_or(0);
        let percent = settings.slice_percent().unwrap_or(100);
        self.locks.admit(Resource::Slice, ids, unix_now())?;
        self.supersede(Kind::Core, ids);
        let mut sorted = ids.to_vec();
        sorted.sort();
        let alloc = Allocation {
            id: new_id()?,
            cores: sorted,
            gpus: slices.into_iter().map(|s| s.uuid).collect(),
            percent,
            memory: Vec::new(),
            quota,
            core_limit: None,
            owner: None,
            created: unix_now(),
            slice: true,
        };
        self.record(alloc)
    }

    /// Make an allocation's directories, keep it and checkpoint it; its answer (with its
    /// CDI name when specs are written).
    fn record(&mut self, alloc: Allocation) -> Result<Answer, CoreError> {
        let id = alloc.id.clone();
        self.make_dirs(&id)?;
        let mut a = answer(&self.layout, &alloc, &self.inventory.gpus);
        self.allocs.insert(id.clone(), alloc);
        if let Err(e) = self.save(&id) {
            // Refused: nothing of it may stay behind (the kubelet retries with a new call).
            self.allocs.remove(&id);
            let _ = std::fs::remove_dir_all(self.layout.dir(&id));
            return Err(e.into());
        }
        // The same edits as a CDI spec. The answer is complete without it, so a spec that
        // cannot be written costs the container CDI, not its start: no name is returned.
        if let Some(cdi) = &self.cdi {
            match cdi.write(&id, &a) {
                Ok(name) => a.cdi_devices.extend(name),
                Err(e) => {
                    tracing::warn!(allocation = %id, error = %e, kind = e.kind(), "no CDI spec for this allocation; Allocate answers its mounts, devices and env only")
                }
            }
        }
        Ok(a)
    }

    /// The kubelet allocates only devices it has freed: an allocation holding any of `ids`
    /// belongs to a container that is gone (a deleted pod, a finished init container, an
    /// admission retried). Remove it now, so that nothing of it (its config, its owner) can be
    /// taken for the new container's.
    fn supersede(&mut self, kind: Kind, ids: &[String]) {
        let gone: Vec<AllocationId> = self
            .allocs
            .values()
            .filter(|a| {
                let mine = match kind {
                    Kind::Core => &a.cores,
                    Kind::Memory => &a.memory,
                };
                ids.iter().any(|i| mine.contains(i))
            })
            .map(|a| a.id.clone())
            .collect();
        for id in gone {
            tracing::info!(allocation = %id, "its devices were allocated again: its container is gone; removing it");
            if let Err(e) = self.remove(&id) {
                tracing::warn!(allocation = %id, error = %e, "cannot remove the allocation");
            }
        }
    }

    /// What the container holding `held` has, as a [`Shape`] (its allocation's share per GPU
    /// and its memory), unless this container was configured before (checked then).
    pub fn unchecked_shape(&self, held: &Holdings) -> Option<Shape> {
        let a = self.by_cores(&held.cores)?;
        let same = a.owned_by(held);
        let memory = parse_ids(Kind::Memory, &held.memory).ok()?;
        (!same).then(|| actual_shape(a, &memory))
    }

    /// The allocation holding these `vcuda-core` IDs.
    pub fn by_cores(&self, cores: &[String]) -> Option<&Allocation> {
        self.allocs
            .values()
            .find(|a| cores.iter().any(|c| a.cores.contains(c)))
    }

    /// PreStartContainer for an allocation already configured (the container's other
    /// resource, or a container restart): the kubelet cannot change a container's devices
    /// without a new Allocate, so there is nothing to check or write. Returns its id.
    pub fn already_started(&self, kind: Kind, ids: &[String]) -> Option<AllocationId> {
        self.allocs
            .values()
            .find(|a| {
                let mine = match kind {
                    Kind::Core => &a.cores,
                    Kind::Memory => &a.memory,
                };
                a.finished() && !ids.is_empty() && ids.iter().all(|i| mine.contains(i))
            })
            .filter(|a| self.layout.config_file(&a.id).exists())
            .map(|a| a.id.clone())
    }

    /// PreStartContainer: `held` is what PodResources says the container holds (`None`: it
    /// lists no container with these devices), `pod_uid` what the kubelet's checkpoint says.
    /// Writes the config the library reads; returns the allocation's id.
    pub fn pre_start(
        &mut self,
        kind: Kind,
        ids: &[String],
        held: Option<Holdings>,
        pod_uid: Option<PodUid>,
    ) -> Result<AllocationId, CoreError> {
        self.pre_start_with(PreStart {
            kind,
            ids,
            held,
            pod_uid,
            pod: None,
            assigned: Decision::None,
        })
    }

    /// [`Core::pre_start`] with the pod as the API server shows it and the scheduler's
    /// decision ([`PreStart`]).
    pub fn pre_start_with(&mut self, p: PreStart<'_>) -> Result<AllocationId, CoreError> {
        let PreStart {
            kind,
            ids,
            held,
            pod_uid,
            pod,
            assigned,
        } = p;
        let Some(held) = held else {
            return Err(CoreError::NotListed {
                resource: kind.resource(&self.settings.domain),
                device: ids.first().cloned().unwrap_or_default(),
                socket: self.settings.pod_resources_socket.clone(),
            });
        };
        self.one_mode(&held)?;
        if !held.slices.is_empty() {
            let id = self
                .by_cores(&held.slices)
                .map(|a| a.id.clone())
                .ok_or_else(|| CoreError::UnknownCores {
                    container: held.who(),
                    state_dir: self.settings.state_dir.clone(),
                })?;
            let quota = self.allocs[&id].quota;
            let pod_uid = pod_uid.or_else(|| pod.map(|p| p.uid.clone()).filter(|u| !u.is_empty()));
            return self.configure(&id, &held, quota, pod_uid);
        }
        if held.cores.is_empty() {
            return Err(CoreError::MemoryWithoutCore {
                container: held.who(),
                core_resource: Kind::Core.resource(&self.settings.domain),
            });
        }
        let id = self
            .by_cores(&held.cores)
            .map(|a| a.id.clone())
            .ok_or_else(|| CoreError::UnknownCores {
                container: held.who(),
                state_dir: self.settings.state_dir.clone(),
            })?;
        let alloc = &self.allocs[&id];
        let same = alloc.owned_by(&held);
        // Configured before: checked then. Otherwise the devices must agree with the decision,
        // and a decision that could not be had refuses the container.
        if let (Decision::Unverified(e), false) = (&assigned, same) {
            return Err(e.clone().into());
        }
        if let (Some(p), false) = (pod, same) {
            match assigned {
                Decision::None => {}
                Decision::Follow(shares) => {
                    let memory = parse_ids(Kind::Memory, &held.memory)?;
                    check_assignment(p, &held.container, &shares, &actual_shape(alloc, &memory))?;
                }
                Decision::Unreadable(e) | Decision::Unverified(e) => {
                    parse_ids(Kind::Memory, &held.memory)?; // a malformed memory ID is told first
                    return Err(e.into());
                }
            }
        }
        let gpu_count = match pod.map(|p| &p.gpu_count) {
            None => None,
            Some(Ok(n)) => Some(*n),
            Some(Err(e)) => return Err(e.clone().into()),
        };
        let quota = finish(&self.inventory.node, alloc, &held, gpu_count)?;
        let pod_uid = pod_uid.or_else(|| pod.map(|p| p.uid.clone()).filter(|u| !u.is_empty()));
        self.configure(&id, &held, quota, pod_uid)
    }

    /// A container gets GPUs of one mode: refuse one whose devices are of two (the whole
    /// GPU's answer and a share's config would each describe a different container).
    fn one_mode(&self, held: &Holdings) -> Result<(), CoreError> {
        let names = self.locks.settings();
        let asked: Vec<(Resource, &Vec<String>)> = vec![
            (Resource::Whole, &held.whole),
            (Resource::Slice, &held.slices),
            (Resource::Shared(Kind::Core), &held.cores),
            (Resource::Shared(Kind::Memory), &held.memory),
        ];
        let asked: Vec<Resource> = asked
            .into_iter()
            .filter(|(_, ids)| !ids.is_empty())
            .map(|(r, _)| r)
            .collect();
        let mut modes: Vec<_> = asked.iter().map(|r| r.mode()).collect();
        modes.dedup();
        if modes.len() > 1 {
            return Err(CoreError::MixedModes {
                container: held.who(),
                resources: asked.iter().map(|&r| names.resource_name(r)).collect(),
            });
        }
        Ok(())
    }

    /// Configure allocation `id` for the container holding `held`: its owner, quota and
    /// limit, its region and the config the library reads (nothing to do when it was
    /// configured for this container before: the container's other resource, a restart).
    fn configure(
        &mut self,
        id: &AllocationId,
        held: &Holdings,
        quota: u64,
        pod_uid: Option<PodUid>,
    ) -> Result<AllocationId, CoreError> {
        let id = id.clone();
        let alloc = &self.allocs[&id];
        let same = alloc.owned_by(held);
        if same && alloc.memory == held.memory && self.layout.config_file(&id).exists() {
            return Ok(id);
        }
        let owner = Owner {
            namespace: held.namespace.clone(),
            pod: held.pod.clone(),
            container: held.container.clone(),
            uid: pod_uid,
        };
        let core_limit = self.settings.core_limit.get(&owner.key()).copied();
        let alloc = self.allocs.get_mut(&id).expect("found above");
        alloc.memory = held.memory.clone();
        alloc.quota = quota;
        alloc.core_limit = core_limit;
        alloc.owner = Some(owner);
        let alloc = alloc.clone();
        let config = container_config(&alloc, &self.inventory.gpus);
        let uuids: Vec<[u8; 16]> = alloc.gpus.iter().filter_map(|u| parse_uuid(u)).collect();
        if !self.layout.region_dir(&id).exists() {
            self.make_dirs(&id)?; // the run directory was emptied (a reboot)
        }
        // Before the container exists: the one time the region is opened by its path.
        let region = RegionFile::create_or_open(&self.layout.region_file(&id), &uuids)?;
        self.regions.insert(id.clone(), Arc::new(region));
        write_atomic(
            &self.layout.config_file(&id),
            config.to_toml().as_bytes(),
            0o644,
        )?;
        self.save(&id)?;
        Ok(id)
    }

    /// The pod UID of an allocation, from the kubelet's checkpoint, when a process of it
    /// registers (kept off PreStartContainer's path).
    pub fn learn_pod_uid(&mut self, id: &AllocationId) {
        if self.allocs.get(id).is_some_and(needs_uid) {
            let entries = read_checkpoint(&self.settings.kubelet_checkpoint);
            self.apply_pod_uids(&entries);
        }
    }

    /// Whether some started allocation has no pod UID yet.
    pub fn uids_wanted(&self) -> bool {
        self.allocs.values().any(needs_uid)
    }

    /// Fill in the pod UIDs the kubelet's checkpoint `entries` give (read them with
    /// [`read_checkpoint`], outside the lock).
    pub fn apply_pod_uids(&mut self, entries: &[identity::CheckpointEntry]) {
        let resource = Kind::Core.resource(&self.settings.domain);
        let learnt: Vec<(AllocationId, PodUid)> = self
            .allocs
            .values()
            .filter(|a| needs_uid(a))
            .filter_map(|a| {
                Some((
                    a.id.clone(),
                    identity::pod_uid_of(entries, &resource, &a.cores)?,
                ))
            })
            .collect();
        for (id, uid) in learnt {
            if let Some(o) = self.allocs.get_mut(&id).and_then(|a| a.owner.as_mut()) {
                o.uid = Some(uid);
            }
            if let Err(e) = self.save(&id) {
                // Kept in memory all the same; learnt again from the kubelet's checkpoint
                // after a restart.
                tracing::warn!(allocation = %id, error = %e, "cannot record the pod UID in the checkpoint");
            }
        }
    }

    /// What checking a process against `allocation` needs, taken under the state lock;
    /// the checks themselves ([`Claimant`]) read `/proc` and the region without it.
    pub fn claimant(&mut self, allocation: &AllocationId) -> Result<Claimant, ClaimError> {
        self.learn_pod_uid(allocation);
        let alloc = self
            .allocs
            .get(allocation)
            .ok_or_else(|| ClaimError::UnknownAllocation {
                allocation: allocation.clone(),
            })?;
        let owner = alloc.owner.as_ref().ok_or_else(|| ClaimError::NotStarted {
            allocation: alloc.id.clone(),
        })?;
        let uid = owner.uid.clone().ok_or_else(|| ClaimError::NoPodUid {
            allocation: alloc.id.clone(),
            owner: owner.key(),
        })?;
        Ok(Claimant {
            allocation: alloc.id.clone(),
            owner: owner.container_ref(),
            uid,
            proc_root: self.settings.proc_root.clone(),
            region: self.regions.get(allocation).cloned(),
            region_path: self.layout.region_file(allocation),
            uuids: alloc.gpus.iter().filter_map(|u| parse_uuid(u)).collect(),
        })
    }

    /// Whether host process `host_pid` belongs to the pod holding `allocation` (see
    /// [`Claimant::check_in_pod`]; for callers that hold the lock anyway).
    pub fn check_in_pod(
        &mut self,
        allocation: &AllocationId,
        host_pid: u32,
    ) -> Result<(), ClaimError> {
        self.claimant(allocation)?.check_in_pod(host_pid)
    }

    /// The allocations' regions held open, and the started allocations that have none yet
    /// (after a manager restart), for the control loop.
    pub fn regions(&self) -> (Vec<(AllocationId, Arc<RegionFile>)>, Vec<Unopened>) {
        let mut held = Vec::new();
        let mut missing = Vec::new();
        for a in self.allocs.values().filter(|a| a.finished()) {
            match self.regions.get(&a.id) {
                Some(r) => held.push((a.id.clone(), r.clone())),
                None => missing.push(Unopened {
                    id: a.id.clone(),
                    path: self.layout.region_file(&a.id),
                    uuids: a.gpus.iter().filter_map(|u| parse_uuid(u)).collect(),
                }),
            }
        }
        (held, missing)
    }

    /// Remember a process the kernel vouched for ([`Claimant::hello`], [`Claimant::verify`]).
    pub fn register(&mut self, host_pid: u32, r: Registration) {
        if self.allocs.contains_key(&r.allocation) {
            self.registrations.insert(host_pid, r);
        }
    }

    /// Every registered process, by host pid.
    pub fn registrations(&self) -> BTreeMap<u32, Registration> {
        self.registrations.clone()
    }

    /// Forget processes that are gone (or whose pid now names another process).
    pub fn forget(&mut self, host_pids: &[u32]) {
        for p in host_pids {
            self.registrations.remove(p);
        }
    }

    /// Keep a region the control loop opened (unless PreStartContainer made one meanwhile).
    pub fn adopt_region(&mut self, id: &AllocationId, region: Arc<RegionFile>) {
        if self.allocs.contains_key(id) {
            self.regions.entry(id.clone()).or_insert(region);
        }
    }

    /// Forget an allocation whose container is gone, and its files.
    pub fn remove(&mut self, id: &AllocationId) -> Result<(), CoreError> {
        self.regions.remove(id);
        self.registrations.retain(|_, r| r.allocation != *id);
        if self.allocs.remove(id).is_some() {
            self.changed.notify_one();
            // First, and never holding up the rest: its device must not outlive it.
            if let Some(cdi) = &self.cdi {
                if let Err(e) = cdi.remove(id) {
                    tracing::warn!(allocation = %id, error = %e, kind = e.kind(), "cannot remove the allocation's CDI spec");
                }
            }
            self.journal.remove(id)?;
            remove_dir(&self.layout.dir(id))?;
        }
        Ok(())
    }
}

/// A process the manager accepted as one of an allocation's, by the kernel's word (peer
/// credentials, cgroup, namespace pid, start time): what attribution and the watchdog use,
/// never the host pid a container can write into its region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registration {
    pub allocation: AllocationId,
    /// Its pid in its container's namespace.
    pub pid: u32,
    /// Its start time (clock ticks since boot): with the host pid, names the process.
    pub start_time: u64,
}

/// A started allocation whose region the manager does not hold open yet.
pub struct Unopened {
    pub id: AllocationId,
    pub path: PathBuf,
    pub uuids: Vec<[u8; 16]>,
}

/// A process's claim on an allocation, checked against the kernel's view of it outside the
/// state lock ([`Core::claimant`]).
pub struct Claimant {
    pub allocation: AllocationId,
    owner: ContainerRef,
    uid: PodUid,
    proc_root: PathBuf,
    region: Option<Arc<RegionFile>>,
    region_path: PathBuf,
    uuids: Vec<[u8; 16]>,
}

impl Claimant {
    /// Whether host process `host_pid` belongs to the pod holding the allocation (its
    /// cgroup names the pod's UID): what lets it register, or ask about its container.
    pub fn check_in_pod(&self, host_pid: u32) -> Result<(), ClaimError> {
        let cgroup = read_proc(&self.proc_root.join(host_pid.to_string()).join("cgroup"))?;
        if !identity::in_pod(&cgroup, self.uid.as_str()) {
            return Err(ClaimError::NotInPod {
                host_pid,
                owner: self.owner.to_string(),
                uid: self.uid.clone(),
                allocation: self.allocation.clone(),
            });
        }
        Ok(())
    }

    /// Whether the kernel confirms that host process `host_pid` is the process a slot says:
    /// in the pod's cgroup, `pid` in its own namespace, started at `start_time`.
    pub fn verify(&self, host_pid: u32, pid: u32, start_time: u64) -> Result<(), ClaimError> {
        self.check_in_pod(host_pid)?;
        let proc_dir = self.proc_root.join(host_pid.to_string());
        if identity::innermost_pid(&read_proc(&proc_dir.join("status"))?) != Some(pid) {
            return Err(ClaimError::WrongPid { host_pid, pid });
        }
        if identity::start_time(&read_proc(&proc_dir.join("stat"))?) != Some(start_time) {
            return Err(ClaimError::WrongStart { host_pid });
        }
        Ok(())
    }

    /// A process claims the allocation over the control socket: check the claim against
    /// the host's view of the connecting process (`host_pid`, from the socket's
    /// credentials) and tell the process its host pid in its region slot. Returns what the
    /// manager then knows of it, or why not. Reads only `/proc` and the region through the
    /// descriptor the manager holds (or, right after a restart, one opened without
    /// following links); never waits.
    pub fn hello(&self, hello: &Hello, host_pid: u32) -> Result<Registration, ClaimError> {
        self.check_in_pod(host_pid)?;
        let opened;
        let region = match &self.region {
            Some(r) => r.as_ref(),
            None => {
                opened = RegionFile::open(&self.region_path, &self.uuids)?;
                &opened
            }
        };
        let snapshot = region.read()?;
        let held = snapshot.active().any(|s| {
            s.index == hello.slot
                && s.pid == hello.pid
                && s.generation == hello.generation
                && s.start_time == hello.start_time
        });
        if !held {
            return Err(ClaimError::SlotNotHeld {
                slot: hello.slot,
                allocation: self.allocation.clone(),
                pid: hello.pid,
            });
        }
        self.verify(host_pid, hello.pid, hello.start_time)?;
        region.set_host_pid(hello.slot, host_pid)?;
        Ok(Registration {
            allocation: self.allocation.clone(),
            pid: hello.pid,
            start_time: hello.start_time,
        })
    }
}

/// A fresh allocation id: 128 random bits, so that a container cannot guess another's (it
/// sees its own in its config and environment) and ids are never reused.
fn new_id() -> Result<AllocationId, CoreError> {
    let mut b = [0u8; 16];
    getrandom::fill(&mut b).map_err(CoreError::RandomId)?;
    Ok(AllocationId::new(format!(
        "a{}",
        b.iter().map(|x| format!("{x:02x}")).collect::<String>()
    )))
}

/// At start-up: remove our CDI specs whose allocation the checkpoint does not know (and our
/// temporary files), then, when specs are written, write every known allocation's again (a
/// reboot may have emptied a tmpfs spec directory, and a restarted container is created
/// with the CDI names the kubelet kept from its Allocate, which is not called again).
fn sync_cdi(
    cdi: &SpecDir,
    layout: &Layout,
    inventory: &Inventory,
    allocs: &BTreeMap<AllocationId, Allocation>,
) {
    match cdi.sweep(|id| allocs.contains_key(id)) {
        Ok(removed) => {
            for p in removed {
                tracing::info!(spec = %p.display(), "removed a CDI spec of an allocation the checkpoint does not know");
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, kind = e.kind(), "cannot clean the CDI spec directory")
        }
    }
    if !cdi.writes() {
        return;
    }
    for a in allocs.values() {
        if let Err(e) = cdi.write(&a.id, &answer(layout, a, &inventory.gpus)) {
            tracing::warn!(allocation = %a.id, error = %e, kind = e.kind(), "cannot write the allocation's CDI spec");
        }
    }
    tracing::info!(dir = %cdi.dir().display(), allocations = allocs.len(), "CDI specs are written (--cdi)");
}

fn needs_uid(a: &Allocation) -> bool {
    a.owner.as_ref().is_some_and(|o| o.uid.is_none())
}

/// The kubelet's checkpoint entries (none when it cannot be read: UIDs stay unknown).
pub fn read_checkpoint(path: &Path) -> Vec<identity::CheckpointEntry> {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|t| identity::parse_checkpoint(&t).ok())
        .unwrap_or_default()
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A file of `/proc` (the kernel's word on a process).
fn read_proc(path: &Path) -> Result<String, ClaimError> {
    std::fs::read_to_string(path).map_err(|source| ClaimError::Proc {
        path: path.to_path_buf(),
        source,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::settings::Flags;
    use clap::Parser;
    use vcuda_manager_core::allocation::Gpu;
    use vcuda_manager_core::ids::all_ids;
    use vcuda_manager_core::placement::{Link, Node};

    const U0: &str = "GPU-5a1c2e4f-0d3b-4c8a-9e61-7b2f10c3d401";
    const U1: &str = "GPU-5a1c2e4f-0d3b-4c8a-9e61-7b2f10c3d402";

    fn core(dir: &Path) -> Core {
        core_with(dir, &[])
    }

    /// [`core`] with more flags.
    fn core_with(dir: &Path, extra: &[&str]) -> Core {
        let (state, run, cdi) = (dir.join("state"), dir.join("run"), dir.join("cdi"));
        let base = [
            "m",
            "--state-dir",
            state.to_str().unwrap(),
            "--run-dir",
            run.to_str().unwrap(),
            "--core-limit",
            "ns/p0/c=60",
            "--cdi-spec-dir",
            cdi.to_str().unwrap(),
        ];
        let flags = Flags::parse_from(base.iter().chain(extra));
        let settings = Settings::load(&flags).unwrap();
        let gpus = vec![
            Gpu {
                uuid: U0.into(),
                memory: 40 << 30,
                minor: 0,
            },
            Gpu {
                uuid: U1.into(),
                memory: 40 << 30,
                minor: 1,
            },
        ];
        let inventory = Inventory {
            node: Node {
                uuids: vec![U0.into(), U1.into()],
                memory: vec![40 << 30; 2],
                links: vec![vec![Link::NvLink(12); 2]; 2],
            },
            gpus,
            numa: vec![None; 2],
            models: vec!["NVIDIA A100-SXM4-40GB".into(); 2],
            compute: vec!["8.0".into(); 2],
        };
        Core::open(settings, inventory).unwrap()
    }

    fn ids(uuid: &str, kind: Kind, skip: usize, n: usize) -> Vec<String> {
        all_ids(uuid, kind, 40 << 30)
            .into_iter()
            .skip(skip)
            .take(n)
            .map(|d| d.to_string())
            .collect()
    }

    fn held(pod: &str, cores: Vec<String>, memory: Vec<String>) -> Option<Holdings> {
        Some(Holdings {
            slices: Vec::new(),
            whole: Vec::new(),
            namespace: "ns".into(),
            pod: pod.into(),
            container: "c".into(),
            cores,
            memory,
        })
    }

    /// Issue 19: a whole GPU is answered as NVIDIA's device plugin answers it (its device
    /// node and `NVIDIA_VISIBLE_DEVICES`, no library) and locks its GPU: a share of it is
    /// refused with the reason, the other GPU still serves shares.
    #[test]
    fn a_whole_gpu_is_answered_without_the_library_and_locks_its_gpu() {
        let d = tempfile::tempdir().unwrap();
        let mut c = core_with(d.path(), &["--modes", "whole,slice,shared"]);
        let a = c.allocate_whole(&[U0.to_string()]).unwrap();
        assert!(
            a.mounts.is_empty(),
            "no library, no preload: {:?}",
            a.mounts
        );
        assert_eq!(a.envs["NVIDIA_VISIBLE_DEVICES"], U0);
        assert!(a.devices.iter().any(|n| n.host == "/dev/nvidia0"));
        assert!(!a.devices.iter().any(|n| n.host == "/dev/nvidia1"));
        assert!(!a.envs.contains_key("VCUDA_CONFIG"));
        let e = c
            .allocate(Kind::Core, &ids(U0, Kind::Core, 0, 30))
            .unwrap_err();
        assert_eq!(e.kind(), "locked-to-other-mode");
        assert!(e.is_lock_conflict() && !e.is_node_fault());
        assert!(e.to_string().contains("locked to whole mode"), "{e}");
        assert_eq!(c.allocations().count(), 0, "refused: nothing recorded");
        c.allocate(Kind::Core, &ids(U1, Kind::Core, 0, 30)).unwrap();
        let cap = c.locks.capacity();
        assert_eq!((cap.whole, cap.slices, cap.cores), (1, 0, 100));
    }

    /// Issue 19: `sgpu: 2` is two slices on two GPUs, each with a GPU's memory / K and no
    /// compute limit; PreStartContainer configures it from PodResources' sgpu entry.
    #[test]
    fn slices_get_memory_over_k_on_different_gpus_and_are_configured() {
        let d = tempfile::tempdir().unwrap();
        let mut c = core_with(d.path(), &["--modes", "slice,shared", "--slices", "2"]);
        let slices = vec![format!("{U0}-sgpu-01"), format!("{U1}-sgpu-00")];
        let a = c.allocate_slices(&slices).unwrap();
        assert!(a.mounts.iter().any(|m| m.container == CONTAINER_LIBRARY));
        let e = c
            .allocate_slices(&[format!("{U0}-sgpu-00"), format!("{U0}-sgpu-01")])
            .unwrap_err();
        assert!(
            ["slices-on-one-gpu", "slice-taken"].contains(&e.kind()),
            "{e}"
        );
        let mut h = held("p0", Vec::new(), Vec::new()).unwrap();
        h.slices = slices.clone();
        let id = c
            .pre_start(Kind::Core, &slices, Some(h.clone()), Some(PodUid::new("u")))
            .unwrap();
        let text = std::fs::read_to_string(c.layout.config_file(&id)).unwrap();
        assert_eq!(text.matches("memory_mib = 20480").count(), 2, "{text}");
        assert_eq!(text.matches("core = 100").count(), 2, "{text}");
        // A container with shares too is refused: one mode per container.
        h.cores = ids(U0, Kind::Core, 0, 10);
        let e = c.pre_start(Kind::Core, &slices, Some(h), None).unwrap_err();
        assert_eq!(e.kind(), "mixed-modes");
        assert!(
            e.to_string()
                .contains("tencent.com/sgpu and tencent.com/vcuda-core"),
            "{e}"
        );
    }

    /// `--slice-compute hard`: each slice is held to 100/K %.
    #[test]
    fn hard_slices_are_held_to_their_share_of_compute() {
        let d = tempfile::tempdir().unwrap();
        let mut c = core_with(
            d.path(),
            &[
                "--modes",
                "slice",
                "--slices",
                "4",
                "--slice-compute",
                "hard",
            ],
        );
        let slices = vec![format!("{U0}-sgpu-03")];
        c.allocate_slices(&slices).unwrap();
        let mut h = held("p0", Vec::new(), Vec::new()).unwrap();
        h.slices = slices.clone();
        let id = c.pre_start(Kind::Core, &slices, Some(h), None).unwrap();
        let text = std::fs::read_to_string(c.layout.config_file(&id)).unwrap();
        assert!(
            text.contains("memory_mib = 10240") && text.contains("core = 25"),
            "{text}"
        );
    }

    #[test]
    fn identical_replicas_get_their_own_allocation_and_config() {
        let d = tempfile::tempdir().unwrap();
        let mut c = core(d.path());
        let mut seen = Vec::new();
        for r in 0..3 {
            let cores = ids(U0, Kind::Core, r * 30, 30);
            let mem = ids(U0, Kind::Memory, r * 16, 16);
            let a = c.allocate(Kind::Core, &cores).unwrap();
            assert!(c.allocate(Kind::Memory, &mem).unwrap().mounts.is_empty());
            let id = c
                .pre_start(
                    Kind::Core,
                    &cores,
                    held(&format!("p{r}"), cores.clone(), mem.clone()),
                    Some(PodUid::new(format!("uid-{r}"))),
                )
                .unwrap();
            let cfg_dir = &a
                .mounts
                .iter()
                .find(|m| m.container == "/etc/vcuda")
                .unwrap()
                .host;
            let text = std::fs::read_to_string(cfg_dir.join("vcuda.toml")).unwrap();
            assert!(
                text.contains("memory_mib = 4096") && text.contains("core = 30"),
                "{text}"
            );
            assert!(!seen.contains(&id));
            seen.push(id);
        }
        // The other resource's PreStartContainer, and restarts, need no lookup.
        let a0 = c.allocation(&seen[0]).unwrap().clone();
        assert_eq!(
            c.already_started(Kind::Memory, &a0.memory),
            Some(seen[0].clone())
        );
        assert_eq!(
            c.already_started(Kind::Core, &a0.cores),
            Some(seen[0].clone())
        );
        assert_eq!(
            c.already_started(Kind::Core, &ids(U1, Kind::Core, 0, 5)),
            None
        );
        let first = c.allocation(&seen[0]).unwrap();
        assert_eq!(first.core_limit, Some(60), "ns/p0/c has an elastic limit");
        assert!(std::fs::read_to_string(c.layout.config_file(&seen[0]))
            .unwrap()
            .contains("core_limit = 60"));
    }

    /// A node cut off from the API server (issue 18): a new container whose pod cannot be
    /// read is refused with the reason; one configured before starts as it was checked.
    #[test]
    fn a_container_whose_pod_cannot_be_read_starts_only_if_configured_before() {
        let d = tempfile::tempdir().unwrap();
        let mut c = core(d.path());
        let cores = ids(U0, Kind::Core, 0, 30);
        let mem = ids(U0, Kind::Memory, 0, 16);
        c.allocate(Kind::Core, &cores).unwrap();
        c.allocate(Kind::Memory, &mem).unwrap();
        let unverified = || {
            Decision::Unverified(AssignError::Unverified {
                pod: "ns/p".into(),
                container: "c".into(),
                error: "connection refused".into(),
            })
        };
        let start = |c: &mut Core, assigned| {
            c.pre_start_with(PreStart {
                kind: Kind::Core,
                ids: &cores,
                held: held("p", cores.clone(), mem.clone()),
                pod_uid: None,
                pod: None,
                assigned,
            })
        };
        let e = start(&mut c, unverified()).unwrap_err();
        assert!(
            e.to_string()
                .contains("ns/p container c: the API server cannot be reached")
                && e.to_string().contains("connection refused"),
            "{e}"
        );
        let id = start(&mut c, Decision::None).unwrap();
        assert_eq!(start(&mut c, unverified()).unwrap(), id, "a restart starts");
    }

    #[test]
    fn a_restarted_manager_knows_its_allocations() {
        let d = tempfile::tempdir().unwrap();
        let cores = ids(U1, Kind::Core, 0, 50);
        let id = {
            let mut c = core(d.path());
            c.allocate(Kind::Core, &cores).unwrap();
            c.pre_start(
                Kind::Core,
                &cores,
                held("p", cores.clone(), ids(U1, Kind::Memory, 0, 8)),
                None,
            )
            .unwrap()
        };
        let mut c = core(d.path());
        let a = c.allocation(&id).expect("reloaded");
        assert_eq!((a.percent, a.quota), (50, 2 << 30));
        c.remove(&id).unwrap();
        assert!(!c.layout.dir(&id).exists());
        assert!(core(d.path()).allocation(&id).is_none());
    }

    #[test]
    fn an_allocate_whose_record_fails_leaves_nothing_behind() {
        let d = tempfile::tempdir().unwrap();
        let cores = ids(U0, Kind::Core, 0, 20);
        // 100 bytes: enough for the files a manager writes at start (an empty checkpoint,
        // the preload file), not for the ~300-byte record of an allocation.
        let code = crate::files::tests::with_file_limit(100, || {
            let mut c = core(d.path());
            let refused = matches!(
                c.allocate(Kind::Core, &cores),
                Err(CoreError::Journal(JournalError::Append { .. }))
            );
            let dirs = std::fs::read_dir(c.layout.allocations_dir())
                .unwrap()
                .count();
            refused && c.allocations().count() == 0 && dirs == 0
        });
        assert_eq!(code, 0, "refused, with no allocation and no directory left");
        // The journal was cut back: the next manager reads it whole and can allocate.
        let mut c = core(d.path());
        assert_eq!(c.allocations().count(), 0);
        c.allocate(Kind::Core, &cores).unwrap();
        assert_eq!(core(d.path()).allocations().count(), 1);
    }

    #[test]
    fn directories_the_checkpoint_does_not_know_are_collected_at_start() {
        let d = tempfile::tempdir().unwrap();
        let c = core(d.path());
        let orphan = c.layout.dir(&"a0123".into());
        std::fs::create_dir_all(orphan.join("region")).unwrap();
        std::fs::write(orphan.join("region").join("region"), b"x").unwrap();
        drop(c);
        let _c = core(d.path());
        assert!(!orphan.exists());
    }

    #[test]
    fn after_a_reboot_prestart_remakes_the_config_and_region() {
        let d = tempfile::tempdir().unwrap();
        let cores = ids(U0, Kind::Core, 0, 20);
        let mem = ids(U0, Kind::Memory, 0, 4);
        let id = {
            let mut c = core(d.path());
            c.allocate(Kind::Core, &cores).unwrap();
            c.pre_start(
                Kind::Core,
                &cores,
                held("p", cores.clone(), mem.clone()),
                None,
            )
            .unwrap()
        };
        // A reboot empties /run; the checkpoint on disk survives.
        std::fs::remove_dir_all(d.path().join("run")).unwrap();
        let mut c = core(d.path());
        assert_eq!(
            c.already_started(Kind::Core, &cores),
            None,
            "its config is gone"
        );
        let again = c
            .pre_start(
                Kind::Core,
                &cores,
                held("p", cores.clone(), mem.clone()),
                None,
            )
            .unwrap();
        assert_eq!(again, id);
        let text = std::fs::read_to_string(c.layout.config_file(&id)).unwrap();
        assert!(
            text.contains("memory_mib = 1024") && text.contains("core = 20"),
            "{text}"
        );
        assert!(c.layout.region_file(&id).exists());
        // A new allocation after the restart does not reuse the id.
        let other = ids(U1, Kind::Core, 0, 10);
        c.allocate(Kind::Core, &other).unwrap();
        assert!(c.allocations().filter(|a| a.id == id).count() == 1);
        assert_eq!(c.allocations().count(), 2);
    }

    #[test]
    fn devices_allocated_again_retire_the_allocation_that_held_them() {
        // Pod p (30 % + 1 GiB) is deleted; pod q gets the same cores and more memory. q must
        // not find p's config (p's owner, p's quota) when it starts.
        let d = tempfile::tempdir().unwrap();
        let mut c = core(d.path());
        let cores = ids(U0, Kind::Core, 0, 30);
        let (m_p, m_q) = (ids(U0, Kind::Memory, 0, 4), ids(U0, Kind::Memory, 0, 8));
        c.allocate(Kind::Core, &cores).unwrap();
        c.allocate(Kind::Memory, &m_p).unwrap();
        let p = c
            .pre_start(
                Kind::Core,
                &cores,
                held("p", cores.clone(), m_p.clone()),
                None,
            )
            .unwrap();
        let answer = c.allocate(Kind::Core, &cores).unwrap();
        assert!(c.allocation(&p).is_none() && !c.layout.dir(&p).exists());
        assert!(!answer
            .mounts
            .iter()
            .any(|m| m.host == c.layout.config_dir(&p)));
        c.allocate(Kind::Memory, &m_q).unwrap();
        assert_eq!(c.already_started(Kind::Memory, &m_q), None);
        assert_eq!(c.already_started(Kind::Core, &cores), None);
        let q = c
            .pre_start(
                Kind::Core,
                &cores,
                held("q", cores.clone(), m_q.clone()),
                None,
            )
            .unwrap();
        assert_ne!(p, q);
        assert_eq!(c.allocation(&q).unwrap().quota, 2 << 30);
        // Memory alone allocated again retires its old holder too.
        c.allocate(Kind::Memory, &m_q[..1]).unwrap();
        assert!(c.allocation(&q).is_none());
    }

    #[test]
    fn invalid_requests_are_refused_in_words() {
        let d = tempfile::tempdir().unwrap();
        let mut c = core(d.path());
        let mut cores = ids(U0, Kind::Core, 0, 100);
        cores.extend(ids(U1, Kind::Core, 0, 50));
        let e = c.allocate(Kind::Core, &cores).unwrap_err();
        assert!(
            matches!(
                e,
                CoreError::Placement(PlacementError::CoresNotShareOrWhole { total: 150 })
            ),
            "{e:?}"
        );
        assert!(!e.is_node_fault() && e.to_string().contains("150"), "{e}");
        let mut mem = ids(U0, Kind::Memory, 0, 160);
        mem.extend(ids(U1, Kind::Memory, 0, 1));
        let e = c.allocate(Kind::Memory, &mem).unwrap_err();
        assert!(e.to_string().contains("does not fit on one GPU"), "{e}");
        let e = c.allocate(Kind::Memory, &cores[..1]).unwrap_err();
        assert!(
            matches!(
                &e,
                CoreError::Device(DeviceError {
                    expected: Kind::Memory,
                    ..
                })
            ),
            "core IDs sent to the memory plugin: {e:?}"
        );
        let m = ids(U0, Kind::Memory, 0, 4);
        let e = c
            .pre_start(Kind::Memory, &m, held("p", vec![], m.clone()), None)
            .unwrap_err();
        assert!(
            matches!(&e, CoreError::MemoryWithoutCore { container, .. } if container == "ns/p container c"),
            "{e:?}"
        );
        assert!(e.to_string().contains("without vcuda-core"), "{e}");
        let e = c.pre_start(Kind::Memory, &m, None, None).unwrap_err();
        assert!(matches!(e, CoreError::NotListed { .. }), "{e:?}");
        assert!(e.to_string().contains("PodResources"), "{e}");
        // Cores no allocation of this manager holds (its state directory was lost).
        let stray = ids(U1, Kind::Core, 90, 10);
        let e = c
            .pre_start(Kind::Core, &stray, held("q", stray.clone(), vec![]), None)
            .unwrap_err();
        assert!(
            matches!(&e, CoreError::UnknownCores { container, .. } if container == "ns/q container c"),
            "{e:?}"
        );
        assert!(e.to_string().contains("delete the pod"), "{e}");
    }

    #[test]
    fn claims_on_what_is_not_the_processs_are_refused_with_the_reason() {
        let d = tempfile::tempdir().unwrap();
        let mut c = core(d.path());
        let proc_root = d.path().join("proc");
        c.settings.proc_root = proc_root.clone();
        c.settings.kubelet_checkpoint = d.path().join("no-checkpoint");
        let e = c.claimant(&"a0".into()).err().expect("refused");
        assert!(
            matches!(&e, ClaimError::UnknownAllocation { allocation } if allocation == "a0"),
            "{e:?}"
        );
        let cores = ids(U0, Kind::Core, 0, 20);
        c.allocate(Kind::Core, &cores).unwrap();
        let id = c.allocations().next().unwrap().id.clone();
        let e = c.claimant(&id).err().expect("refused");
        assert!(matches!(e, ClaimError::NotStarted { .. }), "{e:?}");
        let mem = ids(U0, Kind::Memory, 0, 4);
        c.pre_start(
            Kind::Core,
            &cores,
            held("p", cores.clone(), mem.clone()),
            None,
        )
        .unwrap();
        let e = c.claimant(&id).err().expect("refused");
        assert!(
            matches!(&e, ClaimError::NoPodUid { owner, .. } if owner == "ns/p/c"),
            "no pod UID anywhere: {e:?}"
        );
        // With the pod's UID: a process in another pod's cgroup, and one that is gone.
        let other = ids(U1, Kind::Core, 0, 20);
        c.allocate(Kind::Core, &other).unwrap();
        let id = c
            .pre_start(
                Kind::Core,
                &other,
                held("victim", other.clone(), ids(U1, Kind::Memory, 0, 4)),
                Some("uid-victim".into()),
            )
            .unwrap();
        std::fs::create_dir_all(proc_root.join("42")).unwrap();
        std::fs::write(
            proc_root.join("42").join("cgroup"),
            "0::/kubepods/burstable/poduid-attacker/ctr\n",
        )
        .unwrap();
        let e = c.check_in_pod(&id, 42).unwrap_err();
        assert!(
            matches!(&e, ClaimError::NotInPod { host_pid: 42, uid, .. } if uid == "uid-victim"),
            "{e:?}"
        );
        assert!(
            e.to_string()
                .contains("is not in the cgroup of pod ns/victim/c"),
            "{e}"
        );
        let e = c.check_in_pod(&id, 43).unwrap_err();
        assert!(
            matches!(&e, ClaimError::Proc { path, .. } if path.ends_with("43/cgroup")),
            "{e:?}"
        );
    }

    /// With CDI: Allocate writes the allocation's spec and returns its name with the mounts
    /// answer; the spec goes with the allocation; a restart removes our specs of unknown
    /// allocations (only ours) and writes the known ones' again.
    #[test]
    fn cdi_specs_follow_the_allocations() {
        let d = tempfile::tempdir().unwrap();
        let spec_dir = d.path().join("cdi");
        let names = || {
            let mut v: Vec<String> = std::fs::read_dir(&spec_dir)
                .unwrap()
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect();
            v.sort();
            v
        };
        let cores = ids(U0, Kind::Core, 0, 30);
        let mem = ids(U0, Kind::Memory, 0, 16);
        let (id, kept) = {
            let mut c = core_with(d.path(), &["--cdi", "on"]);
            assert!(c.cdi_writes());
            let a = c.allocate(Kind::Core, &cores).unwrap();
            assert!(
                !a.mounts.is_empty() && !a.envs.is_empty(),
                "the answer stays whole"
            );
            let [name] = &a.cdi_devices[..] else {
                panic!("{a:?}")
            };
            let id = c.allocations().next().unwrap().id.clone();
            assert_eq!(name, &format!("vcuda.io/allocation={id}"));
            assert!(c
                .allocate(Kind::Memory, &mem)
                .unwrap()
                .cdi_devices
                .is_empty());
            assert_eq!(names(), vec![format!("vcuda.io-allocation_{id}.json")]);
            let text = std::fs::read_to_string(spec_dir.join(&names()[0])).unwrap();
            let spec: vcuda_manager_core::cdi::Spec = serde_json::from_str(&text).unwrap();
            assert_eq!(spec, vcuda_manager_core::cdi::spec(&id, &a).unwrap());
            // The same devices allocated again: the old allocation and its spec go.
            c.allocate(Kind::Core, &cores).unwrap();
            let id2 = c.allocations().next().unwrap().id.clone();
            assert_ne!(id, id2);
            assert_eq!(names(), vec![format!("vcuda.io-allocation_{id2}.json")]);
            c.remove(&id2).unwrap();
            assert!(names().is_empty());
            c.allocate(Kind::Core, &cores).unwrap();
            let kept = c.allocations().next().unwrap().id.clone();
            (id, kept)
        };
        // Left by an earlier run: ours for an allocation gone, another vendor's; ours for
        // a known allocation lost (a reboot).
        let stale = format!("vcuda.io-allocation_{id}.json");
        std::fs::write(spec_dir.join(&stale), "{}").unwrap();
        std::fs::write(spec_dir.join("nvidia.com-gpu.json"), "{}").unwrap();
        std::fs::remove_file(spec_dir.join(format!("vcuda.io-allocation_{kept}.json"))).unwrap();
        drop(core_with(d.path(), &["--cdi", "on"]));
        assert_eq!(
            names(),
            vec![
                "nvidia.com-gpu.json".to_string(),
                format!("vcuda.io-allocation_{kept}.json")
            ]
        );
        // Off: nothing is written, no name returned; ours of gone allocations still go.
        std::fs::write(spec_dir.join(&stale), "{}").unwrap();
        let mut c = core_with(d.path(), &["--cdi", "off"]);
        assert!(!c.cdi_writes());
        c.remove(&kept).unwrap();
        let a = c.allocate(Kind::Core, &ids(U1, Kind::Core, 0, 10)).unwrap();
        assert!(a.cdi_devices.is_empty() && !a.mounts.is_empty());
        assert_eq!(names(), vec!["nvidia.com-gpu.json".to_string()]);
    }

    /// A spec that cannot be written costs CDI, not the container: the answer comes
    /// without a name.
    #[test]
    fn an_unwritable_spec_leaves_the_mounts_answer() {
        let d = tempfile::tempdir().unwrap();
        let mut c = core_with(d.path(), &["--cdi", "on"]);
        let cores = ids(U0, Kind::Core, 0, 30);
        // A directory where the next allocation's spec would go is not knowable (random
        // ids); make the directory unusable instead: a non-directory in its place.
        let spec_dir = d.path().join("cdi");
        std::fs::remove_dir(&spec_dir).unwrap();
        std::fs::write(&spec_dir, "").unwrap();
        let a = c.allocate(Kind::Core, &cores).unwrap();
        assert!(a.cdi_devices.is_empty() && !a.mounts.is_empty(), "{a:?}");
    }

    #[test]
    fn an_unreadable_checkpoint_stops_the_state_from_opening() {
        let d = tempfile::tempdir().unwrap();
        drop(core(d.path()));
        let journal = d.path().join("state").join("allocations.jsonl");
        std::fs::remove_file(&journal).unwrap();
        std::fs::create_dir(&journal).unwrap();
        let flags = Flags::parse_from([
            "m",
            "--state-dir",
            d.path().join("state").to_str().unwrap(),
            "--run-dir",
            d.path().join("run").to_str().unwrap(),
            "--cdi",
            "off",
        ]);
        let inventory = Inventory {
            node: Node {
                uuids: vec![],
                memory: vec![],
                links: vec![],
            },
            gpus: vec![],
            numa: vec![],
            models: vec![],
            compute: vec![],
        };
        let e = Core::open(Settings::load(&flags).unwrap(), inventory)
            .err()
            .expect("refused");
        assert!(
            matches!(&e, CoreError::Journal(JournalError::Read { path, .. }) if path == &journal),
            "{e:?}"
        );
        assert!(e.is_node_fault());
    }

    #[test]
    fn the_pairing_keeps_a_containers_resources_together() {
        let d = tempfile::tempdir().unwrap();
        let mut c = core(d.path());
        // GPU 0 is busier: best fit puts a 20 % share there, and its memory follows.
        let avail_c: Vec<String> = ids(U0, Kind::Core, 50, 50)
            .into_iter()
            .chain(ids(U1, Kind::Core, 0, 100))
            .collect();
        let p = c.preferred(Kind::Core, &avail_c, &[], 20);
        assert!(p.iter().all(|i| i.starts_with(U0)));
        let avail_m: Vec<String> = ids(U0, Kind::Memory, 0, 160)
            .into_iter()
            .chain(ids(U1, Kind::Memory, 100, 60))
            .collect();
        let m = c.preferred(Kind::Memory, &avail_m, &[], 8);
        assert!(
            m.iter().all(|i| i.starts_with(U0)),
            "memory follows the share: {m:?}"
        );
    }
}
