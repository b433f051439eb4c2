//! The simulated kernel state and every write the kernel accepts or refuses, pure: no FUSE,
//! no files. [`crate::tree`] maps paths onto it and [`crate::fs`] serves it.
//!
//! Each rule names where the kernel does it:
//! - **PCI binding** (`drivers/base/bus.c`): `bind_store` finds the device by name (a trailing
//!   new line ignored, `sysfs_streq`) and returns `-ENODEV` unless the driver matches it
//!   (`driver_match_device`), then `device_driver_attach` returns `-EBUSY` for a device that
//!   already has a driver; `unbind_store` returns `-ENODEV` unless the device is bound to that
//!   very driver; `drivers_probe_store` returns `-ENODEV` for an unknown device and otherwise
//!   attaches an unbound device to the first matching driver (`bus_rescan_devices_helper`,
//!   success even when none matches; a bound device is left alone).
//! - **Matching** (`drivers/pci/pci-driver.c`, `pci_match_device`; `driver_override` in
//!   `Documentation/ABI/testing/sysfs-bus-pci`): with `driver_override` set, only the driver of
//!   that name matches; without it, the driver whose id table names the device (here its
//!   `native_driver`: vfio-pci's table is empty unless `ids=`/`new_id` is used, which the
//!   simulator does not offer). Writing the override strips the first new line and an empty
//!   string clears it; reading shows `(null)` when unset (`driver_set_override`,
//!   `driver_override_show`).
//! - **VFIO groups** (`Documentation/driver-api/vfio.rst`, "VFIO Usage Example": "Binding this
//!   device to the vfio-pci driver creates the VFIO group character devices for this group"):
//!   `/dev/vfio/<n>` exists while at least one device of group `n` is bound to vfio-pci, and
//!   for each mdev's own group.
//! - **mdev create** (`drivers/vfio/mdev/mdev_sysfs.c`, `create_store`): fewer than 36 or more
//!   than 37 bytes, or no UUID in the first 36 (`guid_parse`), is `-EINVAL`;
//!   (`drivers/vfio/mdev/mdev_core.c`, `mdev_device_create`) a UUID already used by any mdev is
//!   `-EEXIST` (compared as GUIDs: case does not matter), no instance left is `-EUSERS`
//!   (`if (!atomic_read(&parent->available_instances)) return -EUSERS;`, the core's count since
//!   Linux 6.1). The mdev is named by its UUID in lower case (`%pUl`).
//! - **mdev remove** (`mdev_sysfs.c`, `remove_store`): the buffer is parsed by `kstrtoul(buf,
//!   0)` (`-EINVAL` if not a number), `0` does nothing, anything else removes; the vendor
//!   driver may refuse while the device is in use (`Documentation/driver-api/vfio-mediated-device.rst`:
//!   "The vendor driver can fail the remove() callback if that device is active"; the core
//!   returned that refusal as `-EBUSY`, `mdev_device_remove_ops` up to Linux 5.x).
//! - **Available instances**: NVIDIA's driver (seed 000: `vgpu-492: 32`, every other type 0)
//!   reports 0 for every other type once a GPU holds mdevs of one type; a type's own count is
//!   its maximum less its mdevs.
//! - **mdev parents** (`mdev_core.c`, `mdev_register_parent` / `mdev_unregister_parent`): the
//!   vendor driver registers the GPU when it binds it, which creates `mdev_supported_types`;
//!   unbinding it unregisters the parent, which "will unbind and destroy all the created mdevs"
//!   (vfio-mediated-device.rst).
//! - **mdev groups**: every mdev is its own IOMMU group (vfio-mediated-device.rst: the core
//!   adds each mediated device to an IOMMU group), numbered by `iommu_group_alloc`'s
//!   `ida_alloc`, the lowest free number; the simulator starts above every configured group
//!   (the node's other, unsimulated devices hold the lower numbers).

use std::collections::{BTreeMap, BTreeSet};

use crate::config::{Config, DeviceConfig, TypeConfig};

/// The errnos the simulated kernel answers with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Errno {
    Enoent,
    Eio,
    Eacces,
    Ebusy,
    Eexist,
    Enodev,
    Einval,
    Eusers,
}

impl Errno {
    /// The number `write(2)` reports.
    pub fn code(self) -> i32 {
        match self {
            Errno::Enoent => libc::ENOENT,
            Errno::Eio => libc::EIO,
            Errno::Eacces => libc::EACCES,
            Errno::Ebusy => libc::EBUSY,
            Errno::Eexist => libc::EEXIST,
            Errno::Enodev => libc::ENODEV,
            Errno::Einval => libc::EINVAL,
            Errno::Eusers => libc::EUSERS,
        }
    }

    /// The symbolic name, for the log.
    pub fn name(self) -> &'static str {
        match self {
            Errno::Enoent => "ENOENT",
            Errno::Eio => "EIO",
            Errno::Eacces => "EACCES",
            Errno::Ebusy => "EBUSY",
            Errno::Eexist => "EEXIST",
            Errno::Enodev => "ENODEV",
            Errno::Einval => "EINVAL",
            Errno::Eusers => "EUSERS",
        }
    }
}

/// A write the kernel refuses: the errno and why (for the simulator's log).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}: {why}", errno.name())]
pub struct Refused {
    pub errno: Errno,
    pub why: String,
}

fn refuse<T>(errno: Errno, why: impl Into<String>) -> Result<T, Refused> {
    Err(Refused {
        errno,
        why: why.into(),
    })
}

/// The driver KubeVirt and the manager bind passthrough GPUs to.
pub const VFIO_PCI: &str = "vfio-pci";

/// One PCI function and its binding.
#[derive(Debug, Clone)]
pub struct Device {
    pub config: DeviceConfig,
    pub driver: Option<String>,
    pub driver_override: Option<String>,
}

impl Device {
    pub fn address(&self) -> &str {
        &self.config.address
    }

    /// Registered as an mdev parent: bound to the vendor driver that offers its types.
    pub fn is_mdev_parent(&self) -> bool {
        !self.config.mdev_types.is_empty()
            && self.driver.as_deref() == Some(self.config.native_driver.as_str())
    }

    /// Whether `driver` matches the device (`pci_match_device`).
    fn matches(&self, driver: &str) -> bool {
        match &self.driver_override {
            Some(o) => o == driver,
            None => driver == self.config.native_driver,
        }
    }
}

/// A mediated device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mdev {
    pub uuid: String,
    pub parent: String,
    pub type_id: String,
    pub group: u32,
    /// Open by a VM (`sim/busy`): its removal is refused.
    pub busy: bool,
}

/// A member of an IOMMU group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Member {
    Pci(String),
    Mdev { parent: String, uuid: String },
}

/// The whole simulated node.
#[derive(Debug, Clone)]
pub struct Node {
    devices: BTreeMap<String, Device>,
    mdevs: BTreeMap<String, Mdev>,
    drivers: BTreeSet<String>,
    first_mdev_group: u32,
}

/// `sysfs_streq`: the written name without one trailing new line.
fn written_name(buf: &[u8]) -> Option<&str> {
    let s = std::str::from_utf8(buf).ok()?;
    Some(s.strip_suffix('\n').unwrap_or(s))
}

/// `guid_parse` of the first 36 bytes (`uuid_is_valid`: dashes at 8, 13, 18, 23, hex elsewhere),
/// in the lower-case form the mdev is named by.
pub fn parse_uuid(buf: &[u8]) -> Option<String> {
    let b = buf.get(..36)?;
    let ok = b.iter().enumerate().all(|(i, c)| match i {
        8 | 13 | 18 | 23 => *c == b'-',
        _ => c.is_ascii_hexdigit(),
    });
    ok.then(|| String::from_utf8_lossy(b).to_ascii_lowercase())
}

/// `kstrtoul(buf, 0, &val)`: an optional `+`, `0x` for hex, a leading `0` for octal, and one
/// optional trailing new line.
pub fn kstrtoul(buf: &[u8]) -> Option<u64> {
    let s = std::str::from_utf8(buf).ok()?;
    let s = s.strip_suffix('\n').unwrap_or(s);
    let s = s.strip_prefix('+').unwrap_or(s);
    let (digits, radix) = if let Some(h) = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        (h, 16)
    } else if s.len() > 1 && s.starts_with('0') {
        (&s[1..], 8)
    } else {
        (s, 10)
    };
    if digits.is_empty() || !digits.chars().all(|c| c.is_digit(radix)) {
        return None;
    }
    u64::from_str_radix(digits, radix).ok()
}

impl Node {
    /// The node at start: the configured devices bound as configured, no mdevs.
    pub fn new(config: &Config) -> Node {
        let mut drivers = BTreeSet::from([VFIO_PCI.to_string()]);
        let mut devices = BTreeMap::new();
        for d in &config.devices {
            drivers.insert(d.native_driver.clone());
            drivers.extend(d.driver.iter().cloned());
            devices.insert(
                d.address.clone(),
                Device {
                    config: d.clone(),
                    driver: d.driver.clone(),
                    driver_override: None,
                },
            );
        }
        let first_mdev_group = config
            .devices
            .iter()
            .filter_map(|d| d.iommu_group)
            .max()
            .map_or(0, |g| g + 1);
        Node {
            devices,
            mdevs: BTreeMap::new(),
            drivers,
            first_mdev_group,
        }
    }

    pub fn devices(&self) -> impl Iterator<Item = &Device> {
        self.devices.values()
    }

    pub fn device(&self, address: &str) -> Option<&Device> {
        self.devices.get(address)
    }

    /// The drivers loaded (`bus/pci/drivers/<name>`).
    pub fn drivers(&self) -> impl Iterator<Item = &str> {
        self.drivers.iter().map(String::as_str)
    }

    pub fn has_driver(&self, name: &str) -> bool {
        self.drivers.contains(name)
    }

    /// The devices bound to `driver`.
    pub fn bound_to<'a>(&'a self, driver: &'a str) -> impl Iterator<Item = &'a Device> + 'a {
        self.devices
            .values()
            .filter(move |d| d.driver.as_deref() == Some(driver))
    }

    pub fn mdevs(&self) -> impl Iterator<Item = &Mdev> {
        self.mdevs.values()
    }

    pub fn mdev(&self, uuid: &str) -> Option<&Mdev> {
        self.mdevs.get(uuid)
    }

    /// The mdev types `address` offers now (none unless it is a registered parent).
    pub fn types(&self, address: &str) -> &[TypeConfig] {
        match self.devices.get(address) {
            Some(d) if d.is_mdev_parent() => &d.config.mdev_types,
            _ => &[],
        }
    }

    pub fn mdev_type(&self, address: &str, type_id: &str) -> Option<&TypeConfig> {
        self.types(address).iter().find(|t| t.id == type_id)
    }

    /// `available_instances` of a type: 0 once the GPU holds mdevs of another type, else the
    /// maximum less its own mdevs.
    pub fn available(&self, address: &str, type_id: &str) -> Option<u32> {
        let t = self.mdev_type(address, type_id)?;
        let mut own = 0u32;
        for m in self.mdevs.values().filter(|m| m.parent == address) {
            if m.type_id != type_id {
                return Some(0);
            }
            own += 1;
        }
        Some(t.max_instances.saturating_sub(own))
    }

    /// Every IOMMU group that exists: the configured devices' and the mdevs'.
    pub fn groups(&self) -> BTreeSet<u32> {
        self.devices
            .values()
            .filter_map(|d| d.config.iommu_group)
            .chain(self.mdevs.values().map(|m| m.group))
            .collect()
    }

    /// The members of group `g`.
    pub fn group_members(&self, g: u32) -> Vec<Member> {
        let pci = self
            .devices
            .values()
            .filter(|d| d.config.iommu_group == Some(g))
            .map(|d| Member::Pci(d.address().to_string()));
        let mdevs = self
            .mdevs
            .values()
            .filter(|m| m.group == g)
            .map(|m| Member::Mdev {
                parent: m.parent.clone(),
                uuid: m.uuid.clone(),
            });
        pci.chain(mdevs).collect()
    }

    /// The groups that have a `/dev/vfio/<n>` node.
    pub fn vfio_group_nodes(&self) -> BTreeSet<u32> {
        self.devices
            .values()
            .filter(|d| d.driver.as_deref() == Some(VFIO_PCI))
            .filter_map(|d| d.config.iommu_group)
            .chain(self.mdevs.values().map(|m| m.group))
            .collect()
    }

    /// `driver_override` as read: the name, or `(null)`.
    pub fn driver_override_text(&self, address: &str) -> Option<String> {
        let d = self.devices.get(address)?;
        Some(format!(
            "{}\n",
            d.driver_override.as_deref().unwrap_or("(null)")
        ))
    }

    /// Write `driver_override`: up to the first new line; empty clears it.
    pub fn write_driver_override(&mut self, address: &str, buf: &[u8]) -> Result<(), Refused> {
        let Some(d) = self.devices.get_mut(address) else {
            return refuse(Errno::Enodev, format!("no device {address}"));
        };
        if buf.len() >= 4096 {
            return refuse(Errno::Einval, "driver_override longer than a page");
        }
        let Ok(s) = std::str::from_utf8(buf) else {
            return refuse(Errno::Einval, "driver_override is not text");
        };
        let name = s.split('\n').next().unwrap_or("");
        d.driver_override = (!name.is_empty()).then(|| name.to_string());
        Ok(())
    }

    /// `bus/pci/drivers/<driver>/bind`.
    pub fn bind(&mut self, driver: &str, buf: &[u8]) -> Result<(), Refused> {
        let name = written_name(buf).unwrap_or_default();
        let Some(d) = self.devices.get(name) else {
            return refuse(Errno::Enodev, format!("bind {name:?}: no such device"));
        };
        if !d.matches(driver) {
            return refuse(
                Errno::Enodev,
                format!(
                    "bind {name} to {driver}: the driver does not match it (driver_override {:?}, id table of {})",
                    d.driver_override, d.config.native_driver
                ),
            );
        }
        if let Some(cur) = &d.driver {
            return refuse(
                Errno::Ebusy,
                format!("bind {name} to {driver}: already bound to {cur}"),
            );
        }
        self.attach(name.to_string(), driver);
        Ok(())
    }

    /// `bus/pci/drivers/<driver>/unbind`.
    pub fn unbind(&mut self, driver: &str, buf: &[u8]) -> Result<(), Refused> {
        let name = written_name(buf).unwrap_or_default();
        let Some(d) = self.devices.get(name) else {
            return refuse(Errno::Enodev, format!("unbind {name:?}: no such device"));
        };
        if d.driver.as_deref() != Some(driver) {
            return refuse(
                Errno::Enodev,
                format!("unbind {name} from {driver}: it is bound to {:?}", d.driver),
            );
        }
        let name = name.to_string();
        if d.is_mdev_parent() {
            // mdev_unregister_parent: every mdev of the parent goes with it
            self.mdevs.retain(|_, m| m.parent != name);
        }
        if let Some(d) = self.devices.get_mut(&name) {
            d.driver = None;
        }
        Ok(())
    }

    /// `bus/pci/drivers_probe`.
    pub fn drivers_probe(&mut self, buf: &[u8]) -> Result<(), Refused> {
        let name = written_name(buf).unwrap_or_default();
        let Some(d) = self.devices.get(name) else {
            return refuse(
                Errno::Enodev,
                format!("drivers_probe {name:?}: no such device"),
            );
        };
        if d.driver.is_some() {
            return Ok(());
        }
        let candidate = d
            .driver_override
            .clone()
            .unwrap_or_else(|| d.config.native_driver.clone());
        if self.drivers.contains(&candidate) {
            self.attach(name.to_string(), &candidate);
        }
        Ok(())
    }

    fn attach(&mut self, address: String, driver: &str) {
        if let Some(d) = self.devices.get_mut(&address) {
            d.driver = Some(driver.to_string());
        }
    }

    /// `mdev_supported_types/<type_id>/create` of `parent`: the new mdev's UUID.
    pub fn create(&mut self, parent: &str, type_id: &str, buf: &[u8]) -> Result<String, Refused> {
        if buf.len() < 36 || buf.len() > 37 {
            return refuse(
                Errno::Einval,
                format!(
                    "create takes a UUID (36 characters, optionally a new line), not {} bytes",
                    buf.len()
                ),
            );
        }
        let Some(uuid) = parse_uuid(buf) else {
            return refuse(
                Errno::Einval,
                format!("create: {:?} is not a UUID", String::from_utf8_lossy(buf)),
            );
        };
        if self.mdevs.contains_key(&uuid) {
            return refuse(Errno::Eexist, format!("create {uuid}: the UUID is in use"));
        }
        let Some(avail) = self.available(parent, type_id) else {
            return refuse(
                Errno::Enodev,
                format!("create on {parent}: no type {type_id} (not an mdev parent now)"),
            );
        };
        if avail == 0 {
            return refuse(
                Errno::Eusers,
                format!("create {type_id} on {parent}: no instance available"),
            );
        }
        let group = self.fresh_group();
        self.mdevs.insert(
            uuid.clone(),
            Mdev {
                uuid: uuid.clone(),
                parent: parent.to_string(),
                type_id: type_id.to_string(),
                group,
                busy: false,
            },
        );
        Ok(uuid)
    }

    /// The lowest group number above the configured ones that no mdev holds.
    fn fresh_group(&self) -> u32 {
        let used: BTreeSet<u32> = self.mdevs.values().map(|m| m.group).collect();
        (self.first_mdev_group..)
            .find(|g| !used.contains(g))
            .unwrap_or(u32::MAX)
    }

    /// `bus/mdev/devices/<uuid>/remove`.
    pub fn remove(&mut self, uuid: &str, buf: &[u8]) -> Result<(), Refused> {
        let Some(val) = kstrtoul(buf) else {
            return refuse(
                Errno::Einval,
                format!(
                    "remove {uuid}: {:?} is not a number",
                    String::from_utf8_lossy(buf)
                ),
            );
        };
        if val == 0 {
            return Ok(());
        }
        match self.mdevs.get(uuid) {
            None => refuse(Errno::Enodev, format!("remove {uuid}: no such mdev")),
            Some(m) if m.busy => refuse(
                Errno::Ebusy,
                format!("remove {uuid}: the vendor driver refuses, a VM has it open"),
            ),
            Some(_) => {
                self.mdevs.remove(uuid);
                Ok(())
            }
        }
    }

    /// `sim/busy` and `sim/idle`: an mdev opened or released by a VM.
    pub fn set_busy(&mut self, buf: &[u8], busy: bool) -> Result<(), Refused> {
        let text = String::from_utf8_lossy(buf);
        let uuid = text.trim().to_ascii_lowercase();
        match self.mdevs.get_mut(&uuid) {
            Some(m) => {
                m.busy = busy;
                Ok(())
            }
            None => refuse(Errno::Enoent, format!("no mdev {uuid:?}")),
        }
    }

    /// The state as JSON (`sim/state`), for test logs.
    pub fn state_json(&self) -> String {
        let devices: Vec<_> = self
            .devices
            .values()
            .map(|d| {
                serde_json::json!({
                    "address": d.address(),
                    "driver": d.driver,
                    "driver_override": d.driver_override,
                })
            })
            .collect();
        let mdevs: Vec<_> = self
            .mdevs
            .values()
            .map(|m| {
                serde_json::json!({
                    "uuid": m.uuid, "parent": m.parent, "type": m.type_id,
                    "group": m.group, "busy": m.busy,
                })
            })
            .collect();
        let nodes: Vec<u32> = self.vfio_group_nodes().into_iter().collect();
        format!(
            "{}\n",
            serde_json::json!({"devices": devices, "mdevs": mdevs, "vfio_group_nodes": nodes})
        )
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub const GPU: &str = "0000:3b:00.0";
    pub const VF: &str = "0000:86:00.0";
    pub const AUDIO: &str = "0000:86:00.1";
    pub const U1: &str = "83b8f4f2-509f-382f-3c1e-e6bfe0fa1001";
    pub const U2: &str = "83b8f4f2-509f-382f-3c1e-e6bfe0fa1002";

    /// A T4 on nvidia with two types (4 and 2 instances), a passthrough GPU and its audio
    /// function in group 40.
    pub fn node() -> Node {
        let c: Config = serde_json::from_str(&format!(
            r#"{{"devices": [
              {{"address": "{GPU}", "vendor": "0x10de", "device": "0x1eb8", "class": "0x030200",
               "driver": "nvidia", "iommu_group": 12, "numa_node": 0,
               "mdev_types": [{{"id": "nvidia-222", "name": "GRID T4-1B", "max_instances": 4}},
                              {{"id": "nvidia-223", "max_instances": 2}}]}},
              {{"address": "{VF}", "vendor": "0x10de", "device": "0x1f08", "class": "0x030000",
               "driver": "vfio-pci", "iommu_group": 40}},
              {{"address": "{AUDIO}", "vendor": "0x10de", "device": "0x10f9", "class": "0x040300",
               "driver": "snd_hda_intel", "native_driver": "snd_hda_intel", "iommu_group": 40}}
            ]}}"#
        ))
        .unwrap();
        c.check().unwrap();
        Node::new(&c)
    }

    fn errno<T: std::fmt::Debug>(r: Result<T, Refused>) -> Errno {
        r.unwrap_err().errno
    }

    #[test]
    fn create_and_remove_follow_mdev_core() {
        let mut n = node();
        assert_eq!(n.available(GPU, "nvidia-222"), Some(4));
        let u = n
            .create(GPU, "nvidia-222", format!("{U1}\n").as_bytes())
            .unwrap();
        assert_eq!(u, U1);
        // the same UUID again, on any type or parent, in any case: EEXIST
        assert_eq!(
            errno(n.create(GPU, "nvidia-222", U1.as_bytes())),
            Errno::Eexist
        );
        let upper = U1.to_ascii_uppercase();
        assert_eq!(
            errno(n.create(GPU, "nvidia-223", upper.as_bytes())),
            Errno::Eexist
        );
        // not a UUID: EINVAL, whatever the length
        for bad in [
            "",
            "1",
            "83b8f4f2-509f-382f-3c1e-e6bfe0fa100g",
            &format!("{U2}\n\n"),
        ] {
            assert_eq!(
                errno(n.create(GPU, "nvidia-222", bad.as_bytes())),
                Errno::Einval,
                "{bad:?}"
            );
        }
        // the 37th byte is not looked at (guid_parse reads 36)
        assert!(n
            .create(GPU, "nvidia-222", format!("{U2}x").as_bytes())
            .is_ok());
        assert_eq!(n.available(GPU, "nvidia-222"), Some(2));
        // remove: kstrtoul, 0 does nothing
        assert_eq!(errno(n.remove(U1, b"yes")), Errno::Einval);
        n.remove(U1, b"0\n").unwrap();
        assert!(n.mdev(U1).is_some());
        n.remove(U1, b"1\n").unwrap();
        assert!(n.mdev(U1).is_none());
        assert_eq!(errno(n.remove(U1, b"1")), Errno::Enodev);
        assert_eq!(kstrtoul(b"0x1"), Some(1));
        assert_eq!(kstrtoul(b"010"), Some(8));
        assert_eq!(kstrtoul(b"+7\n"), Some(7));
        assert_eq!(kstrtoul(b"1 "), None);
    }

    #[test]
    fn instances_run_out_with_eusers_and_other_types_read_zero() {
        let mut n = node();
        let mut uuids = Vec::new();
        for i in 0..4 {
            let u = format!("00000000-0000-4000-8000-00000000000{i}");
            n.create(GPU, "nvidia-222", u.as_bytes()).unwrap();
            uuids.push(u);
            assert_eq!(n.available(GPU, "nvidia-222"), Some(3 - i));
            // NVIDIA's driver: one type at a time per GPU
            assert_eq!(n.available(GPU, "nvidia-223"), Some(0));
        }
        assert_eq!(
            errno(n.create(GPU, "nvidia-222", U1.as_bytes())),
            Errno::Eusers
        );
        assert_eq!(
            errno(n.create(GPU, "nvidia-223", U1.as_bytes())),
            Errno::Eusers
        );
        for u in &uuids {
            n.remove(u, b"1").unwrap();
        }
        assert_eq!(n.available(GPU, "nvidia-223"), Some(2));
        n.create(GPU, "nvidia-223", U1.as_bytes()).unwrap();
        assert_eq!(n.available(GPU, "nvidia-222"), Some(0));
        assert_eq!(n.available(GPU, "nvidia-223"), Some(1));
    }

    #[test]
    fn busy_mdevs_refuse_removal_with_ebusy() {
        let mut n = node();
        n.create(GPU, "nvidia-222", U1.as_bytes()).unwrap();
        n.set_busy(format!("{}\n", U1.to_ascii_uppercase()).as_bytes(), true)
            .unwrap();
        assert_eq!(errno(n.remove(U1, b"1")), Errno::Ebusy);
        assert!(n.mdev(U1).is_some());
        n.set_busy(U1.as_bytes(), false).unwrap();
        n.remove(U1, b"1").unwrap();
        assert_eq!(errno(n.set_busy(U1.as_bytes(), true)), Errno::Enoent);
    }

    #[test]
    fn each_mdev_gets_a_group_no_one_holds() {
        let mut n = node();
        n.create(GPU, "nvidia-222", U1.as_bytes()).unwrap();
        n.create(GPU, "nvidia-222", U2.as_bytes()).unwrap();
        let (g1, g2) = (n.mdev(U1).unwrap().group, n.mdev(U2).unwrap().group);
        assert_eq!((g1, g2), (41, 42));
        assert_eq!(n.vfio_group_nodes(), BTreeSet::from([40, 41, 42]));
        assert_eq!(
            n.group_members(41),
            [Member::Mdev {
                parent: GPU.into(),
                uuid: U1.into()
            }]
        );
        // ida_alloc: the lowest free number comes back
        n.remove(U1, b"1").unwrap();
        let u3 = "00000000-0000-4000-8000-000000000003";
        n.create(GPU, "nvidia-222", u3.as_bytes()).unwrap();
        assert_eq!(n.mdev(u3).unwrap().group, 41);
        assert!(!n.groups().contains(&0));
    }

    #[test]
    fn binding_follows_the_driver_core() {
        let mut n = node();
        // unbind from a driver it is not bound to: ENODEV
        assert_eq!(errno(n.unbind("nvidia", VF.as_bytes())), Errno::Enodev);
        assert_eq!(errno(n.unbind("vfio-pci", b"0000:00:00.0")), Errno::Enodev);
        n.unbind("vfio-pci", format!("{VF}\n").as_bytes()).unwrap();
        assert_eq!(n.device(VF).unwrap().driver, None);
        assert_eq!(n.vfio_group_nodes(), BTreeSet::new());
        // vfio-pci's id table is empty: it binds only through driver_override
        assert_eq!(errno(n.bind("vfio-pci", VF.as_bytes())), Errno::Enodev);
        n.write_driver_override(VF, b"vfio-pci\n").unwrap();
        assert_eq!(n.driver_override_text(VF).unwrap(), "vfio-pci\n");
        n.drivers_probe(VF.as_bytes()).unwrap();
        assert_eq!(n.device(VF).unwrap().driver.as_deref(), Some("vfio-pci"));
        assert_eq!(n.vfio_group_nodes(), BTreeSet::from([40]));
        // bound already: bind is EBUSY, drivers_probe leaves it
        assert_eq!(errno(n.bind("vfio-pci", VF.as_bytes())), Errno::Ebusy);
        n.drivers_probe(VF.as_bytes()).unwrap();
        // with the override, the native driver no longer matches
        n.unbind("vfio-pci", VF.as_bytes()).unwrap();
        assert_eq!(errno(n.bind("nvidia", VF.as_bytes())), Errno::Enodev);
        // cleared (empty string): the id table again
        n.write_driver_override(VF, b"\n").unwrap();
        assert_eq!(n.driver_override_text(VF).unwrap(), "(null)\n");
        n.drivers_probe(VF.as_bytes()).unwrap();
        assert_eq!(n.device(VF).unwrap().driver.as_deref(), Some("nvidia"));
        // an override naming no loaded driver: drivers_probe succeeds and binds nothing
        n.unbind("nvidia", VF.as_bytes()).unwrap();
        n.write_driver_override(VF, b"none").unwrap();
        n.drivers_probe(VF.as_bytes()).unwrap();
        assert_eq!(n.device(VF).unwrap().driver, None);
        assert_eq!(errno(n.drivers_probe(b"0000:99:00.0")), Errno::Enodev);
    }

    #[test]
    fn unbinding_the_vendor_driver_takes_the_types_and_mdevs() {
        let mut n = node();
        n.create(GPU, "nvidia-222", U1.as_bytes()).unwrap();
        assert_eq!(n.types(GPU).len(), 2);
        n.unbind("nvidia", GPU.as_bytes()).unwrap();
        assert!(n.types(GPU).is_empty());
        assert_eq!(n.mdevs().count(), 0);
        assert_eq!(
            errno(n.create(GPU, "nvidia-222", U2.as_bytes())),
            Errno::Enodev
        );
        n.bind("nvidia", GPU.as_bytes()).unwrap();
        assert_eq!(n.available(GPU, "nvidia-222"), Some(4));
        // a GPU on vfio-pci offers no types
        n.unbind("nvidia", GPU.as_bytes()).unwrap();
        n.write_driver_override(GPU, b"vfio-pci").unwrap();
        n.drivers_probe(GPU.as_bytes()).unwrap();
        assert!(n.types(GPU).is_empty());
        assert_eq!(n.vfio_group_nodes(), BTreeSet::from([12, 40]));
    }
}
