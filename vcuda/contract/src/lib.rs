//! vcuda-contract: what libvcuda and vcuda-manager agree on, versioned, and nothing else.
//!
//! - [`config`]: the per-container config file (read-only to the container).
//! - [`region`]: the per-container usage region (read-write, shared by the container's
//!   processes), its layout and its lock-free reservation protocol.
//! - [`region_file`]: the manager's handle on a region: one descriptor, `pread`/`pwrite`,
//!   never mapped or waited on (the container can truncate, lock or replace the file).
//! - [`slot`]: the life cycle of a process's slot in the region as pure state machines (run
//!   by the region, explored by a model checker in `tests/slot_lifecycle.rs`).
//! - [`control`]: the library ↔ manager control-socket protocol (framing, messages, decoding).
//! - [`view`]: what the manager's query API answers (`vcuda-smi`; its `--json` schema).
//!
//! Invariants: no tokio, no tonic, no allocation-heavy dependencies — this crate is linked
//! into every CUDA process. A change to the region layout bumps `REGION_VERSION`; a change to
//! the config format bumps `CONFIG_VERSION`.

pub mod config;
pub mod control;
pub mod region;
pub mod region_file;
pub mod slot;
pub mod view;

pub use config::{ConfigError, ContainerConfig, GpuLimit};
pub use region::{Region, RegionError, SlotId};
