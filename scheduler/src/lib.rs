//! vcuda-scheduler's core: GPU-aware placement across the cluster for the scheduler
//! extender (filter, prioritize; bind comes with the HTTP server).
//!
//! Everything here is pure: no clock, no I/O, nothing of HTTP or the API server.
//! - [`extender`] — the extender v1 JSON (PascalCase keys, checked against upstream).
//! - [`request`] — what a pod asks for (vcuda-core / vcuda-memory, `vcuda.io/gpu-count`;
//!   whole GPUs `nvidia.com/gpu` and slices `<domain>/sgpu`, one mode per pod).
//! - [`placement`] — [`placement::filter`] (a placement or the reason there is none) and
//!   [`placement::score`] (binpack or spread, 0..=10); [`placement::modes`]: whole GPUs and
//!   slices against each GPU's mode lock (issue 19).
//! - [`quota`] — namespace pools (node labels) and per-model quotas from a ConfigMap, usage
//!   sums and claim pruning.
//! - [`settings`] — command-line values (durations, `NAMESPACE/NAME`).
//! - [`eligibility`] — whether kube-scheduler itself could have chosen a node for a pod
//!   (scheduler name, cordon, taints, nodeSelector, required node affinity): bind refuses
//!   any other pair, so the extender's binding right cannot place a pod where the
//!   scheduler would not.
//! - [`liveness`] — which nodes are lost (their vcuda-manager's Lease unchanged for longer
//!   than its duration, by this scheduler's clock), and the refusal that says so.
//!
//! The schemas shared with vcuda-manager live in `vcuda-cluster`.
//!
//! The I/O lives apart, in modules the pure ones never use (placement stays pure; server and
//! bind own all I/O):
//! - [`server`] — the axum routes and the node source for `nodeCacheCapable` requests.
//! - [`bind`] — the bind verb: reservation on the Node (optimistic concurrency), Binding.
//! - [`admission`] — the quota ConfigMap, namespace usage and quota claims (optimistic
//!   concurrency on the ConfigMap).
//! - [`state`] — what the handlers share: settings, the kube client, the node-list and
//!   quota-ConfigMap caches, [`state::node_view`]; the bottom I/O layer (`state` below
//!   `admission` below `bind` below `server`: no import cycle).
//! - [`leases`] — the Lease watch: lists the managers' Leases every `--lease-poll`, feeds
//!   the liveness tracker, logs nodes lost (with their pods) and back.
//! - [`listen`] — the HTTPS listener: kube-scheduler's client certificate required,
//!   handshake/header/body deadlines, a connection cap (the accept loop is `vcuda-listen`'s);
//!   and the plain-HTTP `/metrics` listener.
//! - [`metrics`] — the Prometheus registry the handlers count in (no I/O itself).

#![forbid(unsafe_code)]

pub mod admission;
pub mod bind;
pub mod eligibility;
pub mod extender;
pub mod leases;
pub mod listen;
pub mod liveness;
pub mod metrics;
pub mod placement;
pub mod quota;
pub mod request;
pub mod server;
pub mod settings;
pub mod state;
