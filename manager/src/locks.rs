//! The node's mode locks as the daemon keeps them (issue 19): the pure
//! [`Modes`](vcuda_manager_core::modes::Modes) keyed by one kubelet Allocate
//! ([`LockKey`]: a resource and the device IDs of one container), when each key was admitted
//! and whether PodResources has listed it yet, and a watch every ListAndWatch stream follows
//! (bumped whenever a GPU is locked or unlocked on a node serving more than one mode, so that
//! its devices of the other modes leave or return; on a one-mode node a lock changes no list).
//!
//! Invariants:
//! - a key is released when PodResources, having listed its devices once, lists none of them
//!   any more (the container is gone), or when it was never listed [`UNSEEN_GRACE_SECS`]
//!   after its Allocate (the kubelet failed the pod's admission after allocating it);
//! - an Allocate naming devices another key of the same resource holds releases that key
//!   first: the kubelet allocates only devices it has freed, so that container is gone;
//! - at start the locks are rebuilt from the kubelet's checkpoint (every container it has
//!   allocated devices to), each key counted as listed, so the first PodResources pass
//!   unlocks GPUs whose pods ended while the manager was down.

use std::collections::{BTreeMap, HashMap};

use tokio::sync::watch;
use tracing::{info, warn};
use vcuda_cluster::{GpuMode, NodeModes};
use vcuda_contract::view::GpuModeView;
use vcuda_manager_core::identity::CheckpointEntry;
use vcuda_manager_core::modes::{
    Capacity, GpuLock, Mode, ModeError, Modes, Resource, Settings, Use,
};

/// How long a key PodResources has never listed is kept (the kubelet lists a container's
/// devices as soon as its Allocate returned; one it never lists was refused admission).
pub const UNSEEN_GRACE_SECS: u64 = 30;

/// One kubelet Allocate of one container: the resource and its device IDs, sorted. Shared
/// (`Arc`): the locks, their bookkeeping and the device index each hold it, and a clone
/// must not copy every ID (Allocate's budget).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LockKey {
    pub resource: Resource,
    pub ids: std::sync::Arc<[String]>,
}

impl LockKey {
    pub fn new(resource: Resource, ids: &[String]) -> LockKey {
        let mut ids = ids.to_vec();
        ids.sort();
        ids.dedup();
        LockKey {
            resource,
            ids: ids.into(),
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Meta {
    admitted_unix_s: u64,
    /// [`Locks::seq`] after its admission.
    admitted_seq: u64,
    listed: bool,
}

/// When a PodResources list was asked for: the time, and how many admissions the locks had
/// seen then. A list tells nothing about a key admitted after it was asked (the kubelet
/// records a container's devices only once its Allocate returned), so such keys are
/// neither marked listed nor released by it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Asked {
    pub unix_s: u64,
    pub seq: u64,
}

/// The locks, their keys' bookkeeping and the watch of changes.
pub struct Locks {
    modes: Modes<LockKey>,
    meta: BTreeMap<LockKey, Meta>,
    /// Every device of every key in `meta`, to the key holding it: an Allocate finds the
    /// keys it supersedes by its own devices, not by a scan of every key (issue 14's budget
    /// for the manager's own time: the scan cost ~60 µs with 100 containers).
    holder: HashMap<Resource, HashMap<String, LockKey>>,
    /// Admissions so far.
    seq: u64,
    /// Bumped at every lock or unlock; ListAndWatch streams re-send their lists.
    changed: watch::Sender<u64>,
}

impl Locks {
    /// The locks the kubelet's checkpoint makes: every entry of our resources, in order.
    /// Entries that cannot be taken back (a GPU gone, a conflict) are logged and left out.
    pub fn restore(settings: Settings, entries: &[CheckpointEntry], now_unix_s: u64) -> Locks {
        let mut uses = Vec::new();
        for e in entries {
            let Some(resource) = settings.resource_of(&e.resource) else {
                continue;
            };
            match Use::parse(&settings, resource, &e.device_ids) {
                Ok(u) => uses.push((LockKey::new(resource, &e.device_ids), u)),
                Err(err) => {
                    warn!(pod = %e.pod_uid, container = %e.container, resource = %e.resource, error = %err, "a checkpointed allocation is not this node's any more; not locking for it")
                }
            }
        }
        let restored = Modes::restore(settings, uses.iter().cloned());
        for (key, err) in &restored.refused {
            warn!(resource = ?key.resource, devices = ?key.ids, error = %err, kind = err.kind(), "a checkpointed allocation conflicts with the locks; its container keeps running, unlocked");
        }
        let mut locks = Locks {
            modes: restored.modes,
            meta: BTreeMap::new(),
            holder: HashMap::new(),
            seq: 0,
            changed: watch::channel(0).0,
        };
        for (k, _) in uses {
            if !restored.refused.iter().any(|(r, _)| *r == k) {
                locks.keep(
                    k,
                    Meta {
                        admitted_unix_s: now_unix_s,
                        admitted_seq: 0,
                        listed: true,
                    },
                );
            }
        }
        for (uuid, lock) in locks.modes.locks() {
            if let Some(mode) = lock.mode() {
                info!(gpu = uuid, %mode, allocations = lock.allocations(), "GPU locked (from the kubelet's checkpoint)");
            }
        }
        locks
    }

    pub fn modes(&self) -> &Modes<LockKey> {
        &self.modes
    }

    pub fn settings(&self) -> &Settings {
        self.modes.settings()
    }

    pub fn capacity(&self) -> Capacity {
        self.modes.capacity()
    }

    /// A receiver that wakes at every lock change.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// Whether GPU `uuid` lists its devices of `resource` (its mode is enabled, and it is
    /// unlocked or locked to that mode).
    pub fn advertises(&self, resource: Resource, uuid: &str) -> bool {
        self.modes.settings().enabled(resource.mode())
            && self
                .modes
                .lock(uuid)
                .is_some_and(|l| l.serves(resource.mode()))
    }

    /// Admit one container's Allocate of `resource`: all or nothing. Keys of the same
    /// resource holding any of `ids` are released first (their containers are gone).
    pub fn admit(
        &mut self,
        resource: Resource,
        ids: &[String],
        now_unix_s: u64,
    ) -> Result<(), ModeError> {
        let use_ = Use::parse(self.modes.settings(), resource, ids)?;
        let key = LockKey::new(resource, ids);
        let mut superseded: Vec<LockKey> = key
            .ids
            .iter()
            .filter_map(|i| self.holder.get(&resource)?.get(i))
            .filter(|k| **k != key)
            .cloned()
            .collect();
        superseded.sort();
        superseded.dedup();
        let mut changed = false;
        for k in &superseded {
            info!(resource = ?k.resource, devices = ?k.ids, "its devices were allocated again: its container is gone; releasing its lock");
            changed |= self.release(k);
        }
        let result = self.modes.admit(key.clone(), &use_);
        match &result {
            Ok(admitted) => {
                self.seq += 1;
                let meta = Meta {
                    admitted_unix_s: now_unix_s,
                    admitted_seq: self.seq,
                    listed: false,
                };
                self.keep(key, meta);
                for uuid in &admitted.locked {
                    info!(gpu = %uuid, mode = %use_.mode(), "GPU locked: its devices of the other modes leave ListAndWatch");
                }
                changed |= !admitted.locked.is_empty();
            }
            Err(e) => {
                warn!(resource = ?resource, error = %e, kind = e.kind(), "Allocate refused by the mode lock")
            }
        }
        if changed {
            self.bump();
        }
        result.map(|_| ())
    }

    /// Wake the ListAndWatch streams after a GPU was locked or unlocked, when that changes
    /// what they list: on a node serving one mode a lock withdraws nothing, and re-sending
    /// every device list would only cost the kubelet and the Allocate path.
    fn bump(&self) {
        if self.multi_mode() {
            self.changed.send_modify(|n| *n += 1);
        }
    }

    fn multi_mode(&self) -> bool {
        let s = self.modes.settings();
        Mode::ALL.into_iter().filter(|&m| s.enabled(m)).count() > 1
    }

    /// Release one key; whether a GPU was unlocked (the caller bumps the watch).
    fn release(&mut self, key: &LockKey) -> bool {
        if self.meta.remove(key).is_some() {
            if let Some(held) = self.holder.get_mut(&key.resource) {
                for i in key.ids.iter() {
                    if held.get(i) == Some(key) {
                        held.remove(i);
                    }
                }
            }
        }
        let released = self.modes.release(key);
        for uuid in &released.unlocked {
            info!(gpu = %uuid, "GPU unlocked: its last allocation in its mode ended; every enabled mode lists it again");
        }
        !released.unlocked.is_empty()
    }

    /// Keep `key`'s bookkeeping (after [`Modes`] admitted it).
    fn keep(&mut self, key: LockKey, meta: Meta) {
        let held = self.holder.entry(key.resource).or_default();
        for i in key.ids.iter() {
            held.insert(i.clone(), key.clone());
        }
        self.meta.insert(key, meta);
    }

    /// Stamp a PodResources list about to be asked for (pass it to [`Locks::observe`] and
    /// [`Locks::release_gone`] with the answer).
    pub fn asked(&self, now_unix_s: u64) -> Asked {
        Asked {
            unix_s: now_unix_s,
            seq: self.seq,
        }
    }

    /// Whether releasing is worth a PodResources list now: a GPU is locked and another mode
    /// could use it once it is unlocked.
    pub fn unlock_wanted(&self) -> bool {
        self.multi_mode() && !self.meta.is_empty()
    }

    /// Mark the keys a list shows (`held(id)`: a container holds device `id`) as listed.
    pub fn observe(&mut self, held: &dyn Fn(&str) -> bool, asked: Asked) {
        for (key, meta) in self.meta.iter_mut() {
            if meta.admitted_seq <= asked.seq && key.ids.iter().any(|i| held(i)) {
                meta.listed = true;
            }
        }
    }

    /// Release what PodResources shows gone: `held(id)` says whether a container holds device
    /// `id` in a list stamped `asked`. Returns how many keys were released.
    pub fn release_gone(&mut self, held: &dyn Fn(&str) -> bool, asked: Asked) -> usize {
        self.observe(held, asked);
        let mut gone = Vec::new();
        for (key, meta) in &self.meta {
            let known = meta.admitted_seq <= asked.seq;
            if known && !key.ids.iter().any(|i| held(i)) && released_now(*meta, asked.unix_s) {
                gone.push(key.clone());
            }
        }
        let mut changed = false;
        for k in &gone {
            info!(resource = ?k.resource, devices = ?k.ids, "its container is gone: releasing its lock");
            changed |= self.release(k);
        }
        if changed {
            self.bump();
        }
        gone.len()
    }

    /// The node's modes as the inventory annotation carries them; `None` on a node serving
    /// shares only (as before modes).
    pub fn node_modes(&self) -> Option<NodeModes> {
        let s = self.modes.settings();
        let enabled: Vec<GpuMode> = Mode::ALL
            .into_iter()
            .filter(|&m| s.enabled(m))
            .map(gpu_mode)
            .collect();
        (enabled != [GpuMode::Shared]).then(|| NodeModes {
            enabled,
            slices: s.slices(),
            whole_resource: s.resource_name(Resource::Whole),
            slice_resource: s.resource_name(Resource::Slice),
        })
    }

    /// Each GPU's mode as `vcuda-smi` and `/metrics` show it.
    pub fn mode_views(&self) -> Vec<GpuModeView> {
        let s = self.modes.settings();
        let k = if s.enabled(Mode::Slice) {
            s.slices()
        } else {
            0
        };
        self.gpu_modes()
            .into_iter()
            .map(|(uuid, mode, slices_held)| {
                let serves = Mode::ALL
                    .into_iter()
                    .filter(|&m| s.enabled(m) && mode.is_none_or(|held| held == m))
                    .map(Mode::name)
                    .collect::<Vec<_>>()
                    .join(",");
                GpuModeView {
                    uuid,
                    mode: mode.map_or("", Mode::name).to_string(),
                    slices_held,
                    slices: k,
                    serves,
                }
            })
            .collect()
    }

    /// Each GPU's UUID and the mode it is locked to, with how many slices are held.
    pub fn gpu_modes(&self) -> Vec<(String, Option<Mode>, u32)> {
        self.modes
            .locks()
            .map(|(uuid, lock)| {
                let slices = match lock {
                    GpuLock::Slice { slices } => slices.len() as u32,
                    _ => 0,
                };
                (uuid.to_string(), lock.mode(), slices)
            })
            .collect()
    }
}

/// A mode as the inventory annotation names it.
pub fn gpu_mode(mode: Mode) -> GpuMode {
    match mode {
        Mode::Whole => GpuMode::Whole,
        Mode::Slice => GpuMode::Slice,
        Mode::Shared => GpuMode::Shared,
    }
}

/// Whether a key PodResources does not list (in a list asked at `listed_unix_s`) is gone:
/// listed before, or never listed and older than [`UNSEEN_GRACE_SECS`].
fn released_now(meta: Meta, listed_unix_s: u64) -> bool {
    meta.listed || listed_unix_s.saturating_sub(meta.admitted_unix_s) > UNSEEN_GRACE_SECS
}

#[cfg(test)]
mod tests {
    use super::*;
    use vcuda_manager_core::ids::{Kind, PodUid};
    use vcuda_manager_core::modes::GpuSpec;

    const G: [&str; 2] = [
        "GPU-5a1c2e4f-0d3b-4c8a-9e61-7b2f10c3d401",
        "GPU-5a1c2e4f-0d3b-4c8a-9e61-7b2f10c3d402",
    ];

    fn settings() -> Settings {
        let gpus = G
            .iter()
            .map(|u| GpuSpec {
                uuid: u.to_string(),
                memory: 4 << 30,
            })
            .collect();
        Settings::new("tencent.com", &Mode::ALL, 2, gpus).unwrap()
    }

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    /// A whole GPU's lock holds until PodResources, having listed it, lists it no more; a
    /// key never listed goes after the grace; the watch wakes at each change.
    #[test]
    fn locks_are_released_when_their_container_leaves_pod_resources() {
        let mut l = Locks::restore(settings(), &[], 0);
        let mut rx = l.subscribe();
        l.admit(Resource::Whole, &s(&[G[0]]), 100).unwrap();
        assert!(rx.has_changed().unwrap());
        rx.borrow_and_update();
        assert!(!l.advertises(Resource::Slice, G[0]));
        assert_eq!(l.capacity().slices, 2);
        // Not listed yet (the kubelet records it after Allocate returns): kept.
        assert_eq!(l.release_gone(&|_| false, l.asked(101)), 0);
        assert_eq!(
            l.release_gone(&|id| id == G[0], l.asked(102)),
            0,
            "listed now"
        );
        assert_eq!(
            l.release_gone(&|_| false, l.asked(103)),
            1,
            "listed before, gone now"
        );
        assert!(rx.has_changed().unwrap());
        assert_eq!(l.capacity().slices, 4);
        // Never listed: released after the grace only.
        l.admit(Resource::Slice, &s(&[&format!("{}-sgpu-00", G[1])]), 200)
            .unwrap();
        assert_eq!(
            l.release_gone(&|_| false, l.asked(200 + UNSEEN_GRACE_SECS)),
            0
        );
        assert_eq!(
            l.release_gone(&|_| false, l.asked(201 + UNSEEN_GRACE_SECS)),
            1
        );
        assert_eq!(l.capacity().whole, 2);
    }

    /// A list asked before an admission knows nothing of it: it neither marks it listed nor
    /// releases it, even when it shows the same devices for the container they replaced.
    #[test]
    fn a_list_older_than_an_admission_neither_lists_nor_releases_it() {
        let mut l = Locks::restore(settings(), &[], 0);
        let before = l.asked(10);
        l.admit(Resource::Whole, &s(&[G[0]]), 10).unwrap();
        l.observe(&|id| id == G[0], before);
        assert_eq!(l.release_gone(&|_| false, before), 0);
        assert_eq!(
            l.release_gone(&|_| false, l.asked(11)),
            0,
            "never listed yet"
        );
        assert_eq!(l.release_gone(&|id| id == G[0], l.asked(12)), 0);
        assert_eq!(l.release_gone(&|_| false, l.asked(13)), 1);
        assert!(!l.unlock_wanted(), "nothing locked");
    }

    /// The kubelet allocating a held device again means its holder is gone: released, and
    /// the new holder admitted; a stale view naming a GPU locked elsewhere is refused.
    #[test]
    fn a_reallocated_device_supersedes_its_old_key_and_a_conflict_is_refused() {
        let mut l = Locks::restore(settings(), &[], 0);
        let a = format!("{}-sgpu-00", G[0]);
        let b = format!("{}-sgpu-01", G[0]);
        l.admit(Resource::Slice, &s(&[&a]), 1).unwrap();
        l.admit(Resource::Slice, &s(&[&a, &format!("{}-sgpu-00", G[1])]), 2)
            .unwrap();
        assert_eq!(l.gpu_modes()[0], (G[0].to_string(), Some(Mode::Slice), 1));
        let e = l.admit(Resource::Whole, &s(&[G[0]]), 3).unwrap_err();
        assert_eq!(e.kind(), "locked-to-other-mode");
        assert!(e.to_string().contains("locked to slice mode"), "{e}");
        l.admit(Resource::Slice, &s(&[&b]), 4).unwrap();
        assert_eq!(l.gpu_modes()[0].2, 2);
    }

    /// Restart: the kubelet's checkpoint rebuilds the locks, counted as listed, so a pod that
    /// ended while the manager was down unlocks at the first PodResources pass.
    #[test]
    fn locks_come_back_from_the_kubelet_checkpoint() {
        let entry = |uid: &str, resource: &str, ids: &[&str]| CheckpointEntry {
            pod_uid: PodUid::new(uid),
            container: "c".into(),
            resource: resource.into(),
            device_ids: s(ids),
        };
        let entries = [
            entry("p1", "nvidia.com/gpu", &[G[0]]),
            entry("p2", "tencent.com/sgpu", &[&format!("{}-sgpu-01", G[1])]),
            entry("p3", "example.com/other", &["x"]),
        ];
        let mut l = Locks::restore(settings(), &entries, 50);
        assert_eq!(
            l.gpu_modes(),
            vec![
                (G[0].to_string(), Some(Mode::Whole), 0),
                (G[1].to_string(), Some(Mode::Slice), 1)
            ]
        );
        assert_eq!(
            l.release_gone(&|id| id == G[0], l.asked(51)),
            1,
            "p2 ended while down"
        );
        assert_eq!(l.gpu_modes()[1].1, None);
        assert_eq!(l.gpu_modes()[0].1, Some(Mode::Whole));
    }
    /// The device index finds exactly the keys a scan of every key would (the rule it
    /// replaced): whatever the order of admissions, supersessions, releases and restarts,
    /// every kept device maps to the one kept key holding it, and nothing else is indexed.
    #[test]
    fn the_device_index_follows_every_admission_and_release() {
        use proptest::prelude::*;
        #[derive(Debug, Clone)]
        enum Step {
            Admit(Vec<u8>),
            Release(Vec<u8>),
        }
        let step = prop_oneof![
            proptest::collection::vec(0u8..12, 1..4).prop_map(Step::Admit),
            proptest::collection::vec(0u8..12, 0..6).prop_map(Step::Release),
        ];
        let id = |n: u8| format!("{}-core-{:04}", G[usize::from(n % 2)], n);
        proptest!(|(steps in proptest::collection::vec(step, 1..40))| {
            let mut l = Locks::restore(settings(), &[], 0);
            for (t, st) in steps.iter().enumerate() {
                let now = 100 + t as u64;
                match st {
                    Step::Admit(ns) => {
                        let ids: Vec<String> = ns.iter().map(|&n| id(n)).collect();
                        let key = LockKey::new(Resource::Shared(Kind::Core), &ids);
                        let overlapping: Vec<LockKey> = l
                            .meta
                            .keys()
                            .filter(|k| **k != key && k.ids.iter().any(|i| key.ids.contains(i)))
                            .cloned()
                            .collect();
                        l.admit(Resource::Shared(Kind::Core), &ids, now).unwrap();
                        for k in &overlapping {
                            prop_assert!(!l.meta.contains_key(k), "{k:?} superseded");
                        }
                        prop_assert!(l.meta.contains_key(&key));
                    }
                    Step::Release(held) => {
                        let held: Vec<String> = held.iter().map(|&n| id(n)).collect();
                        l.release_gone(&|i| held.iter().any(|h| h == i), l.asked(now + UNSEEN_GRACE_SECS + 1));
                    }
                }
                let indexed: usize = l.holder.values().map(HashMap::len).sum();
                let kept: usize = l.meta.keys().map(|k| k.ids.len()).sum();
                prop_assert_eq!(indexed, kept);
                for k in l.meta.keys() {
                    for i in k.ids.iter() {
                        prop_assert_eq!(l.holder.get(&k.resource).and_then(|h| h.get(i)), Some(k));
                    }
                }
            }
        });
    }
}
