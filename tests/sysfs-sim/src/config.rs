//! The node the simulator plays, as JSON (`--config`): its PCI devices and, for mdev-capable
//! GPUs, the mediated device types their vendor driver offers.
//!
//! ```json
//! {"devices": [{"address": "0000:3b:00.0", "vendor": "0x10de", "device": "0x1eb8",
//!               "class": "0x030200", "driver": "nvidia", "native_driver": "nvidia",
//!               "iommu_group": 12, "numa_node": 0,
//!               "mdev_types": [{"id": "nvidia-222", "name": "GRID T4-1B",
//!                               "device_api": "vfio-pci", "max_instances": 16}]}]}
//! ```

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// The whole node.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub devices: Vec<DeviceConfig>,
}

/// One PCI function.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceConfig {
    /// `DDDD:BB:DD.F`, lower-case hex, as `/sys/bus/pci/devices/` names it.
    pub address: String,
    /// `0x`-prefixed hex, served as written (plus the kernel's new line).
    pub vendor: String,
    pub device: String,
    pub class: String,
    /// The driver bound at start (`None`: unbound).
    #[serde(default)]
    pub driver: Option<String>,
    /// The driver whose id table matches the device (bound by `drivers_probe` when no
    /// `driver_override` is set); the mdev parent driver for devices with `mdev_types`.
    #[serde(default = "default_native_driver")]
    pub native_driver: String,
    /// `None`: no IOMMU (no `iommu_group` link).
    #[serde(default)]
    pub iommu_group: Option<u32>,
    /// `-1`: no NUMA affinity, as the kernel writes it.
    #[serde(default = "default_numa_node")]
    pub numa_node: i32,
    #[serde(default)]
    pub mdev_types: Vec<TypeConfig>,
}

/// One `mdev_supported_types/<id>` of a parent device.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct TypeConfig {
    /// `<driver>-<vendor's name>`, e.g. `nvidia-222`.
    pub id: String,
    /// Optional in the ABI (`Documentation/ABI/testing/sysfs-bus-vfio-mdev`): no file when absent.
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default = "default_device_api")]
    pub device_api: String,
    /// Optional: no file when absent.
    #[serde(default)]
    pub description: Option<String>,
    /// How many mdevs of this type the GPU holds when it holds no other type.
    pub max_instances: u32,
}

fn default_native_driver() -> String {
    "nvidia".into()
}

fn default_numa_node() -> i32 {
    -1
}

fn default_device_api() -> String {
    "vfio-pci".into()
}

/// A configuration the simulator cannot play.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read the node configuration {path}: {source}; pass --config with a JSON file of {{\"devices\": [...]}}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a node configuration: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("device address {0:?} is not of the form DDDD:BB:DD.F in lower-case hex (e.g. 0000:3b:00.0), as /sys/bus/pci/devices names devices")]
    Address(String),
    #[error("device {address}: {field} {value:?} is not 0x-prefixed hex as the kernel writes it (e.g. \"0x10de\")")]
    Hex {
        address: String,
        field: &'static str,
        value: String,
    },
    #[error("device {0} is configured twice; each address names one PCI function")]
    DuplicateAddress(String),
    #[error("device {address}: {what} {value:?} cannot be a sysfs name (empty, or holds '/' or a new line)")]
    Name {
        address: String,
        what: &'static str,
        value: String,
    },
    #[error("device {address}: mdev type {id} is listed twice")]
    DuplicateType { address: String, id: String },
    #[error("device {address}: numa_node {value} is neither a node number nor -1")]
    Numa { address: String, value: i32 },
}

impl Config {
    /// Read and check a configuration file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let config: Config = serde_json::from_str(&text).map_err(|source| ConfigError::Json {
            path: path.to_path_buf(),
            source,
        })?;
        config.check()?;
        Ok(config)
    }

    /// Everything the tree needs to be well formed.
    pub fn check(&self) -> Result<(), ConfigError> {
        let mut seen = BTreeSet::new();
        for d in &self.devices {
            if !is_pci_address(&d.address) {
                return Err(ConfigError::Address(d.address.clone()));
            }
            if !seen.insert(d.address.as_str()) {
                return Err(ConfigError::DuplicateAddress(d.address.clone()));
            }
            for (field, value) in [
                ("vendor", &d.vendor),
                ("device", &d.device),
                ("class", &d.class),
            ] {
                let ok = value
                    .strip_prefix("0x")
                    .is_some_and(|h| !h.is_empty() && h.chars().all(|c| c.is_ascii_hexdigit()));
                if !ok {
                    return Err(ConfigError::Hex {
                        address: d.address.clone(),
                        field,
                        value: value.clone(),
                    });
                }
            }
            let names = d
                .driver
                .iter()
                .map(|n| ("driver", n))
                .chain([("native_driver", &d.native_driver)])
                .chain(d.mdev_types.iter().map(|t| ("mdev type id", &t.id)));
            for (what, value) in names {
                if !is_sysfs_name(value) {
                    return Err(ConfigError::Name {
                        address: d.address.clone(),
                        what,
                        value: value.clone(),
                    });
                }
            }
            if d.numa_node < -1 {
                return Err(ConfigError::Numa {
                    address: d.address.clone(),
                    value: d.numa_node,
                });
            }
            let mut ids = BTreeSet::new();
            for t in &d.mdev_types {
                if !ids.insert(t.id.as_str()) {
                    return Err(ConfigError::DuplicateType {
                        address: d.address.clone(),
                        id: t.id.clone(),
                    });
                }
            }
        }
        Ok(())
    }
}

/// `DDDD:BB:DD.F`, lower-case hex.
pub fn is_pci_address(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 12
        && b.iter().enumerate().all(|(i, &c)| match i {
            4 | 7 => c == b':',
            10 => c == b'.',
            11 => (b'0'..=b'7').contains(&c),
            _ => c.is_ascii_digit() || (b'a'..=b'f').contains(&c),
        })
}

/// A name that can be one path component.
pub fn is_sysfs_name(s: &str) -> bool {
    !s.is_empty() && s != "." && s != ".." && !s.contains(['/', '\n', '\0'])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<Config, ConfigError> {
        let c: Config = serde_json::from_str(json).unwrap();
        c.check().map(|()| c)
    }

    #[test]
    fn defaults_follow_the_interface() {
        let c = parse(
            r#"{"devices": [{"address": "0000:3b:00.0", "vendor": "0x10de", "device": "0x1eb8",
                "class": "0x030200", "mdev_types": [{"id": "nvidia-222", "max_instances": 16}]}]}"#,
        )
        .unwrap();
        let d = &c.devices[0];
        assert_eq!(d.driver, None);
        assert_eq!(d.native_driver, "nvidia");
        assert_eq!((d.iommu_group, d.numa_node), (None, -1));
        let t = &d.mdev_types[0];
        assert_eq!(
            (t.name.as_deref(), t.device_api.as_str()),
            (None, "vfio-pci")
        );
    }

    #[test]
    fn refuses_what_sysfs_could_not_show() {
        let dev = |fields: &str| {
            format!(
                r#"{{"devices": [{{"vendor": "0x10de", "device": "0x1eb8", "class": "0x030200", {fields}}}]}}"#
            )
        };
        let e = parse(&dev(r#""address": "0000:3B:00.0""#)).unwrap_err();
        assert!(matches!(e, ConfigError::Address(_)), "{e}");
        assert!(e.to_string().contains("lower-case"), "{e}");
        let e = parse(&dev(r#""address": "0000:3b:00.0", "driver": "a/b""#)).unwrap_err();
        assert!(matches!(e, ConfigError::Name { .. }), "{e}");
        let e = parse(&dev(
            r#""address": "0000:3b:00.0", "mdev_types": [{"id": "x", "max_instances": 1}, {"id": "x", "max_instances": 2}]"#,
        ))
        .unwrap_err();
        assert!(matches!(e, ConfigError::DuplicateType { .. }), "{e}");
        let e = parse(
            r#"{"devices": [{"address": "0000:3b:00.0", "vendor": "10de", "device": "0x1", "class": "0x1"}]}"#,
        )
        .unwrap_err();
        assert!(e.to_string().contains("vendor \"10de\""), "{e}");
        let two =
            r#"{"address": "0000:3b:00.0", "vendor": "0x10de", "device": "0x1", "class": "0x1"}"#;
        let e = parse(&format!(r#"{{"devices": [{two}, {two}]}}"#)).unwrap_err();
        assert!(matches!(e, ConfigError::DuplicateAddress(_)), "{e}");
        assert!(serde_json::from_str::<Config>(r#"{"devices": [], "gpus": []}"#).is_err());
    }
}
