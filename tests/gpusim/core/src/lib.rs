//! gpusim-core: the simulated GPUs every gpusim library and the `gpusim` command share.
//!
//! Invariants:
//! - All cross-process state lives in one file ([`state::State`]), laid out as
//!   [`layout`] documents; no process keeps a private copy of anything another must see.
//! - Time on a GPU passes only in [`sched::Sched::advance`], which is pure and replays the
//!   timeline up to "now"; who calls it, and when, does not change the result.
//! - gpusim-core knows nothing of the CUDA or NVML ABIs; the cdylibs translate.
//! - It shares no code with libvcuda: it is the ground truth libvcuda is judged by.

pub mod config;
pub mod cost;
pub mod hostpid;
pub mod layout;
pub mod robust;
pub mod sched;
pub mod state;
pub mod visible;

pub use config::{Config, ConfigError, GpuConfig, PcieLevel};
pub use state::{now_ns, sleep_until, GpuView, ProcHandle, ProcInfo, ProcSample, SimError, State};
pub use visible::visible_devices;
