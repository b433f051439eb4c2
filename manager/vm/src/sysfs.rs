//! Reading the model from a root laid out like `/sys` and one laid out like `/dev` (the
//! manager's `--sysfs-root` and `--dev-root`; `/sys` and `/dev` on a node, a plain directory
//! in tests and in the simulator). The only I/O of the crate; nothing here decides.
//!
//! The layout read, as the kernel documents it:
//! - `bus/pci/devices/<addr>` (links to `devices/pci…/<addr>`) with `vendor`, `device`,
//!   `class` (`0x…` hex), `numa_node` (`-1` for none), the `driver` link (to
//!   `bus/pci/drivers/<name>`; absent when unbound) and the `iommu_group` link (to
//!   `kernel/iommu_groups/<n>`; absent without an IOMMU) — `Documentation/driver-api/vfio.rst`,
//!   "VFIO Usage Example" (`readlink /sys/bus/pci/devices/0000:06:0d.0/iommu_group` →
//!   `../../../../kernel/iommu_groups/26`);
//! - `/dev/vfio/<n>`, the group's character device, present once the group is bound to VFIO
//!   (same document);
//! - `<parent>/mdev_supported_types/<type-id>/{name, available_instances, device_api,
//!   description}` and `bus/mdev/devices/<uuid>` (a link into its parent's directory) with its
//!   `mdev_type` link — `Documentation/driver-api/vfio-mediated-device.rst`, "Directories and
//!   files under the sysfs for Each Physical Device" / "… for Each mdev Device", and
//!   `Documentation/ABI/testing/sysfs-bus-vfio-mdev` (`device_api` and `available_instances`
//!   mandatory, `name` and `description` optional).
//!
//! Links are read, not followed (their last component is the answer), so a fixture only
//! needs the links, not what they point to.

use std::collections::BTreeSet;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use crate::mdev::{Mdev, MdevSnapshot, MdevType, MdevUuid};
use crate::naming::PciIds;
use crate::pci::{PciAddress, PciDevice, Snapshot};

/// Something under the roots could not be read or is not what the kernel writes.
#[derive(Debug, thiserror::Error)]
pub enum SysfsError {
    #[error("cannot read {path}: {source}; is --sysfs-root (or --dev-root) the host's /sys (/dev), mounted into the manager's container?")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path} holds {value:?}, not {what}; the kernel writes {what} there, so the root is not a sysfs (or a fixture is wrong)")]
    Parse {
        path: PathBuf,
        value: String,
        what: &'static str,
    },
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> SysfsError + '_ {
    move |source| SysfsError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn parse_err(path: &Path, value: &str, what: &'static str) -> SysfsError {
    SysfsError::Parse {
        path: path.to_path_buf(),
        value: value.to_string(),
        what,
    }
}

/// A sysfs attribute's text without its trailing new line.
fn read_attr(path: &Path) -> Result<String, SysfsError> {
    let text = fs::read_to_string(path).map_err(io_err(path))?;
    Ok(text.trim_end_matches('\n').to_string())
}

/// An optional attribute: `None` when the file does not exist.
fn read_optional(path: &Path) -> Result<Option<String>, SysfsError> {
    match fs::read_to_string(path) {
        Ok(t) => Ok(Some(t.trim_end_matches('\n').to_string())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io_err(path)(e)),
    }
}

/// `0x`-prefixed hex, as `vendor`, `device` and `class` are written.
fn read_hex(path: &Path, what: &'static str) -> Result<u32, SysfsError> {
    let v = read_attr(path)?;
    v.strip_prefix("0x")
        .and_then(|h| u32::from_str_radix(h, 16).ok())
        .ok_or_else(|| parse_err(path, &v, what))
}

fn read_id(path: &Path, what: &'static str) -> Result<u16, SysfsError> {
    let v = read_hex(path, what)?;
    u16::try_from(v).map_err(|_| parse_err(path, &format!("{v:#x}"), what))
}

/// The last component of a link's target; `None` when there is no link.
fn link_name(path: &Path) -> Result<Option<String>, SysfsError> {
    match fs::read_link(path) {
        Ok(target) => Ok(target.file_name().map(|n| n.to_string_lossy().into_owned())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io_err(path)(e)),
    }
}

/// The names in a directory, sorted; none when it does not exist.
fn dir_names(path: &Path) -> Result<Vec<String>, SysfsError> {
    let entries = match fs::read_dir(path) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err(path)(e)),
    };
    let mut names = Vec::new();
    for e in entries {
        let e = e.map_err(io_err(path))?;
        names.push(e.file_name().to_string_lossy().into_owned());
    }
    names.sort();
    Ok(names)
}

fn pci_devices_dir(sysfs: &Path) -> PathBuf {
    sysfs.join("bus/pci/devices")
}

/// One PCI device, `bus/pci/devices/<address>`.
pub fn read_pci_device(sysfs: &Path, address: &PciAddress) -> Result<PciDevice, SysfsError> {
    let dir = pci_devices_dir(sysfs).join(address.as_str());
    let numa_path = dir.join("numa_node");
    let numa_node = match read_optional(&numa_path)? {
        None => None,
        Some(v) => {
            let n: i64 = v
                .trim()
                .parse()
                .map_err(|_| parse_err(&numa_path, &v, "a NUMA node number or -1"))?;
            u32::try_from(n).ok()
        }
    };
    let group_path = dir.join("iommu_group");
    let iommu_group = link_name(&group_path)?
        .map(|g| {
            g.parse()
                .map_err(|_| parse_err(&group_path, &g, "a link to kernel/iommu_groups/<n>"))
        })
        .transpose()?;
    Ok(PciDevice {
        address: address.clone(),
        vendor: read_id(&dir.join("vendor"), "a 0x-prefixed 16-bit vendor id")?,
        device: read_id(&dir.join("device"), "a 0x-prefixed 16-bit device id")?,
        class: read_hex(&dir.join("class"), "a 0x-prefixed class code")?,
        driver: link_name(&dir.join("driver"))?,
        iommu_group,
        numa_node,
    })
}

/// Every PCI device under `bus/pci/devices`, in address order.
pub fn read_pci_devices(sysfs: &Path) -> Result<Vec<PciDevice>, SysfsError> {
    let dir = pci_devices_dir(sysfs);
    let mut out = Vec::new();
    for name in dir_names(&dir)? {
        let address: PciAddress = name
            .parse()
            .map_err(|_| parse_err(&dir.join(&name), &name, "a PCI address entry"))?;
        out.push(read_pci_device(sysfs, &address)?);
    }
    Ok(out)
}

/// The group numbers `n` with a `/dev/vfio/<n>` (the `vfio` container node is not a group).
pub fn read_vfio_groups(dev: &Path) -> Result<BTreeSet<u32>, SysfsError> {
    Ok(dir_names(&dev.join("vfio"))?
        .iter()
        .filter_map(|n| n.parse().ok())
        .collect())
}

/// The PCI snapshot of the node: its devices and its VFIO group nodes.
pub fn pci_snapshot(sysfs: &Path, dev: &Path) -> Result<Snapshot, SysfsError> {
    Ok(Snapshot::new(
        read_pci_devices(sysfs)?,
        read_vfio_groups(dev)?,
    ))
}

/// The mdev types of `parent` (none when it has no `mdev_supported_types`).
pub fn read_mdev_types(sysfs: &Path, parent: &PciAddress) -> Result<Vec<MdevType>, SysfsError> {
    let dir = pci_devices_dir(sysfs)
        .join(parent.as_str())
        .join("mdev_supported_types");
    let mut out = Vec::new();
    for id in dir_names(&dir)? {
        let t = dir.join(&id);
        let avail_path = t.join("available_instances");
        let avail = read_attr(&avail_path)?;
        out.push(MdevType {
            parent: parent.clone(),
            available_instances: avail
                .trim()
                .parse()
                .map_err(|_| parse_err(&avail_path, &avail, "a count of instances"))?,
            device_api: read_attr(&t.join("device_api"))?,
            name: read_optional(&t.join("name"))?,
            description: read_optional(&t.join("description"))?,
            id,
        });
    }
    Ok(out)
}

/// Every mdev under `bus/mdev/devices`: its type (the `mdev_type` link), its parent (the
/// directory its link points into) and its IOMMU group.
pub fn read_mdevs(sysfs: &Path) -> Result<Vec<Mdev>, SysfsError> {
    let dir = sysfs.join("bus/mdev/devices");
    let mut out = Vec::new();
    for name in dir_names(&dir)? {
        let entry = dir.join(&name);
        let uuid: MdevUuid = name
            .parse()
            .map_err(|_| parse_err(&entry, &name, "an mdev UUID entry"))?;
        let target = fs::read_link(&entry).map_err(io_err(&entry))?;
        let parent = target
            .parent()
            .and_then(Path::file_name)
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_default();
        let parent: PciAddress = parent.parse().map_err(|_| {
            parse_err(
                &entry,
                &target.to_string_lossy(),
                "a link into its parent PCI device's directory",
            )
        })?;
        let type_path = entry.join("mdev_type");
        let type_id = link_name(&type_path)?.ok_or_else(|| {
            parse_err(
                &type_path,
                "",
                "a link to its mdev_supported_types/<type-id>",
            )
        })?;
        let group_path = entry.join("iommu_group");
        let iommu_group = link_name(&group_path)?
            .map(|g| {
                g.parse()
                    .map_err(|_| parse_err(&group_path, &g, "a link to kernel/iommu_groups/<n>"))
            })
            .transpose()?;
        out.push(Mdev {
            uuid,
            type_id,
            parent,
            iommu_group,
        });
    }
    Ok(out)
}

/// The mdev snapshot of the served `parents`: their types, and the mdevs on them.
pub fn mdev_snapshot(sysfs: &Path, parents: &[PciAddress]) -> Result<MdevSnapshot, SysfsError> {
    let mut types = Vec::new();
    for p in parents {
        types.extend(read_mdev_types(sysfs, p)?);
    }
    let mdevs = read_mdevs(sysfs)?
        .into_iter()
        .filter(|m| parents.contains(&m.parent))
        .collect();
    Ok(MdevSnapshot { types, mdevs })
}

/// Errors reading a `pci.ids` file.
#[derive(Debug, thiserror::Error)]
pub enum PciIdsFileError {
    #[error("cannot read the PCI id database {path}: {source}; install it (Debian: pciutils' pci.ids, hwdata's /usr/share/hwdata/pci.ids) or give none: names then fall back to device ids")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path}: {source}")]
    Parse {
        path: PathBuf,
        #[source]
        source: crate::naming::PciIdsError,
    },
}

/// Read and parse a `pci.ids` file (UTF-8; invalid bytes are replaced, as names only).
pub fn read_pci_ids(path: &Path) -> Result<PciIds, PciIdsFileError> {
    let bytes = fs::read(path).map_err(|source| PciIdsFileError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    PciIds::parse(&String::from_utf8_lossy(&bytes)).map_err(|source| PciIdsFileError::Parse {
        path: path.to_path_buf(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pci::tests::addr;
    use std::os::unix::fs::symlink;

    /// A fixture tree in the kernel's layout: `sys/` and `dev/` under a temporary directory.
    struct Tree {
        dir: tempfile::TempDir,
    }

    impl Tree {
        fn new() -> Tree {
            let t = Tree {
                dir: tempfile::tempdir().unwrap(),
            };
            fs::create_dir_all(t.sys().join("bus/pci/devices")).unwrap();
            fs::create_dir_all(t.dev().join("vfio")).unwrap();
            fs::write(t.dev().join("vfio/vfio"), "").unwrap();
            t
        }

        fn sys(&self) -> PathBuf {
            self.dir.path().join("sys")
        }

        fn dev(&self) -> PathBuf {
            self.dir.path().join("dev")
        }

        /// The device's real directory, `devices/pci0000:80/<addr>`.
        fn real(&self, a: &str) -> PathBuf {
            self.sys().join("devices/pci0000:80").join(a)
        }

        #[allow(clippy::too_many_arguments)]
        fn pci(
            &self,
            a: &str,
            vendor: &str,
            device: &str,
            class: &str,
            driver: Option<&str>,
            group: Option<u32>,
            numa: Option<&str>,
        ) {
            let d = self.real(a);
            fs::create_dir_all(&d).unwrap();
            fs::write(d.join("vendor"), format!("{vendor}\n")).unwrap();
            fs::write(d.join("device"), format!("{device}\n")).unwrap();
            fs::write(d.join("class"), format!("{class}\n")).unwrap();
            if let Some(n) = numa {
                fs::write(d.join("numa_node"), format!("{n}\n")).unwrap();
            }
            if let Some(drv) = driver {
                symlink(format!("../../../bus/pci/drivers/{drv}"), d.join("driver")).unwrap();
            }
            if let Some(g) = group {
                symlink(
                    format!("../../../kernel/iommu_groups/{g}"),
                    d.join("iommu_group"),
                )
                .unwrap();
            }
            symlink(
                format!("../../../devices/pci0000:80/{a}"),
                self.sys().join("bus/pci/devices").join(a),
            )
            .unwrap();
        }

        fn group_node(&self, g: u32) {
            fs::write(self.dev().join("vfio").join(g.to_string()), "").unwrap();
        }

        fn mdev_type(&self, parent: &str, id: &str, name: Option<&str>, avail: u32, api: &str) {
            let t = self.real(parent).join("mdev_supported_types").join(id);
            fs::create_dir_all(t.join("devices")).unwrap();
            fs::write(t.join("available_instances"), format!("{avail}\n")).unwrap();
            fs::write(t.join("device_api"), format!("{api}\n")).unwrap();
            if let Some(n) = name {
                fs::write(t.join("name"), format!("{n}\n")).unwrap();
                fs::write(
                    t.join("description"),
                    "num_heads=4, frl_config=60, framebuffer=1024M\n",
                )
                .unwrap();
            }
        }

        fn mdev(&self, parent: &str, uuid: &str, type_id: &str, group: u32) {
            let d = self.real(parent).join(uuid);
            fs::create_dir_all(&d).unwrap();
            symlink(
                format!("../mdev_supported_types/{type_id}"),
                d.join("mdev_type"),
            )
            .unwrap();
            symlink(
                format!("../../../../kernel/iommu_groups/{group}"),
                d.join("iommu_group"),
            )
            .unwrap();
            let bus = self.sys().join("bus/mdev/devices");
            fs::create_dir_all(&bus).unwrap();
            symlink(
                format!("../../../devices/pci0000:80/{parent}/{uuid}"),
                bus.join(uuid),
            )
            .unwrap();
        }
    }

    const U1: &str = "83b8f4f2-509f-382f-3c1e-e6bfe0fa1001";

    #[test]
    fn reads_pci_devices_and_groups() {
        let t = Tree::new();
        t.pci(
            "0000:86:00.0",
            "0x10de",
            "0x1f08",
            "0x030000",
            Some("vfio-pci"),
            Some(40),
            Some("1"),
        );
        t.pci(
            "0000:86:00.1",
            "0x10de",
            "0x10f9",
            "0x040300",
            Some("snd_hda_intel"),
            Some(40),
            Some("-1"),
        );
        t.pci(
            "0000:00:1f.0",
            "0x8086",
            "0xa1c1",
            "0x060100",
            None,
            None,
            None,
        );
        t.group_node(40);
        let s = pci_snapshot(&t.sys(), &t.dev()).unwrap();
        let gpu = s.device(&addr("0000:86:00.0")).unwrap();
        assert_eq!(
            gpu,
            &PciDevice {
                address: addr("0000:86:00.0"),
                vendor: 0x10de,
                device: 0x1f08,
                class: 0x030000,
                driver: Some("vfio-pci".into()),
                iommu_group: Some(40),
                numa_node: Some(1),
            }
        );
        let audio = s.device(&addr("0000:86:00.1")).unwrap();
        assert_eq!(audio.numa_node, None);
        assert_eq!(audio.driver.as_deref(), Some("snd_hda_intel"));
        let lpc = s.device(&addr("0000:00:1f.0")).unwrap();
        assert_eq!((lpc.driver.as_ref(), lpc.iommu_group), (None, None));
        assert_eq!(read_vfio_groups(&t.dev()).unwrap(), BTreeSet::from([40]));
        // the decisions on what was read: the audio function keeps the group unusable
        let e = s.health(&addr("0000:86:00.0")).unwrap_err();
        assert_eq!(e.kind(), "foreign-peer");
    }

    #[test]
    fn an_empty_or_missing_root_has_no_devices() {
        let t = Tree::new();
        assert!(read_pci_devices(&t.sys()).unwrap().is_empty());
        assert!(read_mdevs(&t.sys()).unwrap().is_empty());
        let none = t.dir.path().join("nowhere");
        assert!(read_pci_devices(&none).unwrap().is_empty());
        assert!(read_vfio_groups(&none).unwrap().is_empty());
    }

    #[test]
    fn malformed_attributes_name_the_file() {
        let t = Tree::new();
        t.pci(
            "0000:86:00.0",
            "10de",
            "0x1f08",
            "0x030000",
            None,
            None,
            None,
        );
        let e = read_pci_devices(&t.sys()).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("0000:86:00.0/vendor"), "{msg}");
        assert!(msg.contains("0x-prefixed"), "{msg}");

        let t = Tree::new();
        t.pci(
            "0000:86:00.0",
            "0x10de",
            "0x1f08",
            "0x030000",
            None,
            None,
            Some("x"),
        );
        let e = read_pci_devices(&t.sys()).unwrap_err();
        assert!(e.to_string().contains("numa_node"), "{e}");

        let t = Tree::new();
        fs::create_dir_all(t.sys().join("bus/pci/devices/not-an-address")).unwrap();
        assert!(matches!(
            read_pci_devices(&t.sys()),
            Err(SysfsError::Parse { .. })
        ));

        // a device directory without its attributes: an I/O error naming the file
        let t = Tree::new();
        fs::create_dir_all(t.sys().join("bus/pci/devices/0000:86:00.0")).unwrap();
        let e = read_pci_devices(&t.sys()).unwrap_err();
        assert!(matches!(e, SysfsError::Io { .. }));
        assert!(e.to_string().contains("--sysfs-root"), "{e}");
    }

    #[test]
    fn reads_mdev_types_and_devices() {
        let t = Tree::new();
        let gpu = "0000:81:00.0";
        t.pci(
            gpu,
            "0x10de",
            "0x1eb8",
            "0x030200",
            Some("nvidia"),
            Some(30),
            Some("0"),
        );
        t.mdev_type(gpu, "nvidia-222", Some("GRID T4-1Q"), 15, "vfio-pci");
        t.mdev_type(gpu, "nvidia-223", None, 0, "vfio-pci");
        t.mdev(gpu, U1, "nvidia-222", 200);
        // another parent's mdev, not served
        t.pci(
            "0000:00:02.0",
            "0x8086",
            "0x3e92",
            "0x030000",
            Some("i915"),
            Some(1),
            None,
        );
        t.mdev_type(
            "0000:00:02.0",
            "i915-GVTg_V5_4",
            Some("GVTg_V5_4"),
            1,
            "vfio-pci",
        );
        t.mdev(
            "0000:00:02.0",
            "00000000-0000-4000-8000-000000000001",
            "i915-GVTg_V5_4",
            201,
        );

        let types = read_mdev_types(&t.sys(), &addr(gpu)).unwrap();
        assert_eq!(types.len(), 2);
        assert_eq!(
            types[0],
            MdevType {
                parent: addr(gpu),
                id: "nvidia-222".into(),
                name: Some("GRID T4-1Q".into()),
                available_instances: 15,
                device_api: "vfio-pci".into(),
                description: Some("num_heads=4, frl_config=60, framebuffer=1024M".into()),
            }
        );
        assert_eq!(
            (types[1].name.as_ref(), types[1].available_instances),
            (None, 0)
        );

        let snap = mdev_snapshot(&t.sys(), &[addr(gpu)]).unwrap();
        assert_eq!(
            snap.mdevs,
            [Mdev {
                uuid: U1.parse().unwrap(),
                type_id: "nvidia-222".into(),
                parent: addr(gpu),
                iommu_group: Some(200),
            }]
        );
        assert_eq!(read_mdevs(&t.sys()).unwrap().len(), 2);
        // a device without mdev_supported_types has no types
        assert!(read_mdev_types(&t.sys(), &addr("0000:86:00.0"))
            .unwrap()
            .is_empty());
        // the mandatory available_instances missing is an error
        fs::remove_file(
            t.real(gpu)
                .join("mdev_supported_types/nvidia-223/available_instances"),
        )
        .unwrap();
        assert!(read_mdev_types(&t.sys(), &addr(gpu)).is_err());
    }

    #[test]
    fn plans_write_where_the_kernel_reads() {
        // the paths an Action writes exist in the kernel's layout
        let t = Tree::new();
        let gpu = "0000:81:00.0";
        t.pci(
            gpu,
            "0x10de",
            "0x1eb8",
            "0x030200",
            Some("nvidia"),
            Some(30),
            None,
        );
        t.mdev_type(gpu, "nvidia-222", Some("GRID T4-1Q"), 15, "vfio-pci");
        t.mdev(gpu, U1, "nvidia-222", 200);
        let create = crate::mdev::Action::Create {
            parent: addr(gpu),
            type_id: "nvidia-222".into(),
            uuid: U1.parse().unwrap(),
        };
        let (path, _) = create.write();
        assert!(t.sys().join(&path).parent().unwrap().is_dir(), "{path}");
        let remove = crate::mdev::Action::Remove {
            uuid: U1.parse().unwrap(),
        };
        let (path, content) = remove.write();
        assert_eq!(content, "1");
        // bus/mdev/devices/<uuid> resolves to the mdev's directory
        assert!(t.sys().join(&path).parent().unwrap().is_dir(), "{path}");
    }

    #[test]
    fn pci_ids_file() {
        let t = Tree::new();
        let p = t.dir.path().join("pci.ids");
        fs::write(
            &p,
            b"10de  NVIDIA Corporation\n\t1f08  TU106 [GeForce RTX 2060 Rev. A]\n\t1234  caf\xe9\n",
        )
        .unwrap();
        let ids = read_pci_ids(&p).unwrap();
        assert_eq!(
            crate::naming::passthrough_resource(Some(&ids), 0x1f08),
            "nvidia.com/TU106_GEFORCE_RTX_2060_REV__A"
        );
        let e = read_pci_ids(&t.dir.path().join("missing")).unwrap_err();
        assert!(e.to_string().contains("fall back to device ids"), "{e}");
        fs::write(&p, "10de NVIDIA\n").unwrap();
        assert!(matches!(
            read_pci_ids(&p),
            Err(PciIdsFileError::Parse { .. })
        ));
    }
}
