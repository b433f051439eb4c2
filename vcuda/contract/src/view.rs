//! What the manager's query API answers (`vcuda-smi`, `vcuda-smi --json`): the node's GPUs
//! and the containers on them, as the control loop last saw them.
//!
//! The same structs are the documented `--json` schema (field names are stable; new fields
//! may be added, existing ones keep their meaning and unit; [`SCHEMA`] is bumped if one
//! ever changes). On the wire they travel postcard-encoded in [`crate::control::Reply::ViewChunk`]
//! frames. Units are in the field names: `_bytes`, `_percent`, `_ns`.

use serde::{Deserialize, Serialize};

/// Version of this schema.
pub const SCHEMA: u32 = 1;

/// The answer to a query.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct View {
    pub schema: u32,
    /// "node" (every GPU and container) or "container" (one container and its GPUs).
    pub scope: String,
    /// Seconds since the epoch when the control loop took it.
    pub taken_unix: u64,
    pub gpus: Vec<GpuView>,
    pub containers: Vec<ContainerView>,
    /// Each GPU's sharing mode (issue 19), in `gpus`' order; empty from a manager before
    /// modes. Last in the struct, so that a reader before modes decodes the rest unchanged
    /// (postcard ignores what follows what it knows).
    #[serde(default)]
    pub modes: Vec<GpuModeView>,
}

/// One GPU's sharing mode.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GpuModeView {
    pub uuid: String,
    /// `whole`, `slice` or `shared`: the mode it is locked to; empty while unlocked.
    pub mode: String,
    /// Slices held (slice mode).
    pub slices_held: u32,
    /// Slices per GPU (K) on this node; 0 when slice mode is off.
    pub slices: u32,
    /// The modes whose devices the GPU lists now, comma-separated (`whole,slice,shared`
    /// while unlocked on a node serving all three).
    pub serves: String,
}

/// One GPU.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GpuView {
    /// NVML index on the node.
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub memory_total_bytes: u64,
    /// As the driver reports it (every process on the GPU).
    pub memory_used_bytes: u64,
    /// The driver's utilization over its last sample period; None if it gave none.
    pub utilization_percent: Option<u32>,
    pub healthy: bool,
    /// Shares allocated on it (a whole GPU counts 100).
    pub core_allocated_percent: u32,
    /// Memory quotas allocated on it (a whole GPU counts its memory).
    pub memory_allocated_bytes: u64,
}

/// One container (one allocation).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ContainerView {
    pub namespace: String,
    pub pod: String,
    pub container: String,
    /// The allocation id (its config and region).
    pub allocation: String,
    pub gpus: Vec<ContainerGpuView>,
    pub processes: Vec<ProcessView>,
}

/// A container on one of its GPUs.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ContainerGpuView {
    /// NVML index on the node.
    pub index: u32,
    pub uuid: String,
    /// Guaranteed compute share (100: whole GPU, not throttled).
    pub core_share_percent: u32,
    /// Upper bound (= the share unless elastic).
    pub core_limit_percent: u32,
    /// Sum of its processes' utilization in the driver's last sample; None if no sample yet.
    pub utilization_percent: Option<u32>,
    /// Device memory its processes hold, as libvcuda accounts it.
    pub memory_used_bytes: u64,
    pub memory_quota_bytes: u64,
    /// Device memory the driver reports for its processes (the watchdog's view).
    pub memory_driver_bytes: u64,
    /// Time its processes waited in the compute limiter.
    pub throttled_ns: u64,
    /// Calls refused with CUDA_ERROR_OUT_OF_MEMORY for its quota.
    pub oom_refusals: u64,
    /// Accounting errors libvcuda repaired in its region (a release below zero); any is a
    /// bug to report. Absent from older managers' answers: 0.
    #[serde(default)]
    pub accounting_errors: u64,
    /// Watchdog violations since the manager started: rounds in which the driver reported
    /// more memory than the quota.
    pub watchdog_violations: u64,
    /// Compute watchdog violations since the manager started: rounds in which the
    /// driver-reported utilization, averaged over the watchdog's window, exceeded the limit
    /// by more than its margin. Absent from older managers' answers: 0.
    #[serde(default)]
    pub watchdog_compute_violations: u64,
}

/// A process of a container.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ProcessView {
    /// Pid on the host (what NVML reports); 0 if not registered yet.
    pub host_pid: u32,
    /// Pid inside the container; 0 if the process never registered with libvcuda (found by
    /// the driver in the pod's cgroup: it bypasses the library).
    pub pid: u32,
    /// Device memory the driver reports for it, summed over its GPUs.
    pub memory_bytes: u64,
}

impl View {
    /// Only the container holding `allocation`, and its GPUs (None if there is none).
    pub fn only(&self, allocation: &str) -> Option<View> {
        let c = self
            .containers
            .iter()
            .find(|c| c.allocation == allocation)?
            .clone();
        let gpus = self
            .gpus
            .iter()
            .filter(|g| c.gpus.iter().any(|x| x.uuid == g.uuid))
            .cloned()
            .collect();
        Some(View {
            modes: Vec::new(),
            schema: self.schema,
            scope: "container".into(),
            taken_unix: self.taken_unix,
            gpus,
            containers: vec![c],
        })
    }

    /// Postcard bytes (what [`crate::control::view_frames`] cuts into frames).
    pub fn to_bytes(&self) -> Vec<u8> {
        postcard::to_allocvec(self).unwrap_or_default()
    }

    pub fn from_bytes(bytes: &[u8]) -> Result<View, postcard::Error> {
        postcard::from_bytes(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view() -> View {
        View {
            modes: Vec::new(),
            schema: SCHEMA,
            scope: "node".into(),
            taken_unix: 1,
            gpus: vec![
                GpuView {
                    index: 0,
                    uuid: "GPU-a".into(),
                    ..Default::default()
                },
                GpuView {
                    index: 1,
                    uuid: "GPU-b".into(),
                    ..Default::default()
                },
            ],
            containers: vec![
                ContainerView {
                    allocation: "a1".into(),
                    pod: "p".into(),
                    gpus: vec![ContainerGpuView {
                        uuid: "GPU-b".into(),
                        index: 1,
                        ..Default::default()
                    }],
                    ..Default::default()
                },
                ContainerView {
                    allocation: "a2".into(),
                    pod: "q".into(),
                    ..Default::default()
                },
            ],
        }
    }

    #[test]
    fn a_container_sees_itself_and_its_gpus_only() {
        let v = view().only("a1").unwrap();
        assert_eq!(v.scope, "container");
        assert_eq!(v.containers.len(), 1);
        assert_eq!(v.containers[0].pod, "p");
        assert_eq!(v.gpus.len(), 1);
        assert_eq!(v.gpus[0].uuid, "GPU-b");
        assert!(view().only("a3").is_none());
    }

    #[test]
    fn round_trips_through_bytes() {
        let v = view();
        assert_eq!(View::from_bytes(&v.to_bytes()).unwrap(), v);
    }
}
