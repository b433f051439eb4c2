//! The daemon's state, owned by one type: [`Shared`], which every task holds an `Arc` of
//! (the device-plugin backends, the control socket, the control loop, the publisher). What
//! changes together sits under one lock ([`Core`]: allocations, pairing, checkpoint);
//! the rest is what the kubelet-facing lookups cache ([`crate::podresources`]) and what the
//! control loop publishes (`view`). Below every module that uses it: it imports none of them.

use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use tokio::sync::watch;

use crate::apiserver::ApiServer;
use crate::core::Core;
use crate::lookup::ListCache;

/// What every service shares.
pub struct Shared {
    pub core: Mutex<Core>,
    /// Health of each GPU (NVML order); ListAndWatch streams follow it.
    pub health: watch::Sender<Vec<bool>>,
    /// The PodResources connection, made on first use and kept (it re-dials by itself).
    pub pod_resources: tokio::sync::Mutex<Option<tonic::transport::Channel>>,
    /// The latest PodResources list and whether PreStartContainer may use it.
    pub lists: Mutex<ListCache>,
    /// Held while listing, so that a PreStartContainer and the prefetch never list at once:
    /// the second finds the first's answer.
    pub listing: tokio::sync::Mutex<()>,
    /// Woken by every answered Allocate: list once they go quiet ([`Shared::prefetch`], in `crate::podresources`).
    pub prefetch_wanted: tokio::sync::Notify,
    /// When the last Allocate was answered.
    pub last_allocate: Mutex<Instant>,
    /// What `vcuda-smi` and `/metrics` show (the control loop replaces it every round).
    pub view: Arc<Mutex<vcuda_contract::view::View>>,
    /// The API server, when the manager uses one.
    pub api: Option<Arc<ApiServer>>,
}
