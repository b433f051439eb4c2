//! gpusim-nvml: the simulated `libnvidia-ml.so.1`. It answers the NVML API (signatures exactly
//! as nvml.h of NVML API 12 declares them) from gpusim-core's shared state, so pynvml, nvitop,
//! gpustat and C programs see the same GPUs, memory, processes, utilization and XID events
//! as the simulated libcuda produces and `gpusim status` reports.
//!
//! Layout:
//! - this file: the export macros (every export is a thin `extern "C"` shell over a safe body
//!   returning [`NvmlResult`], run under `catch_unwind`), init/shutdown reference counting and
//!   the process-global [`State`];
//! - [`ffi`]: pointer wrappers (the only code touching caller memory) and device handles;
//! - [`types`]: nvml.h's constants and `#[repr(C)]` structs;
//! - [`system`], [`device`], [`telemetry`], [`topology`], [`events`]: the API families.
//!
//! NVML never takes a process slot in the state file: only libcuda processes hold slots.

// Names mirror nvml.h (nvmlDeviceGetName, nvmlMemory_t, NVML_SUCCESS, nvmlEventTypeXid...).
#![allow(non_snake_case, non_camel_case_types, non_upper_case_globals)]

use std::io::Write as _;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use gpusim_core::{GpuConfig, GpuView, SimError, State};

use crate::types::*;

/// Define exported NVML functions. Each `fn name(args) { body }` becomes
/// `#[no_mangle] pub unsafe extern "C" fn name(args) -> nvmlReturn_t` running `body` (a safe
/// block evaluating to [`NvmlResult`]) under `catch_unwind`, so no panic crosses into C.
macro_rules! nvml_api {
    ($(
        $(#[doc = $doc:expr])*
        fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $body:block
    )*) => {$(
        $(#[doc = $doc])*
        ///
        /// # Safety
        /// Pointer arguments must be NULL or valid as nvml.h documents for this function.
        #[no_mangle]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> $crate::types::nvmlReturn_t {
            $crate::guard(move || -> $crate::types::NvmlResult { $body })
        }
    )*};
}

pub mod device;
pub mod events;
pub mod ffi;
pub mod system;
pub mod telemetry;
pub mod topology;
pub mod types;

/// Run an export's body; a panic becomes `NVML_ERROR_UNKNOWN`.
pub fn guard(body: impl FnOnce() -> NvmlResult) -> nvmlReturn_t {
    match std::panic::catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => NVML_SUCCESS,
        Ok(Err(code)) => code,
        Err(_) => NVML_ERROR_UNKNOWN,
    }
}

// ---- initialisation -------------------------------------------------------------------------

struct Lib {
    /// Successful nvmlInit* calls not yet matched by nvmlShutdown.
    refs: u32,
    state: Option<Arc<State>>,
}

static LIB: Mutex<Lib> = Mutex::new(Lib {
    refs: 0,
    state: None,
});
/// Whether this process has printed why the simulator could not start.
static REPORTED: AtomicBool = AtomicBool::new(false);

fn lib() -> MutexGuard<'static, Lib> {
    LIB.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The simulator, or `NVML_ERROR_UNINITIALIZED` outside nvmlInit/nvmlShutdown.
pub fn state() -> Result<Arc<State>, nvmlReturn_t> {
    lib().state.clone().ok_or(NVML_ERROR_UNINITIALIZED)
}

/// A simulator failure while the library is running (a broken lock in the state file).
pub fn sim_err(_: SimError) -> nvmlReturn_t {
    NVML_ERROR_UNKNOWN
}

fn init() -> NvmlResult {
    let mut l = lib();
    if l.refs == 0 {
        match State::open_from_env() {
            Ok(st) => l.state = Some(Arc::new(st)),
            Err(e) => {
                if !REPORTED.swap(true, Ordering::Relaxed) {
                    let _ = writeln!(std::io::stderr(), "{e}");
                }
                return Err(NVML_ERROR_DRIVER_NOT_LOADED);
            }
        }
    }
    l.refs += 1;
    Ok(())
}

nvml_api! {
    fn nvmlInit() {
        init()
    }

    fn nvmlInit_v2() {
        init()
    }

    /// Flags (`NVML_INIT_FLAG_NO_GPUS`, `NVML_INIT_FLAG_NO_ATTACH`) change nothing here: there
    /// is always at least one GPU and nothing to attach.
    fn nvmlInitWithFlags(_flags: std::ffi::c_uint) {
        init()
    }

    /// Drops one reference; the simulator is released when the last one goes.
    fn nvmlShutdown() {
        let mut l = lib();
        if l.refs == 0 {
            return Err(NVML_ERROR_UNINITIALIZED);
        }
        l.refs -= 1;
        if l.refs == 0 {
            l.state = None;
        }
        Ok(())
    }
}

// ---- devices --------------------------------------------------------------------------------

/// A validated device handle: the simulator and the GPU index.
pub struct Dev {
    pub st: Arc<State>,
    pub g: usize,
}

impl Dev {
    pub fn cfg(&self) -> &GpuConfig {
        &self.st.config.gpu[self.g]
    }

    /// The GPU's figures now (reaps dead processes first, as the real driver frees their
    /// memory when they die).
    pub fn view(&self) -> Result<GpuView, nvmlReturn_t> {
        self.st.view(self.g).map_err(sim_err)
    }

    /// SM utilization of the last complete sample period, percent.
    pub fn util(&self) -> Result<u32, nvmlReturn_t> {
        Ok(self.view()?.sm_util)
    }
}

/// Check `d` is one of our handles for a GPU of the running simulator.
pub fn dev(d: types::nvmlDevice_t) -> Result<Dev, nvmlReturn_t> {
    let st = state()?;
    match ffi::index_of(d) {
        Some(g) if g < st.num_gpus() => Ok(Dev { st, g }),
        _ => Err(NVML_ERROR_INVALID_ARGUMENT),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guard_turns_panics_into_unknown() {
        assert_eq!(guard(|| Ok(())), NVML_SUCCESS);
        assert_eq!(guard(|| Err(NVML_ERROR_NOT_FOUND)), NVML_ERROR_NOT_FOUND);
        let prev = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        let r = guard(|| panic!("boom"));
        std::panic::set_hook(prev);
        assert_eq!(r, NVML_ERROR_UNKNOWN);
    }
}
