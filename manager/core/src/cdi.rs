//! CDI (Container Device Interface): the same container edits as an Allocate answer, as a
//! spec file a CDI-aware runtime (containerd ≥ 1.7, CRI-O) applies by device name.
//!
//! One CDI device per allocation, of one vendor/class of our own: `vcuda.io/allocation`
//! (the `vcuda.io/` prefix of our annotations; the class says what a device of it is — one
//! container's allocation, not a GPU). Its name is the allocation id (`a` + 32 hex digits,
//! a valid CDI name), so the fully qualified name is `vcuda.io/allocation=<id>`. Each
//! allocation has its own *transient* spec file, named as the CDI library names them
//! (`GenerateTransientSpecName`: `<vendor>-<class>_<id>.json`), so that writing or removing
//! one never touches another's, and a file name alone tells whether it is ours and whose.
//!
//! What is here is pure: the spec's contents from an [`Answer`], the names, and which of a
//! directory's file names are ours and stale. Writing and removing are the daemon's
//! (`vcuda_manager::cdi`).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::allocation::Answer;
use crate::ids::AllocationId;

/// Our vendor (the CDI kind's prefix).
pub const VENDOR: &str = "vcuda.io";
/// Our class (the CDI kind's name): one device is one container's allocation.
pub const CLASS: &str = "allocation";
/// The CDI kind, `vendor/class`.
pub const KIND: &str = "vcuda.io/allocation";
/// The CDI spec version written: the oldest that has every field used (`hostPath` of a
/// device node came in 0.5.0), so the oldest CDI-aware runtimes (containerd 1.7.0 ships
/// the CDI library 0.5) read it.
pub const CDI_VERSION: &str = "0.5.0";

/// Every spec file of ours starts with this: `<vendor>-<class>_`.
const FILE_PREFIX: &str = "vcuda.io-allocation_";
const FILE_SUFFIX: &str = ".json";

/// An allocation id that cannot be a CDI device name, or a file name (a checkpoint written
/// by hand, another release's ids). Nothing is written for it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("allocation id {id:?} is not a CDI device name (letters, digits, '-', '_', '.', starting and ending with a letter or digit); no CDI spec is written for it, its container gets the mounts answer only")]
pub struct NameError {
    pub id: String,
}

/// Whether `name` is a CDI device name (SPEC.md, "CDI Devices": alphanumerics with `-`,
/// `_`, `.` between, beginning and ending alphanumeric). Such a name is also a safe file
/// name component: no `/`, never `.` or `..`.
pub fn is_device_name(name: &str) -> bool {
    let b = name.as_bytes();
    let inner = |c: &u8| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.');
    match (b.first(), b.last()) {
        (Some(f), Some(l)) => {
            f.is_ascii_alphanumeric() && l.is_ascii_alphanumeric() && b.iter().all(inner)
        }
        _ => false,
    }
}

fn checked(id: &AllocationId) -> Result<&str, NameError> {
    let s = id.as_str();
    if is_device_name(s) {
        Ok(s)
    } else {
        Err(NameError { id: s.to_string() })
    }
}

/// The fully qualified CDI device name of an allocation: `vcuda.io/allocation=<id>`, what
/// Allocate returns in `cdi_devices`.
pub fn device_name(id: &AllocationId) -> Result<String, NameError> {
    Ok(format!("{KIND}={}", checked(id)?))
}

/// The spec file's name (in the CDI spec directory): `vcuda.io-allocation_<id>.json`.
pub fn file_name(id: &AllocationId) -> Result<String, NameError> {
    Ok(format!("{FILE_PREFIX}{}{FILE_SUFFIX}", checked(id)?))
}

/// The allocation a spec file name of ours is for; `None`: not one of ours (another
/// vendor's, or a name we never write).
pub fn allocation_of(file_name: &str) -> Option<AllocationId> {
    let id = file_name
        .strip_prefix(FILE_PREFIX)?
        .strip_suffix(FILE_SUFFIX)?;
    is_device_name(id).then(|| AllocationId::new(id))
}

/// Whether `file_name` is a temporary file of ours (`.vcuda.io-allocation_<…>.tmp`: hidden,
/// and not `.json`, so no runtime reads it), left by a writer that died before its rename.
pub fn is_our_temporary(file_name: &str) -> bool {
    file_name
        .strip_prefix('.')
        .and_then(|n| n.strip_prefix(FILE_PREFIX))
        .is_some_and(|n| n.ends_with(".tmp") && !n.contains('/'))
}

/// The prefix of a temporary file for `final_name` (the writer appends random characters and
/// `.tmp`): hidden, in the same directory, never `.json`.
pub fn temporary_prefix(final_name: &str) -> String {
    format!(".{final_name}.")
}

/// Of a spec directory's file names, those to remove: ours (by name) whose allocation is not
/// `known`, and our temporary files. Anyone else's files are never named.
pub fn stale<'a>(
    names: impl IntoIterator<Item = &'a str>,
    known: impl Fn(&AllocationId) -> bool,
) -> Vec<String> {
    names
        .into_iter()
        .filter(|n| is_our_temporary(n) || allocation_of(n).is_some_and(|id| !known(&id)))
        .map(str::to_string)
        .collect()
}

/// A CDI spec (SPEC.md, "JSON Definition"); only the fields we write.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Spec {
    pub cdi_version: String,
    pub kind: String,
    pub devices: Vec<Device>,
}

/// One CDI device: a name and its edits.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Device {
    pub name: String,
    pub container_edits: ContainerEdits,
}

/// The edits applied to the container's OCI spec when the device is requested.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ContainerEdits {
    /// `NAME=VALUE`, appended to the container's environment.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub device_nodes: Vec<DeviceNode>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<Mount>,
}

/// A device node (the runtime reads its type and numbers from `hostPath`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DeviceNode {
    pub path: String,
    pub host_path: String,
    /// Cgroup permissions, `r`, `w`, `m`.
    pub permissions: String,
}

/// A bind mount.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Mount {
    pub host_path: String,
    pub container_path: String,
    /// OCI mount options: `ro`/`rw`, `nosuid`, `nodev`, `bind` (what the NVIDIA container
    /// toolkit's specs use for its library mounts).
    pub options: Vec<String>,
}

/// The spec of an allocation: one device, [`device_name`]'s, whose edits are exactly the
/// Allocate `answer`'s environment, device nodes and mounts (read-only where the answer's
/// are). Its annotations are not edits (the kubelet passes them to the runtime itself).
pub fn spec(id: &AllocationId, answer: &Answer) -> Result<Spec, NameError> {
    let name = checked(id)?.to_string();
    let env = answer
        .envs
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    let device_nodes = answer
        .devices
        .iter()
        .map(|d| DeviceNode {
            path: d.container.clone(),
            host_path: d.host.clone(),
            permissions: d.permissions.clone(),
        })
        .collect();
    let mounts = answer
        .mounts
        .iter()
        .map(|m| Mount {
            host_path: m.host.display().to_string(),
            container_path: m.container.clone(),
            options: [
                if m.read_only { "ro" } else { "rw" },
                "nosuid",
                "nodev",
                "bind",
            ]
            .map(String::from)
            .to_vec(),
        })
        .collect();
    Ok(Spec {
        cdi_version: CDI_VERSION.into(),
        kind: KIND.into(),
        devices: vec![Device {
            name,
            container_edits: ContainerEdits {
                env,
                device_nodes,
                mounts,
            },
        }],
    })
}

impl Spec {
    /// The file's bytes: pretty JSON and a final newline.
    pub fn to_json(&self) -> String {
        let mut s = serde_json::to_string_pretty(self).expect("a spec always serializes");
        s.push('\n');
        s
    }

    /// The spec's environment as a map (the last of a repeated name wins, as in a process's
    /// environment).
    pub fn env(&self) -> BTreeMap<&str, &str> {
        self.devices
            .iter()
            .flat_map(|d| &d.container_edits.env)
            .filter_map(|e| e.split_once('='))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::allocation::{answer, Allocation, Gpu, Layout};
    use std::path::PathBuf;

    const U0: &str = "GPU-5a1c2e4f-0d3b-4c8a-9e61-7b2f10c3d401";
    const ID: &str = "a00112233445566778899aabbccddeeff";

    fn alloc() -> (Allocation, Answer) {
        let layout = Layout {
            state_dir: "/var/lib/vcuda".into(),
            run_dir: "/run/vcuda".into(),
            socket_dir: "/run/vcuda/sock".into(),
            library: "/usr/local/vcuda/lib64/libvcuda.so".into(),
        };
        let a = Allocation {
            slice: false,
            id: AllocationId::new(ID),
            cores: vec![],
            gpus: vec![U0.into()],
            percent: 30,
            memory: vec![],
            quota: 0,
            core_limit: None,
            owner: None,
            created: 0,
        };
        let gpus = [Gpu {
            uuid: U0.into(),
            memory: 40 << 30,
            minor: 3,
        }];
        let ans = answer(&layout, &a, &gpus);
        (a, ans)
    }

    #[test]
    fn names_are_our_vendor_and_class_and_the_allocation_id() {
        let id = AllocationId::new(ID);
        assert_eq!(
            device_name(&id).unwrap(),
            format!("vcuda.io/allocation={ID}")
        );
        assert_eq!(KIND, format!("{VENDOR}/{CLASS}"));
        let f = file_name(&id).unwrap();
        assert_eq!(f, format!("vcuda.io-allocation_{ID}.json"));
        assert_eq!(allocation_of(&f), Some(id));
        assert!(temporary_prefix(&f).starts_with(&format!(".{f}.")));
        assert!(is_our_temporary(&format!(
            "{}x1y2.tmp",
            temporary_prefix(&f)
        )));
    }

    /// An id that would escape the directory, or is no CDI name, gets no spec and no name.
    #[test]
    fn an_id_that_is_no_device_name_gets_no_file_name() {
        for bad in ["", "../x", "a/b", ".", "..", "-a", "a-", "a b", "a\0b", "é"] {
            let id = AllocationId::new(bad);
            assert!(file_name(&id).is_err(), "{bad:?}");
            assert!(device_name(&id).is_err(), "{bad:?}");
            assert!(spec(&id, &Answer::default()).is_err(), "{bad:?}");
        }
        let e = device_name(&AllocationId::new("../x"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"../x\"") && e.contains("mounts answer"), "{e}");
        for good in ["0", "a", "a.b-c_d", "7ab"] {
            assert!(is_device_name(good), "{good}");
        }
    }

    /// Only our own names are ever called stale: another vendor's spec, a file of ours for
    /// an allocation that still exists, and look-alikes stay.
    #[test]
    fn only_our_files_of_gone_allocations_and_our_temporaries_are_stale() {
        let names = [
            "nvidia.com-gpu.json",
            "vcuda.io-allocation_akeep.json",
            "vcuda.io-allocation_agone.json",
            ".vcuda.io-allocation_agone.json.3f2a.tmp",
            "vcuda.io-allocation_agone.yaml",
            "vcuda.io-allocation_.json",
            "vcuda.io-allocation_../x.json",
            "vcuda.io-other_agone.json",
            "xvcuda.io-allocation_agone.json",
            ".nvidia.com-gpu.json.tmp",
        ];
        let known = |id: &AllocationId| id.as_str() == "akeep";
        assert_eq!(
            stale(names.iter().copied(), known),
            vec![
                "vcuda.io-allocation_agone.json".to_string(),
                ".vcuda.io-allocation_agone.json.3f2a.tmp".to_string(),
            ]
        );
    }

    /// The spec's edits are exactly the Allocate answer's: every env, device and mount, with
    /// the answer's read-only flags, and nothing else.
    #[test]
    fn the_spec_makes_exactly_the_edits_of_the_allocate_answer() {
        let (a, ans) = alloc();
        let s = spec(&a.id, &ans).unwrap();
        assert_eq!((s.cdi_version.as_str(), s.kind.as_str()), ("0.5.0", KIND));
        let [d] = &s.devices[..] else {
            panic!("one device: {s:?}")
        };
        assert_eq!(d.name, ID);
        let e = &d.container_edits;
        let env: BTreeMap<String, String> = s
            .env()
            .into_iter()
            .map(|(k, v)| (k.into(), v.into()))
            .collect();
        assert_eq!(env, ans.envs);
        assert_eq!(e.env.len(), ans.envs.len());
        assert_eq!(e.device_nodes.len(), ans.devices.len());
        for (n, d) in e.device_nodes.iter().zip(&ans.devices) {
            assert_eq!(
                (&n.path, &n.host_path, &n.permissions),
                (&d.container, &d.host, &d.permissions)
            );
        }
        assert!(e.device_nodes.iter().any(|n| n.path == "/dev/nvidia3"));
        assert_eq!(e.mounts.len(), ans.mounts.len());
        for (m, a) in e.mounts.iter().zip(&ans.mounts) {
            assert_eq!(PathBuf::from(&m.host_path), a.host);
            assert_eq!(m.container_path, a.container);
            assert_eq!(m.options.contains(&"ro".to_string()), a.read_only, "{m:?}");
            assert_eq!(m.options.contains(&"rw".to_string()), !a.read_only, "{m:?}");
            assert!(m.options.contains(&"bind".to_string()), "{m:?}");
        }
        // The preload file, the library, the config, the region and the socket are there.
        for p in [
            "/etc/ld.so.preload",
            "/usr/local/vcuda/lib64/libvcuda.so",
            "/etc/vcuda",
            "/run/vcuda/region/region",
            "/run/vcuda/sock",
        ] {
            assert!(e.mounts.iter().any(|m| m.container_path == p), "{p}");
        }
    }

    /// The file is JSON with the spec's camelCase keys, read back to the same spec; an empty
    /// answer's edits leave their keys out.
    #[test]
    fn the_json_round_trips_with_the_specs_keys() {
        let (a, ans) = alloc();
        let s = spec(&a.id, &ans).unwrap();
        let text = s.to_json();
        assert!(text.ends_with("}\n"));
        for key in [
            "\"cdiVersion\"",
            "\"containerEdits\"",
            "\"deviceNodes\"",
            "\"hostPath\"",
            "\"containerPath\"",
        ] {
            assert!(text.contains(key), "{key}: {text}");
        }
        assert_eq!(serde_json::from_str::<Spec>(&text).unwrap(), s);
        let empty = spec(&a.id, &Answer::default()).unwrap().to_json();
        let v: serde_json::Value = serde_json::from_str(&empty).unwrap();
        assert_eq!(v["devices"][0]["containerEdits"], serde_json::json!({}));
    }
}
