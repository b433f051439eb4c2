//! The three sharing modes of one node and the lock between them (issue 19; the mixed
//! deployment of seed 002). Pure: the node's GPUs, its settings and what the kubelet
//! allocated come in as arguments; nothing here reads a file, a clock or NVML.
//!
//! - **Whole** GPUs, resource `nvidia.com/gpu` by default (configurable): one device per GPU
//!   whose ID is the GPU's UUID, as NVIDIA's device plugin advertises them
//!   (`--device-id-strategy=uuid`, its default), so pod specs written for it run unchanged.
//! - **Slices**, `<domain>/sgpu`: each GPU split into K equal slices ([`SliceId`],
//!   `<uuid>-sgpu-NN`); a container asking for `sgpu: n` gets n slices on n *different*
//!   GPUs, each with a memory quota of the GPU's memory / K.
//! - **Shared**, `<domain>/vcuda-core` + `<domain>/vcuda-memory`, as before ([`ids`]).
//!
//! **The lock.** A GPU is [`GpuLock::Unlocked`] or locked to exactly one mode, the mode of
//! its first allocation, and stays so while any allocation of that mode holds it; when its
//! last one ends it is unlocked again. [`Modes`] keeps, per GPU, *who* holds it (the
//! caller's allocation key `K`) rather than a count, so that admitting the same allocation
//! twice (the kubelet re-allocating a container's devices) and releasing it twice change
//! nothing, and the locks can be rebuilt exactly from the live allocations
//! ([`Modes::restore`]).
//!
//! Invariants [`Modes`] keeps (property-tested against a model below):
//! - no GPU is ever held in two modes; a GPU locked to whole mode has one holder; a slice
//!   has at most one holder, and no holder has two slices of one GPU;
//! - a resource advertises ([`Modes::advertised_ids`]) every device of every GPU that is
//!   unlocked or locked to its mode, allocated ones included, and nothing of a GPU locked
//!   to another mode: a device the kubelet allocated is never withdrawn;
//! - capacity ([`Modes::capacity`]) is what is advertised, as the seed defines it (the
//!   kubelet's Capacity and Allocatable count allocated devices too); a disabled mode
//!   advertises nothing;
//! - [`Modes::admit`] is all or nothing: refused, it changes nothing.
//!
//! The kubelet allocates from its own cached view of the devices, so an Allocate can name
//! a GPU another mode locked a moment ago: [`Modes::steer`] (GetPreferredAllocation) keeps
//! away from GPUs locked elsewhere and packs GPUs already locked to the mode ("凑整") before
//! opening unlocked ones, and [`Modes::admit`] refuses a conflict with a [`ModeError`] that
//! says what happened rather than admitting it.
//!
//! [`ids`]: crate::ids

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::str::FromStr;

use crate::ids::{all_ids, memory_units, DeviceId, Kind, CORES_PER_GPU};

/// The default name of the whole-GPU resource: NVIDIA's device plugin's.
pub const WHOLE_RESOURCE: &str = "nvidia.com/gpu";
/// The least number of slices per GPU.
pub const SLICES_MIN: u32 = 2;
/// The most slices per GPU: a slice's index has two digits in its ID.
pub const SLICES_MAX: u32 = 99;

/// A sharing mode of the node's GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Mode {
    /// Whole GPUs, exclusive and unthrottled.
    Whole,
    /// K equal slices per GPU, n slices on n different GPUs.
    Slice,
    /// `vcuda-core` + `vcuda-memory` shares, many containers on one GPU.
    Shared,
}

impl Mode {
    pub const ALL: [Mode; 3] = [Mode::Whole, Mode::Slice, Mode::Shared];

    /// Its name in settings, flags, labels and messages: `whole`, `slice`, `shared`.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Whole => "whole",
            Mode::Slice => "slice",
            Mode::Shared => "shared",
        }
    }

    /// The resources it serves.
    pub fn resources(self) -> &'static [Resource] {
        match self {
            Mode::Whole => &[Resource::Whole],
            Mode::Slice => &[Resource::Slice],
            Mode::Shared => &[Resource::Shared(Kind::Core), Resource::Shared(Kind::Memory)],
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Mode {
    type Err = SettingsError;

    fn from_str(s: &str) -> Result<Mode, SettingsError> {
        Mode::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| SettingsError::UnknownMode {
                name: s.to_string(),
            })
    }
}

/// A resource the manager advertises: one for whole GPUs, one for slices, two for shares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Resource {
    Whole,
    Slice,
    Shared(Kind),
}

impl Resource {
    pub const ALL: [Resource; 4] = [
        Resource::Whole,
        Resource::Slice,
        Resource::Shared(Kind::Core),
        Resource::Shared(Kind::Memory),
    ];

    /// The mode it belongs to.
    pub fn mode(self) -> Mode {
        match self {
            Resource::Whole => Mode::Whole,
            Resource::Slice => Mode::Slice,
            Resource::Shared(_) => Mode::Shared,
        }
    }
}

/// Whether a slice's compute is limited.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SliceCompute {
    /// No compute limit, as in the seed: only memory is divided.
    #[default]
    Unlimited,
    /// A hard limit of 100/K % per slice.
    Hard,
}

/// One GPU as the modes see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuSpec {
    pub uuid: String,
    /// Device memory, bytes.
    pub memory: u64,
}

/// A node's mode settings (validated by [`Settings::new`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// The domain of `sgpu`, `vcuda-core` and `vcuda-memory` (e.g. `tencent.com`).
    domain: String,
    /// The whole-GPU resource's name ([`WHOLE_RESOURCE`] by default).
    whole_resource: String,
    enabled: BTreeSet<Mode>,
    /// K: slices per GPU.
    slices: u32,
    slice_compute: SliceCompute,
    /// The node's GPUs, in NVML index order.
    gpus: Vec<GpuSpec>,
}

/// The mode settings cannot be used; each message says what to change.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SettingsError {
    #[error("unknown sharing mode {name:?}: the modes are whole, slice and shared")]
    UnknownMode { name: String },
    #[error("no sharing mode is enabled: enable at least one of whole, slice and shared")]
    NoMode,
    #[error("{slices} slices per GPU: a GPU is split into {SLICES_MIN} to {SLICES_MAX} equal slices; set the slice count within that range")]
    SliceCount { slices: u32 },
    #[error("the whole-GPU resource name {name:?} is not a resource name (domain/name, e.g. nvidia.com/gpu) or is one of vcuda's own resources under {domain:?}; choose another")]
    WholeResource { name: String, domain: String },
    #[error(
        "GPU {uuid} is listed twice (or is an empty UUID); every GPU of the node once, by its UUID"
    )]
    Gpu { uuid: String },
}

impl SettingsError {
    /// A short stable name for counting errors by kind.
    pub fn kind(&self) -> &'static str {
        match self {
            SettingsError::UnknownMode { .. } => "unknown-mode",
            SettingsError::NoMode => "no-mode",
            SettingsError::SliceCount { .. } => "slice-count",
            SettingsError::WholeResource { .. } => "whole-resource",
            SettingsError::Gpu { .. } => "gpu-listed-twice",
        }
    }
}

impl Settings {
    /// Settings with the whole-GPU resource named [`WHOLE_RESOURCE`] and slices without a
    /// compute limit (change with [`Settings::with_whole_resource`] and
    /// [`Settings::with_slice_compute`]).
    pub fn new(
        domain: &str,
        enabled: &[Mode],
        slices: u32,
        gpus: Vec<GpuSpec>,
    ) -> Result<Settings, SettingsError> {
        if enabled.is_empty() {
            return Err(SettingsError::NoMode);
        }
        if !(SLICES_MIN..=SLICES_MAX).contains(&slices) {
            return Err(SettingsError::SliceCount { slices });
        }
        let mut seen = BTreeSet::new();
        if let Some(g) = gpus
            .iter()
            .find(|g| g.uuid.is_empty() || !seen.insert(g.uuid.as_str()))
        {
            return Err(SettingsError::Gpu {
                uuid: g.uuid.clone(),
            });
        }
        Ok(Settings {
            domain: domain.to_string(),
            whole_resource: WHOLE_RESOURCE.to_string(),
            enabled: enabled.iter().copied().collect(),
            slices,
            slice_compute: SliceCompute::default(),
            gpus,
        })
    }

    /// Name the whole-GPU resource `name` (`domain/name`, not one of ours).
    pub fn with_whole_resource(mut self, name: &str) -> Result<Settings, SettingsError> {
        let ours = [
            Resource::Slice,
            Resource::Shared(Kind::Core),
            Resource::Shared(Kind::Memory),
        ]
        .map(|r| self.resource_name(r));
        let shaped = name
            .split_once('/')
            .is_some_and(|(d, n)| !d.is_empty() && !n.is_empty() && !n.contains('/'));
        if !shaped || ours.iter().any(|o| o == name) {
            return Err(SettingsError::WholeResource {
                name: name.to_string(),
                domain: self.domain.clone(),
            });
        }
        self.whole_resource = name.to_string();
        Ok(self)
    }

    pub fn with_slice_compute(mut self, compute: SliceCompute) -> Settings {
        self.slice_compute = compute;
        self
    }

    pub fn enabled(&self, mode: Mode) -> bool {
        self.enabled.contains(&mode)
    }

    /// K: slices per GPU.
    pub fn slices(&self) -> u32 {
        self.slices
    }

    pub fn gpus(&self) -> &[GpuSpec] {
        &self.gpus
    }

    /// A resource's name: `nvidia.com/gpu` (or as configured), `<domain>/sgpu`,
    /// `<domain>/vcuda-core`, `<domain>/vcuda-memory`.
    pub fn resource_name(&self, resource: Resource) -> String {
        match resource {
            Resource::Whole => self.whole_resource.clone(),
            Resource::Slice => format!("{}/sgpu", self.domain),
            Resource::Shared(kind) => kind.resource(&self.domain),
        }
    }

    /// Which of our resources `name` is (e.g. a kubelet checkpoint entry's resource).
    pub fn resource_of(&self, name: &str) -> Option<Resource> {
        Resource::ALL
            .into_iter()
            .find(|&r| self.resource_name(r) == name)
    }

    /// A slice's memory quota on GPU `uuid`, bytes: its memory / K.
    pub fn slice_memory(&self, uuid: &str) -> Option<u64> {
        self.index_of(uuid)
            .map(|g| self.gpus[g].memory / u64::from(self.slices))
    }

    /// A slice's compute limit, percent: `None` when unlimited, else 100/K.
    pub fn slice_percent(&self) -> Option<u32> {
        match self.slice_compute {
            SliceCompute::Unlimited => None,
            SliceCompute::Hard => Some(CORES_PER_GPU / self.slices),
        }
    }

    /// The resources of `mode` as messages name them (`a/vcuda-core / a/vcuda-memory`).
    fn mode_resources(&self, mode: Mode) -> String {
        mode.resources()
            .iter()
            .map(|&r| self.resource_name(r))
            .collect::<Vec<_>>()
            .join(" / ")
    }

    fn index_of(&self, uuid: &str) -> Option<usize> {
        self.gpus.iter().position(|g| g.uuid == uuid)
    }

    /// Devices a resource has on one GPU.
    fn devices_per_gpu(&self, resource: Resource, g: usize) -> u64 {
        match resource {
            Resource::Whole => 1,
            Resource::Slice => u64::from(self.slices),
            Resource::Shared(Kind::Core) => u64::from(CORES_PER_GPU),
            Resource::Shared(Kind::Memory) => u64::from(memory_units(self.gpus[g].memory)),
        }
    }
}

/// A slice's device ID: `<GPU UUID>-sgpu-NN`, NN the slice's index (0..K, two digits).
/// Stable across restarts like [`DeviceId`], ≤ 63 characters for a `GPU-<uuid>` UUID, and
/// never parsed as one of [`DeviceId`]'s (whose tags are `core` and `mem`) nor the other
/// way round.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SliceId {
    pub uuid: String,
    pub index: u32,
}

impl SliceId {
    pub fn new(uuid: &str, index: u32) -> SliceId {
        SliceId {
            uuid: uuid.to_string(),
            index,
        }
    }

    /// Parse a slice ID; `None` for anything else.
    pub fn parse(s: &str) -> Option<SliceId> {
        let (rest, index) = s.rsplit_once('-')?;
        let uuid = rest.strip_suffix("-sgpu")?;
        if index.len() != 2 || !index.bytes().all(|b| b.is_ascii_digit()) || uuid.is_empty() {
            return None;
        }
        Some(SliceId {
            uuid: uuid.to_string(),
            index: index.parse().ok()?,
        })
    }
}

impl fmt::Display for SliceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-sgpu-{:02}", self.uuid, self.index)
    }
}

/// What one allocation uses, by mode: what [`Modes::admit`] takes. Build it from the
/// kubelet's device IDs with [`Use::parse`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Use {
    /// These GPUs whole (by UUID).
    Whole(Vec<String>),
    /// These slices, each on a different GPU.
    Slices(Vec<SliceId>),
    /// Shares (cores, memory or both) of these GPUs (by UUID); which devices of a GPU does
    /// not matter to the lock.
    Shared(Vec<String>),
}

impl Use {
    pub fn mode(&self) -> Mode {
        match self {
            Use::Whole(_) => Mode::Whole,
            Use::Slices(_) => Mode::Slice,
            Use::Shared(_) => Mode::Shared,
        }
    }

    /// What the device IDs the kubelet sent for `resource` use. An ID that is not one of
    /// this node's devices of `resource` is an error naming it.
    pub fn parse(
        settings: &Settings,
        resource: Resource,
        ids: &[String],
    ) -> Result<Use, ModeError> {
        let foreign = |id: &String| ModeError::ForeignDevice {
            id: id.clone(),
            resource: settings.resource_name(resource),
        };
        let known = |uuid: &str| settings.index_of(uuid).is_some();
        match resource {
            Resource::Whole => ids
                .iter()
                .map(|id| known(id).then(|| id.clone()).ok_or_else(|| foreign(id)))
                .collect::<Result<_, _>>()
                .map(Use::Whole),
            Resource::Slice => ids
                .iter()
                .map(|id| {
                    SliceId::parse(id)
                        .filter(|s| known(&s.uuid) && s.index < settings.slices)
                        .ok_or_else(|| foreign(id))
                })
                .collect::<Result<_, _>>()
                .map(Use::Slices),
            Resource::Shared(kind) => {
                let mut gpus: Vec<String> = Vec::new();
                for id in ids {
                    let d = DeviceId::parse(id)
                        .filter(|d| d.kind == kind && known(&d.uuid))
                        .ok_or_else(|| foreign(id))?;
                    if !gpus.contains(&d.uuid) {
                        gpus.push(d.uuid);
                    }
                }
                Ok(Use::Shared(gpus))
            }
        }
    }
}

/// Why an allocation is refused: what the kubelet handed over conflicts with the lock
/// (Allocate's reason, which `kubectl describe pod` shows). Each message names the GPU, the
/// mode that holds it and what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModeError {
    #[error("{resource} is not served on this node: its {mode} mode is disabled (enabled: {enabled}); enable it in the manager's settings, or request a resource of an enabled mode")]
    Disabled {
        mode: Mode,
        resource: String,
        /// The enabled modes, comma-separated.
        enabled: String,
    },
    #[error("device {id:?} is not a {resource} device of this node (another node's, or of settings since changed: GPU UUID, slice count); delete the pod so that the kubelet allocates again")]
    ForeignDevice { id: String, resource: String },
    #[error("GPU {gpu} is locked to {holder} mode ({allocations} live allocation(s)) and cannot serve {wanted} mode ({resource}): the kubelet allocated from a view taken before the lock. Delete the pod so that it is allocated again; the GPU serves every mode again once its last {holder} allocation ends")]
    LockedToOtherMode {
        gpu: String,
        holder: Mode,
        allocations: usize,
        wanted: Mode,
        resource: String,
    },
    #[error("slice {slice} of GPU {gpu} is already held by another container in slice mode; delete the pod so that the kubelet allocates a free slice")]
    SliceTaken { slice: String, gpu: String },
    #[error("GPU {gpu} is already held whole by another container; delete the pod so that the kubelet allocates a free GPU")]
    GpuTaken { gpu: String },
    #[error("slices {} are all on GPU {gpu}, but a container asking for sgpu: n gets n slices on n different GPUs; delete the pod to retry (the scheduler extender places it where that fits), or ask for fewer slices", slices.join(", "))]
    SlicesOnOneGpu { gpu: String, slices: Vec<String> },
}

impl ModeError {
    /// A short stable name for counting errors by kind.
    pub fn kind(&self) -> &'static str {
        match self {
            ModeError::Disabled { .. } => "mode-disabled",
            ModeError::ForeignDevice { .. } => "foreign-device",
            ModeError::LockedToOtherMode { .. } => "locked-to-other-mode",
            ModeError::SliceTaken { .. } => "slice-taken",
            ModeError::GpuTaken { .. } => "gpu-taken",
            ModeError::SlicesOnOneGpu { .. } => "slices-on-one-gpu",
        }
    }
}

/// One GPU's lock: who holds it, in which mode. Never locked with no holder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GpuLock<K> {
    /// Every enabled mode may use it.
    Unlocked,
    /// Held whole by one allocation.
    Whole { holder: K },
    /// Slice index → its holder (non-empty; a holder has at most one slice here).
    Slice { slices: BTreeMap<u32, K> },
    /// Shares held by these allocations (non-empty).
    Shared { holders: BTreeSet<K> },
}

impl<K: Ord> GpuLock<K> {
    /// The mode it is locked to, `None` when unlocked.
    pub fn mode(&self) -> Option<Mode> {
        match self {
            GpuLock::Unlocked => None,
            GpuLock::Whole { .. } => Some(Mode::Whole),
            GpuLock::Slice { .. } => Some(Mode::Slice),
            GpuLock::Shared { .. } => Some(Mode::Shared),
        }
    }

    /// The live allocations holding it in its mode (0 when unlocked).
    pub fn allocations(&self) -> usize {
        match self {
            GpuLock::Unlocked => 0,
            GpuLock::Whole { .. } => 1,
            GpuLock::Slice { slices } => slices.values().collect::<BTreeSet<_>>().len(),
            GpuLock::Shared { holders } => holders.len(),
        }
    }

    /// Whether `mode` may use it: unlocked or locked to `mode`.
    pub fn serves(&self, mode: Mode) -> bool {
        self.mode().is_none_or(|m| m == mode)
    }

    fn holds(&self, key: &K) -> bool {
        match self {
            GpuLock::Unlocked => false,
            GpuLock::Whole { holder } => holder == key,
            GpuLock::Slice { slices } => slices.values().any(|h| h == key),
            GpuLock::Shared { holders } => holders.contains(key),
        }
    }
}

/// What an admission changed: the GPUs it locked (they were unlocked), whose devices of
/// the other modes leave ListAndWatch.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Admitted {
    pub locked: Vec<String>,
}

/// What a release changed: the GPUs it unlocked, whose devices of the other modes return
/// to ListAndWatch.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Released {
    pub unlocked: Vec<String>,
}

/// Capacity per resource as the kubelet will show it (Capacity = Allocatable, allocated
/// devices included).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Capacity {
    pub whole: u64,
    pub slices: u64,
    pub cores: u64,
    /// `vcuda-memory` units (256 MiB each).
    pub memory: u64,
}

impl Capacity {
    pub fn get(&self, resource: Resource) -> u64 {
        match resource {
            Resource::Whole => self.whole,
            Resource::Slice => self.slices,
            Resource::Shared(Kind::Core) => self.cores,
            Resource::Shared(Kind::Memory) => self.memory,
        }
    }
}

/// The modes of one node: its settings and each GPU's lock. `K` is the caller's key of an
/// allocation (the daemon's: one per container and resource, or per container); two
/// admissions under one key are one allocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Modes<K> {
    settings: Settings,
    /// In the settings' GPU order.
    locks: Vec<GpuLock<K>>,
}

/// [`Modes::restore`]'s result: the locks, and the allocations that could not be taken
/// back (each with why), for the daemon to log; their containers keep running.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Restored<K> {
    pub modes: Modes<K>,
    pub refused: Vec<(K, ModeError)>,
}

impl<K: Ord + Clone> Modes<K> {
    /// Every GPU unlocked.
    pub fn new(settings: Settings) -> Modes<K> {
        let locks = settings.gpus.iter().map(|_| GpuLock::Unlocked).collect();
        Modes { settings, locks }
    }

    /// The locks that the live allocations make, e.g. at start-up from the allocations the
    /// kubelet's checkpoint records for containers still running: the same state as
    /// admitting them in this order. A GPU none of them uses comes back unlocked (its
    /// allocations ended while the manager was down). An allocation that cannot be taken
    /// back (a GPU gone, a conflict a manager without locks let in) is left out and
    /// returned in `refused`.
    pub fn restore(
        settings: Settings,
        allocations: impl IntoIterator<Item = (K, Use)>,
    ) -> Restored<K> {
        let mut modes = Modes::new(settings);
        let mut refused = Vec::new();
        for (key, use_) in allocations {
            if let Err(e) = modes.admit(key.clone(), &use_) {
                refused.push((key, e));
            }
        }
        Restored { modes, refused }
    }

    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// GPU `uuid`'s lock, `None` for a GPU not of this node.
    pub fn lock(&self, uuid: &str) -> Option<&GpuLock<K>> {
        self.settings.index_of(uuid).map(|g| &self.locks[g])
    }

    /// Each GPU's UUID and lock, in the settings' order.
    pub fn locks(&self) -> impl Iterator<Item = (&str, &GpuLock<K>)> {
        self.settings
            .gpus
            .iter()
            .map(|g| g.uuid.as_str())
            .zip(&self.locks)
    }

    /// Whether the mode of `resource` is enabled and GPU `g` serves it.
    fn advertises(&self, resource: Resource, g: usize) -> bool {
        self.settings.enabled(resource.mode()) && self.locks[g].serves(resource.mode())
    }

    /// The GPUs whose devices `resource` lists in ListAndWatch: every GPU unlocked or
    /// locked to its mode; none if the mode is disabled.
    pub fn advertised(&self, resource: Resource) -> Vec<&str> {
        (0..self.locks.len())
            .filter(|&g| self.advertises(resource, g))
            .map(|g| self.settings.gpus[g].uuid.as_str())
            .collect()
    }

    /// The device IDs `resource` lists in ListAndWatch, allocated ones included.
    pub fn advertised_ids(&self, resource: Resource) -> Vec<String> {
        let mut out = Vec::new();
        for (g, gpu) in self.settings.gpus.iter().enumerate() {
            if !self.advertises(resource, g) {
                continue;
            }
            match resource {
                Resource::Whole => out.push(gpu.uuid.clone()),
                Resource::Slice => out.extend(
                    (0..self.settings.slices).map(|k| SliceId::new(&gpu.uuid, k).to_string()),
                ),
                Resource::Shared(kind) => out.extend(
                    all_ids(&gpu.uuid, kind, gpu.memory)
                        .iter()
                        .map(DeviceId::to_string),
                ),
            }
        }
        out
    }

    /// Capacity of every resource: the devices it advertises.
    pub fn capacity(&self) -> Capacity {
        let count = |r: Resource| -> u64 {
            (0..self.locks.len())
                .filter(|&g| self.advertises(r, g))
                .map(|g| self.settings.devices_per_gpu(r, g))
                .sum()
        };
        Capacity {
            whole: count(Resource::Whole),
            slices: count(Resource::Slice),
            cores: count(Resource::Shared(Kind::Core)),
            memory: count(Resource::Shared(Kind::Memory)),
        }
    }

    /// Admit allocation `key`'s use of GPUs (Allocate, or taking a restored allocation
    /// back): all of it, or nothing and the first conflict. Admitting what `key` already
    /// holds again changes nothing; more under the same key is added to its allocation.
    pub fn admit(&mut self, key: K, use_: &Use) -> Result<Admitted, ModeError> {
        let mode = use_.mode();
        if !self.settings.enabled(mode) {
            return Err(ModeError::Disabled {
                mode,
                resource: self.settings.mode_resources(mode),
                enabled: self
                    .settings
                    .enabled
                    .iter()
                    .map(|m| m.name())
                    .collect::<Vec<_>>()
                    .join(", "),
            });
        }
        // Named only in refusals (formatted then: Allocate's budget).
        let resources = || self.settings.mode_resources(mode);
        // Resolve every GPU first (an unknown one is foreign).
        let mut gpus: Vec<(usize, Option<u32>)> = Vec::new();
        let foreign = |id: String| ModeError::ForeignDevice {
            id,
            resource: resources(),
        };
        match use_ {
            Use::Whole(uuids) | Use::Shared(uuids) => {
                for u in uuids {
                    let g = self
                        .settings
                        .index_of(u)
                        .ok_or_else(|| foreign(u.clone()))?;
                    gpus.push((g, None));
                }
            }
            Use::Slices(slices) => {
                for s in slices {
                    let g = self
                        .settings
                        .index_of(&s.uuid)
                        .filter(|_| s.index < self.settings.slices)
                        .ok_or_else(|| foreign(s.to_string()))?;
                    gpus.push((g, Some(s.index)));
                }
            }
        }
        gpus.sort_unstable();
        gpus.dedup();
        // Check it all against the locks.
        for &(g, slice) in &gpus {
            let lock = &self.locks[g];
            let uuid = &self.settings.gpus[g].uuid;
            if let Some(holder) = lock.mode().filter(|&m| m != mode) {
                return Err(ModeError::LockedToOtherMode {
                    gpu: uuid.clone(),
                    holder,
                    allocations: lock.allocations(),
                    wanted: mode,
                    resource: resources(),
                });
            }
            match (lock, slice) {
                (GpuLock::Whole { holder }, _) if *holder != key => {
                    return Err(ModeError::GpuTaken { gpu: uuid.clone() });
                }
                (_, Some(k)) => {
                    let mine: Vec<u32> = match lock {
                        GpuLock::Slice { slices } => slices
                            .iter()
                            .filter(|(_, h)| **h == key)
                            .map(|(k, _)| *k)
                            .collect(),
                        _ => Vec::new(),
                    };
                    let asked: Vec<u32> = gpus
                        .iter()
                        .filter(|(h, _)| *h == g)
                        .filter_map(|(_, k)| *k)
                        .collect();
                    let together: BTreeSet<u32> = mine.iter().chain(&asked).copied().collect();
                    if together.len() > 1 {
                        return Err(ModeError::SlicesOnOneGpu {
                            gpu: uuid.clone(),
                            slices: together
                                .iter()
                                .map(|&k| SliceId::new(uuid, k).to_string())
                                .collect(),
                        });
                    }
                    if let GpuLock::Slice { slices } = lock {
                        if slices.get(&k).is_some_and(|h| *h != key) {
                            return Err(ModeError::SliceTaken {
                                slice: SliceId::new(uuid, k).to_string(),
                                gpu: uuid.clone(),
                            });
                        }
                    }
                }
                _ => {}
            }
        }
        // Take it.
        let mut admitted = Admitted::default();
        for (g, slice) in gpus {
            let lock = &mut self.locks[g];
            if matches!(lock, GpuLock::Unlocked) {
                admitted.locked.push(self.settings.gpus[g].uuid.clone());
            }
            match (lock, mode) {
                (lock @ GpuLock::Unlocked, Mode::Whole) => {
                    *lock = GpuLock::Whole {
                        holder: key.clone(),
                    }
                }
                (lock @ GpuLock::Unlocked, Mode::Slice) => {
                    *lock = GpuLock::Slice {
                        slices: [(slice.unwrap_or(0), key.clone())].into(),
                    }
                }
                (lock @ GpuLock::Unlocked, Mode::Shared) => {
                    *lock = GpuLock::Shared {
                        holders: [key.clone()].into(),
                    }
                }
                (GpuLock::Slice { slices }, _) => {
                    slices.insert(slice.unwrap_or(0), key.clone());
                }
                (GpuLock::Shared { holders }, _) => {
                    holders.insert(key.clone());
                }
                (GpuLock::Whole { .. }, _) => {} // held by `key` already
            }
        }
        Ok(admitted)
    }

    /// Allocation `key` ended (its container is gone): it lets go of every GPU it held, in
    /// every mode. Releasing an unknown key changes nothing.
    pub fn release(&mut self, key: &K) -> Released {
        let mut released = Released::default();
        for (g, lock) in self.locks.iter_mut().enumerate() {
            if !lock.holds(key) {
                continue;
            }
            let empty = match lock {
                GpuLock::Unlocked => false,
                GpuLock::Whole { .. } => true,
                GpuLock::Slice { slices } => {
                    slices.retain(|_, h| h != key);
                    slices.is_empty()
                }
                GpuLock::Shared { holders } => {
                    holders.remove(key);
                    holders.is_empty()
                }
            };
            if empty {
                *lock = GpuLock::Unlocked;
                released.unlocked.push(self.settings.gpus[g].uuid.clone());
            }
        }
        released
    }

    /// GetPreferredAllocation for `resource`: `size` IDs of `available` (the kubelet's
    /// view, possibly stale), `must_include` first. Never a device of a GPU locked to
    /// another mode, nor one not of this node, nor one this manager knows is taken (a GPU
    /// held whole, a slice held): what it adds is admitted, however old the view. GPUs
    /// already locked to the mode come before unlocked ones, so that a mode fills the GPUs
    /// it holds ("凑整") before it opens (and locks) another:
    /// - whole: unlocked GPUs in order (the daemon may rank them by topology, as
    ///   `placement::preferred` does);
    /// - slices: one slice per GPU, on GPUs holding the most slices first;
    /// - shares: one GPU, `hint` (the container's other resource's GPU) if it fits, else
    ///   the fullest GPU that fits (best fit) of the first tier that has one; whole GPUs of
    ///   `vcuda-core` (a multiple of 100) on GPUs with every core free. When nothing fits,
    ///   the rest comes from the next GPUs in that order.
    ///
    /// The answer may be shorter than `size` (the kubelet fills the rest); it is a hint and
    /// never fails.
    pub fn steer(
        &self,
        resource: Resource,
        available: &[String],
        must_include: &[String],
        size: usize,
        hint: Option<&str>,
    ) -> Vec<String> {
        let mode = resource.mode();
        // Each offered device's GPU (and slice), if it may be used.
        let gpu_of = |id: &str| -> Option<usize> {
            let uuid = match resource {
                Resource::Whole => id.to_string(),
                Resource::Slice => {
                    SliceId::parse(id)
                        .filter(|s| s.index < self.settings.slices)?
                        .uuid
                }
                Resource::Shared(kind) => DeviceId::parse(id).filter(|d| d.kind == kind)?.uuid,
            };
            self.settings
                .index_of(&uuid)
                .filter(|&g| self.advertises(resource, g))
        };
        // What this manager knows is taken (a view can be stale): a GPU held whole, a slice
        // held. Shares of a GPU are not told apart by the lock; the kubelet's view is theirs.
        let taken = |id: &str, g: usize| match &self.locks[g] {
            GpuLock::Whole { .. } => true,
            GpuLock::Slice { slices } => {
                SliceId::parse(id).is_some_and(|s| slices.contains_key(&s.index))
            }
            _ => false,
        };
        let mut per: BTreeMap<usize, Vec<&String>> = BTreeMap::new();
        for id in available {
            if let Some(g) = gpu_of(id).filter(|&g| !taken(id, g)) {
                per.entry(g).or_default().push(id);
            }
        }
        for ids in per.values_mut() {
            ids.sort();
            ids.dedup();
        }
        // Tier 0: locked to the mode; tier 1: unlocked.
        let tier = |g: usize| usize::from(self.locks[g].mode() != Some(mode));
        let mut chosen: Vec<String> = must_include.to_vec();
        let mut used: BTreeSet<usize> = must_include.iter().filter_map(|id| gpu_of(id)).collect();
        let take = |chosen: &mut Vec<String>, id: &String| {
            if chosen.len() < size && !chosen.contains(id) {
                chosen.push(id.clone());
            }
        };
        match resource {
            Resource::Whole => {
                // Every GPU left is unlocked (one held whole is taken).
                for &g in per.keys() {
                    take(&mut chosen, per[&g][0]);
                }
            }
            Resource::Slice => {
                let held = |g: usize| match &self.locks[g] {
                    GpuLock::Slice { slices } => slices.len(),
                    _ => 0,
                };
                let mut gpus: Vec<usize> =
                    per.keys().copied().filter(|g| !used.contains(g)).collect();
                gpus.sort_by_key(|&g| (tier(g), usize::MAX - held(g), g));
                for g in gpus {
                    if chosen.len() < size {
                        take(&mut chosen, per[&g][0]);
                        used.insert(g);
                    }
                }
            }
            Resource::Shared(kind) => {
                let need = size.saturating_sub(chosen.len());
                let whole = kind == Kind::Core
                    && must_include.is_empty()
                    && size >= CORES_PER_GPU as usize
                    && size.is_multiple_of(CORES_PER_GPU as usize);
                let mut order: Vec<usize> = per.keys().copied().collect();
                if whole {
                    order.retain(|g| per[g].len() >= CORES_PER_GPU as usize);
                    order.sort_by_key(|&g| (tier(g), g));
                } else {
                    let fits = |g: usize| per[&g].len() >= need;
                    let pinned = used.first().copied().or_else(|| {
                        hint.and_then(|h| self.settings.index_of(h))
                            .filter(|g| per.contains_key(g) && fits(*g))
                    });
                    // Best fit within the first tier that has a GPU it fits on; then, for
                    // what does not fit, the GPUs with most.
                    order.sort_by_key(|&g| {
                        (
                            Some(g) != pinned,
                            !fits(g),
                            tier(g),
                            if fits(g) {
                                per[&g].len()
                            } else {
                                usize::MAX - per[&g].len()
                            },
                            g,
                        )
                    });
                }
                for g in order {
                    for id in &per[&g] {
                        take(&mut chosen, id);
                    }
                }
            }
        }
        chosen.truncate(size.max(must_include.len()));
        chosen
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn uuid(g: usize) -> String {
        format!("GPU-5a1c2e4f-0d3b-4c8a-9e61-7b2f10c3d40{g}")
    }

    fn settings(n: usize, slices: u32) -> Settings {
        let gpus = (0..n)
            .map(|g| GpuSpec {
                uuid: uuid(g),
                memory: 40 * GIB,
            })
            .collect();
        Settings::new("tuya.com", &Mode::ALL, slices, gpus).unwrap()
    }

    fn cap(m: &Modes<u32>) -> (u64, u64, u64) {
        let c = m.capacity();
        (c.whole, c.slices, c.memory)
    }

    /// The devices of `resource` the kubelet sees as free: advertised, not held.
    fn free(m: &Modes<u32>, resource: Resource) -> Vec<String> {
        m.advertised_ids(resource)
            .into_iter()
            .filter(|id| match resource {
                Resource::Whole => m.lock(id).unwrap().mode().is_none(),
                Resource::Slice => {
                    let s = SliceId::parse(id).unwrap();
                    match m.lock(&s.uuid).unwrap() {
                        GpuLock::Slice { slices } => !slices.contains_key(&s.index),
                        _ => true,
                    }
                }
                Resource::Shared(_) => true,
            })
            .collect()
    }

    fn steer_admit(m: &mut Modes<u32>, key: u32, resource: Resource, size: usize) -> Use {
        let ids = m.steer(resource, &free(m, resource), &[], size, None);
        assert_eq!(ids.len(), size, "{resource:?} x{size}: {ids:?}");
        let u = Use::parse(m.settings(), resource, &ids).unwrap();
        m.admit(key, &u).unwrap();
        u
    }

    #[test]
    fn the_seeds_worked_example() {
        let mut m: Modes<u32> = Modes::new(settings(4, 2));
        // 40 GiB GPUs: 160 vcuda-memory units each.
        assert_eq!(cap(&m), (4, 8, 4 * 160));
        assert_eq!(m.capacity().cores, 400);

        // sgpu: 2 → two GPUs locked to slices.
        let a = steer_admit(&mut m, 1, Resource::Slice, 2);
        let Use::Slices(s) = &a else { panic!() };
        assert_ne!(s[0].uuid, s[1].uuid, "n slices on n different GPUs");
        assert_eq!(cap(&m), (2, 8, 2 * 160));

        // vcuda-memory: 10, steered: slices' GPUs are not offered, an unlocked one is opened.
        let b = steer_admit(&mut m, 2, Resource::Shared(Kind::Memory), 10);
        let Use::Shared(g) = &b else { panic!() };
        assert_eq!(g.len(), 1);
        assert_eq!(m.lock(&g[0]).unwrap().mode(), Some(Mode::Shared));
        assert_eq!(cap(&m), (1, 6, 2 * 160));

        // An exclusive pod takes the last unlocked GPU.
        let c = steer_admit(&mut m, 3, Resource::Whole, 1);
        assert_eq!(cap(&m), (1, 4, 160));
        assert_eq!(
            m.advertised(Resource::Whole),
            match &c {
                Use::Whole(u) => u.iter().map(String::as_str).collect::<Vec<_>>(),
                _ => panic!(),
            }
        );
        assert!(
            m.locks().all(|(_, l)| l.mode().is_some()),
            "every GPU locked"
        );

        // Nothing unlocked is left: another whole GPU has nowhere to go.
        assert_eq!(free(&m, Resource::Whole), Vec::<String>::new());

        for (key, gone) in [(1, 2), (2, 1), (3, 1)] {
            assert_eq!(m.release(&key).unlocked.len(), gone);
        }
        assert_eq!(cap(&m), (4, 8, 640));
        assert_eq!(m, Modes::new(settings(4, 2)));
    }

    #[test]
    fn refusals_name_the_gpu_the_holder_and_what_to_do() {
        let mut m: Modes<u32> = Modes::new(settings(2, 2));
        let g0 = uuid(0);
        m.admit(1, &Use::Shared(vec![g0.clone()])).unwrap();
        let e = m.admit(2, &Use::Whole(vec![g0.clone()])).unwrap_err();
        assert_eq!(e.kind(), "locked-to-other-mode");
        let msg = e.to_string();
        for part in [
            g0.as_str(),
            "locked to shared mode",
            "1 live allocation",
            "nvidia.com/gpu",
            "Delete the pod",
        ] {
            assert!(msg.contains(part), "{part:?} not in {msg}");
        }
        let e = m
            .admit(2, &Use::Slices(vec![SliceId::new(&g0, 1)]))
            .unwrap_err();
        assert_eq!(e.kind(), "locked-to-other-mode");
        assert!(e.to_string().contains("tuya.com/sgpu"), "{e}");

        // Two slices of one request on one GPU.
        let g1 = uuid(1);
        let e = m
            .admit(
                3,
                &Use::Slices(vec![SliceId::new(&g1, 0), SliceId::new(&g1, 1)]),
            )
            .unwrap_err();
        assert_eq!(e.kind(), "slices-on-one-gpu");
        assert!(
            e.to_string()
                .contains(&format!("{g1}-sgpu-00, {g1}-sgpu-01")),
            "{e}"
        );
        assert_eq!(
            m.lock(&g1),
            Some(&GpuLock::Unlocked),
            "refused: nothing changed"
        );

        // A taken slice; the same allocation again is no change; a second slice of the
        // same allocation on that GPU is refused.
        m.admit(3, &Use::Slices(vec![SliceId::new(&g1, 0)]))
            .unwrap();
        let e = m
            .admit(4, &Use::Slices(vec![SliceId::new(&g1, 0)]))
            .unwrap_err();
        assert_eq!(e.kind(), "slice-taken");
        assert!(
            e.to_string()
                .contains(&format!("slice {g1}-sgpu-00 of GPU {g1}")),
            "{e}"
        );
        let before = m.clone();
        assert_eq!(
            m.admit(3, &Use::Slices(vec![SliceId::new(&g1, 0)])),
            Ok(Admitted::default())
        );
        assert_eq!(m, before);
        assert_eq!(
            m.admit(3, &Use::Slices(vec![SliceId::new(&g1, 1)]))
                .unwrap_err()
                .kind(),
            "slices-on-one-gpu"
        );
        m.admit(4, &Use::Slices(vec![SliceId::new(&g1, 1)]))
            .unwrap();
        assert_eq!(m.lock(&g1).unwrap().allocations(), 2);
        assert_eq!(m.release(&3), Released::default(), "slice 1 still holds it");
        assert_eq!(m.release(&4).unlocked, vec![g1.clone()]);
        assert_eq!(
            m.release(&4),
            Released::default(),
            "released twice: no change"
        );

        // A GPU held whole by another.
        m.admit(5, &Use::Whole(vec![g1.clone()])).unwrap();
        assert_eq!(
            m.admit(6, &Use::Whole(vec![g1.clone()]))
                .unwrap_err()
                .kind(),
            "gpu-taken"
        );

        // Foreign devices and slice indices past K.
        for (r, id) in [
            (Resource::Whole, "GPU-other".to_string()),
            (Resource::Slice, format!("{g0}-sgpu-02")),
            (Resource::Slice, format!("{g0}-core-0001")),
            (Resource::Shared(Kind::Memory), format!("{g0}-core-0001")),
        ] {
            let e = Use::parse(m.settings(), r, std::slice::from_ref(&id)).unwrap_err();
            assert_eq!(e.kind(), "foreign-device", "{id}");
            assert!(e.to_string().contains(&id), "{e}");
        }
        assert_eq!(
            m.admit(7, &Use::Slices(vec![SliceId::new(&g0, 5)]))
                .unwrap_err()
                .kind(),
            "foreign-device"
        );
    }

    #[test]
    fn a_disabled_mode_advertises_nothing_and_admits_nothing() {
        let gpus = vec![GpuSpec {
            uuid: uuid(0),
            memory: 16 * GIB,
        }];
        let s = Settings::new("vcuda.io", &[Mode::Shared, Mode::Whole], 4, gpus).unwrap();
        let mut m: Modes<u32> = Modes::new(s);
        assert_eq!(
            m.capacity(),
            Capacity {
                whole: 1,
                slices: 0,
                cores: 100,
                memory: 64
            }
        );
        assert!(m.advertised_ids(Resource::Slice).is_empty());
        let e = m
            .admit(1, &Use::Slices(vec![SliceId::new(&uuid(0), 0)]))
            .unwrap_err();
        assert_eq!(e.kind(), "mode-disabled");
        assert!(e.to_string().contains("vcuda.io/sgpu is not served"), "{e}");
        assert!(e.to_string().contains("enabled: whole, shared"), "{e}");
        assert_eq!(m.settings().slice_memory(&uuid(0)), Some(4 * GIB));
    }

    #[test]
    fn settings_are_checked_and_name_the_resources() {
        let g = |u: &str| GpuSpec {
            uuid: u.into(),
            memory: GIB,
        };
        let e = |r: Result<Settings, SettingsError>| r.unwrap_err().kind();
        assert_eq!(e(Settings::new("d", &[], 2, vec![])), "no-mode");
        assert_eq!(e(Settings::new("d", &Mode::ALL, 1, vec![])), "slice-count");
        assert_eq!(
            e(Settings::new("d", &Mode::ALL, 100, vec![])),
            "slice-count"
        );
        assert_eq!(
            e(Settings::new("d", &Mode::ALL, 2, vec![g("a"), g("a")])),
            "gpu-listed-twice"
        );
        assert_eq!(
            e(Settings::new("d", &Mode::ALL, 2, vec![g("")])),
            "gpu-listed-twice"
        );
        let s = Settings::new("tuya.com", &Mode::ALL, 4, vec![g("a")]).unwrap();
        for bad in [
            "gpu",
            "tuya.com/sgpu",
            "tuya.com/vcuda-memory",
            "/gpu",
            "a/b/c",
        ] {
            assert_eq!(
                e(s.clone().with_whole_resource(bad)),
                "whole-resource",
                "{bad}"
            );
        }
        let s = s.with_whole_resource("example.com/gpu").unwrap();
        let names: Vec<String> = Resource::ALL.iter().map(|&r| s.resource_name(r)).collect();
        assert_eq!(
            names,
            [
                "example.com/gpu",
                "tuya.com/sgpu",
                "tuya.com/vcuda-core",
                "tuya.com/vcuda-memory"
            ]
        );
        for r in Resource::ALL {
            assert_eq!(s.resource_of(&s.resource_name(r)), Some(r));
        }
        assert_eq!(s.resource_of("nvidia.com/gpu"), None);
        assert_eq!(s.slice_percent(), None);
        assert_eq!(
            s.with_slice_compute(SliceCompute::Hard).slice_percent(),
            Some(25)
        );
        assert_eq!("slice".parse::<Mode>(), Ok(Mode::Slice));
        assert_eq!("mig".parse::<Mode>().unwrap_err().kind(), "unknown-mode");
        let d = Settings::new("d", &Mode::ALL, 2, vec![]).unwrap();
        assert_eq!(d.resource_name(Resource::Whole), WHOLE_RESOURCE);
    }

    #[test]
    fn slice_ids_round_trip_fit_the_api_limit_and_are_told_apart() {
        let u = "GPU-5a1c2e4f-0d3b-4c8a-9e61-7b2f10c3d401";
        for k in 0..SLICES_MAX {
            let id = SliceId::new(u, k);
            let s = id.to_string();
            assert!(s.len() <= 63, "{s} is {} characters", s.len());
            assert_eq!(SliceId::parse(&s), Some(id));
            assert_eq!(DeviceId::parse(&s), None, "{s} is not a core/mem ID");
        }
        assert_eq!(SliceId::new(u, 3).to_string(), format!("{u}-sgpu-03"));
        for s in [
            "".to_string(),
            u.to_string(),
            format!("{u}-sgpu-3"),
            format!("{u}-sgpu-003"),
            format!("{u}-core-0003"),
            format!("{u}-sgpu-x1"),
            "-sgpu-01".to_string(),
        ] {
            assert_eq!(SliceId::parse(&s), None, "{s:?}");
        }
        for id in all_ids(u, Kind::Core, 0) {
            assert_eq!(SliceId::parse(&id.to_string()), None);
        }
    }

    #[test]
    fn steering_packs_held_gpus_and_keeps_away_from_other_modes() {
        let mut m: Modes<u32> = Modes::new(settings(4, 4));
        // GPU 2 holds a slice; GPU 0 is shared.
        m.admit(1, &Use::Slices(vec![SliceId::new(&uuid(2), 0)]))
            .unwrap();
        m.admit(2, &Use::Shared(vec![uuid(0)])).unwrap();
        // A stale view offers every device: the answer never names GPU 0 for slices, and
        // starts on GPU 2 (already slices).
        let stale: Vec<String> = (0..4)
            .flat_map(|g| (0..4).map(move |k| SliceId::new(&uuid(g), k).to_string()))
            .filter(|id| *id != SliceId::new(&uuid(2), 0).to_string())
            .collect();
        let got = m.steer(Resource::Slice, &stale, &[], 2, None);
        assert_eq!(
            got,
            [
                SliceId::new(&uuid(2), 1).to_string(),
                SliceId::new(&uuid(1), 0).to_string()
            ]
        );
        assert_eq!(
            m.steer(Resource::Slice, &stale, &[], 9, None).len(),
            3,
            "one per GPU, GPU 0 never"
        );

        // Shares: the shared GPU first, even when an unlocked one is a better fit.
        let small = Settings::new(
            "d",
            &Mode::ALL,
            2,
            vec![
                GpuSpec {
                    uuid: uuid(0),
                    memory: 80 * GIB,
                },
                GpuSpec {
                    uuid: uuid(1),
                    memory: 16 * GIB,
                },
            ],
        )
        .unwrap();
        let mut m: Modes<u32> = Modes::new(small);
        m.admit(1, &Use::Shared(vec![uuid(0)])).unwrap();
        let offer: Vec<String> = m.advertised_ids(Resource::Shared(Kind::Memory));
        let got = m.steer(Resource::Shared(Kind::Memory), &offer, &[], 10, None);
        assert!(got.iter().all(|id| id.starts_with(&uuid(0))), "{got:?}");
        // The hint wins when it fits; whole cores go to GPUs with every core free.
        let got = m.steer(
            Resource::Shared(Kind::Memory),
            &offer,
            &[],
            10,
            Some(&uuid(1)),
        );
        assert!(got.iter().all(|id| id.starts_with(&uuid(1))), "{got:?}");
        let cores = m.advertised_ids(Resource::Shared(Kind::Core));
        let got = m.steer(Resource::Shared(Kind::Core), &cores[1..], &[], 100, None);
        assert!(got.iter().all(|id| id.starts_with(&uuid(1))), "{got:?}");
        // Whole GPUs: never the shared one, even if a stale view offers it.
        let got = m.steer(Resource::Whole, &[uuid(0), uuid(1)], &[], 2, None);
        assert_eq!(got, [uuid(1)]);
    }

    #[test]
    fn restore_rebuilds_the_locks_the_admissions_made() {
        let s = settings(4, 2);
        let allocations: Vec<(u32, Use)> = vec![
            (
                1,
                Use::Slices(vec![SliceId::new(&uuid(0), 1), SliceId::new(&uuid(1), 0)]),
            ),
            (2, Use::Shared(vec![uuid(2)])),
            (3, Use::Shared(vec![uuid(2)])),
            (4, Use::Slices(vec![SliceId::new(&uuid(0), 0)])),
            (5, Use::Whole(vec![uuid(3)])),
        ];
        let mut live: Modes<u32> = Modes::new(s.clone());
        for (k, u) in &allocations {
            live.admit(*k, u).unwrap();
        }
        let restored = Modes::restore(s.clone(), allocations.clone());
        assert!(restored.refused.is_empty());
        assert_eq!(restored.modes, live);
        assert_eq!(restored.modes.capacity(), live.capacity());

        // Allocations 1 and 5 ended while the manager was down: GPU 1 and 3 come back
        // unlocked, GPU 0 stays a slice GPU (allocation 4).
        let still: Vec<(u32, Use)> = allocations
            .iter()
            .filter(|(k, _)| ![1, 5].contains(k))
            .cloned()
            .collect();
        let r = Modes::restore(s.clone(), still);
        live.release(&1);
        live.release(&5);
        assert_eq!(r.modes, live);
        assert_eq!(r.modes.lock(&uuid(1)), Some(&GpuLock::Unlocked));
        assert_eq!(r.modes.lock(&uuid(3)), Some(&GpuLock::Unlocked));
        assert_eq!(r.modes.lock(&uuid(0)).unwrap().mode(), Some(Mode::Slice));

        // Records that conflict (a manager without locks let them in) are reported, not
        // taken; a GPU the node no longer has is foreign.
        let r = Modes::restore(
            s,
            vec![
                (1, Use::Shared(vec![uuid(0)])),
                (2, Use::Whole(vec![uuid(0)])),
                (3, Use::Whole(vec!["GPU-gone".into()])),
            ],
        );
        let kinds: Vec<(u32, &str)> = r.refused.iter().map(|(k, e)| (*k, e.kind())).collect();
        assert_eq!(kinds, [(2, "locked-to-other-mode"), (3, "foreign-device")]);
    }

    #[test]
    fn checkpoint_device_ids_parse_into_uses() {
        let s = settings(2, 2);
        let ids = |v: &[String]| v.to_vec();
        let mem: Vec<String> = all_ids(&uuid(1), Kind::Memory, 40 * GIB)[..3]
            .iter()
            .map(DeviceId::to_string)
            .collect();
        assert_eq!(
            Use::parse(&s, Resource::Shared(Kind::Memory), &mem),
            Ok(Use::Shared(vec![uuid(1)]))
        );
        let sl = [SliceId::new(&uuid(0), 1).to_string()];
        assert_eq!(
            Use::parse(&s, s.resource_of("tuya.com/sgpu").unwrap(), &ids(&sl)),
            Ok(Use::Slices(vec![SliceId::new(&uuid(0), 1)]))
        );
        assert_eq!(
            Use::parse(&s, Resource::Whole, &[uuid(0)]),
            Ok(Use::Whole(vec![uuid(0)]))
        );
    }

    // ---- The property test: random admissions of all three modes against a model. ----

    /// The model: the flat list of live claims (holder, mode, GPU, slice).
    #[derive(Debug, Clone, Default)]
    struct Model {
        claims: Vec<(u32, Mode, usize, u32)>,
    }

    impl Model {
        fn mode_of(&self, g: usize) -> Option<Mode> {
            self.claims.iter().find(|c| c.2 == g).map(|c| c.1)
        }

        /// Whether the request is admissible, and if not, the kind of the refusal.
        fn admit(
            &mut self,
            key: u32,
            mode: Mode,
            picks: &[(usize, u32)],
        ) -> Result<(), &'static str> {
            let mut picks = picks.to_vec();
            picks.sort_unstable();
            picks.dedup();
            for &(g, k) in &picks {
                if self.mode_of(g).is_some_and(|m| m != mode) {
                    return Err("locked-to-other-mode");
                }
                let on_g = |c: &&(u32, Mode, usize, u32)| c.2 == g;
                match mode {
                    Mode::Whole if self.claims.iter().filter(on_g).any(|c| c.0 != key) => {
                        return Err("gpu-taken")
                    }
                    Mode::Slice => {
                        let mut mine: BTreeSet<u32> = self
                            .claims
                            .iter()
                            .filter(on_g)
                            .filter(|c| c.0 == key)
                            .map(|c| c.3)
                            .collect();
                        mine.extend(picks.iter().filter(|p| p.0 == g).map(|p| p.1));
                        if mine.len() > 1 {
                            return Err("slices-on-one-gpu");
                        }
                        if self
                            .claims
                            .iter()
                            .filter(on_g)
                            .any(|c| c.3 == k && c.0 != key)
                        {
                            return Err("slice-taken");
                        }
                    }
                    _ => {}
                }
            }
            for (g, k) in picks {
                let c = (key, mode, g, if mode == Mode::Slice { k } else { 0 });
                if !self.claims.contains(&c) {
                    self.claims.push(c);
                }
            }
            Ok(())
        }

        fn capacity(&self, s: &Settings) -> Capacity {
            let n = |m: Mode| {
                (0..s.gpus.len())
                    .filter(|&g| self.mode_of(g).is_none_or(|x| x == m))
                    .count() as u64
            };
            Capacity {
                whole: n(Mode::Whole),
                slices: n(Mode::Slice) * u64::from(s.slices),
                cores: n(Mode::Shared) * 100,
                memory: (0..s.gpus.len())
                    .filter(|&g| self.mode_of(g).is_none_or(|x| x == Mode::Shared))
                    .map(|g| u64::from(memory_units(s.gpus[g].memory)))
                    .sum(),
            }
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        /// Admit named devices: a random (often stale) pick of GPUs and slices.
        Admit {
            mode: Mode,
            picks: Vec<(usize, u32)>,
        },
        /// Admit what steering chose from the view taken `age` operations ago.
        Steered {
            resource: Resource,
            size: usize,
            age: usize,
        },
        /// Admit what a kubelet without our preference picks from the view taken `age`
        /// operations ago: `size` of its free devices from the `skip`-th on.
        Stale {
            resource: Resource,
            size: usize,
            age: usize,
            skip: usize,
        },
        /// Release the `n`-th live allocation (modulo).
        Release { n: usize },
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        let mode = prop_oneof![Just(Mode::Whole), Just(Mode::Slice), Just(Mode::Shared)];
        let resource = || {
            prop_oneof![
                Just(Resource::Whole),
                Just(Resource::Slice),
                Just(Resource::Shared(Kind::Core)),
                Just(Resource::Shared(Kind::Memory)),
            ]
        };
        prop_oneof![
            (mode, proptest::collection::vec((0usize..4, 0u32..3), 1..3))
                .prop_map(|(mode, picks)| Op::Admit { mode, picks }),
            (resource(), 1usize..4, 0usize..3).prop_map(|(resource, size, age)| Op::Steered {
                resource,
                size,
                age
            }),
            (resource(), 1usize..4, 0usize..4, 0usize..200).prop_map(
                |(resource, size, age, skip)| Op::Stale {
                    resource,
                    size,
                    age,
                    skip
                }
            ),
            (0usize..8).prop_map(|n| Op::Release { n }),
        ]
    }

    fn pick_use(mode: Mode, picks: &[(usize, u32)]) -> Use {
        match mode {
            Mode::Whole => Use::Whole(picks.iter().map(|p| uuid(p.0)).collect()),
            Mode::Slice => Use::Slices(
                picks
                    .iter()
                    .map(|p| SliceId::new(&uuid(p.0), p.1))
                    .collect(),
            ),
            Mode::Shared => Use::Shared(picks.iter().map(|p| uuid(p.0)).collect()),
        }
    }

    fn picks_of(u: &Use, s: &Settings) -> Vec<(usize, u32)> {
        match u {
            Use::Whole(v) | Use::Shared(v) => {
                v.iter().map(|x| (s.index_of(x).unwrap(), 0)).collect()
            }
            Use::Slices(v) => v
                .iter()
                .map(|x| (s.index_of(&x.uuid).unwrap(), x.index))
                .collect(),
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(300))]
        #[test]
        fn no_gpu_is_ever_in_two_modes(ops in proptest::collection::vec(op(), 1..40)) {
            let s = Settings::new(
                "tuya.com",
                &Mode::ALL,
                3,
                (0..4).map(|g| GpuSpec { uuid: uuid(g), memory: (g as u64 + 1) * 4 * GIB }).collect(),
            ).unwrap();
            let start: Modes<u32> = Modes::new(s.clone());
            let mut m = start.clone();
            let mut model = Model::default();
            let mut live: Vec<u32> = Vec::new();
            let mut views: Vec<Modes<u32>> = vec![m.clone()];
            let mut next = 0u32;
            for op in ops {
                match op {
                    Op::Admit { mode, picks } => {
                        next += 1;
                        let got = m.admit(next, &pick_use(mode, &picks));
                        let want = model.admit(next, mode, &picks);
                        proptest::prop_assert_eq!(got.as_ref().map(|_| ()).map_err(ModeError::kind), want, "{:?} {:?}", mode, picks);
                        if want.is_ok() { live.push(next); }
                    }
                    Op::Steered { resource, size, age } | Op::Stale { resource, size, age, .. } => {
                        next += 1;
                        let view = &views[views.len().saturating_sub(1 + age)];
                        let offer = free(view, resource);
                        let steered = matches!(op, Op::Steered { .. });
                        let ids = match op {
                            Op::Stale { skip, .. } if !offer.is_empty() => {
                                let from = skip % offer.len();
                                offer[from..].iter().take(size).cloned().collect()
                            }
                            _ => m.steer(resource, &offer, &[], size, None),
                        };
                        if ids.is_empty() { continue; }
                        let u = Use::parse(&s, resource, &ids).unwrap();
                        let got = m.admit(next, &u);
                        let want = model.admit(next, resource.mode(), &picks_of(&u, &s));
                        proptest::prop_assert_eq!(got.as_ref().map(|_| ()).map_err(ModeError::kind), want);
                        if steered {
                            // Steered, from however old a view: never refused, slices apart.
                            proptest::prop_assert!(got.is_ok(), "steered from a view {} old, refused: {:?}", age, got);
                            if let Use::Slices(v) = &u {
                                let gpus: BTreeSet<&str> = v.iter().map(|x| x.uuid.as_str()).collect();
                                proptest::prop_assert_eq!(gpus.len(), v.len(), "steered slices share a GPU");
                            }
                        }
                        if let Err(e) = &got {
                            proptest::prop_assert!(["locked-to-other-mode", "slice-taken", "gpu-taken", "slices-on-one-gpu"]
                                .contains(&e.kind()), "{}", e);
                            if age == 0 && e.kind() != "slices-on-one-gpu" {
                                proptest::prop_assert!(false, "a fresh view's free devices refused: {}", e);
                            }
                        }
                        if want.is_ok() { live.push(next); }
                    }
                    Op::Release { n } => {
                        if live.is_empty() { continue; }
                        let key = live.remove(n % live.len());
                        let before: Vec<Option<Mode>> = (0..4).map(|g| model.mode_of(g)).collect();
                        model.claims.retain(|c| c.0 != key);
                        let unlocked: Vec<String> = (0..4)
                            .filter(|&g| before[g].is_some() && model.mode_of(g).is_none())
                            .map(uuid).collect();
                        proptest::prop_assert_eq!(m.release(&key).unlocked, unlocked);
                    }
                }
                // No GPU in two modes; the lock is the model's; capacity and ListAndWatch agree.
                for (g, (_, lock)) in m.locks().enumerate() {
                    let modes: BTreeSet<Mode> = model.claims.iter().filter(|c| c.2 == g).map(|c| c.1).collect();
                    proptest::prop_assert!(modes.len() <= 1, "GPU {} in modes {:?}", g, modes);
                    proptest::prop_assert_eq!(lock.mode(), modes.first().copied());
                    let holders: BTreeSet<u32> = model.claims.iter().filter(|c| c.2 == g).map(|c| c.0).collect();
                    proptest::prop_assert_eq!(lock.allocations(), holders.len());
                }
                let c = m.capacity();
                proptest::prop_assert_eq!(c, model.capacity(&s));
                for r in Resource::ALL {
                    proptest::prop_assert_eq!(m.advertised_ids(r).len() as u64, c.get(r));
                }
                views.push(m.clone());
            }
            // Restoring from the live allocations gives the same locks (up to holder
            // order within a slice GPU, which the model keeps as well).
            let allocations: Vec<(u32, Use)> = live.iter().map(|&k| {
                let mine: Vec<(usize, Mode, u32)> = model.claims.iter().filter(|c| c.0 == k).map(|c| (c.2, c.1, c.3)).collect();
                let mode = mine[0].1;
                (k, pick_use(mode, &mine.iter().map(|c| (c.0, c.2)).collect::<Vec<_>>()))
            }).collect();
            let r = Modes::restore(s.clone(), allocations);
            proptest::prop_assert!(r.refused.is_empty(), "{:?}", r.refused);
            proptest::prop_assert_eq!(&r.modes, &m);
            for k in live {
                m.release(&k);
            }
            proptest::prop_assert_eq!(m, start);
        }
    }
}
