//! vcuda-manager-core: what the node daemon decides, with no I/O. The compiler keeps it
//! pure: this crate depends on no runtime, RPC, API-server or NVML crate, and
//! `tests/docs/test_code_habits.py` fails if it names the filesystem, processes, sockets or
//! the clock's `now()`. The daemon (`vcuda-manager`) reads and writes; these functions take
//! what it read and say what to do.
//!
//! - [`ids`]: device IDs (GPU UUID + kind + index; stable, ≤ 63 characters), and the id
//!   types state is keyed by (allocation id, pod UID, container, pod);
//! - [`placement`]: GetPreferredAllocation and Allocate validation;
//! - [`allocation`]: what Allocate answers and what PreStartContainer finishes;
//! - [`cdi`]: the Allocate answer as a CDI spec (contents, device and file names, which
//!   spec files are ours and stale);
//! - [`assign`]: following the scheduler: the pod being admitted, its assigned GPUs, the
//!   agreement check, the published inventory and retired reservations;
//! - [`identity`]: pod cgroups, the kubelet's checkpoint, /proc fields (parsers over text
//!   the daemon read);
//! - [`inventory`]: the node's GPUs as found at start, and the XID health rule;
//! - [`modes`]: the three sharing modes (whole GPUs, slices, shares), the resources each
//!   advertises, and each GPU locked to the first mode that uses it;
//! - [`lease`]: the node Lease that proves the manager alive to the scheduler (its name,
//!   body after each renewal, and renewal cadence);
//! - [`watchdog`]: the verdicts on a container that runs over its memory quota or compute
//!   share;
//! - [`rounds`]: the control loop's rounds as a state machine (steps, cadence, garbage
//!   collection, the watchdogs' verdicts to act on).

#![forbid(unsafe_code)]

pub mod allocation;
pub mod assign;
pub mod cdi;
pub mod identity;
pub mod ids;
pub mod inventory;
pub mod lease;
pub mod modes;
pub mod placement;
pub mod rounds;
pub mod watchdog;
