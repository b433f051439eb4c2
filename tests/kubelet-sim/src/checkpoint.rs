//! The device manager's checkpoint file, `<plugin dir>/kubelet_internal_checkpoint`
//! (kubelet.md §9), in the shape kubelets ≥ 1.20 write:
//!
//! ```json
//! {"Data":{"PodDeviceEntries":[{"PodUID":"…","ContainerName":"…","ResourceName":"…",
//!          "DeviceIDs":{"-1":["id",…]},"AllocResp":"<base64 protobuf>"}],
//!          "RegisteredDevices":{"vendor.com/res":["healthy id",…]}},
//!  "Checksum":0,"BootID":"…"}
//! ```
//!
//! `DeviceIDs` maps a NUMA node (as a string, `"-1"` = no topology) to IDs; `AllocResp` is
//! base64 of the protobuf `ContainerAllocateResponse` the plugin returned; `RegisteredDevices`
//! holds healthy IDs only; `PodDeviceEntries` is `null` when empty (a nil Go slice).
//!
//! `Checksum`: the real kubelet writes FNV-32a over a Go `spew` dump of `Data`, which is not
//! practical to reproduce outside Go; kubelet-sim writes 0 and does not verify it on reading.
//! Reading is lenient: both `DeviceIDs` shapes (pre-1.20 flat list, ≥ 1.20 map) and unknown
//! fields are accepted.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use base64::Engine;
use serde::{Deserialize, Serialize};

/// File name of the checkpoint inside the plugin directory.
pub const FILE_NAME: &str = "kubelet_internal_checkpoint";

/// NUMA key for devices without topology.
pub const NO_TOPOLOGY: i64 = -1;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Checkpoint {
    #[serde(rename = "Data")]
    pub data: Data,
    #[serde(rename = "Checksum", default)]
    pub checksum: u64,
    #[serde(rename = "BootID", default, skip_serializing_if = "String::is_empty")]
    pub boot_id: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Data {
    #[serde(rename = "PodDeviceEntries", default)]
    pub pod_device_entries: Option<Vec<Entry>>,
    #[serde(rename = "RegisteredDevices", default)]
    pub registered_devices: BTreeMap<String, Vec<String>>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    #[serde(rename = "PodUID")]
    pub pod_uid: String,
    #[serde(rename = "ContainerName")]
    pub container_name: String,
    #[serde(rename = "ResourceName")]
    pub resource_name: String,
    #[serde(rename = "DeviceIDs")]
    pub device_ids: DeviceIds,
    /// base64 (standard alphabet, padded: Go's encoding of `[]byte`; a nil slice is `null`).
    #[serde(rename = "AllocResp", deserialize_with = "null_as_empty")]
    pub alloc_resp: String,
}

/// `DeviceIDs` in either shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum DeviceIds {
    /// ≥ 1.20: NUMA node (decimal string) → IDs. Go sorts map keys as strings.
    PerNuma(BTreeMap<String, Vec<String>>),
    /// < 1.20: a flat list.
    Flat(Vec<String>),
}

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("cannot write {path}: {source}")]
    Write {
        path: String,
        source: std::io::Error,
    },
    #[error("{path} is not a device-manager checkpoint: {source}")]
    Parse {
        path: String,
        source: serde_json::Error,
    },
    #[error("checkpoint entry for pod {pod_uid} container {container}: bad AllocResp: {reason}")]
    AllocResp {
        pod_uid: String,
        container: String,
        reason: String,
    },
}

impl DeviceIds {
    /// NUMA node → IDs (a flat list is read as "no topology").
    pub fn per_numa(&self) -> BTreeMap<i64, Vec<String>> {
        match self {
            DeviceIds::Flat(ids) => [(NO_TOPOLOGY, ids.clone())].into_iter().collect(),
            DeviceIds::PerNuma(m) => m
                .iter()
                .filter_map(|(k, v)| k.parse::<i64>().ok().map(|k| (k, v.clone())))
                .collect(),
        }
    }

    pub fn from_per_numa(m: &BTreeMap<i64, Vec<String>>) -> Self {
        DeviceIds::PerNuma(m.iter().map(|(k, v)| (k.to_string(), v.clone())).collect())
    }
}

fn null_as_empty<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    Ok(Option::<String>::deserialize(d)?.unwrap_or_default())
}

pub fn encode_alloc_resp(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

pub fn decode_alloc_resp(s: &str) -> Result<Vec<u8>, base64::DecodeError> {
    base64::engine::general_purpose::STANDARD.decode(s)
}

/// The kernel's boot id (what newer kubelets store in `BootID`), empty if unreadable.
pub fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// Writes atomically: a temporary file in the same directory, then a rename (as the kubelet's
/// checkpoint manager does), so a reader never sees half a file.
pub fn write(dir: &Path, cp: &Checkpoint) -> Result<(), CheckpointError> {
    let path = dir.join(FILE_NAME);
    let tmp = dir.join(format!(".{FILE_NAME}.tmp"));
    let err = |source| CheckpointError::Write {
        path: path.display().to_string(),
        source,
    };
    let json = serde_json::to_vec(cp).expect("checkpoint serializes");
    let mut f = std::fs::File::create(&tmp).map_err(err)?;
    f.write_all(&json).map_err(err)?;
    f.sync_all().map_err(err)?;
    std::fs::rename(&tmp, &path).map_err(err)
}

/// Reads the checkpoint; `Ok(None)` when the file does not exist (a fresh node).
pub fn read(dir: &Path) -> Result<Option<Checkpoint>, CheckpointError> {
    let path = dir.join(FILE_NAME);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(CheckpointError::Read {
                path: path.display().to_string(),
                source,
            })
        }
    };
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|source| CheckpointError::Parse {
            path: path.display().to_string(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_the_go_shape() {
        let cp = Checkpoint {
            data: Data {
                pod_device_entries: None,
                registered_devices: [("a.com/x".to_string(), vec![])].into_iter().collect(),
            },
            checksum: 0,
            boot_id: String::new(),
        };
        assert_eq!(
            serde_json::to_string(&cp).unwrap(),
            r#"{"Data":{"PodDeviceEntries":null,"RegisteredDevices":{"a.com/x":[]}},"Checksum":0}"#
        );
    }

    #[test]
    fn reads_both_device_id_shapes_and_ignores_unknown_fields() {
        let old = r#"{"Data":{"PodDeviceEntries":[{"PodUID":"u","ContainerName":"c",
            "ResourceName":"a.com/x","DeviceIDs":["d1","d2"],"AllocResp":"","Extra":1}],
            "RegisteredDevices":{"a.com/x":["d1"]}},"Checksum":12345}"#;
        let cp: Checkpoint = serde_json::from_str(old).unwrap();
        let e = &cp.data.pod_device_entries.as_ref().unwrap()[0];
        assert_eq!(e.device_ids.per_numa()[&-1], vec!["d1", "d2"]);

        let new = r#"{"Data":{"PodDeviceEntries":[{"PodUID":"u","ContainerName":"c",
            "ResourceName":"a.com/x","DeviceIDs":{"0":["d1"],"-1":["d2"]},"AllocResp":"CgA="}],
            "RegisteredDevices":{}},"Checksum":1,"BootID":"b"}"#;
        let cp: Checkpoint = serde_json::from_str(new).unwrap();
        let e = &cp.data.pod_device_entries.as_ref().unwrap()[0];
        let m = e.device_ids.per_numa();
        assert_eq!(
            (m[&0].clone(), m[&-1].clone()),
            (vec!["d1".into()], vec!["d2".into()])
        );
        assert_eq!(decode_alloc_resp(&e.alloc_resp).unwrap(), vec![0x0a, 0x00]);
    }

    #[test]
    fn write_then_read_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        assert!(read(dir.path()).unwrap().is_none());
        let per_numa = [(-1, vec!["a".to_string()]), (1, vec!["b".to_string()])]
            .into_iter()
            .collect();
        let cp = Checkpoint {
            data: Data {
                pod_device_entries: Some(vec![Entry {
                    pod_uid: "u".into(),
                    container_name: "c".into(),
                    resource_name: "a.com/x".into(),
                    device_ids: DeviceIds::from_per_numa(&per_numa),
                    alloc_resp: encode_alloc_resp(b"\x0a\x00"),
                }]),
                registered_devices: BTreeMap::new(),
            },
            checksum: 0,
            boot_id: "boot".into(),
        };
        write(dir.path(), &cp).unwrap();
        assert_eq!(read(dir.path()).unwrap(), Some(cp));
    }
}
