//! vcuda-manager: the node daemon that turns libvcuda.so into a Kubernetes feature (issue 5,
//! being written). It does the I/O; what it decides (placement, Allocate answers, following
//! the scheduler, identity, watchdog verdicts, GPU health) is in the pure crate
//! `vcuda_manager_core`, which depends on nothing that does I/O. Modules here:
//! - [`apiserver`]: the API server client (kube-rs);
//! - [`publisher`]: the task that publishes the node's GPUs on its Node;
//! - [`lease`]: the task that renews the node's Lease (the scheduler's proof the node is
//!   alive);
//! - [`settings`]: the settings file and flags;
//! - [`baseline`]: whether the library it mounts loads in old images (glibc baseline; pure);
//! - [`gpus`]: NVML inventory, topology, XID health, process samples;
//! - [`files`]: the manager's own files, replaced atomically (below `core` and `journal`);
//! - [`cdi`]: CDI spec files, one per allocation, replaced atomically (below `core`);
//! - [`journal`]: the checkpoint, an append-only file of allocation records;
//! - [`core`]: the state (allocations, pairing, checkpoint) the services share;
//! - [`lookup`]: when an earlier PodResources list may answer PreStartContainer (pure);
//! - [`state`]: the daemon's state, one owner every task shares;
//! - [`backend`]: a resource the kubelet is served (the seam for device modes) and the one
//!   DevicePlugin gRPC server for any backend;
//! - [`plugin`]: the shares backend (`vcuda-core`, `vcuda-memory`);
//! - [`podresources`]: the kubelet's PodResources API and the prefetch;
//! - [`vm`]: the VM backends (vfio passthrough, mdev vGPUs) over `vcuda_vm`'s decisions;
//! - [`follow`]: following the scheduler through the API server;
//! - [`control`]: the control socket libvcuda registers over;
//! - [`control_loop`]: shares, reclaim, watchdog, garbage collection, the metrics snapshot;
//! - [`metrics`]: the Prometheus endpoint;
//! - [`daemon`]: the tasks, registration, and surviving kubelet restarts.

pub mod apiserver;
pub mod backend;
pub mod baseline;
pub mod cdi;
pub mod control;
pub mod control_loop;
pub mod core;
pub mod daemon;
pub mod files;
pub mod follow;
pub mod gpus;
pub mod journal;
pub mod lease;
pub mod locks;
pub mod lookup;
pub mod metrics;
pub mod plugin;
pub mod podresources;
pub mod publisher;
pub mod settings;
pub mod state;
pub mod vm;
