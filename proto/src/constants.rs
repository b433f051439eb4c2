//! The constants of `k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1/constants.go` (tag `v0.36.3`),
//! plus the kubelet's default PodResources socket. Values are upstream's exactly;
//! `tests/conformance.rs` checks them against `../shared/upstream/`.

use std::time::Duration;

/// `Device.health` of a device that can be allocated.
pub const HEALTHY: &str = "Healthy";
/// `Device.health` of a device the kubelet must not allocate (and subtracts from allocatable).
pub const UNHEALTHY: &str = "Unhealthy";

/// The API version a plugin puts in `RegisterRequest.version`; the kubelet rejects any other.
pub const VERSION: &str = "v1beta1";
/// Every version the kubelet accepts (upstream `SupportedVersions`).
pub const SUPPORTED_VERSIONS: [&str; 1] = [VERSION];

/// Directory of the kubelet's registration socket and of the plugins' own sockets
/// (`RegisterRequest.endpoint` is a file name relative to it). Trailing slash as upstream.
pub const DEVICE_PLUGIN_PATH: &str = "/var/lib/kubelet/device-plugins/";
/// The kubelet's `Registration` socket: [`DEVICE_PLUGIN_PATH`] + `kubelet.sock`.
pub const KUBELET_SOCKET: &str = "/var/lib/kubelet/device-plugins/kubelet.sock";

/// Windows form of [`DEVICE_PLUGIN_PATH`] (upstream carries it; vcuda is Linux-only).
pub const DEVICE_PLUGIN_PATH_WINDOWS: &str = "\\var\\lib\\kubelet\\device-plugins\\";
/// Windows form of [`KUBELET_SOCKET`].
pub const KUBELET_SOCKET_WINDOWS: &str = "\\var\\lib\\kubelet\\device-plugins\\kubelet.sock";

/// Seconds the kubelet waits for `PreStartContainer` (upstream
/// `KubeletPreStartContainerRPCTimeoutInSecs`).
pub const KUBELET_PRE_START_CONTAINER_RPC_TIMEOUT_IN_SECS: u64 = 30;
/// [`KUBELET_PRE_START_CONTAINER_RPC_TIMEOUT_IN_SECS`] as a `Duration`.
pub const KUBELET_PRE_START_CONTAINER_RPC_TIMEOUT: Duration =
    Duration::from_secs(KUBELET_PRE_START_CONTAINER_RPC_TIMEOUT_IN_SECS);

/// The kubelet's default PodResources socket (`--pod-resources` endpoint; not in constants.go).
pub const POD_RESOURCES_SOCKET: &str = "/var/lib/kubelet/pod-resources/kubelet.sock";

#[cfg(test)]
mod tests {
    use super::*;

    /// The socket paths are spelled out (for `const` use) but upstream derives them.
    #[test]
    fn sockets_are_derived_from_their_directories() {
        assert_eq!(KUBELET_SOCKET, format!("{DEVICE_PLUGIN_PATH}kubelet.sock"));
        assert_eq!(
            KUBELET_SOCKET_WINDOWS,
            format!("{DEVICE_PLUGIN_PATH_WINDOWS}kubelet.sock")
        );
    }
}
