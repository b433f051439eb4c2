//! vcuda-manager: the node daemon that turns libvcuda.so into a Kubernetes feature (issue 5,
//! being written). Pure decisions live in their own modules, I/O at the edges:
//! - [`ids`]: device IDs (GPU UUID + kind + index; stable, ≤ 63 characters);
//! - [`placement`]: GetPreferredAllocation and Allocate validation;
//! - [`allocation`]: what Allocate answers and what PreStartContainer finishes;
//! - [`settings`]: the settings file and flags;
//! - [`gpus`]: NVML inventory, topology, XID health, process samples;
//! - [`identity`]: pod cgroups, the kubelet's checkpoint, /proc fields (pure parsers);
//! - [`core`]: the state (allocations, pairing, checkpoint) the services share.

pub mod allocation;
pub mod core;
pub mod gpus;
pub mod identity;
pub mod ids;
pub mod placement;
pub mod settings;
