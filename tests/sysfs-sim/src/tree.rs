//! The sysfs tree over the [`Node`]: what each path is (directory, attribute or link), what an
//! attribute reads, and which write it stands for. Pure; [`crate::fs`] serves it over FUSE.
//!
//! The layout, as the kernel lays it out and `vcuda_vm::sysfs` reads it (links relative, as
//! sysfs writes them, so they resolve inside the mount):
//! ```text
//! bus/pci/devices/<addr>               -> ../../../devices/pci0000:00/<addr>
//! bus/pci/drivers/<drv>/{bind,unbind}  write-only
//! bus/pci/drivers/<drv>/<addr>         -> ../../../../devices/pci0000:00/<addr>
//! bus/pci/drivers_probe                write-only
//! bus/mdev/devices/<uuid>              -> ../../../devices/pci0000:00/<parent>/<uuid>
//! class/mdev_bus/<addr>                -> ../../devices/pci0000:00/<addr>   (mdev parents)
//! devices/pci0000:00/<addr>/{vendor,device,class,numa_node}    read-only
//! devices/pci0000:00/<addr>/driver_override                    read-write
//! devices/pci0000:00/<addr>/driver      -> ../../../bus/pci/drivers/<drv>       (when bound)
//! devices/pci0000:00/<addr>/iommu_group -> ../../../kernel/iommu_groups/<n>     (with an IOMMU)
//! devices/pci0000:00/<addr>/mdev_supported_types/<id>/{name,description,available_instances,device_api}
//! devices/pci0000:00/<addr>/mdev_supported_types/<id>/create   write-only
//! devices/pci0000:00/<addr>/mdev_supported_types/<id>/devices/<uuid> -> ../../../<uuid>
//! devices/pci0000:00/<addr>/<uuid>/remove                      write-only
//! devices/pci0000:00/<addr>/<uuid>/mdev_type   -> ../mdev_supported_types/<id>
//! devices/pci0000:00/<addr>/<uuid>/iommu_group -> ../../../../kernel/iommu_groups/<n>
//! kernel/iommu_groups/<n>/devices/<addr|uuid>  -> ../../../../devices/pci0000:00/<addr>[/<uuid>]
//! sim/{busy,idle}                       write-only, the simulator's own controls
//! sim/state                             read-only JSON, for logs
//! ```
//! Sources: `Documentation/driver-api/vfio.rst` ("VFIO Usage Example": the `iommu_group` link
//! and `iommu_group/devices`), `Documentation/driver-api/vfio-mediated-device.rst` (the
//! parent's and the mdev's directories), `Documentation/ABI/testing/sysfs-bus-vfio-mdev`,
//! `Documentation/ABI/testing/sysfs-bus-pci` (`driver_override`, `drivers_probe`, `bind`,
//! `unbind`).

use crate::model::{Member, Node, Refused};

/// The PCI root the devices hang under.
pub const PCI_ROOT: &str = "pci0000:00";

/// A write-only or read-write attribute's store: what writing it does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Store {
    DriverOverride(String),
    Bind(String),
    Unbind(String),
    DriversProbe,
    Create { parent: String, type_id: String },
    Remove(String),
    SimBusy,
    SimIdle,
}

/// What a path is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    /// A directory and its entries' names.
    Dir(Vec<String>),
    /// An attribute: its text when readable, its store when writable.
    Attr {
        show: Option<String>,
        store: Option<Store>,
    },
    /// A symbolic link and its target.
    Link(String),
}

impl Entry {
    /// The permission bits sysfs gives it.
    pub fn mode(&self) -> u16 {
        match self {
            Entry::Dir(_) => 0o755,
            Entry::Link(_) => 0o777,
            Entry::Attr { show, store } => match (show.is_some(), store.is_some()) {
                (true, true) => 0o644,
                (true, false) => 0o444,
                _ => 0o200,
            },
        }
    }
}

fn dir<I: IntoIterator<Item = S>, S: Into<String>>(names: I) -> Option<Entry> {
    Some(Entry::Dir(names.into_iter().map(Into::into).collect()))
}

fn ro(text: String) -> Option<Entry> {
    Some(Entry::Attr {
        show: Some(text),
        store: None,
    })
}

fn wo(store: Store) -> Option<Entry> {
    Some(Entry::Attr {
        show: None,
        store: Some(store),
    })
}

fn link(target: String) -> Option<Entry> {
    Some(Entry::Link(target))
}

/// The entry at `path` (components below the mount), or `None` when there is none.
pub fn lookup(node: &Node, path: &[&str]) -> Option<Entry> {
    match path {
        [] => dir(["bus", "class", "devices", "kernel", "sim"]),
        ["bus"] => dir(["mdev", "pci"]),
        ["bus", "pci"] => dir(["devices", "drivers", "drivers_probe"]),
        ["bus", "pci", "drivers_probe"] => wo(Store::DriversProbe),
        ["bus", "pci", "devices"] => dir(node.devices().map(|d| d.address().to_string())),
        ["bus", "pci", "devices", addr] => {
            node.device(addr)?;
            link(format!("../../../devices/{PCI_ROOT}/{addr}"))
        }
        ["bus", "pci", "drivers"] => dir(node.drivers().map(str::to_string)),
        ["bus", "pci", "drivers", drv] if node.has_driver(drv) => dir(["bind", "unbind"]
            .into_iter()
            .map(String::from)
            .chain(node.bound_to(drv).map(|d| d.address().to_string()))),
        ["bus", "pci", "drivers", drv, rest] if node.has_driver(drv) => match *rest {
            "bind" => wo(Store::Bind(drv.to_string())),
            "unbind" => wo(Store::Unbind(drv.to_string())),
            addr => {
                let d = node.device(addr)?;
                (d.driver.as_deref() == Some(*drv))
                    .then(|| Entry::Link(format!("../../../../devices/{PCI_ROOT}/{addr}")))
            }
        },
        ["bus", "mdev"] => dir(["devices"]),
        ["bus", "mdev", "devices"] => dir(node.mdevs().map(|m| m.uuid.clone())),
        ["bus", "mdev", "devices", uuid] => {
            let m = node.mdev(uuid)?;
            link(format!("../../../devices/{PCI_ROOT}/{}/{uuid}", m.parent))
        }
        ["class"] => dir(["mdev_bus"]),
        ["class", "mdev_bus"] => dir(node
            .devices()
            .filter(|d| d.is_mdev_parent())
            .map(|d| d.address().to_string())),
        ["class", "mdev_bus", addr] => node
            .device(addr)
            .filter(|d| d.is_mdev_parent())
            .map(|_| Entry::Link(format!("../../devices/{PCI_ROOT}/{addr}"))),
        ["devices"] => dir([PCI_ROOT]),
        ["devices", PCI_ROOT] => dir(node.devices().map(|d| d.address().to_string())),
        ["devices", PCI_ROOT, addr, rest @ ..] => device_entry(node, addr, rest),
        ["kernel"] => dir(["iommu_groups"]),
        ["kernel", "iommu_groups"] => dir(node.groups().iter().map(u32::to_string)),
        ["kernel", "iommu_groups", g, rest @ ..] => group_entry(node, g, rest),
        ["sim"] => dir(["busy", "idle", "state"]),
        ["sim", "busy"] => wo(Store::SimBusy),
        ["sim", "idle"] => wo(Store::SimIdle),
        ["sim", "state"] => ro(node.state_json()),
        _ => None,
    }
}

/// `devices/pci0000:00/<addr>/...`.
fn device_entry(node: &Node, addr: &str, rest: &[&str]) -> Option<Entry> {
    let d = node.device(addr)?;
    let c = &d.config;
    match rest {
        [] => {
            let mut names: Vec<String> =
                ["class", "device", "driver_override", "numa_node", "vendor"]
                    .map(String::from)
                    .into();
            if d.driver.is_some() {
                names.push("driver".into());
            }
            if c.iommu_group.is_some() {
                names.push("iommu_group".into());
            }
            if d.is_mdev_parent() {
                names.push("mdev_supported_types".into());
            }
            names.extend(
                node.mdevs()
                    .filter(|m| m.parent == addr)
                    .map(|m| m.uuid.clone()),
            );
            dir(names)
        }
        ["vendor"] => ro(format!("{}\n", c.vendor)),
        ["device"] => ro(format!("{}\n", c.device)),
        ["class"] => ro(format!("{}\n", c.class)),
        ["numa_node"] => ro(format!("{}\n", c.numa_node)),
        ["driver_override"] => Some(Entry::Attr {
            show: node.driver_override_text(addr),
            store: Some(Store::DriverOverride(addr.to_string())),
        }),
        ["driver"] => d
            .driver
            .as_ref()
            .map(|drv| Entry::Link(format!("../../../bus/pci/drivers/{drv}"))),
        ["iommu_group"] => c
            .iommu_group
            .map(|g| Entry::Link(format!("../../../kernel/iommu_groups/{g}"))),
        ["mdev_supported_types", more @ ..] if d.is_mdev_parent() => type_entry(node, addr, more),
        [uuid, more @ ..] => {
            let m = node.mdev(uuid).filter(|m| m.parent == addr)?;
            match more {
                [] => dir(["iommu_group", "mdev_type", "remove"]),
                ["remove"] => wo(Store::Remove(m.uuid.clone())),
                ["mdev_type"] => link(format!("../mdev_supported_types/{}", m.type_id)),
                ["iommu_group"] => link(format!("../../../../kernel/iommu_groups/{}", m.group)),
                _ => None,
            }
        }
    }
}

/// `devices/pci0000:00/<addr>/mdev_supported_types/...` of a registered parent.
fn type_entry(node: &Node, addr: &str, rest: &[&str]) -> Option<Entry> {
    let [type_id, rest @ ..] = rest else {
        return dir(node.types(addr).iter().map(|t| t.id.clone()));
    };
    let t = node.mdev_type(addr, type_id)?;
    let of_type = || {
        node.mdevs()
            .filter(|m| m.parent == addr && m.type_id == *type_id)
            .map(|m| m.uuid.clone())
    };
    match rest {
        [] => {
            let mut names: Vec<String> = ["available_instances", "create", "device_api", "devices"]
                .map(String::from)
                .into();
            if t.name.is_some() {
                names.push("name".into());
            }
            if t.description.is_some() {
                names.push("description".into());
            }
            dir(names)
        }
        ["available_instances"] => ro(format!("{}\n", node.available(addr, type_id)?)),
        ["device_api"] => ro(format!("{}\n", t.device_api)),
        ["name"] => t.name.as_ref().and_then(|n| ro(format!("{n}\n"))),
        ["description"] => t.description.as_ref().and_then(|n| ro(format!("{n}\n"))),
        ["create"] => wo(Store::Create {
            parent: addr.to_string(),
            type_id: type_id.to_string(),
        }),
        ["devices"] => dir(of_type()),
        ["devices", uuid] => of_type()
            .any(|u| u == *uuid)
            .then(|| Entry::Link(format!("../../../{uuid}"))),
        _ => None,
    }
}

/// `kernel/iommu_groups/<n>/...`.
fn group_entry(node: &Node, g: &str, rest: &[&str]) -> Option<Entry> {
    let n: u32 = g.parse().ok().filter(|n: &u32| n.to_string() == g)?;
    let members = node.group_members(n);
    if members.is_empty() {
        return None;
    }
    let name = |m: &Member| match m {
        Member::Pci(a) => a.clone(),
        Member::Mdev { uuid, .. } => uuid.clone(),
    };
    match rest {
        [] => dir(["devices"]),
        ["devices"] => dir(members.iter().map(name)),
        ["devices", who] => members.iter().find(|m| name(m) == *who).map(|m| match m {
            Member::Pci(a) => Entry::Link(format!("../../../../devices/{PCI_ROOT}/{a}")),
            Member::Mdev { parent, uuid } => {
                Entry::Link(format!("../../../../devices/{PCI_ROOT}/{parent}/{uuid}"))
            }
        }),
        _ => None,
    }
}

/// Run a store with the written bytes.
pub fn store(node: &mut Node, store: &Store, data: &[u8]) -> Result<(), Refused> {
    match store {
        Store::DriverOverride(addr) => node.write_driver_override(addr, data),
        Store::Bind(drv) => node.bind(drv, data),
        Store::Unbind(drv) => node.unbind(drv, data),
        Store::DriversProbe => node.drivers_probe(data),
        Store::Create { parent, type_id } => node.create(parent, type_id, data).map(|_| ()),
        Store::Remove(uuid) => node.remove(uuid, data),
        Store::SimBusy => node.set_busy(data, true),
        Store::SimIdle => node.set_busy(data, false),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::tests::{node, GPU, U1, VF};
    use std::fs;
    use std::os::unix::fs::symlink;
    use std::path::Path;

    /// Write the tree out as real directories, files and links, so that the manager's own
    /// reader can be run on it without FUSE.
    fn materialize(node: &Node, root: &Path, path: &mut Vec<String>) {
        let parts: Vec<&str> = path.iter().map(String::as_str).collect();
        let here = parts.iter().fold(root.to_path_buf(), |p, c| p.join(c));
        match lookup(node, &parts).expect("every listed name resolves") {
            Entry::Dir(names) => {
                fs::create_dir_all(&here).unwrap();
                for n in names {
                    path.push(n);
                    materialize(node, root, path);
                    path.pop();
                }
            }
            Entry::Attr { show, .. } => fs::write(&here, show.unwrap_or_default()).unwrap(),
            Entry::Link(t) => symlink(t, &here).unwrap(),
        }
    }

    #[test]
    fn every_link_resolves_inside_the_tree() {
        let mut n = node();
        n.create(GPU, "nvidia-222", U1.as_bytes()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        materialize(&n, dir.path(), &mut Vec::new());
        let root = dir.path().canonicalize().unwrap();
        let mut stack = vec![root.clone()];
        let mut links = 0;
        while let Some(p) = stack.pop() {
            for e in fs::read_dir(&p).unwrap() {
                let e = e.unwrap();
                let ty = e.file_type().unwrap();
                if ty.is_symlink() {
                    links += 1;
                    let to = fs::canonicalize(e.path())
                        .unwrap_or_else(|err| panic!("{}: {err}", e.path().display()));
                    assert!(
                        to.starts_with(&root),
                        "{} -> {}",
                        e.path().display(),
                        to.display()
                    );
                } else if ty.is_dir() {
                    stack.push(e.path());
                }
            }
        }
        assert!(links >= 15, "{links}");
    }

    #[test]
    fn the_managers_reader_reads_what_the_kernel_would_show() {
        use vcuda_vm::sysfs;
        let mut n = node();
        n.create(GPU, "nvidia-222", U1.as_bytes()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let sys = dir.path().join("sys");
        fs::create_dir(&sys).unwrap();
        materialize(&n, &sys, &mut Vec::new());
        let dev = dir.path().join("dev/vfio");
        fs::create_dir_all(&dev).unwrap();
        for g in n.vfio_group_nodes() {
            fs::write(dev.join(g.to_string()), "").unwrap();
        }
        let snap = sysfs::pci_snapshot(&sys, &dir.path().join("dev")).unwrap();
        let gpu = snap.device(&GPU.parse().unwrap()).unwrap();
        assert_eq!(
            (gpu.vendor, gpu.device, gpu.class, gpu.driver.as_deref()),
            (0x10de, 0x1eb8, 0x030200, Some("nvidia"))
        );
        assert_eq!((gpu.iommu_group, gpu.numa_node), (Some(12), Some(0)));
        let vf = snap.device(&VF.parse().unwrap()).unwrap();
        assert_eq!(
            (vf.driver.as_deref(), vf.numa_node),
            (Some("vfio-pci"), None)
        );
        let health = snap.health(&VF.parse().unwrap()).unwrap_err();
        assert_eq!(health.kind(), "foreign-peer");
        let m = sysfs::mdev_snapshot(&sys, &[GPU.parse().unwrap()]).unwrap();
        let avail: Vec<_> = m
            .types
            .iter()
            .map(|t| (t.id.as_str(), t.available_instances, t.name.as_deref()))
            .collect();
        assert_eq!(
            avail,
            [
                ("nvidia-222", 3, Some("GRID T4-1B")),
                ("nvidia-223", 0, None)
            ]
        );
        assert_eq!(m.mdevs.len(), 1);
        assert_eq!(m.mdevs[0].uuid.as_str(), U1);
        assert_eq!(m.mdevs[0].type_id, "nvidia-222");
        assert_eq!(m.mdevs[0].iommu_group, Some(41));
        // the manager's create/remove paths are attributes of this tree
        for a in [
            vcuda_vm::mdev::Action::Create {
                parent: GPU.parse().unwrap(),
                type_id: "nvidia-222".into(),
                uuid: U1.parse().unwrap(),
            },
            vcuda_vm::mdev::Action::Remove {
                uuid: U1.parse().unwrap(),
            },
        ] {
            let (path, _) = a.write();
            let resolved = fs::canonicalize(sys.join(&path)).unwrap();
            let rel = resolved
                .strip_prefix(sys.canonicalize().unwrap())
                .unwrap()
                .to_string_lossy()
                .into_owned();
            let parts: Vec<&str> = rel.split('/').collect();
            let e = lookup(&n, &parts).unwrap();
            assert!(
                matches!(e, Entry::Attr { store: Some(_), .. }),
                "{path}: {e:?}"
            );
        }
    }

    #[test]
    fn modes_and_absent_entries() {
        let n = node();
        let e = lookup(&n, &["bus", "pci", "drivers_probe"]).unwrap();
        assert_eq!(e.mode(), 0o200);
        let e = lookup(&n, &["devices", PCI_ROOT, GPU, "driver_override"]).unwrap();
        assert_eq!(e.mode(), 0o644);
        let e = lookup(&n, &["devices", PCI_ROOT, GPU, "vendor"]).unwrap();
        assert_eq!(e.mode(), 0o444);
        assert_eq!(
            e,
            Entry::Attr {
                show: Some("0x10de\n".into()),
                store: None
            }
        );
        assert_eq!(
            lookup(&n, &["devices", PCI_ROOT, VF, "mdev_supported_types"]),
            None
        );
        assert_eq!(lookup(&n, &["kernel", "iommu_groups", "012"]), None);
        assert_eq!(lookup(&n, &["bus", "pci", "drivers", "i915"]), None);
        assert_eq!(lookup(&n, &["bus", "mdev", "devices", U1]), None);
    }
}
