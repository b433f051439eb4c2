//! How the kubelet combines the Allocate responses of a container's resources into the
//! container's run options (kubelet.md §4, `deviceRunContainerOptions` in pod_devices.go).
//!
//! Envs and annotations are keyed by name, mounts and devices by container path, CDI devices
//! by name. **The first writer wins**; the real kubelet only logs a conflict, we also return it
//! so tests can assert there is none. The real kubelet walks a Go map, so the order of
//! resources (and so which one "writes first") is random there; here it is the order given.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::proto::deviceplugin::ContainerAllocateResponse;

/// One mount of the merged run options.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MountOut {
    pub container_path: String,
    pub host_path: String,
    pub read_only: bool,
}

/// One device node of the merged run options.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceOut {
    pub container_path: String,
    pub host_path: String,
    pub permissions: String,
}

/// What the container runtime would be told for one container.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunOptions {
    pub envs: BTreeMap<String, String>,
    pub mounts: Vec<MountOut>,
    pub devices: Vec<DeviceOut>,
    pub annotations: BTreeMap<String, String>,
    pub cdi_devices: Vec<String>,
    /// Settings dropped because an earlier resource set the same key differently.
    pub conflicts: Vec<String>,
}

/// Merges `(resource, response)` pairs in the given order; the first writer wins.
pub fn merge<'a>(
    responses: impl IntoIterator<Item = (&'a str, &'a ContainerAllocateResponse)>,
) -> RunOptions {
    let mut out = RunOptions::default();
    let mut mount_owner: BTreeMap<String, usize> = BTreeMap::new();
    let mut device_owner: BTreeMap<String, usize> = BTreeMap::new();
    let mut cdi_seen = BTreeSet::new();
    for (resource, resp) in responses {
        let sorted = |m: &std::collections::HashMap<String, String>| {
            m.iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect::<BTreeMap<_, _>>()
        };
        for (k, v) in sorted(&resp.envs) {
            match out.envs.get(&k) {
                Some(old) if *old != v => out
                    .conflicts
                    .push(format!("env {k}: {resource} wants {v:?}, kept {old:?}")),
                Some(_) => {}
                None => {
                    out.envs.insert(k, v);
                }
            }
        }
        for m in &resp.mounts {
            match mount_owner.get(&m.container_path) {
                Some(&i) if out.mounts[i].host_path != m.host_path => out.conflicts.push(format!(
                    "mount {}: {resource} wants host path {:?}, kept {:?}",
                    m.container_path, m.host_path, out.mounts[i].host_path
                )),
                Some(_) => {}
                None => {
                    mount_owner.insert(m.container_path.clone(), out.mounts.len());
                    out.mounts.push(MountOut {
                        container_path: m.container_path.clone(),
                        host_path: m.host_path.clone(),
                        read_only: m.read_only,
                    });
                }
            }
        }
        for d in &resp.devices {
            match device_owner.get(&d.container_path) {
                Some(&i) if out.devices[i].host_path != d.host_path => out.conflicts.push(format!(
                    "device {}: {resource} wants host path {:?}, kept {:?}",
                    d.container_path, d.host_path, out.devices[i].host_path
                )),
                Some(_) => {}
                None => {
                    device_owner.insert(d.container_path.clone(), out.devices.len());
                    out.devices.push(DeviceOut {
                        container_path: d.container_path.clone(),
                        host_path: d.host_path.clone(),
                        permissions: d.permissions.clone(),
                    });
                }
            }
        }
        for (k, v) in sorted(&resp.annotations) {
            match out.annotations.get(&k) {
                Some(old) if *old != v => out.conflicts.push(format!(
                    "annotation {k}: {resource} wants {v:?}, kept {old:?}"
                )),
                Some(_) => {}
                None => {
                    out.annotations.insert(k, v);
                }
            }
        }
        for c in &resp.cdi_devices {
            if cdi_seen.insert(c.name.clone()) {
                out.cdi_devices.push(c.name.clone());
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::deviceplugin::{CdiDevice, DeviceSpec, Mount};

    fn resp(tag: &str) -> ContainerAllocateResponse {
        ContainerAllocateResponse {
            envs: [
                ("SHARED".into(), tag.into()),
                (format!("ONLY_{tag}"), "1".into()),
            ]
            .into_iter()
            .collect(),
            mounts: vec![
                Mount {
                    container_path: "/shared".into(),
                    host_path: format!("/host/{tag}"),
                    read_only: true,
                },
                Mount {
                    container_path: "/same".into(),
                    host_path: "/host/same".into(),
                    read_only: false,
                },
            ],
            devices: vec![DeviceSpec {
                container_path: "/dev/x".into(),
                host_path: format!("/dev/{tag}"),
                permissions: "rw".into(),
            }],
            annotations: [("a".into(), tag.into())].into_iter().collect(),
            cdi_devices: vec![CdiDevice {
                name: "v.com/c=0".into(),
            }],
        }
    }

    #[test]
    fn first_writer_wins_and_conflicts_are_reported() {
        let (a, b) = (resp("a"), resp("b"));
        let out = merge([("r/a", &a), ("r/b", &b)]);
        assert_eq!(out.envs["SHARED"], "a");
        assert_eq!(out.envs["ONLY_b"], "1");
        assert_eq!(out.mounts.len(), 2);
        assert_eq!(out.mounts[0].host_path, "/host/a");
        assert_eq!(out.devices.len(), 1);
        assert_eq!(out.devices[0].host_path, "/dev/a");
        assert_eq!(out.annotations["a"], "a");
        assert_eq!(out.cdi_devices, vec!["v.com/c=0".to_string()]);
        // env SHARED, mount /shared, device /dev/x, annotation a; "/same" agrees.
        assert_eq!(out.conflicts.len(), 4, "{:?}", out.conflicts);
    }
}
