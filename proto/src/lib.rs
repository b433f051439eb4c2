//! The kubelet APIs vcuda-manager speaks: the device plugin API `v1beta1` (the manager serves
//! `DevicePlugin` and calls `Registration`) and the PodResources API `v1` (the manager calls
//! `PodResourcesLister` to learn which pods hold which devices).
//!
//! The messages and services are generated at build time from verbatim copies of the upstream
//! `.proto` files (`deviceplugin/v1beta1/api.proto`, `podresources/v1/api.proto`), compiled by
//! protox, so no system `protoc` is needed. `tests/conformance.rs` checks them against
//! `../shared/upstream/`. prost renames a few fields (`deviceIDs` → `device_i_ds`, `ID` → `id`);
//! names never travel on the wire.

#![forbid(unsafe_code)]

/// Device plugin API, package `v1beta1` (`k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1`).
pub mod deviceplugin {
    /// Generated from `deviceplugin/v1beta1/api.proto`.
    pub mod v1beta1 {
        // Generated code: its lints and doc formatting are prost's and tonic's, not ours.
        #![allow(clippy::all, clippy::pedantic, rustdoc::all)]
        tonic::include_proto!("v1beta1");
    }
}

/// PodResources API, package `v1` (`k8s.io/kubelet/pkg/apis/podresources/v1`).
pub mod podresources {
    /// Generated from `podresources/v1/api.proto`.
    pub mod v1 {
        // Generated code: its lints and doc formatting are prost's and tonic's, not ours.
        #![allow(clippy::all, clippy::pedantic, rustdoc::all)]
        tonic::include_proto!("v1");
    }
}

pub mod authority;
pub mod constants;
pub mod uds;
