//! Kubelet releases as a device plugin sees them: `--kubelet-version 1.20 … 1.35` picks what
//! kubelet-sim does where releases differ. Each difference is cited in
//! tests/kubelet-sim/README.md ("Kubelet versions"), from the kubelet's source and changelog
//! (tests/kubelet-sim/PROFILES.md has the research). Pure: no I/O.

use std::fmt;
use std::str::FromStr;

/// The oldest release kubelet-sim plays (vcuda supports kubelets from 1.20).
pub const OLDEST: Version = Version(1, 20);
/// The newest release kubelet-sim plays, and its default.
pub const NEWEST: Version = Version(1, 35);

/// A kubelet minor release, `1.N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Version(pub u32, pub u32);

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.0, self.1)
    }
}

impl FromStr for Version {
    type Err = String;

    /// `1.25`, `v1.25` or `1.25.16` (the patch release changes nothing kubelet-sim plays).
    fn from_str(s: &str) -> Result<Version, String> {
        let bad = || {
            format!("kubelet version {s:?}: expected MAJOR.MINOR such as 1.25, from {OLDEST} to {NEWEST}")
        };
        let mut parts = s.strip_prefix('v').unwrap_or(s).split('.');
        let major = parts.next().and_then(|p| p.parse().ok()).ok_or_else(bad)?;
        let minor = parts.next().and_then(|p| p.parse().ok()).ok_or_else(bad)?;
        if parts.next().is_some_and(|p| p.parse::<u32>().is_err()) || parts.next().is_some() {
            return Err(bad());
        }
        let v = Version(major, minor);
        if v < OLDEST || v > NEWEST {
            return Err(bad());
        }
        Ok(v)
    }
}

/// What a PodResources method does in a release.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// Served.
    On,
    /// Served, but its feature gate is off by default: the call fails with gRPC `Unknown`
    /// and this message (the kubelet's own words).
    GateOff(&'static str),
    /// Not in this release's API: `Unimplemented`.
    Absent,
}

/// The HTTP/2 `:authority` the kubelet's gRPC client sends to a device plugin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Authority {
    /// The plugin's socket path, as given to the dialer (grpc-go's default for a target
    /// with no scheme, before kubernetes#112597).
    SocketPath,
    /// `localhost` (`grpc.WithAuthority("localhost")`, 1.26+).
    Localhost,
}

/// The behaviour of one release.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Profile {
    pub version: Version,
}

impl Default for Profile {
    fn default() -> Self {
        Profile { version: NEWEST }
    }
}

impl Profile {
    pub fn new(version: Version) -> Profile {
        Profile { version }
    }

    /// The `:authority` sent to device plugins: the socket path before 1.26.
    pub fn authority(&self) -> Authority {
        if self.version < Version(1, 26) {
            Authority::SocketPath
        } else {
            Authority::Localhost
        }
    }

    /// Whether `Register` dials the plugin and asks `GetDevicePluginOptions` before it
    /// returns (1.25+, kubernetes#109016). Before, `Register` returned at once, the plugin
    /// was dialled afterwards, and its options were the ones in `RegisterRequest.options`.
    pub fn options_in_register(&self) -> bool {
        self.version >= Version(1, 25)
    }

    /// PodResources v1 `GetAllocatableResources`: added 1.21 behind
    /// `KubeletPodResourcesGetAllocatable` (off), on by default from 1.23.
    pub fn get_allocatable(&self) -> Method {
        match self.version {
            v if v < Version(1, 21) => Method::Absent,
            v if v < Version(1, 23) => {
                Method::GateOff("Pod Resources API GetAllocatableResources disabled")
            }
            _ => Method::On,
        }
    }

    /// PodResources v1 `Get`: added 1.27 behind `KubeletPodResourcesGet` (off), on by
    /// default from 1.34.
    pub fn get(&self) -> Method {
        match self.version {
            v if v < Version(1, 27) => Method::Absent,
            v if v < Version(1, 34) => Method::GateOff("PodResources API Get method disabled"),
            _ => Method::On,
        }
    }

    /// Whether the kubelet passes a plugin's `cdi_devices` on to the runtime
    /// (`DevicePluginCDIDevices`: alpha and off in 1.28, on from 1.29, GA 1.31). Without
    /// it they are dropped silently.
    pub fn passes_cdi_devices(&self) -> bool {
        self.version >= Version(1, 29)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_parse_in_the_forms_people_write_them() {
        for s in ["1.25", "v1.25", "1.25.16"] {
            assert_eq!(s.parse::<Version>(), Ok(Version(1, 25)), "{s}");
        }
        for s in ["1.19", "1.36", "2.0", "1", "1.x", "", "1.25.x", "1.25.1.2"] {
            let e = s.parse::<Version>().unwrap_err();
            assert!(e.contains("1.20 to 1.35"), "{s}: {e}");
        }
    }

    #[test]
    fn each_difference_changes_at_its_release() {
        let p = |m| Profile::new(Version(1, m));
        assert_eq!(p(25).authority(), Authority::SocketPath);
        assert_eq!(p(26).authority(), Authority::Localhost);
        assert!(!p(24).options_in_register() && p(25).options_in_register());
        assert_eq!(p(20).get_allocatable(), Method::Absent);
        assert!(matches!(p(22).get_allocatable(), Method::GateOff(_)));
        assert_eq!(p(23).get_allocatable(), Method::On);
        assert_eq!(p(26).get(), Method::Absent);
        assert!(matches!(p(33).get(), Method::GateOff(_)));
        assert_eq!(p(34).get(), Method::On);
        assert!(!p(28).passes_cdi_devices() && p(29).passes_cdi_devices());
        assert_eq!(Profile::default().version, NEWEST);
    }
}
