//! Allocations: what Allocate hands a container and what PreStartContainer finishes.
//!
//! The kubelet calls Allocate once per resource with device IDs and no pod identity, so the
//! `vcuda-core` Allocate creates the allocation (a directory keyed by a fresh id, holding
//! the container's config and region) and answers every mount; the `vcuda-memory` Allocate
//! only validates (two answers mounting the same container path would conflict, and the
//! kubelet keeps the first). PreStartContainer, which runs after the kubelet recorded the
//! allocation, names the pod through PodResources, checks that core and memory landed on the
//! same GPU and writes the config the library reads. Identical replicas get distinct device
//! IDs from the kubelet, hence distinct allocations: nothing is guessed from request sizes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use vcuda_contract::config::{ContainerConfig, GpuLimit, CONFIG_VERSION};

use crate::ids::{AllocationId, ContainerRef, DeviceId, Kind, PodUid, MEMORY_UNIT};
use crate::placement::{check_cores, check_memory, Cores, Node, PlacementError};

/// Paths inside the container.
pub const CONTAINER_LIBRARY: &str = "/usr/local/vcuda/lib64/libvcuda.so";
pub const CONTAINER_PRELOAD: &str = "/etc/ld.so.preload";
pub const CONTAINER_CONFIG_DIR: &str = "/etc/vcuda";
/// The region file itself is mounted, not its directory: a container can then neither
/// rename nor replace it (a bind-mounted file cannot be unlinked), only write it.
pub const CONTAINER_REGION: &str = "/run/vcuda/region/region";
pub const CONTAINER_SOCKET_DIR: &str = "/run/vcuda/sock";
/// The control socket's file name, in the manager's socket directory on the host and in
/// [`CONTAINER_SOCKET_DIR`] inside containers.
pub const SOCKET_NAME: &str = "manager.sock";

/// One GPU as the manager knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gpu {
    pub uuid: String,
    pub memory: u64,
    /// `/dev/nvidia<minor>`.
    pub minor: u32,
}

/// A bind mount of an Allocate answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    pub container: String,
    pub host: PathBuf,
    pub read_only: bool,
}

/// A device node of an Allocate answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceNode {
    pub container: String,
    pub host: String,
    pub permissions: String,
}

/// An Allocate answer for one container.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Answer {
    pub envs: BTreeMap<String, String>,
    pub mounts: Vec<Mount>,
    pub devices: Vec<DeviceNode>,
    pub annotations: BTreeMap<String, String>,
    /// Fully qualified CDI device names whose specs make the same edits
    /// ([`crate::cdi`]); empty when CDI is off. The daemon fills it in once the spec is
    /// written.
    pub cdi_devices: Vec<String>,
}

/// Who an allocation belongs to, once PreStartContainer has found out.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Owner {
    pub namespace: String,
    pub pod: String,
    pub container: String,
    /// From the kubelet's checkpoint, when it names one (for the cgroup check).
    pub uid: Option<PodUid>,
}

impl Owner {
    /// The container it is.
    pub fn container_ref(&self) -> ContainerRef {
        ContainerRef::new(
            self.namespace.clone(),
            self.pod.clone(),
            self.container.clone(),
        )
    }

    /// `namespace/pod/container`.
    pub fn key(&self) -> String {
        self.container_ref().to_string()
    }
}

/// One container's allocation (persisted in the manager's checkpoint).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Allocation {
    pub id: AllocationId,
    /// Its `vcuda-core` device IDs.
    pub cores: Vec<String>,
    /// Its GPUs.
    pub gpus: Vec<String>,
    /// Share of each GPU, percent (100: whole, unthrottled).
    pub percent: u32,
    /// Its `vcuda-memory` device IDs, once PreStartContainer has seen them.
    pub memory: Vec<String>,
    /// Memory quota per GPU, bytes, once known.
    pub quota: u64,
    /// Elastic limit, percent, if the container has one.
    pub core_limit: Option<u32>,
    pub owner: Option<Owner>,
    /// Seconds since the epoch when Allocate made it.
    pub created: u64,
    /// A slice allocation (issue 19): `cores` holds its `<domain>/sgpu` device IDs, one per
    /// GPU, and `quota` (each GPU's memory / K) is fixed at Allocate; `percent` is 100
    /// (no compute limit) or 100/K. Absent from the checkpoint for share allocations, so
    /// that the previous release reads every share allocation as before.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub slice: bool,
}

impl Allocation {
    /// Whether PreStartContainer has written its config.
    pub fn finished(&self) -> bool {
        self.owner.is_some()
    }

    /// Whether it was configured for the container holding `held` (checked then).
    pub fn owned_by(&self, held: &Holdings) -> bool {
        self.owner.as_ref().is_some_and(|o| {
            o.pod == held.pod && o.namespace == held.namespace && o.container == held.container
        })
    }
}

/// The host side of an allocation's files. The checkpoint and the preload file live in
/// `state_dir` (on disk); an allocation's config and region in `run_dir/alloc/<id>` (tmpfs
/// `/run` on a real node: the region is shared memory the limiter writes thousands of times
/// a second, which a disk would write back for nothing, and both are remade by
/// PreStartContainer after a reboot).
pub struct Layout {
    pub state_dir: PathBuf,
    pub run_dir: PathBuf,
    pub socket_dir: PathBuf,
    pub library: PathBuf,
}

impl Layout {
    /// Where every allocation's directory is.
    pub fn allocations_dir(&self) -> PathBuf {
        self.run_dir.join("alloc")
    }
    pub fn dir(&self, id: &AllocationId) -> PathBuf {
        self.allocations_dir().join(id.as_str())
    }
    pub fn journal(&self) -> PathBuf {
        self.state_dir.join("allocations.jsonl")
    }
    pub fn config_dir(&self, id: &AllocationId) -> PathBuf {
        self.dir(id).join("etc")
    }
    pub fn config_file(&self, id: &AllocationId) -> PathBuf {
        self.config_dir(id).join("vcuda.toml")
    }
    pub fn region_dir(&self, id: &AllocationId) -> PathBuf {
        self.dir(id).join("region")
    }
    pub fn region_file(&self, id: &AllocationId) -> PathBuf {
        self.region_dir(id).join("region")
    }
    pub fn preload_file(&self) -> PathBuf {
        self.state_dir.join("ld.so.preload")
    }
}

/// A device ID the kubelet sent is not one of this manager's devices of the resource the
/// call was for (another plugin's, or another release's ID scheme).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("device {id:?} is not a {expected:?} device of vcuda-manager; the kubelet sent an ID this manager does not list (a device of another release?): delete the pod to allocate again")]
pub struct DeviceError {
    pub id: String,
    /// The resource the call was for.
    pub expected: Kind,
}

impl DeviceError {
    /// A short stable name for counting errors by kind.
    pub fn kind(&self) -> &'static str {
        "foreign-device"
    }
}

/// Parse the IDs the kubelet sent for `kind`; unknown IDs are an error naming them.
pub fn parse_ids(kind: Kind, ids: &[String]) -> Result<Vec<DeviceId>, DeviceError> {
    ids.iter()
        .map(|s| {
            DeviceId::parse(s)
                .filter(|d| d.kind == kind)
                .ok_or_else(|| DeviceError {
                    id: s.clone(),
                    expected: kind,
                })
        })
        .collect()
}

/// What the `vcuda-core` Allocate decides: the GPUs and the share.
pub fn plan(cores: &[DeviceId]) -> Result<(Vec<String>, u32), PlacementError> {
    Ok(match check_cores(cores)? {
        Cores::Share { uuid, percent } => (vec![uuid], percent),
        Cores::Whole { uuids } => (uuids, 100),
        Cores::Split { uuids, percent } => (uuids, percent),
    })
}

/// The Allocate answer of an allocation: library, preload, config, region, control socket,
/// device nodes, and the env the NVIDIA container runtime reads to inject the driver.
pub fn answer(layout: &Layout, alloc: &Allocation, gpus: &[Gpu]) -> Answer {
    let mut a = Answer::default();
    let ro = |container: &str, host: PathBuf| Mount {
        container: container.into(),
        host,
        read_only: true,
    };
    a.mounts.push(ro(CONTAINER_LIBRARY, layout.library.clone()));
    a.mounts.push(ro(CONTAINER_PRELOAD, layout.preload_file()));
    a.mounts
        .push(ro(CONTAINER_CONFIG_DIR, layout.config_dir(&alloc.id)));
    a.mounts.push(Mount {
        container: CONTAINER_REGION.into(),
        host: layout.region_file(&alloc.id),
        read_only: false,
    });
    // Read-only: connecting to a socket needs no write access to its mount, and a
    // container must not be able to replace the node's socket with its own.
    a.mounts
        .push(ro(CONTAINER_SOCKET_DIR, layout.socket_dir.clone()));
    gpu_answer(&mut a, &alloc.gpus, gpus);
    a.envs.insert(
        "VCUDA_CONFIG".into(),
        format!("{CONTAINER_CONFIG_DIR}/vcuda.toml"),
    );
    a.annotations
        .insert("vcuda.io/allocation".into(), alloc.id.to_string());
    a
}

/// What every GPU container gets, and all a whole-GPU container (issue 19) gets, as NVIDIA's
/// device plugin gives it: the control nodes, each GPU's device node, and
/// `NVIDIA_VISIBLE_DEVICES` / `NVIDIA_DRIVER_CAPABILITIES`.
pub fn gpu_answer(a: &mut Answer, uuids: &[String], gpus: &[Gpu]) {
    let rw = |p: &str| DeviceNode {
        container: p.into(),
        host: p.into(),
        permissions: "rw".into(),
    };
    for p in ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"] {
        a.devices.push(rw(p));
    }
    for uuid in uuids {
        if let Some(g) = gpus.iter().find(|g| &g.uuid == uuid) {
            a.devices.push(rw(&format!("/dev/nvidia{}", g.minor)));
        }
    }
    a.envs
        .insert("NVIDIA_VISIBLE_DEVICES".into(), uuids.join(","));
    a.envs.insert(
        "NVIDIA_DRIVER_CAPABILITIES".into(),
        "compute,utility".into(),
    );
}

/// The config the library reads, for a finished allocation.
pub fn container_config(alloc: &Allocation, gpus: &[Gpu]) -> ContainerConfig {
    let gpu = alloc
        .gpus
        .iter()
        .map(|uuid| {
            let total = gpus
                .iter()
                .find(|g| &g.uuid == uuid)
                .map_or(0, |g| g.memory);
            // Whole GPUs: the GPU's memory, still shown as the container's GPU size.
            let quota = if alloc.percent >= 100 && !alloc.slice {
                total
            } else {
                alloc.quota
            };
            GpuLimit {
                uuid: uuid.clone(),
                memory_mib: (quota >> 20).max(1),
                core: alloc.percent.min(100),
                core_limit: alloc.core_limit.filter(|&l| l > alloc.percent),
            }
        })
        .collect();
    ContainerConfig {
        version: CONFIG_VERSION,
        region: CONTAINER_REGION.into(),
        socket: Some(Path::new(CONTAINER_SOCKET_DIR).join(SOCKET_NAME)),
        allocation: Some(alloc.id.to_string()),
        cuda_library: "libcuda.so.1".into(),
        nvml_library: "libnvidia-ml.so.1".into(),
        gpu,
    }
}

/// What PodResources says a container holds of our two resources.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Holdings {
    pub namespace: String,
    pub pod: String,
    pub container: String,
    pub cores: Vec<String>,
    pub memory: Vec<String>,
    /// Its slices (`<domain>/sgpu`).
    pub slices: Vec<String>,
    /// Its whole GPUs (the whole-GPU resource).
    pub whole: Vec<String>,
}

impl Holdings {
    /// "namespace/pod container name", as messages name a container.
    pub fn who(&self) -> String {
        format!(
            "{}/{} container {}",
            self.namespace, self.pod, self.container
        )
    }
}

/// Why PreStartContainer refuses a container: what the kubelet allocated would run wrong.
/// `container` is "namespace/pod container name"; every message says what to do (most
/// often: delete the pod, so that the kubelet allocates again).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FinishError {
    #[error(transparent)]
    Device(#[from] DeviceError),
    #[error("{container}: vcuda-memory landed on GPU {memory_gpu} but its whole GPUs are {}; delete the pod to retry", gpus.join(", "))]
    MemoryOffWholeGpus {
        container: String,
        memory_gpu: String,
        gpus: Vec<String>,
    },
    #[error("{container}: a share of a GPU (vcuda-core {cores}) needs vcuda-memory too (1 = 256 MiB); add it to the container's requests and limits")]
    NoMemory { container: String, cores: u32 },
    #[error("{container}: vcuda-core {cores} landed on {} GPUs ({}); a share spans GPUs only for a pod annotated vcuda.io/gpu-count: \"{}\", which this manager could not read (it runs without the API server, or the API server did not answer: see its log; it needs --kubeconfig or an in-cluster service account). Delete the pod to retry", gpus.len(), cores_on(*percent, gpus), gpus.len())]
    SplitUnreadable {
        container: String,
        cores: u32,
        percent: u32,
        gpus: Vec<String>,
    },
    #[error("{container}: vcuda-core {cores} was split over {} GPUs ({}) but the pod does not ask for vcuda.io/gpu-count; no GPU on this node had the whole share free. Delete the pod to retry (the scheduler extender prevents this)", gpus.len(), cores_on(*percent, gpus))]
    SplitUnasked {
        container: String,
        cores: u32,
        percent: u32,
        gpus: Vec<String>,
    },
    #[error("{container}: the pod asks for vcuda.io/gpu-count: \"{asked}\" but its vcuda-core {cores} landed on {} GPU(s) ({}); delete the pod to retry (the scheduler extender places such pods)", gpus.len(), cores_on(*percent, gpus))]
    CountMismatch {
        container: String,
        asked: u32,
        cores: u32,
        percent: u32,
        gpus: Vec<String>,
    },
    #[error("{container}: {source}")]
    Memory {
        container: String,
        source: PlacementError,
    },
    #[error("{container}: vcuda-core landed on GPU {} and vcuda-memory on GPU {}; a container's share and memory must be on the same GPU(s). Delete the pod to retry (the scheduler extender prevents this on multi-GPU nodes)", cores.join(", "), memory.join(", "))]
    Apart {
        container: String,
        cores: Vec<String>,
        memory: Vec<String>,
    },
}

impl FinishError {
    /// A short stable name for counting errors by kind.
    pub fn kind(&self) -> &'static str {
        match self {
            FinishError::Device(e) => e.kind(),
            FinishError::MemoryOffWholeGpus { .. } => "memory-off-whole-gpus",
            FinishError::NoMemory { .. } => "no-memory",
            FinishError::SplitUnreadable { .. } => "split-unreadable",
            FinishError::SplitUnasked { .. } => "split-unasked",
            FinishError::CountMismatch { .. } => "gpu-count-mismatch",
            FinishError::Memory { .. } => "memory-placement",
            FinishError::Apart { .. } => "cores-and-memory-apart",
        }
    }
}

/// "30 % on GPU-a, 30 % on GPU-b".
fn cores_on(percent: u32, gpus: &[String]) -> String {
    gpus.iter()
        .map(|g| format!("{percent} % on {g}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// PreStartContainer's decision for an allocation: the memory quota per GPU, or why the
/// container must not start. `gpu_count` is the pod's `vcuda.io/gpu-count` (1 when unset),
/// `None` when the pod cannot be read (no API server access).
pub fn finish(
    node: &Node,
    alloc: &Allocation,
    held: &Holdings,
    gpu_count: Option<u32>,
) -> Result<u64, FinishError> {
    let who = held.who();
    if alloc.percent >= 100 {
        // Whole GPUs: memory requests, if any, must be on them; the quota is the GPU.
        if !held.memory.is_empty() {
            let mem = parse_ids(Kind::Memory, &held.memory)?;
            if let Some(m) = mem.iter().find(|m| !alloc.gpus.contains(&m.uuid)) {
                return Err(FinishError::MemoryOffWholeGpus {
                    container: who,
                    memory_gpu: m.uuid.clone(),
                    gpus: alloc.gpus.clone(),
                });
            }
        }
        return Ok(0);
    }
    let n = alloc.gpus.len() as u32;
    let cores = alloc.percent * n;
    if held.memory.is_empty() {
        return Err(FinishError::NoMemory {
            container: who,
            cores,
        });
    }
    match gpu_count {
        Some(k) if k == n => {}
        None if n == 1 => {}
        None => {
            return Err(FinishError::SplitUnreadable {
                container: who,
                cores,
                percent: alloc.percent,
                gpus: alloc.gpus.clone(),
            })
        }
        Some(1) => {
            return Err(FinishError::SplitUnasked {
                container: who,
                cores,
                percent: alloc.percent,
                gpus: alloc.gpus.clone(),
            })
        }
        Some(k) => {
            return Err(FinishError::CountMismatch {
                container: who,
                asked: k,
                cores,
                percent: alloc.percent,
                gpus: alloc.gpus.clone(),
            })
        }
    }
    let mem = parse_ids(Kind::Memory, &held.memory)?;
    let placed = check_memory(node, &mem).map_err(|source| FinishError::Memory {
        container: who.clone(),
        source,
    })?;
    let mut cores = alloc.gpus.clone();
    cores.sort();
    if placed.gpus != cores {
        return Err(FinishError::Apart {
            container: who,
            cores,
            memory: placed.gpus,
        });
    }
    debug_assert_eq!(placed.per_gpu % MEMORY_UNIT, 0);
    Ok(placed.per_gpu)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::all_ids;
    use crate::placement::Link;

    const U0: &str = "GPU-5a1c2e4f-0d3b-4c8a-9e61-7b2f10c3d401";
    const U1: &str = "GPU-5a1c2e4f-0d3b-4c8a-9e61-7b2f10c3d402";

    fn node() -> Node {
        Node {
            uuids: vec![U0.into(), U1.into()],
            memory: vec![40 << 30; 2],
            links: vec![vec![Link::NvLink(12); 2]; 2],
        }
    }

    fn gpus() -> Vec<Gpu> {
        vec![
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
        ]
    }

    fn ids(uuid: &str, kind: Kind, n: usize) -> Vec<String> {
        all_ids(uuid, kind, 40 << 30)
            .into_iter()
            .take(n)
            .map(|d| d.to_string())
            .collect()
    }

    fn alloc(percent: u32, gpus: &[&str]) -> Allocation {
        Allocation {
            slice: false,
            id: "a1".into(),
            cores: vec![],
            gpus: gpus.iter().map(|s| s.to_string()).collect(),
            percent,
            memory: vec![],
            quota: 0,
            core_limit: None,
            owner: None,
            created: 0,
        }
    }

    #[test]
    fn the_answer_mounts_everything_the_library_needs() {
        let layout = Layout {
            state_dir: "/var/lib/vcuda".into(),
            run_dir: "/run/vcuda".into(),
            socket_dir: "/run/vcuda/sock".into(),
            library: "/opt/vcuda/libvcuda.so".into(),
        };
        let a = answer(&layout, &alloc(30, &[U1]), &gpus());
        let paths: Vec<&str> = a.mounts.iter().map(|m| m.container.as_str()).collect();
        assert_eq!(
            paths,
            [
                CONTAINER_LIBRARY,
                CONTAINER_PRELOAD,
                CONTAINER_CONFIG_DIR,
                CONTAINER_REGION,
                CONTAINER_SOCKET_DIR
            ]
        );
        assert!(
            a.mounts[..3].iter().all(|m| m.read_only) && a.mounts[4].read_only,
            "library, preload, config and the socket directory are read-only"
        );
        assert_eq!(a.mounts[2].host, Path::new("/run/vcuda/alloc/a1/etc"));
        assert_eq!(
            (a.mounts[3].host.as_path(), a.mounts[3].read_only),
            (Path::new("/run/vcuda/alloc/a1/region/region"), false),
            "the region file itself, not a directory the container could rename in"
        );
        assert!(a.devices.iter().any(|d| d.host == "/dev/nvidia1"));
        assert!(
            !a.devices.iter().any(|d| d.host == "/dev/nvidia0"),
            "only its GPU"
        );
        assert_eq!(a.envs["NVIDIA_VISIBLE_DEVICES"], U1);
    }

    #[test]
    fn the_config_holds_share_quota_and_limit() {
        let mut a = alloc(30, &[U0]);
        a.quota = 4 << 30;
        a.core_limit = Some(60);
        let c = container_config(&a, &gpus());
        assert_eq!(c.gpu.len(), 1);
        assert_eq!(
            (c.gpu[0].memory_mib, c.gpu[0].core, c.gpu[0].core_limit),
            (4096, 30, Some(60))
        );
        assert_eq!(c.allocation.as_deref(), Some("a1"));
        // it parses back as the library will read it
        assert_eq!(ContainerConfig::parse(&c.to_toml(), "x").unwrap(), c);
        let w = container_config(&alloc(100, &[U0, U1]), &gpus());
        assert_eq!(w.gpu.len(), 2);
        assert!(
            w.gpu.iter().all(|g| g.core == 100 && g.memory_mib == 40960),
            "whole GPUs: unthrottled, GPU-sized"
        );
    }

    #[test]
    fn pre_start_refuses_what_would_run_wrong() {
        let n = node();
        let held = |cores: Vec<String>, memory: Vec<String>| Holdings {
            slices: Vec::new(),
            whole: Vec::new(),
            namespace: "ns".into(),
            pod: "p".into(),
            container: "c".into(),
            cores,
            memory,
        };
        let a = alloc(30, &[U0]);
        assert_eq!(
            finish(
                &n,
                &a,
                &held(ids(U0, Kind::Core, 30), ids(U0, Kind::Memory, 16)),
                None
            ),
            Ok(4 << 30)
        );
        let e = finish(
            &n,
            &a,
            &held(ids(U0, Kind::Core, 30), ids(U1, Kind::Memory, 16)),
            Some(1),
        )
        .unwrap_err();
        assert!(matches!(e, FinishError::Apart { .. }), "{e:?}");
        let e = e.to_string();
        assert!(
            e.contains("same GPU") && e.contains("ns/p container c"),
            "{e}"
        );
        let e = finish(&n, &a, &held(ids(U0, Kind::Core, 30), vec![]), None).unwrap_err();
        assert_eq!(
            e,
            FinishError::NoMemory {
                container: "ns/p container c".into(),
                cores: 30
            }
        );
        assert!(e.to_string().contains("needs vcuda-memory"), "{e}");
        let e = finish(
            &n,
            &alloc(100, &[U0]),
            &held(ids(U0, Kind::Core, 100), ids(U1, Kind::Memory, 1)),
            None,
        )
        .unwrap_err();
        assert!(
            matches!(&e, FinishError::MemoryOffWholeGpus { memory_gpu, .. } if memory_gpu == U1),
            "{e:?}"
        );
        assert_eq!(
            finish(
                &n,
                &alloc(100, &[U0]),
                &held(ids(U0, Kind::Core, 100), vec![]),
                None
            ),
            Ok(0)
        );
    }

    #[test]
    fn a_split_over_gpus_needs_the_pods_gpu_count() {
        let n = node();
        let held = |cores, memory| Holdings {
            slices: Vec::new(),
            whole: Vec::new(),
            namespace: "ns".into(),
            pod: "p".into(),
            container: "c".into(),
            cores,
            memory,
        };
        let both = |k: Kind, each: usize| {
            let mut v = ids(U0, k, each);
            v.extend(ids(U1, k, each));
            v
        };
        let a = alloc(30, &[U0, U1]);
        let h = held(both(Kind::Core, 30), both(Kind::Memory, 8));
        assert_eq!(finish(&n, &a, &h, Some(2)), Ok(2 << 30));
        let e = finish(&n, &a, &h, Some(1)).unwrap_err();
        assert!(
            matches!(e, FinishError::SplitUnasked { cores: 60, .. }),
            "{e:?}"
        );
        let e = e.to_string();
        assert!(e.contains("does not ask for vcuda.io/gpu-count"), "{e}");
        assert!(e.contains(&format!("30 % on {U0}, 30 % on {U1}")), "{e}");
        let e = finish(&n, &a, &h, Some(3)).unwrap_err();
        assert!(
            matches!(e, FinishError::CountMismatch { asked: 3, .. }),
            "{e:?}"
        );
        let e = e.to_string();
        assert!(e.contains("gpu-count: \"3\"") && e.contains("2 GPU"), "{e}");
        let e = finish(&n, &a, &h, None).unwrap_err();
        assert!(matches!(e, FinishError::SplitUnreadable { .. }), "{e:?}");
        let e = e.to_string();
        assert!(
            e.contains("could not read") && e.contains("gpu-count: \"2\""),
            "{e}"
        );
        // Memory on one of the two GPUs only.
        let h = held(both(Kind::Core, 30), ids(U0, Kind::Memory, 16));
        let e = finish(&n, &a, &h, Some(2)).unwrap_err();
        assert!(e.to_string().contains("same GPU"), "{e}");
        // Asked for two GPUs, got one.
        let one = alloc(60, &[U0]);
        let h = held(ids(U0, Kind::Core, 60), ids(U0, Kind::Memory, 16));
        let e = finish(&n, &one, &h, Some(2)).unwrap_err();
        assert!(e.to_string().contains("landed on 1 GPU"), "{e}");
    }

    #[test]
    fn plans_follow_the_core_ids() {
        let c: Vec<DeviceId> = parse_ids(Kind::Core, &ids(U1, Kind::Core, 25)).unwrap();
        assert_eq!(plan(&c), Ok((vec![U1.to_string()], 25)));
        let mem = ids(U1, Kind::Memory, 1);
        assert_eq!(
            parse_ids(Kind::Core, &mem),
            Err(DeviceError {
                id: mem[0].clone(),
                expected: Kind::Core
            }),
            "memory IDs sent to the core plugin"
        );
    }
}
