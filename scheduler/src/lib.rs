//! vcuda-scheduler's core: GPU-aware placement across the cluster for the scheduler
//! extender (filter, prioritize; bind comes with the HTTP server).
//!
//! Everything here is pure: no clock, no I/O, nothing of HTTP or the API server.
//! - [`extender`] — the extender v1 JSON (PascalCase keys, checked against upstream).
//! - [`request`] — what a pod asks for (vcuda-core / vcuda-memory, `vcuda.io/gpu-count`).
//! - [`placement`] — [`placement::filter`] (a placement or the reason there is none) and
//!   [`placement::score`] (binpack or spread, 0..=10).
//! - [`quota`] — namespace pools (node labels) and per-model quotas from a ConfigMap.
//!
//! The schemas shared with vcuda-manager live in `vcuda-cluster`.

pub mod extender;
pub mod placement;
pub mod quota;
pub mod request;
