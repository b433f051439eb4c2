//! The container runtime's part (`serve --runtime docker`): after a successful
//! PreStartContainer, kubelet-sim creates the container with `docker run`, applying the
//! device plugin's answer the way containerd and CRI-O apply what the kubelet hands them
//! (kubelet.md §4: mounts with their read-only flags, device nodes, environment,
//! annotations) and, where the kubelet passes them (1.29+), the CDI devices' edits read from
//! the spec directory (CDI SPEC.md, "OCI Edits"). The pod's containers share one cgroup
//! parent shaped like the kubelet's, for the cgroupfs or the systemd driver.
//!
//! The decisions are pure functions here ([`pod_cgroup_parent`], [`container_name`],
//! [`resolve_cdi`], [`container_edits`], [`docker_run_args`]); [`Docker`] runs the `docker`
//! client at the edge (tokio::process) and removes the pod's cgroup directories.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use crate::merge::{DeviceOut, MountOut, RunOptions};

/// `--cgroup-driver`: how the kubelet names a pod's cgroup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CgroupDriver {
    #[default]
    Cgroupfs,
    Systemd,
}

impl FromStr for CgroupDriver {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cgroupfs" => Ok(CgroupDriver::Cgroupfs),
            "systemd" => Ok(CgroupDriver::Systemd),
            _ => Err(format!("cgroup driver {s:?}: expected cgroupfs or systemd")),
        }
    }
}

/// `--runtime-edits`: which of the plugin's answers the runtime applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Edits {
    /// The Allocate answer's mounts, devices and envs, then the CDI devices' edits (a
    /// runtime with CDI: containerd ≥ 1.7, CRI-O).
    #[default]
    All,
    /// The Allocate answer's only (a runtime without CDI).
    Mounts,
    /// The CDI devices' edits only: proves the spec alone suffices.
    Cdi,
}

impl FromStr for Edits {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "all" => Ok(Edits::All),
            "mounts" => Ok(Edits::Mounts),
            "cdi" => Ok(Edits::Cdi),
            _ => Err(format!("runtime edits {s:?}: expected all, mounts or cdi")),
        }
    }
}

impl Edits {
    fn answer(self) -> bool {
        self != Edits::Cdi
    }
    fn cdi(self) -> bool {
        self != Edits::Mounts
    }
}

/// `--runtime-mount SRC:DST[:ro]`: a bind mount the node injects into every container (the
/// NVIDIA container toolkit's part: the driver's libraries and state).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeMount {
    pub host_path: String,
    pub container_path: String,
    pub read_only: bool,
}

impl FromStr for NodeMount {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad =
            || format!("runtime mount {s:?}: expected SRC:DST or SRC:DST:ro (absolute paths)");
        let parts: Vec<&str> = s.split(':').collect();
        let (src, dst, read_only) = match parts.as_slice() {
            [src, dst] => (*src, *dst, false),
            [src, dst, "ro"] => (*src, *dst, true),
            [src, dst, "rw"] => (*src, *dst, false),
            _ => return Err(bad()),
        };
        if !src.starts_with('/') || !dst.starts_with('/') {
            return Err(bad());
        }
        Ok(NodeMount {
            host_path: src.into(),
            container_path: dst.into(),
            read_only,
        })
    }
}

/// `--runtime-env K=V`.
pub fn parse_env(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.into(), v.into())),
        _ => Err(format!("runtime env {s:?}: expected NAME=VALUE")),
    }
}

/// How `serve --runtime docker` starts containers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuntimeConfig {
    pub image: String,
    pub cgroup_driver: CgroupDriver,
    pub node_mounts: Vec<NodeMount>,
    pub node_env: Vec<(String, String)>,
    pub edits: Edits,
    pub cdi_spec_dir: PathBuf,
}

/// The default CDI spec directory (containerd and CRI-O scan `/etc/cdi` and `/var/run/cdi`).
pub const DEFAULT_CDI_SPEC_DIR: &str = "/var/run/cdi";

/// A container the runtime could not start; each names the thing and the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RuntimeError {
    #[error("failed to inject CDI devices: unresolvable CDI devices {names} (no spec in {dir} has them; is the device plugin writing its CDI specs there? pass its directory as --cdi-spec-dir)")]
    Unresolvable { names: String, dir: String },
    #[error("cannot read the CDI spec directory {dir}: {reason}; create it or pass another --cdi-spec-dir")]
    SpecDir { dir: String, reason: String },
    #[error("`docker {what}` failed: {stderr}")]
    Docker { what: String, stderr: String },
    #[error("cannot run `docker`: {0}; is the Docker client installed and on PATH?")]
    Spawn(String),
}

/// The kubelet's pod cgroup for a burstable pod (the QoS class of a pod with limits on
/// extended resources and no CPU/memory requests = limits), as the runtime is given it as
/// `cgroup_parent`: `CgroupName{"kubepods","burstable","pod<uid>"}` rendered by
/// `ToCgroupfs` (`/kubepods/burstable/pod<uid>`) or `ToSystemd`
/// (`/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid, '-' → '_'>.slice`),
/// pkg/kubelet/cm/cgroup_manager_linux.go.
pub fn pod_cgroup_parent(driver: CgroupDriver, uid: &str) -> String {
    let qos = "burstable";
    match driver {
        CgroupDriver::Cgroupfs => format!("/kubepods/{qos}/pod{uid}"),
        CgroupDriver::Systemd => format!(
            "/kubepods.slice/kubepods-{qos}.slice/kubepods-{qos}-pod{}.slice",
            uid.replace('-', "_")
        ),
    }
}

/// dockershim's container name: `k8s_<container>_<pod>_<namespace>_<uid>_<restart count>`
/// (pkg/kubelet/dockershim/naming.go, `makeContainerName`).
pub fn container_name(
    container: &str,
    pod: &str,
    namespace: &str,
    uid: &str,
    restart_count: u32,
) -> String {
    format!("k8s_{container}_{pod}_{namespace}_{uid}_{restart_count}")
}

/// A CDI spec file as read (SPEC.md, "JSON Definition"); unknown fields are ignored, hooks
/// and the v0.7 fields are not applied.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CdiSpec {
    pub kind: String,
    #[serde(default)]
    pub devices: Vec<CdiDevice>,
    #[serde(default)]
    pub container_edits: CdiEdits,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CdiDevice {
    pub name: String,
    #[serde(default)]
    pub container_edits: CdiEdits,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CdiEdits {
    #[serde(default)]
    pub env: Vec<String>,
    #[serde(default)]
    pub device_nodes: Vec<CdiDeviceNode>,
    #[serde(default)]
    pub mounts: Vec<CdiMount>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CdiDeviceNode {
    pub path: String,
    /// Absent: `path` (SPEC.md).
    #[serde(default)]
    pub host_path: Option<String>,
    #[serde(default)]
    pub permissions: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CdiMount {
    pub host_path: String,
    pub container_path: String,
    #[serde(default)]
    pub options: Vec<String>,
}

/// The edits a container is created with, in the order they were applied.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ContainerEdits {
    /// Name → value; a later edit of a name wins (as a process's environment does).
    pub env: BTreeMap<String, String>,
    /// By container path; a later mount at the same path replaces the earlier one (CDI's
    /// `ContainerEdits.Apply`; docker refuses two mounts at one path).
    pub mounts: Vec<MountOut>,
    pub devices: Vec<DeviceOut>,
}

impl ContainerEdits {
    fn env(&mut self, k: &str, v: &str) {
        self.env.insert(k.into(), v.into());
    }
    fn mount(&mut self, m: MountOut) {
        self.mounts.retain(|o| o.container_path != m.container_path);
        self.mounts.push(m);
    }
    fn device(&mut self, d: DeviceOut) {
        self.devices
            .retain(|o| o.container_path != d.container_path);
        self.devices.push(d);
    }

    fn apply_cdi(&mut self, e: &CdiEdits) {
        for kv in &e.env {
            if let Some((k, v)) = kv.split_once('=') {
                self.env(k, v);
            }
        }
        for m in &e.mounts {
            self.mount(MountOut {
                container_path: m.container_path.clone(),
                host_path: m.host_path.clone(),
                read_only: m.options.iter().any(|o| o == "ro"),
            });
        }
        for d in &e.device_nodes {
            self.device(DeviceOut {
                container_path: d.path.clone(),
                host_path: d.host_path.clone().unwrap_or_else(|| d.path.clone()),
                permissions: d.permissions.clone().unwrap_or_else(|| "rwm".into()),
            });
        }
    }
}

/// Resolves CDI device names (`vendor/class=name`) against the specs of a directory: per
/// name, the spec-wide `containerEdits` of its spec, then the device's own (SPEC.md, "OCI
/// Edits"). A name no spec has fails the whole resolution, naming every such name, as
/// containerd fails the container ("unresolvable CDI devices").
pub fn resolve_cdi(
    specs: &[CdiSpec],
    names: &[String],
    dir: &Path,
) -> Result<Vec<CdiEdits>, RuntimeError> {
    let mut out = Vec::new();
    let mut missing = Vec::new();
    for name in names {
        let found = name.split_once('=').and_then(|(kind, dev)| {
            specs.iter().find_map(|s| {
                (s.kind == kind)
                    .then(|| s.devices.iter().find(|d| d.name == dev))
                    .flatten()
                    .map(|d| (s, d))
            })
        });
        match found {
            Some((s, d)) => {
                out.push(s.container_edits.clone());
                out.push(d.container_edits.clone());
            }
            None => missing.push(name.clone()),
        }
    }
    if missing.is_empty() {
        Ok(out)
    } else {
        Err(RuntimeError::Unresolvable {
            names: missing.join(", "),
            dir: dir.display().to_string(),
        })
    }
}

/// What a container is created with: the node's injections (`--runtime-mount`,
/// `--runtime-env`), then the Allocate answer's mounts, devices and envs (unless `edits` is
/// `cdi`), then the resolved CDI edits (unless `edits` is `mounts`), each later edit of a
/// path or name replacing an earlier one, as containerd applies CDI over the CRI config.
pub fn container_edits(
    cfg: &RuntimeConfig,
    answer: &RunOptions,
    cdi: &[CdiEdits],
) -> ContainerEdits {
    let mut e = ContainerEdits::default();
    for m in &cfg.node_mounts {
        e.mount(MountOut {
            container_path: m.container_path.clone(),
            host_path: m.host_path.clone(),
            read_only: m.read_only,
        });
    }
    for (k, v) in &cfg.node_env {
        e.env(k, v);
    }
    if cfg.edits.answer() {
        for m in &answer.mounts {
            e.mount(m.clone());
        }
        for d in &answer.devices {
            e.device(d.clone());
        }
        for (k, v) in &answer.envs {
            e.env(k, v);
        }
    }
    if cfg.edits.cdi() {
        for c in cdi {
            e.apply_cdi(c);
        }
    }
    e
}

/// Who a container is: what names it, its cgroup parent, and the labels it carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity<'a> {
    pub name: &'a str,
    pub cgroup_parent: &'a str,
    pub pod: &'a str,
    pub namespace: &'a str,
    pub uid: &'a str,
    pub container: &'a str,
    pub restart_count: u32,
}

/// The `docker run` arguments (after `docker`) that create the container, and the device
/// nodes skipped because `exists` says the host has no such node (`/dev/nvidia*` on a
/// machine without a GPU: listed, never invented). The answer's annotations become labels
/// (`docker run` has no annotations), beside the kubelet's `io.kubernetes.*` labels.
pub fn docker_run_args(
    id: &Identity<'_>,
    image: &str,
    edits: &ContainerEdits,
    annotations: &BTreeMap<String, String>,
    exists: impl Fn(&str) -> bool,
) -> (Vec<String>, Vec<String>) {
    let mut a: Vec<String> = ["run", "-d", "--name", id.name, "--cgroup-parent"]
        .map(String::from)
        .to_vec();
    a.push(id.cgroup_parent.into());
    a.extend(["--network".into(), "none".into()]);
    for (k, v) in [
        ("io.kubernetes.pod.name", id.pod.to_string()),
        ("io.kubernetes.pod.namespace", id.namespace.to_string()),
        ("io.kubernetes.pod.uid", id.uid.to_string()),
        ("io.kubernetes.container.name", id.container.to_string()),
        (
            "io.kubernetes.container.restartCount",
            id.restart_count.to_string(),
        ),
    ] {
        a.extend(["--label".into(), format!("{k}={v}")]);
    }
    for (k, v) in annotations {
        a.extend(["--label".into(), format!("{k}={v}")]);
    }
    for m in &edits.mounts {
        let mut spec = format!("type=bind,src={},dst={}", m.host_path, m.container_path);
        if m.read_only {
            spec.push_str(",readonly");
        }
        a.extend(["--mount".into(), spec]);
    }
    let mut skipped = Vec::new();
    for d in &edits.devices {
        if exists(&d.host_path) {
            let perms = if d.permissions.is_empty() {
                "rwm"
            } else {
                &d.permissions
            };
            a.extend([
                "--device".into(),
                format!("{}:{}:{perms}", d.host_path, d.container_path),
            ]);
        } else {
            skipped.push(d.host_path.clone());
        }
    }
    for (k, v) in &edits.env {
        a.extend(["-e".into(), format!("{k}={v}")]);
    }
    a.extend([image.into(), "sleep".into(), "infinity".into()]);
    (a, skipped)
}

/// What the runtime did for one container start (the `runtime` of a start result).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Started {
    /// The engine's container name (dockershim's `k8s_…` naming).
    pub name: String,
    /// The engine's container id.
    pub id: String,
    pub cgroup_parent: String,
    /// The host pid of the container's first process.
    pub host_pid: u32,
    /// Device nodes of the answer or the CDI spec that the host does not have.
    pub skipped_devices: Vec<String>,
    /// Whether CDI devices' edits were applied (names reached the runtime and `--runtime-edits`
    /// is `all` or `cdi`).
    pub cdi_applied: bool,
    /// The CDI device names resolved.
    pub cdi_devices: Vec<String>,
}

/// Reads every `*.json` spec of `dir` (a missing directory holds none). YAML specs are not
/// read.
pub fn load_specs(dir: &Path) -> Result<Vec<CdiSpec>, RuntimeError> {
    let bad = |reason: String| RuntimeError::SpecDir {
        dir: dir.display().to_string(),
        reason,
    };
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(vec![]),
        Err(e) => return Err(bad(e.to_string())),
    };
    let mut paths: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    paths.sort();
    let mut out = Vec::new();
    for p in paths {
        // A spec being replaced or removed under us is skipped, as the CDI registry does
        // with a file it cannot read (it reports it and goes on).
        match std::fs::read_to_string(&p)
            .map_err(|e| e.to_string())
            .and_then(|t| serde_json::from_str::<CdiSpec>(&t).map_err(|e| e.to_string()))
        {
            Ok(s) => out.push(s),
            Err(e) => warn!(spec = %p.display(), "CDI spec skipped: {e}"),
        }
    }
    Ok(out)
}

/// The `docker` client at the edge.
#[derive(Debug, Clone)]
pub struct Docker {
    pub config: RuntimeConfig,
}

async fn docker(args: &[String]) -> Result<String, RuntimeError> {
    let out = tokio::process::Command::new("docker")
        .args(args)
        .kill_on_drop(true)
        .output()
        .await
        .map_err(|e| RuntimeError::Spawn(e.to_string()))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    } else {
        let what = args.iter().take(2).cloned().collect::<Vec<_>>().join(" ");
        Err(RuntimeError::Docker {
            what,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        })
    }
}

impl Docker {
    pub fn new(config: RuntimeConfig) -> Self {
        Docker { config }
    }

    /// Creates and starts the container; on a restart (`restart_count` > 0) the previous
    /// container `previous` is removed first.
    pub async fn start(
        &self,
        id: &Identity<'_>,
        answer: &RunOptions,
        previous: Option<&str>,
    ) -> Result<Started, RuntimeError> {
        let cfg = &self.config;
        let cdi_wanted = cfg.edits.cdi() && !answer.cdi_devices.is_empty();
        let cdi = if cdi_wanted {
            let specs = load_specs(&cfg.cdi_spec_dir)?;
            resolve_cdi(&specs, &answer.cdi_devices, &cfg.cdi_spec_dir)?
        } else {
            vec![]
        };
        let edits = container_edits(cfg, answer, &cdi);
        let (args, skipped) = docker_run_args(id, &cfg.image, &edits, &answer.annotations, |p| {
            Path::new(p).exists()
        });
        if let Some(old) = previous {
            self.remove(old).await;
        }
        info!(
            name = id.name,
            cgroup_parent = id.cgroup_parent,
            "docker run"
        );
        let container_id = match docker(&args).await {
            Ok(id) => id,
            Err(e) => {
                // A container the engine created but could not start keeps its name: free it.
                self.remove(id.name).await;
                return Err(e);
            }
        };
        let pid = docker(&[
            "inspect".into(),
            "-f".into(),
            "{{.State.Pid}}".into(),
            container_id.clone(),
        ])
        .await?;
        Ok(Started {
            name: id.name.to_string(),
            id: container_id,
            cgroup_parent: id.cgroup_parent.to_string(),
            host_pid: pid.parse().unwrap_or(0),
            skipped_devices: skipped,
            cdi_applied: cdi_wanted,
            cdi_devices: if cdi_wanted {
                answer.cdi_devices.clone()
            } else {
                vec![]
            },
        })
    }

    /// `docker rm -f`; a container already gone is not an error.
    pub async fn remove(&self, name_or_id: &str) {
        if let Err(e) = docker(&["rm".into(), "-f".into(), name_or_id.into()]).await {
            if !e.to_string().contains("No such container") {
                warn!(container = name_or_id, "{e}");
            }
        }
    }

    /// Removes a deleted pod's cgroup directories in every hierarchy: the pod's and, when
    /// empty, its QoS parent's (never the `kubepods` top, the kubelet's for good). The
    /// engine removes each container's own cgroup but not the parent the kubelet owns.
    pub fn remove_pod_cgroups(&self, cgroup_parent: &str) {
        for root in cgroup_mounts() {
            remove_up(&root, cgroup_parent);
        }
    }
}

/// Removes `rel` under `root` and its parents while they are empty, stopping below the
/// first component.
fn remove_up(root: &Path, rel: &str) {
    let parts: Vec<&str> = rel.split('/').filter(|p| !p.is_empty()).collect();
    for n in (2..=parts.len()).rev() {
        let d = parts[..n].iter().fold(root.to_path_buf(), |d, p| d.join(p));
        if !d.is_dir() {
            continue;
        }
        if std::fs::remove_dir(&d).is_err() {
            break;
        }
    }
}

/// Where each cgroup hierarchy is mounted (v1: one per controller; v2: one).
pub fn cgroup_mounts() -> Vec<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    parse_cgroup_mounts(&text)
}

fn parse_cgroup_mounts(mountinfo: &str) -> Vec<PathBuf> {
    mountinfo
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let sep = f.iter().position(|x| *x == "-")?;
            let fstype = *f.get(sep + 1)?;
            if fstype == "cgroup" || fstype == "cgroup2" {
                f.get(4).map(PathBuf::from)
            } else {
                None
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "6f1c0a52-1b2a-4c5d-8e9f-001122334455";

    fn cfg(edits: Edits) -> RuntimeConfig {
        RuntimeConfig {
            image: "img".into(),
            cgroup_driver: CgroupDriver::Cgroupfs,
            node_mounts: vec!["/lib/gpusim:/usr/local/gpusim/lib:ro".parse().unwrap()],
            node_env: vec![parse_env("LD_LIBRARY_PATH=/usr/local/gpusim/lib").unwrap()],
            edits,
            cdi_spec_dir: "/cdi".into(),
        }
    }

    fn answer() -> RunOptions {
        RunOptions {
            envs: [("VCUDA_CONFIG".into(), "/etc/vcuda/vcuda.toml".into())].into(),
            mounts: vec![
                MountOut {
                    container_path: "/etc/vcuda".into(),
                    host_path: "/state/a1".into(),
                    read_only: true,
                },
                MountOut {
                    container_path: "/run/vcuda/region/region".into(),
                    host_path: "/run/a1/region".into(),
                    read_only: false,
                },
            ],
            devices: vec![
                DeviceOut {
                    container_path: "/dev/nvidia0".into(),
                    host_path: "/dev/nvidia0".into(),
                    permissions: "rw".into(),
                },
                DeviceOut {
                    container_path: "/dev/null-ish".into(),
                    host_path: "/dev/null".into(),
                    permissions: String::new(),
                },
            ],
            annotations: [("vcuda.io/allocation".into(), "a1".into())].into(),
            cdi_devices: vec!["vcuda.io/allocation=a1".into()],
            conflicts: vec![],
        }
    }

    fn spec() -> CdiSpec {
        serde_json::from_str(
            r#"{"cdiVersion":"0.5.0","kind":"vcuda.io/allocation",
                "containerEdits":{"env":["FROM_SPEC=1"]},
                "devices":[{"name":"a1","containerEdits":{
                  "env":["VCUDA_CONFIG=/etc/vcuda/cdi.toml"],
                  "mounts":[{"hostPath":"/state/a1-cdi","containerPath":"/etc/vcuda","options":["ro","nosuid","nodev","bind"]},
                            {"hostPath":"/run/a1/region","containerPath":"/run/vcuda/region/region","options":["rw","bind"]}],
                  "deviceNodes":[{"path":"/dev/nvidiactl","permissions":"rw"}]}}]}"#,
        )
        .unwrap()
    }

    #[test]
    fn both_cgroup_parents_are_the_kubelets() {
        assert_eq!(
            pod_cgroup_parent(CgroupDriver::Cgroupfs, UID),
            format!("/kubepods/burstable/pod{UID}")
        );
        // cgroup_manager_linux.go's own example: {"kubepods","burstable","pod1234-abcd-5678-efgh"}.
        assert_eq!(
            pod_cgroup_parent(CgroupDriver::Systemd, "1234-abcd-5678-efgh"),
            "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1234_abcd_5678_efgh.slice"
        );
        assert_eq!(
            container_name("main", "train", "ml", UID, 2),
            format!("k8s_main_train_ml_{UID}_2")
        );
        assert_eq!("systemd".parse(), Ok(CgroupDriver::Systemd));
        assert!("cgroupv2"
            .parse::<CgroupDriver>()
            .unwrap_err()
            .contains("cgroupfs or systemd"));
    }

    #[test]
    fn flags_parse_and_name_the_expected_form() {
        let m: NodeMount = "/a:/b:ro".parse().unwrap();
        assert!(m.read_only && m.host_path == "/a" && m.container_path == "/b");
        assert!(!"/a:/b".parse::<NodeMount>().unwrap().read_only);
        for bad in ["/a", "a:/b", "/a:/b:x", "/a:/b:ro:x"] {
            assert!(
                bad.parse::<NodeMount>().unwrap_err().contains("SRC:DST"),
                "{bad}"
            );
        }
        assert_eq!(parse_env("A=b=c"), Ok(("A".into(), "b=c".into())));
        assert!(parse_env("=x").is_err() && parse_env("A").is_err());
        assert_eq!("cdi".parse(), Ok(Edits::Cdi));
        assert!("both".parse::<Edits>().is_err());
    }

    #[test]
    fn the_argument_list_applies_the_answer() {
        let a = answer();
        let edits = container_edits(&cfg(Edits::Mounts), &a, &[]);
        let parent = pod_cgroup_parent(CgroupDriver::Cgroupfs, UID);
        let name = container_name("main", "p", "default", UID, 0);
        let id = Identity {
            name: &name,
            cgroup_parent: &parent,
            pod: "p",
            namespace: "default",
            uid: UID,
            container: "main",
            restart_count: 0,
        };
        let (args, skipped) =
            docker_run_args(&id, "img", &edits, &a.annotations, |p| p == "/dev/null");
        let s = args.join(" ");
        assert!(s.starts_with(&format!(
            "run -d --name {name} --cgroup-parent /kubepods/burstable/pod{UID} --network none"
        )));
        assert!(
            s.contains("--mount type=bind,src=/state/a1,dst=/etc/vcuda,readonly"),
            "{s}"
        );
        assert!(
            s.contains("--mount type=bind,src=/run/a1/region,dst=/run/vcuda/region/region --"),
            "{s}"
        );
        assert!(s.contains("--mount type=bind,src=/lib/gpusim,dst=/usr/local/gpusim/lib,readonly"));
        assert!(s.contains("--device /dev/null:/dev/null-ish:rwm"), "{s}");
        assert!(
            !s.contains("nvidia0"),
            "a device node the host lacks is skipped: {s}"
        );
        assert_eq!(skipped, vec!["/dev/nvidia0".to_string()]);
        assert!(s.contains("-e VCUDA_CONFIG=/etc/vcuda/vcuda.toml"));
        assert!(s.contains("-e LD_LIBRARY_PATH=/usr/local/gpusim/lib"));
        assert!(s.contains("--label vcuda.io/allocation=a1"));
        assert!(s.contains(&format!("--label io.kubernetes.pod.uid={UID}")));
        assert!(s.ends_with("img sleep infinity"), "{s}");
    }

    #[test]
    fn cdi_names_resolve_to_their_edits_and_an_unknown_name_fails() {
        let specs = vec![spec()];
        let names = vec!["vcuda.io/allocation=a1".to_string()];
        let cdi = resolve_cdi(&specs, &names, Path::new("/cdi")).unwrap();
        // CDI only: the spec's edits, none of the answer's.
        let e = container_edits(&cfg(Edits::Cdi), &answer(), &cdi);
        assert_eq!(e.env["FROM_SPEC"], "1");
        assert_eq!(e.env["VCUDA_CONFIG"], "/etc/vcuda/cdi.toml");
        let etc = e
            .mounts
            .iter()
            .find(|m| m.container_path == "/etc/vcuda")
            .unwrap();
        assert!(etc.read_only && etc.host_path == "/state/a1-cdi");
        let region = e
            .mounts
            .iter()
            .find(|m| m.container_path.ends_with("region"))
            .unwrap();
        assert!(!region.read_only);
        assert_eq!(e.devices.len(), 1);
        assert_eq!(
            (
                e.devices[0].host_path.as_str(),
                e.devices[0].permissions.as_str()
            ),
            ("/dev/nvidiactl", "rw"),
            "hostPath defaults to path"
        );
        // All: the answer, then CDI over it at the same paths (one mount per path).
        let e = container_edits(&cfg(Edits::All), &answer(), &cdi);
        assert_eq!(
            e.mounts
                .iter()
                .filter(|m| m.container_path == "/etc/vcuda")
                .count(),
            1
        );
        assert_eq!(e.devices.len(), 3);
        // Mounts: the CDI edits are not applied.
        let e = container_edits(&cfg(Edits::Mounts), &answer(), &cdi);
        assert!(!e.env.contains_key("FROM_SPEC"));

        let unknown = vec![
            "vcuda.io/allocation=a1".to_string(),
            "vcuda.io/allocation=gone".to_string(),
            "other.com/x=a1".to_string(),
        ];
        let err = resolve_cdi(&specs, &unknown, Path::new("/var/run/cdi")).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("unresolvable CDI devices vcuda.io/allocation=gone, other.com/x=a1"),
            "{msg}"
        );
        assert!(
            msg.contains("/var/run/cdi") && msg.contains("--cdi-spec-dir"),
            "{msg}"
        );
    }

    #[test]
    fn specs_are_read_from_json_files_and_cgroup_dirs_removed_up_to_the_top() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(
            d.path().join("a.json"),
            r#"{"kind":"k.io/c","devices":[{"name":"x"}]}"#,
        )
        .unwrap();
        std::fs::write(d.path().join("b.yaml"), "kind: k.io/c").unwrap();
        std::fs::write(d.path().join("c.json"), "{half").unwrap();
        let specs = load_specs(d.path()).unwrap();
        assert_eq!(specs.len(), 1);
        assert_eq!(specs[0].devices[0].name, "x");
        assert!(load_specs(&d.path().join("none")).unwrap().is_empty());

        let pod = d.path().join("kubepods/burstable/podu");
        std::fs::create_dir_all(&pod).unwrap();
        std::fs::create_dir_all(d.path().join("kubepods/besteffort")).unwrap();
        remove_up(d.path(), "/kubepods/burstable/podu");
        assert!(!d.path().join("kubepods/burstable").exists());
        assert!(d.path().join("kubepods/besteffort").exists());

        let mi = "30 25 0:26 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n\
                  31 25 0:27 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n\
                  32 25 0:28 / /proc rw - proc proc rw\n";
        assert_eq!(
            parse_cgroup_mounts(mi),
            vec![
                PathBuf::from("/sys/fs/cgroup/memory"),
                PathBuf::from("/sys/fs/cgroup/unified")
            ]
        );
    }
}
