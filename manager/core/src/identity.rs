//! Who a process is: which pod's cgroup it runs in, and what the kubelet's checkpoint says a
//! pod UID holds. Pure parsers over text the caller reads.
//!
//! A process registering over the control socket claims an allocation. The socket's peer
//! credentials give its host pid; `/proc/<pid>/cgroup` names the pod it runs in (the
//! kubelet puts every container under `.../pod<UID>/...` with the cgroupfs driver or
//! `...-pod<UID_with_underscores>.slice/...` with systemd); the kubelet's device-manager
//! checkpoint (read-only, lenient: kubelet.md §9) names the pod UID that holds the
//! allocation's device IDs. The claim is accepted only if the two agree.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::ids::PodUid;

/// One entry of the kubelet's checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointEntry {
    pub pod_uid: PodUid,
    pub container: String,
    pub resource: String,
    pub device_ids: Vec<String>,
}

/// The kubelet's checkpoint is not readable as a whole (single entries that are not are
/// skipped, not errors).
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("the kubelet's device-manager checkpoint is not JSON ({0}); is --kubelet-checkpoint the kubelet's kubelet_internal_checkpoint?")]
    NotJson(#[source] serde_json::Error),
}

impl CheckpointError {
    /// A short stable name for counting errors by kind.
    pub fn kind(&self) -> &'static str {
        match self {
            CheckpointError::NotJson(_) => "checkpoint-not-json",
        }
    }
}

/// Parse `kubelet_internal_checkpoint` leniently: both shapes of `DeviceIDs` (a flat list
/// before Kubernetes 1.20, a map by NUMA node since), unknown fields ignored, malformed
/// entries skipped. The checksum is not checked (it is FNV over a Go dump; we never write
/// the file).
pub fn parse_checkpoint(text: &str) -> Result<Vec<CheckpointEntry>, CheckpointError> {
    let v: Value = serde_json::from_str(text).map_err(CheckpointError::NotJson)?;
    let entries = v
        .pointer("/Data/PodDeviceEntries")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let mut out = Vec::new();
    for e in entries {
        let s = |k: &str| e.get(k).and_then(Value::as_str).map(str::to_string);
        let (Some(pod_uid), Some(container), Some(resource)) =
            (s("PodUID"), s("ContainerName"), s("ResourceName"))
        else {
            continue;
        };
        let mut device_ids = Vec::new();
        match e.get("DeviceIDs") {
            Some(Value::Array(a)) => {
                device_ids.extend(a.iter().filter_map(Value::as_str).map(str::to_string))
            }
            Some(Value::Object(m)) => {
                for ids in m.values() {
                    if let Some(a) = ids.as_array() {
                        device_ids.extend(a.iter().filter_map(Value::as_str).map(str::to_string));
                    }
                }
            }
            _ => {}
        }
        out.push(CheckpointEntry {
            pod_uid: PodUid::new(pod_uid),
            container,
            resource,
            device_ids,
        });
    }
    Ok(out)
}

/// The pod UID holding any of `ids` of `resource`, per the checkpoint.
pub fn pod_uid_of(entries: &[CheckpointEntry], resource: &str, ids: &[String]) -> Option<PodUid> {
    entries
        .iter()
        .find(|e| e.resource == resource && e.device_ids.iter().any(|d| ids.contains(d)))
        .map(|e| e.pod_uid.clone())
}

/// Whether `/proc/<pid>/cgroup` text places the process in pod `uid`'s cgroup.
pub fn in_pod(cgroup: &str, uid: &str) -> bool {
    let dashed = uid.to_ascii_lowercase();
    let underscored = dashed.replace('-', "_");
    cgroup.lines().any(|line| {
        let path = line
            .splitn(3, ':')
            .nth(2)
            .unwrap_or("")
            .to_ascii_lowercase();
        path.split('/').any(|part| {
            part == format!("pod{dashed}")
                || part.contains(&format!("-pod{underscored}.slice"))
                || part.contains(&format!("-pod{dashed}.slice"))
        })
    })
}

/// The pid a process has in its innermost pid namespace, from `/proc/<pid>/status`
/// (`NSpid:` lists the pid in each namespace, outermost first).
pub fn innermost_pid(status: &str) -> Option<u32> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))
        .and_then(|rest| rest.split_whitespace().last())
        .and_then(|p| p.parse().ok())
}

/// Field 22 (start time, clock ticks since boot) of `/proc/<pid>/stat`.
pub fn start_time(stat: &str) -> Option<u64> {
    // The command name (field 2) may contain spaces and parentheses: count from the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Pod UIDs per resource and device, for quick lookups over many entries.
/// Keyed by (resource name, device ID).
pub fn index(entries: &[CheckpointEntry]) -> BTreeMap<(String, String), PodUid> {
    let mut m = BTreeMap::new();
    for e in entries {
        for d in &e.device_ids {
            m.insert((e.resource.clone(), d.clone()), e.pod_uid.clone());
        }
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_checkpoint_shapes_parse() {
        let new = r#"{"Data":{"PodDeviceEntries":[
            {"PodUID":"u-1","ContainerName":"c","ResourceName":"tencent.com/vcuda-core","DeviceIDs":{"0":["a","b"],"-1":["c"]},"AllocResp":"AA=="},
            {"PodUID":"u-2","ContainerName":"c","ResourceName":"tencent.com/vcuda-memory","DeviceIDs":["m1"]},
            {"Garbage":true}],
            "RegisteredDevices":{}},"Checksum":123,"BootID":"x"}"#;
        let e = parse_checkpoint(new).unwrap();
        assert_eq!(e.len(), 2);
        let mut ids = e[0].device_ids.clone();
        ids.sort();
        assert_eq!(ids, ["a", "b", "c"]);
        assert_eq!(
            pod_uid_of(&e, "tencent.com/vcuda-core", &["c".into()])
                .as_ref()
                .map(PodUid::as_str),
            Some("u-1")
        );
        assert_eq!(
            pod_uid_of(&e, "tencent.com/vcuda-memory", &["m1".into()])
                .as_ref()
                .map(PodUid::as_str),
            Some("u-2")
        );
        assert_eq!(
            pod_uid_of(&e, "tencent.com/vcuda-core", &["m1".into()]),
            None
        );
        assert!(parse_checkpoint("{}").unwrap().is_empty());
        assert!(matches!(
            parse_checkpoint("nope"),
            Err(CheckpointError::NotJson(_))
        ));
    }

    #[test]
    fn pod_cgroups_of_both_drivers() {
        let uid = "0f6c7d3e-1b2a-4c5d-8e9f-001122334455";
        let cgroupfs = "0::/kubepods/burstable/pod0f6c7d3e-1b2a-4c5d-8e9f-001122334455/8d2f...\n";
        let systemd = "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod0f6c7d3e_1b2a_4c5d_8e9f_001122334455.slice/cri-containerd-1.scope\n";
        let v1 = "12:memory:/kubepods/pod0f6c7d3e-1b2a-4c5d-8e9f-001122334455/abc\n11:cpu:/x\n";
        for c in [cgroupfs, systemd, v1] {
            assert!(in_pod(c, uid), "{c}");
        }
        assert!(!in_pod(cgroupfs, "0f6c7d3e-1b2a-4c5d-8e9f-001122334456"));
        assert!(!in_pod("0::/user.slice/session-1.scope\n", uid));
    }

    #[test]
    fn proc_fields() {
        assert_eq!(
            innermost_pid("Name:\tx\nNSpid:\t4242\t17\nPPid:\t1\n"),
            Some(17)
        );
        assert_eq!(innermost_pid("Name:\tx\nNSpid:\t4242\n"), Some(4242));
        let stat = "4242 (a (weird) name) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 10";
        assert_eq!(start_time(stat), Some(987654));
        assert_eq!(start_time("garbage"), None);
    }
}
