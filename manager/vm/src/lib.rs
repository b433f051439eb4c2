//! vcuda-vm: GPUs handed to virtual machines rather than containers (issue 20), the two
//! backends of seeds 004 and 000:
//!
//! - **vfio passthrough** for KubeVirt: NVIDIA GPUs bound to `vfio-pci`, advertised by model
//!   as NVIDIA's kubevirt-gpu-device-plugin names them (`nvidia.com/TU106_GEFORCE_RTX_2060_REV__A`),
//!   allocated as the VFIO group device nodes plus the `PCI_RESOURCE_<NAME>` variable
//!   KubeVirt's virt-launcher reads ([`naming`], [`pci`]);
//! - **mdev vGPUs** for Kata and KubeVirt: one resource per `mdev_supported_types` type, the
//!   mediated device created with a fresh UUID at Allocate and removed when its pod is gone,
//!   kept in a checkpointed [`mdev::Ledger`] ([`mdev`]).
//!
//! Everything but [`sysfs`] is pure: the node's devices, the ledger, the live pods, the clock
//! and the UUIDs come in as arguments, and the answers are values — the Allocate answer, or a
//! plan of sysfs writes ([`mdev::Action`]) the manager executes. [`sysfs`] reads the model
//! from a root laid out like `/sys` and a root laid out like `/dev` (the manager's
//! `--sysfs-root` / `--dev-root`), so tests and the simulator run it on a plain directory.

#![forbid(unsafe_code)]

pub mod mdev;
pub mod naming;
pub mod pci;
pub mod sysfs;
