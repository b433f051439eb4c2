//! The manager's state: allocations, the placement pairing, and the checkpoint that lets a
//! restarted manager pick them up. Synchronous and I/O-light (its own files only): the gRPC
//! services and the control socket call into it under one lock, briefly.

use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use vcuda_contract::config::parse_uuid;
use vcuda_contract::control::Hello;
use vcuda_contract::region::Region;

use crate::allocation::{
    answer, container_config, finish, parse_ids, plan, Allocation, Answer, Holdings, Layout, Owner,
    CONTAINER_LIBRARY,
};
use crate::gpus::Inventory;
use crate::identity;
use crate::ids::{DeviceId, Kind};
use crate::placement::{check_memory, preferred, Pairing};
use crate::settings::Settings;

/// Format version of an allocation's record.
const RECORD_VERSION: u32 = 1;

/// What `<state-dir>/alloc/<id>/alloc.json` holds: the checkpoint is one small record per
/// allocation, so a change rewrites only its own.
#[derive(Serialize, Deserialize)]
struct Record {
    version: u32,
    allocation: Allocation,
}

/// The manager's state.
pub struct Core {
    pub settings: Settings,
    pub inventory: Inventory,
    pub layout: Layout,
    allocs: BTreeMap<String, Allocation>,
    pairing: Pairing,
    epoch: Instant,
    next_id: u64,
}

impl Core {
    /// Load the checkpoint (if any) and prepare the state directory: the preload file every
    /// container mounts, and the allocation directories.
    pub fn open(settings: Settings, inventory: Inventory) -> Result<Core, String> {
        let layout = Layout {
            state_dir: settings.state_dir.clone(),
            socket_dir: settings
                .socket_path()
                .parent()
                .map(Path::to_path_buf)
                .unwrap_or_default(),
            library: settings.library.clone(),
        };
        let mk = |p: &Path| {
            std::fs::create_dir_all(p).map_err(|e| format!("cannot create {}: {e}", p.display()))
        };
        mk(&layout.state_dir.join("alloc"))?;
        mk(&layout.socket_dir)?;
        write_atomic(
            &layout.preload_file(),
            format!("{CONTAINER_LIBRARY}\n").as_bytes(),
            0o644,
        )?;
        let mut core = Core {
            settings,
            inventory,
            layout,
            allocs: BTreeMap::new(),
            pairing: Pairing::default(),
            epoch: Instant::now(),
            next_id: 1,
        };
        core.load()?;
        Ok(core)
    }

    /// Read every allocation's record (a restarted manager). A record that cannot be read
    /// is reported and its allocation left alone: its container keeps running with the config
    /// it has, and the manager does not reuse its id.
    fn load(&mut self) -> Result<(), String> {
        let dir = self.layout.state_dir.join("alloc");
        let entries =
            std::fs::read_dir(&dir).map_err(|e| format!("cannot list {}: {e}", dir.display()))?;
        for e in entries.flatten() {
            let path = e.path().join("alloc.json");
            let name = e.file_name().to_string_lossy().to_string();
            if let Some(n) = name
                .rsplit_once('-')
                .and_then(|(_, n)| n.parse::<u64>().ok())
            {
                self.next_id = self.next_id.max(n + 1);
            }
            let Ok(bytes) = std::fs::read(&path) else {
                continue;
            };
            match serde_json::from_slice::<Record>(&bytes) {
                Ok(r) if r.version == RECORD_VERSION && r.allocation.id == name => {
                    self.allocs.insert(name, r.allocation);
                }
                Ok(r) => {
                    tracing::warn!(path = %path.display(), version = r.version, "allocation record of another version or id; left alone")
                }
                Err(err) => {
                    tracing::warn!(path = %path.display(), error = %err, "unreadable allocation record; left alone")
                }
            }
        }
        Ok(())
    }

    /// Write one allocation's record. Atomic (rename) but not synced: a manager crash keeps
    /// what the kernel has, and after a power loss every container starts again and the
    /// kubelet allocates afresh — so no fsync sits on Allocate's path.
    fn save(&self, id: &str) -> Result<(), String> {
        let Some(a) = self.allocs.get(id) else {
            return Ok(());
        };
        let r = Record {
            version: RECORD_VERSION,
            allocation: a.clone(),
        };
        let text = serde_json::to_vec(&r).map_err(|e| e.to_string())?;
        write_atomic(&self.layout.dir(id).join("alloc.json"), &text, 0o600)
    }

    fn now(&self) -> Duration {
        self.epoch.elapsed()
    }

    pub fn allocations(&self) -> impl Iterator<Item = &Allocation> {
        self.allocs.values()
    }

    pub fn allocation(&self, id: &str) -> Option<&Allocation> {
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
        let parse = |v: &[String]| -> Vec<DeviceId> {
            v.iter()
                .filter_map(|s| DeviceId::parse(s))
                .filter(|d| d.kind == kind)
                .collect()
        };
        let now = self.now();
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
    pub fn allocate(&mut self, kind: Kind, ids: &[String]) -> Result<Answer, String> {
        let parsed = parse_ids(kind, ids)?;
        let now = self.now();
        if kind == Kind::Memory {
            let (uuid, _) = check_memory(&self.inventory.node, &parsed)?;
            self.pairing.placed(Kind::Memory, &uuid, now);
            return Ok(Answer::default());
        }
        let (gpus, percent) = plan(&parsed)?;
        self.pairing.placed(Kind::Core, &gpus[0], now);
        let mut sorted = ids.to_vec();
        sorted.sort();
        if let Some(a) = self.allocs.values().find(|a| a.cores == sorted) {
            return Ok(answer(&self.layout, a, &self.inventory.gpus));
        }
        let id = format!("a{:x}-{}", unix_now(), self.next_id);
        self.next_id += 1;
        let alloc = Allocation {
            id: id.clone(),
            cores: sorted,
            gpus,
            percent,
            memory: Vec::new(),
            quota: 0,
            core_limit: None,
            owner: None,
            created: unix_now(),
        };
        for d in [self.layout.config_dir(&id), self.layout.region_dir(&id)] {
            std::fs::create_dir_all(&d)
                .map_err(|e| format!("cannot create {}: {e}", d.display()))?;
        }
        // The container's processes may run as any user: they create and write the region.
        let _ = std::fs::set_permissions(
            self.layout.region_dir(&id),
            std::fs::Permissions::from_mode(0o1777),
        );
        let a = answer(&self.layout, &alloc, &self.inventory.gpus);
        self.allocs.insert(id.clone(), alloc);
        self.save(&id)?;
        Ok(a)
    }

    /// The allocation holding these `vcuda-core` IDs.
    pub fn by_cores(&self, cores: &[String]) -> Option<&Allocation> {
        self.allocs
            .values()
            .find(|a| cores.iter().any(|c| a.cores.contains(c)))
    }

    /// PreStartContainer: `held` is what PodResources says the container holds (`None`: it
    /// lists no container with these devices), `pod_uid` what the kubelet's checkpoint says.
    /// Writes the config the library reads; returns the allocation's id.
    /// PreStartContainer for an allocation already configured (the container's other
    /// resource, or a container restart): the kubelet cannot change a container's devices
    /// without a new Allocate, so there is nothing to check or write. Returns its id.
    pub fn already_started(&self, kind: Kind, ids: &[String]) -> Option<String> {
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

    pub fn pre_start(
        &mut self,
        kind: Kind,
        ids: &[String],
        held: Option<Holdings>,
        pod_uid: Option<String>,
    ) -> Result<String, String> {
        let Some(held) = held else {
            return Err(format!(
                "the kubelet's PodResources API lists no container holding {} {}; is --pod-resources-socket ({}) the kubelet's?",
                kind.resource(&self.settings.domain),
                ids.first().map_or("", String::as_str),
                self.settings.pod_resources_socket.display()
            ));
        };
        if held.cores.is_empty() {
            return Err(format!(
                "{}/{} container {}: vcuda-memory without vcuda-core; request {} too (1 to 99 for a share of one GPU, 100·n for whole GPUs)",
                held.namespace, held.pod, held.container, Kind::Core.resource(&self.settings.domain)
            ));
        }
        let id = self
            .by_cores(&held.cores)
            .map(|a| a.id.clone())
            .ok_or_else(|| format!("{}/{} container {}: its vcuda-core devices were not allocated by this manager (was its state directory {} lost?); delete the pod to allocate again", held.namespace, held.pod, held.container, self.settings.state_dir.display()))?;
        let alloc = &self.allocs[&id];
        let quota = finish(&self.inventory.node, alloc, &held)?;
        // The container's other resource, or a restart: nothing changed, nothing to write.
        let same = alloc.owner.as_ref().is_some_and(|o| {
            o.pod == held.pod && o.namespace == held.namespace && o.container == held.container
        });
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
        let region = self.layout.region_file(&id);
        Region::open_or_create(&region, &uuids).map_err(|e| e.to_string())?;
        let _ = std::fs::set_permissions(&region, std::fs::Permissions::from_mode(0o666));
        write_atomic(
            &self.layout.config_file(&id),
            config.to_toml().as_bytes(),
            0o644,
        )?;
        self.save(&id)?;
        Ok(id)
    }

    /// The pod UID of an allocation, from the kubelet's checkpoint, when a process of it
    /// registers or the control loop needs it (kept off PreStartContainer's path).
    pub fn learn_pod_uid(&mut self, id: &str) {
        let Some(a) = self.allocs.get(id) else { return };
        if a.owner.as_ref().is_none_or(|o| o.uid.is_some()) {
            return;
        }
        let resource = Kind::Core.resource(&self.settings.domain);
        let uid = std::fs::read_to_string(&self.settings.kubelet_checkpoint)
            .ok()
            .and_then(|t| identity::parse_checkpoint(&t).ok())
            .and_then(|e| identity::pod_uid_of(&e, &resource, &a.cores));
        if let (Some(uid), Some(a)) = (uid, self.allocs.get_mut(id)) {
            if let Some(o) = a.owner.as_mut() {
                o.uid = Some(uid);
            }
            let _ = self.save(id);
        }
    }

    /// Forget an allocation whose container is gone, and its files.
    pub fn remove(&mut self, id: &str) -> Result<(), String> {
        if self.allocs.remove(id).is_some() {
            std::fs::remove_dir_all(self.layout.dir(id))
                .map_err(|e| format!("cannot remove {}: {e}", self.layout.dir(id).display()))?;
        }
        Ok(())
    }

    /// A process claims an allocation over the control socket: check the claim against the
    /// host's view of the connecting process (`host_pid`, from the socket's credentials)
    /// and record its host pid in its region slot. Returns the host pid, or why not.
    pub fn hello(&mut self, hello: &Hello, host_pid: u32) -> Result<u32, String> {
        self.learn_pod_uid(&hello.allocation);
        let alloc = self
            .allocs
            .get(&hello.allocation)
            .ok_or_else(|| format!("no allocation {:?} on this node", hello.allocation))?;
        let owner = alloc.owner.as_ref().ok_or_else(|| {
            format!(
                "allocation {} has not been started by the kubelet",
                alloc.id
            )
        })?;
        let proc_dir = self.settings.proc_root.join(host_pid.to_string());
        let read = |f: &str| {
            std::fs::read_to_string(proc_dir.join(f))
                .map_err(|e| format!("cannot read {}/{f}: {e}", proc_dir.display()))
        };
        let uid = owner.uid.as_deref().ok_or_else(|| {
            format!("allocation {} ({}): the kubelet's checkpoint names no pod UID for it, so the process's cgroup cannot be checked", alloc.id, owner.key())
        })?;
        if !identity::in_pod(&read("cgroup")?, uid) {
            return Err(format!("process {host_pid} is not in the cgroup of pod {} (uid {uid}), which holds allocation {}", owner.key(), alloc.id));
        }
        if identity::innermost_pid(&read("status")?) != Some(hello.pid) {
            return Err(format!(
                "process {host_pid} claims pid {} in its namespace, which it is not",
                hello.pid
            ));
        }
        let region = Region::open_or_create(
            &self.layout.region_file(&alloc.id),
            &alloc
                .gpus
                .iter()
                .filter_map(|u| parse_uuid(u))
                .collect::<Vec<_>>(),
        )
        .map_err(|e| e.to_string())?;
        let slot = region
            .slots()
            .get(hello.slot as usize)
            .ok_or_else(|| format!("slot {} does not exist", hello.slot))?;
        use std::sync::atomic::Ordering::Relaxed;
        if slot.pid.load(Relaxed) != hello.pid
            || slot.generation.load(Relaxed) != hello.generation
            || slot.start_time.load(Relaxed) != hello.start_time
        {
            return Err(format!(
                "slot {} of allocation {} is not held by pid {}",
                hello.slot, alloc.id, hello.pid
            ));
        }
        if identity::start_time(&read("stat")?) != Some(hello.start_time) {
            return Err(format!(
                "process {host_pid} did not start at the time its slot says"
            ));
        }
        slot.host_pid.store(host_pid, Relaxed);
        Ok(host_pid)
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Write a file so that readers see the old or the new content, never a mix, and a crash of
/// the writer leaves one of the two: a temporary file in the same directory, renamed. Not
/// synced to disk (see [`Core::save`]).
pub fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> Result<(), String> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = dir.join(format!(
        ".{}.tmp",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("file")
    ));
    let res = (|| -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.set_permissions(std::fs::Permissions::from_mode(mode))?;
        std::fs::rename(&tmp, path)
    })();
    res.map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        format!("cannot write {}: {e}", path.display())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::allocation::Gpu;
    use crate::ids::all_ids;
    use crate::placement::{Link, Node};
    use crate::settings::Flags;
    use clap::Parser;

    const U0: &str = "GPU-5a1c2e4f-0d3b-4c8a-9e61-7b2f10c3d401";
    const U1: &str = "GPU-5a1c2e4f-0d3b-4c8a-9e61-7b2f10c3d402";

    fn core(dir: &Path) -> Core {
        let flags = Flags::parse_from([
            "m",
            "--state-dir",
            dir.join("state").to_str().unwrap(),
            "--run-dir",
            dir.join("run").to_str().unwrap(),
            "--core-limit",
            "ns/p0/c=60",
        ]);
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
            namespace: "ns".into(),
            pod: pod.into(),
            container: "c".into(),
            cores,
            memory,
        })
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
                    Some(format!("uid-{r}")),
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
        // A second Allocate for the same IDs (node reboot) answers the same allocation.
        let again = c.allocate(Kind::Core, &cores).unwrap();
        assert!(again
            .mounts
            .iter()
            .any(|m| m.host == c.layout.config_dir(&id)));
        c.remove(&id).unwrap();
        assert!(!c.layout.dir(&id).exists());
        assert!(core(d.path()).allocation(&id).is_none());
    }

    #[test]
    fn invalid_requests_are_refused_in_words() {
        let d = tempfile::tempdir().unwrap();
        let mut c = core(d.path());
        let mut cores = ids(U0, Kind::Core, 0, 100);
        cores.extend(ids(U1, Kind::Core, 0, 50));
        assert!(c.allocate(Kind::Core, &cores).unwrap_err().contains("150"));
        let mut mem = ids(U0, Kind::Memory, 0, 160);
        mem.extend(ids(U1, Kind::Memory, 0, 1));
        assert!(c
            .allocate(Kind::Memory, &mem)
            .unwrap_err()
            .contains("does not fit on one GPU"));
        let m = ids(U0, Kind::Memory, 0, 4);
        let e = c
            .pre_start(Kind::Memory, &m, held("p", vec![], m.clone()), None)
            .unwrap_err();
        assert!(e.contains("without vcuda-core"), "{e}");
        assert!(c
            .pre_start(Kind::Memory, &m, None, None)
            .unwrap_err()
            .contains("PodResources"));
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
