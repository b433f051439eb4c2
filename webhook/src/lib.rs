//! vcuda-webhook: vcuda's admission webhook (issue 21).
//!
//! Pure (no I/O, no clock):
//! - [`rules`] — what is refused: the extender's request rules at creation (the same code,
//!   [`vcuda_scheduler::request`], so the same words), vGPU requests, and vcuda's own pod
//!   annotations kept to its service accounts.
//! - [`inject`] — what a vGPU (VM) pod is given: init containers, sidecars, volumes, the
//!   runtime class, from a configuration; idempotent by name.
//! - [`review`] — AdmissionReview v1 in (kube-rs's types), AdmissionReview v1 out.
//!
//! I/O: [`server`] — the routes, the configuration file followed, the Node list read in the
//! background; `main` — flags, TLS ([`vcuda_scheduler::listen`]), start.

#![forbid(unsafe_code)]

pub mod inject;
pub mod review;
pub mod rules;
pub mod server;
