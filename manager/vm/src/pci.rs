//! PCI devices as sysfs shows them, and the vfio passthrough decisions: which devices are
//! NVIDIA GPUs, which are served (bound to `vfio-pci`), their health, and the Allocate
//! answer.
//!
//! **The IOMMU group is the unit.** VFIO hands a user a whole IOMMU group, never a device
//! (`Documentation/driver-api/vfio.rst`, "Groups, Devices, and IOMMUs"): the group is usable
//! ("viable") only when every device in it is bound to a VFIO driver or to no host driver at
//! all, and its character device `/dev/vfio/<group>` appears once that holds. A GPU's audio,
//! USB and UCSI functions are not GPUs (their class is not display, `0x03`) but usually
//! share the GPU's group, so they must be bound to `vfio-pci` too. Hence the health rule
//! ([`Snapshot::health`]): a served GPU is healthy while it is bound to `vfio-pci`, has an
//! IOMMU group whose `/dev/vfio/<group>` exists, and every other device of that group is
//! bound to `vfio-pci`, to no driver, or to a driver that takes no DMA ownership
//! (`pci-stub`, and `pcieport` for bridges, which the kernel allows in a user-owned group);
//! otherwise it is unhealthy with an [`Unhealthy`] reason that names the device and the fix.
//!
//! **Allocate** ([`Snapshot::allocate`]) answers the device nodes `/dev/vfio/vfio` (the
//! container) and `/dev/vfio/<group>` of each distinct group in request order, and
//! `PCI_RESOURCE_<NAME>=<addr>[,<addr>…]` with the addresses in the order asked — the
//! positional list virt-launcher pops from. All of a group goes together: a request naming
//! one served GPU of a group that holds two is refused ([`AllocateError::SplitGroup`]), since
//! handing out the group hands out both.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::str::FromStr;

use crate::naming::{env_var_name, NVIDIA_VENDOR, PCI_RESOURCE_PREFIX};

/// The driver that makes a device usable by VFIO.
pub const VFIO_DRIVER: &str = "vfio-pci";
/// Drivers a device may have and still leave its group viable for VFIO: they take no DMA
/// ownership (`driver_managed_dma`): `pci-stub`, and `pcieport` for PCIe bridges.
pub const GROUP_SAFE_DRIVERS: [&str; 3] = [VFIO_DRIVER, "pci-stub", "pcieport"];
/// The VFIO container device node every user of VFIO opens.
pub const VFIO_CONTAINER: &str = "/dev/vfio/vfio";

/// A PCI address in sysfs' form, `dddd:bb:dd.f` (domain, bus, device, function; lower-case
/// hex), e.g. `0000:86:00.0`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PciAddress(String);

/// Not a PCI address in sysfs' form.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a PCI address: sysfs' form is dddd:bb:dd.f in hex (e.g. 0000:86:00.0), as `lspci -D` prints it")]
pub struct AddressError(pub String);

impl FromStr for PciAddress {
    type Err = AddressError;

    /// Accepts upper-case hex too (as a person may type it) and keeps the lower-case form
    /// sysfs uses.
    fn from_str(s: &str) -> Result<PciAddress, AddressError> {
        let b = s.as_bytes();
        let hex = |r: std::ops::Range<usize>| b[r].iter().all(u8::is_ascii_hexdigit);
        let ok = b.len() == 12
            && b[4] == b':'
            && b[7] == b':'
            && b[10] == b'.'
            && hex(0..4)
            && hex(5..7)
            && hex(8..10)
            && (b'0'..=b'7').contains(&b[11])
            // device numbers are five bits
            && u8::from_str_radix(&s[8..10], 16).is_ok_and(|d| d < 32);
        if ok {
            Ok(PciAddress(s.to_ascii_lowercase()))
        } else {
            Err(AddressError(s.to_string()))
        }
    }
}

impl PciAddress {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for PciAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// One PCI device as `/sys/bus/pci/devices/<address>` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PciDevice {
    pub address: PciAddress,
    /// `vendor`, e.g. `0x10de`.
    pub vendor: u16,
    /// `device`, e.g. `0x1f08`.
    pub device: u16,
    /// `class`: base class, subclass, programming interface (`0x030000` VGA).
    pub class: u32,
    /// The name of the `driver` link's target, or none when no driver is bound.
    pub driver: Option<String>,
    /// The number the `iommu_group` link points to; none without an IOMMU (off in the
    /// kernel command line, or absent).
    pub iommu_group: Option<u32>,
    /// `numa_node`; none where it says `-1` (no affinity) or is absent.
    pub numa_node: Option<u32>,
}

impl PciDevice {
    /// An NVIDIA GPU: vendor `10de`, base class `0x03` (display: VGA `0x0300`, 3D
    /// `0x0302`, other `0x0380`). A card's audio (`0x0403`), USB (`0x0c03`) and UCSI
    /// (`0x0c80`) functions are not GPUs, though they share its IOMMU group.
    pub fn is_nvidia_gpu(&self) -> bool {
        self.vendor == NVIDIA_VENDOR && self.class >> 16 == 0x03
    }

    /// Bound to `vfio-pci`.
    pub fn is_vfio(&self) -> bool {
        self.driver.as_deref() == Some(VFIO_DRIVER)
    }

    /// Leaves its IOMMU group viable for VFIO (see [`GROUP_SAFE_DRIVERS`]).
    fn group_safe(&self) -> bool {
        self.driver
            .as_deref()
            .is_none_or(|d| GROUP_SAFE_DRIVERS.contains(&d))
    }
}

/// Why a passthrough GPU cannot be handed out; each message names the device and the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unhealthy {
    #[error("{address} is gone from /sys/bus/pci/devices (removed or hot-unplugged); it comes back when the device does")]
    Gone { address: PciAddress },
    #[error("{address} is bound to no driver; bind it to vfio-pci (echo {address} > /sys/bus/pci/drivers/vfio-pci/bind, after driver_override or new_id)")]
    Unbound { address: PciAddress },
    #[error("{address} is bound to {driver}, not vfio-pci (a GPU serves either containers or VMs); unbind it and bind it to vfio-pci to hand it to VMs")]
    OtherDriver { address: PciAddress, driver: String },
    #[error("{address} has no IOMMU group: the IOMMU is off; enable it on the kernel command line (intel_iommu=on or amd_iommu=on, iommu=pt) and reboot")]
    NoIommuGroup { address: PciAddress },
    #[error("{address}: /dev/vfio/{group} does not exist, so IOMMU group {group} cannot be opened; bind every device of the group to vfio-pci (the node appears when the group is viable)")]
    NoGroupNode { address: PciAddress, group: u32 },
    #[error("{address}: its IOMMU group {group} also holds {peer}, bound to {driver}; VFIO hands out whole groups, so bind {peer} to vfio-pci too (or unbind it)")]
    ForeignPeer {
        address: PciAddress,
        group: u32,
        peer: PciAddress,
        driver: String,
    },
}

impl Unhealthy {
    /// A short stable name for counting by kind.
    pub fn kind(&self) -> &'static str {
        match self {
            Unhealthy::Gone { .. } => "gone",
            Unhealthy::Unbound { .. } => "unbound",
            Unhealthy::OtherDriver { .. } => "other-driver",
            Unhealthy::NoIommuGroup { .. } => "no-iommu-group",
            Unhealthy::NoGroupNode { .. } => "no-group-node",
            Unhealthy::ForeignPeer { .. } => "foreign-peer",
        }
    }
}

/// A refused passthrough Allocate.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocateError {
    #[error("the kubelet asked for {id:?}, which is not a passthrough GPU of this node; it allocates only device IDs the plugin advertised, so its view is stale: it refreshes on the next ListAndWatch")]
    UnknownDevice { id: String },
    #[error("the kubelet asked for {address}, which is unhealthy: {reason}")]
    Unhealthy {
        address: PciAddress,
        reason: Unhealthy,
    },
    #[error("the kubelet asked for {address} twice in one request")]
    Duplicate { address: PciAddress },
    #[error("{address} shares IOMMU group {group} with {missing}, which was not asked for; VFIO hands out whole groups, so both would go to this pod: request them together, or separate them (ACS-capable slots)")]
    SplitGroup {
        address: PciAddress,
        group: u32,
        missing: PciAddress,
    },
    #[error("an Allocate with no devices")]
    Empty,
}

/// A VFIO Allocate answer: the device nodes to pass (host path = container path) and the
/// one environment variable virt-launcher reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VfioAnswer {
    /// `/dev/vfio/vfio`, then `/dev/vfio/<group>` of each distinct group in request order.
    pub device_nodes: Vec<String>,
    /// (`PCI_RESOURCE_<NAME>` or `MDEV_PCI_RESOURCE_<NAME>`, comma-joined values in order).
    pub env: (String, String),
}

impl VfioAnswer {
    /// The answer for devices `values` (addresses or UUIDs, in order) in `groups`, under
    /// `prefix` for `resource`.
    pub fn new(
        prefix: &str,
        resource: &str,
        values: &[&str],
        groups: impl IntoIterator<Item = u32>,
    ) -> VfioAnswer {
        let mut device_nodes = vec![VFIO_CONTAINER.to_string()];
        let mut seen = BTreeSet::new();
        for g in groups {
            if seen.insert(g) {
                device_nodes.push(format!("/dev/vfio/{g}"));
            }
        }
        VfioAnswer {
            device_nodes,
            env: (env_var_name(prefix, resource), values.join(",")),
        }
    }
}

/// The node's PCI devices and the VFIO group nodes present under `/dev/vfio`, at one moment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Snapshot {
    devices: BTreeMap<PciAddress, PciDevice>,
    group_nodes: BTreeSet<u32>,
}

impl Snapshot {
    /// `devices` (one per address: a later duplicate replaces an earlier one) and the group
    /// numbers `n` for which `/dev/vfio/<n>` exists.
    pub fn new(devices: Vec<PciDevice>, group_nodes: BTreeSet<u32>) -> Snapshot {
        Snapshot {
            devices: devices
                .into_iter()
                .map(|d| (d.address.clone(), d))
                .collect(),
            group_nodes,
        }
    }

    pub fn device(&self, address: &PciAddress) -> Option<&PciDevice> {
        self.devices.get(address)
    }

    pub fn devices(&self) -> impl Iterator<Item = &PciDevice> {
        self.devices.values()
    }

    /// The NVIDIA GPUs, in address order, whatever their driver.
    pub fn nvidia_gpus(&self) -> impl Iterator<Item = &PciDevice> {
        self.devices.values().filter(|d| d.is_nvidia_gpu())
    }

    /// The GPUs the passthrough backend serves: NVIDIA GPUs bound to `vfio-pci`. A GPU
    /// bound to `nvidia` belongs to the container modes; one bound to nothing to neither.
    pub fn vfio_gpus(&self) -> impl Iterator<Item = &PciDevice> {
        self.nvidia_gpus().filter(|d| d.is_vfio())
    }

    /// The devices of IOMMU group `group`, in address order.
    pub fn group(&self, group: u32) -> impl Iterator<Item = &PciDevice> {
        self.devices
            .values()
            .filter(move |d| d.iommu_group == Some(group))
    }

    /// The health of the passthrough GPU at `address` (see the module documentation). The
    /// checks run in order, so the reason is the first thing to fix.
    pub fn health(&self, address: &PciAddress) -> Result<(), Unhealthy> {
        let Some(dev) = self.devices.get(address) else {
            return Err(Unhealthy::Gone {
                address: address.clone(),
            });
        };
        match dev.driver.as_deref() {
            None => {
                return Err(Unhealthy::Unbound {
                    address: address.clone(),
                })
            }
            Some(VFIO_DRIVER) => {}
            Some(other) => {
                return Err(Unhealthy::OtherDriver {
                    address: address.clone(),
                    driver: other.to_string(),
                })
            }
        }
        let Some(group) = dev.iommu_group else {
            return Err(Unhealthy::NoIommuGroup {
                address: address.clone(),
            });
        };
        if let Some(peer) = self
            .group(group)
            .find(|p| &p.address != address && !p.group_safe())
        {
            return Err(Unhealthy::ForeignPeer {
                address: address.clone(),
                group,
                peer: peer.address.clone(),
                driver: peer.driver.clone().unwrap_or_default(),
            });
        }
        if !self.group_nodes.contains(&group) {
            return Err(Unhealthy::NoGroupNode {
                address: address.clone(),
                group,
            });
        }
        Ok(())
    }

    /// The Allocate answer for the device IDs (PCI addresses) `ids` of `resource`, in the
    /// order given: all healthy served GPUs, no address twice, no group split.
    pub fn allocate(&self, resource: &str, ids: &[&str]) -> Result<VfioAnswer, AllocateError> {
        if ids.is_empty() {
            return Err(AllocateError::Empty);
        }
        let mut asked: Vec<&PciDevice> = Vec::with_capacity(ids.len());
        for id in ids {
            let unknown = || AllocateError::UnknownDevice { id: id.to_string() };
            let address: PciAddress = id.parse().map_err(|_| unknown())?;
            let dev = self
                .devices
                .get(&address)
                .filter(|d| d.is_nvidia_gpu())
                .ok_or_else(unknown)?;
            if asked.iter().any(|a| a.address == address) {
                return Err(AllocateError::Duplicate { address });
            }
            self.health(&address)
                .map_err(|reason| AllocateError::Unhealthy {
                    address: address.clone(),
                    reason,
                })?;
            asked.push(dev);
        }
        for dev in &asked {
            let group = dev.iommu_group.unwrap_or_default(); // healthy: it has one
            if let Some(missing) = self.group(group).find(|p| {
                p.is_nvidia_gpu() && p.is_vfio() && !asked.iter().any(|a| a.address == p.address)
            }) {
                return Err(AllocateError::SplitGroup {
                    address: dev.address.clone(),
                    group,
                    missing: missing.address.clone(),
                });
            }
        }
        let values: Vec<&str> = asked.iter().map(|d| d.address.as_str()).collect();
        Ok(VfioAnswer::new(
            PCI_RESOURCE_PREFIX,
            resource,
            &values,
            asked.iter().filter_map(|d| d.iommu_group),
        ))
    }

    /// GetPreferredAllocation: `size` of the `available` IDs (PCI addresses), `must` first,
    /// in whole IOMMU groups where the IDs allow it — [`Snapshot::allocate`] refuses a
    /// request that splits a group, and the kubelet, left to itself, picks IDs in its own
    /// order. Whole groups (every served GPU of the group available) the request leaves room
    /// for go in largest first (fewer left split for later requests), in address order among
    /// equals; only when they cannot fill it are the rest taken from the others in address
    /// order (that request is then refused, as it would be anyway). Fewer than `size` when
    /// fewer are available.
    pub fn preferred<'a>(
        &self,
        available: &[&'a str],
        must: &[&'a str],
        size: usize,
    ) -> Vec<String> {
        // the unit a device goes in: its group, or itself when it has none
        let unit = |id: &str| -> Result<u32, String> {
            id.parse::<PciAddress>()
                .ok()
                .and_then(|a| self.devices.get(&a))
                .and_then(|d| d.iommu_group)
                .ok_or_else(|| id.to_string())
        };
        let mut units: BTreeMap<Result<u32, String>, Vec<&'a str>> = BTreeMap::new();
        let mut sorted: Vec<&'a str> = available.iter().chain(must).copied().collect();
        sorted.sort_unstable();
        sorted.dedup();
        for id in sorted {
            units.entry(unit(id)).or_default().push(id);
        }
        let mut chosen: Vec<&'a str> = Vec::with_capacity(size);
        fn take<'a>(chosen: &mut Vec<&'a str>, ids: &[&'a str]) {
            for id in ids {
                if !chosen.contains(id) {
                    chosen.push(id);
                }
            }
        }
        for m in must {
            take(&mut chosen, &[m]);
        }
        for m in must {
            if let Some(members) = units.remove(&unit(m)) {
                take(&mut chosen, &members);
            }
        }
        // a group some of whose GPUs are not available (taken, or unhealthy) cannot be whole
        let whole = |key: &Result<u32, String>, members: &[&str]| match key {
            Ok(g) => self
                .group(*g)
                .filter(|p| p.is_nvidia_gpu() && p.is_vfio())
                .all(|p| members.contains(&p.address.as_str())),
            Err(_) => true,
        };
        let mut rest: Vec<(bool, Vec<&'a str>)> =
            units.into_iter().map(|(k, u)| (whole(&k, &u), u)).collect();
        // stable: address order among equals
        rest.sort_by_key(|(w, u)| (!w, std::cmp::Reverse(u.len())));
        let mut split = Vec::new();
        for (w, u) in rest {
            if w && chosen.len() + u.len() <= size {
                take(&mut chosen, &u);
            } else {
                split.push(u);
            }
        }
        for u in split {
            take(&mut chosen, &u);
        }
        chosen.truncate(size.max(must.len()));
        chosen.into_iter().map(str::to_string).collect()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn addr(s: &str) -> PciAddress {
        s.parse().unwrap()
    }

    pub(crate) fn dev(
        a: &str,
        vendor: u16,
        device: u16,
        class: u32,
        driver: Option<&str>,
        group: Option<u32>,
    ) -> PciDevice {
        PciDevice {
            address: addr(a),
            vendor,
            device,
            class,
            driver: driver.map(str::to_string),
            iommu_group: group,
            numa_node: Some(1),
        }
    }

    const RES: &str = "nvidia.com/TU106_GEFORCE_RTX_2060_REV__A";

    /// Seed 004's node: RTX 2060s at 86:00 and af:00, each with its audio, USB and UCSI
    /// functions in its group; a bridge; an NVMe drive elsewhere.
    fn seed_node() -> Vec<PciDevice> {
        let v = Some(VFIO_DRIVER);
        vec![
            dev("0000:86:00.0", 0x10de, 0x1f08, 0x030000, v, Some(40)),
            dev("0000:86:00.1", 0x10de, 0x10f9, 0x040300, v, Some(40)),
            dev("0000:86:00.2", 0x10de, 0x1ada, 0x0c0330, v, Some(40)),
            dev("0000:86:00.3", 0x10de, 0x1adb, 0x0c8000, v, Some(40)),
            dev("0000:af:00.0", 0x10de, 0x1f08, 0x030000, v, Some(60)),
            dev("0000:af:00.1", 0x10de, 0x10f9, 0x040300, v, Some(60)),
            dev(
                "0000:80:02.0",
                0x8086,
                0x2030,
                0x060400,
                Some("pcieport"),
                Some(3),
            ),
            dev(
                "0000:5e:00.0",
                0x144d,
                0xa808,
                0x010802,
                Some("nvme"),
                Some(7),
            ),
        ]
    }

    fn nodes(groups: &[u32]) -> BTreeSet<u32> {
        groups.iter().copied().collect()
    }

    #[test]
    fn addresses() {
        assert_eq!(addr("0000:86:00.0").as_str(), "0000:86:00.0");
        assert_eq!(addr("0000:AF:00.0").as_str(), "0000:af:00.0");
        for bad in [
            "86:00.0",
            "0000:86:00.8",
            "0000:86:20.0",
            "0000:86:00:0",
            "0000-86:00.0",
            "000g:86:00.0",
            "0000:86:00.0 ",
        ] {
            let e = bad.parse::<PciAddress>().unwrap_err();
            assert!(e.to_string().contains("dddd:bb:dd.f"), "{bad}: {e}");
        }
    }

    #[test]
    fn gpus_are_display_class_nvidia_functions() {
        let s = Snapshot::new(seed_node(), nodes(&[40, 60]));
        let gpus: Vec<_> = s.nvidia_gpus().map(|d| d.address.as_str()).collect();
        assert_eq!(gpus, ["0000:86:00.0", "0000:af:00.0"]);
        // the audio/USB/UCSI functions share the GPU's group
        assert_eq!(s.group(40).count(), 4);
        // 3D controllers (0x0302, data-centre GPUs) are GPUs; an Intel VGA is not
        assert!(dev("0000:01:00.0", 0x10de, 0x1eb8, 0x030200, None, None).is_nvidia_gpu());
        assert!(!dev("0000:00:02.0", 0x8086, 0x3e92, 0x030000, None, None).is_nvidia_gpu());
    }

    #[test]
    fn served_gpus_are_the_vfio_bound_ones() {
        let mut devs = seed_node();
        devs[4].driver = Some("nvidia".into());
        let s = Snapshot::new(devs, nodes(&[40, 60]));
        let served: Vec<_> = s.vfio_gpus().map(|d| d.address.as_str()).collect();
        assert_eq!(served, ["0000:86:00.0"]);
    }

    #[test]
    fn healthy_group() {
        let s = Snapshot::new(seed_node(), nodes(&[40, 60]));
        assert_eq!(s.health(&addr("0000:86:00.0")), Ok(()));
        assert_eq!(s.health(&addr("0000:af:00.0")), Ok(()));
        // a bridge (pcieport), a pci-stub or an unbound peer leaves the group viable
        let mut devs = seed_node();
        devs[1].driver = None;
        devs[2].driver = Some("pci-stub".into());
        devs[3].iommu_group = Some(3); // joins the bridge's group: irrelevant
        devs.push(dev(
            "0000:85:00.0",
            0x10b5,
            0x8747,
            0x060400,
            Some("pcieport"),
            Some(40),
        ));
        let s = Snapshot::new(devs, nodes(&[40]));
        assert_eq!(s.health(&addr("0000:86:00.0")), Ok(()));
    }

    #[test]
    fn a_peer_on_a_host_driver_makes_the_group_unhealthy() {
        let mut devs = seed_node();
        devs[1].driver = Some("snd_hda_intel".into());
        let s = Snapshot::new(devs, nodes(&[40, 60]));
        let e = s.health(&addr("0000:86:00.0")).unwrap_err();
        assert_eq!(
            e,
            Unhealthy::ForeignPeer {
                address: addr("0000:86:00.0"),
                group: 40,
                peer: addr("0000:86:00.1"),
                driver: "snd_hda_intel".into()
            }
        );
        let msg = e.to_string();
        assert!(msg.contains("0000:86:00.1"), "{msg}");
        assert!(msg.contains("bind 0000:86:00.1 to vfio-pci too"), "{msg}");
        assert_eq!(e.kind(), "foreign-peer");
        // the other card is not affected
        assert_eq!(s.health(&addr("0000:af:00.0")), Ok(()));
    }

    #[test]
    fn unbound_rebound_gone_and_no_node() {
        let mut devs = seed_node();
        devs[0].driver = None;
        devs[4].driver = Some("nvidia".into());
        let s = Snapshot::new(devs, nodes(&[40, 60]));
        let e = s.health(&addr("0000:86:00.0")).unwrap_err();
        assert_eq!(e.kind(), "unbound");
        assert!(e.to_string().contains("bind it to vfio-pci"), "{e}");
        let e = s.health(&addr("0000:af:00.0")).unwrap_err();
        assert_eq!(
            e,
            Unhealthy::OtherDriver {
                address: addr("0000:af:00.0"),
                driver: "nvidia".into()
            }
        );
        assert!(e.to_string().contains("bound to nvidia"), "{e}");
        let e = s.health(&addr("0000:3b:00.0")).unwrap_err();
        assert_eq!(e.kind(), "gone");

        // the group's node missing
        let s = Snapshot::new(seed_node(), nodes(&[60]));
        let e = s.health(&addr("0000:86:00.0")).unwrap_err();
        assert_eq!(
            e,
            Unhealthy::NoGroupNode {
                address: addr("0000:86:00.0"),
                group: 40
            }
        );
        assert!(e.to_string().contains("/dev/vfio/40"), "{e}");
        // and back when it returns
        let s = Snapshot::new(seed_node(), nodes(&[40, 60]));
        assert_eq!(s.health(&addr("0000:86:00.0")), Ok(()));

        // no IOMMU
        let mut devs = seed_node();
        devs[0].iommu_group = None;
        let s = Snapshot::new(devs, nodes(&[40, 60]));
        let e = s.health(&addr("0000:86:00.0")).unwrap_err();
        assert!(e.to_string().contains("intel_iommu=on"), "{e}");
    }

    #[test]
    fn allocate_one_and_two() {
        let s = Snapshot::new(seed_node(), nodes(&[40, 60]));
        let a = s.allocate(RES, &["0000:86:00.0"]).unwrap();
        assert_eq!(a.device_nodes, ["/dev/vfio/vfio", "/dev/vfio/40"]);
        assert_eq!(
            a.env,
            (
                "PCI_RESOURCE_NVIDIA_COM_TU106_GEFORCE_RTX_2060_REV__A".to_string(),
                "0000:86:00.0".to_string()
            )
        );
        // two: comma-joined in the order asked (virt-launcher hands them out in order)
        let a = s.allocate(RES, &["0000:af:00.0", "0000:86:00.0"]).unwrap();
        assert_eq!(
            a.device_nodes,
            ["/dev/vfio/vfio", "/dev/vfio/60", "/dev/vfio/40"]
        );
        assert_eq!(a.env.1, "0000:af:00.0,0000:86:00.0");
    }

    #[test]
    fn allocate_refusals() {
        let mut devs = seed_node();
        devs[1].driver = Some("snd_hda_intel".into());
        let s = Snapshot::new(devs, nodes(&[40, 60]));
        for id in ["0000:3b:00.0", "0000:86:00.1", "0000:5e:00.0", "GPU-1234"] {
            assert_eq!(
                s.allocate(RES, &[id]),
                Err(AllocateError::UnknownDevice { id: id.into() })
            );
        }
        let e = s
            .allocate(RES, &["0000:af:00.0", "0000:86:00.0"])
            .unwrap_err();
        assert!(
            matches!(e, AllocateError::Unhealthy { ref address, .. } if address.as_str() == "0000:86:00.0")
        );
        assert!(e.to_string().contains("snd_hda_intel"), "{e}");
        assert_eq!(
            s.allocate(RES, &["0000:af:00.0", "0000:AF:00.0"]),
            Err(AllocateError::Duplicate {
                address: addr("0000:af:00.0")
            })
        );
        assert_eq!(s.allocate(RES, &[]), Err(AllocateError::Empty));
    }

    #[test]
    fn a_group_goes_together() {
        let v = Some(VFIO_DRIVER);
        let devs = vec![
            dev("0000:06:00.0", 0x10de, 0x20b5, 0x030200, v, Some(26)),
            dev("0000:07:00.0", 0x10de, 0x20b5, 0x030200, v, Some(26)),
            dev("0000:08:00.0", 0x10de, 0x20b5, 0x030200, v, Some(27)),
        ];
        let s = Snapshot::new(devs, nodes(&[26, 27]));
        let e = s.allocate("nvidia.com/GA100_A100_PCIE_80GB", &["0000:06:00.0"]);
        assert_eq!(
            e,
            Err(AllocateError::SplitGroup {
                address: addr("0000:06:00.0"),
                group: 26,
                missing: addr("0000:07:00.0")
            })
        );
        let a = s
            .allocate(
                "nvidia.com/GA100_A100_PCIE_80GB",
                &["0000:07:00.0", "0000:08:00.0", "0000:06:00.0"],
            )
            .unwrap();
        assert_eq!(
            a.device_nodes,
            ["/dev/vfio/vfio", "/dev/vfio/26", "/dev/vfio/27"]
        );
        assert_eq!(a.env.1, "0000:07:00.0,0000:08:00.0,0000:06:00.0");
    }

    /// The kubelet is steered to whole groups: two GPUs sharing a group go together, a lone
    /// GPU fills a request of one, `must` comes first with its group, and a request no whole
    /// groups can fill still gets its size (Allocate then refuses the split, naming it).
    #[test]
    fn preferred_allocations_keep_iommu_groups_whole() {
        let v = Some(VFIO_DRIVER);
        let s = Snapshot::new(
            vec![
                dev("0000:3b:00.0", 0x10de, 0x1f08, 0x030000, v, Some(7)),
                dev("0000:3c:00.0", 0x10de, 0x1f08, 0x030000, v, Some(8)),
                dev("0000:3d:00.0", 0x10de, 0x1f08, 0x030000, v, Some(8)),
                dev("0000:3e:00.0", 0x10de, 0x1f08, 0x030000, v, Some(9)),
            ],
            [7, 8, 9].into(),
        );
        let all = [
            "0000:3b:00.0",
            "0000:3c:00.0",
            "0000:3d:00.0",
            "0000:3e:00.0",
        ];
        assert_eq!(s.preferred(&all, &[], 2), ["0000:3c:00.0", "0000:3d:00.0"]);
        assert_eq!(s.preferred(&all, &[], 1), ["0000:3b:00.0"]);
        assert_eq!(
            s.preferred(&all, &["0000:3d:00.0"], 3),
            ["0000:3d:00.0", "0000:3c:00.0", "0000:3b:00.0"]
        );
        assert_eq!(s.preferred(&all, &[], 9).len(), 4, "no more than available");
        // group 8 half taken elsewhere: a request of 2 gets the two lone GPUs
        let left = ["0000:3b:00.0", "0000:3d:00.0", "0000:3e:00.0"];
        let two = s.preferred(&left, &[], 2);
        assert_eq!(two, ["0000:3b:00.0", "0000:3e:00.0"]);
        // and what it prefers Allocate accepts
        let three = s.preferred(&all, &[], 3);
        let ids: Vec<&str> = three.iter().map(String::as_str).collect();
        assert_eq!(ids, ["0000:3c:00.0", "0000:3d:00.0", "0000:3b:00.0"]);
        assert!(s.allocate(RES, &ids).is_ok(), "{ids:?}");
        // one of a group of two cannot be whole: the size is kept, and Allocate names the split
        let odd = s.preferred(&["0000:3c:00.0", "0000:3d:00.0"], &[], 1);
        let odd: Vec<&str> = odd.iter().map(String::as_str).collect();
        assert!(matches!(
            s.allocate(RES, &odd),
            Err(AllocateError::SplitGroup { .. })
        ));
    }
}
