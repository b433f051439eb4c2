//! kubelet-sim: a simulator of the kubelet's device manager, the ground truth vcuda's tests
//! drive vcuda-manager against. It follows the kubelet's behaviour as recorded in
//! `shared/reference/kubelet.md` (sections cited as §N) and shares no code with the project.
//!
//! - [`sim`]: the device manager (registration bookkeeping, ListAndWatch, admission,
//!   PreStartContainer, pod deletion, kubelet restarts, the checkpoint).
//! - [`grpc`]: the Registration and PodResources servers and the plugin client.
//! - [`control`]: the JSON-lines control socket and its client (the CLI's transport).
//! - [`checkpoint`], [`merge`], [`names`], [`versions`]: pure pieces (file shape, response
//!   merging, registration validation, what differs between kubelet releases).
//! - [`runtime`]: `serve --runtime docker`, the container runtime's part: the container
//!   created with `docker run` after PreStartContainer, in a kubelet-shaped pod cgroup.
//! - [`wire`]: what kubelets before 1.26 send as `:authority` (the socket path), put on the
//!   wire under kubelet-sim's tonic client.

#![forbid(unsafe_code)]

pub mod api;
pub mod checkpoint;
pub mod control;
pub mod grpc;
pub mod merge;
pub mod names;
pub mod runtime;
pub mod sim;
pub mod versions;
pub mod wire;

pub use api::*;
pub use sim::{Config, SimError, Simulator};

/// kubelet-sim's own copies of the upstream protos (Kubernetes 1.36.3, verbatim).
pub mod proto {
    /// `k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1`.
    pub mod deviceplugin {
        tonic::include_proto!("v1beta1");
    }
    /// `k8s.io/kubelet/pkg/apis/podresources/v1`.
    pub mod podresources {
        tonic::include_proto!("v1");
    }
}
