//! sysfs-sim: the parts of Linux sysfs and devfs that vcuda-manager's VM backends use (issue
//! 20: vfio passthrough and mdev vGPUs), simulated for tests without hardware.
//!
//! The sysfs side is served over FUSE so that a write the kernel would refuse fails with the
//! kernel's errno (`EEXIST`, `EUSERS`, `EBUSY`, ...) from `write(2)`; the dev side is a plain
//! directory of `vfio/<group>` files. The model ([`model`]: devices, bindings, IOMMU groups,
//! mdevs, errnos) and the tree over it ([`tree`]) are pure; [`fs`] is the FUSE glue and
//! [`devtree`] the `/dev` files.

#![forbid(unsafe_code)]

pub mod config;
pub mod devtree;
pub mod fs;
pub mod model;
pub mod tree;
