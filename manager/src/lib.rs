//! vcuda-manager: the node daemon that turns libvcuda.so into a Kubernetes feature (issue 5,
//! being written). Pure decisions live in their own modules, I/O at the edges:
//! - [`ids`]: device IDs (GPU UUID + kind + index; stable, ≤ 63 characters);
//! - [`placement`]: GetPreferredAllocation and Allocate validation;
//! - [`allocation`]: what Allocate answers and what PreStartContainer finishes;
//! - [`assign`]: following the scheduler: the pod being admitted, its assigned GPUs, the
//!   agreement check, the published inventory and retired reservations (pure);
//! - [`apiserver`]: the API server client (kube-rs);
//! - [`publisher`]: the task that publishes the node's GPUs on its Node;
//! - [`settings`]: the settings file and flags;
//! - [`baseline`]: whether the library it mounts loads in old images (glibc baseline; pure);
//! - [`gpus`]: NVML inventory, topology, XID health, process samples;
//! - [`identity`]: pod cgroups, the kubelet's checkpoint, /proc fields (pure parsers);
//! - [`files`]: the manager's own files, replaced atomically (below `core` and `journal`);
//! - [`journal`]: the checkpoint, an append-only file of allocation records;
//! - [`core`]: the state (allocations, pairing, checkpoint) the services share;
//! - [`lookup`]: when an earlier PodResources list may answer PreStartContainer (pure);
//! - [`plugin`]: the DevicePlugin gRPC services and the PodResources lookup;
//! - [`control`]: the control socket libvcuda registers over;
//! - [`control_loop`]: shares, reclaim, watchdog, garbage collection, the metrics snapshot;
//! - [`metrics`]: the Prometheus endpoint;
//! - [`daemon`]: the tasks, registration, and surviving kubelet restarts.

pub mod allocation;
pub mod apiserver;
pub mod assign;
pub mod baseline;
pub mod control;
pub mod control_loop;
pub mod core;
pub mod daemon;
pub mod files;
pub mod gpus;
pub mod identity;
pub mod ids;
pub mod journal;
pub mod lookup;
pub mod metrics;
pub mod placement;
pub mod plugin;
pub mod publisher;
pub mod settings;
pub mod watchdog;
