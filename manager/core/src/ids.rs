//! The ids the manager keys its state by, each its own type so that the compiler tells them
//! apart: an allocation's id ([`AllocationId`]) from a pod's UID ([`PodUid`]), a container
//! ([`ContainerRef`]) from a pod ([`PodRef`]).
//!
//! Device IDs: what the kubelet sees of our GPUs. `vcuda-core` advertises 100 devices per GPU
//! (1 % each), `vcuda-memory` one per 256 MiB. An ID is the GPU's UUID plus a kind and an
//! index, so it names its GPU, stays the same across manager and node restarts (the kubelet
//! keys its checkpoint by ID), and fits the API's 63-character limit.

use std::borrow::Borrow;
use std::fmt;

use serde::{Deserialize, Serialize};

/// A newtype over a `String` id: ordered, hashed and (de)serialized as the string itself
/// (`#[serde(transparent)]`: the checkpoint and the wire carry the bare string), shown as
/// it, and looked up by `&str` in maps keyed by it (`Borrow<str>`).
macro_rules! string_id {
    ($(#[$meta:meta])* $name:ident) => {
        $(#[$meta])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(String);

        impl $name {
            pub fn new(id: impl Into<String>) -> Self {
                $name(id.into())
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }

            pub fn is_empty(&self) -> bool {
                self.0.is_empty()
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl Borrow<str> for $name {
            fn borrow(&self) -> &str {
                &self.0
            }
        }

        impl From<String> for $name {
            fn from(id: String) -> Self {
                $name(id)
            }
        }

        impl From<&str> for $name {
            fn from(id: &str) -> Self {
                $name(id.to_string())
            }
        }

        impl From<$name> for String {
            fn from(id: $name) -> String {
                id.0
            }
        }

        impl PartialEq<str> for $name {
            fn eq(&self, other: &str) -> bool {
                self.0 == other
            }
        }

        impl PartialEq<&str> for $name {
            fn eq(&self, other: &&str) -> bool {
                self.0 == *other
            }
        }
    };
}

string_id! {
    /// An allocation's id: `a` and 128 random bits in hex, drawn by the daemon at the
    /// `vcuda-core` Allocate (a container sees its own in its config, so none can guess
    /// another's, and ids are never reused). Names its directory, its checkpoint record,
    /// and what a process claims on the control socket.
    AllocationId
}

string_id! {
    /// A pod's UID (`metadata.uid`; the kubelet's checkpoint's `PodUID`): what names the
    /// pod's cgroup, and the scheduler's reservations.
    PodUid
}

/// A pod by name: `namespace/name`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PodRef {
    pub namespace: String,
    pub name: String,
}

impl PodRef {
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> Self {
        PodRef {
            namespace: namespace.into(),
            name: name.into(),
        }
    }
}

impl fmt::Display for PodRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// A container by name: `namespace/pod/container`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ContainerRef {
    pub namespace: String,
    pub pod: String,
    pub container: String,
}

impl ContainerRef {
    pub fn new(
        namespace: impl Into<String>,
        pod: impl Into<String>,
        container: impl Into<String>,
    ) -> Self {
        ContainerRef {
            namespace: namespace.into(),
            pod: pod.into(),
            container: container.into(),
        }
    }

    /// Its pod.
    pub fn pod_ref(&self) -> PodRef {
        PodRef::new(self.namespace.clone(), self.pod.clone())
    }
}

impl fmt::Display for ContainerRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}/{}", self.namespace, self.pod, self.container)
    }
}

/// Memory unit of `vcuda-memory`, bytes (GPUManager's contract).
pub const MEMORY_UNIT: u64 = 256 << 20;
/// `vcuda-core` devices per GPU.
pub const CORES_PER_GPU: u32 = 100;

/// The two resources.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    Core,
    Memory,
}

impl Kind {
    /// The resource's name under a domain, e.g. `tencent.com/vcuda-core`.
    pub fn resource(self, domain: &str) -> String {
        match self {
            Kind::Core => format!("{domain}/vcuda-core"),
            Kind::Memory => format!("{domain}/vcuda-memory"),
        }
    }

    /// The socket file name of the resource's device plugin.
    pub fn socket(self) -> &'static str {
        match self {
            Kind::Core => "vcuda-core.sock",
            Kind::Memory => "vcuda-memory.sock",
        }
    }

    fn tag(self) -> &'static str {
        match self {
            Kind::Core => "core",
            Kind::Memory => "mem",
        }
    }
}

/// One device ID, parsed.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeviceId {
    pub uuid: String,
    pub kind: Kind,
    pub index: u32,
}

impl fmt::Display for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}-{:04}", self.uuid, self.kind.tag(), self.index)
    }
}

impl DeviceId {
    pub fn new(uuid: &str, kind: Kind, index: u32) -> DeviceId {
        DeviceId {
            uuid: uuid.to_string(),
            kind,
            index,
        }
    }

    /// Parse an ID of ours; `None` for anything else.
    pub fn parse(s: &str) -> Option<DeviceId> {
        let (rest, index) = s.rsplit_once('-')?;
        let (uuid, tag) = rest.rsplit_once('-')?;
        let kind = match tag {
            "core" => Kind::Core,
            "mem" => Kind::Memory,
            _ => return None,
        };
        if index.len() != 4 || !index.bytes().all(|b| b.is_ascii_digit()) || uuid.is_empty() {
            return None;
        }
        Some(DeviceId {
            uuid: uuid.to_string(),
            kind,
            index: index.parse().ok()?,
        })
    }
}

/// Memory devices a GPU of `bytes` advertises.
pub fn memory_units(bytes: u64) -> u32 {
    (bytes / MEMORY_UNIT).min(9999) as u32
}

/// Every ID of one kind on one GPU.
pub fn all_ids(uuid: &str, kind: Kind, memory_bytes: u64) -> Vec<DeviceId> {
    let n = match kind {
        Kind::Core => CORES_PER_GPU,
        Kind::Memory => memory_units(memory_bytes),
    };
    (0..n).map(|i| DeviceId::new(uuid, kind, i)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const U: &str = "GPU-5a1c2e4f-0d3b-4c8a-9e61-7b2f10c3d401";

    #[test]
    fn ids_round_trip_and_fit_the_api_limit() {
        for id in all_ids(U, Kind::Core, 0)
            .into_iter()
            .chain(all_ids(U, Kind::Memory, 80 << 30))
        {
            let s = id.to_string();
            assert!(s.len() <= 63, "{s} is {} characters", s.len());
            assert_eq!(DeviceId::parse(&s), Some(id));
        }
        assert_eq!(all_ids(U, Kind::Memory, 40 << 30).len(), 160);
        assert_eq!(all_ids(U, Kind::Core, 0).len(), 100);
    }

    #[test]
    fn string_ids_serialize_as_the_bare_string() {
        let id = AllocationId::new("a0123");
        assert_eq!(serde_json::to_string(&id).unwrap(), "\"a0123\"");
        assert_eq!(
            serde_json::from_str::<AllocationId>("\"a0123\"").unwrap(),
            id
        );
        assert_eq!(id.to_string(), "a0123");
        let m: std::collections::BTreeMap<AllocationId, u32> = [(id.clone(), 1)].into();
        assert_eq!(m.get("a0123"), Some(&1), "looked up by &str");
        let uid: Option<PodUid> = serde_json::from_str("\"u-1\"").unwrap();
        assert_eq!(uid.as_ref().map(PodUid::as_str), Some("u-1"));
        assert_eq!(ContainerRef::new("ns", "p", "c").to_string(), "ns/p/c");
        assert_eq!(
            ContainerRef::new("ns", "p", "c").pod_ref().to_string(),
            "ns/p"
        );
    }

    #[test]
    fn foreign_ids_are_not_ours() {
        for s in [
            "",
            "GPU-x",
            "nvidia0",
            &format!("{U}-core-7"),
            &format!("{U}-gpu-0001"),
            "-core-0001",
        ] {
            assert_eq!(DeviceId::parse(s), None, "{s:?}");
        }
    }
}
