//! Device IDs: what the kubelet sees of our GPUs. `vcuda-core` advertises 100 devices per GPU
//! (1 % each), `vcuda-memory` one per 256 MiB. An ID is the GPU's UUID plus a kind and an
//! index, so it names its GPU, stays the same across manager and node restarts (the kubelet
//! keys its checkpoint by ID), and fits the API's 63-character limit.

use std::fmt;

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
